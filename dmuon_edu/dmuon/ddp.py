"""The DDP backend: dedicate_params_ddp for the Muon matrices, replicate for the rest.

    dmuon.dedicate_params_ddp(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    dmuon.replicate(model, mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

The public dmuon project's semantics: every rank keeps every parameter whole, as under
DDP, so nothing is broadcast before a forward; a dedicated matrix's owner alone receives
its averaged gradient, runs Newton-Schulz (or AdamW, by its policy) on it and, after the
step, broadcasts the result to every rank. ``replicate`` averages the gradients of every
other trainable parameter over all ranks (one all-reduce per bucket), and every rank
steps those with AdamW, as DDP does.

Per optimizer step (P_M = bytes of the trainable dedicated matrices, P_R = bytes of the
replicated parameters; N micro-batches, the first N-1 inside ``dmuon.no_sync``), as
count_comm counts (the whole tensor on every rank taking part):

- reduce (AVG) of the dedicated gradients to their owners, one per (layer, owner,
  dtype) bucket, issued in backward as soon as a bucket is complete: P_M (N * P_M
  without no_sync);
- all-reduce (AVG) of the replicated gradients, in buckets of about 4 MiB, issued in
  backward as soon as a bucket is complete: P_R (N * P_R without no_sync);
- broadcast of the updated matrices from their owners, one per (owner, dtype), issued
  at the end of ``step()`` and waited at the next forward (``dmuon.Muon(...,
  replicate_async=True)``, the default; a direct read of a non-owner's matrix before it
  waits first: placeholder.py) or within ``step()``: P_M;
- the step's all-reduce of a few numbers (step_agreement.py).

DDP with replicated Muon moves 2(W-1)/W * (P_M + P_R) per rank on a ring all-reduce; this
backend moves (W-1)/W * P_M twice for the matrices (reduce, then broadcast) and runs each
matrix's Newton-Schulz once instead of on every rank. The memory is DDP's: every rank
holds every parameter; only the owner holds a matrix's momentum.

Dedicated gradients are accumulated and reduced as under dedicate_params (gradients.py):
this module gives the state its own residency, ``LocalCopies`` (every rank holds every
matrix: no placeholders and no broadcast before a forward), and its own publisher,
``OwnersBroadcast`` (each owner's results to every rank). Mixed precision: a
policy's ``param_dtype`` (or ``compute_dtype``) makes each rank compute with a copy of
the matrix in that dtype, made at the first forward after each step, while the float32
master stays with it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dmuon_edu.arguments import require_module

from . import tp
from .boundary import HookBoundaryPredicate, HookBoundaryResolver
from .dedicate import DMuonState, _require_predicate, dedicate, no_sync, state_of
from .policy import PolicyFn
from .publish import Publisher, finish_packed_broadcasts, start_packed_broadcasts
from .record import record_of
from .residency import InFlight, Residency, Unit, local, outside_dynamo, set_data

__all__ = ["dedicate_params_ddp", "dedicate_params_ddp_tp", "replicate", "replicate_tp", "DDPState", "Replicated"]

# DDP's own default bucket size is 25 MiB; smaller buckets start the first all-reduce earlier in a small
# model's backward, and the per-call cost is small next to a bucket's transfer.
BUCKET_BYTES = 4 * 2**20


@dataclass
class Replicated:
    """The parameters ``replicate`` averages: their buckets, in the order their gradients come (reverse model
    order), and this backward's all-reduces."""

    params: list[nn.Parameter]
    buckets: list[list[nn.Parameter]]
    bucket_of: dict[nn.Parameter, int]
    ready: list[set[nn.Parameter]]  # per bucket: the parameters whose gradient this backward has completed
    reducing: list[InFlight] = field(default_factory=list)
    end_of_backward_queued: bool = False


