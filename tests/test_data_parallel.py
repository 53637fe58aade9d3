"""Module 5: the launcher, and the data-parallel exercise scripts against their baseline.

Launches are the expensive part (~4 s each), so each solution script runs once
and writes its numbers to JSON; the tests below read those numbers.
"""

import json
import time
from pathlib import Path

import pytest
from helpers import processes_running
import torch

from dmuon_edu.course import grading, notebooks
from dmuon_edu.course.data_parallel import Problem
from dmuon_edu.launch import RankFailedError, torchrun

# The scripts' own verdicts use data_parallel.ADAMW_TOLERANCE (its comment says why 1e-5);
# the tests fix the same bound here, so that loosening the package's does not loosen them.
ADAMW_TOLERANCE = 1e-5

pytestmark = pytest.mark.torchrun

DIST = Path(__file__).parent / "dist"
SCRIPTS = notebooks.SOLUTION_SCRIPTS
MODULE_5 = sorted(SCRIPTS.glob("05_*.py"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each module 5 solution script on 2 ranks, and the by-hand one on 4 too."""
    out = {}
    for script, nproc in [(s, 2) for s in MODULE_5] + [(SCRIPTS / "05_allreduce_by_hand.py", 4)]:
        path = tmp_path_factory.mktemp("results") / f"{script.stem}-{nproc}.json"
        torchrun(script, nproc=nproc, args=[path], echo=False, timeout=120)
        out[script.stem, nproc] = json.loads(path.read_text())
    return out


@pytest.mark.parametrize("run", [(s.stem, 2) for s in MODULE_5] + [("05_allreduce_by_hand", 4)], ids=str)
def test_every_step_equals_the_single_process_baseline(results, run):
    result = results[run]
    assert result["status"] == "PASS"
    assert len(result["differences"]) == Problem().n_windows
    assert max(result["differences"]) < ADAMW_TOLERANCE


def test_by_hand_all_reduces_once_per_window(results):
    gradient_bytes = sum(p.numel() * p.element_size() for p in Problem().model().parameters())
    for nproc in (2, 4):
        assert results["05_allreduce_by_hand", nproc]["collectives"]["all_reduce"] == [1, gradient_bytes]


def test_ddp_all_reduces_once_per_window_with_no_sync_and_n_times_without(results):
    rows = results["05_ddp_no_sync", 2]["collectives"]
    n = Problem().accum_steps
    calls_sync, bytes_sync = rows["all_reduce, no_sync around forward+backward"]
    calls_wrong, bytes_wrong = rows["all_reduce, no_sync around backward only"]
    assert (calls_sync, calls_wrong) == (1, n)  # the model fits in one DDP bucket
    assert bytes_wrong == n * bytes_sync


def test_fsdp2_reduce_scatters_once_per_window_and_keeps_parameters_gathered(results):
    rows = results["05_fsdp2_accumulation", 2]["collectives"]
    n, layers = Problem().accum_steps, 3
    assert rows["reduce_scatter, reduce-scatter every micro-batch"][0] == n * layers
    assert rows["reduce_scatter, gradient sync on the last only"][0] == layers
    # One all-gather per layer for each forward and each backward, unless parameters stay gathered:
    # then only the first forward gathers, and the last backward (resharding again) gathers nothing new.
    assert rows["all_gather, gradient sync on the last only"][0] == 2 * n * layers
    assert rows["all_gather, ... and parameters kept gathered"][0] < 2 * n * layers
    kept = results["05_fsdp2_accumulation", 2]["measurements"]["gradient bytes kept between micro-batches"]
    assert kept["without sync"] == 2 * kept["with sync"]  # the whole gradient instead of a 1/W shard, W = 2


@pytest.mark.parametrize("script", MODULE_5, ids=lambda p: p.stem)
def test_learner_scripts_are_real_exercises(script):
    # One rank suffices to reach the stub, and starts faster than two.
    status = grading.grade_script(notebooks.NOTEBOOKS / "scripts" / script.name, nproc=1)
    assert status.status == "not attempted", status


# --- the launcher ---------------------------------------------------------------------------


def test_a_failing_rank_is_named_with_its_exception_quickly_and_nothing_is_left_behind():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as failure:
        torchrun(DIST / "raise_on_rank1.py", nproc=2, echo=False, timeout=60)
    assert time.monotonic() - start < 30  # a launch costs 3-6 s here; a hang would run to the 60 s timeout
    assert failure.value.rank == 1
    assert failure.value.exception == "ValueError: injected failure on rank 1"
    assert "rank 1 failed: ValueError: injected failure on rank 1" in str(failure.value)
    assert processes_running("raise_on_rank1.py") == []


def test_a_hanging_job_is_killed_at_its_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 6 s"):
        torchrun(DIST / "hang.py", nproc=2, echo=False, timeout=6)
    assert time.monotonic() - start < 6 + 10  # the timeout, plus the grace given to SIGTERM
    assert processes_running("hang.py") == []


def test_bad_launcher_input_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no script at"):
        torchrun(tmp_path / "missing.py")
    with pytest.raises(ValueError, match="nproc must be an int >= 1"):
        torchrun(DIST / "hang.py", nproc=0)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        torchrun(DIST / "hang.py", timeout=0)


def test_session_outside_torchrun_says_how_to_launch(monkeypatch):
    from dmuon_edu import distributed

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="not started by torchrun"):
        with distributed.session():
            pass


def test_a_rank_share_must_divide_evenly():
    with pytest.raises(ValueError, match="does not split evenly"):
        Problem(global_microbatch=6).local((torch.zeros(6), torch.zeros(6)), rank=0, world_size=4)


def test_echo_shrinks_a_traceback_to_its_last_frame_and_exception():
    from dmuon_edu.launch import _shown_lines

    lines, shown = [], []
    for line in ["hello", "Traceback (most recent call last):", '  File "a.py", line 3, in <module>', "    f()",
                 '  File "a.py", line 1, in f', "    raise ValueError('boom')", "ValueError: boom", "after"]:
        lines.append(line)
        shown += _shown_lines(lines)
    assert shown == ["hello", 'File "a.py", line 1, in f', "ValueError: boom", "after"]


def test_a_rank_that_dies_without_a_traceback_is_named_with_its_own_exit_status():
    from dmuon_edu.launch import LaunchResult, _exception_of, _failed_rank

    # torchrun's failure summary, as printed when rank 1 called os.abort() (torch 2.13)
    summary = """Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_11:23:45
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 21311)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 21311
======================================================="""
    aborted = LaunchResult(returncode=1, output={0: ["step 1"], 1: []}, launcher_log=summary.splitlines())
    assert _failed_rank(aborted) == 1
    assert _exception_of(aborted, 1).startswith("exit code -6 (SIGABRT), no Python traceback")
    exited = LaunchResult(returncode=1, launcher_log=summary.replace("-6 (pid: 21311)  (SIGABRT)", "3 (pid: 2)").splitlines())
    assert _exception_of(exited, 1).startswith("exit code 3, no Python traceback: the script called sys.exit")
    # torchrun names only the signals Python's signal module knows; a real-time one comes bare
    unnamed = LaunchResult(returncode=1, launcher_log=summary.replace("-6 (pid: 21311)  (SIGABRT)", "-40 (pid: 2) ").splitlines())
    assert _exception_of(unnamed, 1).startswith("exit code -40 (signal 40), no Python traceback")


def test_a_failure_after_the_session_still_fails_the_job():
    # After a clean session the script is an ordinary Python program again: an exception fails it.
    with pytest.raises(RankFailedError, match="ValueError: after the session"):
        torchrun(DIST / "raise_after_session.py", nproc=2, echo=False, timeout=60)

