"""Accumulation in a real loop, each feature against a full-batch reference.

The reference always sees the concatenated window as one batch and takes one
step. Float32 tolerances as in test_accumulation.py (1e-6 on parameters of
size ~0.1-1: reordered sums move them by a few ulps; every bug tested here
moves them by > 1e-3, which the "bug is visible" tests confirm).
"""

import pytest
import torch
import torch.nn.functional as F

from dmuon_edu import accumulation_windows, summed_token_loss, train, train_step_with_accumulation
from dmuon_edu.course import amp_pitfalls, pitfalls
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data import MarkovSource, lm_batch

ATOL = 1e-6


def make_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def full_batch_step(model, optimizer, x, y, loss_fn=F.mse_loss, max_grad_norm=None, scheduler=None):
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return loss.item()


def batches(n_batches, size=4, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=generator), torch.randn(size, 3, generator=generator)) for _ in range(n_batches)]


# --- leftover windows -------------------------------------------------------------------------


def test_windows_keep_a_short_last_window():
    assert list(accumulation_windows(range(10), 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(accumulation_windows(range(8), 4)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(accumulation_windows([], 3)) == []
    assert list(accumulation_windows(iter(range(3)), 1)) == [[0], [1], [2]]


@pytest.mark.parametrize("accum_steps", [0, -1, 2.0, "4", True, None])
def test_bad_accum_steps_are_refused(accum_steps):
    with pytest.raises(ValueError, match="accum_steps must be an int >= 1"):
        accumulation_windows(range(4), accum_steps)


@pytest.mark.parametrize("make_optimizer", [lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.AdamW(p, lr=1e-2)])
def test_an_epoch_with_a_leftover_window_equals_full_batch_steps(make_optimizer):
    data = batches(10)  # 10 batches, N = 4: windows of 4, 4 and 2
    model, reference = make_mlp(), make_mlp()
    optimizer, reference_optimizer = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    losses = train(model, optimizer, data, F.mse_loss, accum_steps=4, progress=False)
    expected = []
    for window in ([data[0:4]], [data[4:8]], [data[8:10]]):
        x, y = torch.cat([b[0] for b in window[0]]), torch.cat([b[1] for b in window[0]])
        expected.append(full_batch_step(reference, reference_optimizer, x, y))
    assert losses == pytest.approx(expected, rel=1e-6)  # the same float32 sums in another order: ~1e-7
    assert max_parameter_difference(model, reference) < ATOL


def test_dividing_by_the_configured_n_halves_a_leftover_window_of_two():
    # The bug of the common libraries, measured: with SGD the last window's update is exactly r/N = 2/4.
    data = batches(10)
    reference, buggy = make_mlp(), make_mlp()
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), data[:8], F.mse_loss, 4, progress=False)
    pitfalls.underweight_leftover_window(buggy, torch.optim.SGD(buggy.parameters(), lr=0.1), data[:8], F.mse_loss, 4)
    before = [p.detach().clone() for p in reference.parameters()]
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), data[8:], F.mse_loss, 4, progress=False)
    pitfalls.underweight_leftover_window(buggy, torch.optim.SGD(buggy.parameters(), lr=0.1), data[8:], F.mse_loss, 4)
    exact = torch.cat([(p - b).flatten() for p, b in zip(reference.parameters(), before)])
    applied = torch.cat([(p - b).flatten() for p, b in zip(buggy.parameters(), before)])
    # float32 reordering, ~1e-7 relative (measured 1.5e-8 absolute); a wrong weight is off by 50%
    torch.testing.assert_close(applied, 0.5 * exact, atol=1e-7, rtol=1e-5)


# --- token weighting --------------------------------------------------------------------------


class Bigram(torch.nn.Module):
    def __init__(self, vocab_size=12):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab_size, 16)
        self.head = torch.nn.Linear(16, vocab_size)

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens)))


def token_windows(lengths_per_microbatch):
    source = MarkovSource.random(12, seed=3)
    generator = torch.Generator().manual_seed(4)
    sequences = [[source.sample(1, n, generator)[0] for n in lengths] for lengths in lengths_per_microbatch]
    return [lm_batch(group) for group in sequences], lm_batch([s for group in sequences for s in group])


