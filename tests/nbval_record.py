"""A pytest plugin for nbval runs: keeps each executed cell's raw outputs, for a test that needs the same execution.

    DMUON_EDU_NBVAL_OUTPUTS=DIR python -m pytest -p tests.nbval_record --nbval ... NOTEBOOK.ipynb ...

nbval compares a cell's outputs only after sanitising them and merging its streams, and not at all in
nbval-ignore-output cells; test_reliability's determinism test compares the text exactly. Rather than
execute a notebook a second time, that test reads nbval's execution from DIR (recorded_execution), and
executes the notebook itself when DIR holds no complete record of it (the variable unset, the test run
alone, or before nbval reached that notebook's last cell). Each notebook's record is DIR/<stem>.json,
rewritten after each cell. DIR must be new for each run of the suite (tests/stages.sh makes one), so that a
record is always this run's execution.

The outputs are built from the kernel's messages as nbclient builds them (nbformat's output_from_msg, in
order, streams unmerged). nbclient does more with some messages (clear_output, display updates, widget
comms, outputs with a display id): a notebook whose cells send any of these is marked, and not read back.
"""

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import output_from_msg
from nbval.plugin import IPyNbCell

OUTPUTS_ENV = "DMUON_EDU_NBVAL_OUTPUTS"
OUTPUTS = ("stream", "display_data", "execute_result", "error")

_records: dict[Path, dict] = {}  # notebook -> its record so far, in this process


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    folder = os.environ.get(OUTPUTS_ENV)
    if not folder or not isinstance(item, IPyNbCell):
        return (yield)
    notebook, messages = item.parent, []
    receive = notebook.get_kernel_message

    def recording(*args, **kwargs):  # nbval reads every iopub message of the cell through this method
        message = receive(*args, **kwargs)
        messages.append(message)
        return message

    notebook.get_kernel_message = recording
    try:
        return (yield)
    finally:  # a failing cell too: its outputs are what this execution produced
        del notebook.get_kernel_message
        _record(Path(folder), item, messages)


def _record(folder: Path, item: IPyNbCell, messages: list[dict]) -> None:
    path = Path(item.parent.path).resolve()
    record = _records.setdefault(path, {"notebook": str(path), "cells": {}, "unrecordable": []})
    request = next((m["parent_header"].get("msg_id") for m in messages if m["msg_type"] == "execute_input"), None)
    outputs = []
    for message in messages:
        kind = message["msg_type"]
        if message["parent_header"].get("msg_id") != request or kind in ("status", "execute_input"):
            continue
        if kind in OUTPUTS and not (message["content"].get("transient") or {}).get("display_id"):
            outputs.append(output_from_msg(message))
        else:
            record["unrecordable"].append(f"cell {item.cell_num}: {kind}")
    record["cells"][item.cell_num] = {"source": item.cell.source, "outputs": outputs}
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{path.stem}.partial"
    partial.write_text(json.dumps(record))
    partial.replace(folder / f"{path.stem}.json")  # whole or absent, to a test reading it meanwhile


def recorded_execution(path: Path) -> nbformat.NotebookNode | None:
    """The notebook at ``path`` with the outputs of nbval's execution of it in this run in place of its stored
    ones; None when DMUON_EDU_NBVAL_OUTPUTS names no folder, or it holds no complete, readable record of it."""
    folder = os.environ.get(OUTPUTS_ENV)
    record_path = Path(folder or ".") / f"{path.stem}.json"
    if not folder or not record_path.exists():
        return None
    record = json.loads(record_path.read_text())
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    cells = record["cells"]
    if (record["notebook"] != str(path.resolve()) or record["unrecordable"] or len(cells) != len(code)
            or any(cells.get(str(n), {}).get("source") != cell.source for n, cell in enumerate(code))):
        return None
    for n, cell in enumerate(code):
        cell.outputs = [nbformat.from_dict(output) for output in cells[str(n)]["outputs"]]
    return notebook
