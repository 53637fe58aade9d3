"""Grading: run learner notebooks and scripts headless and tabulate their verdicts.

A check cell prints one line, ``PASS name: ...``, ``FAIL name: <hint>`` or
``TODO name: ...`` (see :mod:`dmuon_edu.course.checks`); :func:`grade` runs a
notebook and reads those lines back, :func:`grade_script` runs a torchrun exercise
script, and :func:`format_table` makes the table that ``make check`` prints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from dmuon_edu.course.checks import RESULT_LINE, run_script_check
from dmuon_edu.course.notebooks import CELL_TIMEOUT_S

CHECK_CALL = re.compile(r"""check\(\s*["'](\w+)["']""")


@dataclass(frozen=True)
class ExerciseStatus:
    notebook: str
    exercise: str
    status: str  # "passed", "not attempted" or "failed"
    hint: str = ""


def grade(path: Path) -> list[ExerciseStatus]:
    """Run a learner notebook headless, letting cells fail, and read every check cell's verdict."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    statuses = []
    for cell in notebook.cells:
        match = CHECK_CALL.search(cell.source) if cell.cell_type == "code" else None
        if match:
            status, hint = _verdict(cell.get("outputs", []))
            statuses.append(ExerciseStatus(path.stem, match.group(1), status, hint))
    return statuses


def grade_script(path: Path, nproc: int = 2) -> ExerciseStatus:
    """Run a learner script on ``nproc`` ranks and read its verdict."""
    result = run_script_check(path, nproc)
    return ExerciseStatus(path.stem, result.exercise, *_STATUS_WORDS[result.status](result.message))


_STATUS_WORDS = {
    "PASS": lambda message: ("passed", ""),
    "TODO": lambda message: ("not attempted", ""),
    "FAIL": lambda message: ("failed", message),
}


def _verdict(outputs) -> tuple[str, str]:
    for output in outputs:
        if output.output_type == "stream":
            for line in output.text.splitlines():
                result = RESULT_LINE.match(line)
                if result:
                    word, _, message = result.groups()
                    return _STATUS_WORDS[word](message)
        if output.output_type == "error":
            if output.ename == "NotImplementedError":
                return "not attempted", ""
            if output.ename == "NameError":
                return "failed", f"{output.evalue}: run the exercise cell above and fix its error"
            return "failed", f"the check cell raised {output.ename}: {output.evalue}"
    return "failed", "the check cell printed no verdict; run the notebook from the top"


def format_table(statuses: list[ExerciseStatus]) -> str:
    rows = [("notebook", "exercise", "status")] + [
        (s.notebook, s.exercise, s.status + (f": {s.hint}" if s.hint else "")) for s in statuses
    ]
    notebook_width, exercise_width = (max(len(row[i]) for row in rows) for i in range(2))
    lines = [f"{a:<{notebook_width}}  {b:<{exercise_width}}  {c}" for a, b, c in rows]
    lines.insert(1, "-" * (notebook_width + exercise_width + 4 + len("not attempted")))
    done = sum(s.status == "passed" for s in statuses)
    lines.append(f"\n{done} of {len(statuses)} exercises passed")
    return "\n".join(lines)
