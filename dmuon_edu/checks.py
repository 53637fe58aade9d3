"""Self-checks for the course's exercises.

A check cell in a notebook calls ``check("exercise_name", learner_function)``.
The checker runs the learner's function next to the package's reference on a
small, seeded problem and prints one line::

    PASS train_step_with_accumulation: ...
    FAIL train_step_with_accumulation: <a hint that names the mistake>
    TODO train_step_with_accumulation: not attempted yet ...

A wrong answer is recognised by its *effect*: the learner's update is compared
with the updates that the known mistakes in :mod:`dmuon_edu.pitfalls` produce,
so the hint names the mistake rather than just saying "wrong".
``python -m dmuon_edu check`` reads these lines back to build its table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dmuon_edu import pitfalls
from dmuon_edu.accumulation import train_step_with_accumulation

__all__ = ["CheckResult", "check", "run_check", "EXERCISES", "RESULT_LINE"]

RESULT_LINE = re.compile(r"^(PASS|FAIL|TODO) (\w+): (.*)$")

# Float32 parameters of size ~0.1-1 after a few additions: two correct
# implementations that order or group the scaling differently differ by a few
# ulps (~1e-7). Any real mistake moves them by more than 1e-3.
PARAMETER_ATOL = 1e-6
LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class CheckResult:
    exercise: str
    status: str  # "PASS", "FAIL" or "TODO"
    message: str

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    def __str__(self) -> str:
        return f"{self.status} {self.exercise}: {self.message}"


def check(exercise: str, candidate: Callable) -> None:
    """Run the checker of ``exercise`` on ``candidate`` and print its verdict."""
    print(run_check(exercise, candidate))


def run_check(exercise: str, candidate: Callable) -> CheckResult:
    """The verdict of the checker of ``exercise`` on ``candidate``."""
    if exercise not in EXERCISES:
        raise ValueError(f"unknown exercise {exercise!r}; known exercises: {', '.join(sorted(EXERCISES))}")
    if not callable(candidate):
        raise TypeError(f"pass your function itself, e.g. check({exercise!r}, {exercise}), not its result")
    try:
        status, message = EXERCISES[exercise](candidate)
    except NotImplementedError:
        status, message = "TODO", "not attempted yet: replace the `raise NotImplementedError(...)` line with your code"
    except Exception as error:  # the learner's code may fail in any way; report it, do not crash the notebook
        status, message = "FAIL", f"your function raised {type(error).__name__}: {error}"
    return CheckResult(exercise, status, message)


# --- train_step_with_accumulation ---------------------------------------------------------

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
        windows = _windows(sizes, n_windows=2)
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


def _windows(sizes: list[int], n_windows: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(1234)
    return [
        [(torch.randn(size, 4, generator=generator), torch.randn(size, 2, generator=generator)) for size in sizes]
        for _ in range(n_windows)
    ]


def _train(step_fn: Callable, windows) -> tuple[torch.Tensor, list]:
    """Parameters after calling ``step_fn`` once per window from a fixed start, and its returns."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [step_fn(model, optimizer, window, torch.nn.functional.mse_loss) for window in windows]
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return params, losses


EXERCISES: dict[str, Callable[[Callable], tuple[str, str]]] = {
    "train_step_with_accumulation": _check_train_step,
}
