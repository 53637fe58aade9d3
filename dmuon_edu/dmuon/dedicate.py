"""dedicate_params: owners, residency (broadcast / release) and gradients (reduce / no_sync).

Everything dmuon keeps about a model lives in one :class:`DMuonState`, at
``model._dmuon``, and what it knows of each matrix in that matrix's record (record.py),
which the parameter points to. Hooks, all registered by :func:`dedicate_params`:

- on each *unit* (the module of a layer, its hook boundary: boundary.py), a forward
  pre-hook and a forward hook. They raise the unit's events, and :meth:`DMuonState.run`
  carries out what the schedule (schedule.py) lists for each: issue a unit's broadcasts
  (one per owner and dtype, packed), land them, release them, and watch for the unit's
  backward (a hook on its outputs, which autograd runs before the unit's own backward)
  and for its end (a multi-grad hook on its inputs). In Z3 a unit is broadcast again when
  the backward reaches it; each broadcast is issued ``prefetch_depth`` units ahead;
- on each trainable dedicated parameter, a post-accumulate-grad hook: inside no_sync it
  moves ``p.grad`` into its record's ``accumulated_grad``; outside, it adds that
  and puts the gradient in its *bucket* (the matrices of one unit with one owner and
  dtype). A complete bucket is reduced (AVG) to its owner at once, asynchronously, in one
  packed buffer; a callback at the end of the backward reduces partial buckets (matrices
  that got no gradient), waits for every reduce and adds the results into the owners'
  records' ``reduced_grad``. Either way ``p.grad`` is left None.

Residency has one record: ``Unit.resident``, set when the unit's broadcasts are issued and
cleared when it is released. A non-owner holds a matrix exactly while some resident unit
uses it (:meth:`DMuonState.release` drops it when the last one goes). In Z3 a unit is
released after its forward, and after its backward: when autograd has computed the
gradients of the unit's inputs, or at the end of the backward for a unit whose inputs need
none (the first layer's). So a frozen matrix (``requires_grad=False``), which gets no gradient hook, is
freed like any other.

Every collective is asynchronous (``async_op=True``) and waited just before its result
is used, so it travels while the previous layer computes: on CUDA, NCCL runs it on its
own stream and ``work.wait()`` makes the compute stream wait for it; on CPU gloo runs it
on its worker threads. Every rank issues the same collectives in the same order (the
units' and buckets' order is the model's; order.py checks it).

A non-owner's parameter is a guarded placeholder between uses (placeholder.py). A
matrix reached from several modules (tied weights) belongs to the unit of each of them;
it stays resident while any of those units is.

Mixed precision: when the unit sits under a ``fully_shard(..., mp_policy=...)`` with a
``param_dtype`` (or the parameter's policy has one, policy.py), the broadcast carries the
matrix in that dtype and every rank, owner included, computes with that copy; the owner
keeps its float32 master (its record's ``master``) for the optimizer, gradients are reduced in
the policy's ``reduce_dtype`` (or the parameter's ``grad_dtype``) and accumulated under
no_sync in the master's dtype.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from dmuon_edu.arguments import require_called_as, require_module
from dmuon_edu.distributed import release_gloo_workers_at_exit

from . import fsdp_exclusion, placeholder, tp
from .record import MatrixRecord, TPShard, attach, record_of
from .schedule import Schedule
from .boundary import HookBoundaryPredicate, HookBoundaryResolver, check_hook_boundary_arguments, hook_boundaries
from .names import fqn
from .order import CollectiveOrder, group_timeout
from .plan import plan_owners
from .policy import DMuonParamPolicy, PolicyFn, resolve_param_policies

__all__ = ["dedicate_params", "no_sync", "ownership", "held_bytes", "in_flight_bytes", "DMuonState", "state_of"]


@dataclass(eq=False)
class InFlight:
    """One asynchronous collective: its work handle, its buffer, and the parameters packed in it."""

    event: int  # its number in the CollectiveOrder
    description: str
    owner: int  # the source or destination in the collective's group
    params: list[nn.Parameter]
    flat: torch.Tensor
    work: dist.Work
    replica: int = 0  # a reduce's: the replica whose holder runs Muon on these matrices


@dataclass(eq=False)
class Bucket:
    """The gradients one reduce carries: a unit's matrices of one (owner, replica, dtype), each matrix in the
    first unit (in model order) that uses it, whose backward is the last to add to its gradient."""

    unit: Unit
    owner: int
    replica: int
    params: list[nn.Parameter]
    ready: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)  # this backward's gradients so far


@dataclass(eq=False)
class Unit:
    """The dedicated parameters one layer uses, packed per (owner, dtype): one broadcast each."""

    path: str
    index: int  # in model order: forward prefetches index + 1, backward index - 1
    packs: list[tuple[int, list[nn.Parameter]]]
    resident: bool = False  # the one record of residency: broadcast issued (maybe in flight), not released
    in_flight: list[InFlight] = field(default_factory=list)
    precision: tuple[torch.dtype | None, torch.dtype | None] | None = None  # (param_dtype, reduce_dtype), found lazily

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, params in self.packs for p in params]


@dataclass
class DMuonState:
    # The entry point that builds this kind of state, the calls that go with it (for messages), whether every
    # rank holds every dedicated matrix between uses (the DDP backend, ddp.py) or only its owner does, and whether
    # collectives not dmuon's (FSDP2's all-gathers) run in a forward between dmuon's own.
    entry: ClassVar[str] = "dedicate_params"
    order_of_calls: ClassVar[str] = ("call dmuon.dedicate_params(model, mesh, predicate) first, then fully_shard "
                                     "the layers and the model")
    holds_every_matrix: ClassVar[bool] = False
    others_collectives_in_forward: ClassVar[bool] = True

    model: nn.Module = field(repr=False)
    mesh: DeviceMesh
    reshard_after_forward: bool
    params: dict[str, nn.Parameter]  # dedicated, by name, in model order
    records: dict[str, MatrixRecord]  # what this rank knows of each, by name (record.py)
    owners: dict[str, int]  # name -> the owner's global rank (what ownership() reports)
    order: CollectiveOrder = field(repr=False)  # every collective over the mesh is checked by it
    replicate_mesh: DeviceMesh | None = None  # HSDP: the replicas' axis
    replicate_order: CollectiveOrder | None = field(default=None, repr=False)  # collectives along it
    units: list[Unit] = field(default_factory=list)
    units_of: dict[nn.Parameter, list[Unit]] = field(default_factory=lambda: defaultdict(list))
    bucket_of: dict[nn.Parameter, Bucket] = field(default_factory=dict)
    buckets: list[Bucket] = field(default_factory=list)
    reducing: list[InFlight] = field(default_factory=list)  # this backward's reduces, waited at its end
    publishing: list[InFlight] = field(default_factory=list)  # HSDP: the step's results, on their way
    end_of_backward_queued: bool = False
    # Whether a clip touched this window's gradients, for dmuon.Muon.step's check that a clip saw them all:
    symmetric_sample: torch.Tensor | None = None  # entries of the FSDP2 gradients as the last backward left them
    clipped: bool = False  # dmuon.clip_grad_norm_ scaled the gradients since the last backward
    schedule: Schedule | None = None  # what the hooks do at each event (schedule.py); set once the units are known
    in_no_sync: bool = False
    # Forwards of the first unit since the last optimizer step: the micro-batch of the window, which the
    # order check's forward events name, so that ranks with different numbers of micro-batches are told so.
    microbatch: int = 0
    tp_index: int = 0  # with tensor parallelism (tp.py): this rank's TP index, and the TP mesh dim's name
    tp_name: str | None = None
    tp_order: CollectiveOrder | None = field(default=None, repr=False)  # the TP group's gathers and scatters

    def __post_init__(self):
        self.group = self.mesh.get_group()
        self.rank = self.mesh.get_local_rank()
        self.world_size = self.mesh.size()
        self.mesh_device = next(iter(self.params.values())).device
        self.name_of = {p: name for name, p in self.params.items()}
        replicated = self.replicate_mesh is not None
        self.replica = self.replicate_mesh.get_local_rank() if replicated else 0
        self.replicas = self.replicate_mesh.size() if replicated else 1
        self.replicate_group = self.replicate_mesh.get_group() if replicated else None
        self.everyone = dist.group.WORLD if replicated else self.group  # a collective over every rank

    @property
    def orders(self) -> list[CollectiveOrder]:
        """Every CollectiveOrder of this model: the mesh's, and the replicate axis's (HSDP) and the TP group's
        where there are such; dmuon.Muon's order_check sets the mode of each."""
        return [o for o in (self.order, self.replicate_order, self.tp_order) if o is not None]

    @staticmethod
    def owner_of(p: nn.Parameter) -> int:
        """The matrix's *holder* in the mesh: the rank that keeps it whole and broadcasts it. With a
        replicate mesh there is one holder per replica, all at this index."""
        return record_of(p).holder

    def receives_gradient(self, p: nn.Parameter) -> bool:
        """Whether this rank is the matrix's holder in its replica (and TP column): the rank its averaged
        gradient is reduced to."""
        return self.owner_of(p) == self.rank

    def owns(self, p: nn.Parameter) -> bool:
        """Whether this rank holds the whole matrix between uses: its holder only."""
        return self.receives_gradient(p)

    def steps(self, p: nn.Parameter) -> bool:
        """Whether this rank is the matrix's one owner: its holder in the replica that steps it (for a TP-sharded
        matrix, the holder at its TP owner's index: tp.py)."""
        record = record_of(p)
        tp = record.tp
        return self.receives_gradient(p) and record.replica == self.replica and (tp is None or tp.index == tp.owner)

    @staticmethod
    def stepped(p: nn.Parameter) -> torch.Tensor:
        """The tensor the owner's optimizer steps for ``p``: ``p``, or a TP-sharded matrix's full-shape proxy."""
        tp = record_of(p).tp
        return p if tp is None else tp.proxy

    @staticmethod
    def full_shape(p: nn.Parameter) -> torch.Size:
        """The logical matrix's shape (a TP-sharded matrix's, not its shard's)."""
        record = record_of(p)
        return record.shape if record.tp is None else record.tp.full_shape

    # -- residency: Unit.resident is the one record (module docstring) ---------------
    def run(self, event: str, unit: Unit | None = None, watched=()) -> None:
        """Carry out the schedule's actions at ``event`` of ``unit`` (schedule.py) in order; a watch action hooks
        the tensors in ``watched`` (the unit's inputs, or its outputs)."""
        for action in self.schedule.actions(event, None if unit is None else unit.index):
            target = None if action.unit is None else self.units[action.unit]
            if action.verb == "release_all":
                self.release_all()
            elif action.verb in _WATCHERS:
                _WATCHERS[action.verb](self, target, watched)
            else:
                getattr(self, _RESIDENCY_METHODS[action.verb])(target)

    def make_resident(self, unit: Unit) -> None:
        """The unit's dedicated parameters hold their values on every rank (issued now if not yet)."""
        self.issue_broadcasts(unit)
        self.land(unit)

    def issue_broadcasts(self, unit: Unit) -> None:
        """Each owner starts sending the unit's matrices it owns, packed in one buffer per (owner, dtype)."""
        if unit.resident:
            return
        self.wait_published()
        flats, descriptions = [], []
        for owner, params in unit.packs:
            dtype = self.compute_dtype(unit, params[0])
            if owner == self.rank:
                flat = torch.cat([record_of(p).master.detach().reshape(-1).to(dtype) for p in params])
            else:
                flat = torch.empty(_numel(params), dtype=dtype, device=self.mesh_device)
            flats.append(flat)
            descriptions.append(f"the broadcast of {unit.path or 'the model'}'s matrices from rank {owner} "
                                f"({flat.numel()} values of {dtype})")
        events = self.order.check_all(descriptions)
        for (owner, params), flat, event, description in zip(unit.packs, flats, events, descriptions):
            work = dist.broadcast(flat, group=self.group, group_src=owner, async_op=True)
            unit.in_flight.append(InFlight(event, description, owner, params, flat, work))
        unit.resident = True

    def land(self, unit: Unit) -> None:
        """Wait for the unit's broadcasts in flight and point its parameters at the received values."""
        for sent in unit.in_flight:
            with self.order.waiting(sent.event, sent.description):
                sent.work.wait()
            for p, values in zip(sent.params, _unpacked(sent)):
                if sent.owner == self.rank:
                    if values.dtype != record_of(p).dtype:  # compute with the policy's copy; the master waits
                        _set_data(p, values)
                else:
                    placeholder.hold(p, values)
        unit.in_flight.clear()

    def release(self, unit: Unit) -> None:
        """The unit is done with its parameters: non-owners drop copies no resident unit uses."""
        if not unit.resident:
            return
        self.land(unit)  # a prefetched broadcast still owns its buffer until it completes
        unit.resident = False
        for p in unit.params:
            if not any(u.resident for u in self.units_of[p]):
                self._drop(p)

    def release_all(self) -> None:
        """Every non-owner copy is dropped and every owner computes from its master again."""
        for unit in self.units:
            self.release(unit)

    def _drop(self, p: nn.Parameter) -> None:
        if self.owns(p):
            _set_data(p, record_of(p).master)
        elif placeholder.is_resident(p):
            placeholder.release(p)

    def compute_dtype(self, unit: Unit, p: nn.Parameter) -> torch.dtype:
        """The dtype ``p`` is broadcast and computed in: its policy's param_dtype, else fully_shard's, else its own."""
        record = record_of(p)
        return record.policy.param_dtype or self.precision(unit)[0] or record.dtype

    def wire_dtype(self, unit: Unit, p: nn.Parameter) -> torch.dtype:
        """The dtype ``p``'s gradient is reduced in: its policy's grad_dtype, else fully_shard's reduce_dtype, else
        its own."""
        record = record_of(p)
        return record.policy.grad_dtype or self.precision(unit)[1] or record.dtype

    def precision(self, unit: Unit) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(param_dtype, reduce_dtype) of the fully_shard mixed-precision policy over the unit, or Nones.

        Raises:
            ValueError: a parameter's compute_dtype (its policy's param_dtype) is not the policy's param_dtype, or a
                TP-sharded matrix would compute in a dtype other than its own.
        """
        if unit.precision is None:
            policy = None
            path = unit.path
            while True:  # the unit's module, else its nearest ancestor that fully_shard wrapped
                module = self.model.get_submodule(path)
                if isinstance(module, FSDPModule):
                    policy = module._get_fsdp_state()._mp_policy
                    break
                if not path:
                    break
                path = path.rpartition(".")[0]
            param_dtype, reduce_dtype = (policy.param_dtype, policy.reduce_dtype) if policy is not None else (None, None)
            for p in unit.params:
                wanted = record_of(p).policy.param_dtype
                if wanted is not None and param_dtype is not None and wanted != param_dtype:
                    raise ValueError(
                        f"{self.name_of[p]} has compute_dtype (param_dtype) {wanted}, but fully_shard's "
                        f"MixedPrecisionPolicy over {unit.path or 'the model'} computes in {param_dtype}: the layer's "
                        f"inputs and other parameters are cast to {param_dtype}. Pass compute_dtype={param_dtype} "
                        "(or None) to dedicate_params, or change the policy"
                    )
            for p in unit.params:
                record = record_of(p)
                dtype = record.policy.param_dtype or param_dtype
                if isinstance(p, DTensor) and dtype not in (None, record.dtype):
                    raise ValueError(
                        f"{self.name_of[p]} is tensor-parallel (a DTensor) and would compute in {dtype}, but dmuon_edu "
                        f"casts plain tensors only: a DTensor keeps its dtype ({record.dtype}). Leave compute_dtype "
                        f"and the policy's param_dtype at None for it and run the forward under torch.autocast("
                        f"device_type, dtype={dtype}), or leave the matrix out of the predicate"
                    )
            unit.precision = (param_dtype, reduce_dtype)
        return unit.precision

    # -- gradients -----------------------------------------------------------------
    def on_grad(self, p: nn.Parameter) -> None:
        """Called once p.grad holds this backward's whole gradient."""
        record = record_of(p)
        g, p.grad = _local(p.grad), None
        g = g.to(record.dtype)  # accumulate and keep in the master's precision
        self.queue_end_of_backward()
        if self.in_no_sync:
            record.accumulated_grad = g if record.accumulated_grad is None else record.accumulated_grad.add_(g)
            return
        if record.accumulated_grad is not None:
            g, record.accumulated_grad = record.accumulated_grad.add_(g), None
        bucket = self.bucket_of[p]
        bucket.ready[p] = g
        if len(bucket.ready) == len(bucket.params):
            self.issue_reduce(bucket)

    def queue_end_of_backward(self) -> None:
        """Have :meth:`finish_backward` run when the backward running now ends (once)."""
        if not self.end_of_backward_queued:
            torch.autograd.Variable._execution_engine.queue_callback(_outside_dynamo(self.finish_backward))
            self.end_of_backward_queued = True

    def issue_reduce(self, bucket: Bucket) -> None:
        """Start reducing (AVG) the bucket's gradients to their owner, in one packed buffer."""
        params = [p for p in bucket.params if p in bucket.ready]  # all of them, unless the backward ended first
        wire_dtype = self.wire_dtype(bucket.unit, params[0])
        flat = torch.cat([bucket.ready[p].to(wire_dtype).reshape(-1) for p in params])
        bucket.ready.clear()
        description = (f"the reduce of {bucket.unit.path or 'the model'}'s gradients to rank {bucket.owner} "
                       f"({len(params)} matrices, {flat.numel()} values of {wire_dtype})")
        event = self.order.check(description)
        work = dist.reduce(flat, group=self.group, group_dst=bucket.owner, op=dist.ReduceOp.AVG, async_op=True)
        self.reducing.append(InFlight(event, description, bucket.owner, params, flat, work, bucket.replica))

    def finish_backward(self) -> None:
        """At the end of a backward: reduce what a partial bucket holds, wait for every reduce, and add
        the results into the owners' records' ``reduced_grad``; in Z3, release the units still resident (those whose
        inputs needed no gradient, and prefetched ones whose backward did not come)."""
        self.end_of_backward_queued = False
        self.run("end_of_backward")
        for bucket in self.buckets:  # model order on every rank: a matrix without a gradient leaves a bucket partial
            if bucket.ready:
                self.issue_reduce(bucket)
        held = []  # HSDP: the reduces this rank holds, whose replica averages go on to the replica that steps them
        for sent in self.reducing:
            with self.order.waiting(sent.event, sent.description):
                sent.work.wait()
            if sent.owner != self.rank:
                continue
            if self.replicas == 1:
                self._add_reduced(sent)
            else:
                held.append(sent)
        across = []
        if held:  # checked as one batch: they are issued together
            descriptions = [f"the reduce of {len(sent.params)} matrices' replica gradients to replica {sent.replica} "
                            f"({sent.flat.numel()} values)" for sent in held]
            events = self.replicate_order.check_all(descriptions)
            for sent, event, description in zip(held, events, descriptions):
                work = dist.reduce(sent.flat, group=self.replicate_group, group_dst=sent.replica,
                                   op=dist.ReduceOp.AVG, async_op=True)
                across.append(InFlight(event, description, sent.replica, sent.params, sent.flat, work, sent.replica))
        for sent in across:
            with self.replicate_order.waiting(sent.event, sent.description):
                sent.work.wait()
            if sent.replica == self.replica:
                self._add_reduced(sent)
        self.reducing.clear()
        if not self.in_no_sync:
            # After every callback queued so far: FSDP2's final one assigns the root's gradients.
            torch.autograd.Variable._execution_engine.queue_callback(_outside_dynamo(self._sample_after_backward))

    def _sample_after_backward(self) -> None:
        self.symmetric_sample, self.clipped = self.sample_symmetric_gradients(), False

    @torch.no_grad()
    def sample_symmetric_gradients(self) -> torch.Tensor | None:
        """The first and last entry of each gradient shard of the symmetric (FSDP2) parameters on this rank.

        A scaling of those gradients (torch.nn.utils.clip_grad_norm_, which sees only
        them) changes every nonzero entry; a pass over two entries per tensor sees it.
        (Version counters do not: DTensor's in-place foreach ops leave them alone.)
        """
        entries = [g.reshape(-1)[:: max(1, g.numel() - 1)].float()
                   for g in (_local(p.grad) for p in self.model.parameters()
                             if p.grad is not None and p not in self.name_of)
                   if g.numel() > 0]
        return torch.cat(entries) if entries else None

    @staticmethod
    def _add_reduced(sent: InFlight) -> None:
        for p, g in zip(sent.params, _unpacked(sent)):
            record = record_of(p)
            g = g.to(record.dtype)
            record.reduced_grad = g if record.reduced_grad is None else record.reduced_grad.add_(g)

    # -- publishing (HSDP) --------------------------------------------------------------
    def publish(self) -> None:
        """After the step: each owner starts sending its updated matrices to their holders in the other
        replicas, one packed buffer per (owner's replica, dtype). Nothing to do with one replica."""
        if self.replicas == 1:
            return
        packs: dict[tuple[int, str], list[nn.Parameter]] = {}
        for p in self.params.values():
            if self.owns(p) and p.requires_grad:  # a frozen matrix never changes
                packs.setdefault((record_of(p).replica, str(record_of(p).dtype)), []).append(p)
        self.publishing += start_packed_broadcasts(packs, self.replica, self.replicate_group, self.mesh_device,
                                                   self.replicate_order,
                                                   "the publish of {n} matrices from replica {source}",
                                                   self.wait_published)

    def wait_published(self) -> None:
        """Wait for the step's published matrices and copy them into this replica's holders' masters."""
        finish_packed_broadcasts(self.publishing, self.replica, self.replicate_order)

