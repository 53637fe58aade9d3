"""Module 2: the pitfalls do what their names say, the unscaled loss's physics, and the checks.

The loops given to the checks are written the way a learner writes them, not
taken from dmuon_edu.course.pitfalls, so that each check is tested against code it
has never seen.
"""

import re

import pytest
import torch
import torch.nn.functional as F

import dmuon_edu
from dmuon_edu import train_step_with_accumulation
from dmuon_edu.course import pitfalls
from dmuon_edu.course.checks import run_check
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.muon import Muon

ACCUM_STEPS = [2, 8, 32]


# --- effective_lr_multiplier: the physics -----------------------------------------------------


@pytest.mark.parametrize("accum_steps", ACCUM_STEPS)
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_unscaled_loss_multiplies_sgds_learning_rate_by_n(optimizer, accum_steps):
    # The first SGD update is lr * gradient (momentum's buffer starts as the gradient), and the
    # unscaled gradient is exactly N times the full-batch one: only float32 summation order
    # differs (measured 1.2e-7 relative).
    assert pitfalls.effective_lr_multiplier(optimizer, accum_steps) == pytest.approx(accum_steps, rel=1e-5)


@pytest.mark.parametrize("accum_steps", ACCUM_STEPS)
def test_unscaled_loss_barely_changes_adamw(accum_steps):
    # AdamW's first update is lr * g / (|g| + eps) per entry: N times g changes it by a relative
    # (N - 1) eps / (N |g| + eps) < eps / |g|. With eps = 1e-8 and gradient entries mostly above
    # 1e-5 here that is below 1e-3 (measured 1.4e-5 at N = 32); growing, but never past 1.
    multiplier = pitfalls.effective_lr_multiplier("adamw", accum_steps)
    assert 1 <= multiplier < 1 + 1e-3


@pytest.mark.parametrize("accum_steps", ACCUM_STEPS)
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_unscaled_loss_barely_changes_muon(accum_steps, ns_dtype):
    # Newton-Schulz divides by ||U|| + 1e-7 first, so N times U gives the same update up to that
    # eps and rounding: 1e-5 in float32; in bf16 the rounded inputs can differ in the last bit
    # (8 bits of mantissa), so 1e-2.
    tolerance = 1e-5 if ns_dtype == torch.float32 else 1e-2
    multiplier = pitfalls.effective_lr_multiplier("muon", accum_steps, ns_dtype=ns_dtype)
    assert multiplier == pytest.approx(1, abs=tolerance)


@pytest.mark.parametrize("accum_steps", ACCUM_STEPS)
@pytest.mark.parametrize("optimizer", pitfalls.OPTIMIZERS)
def test_scaled_loss_gives_the_full_batch_update(optimizer, accum_steps):
    # The scaled run is compared with a real full-batch step, not a number with itself.
    # Float32 summation order: < 1e-5 relative. For SGD and momentum a missing 1/N or a
    # dropped micro-batch shows here; AdamW and Muon normalise away the scale (that is the
    # lesson), so for them only a dropped or doubled micro-batch would.
    multiplier = pitfalls.effective_lr_multiplier(optimizer, accum_steps, scale_loss=True, ns_dtype=torch.float32) \
        if optimizer == "muon" else pitfalls.effective_lr_multiplier(optimizer, accum_steps, scale_loss=True)
    assert multiplier == pytest.approx(1, rel=1e-5)


def test_invariance_breaks_where_the_notebook_says():
    n = 8
    # AdamW's eps dominates a small gradient: a large eps makes AdamW behave like SGD
    # (measured 5.9 of SGD's 8; an AdamW that ignored eps would stay at 1).
    assert pitfalls.effective_lr_multiplier("adamw", n, eps=1.0) > 2
    # At a realistic decay the update size does not show the decay at all (measured 7.998 of 8).
    assert pitfalls.effective_lr_multiplier("sgd", n, weight_decay=5e-4) == pytest.approx(n, rel=1e-3)
    # Clipping the gradient to a norm both runs exceed hides the bug from SGD entirely.
    assert pitfalls.effective_lr_multiplier("sgd", n, max_grad_norm=1e-3) == pytest.approx(1, rel=1e-5)


