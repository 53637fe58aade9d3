"""Module 7's capstone: the data and its floor, the accumulation guide's loop, and the dmuon runs on 2 ranks."""

import json
import math

import pytest
import torch

from dmuon_edu.course import capstone
from dmuon_edu.course.capstone import Capstone, counted_bytes_per_step, run_single_process, single_process_optimizers, train
from dmuon_edu.course.checks import run_check
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data import MarkovSource
from dmuon_edu.course.gpt import is_hidden_matrix
from dmuon_edu.launch import torchrun

SHORT = Capstone(steps=30)


def test_the_entropy_rate_of_a_two_state_chain_has_its_closed_form():
    # P = [[1-a, a], [b, 1-b]]: stationary (b, a) / (a + b), so H = (b h(a) + a h(b)) / (a + b),
    # h the binary entropy. Weighting rows equally, or by the wrong eigenvector, gives other numbers.
    a, b = 0.1, 0.3
    h = lambda q: -q * math.log(q) - (1 - q) * math.log(1 - q)  # noqa: E731
    source = MarkovSource(torch.tensor([[1 - a, a], [b, 1 - b]], dtype=torch.float64))
    assert source.entropy_rate() == pytest.approx((b * h(a) + a * h(b)) / (a + b), rel=1e-12)  # float64 sums


def test_the_floor_is_the_entropy_rate_well_below_a_uniform_guess():
    settings = Capstone()
    assert settings.floor() == pytest.approx(settings.source().entropy_rate())
    assert settings.floor() < math.log(settings.vocab_size) - 1


def test_each_rank_takes_an_equal_share_of_every_global_micro_batch():
    batches = SHORT.microbatches()
    assert len(batches) == SHORT.steps * SHORT.accum_steps
    assert batches[0][0].shape == (SHORT.global_microbatch, SHORT.seq_len)
    shares = [SHORT.local(batches, rank, 2) for rank in range(2)]
    for i, (inputs, targets) in enumerate(batches):
        assert torch.equal(torch.cat([shares[0][i][0], shares[1][i][0]]), inputs)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next tokens
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        SHORT.local(batches, 0, 3)


def test_an_accumulated_step_equals_one_full_batch_step():
    settings = Capstone(steps=3)
    accumulated, full = settings.model(), settings.model()
    batches = settings.microbatches()
    whole = [tuple(torch.cat(parts) for parts in zip(*batches[i:i + settings.accum_steps]))
             for i in range(0, len(batches), settings.accum_steps)]
    train(accumulated, single_process_optimizers("AdamW", accumulated, settings), batches, settings.accum_steps)
    train(full, single_process_optimizers("AdamW", full, settings), whole, 1)
    # AdamW on a GPT: reordered float32 sums, amplified where a gradient component nearly cancels
    # (measured 4e-6); an unscaled or dropped micro-batch moves parameters by > 1e-3.
    assert max_parameter_difference(accumulated, full) < 1e-5


def test_a_short_run_learns_most_of_the_way_to_the_floor():
    result = run_single_process(SHORT, "Muon", progress=False)
    assert len(result.losses) == SHORT.steps
    assert result.losses[0] > math.log(SHORT.vocab_size) - 0.1  # it starts from a near-uniform guess (2.781 vs 2.773)
    # 30 steps get within 0.054 nats of the floor (measured); log V - floor is about 1.1 nats, so
    # 0.25 still demands most of the way while leaving room for another machine's rounding.
    assert result.held_out_loss < SHORT.floor() + 0.25
    learned = torch.tensor(result.learned_transition, dtype=torch.float64)
    assert learned.shape == (SHORT.vocab_size, SHORT.vocab_size)
    assert torch.allclose(learned.sum(dim=1), torch.ones(SHORT.vocab_size, dtype=torch.float64))


def test_held_bytes_counts_parameters_and_optimizer_state():
    model = SHORT.model()
    optimizers = single_process_optimizers("AdamW", model, SHORT)
    train(model, optimizers, SHORT.microbatches()[:2], SHORT.accum_steps)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert capstone.held_bytes(model, []) == parameter_bytes
    assert capstone.held_bytes(model, optimizers) >= 3 * parameter_bytes  # + exp_avg and exp_avg_sq


def test_unknown_optimizer_names_the_known_ones():
    with pytest.raises(ValueError, match="use one of"):
        single_process_optimizers("SGD", SHORT.model(), SHORT)


def test_predicted_bytes_follow_module_6():
    assert counted_bytes_per_step(100, 4, zero3=True, no_sync=True) == {"broadcast": 800, "reduce": 100}
    assert counted_bytes_per_step(100, 4, zero3=False, no_sync=True) == {"broadcast": 100, "reduce": 100}
    assert counted_bytes_per_step(100, 4, zero3=False, no_sync=False) == {"broadcast": 100, "reduce": 400}


@pytest.mark.parametrize("predicate, status, hint", [
    (is_hidden_matrix, "PASS", ""),
    (lambda n, p: p.ndim == 2, "FAIL", "embedding"),
    (lambda n, p: p.ndim == 2 and "embedding" not in n, "FAIL", "lm_head"),
    (lambda n, p: "proj" in n, "FAIL", "1-D"),
    (lambda n, p: "mlp" in n and p.ndim == 2, "FAIL", "not selected"),
])
def test_the_predicate_check_names_the_mistake(predicate, status, hint):
    result = run_check("is_hidden_matrix", predicate)
    assert result.status == status and hint in result.message


@pytest.mark.torchrun
def test_dmuon_runs_follow_single_process_muon_and_send_what_module_6_predicts(tmp_path):
    steps = 3
    path = tmp_path / "capstone.json"
    torchrun(capstone.__file__, nproc=2, args=[path, "--steps", steps, "--modes", "Z2", "Z3", "Z3 without no_sync"],
             echo=False, timeout=120)
    results = json.loads(path.read_text())
    reference = run_single_process(Capstone(steps=steps), "Muon", progress=False)
    single_process_bytes = reference.held_bytes
    for mode, result in results.items():
        assert result["comm_per_step"]["broadcast"][1] == result["predicted_per_step"]["broadcast"], mode
        assert result["comm_per_step"]["reduce"][1] == result["predicted_per_step"]["reduce"], mode
        # bf16 Newton-Schulz on both sides; the sums run in another order.
        assert result["losses"] == pytest.approx(reference.losses, abs=2e-2), mode
        assert all(held < single_process_bytes for held in result["held_bytes_per_rank"]), mode
    p_m, k = results["Z2"]["P_M"], Capstone().accum_steps
    assert results["Z2"]["matrix_bytes_during_forward_per_rank"] == [p_m, p_m]  # Z2 keeps every matrix
    assert all(b < p_m for b in results["Z3"]["matrix_bytes_during_forward_per_rank"])
    assert results["Z3 without no_sync"]["comm_per_step"]["reduce"][1] == k * p_m
