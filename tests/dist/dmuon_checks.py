"""Many dmuon checks in one torchrun launch (tests/test_dmuon.py launches it on 2 and 4 ranks).

    CHECKS_FILE=checks.jsonl torchrun --nproc-per-node=2 tests/dist/dmuon_checks.py CHECKPOINT_DIR MARKS_DIR

The 4 ranks are two torchrun agents of 2 ranks each, as on two machines, that meet at a c10d rendezvous:

    AGENT=a CHECKS_FILE=checks.jsonl torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:PORT tests/dist/dmuon_checks.py CHECKPOINT_DIR MARKS_DIR   (and the same with AGENT=b)

Ranks are numbered node rank * 2 + local rank, so the rows of the (replicate, shard) mesh of HSDP are the
nodes; check_placement reports where each rank is. Every other check is the same as on one agent.

Rank 0 writes one JSON record per check, with the measured quantities, into the file
CHECKS_FILE names (check_channel.py); the test file holds the tolerances and asserts. Every rank builds the same global data
from a seed and takes its own slice, so rank 0 can train the single-process reference
locally: a plain copy of the model on the whole global batch, dmuon_edu.muon.Muon
(float32 Newton-Schulz) on the dedicated matrices and torch.optim.AdamW on the rest.
"""

import atexit
import contextlib
import copy
import datetime
import io
import math
import os
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import check_channel
from dmuon_edu import checkpoint as checkpoints, distributed, dmuon, muon
from dmuon_edu.course.dmuon_problem import is_dedicated as predicate, per_rank
from dmuon_edu.dmuon import step_time
from dmuon_edu.dmuon.names import fqn
from dmuon_edu.dmuon.placeholder import is_resident
from dmuon_edu.newton_schulz import newton_schulz

IN, D, H, OUT, LAYERS = 5, 16, 32, 3, 3
HYPER = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn="original", ns_steps=5)
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
MAX_NORM = 0.5
DEVICE = ["cpu"]  # the mesh's device: cpu with gloo, cuda with NCCL (set in main)
K = 3  # micro-batches per optimizer step
STEPS = 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q_proj = nn.Linear(D, D, bias=False)  # q and k: same shape, batched through NS
        self.k_proj = nn.Linear(D, D, bias=False)
        self.up_proj = nn.Linear(D, H)  # its bias stays with FSDP2
        self.down_proj = nn.Linear(H, D, bias=False)

    def forward(self, x):
        h = self.norm(x)
        x = x + torch.tanh(self.q_proj(h)) * self.k_proj(h)
        return x + self.down_proj(F.gelu(self.up_proj(self.norm(x))))


class Net(nn.Module):
    def __init__(self, tied=False, checkpointed=False):
        super().__init__()
        self.checkpointed = checkpointed  # non-reentrant activation checkpointing of every layer
        self.dropped = set()  # layers this rank skips, as LayerDrop would with a per-rank random draw
        self.run_order = None  # the order this rank runs the layers in (None: 0, 1, 2, ...)
        self.boxed = False  # return the output in an object FSDP2 does not look into, as model(...).loss would
        self.embed = nn.Linear(IN, D)  # 2-D but not selected: AdamW
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, OUT)  # 3 rows over 4 ranks: uneven FSDP2 shards
        if tied:  # one matrix reached from two layers (cross-layer sharing, as in ALBERT)
            self.layers[2].up_proj.weight = self.layers[0].up_proj.weight

    def forward(self, x):
        x = self.embed(x)
        for i in self.run_order or range(len(self.layers)):
            if i in self.dropped:
                continue
            layer = self.layers[i]
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        return Boxed(self.head(x)) if self.boxed else self.head(x)


class Boxed:
    def __init__(self, value):
        self.value = value


class Pooled(nn.Module):
    """nn.MultiheadAttention at the root, which reads out_proj.weight without calling out_proj."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(1, D)  # each sample becomes a sequence of IN tokens
        self.pool = nn.MultiheadAttention(D, 2, bias=False, batch_first=True)  # no bias: its key part has a zero gradient, noise that AdamW would scale up
        self.head = nn.Linear(D, OUT)

    def forward(self, x):
        h = self.embed(x.unsqueeze(-1))
        h, _ = self.pool(h, h, h, need_weights=False)
        return self.head(h.mean(dim=1))


class PooledTP(Pooled):
    """Pooled with one Block before the pool, for tensor parallelism: parallelize() shards the block's matrices over
    the TP axis, while the nn.MultiheadAttention stays replicated over it (torch has no TP plan for it: its packed
    in_proj cannot be column-split as is)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block()])

    def forward(self, x):
        h = self.layers[0](self.embed(x.unsqueeze(-1)))
        h, _ = self.pool(h, h, h, need_weights=False)
        return self.head(h.mean(dim=1))


def pooled_tp_boundary(module):
    """PooledTP's hook boundaries: the MHA (it reads out_proj.weight itself) and the block."""
    return isinstance(module, (nn.MultiheadAttention, Block))


def pooled_matrices(name, p):
    return name.startswith("pool.") and p.ndim == 2  # in_proj_weight, out_proj.weight


# When this rank last reported: each record carries the seconds since then, the work that produced it (a check
# that reports several records is costed on its first). tests/test_dmuon.py prints the costliest checks.
LAST_REPORT = [time.perf_counter()]


def report(name, **measured):
    now = time.perf_counter()
    seconds, LAST_REPORT[0] = now - LAST_REPORT[0], now
    if dist.get_rank() == 0:
        check_channel.report({"name": name, "nproc": dist.get_world_size(), "seconds": round(seconds, 2), **measured})


def window(step, rank, world):
    """Micro-batch sizes (unequal across micro-batches and ranks) and this step's global data."""
    sizes = [[1 + (3 * r + 5 * j + step) % 5 for j in range(K)] for r in range(world)]
    total = sum(map(sum, sizes))
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(total, IN, generator=g)
    y = torch.randn(total, OUT, generator=g)
    offsets = torch.tensor([0] + [s for row in sizes for s in row]).cumsum(0).tolist()
    device = DEVICE[0]
    mine = [(x[offsets[rank * K + j]:offsets[rank * K + j + 1]].to(device),
             y[offsets[rank * K + j]:offsets[rank * K + j + 1]].to(device)) for j in range(K)]
    return mine, (x, y), total


HSDP_MESH = []  # built once: (replicate, shard) = (2, world / 2)