class LocalCopies(Residency):
    """The DDP backend's residency: every rank holds every matrix, so nothing is broadcast before a forward; a
    unit's "issue" makes its compute-dtype copies, and its release drops them."""

    def issue_broadcasts(self, unit: Unit) -> None:
        """Before a unit's first forward after a step: the step's results have landed, and each matrix is
        computed with its policy's dtype."""
        if unit.resident:
            return
        self.state.publisher.wait()
        for p in unit.params:
            dtype = self.state.compute_dtype(unit, p)
            if dtype != record_of(p).dtype:
                set_data(p, record_of(p).master.to(dtype))
        unit.resident = True

    def drop(self, p: nn.Parameter) -> None:
        set_data(p, record_of(p).master)  # the compute copy goes; every rank keeps the master


class OwnersBroadcast(Publisher):
    """The DDP backend's publish: each owner's updated matrices to every rank."""

    def publish(self) -> None:
        """After the step: each owner starts broadcasting, one packed buffer per (owner, dtype)."""
        state = self.state
        packs: dict[tuple[int, str], list[nn.Parameter]] = {}
        for p in state.params.values():
            if p.requires_grad:  # a frozen matrix never changes
                packs.setdefault((state.owner_of(p), str(record_of(p).dtype)), []).append(p)
        self.started += start_packed_broadcasts(packs, state.rank, state.group, state.mesh_device, state.order,
                                                "the post-step broadcast of {n} matrices from rank {source}",
                                                self.wait)

    def wait(self) -> None:
        """Wait for the step's broadcasts and copy the owners' results into every other rank's matrices."""
        finish_packed_broadcasts(self.started, self.state.rank, self.state.order)