def start_packed_broadcasts(packs: dict[tuple[int, str], list[nn.Parameter]], me: int, group: dist.ProcessGroup,
                            device: torch.device, order: CollectiveOrder, what: str,
                            land: Callable[[], None]) -> list[InFlight]:
    """Start one asynchronous broadcast per (source, dtype) pack of matrices' masters, from the source's rank
    in ``group``; ``what`` names it for the order check ("{n}" matrices, "{source}"). Until ``land()`` (which
    calls :func:`finish_packed_broadcasts`) a receiver's matrices hold the previous values, so their first
    read calls it (placeholder.publishing)."""
    packed = []
    for (source, _), params in sorted(packs.items()):
        if source == me:
            flat = torch.cat([record_of(p).master.reshape(-1) for p in params])
        else:
            flat = torch.empty(_numel(params), dtype=record_of(params[0]).dtype, device=device)
        packed.append((source, params, flat, f"{what.format(n=len(params), source=source)} ({flat.numel()} values)"))
    events = order.check_all([description for *_, description in packed])
    started = [InFlight(event, description, source, params, flat,
                        dist.broadcast(flat, group=group, group_src=source, async_op=True))
               for (source, params, flat, description), event in zip(packed, events)]
    # Marked once every broadcast has started, so that each marked matrix is one that land() brings
    for sent in started:
        if sent.owner != me:
            for p in sent.params:
                placeholder.publishing(p, land)
    return started