def hsdp_mesh(device_type):
    if not HSDP_MESH:
        HSDP_MESH.append(init_device_mesh(device_type, (2, dist.get_world_size() // 2),
                                          mesh_dim_names=("replicate", "shard")))
    return HSDP_MESH[0]


def check_placement():
    """Where each rank is: its agent (AGENT, set by the test for each of two agents; None with one), node rank
    and local rank, and its groups on the 2 x 2 HSDP mesh: one shard group per node, the replicate groups
    across the nodes, when the ranks are numbered node by node."""
    mesh = hsdp_mesh(DEVICE[0].type)
    where = {"rank": dist.get_rank(), "agent": os.environ.get("AGENT"), "node_rank": int(os.environ["GROUP_RANK"]),
             "local_rank": int(os.environ["LOCAL_RANK"]),
             "shard_group": dist.get_process_group_ranks(mesh["shard"].get_group()),
             "replicate_group": dist.get_process_group_ranks(mesh["replicate"].get_group())}
    report("placement", ranks=per_rank(where))


TP_MESH = []  # built once: (dp, tp) = (world / 2, 2)


def tp_mesh(device_type):
    if not TP_MESH:
        TP_MESH.append(init_device_mesh(device_type, (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp")))
    return TP_MESH[0]


def data_coordinates(tp=False):
    """(index, count) of this rank's share of the data: its DP index under tensor parallelism, where the
    two ranks of a TP group compute on the same micro-batches."""
    if tp:
        dp = tp_mesh(DEVICE[0].type)["dp"]
        return dp.get_local_rank(), dp.size()
    return dist.get_rank(), dist.get_world_size()


def parallelize(model, mesh):
    """Megatron-style TP on every block: q and k column-parallel, gathered back (the block adds them to the
    residual stream); the MLP's up_proj column-parallel (bias too), down_proj row-parallel."""
    gathered = ColwiseParallel(output_layouts=Replicate())
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {"q_proj": gathered, "k_proj": gathered,
                                               "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})


def build(mesh, zero3, seed=0, tied=False, mp_policy=None, checkpointed=False, compiled=False, hsdp=False,
          replicate_async=True, wrapped=False, frozen=(), muon_kwargs=None, tp=False, net=None, **dedicate_kwargs):
    """dmuon on FSDP2 (Net, or ``net()``: a model with ``layers``); ``muon_kwargs`` may be a function of the model
    (param_groups are built from its parameters)."""
    torch.manual_seed(seed)
    model = (Net(tied, checkpointed) if net is None else net()).to(mesh.device_type)
    if tp:  # tensor parallelism first, then activation checkpointing, as torchtitan orders them
        parallelize(model, tp_mesh(mesh.device_type))
    if wrapped:  # each block in a CheckpointWrapper: its names gain "_checkpoint_wrapped_module."
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    if compiled:  # torchtitan's order: TP, checkpoint_wrapper, then torch.compile of each block, then dmuon
        compile_blocks(model)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    if hsdp:  # FSDP2 shards on the shard axis and replicates across; dmuon holds one copy per replica
        mesh2d = hsdp_mesh(mesh.device_type)
        dmuon.dedicate_params(model, mesh2d["shard"], predicate, reshard_after_forward=zero3,
                              replicate_mesh=mesh2d["replicate"])
        mesh = mesh2d
    elif tp:  # the public tp-dp order: TP (above), then dedicate_params and fully_shard on the DP axis
        mesh = tp_mesh(mesh.device_type)["dp"]
        dmuon.dedicate_params(model, mesh, predicate, reshard_after_forward=zero3, **dedicate_kwargs)
    else:
        dmuon.dedicate_params(model, mesh, predicate, reshard_after_forward=zero3, **dedicate_kwargs)
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model, muon_of(model, replicate_async=replicate_async, **_muon_kwargs(model, muon_kwargs))


def _muon_kwargs(model, muon_kwargs):
    return (muon_kwargs(model) if callable(muon_kwargs) else muon_kwargs) or {}


def compile_blocks(model, wrapping=True, backend="aot_eager"):
    """torch.compile of each block: wrapping it (``model.layers[i] = torch.compile(block)``) or in place
    (``block.compile()``); aot_eager: no C++ to compile on 2 cores."""
    for i, layer in enumerate(model.layers):
        if wrapping:
            model.layers[i] = torch.compile(layer, backend=backend)
        else:
            layer.compile(backend=backend)


def muon_of(model, **kwargs):
    """dmuon.Muon with the checks' hyperparameters (float32 Newton-Schulz)."""
    return dmuon.Muon(model, **HYPER, ns_dtype=torch.float32, adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"],
                      adamw_eps=ADAMW["eps"], adamw_weight_decay=ADAMW["weight_decay"], **kwargs)


def reference_optimizers(ref, selects, muon_class=muon.Muon):
    """The single-process reference's optimizers: Muon (float32 Newton-Schulz) on the matrices ``selects``
    picks, AdamW on the rest."""
    return [muon_class([p for n, p in ref.named_parameters() if selects(n, p)], **HYPER, ns_dtype=torch.float32),
            torch.optim.AdamW([p for n, p in ref.named_parameters() if not selects(n, p)], **ADAMW)]


def reference_step(ref, optimizers, step, tp=False, clip_log=None):
    """One step of the single-process reference on step ``step``'s whole global batch, clipped like dmuon. With
    ``clip_log`` (a list) it appends the norm of the gradients of ``optimizers[0]`` (the Muon matrices) and the
    norm of every gradient, both before the clip."""
    _, (x, y), total = window(step, *data_coordinates(tp))
    F.mse_loss(ref(x), y, reduction="sum").div(total * OUT).backward()
    if clip_log is not None:
        muon_norm = torch.stack([p.grad.norm() for g in optimizers[0].param_groups for p in g["params"]]).norm()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    if clip_log is not None:
        clip_log.append((muon_norm.item(), norm.item()))
    for o in optimizers:
        o.step()
        o.zero_grad()


def train_side_by_side(model, opt, ref, ref_optimizers, steps=2, tp=False, clip_log=None):
    """Train dmuon and the single-process reference (full batch, same clipping) at a constant lr; the max
    |difference| of any parameter after each step, and the largest change of the reference's parameters. With
    ``clip_log`` (a dict) its "dmuon" and "reference" lists get each step's clip statistics (train_window,
    reference_step)."""
    rank, world = data_coordinates(tp)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    max_diff = 0.0
    for step in range(steps):
        mine, _, total = window(step, rank, world)
        train_window(model, opt, sched, mine, total, use_no_sync=True, tp=tp,
                     clip_log=None if clip_log is None else clip_log.setdefault("dmuon", []))
        reference_step(ref, ref_optimizers, step, tp=tp,
                       clip_log=None if clip_log is None else clip_log.setdefault("reference", []))
        ours = full_params(model)
        max_diff = max(max_diff, max((ours[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()))
    moved = max((p.detach() - initial[n]).abs().max().item() for n, p in ref.named_parameters())
    return max_diff, moved


def schedule(step):
    return 1.0 / (1.0 + step)


def train_window(model, opt, sched, mine, total, use_no_sync, autocast=False, tp=False, clip_log=None,
                 clip_counter=None):
    """One optimizer step over this rank's micro-batches (the forward under bf16 autocast with ``autocast``);
    the global gradient norm before clipping. With ``clip_log`` (a list) it appends the statistics of
    opt.clip_grad_norm_(None) (the Muon gradients, measured only) and of the model's clip; ``clip_counter`` (a
    count_comm) counts the clip's own collectives."""
    _, world = data_coordinates(tp)
    for j, (x, y) in enumerate(mine):
        ctx = dmuon.no_sync(model) if use_no_sync and j < K - 1 else contextlib.nullcontext()
        with ctx:
            with torch.autocast(x.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                out = model(x)
            loss = F.mse_loss(out.float(), y, reduction="sum") * world / (total * OUT)
            loss.backward()
    measured = opt.clip_grad_norm_(None) if clip_log is not None else None
    with clip_counter or contextlib.nullcontext():
        norm = dmuon.clip_grad_norm_(model, MAX_NORM)
    if clip_log is not None:
        clip_log.append((measured, norm))
    opt.step()
    sched.step()
    opt.zero_grad()
    return norm.total_norm.item()


def dedicated_bytes(model):
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if predicate(n, p))


def max_difference(model, other):
    """Max |difference| of any parameter of two dmuon models (full tensors, gathered)."""
    a, b = full_params(model), full_params(other)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def step_both_and_compare(trained, resumed, tp=False):
    """Train the window of step 2 on both (model, optimizer, scheduler); their max parameter difference after."""
    mine, _, total = window(2, *data_coordinates(tp))
    for model, opt, sched in (trained, resumed):
        train_window(model, opt, sched, mine, total, use_no_sync=True, tp=tp)
    return max_difference(trained[0], resumed[0])


def full_params(model):
    sd = dmuon.get_model_state_dict(model, dmuon.StateDictOptions(full_state_dict=True))
    names = {fqn(n) for n, _ in model.named_parameters()}
    return {k: v.cpu() for k, v in sd.items() if k in names}


def check_equivalence(mesh, zero3, use_no_sync, tied=False, checkpointed=False, hsdp=False, tp=False):
    """Train dmuon and the single-process reference side by side; compare after every step."""
    rank, world = data_coordinates(tp)
    label = (f"{'z3' if zero3 else 'z2'}_{'no_sync' if use_no_sync else 'sync_every_micro_batch'}"
             f"{'_tied' * tied}{'_checkpointed' * checkpointed}{'_hsdp' * hsdp}{'_tp' * tp}")
    model, opt = build(mesh, zero3, tied=tied, checkpointed=checkpointed, hsdp=hsdp, tp=tp)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    torch.manual_seed(0)
    ref = Net(tied)
    ref_muon = muon.Muon([p for n, p in ref.named_parameters() if predicate(n, p)], **HYPER, ns_dtype=torch.float32)
    ref_adamw = torch.optim.AdamW([p for n, p in ref.named_parameters() if not predicate(n, p)], **ADAMW)
    ref_scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (ref_muon, ref_adamw)]

    max_diff, max_norm_rel, clipped, comm, storage = 0.0, 0.0, 0, None, []
    p_m = dedicated_bytes(ref)
    clip_counter = dmuon.count_comm()
    for step in range(STEPS):
        mine, (x, y), total = window(step, rank, world)
        counter = dmuon.count_comm() if step == 1 else contextlib.nullcontext()
        with counter:
            norm = train_window(model, opt, sched, mine, total, use_no_sync, tp=tp,
                                clip_counter=clip_counter if step == 1 else None)
        if step == 1:
            comm = {**{name: counter.bytes.get(name, 0) for name in ("broadcast", "reduce", "gather", "scatter")},
                    "broadcast_calls": counter.calls.get("broadcast", 0), "reduce_calls": counter.calls.get("reduce", 0)}
            layout = dmuon.Layout("fsdp2", "dmuon", reshard_after_forward=zero3, replicas=2 if hsdp else 1,
                                  tp=2 if tp else 1)
            # the time model plans the no_sync schedule of an untied model
            predicted = (time_model_counts(layout, counter, clip_counter, tp)
                         if use_no_sync and not tied else None)
        storage.append(_storage_ok(model))

        F.mse_loss(ref(x), y, reduction="sum").div(total * OUT).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
        for o in (ref_muon, ref_adamw):
            o.step()
            o.zero_grad()
        for s in ref_scheds:
            s.step()
        max_norm_rel = max(max_norm_rel, abs(norm - ref_norm) / ref_norm)
        clipped += ref_norm > MAX_NORM
        ours = full_params(model)
        max_diff = max(max_diff, max((ours[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()))

    moved = max((p.detach() - q).abs().max().item() for p, q in zip(ref.parameters(), _initial_params(tied)))
    report(f"equivalence_{label}", max_abs_diff=max_diff, largest_change=moved, steps=STEPS, k=K,
           clip_norm_rel_diff=max_norm_rel, clipped_steps=int(clipped))
    comm_all = per_rank(comm)
    plan = per_rank(dmuon.summarize_comm_plan(model)["totals"])
    report(f"comm_{label}", k=K, dedicated_bytes=p_m, per_rank=comm_all, zero3=zero3, no_sync=use_no_sync, plan=plan,
           time_model=per_rank(predicted))
    report(f"storage_{label}", ok_every_step_every_rank=all(all(s) for s in per_rank(storage)))


def _initial_params(tied=False):
    torch.manual_seed(0)
    return [p.detach() for p in Net(tied).parameters()]


def check_placeholders(mesh):
    """A non-owner's matrix between uses: metadata answered, every read refused by name, the same objects."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(mesh, zero3=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    state = model._dmuon
    ids_before = [id(p) for p in model.parameters()]
    name, p = next((n, q) for n, q in state.params.items() if not state.owns(q))
    refusals = {}
    for what, read in [("norm", lambda: p.norm()), ("clone", lambda: p.clone()), ("data", lambda: p.data),
                       ("detach", lambda: p.detach()), ("torch.save", lambda: torch.save(p, io.BytesIO())),
                       ("ema", lambda: torch._foreach_mul_([p], 0.9)),
                       ("model.state_dict", lambda: model.state_dict()),
                       ("torch.save(state_dict)", lambda: torch.save(model.state_dict(), io.BytesIO()))]:
        try:
            read()
            refusals[what] = None
        except RuntimeError as error:
            refusals[what] = str(error)
    for step in range(2):
        mine, _, total = window(step, rank, world)
        train_window(model, opt, sched, mine, total, use_no_sync=True)
    owner = state.owner_of(p)
    report("placeholders", matrix=name, owner=owner, refusals=refusals,
           shape=list(p.shape), size=list(p.size()), numel=p.numel(), expected_shape=list(_shape_of(name)),
           same_objects=ids_before == [id(q) for q in model.parameters()], resident=is_resident(p),
           repr_names_owner=f"owned by rank {owner}" in repr(p))


def check_compiled(mesh, backend="fsdp2"):
    """torchtitan's recipe, each block in a checkpoint_wrapper and then torch.compile'd (aot_eager) before dmuon,
    against the same blocks eager (Z3, or the DDP backend): the same steps, and no recompile after warm-up (the
    graphs compiled so far in this process, per rank, after each step).

    Dynamo's default limit of 8 compilations per code object is reached on rank 1 (nn.Linear.forward serves
    three weight shapes, with and without bias, over micro-batch sizes 1 to 5), and past it Dynamo runs the
    frame eagerly without a word: the limit is raised for the check, and reaching it fails the check."""
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {}
    for compiled in (False, True):
        model, opt = (build(mesh, zero3=True, wrapped=True, compiled=compiled) if backend == "fsdp2"
                      else build_ddp(mesh, wrapped=True, compiled=compiled))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        graphs = []
        with torch._dynamo.config.patch(recompile_limit=32, fail_on_recompile_limit_hit=True):
            for step in range(STEPS + 1):
                mine, _, total = window(step, rank, world)
                train_window(model, opt, sched, mine, total, use_no_sync=True)
                graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        runs[compiled] = (full_params(model), graphs)
    (eager, _), (compiled, graphs) = runs[False], runs[True]
    report("compiled" if backend == "fsdp2" else f"compiled_{backend}",
           max_abs_diff=max((eager[n] - compiled[n]).abs().max().item() for n in eager),
           graphs_after_each_step=per_rank(graphs))


COMPILE_STYLES = {f"{'checkpointed' if c else 'plain'}, {'wrapping' if w else 'in place'}": (c, w)
                  for c in (True, False) for w in (True, False)}


def compiled_graphs(layout, checkpointed, wrapping, backend="aot_eager"):
    """(unique graphs, graph breaks) Dynamo counts when each block of a fresh model is compiled in torchtitan's order
    (TP, checkpoint_wrapper, torch.compile, then data parallelism) and trained two windows of two micro-batches.

    ``layout``: "alone" (the blocks, nothing distributed), "z3", "z2", "ddp" (dmuon's DDP backend), "hsdp" (2 x
    W/2, Z3); "tp alone", "tp" (FSDP2 + TP, Z3), "ddp_tp". Dynamo's caches are reset first, so that each layout
    compiles from nothing."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Net().to(DEVICE[0])
    with_tp = layout.startswith("tp") or layout == "ddp_tp"
    if with_tp:
        parallelize(model, tp_mesh(DEVICE[0].type))
    if checkpointed:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    compile_blocks(model, wrapping, backend)
    mesh = tp_mesh(DEVICE[0].type)["dp"] if with_tp else init_device_mesh(DEVICE[0].type, (dist.get_world_size(),))
    if layout in ("z3", "z2", "tp"):
        dmuon.dedicate_params(model, mesh, predicate, reshard_after_forward=layout != "z2")
    elif layout == "hsdp":
        mesh = hsdp_mesh(DEVICE[0].type)
        dmuon.dedicate_params(model, mesh["shard"], predicate, replicate_mesh=mesh["replicate"])
    elif layout in ("ddp", "ddp_tp"):
        (dmuon.dedicate_params_ddp_tp if with_tp else dmuon.dedicate_params_ddp)(model, mesh, predicate)
        (dmuon.replicate_tp if with_tp else dmuon.replicate)(model, mesh)
    if layout in ("z3", "z2", "tp", "hsdp"):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    distributed_run = "alone" not in layout
    opt = muon_of(model) if distributed_run else torch.optim.AdamW(model.parameters(), **ADAMW)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        for j in range(2):
            with dmuon.no_sync(model) if distributed_run and j == 0 else contextlib.nullcontext():
                model(torch.randn(4, IN, generator=g).to(DEVICE[0])).square().mean().backward()
        opt.step()
        opt.zero_grad()
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def check_compiled_graphs(layouts, name, styles=tuple(COMPILE_STYLES)):
    """Per layout and compile style, what compiled_graphs counts on each rank: under dmuon as many graphs as the same
    blocks alone, and no graph break. Graph breaks and recompiles are Dynamo's: its "eager" backend counts them
    without AOTAutograd's tracing of each graph (check_compiled runs aot_eager, and TP's first compile in a 4-rank
    process costs 7 s on 2 cores: the TP layouts take two styles, the recipe and its opposite)."""
    counted = {f"{layout}; {style}": per_rank(compiled_graphs(layout, *COMPILE_STYLES[style], backend="eager"))
               for layout in layouts for style in styles}
    torch._dynamo.reset()
    report(name, graphs=counted)


def check_mixed_precision(mesh, zero3, via_compute_dtype=False, backend="fsdp2"):
    """bf16 compute with dedicated matrices, against one process computing in the same precision: FSDP2's
    bf16 policy, or (``via_compute_dtype``) dedicate_params' compute_dtype, in the public positional order,
    without a policy and with the forward under autocast.

    The reference runs every rank's micro-batches in turn, with the same shapes, through a bf16 copy of its
    float32 master model (FSDP2 casts parameters and inputs to param_dtype), or through the float32 model
    under autocast, sums the bf16 gradients in float32 and averages over ranks (reduce_dtype), then steps
    float32 Muon and AdamW: the same arithmetic as the distributed run, in another order of float32 sums,
    so the float32 tolerance applies. It applies while both sides round the same float32 masters to bf16: a
    master that differs by 1e-7 can round to the neighbouring bf16 value (1 part in 256) at a later step. The
    compute_dtype run is compared after its first step (the initial masters are the same), where that cannot
    happen. ``backend="ddp"``: the compute_dtype run on the DDP backend (dedicate_params_ddp + replicate).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "ddp":
        model, opt = build_ddp(mesh, compute_dtype=torch.bfloat16)
    elif via_compute_dtype:
        torch.manual_seed(0)
        model = Net().to(mesh.device_type)
        dmuon.dedicate_params(model, mesh, predicate, torch.bfloat16, zero3)  # (model, mesh, predicate, compute_dtype, reshard_after_forward)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = muon_of(model)
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model, opt = build(mesh, zero3, mp_policy=policy)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    state = model._dmuon
    seen = set()
    model.layers[0].q_proj.register_forward_pre_hook(lambda m, a: seen.add(str(m.weight.dtype)))
    torch.manual_seed(0)
    ref = Net()
    ref_muon = muon.Muon([p for n, p in ref.named_parameters() if predicate(n, p)], **HYPER, ns_dtype=torch.float32)
    ref_adamw = torch.optim.AdamW([p for n, p in ref.named_parameters() if not predicate(n, p)], **ADAMW)
    ref_scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (ref_muon, ref_adamw)]
    max_diff, broadcast_bytes = 0.0, None
    for step in range(1 if via_compute_dtype else STEPS):
        mine, _, total = window(step, rank, world)
        with dmuon.count_comm() as counts:
            train_window(model, opt, sched, mine, total, use_no_sync=True, autocast=via_compute_dtype)
        broadcast_bytes = broadcast_bytes or counts.bytes.get("broadcast", 0)
        low = copy.deepcopy(ref) if via_compute_dtype else copy.deepcopy(ref).to(torch.bfloat16)
        summed = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(world):
            for x, y in window(step, r, world)[0]:
                with torch.autocast("cpu", dtype=torch.bfloat16) if via_compute_dtype else contextlib.nullcontext():
                    out = low(x if via_compute_dtype else x.to(torch.bfloat16))
                loss = F.mse_loss(out.float(), y, reduction="sum") * world / (total * OUT)
                loss.backward()
                for acc, q in zip(summed, low.parameters()):
                    acc.add_(q.grad.float())
                low.zero_grad()
        for p, g in zip(ref.parameters(), summed):
            p.grad = g / world
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        for o in (ref_muon, ref_adamw):
            o.step()
            o.zero_grad()
        for s in ref_scheds:
            s.step()
        ours = full_params(model)
        max_diff = max(max_diff, max((ours[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()))
    owned = [p for p in state.params.values() if state.steps(p)]
    moved = max((p.detach() - q).abs().max().item() for p, q in zip(ref.parameters(), _initial_params()))
    refused = None
    if via_compute_dtype and backend == "fsdp2":  # a compute_dtype other than the policy's: refused when Muon is built
        torch.manual_seed(0)
        other = Net().to(mesh.device_type)
        dmuon.dedicate_params(other, mesh, predicate, torch.float16)
        for module in [*other.layers, other]:
            fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        refused = per_rank(error_of(lambda: muon_of(other)))
    report(f"{'compute_dtype' if via_compute_dtype else 'mixed_precision'}_{'z3' if zero3 else 'z2'}"
           f"{'' if backend == 'fsdp2' else '_' + backend}",
           max_abs_diff=max_diff, largest_change=moved, refused=refused,
           forward_dtypes=sorted(seen),
           master_dtypes=sorted({str(p.dtype) for p in owned}),
           momentum_dtypes=sorted({str(opt._muon.state[p]["momentum_buffer"].dtype) for p in owned}),
           broadcast_bytes=broadcast_bytes, dedicated_bytes_fp32=dedicated_bytes(ref), zero3=zero3, k=K)


# The groups' hyperparameters that dmuon.Muon's defaults set (the test compares them with the public signatures)
MUON_GROUP_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "ns_steps", "adjust_lr_fn")
ADAMW_GROUP_KEYS = ("lr", "betas", "weight_decay", "eps")


def check_public_api(mesh, directory):
    """The public project's defaults, positional order and argument names, its checkpoint flow, its
    clip_grad_norm_(optimizer, ...) form with its statistics."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = Net().to(mesh.device_type)
    dmuon.dedicate_params(plain, mesh, predicate, None, True, None)  # compute_dtype, reshard_after_forward, replicate_mesh
    for layer in plain.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    defaults = dmuon.Muon(plain)
    muon_group = {k: defaults.param_groups[0][k] for k in MUON_GROUP_KEYS}
    adamw_group = {k: defaults.param_groups[1][k] for k in ADAMW_GROUP_KEYS}

    # Train two steps, then save the documented way: full state dicts, torch.save on rank 0.
    model, opt = build(mesh, zero3=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(2):
        mine, _, total = window(step, rank, world)
        train_window(model, opt, sched, mine, total, use_no_sync=True)
    model_sd, optim_sd = dmuon.get_model_state_dict(model), dmuon.get_optimizer_state_dict(model, opt)
    on_cpu = all(t.device.type == "cpu" and not isinstance(t, DTensor) for t in model_sd.values())
    kept = [len(model_sd) > 0, len(optim_sd) > 0]
    path = f"{directory}/public-flow.pt"
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, path)
    distributed.barrier()
    loaded = torch.load(path, weights_only=False)
    # The same full state dicts (rank 0's only) through checkpoint.save: refused on every rank, naming the options.
    refused_save = error_of(lambda: checkpoints.save({"model": model_sd, "optim": optim_sd}, f"{directory}/rank0-only"))
    fresh, fresh_opt = build(mesh, zero3=True, seed=123)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, schedule)  # before the load: it sets lr
    fresh_sched.load_state_dict(sched.state_dict())
    dmuon.set_model_state_dict(fresh, state_dict=loaded["model"])  # the public argument names
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, state_dict=loaded["optim"])
    restored = max_difference(model, fresh)
    continued = step_both_and_compare((model, opt, sched), (fresh, fresh_opt, fresh_sched))

    # A state dict of gradient-tracking tensors, as named_parameters() gives them.
    torch.manual_seed(7)
    source = Net().to(mesh.device_type)
    dmuon.set_model_state_dict(fresh, {k: v.clone() for k, v in source.state_dict(keep_vars=True).items()})
    b = full_params(fresh)
    from_tracking = max((b[n] - q.detach().cpu()).abs().max().item() for n, q in source.named_parameters())

    # clip_grad_norm_(optimizer, None): the Muon gradients only, measured, nothing scaled; the model form with
    # other norms; against the reference's full-batch gradients.
    mine, (x, y), total = window(0, rank, world)
    for xb, yb in mine:
        (F.mse_loss(model(xb), yb, reduction="sum") * world / (total * OUT)).backward()
    owned = [dmuon.record_of(p) for p in model._dmuon.params.values() if model._dmuon.steps(p)]
    before = [r.reduced_grad.clone() for r in owned]
    stats = opt.clip_grad_norm_(None)  # the public method, i.e. dmuon.clip_grad_norm_(opt, None)
    unchanged = all(torch.equal(b, r.reduced_grad) for b, r in zip(before, owned))
    inf_norm = dmuon.clip_grad_norm_(model, None, norm_type=float("inf")).total_norm.item()
    full_norm = dmuon.clip_grad_norm_(model, None).total_norm.item()
    opt.zero_grad()
    ref = _reference_at(full_params(model))
    F.mse_loss(ref(x), y, reduction="sum").div(total * OUT).backward()
    ref_muon_norm = torch.stack([p.grad.norm() for n, p in ref.named_parameters() if predicate(n, p)]).norm().item()
    ref_full_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
    ref_inf_norm = max(p.grad.abs().max().item() for p in ref.parameters())
    report("public_api", muon_group=muon_group, adamw_group=adamw_group,
           full_on_cpu=on_cpu, kept_per_rank=per_rank(kept), restored_max_diff=restored,
           refused_rank0_only_save=per_rank(refused_save),
           continued_max_diff=continued, from_tracking_max_diff=from_tracking,
           muon_norm_rel_diff=abs(stats.total_norm.item() - ref_muon_norm) / ref_muon_norm,
           full_norm_rel_diff=abs(full_norm - ref_full_norm) / ref_full_norm,
           inf_norm_rel_diff=abs(inf_norm - ref_inf_norm) / ref_inf_norm,
           stats=per_rank({"fields": sorted(stats.as_dict()), "max_norm": stats.max_norm, "norm_type": stats.norm_type,
                           "clip_coef": float(stats.clip_coef), "clipped": bool(stats.clipped),
                           "param_count": stats.param_count, "owned_muon": len(opt._owned),
                           "found_inf": bool(stats.found_inf), "strategy": stats.strategy,
                           "zero_dim": all(getattr(stats, f).ndim == 0 for f in ("total_norm", "found_inf")),
                           "kept": opt.last_muon_grad_clip_stats is stats, "unchanged": unchanged}))


# The public dmuon's examples, X-Square-Robot/dmuon at this commit: their calls, in their order, with only the
# device, the backend, the import and the sizes changed (fewer layers and steps, smaller matrices).
PUBLIC_EXAMPLES_COMMIT = "f002f24a7e7397ae4b92ee6fd33fe62c75e9deb2"


class ExampleBlock(nn.Module):  # examples/basic_dp.py's Block, d=512, ff=2048 there
    def __init__(self, d=16, ff=32):
        super().__init__()
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        h = self.ln(x)
        return x + self.down_proj(self.gate_proj(h) * self.up_proj(h))


class ExampleTinyModel(nn.Module):  # examples/basic_dp.py's TinyModel
    def __init__(self, num_layers=2, d=16, ff=32):
        super().__init__()
        self.layers = nn.ModuleList([ExampleBlock(d, ff) for _ in range(num_layers)])
        self.head = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def check_public_basic_dp(directory):
    """examples/basic_dp.py (PUBLIC_EXAMPLES_COMMIT), from its mesh to its checkpoint's load, on gloo ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(42)
    model = ExampleTinyModel()
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, momentum=0.95, ns_steps=5, adamw_lr=1e-3, adamw_weight_decay=0.01)
    owned = dmuon.get_owned_params(model, rank=rank)  # the example prints these on rank 0
    total = sum(dp.numel for dp in owned)
    backend = dmuon.get_ns_backend()
    losses = []
    for step in range(3):  # 50 there
        optimizer.zero_grad()
        x = torch.randn(4, 16)
        loss = model(x)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model_sd = dmuon.get_model_state_dict(model)
    optim_sd = dmuon.get_optimizer_state_dict(model, optimizer)
    path = f"{directory}/dmuon_ckpt.pt"  # /tmp/dmuon_ckpt.pt there
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd, "step": 3}, path)
    dist.barrier()
    ckpt = torch.load(path, map_location="cpu")
    before = full_params(model)
    dmuon.set_model_state_dict(model, ckpt["model"])
    dmuon.set_optimizer_state_dict(model, optimizer, ckpt["optim"])
    after = full_params(model)
    report("public_basic_dp", owned=per_rank(sorted(dp.param_name for dp in owned)),
           owned_elements=per_rank(total), ownership=dmuon.ownership(model), ns_backend=backend,
           losses_finite=all(math.isfinite(v) for v in losses),
           reloaded_max_diff=max((before[n] - after[n]).abs().max().item() for n in before))


class ExampleAttention(nn.Module):  # examples/tp_dp.py's Attention (GQA), d=256 there
    def __init__(self, d=16, n_heads=4, n_kv_heads=2):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d // n_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        repeat = self.n_heads // self.n_kv_heads
        return self.o_proj(q + k.repeat(1, 1, repeat) + v.repeat(1, 1, repeat))


class ExampleMLP(nn.Module):  # examples/tp_dp.py's MLP, ff=1024 there
    def __init__(self, d=16, ff=32):
        super().__init__()
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


class ExampleTransformerBlock(nn.Module):
    def __init__(self, d=16, ff=32):
        super().__init__()
        self.attn, self.mlp = ExampleAttention(d), ExampleMLP(d, ff)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ExampleTinyTransformer(nn.Module):  # examples/tp_dp.py's TinyTransformer, 4 layers there
    def __init__(self, num_layers=2, d=16):
        super().__init__()
        self.layers = nn.ModuleList([ExampleTransformerBlock(d) for _ in range(num_layers)])
        self.head = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def check_public_tp_dp():
    """examples/tp_dp.py (PUBLIC_EXAMPLES_COMMIT) on 4 gloo ranks as 2 DP x 2 TP, its record inspection included."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dp_size = 2
    tp_size = world_size // dp_size
    mesh_2d = init_device_mesh("cpu", (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = mesh_2d["dp"], mesh_2d["tp"]
    torch.manual_seed(42)
    model = ExampleTinyTransformer()
    for layer in model.layers:
        parallelize_module(layer.attn, tp_mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                 "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
        parallelize_module(layer.mlp, tp_mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                "down_proj": RowwiseParallel()})
    dmuon.dedicate_params(model, dp_mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = dmuon.Muon(model, lr=0.02, momentum=0.95, adamw_lr=1e-3)
    backend = dmuon.get_ns_backend()
    records = [{"name": dp.param_name, "local": list(dp._orig_size), "full": list(dp.full_shape),
                "shard_dim": dp.shard_dim, "tp_size": dp.tp_group.size() if dp.tp_group is not None else None,
                "is_tp_owner": dp.is_tp_owner} for dp in dmuon.get_owned_params(model, rank=0)]
    losses = []
    for step in range(3):  # 30 there
        optimizer.zero_grad()
        x = torch.randn(4, 8, 16)  # (batch, seq, d)
        loss = model(x)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    report("public_tp_dp", owned_by_shard_0=per_rank(records), ns_backend=backend,
           losses_finite=all(math.isfinite(v) for v in losses))


def _reference_at(params):
    """A single-process Net holding ``params`` (full tensors by name)."""
    net = Net()
    net.load_state_dict(params, strict=False)
    return net


def check_misuse(mesh):
    """Mistakes that used to pass silently or crash natively now raise, on every rank, with a message."""
    rank, world = dist.get_rank(), dist.get_world_size()
    outcome = {}
    # A window whose every micro-batch ran inside no_sync: nothing was reduced.
    model, opt = build(mesh, zero3=True)
    mine, _, total = window(0, rank, world)
    for x, y in mine:
        with dmuon.no_sync(model):
            F.mse_loss(model(x), y).backward()
    outcome["step_after_all_no_sync"] = error_of(opt.step)
    # optimizer.step() inside dmuon.no_sync, after the window's last backward: its gradients are not reduced yet.
    model, opt = build(mesh, zero3=True)
    with dmuon.no_sync(model):
        F.mse_loss(model(mine[0][0]), mine[0][1]).backward()
        outcome["step_inside_no_sync"] = error_of(opt.step)
    # fully_shard before dedicate_params: FSDP2 already owns the matrices.
    torch.manual_seed(0)
    sharded_first = Net().to(mesh.device_type)
    for layer in sharded_first.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded_first, mesh=mesh)
    outcome["fully_shard_first"] = error_of(lambda: dmuon.dedicate_params(sharded_first, mesh, predicate))
    # A predicate that depends on the rank: the ranks would pair their broadcasts wrongly.
    torch.manual_seed(0)
    skewed = Net().to(mesh.device_type)
    outcome["rank_dependent_predicate"] = error_of(lambda: dmuon.dedicate_params(
        skewed, mesh, lambda n, p: predicate(n, p) and not (rank == 1 and n == "layers.1.k_proj.weight")))
    # A pipeline stage per rank (torchtitan's split: each keeps its layers under their own names): refused.
    torch.manual_seed(0)
    stage = Net().to(mesh.device_type)
    stage.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(stage.layers) if i % world == rank})
    stage.embed, stage.head = (stage.embed, None) if rank == 0 else (None, stage.head)
    outcome["pipeline_stages"] = error_of(lambda: dmuon.dedicate_params(stage, mesh, predicate))
    # One rank never calls dedicate_params, and runs a collective of its own on the group meanwhile (gloo aborted
    # both processes natively on the size mismatch, 180 bytes against 4): the caller gives up at the group's
    # timeout, naming the rank that never came.
    short = short_timeout_mesh()
    if rank == 0:
        torch.manual_seed(0)
        outcome["a_rank_never_calls"] = error_of(lambda: dmuon.dedicate_params(Net(), short, predicate))
    else:
        outcome["a_rank_never_calls"] = error_of(lambda: dist.all_reduce(torch.zeros(45), group=short.get_group()))
    distributed.barrier()
    # torch.autocast around dmuon's forward and backward.
    model, opt = build(mesh, zero3=True)
    with torch.autocast(mesh.device_type, dtype=torch.bfloat16):
        out = model(mine[0][0])
    F.mse_loss(out.float(), mine[0][1]).backward()
    outcome["autocast_step"] = error_of(opt.step)
    outcome["autocast_output_dtype"] = str(out.dtype)
    report("misuse", **per_rank_outcomes(outcome))


class ScheduleLog(TorchDispatchMode):
    """What one rank does, in order: its c10d collectives (op and size), dmuon's events (the
    descriptions its order check is given), and the end of each layer's forward and the start of its
    backward (a hook on its output, which autograd runs after dmuon's, registered earlier)."""

    def __init__(self, model):
        super().__init__()
        self.events = []
        order = model._dmuon.order
        record = order._record  # check(), check_all() and note() go through it
        order._record = lambda descriptions, collective: (self.events.extend(("dmuon", d) for d in descriptions),
                                                          record(descriptions, collective))[1]
        for i, layer in enumerate(model.layers):
            layer.register_forward_hook(lambda _m, _a, out, i=i: self._end_of_forward(i, out))

    def _end_of_forward(self, i, output):
        self.events.append(("end of forward", f"layers.{i}"))
        if output.requires_grad:
            output.register_hook(lambda grad: self.events.append(("start of backward", f"layers.{i}")))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func.overloadpacket.__name__.endswith("_"):  # the collectives
            tensors = [t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
            self.events.append(("c10d", f"{func.overloadpacket.__name__} {tensors[0].numel() if tensors else 0}"))
        return func(*args, **(kwargs or {}))

    def first(self, kind, text):
        return next(i for i, (k, what) in enumerate(self.events) if k == kind and text in what)

    def all(self, kind, text):
        return [i for i, (k, what) in enumerate(self.events) if k == kind and text in what]


def check_schedule(mesh):
    """Z3 with forward_prefetch_depth 1 and 0: when each layer's broadcast is issued, how many reduces
    a step makes, whether every rank issues the same sequence, and whether both schedules agree."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, _, total = window(0, rank, world)
    result, params = {}, {}
    for depth in (1, 0):
        model, opt = build(mesh, zero3=True)
        opt = dmuon.Muon(model, **HYPER, ns_dtype=torch.float32, adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"],
                         adamw_eps=ADAMW["eps"], adamw_weight_decay=ADAMW["weight_decay"], forward_prefetch_depth=depth)
        log = ScheduleLog(model)
        with log:
            train_window(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule), mine, total, use_no_sync=True)
        params[depth] = full_params(model)
        last = len(model.layers) - 1
        forward = [log.first("dmuon", f"broadcast of layers.{i + 1}'s") < log.first("end of forward", f"layers.{i}")
                   for i in range(last)]
        # Z3 broadcasts every layer again before its backward, which starts after the last layer's forward.
        forward_ends = log.first("end of forward", f"layers.{last}")
        backward = [min(j for j in log.all("dmuon", f"broadcast of layers.{i - 1}'s") if j > forward_ends)
                    < log.first("start of backward", f"layers.{i}") for i in range(1, last + 1)]
        collectives = [what for kind, what in log.events if kind == "c10d"]
        reduces = sum(what.startswith("reduce_ ") for what in collectives)
        owners = dmuon.ownership(model)
        buckets = len({(name.split(".")[1], owner) for name, owner in owners.items()})  # (layer, owner) pairs
        everyone = per_rank(collectives)
        result[f"depth{depth}"] = dict(
            forward_prefetched=forward, backward_prefetched=backward, reduce_calls=reduces,
            layer_owner_pairs=buckets, matrices=len(owners),
            same_sequence_on_every_rank=all(seq == everyone[0] for seq in everyone),
            collectives=len(collectives))
    diff = max((params[1][n] - params[0][n]).abs().max().item() for n in params[1])
    report("schedule", **result, max_abs_diff_between_schedules=diff)


def check_divergence():
    """A rank that skips a layer: in Z3 the forward's broadcasts diverge, in Z2 (resident) the
    backward's reduces. Every rank raises, naming the layers and the ranks. Then ranks with windows
    of different lengths (a rank that stops answering in a reduce: tests/dist/reliability_faults.py)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    outcome = {}
    for zero3, dropped_in in ((True, 0), (False, 1)):
        # The rank that did not detect it waits until the short timeout.
        model, opt = build(short_timeout_mesh(), zero3)
        mine, _, total = window(0, rank, world)

        def train():
            for j, (x, y) in enumerate(mine[:2]):
                model.dropped = {1} if rank == 1 and j == dropped_in else set()
                with dmuon.no_sync(model) if j == 0 else contextlib.nullcontext():
                    F.mse_loss(model(x), y).backward()

        outcome["z3" if zero3 else "z2"] = error_of(train)
        distributed.barrier()
    outcome["uneven_windows"] = uneven_windows(rank)
    report("divergence", **per_rank_outcomes(outcome))


# The timeout of short_timeout_mesh's groups. Each check on one waits it out once, on purpose (5 times in the 2-rank
# launch), so it is short. Before that wait its honest collectives wait only for the other rank's share of the same
# work, a few milliseconds on this model: the ranks leave the previous collective together (a new group connects
# right after one), and they are warm (these checks come after the launch's first ones, so no rank does first-time
# work, imports or lazy inits, that the other waits for, unlike a fresh launch's first step: reliability_faults.py).
# A rank descheduled on a loaded 2-core machine is back within tens of milliseconds: 1 s is a margin of tens.
# Checked: these checks 10 times over at 1 s, in two launches, with the load average at 6 to 8.
SHORT_TIMEOUT_S = 1


def short_timeout_mesh():
    """A mesh over a group of its own with a SHORT_TIMEOUT_S timeout, for a check where one rank waits for another
    that never comes: the group is broken afterwards, and the job goes on on the default group."""
    # The ranks meet first: a check before may leave them up to its timeout apart, and creating the group waits
    # for its ranks no longer than the group's own timeout.
    distributed.barrier()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=SHORT_TIMEOUT_S))
    return DeviceMesh.from_group(group, "cpu")


def uneven_windows(rank):
    """Rank 0 ends its window after 2 micro-batches, rank 1 after 3 (all but the last inside no_sync):
    both raise at the second micro-batch's first forward, naming it on both sides."""
    model, _ = build(short_timeout_mesh(), zero3=True)
    mine, _, _ = window(0, rank, dist.get_world_size())
    counts = 2 if rank == 0 else 3

    def train():
        for j, (x, y) in enumerate(mine[:counts]):
            with dmuon.no_sync(model) if j < counts - 1 else contextlib.nullcontext():
                F.mse_loss(model(x), y).backward()

    error = error_of(train)
    distributed.barrier()
    return error


def per_rank_outcomes(outcome):
    return {key: [o.get(key) for o in per_rank(outcome)] for key in sorted(set().union(*per_rank(outcome)))}


def error_of(fn):
    try:
        fn()
        return None
    except (RuntimeError, ValueError, TypeError) as error:
        return str(error)


def _shape_of(name):
    torch.manual_seed(0)
    return dict(Net().named_parameters())[name].shape


def _storage_ok(model):
    """Between steps a non-owner holds no bytes of a dedicated matrix, and its owner all of them (under
    tensor parallelism: all of its TP shard)."""
    state = model._dmuon
    owned = sum(state.records[n].master.numel() * state.records[n].master.element_size()
                for n, p in state.params.items() if state.owns(p))
    return dmuon.held_bytes(model) == owned and not any(
        is_resident(p) for p in state.params.values() if not state.owns(p))


def attributes_of_dedicated(model):
    """Every instance attribute the dedicated parameters carry, over all of them (one record's pointer expected),
    but torch's own: nn.Parameter marks a parameter of a tensor subclass (a DTensor, under TP) with _is_param."""
    return sorted({key for p in model._dmuon.params.values() for key in vars(p)} - {"_is_param"})


def check_structure(mesh):
    world = dist.get_world_size()
    model, opt = build(mesh, zero3=True)
    dedicated = {n for n, p in model.named_parameters() if predicate(n, p)}
    is_dtensor = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
    report("fsdp_leaves_dedicated_alone",
           dedicated_sharded=[n for n in dedicated if is_dtensor[n]],
           others_not_sharded=[n for n in is_dtensor if n not in dedicated and not is_dtensor[n]],
           dedicated=len(dedicated))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if predicate(n, p)}
    everyone = per_rank(dmuon.ownership(model))
    report("ownership", same_on_every_rank=all(o == everyone[0] for o in everyone),
           equals_plan=everyone[0] == dmuon.plan_owners(shapes, world),
           owners_used=sorted(set(everyone[0].values())))

    # no_sync: local accumulation, no communication of either kind, step refused.
    (x, y), = window(0, dist.get_rank(), world)[0][:1]
    with dmuon.count_comm() as counts, dmuon.no_sync(model):
        model(x).square().mean().backward()
        try:
            opt.step()
            raised = None
        except RuntimeError as e:
            raised = str(e)
    state = model._dmuon
    report("no_sync", reduce_calls=counts.calls.get("reduce", 0), reduce_scatter_calls=counts.calls.get("reduce_scatter", 0),
           all_accumulated=all(r.accumulated_grad is not None for r in state.records.values()),
           none_reduced=all(r.reduced_grad is None for r in state.records.values()),
           step_raised=raised)

    # The next backward outside no_sync merges and reduces; zero_grad clears everything.
    model(x).square().mean().backward()
    owned = [p for p in state.params.values() if state.owns(p)]
    merged = all(r.accumulated_grad is None for r in state.records.values()) and all(
        dmuon.record_of(p).reduced_grad is not None for p in owned)
    fsdp_grads = any(p.grad is not None for p in model.parameters() if isinstance(p, DTensor))
    opt.zero_grad()
    cleared = all(r.reduced_grad is None and r.accumulated_grad is None for r in state.records.values()) and all(
        p.grad is None for p in model.parameters())
    model(x).square().mean().backward()  # and a step, for what the parameters carry after one
    opt.step()
    report("zero_grad", merged_and_reduced=all(per_rank(merged)), fsdp_had_grads=fsdp_grads,
           cleared_every_rank=all(per_rank(cleared)), attributes=per_rank(attributes_of_dedicated(model)))

    # Z2 residency: resident from the first forward through the window, released by step().
    model, opt = build(mesh, zero3=False)
    state = model._dmuon
    resident = []
    with dmuon.no_sync(model):
        model(x).sum().backward()
    resident.append(all(is_resident(p) for p in state.params.values()))
    model(x).sum().backward()
    resident.append(all(is_resident(p) for p in state.params.values()))
    opt.step()
    opt.zero_grad()
    report("z2_residency", resident_through_window=all(all(r) for r in per_rank(resident)),
           released_by_step=all(per_rank(_storage_ok(model))), attributes=per_rank(attributes_of_dedicated(model)))


def check_hsdp_publish(mesh, directory):
    """HSDP 2 x (W/2), Z3: the asynchronous and the synchronous publish give the same weights bit for
    bit, and the public checkpoint flow (full state dicts) resumes bit-identically."""
    rank, world = dist.get_rank(), dist.get_world_size()
    models = {}
    for replicate_async in (True, False):
        model, opt = build(mesh, zero3=True, hsdp=True, replicate_async=replicate_async)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(2):
            mine, _, total = window(step, rank, world)
            train_window(model, opt, sched, mine, total, use_no_sync=True)
        models[replicate_async] = (model, opt, sched)
    between_schedules = max_difference(models[True][0], models[False][0])

    model, opt, sched = models[True]
    saved = {"model": dmuon.get_model_state_dict(model, cpu_offload=True, rank0_only=False),
             "optim": dmuon.get_optimizer_state_dict(model, opt, cpu_offload=True, rank0_only=False)}
    fresh, fresh_opt = build(mesh, zero3=True, hsdp=True, seed=123)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, schedule)
    fresh_sched.load_state_dict(sched.state_dict())
    dmuon.set_model_state_dict(fresh, saved["model"])
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, saved["optim"])
    report("hsdp_publish", max_abs_diff_between_schedules=between_schedules,
           max_abs_diff_after_resume=step_both_and_compare((model, opt, sched), (fresh, fresh_opt, fresh_sched)),
           owners=sorted(set(dmuon.ownership(model).values())))


def check_hsdp_frozen(mesh):
    """HSDP 2 x (W/2), Z3, one frozen matrix: one window's broadcasts as counted are the replicas' per-layer
    broadcasts and the post-step publish, as summarize_comm_plan plans them; the publish leaves the frozen one out."""
    frozen = "layers.2.down_proj.weight"
    model, opt = build(mesh, zero3=True, hsdp=True, frozen=[frozen])
    mine, _, total = window(0, dist.get_rank(), dist.get_world_size())
    with dmuon.count_comm() as counted:
        train_window(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule), mine, total, use_no_sync=True)
        model._dmuon.publisher.wait()
    totals = dmuon.summarize_comm_plan(model)["totals"]
    state = model._dmuon
    held_trainable = sum(state.records[n].master.numel() * state.records[n].master.element_size()
                         for n, p in state.params.items() if state.owns(p) and n != frozen)
    report("hsdp_frozen", k=K, counted=per_rank(counted.bytes.get("broadcast", 0)),
           planned_per_layer=per_rank(totals["broadcast_tensor_bytes"]),
           planned_publish=per_rank(totals["post_step_replicate_broadcast_tensor_bytes_this_rank"]),
           held_trainable=per_rank(held_trainable))