@pytest.mark.parametrize("weight_decay", [5e-4, 1e-2])
@pytest.mark.parametrize("optimizer, expected", [("sgd", 1 / 8), ("momentum", 1 / 8), ("adamw", 1.0), ("muon", 1.0)])
def test_an_unscaled_loss_weakens_coupled_decay_n_times_and_leaves_decoupled_decay(optimizer, expected, weight_decay):
    # SGD's first step is lr (N g + wd w) against lr (g + wd w): decay's share falls by exactly N.
    # AdamW's and Muon's decay (lr wd w) is outside the normalised gradient part: its share stays.
    # The decay part is the difference of two float32 updates of which it is ~1e-3 (relative
    # rounding ~1e-7 / 1e-3 = 1e-4; measured 2e-4 at most); a share that did not change for SGD, or
    # changed N-fold for AdamW, is off by 7/8.
    strength = pitfalls.relative_decay_strength(optimizer, 8, weight_decay)
    assert strength == pytest.approx(expected, rel=1e-3)


def test_relative_decay_strength_needs_a_decay():
    with pytest.raises(ValueError, match="weight_decay must be > 0"):
        pitfalls.relative_decay_strength("sgd", 8, 0.0)


def test_step_gradient_norms_logs_what_each_step_saw():
    torch.manual_seed(3)
    window = [(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(4)]
    model = make_matrix_model()
    # The reference: the full window's mean-loss gradient, by autograd directly.
    x, y = torch.cat([a for a, _ in window]), torch.cat([b for _, b in window])
    expected = torch.cat([g.flatten() for g in torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))]).norm()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: both windows start from the same weights
    norms = pitfalls.step_gradient_norms(train_step_with_accumulation, model, optimizer, [window, window], F.mse_loss)
    assert norms == pytest.approx([expected.item()] * 2, rel=1e-5)  # float32 summation order
    assert pitfalls.step_gradient_norms(pitfalls.zero_grad_between_backward_and_step, model, optimizer, [window], F.mse_loss) == [0.0]
    assert len(pitfalls.step_gradient_norms(pitfalls.step_every_microbatch, model, optimizer, [window], F.mse_loss)) == 4
    assert not optimizer._optimizer_step_pre_hooks, "the logging hook is removed afterwards"


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (("adam", 4), {}, ValueError, "unknown optimizer 'adam'; use one of sgd, momentum, adamw, muon"),
        ((4, 4), {}, TypeError, "optimizer must be a name"),
        (("sgd", 0), {}, ValueError, "accum_steps must be an int >= 1"),
        (("sgd", 2.0), {}, ValueError, "accum_steps must be an int >= 1"),
        (("sgd", 4), {"eps": 1e-8}, TypeError, "'sgd' does not take the hyperparameters"),
        (("sgd", 4), {"max_grad_norm": 0.0}, ValueError, "max_grad_norm must be positive"),
        (("sgd", 4), {"lr": 0.0}, ValueError, "lr must be > 0"),
        (("sgd", 4), {"scale_loss": "no"}, TypeError, "scale_loss must be True or False, got 'no'"),  # "no" is truthy
    ],
)
def test_bad_arguments_are_refused(args, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        pitfalls.effective_lr_multiplier(*args, **kwargs)


def test_training_curve_refuses_a_scale_loss_that_is_not_a_bool():
    with pytest.raises(TypeError, match=re.escape("scale_loss must be True or False, got 'no'")):
        pitfalls.training_curve("sgd", 4, scale_loss="no", steps=2)


def test_training_curve_with_a_scaled_loss_does_not_depend_on_n():
    one = pitfalls.training_curve("sgd", 1, scale_loss=True, steps=10)
    eight = pitfalls.training_curve("sgd", 8, scale_loss=True, steps=10)
    assert one == pytest.approx(eight, rel=1e-4)  # equal up to float32 reordering of the 1/N-weighted sums
    assert eight[-1] < eight[0]


def test_a_diverging_training_curve_ends_in_nan():
    losses = pitfalls.training_curve("sgd", 64, scale_loss=False, steps=30, lr=0.5)
    assert len(losses) == 30 and losses[-1] != losses[-1]


# --- the Muon that overwrites p.grad --------------------------------------------------------------


def make_matrix_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 2, bias=False))