def finish_packed_broadcasts(started: list[InFlight], me: int, order: CollectiveOrder) -> None:
    """Wait for the broadcasts of :func:`start_packed_broadcasts` and copy each into the receivers' masters."""
    for sent in started:
        with order.waiting(sent.event, sent.description):
            sent.work.wait()
        if sent.owner == me:
            continue
        for p, values in zip(sent.params, _unpacked(sent)):
            record_of(p).master.copy_(values)
            placeholder.landed(p)
    started.clear()


def _numel(params: list[nn.Parameter]) -> int:
    """The values of a packed buffer of these matrices (this rank's shards, under tensor parallelism)."""
    return sum(record_of(p).shape.numel() for p in params)


def _unpacked(sent: InFlight) -> Iterator[torch.Tensor]:
    """Views of a packed buffer, one per matrix, in its order and of its shape."""
    offset = 0
    for p in sent.params:
        shape = record_of(p).shape
        yield sent.flat[offset : offset + shape.numel()].view(shape)
        offset += shape.numel()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _set_data(p: torch.Tensor, values: torch.Tensor) -> None:
    if isinstance(p, DTensor):  # a TP shard: DTensor reads its local tensor at each op
        p._local_tensor = values
        return
    with torch._C.DisableTorchFunctionSubclass():
        p.data = values