def mean_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def test_token_weighted_accumulation_equals_the_full_batch_token_mean():
    # Micro-batches of 2, 130, 9 and 61 predicted tokens: a per-micro-batch mean would be far off.
    microbatches, (x, y) = token_windows([[3], [40, 64, 30], [5, 6], [62]])
    model, reference = Bigram(), Bigram()
    optimizer, reference_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        loss = train_step_with_accumulation(model, optimizer, microbatches, summed_token_loss)
        expected = full_batch_step(reference, reference_optimizer, x, y, loss_fn=mean_token_loss)
        assert loss == pytest.approx(expected, rel=1e-6)  # the same sums in another order: ~1e-7
    # AdamW divides by sqrt(v): where a gradient component nearly cancels (embedding rows of rare
    # tokens), the reordered sum's rounding is amplified relative to that component. Measured 2.4e-7
    # after 3 steps; the mean-of-means bug moves parameters by > 1e-3.
    assert max_parameter_difference(model, reference) < 1e-5


def test_mean_of_micro_batch_means_is_visibly_wrong_on_the_same_data():
    microbatches, (x, y) = token_windows([[3], [40, 64, 30], [5, 6], [62]])
    model = Bigram()
    full = torch.autograd.grad(mean_token_loss(model(x), y), list(model.parameters()))
    by_means = torch.autograd.grad(
        sum(mean_token_loss(model(a), b) for a, b in microbatches) / len(microbatches), list(model.parameters())
    )
    relative = torch.cat([(a - b).flatten() for a, b in zip(by_means, full)]).norm() / torch.cat([g.flatten() for g in full]).norm()
    assert relative > 0.1


def test_summed_token_loss_ignores_padding():
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, 2, -100], [4, -100, -100]])
    loss_sum, count = summed_token_loss(logits, targets)
    expected = sum(F.cross_entropy(logits[r, c][None], targets[r, c][None]) for r, c in [(0, 0), (0, 1), (1, 0)])
    assert count == 3
    torch.testing.assert_close(loss_sum, expected)


def test_a_window_without_items_is_refused():
    model = Bigram()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    padding_only = (torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), -100))
    with pytest.raises(ValueError, match="no items"):
        train_step_with_accumulation(model, optimizer, [padding_only, padding_only], summed_token_loss)


def test_mixing_mean_and_summed_losses_is_refused():
    outputs = iter([torch.tensor(1.0, requires_grad=True), (torch.tensor(2.0, requires_grad=True), 3)])
    model = make_mlp()
    with pytest.raises(ValueError, match="mean for some micro-batches"):
        train_step_with_accumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(2), lambda out, y: next(outputs))


@pytest.mark.parametrize("count, error, match", [
    (2.5, ValueError, "num_items must be a whole number >= 0, got 2.5"),
    (torch.tensor(2.5), ValueError, "num_items must be a whole number >= 0, got 2.5"),
    (float("nan"), ValueError, "num_items must be a whole number >= 0, got nan"),
    (-1, ValueError, "num_items must be a whole number >= 0, got -1"),
    ("3", TypeError, "num_items must be a number"),
    (torch.tensor([1, 2]), TypeError, r"num_items must be a number .* got a tensor of shape \(2,\)"),
])
def test_an_item_count_that_is_not_a_whole_number_is_refused(count, error, match):
    # int() used to truncate 2.5 to 2, silently reweighting the window.
    model = make_mlp()
    with pytest.raises(error, match=match):
        train_step_with_accumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(2),
                                     lambda out, y: (F.mse_loss(out, y, reduction="sum"), count))


def test_a_whole_item_count_may_be_a_float_or_a_tensor():
    # (targets != -100).float().sum() is a float tensor; the count it holds is whole.
    data = batches(2)
    counted = {}
    for name, count in [("int", 12), ("float", 12.0), ("float tensor", torch.tensor(12.0)), ("long tensor", torch.tensor(12))]:
        model = make_mlp()
        train_step_with_accumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                                     lambda out, y: (F.mse_loss(out, y, reduction="sum"), count))
        counted[name] = model
    assert all(max_parameter_difference(m, counted["int"]) == 0 for m in counted.values())


# --- clipping and schedulers ----------------------------------------------------------------