def check_state_dict(mesh, directory):
    """Save at step 2 (sharded state dicts, torch.distributed.checkpoint), load into a fresh model, continue."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(mesh, zero3=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(2):
        mine, _, total = window(step, rank, world)
        train_window(model, opt, sched, mine, total, use_no_sync=True)
    sharded = dmuon.StateDictOptions()
    dcp.save({"model": dmuon.get_model_state_dict(model, sharded),
              "optim": dmuon.get_optimizer_state_dict(model, opt, sharded)},
             checkpoint_id=directory)

    fresh, fresh_opt = build(mesh, zero3=True, seed=123)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, schedule)
    fresh_sched.load_state_dict(sched.state_dict())
    loaded = {"model": dmuon.get_model_state_dict(fresh, sharded),
              "optim": dmuon.get_optimizer_state_dict(fresh, fresh_opt, sharded)}
    dcp.load(loaded, checkpoint_id=directory)
    dmuon.set_model_state_dict(fresh, loaded["model"])
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, loaded["optim"])
    report("state_dict_roundtrip",
           max_abs_diff_after_resume=step_both_and_compare((model, opt, sched), (fresh, fresh_opt, fresh_sched)),
           lr_after=[g["lr"] for g in fresh_opt.param_groups], lr_expected=[g["lr"] for g in opt.param_groups])


def check_tp_resume(mesh, directory):
    """Tensor parallel (dp, tp) = (W/2, 2): two steps, a save, a fresh model loads it and both take step 3.
    Z2 through the documented flow (full state dicts, torch.save on rank 0, torch.load on every rank), Z3
    through torch.distributed.checkpoint (sharded state dicts)."""
    rank, world = data_coordinates(tp=True)
    resumed = {}
    for zero3 in (False, True):
        model, opt = build(mesh, zero3, tp=True)
        if zero3:  # a plain state_dict() between uses, and the first matrix in it this rank holds no copy of
            state = model._dmuon
            absent = next(name for name, value in model.state_dict(keep_vars=True).items()
                          if any(value is q for q in state.params.values()) and not is_resident(value))
            plain = {"error": error_of(model.state_dict), "first_absent": fqn(absent),
                     "is_tp_shard": isinstance(model.get_parameter(absent), DTensor)}
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(2):
            mine, _, total = window(step, rank, world)
            train_window(model, opt, sched, mine, total, use_no_sync=True, tp=True)
        fresh, fresh_opt = build(mesh, zero3, seed=123, tp=True)
        fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, schedule)
        fresh_sched.load_state_dict(sched.state_dict())
        if zero3:
            sharded = dmuon.StateDictOptions()
            dcp.save({"model": dmuon.get_model_state_dict(model, sharded),
                      "optim": dmuon.get_optimizer_state_dict(model, opt, sharded)}, checkpoint_id=f"{directory}/tp")
            loaded = {"model": dmuon.get_model_state_dict(fresh, sharded),
                      "optim": dmuon.get_optimizer_state_dict(fresh, fresh_opt, sharded)}
            dcp.load(loaded, checkpoint_id=f"{directory}/tp")
        else:
            path = f"{directory}/tp-full.pt"
            saved = {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt)}
            if dist.get_rank() == 0:
                torch.save(saved, path)
            distributed.barrier()
            loaded = torch.load(path, weights_only=False)
        dmuon.set_model_state_dict(fresh, loaded["model"])
        dmuon.set_optimizer_state_dict(fresh, fresh_opt, loaded["optim"])
        resumed["z3" if zero3 else "z2"] = step_both_and_compare((model, opt, sched), (fresh, fresh_opt, fresh_sched),
                                                                 tp=True)
    report("tp_resume", max_abs_diff_after_resume=resumed, plain_state_dict=per_rank(plain))


def check_hook_boundaries(mesh):
    """nn.MultiheadAttention at the root, its matrices dedicated: with hook_boundary_predicate it trains in Z3
    and Z2 like one process; without, the non-owner's first forward refuses the read, naming the fix; a
    predicate that matches nothing is refused at once (strict); a resolver chooses the module."""
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {}
    for zero3 in (True, False):
        torch.manual_seed(0)
        model = Pooled().to(mesh.device_type)
        dmuon.dedicate_params(model, mesh, pooled_matrices, reshard_after_forward=zero3,
                              hook_boundary_predicate=lambda m: isinstance(m, nn.MultiheadAttention))
        fully_shard(model, mesh=mesh)
        opt = muon_of(model)
        torch.manual_seed(0)
        ref = Pooled()
        diff, moved = train_side_by_side(model, opt, ref, reference_optimizers(ref, pooled_matrices))
        result["z3" if zero3 else "z2"] = dict(max_abs_diff=diff, largest_change=moved,
                                               units=[u.path for u in model._dmuon.units],
                                               storage_ok=all(per_rank(_storage_ok(model))))
    # The DDP backend: every rank holds the matrices; the boundary is where they are cast and the order checked.
    torch.manual_seed(0)
    model = Pooled().to(mesh.device_type)
    dmuon.dedicate_params_ddp(model, mesh, pooled_matrices,
                              hook_boundary_predicate=lambda m: isinstance(m, nn.MultiheadAttention))
    dmuon.replicate(model, mesh)
    opt = muon_of(model)
    torch.manual_seed(0)
    ref = Pooled()
    diff, moved = train_side_by_side(model, opt, ref, reference_optimizers(ref, pooled_matrices))
    result["ddp"] = dict(max_abs_diff=diff, largest_change=moved, units=[u.path for u in model._dmuon.units],
                         storage_ok=True)
    torch.manual_seed(0)
    model = Pooled().to(mesh.device_type)
    dmuon.dedicate_params(model, mesh, pooled_matrices)
    fully_shard(model, mesh=mesh)
    mine, _, _ = window(0, rank, world)
    result["without_boundary"] = per_rank(error_of(lambda: model(mine[0][0])))
    result["strict"] = per_rank(error_of(lambda: dmuon.dedicate_params(
        Pooled(), mesh, pooled_matrices, hook_boundary_predicate=lambda m: False)))
    torch.manual_seed(0)
    model = Pooled().to(mesh.device_type)
    dmuon.dedicate_params(model, mesh, pooled_matrices, hook_boundary_resolver=lambda name, p: model.pool)
    result["resolver_units"] = [u.path for u in model._dmuon.units]
    report("hook_boundaries", **result)


def check_frozen(mesh, tp=False):
    """A frozen dedicated matrix (requires_grad=False, so no gradient hook) in Z3: freed after its layer's
    backward like the others, unchanged by the steps, and the rest trains like one process. With ``tp`` the
    frozen matrix is a TP shard (down_proj is row-parallel)."""
    frozen = "layers.2.down_proj.weight"
    model, opt = build(mesh, zero3=True, frozen=[frozen], tp=tp)
    state = model._dmuon
    last = [u for u in state.units if u.path == "layers.2"][0]
    seen = []  # at the start of layer 0's backward: does this rank hold a matrix of layer 2 it does not own?

    def look(_grad):
        seen.append(any(is_resident(p) for p in last.params if not state.owns(p)))

    def watch(_module, _args, output):
        output.register_hook(look)

    model.layers[0].register_forward_hook(watch)
    torch.manual_seed(0)
    ref = Net()
    ref.get_parameter(frozen).requires_grad_(False)
    before = ref.get_parameter(frozen).detach().clone()
    diff, moved = train_side_by_side(model, opt, ref, reference_optimizers(ref, predicate), tp=tp)
    frozen_change = (full_params(model)[frozen] - before).abs().max().item()
    storage_ok, looked, held = all(per_rank(_storage_ok(model))), len(seen), per_rank(any(seen))
    # One more window, counted: the frozen matrix is broadcast (its layer needs it) but never reduced, as planned.
    mine, _, total = window(2, *data_coordinates(tp))
    with dmuon.count_comm() as counted:
        train_window(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0), mine, total,
                     use_no_sync=True, tp=tp)
    report("frozen" + "_tp" * tp, max_abs_diff=diff, largest_change=moved, layer2_held_in_layer0_backward=held,
           looked=looked, frozen_change=frozen_change, storage_ok=storage_ok, k=K,
           plan=per_rank(_planned_bytes(model)),
           counted=per_rank({name: counted.bytes.get(name, 0) for name in ("broadcast", "reduce")}),
           dedicated_bytes=dedicated_bytes(ref), frozen_bytes=ref.get_parameter(frozen).numel() * 4)


def grouped(model):
    """Public-style semantic groups: no weight decay for 1-D parameters; other learning rates for matrices."""
    return [{"params": [p for p in model.parameters() if p.ndim < 2], "group_name": "no_decay", "weight_decay": 0.0},
            {"params": [p for p in model.parameters() if p.ndim == 2], "group_name": "rest", "muon_lr": 0.01,
             "adamw_lr": 5e-3}]


def grouped_reference_optimizers(ref, on_muon, muon_class=muon.Muon):
    """The single-process reference of dmuon.Muon(param_groups=grouped(model)): Muon at the "rest" group's lr on
    the matrices ``on_muon`` picks; AdamW without weight decay on the 1-D parameters and at 5e-3 on the other
    matrices."""
    named = dict(ref.named_parameters())
    return [muon_class([p for n, p in named.items() if on_muon(n, p)], **{**HYPER, "lr": 0.01}, ns_dtype=torch.float32),
            torch.optim.AdamW([{"params": [p for p in named.values() if p.ndim < 2], "weight_decay": 0.0},
                               {"params": [p for n, p in named.items() if p.ndim == 2 and not on_muon(n, p)],
                                "lr": 5e-3}], **ADAMW)]


ROUTED = {"layers.0.k_proj.weight": "adamw", "layers.0.q_proj.weight": "sharded_adamw"}
POLICY = {"overrides": [{"name": name.removesuffix(".weight"), "set": {"route": route}} for name, route in ROUTED.items()]}


def check_param_groups(mesh):
    """param_groups (per-group weight decay and learning rates) and param_policy routes ("adamw": the owner
    steps the matrix with AdamW; "sharded_adamw": left to fully_shard) against one process with the same
    groups; a resume of the AdamW-routed matrix's state; refusals by name."""
    def make(seed):  # the groups are built from the model's parameters after fully_shard
        model, _ = build(mesh, zero3=True, seed=seed, param_policy=POLICY)
        return model, muon_of(model, param_groups=grouped(model))

    model, opt = make(0)
    torch.manual_seed(0)
    ref = Net()
    diff, moved = train_side_by_side(model, opt, ref, grouped_reference_optimizers(
        ref, lambda n, p: predicate(n, p) and n not in ROUTED))
    kinds = {n: ("dedicated" if n in model._dmuon.params else "dtensor" if isinstance(p, DTensor) else "plain")
             for n, p in model.named_parameters() if n in ROUTED}
    # The AdamW-routed matrix's state (exp_avg, exp_avg_sq, step: full, by name) resumes bit-identically.
    saved = dmuon.get_optimizer_state_dict(model, opt, rank0_only=False)
    weights = dmuon.get_model_state_dict(model, rank0_only=False)
    fresh, fresh_opt = make(123)
    dmuon.set_model_state_dict(fresh, weights)
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, saved)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda step: 1.0)
    continued = step_both_and_compare((model, opt, sched), (fresh, fresh_opt, fresh_sched))
    torch.manual_seed(0)
    refusals = {
        "unknown_key": error_of(lambda: muon_of(model, param_groups=[{"params": list(model.parameters()),
                                                                       "betas": (0.9, 0.99)}])),
        "left_out": error_of(lambda: muon_of(model, param_groups=grouped(model)[:1])),
        "output_dtype": error_of(lambda: dmuon.dedicate_params(Net(), mesh, predicate, param_policy={
            "defaults": {"output_dtype": "bf16"}})),
        "master_dtype": error_of(lambda: dmuon.dedicate_params(Net(), mesh, predicate, param_policy={
            "defaults": {"master_dtype": torch.bfloat16}})),
    }
    groups_summary, plan = dmuon.summarize_param_groups(model, opt), dmuon.summarize_comm_plan(model)
    text = dmuon.format_summary(groups_summary) + dmuon.format_summary(plan)
    summaries = per_rank({
        "keys": sorted(groups_summary), "group_keys": sorted(groups_summary["groups"][0]),
        "row_keys": sorted(groups_summary["parameters"][0]), "plan_keys": sorted(plan),
        "plan_group_keys": sorted(plan["groups"][0]), "plan_total_keys": sorted(plan["totals"]),
        "owned": groups_summary["owned_dedicated_param_count"], "dedicated": groups_summary["dedicated_param_count"],
        "routes": {row["name"]: row["route"] for row in groups_summary["parameters"]},
        "text_names_everything": all(name in text for name in [*(g["group_name"] for g in opt.param_groups),
                                                                *(u.path for u in model._dmuon.units)])})
    report("param_groups", max_abs_diff=diff, largest_change=moved, kinds=kinds, summaries=summaries,
           groups=[g["group_name"] for g in opt.param_groups],
           exp_avg_saved="exp_avg" in saved["state"]["layers.0.k_proj.weight"],
           continued_max_diff=continued, refusals=per_rank_outcomes(refusals))


