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
# them by more than 1e-3.
GRADIENT_ATOL = 1e-6
PARAMETER_ATOL = 1e-6

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

_EPOCH_MISTAKES = [
    (
        pitfalls.drop_leftover_window,
        "the last, short window was never applied: the loop steps only when (i + 1) % accum_steps == 0; also step "
        "after the last batch, and its gradient would otherwise leak into whatever runs next",
    ),
    (
        pitfalls.underweight_leftover_window,
        "the last, short window of r < accum_steps batches was applied with weight r / accum_steps: its losses "
        "went through backward divided by accum_steps, so multiply its gradient by accum_steps / r before the step",
    ),
]


@dataclass(frozen=True)
class _Record:
    """What a loop did: the gradient each optimizer.step() call saw, and the parameters at the end."""

    step_gradients: list[torch.Tensor]
    parameters: torch.Tensor

    def matches(self, other: _Record) -> bool:
        return (
            len(self.step_gradients) == len(other.step_gradients)
            and all(torch.allclose(a, b, atol=GRADIENT_ATOL, rtol=0) for a, b in zip(self.step_gradients, other.step_gradients))
            and torch.allclose(self.parameters, other.parameters, atol=PARAMETER_ATOL, rtol=0)
        )


def _check_accumulate_window(candidate: Callable) -> tuple[str, str]:
    windows = _windows()

    def record(loop):
        return _record(lambda model, opt: [loop(model, opt, window, F.mse_loss) for window in windows])

    verdict = _verdict(record(candidate), record(train_step_with_accumulation), record, _WINDOW_MISTAKES, N_WINDOWS)
    return verdict or ("PASS", "every window's step saw exactly the full-batch gradient, and the parameters match full-batch steps")


class _StreamBroken(Exception):
    """The learner's loop used the streamed batches as a list: what a streaming loader cannot do."""


class _Stream:
    """An epoch's batches as a streaming loader gives them: read once, in order, with no len() and no indexing,
    and each batch read only after the one before it went through its backward (one batch held at a time)."""

    def __init__(self, batches, model):
        self._batches, self._read, self._backwards = iter(batches), 0, 0
        first = next(model.parameters())
        first.register_post_accumulate_grad_hook(lambda _p: setattr(self, "_backwards", self._backwards + 1))

    def __iter__(self):
        return self

    def __next__(self):
        if self._read > self._backwards:
            raise _StreamBroken(
                f"your loop read batch {self._read + 1} of the epoch before batch {self._read}'s backward ran: it "
                "held two batches (or their graphs) at once, as gathering a window first does. Run each batch's "
                "forward and backward as it comes, and fix the short last window's gradient when the loader ends")
        batch = next(self._batches)
        self._read += 1
        return batch

    def __len__(self):
        raise _StreamBroken("batches streams from a loader: it has no len(), so you cannot tell in advance that the "
                            "last window is short. Count the batches of the window as they come, and fix its "
                            "gradient when the loader ends")

    def __getitem__(self, _index):
        raise _StreamBroken("batches streams from a loader: it cannot be indexed or sliced; iterate over it once")


def _check_train_epoch(candidate: Callable) -> tuple[str, str]:
    batches = [window[0] for window in _windows(n_windows=EPOCH_BATCHES, sizes=[4])]

    def record(loop, streamed=False):
        return _record(lambda model, opt: loop(model, opt, _Stream(batches, model) if streamed else batches,
                                               F.mse_loss, ACCUM_STEPS))

    def correct_epoch(model, optimizer, batches, loss_fn, accum_steps):
        for window in accumulation_windows(batches, accum_steps):
            train_step_with_accumulation(model, optimizer, window, loss_fn)

    try:
        learner = record(candidate, streamed=True)
    except _StreamBroken as broken:
        return "FAIL", str(broken)
    n_steps = len(list(accumulation_windows(batches, ACCUM_STEPS)))
    verdict = _verdict(learner, record(correct_epoch), record, _EPOCH_MISTAKES, n_steps)
    return verdict or ("PASS", "every window, the short last one included, was applied as one full-batch step, "
                               "from a loader read one batch at a time")


