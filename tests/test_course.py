"""One source of truth: learner notebooks are generated from solutions, and graded."""

import json
import re
import subprocess
import sys
import time

import nbformat
import pytest
from helpers import processes_running
from nbformat.v4 import new_code_cell, new_notebook

from dmuon_edu.course import cli, grading, notebooks, reading_time

SOLUTION_NOTEBOOKS = sorted(notebooks.SOLUTIONS.glob("*.ipynb"))


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """A fresh build of the learner files: tests never read notebooks/, where a learner works."""
    folder = tmp_path_factory.mktemp("learner")
    notebooks.build(into=folder)
    return folder


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


def _git(*args):
    return subprocess.run(["git", "-C", str(notebooks.ROOT), *args], capture_output=True, timeout=60)


def test_committed_learner_files_are_what_build_writes(learner):
    # The committed files, not the working copy: a learner's edits in notebooks/ must not fail the suite.
    if _git("rev-parse", "HEAD").returncode != 0:
        pytest.skip("not a git checkout with a commit: the committed learner files cannot be read")
    built = sorted(str(p.relative_to(learner)) for p in learner.rglob("*") if p.is_file())
    listed = _git("ls-tree", "-r", "--name-only", "HEAD", "notebooks/").stdout.decode().splitlines()
    committed = sorted(line.removeprefix("notebooks/") for line in listed)
    stale = [name for name in built if _git("show", f"HEAD:notebooks/{name}").stdout != (learner / name).read_bytes()]
    assert (built, stale) == (committed, []), (
        f"notebooks/ as committed is not what `make notebooks` builds from solutions/ (differs: {stale}; "
        f"built only: {sorted(set(built) - set(committed))}; committed only: {sorted(set(committed) - set(built))}): "
        "run `make notebooks` and commit notebooks/, .manifest.json included")


def _learner_copy(tmp_path):
    folder = tmp_path / "notebooks"
    notebooks.build(into=folder)
    return folder, folder / "01_loss_scaled_accumulation.ipynb"


def _as_if_built_from_other_solutions(folder, name):
    """Record another hash for ``name``: to build, its solution changed since the last build."""
    manifest = json.loads((folder / notebooks.MANIFEST).read_text())
    manifest[name] = "0" * 64
    (folder / notebooks.MANIFEST).write_text(json.dumps(manifest))


def test_build_refuses_to_replace_a_changed_file_and_writes_nothing(tmp_path):
    folder, path = _learner_copy(tmp_path)
    path.write_text(path.read_text().replace("NotImplementedError", "print('my work')", 1))
    (folder / "02a_zero_grad_pitfalls.ipynb").unlink()
    _as_if_built_from_other_solutions(folder, path.name)
    manifest = (folder / notebooks.MANIFEST).read_text()
    with pytest.raises(notebooks.WorkWouldBeLost, match=rf"(?s){path.name}.*Nothing was written.*restore NAME.*FORCE=1"):
        notebooks.build(into=folder)
    assert "my work" in path.read_text()
    assert not (folder / "02a_zero_grad_pitfalls.ipynb").exists() and (folder / notebooks.MANIFEST).read_text() == manifest
    assert not list(folder.glob("*.bak-*"))


def test_build_with_force_keeps_a_backup_of_the_changed_file(tmp_path):
    folder, path = _learner_copy(tmp_path)
    fresh = path.read_text()
    path.write_text(fresh.replace("NotImplementedError", "print('my work')", 1))
    _as_if_built_from_other_solutions(folder, path.name)
    written, backups = notebooks.build(into=folder, force=True)
    [backup] = folder.glob(f"{path.name}.bak-*")
    assert written == [path] and backups == {path: backup}
    assert path.read_text() == fresh and "my work" in backup.read_text()


def test_build_keeps_a_changed_file_when_solutions_give_nothing_new_and_updates_the_rest(tmp_path):
    folder, path = _learner_copy(tmp_path)
    path.write_text(path.read_text().replace("NotImplementedError", "print('my work')", 1))
    script = folder / "scripts" / "05_ddp_no_sync.py"
    fresh_script = script.read_text()
    script.write_text("# as an older build wrote it\n")  # untouched since that build: rewritten freely
    manifest = json.loads((folder / notebooks.MANIFEST).read_text())
    manifest["scripts/05_ddp_no_sync.py"] = notebooks._sha256(script.read_bytes())
    (folder / notebooks.MANIFEST).write_text(json.dumps(manifest))
    assert notebooks.build(into=folder) == ([script], {})
    assert "my work" in path.read_text() and script.read_text() == fresh_script