class PolarExpressMuon(muon.Muon):
    """The reference of ns_backend=POLAR_EXPRESS: dmuon_edu.newton_schulz run directly with those coefficients."""

    def _orthogonaliser(self, group):
        return partial(newton_schulz, steps=group["ns_steps"], coefficients=dmuon.POLAR_EXPRESS_COEFFICIENTS,
                       dtype=group["ns_dtype"], gram_space=False)


def polar_express():
    return dmuon.NewtonSchulz("direct", coefficients=dmuon.POLAR_EXPRESS_COEFFICIENTS)


def check_ns_backend(mesh):
    """ns_backend=NewtonSchulz("direct", coefficients=POLAR_EXPRESS_COEFFICIENTS) against one process running
    dmuon_edu.newton_schulz directly with those coefficients."""
    model, opt = build(mesh, zero3=True, muon_kwargs={"ns_backend": polar_express()})
    torch.manual_seed(0)
    ref = Net()
    diff, moved = train_side_by_side(model, opt, ref, reference_optimizers(ref, predicate, PolarExpressMuon))
    torch.manual_seed(0)
    jordan = Net()  # the default coefficients, for scale: the comparison above must tell the two apart
    jordan_optimizers = reference_optimizers(jordan, predicate)
    for step in range(2):
        reference_step(jordan, jordan_optimizers, step)
    report("ns_backend", max_abs_diff=diff, largest_change=moved,
           differs_from_jordan=max((a - b).abs().max().item() for a, b in zip(ref.parameters(), jordan.parameters())))