def test_clipping_happens_once_on_the_window_gradient():
    data = batches(4)
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    model, reference = make_mlp(), make_mlp()
    train_step_with_accumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), data, F.mse_loss, max_grad_norm=0.05)
    full_batch_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), x, y, max_grad_norm=0.05)
    assert max_parameter_difference(model, reference) < ATOL


def test_clipping_each_micro_batch_would_differ():
    data = batches(4)
    clipped_once, clipped_each = make_mlp(), make_mlp()
    train_step_with_accumulation(clipped_once, torch.optim.SGD(clipped_once.parameters(), lr=0.1), data, F.mse_loss, max_grad_norm=0.05)
    optimizer = torch.optim.SGD(clipped_each.parameters(), lr=0.1)
    for x, y in data:
        (F.mse_loss(clipped_each(x), y) / 4).backward()
        torch.nn.utils.clip_grad_norm_(clipped_each.parameters(), 0.05)
    optimizer.step()
    assert max_parameter_difference(clipped_once, clipped_each) > 1e-4  # measured 1.3e-3; rounding is < 1e-6


@pytest.mark.parametrize("max_grad_norm, error, match", [
    (0, ValueError, "max_grad_norm must be positive"),  # clipping to 0 would zero every gradient
    (-1.0, ValueError, "max_grad_norm must be positive"),
    (float("nan"), ValueError, "max_grad_norm must be positive"),
    (True, TypeError, "max_grad_norm must be a number"),  # True > 0, and would clip to 1.0
    ("1.0", TypeError, "max_grad_norm must be a number"),
])
def test_a_max_grad_norm_that_is_not_a_positive_number_is_refused(max_grad_norm, error, match):
    model = make_mlp()
    with pytest.raises(error, match=match):
        train_step_with_accumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(2), F.mse_loss, max_grad_norm=max_grad_norm)


def _scheduler_of_another_optimizer(optimizer):
    other = torch.optim.SGD(make_mlp().parameters(), lr=0.1)
    return torch.optim.lr_scheduler.LambdaLR(other, lambda step: 0.5**step)


@pytest.mark.parametrize("make_scheduler, error, match", [
    (_scheduler_of_another_optimizer, ValueError, "the scheduler was built on another optimizer"),
    (lambda optimizer: "cosine", TypeError, "scheduler must be a torch.optim.lr_scheduler.LRScheduler, got str"),
    (lambda optimizer: torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), TypeError,
     r"call scheduler.step\(loss\) yourself"),
], ids=["another_optimizer", "a_string", "reduce_on_plateau"])
def test_a_bad_scheduler_is_refused_before_the_weights_move(make_scheduler, error, match):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = make_scheduler(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        train_step_with_accumulation(model, optimizer, batches(2), F.mse_loss, scheduler=scheduler)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        assert scheduler.optimizer.param_groups[0]["lr"] == 0.1  # the other optimizer's schedule did not advance


def test_scheduler_steps_once_per_optimizer_step():
    data = batches(12)
    model, reference = make_mlp(), make_mlp()
    optimizer, reference_optimizer = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    decay = lambda k: 0.5**k  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    reference_scheduler = torch.optim.lr_scheduler.LambdaLR(reference_optimizer, decay)
    train(model, optimizer, data, F.mse_loss, accum_steps=4, scheduler=scheduler, progress=False)
    for window in accumulation_windows(data, 4):
        full_batch_step(reference, reference_optimizer, torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window]), scheduler=reference_scheduler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)  # 3 optimizer steps, not 12
    assert max_parameter_difference(model, reference) < ATOL


# --- AMP: one scale per window ----------------------------------------------------------------


class RecordingScaler(torch.amp.GradScaler):
    """A GradScaler that records the scale used for every micro-batch."""

    def __init__(self, **kwargs):
        super().__init__("cpu", **kwargs)
        self.scales_used = []

    def scale(self, outputs):
        self.scales_used.append(self.get_scale())
        return super().scale(outputs)


def autocast_forward(model):
    def forward(inputs):
        with torch.autocast("cpu", dtype=torch.float16):
            return model(inputs).float()

    return forward