@dataclass
class DDPState(DMuonState):
    """DMuonState where every rank holds every dedicated matrix: its owner steps it and publishes the result."""

    entry: ClassVar[str] = "dedicate_params_ddp"
    order_of_calls: ClassVar[str] = ("dmuon.dedicate_params_ddp(model, mesh, predicate) and dmuon.replicate(model, "
                                     "mesh) take the plain model; they replace fully_shard, not join it")
    holds_every_matrix: ClassVar[bool] = True
    others_collectives_in_forward: ClassVar[bool] = False  # replicate()'s are dmuon's own (TP's are the exception)
    residency_type: ClassVar[type] = LocalCopies
    publisher_type: ClassVar[type] = OwnersBroadcast

    replicated: Replicated | None = None  # set by replicate()

    def owns(self, p: nn.Parameter) -> bool:
        return True  # every rank keeps the whole matrix (under tensor parallelism: its whole TP shard)

    # -- the replicated parameters (replicate) -------------------------------------------
    def on_replicated_grad(self, p: nn.Parameter) -> None:
        """Called once p.grad holds this backward's whole gradient (added to what no_sync accumulated in it)."""
        if self.in_no_sync:
            return  # autograd keeps adding into p.grad
        group = self.replicated
        self.queue_end_of_replicated_backward()
        index = group.bucket_of[p]
        group.ready[index].add(p)
        if len(group.ready[index]) == len(group.buckets[index]):
            self.issue_all_reduce(index)

    def queue_end_of_replicated_backward(self) -> None:
        if not self.replicated.end_of_backward_queued:
            torch.autograd.Variable._execution_engine.queue_callback(outside_dynamo(self.finish_replicated_backward))
            self.replicated.end_of_backward_queued = True

    def issue_all_reduce(self, index: int) -> None:
        """Start averaging bucket ``index``'s gradients over every rank, in one packed buffer. A parameter that got
        no gradient in this backward (on this rank) adds zeros, so that every rank sends the same buffer."""
        group = self.replicated
        params = group.buckets[index]
        group.ready[index].clear()
        flat = torch.cat([(local(p.grad) if p.grad is not None else torch.zeros_like(local(p))).reshape(-1)
                          for p in params])
        description = f"the all-reduce of replicated gradients, bucket {index} ({flat.numel()} values of {flat.dtype})"
        event = self.order.check(description)
        work = dist.all_reduce(flat, group=self.group, op=dist.ReduceOp.AVG, async_op=True)
        group.reducing.append(InFlight(event, description, -1, params, flat, work))

    def finish_replicated_backward(self) -> None:
        """At the end of a backward: all-reduce the partial buckets (in bucket order, the same on every rank),
        wait for every all-reduce and write the averages into p.grad."""
        group = self.replicated
        group.end_of_backward_queued = False
        for index, ready in enumerate(group.ready):
            if ready:
                self.issue_all_reduce(index)
        for sent in group.reducing:
            with self.order.waiting(sent.event, sent.description):
                sent.work.wait()
            offset = 0
            for p in sent.params:
                shard = local(p)
                average = sent.flat[offset : offset + shard.numel()].view_as(shard)
                p.grad = (DTensor.from_local(average, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                          if isinstance(p, DTensor) else average)  # a TP shard's gradient is a DTensor like it
                offset += shard.numel()
        group.reducing.clear()


def dedicate_params_ddp(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Callable[[str, nn.Parameter], bool],
    compute_dtype: torch.dtype | str | None = None,
    hook_boundary_predicate: HookBoundaryPredicate | None = None,
    hook_boundary_strict: bool = True,
    hook_boundary_resolver: HookBoundaryResolver | None = None,
    *,
    param_policy: Mapping[str, Any] | None = None,
    param_policy_fn: PolicyFn | None = None,
) -> dict[str, int]:
    """Give each matrix that ``predicate(name, param)`` selects one owner rank, every rank keeping it whole.

    The DDP backend (module docstring): the owner receives the matrix's averaged gradient,
    steps it and broadcasts the result after ``step()``; then call :func:`replicate` for
    the other parameters, and build ``dmuon.Muon(model, ...)``. Use ``dmuon.no_sync(model)``
    for the micro-batches that only accumulate.

    The arguments and their positional order are the public dmuon project's, up to
    ``hook_boundary_resolver``; ``predicate``, ``compute_dtype``, the hook boundary
    arguments, ``param_policy`` and ``param_policy_fn`` mean what they mean for
    ``dedicate_params`` (a hook boundary here is the module at whose forward a unit's
    matrices are cast to their compute dtype and the order check records the forward).
    Route "sharded_adamw" is refused: nothing is sharded here.

    Returns:
        ``{name: owner's rank}`` for each dedicated matrix.

    Raises:
        ValueError: ``mesh`` is not 1-D over every rank of the process group, or what
            ``dedicate_params`` refuses about the selection and the policies.
        RuntimeError: the model is already sharded by fully_shard, or was already dedicated.
        TypeError: ``mesh`` is not a DeviceMesh, or as ``dedicate_params``.
    """
    require_module("dedicate_params_ddp", model, "pass the model itself, before dmuon.replicate")
    _require_predicate(predicate)
    if not any(isinstance(m, FSDPModule) for m in model.modules()):  # (a sharded model: refused by dedicate())
        tensor_parallel = next((n for n, p in model.named_parameters() if isinstance(p, DTensor) and predicate(n, p)),
                               None)
        if tensor_parallel is not None:
            raise ValueError(
                f"{tensor_parallel} is a DTensor (tensor parallel), which dedicate_params_ddp does not take: call "
                "dmuon.dedicate_params_ddp_tp(model, mesh['dp'], predicate), then dmuon.replicate_tp(model, mesh['dp'])"
            )
    _require_data_parallel_mesh("dedicate_params_ddp", mesh)
    return dedicate(DDPState, model, mesh, predicate, compute_dtype, False, None, hook_boundary_predicate,
                    hook_boundary_strict, hook_boundary_resolver, param_policy, param_policy_fn)


def dedicate_params_ddp_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Callable[[str, nn.Parameter], bool],
    compute_dtype: torch.dtype | str | None = None,
    hook_boundary_predicate: HookBoundaryPredicate | None = None,
    hook_boundary_strict: bool = True,
    hook_boundary_resolver: HookBoundaryResolver | None = None,
    *,
    param_policy: Mapping[str, Any] | None = None,
    param_policy_fn: PolicyFn | None = None,
) -> dict[str, int]:
    """The DDP backend for a tensor-parallel model: call it on ``mesh["dp"]`` after ``parallelize_module``.

    The public dmuon project's DDP + TP order::

        mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(layer.attn, mesh["tp"], {...})
        dmuon.dedicate_params_ddp_tp(model, mesh["dp"], predicate)
        dmuon.replicate_tp(model, mesh["dp"])
        optimizer = dmuon.Muon(model, ...)

    Every rank keeps its whole TP shard of every matrix, as under DDP. Within each TP
    column (the ranks of one TP index) a matrix's DP owner receives its shard's averaged
    gradient; the DP owners of one TP group send their shards to the matrix's TP owner,
    which runs Muon on the whole matrix and scatters the update's shards back (tp.py);
    after ``step()`` each DP owner broadcasts its updated shard over its column. A matrix
    that is not TP-sharded takes the DDP path of :func:`dedicate_params_ddp`. The
    arguments mean what they mean there.

    Returns:
        ``{name: owner's global rank}``: a TP-sharded matrix's TP owner.

    Raises:
        ValueError: ``mesh`` is not the data-parallel axis beside the matrices' tensor-
            parallel one, or what ``dedicate_params_ddp`` and tp.py refuse.
        RuntimeError, TypeError: as ``dedicate_params_ddp``.
    """
    require_module("dedicate_params_ddp_tp", model, "pass the model itself, after parallelize_module and before "
                                                     "dmuon.replicate_tp")
    _require_one_dimensional("dedicate_params_ddp_tp", mesh)
    _require_predicate(predicate)
    sharded = any(isinstance(m, FSDPModule) for m in model.modules())  # refused by dedicate(), naming the order
    tp_mesh = None if sharded else tp.find_tp_mesh(model, predicate, mesh, None)
    if tp_mesh is None:  # no TP-sharded matrix: the plain DDP backend
        _require_data_parallel_mesh("dedicate_params_ddp_tp", mesh)
    else:
        tp.require_grid(mesh, tp_mesh)
    return dedicate(DDPState, model, mesh, predicate, compute_dtype, False, None, hook_boundary_predicate,
                    hook_boundary_strict, hook_boundary_resolver, param_policy, param_policy_fn, tp_mesh=tp_mesh)