def check_wrapped_checkpoints(mesh, layout="fsdp2"):
    """A checkpoint saved with checkpoint_wrapper around every block resumes into the model without it, and
    the reverse: the same keys, the same weights, and the same next step, bit for bit. ``layout``: "fsdp2",
    "ddp" (the DDP backend), "tp" (FSDP2 + TP) or "ddp_tp"."""
    tp = layout.endswith("tp")
    builder = (partial(build_ddp, mesh, tp=tp) if layout.startswith("ddp") else partial(build, mesh, True, tp=tp))
    result = {}
    for saved_wrapped in (True, False):
        model, opt = builder(wrapped=saved_wrapped)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(2):
            mine, _, total = window(step, *data_coordinates(tp))
            train_window(model, opt, sched, mine, total, use_no_sync=True, tp=tp)
        saved = {"model": dmuon.get_model_state_dict(model, rank0_only=False),
                 "optim": dmuon.get_optimizer_state_dict(model, opt, rank0_only=False)}
        fresh, fresh_opt = builder(seed=123, wrapped=not saved_wrapped)
        fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, schedule)
        fresh_sched.load_state_dict(sched.state_dict())
        dmuon.set_model_state_dict(fresh, saved["model"])
        dmuon.set_optimizer_state_dict(fresh, fresh_opt, saved["optim"])
        keys = [*saved["model"], *saved["optim"]["state"]]
        result["saved_wrapped" if saved_wrapped else "saved_plain"] = dict(
            wrapper_in_keys=[k for k in keys if "_checkpoint_wrapped_module" in k],
            restored_max_diff=max_difference(model, fresh),
            continued_max_diff=step_both_and_compare((model, opt, sched), (fresh, fresh_opt, fresh_sched), tp=tp))
    report("wrapped_checkpoints" + ("" if layout == "fsdp2" else f"_{layout}"), **result)


