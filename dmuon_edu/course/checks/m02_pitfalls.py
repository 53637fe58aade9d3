"""Checks for module 2: zero_grad placement and friends.

A loop's bug is recognised by what it does, never by its source text. The
checker runs the loop on a small seeded problem with an optimizer that
records the gradient in ``.grad`` at every ``step()`` call, and compares that
record, and the parameters at the end, with the record of the correct loop
and of each loop in :mod:`dmuon_edu.course.pitfalls`. Two loops whose records agree
do the same thing to the model, whatever their code looks like.

``scaled_loss_lr`` is graded the same way, by effect: the learner's learning
rate must make the correct loop train loss for loss like the unscaled loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dmuon_edu.course import pitfalls
from dmuon_edu.accumulation import accumulation_windows, train_step_with_accumulation
from dmuon_edu.course.checks.problem import Window, regression_model, regression_windows

# Float32 gradients and parameters of size ~0.01-1: correct loops that scale
# or add in a different order differ by a few ulps (~1e-7). Every bug moves
# them by more than 1e-3. Newton-Schulz amplifies rounding differences (five
# polynomial steps with slopes up to ~3), hence the looser parameter
# tolerance for Muon; its bugs still move parameters by more than 1e-3.
GRADIENT_ATOL = 1e-6
PARAMETER_ATOL = {"sgd": 1e-6, "muon": 1e-5}

ACCUM_STEPS = 4
N_WINDOWS = 3
EPOCH_BATCHES = 10  # with ACCUM_STEPS = 4: windows of 4, 4 and a leftover of 2

_ZERO_GRAD_INSIDE = (
    "only the last micro-batch's gradient reached optimizer.step(): optimizer.zero_grad() runs inside the "
    "micro-batch loop and erases the others; call it once per window, before the loop"
)
_BETWEEN_BACKWARD_AND_STEP = (
    "optimizer.step() saw no gradient, so the parameters never moved: optimizer.zero_grad() runs after the "
    "backward passes and before the step; move it to the start of the window (or after the step)"
)
_UNSCALED = (
    "the gradient that reached optimizer.step() is N times the full-batch gradient: divide each micro-batch loss "
    "by N *before* .backward(); dividing afterwards changes nothing, the gradient is already in .grad"
)

# (pitfall, hint) in the order tried; the first whose record matches names the bug.
_WINDOW_MISTAKES = [
    (pitfalls.unscaled_loss, _UNSCALED + ". For SGD that is an N-times learning rate"),
    (pitfalls.zero_grad_inside_loop, _ZERO_GRAD_INSIDE),
    (
        pitfalls.never_zero_grad,
        "from the second window on, optimizer.step() also saw the earlier windows' gradients: .grad is never "
        "cleared; call optimizer.zero_grad() once at the start of every window",
    ),
    (pitfalls.zero_grad_between_backward_and_step, _BETWEEN_BACKWARD_AND_STEP),
    (
        pitfalls.step_every_microbatch,
        "optimizer.step() ran after every micro-batch, N small steps on partial gradients; call it once per "
        "window, after the micro-batch loop",
    ),
]

_MUON_MISTAKES = [
    (
        pitfalls.unscaled_loss,
        _UNSCALED + ". Muon hides it (Newton-Schulz normalises the update), and so does AdamW (m / sqrt(v) "
        "divides the scale away, all but eps); gradient clipping does not: its threshold sees the N-times gradient",
    ),
    (pitfalls.zero_grad_inside_loop, _ZERO_GRAD_INSIDE),
    (
        pitfalls.never_zero_grad,
        "from the second window on, the gradient started from the previous step's Nesterov blend: this Muon "
        "writes gradient + momentum into .grad, and .grad is never cleared, so momentum is counted twice; call "
        "optimizer.zero_grad() once at the start of every window",
    ),
    (pitfalls.zero_grad_between_backward_and_step, _BETWEEN_BACKWARD_AND_STEP),
    (
        pitfalls.step_every_microbatch,
        "optimizer.step() ran after every micro-batch, and each step wrote its Nesterov blend into .grad, so the "
        "next micro-batch added onto the blend; step once per window, after the micro-batch loop",
    ),
]

_EPOCH_MISTAKES = [
    (
        pitfalls.drop_leftover_window,
        "the last, short window was never applied: the loop steps only when (i + 1) % accum_steps == 0; also step "
        "after the last batch, and its gradient would otherwise leak into whatever runs next",
    ),
    (
        pitfalls.underweight_leftover_window,
        "the last, short window of r < accum_steps batches was applied with weight r / accum_steps: divide its "
        "losses by its own number of batches, not by accum_steps",
    ),
]


@dataclass(frozen=True)
class _Record:
    """What a loop did: the gradient each optimizer.step() call saw, and the parameters at the end."""

    step_gradients: list[torch.Tensor]
    parameters: torch.Tensor

    def matches(self, other: _Record, parameter_atol: float) -> bool:
        return (
            len(self.step_gradients) == len(other.step_gradients)
            and all(torch.allclose(a, b, atol=GRADIENT_ATOL, rtol=0) for a, b in zip(self.step_gradients, other.step_gradients))
            and torch.allclose(self.parameters, other.parameters, atol=parameter_atol, rtol=0)
        )


def _check_accumulate_window(candidate: Callable) -> tuple[str, str]:
    return _check_window_loop(candidate, "sgd", _WINDOW_MISTAKES)


def _check_muon_accumulate_window(candidate: Callable) -> tuple[str, str]:
    return _check_window_loop(candidate, "muon", _MUON_MISTAKES)


def _check_window_loop(candidate: Callable, optimizer: str, mistakes) -> tuple[str, str]:
    windows = _windows()

    def record(loop):
        return _record(lambda model, opt: [loop(model, opt, window, F.mse_loss) for window in windows], optimizer)

    verdict = _verdict(record(candidate), record(train_step_with_accumulation), record, mistakes, optimizer, N_WINDOWS)
    return verdict or ("PASS", "every window's step saw exactly the full-batch gradient, and the parameters match full-batch steps")


def _check_train_epoch(candidate: Callable) -> tuple[str, str]:
    batches = [window[0] for window in _windows(n_windows=EPOCH_BATCHES, sizes=[4])]

    def record(loop):
        return _record(lambda model, opt: loop(model, opt, batches, F.mse_loss, ACCUM_STEPS), "sgd")

    def correct_epoch(model, optimizer, batches, loss_fn, accum_steps):
        for window in accumulation_windows(batches, accum_steps):
            train_step_with_accumulation(model, optimizer, window, loss_fn)

    n_steps = len(list(accumulation_windows(batches, ACCUM_STEPS)))
    verdict = _verdict(record(candidate), record(correct_epoch), record, _EPOCH_MISTAKES, "sgd", n_steps)
    return verdict or ("PASS", "every window, the short last one included, was applied as one full-batch step")


def _verdict(learner: _Record, correct: _Record, record, mistakes, optimizer: str, n_steps: int) -> tuple[str, str] | None:
    """None when the learner's record matches the correct one; else FAIL with the hint of the bug it matches."""
    atol = PARAMETER_ATOL[optimizer]
    if learner.matches(correct, atol):
        return None
    for mistake, hint in mistakes:
        if learner.matches(record(mistake), atol):
            return "FAIL", hint
    calls = len(learner.step_gradients)
    if calls == 0:
        return "FAIL", "optimizer.step() was never called: call it once per window, after the last backward"
    if calls != n_steps:
        return "FAIL", f"optimizer.step() ran {calls} times where {n_steps} optimizer steps were due: one per window"
    worst = max((a - b).abs().max().item() for a, b in zip(learner.step_gradients, correct.step_gradients))
    return "FAIL", (
        f"the gradients your steps saw differ from the full-batch gradients by up to {worst:.2g}; zero_grad once "
        "per window, divide each loss by N before its backward, step once after the loop"
    )


