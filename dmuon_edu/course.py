"""The course's notebooks: one source of truth, and grading.

``solutions/NN_name.ipynb`` holds each notebook complete, with stored outputs.
Exercise code sits between markers::

    ### BEGIN SOLUTION
    ...
    ### END SOLUTION

Distributed exercises are torchrun scripts, ``solutions/scripts/NN_name.py``,
with the same markers.

``build`` writes the learner twins ``notebooks/NN_name.ipynb`` and
``notebooks/scripts/NN_name.py``: every marked block becomes a stub that
raises NotImplementedError, outputs and widget state are gone. ``execute``
refreshes the solutions' stored outputs. ``check`` runs the learner notebooks
headless and the learner scripts under torchrun, and tabulates the verdicts
they print (see :mod:`dmuon_edu.checks`).

    python -m dmuon_edu.course build        # solutions/ -> notebooks/
    python -m dmuon_edu.course execute [NN] # re-run solutions, store clean outputs
    python -m dmuon_edu.course check [NN]   # grade notebooks/ (also: python -m dmuon_edu check)
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from dmuon_edu.checks import RESULT_LINE, run_script_check

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
NOTEBOOKS = ROOT / "notebooks"
SOLUTION_SCRIPTS = SOLUTIONS / "scripts"

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB_MESSAGE = "Exercise: replace this line with your code (the cell above says what to do), then run the check below."
SCRIPT_STUB_MESSAGE = "Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell."
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
CELL_TIMEOUT_S = 600


# --- build: solutions -> learner notebooks ------------------------------------------------


def strip_solutions(source: str, where: str = "source", message: str = STUB_MESSAGE) -> str:
    """Replace each BEGIN/END SOLUTION block by a NotImplementedError stub at the marker's indent."""
    out, indent = [], None
    for number, line in enumerate(source.splitlines(keepends=True), start=1):
        marker = line.strip()
        if marker == BEGIN:
            if indent is not None:
                raise ValueError(f"{where}, line {number}: {BEGIN} inside another solution block; close it first")
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}raise NotImplementedError({message!r})\n")
        elif marker == END:
            if indent is None:
                raise ValueError(f"{where}, line {number}: {END} without a {BEGIN} before it")
            indent = None
        elif indent is None:
            out.append(line)
    if indent is not None:
        raise ValueError(f"{where}: {BEGIN} is never closed; add {END} after the solution")
    return "".join(out).rstrip("\n")


def learner_notebook(solution: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The learner twin of a solution notebook: stubs, no outputs, no execution noise."""
    learner = nbformat.from_dict(solution)
    clean_outputs(learner)
    for index, cell in enumerate(learner.cells):
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source, where=f"{name}, cell {index}")
            cell.outputs = []
            cell.execution_count = None
    return learner


def learner_script(source: str, name: str) -> str:
    """The learner twin of a solution script: the same file with its solution blocks stubbed."""
    return strip_solutions(source, where=name, message=SCRIPT_STUB_MESSAGE) + "\n"


def build(check_only: bool = False) -> list[Path]:
    """Write notebooks/ (and notebooks/scripts/) from solutions/; return what was (or would be) changed."""
    changed = []
    twins = [
        (path, nbformat.writes(learner_notebook(nbformat.read(path, as_version=4), path.name)) + "\n")
        for path in sorted(SOLUTIONS.glob("*.ipynb"))
    ] + [(path, learner_script(path.read_text(), path.name)) for path in sorted(SOLUTION_SCRIPTS.glob("*.py"))]
    for solution_path, text in twins:
        target = NOTEBOOKS / solution_path.relative_to(SOLUTIONS)
        if not target.exists() or target.read_text() != text:
            changed.append(target)
            if not check_only:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
    return changed


# --- execute: refresh the solutions' stored outputs ---------------------------------------


def clean_outputs(notebook: nbformat.NotebookNode) -> None:
    """Drop what changes from run to run and means nothing to a reader: widget state and timings."""
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            data.pop(WIDGET_VIEW, None)


def execute(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    clean_outputs(notebook)
    path.write_text(nbformat.writes(notebook) + "\n")


# --- check: grade learner notebooks -------------------------------------------------------

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


def select(folder: Path, selector: str | None, pattern: str = "*.ipynb") -> list[Path]:
    """Files of ``folder`` whose name starts with ``selector`` (e.g. "01"), or the path ``selector`` itself."""
    if selector and Path(selector).suffix in (".ipynb", ".py"):
        path = Path(selector)
        if not path.exists():
            raise SystemExit(f"no file at {selector}")
        return [path] if path.match(pattern) else []
    return [p for p in sorted(folder.glob(pattern)) if selector is None or p.name.startswith(selector)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dmuon_edu.course", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="write notebooks/ from solutions/")
    commands.add_parser("sync-check", help="fail if notebooks/ is not what build would write")
    for name, help_text in [("execute", "re-run solution notebooks and store clean outputs"),
                            ("check", "grade your notebooks: one row per exercise")]:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("selector", nargs="?", help="a notebook number such as 01, or a notebook path")
    args = parser.parse_args(argv)

    if args.command in ("build", "sync-check"):
        changed = build(check_only=args.command == "sync-check")
        for path in changed:
            print(f"{'out of date' if args.command == 'sync-check' else 'wrote'}: {path.relative_to(ROOT)}")
        if args.command == "sync-check" and changed:
            print("notebooks/ is out of date with solutions/: run `make notebooks`", file=sys.stderr)
            return 1
        return 0
    if args.command == "execute":
        for path in select(SOLUTIONS, args.selector):
            print(f"executing {path.relative_to(ROOT)}", flush=True)
            execute(path)
        return 0
    notebooks = select(NOTEBOOKS, args.selector)
    scripts = select(NOTEBOOKS / "scripts", args.selector, "*.py")
    if not notebooks and not scripts:
        raise SystemExit(f"nothing in {NOTEBOOKS} starts with {args.selector!r}")
    statuses = [status for path in notebooks for status in grade(path)]
    statuses += [grade_script(path) for path in scripts]
    print(format_table(statuses))
    return 0 if all(s.status == "passed" for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
