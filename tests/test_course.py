"""One source of truth: learner notebooks are generated from solutions, and graded."""

import re
import subprocess
import sys

import nbformat
import pytest

from dmuon_edu.course import grading, notebooks

SOLUTION_NOTEBOOKS = sorted(notebooks.SOLUTIONS.glob("*.ipynb"))


def test_strip_solutions_keeps_the_marker_indent_and_the_rest():
    source = "def f(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n\nprint(f)\n"
    stripped = notebooks.strip_solutions(source)
    assert stripped == f"def f(x):\n    raise NotImplementedError({notebooks.STUB_MESSAGE!r})\n\nprint(f)"
    assert "2 * x" not in stripped


def test_strip_solutions_handles_several_blocks():
    source = "### BEGIN SOLUTION\na = 1\n### END SOLUTION\nb = 2\n### BEGIN SOLUTION\nc = 3\n### END SOLUTION"
    assert notebooks.strip_solutions(source).count("NotImplementedError") == 2


@pytest.mark.parametrize(
    "source, message",
    [
        ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
        ("x = 1\n### END SOLUTION\n", "without a"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "inside another"),
    ],
)
def test_unbalanced_markers_are_refused(source, message):
    with pytest.raises(ValueError, match=message):
        notebooks.strip_solutions(source, where="nb, cell 3")


def test_learner_notebooks_are_up_to_date():
    stale = notebooks.build(check_only=True)
    assert not stale, f"notebooks/ is out of date ({[p.name for p in stale]}): run `make notebooks`"


@pytest.mark.parametrize("path", SOLUTION_NOTEBOOKS, ids=lambda p: p.stem)
def test_solution_notebooks_are_clean_and_every_exercise_is_checked(path):
    notebook = nbformat.read(path, as_version=4)
    assert "widgets" not in notebook.metadata, "widget state is stored: run `make solutions`"
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    for cell in code_cells:
        assert "execution" not in cell.metadata
        for output in cell.outputs:
            text = output.get("text", "") + "".join(output.get("data", {}).get("text/plain", ""))
            assert output.output_type != "error" and not re.search(
                r"Traceback|terminate called|^(\[rank \d+\] )?(FAIL|TODO) \w+:", text, flags=re.M
            ), f"a stored output of {path.name} records a failure: re-run `make solutions NB={path.name[:2]}`:\n{text[:300]}"
        assert cell.outputs or IGNORE_TAG in cell.metadata.get("tags", []) or not _prints(cell), (
            f"cell without stored output: run `make solutions`:\n{cell.source[:200]}"
        )
    exercises = [i for i, cell in enumerate(code_cells) if notebooks.BEGIN in cell.source]
    scripts = sorted(notebooks.SOLUTION_SCRIPTS.glob(f"{path.name[:2]}_*.py"))
    assert exercises or scripts, "a module has at least one exercise, in its notebook or in its scripts"
    for script in scripts:
        assert notebooks.BEGIN in script.read_text(), f"{script.name} has no exercise block"
        assert any(f'check_script("scripts/{script.name}"' in cell.source for cell in code_cells), (
            f"{path.name} never runs scripts/{script.name} with check_script"
        )
    for i in exercises:
        following = code_cells[i + 1].source if i + 1 < len(code_cells) else ""
        assert grading.CHECK_CALL.search(following), f"exercise cell {i} is not followed by a check cell"


# nbval reads NBVAL_IGNORE_OUTPUT as a source comment, or as this cell metadata tag.
IGNORE_TAG = "nbval-ignore-output"


@pytest.mark.parametrize("path", SOLUTION_NOTEBOOKS, ids=lambda p: p.stem)
def test_exactly_the_plot_and_widget_cells_ignore_their_output(path):
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        shows_picture = any("image/png" in output.get("data", {}) for output in cell.outputs)
        shows_widget = "_widget(" in cell.source
        tagged = IGNORE_TAG in cell.metadata.get("tags", [])
        assert tagged == (shows_picture or shows_widget), (
            f"{path.name}: {'untag' if tagged else 'tag'} this cell (only plot and widget cells ignore "
            f"their output):\n{cell.source[:200]}"
        )


def _prints(cell):
    return any(call in cell.source for call in ("print(", "check(", "check_script("))


# --- grading, end to end through a real kernel ----------------------------------------------

LEARNER_01 = notebooks.NOTEBOOKS / "01_loss_scaled_accumulation.ipynb"

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


def _exercise_only(tmp_path, answer):
    """The learner notebook cut to its set-up cell, exercise cell (answered) and check cell."""
    notebook = nbformat.read(LEARNER_01, as_version=4)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    exercise = next(i for i, cell in enumerate(code_cells) if "NotImplementedError" in cell.source)
    code_cells[exercise].source = answer
    notebook.cells = [code_cells[0], code_cells[exercise], code_cells[exercise + 1]]
    path = tmp_path / "01_answered.ipynb"
    nbformat.write(notebook, path)
    return path


# Modules whose exercises are torchrun scripts (05, 06) are graded through their scripts,
# which tests launch on their own; their learner notebooks stop, by design, with a
# one-line ExerciseNotDone where a cell needs an unfinished script's numbers.
NOTEBOOKS_WITH_CHECK_CELLS = [
    path for path in SOLUTION_NOTEBOOKS
    if any(grading.CHECK_CALL.search(cell.source) for cell in nbformat.read(path, as_version=4).cells)
]


@pytest.mark.parametrize("solution", NOTEBOOKS_WITH_CHECK_CELLS, ids=lambda p: p.stem)
def test_learner_notebook_runs_top_to_bottom_and_reports_not_attempted(solution):
    exercises = [
        grading.CHECK_CALL.search(cell.source).group(1)
        for cell in nbformat.read(solution, as_version=4).cells
        if cell.cell_type == "code" and grading.CHECK_CALL.search(cell.source)
    ]
    statuses = grading.grade(notebooks.NOTEBOOKS / solution.name)
    assert [(s.exercise, s.status) for s in statuses] == [(name, "not attempted") for name in exercises]


def test_a_missing_one_over_n_is_named(tmp_path):
    [status] = grading.grade(_exercise_only(tmp_path, NO_SCALING))
    assert status.status == "failed" and "N times too large" in status.hint


def test_check_command_prints_the_table_and_names_zero_grad_inside_the_loop(tmp_path):
    path = _exercise_only(tmp_path, ZERO_GRAD_INSIDE)
    result = subprocess.run([sys.executable, "-m", "dmuon_edu", "check", str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "train_step_with_accumulation" in result.stdout
    assert "zero_grad() is inside the micro-batch loop" in result.stdout
    assert "0 of 1 exercises passed" in result.stdout


def test_the_solution_passes_its_check(tmp_path):
    solution = nbformat.read(notebooks.SOLUTIONS / LEARNER_01.name, as_version=4)
    answer = next(cell.source for cell in solution.cells if notebooks.BEGIN in cell.source)
    [status] = grading.grade(_exercise_only(tmp_path, answer))
    assert status.status == "passed", status.hint