def state_of(model: nn.Module) -> DMuonState:
    require_module("dmuon", model, "pass the model that dmuon.dedicate_params(model, mesh, predicate) prepared")
    state = getattr(model, "_dmuon", None)
    if state is None:
        raise ValueError(
            "this model has no dedicated parameters: call dmuon.dedicate_params(model, mesh, predicate) "
            "before fully_shard, and pass that same model here"
        )
    return state


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Callable[[str, nn.Parameter], bool],
    compute_dtype: torch.dtype | str | None = None,
    reshard_after_forward: bool = True,
    replicate_mesh: DeviceMesh | None = None,
    hook_boundary_predicate: HookBoundaryPredicate | None = None,
    hook_boundary_strict: bool = True,
    hook_boundary_resolver: HookBoundaryResolver | None = None,
    *,
    param_policy: Mapping[str, Any] | None = None,
    param_policy_fn: PolicyFn | None = None,
) -> dict[str, int]:
    """Give each parameter that ``predicate(name, param)`` selects one owner rank; call before fully_shard.

    The owner keeps the full parameter and, later, its optimizer state; the other ranks
    free their copies now and receive them by broadcast before each use. Every later
    ``fully_shard`` call leaves these parameters alone (see fsdp_exclusion).
    ``reshard_after_forward=True`` is Z3 (free after forward, broadcast again for
    backward); False is Z2 (resident from the first forward until optimizer.step(),
    through every micro-batch, since the parameters cannot change before the step).
    Returns ``{name: owner rank}``.

    HSDP: with ``replicate_mesh``, ``mesh`` is the shard axis of a 2-D ``(replicate,
    shard)`` mesh (``mesh["shard"]``, ``replicate_mesh=mesh["replicate"]``; fully_shard
    the layers on the 2-D mesh). Each matrix still has one owner, planned over every
    rank, that runs Muon on it; in every replica the rank at the owner's shard index
    holds it whole and broadcasts it within its replica. Gradients are averaged within
    each replica to that holder, then across replicas to the owner; after ``step()`` the
    owner publishes the result to the holders of the other replicas.

    Broadcasts happen per layer, on the parameter's *hook boundary* (boundary.py): by
    default the module named by the parameter's name up to its first numeric index
    (``model.layers[3]`` for "layers.3.mlp.up_proj.weight"), or the parameter's own module
    when there is no such index or that module is a container that is never called (a
    ModuleDict); ``hook_boundary_predicate`` or ``hook_boundary_resolver`` choose another
    (a module that reads a child's weight without calling the child, such as
    nn.MultiheadAttention with its ``out_proj``, needs one). Move the model to the mesh's
    device first.

    The arguments and their positional order are the public dmuon project's, up to
    ``hook_boundary_resolver``; names in the result, in state dicts and in
    ``param_policy`` are FQNs without wrapper segments (names.py).

    Args:
        model: the plain model, not yet sharded, on the mesh's device.
        mesh: a 1-D DeviceMesh over every rank of the process group, or, with
            ``replicate_mesh``, the shard axis of a 2-D mesh.
        predicate: ``predicate(name, param) -> bool``, called for each of
            ``model.named_parameters()``; it must select 2-D matrices only (or
            parameters that ``param_policy`` routes to "sharded_adamw").
        compute_dtype: the dtype dedicated matrices are broadcast and computed in (the
            default ``param_dtype`` of ``param_policy``): under a ``fully_shard`` mixed
            precision policy it must be the policy's ``param_dtype``; without one it sets
            it (run the forward under ``torch.autocast`` then). None: the policy's, else
            the parameter's own dtype.
        reshard_after_forward: True for Z3, False for Z2.
        replicate_mesh: HSDP's replicate axis of the same 2-D mesh, or None.
        hook_boundary_predicate: ``(module) -> bool``: the lowest module above each
            parameter (its own included) for which it is True carries its hooks.
        hook_boundary_strict: with ``hook_boundary_predicate`` or
            ``hook_boundary_resolver``, raise when one finds no module for a parameter
            (True, the default), or fall back to the parameter's own module (False).
        hook_boundary_resolver: ``(name, param) -> module or None``: the module that
            carries the parameter's hooks; it takes precedence over the predicate.
        param_policy: per-parameter routes and dtypes, ``{"defaults": {...},
            "overrides": [{"name": tokens, "set": {...}}, ...]}`` (policy.py).
        param_policy_fn: ``(name, param) -> mapping, DMuonParamPolicy or None``, instead
            of ``param_policy``.

    Returns:
        ``{name: owner's rank}`` for each dedicated parameter (its global rank; on a
        1-D mesh over the process group, its rank in the mesh too).

    Raises:
        ValueError: the mesh is not 1-D or does not span the process group (with
            ``replicate_mesh``: the two axes do not span it as a grid), the predicate
            selects nothing or a non-matrix, a matrix is on another device, is not
            contiguous, or shares its storage; a hook boundary cannot be found (strict); a
            policy asks for what dmuon does not do (policy.py says which fields).
        RuntimeError: the model is already sharded, or was already dedicated.
        TypeError: ``model`` is not an nn.Module, a mesh is not a DeviceMesh, ``predicate``
            is not a function of (name, param), ``reshard_after_forward`` or
            ``hook_boundary_strict`` is not a bool, or a hook boundary argument or policy
            part has the wrong type.
    """
    require_module("dedicate_params", model, "pass the model itself, before fully_shard")
    for argument, value in (("mesh", mesh), ("replicate_mesh", replicate_mesh)):
        if (value is not None or argument == "mesh") and (not isinstance(value, DeviceMesh) or value.ndim != 1):
            what = f"a {value.ndim}-D DeviceMesh" if isinstance(value, DeviceMesh) else type(value).__name__
            raise (ValueError if isinstance(value, DeviceMesh) else TypeError)(
                f"dedicate_params needs a 1-D DeviceMesh as {argument}, got {what}: use "
                "init_device_mesh(device_type, (world_size,)), or for HSDP mesh=mesh2d['shard'], "
                "replicate_mesh=mesh2d['replicate'] of init_device_mesh(device_type, (replicas, shards), "
                "mesh_dim_names=('replicate', 'shard'))"
            )
    world = dist.get_world_size() if dist.is_initialized() else None
    replicas = replicate_mesh.size() if replicate_mesh is not None else 1
    _require_predicate(predicate)
    # (a model fully_shard already sharded is refused by dedicate() below, naming the call order)
    sharded = any(isinstance(m, FSDPModule) for m in model.modules())
    tp_mesh = None if sharded else tp.find_tp_mesh(model, predicate, mesh, replicate_mesh)
    if tp_mesh is not None:
        tp.require_grid(mesh, tp_mesh)
    if replicate_mesh is not None and mesh.size() * replicas != world:
        raise ValueError(
            f"the shard mesh ({mesh.size()} ranks) times the replicate mesh ({replicas}) is not the process "
            f"group's {world} ranks: pass the two axes of one 2-D mesh over every rank"
        )
    if replicate_mesh is None and tp_mesh is None and not sharded and mesh.size() != world:
        raise ValueError(
            f"the mesh spans {mesh.size()} rank(s) but the process group has {world}: dmuon needs a mesh over "
            f"every rank of the process group; build it with init_device_mesh('{mesh.device_type}', "
            "(dist.get_world_size(),)) after the process group exists"
        )
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be True (Z3) or False (Z2), got {reshard_after_forward!r}")
    return dedicate(DMuonState, model, mesh, predicate, compute_dtype, reshard_after_forward, replicate_mesh,
                    hook_boundary_predicate, hook_boundary_strict, hook_boundary_resolver, param_policy,
                    param_policy_fn, tp_mesh=tp_mesh)