def windows(n_windows=3, n_micro=4):
    generator = torch.Generator().manual_seed(7)
    return [[(torch.randn(3, 4, generator=generator), torch.randn(3, 2, generator=generator)) for _ in range(n_micro)]
            for _ in range(n_windows)]


def run(loop, optimizer_class):
    model = make_matrix_model()
    optimizer = optimizer_class(model.parameters(), lr=0.02, ns_dtype=torch.float32)
    for window in windows():
        loop(model, optimizer, window, F.mse_loss)
    return model


def test_grad_overwriting_muon_equals_muon_with_a_correct_loop():
    # The EMA buffer is (1 - mu) times Muon's summed buffer; NS removes the factor up to eps.
    a, b = run(train_step_with_accumulation, pitfalls.GradOverwritingMuon), run(train_step_with_accumulation, Muon)
    assert max_parameter_difference(a, b) < 1e-5


def test_grad_overwriting_muon_writes_the_blend_into_grad():
    model = make_matrix_model()
    optimizer = pitfalls.GradOverwritingMuon(model.parameters(), lr=0.02)
    F.mse_loss(model(torch.randn(5, 4)), torch.randn(5, 2)).backward()
    gradient = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    # First step: B = (1 - mu) G, blend = G + mu (B - G) = (1 - mu^2) G.
    for p, g in zip(model.parameters(), gradient):
        torch.testing.assert_close(p.grad, (1 - 0.95**2) * g)


def test_never_zeroing_leaks_the_blend_not_the_gradient():
    overwriting, clean = run(pitfalls.never_zero_grad, pitfalls.GradOverwritingMuon), run(pitfalls.never_zero_grad, Muon)
    assert max_parameter_difference(overwriting, clean) > 1e-3


def test_grad_overwriting_muon_checks_its_hyperparameters_as_muon_does():
    with pytest.raises(ValueError, match="ns_steps must be >= 1"):
        pitfalls.GradOverwritingMuon([torch.nn.Parameter(torch.zeros(3, 3))], lr=0.02, ns_steps=0)


def test_grad_overwriting_muon_refuses_vectors():
    with pytest.raises(ValueError, match="2-D matrices only.*AdamW"):
        pitfalls.GradOverwritingMuon([torch.nn.Parameter(torch.zeros(3))], lr=0.02)


# --- the checks: learner-written loops ---------------------------------------------------------