def _verdict(learner: _Record, correct: _Record, record, mistakes, n_steps: int) -> tuple[str, str] | None:
    """None when the learner's record matches the correct one; else FAIL with the hint of the bug it matches."""
    if learner.matches(correct):
        return None
    for mistake, hint in mistakes:
        if learner.matches(record(mistake)):
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


def _record(run: Callable, momentum: float | None = None) -> _Record:
    """Run ``run(model, optimizer)`` from a fixed start, recording the gradient at every step() call: with SGD, or
    with the Muon that writes its blend into .grad at ``momentum``."""
    model = regression_model(bias=momentum is None)  # Muon takes matrices only
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if momentum is None
        else pitfalls.GradOverwritingMuon(model.parameters(), lr=0.02, momentum=momentum, ns_dtype=torch.float32)
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


# --- second_step_gradient: what a Muon that writes into .grad leaves for the next window ---------

SECOND_STEP_MOMENTA = (0.95, 0.5)  # two momenta, so that a number worked out for one fails
# What learners answer, and why it is not what the step saw.
_SECOND_STEP_ANSWERS = [
    (lambda g1, g2, mu: g2, "that is what the step sees when .grad is cleared every window; here nothing clears it, "
                            "and the first step left its Nesterov blend in .grad"),
    (lambda g1, g2, mu: g1 + g2, "that is what a Muon that never writes .grad (dmuon_edu.muon.Muon) would see: "
                                 "this one replaced g1 in .grad with its blend, lerp(g1, B, momentum)"),
    (lambda g1, g2, mu: g2 + (1 - mu) * g1, "(1 - momentum) g1 is the buffer B after the first step; .grad holds "
                                            "the blend, lerp(g1, B, momentum) = g1 + momentum (B - g1)"),
    (lambda g1, g2, mu: g2 + mu * g1, "the blend is lerp(g1, B, momentum) = g1 + momentum (B - g1), with the buffer "
                                      "B = (1 - momentum) g1 after the first step: expand it"),
]


def _check_second_step_gradient(candidate: Callable) -> tuple[str, str]:
    windows = _windows(n_windows=2)

    def step_gradients(loop, momentum):
        return _record(lambda model, opt: [loop(model, opt, window, F.mse_loss) for window in windows],
                       momentum).step_gradients

    for momentum in SECOND_STEP_MOMENTA:
        g1, g2 = step_gradients(train_step_with_accumulation, momentum)  # what a cleared .grad holds
        seen = step_gradients(pitfalls.never_zero_grad, momentum)[1]
        answer = candidate(g1.clone(), g2.clone(), momentum)
        if not isinstance(answer, torch.Tensor) or answer.shape != g1.shape:
            return "FAIL", f"return a tensor shaped like g1 ({tuple(g1.shape)}), got {answer!r:.80}"
        if torch.allclose(answer, seen, atol=GRADIENT_ATOL, rtol=0):
            continue
        hint = next((hint for formula, hint in _SECOND_STEP_ANSWERS
                     if torch.allclose(answer, formula(g1, g2, momentum), atol=GRADIENT_ATOL, rtol=0)),
                    "follow the two lines of the update with B = 0 at the start: B <- lerp(B, g1, 1 - momentum), "
                    "then .grad <- lerp(g1, B, momentum); the second window's backward adds g2 onto that")
        off = ((answer - seen).norm() / seen.norm()).item()
        return "FAIL", f"with momentum {momentum}, off by {off:.0%} of what the step saw: {hint}"
    return "PASS", (f"for momentum {' and '.join(map(str, SECOND_STEP_MOMENTA))} your gradient is the one the second "
                    "step found in .grad, measured")


EXERCISES = {
    "accumulate_window": _check_accumulate_window,
    "train_epoch": _check_train_epoch,
    "second_step_gradient": _check_second_step_gradient,
    "scaled_loss_lr": _check_scaled_loss_lr,
}