def dedicate(state_type: type[DMuonState], model: nn.Module, mesh: DeviceMesh, predicate, compute_dtype,
             reshard_after_forward: bool, replicate_mesh: DeviceMesh | None, hook_boundary_predicate,
             hook_boundary_strict, hook_boundary_resolver, param_policy, param_policy_fn,
             tp_mesh: DeviceMesh | None = None) -> dict[str, int]:
    """What dedicate_params and dedicate_params_ddp (ddp.py) share once their meshes are checked: the
    selection and its checks, the plan, the per-parameter records and hooks, the units. ``state_type`` says
    who holds a matrix between uses (DMuonState: its owner only); ``tp_mesh`` is the TP axis of TP-sharded
    matrices (tp.py), None without."""
    entry = state_type.entry
    replicas = replicate_mesh.size() if replicate_mesh is not None else 1
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError(f"the model is already sharded by fully_shard: {state_type.order_of_calls}")
    if getattr(model, "_dmuon", None) is not None:
        raise RuntimeError(f"{entry} (or another dmuon entry point) was already called on this model; call it once")
    _require_predicate(predicate)
    check_hook_boundary_arguments(hook_boundary_predicate, hook_boundary_strict, hook_boundary_resolver)

    selected = {name: p for name, p in model.named_parameters() if predicate(name, p)}
    if not selected:
        raise ValueError(
            "the predicate selected no parameter: it is called as predicate(name, param) for each of "
            "model.named_parameters(); e.g. lambda n, p: 'proj' in n and p.ndim == 2"
        )
    policies = resolve_param_policies(selected, compute_dtype, param_policy, param_policy_fn)
    if state_type.holds_every_matrix:
        sharded = next((name for name, policy in policies.items() if policy.route == "sharded_adamw"), None)
        if sharded is not None:
            raise ValueError(
                f"param_policy routes {sharded} to 'sharded_adamw', AdamW on fully_shard's shards, but {entry} "
                "shards nothing: route it to 'adamw' (its owner steps it with AdamW), or leave it out of the "
                "predicate (dmuon.replicate then all-reduces its gradient and every rank steps it with AdamW)"
            )
    # "sharded_adamw" is AdamW on shards: what fully_shard does with a parameter dmuon leaves alone.
    params = {fqn(name): p for name, p in selected.items() if policies[name].route != "sharded_adamw"}
    if not params:
        raise ValueError(
            "param_policy routes every selected parameter to 'sharded_adamw', which leaves it to fully_shard: "
            "route the matrices for Muon to 'muon' (the default)"
        )
    routes = {fqn(name): policy.optimizer for name, policy in policies.items()}
    for name, p in params.items():
        if isinstance(p, DTensor) and tp_mesh is None and p.device_mesh.size() == 1:
            raise ValueError(
                f"{name} is a DTensor on a tensor-parallel mesh of 1 rank ({p.device_mesh.mesh_dim_names}), which "
                f"shards nothing, and {entry} takes plain matrices then: skip parallelize_module when the TP degree "
                "is 1 (and pass the whole data-parallel mesh), or use a TP degree of 2 or more"
            )
        if isinstance(p, DTensor) and tp_mesh is None:
            raise ValueError(
                f"{name} is a DTensor (tensor parallel), which {entry} does not take: tensor parallelism goes with "
                "dmuon.dedicate_params(model, mesh['dp'], ...) on a (dp, tp) mesh with mesh_dim_names, then "
                "fully_shard(..., mesh=mesh['dp']); or, for the DDP backend, dmuon.dedicate_params_ddp_tp(model, "
                "mesh['dp'], ...), then dmuon.replicate_tp(model, mesh['dp'])"
            )
        if tp.shard_dim(p, tp_mesh) is not None and routes[name] != "muon":
            # The DDP backend refuses 'sharded_adamw' (above), so it must not be the way out there.
            raise ValueError(
                f"param_policy routes the tensor-parallel matrix {name} to AdamW on its owner, which dmuon_edu does "
                "not do for TP shards: " + (
                    "route it to 'muon', or leave it out of the predicate (dmuon.replicate_tp then averages its "
                    "shards' gradients and every rank steps them with AdamW)" if state_type.holds_every_matrix else
                    "route it to 'sharded_adamw' (fully_shard then shards it with its TP layout) or to 'muon'")
            )
        if p.ndim != 2:
            raise ValueError(
                f"the predicate selected {name} of shape {tuple(p.shape)}: only 2-D matrices can be dedicated "
                "(Muon orthogonalises matrices); add `and p.ndim == 2` to the predicate, or route it to "
                "'sharded_adamw' with param_policy (fully_shard then shards it and AdamW steps the shards)"
            )
        if p.device.type != mesh.device_type:
            raise ValueError(
                f"{name} is on {p.device} but the mesh is on {mesh.device_type}: move the model to the mesh's "
                f"device first (e.g. model.to('{mesh.device_type}')), then call {entry}"
            )
        # A dedicated matrix travels as one block of memory of its own, and its non-owners free that memory.
        local = _local(p)
        if not local.is_contiguous():
            raise ValueError(f"{name} is not contiguous (a transposed or expand()-ed view), and a dedicated matrix "
                             "travels as one block of memory of its own: replace it with "
                             f"nn.Parameter(weight.detach().contiguous()) before {entry}")
        if local.storage_offset() != 0 or local.untyped_storage().nbytes() != local.numel() * local.element_size():
            raise ValueError(f"{name} shares its storage with another tensor (it is a view into a larger one); "
                             "dedicated parameters need their own: replace it with "
                             f"nn.Parameter(weight.detach().clone()) before {entry}")

    dedicated = {id(p) for p in params.values()}
    aliases = [(alias, p) for alias, p in model.named_parameters(remove_duplicate=False) if id(p) in dedicated]
    boundaries = hook_boundaries(model, aliases, hook_boundary_predicate, hook_boundary_strict, hook_boundary_resolver)
    policy_of = {fqn(name): policy for name, policy in policies.items()}
    # With TP the grid is (TP index, DP index): each TP column is a data-parallel world of its own.
    key, rank_at = _agree_on_every_rank(entry, params, policy_of, mesh, replicate_mesh or tp_mesh)
    shards = mesh.size()
    plan = plan_owners({name: tuple(p.shape) for name, p in params.items()}, shards * replicas)
    # Owner g of the plan: replica g // shards, shard index g % shards.
    owners = {name: rank_at[divmod(g, shards)] for name, g in plan.items()}
    tp_sharded = {name: tp.shard_dim(p, tp_mesh) for name, p in params.items() if tp.shard_dim(p, tp_mesh) is not None}
    tp_owner: dict[str, int] = {}
    if tp_mesh is not None:
        column = tp_mesh.get_local_rank()
        for d in range(shards):  # per DP owner, its TP group shares the Newton-Schulz work on full matrices
            tp_owner.update(plan_owners({n: tuple(params[n].shape) for n in tp_sharded if plan[n] == d},
                                        tp_mesh.size()))
        owners = {name: rank_at[(tp_owner.get(name, column), g)] for name, g in plan.items()}
    # Every replica runs the same events on its shard axis: one key for all ranks. The replicate axis has a key
    # per shard index, shared by that column's ranks.
    # A rank that may wait in another's collective after a layer's forward must report it got there (order.py).
    order = CollectiveOrder(key, dist.get_rank(), range(dist.get_world_size()), mesh.get_group(),
                            report_notes=state_type.others_collectives_in_forward or tp_mesh is not None)
    replicate_order = (CollectiveOrder(f"{key}/replicate-axis-{mesh.get_local_rank()}", dist.get_rank(),
                                       dist.get_process_group_ranks(replicate_mesh.get_group()),
                                       replicate_mesh.get_group())
                       if replicate_mesh is not None else None)
    records = {}
    for name, p in params.items():
        # a DTensor's local tensor (its shard), outside autograd: the master is written in place
        local = _local(p).detach() if isinstance(p, DTensor) else p.data
        records[name] = MatrixRecord(name, holder=plan[name] % shards, replica=plan[name] // shards,
                                     owner_rank=owners[name], shape=local.shape, dtype=p.dtype,
                                     policy=policy_of[name], master=local, own_class=type(p))
        attach(p, records[name])
    state = state_type(model, mesh, reshard_after_forward, params, records, owners, order, replicate_mesh,
                       replicate_order)
    if tp_mesh is not None:  # across the TP group of each DP index: its gathers and scatters
        state.everyone = dist.group.WORLD
        tp_order = CollectiveOrder(f"{key}/tp-axis-{mesh.get_local_rank()}", dist.get_rank(),
                                   dist.get_process_group_ranks(tp_mesh.get_group()), tp_mesh.get_group())
        state.tp_index = tp_mesh.get_local_rank()
        state.tp_name = tp_mesh.mesh_dim_names[0]
        state.tp_order = tp_order
    fsdp_exclusion.install()
    if dist.get_backend() == "gloo":
        release_gloo_workers_at_exit()
    for name, p in params.items():
        record = records[name]
        if name in tp_sharded:
            record.tp = TPShard(tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size(), tp_sharded[name],
                                tp_owner[name], p.shape, tp_order)
            if state.receives_gradient(p) and record.tp.index == record.tp.owner:
                record.tp.proxy = torch.zeros(p.shape, dtype=p.dtype, device=record.master.device)
        if not state.owns(p):
            record.master = None
            placeholder.make_placeholder(p)
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(_outside_dynamo(state.on_grad))
    for module in {model.get_submodule(alias.rpartition(".")[0]) for alias, p in aliases
                   if isinstance(p, DTensor) and not state.owns(p)}:
        placeholder.guard_state_dict(module)
    _build_units(model, state, aliases, boundaries)
    state.schedule = Schedule(len(state.units), reshard_after_forward)
    model._dmuon = state
    return dict(owners)