def learner_correct(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    for x, y in microbatches:
        (loss_fn(model(x), y) * (1 / len(microbatches))).backward()
    optimizer.step()


def learner_correct_zero_grad_after_step(model, optimizer, microbatches, loss_fn):
    for x, y in microbatches:
        loss = loss_fn(model(x), y)
        (loss / len(microbatches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def learner_no_scaling(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    for x, y in microbatches:
        loss_fn(model(x), y).backward()
    optimizer.step()


def learner_scales_after_backward(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    total = 0.0
    for x, y in microbatches:
        loss = loss_fn(model(x), y)
        loss.backward()
        loss /= len(microbatches)
        total += loss.item()
    optimizer.step()
    return total


def learner_zero_grad_in_loop(model, optimizer, microbatches, loss_fn):
    for x, y in microbatches:
        model.zero_grad()
        (loss_fn(model(x), y) / len(microbatches)).backward()
    optimizer.step()


def learner_never_zeroes(model, optimizer, microbatches, loss_fn):
    for x, y in microbatches:
        (loss_fn(model(x), y) / len(microbatches)).backward()
    optimizer.step()


def learner_zero_grad_before_step(model, optimizer, microbatches, loss_fn):
    for x, y in microbatches:
        (loss_fn(model(x), y) / len(microbatches)).backward()
    optimizer.zero_grad(set_to_none=False)
    optimizer.step()


def learner_steps_every_microbatch(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    for x, y in microbatches:
        (loss_fn(model(x), y) / len(microbatches)).backward()
        optimizer.step()


def learner_never_steps(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    for x, y in microbatches:
        (loss_fn(model(x), y) / len(microbatches)).backward()


WINDOW_LOOPS = [
    (learner_correct, "PASS", "full-batch gradient"),
    (learner_correct_zero_grad_after_step, "PASS", "full-batch gradient"),
    (learner_no_scaling, "FAIL", r"N times the full-batch gradient: divide each micro-batch loss by N \*before\*"),
    (learner_scales_after_backward, "FAIL", "dividing afterwards changes nothing"),
    (learner_zero_grad_in_loop, "FAIL", "zero_grad\\(\\) runs inside the micro-batch loop"),
    (learner_never_zeroes, "FAIL", ".grad is never cleared"),
    (learner_zero_grad_before_step, "FAIL", "zero_grad\\(\\) runs after the backward passes and before the step"),
    (learner_steps_every_microbatch, "FAIL", "step\\(\\) ran after every micro-batch"),
    (learner_never_steps, "FAIL", "step\\(\\) was never called"),
]


@pytest.mark.parametrize("candidate, status, hint", WINDOW_LOOPS, ids=lambda x: getattr(x, "__name__", None))
def test_window_check_names_each_bug(candidate, status, hint):
    result = run_check("accumulate_window", candidate)
    assert result.status == status, str(result)
    assert re.search(hint, result.message), str(result)


def second_step_expanded(g1, g2, momentum):
    return g2 + (1 - momentum**2) * g1


def second_step_simulated(g1, g2, momentum):
    # the other honest answer: run the two lines on a copy of .grad
    grad, buffer = g1.clone(), torch.zeros_like(g1)
    buffer.lerp_(grad, 1 - momentum)
    grad.lerp_(buffer, momentum)
    return grad + g2


@pytest.mark.parametrize(
    "candidate, status, hint",
    [
        (second_step_expanded, "PASS", "found in .grad, measured"),
        (second_step_simulated, "PASS", "found in .grad, measured"),
        (lambda g1, g2, mu: g2, "FAIL", "cleared every window"),
        (lambda g1, g2, mu: g1 + g2, "FAIL", "never writes .grad"),
        (lambda g1, g2, mu: g2 + (1 - mu) * g1, "FAIL", "is the buffer B after the first step"),
        (lambda g1, g2, mu: g2 + mu * g1, "FAIL", "B = \\(1 - momentum\\) g1 after the first step: expand it"),
        (lambda g1, g2, mu: g2 + 0.0975 * g1, "FAIL", "momentum 0.5, off by"),  # worked out for 0.95 only
        (lambda g1, g2, mu: g2 - (1 - mu**2) * g1, "FAIL", "follow the two lines"),
        (lambda g1, g2, mu: float(g2.sum()), "FAIL", "return a tensor shaped like g1"),
    ],
    ids=["expanded", "simulated", "cleared", "never_written", "buffer", "momentum_times_g1", "one_momentum",
         "sign", "a_number"],
)
def test_second_step_check_names_each_wrong_blend(candidate, status, hint):
    result = run_check("second_step_gradient", candidate)
    assert result.status == status, str(result)
    assert re.search(hint, result.message), str(result)


def _epoch_rescaling_the_short_window(model, optimizer, batches, loss_fn, accum_steps, factor):
    """A streaming loop that divides every loss by accum_steps and multiplies a short last window's gradient of r
    batches by factor(r, accum_steps) before its step."""
    optimizer.zero_grad()
    in_window = 0
    for x, y in batches:
        (loss_fn(model(x), y) / accum_steps).backward()
        in_window += 1
        if in_window == accum_steps:
            optimizer.step()
            optimizer.zero_grad()
            in_window = 0
    if in_window:
        for p in model.parameters():
            p.grad *= factor(in_window, accum_steps)
        optimizer.step()


def learner_epoch_rescales_the_short_window(model, optimizer, batches, loss_fn, accum_steps):
    _epoch_rescaling_the_short_window(model, optimizer, batches, loss_fn, accum_steps, lambda r, n: n / r)


def learner_epoch_divides_gradients_at_each_step(model, optimizer, batches, loss_fn, accum_steps):
    # the other honest answer: undivided losses, the gradient divided by the window's own count before each step
    def step(count):
        for p in model.parameters():
            p.grad /= count
        optimizer.step()
        optimizer.zero_grad()

    count = 0
    for x, y in batches:
        loss_fn(model(x), y).backward()
        count += 1
        if count == accum_steps:
            step(count)
            count = 0
    if count:
        step(count)


def learner_epoch_gathers_each_window(model, optimizer, batches, loss_fn, accum_steps):
    # section 3's correct_epoch, transcribed: right on a list, two batches held at once from a loader
    for window in dmuon_edu.accumulation_windows(batches, accum_steps):
        dmuon_edu.train_step_with_accumulation(model, optimizer, window, loss_fn)


def learner_epoch_slices(model, optimizer, batches, loss_fn, accum_steps):
    for start in range(0, len(batches), accum_steps):
        window = batches[start:start + accum_steps]
        optimizer.zero_grad()
        for x, y in window:
            (loss_fn(model(x), y) / len(window)).backward()
        optimizer.step()


def learner_epoch_drops_leftover(model, optimizer, batches, loss_fn, accum_steps):
    optimizer.zero_grad()
    for i, (x, y) in enumerate(batches):
        (loss_fn(model(x), y) / accum_steps).backward()
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()


def learner_epoch_underweights_leftover(model, optimizer, batches, loss_fn, accum_steps):
    in_window = 0
    for x, y in batches:
        if in_window == 0:
            optimizer.zero_grad()
        (loss_fn(model(x), y) / accum_steps).backward()
        in_window += 1
        if in_window == accum_steps:
            optimizer.step()
            in_window = 0
    if in_window:
        optimizer.step()


def learner_epoch_rescales_by_the_inverse(model, optimizer, batches, loss_fn, accum_steps):
    # r / N where N / r was due
    _epoch_rescaling_the_short_window(model, optimizer, batches, loss_fn, accum_steps, lambda r, n: r / n)


def learner_epoch_zero_grad_every_batch(model, optimizer, batches, loss_fn, accum_steps):
    in_window = 0
    for x, y in batches:
        optimizer.zero_grad()
        (loss_fn(model(x), y) / accum_steps).backward()
        in_window += 1
        if in_window == accum_steps:
            optimizer.step()
            in_window = 0
    if in_window:
        optimizer.step()


@pytest.mark.parametrize(
    "candidate, status, hint",
    [
        (learner_epoch_rescales_the_short_window, "PASS", "short last one included.*one batch at a time"),
        (learner_epoch_divides_gradients_at_each_step, "PASS", "short last one included"),
        (learner_epoch_gathers_each_window, "FAIL", "read batch 2 of the epoch before batch 1's backward"),
        (learner_epoch_slices, "FAIL", r"no len\(\)"),
        (learner_epoch_drops_leftover, "FAIL", "last, short window was never applied"),
        (learner_epoch_underweights_leftover, "FAIL", "weight r / accum_steps.*multiply its gradient by "
                                                      "accum_steps / r"),
        (learner_epoch_rescales_by_the_inverse, "FAIL", "differ from the full-batch gradients"),
        (learner_epoch_zero_grad_every_batch, "FAIL", "differ from the full-batch gradients"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_epoch_check_names_each_leftover_bug(candidate, status, hint):
    result = run_check("train_epoch", candidate)
    assert result.status == status, str(result)
    assert re.search(hint, result.message), str(result)


# scaled_loss_lr: the learning rates learners derive, right and wrong.


def lr_right(optimizer, unscaled_lr, accum_steps):
    return unscaled_lr * accum_steps if optimizer in ("sgd", "momentum") else unscaled_lr


def lr_unchanged(optimizer, unscaled_lr, accum_steps):
    return unscaled_lr


def lr_times_n_everywhere(optimizer, unscaled_lr, accum_steps):
    return unscaled_lr * accum_steps


def lr_over_n(optimizer, unscaled_lr, accum_steps):
    return unscaled_lr / accum_steps


def lr_momentum_taken_for_normalising(optimizer, unscaled_lr, accum_steps):
    return unscaled_lr * accum_steps if optimizer == "sgd" else unscaled_lr


def lr_muon_taken_for_sgd(optimizer, unscaled_lr, accum_steps):
    return unscaled_lr if optimizer == "adamw" else unscaled_lr * accum_steps


def lr_hard_wired_to_n_8(optimizer, unscaled_lr, accum_steps):
    return unscaled_lr * 8 if optimizer in ("sgd", "momentum") else unscaled_lr


def lr_not_a_number(optimizer, unscaled_lr, accum_steps):
    return str(unscaled_lr)


@pytest.mark.parametrize(
    "candidate, status, hint",
    [
        (lr_right, "PASS", "takes the unscaled loop's steps"),
        (lr_unchanged, "FAIL", r"^sgd with N = 4: .*\(the unscaled loop's learning rate unchanged\).*SGD's step is lr x gradient"),
        (lr_times_n_everywhere, "FAIL", r"^adamw with N = 4: .*\(N times the unscaled loop's learning rate\).*m and sqrt\(v\) alike"),
        (lr_over_n, "FAIL", r"^sgd with N = 4: .*\(the unscaled loop's learning rate / N\)"),
        (lr_momentum_taken_for_normalising, "FAIL", r"^momentum with N = 4: .*N-times buffer"),
        (lr_muon_taken_for_sgd, "FAIL", r"^muon with N = 4: .*divid(ing|es) its input by its norm"),
        (lr_hard_wired_to_n_8, "FAIL", r"^sgd with N = 4: the unscaled loop ran at lr 0.025; your answer 0.2 makes the correct loop's loss .* where the unscaled"),
        (lr_not_a_number, "FAIL", "return a learning rate, a number > 0"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_lr_check_names_the_wrong_derivation_and_its_cost(candidate, status, hint):
    result = run_check("scaled_loss_lr", candidate)
    assert result.status == status, str(result)
    assert re.search(hint, result.message), str(result)


@pytest.mark.parametrize(
    "exercise, pitfall",
    [
        ("accumulate_window", pitfalls.unscaled_loss),
        ("accumulate_window", pitfalls.scale_after_backward),
        ("accumulate_window", pitfalls.zero_grad_inside_loop),
        ("accumulate_window", pitfalls.never_zero_grad),
        ("accumulate_window", pitfalls.zero_grad_between_backward_and_step),
        ("accumulate_window", pitfalls.step_every_microbatch),
        ("train_epoch", pitfalls.drop_leftover_window),
        ("train_epoch", pitfalls.underweight_leftover_window),
    ],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_every_named_pitfall_fails_its_check(exercise, pitfall):
    result = run_check(exercise, pitfall)
    assert result.status == "FAIL" and "differ from" not in result.message, str(result)
