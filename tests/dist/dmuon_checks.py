"""Many dmuon checks in one torchrun launch (tests/test_dmuon.py launches it on 2 and 4 ranks).

    torchrun --nproc-per-node=2 tests/dist/dmuon_checks.py CHECKPOINT_DIR

Rank 0 prints one line per check, ``CHECK {json}``, with the measured quantities; the
test file holds the tolerances and asserts. Every rank builds the same global data
from a seed and takes its own slice, so rank 0 can train the single-process reference
locally: a plain copy of the model on the whole global batch, dmuon_edu.muon.Muon
(float32 Newton-Schulz) on the dedicated matrices and torch.optim.AdamW on the rest.
"""

import atexit
import contextlib
import copy
import datetime
import io
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from dmuon_edu import distributed, dmuon, muon
from dmuon_edu.course.dmuon_problem import is_dedicated as predicate, per_rank
from dmuon_edu.dmuon.placeholder import is_resident

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
        self.embed = nn.Linear(IN, D)  # 2-D but not selected: AdamW
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, OUT)  # 3 rows over 4 ranks: uneven FSDP2 shards
        if tied:  # one matrix reached from two layers (cross-layer sharing, as in ALBERT)
            self.layers[2].up_proj.weight = self.layers[0].up_proj.weight

    def forward(self, x):
        x = self.embed(x)
        for i, layer in enumerate(self.layers):
            if i in self.dropped:
                continue
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        return self.head(x)


def report(name, **measured):
    distributed.print0("CHECK " + json.dumps({"name": name, "nproc": dist.get_world_size(), **measured}))


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


def build(mesh, zero3, seed=0, tied=False, mp_policy=None, checkpointed=False, compiled=False, hsdp=False,
          replicate_async=True):
    torch.manual_seed(seed)
    model = Net(tied, checkpointed).to(mesh.device_type)
    if hsdp:  # FSDP2 shards on the shard axis and replicates across; dmuon holds one copy per replica
        mesh2d = hsdp_mesh(mesh.device_type)
        dmuon.dedicate_params(model, mesh2d["shard"], predicate, reshard_after_forward=zero3,
                              replicate_mesh=mesh2d["replicate"])
        mesh = mesh2d
    else:
        dmuon.dedicate_params(model, mesh, predicate, reshard_after_forward=zero3)
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    if compiled:  # per block; aot_eager: no C++ to compile on 2 cores
        for layer in model.layers:
            layer.compile(backend="aot_eager")
    opt = dmuon.Muon(model, **HYPER, ns_dtype=torch.float32, adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"],
                     adamw_eps=ADAMW["eps"], adamw_weight_decay=ADAMW["weight_decay"], replicate_async=replicate_async)
    return model, opt


def schedule(step):
    return 1.0 / (1.0 + step)


def train_window(model, opt, sched, mine, total, use_no_sync):
    world = dist.get_world_size()
    for j, (x, y) in enumerate(mine):
        ctx = dmuon.no_sync(model) if use_no_sync and j < K - 1 else contextlib.nullcontext()
        with ctx:
            loss = F.mse_loss(model(x), y, reduction="sum") * world / (total * OUT)
            loss.backward()
    norm = dmuon.clip_grad_norm_(model, MAX_NORM)
    opt.step()
    sched.step()
    opt.zero_grad()
    return norm.item()


def dedicated_bytes(model):
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if predicate(n, p))


def max_difference(model, other):
    """Max |difference| of any parameter of two dmuon models (full tensors, gathered)."""
    a, b = full_params(model), full_params(other)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def step_both_and_compare(trained, resumed):
    """Train the window of step 2 on both (model, optimizer, scheduler); their max parameter difference after."""
    mine, _, total = window(2, dist.get_rank(), dist.get_world_size())
    for model, opt, sched in (trained, resumed):
        train_window(model, opt, sched, mine, total, use_no_sync=True)
    return max_difference(trained[0], resumed[0])


def full_params(model):
    sd = dmuon.get_model_state_dict(model, dmuon.StateDictOptions(full_state_dict=True))
    return {k: v.cpu() for k, v in sd.items() if k in dict(model.named_parameters())}