def _require_predicate(predicate) -> None:
    require_called_as("predicate", predicate, "predicate(name, param)", ("name", None),
                      "pass a function of (name, param), e.g. lambda n, p: 'proj' in n and p.ndim == 2")


def _agree_on_every_rank(entry: str, params: dict[str, nn.Parameter], policies: dict[str, DMuonParamPolicy],
                         mesh: DeviceMesh, replicate_mesh: DeviceMesh | None) -> tuple[str, dict[tuple[int, int], int]]:
    """Every rank must dedicate the same matrices, with the same shapes, dtypes and policies, or the broadcasts
    pair wrongly; with a replicate mesh, the two axes must cover the process group as a grid.

    Returns a store key for this model's CollectiveOrder that every rank shares (rank 0's), and
    ``{(replica, shard index): global rank}``.
    """
    mine = [(name, tuple(p.shape), str(p.dtype), str(policies[name].param_dtype), str(policies[name].grad_dtype),
             policies[name].optimizer) for name, p in params.items()]
    replica = replicate_mesh.get_local_rank() if replicate_mesh is not None else 0
    here = (f"dmuon/order/{uuid.uuid4().hex}", mine, (replica, mesh.get_local_rank()), dist.get_rank())
    group = mesh.get_group() if replicate_mesh is None else dist.group.WORLD
    _meet_every_rank(entry, group)
    everyone: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(everyone, here, group=group)
    except RuntimeError as error:
        raise RuntimeError(
            f"{entry}: not every rank called {entry} within the collective timeout. Every rank "
            "must call it, with the same model and predicate"
        ) from error
    for _, theirs, _, rank in everyone:
        if theirs != mine:
            first = next((a, b) for a, b in itertools.zip_longest(mine, theirs) if a != b)
            stages = ("" if {m[0] for m in theirs} & {m[0] for m in mine} else
                      " No name is on both ranks: if each holds a pipeline stage, dmuon does not support pipeline "
                      "parallelism (every rank of its mesh holds the whole model, or its TP shards); step a stage's "
                      "matrices with dmuon_edu.Muon on each rank instead, or use FSDP2, HSDP or TP with dmuon.")
            raise RuntimeError(
                f"{entry}: rank {dist.get_rank()} and rank {rank} selected different matrices; the first "
                f"difference is {first[0]} here and {first[1]} there (name, shape, dtype, param_dtype, grad_dtype, "
                "optimizer). The predicate and the policy must select the same on every rank: make them depend "
                f"on names and shapes only.{stages}"
            )
    rank_at = {coordinates: rank for _, _, coordinates, rank in everyone}
    grid = {(r, s) for r in range(replicate_mesh.size() if replicate_mesh is not None else 1) for s in range(mesh.size())}
    if set(rank_at) != grid or len(rank_at) != len(everyone):
        raise ValueError(
            "mesh and replicate_mesh are not the two axes of one 2-D mesh: every (replica, shard) pair must be "
            "exactly one rank. Pass mesh2d['shard'] and mesh2d['replicate'] of the same init_device_mesh"
        )
    return everyone[0][0], rank_at


