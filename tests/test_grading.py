"""Grading end to end through a real kernel: the command a learner runs, on answers to module 1's exercise.

One run of ``python -m dmuon_edu check`` grades one notebook: module 1's set-up cell, then its exercise
cell answered three ways (the solution, a missing 1/N, zero_grad inside the loop), each followed by its
check cell, then a cell that forges ``check``. Each answer is graded when its check cell has run, on the
function defined then, so one kernel (its start and the set-up's imports, most of a grading's time) gives
a row per answer; the solution comes first, where a learner's kernel is fresh. This file is one unit for
xdist's loadfile scheduling: the run is made once.
"""

import subprocess
import sys

import nbformat
import pytest

from dmuon_edu.course import notebooks

LEARNER_01 = "01_loss_scaled_accumulation.ipynb"

NO_SCALING = """
def train_step_with_accumulation(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    total = 0.0
    for inputs, targets in microbatches:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        total += loss.item()
    optimizer.step()
    return total / len(microbatches)
"""

ZERO_GRAD_INSIDE = """
def train_step_with_accumulation(model, optimizer, microbatches, loss_fn):
    n = len(microbatches)
    total = 0.0
    for inputs, targets in microbatches:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets) / n
        loss.backward()
        total += loss.item() * n
    optimizer.step()
    return total / n
"""

# A learner cell that answers module 7's exercise wrongly and replaces `check` by one that prints PASS.
FORGED = ("def is_hidden_matrix(name, p):\n    return True\n\n"
          "def check(exercise, candidate):\n    print(f'PASS {exercise}: looks right')")
FORGED_CHECK_CELL = 'check("is_hidden_matrix", is_hidden_matrix)'


@pytest.fixture(scope="module")
def check_run(tmp_path_factory):
    """The learner notebook of module 1 cut to its set-up cell and, per answer, exercise and check; graded."""
    learner = tmp_path_factory.mktemp("learner")
    notebooks.build(into=learner)  # the learner's cells as a learner gets them, never notebooks/
    notebook = nbformat.read(learner / LEARNER_01, as_version=4)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    exercise = next(i for i, cell in enumerate(code_cells) if "NotImplementedError" in cell.source)
    solution = nbformat.read(notebooks.SOLUTIONS / LEARNER_01, as_version=4)
    answer = next(cell.source for cell in solution.cells if notebooks.BEGIN in cell.source)
    check_cell = code_cells[exercise + 1].source
    pairs = [(answer, check_cell), (NO_SCALING, check_cell), (ZERO_GRAD_INSIDE, check_cell), (FORGED, FORGED_CHECK_CELL)]
    notebook.cells = [code_cells[0], *(nbformat.v4.new_code_cell(source) for pair in pairs for source in pair)]
    path = tmp_path_factory.mktemp("answered") / "01_answered.ipynb"
    nbformat.write(notebook, path)
    result = subprocess.run([sys.executable, "-m", "dmuon_edu", "check", str(path)],
                            capture_output=True, text=True, timeout=300)
    # A row: notebook, exercise, then its status and hint ("failed: the update is ...").
    rows = [line.split(maxsplit=2)[1:] for line in result.stdout.splitlines() if line.startswith("01_answered ")]
    assert len(rows) == 4, result.stdout + result.stderr
    return result, dict(zip(["solution", "no 1/N", "zero_grad inside", "forged"], rows))


def test_the_solution_passes_its_check(check_run):
    _, rows = check_run
    assert rows["solution"] == ["train_step_with_accumulation", "passed"], rows["solution"]


def test_a_missing_one_over_n_is_named(check_run):
    _, rows = check_run
    exercise, verdict = rows["no 1/N"]
    assert exercise == "train_step_with_accumulation" and verdict.startswith("failed: ") and "N times too large" in verdict


def test_check_command_prints_the_table_and_names_zero_grad_inside_the_loop(check_run):
    result, rows = check_run
    assert result.returncode == 1, result.stderr
    exercise, verdict = rows["zero_grad inside"]
    assert exercise == "train_step_with_accumulation" and verdict.startswith("failed: ")
    assert "zero_grad() is inside the micro-batch loop" in verdict
    assert "1 of 4 exercises passed" in result.stdout


def test_a_redefined_check_does_not_pass(check_run):
    _, rows = check_run
    exercise, verdict = rows["forged"]
    assert exercise == "is_hidden_matrix" and verdict.startswith("failed: ")
    assert "Muon orthogonalises matrices only" in verdict  # the package's checker spoke
