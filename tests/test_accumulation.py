"""train_step_with_accumulation against a single full-batch step.

Reference: the same model, one forward/backward on the concatenated batch,
one optimizer step. Both runs start from identical weights and see identical
samples; only the grouping of the sum differs.

Tolerance: parameters agree to 1e-6 absolute. The weights are O(0.1-1) float32
numbers; the accumulated gradient adds the same terms as the full-batch
gradient in a different order (per micro-batch, then across), which moves it by
a few float32 ulps (~1e-7 relative). SGD passes that through scaled by lr; Adam
normalises by sqrt(v), so a 1e-7 relative change in g stays ~1e-7 relative in
the update. Over 4 steps that stays well under 1e-6, while any real mistake
(a 1/N missing, a micro-batch dropped) moves parameters by > 1e-3. Returned
losses are the same sums in another order too: 1e-6 relative.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from dmuon_edu import train_step_with_accumulation
from dmuon_edu.compare import max_parameter_difference

PARAMETER_ATOL = 1e-6
LOSS_RTOL = 1e-6

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def full_batch_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
@pytest.mark.parametrize("sizes", [[4, 4, 4, 4], [1, 7, 3, 5], [16]], ids=["equal", "unequal", "single"])
def test_accumulated_step_equals_full_batch_step(optimizer_name, sizes):
    reference, accumulated = make_model(), make_model()
    reference_opt = OPTIMIZERS[optimizer_name](reference.parameters())
    accumulated_opt = OPTIMIZERS[optimizer_name](accumulated.parameters())
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(sum(sizes), 6, generator=generator), torch.randn(sum(sizes), 3, generator=generator)
        expected_loss = full_batch_step(reference, reference_opt, x, y)
        loss = train_step_with_accumulation(accumulated, accumulated_opt, list(zip(x.split(sizes), y.split(sizes))), F.mse_loss)
        assert isinstance(loss, float)
        assert loss == pytest.approx(expected_loss, rel=LOSS_RTOL)
        for p, q in zip(accumulated.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, atol=PARAMETER_ATOL, rtol=0)


def test_unequal_sizes_really_differ_from_one_over_n_weighting():
    # Guards the test above: with these sizes, 1/N weighting is measurably wrong,
    # so passing it means sample weighting is actually happening.
    sizes = [1, 7, 3, 5]
    model = make_model()
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    full = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    per_count = [torch.zeros_like(p) for p in model.parameters()]
    for xb, yb in zip(x.split(sizes), y.split(sizes)):
        grads = torch.autograd.grad(F.mse_loss(model(xb), yb) / len(sizes), list(model.parameters()))
        per_count = [a + g for a, g in zip(per_count, grads)]
    assert max_parameter_difference(per_count, full) > 1e-2


def test_broadcast_targets_weight_each_micro_batch_by_its_inputs():
    # One target row for every sample (a regression towards a fixed point): each micro-batch's
    # targets have one row, whatever its size, so a weight read from them would give the
    # micro-batches of 1 and of 7 samples the same share.
    sizes = [1, 7, 3, 5]
    reference, accumulated = make_model(), make_model()
    reference_opt, accumulated_opt = torch.optim.SGD(reference.parameters(), lr=0.1), torch.optim.SGD(accumulated.parameters(), lr=0.1)
    x, target = torch.randn(sum(sizes), 6), torch.randn(1, 3)
    broadcast_mse = lambda out, y: (out - y).square().mean()  # noqa: E731  (F.mse_loss warns on broadcasting)
    expected_loss = full_batch_step(reference, reference_opt, x, target.expand(sum(sizes), 3))
    loss = train_step_with_accumulation(accumulated, accumulated_opt, [(xb, target) for xb in x.split(sizes)], broadcast_mse)
    assert loss == pytest.approx(expected_loss, rel=LOSS_RTOL)
    for p, q in zip(accumulated.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=PARAMETER_ATOL, rtol=0)


def test_zero_grad_once_per_window_discards_stale_gradients():
    model, reference = make_model(), make_model()
    opt, reference_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 100.0)  # garbage left over from elsewhere
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    train_step_with_accumulation(model, opt, list(zip(x.chunk(2), y.chunk(2))), F.mse_loss)
    full_batch_step(reference, reference_opt, x, y)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=PARAMETER_ATOL, rtol=0)


def test_optimizer_steps_exactly_once():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    optimizer.register_step_post_hook(lambda *args: calls.append(1))
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    train_step_with_accumulation(model, optimizer, list(zip(x.chunk(4), y.chunk(4))), F.mse_loss)
    assert len(calls) == 1


def _setup():
    model = make_model()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "microbatches, loss_fn, error, message",
    [
        ([], F.mse_loss, ValueError, "empty"),
        ([(torch.randn(2, 6), torch.randn(2, 3))], "mse", TypeError, "loss_fn must be callable"),
        ([torch.randn(2, 6)], F.mse_loss, TypeError, r"\(inputs, targets\) pair"),
        ([(torch.randn(2, 6),)], F.mse_loss, TypeError, r"\(inputs, targets\) pair"),
        (torch.randn(4, 6), F.mse_loss, TypeError, "list of"),
        ([(torch.tensor(3.0), torch.randn(2, 3))], F.mse_loss, TypeError, "inputs of microbatch 0 must be a tensor with a batch dimension"),
        ([(torch.randn(0, 6), torch.randn(0, 3))], F.mse_loss, ValueError, "empty"),
        (
            [(torch.randn(2, 6), torch.randn(2, 3))],
            lambda out, y: F.mse_loss(out, y, reduction="none"),
            ValueError,
            "scalar",
        ),
    ],
    ids=["empty", "loss_fn", "not_pair", "one_element", "tensor", "inputs", "empty_microbatch", "not_scalar"],
)
def test_bad_input_is_refused_with_a_clear_error(microbatches, loss_fn, error, message):
    model, optimizer = _setup()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=message):
        train_step_with_accumulation(model, optimizer, microbatches, loss_fn)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), "a refused call must not move the weights"
