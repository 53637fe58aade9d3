"""dmuon: distributed Muon with dedicated owners, no_sync and Z2/Z3.

Few torchrun launches (each costs seconds before any work): the checks script on 2 ranks, and on
4 ranks as two torchrun agents of 2 ranks that meet at a c10d rendezvous, as on two machines; the
accumulation guide's loop and the public tp-dp snippet, each run unchanged. Each checks launch runs many
checks and rank 0 writes one JSON record per check into a file (tests/dist/check_channel.py); the tests
below assert on them.
Everything else runs in this process, with a one-rank gloo group where it needs one.

Tolerance of the equivalence checks: dmuon on W ranks against one process training on
the whole global batch (float32 Newton-Schulz on both sides), 3 optimizer steps of
3 micro-batches of unequal sizes, clipping and an lr schedule included. The two differ
only in the order of floating-point sums: the AVG reduce and FSDP2's reduce-scatter
sum per-rank gradients that the reference sums in one backward (relative ~1e-7).
Newton-Schulz and AdamW's m / sqrt(v) carry that through without amplifying it much.
Measured on a 2-core x86_64 CPU, torch 2.13.0+cpu: max |difference| of any parameter
2.7e-7 on 2 ranks and 4.0e-7 on 4 ranks, for parameters that moved by 2.4e-2. The
tests allow 1e-5, 25 times the measurement and a tenth of the course's 1e-4 bound.
On GPUs (NCCL) the same checks compare CUDA training with the same CPU reference, TF32
off: cuBLAS and the CPU's BLAS sum float32 products in other orders, which is the same
~1e-7 relative reordering, so the same 1e-5 holds (not yet run on a GPU).
"""

import ast
import datetime
import concurrent.futures
import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import unittest.mock
from pathlib import Path

import pytest
from helpers import Tiny
import dist.check_channel as check_channel
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.torchrun

from dmuon_edu import dmuon
from dmuon_edu.dmuon import fsdp_exclusion
from dmuon_edu.newton_schulz import ns_flops
from dmuon_edu.course import cost_model
from dmuon_edu.course.dmuon_problem import is_dedicated
from dmuon_edu.launch import torchrun

PUBLIC_SIGNATURES = json.loads((Path(__file__).parent / "public_signatures.json").read_text())["signatures"]

DIST = Path(__file__).parent / "dist"
TOLERANCE = 1e-5
CONFIGS = ["z3_no_sync", "z3_sync_every_micro_batch", "z2_no_sync", "z2_sync_every_micro_batch"]


