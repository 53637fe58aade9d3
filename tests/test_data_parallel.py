"""Module 5: the launcher, and the data-parallel exercise scripts against their baseline.

Launches are the expensive part (~4 s each), so each solution script runs once
and writes its numbers to JSON; the tests below read those numbers.
"""

import json
import math
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import processes_running
import torch

from dmuon_edu import launch
from dmuon_edu.course import cost_model, data_parallel, notebooks
from dmuon_edu.course.checks import recorded_script_results
from dmuon_edu.course.data_parallel import Problem
from dmuon_edu.launch import RankFailedError, torchrun

# The scripts' own verdicts use data_parallel.ADAMW_TOLERANCE (its comment says why 1e-5);
# the tests fix the same bound here, so that loosening the package's does not loosen them.
ADAMW_TOLERANCE = 1e-5

pytestmark = pytest.mark.torchrun

DIST = Path(__file__).parent / "dist"
SCRIPTS = notebooks.SOLUTION_SCRIPTS
MODULE_5 = sorted(SCRIPTS.glob("05_*.py"))
BY_HAND = SCRIPTS / "05_allreduce_by_hand.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every module 5 solution script on 2 ranks, and the by-hand one on 4 ranks too: each script's report.

    Notebooks 05a-05c run exactly these (check_script, same nproc, same Problem). When
    DMUON_EDU_SCRIPT_RESULTS (checks.SCRIPT_RESULTS_ENV) names the folder their nbval run of this
    `make test` recorded into, a report is read from there (checks.recorded_script_results: only the
    unchanged solution script's own run). The rest run here: the 2-rank ones in one launch
    (tests/dist/run_scripts.py), the 4-rank one in another; with the variable unset, all of them.
    """
    recorded = {(script.stem, nproc): report for script, nproc in [*((s, 2) for s in MODULE_5), (BY_HAND, 4)]
                if (report := recorded_script_results(script, nproc)) is not None}
    out = dict(recorded)
    folder = tmp_path_factory.mktemp("results")
    if missing := [script for script in MODULE_5 if (script.stem, 2) not in out]:
        torchrun(DIST / "run_scripts.py", nproc=2, args=[folder, *missing], echo=False, timeout=300)
        out |= {(script.stem, 2): json.loads((folder / f"{script.stem}.json").read_text()) for script in missing}
    if (BY_HAND.stem, 4) not in out:
        path = folder / f"{BY_HAND.stem}-4.json"
        torchrun(BY_HAND, nproc=4, args=[path], echo=False, timeout=120)
        out[BY_HAND.stem, 4] = json.loads(path.read_text())
    print(f"module 5: {len(recorded)} of {len(out)} reports read from the notebooks' runs")  # shown with -s
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


def test_ddp_all_reduces_once_per_window_when_the_forwards_are_inside_no_sync_and_n_times_when_only_backwards(results):
    result = results["05_ddp_no_sync", 2]
    calls = {label.removeprefix("all_reduce, "): calls for label, (calls, _) in result["collectives"].items()}
    n = Problem().accum_steps
    # DDP decides in the forward whether the coming backward syncs; the model fits in one DDP bucket.
    assert calls == {"backward_inside": n, "forward_and_backward_inside": 1, "forward_inside": 1,
                     "every_micro_batch_inside": 0}
    assert result["collectives"]["all_reduce, backward_inside"][1] == n * result["collectives"][
        "all_reduce, forward_and_backward_inside"][1]
    # Only the placement that never all-reduces leaves the ranks apart from one process.
    assert result["measurements"]["equal to the single process"] == {
        "backward_inside": True, "forward_and_backward_inside": True, "forward_inside": True,
        "every_micro_batch_inside": False}


def test_fsdp2_reduce_scatters_once_per_window_and_keeps_parameters_gathered_as_the_budget_allows(results):
    rows = results["05_fsdp2_accumulation", 2]["collectives"]
    n, layers = Problem().accum_steps, 3
    # 0.75 P: only the gradient shard fits, so every micro-batch reduce-scatters; 1.25 P: the whole gradient fits;
    # 2.5 P: the gathered parameters too.
    assert [rows[f"reduce_scatter, budget {b} P"][0] for b in ("0.75", "1.25", "2.5")] == [n * layers, layers, layers]
    # One all-gather per layer for each forward and each backward, unless parameters stay gathered after
    # backward: then only the first forward and every backward gather.
    assert [rows[f"all_gather, budget {b} P"][0] for b in ("0.75", "1.25", "2.5")] == [
        2 * n * layers, 2 * n * layers, (n + 1) * layers]
    measured = results["05_fsdp2_accumulation", 2]["measurements"]
    assert measured["shard bytes"] * 2 == measured["parameter bytes"]  # a 1/W shard, W = 2


GRADIENT_BYTES = 284688  # the Problem's MLP: (16*256 + 256 + 256*256 + 256 + 256*4 + 4) float32 parameters


def test_the_problem_has_the_gradient_bytes_the_hand_counts_below_assume():
    assert sum(p.numel() * p.element_size() for p in Problem().model().parameters()) == GRADIENT_BYTES


def test_bucketed_ddp_all_reduces_as_its_bucketing_rule_predicts(results):
    result = results["05_bucketed_ddp", 2]
    assert result["measurements"]["bucket bytes"] == 131072
    # 284688 bytes cut into buckets of exactly 131072: two full buckets and one of the remaining 22544 bytes.
    assert result["collectives"]["all_reduce"] == [3, GRADIENT_BYTES]
    assert data_parallel.buckets_per_sync(GRADIENT_BYTES, 131072) == 3
    assert data_parallel.buckets_per_sync(131072, 131072) == 1 and data_parallel.buckets_per_sync(131073, 131072) == 2


def test_bucketed_ddp_sends_buckets_during_the_backward_and_waits_for_all_before_step(results):
    events = results["05_bucketed_ddp", 2]["measurements"]["last backward"]
    kinds = [kind if kind != "mark" else detail for _, kind, detail in events]
    done, step = kinds.index("backward done"), kinds.index("step")
    # Backward order, last layer first: the second layer's 256x256 weight completes the first two buckets
    # while the first layer's gradients are still to come; the remainder goes once the backward is done.
    assert kinds[:done].count("all_reduce") == 2 and "gradient" in kinds[kinds.index("all_reduce"):done]
    assert kinds[done:step].count("all_reduce") == 1
    assert kinds[done:step].count("wait") == 3 and "wait" not in kinds[:done]


@pytest.mark.parametrize("events, problem", [
    (["backward", "gradient", "all_reduce", "gradient", "backward done", "wait", "step"], None),
    (["backward", "gradient", "all_reduce", "wait", "gradient", "backward done", "step"], "waited before the backward"),
    (["backward", "gradient", "gradient", "backward done", "all_reduce", "wait", "step"], "no all_reduce was issued"),
    (["backward", "gradient", "all_reduce", "gradient", "backward done", "step"], "only 0 of the 1 all_reduces"),
], ids=["overlapped", "waited_right_away", "sent_after_backward", "never_waited"])
def test_overlap_is_read_from_the_order_of_events(events, problem):
    timed = [(float(t), "mark" if kind in ("backward", "backward done", "step") else kind,
              kind if kind in ("backward", "backward done", "step") else "") for t, kind in enumerate(events)]
    problems = data_parallel.overlap_problems(timed)
    assert (problems == []) if problem is None else (len(problems) == 1 and problem in problems[0]), problems


def test_zero1_keeps_2p_over_n_of_optimizer_state_per_rank_as_the_cost_model_predicts(results):
    measured = results["05_zero1_adamw", 2]["measurements"]
    # Two fp32 moments of a 1/2 shard: 2 * 284688 / 2 bytes, and AdamW's fp32 step counter (4 bytes).
    assert measured["optimizer state bytes per rank"] == [GRADIENT_BYTES + 4] * 2
    assert measured["shard bytes per rank"] == [GRADIENT_BYTES // 2] * 2
    predicted = cost_model.cost("ZeRO-1", P=GRADIENT_BYTES, W=2, N=Problem().accum_steps, L=3)
    assert predicted.optimizer_state == GRADIENT_BYTES
    # The cost model's ZeRO-1 reduces to owners and broadcasts; this one reduce-scatters and all-gathers:
    # the same counted bytes per optimizer step, and the same (N-1)/N of them on the wire.
    rows = results["05_zero1_adamw", 2]["collectives"]
    assert rows == {"reduce_scatter": [1, GRADIENT_BYTES], "all_gather": [1, GRADIENT_BYTES]}
    assert sum(predicted.counted.values()) == 2 * GRADIENT_BYTES
    assert predicted.wire == sum(nbytes * cost_model.wire_factor(op, 2) for op, (_, nbytes) in rows.items())


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "sync_every_micro_batch"])
def test_the_cost_model_predicts_what_ddp_counted(results, no_sync):
    problem = Problem()
    P = sum(p.numel() * p.element_size() for p in problem.model().parameters())
    row = "all_reduce, forward_and_backward_inside" if no_sync else "all_reduce, backward_inside"
    predicted = cost_model.cost("DDP", P=P, W=2, N=problem.accum_steps, L=3, no_sync=no_sync)
    assert predicted.counted["all_reduce"] == results["05_ddp_no_sync", 2]["collectives"][row][1]


@pytest.mark.parametrize("budget, no_sync", [("0.75", False), ("1.25", True)])
def test_the_cost_model_predicts_what_fsdp2_counted_and_kept(results, budget, no_sync):
    problem = Problem()
    P = sum(p.numel() * p.element_size() for p in problem.model().parameters())
    result = results["05_fsdp2_accumulation", 2]
    predicted = cost_model.cost("FSDP2", P=P, W=2, N=problem.accum_steps, L=3, no_sync=no_sync)
    for op in ("all_gather", "reduce_scatter"):
        assert predicted.counted[op] == result["collectives"][f"{op}, budget {budget} P"][1], (op, predicted)
    # Without sync a rank keeps the whole gradient; with it, its shard (the model adds the layer in flight,
    # P / L under its equal-layer assumption).
    if no_sync:
        assert predicted.gradients == P
    else:
        assert predicted.gradients - P / 3 == result["measurements"]["shard bytes"]


# --- the launcher ---------------------------------------------------------------------------


def test_a_failing_rank_is_named_with_its_exception_quickly_and_nothing_is_left_behind():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as failure:
        torchrun(DIST / "raise_on_rank1.py", nproc=2, echo=False, timeout=300)
    # A hang guard, well inside the 300 s that rank 0's collective would wait: a launch takes 3-6 s on an
    # idle 2-core machine, 32 s measured under a load average of 10.
    assert time.monotonic() - start < 120
    assert failure.value.rank == 1
    assert failure.value.exception == "ValueError: injected failure on rank 1"
    assert "rank 1 failed: ValueError: injected failure on rank 1" in str(failure.value)
    assert processes_running("raise_on_rank1.py") == []


def test_a_hanging_job_is_killed_at_its_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 6 s"):
        torchrun(DIST / "hang.py", nproc=2, echo=False, timeout=6)
    # A hang guard: the 6 s timeout, SIGTERM's 5 s grace, and room for a loaded machine; a launcher that
    # waited for its ranks would wait for their hour-long sleep.
    assert time.monotonic() - start < 60
    assert processes_running("hang.py") == []


@pytest.mark.parametrize("arguments,error,fragment", [
    ({"script": "missing.py"}, FileNotFoundError, "no script at"),
    ({"nproc": 0}, ValueError, "nproc must be an int >= 1"),
    ({"nproc": 1.5}, ValueError, "nproc must be an int >= 1"),
    ({"nproc": True}, ValueError, "nproc must be an int >= 1"),
    ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds, finite"),
    ({"timeout": math.inf}, ValueError, "timeout must be a positive number of seconds, finite"),
    ({"timeout": math.nan}, ValueError, "timeout must be a positive number of seconds, finite"),
    ({"timeout": "10"}, ValueError, "timeout must be a positive number of seconds, finite"),
    ({"args": "--steps 3"}, TypeError, "not one string"),
    ({"args": {"--steps": 3}}, TypeError, "args must be a list of arguments"),
    ({"args": ["--steps", None]}, TypeError, "args[1] is None: pass every argument as a string, a path or a number"),
    ({"args": ["--fast", True]}, TypeError, "args[1] is True"),
    ({"env": {"OMP_NUM_THREADS": 1}}, TypeError, "env must be a dict of strings to strings"),
    ({"echo": "no"}, TypeError, "echo must be True or False"),
], ids=lambda value: ",".join(f"{k}={v!r}" for k, v in value.items()) if isinstance(value, dict) else None)
def test_bad_launcher_input_is_refused_before_anything_starts(monkeypatch, tmp_path, arguments, error, fragment):
    def started(*args, **kwargs):
        raise AssertionError("torchrun started a process before checking its arguments")

    monkeypatch.setattr(launch.subprocess, "Popen", started)
    arguments = {"script": DIST / "hang.py", **arguments}
    arguments["script"] = tmp_path / arguments["script"]  # an absolute path stays as it is
    with pytest.raises(error, match=re.escape(fragment)):
        torchrun(**arguments)


def _alive(pid):
    """Whether ``pid`` is a running process (an exited one that is not yet reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _when_both_ranks_run(pids, act):
    """From a thread, call ``act(torchrun's pid)`` once both ranks of sleep_and_record_pid.py wrote their pids."""
    acted = []

    def wait_then_act():
        deadline = time.monotonic() + 60  # shorter than the launch's timeout: never act on a later launch
        while len(list(pids.glob("rank-*"))) < 2:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        acted.append(time.monotonic())
        act(int((pids / "rank-0").read_text().split()[1]))

    threading.Thread(target=wait_then_act, daemon=True).start()
    return acted


def _ranks_and_torchrun(pids):
    processes = [tuple(map(int, path.read_text().split())) for path in sorted(pids.glob("rank-*"))]
    return [pid for pid, _ in processes] + [processes[0][1]]


def test_killing_torchrun_itself_leaves_no_rank_behind(tmp_path):
    acted = _when_both_ranks_run(tmp_path, lambda torchrun_pid: os.kill(torchrun_pid, signal.SIGKILL))
    with pytest.raises(RuntimeError, match=r"torchrun itself was killed \(SIGKILL\).*every process of the job"):
        torchrun(DIST / "sleep_and_record_pid.py", nproc=2, args=[tmp_path], echo=False, timeout=120)
    # A hang guard: the ranks' 5 s SIGTERM grace and room for a loaded machine, well inside the 120 s
    # after which the launcher would have stopped the job on its own.
    assert acted and time.monotonic() - acted[0] < 40
    processes = _ranks_and_torchrun(tmp_path)
    assert len(processes) == 3 and not any(map(_alive, processes)), processes


def test_ctrl_c_stops_every_process_of_the_job(tmp_path):
    # A real SIGINT to the main thread, where it interrupts the launcher's wait as Ctrl-C in a notebook does.
    # Python's own handler, as a terminal or a kernel has it: a suite started in the background by a
    # non-interactive shell inherits SIGINT ignored, and then no KeyboardInterrupt could come.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    acted = _when_both_ranks_run(tmp_path, lambda _: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt):
            torchrun(DIST / "sleep_and_record_pid.py", nproc=2, args=[tmp_path], echo=False, timeout=120)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert acted and time.monotonic() - acted[0] < 40  # a hang guard, as in the test above
    processes = _ranks_and_torchrun(tmp_path)
    assert len(processes) == 3 and not any(map(_alive, processes)), processes


@pytest.mark.parametrize("source,exception", [
    ("def f(:\n    pass\n", "SyntaxError: "),
    ("import a_module_that_does_not_exist\n", "ModuleNotFoundError: No module named 'a_module_that_does_not_exist'"),
], ids=["syntax_error", "import_error"])
def test_a_script_that_does_not_compile_or_import_is_named_with_its_error(tmp_path, source, exception):
    script = tmp_path / "broken.py"
    script.write_text(source)
    with pytest.raises(RankFailedError) as failure:
        torchrun(script, nproc=2, echo=False, timeout=60)
    assert failure.value.rank in (0, 1) and failure.value.exception.startswith(exception), failure.value.exception
    if exception == "SyntaxError: ":
        assert failure.value.exception.endswith(f"({script}, line 1)"), failure.value.exception
    assert str(failure.value).startswith(f"rank {failure.value.rank} failed: {exception}")


def test_a_collective_mismatch_that_gloo_aborts_is_named_as_such():
    with pytest.raises(RankFailedError) as failure:
        torchrun(DIST / "gloo_mismatch.py", nproc=2, echo=False, timeout=60)
    message = str(failure.value)
    assert failure.value.rank == 0, message  # rank 0's buffer is the smaller one: gloo aborts it
    assert message.startswith("rank 0 failed: gloo aborted it (SIGABRT, gloo::EnforceNotMet: op.preamble.length "
                              "<= op.nbytes. 8 vs 4. Received data size doesn't match expected size."), message
    assert "called different collectives" in message and "TORCH_DISTRIBUTED_DEBUG" in message, message
    assert "memory" not in message and "\n" not in message, message
    assert processes_running("gloo_mismatch.py") == []


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
    assert _exception_of(aborted, 1) == ("exit code -6 (SIGABRT), no Python traceback: it aborted in native code "
                                         "(its output may say where)")
    # gloo's IoException when a peer went away (its text as in gloo's pair.cc; not produced by a test launch here)
    aborted.output[1] = ["terminate called after throwing an instance of 'gloo::IoException'",
                         "  what():  [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer "
                         "[127.0.0.1]:51234"]
    assert _failed_rank(aborted) == 1  # torchrun's root cause: this abort follows from another rank's end
    assert _exception_of(aborted, 1) == ("gloo aborted it (SIGABRT, gloo::IoException: Connection closed by peer "
                                         "[127.0.0.1]:51234) (another rank exited or crashed first: its output says why)")
    killed = LaunchResult(returncode=1, launcher_log=summary.replace("-6 (pid: 21311)  (SIGABRT)", "-9 (pid: 2)  (SIGKILL)").splitlines())
    assert "out-of-memory killer" in _exception_of(killed, 1)
    exited = LaunchResult(returncode=1, launcher_log=summary.replace("-6 (pid: 21311)  (SIGABRT)", "3 (pid: 2)").splitlines())
    assert _exception_of(exited, 1).startswith("exit code 3, no Python traceback: the script called sys.exit")
    # torchrun names only the signals Python's signal module knows; a real-time one comes bare
    unnamed = LaunchResult(returncode=1, launcher_log=summary.replace("-6 (pid: 21311)  (SIGABRT)", "-40 (pid: 2) ").splitlines())
    assert _exception_of(unnamed, 1).startswith("exit code -40 (signal 40), no Python traceback")


def test_a_rank_that_crashes_natively_is_named_with_where_python_was():
    # faulthandler is on in every rank: the launcher names the signal and the innermost Python frame
    with pytest.raises(RankFailedError) as failure:
        torchrun(DIST / "segfault_on_rank1.py", nproc=2, echo=False, timeout=120)
    assert failure.value.rank == 1, failure.value
    assert re.match(r"exit code -11 \(SIGSEGV\) in string_at \(.*ctypes.*\), called from read_address_zero "
                    r"\(.*segfault_on_rank1\.py, line 9\)", failure.value.exception), failure.value.exception


def test_a_failure_after_the_session_still_fails_the_job():
    # After a clean session the script is an ordinary Python program again: an exception fails it.
    with pytest.raises(RankFailedError, match="ValueError: after the session"):
        torchrun(DIST / "raise_after_session.py", nproc=2, echo=False, timeout=60)