def check_equivalence(mesh, zero3, use_no_sync, tied=False, checkpointed=False, hsdp=False):
    """Train dmuon and the single-process reference side by side; compare after every step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    label = (f"{'z3' if zero3 else 'z2'}_{'no_sync' if use_no_sync else 'sync_every_micro_batch'}"
             f"{'_tied' * tied}{'_checkpointed' * checkpointed}{'_hsdp' * hsdp}")
    model, opt = build(mesh, zero3, tied=tied, checkpointed=checkpointed, hsdp=hsdp)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    torch.manual_seed(0)
    ref = Net(tied)
    ref_muon = muon.Muon([p for n, p in ref.named_parameters() if predicate(n, p)], **HYPER, ns_dtype=torch.float32)
    ref_adamw = torch.optim.AdamW([p for n, p in ref.named_parameters() if not predicate(n, p)], **ADAMW)
    ref_scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (ref_muon, ref_adamw)]

    max_diff, max_norm_rel, clipped, comm, storage = 0.0, 0.0, 0, None, []
    p_m = dedicated_bytes(ref)
    for step in range(STEPS):
        mine, (x, y), total = window(step, rank, world)
        counter = dmuon.count_comm() if step == 1 else contextlib.nullcontext()
        with counter:
            norm = train_window(model, opt, sched, mine, total, use_no_sync)
        if step == 1:
            comm = {"broadcast": counter.bytes.get("broadcast", 0), "reduce": counter.bytes.get("reduce", 0),
                    "broadcast_calls": counter.calls.get("broadcast", 0), "reduce_calls": counter.calls.get("reduce", 0)}
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
    report(f"comm_{label}", k=K, dedicated_bytes=p_m, per_rank=comm_all, zero3=zero3, no_sync=use_no_sync)
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


def check_compiled(mesh):
    """Per-block torch.compile (aot_eager) against eager dmuon: the same steps, and no recompile after warm-up."""
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {}
    for compiled in (False, True):
        model, opt = build(mesh, zero3=True, compiled=compiled)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        graphs = []
        for step in range(STEPS + 1):
            mine, _, total = window(step, rank, world)
            train_window(model, opt, sched, mine, total, use_no_sync=True)
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        runs[compiled] = (full_params(model), graphs)
    (eager, _), (compiled, graphs) = runs[False], runs[True]
    report("compiled", max_abs_diff=max((eager[n] - compiled[n]).abs().max().item() for n in eager),
           graphs_after_each_step=graphs)


def check_mixed_precision(mesh, zero3):
    """FSDP2's bf16 policy with dedicated matrices, against one process computing in the same precision.

    The reference runs every rank's micro-batches in turn through a bf16 copy of its float32
    master model (FSDP2 casts parameters and inputs to param_dtype), sums the bf16 gradients
    in float32 and averages over ranks (reduce_dtype), then steps float32 Muon and AdamW:
    the same arithmetic as the distributed run, in another order of float32 sums, so the
    float32 tolerance applies.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
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
    for step in range(STEPS):
        mine, _, total = window(step, rank, world)
        with dmuon.count_comm() as counts:
            train_window(model, opt, sched, mine, total, use_no_sync=True)
        broadcast_bytes = broadcast_bytes or counts.bytes.get("broadcast", 0)
        low = copy.deepcopy(ref).to(torch.bfloat16)
        summed = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(world):
            for x, y in window(step, r, world)[0]:
                loss = F.mse_loss(low(x.to(torch.bfloat16)), y, reduction="sum") * world / (total * OUT)
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
    owned = [p for p in state.params.values() if state.owns(p)]
    moved = max((p.detach() - q).abs().max().item() for p, q in zip(ref.parameters(), _initial_params()))
    report(f"mixed_precision_{'z3' if zero3 else 'z2'}", max_abs_diff=max_diff, largest_change=moved,
           forward_dtypes=sorted(seen),
           master_dtypes=sorted({str(p.dtype) for p in owned}),
           momentum_dtypes=sorted({str(opt._muon.state[p]["momentum_buffer"].dtype) for p in owned}),
           broadcast_bytes=broadcast_bytes, dedicated_bytes_fp32=dedicated_bytes(ref), zero3=zero3, k=K)