# Per process group: how many times this rank has entered dedicate_params (or its DDP forms) on it.
_ENTRIES: dict[str, int] = defaultdict(int)


def _meet_every_rank(entry: str, group: dist.ProcessGroup) -> None:
    """Wait, in the store, until every rank of ``group`` has entered ``entry`` as often as this one; raise naming
    those that did not within the group's timeout.

    A rank that never calls ``entry`` runs something else on the group meanwhile: the first collective of the
    others would meet one of another size, which gloo answers by aborting the process natively. Only a timed
    wait can tell a rank that never comes from a slow one, and the store's is one that cannot mismatch.
    """
    store = dist.distributed_c10d._get_default_store()
    _ENTRIES[group.group_name] += 1
    prefix = f"dmuon/entered/{group.group_name}/{_ENTRIES[group.group_name]}"
    ranks = dist.get_process_group_ranks(group)
    store.set(f"{prefix}/{dist.get_rank()}", entry)
    timeout = group_timeout(group)
    try:
        store.wait([f"{prefix}/{rank}" for rank in ranks], timeout)
    except RuntimeError:  # DistStoreError: not every key in time
        absent = [rank for rank in ranks if not store.check([f"{prefix}/{rank}"])]
        raise RuntimeError(
            f"{entry}: rank(s) {', '.join(map(str, absent))} did not call {entry} within the group's timeout "
            f"({timeout.total_seconds():g} s), while rank {dist.get_rank()} waited for them. Every rank must call "
            f"it, with the same model and predicate: a call under `if rank == 0:` leaves the others out"
        ) from None


