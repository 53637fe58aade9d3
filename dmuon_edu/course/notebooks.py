"""Learner notebooks from the solutions: one source of truth.

``solutions/NN_name.ipynb`` holds each notebook complete, with stored outputs.
Exercise code sits between markers::

    ### BEGIN SOLUTION
    ...
    ### END SOLUTION

Distributed exercises are torchrun scripts, ``solutions/scripts/NN_name.py``,
with the same markers.

:func:`build` writes the learner twins ``notebooks/NN_name.ipynb`` and
``notebooks/scripts/NN_name.py``: every marked block becomes a stub that
raises NotImplementedError, outputs and widget state are gone. :func:`execute`
refreshes a solution's stored outputs. Grading lives in :mod:`dmuon_edu.course.grading`,
the command line in :mod:`dmuon_edu.course.cli`.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
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