def test_a_file_there_before_any_build_counts_as_the_learners(tmp_path):
    folder, path = _learner_copy(tmp_path)
    path.write_text("my own notebook")
    (folder / notebooks.MANIFEST).unlink()
    with pytest.raises(notebooks.WorkWouldBeLost, match=path.name):
        notebooks.build(into=folder)


def test_restore_starts_one_exercise_over_and_keeps_a_backup(tmp_path):
    folder, path = _learner_copy(tmp_path)
    fresh = path.read_text()
    path.write_text(fresh.replace("NotImplementedError", "print('my work')", 1))
    [(restored, backup)] = notebooks.restore("01", into=folder).items()
    assert restored == path and path.read_text() == fresh and "my work" in backup.read_text()
    assert notebooks.plan(folder).write == notebooks.plan(folder).edited == []
    with pytest.raises(ValueError, match="no learner file starts with '99'; they are: 01_loss"):
        notebooks.restore("99", into=folder)


def test_a_broken_manifest_is_named_with_the_way_out(tmp_path):
    folder, _ = _learner_copy(tmp_path)
    (folder / notebooks.MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match=r"\.manifest\.json is not valid JSON .*git checkout -- "):
        notebooks.build(into=folder)


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
    scripts = _checked_scripts(path)
    assert exercises or scripts, "a notebook has at least one exercise, in its cells or in the scripts it checks"
    for script in scripts:
        assert script.name[:2] == path.name[:2], f"{path.name} checks {script.name}, another module's script"
        assert notebooks.BEGIN in script.read_text(), f"{script.name} has no exercise block"
    for i in exercises:
        following = code_cells[i + 1].source if i + 1 < len(code_cells) else ""
        check = grading.CHECK_CALL.search(following)
        assert check, f"exercise cell {i} is not followed by a check cell"
        # The grader checks the function named as the exercise, whatever the check cell passes.
        name = check.group(1)
        assert re.fullmatch(rf'check\("{name}", {name}\)', following.strip()), following


def _checked_scripts(path):
    """The exercise scripts a notebook runs with check_script (each must exist)."""
    cells = nbformat.read(path, as_version=4).cells
    names = re.findall(r'check_script\("scripts/(\w+\.py)"', "".join(c.source for c in cells if c.cell_type == "code"))
    return [notebooks.SOLUTION_SCRIPTS / name for name in names]


def test_every_exercise_script_is_checked_by_exactly_one_notebook_of_its_module():
    checked = sorted({(script.name, path.name) for path in SOLUTION_NOTEBOOKS for script in _checked_scripts(path)})
    names = [name for name, _ in checked]
    missing = [script.name for script in sorted(notebooks.SOLUTION_SCRIPTS.glob("*.py")) if script.name not in names]
    assert not missing, f"no notebook runs these scripts with check_script: {missing}"
    assert all((notebooks.SOLUTION_SCRIPTS / name).exists() for name in names), checked
    assert len(names) == len(set(names)), f"a script is checked by two notebooks: {checked}"


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
# (Answers to module 1's exercise, graded by the check command: tests/test_grading.py.)

# Modules whose exercises are torchrun scripts (05, 06) are graded through their scripts,
# which tests launch on their own; their learner notebooks stop, by design, with a
# one-line ExerciseNotDone where a cell needs an unfinished script's numbers.
NOTEBOOKS_WITH_CHECK_CELLS = [
    path for path in SOLUTION_NOTEBOOKS
    if any(grading.CHECK_CALL.search(cell.source) for cell in nbformat.read(path, as_version=4).cells)
]


@pytest.mark.parametrize("solution", NOTEBOOKS_WITH_CHECK_CELLS, ids=lambda p: p.stem)
def test_learner_notebook_runs_top_to_bottom_and_reports_not_attempted(solution, learner):
    exercises = [
        grading.CHECK_CALL.search(cell.source).group(1)
        for cell in nbformat.read(solution, as_version=4).cells
        if cell.cell_type == "code" and grading.CHECK_CALL.search(cell.source)
    ]
    statuses = grading.grade(learner / solution.name)
    assert [(s.exercise, s.status) for s in statuses] == [(name, "not attempted") for name in exercises]