def check_partial_clip(mesh, backend="fsdp2"):
    """torch.nn.utils.clip_grad_norm_(model.parameters()) sees the FSDP2 gradients (on the DDP backend: the
    replicated ones) only: its norm is below the global one, and step() warns on every rank; no warning
    without a clip or with dmuon's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "fsdp2":
        model, opt = build(mesh, zero3=True)
        # An output FSDP2's root does not look into: its last gradients are written in its end-of-backward
        # callback, after dmuon's, which must not take that for a clip.
        model.boxed = True
    else:
        model, opt = build_ddp(mesh)
    outcome, norms, stats = {}, {}, {}
    for step, clip in enumerate(("none", "dmuon", "torch")):
        mine, (x_full, y_full), total = window(step, rank, world)
        for x, y in mine:  # no no_sync: each backward's gradients are added into the ones before
            out = model(x).value if backend == "fsdp2" else model(x)
            (F.mse_loss(out, y, reduction="sum") * world / (total * OUT)).backward()
        if clip == "torch" and backend == "ddp":
            # The full batch's gradient norm at this step's weights: read after the window's first forward,
            # which waited for the last step's broadcast of the owners' matrices (replicate_async).
            ref = Net()
            ref.load_state_dict({n: p.detach().cpu() for n, p in model.named_parameters()}, strict=True)
            F.mse_loss(ref(x_full), y_full, reduction="sum").div(total * OUT).backward()
            norms["reference"] = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
        if clip == "dmuon":
            clipped = dmuon.clip_grad_norm_(model, 1e-3)
            stats = {"max_norm": clipped.max_norm, "norm_type": clipped.norm_type, "clipped": bool(clipped.clipped),
                     "clip_coef_below_1": float(clipped.clip_coef) < 1, "found_inf": bool(clipped.found_inf),
                     "strategy": clipped.strategy}
        if clip == "torch":
            norms["global"] = dmuon.clip_grad_norm_(model, None).total_norm.item()
            norms["torch"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        opt.zero_grad()
        outcome[clip] = [str(w.message) for w in caught if "were scaled after the backward" in str(w.message)]
    report("partial_clip" if backend == "fsdp2" else "ddp_partial_clip", warned=per_rank_outcomes(outcome),
           stats=per_rank(stats), **norms)


def check_order_modes(mesh):
    """order_check "per_step", after its first step (strict): a step like the last one makes no store round
    trip; a step that every rank changes alike (an evaluation on every rank first) meets in the store and goes
    on, as does the step after it (unlike the one before), and the next makes none again. On gloo a rank that
    runs layers 1 and 2 swapped (resident in Z2: no dmuon collective notices) is named at that forward, on both
    ranks; as on NCCL (nothing checked before a collective) step() refuses it on every rank, naming both layers;
    and a wait that times out names the first differing event from the ranks' logs. "off" makes no round trip."""
    rank, world = dist.get_rank(), dist.get_world_size()
    short = short_timeout_mesh()
    outcome, trips = {}, {}
    model, opt = build(short, zero3=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    order = model._dmuon.order
    for step in range(5):
        before = order.round_trips
        mine, _, total = window(step, rank, world)
        if step == 2:
            with torch.no_grad():
                model(mine[0][0])
        train_window(model, opt, sched, mine, total, use_no_sync=True)
        trips[f"step_{step}"] = order.round_trips - before
    mine, _, total = window(5, rank, world)

    def swapped_window():
        for j, (x, y) in enumerate(mine):
            model.run_order = [0, 2, 1] if rank == 1 and j == 1 else None
            with dmuon.no_sync(model) if j < K - 1 else contextlib.nullcontext():
                (F.mse_loss(model(x), y, reduction="sum") * world / (total * OUT)).backward()
        opt.step()

    outcome["forward"] = error_of(swapped_window)
    distributed.barrier()
    model, opt = build(short_timeout_mesh(), zero3=False)
    train_window(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule), *window(0, rank, world)[::2],
                 use_no_sync=True)
    model._dmuon.order.gloo = False  # as on NCCL: the step's comparison is the only check after the first step
    outcome["step"] = error_of(swapped_window)
    distributed.barrier()
    model, opt = build(short_timeout_mesh(), zero3=True)
    train_window(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule), *window(0, rank, world)[::2],
                 use_no_sync=True)
    state = model._dmuon
    state.order.gloo = False  # as on NCCL, where nothing refuses the event before it runs: only the timeout tells
    # Each rank waits in a broadcast from the other: both receive, both time out.
    target = next(p for p in state.params.values() if not state.owns(p))
    buffer = torch.empty(dmuon.record_of(target).shape)

    def wait():
        description = f"a test broadcast of {state.name_of[target]} from rank {state.owner_of(target)}"
        with state.order.collective(description):
            dist.broadcast(buffer, group=state.group, group_src=state.owner_of(target))

    outcome["timeout"] = error_of(wait)
    distributed.barrier()
    model, opt = build(mesh, zero3=True, muon_kwargs={"order_check": "off"})
    train_window(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule), *window(0, rank, world)[::2],
                 use_no_sync=True)
    trips["off"] = model._dmuon.order.round_trips
    # The DDP backend broadcasts its updates at the end of each step(): those broadcasts belong to the step that
    # issued them, so the second step is like the first and meets no rank (it met at every event when they
    # counted as the next step's first).
    model, opt = build_ddp(mesh)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(3):
        before = model._dmuon.order.round_trips
        train_window(model, opt, sched, *window(step, rank, world)[::2], use_no_sync=True)
        trips[f"ddp_backend_step_{step}"] = model._dmuon.order.round_trips - before
    report("order_modes", **per_rank_outcomes(outcome), round_trips=trips)


# ------------------------------------------------------------------ the DDP backend (dedicate_params_ddp)
DDP_ROUTED = "layers.0.k_proj.weight"  # routed to AdamW by param_policy: its owner steps it with AdamW
DDP_FROZEN = "layers.2.down_proj.weight"  # requires_grad=False: never reduced, never broadcast


def check_evaluation_on_one_rank():
    """A classic port bug: after a step, rank 0 alone evaluates (a forward under no_grad). Its peers' next
    collectives pair with that forward's: gloo aborted both processes natively on the first size mismatch (26 s
    in, no Python error). Per order_check mode, what each rank raises and how long after the evaluation."""
    rank, world = dist.get_rank(), dist.get_world_size()
    outcome = {}
    for mode in ("per_step", "strict"):
        # a group of its own with a 1 s timeout: the rank ahead waits in its collective until the other's refusal
        # ends its process, or, as here where it goes on, until the timeout
        model, opt = build(short_timeout_mesh(), zero3=True, muon_kwargs={"order_check": mode})
        started = None
        try:
            for step in range(3):
                mine, _, total = window(step, rank, world)
                for x, y in mine:
                    F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                started = time.perf_counter()
                if rank == 0:
                    with torch.no_grad():
                        model(mine[0][0])
            outcome[mode] = {"error": None}
        except RuntimeError as error:
            outcome[mode] = {"error": str(error), "seconds": time.perf_counter() - started}
    report("evaluation_on_one_rank", **per_rank_outcomes(outcome))


def _initial_model():
    torch.manual_seed(0)
    return Net()