def replicate(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Average the gradients of every trainable parameter that ``dedicate_params_ddp`` left out, over ``mesh``.

    Call it after :func:`dedicate_params_ddp`, with the same mesh. Each gradient joins a
    bucket (about 4 MiB, in the order gradients come in backward); a complete bucket is
    all-reduced (AVG) at once, asynchronously, and the backward's end waits for them all
    and writes the averages into ``p.grad``. Inside ``dmuon.no_sync(model)`` gradients
    only accumulate. A parameter that gets no gradient on any rank in a backward gets a
    zero one (every rank must send the same buffers). As in the public project, the model
    itself is returned and gains ``model.no_sync()``, the same as ``dmuon.no_sync(model)``.

    Raises:
        ValueError: ``dedicate_params_ddp`` was not called on ``model`` (or
            ``dedicate_params_ddp_tp`` was: use :func:`replicate_tp`), or ``mesh`` is not
            its mesh's ranks.
        RuntimeError: ``replicate`` was already called, or a parameter is a DTensor
            (fully_shard's, or tensor parallel's: not supported by this backend).
    """
    require_module("replicate", model, "pass the model that dmuon.dedicate_params_ddp prepared")
    state = _ddp_state("replicate", model)
    if state.tp_name is not None:
        raise ValueError("this model's matrices are tensor-parallel (dmuon.dedicate_params_ddp_tp prepared it): call "
                         "dmuon.replicate_tp(model, mesh['dp']), which averages the TP shards' gradients over mesh['dp']")
    _require_data_parallel_mesh("replicate", mesh)
    return _replicate("replicate", model, state, mesh)


def replicate_tp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """:func:`replicate` for a tensor-parallel model: call it after :func:`dedicate_params_ddp_tp`, on the same
    ``mesh["dp"]``. A parameter that is a TP DTensor (a ColwiseParallel bias, say) has its local shard's
    gradient averaged over ``mesh`` and keeps its TP layout.

    Raises:
        ValueError: ``dedicate_params_ddp_tp`` was not called on ``model``, or ``mesh`` is not its mesh's ranks.
        RuntimeError: ``replicate_tp`` was already called, or a parameter is a DTensor on another mesh than the
            matrices' TP mesh (fully_shard's, say).
    """
    require_module("replicate_tp", model, "pass the model that dmuon.dedicate_params_ddp_tp prepared")
    state = _ddp_state("replicate_tp", model)
    _require_one_dimensional("replicate_tp", mesh)
    return _replicate("replicate_tp", model, state, mesh)


def _ddp_state(entry: str, model: nn.Module) -> DDPState:
    state = getattr(model, "_dmuon", None)
    if not isinstance(state, DDPState):
        ddp_entry = "dedicate_params_ddp_tp" if entry == "replicate_tp" else "dedicate_params_ddp"
        raise ValueError(
            f"dmuon.{entry} is the DDP backend's companion: call dmuon.{ddp_entry}(model, mesh, predicate) "
            "first" + (" (this model was prepared by dedicate_params, whose other parameters fully_shard shards)"
                       if state is not None else "")
        )
    return state


def _replicate(entry: str, model: nn.Module, state: DDPState, mesh: DeviceMesh) -> nn.Module:
    if dist.get_process_group_ranks(mesh.get_group()) != dist.get_process_group_ranks(state.group):
        raise ValueError(f"{entry}'s mesh must span the ranks of the dedicate call's mesh: pass the same mesh")
    if state.replicated is not None:
        raise RuntimeError(f"dmuon.{entry} was already called on this model; call it once")
    names = {id(p): name for name, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad and p not in state.name_of]
    sharded = next((names[id(p)] for p in params if isinstance(p, DTensor) and not (
        entry == "replicate_tp" and p.device_mesh.mesh_dim_names == (state.tp_name,))), None)
    if sharded is not None:
        raise RuntimeError(
            f"{sharded} is a DTensor (sharded by fully_shard{'' if entry == 'replicate_tp' else ' or tensor parallelism'}"
            f"): dmuon.{entry} averages whole tensors{' and TP shards' if entry == 'replicate_tp' else ''}. Use "
            "dedicate_params with fully_shard for a sharded model"
            + ("" if entry == "replicate_tp" else ", or dedicate_params_ddp_tp and replicate_tp for tensor parallelism")
        )
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):  # backward produces gradients roughly in reverse model order
        nbytes = local(p).numel() * p.element_size()
        if not buckets or size + nbytes > BUCKET_BYTES or buckets[-1][0].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    bucket_of = {p: i for i, bucket in enumerate(buckets) for p in bucket}
    state.replicated = Replicated(params, buckets, bucket_of, [set() for _ in buckets])
    for p in params:
        p.register_post_accumulate_grad_hook(outside_dynamo(state.on_replicated_grad))
    model.no_sync = functools.partial(no_sync, model)
    return model


def replicated_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters ``replicate`` averages on ``model`` (empty if it was not called)."""
    state = state_of(model)
    return list(state.replicated.params) if isinstance(state, DDPState) and state.replicated is not None else []


def _require_one_dimensional(entry: str, mesh) -> None:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        what = f"a {mesh.ndim}-D DeviceMesh" if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise (ValueError if isinstance(mesh, DeviceMesh) else TypeError)(
            f"{entry} needs a 1-D DeviceMesh over the data-parallel ranks, got {what}: use "
            "init_device_mesh(device_type, (world_size,)), or mesh['dp'] of a (dp, tp) mesh with "
            "dedicate_params_ddp_tp. For HSDP use dedicate_params(model, mesh2d['shard'], "
            "predicate, replicate_mesh=mesh2d['replicate']) with fully_shard"
        )


def _require_data_parallel_mesh(entry: str, mesh) -> None:
    _require_one_dimensional(entry, mesh)
    world = dist.get_world_size() if dist.is_initialized() else None
    if mesh.size() != world:
        raise ValueError(
            f"the mesh spans {mesh.size()} rank(s) but the process group has {world}: {entry} needs a mesh over "
            f"every rank of the process group; build it with init_device_mesh('{mesh.device_type}', "
            "(dist.get_world_size(),)) after the process group exists"
        )
