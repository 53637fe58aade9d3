"""Grading: run learner notebooks and scripts headless and tabulate their verdicts.

What a verdict rests on. The threat model is honest mistakes and casual forgery (a
learner cell that redefines ``check``, or prints ``PASS``), not a determined adversary:
the learner's code runs in the kernel that is graded and could, with effort, reach
anything the grader does there. So no verdict comes from what the notebook's own cells
print. After each check cell the grader adds a cell of its own, which imports the
package's checkers afresh (dropping any the notebook imported or patched), runs the one
the check cell names on the function of that name, and prints the verdict after a random
token drawn for this run; :func:`grade` reads only those lines.

Each notebook runs in a temporary working directory, with the exercise scripts it names
copied beside it, and with HOME there too: a relative path or ``~`` in a learner's cell
reaches that directory, not the course or the user's files. That is no sandbox: the
learner's code runs with the user's rights (as in nbgrader), and an absolute path
reaches anything the user may touch. A cell that runs past ``cell_timeout``, a kernel that dies and a file
that is not a notebook each become a row, and the other notebooks are still graded; so
does a notebook with no exercise. :func:`grade_script` runs a torchrun exercise script
(its verdict is the line the package's ``report`` prints on rank 0), and
:func:`format_table` makes the table that ``make check`` prints.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from dmuon_edu.course.checks import run_check, run_script_check

GRADE_CELL_TIMEOUT_S = 120
NOTEBOOK_ROW = "(notebook)"  # the exercise column of a row about the whole notebook
# The kernel's environment carries this variable, with a value drawn per run, and so does every process
# its cells start: a torchrun job's ranks too, each in a session of its own, and after the kernel died.
RUN_MARK = "DMUON_EDU_GRADING_RUN"
CHECK_CALL = re.compile(r"""check\(\s*["'](\w+)["']""")
SCRIPT_CALL = re.compile(r"""["']scripts/(\w+\.py)["']""")

_GRADER_CELL = """\
# Added by the grader: the package's checker, imported afresh, on the function named {exercise}.
import sys as _grader_sys
for _grader_module in [m for m in _grader_sys.modules if m.startswith(("dmuon_edu.course.checks", "dmuon_edu.course.grading"))]:
    del _grader_sys.modules[_grader_module]
from dmuon_edu.course.grading import verdict_line as _grader_verdict_line
print(_grader_verdict_line({token!r}, {exercise!r}, globals().get({exercise!r})))
"""


@dataclass(frozen=True)
class ExerciseStatus:
    notebook: str
    exercise: str  # or NOTEBOOK_ROW
    status: str  # "passed", "not attempted", "failed", "not graded" or "no exercise"
    hint: str = ""


_STATUS_WORDS = {
    "PASS": lambda message: ("passed", ""),
    "TODO": lambda message: ("not attempted", ""),
    "FAIL": lambda message: ("failed", message),
}


def verdict_line(token: str, exercise: str, candidate) -> str:
    """Inside the graded kernel: the package's verdict on ``candidate``, as one line after ``token``."""
    if candidate is None:
        status, hint = "failed", f"no function named {exercise}: run the exercise cell above and fix its error"
    else:
        try:
            result = run_check(exercise, candidate)
        except (TypeError, ValueError) as error:  # not a function, or a check cell naming no known exercise
            status, hint = "failed", str(error)
        else:
            status, hint = _STATUS_WORDS[result.status](result.message)
    return f"{token} {json.dumps({'status': status, 'hint': hint})}"


def called_scripts(path: Path) -> list[Path]:
    """The exercise scripts beside the notebook at ``path`` that its code cells name (none if it is unreadable)."""
    try:
        notebook = nbformat.read(path, as_version=4)
    except Exception:  # grade() reports an unreadable notebook; it calls no script
        return []
    return _scripts(notebook, path.parent)


def grade(path: Path, cell_timeout: float = GRADE_CELL_TIMEOUT_S) -> list[ExerciseStatus]:
    """Run a learner notebook headless, letting cells fail, and grade the exercise of every check cell."""
    name = path.stem
    try:
        notebook = nbformat.read(path, as_version=4)
    except Exception as error:  # a learner's file can be broken in any way: it is a row, the others are graded
        return [ExerciseStatus(name, NOTEBOOK_ROW, "failed",
                               f"not a notebook that can be read ({_first_line(error)}); start it over, keeping "
                               f"a backup: python -m dmuon_edu.course restore {path.name}")]
    checked = {index: match.group(1) for index, cell in enumerate(notebook.cells)
               if cell.cell_type == "code" and (match := CHECK_CALL.search(cell.source))}
    scripts = _scripts(notebook, path.parent)
    if not checked and not scripts:
        return [ExerciseStatus(name, NOTEBOOK_ROW, "no exercise",
                               "it has no check cell and runs no exercise script: is this the right file?")]

    token = secrets.token_hex(16)
    cells, graders, origin = [], {}, []  # graders: position of a grader cell -> exercise; origin: learner cell index
    for index, cell in enumerate(notebook.cells):
        cells.append(cell)
        origin.append(index)
        if index in checked:
            graders[len(cells)] = checked[index]
            cells.append(nbformat.v4.new_code_cell(_GRADER_CELL.format(token=token, exercise=checked[index])))
            origin.append(index)
    notebook.cells = cells
    stop = _run(notebook, scripts, cell_timeout)
    if stop and stop[0] + 1 in graders:  # the learner's own check cell stopped: a verdict on that exercise
        stop = (stop[0] + 1, stop[1])

    events = sorted([*graders.items(), *([(stop[0], None)] if stop and stop[0] not in graders else [])])
    rows = []
    for position, exercise in events:
        if exercise is None:  # the learner cell the run stopped at
            first = (notebook.cells[position].source.strip().splitlines() or [""])[0][:60]
            rows.append(ExerciseStatus(name, NOTEBOOK_ROW, "failed", f"cell {origin[position] + 1} (`{first}`) {stop[1]}"))
        elif stop is None or position < stop[0]:
            rows.append(_read_verdict(name, exercise, notebook.cells[position], token))
        elif position == stop[0]:  # the learner's function, called by the grader's cell
            rows.append(ExerciseStatus(name, exercise, "failed", f"its check {stop[1]}"))
        else:
            rows.append(ExerciseStatus(name, exercise, "not graded", "the run stopped before its check (see above)"))
    return rows


def grade_script(path: Path, nproc: int = 2) -> ExerciseStatus:
    """Run a learner script on ``nproc`` ranks and read its verdict."""
    try:
        result = run_script_check(path, nproc)
    except TimeoutError as error:  # the launcher killed the job; a row, and the other exercises are graded
        return ExerciseStatus(path.stem, path.stem, "failed", str(error).split(" Last lines:")[0])
    return ExerciseStatus(path.stem, result.exercise, *_STATUS_WORDS[result.status](result.message))


def format_table(statuses: list[ExerciseStatus]) -> str:
    rows = [("notebook", "exercise", "status")] + [
        (s.notebook, s.exercise, s.status + (f": {s.hint}" if s.hint else "")) for s in statuses
    ]
    notebook_width, exercise_width = (max(len(row[i]) for row in rows) for i in range(2))
    lines = [f"{a:<{notebook_width}}  {b:<{exercise_width}}  {c}" for a, b, c in rows]
    lines.insert(1, "-" * (notebook_width + exercise_width + 4 + len("not attempted")))
    exercises = [s for s in statuses if s.exercise != NOTEBOOK_ROW]
    done = sum(s.status == "passed" for s in exercises)
    lines.append(f"\n{done} of {len(exercises)} exercises passed")
    return "\n".join(lines)


def _scripts(notebook: nbformat.NotebookNode, folder: Path) -> list[Path]:
    names = {name for cell in notebook.cells if cell.cell_type == "code" for name in SCRIPT_CALL.findall(cell.source)}
    return [folder / "scripts" / name for name in sorted(names) if (folder / "scripts" / name).is_file()]


def _run(notebook: nbformat.NotebookNode, scripts: list[Path], cell_timeout: float) -> tuple[int, str] | None:
    """Execute ``notebook`` in place in a fresh directory; None, or (cell position, why the run stopped there)."""
    with tempfile.TemporaryDirectory(prefix="dmuon-grade-") as workdir:
        for script in scripts:
            (Path(workdir) / "scripts").mkdir(exist_ok=True)
            shutil.copy2(script, Path(workdir) / "scripts" / script.name)
        client = NotebookClient(notebook, timeout=cell_timeout, kernel_name="python3", allow_errors=True,
                                shutdown_kernel="immediate", resources={"metadata": {"path": workdir}})
        mark = secrets.token_hex(8)
        try:
            with client.setup_kernel(env={**os.environ, RUN_MARK: mark, "HOME": workdir}):
                try:
                    for position, cell in enumerate(notebook.cells):
                        client.execute_cell(cell, position)
                except CellTimeoutError:
                    return position, (f"did not finish within {cell_timeout:g} s: an endless loop? Fix it and check "
                                      "again (if it is only slow: make check CELL_TIMEOUT=600)")
                except DeadKernelError:
                    return position, ("killed the kernel (os._exit, exit(), a crash in native code, or out of "
                                      "memory): fix it and check again")
        finally:
            _kill_marked(f"{RUN_MARK}={mark}".encode())  # what the cells started must not outlive the grading
    return None


def _kill_marked(mark: bytes) -> None:
    """SIGKILL every process whose environment holds ``mark`` (none where there is no /proc)."""
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else []:
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:  # gone meanwhile, or another user's
            continue


def _read_verdict(notebook: str, exercise: str, cell, token: str) -> ExerciseStatus:
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            for line in output.text.splitlines():
                if token in line:  # anywhere: the learner's function may have printed without a newline
                    verdict = json.loads(line.split(f"{token} ", 1)[1])
                    return ExerciseStatus(notebook, exercise, verdict["status"], verdict["hint"])
    errors = [f"{output.ename}: {output.evalue}" for output in cell.get("outputs", []) if output.output_type == "error"]
    return ExerciseStatus(notebook, exercise, "failed", f"its check raised {errors[0]}" if errors else
                          "its check printed no verdict (does a cell replace print or sys.stdout?)")


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