def build_ddp(mesh, seed=0, muon_kwargs=None, tp=False, wrapped=False, tied=False, compiled=False, net=None,
              **dedicate_kwargs):
    """dmuon's DDP backend (with ``tp``: DDP + TP); ``tied``, ``compiled``, ``net`` and ``muon_kwargs`` as for build."""
    torch.manual_seed(seed)
    model = (Net(tied) if net is None else net()).to(mesh.device_type)
    mesh2d = tp_mesh(mesh.device_type) if tp else None
    if tp:
        parallelize(model, mesh2d)
    if wrapped:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    if compiled:
        compile_blocks(model)
    if tp:  # the public DDP + TP order: TP, then dedicate_params_ddp_tp and replicate_tp on the DP axis
        dmuon.dedicate_params_ddp_tp(model, mesh2d["dp"], predicate, **dedicate_kwargs)
        dmuon.replicate_tp(model, mesh2d["dp"])
    else:
        dmuon.dedicate_params_ddp(model, mesh, predicate, **dedicate_kwargs)
        dmuon.replicate(model, mesh)
    return model, muon_of(model, **_muon_kwargs(model, muon_kwargs))


def check_ddp_tp(mesh):
    """dedicate_params_ddp_tp + replicate_tp on (dp, tp) = (W/2, 2): 3 steps with no_sync and clipping against one
    process, one step's collectives against the plan, what each rank holds, and a resume from full state dicts."""
    rank, world = data_coordinates(tp=True)
    model, opt = build_ddp(mesh, tp=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref = _initial_model()
    ref_optimizers = reference_optimizers(ref, predicate)
    ref_scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in ref_optimizers]
    max_diff = 0.0
    clip_counter = dmuon.count_comm()
    for step in range(STEPS):
        mine, _, total = window(step, rank, world)
        counter = dmuon.count_comm() if step == 1 else contextlib.nullcontext()
        with counter:
            train_window(model, opt, sched, mine, total, use_no_sync=True, tp=True,
                         clip_counter=clip_counter if step == 1 else None)
        if step == 1:
            comm = {name: counter.bytes.get(name, 0) for name in ("reduce", "broadcast", "gather", "scatter")}
            predicted = time_model_counts(dmuon.Layout("ddp", "dmuon", tp=2), counter, clip_counter, tp=True)
        reference_step(ref, ref_optimizers, step, tp=True)
        for s in ref_scheds:
            s.step()
        ours = full_params(model)
        max_diff = max(max_diff, max((ours[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()))
    moved = max((p.detach() - q).abs().max().item() for p, q in zip(ref.parameters(), _initial_params()))
    totals = dmuon.summarize_comm_plan(model)["totals"]
    plan = {"reduce": totals["stage1_shard_reduce_tensor_bytes"], "broadcast": totals["broadcast_tensor_bytes"],
            "gather": totals["tp_gather_tensor_bytes_this_rank"], "scatter": totals["tp_scatter_tensor_bytes_this_rank"]}
    local_bytes = sum(r.master.numel() * r.master.element_size() for r in model._dmuon.records.values())

    weights = dmuon.get_model_state_dict(model, rank0_only=False)
    state = dmuon.get_optimizer_state_dict(model, opt, rank0_only=False)
    fresh, fresh_opt = build_ddp(mesh, seed=123, tp=True)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, schedule)
    fresh_sched.load_state_dict(sched.state_dict())
    dmuon.set_model_state_dict(fresh, weights)
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, state)
    # The wrong entry point for each half of DDP + TP is refused on every rank, naming the right one.
    refusals = {}
    torch.manual_seed(0)
    plain = Net()
    parallelize(plain, tp_mesh(mesh.device_type))
    dp = tp_mesh(mesh.device_type)["dp"]
    for what, call in (("dedicate_params_ddp", lambda: dmuon.dedicate_params_ddp(plain, dp, predicate)),
                       ("replicate", lambda: dmuon.replicate(model, dp)),
                       ("compute_dtype", lambda: build_ddp(mesh, tp=True, compute_dtype=torch.bfloat16))):
        try:
            call()
        except (ValueError, RuntimeError) as error:
            refusals[what] = str(error)
    report("ddp_tp", max_abs_diff=max_diff, refusals=refusals, largest_change=moved, dedicated_bytes=dedicated_bytes(ref),
           per_rank=per_rank(comm), plan=per_rank(plan), time_model=per_rank(predicted),
           # every rank keeps its whole TP shard of every matrix (half of each)
           held_everywhere=all(per_rank(dmuon.held_bytes(model) == local_bytes == dedicated_bytes(ref) // 2)),
           max_abs_diff_after_resume=step_both_and_compare((model, opt, sched), (fresh, fresh_opt, fresh_sched),
                                                           tp=True))


DDP_TP_ROUTED = "pool.out_proj.weight"  # not TP-sharded (the MHA stays replicated over TP): it may go to AdamW


def check_ddp_tp_api(mesh):
    """The public API on DDP + TP, PooledTP on (dp, tp) = (W/2, 2), 2 steps against one process with the same
    groups, coefficients and clipping: param_groups, param_policy routing the MHA's out_proj to AdamW, the Polar
    Express ns_backend, a hook boundary predicate, and both clip forms' statistics (opt.clip_grad_norm_(None): the
    Muon gradients, measured; dmuon.clip_grad_norm_(model, MAX_NORM): every gradient, clipped)."""
    policy = {"overrides": [{"name": DDP_TP_ROUTED.removesuffix(".weight"), "set": {"route": "adamw"}}]}
    model, opt = build_ddp(mesh, tp=True, net=PooledTP, param_policy=policy, hook_boundary_predicate=pooled_tp_boundary,
                           muon_kwargs=lambda m: {"param_groups": grouped(m), "ns_backend": polar_express()})
    torch.manual_seed(0)
    ref = PooledTP()
    log = {}
    diff, moved = train_side_by_side(model, opt, ref, grouped_reference_optimizers(
        ref, lambda n, p: predicate(n, p) and n != DDP_TP_ROUTED, PolarExpressMuon), tp=True, clip_log=log)
    clips = []
    for (measured, clipped), (ref_muon_norm, ref_norm) in zip(log["dmuon"], log["reference"]):
        ref_coef = min(1.0, MAX_NORM / (ref_norm + 1e-6))  # torch's clip_grad_norm_ coefficient
        clips.append(dict(
            muon_norm_rel_diff=abs(measured.total_norm.item() - ref_muon_norm) / ref_muon_norm,
            norm_rel_diff=abs(clipped.total_norm.item() - ref_norm) / ref_norm,
            coef_rel_diff=abs(float(clipped.clip_coef) - ref_coef) / ref_coef, reference_norm=ref_norm,
            reference_clipped=ref_norm > MAX_NORM,
            per_rank=per_rank({"norms": [measured.total_norm.item(), clipped.total_norm.item()],
                               "fields": [sorted(s.as_dict()) for s in (measured, clipped)],
                               "max_norm": [measured.max_norm, clipped.max_norm],
                               "clip_coef_measured": float(measured.clip_coef),
                               "clipped": [bool(measured.clipped), bool(clipped.clipped)],
                               "found_inf": [bool(measured.found_inf), bool(clipped.found_inf)],
                               "strategy": [measured.strategy, clipped.strategy]})))
    torch.manual_seed(0)
    jordan = PooledTP()  # the default coefficients, for scale: the comparison above must tell the two apart
    jordan_optimizers = grouped_reference_optimizers(jordan, lambda n, p: predicate(n, p) and n != DDP_TP_ROUTED)
    for step in range(2):
        reference_step(jordan, jordan_optimizers, step, tp=True)
    routes = {row["name"]: row["route"] for row in dmuon.summarize_param_groups(model, opt)["parameters"]}
    # A TP-sharded matrix routed to AdamW is refused on every rank, naming what this backend can do instead.
    sharded_route = {"overrides": [{"name": "layers.0.k_proj", "set": {"route": "adamw"}}]}
    refused = error_of(lambda: build_ddp(mesh, tp=True, net=PooledTP, param_policy=sharded_route,
                                         hook_boundary_predicate=pooled_tp_boundary))
    report("ddp_tp_api", max_abs_diff=diff, largest_change=moved, clips=clips, max_norm=MAX_NORM,
           differs_from_jordan=max((a - b).abs().max().item() for a, b in zip(ref.parameters(), jordan.parameters())),
           sharded_adamw_refusal=per_rank(refused),
           units=[u.path for u in model._dmuon.units], groups=[g["group_name"] for g in opt.param_groups],
           routed=routes.get(DDP_TP_ROUTED),
           tp_sharded=sorted(n for n, p in model._dmuon.params.items() if dmuon.record_of(p).tp))


def check_hook_boundaries_tp(mesh):
    """PooledTP: a TP-sharded block, then an nn.MultiheadAttention that stays replicated over TP, every matrix
    dedicated on mesh["dp"] with a hook boundary predicate: FSDP2 + TP in Z3 and Z2 and DDP + TP, 2 steps with
    clipping against one process."""
    result = {}
    for layout in ("z3", "z2", "ddp"):
        if layout == "ddp":
            model, opt = build_ddp(mesh, tp=True, net=PooledTP, hook_boundary_predicate=pooled_tp_boundary)
        else:
            model, opt = build(mesh, layout == "z3", tp=True, net=PooledTP, hook_boundary_predicate=pooled_tp_boundary)
        torch.manual_seed(0)
        ref = PooledTP()
        diff, moved = train_side_by_side(model, opt, ref, reference_optimizers(ref, predicate), tp=True)
        result[layout] = dict(
            max_abs_diff=diff, largest_change=moved, units=[u.path for u in model._dmuon.units],
            storage_ok=all(per_rank(_storage_ok(model))),
            tp_sharded=sorted(n for n, p in model._dmuon.params.items() if dmuon.record_of(p).tp),
            dedicated=sorted(model._dmuon.params))
    report("hook_boundaries_tp", **result)


def replicated_muon_step(ddp, optimizers, mine, total, use_no_sync):
    """One optimizer step of torch DDP with Muon replicated on every rank (the peer dmuon's DDP backend must
    match): the same micro-batches, loss scaling and clipping as train_window."""
    world = dist.get_world_size()
    for j, (x, y) in enumerate(mine):
        with ddp.no_sync() if use_no_sync and j < K - 1 else contextlib.nullcontext():
            (F.mse_loss(ddp(x), y, reduction="sum") * world / (total * OUT)).backward()
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
    for o in optimizers:
        o.step()
        o.zero_grad()


def check_ddp(mesh):
    """dedicate_params_ddp + replicate against one process (full batch) and against torch DDP with replicated
    Muon, with and without no_sync; the bytes of one optimizer step; a resume; param_policy with a hook boundary
    predicate; the matrices every rank holds."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    for use_no_sync in (True, False):
        label = "no_sync" if use_no_sync else "sync_every_micro_batch"
        model, opt = build_ddp(mesh)
        ref, peer = _initial_model(), DistributedDataParallel(_initial_model().to(mesh.device_type))
        ref_optimizers, peer_optimizers = reference_optimizers(ref, predicate), reference_optimizers(peer.module,
                                                                                                     predicate)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (opt, *ref_optimizers, *peer_optimizers)]
        max_diff = max_peer_diff = 0.0
        clip_counter = dmuon.count_comm()
        for step in range(STEPS):
            mine, _, total = window(step, rank, world)
            counter = dmuon.count_comm() if step == 1 else contextlib.nullcontext()
            with counter:
                train_window(model, opt, schedulers[0], mine, total, use_no_sync,
                             clip_counter=clip_counter if step == 1 else None)
            if step == 1:
                comm = {name: counter.bytes.get(name, 0) for name in ("reduce", "broadcast", "all_reduce")}
                predicted = (time_model_counts(dmuon.LAYOUTS["dmuon DDP backend"], counter, clip_counter)
                             if use_no_sync else None)
            peer_counter = dmuon.count_comm() if step == 1 else contextlib.nullcontext()
            with peer_counter:
                replicated_muon_step(peer, peer_optimizers, mine, total, use_no_sync)
            if step == 1:
                peer_comm = dict(peer_counter.bytes)
            reference_step(ref, ref_optimizers, step)
            for s in schedulers[1:]:
                s.step()
            ours = full_params(model)
            max_diff = max(max_diff, max((ours[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()))
            max_peer_diff = max(max_peer_diff, max((ours[n] - p.detach().cpu()).abs().max().item()
                                                   for n, p in peer.module.named_parameters()))
        moved = max((p.detach() - q).abs().max().item() for p, q in zip(ref.parameters(), _initial_params()))
        matrices = [p for p in model._dmuon.params.values()]
        plan = per_rank(_planned_bytes(model))
        report(f"ddp_{label}", max_abs_diff=max_diff, max_abs_diff_to_ddp_replicated_muon=max_peer_diff,
               largest_change=moved, k=K, dedicated_bytes=dedicated_bytes(ref), plan=plan,
               replicated_bytes=sum(p.numel() * p.element_size() for n, p in ref.named_parameters()
                                    if not predicate(n, p)),
               per_rank=per_rank(comm), peer_per_rank=per_rank(peer_comm), time_model=per_rank(predicted),
               # every rank keeps every matrix whole, and exactly one rank steps each
               held_everywhere=all(per_rank(dmuon.held_bytes(model) == dedicated_bytes(ref))),
               owners=sorted(set(dmuon.ownership(model).values())),
               steppers=[sum(x) for x in zip(*per_rank([opt._dmuon.steps(p) for p in matrices]))])

    # A resume from full state dicts continues bit-identically.
    model, opt = build_ddp(mesh)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(2):
        mine, _, total = window(step, rank, world)
        train_window(model, opt, sched, mine, total, use_no_sync=True)
    weights, state = dmuon.get_model_state_dict(model, rank0_only=False), dmuon.get_optimizer_state_dict(
        model, opt, rank0_only=False)
    fresh, fresh_opt = build_ddp(mesh, seed=123)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, schedule)
    fresh_sched.load_state_dict(sched.state_dict())
    dmuon.set_model_state_dict(fresh, weights)
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, state)
    resumed = step_both_and_compare((model, opt, sched), (fresh, fresh_opt, fresh_sched))

    # param_policy (one matrix routed to AdamW), a hook boundary predicate, param_groups and the Polar Express
    # ns_backend, against one process with the same groups and coefficients.
    policy = {"overrides": [{"name": DDP_ROUTED.removesuffix(".weight"), "set": {"route": "adamw"}}]}
    torch.manual_seed(0)
    model = Net().to(mesh.device_type)
    dmuon.dedicate_params_ddp(model, mesh, predicate, param_policy=policy,
                              hook_boundary_predicate=lambda m: isinstance(m, Block))
    dmuon.replicate(model, mesh)
    opt = muon_of(model, param_groups=grouped(model), ns_backend=polar_express())
    torch.manual_seed(0)
    ref = Net()
    on_muon = lambda n, p: predicate(n, p) and n != DDP_ROUTED  # noqa: E731
    named = dict(ref.named_parameters())
    diff, moved = train_side_by_side(model, opt, ref, [
        PolarExpressMuon([p for n, p in named.items() if on_muon(n, p)], **{**HYPER, "lr": 0.01},
                         ns_dtype=torch.float32),
        torch.optim.AdamW([{"params": [p for p in named.values() if p.ndim < 2], "weight_decay": 0.0},
                           {"params": [p for n, p in named.items() if p.ndim == 2 and not on_muon(n, p)], "lr": 5e-3}],
                          **ADAMW)])
    report("ddp_resume_and_policy", max_abs_diff_after_resume=resumed, policy_max_abs_diff=diff,
           policy_largest_change=moved, units=[u.path for u in model._dmuon.units],
           groups=[g["group_name"] for g in opt.param_groups])

    # compute_dtype (the public positional order) and a frozen matrix: the matrices compute in bf16, their masters
    # stay float32, and summarize_comm_plan plans what count_comm counts in a window (no broadcast before a
    # forward; after the step, the trainable masters in float32).
    torch.manual_seed(0)
    model = Net().to(mesh.device_type)
    model.get_parameter(DDP_FROZEN).requires_grad_(False)
    dmuon.dedicate_params_ddp(model, mesh, predicate, torch.bfloat16)
    dmuon.replicate(model, mesh)
    opt = muon_of(model)
    seen = []
    model.layers[0].q_proj.register_forward_pre_hook(lambda m, _args: seen.append(str(m.weight.dtype)))
    mine, _, total = window(0, rank, world)
    with dmuon.count_comm() as counted:
        train_window(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule), mine, total, use_no_sync=True,
                     autocast=True)
    frozen_bytes = model.get_parameter(DDP_FROZEN).numel() * 4
    report("ddp_compute_dtype_and_frozen", plan=per_rank(_planned_bytes(model)),
           counted=per_rank({name: counted.bytes.get(name, 0) for name in ("broadcast", "reduce")}),
           trainable_bytes=dedicated_bytes(_initial_model()) - frozen_bytes,
           forward_dtypes=sorted(set(seen)), master_dtypes=sorted({str(r.master.dtype)
                                                                    for r in model._dmuon.records.values()}))


def check_direct_reads(mesh, backend):
    """Direct reads of every dedicated matrix right after step(), before the next forward, on every rank that
    holds it: the DDP backend's ("ddp", "ddp_tp": its TP shards), whose non-owners, or HSDP's ("hsdp": 2 x W/2),
    whose holders in the replica that does not step it, are still receiving the step's result
    (replicate_async=True). Each kind of read is the first after its own step: p.clone() after step 0,
    torch.save(model.state_dict()) after step 1, an EMA of the weights (torch._foreach_mul_ / _foreach_add_)
    after step 2. Every rank's read against the rank that made the result (in its TP column), and how far each
    step moved the matrices (what a stale read would be off by). HSDP runs as 2 x 1 on 2 ranks (with more shards
    a non-holder's model.state_dict() is refused by name); "ddp_tp" needs (dp, tp) = (2, 2)."""
    tp = backend == "ddp_tp"
    rank, world = data_coordinates(tp)
    model, opt = build_ddp(mesh, tp=tp) if backend != "hsdp" else build(mesh, zero3=True, hsdp=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    state = model._dmuon
    names = [n for n, p in state.params.items() if state.owns(p)]  # HSDP's non-holders refuse reads by name
    params = [state.params[n] for n in names]
    ema = [p.detach().clone() for p in params]
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731

    def update_ema():
        torch._foreach_mul_(ema, 0.9)
        torch._foreach_add_(ema, params, alpha=0.1)

    def saved():
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        loaded = {fqn(k): v for k, v in torch.load(buffer, weights_only=False).items()}
        return [loaded[n] for n in names]

    reads, moved = {}, []
    for step, kind in enumerate(("clone", "torch.save(model.state_dict())", "ema")):
        before = [local(p.detach()).clone() for p in params]
        mine, _, total = window(step, rank, world)
        train_window(model, opt, sched, mine, total, use_no_sync=True, tp=tp)
        if kind == "ema":
            update_ema()
            read = [e.clone() for e in ema]
        else:
            read = [p.clone() for p in params] if kind == "clone" else saved()
            update_ema()
        reads[kind] = {n: local(r) for n, r in zip(names, read)}
        moved.append(min((local(p.detach()) - b).abs().max().item() for p, b in zip(params, before)))  # landed now
    # the ranks whose masters the step wrote (the others receive them): the owner, HSDP's stepping replica's holder
    made_here = {n: state.receives_gradient(p) and dmuon.record_of(p).replica == state.replica
                 for n, p in zip(names, params)}
    everyone = per_rank((state.tp_index, made_here, reads))
    attributes = per_rank(attributes_of_dedicated(model))
    maker = {(column, n): theirs for column, made, theirs in everyone for n, here in made.items() if here}
    differences = {kind: max((theirs[kind][n] - maker[column, n][kind][n]).abs().max().item()
                             for column, _, theirs in everyone for n in theirs[kind]) for kind in reads}
    report(f"direct_reads_{backend}", max_abs_diff_to_stepper=differences,
           min_change_by_a_step=min(per_rank(min(moved))),
           matrices_read_per_rank=[len(theirs["clone"]) for _, _, theirs in everyone],
           stepped_elsewhere_per_rank=[sum(not here for here in made.values()) for _, made, _ in everyone],
           attributes=attributes)


def check_ddp_tied(mesh):
    """The DDP backend with one matrix reached from two layers (Net(tied=True)): 2 steps with no_sync against
    one process."""
    model, opt = build_ddp(mesh, tied=True)
    torch.manual_seed(0)
    ref = Net(tied=True)
    diff, moved = train_side_by_side(model, opt, ref, reference_optimizers(ref, predicate))
    report("ddp_tied", max_abs_diff=diff, largest_change=moved,
           tied_units=len(model._dmuon.units_of[model.layers[0].up_proj.weight]))


# The TP plan of parallelize(), in the time model's words.
TP_STYLES = {f"layers.{i}.{name}": style for i in range(LAYERS)
             for name, style in (("q_proj", "colwise, gathered"), ("k_proj", "colwise, gathered"),
                                 ("up_proj", "colwise"), ("down_proj", "rowwise"))}


def time_model_counts(layout, counter, clip_counter, tp=False):
    """One step's collectives on this rank as count_comm counted them, the clip's own all-reduces taken out (the
    layout does not issue them), beside what the time model plans for this rank: {collective: [calls, bytes]}."""
    counted = {name: [counter.calls[name] - clip_counter.calls.get(name, 0),
                      counter.bytes[name] - clip_counter.bytes.get(name, 0)] for name in counter.calls}
    workload = dmuon.Workload.from_model(Net(), predicate, tokens=1, tensor_parallel=TP_STYLES if tp else {})
    planned = step_time.counted(dmuon.planned_collectives(workload, layout, world_size=dist.get_world_size(),
                                                          micro_batches=K, rank=dist.get_rank()))
    return {"counted": {k: v for k, v in counted.items() if v[0]}, "planned": planned}


def check_calibrate():
    """dmuon.calibrate() on these ranks: its seconds and what it measured."""
    started = time.perf_counter()
    hardware = dmuon.calibrate()
    report("calibrate", seconds_taken=time.perf_counter() - started, world=dist.get_world_size(),
           matmul_flops=dict(hardware.matmul_flops), memory_bandwidth=hardware.memory_bandwidth,
           elementwise_seconds=hardware.elementwise_seconds, nonlinearity_seconds=hardware.nonlinearity_seconds,
           cores=hardware.cores, concurrent_share=hardware.concurrent_share, calibrated={size: {c: [cost.alpha, cost.beta] for c, cost in costs.items()}
                                             for size, costs in hardware.calibrated.items()},
           host_work={size: dict(work) for size, work in hardware.host_work.items()})


def _planned_bytes(model):
    """summarize_comm_plan's planned broadcast and reduce bytes of one pass (this rank's)."""
    totals = dmuon.summarize_comm_plan(model)["totals"]
    return {"broadcast": totals["broadcast_tensor_bytes"], "reduce": totals["stage1_shard_reduce_tensor_bytes"]}


def main():
    directory, atexit_marks = sys.argv[1], sys.argv[2]
    with distributed.session() as ranks:
        # session() leaves the interpreter's exit to the script: a user's atexit handler (a logger's
        # flush, an async checkpoint's wait) must run on every rank, FSDP2 and dmuon still alive.
        atexit.register(lambda: (Path(atexit_marks) / f"rank{ranks.rank}").write_text("ran"))
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        DEVICE[0] = ranks.device
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference runs in true float32 on the CPU
        LAST_REPORT[0] = time.perf_counter()  # the first check's seconds leave out the start-up
        # What real training does, tested once: on 2 CPU ranks (its timeout checks need gloo, which
        # raises at a timeout where NCCL's watchdog ends the process).
        real_use = ranks.world_size == 2 and ranks.device.type == "cpu"
        check_structure(mesh)
        check_schedule(mesh)
        if real_use:
            check_placeholders(mesh)
            check_misuse(mesh)
            check_divergence()
        for zero3 in (True, False):
            for use_no_sync in (True, False):
                check_equivalence(mesh, zero3, use_no_sync)
            if real_use:
                check_equivalence(mesh, zero3, use_no_sync=True, tied=True)
                check_equivalence(mesh, zero3, use_no_sync=True, checkpointed=True)
                check_mixed_precision(mesh, zero3)
        check_state_dict(mesh, directory)
        if ranks.world_size == 4:  # HSDP as 2 x 2, tensor parallelism as (dp, tp) = (2, 2)
            check_placement()
            for zero3 in (True, False):
                check_equivalence(mesh, zero3, use_no_sync=True, hsdp=True)
                check_equivalence(mesh, zero3, use_no_sync=True, tp=True)
            check_hsdp_publish(mesh, directory)
            check_hsdp_frozen(mesh)
            check_tp_resume(mesh, directory)
            check_ddp_tp(mesh)
            check_ddp_tp_api(mesh)
            check_hook_boundaries_tp(mesh)
            for layout in ("tp", "ddp_tp"):
                check_wrapped_checkpoints(mesh, layout)
            check_frozen(mesh, tp=True)
            check_public_tp_dp()
            check_direct_reads(mesh, "ddp_tp")
            check_compiled_graphs(["tp alone", "tp", "ddp_tp"], "compiled_graphs_tp",
                                  styles=("checkpointed, wrapping", "plain, in place"))
        if real_use:
            check_compiled(mesh)
            check_compiled_graphs(["alone", "z3", "z2", "ddp", "hsdp"], "compiled_graphs")
            check_public_api(mesh, directory)
            check_public_basic_dp(directory)
            check_mixed_precision(mesh, zero3=True, via_compute_dtype=True)
            check_hook_boundaries(mesh)
            check_frozen(mesh)
            check_param_groups(mesh)
            check_ns_backend(mesh)
            check_wrapped_checkpoints(mesh)
            check_partial_clip(mesh)
            check_order_modes(mesh)
            check_evaluation_on_one_rank()
            check_calibrate()
            check_ddp(mesh)
            check_partial_clip(mesh, backend="ddp")
            check_wrapped_checkpoints(mesh, "ddp")
            check_ddp_tied(mesh)
            check_compiled(mesh, backend="ddp")
            check_mixed_precision(mesh, zero3=True, via_compute_dtype=True, backend="ddp")
            for backend in ("ddp", "hsdp"):
                check_direct_reads(mesh, backend)
        if ranks.rank == 0:
            check_channel.done()


if __name__ == "__main__":
    main()