def _record(run: Callable, optimizer: str) -> _Record:
    """Run ``run(model, optimizer)`` from a fixed start, recording the gradient at every step() call."""
    model = regression_model(bias=optimizer != "muon")  # Muon takes matrices only
    opt = (
        pitfalls.GradOverwritingMuon(model.parameters(), lr=0.02, ns_dtype=torch.float32)
        if optimizer == "muon"
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    parameters = list(model.parameters())
    step_gradients = []

    def remember_gradient(*_):
        # A parameter without .grad (zero_grad's set_to_none) saw a zero gradient.
        step_gradients.append(torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().clone() for p in parameters
        ]))

    opt.register_step_pre_hook(remember_gradient)
    run(model, opt)
    return _Record(step_gradients, torch.cat([p.detach().flatten() for p in parameters]))


def _windows(n_windows: int = N_WINDOWS, sizes=(3,) * ACCUM_STEPS) -> list[Window]:
    return regression_windows(sizes, n_windows, seed=2024)


# --- scaled_loss_lr: which learning rate the unscaled loop really used ----------------------

LR_CHECK_ACCUM_STEPS = (4, 8)  # two N, so that an answer hard-wired to one N fails
LR_CHECK_STEPS = 5
# Losses of order 0.1-1 after five float32 steps: at the matching learning rate the two runs differ
# by float32 rounding, measured below 3e-7 relative (AdamW's and Muon's eps included); a learning
# rate off by a factor of 2 or more moves some loss by more than 10%.
LOSS_RTOL = 1e-4