# --- a grader that cannot be fooled by accident, or stalled -----------------------------------

CHECK_CELL = 'check("is_hidden_matrix", is_hidden_matrix)'


def _notebook(path, *sources):
    nbformat.write(new_notebook(cells=[new_code_cell(source) for source in sources]), path)
    return path


# One grading run over a folder of broken notebooks (a short cell timeout), read by the tests below.
# Child processes, one started by a stalled cell, one by a cell that then kills its kernel: neither may
# outlive the grading. The stalled cell first deletes a folder by a relative path and one under ~: the
# grader runs in a folder and with a HOME that each hold a folder of that name, which must survive.
SLEEPERS = {"loop": "293.71", "dies": "293.72"}
REACH_OUT = ("import shutil\nshutil.rmtree('victim', ignore_errors=True)\n"
             "shutil.rmtree(os.path.expanduser('~/victim'), ignore_errors=True)\n")


@pytest.fixture(scope="module")
def outside_folders(tmp_path_factory):
    """The folder the grader runs in and its HOME, each holding a folder named victim."""
    folders = tmp_path_factory.mktemp("grader_cwd"), tmp_path_factory.mktemp("home")
    for folder in folders:
        (folder / "victim").mkdir()
    return folders


@pytest.fixture(scope="module")
def broken_folder_run(tmp_path_factory, outside_folders):
    folder = tmp_path_factory.mktemp("broken")
    (folder / "00_not_json.ipynb").write_text("{ this is not JSON")
    start_sleeper = "import os, subprocess\nsubprocess.Popen(['sleep', '{}'], start_new_session=True)\n"
    _notebook(folder / "01_kills_its_kernel.ipynb", start_sleeper.format(SLEEPERS["dies"]) + "os._exit(3)", CHECK_CELL)
    _notebook(folder / "02_endless_loop.ipynb",
              start_sleeper.format(SLEEPERS["loop"]) + REACH_OUT + "while True:\n    pass", CHECK_CELL)
    where, home = map(str, outside_folders)
    program = ("import os, sys; from pathlib import Path; from dmuon_edu.course import cli; "
               f"os.chdir({where!r}); os.environ['HOME'] = {home!r}; "
               f"cli.NOTEBOOKS = Path({str(folder)!r}); sys.exit(cli.main(['check', '--cell-timeout', '2']))")
    start = time.monotonic()
    # The subprocess's own timeout: a grader that stalls fails this test instead of hanging the suite.
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    return result, time.monotonic() - start


def _row(result, notebook):
    return [line for line in result.stdout.splitlines() if line.startswith(notebook)]


@pytest.mark.serial  # shares the grading run whose time a hang guard asserts
def test_a_notebook_that_is_not_json_is_a_row_and_the_others_are_graded(broken_folder_run):
    result, _ = broken_folder_run
    [row] = _row(result, "00_not_json")
    assert "(notebook)" in row and "failed: not a notebook that can be read" in row and "restore" in row
    assert _row(result, "01_kills_its_kernel") and _row(result, "02_endless_loop"), result.stdout + result.stderr
    assert result.returncode == 1 and "0 of 2 exercises passed" in result.stdout


@pytest.mark.serial  # shares the grading run whose time a hang guard asserts
def test_a_dead_kernel_is_a_row(broken_folder_run):
    result, _ = broken_folder_run
    notebook_row, exercise_row = _row(result, "01_kills_its_kernel")
    assert "cell 1 (`import os, subprocess`) killed the kernel" in notebook_row
    assert "is_hidden_matrix" in exercise_row and "not graded" in exercise_row
    assert processes_running(f"sleep {SLEEPERS['dies']}") == []  # orphaned when its kernel died, found anyway


@pytest.mark.serial  # shares the grading run whose time a hang guard asserts
def test_an_endless_loop_ends_at_the_cell_timeout_as_a_row_and_leaves_nothing_behind(broken_folder_run):
    result, seconds = broken_folder_run
    notebook_row, exercise_row = _row(result, "02_endless_loop")
    assert "cell 1 (`import os, subprocess`) did not finish within 2 s" in notebook_row and "not graded" in exercise_row
    # A hang guard: three kernel starts and imports take 10-45 s (idle to loaded); a grader that ignored the
    # 2 s cell timeout would run the loop for the default 120 s.
    assert seconds < 100, f"a 2 s cell timeout took {seconds:.0f} s"
    assert processes_running(f"sleep {SLEEPERS['loop']}") == []


