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
raises NotImplementedError, outputs and widget state are gone. It records the
hash of every file it writes in ``notebooks/.manifest.json`` (committed with
them), so that it can tell a learner's work from its own output: a file that
differs from its recorded hash is never overwritten without ``force``, and
then only after a backup. :func:`restore` starts one exercise over.
:func:`execute` refreshes a solution's stored outputs. Grading lives in
:mod:`dmuon_edu.course.grading`, the command line in :mod:`dmuon_edu.course.cli`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
NOTEBOOKS = ROOT / "notebooks"
SOLUTION_SCRIPTS = SOLUTIONS / "scripts"
MANIFEST = ".manifest.json"  # in notebooks/: what build last wrote, relative path -> sha256

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


def twins() -> dict[str, str]:
    """Every learner file build writes: its path relative to notebooks/ -> its text."""
    texts = {path.name: nbformat.writes(learner_notebook(nbformat.read(path, as_version=4), path.name)) + "\n"
             for path in sorted(SOLUTIONS.glob("*.ipynb"))}
    texts.update((f"scripts/{path.name}", learner_script(path.read_text(), path.name))
                 for path in sorted(SOLUTION_SCRIPTS.glob("*.py")))
    return texts


class WorkWouldBeLost(RuntimeError):
    """build was asked to replace files a learner has changed since the last build."""


@dataclass(frozen=True)
class Plan:
    """What build would do to a folder of learner files (paths relative to it)."""

    texts: dict[str, str] = field(repr=False)  # what build writes, every file
    write: list[str]  # absent, or exactly as the last build left them: rewritten freely
    edited: list[str]  # changed by the learner since the last build, and solutions/ changed too: refused
    kept: list[str]  # changed by the learner, but solutions/ give nothing new for them: left alone


def plan(into: Path = NOTEBOOKS) -> Plan:
    """Compare each learner file with what build would write and with what the last build wrote."""
    texts, recorded = twins(), _read_manifest(into)
    write, edited, kept = [], [], []
    for name, text in texts.items():
        target = into / name
        if not target.exists():
            write.append(name)
            continue
        current, new = _sha256(target.read_bytes()), _sha256(text.encode())
        if current == new:
            continue
        if current == recorded.get(name):
            write.append(name)
        else:
            (kept if recorded.get(name) == new else edited).append(name)
    return Plan(texts, write, edited, kept)


def build(into: Path = NOTEBOOKS, force: bool = False) -> tuple[list[Path], dict[Path, Path]]:
    """Write the learner files into ``into`` from solutions/; return the files written and {file: its backup}.

    A file the learner changed since the last build is replaced only with ``force``, after
    a copy to ``<name>.bak-<time>``; without it, WorkWouldBeLost names every such file and
    nothing at all is written (a partial build would record the new hashes and hide the
    conflict from the next one).
    """
    todo = plan(into)
    if todo.edited and not force:
        listed = "\n".join(f"  {into / name}" for name in todo.edited)
        raise WorkWouldBeLost(
            f"not rebuilding {into}: these files changed since the last build, and the solutions behind them "
            f"changed too, so rebuilding would replace your work:\n{listed}\nNothing was written. To take the new "
            "version of one, keeping a backup of yours: python -m dmuon_edu.course restore NAME. To replace all of "
            "them, each with a backup: make notebooks FORCE=1 (python -m dmuon_edu.course build --force)."
        )
    backups = {into / name: _backup(into / name) for name in todo.edited}
    for name in todo.write + todo.edited:
        _write(into / name, todo.texts[name])
    _write_manifest(into, {name: _sha256(text.encode()) for name, text in todo.texts.items()})
    return [into / name for name in todo.write + todo.edited], backups


def restore(selector: str, into: Path = NOTEBOOKS) -> dict[Path, Path | None]:
    """Rewrite the learner files whose name starts with ``selector`` (e.g. "01") as build makes them.

    Returns {file: its backup, or None where the file was missing or untouched}.
    """
    texts = twins()
    chosen = [name for name in texts if Path(selector).name and Path(name).name.startswith(Path(selector).name)]
    if not chosen:
        raise ValueError(f"no learner file starts with {selector!r}; they are: {', '.join(texts)}")
    recorded = _read_manifest(into)
    restored = {}
    for name in chosen:
        target = into / name
        changed = target.exists() and target.read_text() != texts[name]
        restored[target] = _backup(target) if changed else None
        _write(target, texts[name])
        recorded[name] = _sha256(texts[name].encode())
    _write_manifest(into, recorded)
    return restored


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_manifest(into: Path) -> dict[str, str]:
    path = into / MANIFEST
    if not path.exists():
        return {}  # a first build: a file already there counts as the learner's unless it equals the build
    try:
        recorded = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error}): restore it with git checkout -- {path}") from None
    if not isinstance(recorded, dict):
        raise ValueError(f"{path} should map file names to hashes: restore it with git checkout -- {path}")
    return recorded


def _write_manifest(into: Path, hashes: dict[str, str]) -> None:
    (into / MANIFEST).write_text(json.dumps(dict(sorted(hashes.items())), indent=1) + "\n")


def _backup(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup, n = path.with_name(f"{path.name}.bak-{stamp}"), 1
    while backup.exists():  # two backups within one second
        n += 1
        backup = path.with_name(f"{path.name}.bak-{stamp}-{n}")
    shutil.copy2(path, backup)
    return backup


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


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