def _build_units(model: nn.Module, state: DMuonState, aliases: list[tuple[str, nn.Parameter]],
                 boundaries: dict[str, str]) -> None:
    """One unit per hook boundary that uses dedicated matrices; a tied matrix joins the unit of every module that
    holds it. A unit packs its matrices by owner and dtypes (the master's, and the policy's param and grad dtypes)."""
    by_path: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for alias, p in aliases:
        by_path.setdefault(boundaries[alias], []).append((alias, p))
    for path, used in by_path.items():
        packs: dict[tuple, list[nn.Parameter]] = {}
        for _, p in used:
            record = record_of(p)
            key = (record.holder, str(record.dtype), str(record.policy.param_dtype), str(record.policy.grad_dtype))
            pack = packs.setdefault(key, [])
            if all(q is not p for q in pack):  # identity: == on tensors compares values
                pack.append(p)
        unit = Unit(path, len(state.units), [(key[0], ps) for key, ps in sorted(packs.items())])
        state.units.append(unit)
        for owner, ps in unit.packs:
            for p in ps:
                state.units_of[p].append(unit)
            # A tied matrix's gradient is complete after the backward of its first unit.
            first_use = [p for p in ps if p not in state.bucket_of]
            for replica in sorted({record_of(p).replica for p in first_use}):
                members = [p for p in first_use if record_of(p).replica == replica]
                bucket = Bucket(unit, owner, replica, members)
                state.buckets.append(bucket)
                state.bucket_of.update((p, bucket) for p in members)
        module = model.get_submodule(path)
        module.register_forward_pre_hook(
            _outside_dynamo(lambda _m, args, kwargs, unit=unit: _before_forward(state, unit, (args, kwargs))),
            with_kwargs=True)
        module.register_forward_hook(_outside_dynamo(lambda _m, _args, output, unit=unit: _after_forward(state, unit, output)))
        # A safety net, for code that calls a layer's parts without calling the layer:
        # the module holding the parameter makes the unit resident too (a no-op if it is).
        for own in {alias.rpartition(".")[0] for alias, _ in used} - {path}:
            model.get_submodule(own).register_forward_pre_hook(_resident_before(state, unit))


def _resident_before(state: DMuonState, unit: Unit):
    """A forward pre-hook that makes ``unit`` resident unless it is. Inside a compiled block Dynamo traces the test
    (and guards on it) instead of breaking the graph: the unit's own hook, which runs outside, made it resident."""
    make_resident = _outside_dynamo(state.make_resident)

    def hook(_module, _args):
        if not unit.resident:
            make_resident(unit)
    return hook


def _outside_dynamo(hook):
    """A hook torch.compile runs eagerly, between graphs: collectives and data swaps are not traced."""
    return torch.compiler.disable(hook, recursive=True)


def _before_forward(state: DMuonState, unit: Unit, inputs) -> None:
    recomputing = torch._C._current_graph_task_id() != -1  # inside a backward: activation checkpointing's rerun
    if unit.index == 0 and not recomputing:  # a new forward
        state.microbatch += 1
    state.order.note(f"the forward of {unit.path or 'the model'} in micro-batch {state.microbatch} of the window, "
                     f"{'inside' if state.in_no_sync else 'outside'} no_sync")
    state.run("recompute" if recomputing else "forward", unit, inputs)


def _after_forward(state: DMuonState, unit: Unit, output) -> None:
    if torch._C._current_graph_task_id() == -1:  # a rerun's end changes nothing: the unit's backward comes next
        state.run("forward_end", unit, output)


def _watch_backward(state: DMuonState, unit: Unit, outputs) -> None:
    """Run the unit's "backward" event when autograd reaches it: a hook on an output's gradient runs before the
    backward of the operation that made the output, i.e. before the unit's backward."""
    if not torch.is_grad_enabled():
        return

    def before_backward(grad):
        state.queue_end_of_backward()
        state.run("backward", unit)

    for t in tree_leaves(outputs):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(before_backward)


def _watch_backward_end(state: DMuonState, unit: Unit, inputs) -> None:
    """Run the unit's "backward_end" event once autograd has the gradients of all its inputs that need one, as
    FSDP2 does. A unit whose inputs need none (the first layer's) ends with the backward ("end_of_backward")."""
    needing = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if needing and torch.is_grad_enabled():
        torch.autograd.graph.register_multi_grad_hook(
            needing, _outside_dynamo(lambda _grads: state.run("backward_end", unit)))


_WATCHERS = {"watch_backward": _watch_backward, "watch_backward_end": _watch_backward_end}
_RESIDENCY_METHODS = {"issue": "issue_broadcasts", "land": "land", "release": "release"}


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally, with no communication of either kind, until the block ends.

    Dedicated gradients add into their records' ``accumulated_grad`` on every rank; the FSDP2
    modules get ``set_requires_gradient_sync(False)``. The first backward after the
    block reduces everything accumulated. Run the forward inside the block too.
    """
    state = state_of(model)
    if state.in_no_sync:  # nested: the outer block restores
        yield
        return
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    state.in_no_sync = True
    for m in fsdp_modules:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        state.in_no_sync = False
        for m in fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)


def ownership(model: nn.Module) -> dict[str, int]:
    """``{name: owner rank in the mesh}`` for each dedicated parameter of ``model``.

    Raises:
        ValueError: ``dedicate_params`` was never called on ``model``.
    """
    return dict(state_of(model).owners)


def held_bytes(model: nn.Module) -> int:
    """Bytes of dedicated-matrix values this rank holds right now, each storage counted once.

    An owner holds its matrices (and, under a mixed-precision policy while a layer uses
    them, their compute copies); a non-owner holds only the copies that are resident,
    i.e. nothing between optimizer steps. Exact, unlike a profiler's peak.

    Raises:
        ValueError: ``dedicate_params`` was never called on ``model``.
    """
    state = state_of(model)
    storages: dict[int, int] = {}
    with torch._C.DisableTorchFunctionSubclass():
        for p in state.params.values():
            for t in (_local(p), record_of(p).master) if state.owns(p) else (_local(p),):
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def in_flight_bytes(model: nn.Module) -> int:
    """Bytes of the broadcast buffers this rank has in flight right now, which :func:`held_bytes` leaves out.

    A broadcast issued ahead of its layer (the forward prefetch, or the backward's) owns a
    packed buffer until the layer lands it: on the owner a copy of its matrices, on the other
    ranks the space they receive into. Exact, like :func:`held_bytes`.

    Raises:
        ValueError: ``dedicate_params`` was never called on ``model``.
    """
    state = state_of(model)
    return sum(sent.flat.untyped_storage().nbytes() for unit in state.units for sent in unit.in_flight)