@pytest.mark.serial  # shares the grading run whose time a hang guard asserts
def test_a_cell_cannot_reach_the_graders_folder_or_home_by_a_relative_path_or_tilde(broken_folder_run,
                                                                                      outside_folders):
    result, _ = broken_folder_run
    assert _row(result, "02_endless_loop"), result.stdout + result.stderr  # the cell ran
    assert all((folder / "victim").is_dir() for folder in outside_folders), outside_folders


def test_no_exercise_is_reported_and_exits_1(tmp_path, capsys):
    nothing = _notebook(tmp_path / "01_notes.ipynb", "print('no check here')")
    assert cli.main(["check", str(nothing)]) == 1
    out = capsys.readouterr().out
    assert "01_notes  (notebook)  no exercise" in out and "0 of 0 exercises passed" in out


def test_an_unknown_module_is_refused_naming_the_modules_there(tmp_path, monkeypatch):
    for name in ("01_loss.ipynb", "02_zero_grad.ipynb"):
        _notebook(tmp_path / name, "print('no check here')")
    monkeypatch.setattr(cli, "NOTEBOOKS", tmp_path)
    with pytest.raises(SystemExit, match=r"starts with 'nope': name a module by its number \(01, 02\), e.g. "
                                         r"`python -m dmuon_edu check 01`, or no name to grade them all"):
        cli.main(["check", "nope"])


def test_execute_of_an_unknown_module_is_refused_and_executes_nothing(tmp_path, monkeypatch):
    # It used to exit 0 having done nothing.
    _notebook(tmp_path / "01_loss.ipynb", "print('no check here')")
    monkeypatch.setattr(cli, "SOLUTIONS", tmp_path)
    monkeypatch.setattr(cli, "execute", lambda path: pytest.fail(f"executed {path}"))
    with pytest.raises(SystemExit, match=r"starts with '99': name a module by its number \(01\), e.g. "
                                         r"`python -m dmuon_edu.course execute 01`"):
        cli.main(["execute", "99"])


@pytest.mark.parametrize("timeout", ["0", "inf"])
def test_the_cell_timeout_must_be_positive_and_finite(capsys, timeout):
    with pytest.raises(SystemExit):
        cli.main(["check", "--cell-timeout", timeout])
    assert f"a cell timeout is a positive, finite number of seconds, got {timeout}" in capsys.readouterr().err


# What `make check NB=..` grades, per selector: notebooks by name, and the scripts each notebook runs,
# read from the notebook (06a's scripts are named 06_*, not 06a_*). Nothing is executed.
_M04 = ["04a_newton_schulz", "04b_muon_optimizer"]
_SCRIPTS_05A = ["05_allreduce_by_hand", "05_ddp_no_sync", "05_fsdp2_accumulation"]
_SCRIPTS_05B = ["05_bucketed_ddp"]
_SCRIPTS_06A, _SCRIPTS_06B = ["06_owners_only", "06_reduce_broadcast"], ["06_no_sync_merge", "06_z2_z3_training"]
_SCRIPTS_06C = ["06_save_and_resume", "06_uneven_windows"]
_SCRIPTS_06D = ["06_time_collectives"]
SELECTIONS = {
    "01": (["01_loss_scaled_accumulation"], []),
    "02": (["02a_zero_grad_pitfalls", "02b_unscaled_loss_learning_rate"], []),
    "02a": (["02a_zero_grad_pitfalls"], []),
    "02b": (["02b_unscaled_loss_learning_rate"], []),
    "03": (["03_accumulation_in_real_training"], []),
    "04": (_M04, []),
    "04a": (_M04[:1], []),
    "04b": (_M04[1:], []),
    "05": (["05a_data_parallel_accumulation", "05b_bucketed_ddp", "05c_token_weighted_ddp", "05d_zero1_adamw"],
           sorted(_SCRIPTS_05A + _SCRIPTS_05B + ["05_token_weighted_ddp", "05_zero1_adamw"])),
    "05a": (["05a_data_parallel_accumulation"], _SCRIPTS_05A),
    "05b": (["05b_bucketed_ddp"], _SCRIPTS_05B),
    "05c": (["05c_token_weighted_ddp"], ["05_token_weighted_ddp"]),
    "05d": (["05d_zero1_adamw"], ["05_zero1_adamw"]),
    "06": (["06a_dmuon_owner_ranks", "06b_dmuon_no_sync_z2_z3", "06c_dmuon_uneven_data_and_checkpoints",
            "06d_timing_communication"], sorted(_SCRIPTS_06A + _SCRIPTS_06B + _SCRIPTS_06C + _SCRIPTS_06D)),
    "06a": (["06a_dmuon_owner_ranks"], _SCRIPTS_06A),
    "06b": (["06b_dmuon_no_sync_z2_z3"], _SCRIPTS_06B),
    "06c": (["06c_dmuon_uneven_data_and_checkpoints"], _SCRIPTS_06C),
    "06d": (["06d_timing_communication"], _SCRIPTS_06D),
    "07": (["07a_capstone_problem", "07b_capstone_dmuon"], ["07_train_capstone"]),
    "07a": (["07a_capstone_problem"], []),
    "07b": (["07b_capstone_dmuon"], ["07_train_capstone"]),
    "notebooks/06a_dmuon_owner_ranks.ipynb": (["06a_dmuon_owner_ranks"], _SCRIPTS_06A),
    "06_owners": ([], ["06_owners_only"]),
}


