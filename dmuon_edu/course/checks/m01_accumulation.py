"""Checks for module 1: loss-scaled accumulation."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dmuon_edu.course import pitfalls
from dmuon_edu.accumulation import train_step_with_accumulation
from dmuon_edu.course.checks.problem import regression_model, regression_windows

# Float32 parameters of size ~0.1-1 after a few additions: two correct
# implementations that order or group the scaling differently differ by a few
# ulps (~1e-7). Any real mistake moves them by more than 1e-3.
PARAMETER_ATOL = 1e-6
LOSS_RTOL = 1e-5

_STEP_MISTAKES = [
    (
        pitfalls.unscaled_loss,
        "the update is N times too large: each micro-batch loss must be divided by the number of "
        "micro-batches (its share of the samples) before .backward(), because .backward() adds into .grad",
    ),
    (
        pitfalls.zero_grad_inside_loop,
        "only the last micro-batch reached the step: optimizer.zero_grad() is inside the micro-batch loop; "
        "call it once, before the loop",
    ),
    (
        pitfalls.never_zero_grad,
        "the second window also applied the first window's gradient: .grad is never cleared; "
        "call optimizer.zero_grad() once at the start of every window",
    ),
    (
        pitfalls.step_every_microbatch,
        "optimizer.step() runs after every micro-batch; call it once, after the loop",
    ),
    (
        pitfalls.mean_of_microbatch_means,
        "with micro-batches of unequal size every micro-batch was weighted 1/N, so small micro-batches count "
        "too much; weight micro-batch i by its share of the samples, len(targets_i) / total",
    ),
]


def _check_train_step(candidate: Callable) -> tuple[str, str]:
    for sizes in ([3, 3, 3, 3], [1, 5, 2, 4]):
        windows = regression_windows(sizes, n_windows=2, seed=1234)
        expected_params, expected_losses = _train(train_step_with_accumulation, windows)
        params, losses = _train(candidate, windows)
        if not torch.allclose(params, expected_params, atol=PARAMETER_ATOL, rtol=0):
            return "FAIL", _diagnose_update(params, windows, sizes)
        for loss, expected in zip(losses, expected_losses):
            if not isinstance(loss, float):
                return "FAIL", f"return the loss as a Python float (loss.item()), not {type(loss).__name__}"
            if abs(loss - expected) > LOSS_RTOL * abs(expected):
                return "FAIL", _diagnose_loss(loss, expected, len(sizes))
    return "PASS", "your step equals one full-batch step, for equal and unequal micro-batches, and returns the mean loss"


def _diagnose_update(params: torch.Tensor, windows, sizes) -> str:
    initial, _ = _train(lambda *args: 0.0, windows)
    if torch.equal(params, initial):
        return "the parameters did not change: call optimizer.step() once, after the micro-batch loop"
    for mistake, hint in _STEP_MISTAKES:
        mistaken, _ = _train(mistake, windows)
        if torch.allclose(params, mistaken, atol=PARAMETER_ATOL, rtol=0):
            return hint
    expected, _ = _train(train_step_with_accumulation, windows)
    return (
        f"with micro-batch sizes {sizes} your parameters differ from one full-batch step by up to "
        f"{(params - expected).abs().max().item():.2g}; zero_grad once, scale each loss by its share "
        "of the samples, backward every micro-batch, step once"
    )


def _diagnose_loss(loss: float, expected: float, n_microbatches: int) -> str:
    if abs(loss * n_microbatches - expected) <= LOSS_RTOL * abs(expected):
        return "the returned loss is N times too small: undo the scaling when logging, loss.item() * N"
    return f"the returned loss {loss:.4f} is not the window's mean loss {expected:.4f}"


def _train(step_fn: Callable, windows) -> tuple[torch.Tensor, list]:
    """Parameters after calling ``step_fn`` once per window from a fixed start, and its returns."""
    model = regression_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [step_fn(model, optimizer, window, torch.nn.functional.mse_loss) for window in windows]
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return params, losses



EXERCISES = {
    "train_step_with_accumulation": _check_train_step,
}
