"""Self-checks for the course's exercises.

A check cell in a notebook calls ``check("exercise_name", learner_function)``.
The checker runs the learner's function next to the package's reference on a
small, seeded problem and prints one line::

    PASS train_step_with_accumulation: ...
    FAIL train_step_with_accumulation: <a hint that names the mistake>
    TODO train_step_with_accumulation: not attempted yet ...

A wrong answer is recognised by its *effect*: the learner's update is compared
with the updates that the known mistakes in :mod:`dmuon_edu.course.pitfalls` produce,
so the hint names the mistake rather than just saying "wrong". Each course
module's checkers live in a submodule (``m01_accumulation``, ...).
``python -m dmuon_edu check`` reads these lines back to build its table.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dmuon_edu.course.checks import (m01_accumulation, m02_pitfalls, m03_real_loops, m04_muon, m06_seconds,
                                     m07_capstone)
from dmuon_edu.launch import RankFailedError, torchrun

__all__ = [
    "CheckResult",
    "check",
    "run_check",
    "check_script",
    "run_script_check",
    "load_script_results",
    "SCRIPT_RESULTS_ENV",
    "recorded_script_results",
    "ExerciseNotDone",
    "EXERCISES",
    "RESULT_LINE",
]

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
    module = getattr(candidate, "__module__", None) or ""
    if module.partition(".")[0] == "dmuon_edu" and not module.startswith("dmuon_edu.course"):
        name = f"{module}.{getattr(candidate, '__qualname__', '')}"
        return CheckResult(exercise, "FAIL", f"that is the package's own {name}: the exercise is to write it, "
                                             "so pass the function you wrote")
    try:
        status, message = EXERCISES[exercise](candidate)
    except NotImplementedError:
        status, message = "TODO", "not attempted yet: replace the `raise NotImplementedError(...)` line with your code"
    except Exception as error:  # the learner's code may fail in any way; report it, do not crash the notebook
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        status, message = "FAIL", f"your function raised {type(error).__name__}: {first_line}"
    return CheckResult(exercise, status, message)


# When set, a folder: every check_script run also keeps the script's results there (see _record_results).
SCRIPT_RESULTS_ENV = "DMUON_EDU_SCRIPT_RESULTS"


def check_script(path: str | os.PathLike, nproc: int = 2, args: tuple | list = ()) -> None:
    """Run a torchrun exercise script (its ranks' output shown as it arrives) and print its verdict."""
    path, folder = Path(path), os.environ.get(SCRIPT_RESULTS_ENV)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        # report() writes the results where the script's first argument says, or nowhere without one:
        # give it a path of our own then; the script runs the same, its output is the same.
        ours = None if args else Path(folder) / f"{path.stem}-w{nproc}.report.json"
        args = list(args) or [ours]
        started, source = time.time(), path.read_bytes()
    result, printed_by_script = _script_verdict(path, nproc, args, echo=True)
    if folder and result.status == "PASS":  # a failed run is never read in place of the tests' own launch
        _record_results(Path(folder), path, nproc, source, Path(args[0]), started)
        if ours is not None:
            ours.unlink(missing_ok=True)
    if not printed_by_script:
        print(result)


def _script_record_path(folder: Path, path: Path, nproc: int) -> Path:
    return folder / f"{path.stem}-w{nproc}.json"


def _record_results(folder: Path, path: Path, nproc: int, source: bytes, written: Path, started: float) -> None:
    """Keep what a check cell's run of an exercise script reported, for the tests that assert on the same run.

    `make test` executes the solution notebooks (nbval) with SCRIPT_RESULTS_ENV naming a fresh folder;
    tests/test_data_parallel.py and tests/test_module6.py then read these records instead of launching
    every script again (recorded_script_results). A record names the script and the hash of the source
    that ran, so that a test reads only the run of the solution script it asserts on.
    """
    if not written.exists() or written.stat().st_mtime < started:  # no report from this run (it failed)
        return
    record = {"script": str(path.resolve()), "sha256": hashlib.sha256(source).hexdigest(), "nproc": nproc,
              "results": json.loads(written.read_text())}
    final = _script_record_path(folder, path, nproc)
    partial = final.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    partial.replace(final)  # whole or absent, to a test reading it meanwhile


def recorded_script_results(path: str | os.PathLike, nproc: int) -> dict | None:
    """The results a notebook's check_script run of the script at ``path`` on ``nproc`` ranks reported,
    when SCRIPT_RESULTS_ENV names a folder holding them and that script's source is unchanged since; else None."""
    folder = os.environ.get(SCRIPT_RESULTS_ENV)
    if not folder:
        return None
    path = Path(path)
    record_path = _script_record_path(Path(folder), path, nproc)
    if not record_path.exists():
        return None
    record = json.loads(record_path.read_text())
    if (record["script"], record["sha256"], record["nproc"]) != (
            str(path.resolve()), hashlib.sha256(path.read_bytes()).hexdigest(), nproc):
        return None
    return record["results"]


def run_script_check(path: str | os.PathLike, nproc: int = 2, args: tuple | list = (), echo: bool = False) -> CheckResult:
    """The verdict of a torchrun exercise script: the line its rank 0 prints, or why it printed none."""
    return _script_verdict(Path(path), nproc, args, echo)[0]


def _script_verdict(path: Path, nproc: int, args, echo: bool) -> tuple[CheckResult, bool]:
    try:
        output = torchrun(path, nproc=nproc, args=args, echo=echo).stdout(0)
    except RankFailedError as error:
        if error.exception.startswith("NotImplementedError"):
            return CheckResult(path.stem, "TODO", f"not attempted yet: fill in the exercise in {path.name}"), False
        return CheckResult(path.stem, "FAIL", f"rank {error.rank} raised {error.exception}"), False
    for line in reversed(output.splitlines()):
        match = RESULT_LINE.match(line)
        if match:
            status, exercise, message = match.groups()
            return CheckResult(exercise, status, message), True
    return CheckResult(path.stem, "FAIL", "the script printed no verdict"), False


class ExerciseNotDone(RuntimeError):
    """Raised where a cell needs what an unfinished exercise would produce; shown as one line."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback: the learner needs the sentence, not the stack.
        return [f"{type(self).__name__}: {self}"]


def load_script_results(path: str | os.PathLike) -> dict:
    """The JSON results an exercise script wrote, or a one-line ExerciseNotDone if it has not run to the end."""
    path = Path(path)
    if not path.exists():
        raise ExerciseNotDone(
            f"no results in {path.name} yet: finish the exercise script and run its check cell above first"
        )
    return json.loads(path.read_text())


# exercise name -> checker(candidate) -> (status, message); one module of checkers per course module.
EXERCISES: dict[str, Callable[[Callable], tuple[str, str]]] = {
    **m01_accumulation.EXERCISES,
    **m02_pitfalls.EXERCISES,
    **m03_real_loops.EXERCISES,
    **m04_muon.EXERCISES,
    **m06_seconds.EXERCISES,
    **m07_capstone.EXERCISES,
}
