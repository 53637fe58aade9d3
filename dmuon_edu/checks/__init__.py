"""Self-checks for the course's exercises.

A check cell in a notebook calls ``check("exercise_name", learner_function)``.
The checker runs the learner's function next to the package's reference on a
small, seeded problem and prints one line::

    PASS train_step_with_accumulation: ...
    FAIL train_step_with_accumulation: <a hint that names the mistake>
    TODO train_step_with_accumulation: not attempted yet ...

A wrong answer is recognised by its *effect*: the learner's update is compared
with the updates that the known mistakes in :mod:`dmuon_edu.pitfalls` produce,
so the hint names the mistake rather than just saying "wrong". Each course
module's checkers live in a submodule (``m01_accumulation``, ...).
``python -m dmuon_edu check`` reads these lines back to build its table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from dmuon_edu.checks import m01_accumulation, m03_real_loops

__all__ = ["CheckResult", "check", "run_check", "EXERCISES", "RESULT_LINE"]

RESULT_LINE = re.compile(r"^(PASS|FAIL|TODO) (\w+): (.*)$")


@dataclass(frozen=True)
class CheckResult:
    exercise: str
    status: str  # "PASS", "FAIL" or "TODO"
    message: str

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


# exercise name -> checker(candidate) -> (status, message); one module of checkers per course module.
EXERCISES: dict[str, Callable[[Callable], tuple[str, str]]] = {
    **m01_accumulation.EXERCISES,
    **m03_real_loops.EXERCISES,
}