# What the unscaled loop's N-times gradient does to each optimizer's step, said after a wrong answer.
_WHY = {
    "sgd": "SGD's step is lr x gradient, and the unscaled gradient was N times the correct one",
    "momentum": "momentum's buffer adds up gradients: N-times gradients make an N-times buffer and an N-times step",
    "adamw": "AdamW's step is lr x m / (sqrt(v) + eps), and N-times gradients multiply m and sqrt(v) alike",
    "muon": "Muon's Newton-Schulz iteration starts by dividing its input by its norm, so an N-times momentum "
            "gives the same step",
}
# Answers that a learner gives, by what they do to the unscaled loop's learning rate.
_LR_ANSWERS = {
    "the unscaled loop's learning rate unchanged": lambda lr, n: lr,
    "N times the unscaled loop's learning rate": lambda lr, n: lr * n,
    "the unscaled loop's learning rate / N": lambda lr, n: lr / n,
}


def _check_scaled_loss_lr(candidate: Callable) -> tuple[str, str]:
    for optimizer in pitfalls.OPTIMIZERS:
        for n in LR_CHECK_ACCUM_STEPS:
            unscaled_lr = pitfalls.DEFAULT_LR[optimizer] / 4
            answer = candidate(optimizer, unscaled_lr, n)
            if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not 0 < answer < float("inf"):
                return "FAIL", f"return a learning rate, a number > 0; for {optimizer!r} with N = {n} you returned {answer!r}"
            unscaled = _lr_curve(optimizer, n, scale_loss=False, lr=unscaled_lr)
            yours = _lr_curve(optimizer, n, scale_loss=True, lr=answer)
            if not _same_curve(yours, unscaled):
                return "FAIL", _diagnose_lr(optimizer, n, unscaled_lr, answer, yours, unscaled)
    return "PASS", (
        f"at your learning rates the correct loop takes the unscaled loop's steps, loss for loss over "
        f"{LR_CHECK_STEPS} steps, for {', '.join(pitfalls.OPTIMIZERS)} at N = 4 and 8"
    )


def _diagnose_lr(optimizer: str, n: int, unscaled_lr: float, answer: float, yours, unscaled) -> str:
    what = next(
        (f" ({name})" for name, answer_of in _LR_ANSWERS.items()
         if _same_curve(yours, _lr_curve(optimizer, n, scale_loss=True, lr=answer_of(unscaled_lr, n)))),
        "",
    )
    return (
        f"{optimizer} with N = {n}: the unscaled loop ran at lr {unscaled_lr:g}; your answer {answer:g}{what} makes "
        f"the correct loop's loss after {LR_CHECK_STEPS} steps {yours[-1]:.3f} where the unscaled loop's is "
        f"{unscaled[-1]:.3f}. {_WHY[optimizer]}"
    )


def _lr_curve(optimizer: str, n: int, scale_loss: bool, lr: float) -> list[float]:
    # float32 Newton-Schulz: bf16 rounding would blur the comparison (and depends on the CPU's kernels).
    hyper = {"ns_dtype": torch.float32} if optimizer == "muon" else {}
    return pitfalls.training_curve(optimizer, n, scale_loss=scale_loss, steps=LR_CHECK_STEPS, lr=lr, **hyper)


def _same_curve(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= LOSS_RTOL * abs(y) for x, y in zip(a, b))


EXERCISES = {
    "accumulate_window": _check_accumulate_window,
    "train_epoch": _check_train_epoch,
    "muon_accumulate_window": _check_muon_accumulate_window,
    "scaled_loss_lr": _check_scaled_loss_lr,
}