PUBLIC_DEFAULTS = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5,
                       adjust_lr_fn="match_rms_adamw")
PUBLIC_ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8)


def check_public_api(mesh, directory):
    """The public project's defaults, its checkpoint flow, its clip_grad_norm_(optimizer, ...) form."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = Net().to(mesh.device_type)
    dmuon.dedicate_params(plain, mesh, predicate)
    for layer in plain.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    defaults = dmuon.Muon(plain)
    muon_group = {k: defaults.param_groups[0][k] for k in PUBLIC_DEFAULTS}
    adamw_group = {k: defaults.param_groups[1][k] for k in PUBLIC_ADAMW_DEFAULTS}

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
    fresh, fresh_opt = build(mesh, zero3=True, seed=123)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, schedule)  # before the load: it sets lr
    fresh_sched.load_state_dict(sched.state_dict())
    dmuon.set_model_state_dict(fresh, loaded["model"])
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, loaded["optim"])
    restored = max_difference(model, fresh)
    continued = step_both_and_compare((model, opt, sched), (fresh, fresh_opt, fresh_sched))

    # A state dict of gradient-tracking tensors, as named_parameters() gives them.
    torch.manual_seed(7)
    source = Net().to(mesh.device_type)
    dmuon.set_model_state_dict(fresh, {k: v.clone() for k, v in source.state_dict(keep_vars=True).items()})
    b = full_params(fresh)
    from_tracking = max((b[n] - q.detach().cpu()).abs().max().item() for n, q in source.named_parameters())

    # clip_grad_norm_(optimizer, ...): the Muon gradients only, against the reference's full-batch gradients.
    mine, (x, y), total = window(0, rank, world)
    for xb, yb in mine:
        (F.mse_loss(model(xb), yb, reduction="sum") * world / (total * OUT)).backward()
    muon_norm = dmuon.clip_grad_norm_(opt, 1e9).item()
    opt.zero_grad()
    ref = _reference_at(full_params(model))
    F.mse_loss(ref(x), y, reduction="sum").div(total * OUT).backward()
    ref_muon_norm = torch.stack([p.grad.norm() for n, p in ref.named_parameters() if predicate(n, p)]).norm().item()
    report("public_api", muon_group=muon_group, adamw_group=adamw_group,
           public_defaults=PUBLIC_DEFAULTS, public_adamw_defaults={**PUBLIC_ADAMW_DEFAULTS, "betas": [0.9, 0.999]},
           full_on_cpu=on_cpu, kept_per_rank=per_rank(kept), restored_max_diff=restored,
           continued_max_diff=continued, from_tracking_max_diff=from_tracking,
           muon_norm_rel_diff=abs(muon_norm - ref_muon_norm) / ref_muon_norm)


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
    # A predicate that depends on the rank: the ranks would pair their broadcasts wrongly.
    torch.manual_seed(0)
    skewed = Net().to(mesh.device_type)
    outcome["rank_dependent_predicate"] = error_of(lambda: dmuon.dedicate_params(
        skewed, mesh, lambda n, p: predicate(n, p) and not (rank == 1 and n == "layers.1.k_proj.weight")))
    # One rank never calls dedicate_params: the others give up at the group's timeout, with a message.
    short = DeviceMesh.from_group(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3)), "cpu")
    if rank == 0:
        torch.manual_seed(0)
        outcome["a_rank_never_calls"] = error_of(lambda: dmuon.dedicate_params(Net(), short, predicate))
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
        check = order.check
        order.check = lambda description: (self.events.append(("dmuon", description)), check(description))[1]
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
    of different lengths, and a rank that stops answering in a reduce."""
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
    outcome["silent_in_reduce"] = silent_in_reduce(rank)
    report("divergence", **per_rank_outcomes(outcome))