def test_grad_scaler_keeps_one_scale_per_window_and_updates_once():
    data = batches(8)
    model, reference = make_mlp(), make_mlp()
    optimizer, reference_optimizer = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = RecordingScaler(init_scale=2.0**8, growth_interval=1)  # update() doubles the scale after a clean step
    for window in accumulation_windows(data, 4):
        train_step_with_accumulation(autocast_forward(model), optimizer, window, F.mse_loss, scaler=scaler, max_grad_norm=1.0)
        full_batch_step(reference, reference_optimizer, torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window]), max_grad_norm=1.0)
    assert scaler.scales_used == [2.0**8] * 4 + [2.0**9] * 4
    assert scaler.get_scale() == 2.0**10
    # fp16 forward: 11-bit mantissa, relative rounding ~5e-4 per product; the updates (lr 0.1 x grad ~0.1-1)
    # land within 1e-3 of the fp32 reference, while a double-unscaled or unscaled-once-too-few step is off by 2^8.
    assert max_parameter_difference(model, reference) < 1e-3


def test_grad_scaler_skips_a_window_with_an_overflow():
    model = make_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    data = batches(2)
    data[1] = (data[1][0], torch.full_like(data[1][1], float("inf")))
    train_step_with_accumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), data, F.mse_loss, scaler=scaler)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() == 2.0**7


def test_a_scaler_already_used_inside_the_window_is_refused():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = batches(1)[0]
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.step(optimizer)  # stepped by hand, update() forgotten
    with pytest.raises(RuntimeError, match="already unscaled or stepped"):
        train_step_with_accumulation(model, optimizer, batches(2), F.mse_loss, scaler=scaler)


# --- AMP: what each broken rule does (module 3 shows these) -----------------------------------


def _amp_window(loop, data, init_scale=2.0**12, max_grad_norm=1.0):
    model = make_mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    loop(autocast_forward(model), torch.optim.SGD(model.parameters(), lr=0.1), data, F.mse_loss, scaler, max_grad_norm)
    return model, scaler


def _update(model):
    return torch.cat([(p - q).detach().flatten() for p, q in zip(model.parameters(), make_mlp().parameters())])


def test_clipping_before_unscale_applies_max_norm_over_the_scaled_norm():
    data = batches(4)
    reference = make_mlp()
    F.mse_loss(reference(torch.cat([b[0] for b in data])), torch.cat([b[1] for b in data])).backward()
    norm = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()
    assert norm < 1.0  # the right loop does not clip, so it applies the whole update
    right, _ = _amp_window(lambda m, o, b, f, s, c: train_step_with_accumulation(m, o, b, f, scaler=s, max_grad_norm=c), data)
    wrong, _ = _amp_window(amp_pitfalls.clip_before_unscale, data)
    fraction = (_update(wrong) @ _update(right) / _update(right).norm() ** 2).item()
    # clip to 1 / (s * norm), then unscale: the fp16 gradient's norm differs from the fp32 one by ~1e-3
    assert fraction == pytest.approx(1.0 / (2.0**12 * norm), rel=1e-2)


@pytest.mark.parametrize("loop, error, match", [
    (amp_pitfalls.unscale_every_microbatch, RuntimeError, r"unscale_\(\) has already been called"),
    (amp_pitfalls.update_every_microbatch, AssertionError, "No inf checks were recorded"),
])
def test_grad_scaler_refuses_a_second_unscale_and_an_update_without_a_step(loop, error, match):
    with pytest.raises(error, match=match):
        _amp_window(loop, batches(4))


def test_an_overflowing_micro_batch_skips_the_window_unless_the_optimizer_is_stepped_by_hand():
    data = batches(4)
    data[2] = (data[2][0], 1e4 * data[2][1])  # its scaled gradient passes float16's 65504 at s = 2^12
    skipped, scaler = _amp_window(lambda m, o, b, f, s, c: train_step_with_accumulation(m, o, b, f, scaler=s, max_grad_norm=c), data)
    assert all(torch.equal(p, q) for p, q in zip(skipped.parameters(), make_mlp().parameters()))
    assert scaler.get_scale() == 2.0**11
    applied, _ = _amp_window(amp_pitfalls.step_without_scaler, data)
    assert not all(p.isfinite().all() for p in applied.parameters())


def test_train_returns_one_loss_per_optimizer_step():
    model = make_mlp()
    losses = train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(9), F.mse_loss, 4, progress=False)
    assert len(losses) == 3 and all(isinstance(loss, float) for loss in losses)