# ---------------------------------------------------------------------------- launches
GPUS = torch.cuda.device_count()
# One rank per GPU, NCCL. On one GPU that is one rank: every collective still runs through NCCL,
# asynchronously on its own stream, and the results meet the same single-process CPU reference.
ON_GPUS = pytest.param((max(1, min(GPUS, 4)), 1), id="gpus_nccl", marks=[
    pytest.mark.cuda, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU (NCCL, one rank per GPU)")])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_agents(script, nproc, nnodes, args, env, timeout=300):
    """torchrun ``script`` on ``nproc`` ranks per agent. With ``nnodes`` > 1, one agent per node, each its own process
    as on its own machine, named by AGENT (a, b, ...): they meet at a c10d rendezvous on 127.0.0.1 (the first to start
    serves it) and take node ranks in the order they join. The launcher ends each agent after ``timeout``, whatever
    it waits for (the rendezvous included, whose own join timeout is torchrun's 600 s)."""
    if nnodes == 1:
        torchrun(script, nproc=nproc, args=args, timeout=timeout, echo=False, env=env)
        return
    endpoint = f"127.0.0.1:{_free_port()}"
    with concurrent.futures.ThreadPoolExecutor(nnodes) as agents:
        launches = [agents.submit(torchrun, script, nproc=nproc, nnodes=nnodes, rdzv_endpoint=endpoint, args=args,
                                  timeout=timeout, echo=False, env={**env, "AGENT": chr(ord("a") + node)})
                    for node in range(nnodes)]
        for launch in launches:
            launch.result(timeout=timeout + 20)


# (ranks per agent, agents): on CPU-only machines gloo ranks, 4 as two agents (the c10d rendezvous of a multi-node
# job, tested by test_hsdp_across_two_torchrun_agents_matches_one_process); with a GPU per rank, session() picks NCCL.
@pytest.fixture(scope="module", params=[pytest.param((2, 1), id="2ranks"), pytest.param((2, 2), id="4ranks"), ON_GPUS])
def checks(request, tmp_path_factory):
    per_agent, agents = request.param
    nproc = per_agent * agents
    try:
        fsdp_exclusion.check_compatible()
    except RuntimeError as error:  # another torch (e.g. a GPU machine's own build): say why, do not crash
        pytest.skip(str(error))
    marks = tmp_path_factory.mktemp(f"atexit{nproc}")
    records = tmp_path_factory.mktemp(f"checks{nproc}") / "checks.jsonl"
    launch_agents(DIST / "dmuon_checks.py", per_agent, agents, args=[tmp_path_factory.mktemp(f"ckpt{nproc}"), marks],
                  env={check_channel.ENV: str(records)})
    checks = check_channel.read(records)
    _show_costliest(request.config, f"dmuon_checks.py on {nproc} ranks", checks)
    # on_cpu: gloo ranks (the first two params); ON_GPUS's launch runs NCCL, without the CPU-only checks
    return {"atexit_marks": sorted(path.name for path in marks.iterdir()), "nproc": nproc,
            "on_cpu": request.param_index < 2, **checks}


def _show_costliest(config, launch, records, n=10):
    """Print the ``n`` records that took the most seconds on rank 0 (each record's ``seconds``: the work since the
    previous one), so that the time inside a launch can be sized. Shown on the terminal past pytest's capture; not
    shown in an xdist worker, which has no terminal."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    costs = sorted(((r["seconds"], name) for name, r in records.items()), reverse=True)
    if terminal is None or capture is None or not costs:
        return
    with capture.global_and_fixture_disabled():
        terminal.write_line("")
        terminal.write_line(f"{launch}: {sum(s for s, _ in costs):.1f} s of checks on rank 0, the {n} costliest:")
        for seconds, name in costs[:n]:
            terminal.write_line(f"  {seconds:6.2f} s  {name}")


def test_a_users_atexit_handler_runs_on_every_rank_after_a_session(checks):
    # session() installs no exception hook and no exit of its own. The one status accepted is 0 on
    # every rank: torchrun returns 0 only then, and anything else made the fixture raise. Run on 2
    # and 4 ranks, with FSDP2 and dmuon holding the process group at the interpreter's exit; the
    # old session() ran the handler on none. (The abort rate at exit over 100 launches:
    # benchmarks/teardown_rate.py and benchmarks/README.md.)
    assert checks["atexit_marks"] == [f"rank{rank}" for rank in range(checks["nproc"])]


def record(checks, name):
    """The launch's record ``name``, which its main() must have written: a check dropped from main(), or one that
    ended without reporting, fails every test that reads it (it used to skip them)."""
    if name not in checks:
        pytest.fail(f"the {checks['nproc']}-rank launch of dmuon_checks.py wrote no {name!r} record: a check was "
                    "dropped from its main(), or ended without reporting", pytrace=False)
    return checks[name]


def real_use(checks, name):
    if checks["nproc"] != 2 or not checks["on_cpu"]:
        pytest.skip("what real training does is checked on 2 CPU ranks")
    return record(checks, name)


REAL_USE = ["z3_no_sync_tied", "z2_no_sync_tied", "z3_no_sync_checkpointed", "z2_no_sync_checkpointed"]


@pytest.mark.parametrize("config", CONFIGS + REAL_USE)
def test_matches_single_process_full_batch(checks, config):
    c = real_use(checks, f"equivalence_{config}")
    assert c["max_abs_diff"] < TOLERANCE, c
    assert c["largest_change"] > 1000 * TOLERANCE, c  # the comparison is not trivially passed
    # the global norm sums the same squares per shard and per rank: float32 reordering, ~1e-7
    assert c["clip_norm_rel_diff"] < 1e-5 and c["clipped_steps"] > 0, c


@pytest.mark.parametrize("config", CONFIGS + ["z3_no_sync_checkpointed", "z2_no_sync_checkpointed"])
def test_communication_is_as_designed(checks, config):
    c = real_use(checks, f"comm_{config}")
    k, p_m = c["k"], c["dedicated_bytes"]
    for per_rank, plan in zip(c["per_rank"], c["plan"]):  # every rank counts every call, with the whole tensor's bytes
        assert per_rank["reduce"] == (p_m if c["no_sync"] else k * p_m), c
        assert per_rank["broadcast"] == (2 * k * p_m if c["zero3"] else p_m), c
        # dmuon.summarize_comm_plan plans what count_comm then counts: one broadcast and one reduce of each
        # matrix per pass of the window (rank-local facts, the same on every rank of a 1-D mesh here)
        assert plan["broadcast_tensor_bytes"] == plan["stage1_shard_reduce_tensor_bytes"] == p_m, c


def test_each_layer_broadcasts_ahead_of_its_use_and_reduces_once_per_owner(checks):
    # Z3, one optimizer step (3 micro-batches, no_sync on the first 2), the event log of every rank.
    c = checks["schedule"]
    ahead, in_time = c["depth1"], c["depth0"]
    # Prefetch depth 1: layer i+1's broadcast is issued before layer i's forward ends, and layer i-1's
    # before layer i's backward starts. Depth 0, the synchronous schedule: neither.
    assert all(ahead["forward_prefetched"]) and all(ahead["backward_prefetched"]), c
    assert not any(in_time["forward_prefetched"]) and not any(in_time["backward_prefetched"]), c
    for schedule in (ahead, in_time):
        assert schedule["same_sequence_on_every_rank"], c
        # One reduce per (layer, owner) bucket: fewer calls than matrices once layers hold more
        # matrices than there are ranks (4 per layer here).
        assert schedule["reduce_calls"] == schedule["layer_owner_pairs"], c
        if c["nproc"] < 4:
            assert schedule["reduce_calls"] < schedule["matrices"], c
    # The same collectives, issued earlier: the same sums in the same order, bit for bit.
    assert c["max_abs_diff_between_schedules"] == 0.0, c


def two_by_two(checks, name):
    if checks["nproc"] != 4:
        pytest.skip("HSDP and tensor parallelism are checked on 4 ranks: 2 replicas x 2 shards, 2 dp x 2 tp")
    return record(checks, name)


@pytest.mark.parametrize("read", [real_use, two_by_two])
def test_a_record_a_launch_did_not_write_fails_its_tests_instead_of_skipping(read):
    # The mutation: a check dropped from dmuon_checks.main() leaves its record out of the launch's records.
    launch = {"nproc": 2 if read is real_use else 4, "on_cpu": True, "placement": {}}
    assert read(launch, "placement") == {}
    with pytest.raises(pytest.fail.Exception, match="wrote no 'dropped' record: a check was dropped from its main()"):
        read(launch, "dropped")


@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_hsdp_2x2_matches_single_process_full_batch(checks, mode):
    # The same tolerance as 1-D: averaging within each replica, then across, reorders the same sums.
    c = two_by_two(checks, f"equivalence_{mode}_no_sync_hsdp")
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    assert c["clip_norm_rel_diff"] < 1e-5 and c["clipped_steps"] > 0, c
    assert two_by_two(checks, f"storage_{mode}_no_sync_hsdp")["ok_every_step_every_rank"]


def test_hsdp_publishes_the_same_weights_async_or_not_and_resumes_exactly(checks):
    c = two_by_two(checks, "hsdp_publish")
    # One owner per matrix, planned over all 4 ranks of both axes.
    assert c["owners"] == [0, 1, 2, 3], c
    assert c["max_abs_diff_between_schedules"] == 0.0 and c["max_abs_diff_after_resume"] == 0.0, c


@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_tensor_parallel_2x2_matches_single_process_full_batch(checks, mode):
    # (dp, tp) = (2, 2), no_sync over 3 micro-batches, clipping. Each TP owner orthogonalises the whole gathered
    # matrix, so the sums are only reordered (the AVG reduce, RowwiseParallel's partial sums): the 1-D tolerance.
    c = two_by_two(checks, f"equivalence_{mode}_no_sync_tp")
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    assert c["clip_norm_rel_diff"] < 1e-5 and c["clipped_steps"] > 0, c
    # a non-owner holds nothing of its TP shard between steps, an owner its whole shard
    assert two_by_two(checks, f"storage_{mode}_no_sync_tp")["ok_every_step_every_rank"]


@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_tensor_parallel_communicates_as_planned(checks, mode):
    c = two_by_two(checks, f"comm_{mode}_no_sync_tp")
    k = c["k"]
    for counted, plan in zip(c["per_rank"], c["plan"]):
        # every rank of a TP pair broadcasts and reduces its half of each matrix (its TP shard), within its column
        assert plan["broadcast_tensor_bytes"] == plan["stage1_shard_reduce_tensor_bytes"] == c["dedicated_bytes"] // 2
        assert counted["broadcast"] == (2 * k if c["zero3"] else 1) * plan["broadcast_tensor_bytes"], c
        assert counted["reduce"] == plan["stage1_shard_reduce_tensor_bytes"], c  # once a window: no_sync
        # once a step, the gradient shards gathered to the TP owner and the update scattered back, as planned
        assert counted["gather"] == plan["tp_gather_tensor_bytes_this_rank"] > 0, c
        assert counted["scatter"] == plan["tp_scatter_tensor_bytes_this_rank"] > 0, c
    # the course's cost model predicts it: per rank, and for the TP gather and scatter on average over the ranks
    model = cost_model.cost(f"dmuon {mode.upper()}", P=c["dedicated_bytes"], W=2, N=k, L=3, T=2)
    for op in ("broadcast", "reduce"):
        assert all(counted[op] == model.counted[op] for counted in c["per_rank"]), (op, model, c)
    for op in ("gather", "scatter"):
        assert sum(counted[op] for counted in c["per_rank"]) / len(c["per_rank"]) == model.counted[op], (op, model, c)


# The time model (dmuon_edu/dmuon/step_time.py) prices the collectives it plans from names and shapes alone; they
# must be the ones that run. Per layout and rank, one step (3 micro-batches, no_sync): count_comm's calls and bytes of
# every collective (the clip's own all-reduces taken out: the training loop's, not the layout's) equal the plan's.
TIME_MODEL_RECORDS = {2: ["comm_z3_no_sync", "comm_z2_no_sync", "ddp_no_sync"],
                      4: ["comm_z3_no_sync", "comm_z2_no_sync", "comm_z3_no_sync_hsdp", "comm_z2_no_sync_hsdp",
                          "comm_z3_no_sync_tp", "comm_z2_no_sync_tp", "ddp_tp"]}


def test_time_model_plans_the_collectives_that_run(checks):
    if checks["nproc"] not in TIME_MODEL_RECORDS:
        pytest.skip("the time model's plan is compared on 2 and 4 CPU ranks")
    for name in TIME_MODEL_RECORDS[checks["nproc"]]:
        c = checks[name]
        for rank, predicted in enumerate(c["time_model"]):
            assert predicted["counted"] == predicted["planned"], (name, rank, predicted)
            assert predicted["planned"], (name, rank)  # a step communicates
        # and summarize_comm_plan's totals, this rank's, for dmuon's own collectives of one pass
        for rank, (predicted, plan) in enumerate(zip(c["time_model"], c["plan"])):
            if name.startswith("comm_"):
                passes = 2 * c["k"] if c["zero3"] else 1
                assert predicted["planned"]["broadcast"][1] == (passes * plan["broadcast_tensor_bytes"]
                                                                + plan["post_step_replicate_broadcast_tensor_bytes_this_rank"]), (name, rank)
                assert predicted["planned"]["reduce"][1] == (plan["stage1_shard_reduce_tensor_bytes"]
                                                             + plan["stage2_replicate_reduce_tensor_bytes_this_rank"]), (name, rank)
            else:  # the DDP backend: a reduce per window, a broadcast after the step
                assert predicted["planned"]["broadcast"][1] == plan["broadcast"], (name, rank)
                assert predicted["planned"]["reduce"][1] == plan["reduce"], (name, rank)
            for op in ("gather", "scatter"):  # the TP gathers and scatters, where the layout has them
                planned_tp = plan.get(f"tp_{op}_tensor_bytes_this_rank", plan.get(op, 0))
                assert predicted["planned"].get(op, [0, 0])[1] == planned_tp, (name, rank)


def test_calibrate_measures_this_machine_in_30_seconds(checks):
    c = real_use(checks, "calibrate")
    assert c["seconds_taken"] < 30, c  # the budget; 5 to 6 s measured on 2 cores
    assert c["cores"] >= 1 and c["memory_bandwidth"] > 1e8, c  # any machine streams more than 100 MB/s
    # two ranks multiplying at once: a rank keeps some of its alone rate, and never more than all of it
    assert 0 < c["concurrent_share"] <= 1, c
    # 0.1 GFLOP/s: an AVX2-only CPU multiplies bf16 at 0.46 GFLOP/s on one thread (float32 at 22)
    assert all(rate > 1e8 for rate in c["matmul_flops"].values()), c
    assert 0 < c["elementwise_seconds"] < 1e-6 and 0 < c["nonlinearity_seconds"] < 1e-6, c
    costs = c["calibrated"][str(c["world"])]  # the whole world's group, every collective
    assert sorted(costs) == sorted(dmuon.hardware.COLLECTIVES), c
    # a call costs something, and no collective on one machine is slower than a megabyte per second
    assert all(alpha > 0 and 0 <= beta < 1e-6 for alpha, beta in costs.values()), c
    # the frameworks' own work, timed alone on tiny modules: FSDP2's per unit, DTensor's per TP style
    work = c["host_work"][str(c["world"])]
    assert sorted(work) == ["colwise", "colwise, gathered", "fsdp2 unit", "rowwise", "rowwise, from replicated"], c
    assert all(per_unit >= 0 and per_parameter >= 0 for per_unit, per_parameter in work.values()), c
    assert work["fsdp2 unit"][0] > 0, c  # an FSDP2 unit's gathers and hooks take time


def test_tensor_parallel_resumes_bit_identically(checks):
    # Z2 through full state dicts and torch.save, Z3 through torch.distributed.checkpoint: a fresh model takes
    # step 3 exactly as the one that trained steps 1 and 2 (the TP owners' full momentum comes back)
    assert two_by_two(checks, "tp_resume")["max_abs_diff_after_resume"] == {"z2": 0.0, "z3": 0.0}


def test_a_plain_state_dict_under_tensor_parallelism_is_refused_by_name_on_every_rank(checks):
    # Between uses a non-owner's TP shard holds a 0-element local tensor; model.state_dict() would save it without
    # a word (it did for 5 of 8 attention matrices). Every rank refuses, naming the first matrix it lacks (a TP
    # shard on some rank, so the DTensor path is the one tested) and the collective to call instead.
    plain = two_by_two(checks, "tp_resume")["plain_state_dict"]
    for rank in plain:
        assert rank["error"] and rank["error"].startswith(f"{rank['first_absent']} is owned by rank "), plain
        assert "dmuon.get_model_state_dict(model) on every rank" in rank["error"], plain
    assert any(rank["is_tp_shard"] for rank in plain), plain


def test_ddp_with_tensor_parallelism_matches_one_process_and_its_plan(checks):
    # dedicate_params_ddp_tp + replicate_tp on (dp, tp) = (2, 2), 3 steps of 3 unequal micro-batches with no_sync,
    # clipping and an lr schedule: the same float32 reordering as FSDP2 + TP, so the same tolerance
    c = two_by_two(checks, "ddp_tp")
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    # every rank keeps its whole TP shard of every matrix; per step each DP owner's shard is reduced once (no_sync)
    # and broadcast once after the step, and the TP owners gather and scatter as summarize_comm_plan plans
    assert c["held_everywhere"], c
    model = cost_model.cost("dmuon DDP backend", P=c["dedicated_bytes"], W=2, N=3, L=3, T=2)  # the cost model's row
    for counted, plan in zip(c["per_rank"], c["plan"]):
        assert counted == plan and counted["reduce"] == counted["broadcast"] == c["dedicated_bytes"] // 2, c
        assert counted["reduce"] == model.counted["reduce"] and counted["broadcast"] == model.counted["broadcast"], c
    for op in ("gather", "scatter"):
        assert sum(counted[op] for counted in c["per_rank"]) / len(c["per_rank"]) == model.counted[op], (op, model, c)
    assert c["max_abs_diff_after_resume"] == 0.0, c  # full state dicts: bit for bit
    assert "dedicate_params_ddp_tp" in c["refusals"]["dedicate_params_ddp"], c
    assert "replicate_tp" in c["refusals"]["replicate"], c
    # a DTensor keeps its dtype, so a TP shard's compute_dtype is refused when dmuon.Muon is built, naming autocast
    assert "is tensor-parallel (a DTensor)" in c["refusals"]["compute_dtype"], c
    assert "torch.autocast" in c["refusals"]["compute_dtype"], c


POOLED_TP_BLOCK = [f"layers.0.{m}_proj.weight" for m in ("down", "k", "q", "up")]  # TP-sharded by parallelize()
CLIP_STATS_FIELDS = ["clip_coef", "clipped", "found_inf", "max_norm", "norm_type", "param_count", "strategy",
                     "total_norm"]


def test_the_public_api_on_ddp_with_tensor_parallelism_matches_one_process(checks):
    # An MHA beside a TP-sharded block on (dp, tp) = (2, 2), DDP + TP, 2 steps with clipping: the semantic
    # param_groups, param_policy routing the MHA's out_proj (not TP-sharded) to AdamW, the Polar Express
    # coefficients and hook boundaries on the MHA and the block, against one process with the same groups,
    # coefficients and clipping: the same float32 reordering as the other equivalence checks, the same tolerance
    c = two_by_two(checks, "ddp_tp_api")
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    assert c["differs_from_jordan"] > 100 * TOLERANCE, c  # the coefficients reach the update (measured 2.9e-3)
    assert c["groups"] == ["no_decay/muon", "no_decay/adamw", "rest/muon", "rest/adamw"], c
    assert c["units"] == ["pool", "layers.0"] and c["routed"] == "adamw" and c["tp_sharded"] == POOLED_TP_BLOCK, c
    # Both clip forms against torch's on the full-batch gradients, each step: the norms sum the same squares over
    # shards and ranks in another order (~1e-7 relative). The MHA's gradient, the same in both TP columns, counts
    # once: it counted twice (the norms 27% and 32% off, the clip coefficient 21%).
    for clip in c["clips"]:
        assert clip["muon_norm_rel_diff"] < 1e-5 and clip["norm_rel_diff"] < 1e-5, clip
        assert clip["coef_rel_diff"] < 1e-5 and clip["reference_clipped"], clip  # the clip scaled: it is tested
        for s in clip["per_rank"]:
            assert s["fields"] == [CLIP_STATS_FIELDS] * 2 and s["norms"] == clip["per_rank"][0]["norms"], clip
            assert s["max_norm"] == [None, c["max_norm"]] and s["clip_coef_measured"] == 1.0, clip
            assert s["clipped"] == [False, True] and s["found_inf"] == [False, False], clip
            assert s["strategy"] == ["global_norm"] * 2, clip
    # a TP shard routed to AdamW is refused on every rank, naming what this backend does (it used to name
    # 'sharded_adamw', which this backend refuses in turn, naming 'adamw')
    for message in c["sharded_adamw_refusal"]:
        assert message and "layers.0.k_proj.weight" in message and "replicate_tp" in message, c
        assert "sharded_adamw" not in message, c


@pytest.mark.parametrize("layout", ["z3", "z2", "ddp"])
def test_mha_beside_a_tensor_parallel_block_trains_like_one_process_with_a_hook_boundary_predicate(checks, layout):
    # torch has no TP plan for nn.MultiheadAttention, so it stays replicated over TP while the block before it is
    # TP-sharded; its matrices, dedicated on mesh["dp"] with the MHA as hook boundary, have an owner in each TP
    # column. FSDP2 + TP in Z3 and Z2, and DDP + TP, 2 steps with clipping, against one process: float32 reordering
    # as above. The clip counted the MHA's gradients once per TP column (1.2e-3 off after 2 steps).
    c = two_by_two(checks, "hook_boundaries_tp")[layout]
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    assert c["units"] == ["pool", "layers.0"] and c["storage_ok"], c
    assert c["tp_sharded"] == POOLED_TP_BLOCK and c["dedicated"] == POOLED_TP_BLOCK + ["pool.in_proj_weight",
                                                                                      "pool.out_proj.weight"], c


def test_hsdp_publishes_only_the_trainable_matrices_as_planned(checks):
    # one Z3 window with no_sync on 2 x 2, one matrix frozen: the replicas' per-layer broadcasts (2N per matrix)
    # and the post-step publish, which used to send the frozen matrix too; the plan says the same
    c = two_by_two(checks, "hsdp_frozen")
    for counted, per_layer, publish, trainable in zip(c["counted"], c["planned_per_layer"], c["planned_publish"],
                                                      c["held_trainable"]):
        assert publish == trainable and counted == 2 * c["k"] * per_layer + publish, c
    assert sum(c["planned_publish"]) > 0, c


def test_no_sync_divides_reduce_bytes_by_k(checks):
    # on every rank: each takes part in every reduce, as sender or as receiver
    with_no_sync, without = checks["comm_z2_no_sync"], checks["comm_z2_sync_every_micro_batch"]
    assert len(with_no_sync["per_rank"]) == checks["nproc"], with_no_sync
    for mine, theirs in zip(with_no_sync["per_rank"], without["per_rank"], strict=True):
        assert mine["reduce"] > 0 and mine["reduce"] * with_no_sync["k"] == theirs["reduce"], (mine, theirs)


@pytest.mark.parametrize("config", CONFIGS)
def test_non_owners_hold_no_storage_between_steps(checks, config):
    assert checks[f"storage_{config}"]["ok_every_step_every_rank"]


def test_fully_shard_leaves_dedicated_params_alone(checks):
    c = checks["fsdp_leaves_dedicated_alone"]
    assert c["dedicated"] == 12 and c["dedicated_sharded"] == [] and c["others_not_sharded"] == [], c


def test_ownership_is_the_plan_on_every_rank(checks):
    c = checks["ownership"]
    assert c["same_on_every_rank"] and c["equals_plan"] and c["owners_used"] == list(range(c["nproc"])), c


def test_no_sync_communicates_nothing_and_refuses_to_step(checks):
    c = checks["no_sync"]
    assert c["reduce_calls"] == 0 and c["reduce_scatter_calls"] == 0, c
    assert c["all_accumulated"] and c["none_reduced"], c
    assert c["step_raised"] and "no_sync" in c["step_raised"], c


def test_next_backward_merges_and_zero_grad_clears(checks):
    c = checks["zero_grad"]
    assert c["merged_and_reduced"] and c["fsdp_had_grads"] and c["cleared_every_rank"], c


def test_z2_keeps_params_through_the_window(checks):
    c = checks["z2_residency"]
    assert c["resident_through_window"] and c["released_by_step"], c


@pytest.mark.parametrize("layout", ["z3", "z2", "ddp", "hsdp", "ddp_tp"])
def test_a_dedicated_parameter_carries_nothing_of_dmuons_but_the_pointer_to_its_record(checks, layout):
    # Everything dmuon knows of a matrix is in its MatrixRecord (record.py); the parameter points to it, on its
    # owner and elsewhere, after a window and a step. (Before the record: 13 _dmuon_* attributes, _reduced_grad and
    # _accumulated_grad.) Read on every rank: FSDP2 Z3 (after a no_sync window, zero_grad, and a step) and Z2 (after
    # a window and a step) on the structure check's models, the DDP backend, HSDP and DDP + TP after three steps of
    # the direct-read check.
    if layout in ("z3", "z2"):
        c = checks["zero_grad" if layout == "z3" else "z2_residency"]
    elif layout == "ddp_tp":
        c = two_by_two(checks, "direct_reads_ddp_tp")
    else:
        c = real_use(checks, f"direct_reads_{layout}")
    assert c["attributes"] == [["_dmuon_record"]] * checks["nproc"], c


def test_checkpoint_roundtrip_resumes_bit_identically(checks):
    c = checks["state_dict_roundtrip"]
    assert c["max_abs_diff_after_resume"] == 0.0 and c["lr_after"] == c["lr_expected"], c


# The step's all-reduce carries six float64 numbers (optim.py); dmuon.clip_grad_norm_ all-reduces one float32.
STEP_ALL_REDUCE_BYTES, CLIP_ALL_REDUCE_BYTES = 6 * 8, 4


@pytest.mark.parametrize("config", ["no_sync", "sync_every_micro_batch"])
def test_the_ddp_backend_matches_one_process_and_ddp_with_replicated_muon(checks, config):
    # dedicate_params_ddp + replicate on 2 ranks, 3 steps of 3 unequal micro-batches, clipping and an lr schedule,
    # against one process on the full batch and against torch DDP with Muon on every rank (float32 Newton-Schulz
    # everywhere). The same 1e-5 as FSDP2: the AVG reduce to the owner and the all-reduce reorder float32 sums
    # of per-rank gradients (relative ~1e-7), and nothing else differs.
    c = real_use(checks, f"ddp_{config}")
    assert c["max_abs_diff"] < TOLERANCE and c["max_abs_diff_to_ddp_replicated_muon"] < TOLERANCE, c
    assert c["largest_change"] > 1000 * TOLERANCE, c
    # every rank holds every matrix; each matrix has one owner, the only rank that steps it; both ranks own some
    assert c["held_everywhere"] and c["owners"] == [0, 1] and c["steppers"] == [1] * 12, c


@pytest.mark.parametrize("config", ["no_sync", "sync_every_micro_batch"])
def test_the_ddp_backend_moves_the_bytes_of_its_formula(checks, config):
    # Per optimizer step, as count_comm counts (the whole tensor on every rank taking part), with P_M the
    # dedicated matrices' bytes, P_R the rest's and k micro-batches (1 reducing pass with no_sync):
    # reduce to the owners k' * P_M, broadcast of the results P_M, all-reduce k' * P_R plus the step's and the
    # clip's few numbers. DDP with replicated Muon all-reduces k' * (P_M + P_R): on the wire a ring all-reduce
    # moves 2 (W-1)/W of it per rank, a reduce and a broadcast (W-1)/W each, so the matrices cost the same
    # bytes and the backend saves the W-1 redundant Newton-Schulz runs per matrix.
    c = real_use(checks, f"ddp_{config}")
    passes = 1 if config == "no_sync" else c["k"]
    p_m, p_r = c["dedicated_bytes"], c["replicated_bytes"]
    model = cost_model.cost("dmuon DDP backend", P=p_m, W=2, N=c["k"], L=3, no_sync=config == "no_sync")
    for mine, peer, plan in zip(c["per_rank"], c["peer_per_rank"], c["plan"]):
        assert mine["reduce"] == passes * p_m and mine["broadcast"] == p_m, c
        assert {op: mine[op] for op in model.counted} == model.counted, (model, c)  # the course's cost model
        # summarize_comm_plan plans it: one reduce per pass, one broadcast per step (after it), not per layer
        assert plan["reduce"] * passes == mine["reduce"] and plan["broadcast"] == mine["broadcast"], c
        assert mine["all_reduce"] == passes * p_r + STEP_ALL_REDUCE_BYTES + CLIP_ALL_REDUCE_BYTES, c
        assert peer["all_reduce"] == passes * (p_m + p_r), c


def test_the_ddp_backend_resumes_exactly_and_takes_a_policy_a_hook_boundary_groups_and_an_ns_backend(checks):
    c = real_use(checks, "ddp_resume_and_policy")
    assert c["max_abs_diff_after_resume"] == 0.0, c  # the same state, the same operations: bit for bit
    # one matrix routed to AdamW by param_policy, hooks on the blocks, two semantic param_groups and the Polar
    # Express coefficients (test_ns_backend_... shows that the comparison tells them from Jordan's): the same
    # tolerance against one process with the same groups and coefficients
    assert c["policy_max_abs_diff"] < TOLERANCE and c["policy_largest_change"] > 1000 * TOLERANCE, c
    assert c["units"] == ["layers.0", "layers.1", "layers.2"], c
    assert c["groups"] == ["no_decay/muon", "no_decay/adamw", "rest/muon", "rest/adamw"], c


def test_the_ddp_backend_trains_a_tied_matrix_like_one_process(checks):
    # Net(tied=True): layers.2.up_proj.weight is layers.0.up_proj.weight, in both layers' units; 2 steps with
    # no_sync against one process with the same tie: the same float32 reordering as the untied run.
    c = real_use(checks, "ddp_tied")
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    assert c["tied_units"] == 2, c


@pytest.mark.parametrize("backend", ["ddp", "hsdp", "ddp_tp"])  # ddp_tp: (dp, tp) = (2, 2), its TP shards
def test_a_direct_read_right_after_step_sees_the_steps_result(checks, backend):
    # After step() (replicate_async=True) the DDP backend's non-owners, and HSDP's holders in the replica that
    # does not step a matrix, hold its previous values until the owner's broadcast lands; a read then (p.clone(),
    # torch.save(model.state_dict()), an EMA with torch._foreach_*) waits for it. Every rank's read equals the
    # stepping rank's value bit for bit: the same bytes, or (the EMA) the same operations on the same bytes.
    # The old code read the previous step's values: 1.6e-2, 8.3e-3 and 2.1e-3 off.
    c = two_by_two(checks, "direct_reads_ddp_tp") if backend == "ddp_tp" else real_use(checks, f"direct_reads_{backend}")
    assert c["max_abs_diff_to_stepper"] == {"clone": 0.0, "torch.save(model.state_dict())": 0.0, "ema": 0.0}, c
    assert c["min_change_by_a_step"] > 100 * TOLERANCE, c  # a stale read would differ (an EMA's by a tenth of it)
    # every rank read every matrix, half of them stepped on the other rank
    world = len(c["matrices_read_per_rank"])
    assert c["matrices_read_per_rank"] == [12] * world and c["stepped_elsewhere_per_rank"] == [6] * world, c


def test_the_ddp_backend_computes_in_compute_dtype_and_plans_what_it_sends(checks):
    # dedicate_params_ddp(model, mesh, predicate, torch.bfloat16) with one frozen matrix, one window with no_sync:
    # every rank computes in bf16 from float32 masters; the frozen matrix is neither reduced nor broadcast; the
    # post-step broadcast carries the trainable float32 masters, and the plan says so (it used to plan per-layer
    # broadcasts in bf16, which this backend never makes).
    c = real_use(checks, "ddp_compute_dtype_and_frozen")
    assert c["forward_dtypes"] == ["torch.bfloat16"] and c["master_dtypes"] == ["torch.float32"], c
    for plan, counted in zip(c["plan"], c["counted"]):
        assert counted == {"broadcast": c["trainable_bytes"], "reduce": c["trainable_bytes"]}, c
        assert plan == counted, c


def test_hsdp_across_two_torchrun_agents_matches_one_process(checks):
    # The 4-rank checks ran as two torchrun agents, each its own process as on two machines, which the test does
    # not assume to take node ranks in any order. HSDP's 2 x 2 mesh there: its rows must be the nodes.
    c = two_by_two(checks, "placement")
    ranks = c["ranks"]
    if any(r["agent"] is None for r in ranks):
        pytest.skip("the 4 CPU ranks run as two agents; this launch had one")
    # one agent per node rank, whichever; each holds global ranks node rank * 2 + local rank
    assert sorted((r["agent"], r["node_rank"]) for r in ranks if r["local_rank"] == 0) in (
        [("a", 0), ("b", 1)], [("a", 1), ("b", 0)]), ranks
    assert all(r["rank"] == 2 * r["node_rank"] + r["local_rank"] for r in ranks), ranks
    node_of = {r["rank"]: r["node_rank"] for r in ranks}
    for r in ranks:  # the shard axis within a node, the replicate axis across the nodes
        assert {node_of[q] for q in r["shard_group"]} == {r["node_rank"]}, ranks
        assert sorted(node_of[q] for q in r["replicate_group"]) == [0, 1], ranks
    # The same tolerance as HSDP on one node: the sums over ranks are reordered the same way.
    e = checks["equivalence_z3_no_sync_hsdp"]
    assert e["max_abs_diff"] < TOLERANCE and e["largest_change"] > 1000 * TOLERANCE, e
    assert checks["storage_z3_no_sync_hsdp"]["ok_every_step_every_rank"]


def test_the_accumulation_guide_loop_trains():
    result = torchrun(DIST / "accumulation_guide_loop.py", nproc=2, timeout=180, echo=False)
    losses = [float(line.rsplit("=", 1)[1]) for line in result.stdout(0).splitlines() if line.startswith("step ")]
    assert len(losses) == 15, result.stdout(0)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses


# ----------------------------------------------------------------------- plan_owners
def gpt2_small_shapes():
    shapes = {}
    for layer in range(12):
        shapes[f"h.{layer}.attn.c_attn.weight"] = (768, 2304)
        shapes[f"h.{layer}.attn.c_proj.weight"] = (768, 768)
        shapes[f"h.{layer}.mlp.c_fc.weight"] = (768, 3072)
        shapes[f"h.{layer}.mlp.c_proj.weight"] = (3072, 768)
    return shapes


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_plan_balances_gpt2_small_by_newton_schulz_flops(world_size):
    shapes = gpt2_small_shapes()
    owners = dmuon.plan_owners(shapes, world_size)
    assert list(owners) == list(shapes) and set(owners.values()) == set(range(world_size))
    load = [0] * world_size
    for name, rank in owners.items():
        load[rank] += ns_flops(shapes[name])  # tests/test_step_time.py counts them against the products run
    # 12 equal layers split exactly over 2 and 4 ranks (1.000); over 8, 1.5 layers a rank, no subset of a
    # layer's 4 matrices makes half of its flops, and greedy placement lands at 1.041: 5% is that and room for a
    # tie broken another way. (That it weighs flops, not entries: test_plan_weighs_newton_schulz_time_not_size.)
    assert max(load) / (sum(load) / world_size) <= 1.05


def test_imbalance_is_max_over_mean_time():
    # Newton-Schulz flops 5 (4 m^2 n + 2 m^3) with m = 2: 240 for (2, 2), 400 for (4, 2); max 400 over mean 320
    assert dmuon.imbalance({"a": 0, "b": 1}, {"a": (2, 2), "b": (4, 2)}, 2) == pytest.approx(1.25)


def _layer_owner_pairs(owners):
    return {(name.split(".")[1], rank) for name, rank in owners.items()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_plan_keeps_each_layer_on_one_owner_where_whole_layers_balance(world_size):
    # 12 equal layers split evenly over 2 and 4 ranks: each (layer, owner) pair is a broadcast per pass and a
    # reduce per window, so a layer on one owner costs a quarter of the collectives of a layer over four
    owners = dmuon.plan_owners(gpt2_small_shapes(), world_size)
    assert len(_layer_owner_pairs(owners)) == 12, owners
    assert dmuon.imbalance(owners, gpt2_small_shapes(), world_size) == 1.0


def test_plan_places_matrix_by_matrix_where_whole_layers_would_unbalance_the_work():
    # 12 equal layers over 8 ranks: whole, the most loaded rank would hold 2 layers against a mean of 1.5 (1.33);
    # matrix by matrix the work splits within 5% (1.041), and among equally loaded ranks a matrix joins the rank
    # that holds its layer: 24 (layer, owner) pairs, where 48 would be one pair per matrix
    owners = dmuon.plan_owners(gpt2_small_shapes(), 8)
    assert dmuon.imbalance(owners, gpt2_small_shapes(), 8) <= 1.05
    assert len(_layer_owner_pairs(owners)) == 24, owners
    # 3 equal layers of 2 equal matrices over 2 ranks: whole layers would be 2 against 1
    three = {f"layers.{i}.{m}.weight": (64, 32) for i in range(3) for m in ("up_proj", "down_proj")}
    assert list(dmuon.plan_owners(three, 2).values()) == [0, 1, 0, 1, 0, 1]


def test_plan_weighs_newton_schulz_time_not_size():
    # Every matrix has 2^20 entries, but Newton-Schulz on "big" takes 30 2^30 flops, on each 256 x 4096 (Gram-space
    # pairs) 3.3 2^30. By time, "big" alone outweighs the other four; by size it would share a rank with two.
    shapes = {"big": (1024, 1024), "a": (256, 4096), "b": (256, 4096), "c": (4096, 256), "d": (4096, 256)}
    owners = dmuon.plan_owners(shapes, 2)
    assert owners["big"] != owners["a"] and len({owners[n] for n in "abcd"}) == 1


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="world_size"):
        dmuon.plan_owners({"w": (2, 2)}, 0)
    with pytest.raises(ValueError, match="2-D"):
        dmuon.plan_owners({"w": (2, 2, 2)}, 2)


# ------------------------------------------------------- in this process, on one rank
@pytest.fixture(scope="module")
def one_rank(one_rank_mesh):
    return one_rank_mesh


def test_fsdp_internal_that_dmuon_patches_is_still_there():
    # If this fails after a torch upgrade, update dmuon_edu/dmuon/fsdp_exclusion.py.
    fsdp_exclusion.check_compatible()


def test_fully_shard_without_ignored_params_skips_dedicated(one_rank):
    model = Tiny()
    dmuon.dedicate_params(model, one_rank, is_dedicated)
    fully_shard(model, mesh=one_rank)
    kinds = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
    assert kinds == {n: "up_proj.weight" not in n for n in kinds}


def test_count_comm_counts_calls_and_bytes_of_each_collective(one_rank):
    # dmuon.count_comm (the public project's name) counts what the collectives carry: calls and whole-tensor bytes,
    # an async call when it is issued
    with dmuon.count_comm() as counted:
        torch.distributed.all_reduce(torch.ones(3))
        torch.distributed.broadcast(torch.ones(2, 4, dtype=torch.float64), src=0, async_op=True).wait()
    assert dict(counted.calls) == {"all_reduce": 1, "broadcast": 1}, counted.calls
    assert dict(counted.bytes) == {"all_reduce": 12, "broadcast": 64}, counted.bytes


def test_bad_predicates_raise_value_error(one_rank):
    with pytest.raises(ValueError, match="only 2-D"):
        dmuon.dedicate_params(Tiny(), one_rank, lambda n, p: "proj" in n)  # selects the biases too
    with pytest.raises(ValueError, match="selected no parameter"):
        dmuon.dedicate_params(Tiny(), one_rank, lambda n, p: False)


def test_already_sharded_model_raises_runtime_error(one_rank):
    model = Tiny()
    fully_shard(model, mesh=one_rank)
    with pytest.raises(RuntimeError, match="before fully_shard|first, then fully_shard"):
        dmuon.dedicate_params(model, one_rank, is_dedicated)


def test_mesh_must_be_one_dimensional(one_rank):
    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        dmuon.dedicate_params(Tiny(), init_device_mesh("cpu", (1, 1)), is_dedicated)


def test_a_replicate_mesh_must_be_one_axis_of_a_2d_mesh(one_rank):
    two_d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match="1-D DeviceMesh as replicate_mesh"):
        dmuon.dedicate_params(Tiny(), two_d["shard"], is_dedicated, replicate_mesh=two_d)
    with pytest.raises(TypeError, match=r"mesh2d\['replicate'\]"):  # a name, not the mesh
        dmuon.dedicate_params(Tiny(), two_d["shard"], is_dedicated, replicate_mesh="replicate")


def test_dedicating_twice_raises(one_rank):
    model = Tiny()
    dmuon.dedicate_params(model, one_rank, is_dedicated)
    with pytest.raises(RuntimeError, match="once"):
        dmuon.dedicate_params(model, one_rank, is_dedicated)


def test_a_model_without_dedicated_params_is_refused():
    with pytest.raises(ValueError, match="dedicate_params"):
        dmuon.Muon(Tiny())
    with pytest.raises(ValueError, match="dedicate_params"), dmuon.no_sync(Tiny()):
        pass


@pytest.mark.parametrize("depth", [-1, 1.0, True, "1"])
def test_forward_prefetch_depth_must_be_an_int_of_at_least_zero(one_rank, depth):
    model = Tiny()
    dmuon.dedicate_params(model, one_rank, is_dedicated)
    fully_shard(model, mesh=one_rank)
    with pytest.raises(ValueError, match="forward_prefetch_depth must be an int >= 0"):
        dmuon.Muon(model, forward_prefetch_depth=depth)


def test_unsupported_state_dict_options_raise(one_rank):
    model = Tiny()
    dmuon.dedicate_params(model, one_rank, is_dedicated)
    with pytest.raises(ValueError, match="broadcast_from_rank0"):
        dmuon.get_model_state_dict(model, dmuon.StateDictOptions(broadcast_from_rank0=True))


def test_optimizer_works_with_lr_scheduler_and_zero_grad(one_rank):
    model = Tiny()
    dmuon.dedicate_params(model, one_rank, is_dedicated)
    fully_shard(model, mesh=one_rank)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    # square(): the sum of a LayerNorm's outputs does not depend on its inputs, so a plain sum
    # would give the matrices (numerically) zero gradients and nothing to step
    with dmuon.no_sync(model):
        model(torch.randn(3, 4)).square().sum().backward()
    model(torch.randn(3, 4)).square().sum().backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if is_dedicated(n, p)}
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.01, 5e-4]
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)
    opt.zero_grad()
    assert all(dmuon.record_of(p).reduced_grad is None and dmuon.record_of(p).accumulated_grad is None
               and p.grad is None for n, p in model.named_parameters() if n in before)
    with pytest.raises(RuntimeError, match="get_optimizer_state_dict"):
        opt.state_dict()


# ---------------------------------------------------------------------- real use
def test_a_non_owner_refuses_every_read_of_a_matrix_it_does_not_hold_by_name(checks):
    c = real_use(checks, "placeholders")
    for what, message in c["refusals"].items():
        assert message is not None, f"{what} on a non-owner's matrix did not raise: {c}"
        assert "dmuon.get_model_state_dict(model)" in message and "holds no copy of it between uses" in message, (
            what, message)
        if "state_dict" not in what:  # a state dict names the first matrix this rank does not own
            assert c["matrix"] in message and f"owned by rank {c['owner']}" in message, (what, message)
    assert c["shape"] == c["size"] == c["expected_shape"] and c["numel"] == c["expected_shape"][0] * c["expected_shape"][1]
    assert c["repr_names_owner"] and not c["resident"]


def test_the_parameters_stay_the_same_objects_across_steps(checks):
    assert real_use(checks, "placeholders")["same_objects"]


@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_fsdp2_mixed_precision_computes_in_bf16_and_keeps_float32_masters(checks, mode):
    c = real_use(checks, f"mixed_precision_{mode}")
    # The reference does the same bf16 products and float32 sums in another order: float32's tolerance.
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    assert c["forward_dtypes"] == ["torch.bfloat16"], c
    assert c["master_dtypes"] == c["momentum_dtypes"] == ["torch.float32"], c
    # The broadcast carries bf16: half the float32 bytes, once (Z2) or 2k times (Z3) per step.
    assert c["broadcast_bytes"] == c["dedicated_bytes_fp32"] // 2 * (2 * c["k"] if c["zero3"] else 1), c


def test_a_window_entirely_inside_no_sync_is_refused_at_step_on_every_rank(checks):
    for message in real_use(checks, "misuse")["step_after_all_no_sync"]:
        assert message and "every backward ran inside dmuon.no_sync" in message, real_use(checks, "misuse")


def test_a_step_inside_no_sync_is_refused_by_name_on_every_rank(checks):
    for message in real_use(checks, "misuse")["step_inside_no_sync"]:
        assert message and "optimizer.step() inside dmuon.no_sync(model)" in message, real_use(checks, "misuse")


def test_dedicate_params_after_fully_shard_is_refused_by_name_on_every_rank(checks):
    for message in real_use(checks, "misuse")["fully_shard_first"]:
        assert message and "already sharded by fully_shard" in message, real_use(checks, "misuse")
        assert "call dmuon.dedicate_params(model, mesh, predicate) first" in message, message


def test_ranks_that_dedicate_different_matrices_are_refused_on_every_rank_naming_the_first(checks):
    for message in real_use(checks, "misuse")["rank_dependent_predicate"]:
        assert message and "selected different matrices" in message and "layers.1.k_proj.weight" in message, message


def test_pipeline_stages_are_refused_on_every_rank_naming_the_layout(checks):
    # each rank holds other layers (a pipeline stage): refused before any broadcast could pair two layers
    for message in real_use(checks, "misuse")["pipeline_stages"]:
        assert message and "selected different matrices" in message, message
        assert "dmuon does not support pipeline parallelism" in message and "dmuon_edu.Muon" in message, message


def test_a_rank_that_never_calls_dedicate_params_is_named_at_the_groups_timeout(checks):
    # rank 1 runs its own all-reduce on the group instead (it used to meet rank 0's first collective there, and
    # gloo aborted both processes): rank 0 waits in the store for the group's 1 s and names rank 1
    message = real_use(checks, "misuse")["a_rank_never_calls"][0]
    assert message and message.startswith("dedicate_params: rank(s) 1 did not call dedicate_params within the "
                                           "group's timeout (1 s)") and "if rank == 0:" in message, message


@pytest.mark.parametrize("mode", ["per_step", "strict"])
def test_an_evaluation_on_rank_0_only_is_named_on_every_rank_before_gloo_can_abort(checks, mode):
    # After a step rank 0 alone runs a forward: its peers' next collectives met that forward's, and gloo aborted
    # both processes natively (default per_step), or the rank ahead waited out the collective timeout (strict).
    # Now every rank raises, naming the first events where they part and the fix, well inside the 60 s collective
    # timeout (15 s: the longest a rank waits for the others' logs).
    outcomes = real_use(checks, "evaluation_on_one_rank")[mode]
    for rank, outcome in enumerate(outcomes):
        message = outcome["error"]
        assert message and "the ranks diverged at their event #" in message, outcomes
        assert "rank 0" in message and "rank 1" in message and "of layers." in message, outcomes
        assert "evaluate on every rank" in message and outcome["seconds"] < 15, outcomes


def _names_the_divergence(message):
    return (message is not None and "the ranks diverged at their event #" in message and "mask its output" in message
            and all(f"the forward of layers.{i}" in message for i in (1, 2)) and "rank 0" in message and "rank 1" in message)


@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_a_rank_that_skips_a_layer_is_caught_and_no_rank_goes_on(checks, mode):
    # Z3, first micro-batch: layer 1's broadcasts would pair with layer 2's; Z2, second micro-batch:
    # the matrices are resident and no dmuon collective would notice. The rank that gets to the
    # layer second raises there, naming it; the other raises when its next wait times out: in a
    # dmuon collective with the same message, or in fully_shard's all-gather with FSDP2's.
    messages = real_use(checks, "divergence")[mode]
    assert all(m is not None for m in messages) and any(_names_the_divergence(m) for m in messages), messages


def test_ranks_with_windows_of_different_lengths_are_told_so_at_the_first_forward_where_they_part(checks):
    # Rank 0 runs 2 micro-batches, rank 1 runs 3: the second is rank 0's last (outside no_sync) and not
    # rank 1's. Both raise, one at once, the other when its wait times out, naming the micro-batch on both.
    messages = real_use(checks, "divergence")["uneven_windows"]
    assert all(m is not None for m in messages), messages
    assert any("in micro-batch 2 of the window, outside no_sync" in m and "in micro-batch 2 of the window, inside "
               "no_sync" in m and "the same number of micro-batches per optimizer step" in m for m in messages), messages


def test_the_order_check_names_both_ranks_and_wraps_around_its_slots(one_rank, monkeypatch):
    # Two ranks' checkers in one process, on one store key, as two ranks would be.
    from dmuon_edu.dmuon import order
    monkeypatch.setattr(order, "SLOTS", 3)
    first, second = (order.CollectiveOrder("test/order", rank, [0, 1], torch.distributed.group.WORLD) for rank in (0, 1))
    for n in range(7):  # more collectives than slots: stale slots are taken over, never mistaken
        for checker in (first, second):
            with checker.collective(f"the broadcast of layers.{n}"):
                pass
    with first.collective("the broadcast of layers.7"):
        pass
    with pytest.raises(RuntimeError, match=r"event #7: rank 1 is about to run the broadcast of layers.8, "
                                           r"but rank 0 ran the broadcast of layers.7"):
        with second.collective("the broadcast of layers.8"):
            pass
    # The rank that went first waits in its collective #8 until the timeout, then reports the divergence.
    with pytest.raises(RuntimeError, match=r"rank 1 is about to run .* \(this rank, 0, was waiting in its event #8"):
        with first.collective("the broadcast of layers.8"):
            raise RuntimeError("Timed out waiting 3000ms")


def _verified_pair(key, step, report_notes=True):
    """Two ranks' checkers in one process, as two ranks would be, after a first step of ``step`` (checked strictly,
    then verified)."""
    from dmuon_edu.dmuon import order
    pair = [order.CollectiveOrder(key, rank, [0, 1], torch.distributed.group.WORLD, report_notes=report_notes)
            for rank in (0, 1)]
    for checker in pair:
        checker.timeout = datetime.timedelta(seconds=0.5)
        checker.check_all(step)
    for checker in pair:
        checker.step_checked()
    return pair


STEP = ["the forward of layers.0", "the broadcast of layers.0", "the reduce of layers.0"]


def test_per_step_on_gloo_meets_no_rank_in_a_step_like_the_last(one_rank):
    first, second = _verified_pair("test/repeat", STEP)
    trips = [c.round_trips for c in (first, second)]
    for description in STEP:
        for checker in (first, second):
            checker.check(description)
    assert [c.round_trips for c in (first, second)] == trips


def test_per_step_on_gloo_keeps_a_bounded_list_of_a_steps_events(one_rank, monkeypatch):
    # a long loop of forwards between two steps (an evaluation, inference) must not grow the list without end
    from dmuon_edu.dmuon import order
    monkeypatch.setattr(order, "STEP_EVENTS_KEPT", 2)
    pair = [order.CollectiveOrder("test/bounded", rank, [0, 1], torch.distributed.group.WORLD) for rank in (0, 1)]
    for checker in pair:
        for description in STEP:
            checker.check(description)
    for checker in pair:
        checker.step_checked()
    assert [checker.expected for checker in pair] == [STEP[:2]] * 2
    assert [checker.step_events for checker in pair] == [0, 0]


def test_per_step_on_gloo_lets_ranks_that_all_take_the_same_turn_go_on(one_rank):
    first, second = _verified_pair("test/turn", STEP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # both wait in the store for the other: two threads
        waiting = pool.submit(first.check, "the forward of layers.0 for an evaluation")
        assert second.check("the forward of layers.0 for an evaluation") == 3
        assert waiting.result(timeout=5) == 3


def test_per_step_on_gloo_names_a_rank_that_ran_the_last_steps_event_where_this_one_turns(one_rank):
    first, second = _verified_pair("test/diverge", STEP)
    first.check("the forward of layers.0")  # as last step: rank 0 reports it is past event 3 and goes on
    with pytest.raises(RuntimeError, match=r"event #3: rank 1 is about to run the forward of layers.0 for an "
                                           r"evaluation, but rank 0 ran the forward of layers.0\. .*evaluate on every"):
        second.check("the forward of layers.0 for an evaluation")


def test_per_step_on_gloo_a_rank_reports_a_forward_only_where_others_collectives_can_follow(one_rank):
    # FSDP2 (or TP) can make a rank wait in its all-gather right after a layer's forward: the forward is reported.
    # The DDP backend's next collective is dmuon's, which reports it (on a busy CPU each write can cost the rank
    # its core: 4 ranks on 2 cores spent 13 ms of a 1.25 s step reporting forwards).
    for report_notes, writes in ((True, 2), (False, 1)):
        first, _ = _verified_pair(f"test/notes-{report_notes}", STEP, report_notes)
        with unittest.mock.patch.object(first, "_report", wraps=first._report) as report:
            first.note(STEP[0])
            first.check(STEP[1])
        assert report.call_count == writes, (report_notes, report.call_args_list)


def test_per_step_on_gloo_a_rank_past_unreported_forwards_is_named_at_its_next_collective(one_rank):
    first, second = _verified_pair("test/unreported", STEP, report_notes=False)
    first.note(STEP[0])  # as last step, and not reported
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(second.note, "the forward of layers.0 for an evaluation")
        first.check(STEP[1])  # reports that it is past both
        with pytest.raises(RuntimeError, match=r"event #3: rank 1 is about to run the forward of layers.0 for an "
                                               r"evaluation, but rank 0 ran the forward of layers.0\."):
            waiting.result(timeout=5)


def test_per_step_on_gloo_a_rank_that_meets_after_unreported_forwards_reports_first(one_rank):
    # Rank 0 passed the forward without a report and turns at the next event; rank 1 turned at the forward. Each
    # waits for the other unless the later one says where it is before it waits: then both raise at once.
    first, second = _verified_pair("test/both-turn", STEP, report_notes=False)
    for checker in (first, second):
        checker.timeout = datetime.timedelta(seconds=60)  # far longer than the test may take
    first.note(STEP[0])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(second.note, "the forward of layers.0 for an evaluation")
        with pytest.raises(RuntimeError, match=r"event #3: rank 1 is about to run the forward of layers.0 for an "
                                               r"evaluation, but rank 0 ran the forward of layers.0\. .* \(this "
                                               r"rank, 0, was waiting for the others at its event #4"):
            first.check("the broadcast of layers.1")
        with pytest.raises(RuntimeError, match=r"event #3: rank 1 is about to run the forward of layers.0 for an "):
            waiting.result(timeout=5)


def test_per_step_on_gloo_a_rank_waiting_at_a_turn_reads_a_refusal_made_elsewhere_at_once(one_rank):
    first, second = _verified_pair("test/refused", STEP)
    second.timeout = datetime.timedelta(seconds=60)  # far longer than the test may take: the refusal must end it
    first.store.compare_set(f"{first.key}/diverged", "", "dmuon: the ranks diverged at their event #9 (a test)")
    with pytest.raises(RuntimeError, match=r"event #9 \(a test\) \(this rank, 1, was waiting for the others at its "
                                           r"event #3, the forward of layers.0 for an evaluation\)"):
        second.check("the forward of layers.0 for an evaluation")


def test_per_step_on_gloo_names_a_rank_that_never_gets_there_at_the_timeout(one_rank):
    _, second = _verified_pair("test/silent", STEP)
    with pytest.raises(RuntimeError, match=r"timed out waiting 0:00:00.500000 \(the collective timeout\) for ranks "
                                           r"\[0\] at this rank's event #3, the forward of layers.0 for an evaluation"):
        second.check("the forward of layers.0 for an evaluation")


def test_autocast_runs_through_dmuon(checks):
    c = real_use(checks, "misuse")
    assert c["autocast_step"] == [None] * len(c["autocast_step"]) and c["autocast_output_dtype"][0] == "torch.bfloat16", c


def test_dmuon_muon_has_the_public_projects_defaults(checks):
    # The groups dmuon.Muon(model) builds, against the public Muon's signature as read from its source
    # (tests/public_signatures.json); the public project scales every matrix as "match_rms_adamw", fixed.
    c = real_use(checks, "public_api")
    public = {name: ast.literal_eval(default) for name, _, default in PUBLIC_SIGNATURES["Muon"] if default is not None}
    assert c["muon_group"] == {**{k: public[k] for k in ("lr", "momentum", "nesterov", "weight_decay", "ns_steps")},
                               "adjust_lr_fn": "match_rms_adamw"}, (c, public)
    assert {**c["adamw_group"], "betas": tuple(c["adamw_group"]["betas"])} == {
        k: public[f"adamw_{k}"] for k in ("lr", "betas", "weight_decay", "eps")}, (c, public)


def test_the_public_checkpoint_flow_restores_every_weight_exactly(checks):
    c = real_use(checks, "public_api")
    # full tensors, on the CPU, on rank 0 only (every rank took part in the collectives)
    assert c["full_on_cpu"] and c["kept_per_rank"][0] == [True, True], c
    assert all(kept == [False, False] for kept in c["kept_per_rank"][1:]), c
    assert c["restored_max_diff"] == 0.0 and c["continued_max_diff"] == 0.0, c


def test_checkpoint_save_refuses_a_state_gathered_to_rank_0_only_on_every_rank(checks):
    # The public default (full state dicts kept on rank 0) through checkpoint.save: marked complete, its resume
    # would find nothing for rank 1. Refused before anything is written, on every rank, naming the options to use.
    c = real_use(checks, "public_api")
    for error in c["refused_rank0_only_save"]:
        assert error and "state['model'] is empty on rank(s) 1" in error and "dmuon.StateDictOptions()" in error, c


def test_set_model_state_dict_accepts_gradient_tracking_tensors(checks):
    assert real_use(checks, "public_api")["from_tracking_max_diff"] == 0.0, real_use(checks, "public_api")


def test_clip_grad_norm_of_the_optimizer_measures_the_muon_gradients_only(checks):
    # float32 sums in another order, over shards and ranks: ~1e-7 relative
    assert real_use(checks, "public_api")["muon_norm_rel_diff"] < 1e-5, real_use(checks, "public_api")


@pytest.mark.parametrize("name", ["compiled", "compiled_ddp"])  # Z3, and the DDP backend
def test_per_block_torch_compile_equals_eager_and_does_not_recompile(checks, name):
    # torchtitan's recipe: each block in a checkpoint_wrapper, then torch.compile'd, then dmuon
    c = real_use(checks, name)
    # aot_eager runs eager kernels after decompositions: float32 reordering at most (measured: 0.0 on both;
    # a non-owner's matrix is a plain Parameter while its layer runs, as an owner's is, so every block's guards
    # see the same types)
    assert c["max_abs_diff"] < TOLERANCE, c
    # Graphs compiled so far, per rank, after each step (Dynamo's recompile limit is raised and reaching it
    # fails: no silent fallback to eager). Warm-up is two steps on rank 0 (the first also initialises FSDP2
    # and the optimizer state; the second recompiles with a dynamic batch size) and three on rank 1, whose third
    # step is its first with one-sample micro-batches (Dynamo specialises size 1); then no new graph.
    for graphs in c["graphs_after_each_step"]:
        assert graphs[0] > 0 and len(set(graphs[2:])) == 1, c
    assert len(set(c["graphs_after_each_step"][0][1:])) == 1, c


@pytest.mark.parametrize("record, nproc", [("compiled_graphs", 2), ("compiled_graphs_tp", 4)])
def test_compiled_blocks_have_as_many_graphs_under_dmuon_as_alone(checks, record, nproc):
    # Each block compiled in torchtitan's order, wrapping or in place, with and without checkpoint_wrapper, under
    # every layout: Dynamo's unique graphs on each rank, after two windows, against the same blocks alone. A graph
    # break (a dmuon hook inside the compiled region) or a recompile (a parameter whose type depends on its owner)
    # would add graphs; a break inside a checkpointed region drops the whole block to eager (0 graphs).
    if checks["nproc"] != nproc or GPUS:
        pytest.skip(f"counted on {nproc} CPU ranks")
    counted = checks[record]["graphs"]
    layouts = {key.split("; ")[0] for key in counted}
    styles = {key.split("; ")[1] for key in counted}
    # every style on the 1-D layouts; on TP, torchtitan's recipe (checkpointed, wrapping) and its opposite
    assert layouts == ({"alone", "z3", "z2", "ddp", "hsdp"} if nproc == 2 else {"tp alone", "tp", "ddp_tp"}), counted
    assert len(styles) == (4 if nproc == 2 else 2) and len(counted) == len(layouts) * len(styles), counted
    alone = "alone" if nproc == 2 else "tp alone"
    for style in styles:
        expected = counted[f"{alone}; {style}"]
        assert all(graphs >= 1 and breaks == 0 for graphs, breaks in expected), (style, expected)
        for layout in layouts - {alone}:
            assert counted[f"{layout}; {style}"] == expected, (layout, style, counted)


# --------------------------------------------- the public API: hook boundaries, groups, policies, diagnostics
def test_mha_trains_in_z3_z2_and_on_the_ddp_backend_with_a_hook_boundary_predicate(checks):
    # nn.MultiheadAttention at the root reads out_proj.weight without calling out_proj; its module is the hook
    # boundary. Against one process: the same float32 reordering as the other equivalence checks.
    c = real_use(checks, "hook_boundaries")
    for mode in ("z3", "z2", "ddp"):
        assert c[mode]["max_abs_diff"] < TOLERANCE and c[mode]["largest_change"] > 1000 * TOLERANCE, c
        assert c[mode]["units"] == ["pool"] and c[mode]["storage_ok"], c


def test_without_a_hook_boundary_the_read_in_forward_is_refused_naming_the_fix(checks):
    c = real_use(checks, "hook_boundaries")
    refused = [m for m in c["without_boundary"] if m is not None]
    assert refused and all("hook_boundary_predicate" in m and "MultiheadAttention" in m for m in refused), c
    assert all(m and "hook_boundary_predicate matched no module" in m for m in c["strict"]), c  # on every rank
    assert c["resolver_units"] == ["pool"], c


@pytest.mark.parametrize("record", ["frozen", "frozen_tp"])  # 1-D FSDP2; FSDP2 + TP, the frozen matrix a TP shard
def test_a_frozen_dedicated_matrix_is_freed_after_its_layers_backward_in_z3(checks, record):
    # It gets no gradient hook; it used to stay on the non-owner from its first backward until step(). Under TP it
    # used to take the step's weight decay (its TP owner stepped a zero update and its DP owners decayed the shard).
    c = two_by_two(checks, record) if record.endswith("tp") else real_use(checks, record)
    assert c["looked"] == 6 and c["layer2_held_in_layer0_backward"] == [False] * c["nproc"], c
    assert c["frozen_change"] == 0.0 and c["storage_ok"], c
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    # one window of Z3 with no_sync: the frozen matrix is broadcast 2N times (N micro-batches) like the others but never reduced,
    # and summarize_comm_plan plans exactly that (under TP, of this rank's halves)
    shards = 2 if record.endswith("tp") else 1
    for plan, counted in zip(c["plan"], c["counted"]):
        assert counted["reduce"] == plan["reduce"] == (c["dedicated_bytes"] - c["frozen_bytes"]) // shards, c
        assert counted["broadcast"] == 2 * c["k"] * plan["broadcast"] == 2 * c["k"] * c["dedicated_bytes"] // shards, c


def test_param_groups_and_policy_routes_train_like_one_process_and_resume(checks):
    # Two semantic groups (no weight decay for 1-D parameters; other learning rates for matrices), one matrix
    # routed to AdamW on its owner, one to sharded AdamW (left to fully_shard): against one process with the
    # same groups. AdamW on a whole matrix and on its shards is the same elementwise arithmetic.
    c = real_use(checks, "param_groups")
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    assert c["groups"] == ["no_decay/muon", "no_decay/adamw", "rest/muon", "rest/adamw"], c
    assert c["kinds"] == {"layers.0.q_proj.weight": "dtensor", "layers.0.k_proj.weight": "dedicated"}, c
    assert c["exp_avg_saved"] and c["continued_max_diff"] == 0.0, c


def test_param_groups_and_policies_refuse_by_name(checks):
    r = real_use(checks, "param_groups")["refusals"]
    assert all(m and "unknown key(s) ['betas']" in m and "adamw_betas" in m for m in r["unknown_key"]), r
    assert all(m and "leaves out" in m and "layers.0.k_proj.weight" in m for m in r["left_out"]), r
    assert all(m and "output_dtype" in m and "MixedPrecisionPolicy" in m for m in r["output_dtype"]), r
    assert all(m and "master_dtype=torch.bfloat16" in m for m in r["master_dtype"]), r


def test_ns_backend_with_the_public_polar_express_coefficients_matches_one_process(checks):
    c = real_use(checks, "ns_backend")
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    # the coefficients do reach the update: the Jordan reference ends 600 x TOLERANCE away
    assert c["differs_from_jordan"] > 100 * TOLERANCE, c


PUBLIC_SUMMARY_KEYS = ["available", "dedicated_param_count", "groups", "num_groups", "owned_dedicated_param_count",
                       "parameters", "parameters_truncated"]
PUBLIC_GROUP_KEYS = ["adamw_param_count", "dedicated_adamw_param_count", "dedicated_muon_param_count",
                     "dedicated_param_count", "group_index", "group_name", "optimizer_param_count",
                     "owned_dedicated_param_count", "route_param_counts", "semantic_group_name", "subgroup_type",
                     "use_muon"]
PUBLIC_ROW_KEYS = ["cast_forward_inputs", "grad_dtype", "group_index", "group_name", "is_dtensor", "is_owner",
                   "master_dtype", "matched_policy_overrides", "name", "numel", "optim_dtype", "output_dtype",
                   "owner_rank", "param_dtype", "param_name", "route", "shape", "uses_sharded_adamw"]
PUBLIC_PLAN_KEYS = ["available", "group_count", "groups", "groups_truncated", "totals"]
PUBLIC_PLAN_GROUP_KEYS = ["debug_name", "group_index", "owner_bucket_bytes", "owner_bucket_bytes_in_order",
                          "owner_bucket_count", "owner_buckets", "param_collectives", "param_collectives_truncated",
                          "param_count", "replicate_rank", "shard_rank"]
PUBLIC_PLAN_TOTALS = ["dedicated_local_bytes", "max_owner_bucket_bytes", "owner_update_ring_bytes_per_rank",
                      "post_step_replicate_broadcast_tensor_bytes_this_rank", "same_payload_allreduce_ring_bytes_per_rank",
                      "stage1_shard_reduce_ring_bytes_per_rank", "stage1_shard_reduce_tensor_bytes",
                      "stage2_replicate_reduce_tensor_bytes_this_rank"]


def test_the_summaries_have_the_public_keys_and_this_ranks_facts(checks):
    c = real_use(checks, "param_groups")
    summaries = c["summaries"]
    for s in summaries:
        assert s["keys"] == PUBLIC_SUMMARY_KEYS and s["group_keys"] == PUBLIC_GROUP_KEYS, s
        assert set(PUBLIC_ROW_KEYS) <= set(s["row_keys"]) and s["plan_keys"] == PUBLIC_PLAN_KEYS, s
        assert set(PUBLIC_PLAN_GROUP_KEYS) == set(s["plan_group_keys"]) and set(PUBLIC_PLAN_TOTALS) <= set(s["plan_total_keys"])
        assert s["routes"]["layers.0.k_proj.weight"] == "adamw" and s["text_names_everything"], s
    # each dedicated matrix is owned on exactly one rank (the counts are rank-local)
    assert sum(s["owned"] for s in summaries) == summaries[0]["dedicated"] == 11, summaries


def test_clip_grad_norm_returns_the_public_statistics_and_measures_only_with_none(checks):
    c = real_use(checks, "public_api")
    for s in c["stats"]:  # every rank
        assert s["fields"] == CLIP_STATS_FIELDS, s
        assert s["max_norm"] is None and s["clip_coef"] == 1.0 and s["clipped"] is False and s["unchanged"], s
        assert s["param_count"] == s["owned_muon"] and s["found_inf"] is False and s["strategy"] == "global_norm"
        assert s["zero_dim"] and s["kept"], s
    # the model form with max_norm=None, in the 2-norm and in the max-norm: float32 sums in another order
    assert c["full_norm_rel_diff"] < 1e-5 and c["inf_norm_rel_diff"] < 1e-5, c


def test_compute_dtype_computes_in_bf16_without_a_policy_and_a_disagreement_is_refused(checks):
    # dedicate_params(model, mesh, predicate, torch.bfloat16, True): the public positional order. Under autocast
    # the reference casts the same float32 weights to bf16: float32's tolerance after the first step.
    c = real_use(checks, "compute_dtype_z3")
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    assert c["forward_dtypes"] == ["torch.bfloat16"] and c["master_dtypes"] == ["torch.float32"], c
    assert c["broadcast_bytes"] == c["dedicated_bytes_fp32"] // 2 * 2 * c["k"], c
    assert all(m and "compute_dtype (param_dtype) torch.float16" in m and "torch.bfloat16" in m for m in c["refused"]), c


def test_the_ddp_backend_under_autocast_with_a_bf16_compute_dtype_matches_one_process(checks):
    # dedicate_params_ddp(..., compute_dtype=torch.bfloat16), the forward under torch.autocast, float32 masters,
    # against the same reference and tolerance as the FSDP2 run above (one step).
    c = real_use(checks, "compute_dtype_z3_ddp")
    assert c["max_abs_diff"] < TOLERANCE and c["largest_change"] > 1000 * TOLERANCE, c
    assert c["forward_dtypes"] == ["torch.bfloat16"], c
    assert c["master_dtypes"] == c["momentum_dtypes"] == ["torch.float32"], c
    assert c["broadcast_bytes"] == c["dedicated_bytes_fp32"], c  # no broadcast before a forward; float32 after the step


@pytest.mark.parametrize("layout", ["", "_ddp", "_tp", "_ddp_tp"])  # FSDP2, the DDP backend, and both with TP
def test_a_checkpoint_with_checkpoint_wrapper_resumes_without_it_and_back_bit_identically(checks, layout):
    name = f"wrapped_checkpoints{layout}"
    c = two_by_two(checks, name) if layout.endswith("tp") else real_use(checks, name)
    for direction in ("saved_wrapped", "saved_plain"):
        assert c[direction] == {"wrapper_in_keys": [], "restored_max_diff": 0.0, "continued_max_diff": 0.0}, c


@pytest.mark.parametrize("record", ["partial_clip", "ddp_partial_clip"])  # FSDP2 and the DDP backend
def test_torch_clip_of_the_model_parameters_is_partial_and_step_warns_on_every_rank(checks, record):
    c = real_use(checks, record)
    assert c["torch"] < 0.9 * c["global"], c  # it saw the other parameters' gradients only
    assert all(len(w) == 1 and "dmuon.clip_grad_norm_(model, max_norm)" in w[0] for w in c["warned"]["torch"]), c
    assert c["warned"]["none"] == c["warned"]["dmuon"] == [[]] * c["nproc"], c
    # dmuon's clip of the model, on every rank: the fields of MuonGradClipStats it returns.
    assert c["stats"] == [{"max_norm": 1e-3, "norm_type": 2.0, "clipped": True, "clip_coef_below_1": True,
                           "found_inf": False, "strategy": "global_norm"}] * c["nproc"], c
    if record == "ddp_partial_clip":  # the global norm is the full batch's: float32 sums in another order
        assert abs(c["global"] - c["reference"]) < 1e-5 * c["reference"], c


def test_the_order_check_per_step_costs_no_round_trip_after_the_first_step_and_still_names_divergences(checks):
    c = real_use(checks, "order_modes")
    # the first step checks every event through the store; a step like the last makes no round trip (on gloo a
    # one-way write per event); a step every rank changes alike (an evaluation first) meets in the store, and so
    # does the next (it differs from that one); then none again. "off" makes none.
    trips = c["round_trips"]  # rank 0's
    assert trips["step_0"] > 0 and trips["step_1"] == 0, c
    assert trips["step_2"] > 0 and trips["step_3"] > 0 and trips["step_4"] == 0, c
    assert trips["off"] == 0, c
    # the DDP backend: its post-step broadcasts close the step that issued them, so its second step is like its first
    assert trips["ddp_backend_step_0"] > 0 and trips["ddp_backend_step_1"] == trips["ddp_backend_step_2"] == 0, c
    # swapped layers, resident in Z2: on gloo the rank that swapped meets a peer already past that forward and
    # names both forwards at once; the peer raises at its next wait's timeout, in one of dmuon's collectives with
    # that message or in one of fully_shard's with FSDP2's
    assert all(message is not None for message in c["forward"]), c
    assert any(message and "the ranks diverged at their event #" in message and "the forward of layers.1" in message
               and "the forward of layers.2" in message for message in c["forward"]), c
    # ... and as on NCCL, step() refuses on every rank, naming both
    for message in c["step"]:
        assert message and "refused the step on every rank" in message, c
        assert "the forward of layers.1" in message and "the forward of layers.2" in message, c
    # a wait that timed out: the ranks' logs name the first event where they differ
    for message in c["timeout"]:
        assert message and "the ranks diverged at their event #" in message and "until the timeout" in message, c
        assert "a test broadcast of" in message and "from rank 0" in message and "from rank 1" in message, c


def test_the_checks_channel_keeps_every_record_whole_with_writers_in_parallel(tmp_path):
    # The channel's promise: one write per record, so records never interleave, even with several writers.
    records = tmp_path / "checks.jsonl"
    writer = ("import sys; sys.path.insert(0, sys.argv[1]); import check_channel; "
              "[check_channel.report({'name': f'{sys.argv[2]}-{i}', 'payload': 'x' * 5000}) for i in range(200)]")
    env = {**os.environ, check_channel.ENV: str(records)}
    writers = [subprocess.Popen([sys.executable, "-c", writer, str(DIST), str(w)], env=env) for w in range(4)]
    assert all(w.wait(timeout=60) == 0 for w in writers)
    lines = records.read_text().splitlines()
    assert len(lines) == 800 and len({json.loads(line)["name"] for line in lines}) == 800


# ----------------------------------------------- the public API, in this process (one rank, or no group)
def test_polar_express_coefficients_are_the_public_ones():
    # The Polar Express paper's (arXiv:2505.16932) tuples at x / 1.05, as the public dmuon project exports
    # them: its first and last tuple, written out.
    assert len(dmuon.POLAR_EXPRESS_COEFFICIENTS) == 5
    assert dmuon.POLAR_EXPRESS_COEFFICIENTS[0] == pytest.approx(
        (7.892582874424408, -20.38301394587957, 13.555306149406924), rel=1e-15)
    assert dmuon.POLAR_EXPRESS_COEFFICIENTS[-1] == pytest.approx(
        (2.1910971618617303, -1.441662010214663, 0.328146487623155), rel=1e-15)
    assert dmuon.YOU_COEFFICIENTS[0] == [4.0848, -6.8946, 2.9270]


def test_ns_backend_gram_and_direct_map_onto_newton_schulz():
    from dmuon_edu.newton_schulz import newton_schulz
    G = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))  # wide enough for Gram space
    gram, direct = dmuon.NewtonSchulz("gram"), dmuon.NewtonSchulz("direct")
    assert torch.equal(gram.orthogonalise(G, 5, torch.float32), newton_schulz(G, 5, dtype=torch.float32))
    assert torch.equal(direct.orthogonalise(G, 5, torch.float32),
                       newton_schulz(G, 5, dtype=torch.float32, gram_space=False))
    assert not torch.equal(gram.orthogonalise(G, 5, torch.float32), direct.orthogonalise(G, 5, torch.float32))
    for bad, match in [(dict(backend="syrk"), "'gram' or 'direct'"), (dict(kernel="quack"), "SYRK kernels"),
                       (dict(restart_iterations=[2]), "restart_iterations")]:
        with pytest.raises(ValueError, match=re.escape(match)):
            dmuon.NewtonSchulz(**bad)
    with pytest.raises(TypeError, match=re.escape("(a, b, c) tuple of numbers")):
        dmuon.NewtonSchulz(coefficients=[(1, 2)])


def test_the_public_getters_describe_the_dedicated_matrices(one_rank_mesh):
    # The records the public examples print (examples/basic_dp.py, examples/tp_dp.py); one rank owns everything.
    model = Tiny()
    dmuon.dedicate_params(model, one_rank_mesh, is_dedicated)
    fully_shard(model, mesh=one_rank_mesh)
    records = dmuon.get_dedicated_params(model)
    assert [r.param_name for r in records] == list(dmuon.ownership(model)) == ["layers.0.up_proj.weight",
                                                                                "layers.1.up_proj.weight"]
    for r in records:
        assert r.owner_rank == (0, 0) and r.owner_shard == 0 and r.owner_replicate == 0 and r.is_owner, r
        assert r.full_shape == r._orig_size == (4, 4) and r.numel == 16, r
        assert r.shard_dim is None and r.tp_group is None and not r.is_tp_owner, r
        assert r.param is model.get_parameter(r.param_name)
    for rank in (0, (0, 0)):
        assert [r.param_name for r in dmuon.get_owned_params(model, rank=rank)] == [r.param_name for r in records]
    assert dmuon.get_owned_params(model, rank=1) == []
    with pytest.raises(TypeError, match="rank must be a shard index"):
        dmuon.get_owned_params(model, rank="0")


def test_the_public_newton_schulz_names_are_dmuon_edus_newton_schulz():
    from dmuon_edu.newton_schulz import newton_schulz
    G = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(dmuon.newton_schulz(G), newton_schulz(G, 5, dtype="auto"))
    assert torch.equal(dmuon.gram_newton_schulz(G, 3, coefficients=dmuon.POLAR_EXPRESS_COEFFICIENTS, deterministic=True),
                       newton_schulz(G, 3, coefficients=dmuon.POLAR_EXPRESS_COEFFICIENTS, dtype="auto"))
    with pytest.raises(ValueError, match="restart_iterations cannot be chosen here"):
        dmuon.newton_schulz(G, restart_iterations=[2])
    assert dmuon.get_ns_backend().startswith("Gram NS · kernel=cublas (")
    status = dmuon.get_backend_status()
    assert sorted(status) == ["auto_choice", "cublas_always_available", "cute_sm80_available", "quack_available",
                              "sm_version"], status
    assert status["auto_choice"] == "cublas" and not status["quack_available"] and status["cublas_always_available"]


def test_the_public_basic_dp_example_runs_with_only_device_backend_import_and_sizes_changed(checks):
    # examples/basic_dp.py of the public dmuon (dmuon_checks.PUBLIC_EXAMPLES_COMMIT), its calls in its order: it used
    # to stop at get_owned_params. Every rank's records are the matrices ownership() gives it, all of them between
    # the ranks; the checkpoint's documented round trip (torch.save on rank 0, torch.load everywhere) is exact.
    c = real_use(checks, "public_basic_dp")
    assert all(c["owned"][rank] == sorted(n for n, owner in c["ownership"].items() if owner == rank)
               for rank in range(2)), c
    assert sum(c["owned_elements"]) == 2 * 3 * 16 * 32, c  # 2 blocks of gate, up and down: 16 x 32 each
    assert c["ns_backend"].startswith("Gram NS · kernel=") and c["losses_finite"], c
    assert c["reloaded_max_diff"] == 0.0, c


def test_the_public_tp_dp_example_runs_with_only_device_backend_import_and_sizes_changed(checks):
    # examples/tp_dp.py of the public dmuon on (dp, tp) = (2, 2), its record inspection included: each record of
    # DP shard 0's matrices is a TP shard of half the matrix along its sharded dim (0 colwise, 1 rowwise), over a
    # TP group of 2, and within each TP group exactly one rank orthogonalises each matrix.
    c = two_by_two(checks, "public_tp_dp")
    by_rank = c["owned_by_shard_0"]
    assert by_rank[0] and c["losses_finite"] and c["ns_backend"].startswith("Gram NS · kernel="), c
    for records in by_rank:
        for r in records:
            assert r["shard_dim"] == (1 if r["name"].split(".")[-2] in ("o_proj", "down_proj") else 0), r
            assert r["tp_size"] == 2 and 2 * r["local"][r["shard_dim"]] == r["full"][r["shard_dim"]], r
    for group in ((0, 1), (2, 3)):
        owners = {}
        for rank in group:
            for r in by_rank[rank]:
                owners[r["name"]] = owners.get(r["name"], 0) + r["is_tp_owner"]
        assert owners and set(owners.values()) == {1}, (group, owners)


def test_param_policies_resolve_in_order_with_the_public_spellings():
    from dmuon_edu.dmuon.policy import resolve_param_policies
    params = {name: nn.Parameter(torch.zeros(2, 2)) for name in
              ("layers.0._checkpoint_wrapped_module.attn.q.weight", "layers.0.mlp.up.weight", "lm_head.weight")}
    policy = {"defaults": {"param_dtype": "bf16"},
              "overrides": [{"name": ["mlp", "lm_head"], "set": {"route": "base"}},  # the public alias of "adamw"
                            {"contains": "lm_head", "set": {"route": "sharded", "grad_dtype": "fp32"}}]}
    resolved = resolve_param_policies(params, None, policy)
    q, up, head = resolved.values()
    assert (q.route, q.param_dtype, q.matched_overrides) == (None, torch.bfloat16, ())
    assert (up.optimizer, up.matched_overrides) == ("adamw", (0,))
    assert (head.route, head.grad_dtype, head.matched_overrides) == ("sharded_adamw", torch.float32, (0, 1))
    by_fn = resolve_param_policies(params, torch.float16, param_policy_fn=lambda n, p: {"route": "adamw"} if "q" in n else None)
    assert [p.optimizer for p in by_fn.values()] == ["adamw", "muon", "muon"] and by_fn[next(iter(params))].param_dtype == torch.float16
    with pytest.raises(ValueError, match="not both"):
        resolve_param_policies(params, None, policy, lambda n, p: None)
    with pytest.raises(ValueError, match=r"unknown policy field\(s\) \['rout'\]"):
        resolve_param_policies(params, None, {"defaults": {"rout": "adamw"}})
    with pytest.raises(ValueError, match="muon_forward_unshard='all_gather'"):
        resolve_param_policies(params, None, {"defaults": {"muon_forward_unshard": "all_gather"}})


def test_names_drop_wrapper_segments_in_both_state_dicts(one_rank):
    from dmuon_edu.dmuon.names import fqn
    assert fqn("layers.0._checkpoint_wrapped_module.attn._orig_mod.q_proj.weight") == "layers.0.attn.q_proj.weight"
    model = Tiny()
    model.layers[0] = torch.compile(model.layers[0], backend="eager")  # names gain "_orig_mod." (never called)
    assert any("_orig_mod" in n for n, _ in model.named_parameters())
    dmuon.dedicate_params(model, one_rank, is_dedicated)
    fully_shard(model, mesh=one_rank)
    opt = dmuon.Muon(model)
    weights = dmuon.get_model_state_dict(model)
    optimizer_state = dmuon.get_optimizer_state_dict(model, opt)
    assert not [k for k in [*weights, *optimizer_state["state"]] if "_orig_mod" in k]
    assert "layers.0.up_proj.weight" in weights and "layers.0.up_proj.weight" in optimizer_state["state"]
    dmuon.set_model_state_dict(model, state_dict=weights)
    dmuon.set_optimizer_state_dict(model, opt, state_dict=optimizer_state)


def test_order_check_and_hook_boundary_arguments_are_checked(one_rank):
    model = Tiny()
    dmuon.dedicate_params(model, one_rank, is_dedicated)
    fully_shard(model, mesh=one_rank)
    with pytest.raises(ValueError, match="order_check must be one of 'strict', 'per_step', 'off'"):
        dmuon.Muon(model, order_check="sometimes")
    with pytest.raises(TypeError, match="hook_boundary_strict must be True or False"):
        dmuon.dedicate_params(Tiny(), one_rank, is_dedicated, hook_boundary_strict="yes")
    with pytest.raises(TypeError, match="hook_boundary_predicate must be a callable"):
        dmuon.dedicate_params(Tiny(), one_rank, is_dedicated, hook_boundary_predicate="MultiheadAttention")


def test_the_public_tp_dp_snippet_runs_unchanged_and_matches_one_process():
    # 4 gloo ranks as (dp, tp) = (2, 2), Z3, 3 steps, float32 Newton-Schulz on both sides. Each TP-sharded matrix's
    # TP owner orthogonalises the whole gathered matrix, so the only difference from one process is the order of
    # float32 sums (the AVG reduce, TP's partial sums): measured 4.3e-7 on a 2-core x86_64 CPU; 1e-5 as above.
    result = torchrun(DIST / "tp_dp_snippet.py", nproc=4, timeout=180, echo=False)
    diffs = [float(line.rsplit("=", 1)[1]) for line in result.stdout(0).splitlines() if line.startswith("step ")]
    assert len(diffs) == 3 and max(diffs) < TOLERANCE, result.stdout(0)
    # The same launch, beyond the public example. One step (Z3, no micro-batches) as summarize_comm_plan plans it
    # and count_comm counts it, on every rank: the broadcast twice (forward, backward), the reduce once, the TP
    # gather and scatter as planned.
    for rank in range(4):
        [line] = [line for line in result.stdout(rank).splitlines() if line.startswith("plan ")]
        plan = json.loads(line.removeprefix("plan "))
        planned, counted = plan["planned"], plan["counted"]
        assert counted["broadcast"] == 2 * planned["broadcast_tensor_bytes"] > 0, plan
        assert counted["reduce"] == planned["stage1_shard_reduce_tensor_bytes"], plan
        assert counted["gather"] == planned["tp_gather_tensor_bytes_this_rank"] > 0, plan
        assert counted["scatter"] == planned["tp_scatter_tensor_bytes_this_rank"] > 0, plan
        # the order check (per_step): every axis's events went through the store until the first step checked
        # them, and the second step (its state dict's collectives came first) met there; the fourth is like the
        # third, so no axis makes a round trip, though each ran collectives
        assert all(n > 0 for n in plan["round_trips_in_steps_1_to_3"]), plan
        assert plan["round_trips_in_step_4"] == [0] * len(plan["round_trips_in_steps_1_to_3"]), plan
        assert all(n > 0 for n in plan["collective_events_in_step_4"]), plan
    # param_groups, the Polar Express ns_backend, a hook boundary predicate and clip_grad_norm_ (the optimizer's
    # form measuring the Muon gradients, the model's clipping every one to 1) on TP against one process with the
    # same groups, coefficients and clipping, 2 steps: the same float32 reordering as above, and the norms' too
    [line] = [line for line in result.stdout(0).splitlines() if line.startswith("api ")]
    api = json.loads(line.removeprefix("api "))
    assert api["max_abs_diff"] < TOLERANCE and api["largest_change"] > 1000 * TOLERANCE, api
    assert all(muon < 1e-5 and full < 1e-5 and norm > 1.0 for muon, full, norm in api["norm_rel_diffs"]), api
    assert api["groups"] == ["no_decay/muon", "no_decay/adamw", "rest/muon", "rest/adamw"], api
    assert api["units"] == ["layers.0", "layers.1"], api
    assert api["round_trips_with_order_check_off"] == [0, 0], api  # order_check="off" reaches the TP group's too


def test_a_publishing_matrix_keeps_its_own_class_and_a_read_whose_result_cannot_come_is_refused():
    # In one process, without a broadcast: publishing() marks a matrix whose step result is on its way; its
    # first read calls land(), which (as the state's publisher does) lands it with landed().
    from dmuon_edu.dmuon import placeholder
    from dmuon_edu.dmuon.record import MatrixRecord, attach

    def recorded(p):  # what dedicate_params gives each matrix: its record
        attach(p, MatrixRecord("w", holder=0, replica=0, owner_rank=0, shape=p.shape, dtype=p.dtype,
                               policy=dmuon.DMuonParamPolicy(), own_class=type(p)))
        return p

    class UsersParameter(nn.Parameter):  # a user's Parameter subclass keeps its class across the publish
        pass

    p = recorded(UsersParameter(torch.ones(2, 2)))
    lands = []
    land = lambda: (lands.append(1), placeholder.landed(p))  # noqa: E731
    placeholder.publishing(p, land)
    placeholder.publishing(p, land)  # a second publish before any read
    assert torch.equal(p.clone(), torch.ones(2, 2)) and lands == [1] and type(p) is UsersParameter
    # A mark that no broadcast in flight will land (a step that failed part way): every read is refused by name,
    # where the Python-level reads (torch.save, deepcopy) recursed without end.
    q = recorded(nn.Parameter(torch.ones(3)))
    placeholder.publishing(q, lambda: None)
    for read in (q.clone, lambda: torch.save(q, io.BytesIO())):
        with pytest.raises(RuntimeError, match="still waiting for its step result"):
            read()