@pytest.mark.parametrize("selector", SELECTIONS)
def test_check_selects_each_modules_notebooks_and_the_scripts_they_run(selector, monkeypatch):
    monkeypatch.chdir(notebooks.ROOT)  # a notebook path is relative to the repository
    picked, scripts = cli.selection(selector)
    assert ([p.stem for p in picked], [s.stem for s in scripts]) == SELECTIONS[selector]


def test_check_without_a_selector_grades_every_notebook_and_every_script():
    picked, scripts = cli.selection(None)
    assert [p.name for p in picked] == sorted(p.name for p in notebooks.NOTEBOOKS.glob("*.ipynb"))
    assert [s.name for s in scripts] == sorted(s.name for s in (notebooks.NOTEBOOKS / "scripts").glob("*.py"))


@pytest.mark.parametrize("solution", SOLUTION_NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_takes_an_hour_or_so_by_the_estimate_and_says_so(solution):
    estimate = reading_time.estimate(solution)
    assert estimate.minutes <= reading_time.MINUTES_CAP, (solution.stem, estimate)
    assert estimate.words <= reading_time.WORDS_CAP, (solution.stem, estimate)
    assert reading_time.stated_minutes(solution) == estimate.rounded, (solution.stem, estimate)


def test_the_readme_states_each_notebooks_minutes_and_their_total():
    readme = (notebooks.ROOT / "README.md").read_text()
    stated = {name: int(minutes) for name, minutes in re.findall(r"^\| \w+ \| `(\w+)` \| (\d+) \|", readme, re.M)}
    estimates = {path.stem: reading_time.estimate(path).rounded for path in SOLUTION_NOTEBOOKS}
    assert stated == estimates
    total = sum(estimates.values())
    assert f"about {round(total / 60)} hours in all ({total} minutes by the table below)" in readme, total


def test_the_estimate_counts_what_a_learner_reads_and_does(tmp_path):
    # 400 words with the first line's and the formula (2 min), 16 code lines (2 min), one exercise (10), one
    # prediction (2), a script of 30 lines (2) with one more exercise (10): 28 minutes; 400 words plus the script's
    script = "### BEGIN SOLUTION\n" + "x = 1\n" * 28 + "### END SOLUTION\n"
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "s.py").write_text(script)
    cells = [nbformat.v4.new_markdown_cell("**About 30 minutes**: " + "word " * 395 + "**Predict** $a + b$"),
             new_code_cell("### BEGIN SOLUTION\n" + "y = 2\n" * 13 + "### END SOLUTION"),
             new_code_cell('check_script("scripts/s.py")')]
    nbformat.write(new_notebook(cells=cells), tmp_path / "n.ipynb")
    estimate = reading_time.estimate(tmp_path / "n.ipynb")
    assert (estimate.minutes, estimate.exercises, estimate.rounded) == (28, 2, 30)
    assert estimate.words == 400 + len(script.split())
    assert reading_time.stated_minutes(tmp_path / "n.ipynb") == 30
