"""peak_memory_bytes against allocations of known size."""

import pytest
import torch
import torch.nn.functional as F

from dmuon_edu import peak_memory_bytes

MIB = 2**20


def allocate_and_hold():
    x = torch.empty(MIB, dtype=torch.float32)  # 4 MiB
    return x.fill_(1.0).sum()


def allocate_one_after_another():
    for _ in range(3):
        torch.empty(MIB, dtype=torch.float32).fill_(1.0)  # each freed before the next


def test_peak_counts_a_live_allocation():
    peak = peak_memory_bytes(allocate_and_hold)
    # The 4 MiB buffer plus sum()'s few-byte result; nothing else of size is allocated.
    assert 4 * MIB <= peak < 4 * MIB + 64 * 1024


def test_peak_is_the_high_water_mark_not_the_total():
    assert 4 * MIB <= peak_memory_bytes(allocate_one_after_another) < 8 * MIB


def test_accumulation_lowers_the_peak_of_a_window():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))
    x, y = torch.randn(2048, 64), torch.randn(2048, 4)

    def window(n):
        model.zero_grad(set_to_none=True)
        return peak_memory_bytes(lambda: [(F.mse_loss(model(a), b) / n).backward() for a, b in zip(x.chunk(n), y.chunk(n))])

    # The hidden activation (2048 x 512 floats, 4 MiB, kept twice: linear output and ReLU output) dominates.
    assert window(4) < 0.5 * window(1)


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="callable"):
        peak_memory_bytes(42)
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        peak_memory_bytes(lambda: None, device="meta")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_counts_a_live_allocation():
    def allocate():
        return torch.empty(MIB, dtype=torch.float32, device="cuda").fill_(1.0).sum()

    # The caching allocator rounds blocks up to 512 bytes; 4 MiB is a multiple.
    assert 4 * MIB <= peak_memory_bytes(allocate, device="cuda") < 4 * MIB + 64 * 1024
