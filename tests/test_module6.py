"""Module 6: the dmuon exercise scripts against the single-process reference, and their communication.

Launches are the expensive part (~4 s each), so each solution script runs once, on
2 ranks, and writes its numbers to JSON; the tests below read those numbers. Byte
counts are exact: count_collectives counts each call's whole tensor on every rank.
"""

import json
from pathlib import Path

import pytest

from dmuon_edu import dmuon
from dmuon_edu.course import cost_model, notebooks, timeline
from dmuon_edu.course.checks import recorded_script_results
from dmuon_edu.course.checks.m06_seconds import fit_verdict
from dmuon_edu.course.dmuon_problem import Problem, dedicated_parameters, guide_batches
from dmuon_edu.launch import torchrun
from helpers import fit_relative, fit_least_absolute

# The scripts' own verdicts use data_parallel.ADAMW_TOLERANCE (its comment says why 1e-5);
# the tests fix the same bound here, so that loosening the package's does not loosen them.
ADAMW_TOLERANCE = 1e-5

pytestmark = pytest.mark.torchrun

DIST = Path(__file__).parent / "dist"
MODULE_6 = sorted(notebooks.SOLUTION_SCRIPTS.glob("06_*.py"))
NPROC = 2
K = Problem().accum_steps
P_M = sum(p.numel() * p.element_size() for p in dedicated_parameters(Problem().model()).values())
MATRICES = len(dedicated_parameters(Problem().model()))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every module 6 solution script on 2 ranks: each script's report.

    Notebooks 06a-06d run exactly these (check_script, same nproc, same problem). When
    DMUON_EDU_SCRIPT_RESULTS (checks.SCRIPT_RESULTS_ENV) names the folder their nbval run of this
    `make test` recorded into, a report is read from there (checks.recorded_script_results: only the
    unchanged solution script's own run). The rest run here, in one launch (tests/dist/run_scripts.py);
    with the variable unset, all of them.
    """
    out = {script.stem: report for script in MODULE_6
           if (report := recorded_script_results(script, NPROC)) is not None}
    recorded = len(out)
    if missing := [script for script in MODULE_6 if script.stem not in out]:
        folder = tmp_path_factory.mktemp("results")
        torchrun(DIST / "run_scripts.py", nproc=NPROC, args=[folder, *missing], echo=False, timeout=300)
        out |= {script.stem: json.loads((folder / f"{script.stem}.json").read_text()) for script in missing}
    print(f"module 6: {recorded} of {len(out)} reports read from the notebooks' runs")  # shown with -s
    return out


# Every module 6 script trains against the single-process reference, but 6d's, which times communication.
TRAINING_SCRIPTS = [s.stem for s in MODULE_6 if s.stem != "06_time_collectives"]


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_every_step_equals_the_single_process_reference(results, script):
    result = results[script]
    assert result["status"] == "PASS"
    # 06_save_and_resume trains a fourth window: its save is the one cut short
    assert len(result["differences"]) == (4 if script == "06_save_and_resume" else Problem().n_windows)
    assert max(result["differences"]) < ADAMW_TOLERANCE


def test_zero1_by_hand_reduces_and_broadcasts_p_m_once_per_step(results):
    result = results["06_reduce_broadcast"]
    assert result["collectives"]["reduce"] == [MATRICES, P_M]
    assert result["collectives"]["broadcast"] == [MATRICES, P_M]
    measured = result["measurements"]
    assert measured["P_M"] == P_M
    assert measured["dedicated bytes held between steps"] == [P_M] * NPROC  # replicated: everyone holds all
    assert sum(measured["owned bytes"]) == P_M
    assert max(measured["gradient differences"]) < ADAMW_TOLERANCE


def test_owners_only_holds_owned_bytes_and_one_layer_more(results):
    result = results["06_owners_only"]
    assert result["collectives"]["broadcast"][1] == 2 * K * P_M  # Z3, before each forward and each backward
    assert result["collectives"]["reduce"][1] == K * P_M  # no no_sync: every micro-batch reduces
    measured = result["measurements"]
    assert measured["dedicated bytes held between steps"] == measured["owned bytes"]
    assert sum(measured["owned bytes"]) == P_M
    one_layer_not_owned = P_M // 3 // NPROC  # each layer's two matrices have different owners
    assert measured["dedicated bytes held during a forward, at most"] == [
        owned + one_layer_not_owned for owned in measured["owned bytes"]]
    # The prefetched next layer, in flight: its other-owned matrix received, its own copied to send.
    assert measured["dedicated bytes in flight during a forward, at most"] == [P_M // 3] * NPROC
    assert measured["dedicated bytes held and in flight during a forward, at most"] == [
        owned + one_layer_not_owned + P_M // 3 for owned in measured["owned bytes"]]


def test_the_merge_divides_reduce_bytes_by_n(results):
    result = results["06_no_sync_merge"]
    assert result["collectives"]["reduce, no_sync on the first N-1"] == [MATRICES, P_M]
    assert result["collectives"]["reduce, no no_sync"] == [K * MATRICES, K * P_M]
    for label in ("no_sync on the first N-1", "no no_sync"):
        assert max(result["measurements"][f"gradient differences, {label}"]) < ADAMW_TOLERANCE


@pytest.mark.parametrize("zero3", [True, False], ids=["Z3", "Z2"])
@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "no_no_sync"])
def test_z2_z3_bytes_per_optimizer_step(results, zero3, no_sync):
    result = results["06_z2_z3_training"]
    config = f"{'Z3' if zero3 else 'Z2'}, {'no_sync' if no_sync else 'no no_sync'}"
    assert result["collectives"][f"broadcast, {config}"][1] == (2 * K if zero3 else 1) * P_M
    assert result["collectives"][f"reduce, {config}"][1] == (1 if no_sync else K) * P_M
    held = result["measurements"]["dedicated bytes held during a forward, at most"][config]
    # Z3: a rank's own half of P_M, plus the one matrix of the running layer it does not own; Z2: all of P_M.
    assert held == ([P_M // NPROC + P_M // MATRICES] * NPROC if zero3 else [P_M] * NPROC)


@pytest.mark.parametrize("zero3", [True, False], ids=["Z3", "Z2"])
@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "no_no_sync"])
def test_the_cost_model_predicts_what_the_z2_z3_runs_counted_and_held(results, zero3, no_sync):
    result = results["06_z2_z3_training"]
    config = f"{'Z3' if zero3 else 'Z2'}, {'no_sync' if no_sync else 'no no_sync'}"
    layers = 3
    predicted = cost_model.cost(f"dmuon {config[:2]}", P=P_M, W=NPROC, N=K, L=layers, no_sync=no_sync, s=1)
    for op in ("broadcast", "reduce"):
        assert predicted.counted[op] == result["collectives"][f"{op}, {config}"][1], (op, predicted)
    # held_bytes sees the copies a layer computes with; the prefetched layer's buffers are in flight beside them.
    held = result["measurements"]["dedicated bytes held during a forward, at most"][config]
    assert [predicted.parameters] * NPROC == held, (predicted, held)
    total = result["measurements"]["dedicated bytes held and in flight during a forward, at most"][config]
    assert [predicted.parameters + predicted.in_flight] * NPROC == total, (predicted, total)


def test_the_cost_model_predicts_zero1_by_hand(results):
    measured = results["06_reduce_broadcast"]
    predicted = cost_model.cost("ZeRO-1", P=P_M, W=NPROC, N=K, L=3, s=1)
    assert {op: predicted.counted[op] for op in ("reduce", "broadcast")} == {
        op: measured["collectives"][op][1] for op in ("reduce", "broadcast")}
    assert [predicted.parameters] * NPROC == measured["measurements"]["dedicated bytes held between steps"]
    # What crosses the wire: the reduce and the broadcast each send (N-1)/N of P_M per rank, as much
    # as one ring all-reduce (2(N-1)/N) would.
    assert predicted.wire == cost_model.cost("DDP", P=P_M, W=NPROC, N=K, L=3).wire


def test_a_rank_with_one_more_micro_batch_finishes_under_the_guide_loop_and_trains_on_other_windows(results):
    measured = results["06_uneven_windows"]["measurements"]["one more micro-batch on rank 1"]
    # The extra micro-batch falls inside no_sync: no collective waits for it, both ranks take the same steps
    # and agree, the extra's gradient is never stepped, and every window after it holds other data.
    assert measured["micro-batches per rank"] == [8, 9] and measured["optimizer steps per rank"] == [2, 2]
    assert measured["a gradient never stepped, per rank"] == [False, True]
    assert measured["largest difference between the ranks' parameters"] == 0
    assert measured["largest difference from the run without the extra micro-batch"] > 1e-3  # a real mistake's size


def test_the_guide_loop_loss_falls(results):
    losses = results["06_z2_z3_training"]["measurements"]["guide loop losses"]
    assert len(losses) == 15
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses


def test_guide_batches_differ_per_rank_and_repeat_per_call():
    (x0, y0), = guide_batches(1, rank=0)
    (x1, _), = guide_batches(1, rank=1)
    (again, _), = guide_batches(1, rank=0)
    assert x0.shape == (32, 16) and y0.shape == (32, 4)
    assert not x0.equal(x1) and x0.equal(again)


@pytest.mark.parametrize("zero3", [True, False], ids=["Z3", "Z2"])
def test_no_sync_keeps_p_m_of_gradients_on_every_rank_and_without_it_only_the_owners_share(results, zero3):
    measured = results["06_z2_z3_training"]["measurements"]["dedicated gradient bytes held during a forward, at most"]
    mode = "Z3" if zero3 else "Z2"
    shapes = {name: tuple(p.shape) for name, p in dedicated_parameters(Problem().model()).items()}
    owners = dmuon.plan_owners(shapes, NPROC)
    owned = [sum(P_M // MATRICES for name in shapes if owners[name] == rank) for rank in range(NPROC)]
    assert measured[f"{mode}, no_sync"] == [P_M] * NPROC  # every rank's accumulated_grad of every matrix (its records)
    assert measured[f"{mode}, no no_sync"] == owned  # each reduce hands the gradient to its owner


@pytest.mark.parametrize("zero3", [True, False], ids=["Z3", "Z2"])
def test_the_timeline_shows_z3_broadcasting_in_every_forward_and_backward_and_z2_in_the_first_forward(results, zero3):
    timelines = results["06_z2_z3_training"]["measurements"]["timeline of the second window"]
    for rank_timeline in timelines[f"{'Z3' if zero3 else 'Z2'}, no_sync"]:
        phases = timeline.collectives_by_phase(rank_timeline)
        # One broadcast per (layer, owner): each of the 3 layers has one matrix on each of the 2 ranks.
        per_pass = MATRICES
        assert phases["forward"]["broadcast"] == (K * per_pass if zero3 else per_pass)
        assert phases["backward"].get("broadcast", 0) == (K * per_pass if zero3 else 0)
        assert phases["backward"]["reduce"] == per_pass and "reduce" not in phases["forward"]
        assert [phase for phase, *_ in rank_timeline["spans"]].count("forward") == K * 3  # k micro-batches, 3 layers


# -- 6d: the timing script's run ---------------------------------------------------------------------------------
def test_the_timing_script_times_each_collective_at_every_size_and_fits_it(results):
    result = results["06_time_collectives"]
    assert result["status"] == "PASS"
    measured = result["measurements"]
    for name in ("all_reduce", "broadcast", "reduce"):
        seconds = measured["timings"][name]
        assert [int(size) for size in seconds] == [2**k for k in range(10, 23)]
        assert all(0 < t < 1 for t in seconds.values()), seconds  # a call of 4 MiB on 2 ranks, well under a second
        alpha, per_byte = measured["fits"][name]
        assert alpha > 0 and per_byte > 0, (name, alpha, per_byte)


@pytest.mark.parametrize("fit", ["fit_relative", "fit_least_absolute"])
def test_honest_fits_pass_on_this_machines_own_medians(results, fit):
    # The check grades a fit on the learner's own gloo medians: an honest fit must pass on any machine.
    medians = results["06_time_collectives"]["measurements"]["timings"]["all_reduce"]
    sizes = [int(size) for size in medians]
    status, message = fit_verdict({"fit_relative": fit_relative, "fit_least_absolute": fit_least_absolute}[fit], sizes,
                                  list(medians.values()))
    assert status == "PASS", message


def test_the_bucket_sweep_makes_ceil_p_over_b_calls_at_each_size(results):
    sweep = results["06_time_collectives"]["measurements"]["sweep"]
    P = sweep["gradient bytes"]
    assert P == 8 * (256 * 256 + 256) * 4
    for bucket, row in sweep["rows"].items():
        calls = 0 if bucket == "no communication" else -(-P // int(bucket))
        assert row["calls"] == calls and row["seconds"] > 0, (bucket, row)
    assert [int(b) for b in sweep["rows"] if b != "no communication"] == [2**14, 2**16, 2**18, 2**20, P]
