"""The capstone's GPT: shapes, causal attention, and names that the accumulation guide's predicate reads right."""

import pytest
import torch
import torch.nn.functional as F

from dmuon_edu.accumulation import IGNORE_INDEX
from dmuon_edu.course.gpt import GPT, GPTConfig, is_hidden_matrix
from dmuon_edu.muon import muon_param_groups

CONFIG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(CONFIG)


def test_logits_have_one_distribution_per_position_and_the_loss_is_their_mean_cross_entropy(model):
    idx = torch.randint(0, CONFIG.vocab_size, (3, 5))
    targets = torch.randint(0, CONFIG.vocab_size, (3, 5))
    out = model(idx, targets)
    assert out.logits.shape == (3, 5, CONFIG.vocab_size)
    assert torch.allclose(out.loss, F.cross_entropy(out.logits.reshape(-1, CONFIG.vocab_size), targets.reshape(-1)))
    assert model(idx).loss is None


def test_padding_targets_do_not_count(model):
    idx = torch.randint(0, CONFIG.vocab_size, (2, 6))
    targets = torch.randint(0, CONFIG.vocab_size, (2, 6))
    padded = targets.clone()
    padded[1, 3:] = IGNORE_INDEX
    logits = model(idx).logits
    kept = padded != IGNORE_INDEX
    assert torch.allclose(model(idx, padded).loss, F.cross_entropy(logits[kept], targets[kept]))


def test_a_later_token_never_changes_earlier_logits(model):
    idx = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    changed = idx.clone()
    changed[:, 5] = (changed[:, 5] + 1) % CONFIG.vocab_size
    before, after = model(idx).logits, model(changed).logits
    assert torch.equal(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def test_seed_000s_predicate_selects_exactly_the_hidden_matrices(model):
    selected = {name for name, p in model.named_parameters() if is_hidden_matrix(name, p)}
    per_layer = {"attn.qkv_proj.weight", "attn.out_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
    assert selected == {f"layers.{i}.{name}" for i in range(CONFIG.n_layer) for name in per_layer}
    muon, _ = muon_param_groups(model)  # the package's own split agrees
    assert {id(p) for p in muon} == {id(p) for name, p in model.named_parameters() if name in selected}


def test_blocks_are_in_model_layers_for_fully_shard_and_dmuon(model):
    assert len(model.layers) == CONFIG.n_layer
    assert all(name.startswith("layers.") for name, p in model.named_parameters() if is_hidden_matrix(name, p))


def test_a_sequence_longer_than_block_size_is_refused_with_what_to_do(model):
    with pytest.raises(ValueError, match="longer than block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("kwargs, message", [
    (dict(d_model=10, n_head=4), "multiple of n_head"),
    (dict(n_layer=0), "n_layer must be an int >= 1"),
])
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpt_gives_the_same_logits_and_gradients_on_cuda(model):
    idx = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    on_cpu = model(idx, idx).loss
    on_cpu.backward()
    cpu_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.cuda()
    on_cuda = model(idx.cuda(), idx.cuda()).loss
    on_cuda.backward()
    # Other kernels, other summation orders: float32 agreement to ~1e-6 relative per op, which
    # a backward through 2 layers, softmax and layer norm compounds; 1e-4 / 1e-3 leave a margin
    # of two orders while a wrong gradient (a missing term) is off by O(1).
    assert on_cuda.item() == pytest.approx(on_cpu.item(), rel=1e-4)
    for p, g in zip(model.parameters(), cpu_grads):
        assert torch.allclose(p.grad.cpu(), g, atol=1e-5, rtol=1e-3)