def short_timeout_mesh():
    """A mesh over a group of its own with a 3 s timeout, for a check where one rank waits for another that
    never comes: the group is broken afterwards, and the job goes on on the default group."""
    return DeviceMesh.from_group(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3)), "cpu")


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


def silent_in_reduce(rank):
    """Rank 1 stops answering in its backward, after some of its reduces are issued; rank 0's error is what
    the launcher must name as a collective timeout, with rank 1 as the silent one. Rank 1 then leaves the
    broken group alone (its backward ends with an exception of its own)."""
    model, _ = build(short_timeout_mesh(), zero3=True)
    mine, _, _ = window(0, rank, dist.get_world_size())
    store, key = dist.distributed_c10d._get_default_store(), "silent_in_reduce/rank0_done"

    def stop_answering(_):
        if rank == 1:
            store.wait([key], datetime.timedelta(seconds=60))
            raise SilentRankStopped()

    model.layers[0].down_proj.weight.register_post_accumulate_grad_hook(stop_answering)
    error = None
    try:
        F.mse_loss(model(mine[0][0]), mine[0][1]).backward()
    except SilentRankStopped:
        pass
    except RuntimeError as raised:
        error = f"{type(raised).__name__}: {raised}"
    if rank == 0:
        store.set(key, "1")
    distributed.barrier()
    return error


class SilentRankStopped(Exception):
    """How the silent rank of silent_in_reduce leaves its backward."""


def per_rank_outcomes(outcome):
    return {key: [o.get(key) for o in per_rank(outcome)] for key in sorted(set().union(*per_rank(outcome)))}


def error_of(fn):
    try:
        fn()
        return None
    except RuntimeError as error:
        return str(error)


def _shape_of(name):
    torch.manual_seed(0)
    return dict(Net().named_parameters())[name].shape


def _storage_ok(model):
    """Between steps a non-owner holds no bytes of a dedicated matrix, and its owner all of them."""
    state = model._dmuon
    owned = sum(p.numel() * p.element_size() for p in state.params.values() if state.owns(p))
    return dmuon.held_bytes(model) == owned and not any(
        is_resident(p) for p in state.params.values() if not state.owns(p))


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
           all_accumulated=all(p._accumulated_grad is not None for p in state.params.values()),
           none_reduced=all(p._reduced_grad is None for p in state.params.values()),
           step_raised=raised)

    # The next backward outside no_sync merges and reduces; zero_grad clears everything.
    model(x).square().mean().backward()
    owned = [p for p in state.params.values() if state.owns(p)]
    merged = all(p._accumulated_grad is None for p in state.params.values()) and all(
        p._reduced_grad is not None for p in owned)
    fsdp_grads = any(p.grad is not None for p in model.parameters() if isinstance(p, DTensor))
    opt.zero_grad()
    cleared = all(p._reduced_grad is None and p._accumulated_grad is None for p in state.params.values()) and all(
        p.grad is None for p in model.parameters())
    report("zero_grad", merged_and_reduced=all(per_rank(merged)), fsdp_had_grads=fsdp_grads,
           cleared_every_rank=all(per_rank(cleared)))

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
           released_by_step=all(per_rank(_storage_ok(model))))


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


def main():
    directory, atexit_marks = sys.argv[1], sys.argv[2]
    with distributed.session() as ranks:
        # session() leaves the interpreter's exit to the script: a user's atexit handler (a logger's
        # flush, an async checkpoint's wait) must run on every rank, FSDP2 and dmuon still alive.
        atexit.register(lambda: (Path(atexit_marks) / f"rank{ranks.rank}").write_text("ran"))
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        DEVICE[0] = ranks.device
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference runs in true float32 on the CPU
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
        if ranks.world_size == 4:  # HSDP as 2 x 2
            for zero3 in (True, False):
                check_equivalence(mesh, zero3, use_no_sync=True, hsdp=True)
            check_hsdp_publish(mesh, directory)
        if real_use:
            check_compiled(mesh)
            check_public_api(mesh, directory)
        distributed.print0("ALL CHECKS RAN")


if __name__ == "__main__":
    main()
