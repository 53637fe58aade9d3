"""Tensor parallelism under dedicate_params: a (dp, tp) mesh, each TP-sharded matrix with one owner.

The public dmuon project's call order (its tp-dp example):

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(layer.attn, mesh["tp"], {"q_proj": ColwiseParallel(), ..., "o_proj": RowwiseParallel()})
    dmuon.dedicate_params(model, mesh["dp"], predicate)   # the DP axis only, as fully_shard
    fully_shard(layer, mesh=mesh["dp"]); fully_shard(model, mesh=mesh["dp"])
    optimizer = dmuon.Muon(model, ...)

A matrix that parallelize_module made a DTensor sharded on a mesh dim that ``mesh`` does
not name (the TP axis, found by name, as the public project does) is *TP-sharded*: each
rank holds a shard of it, ``Shard(0)`` for ColwiseParallel, ``Shard(1)`` for RowwiseParallel.
dmuon treats the shard as the matrix along the DP axis: within each TP column (the ranks
with one TP index) the plan's DP owner holds its shard, broadcasts it for the forward and
receives the shard's averaged gradient, exactly as on a 1-D mesh. The plan is made from the
full shapes, so every column has the same DP owners, and the ranks at one DP index form a
TP group that together holds the whole matrix. One of them, its *TP owner* (planned by
Newton-Schulz time over the TP group, per DP owner), runs Muon on the full logical matrix
at the optimizer step, never on a shard (an orthogonalised shard is not a shard of the
orthogonalised matrix):

1. gather: the DP owners of the TP group send their averaged gradient shards to the TP
   owner (one gather per matrix), which joins them along the shard dim;
2. the TP owner steps a full-shape *proxy* of the matrix, zero before the step, with Muon
   (momentum, Nesterov, Newton-Schulz, the shape factor s(m, n) of the full shape), whose
   momentum buffer is the full matrix's; the proxy ends as the update, -lr s(m, n) O;
3. scatter: each DP owner receives its shard of the update and applies it to its shard
   after the decoupled weight decay: W <- (1 - lr wd) W + update, Muon's step in two parts.

The DDP backend (``dedicate_params_ddp_tp(model, mesh["dp"], ...)`` and ``replicate_tp``,
ddp.py) takes the same three steps; there every DP rank keeps its shard whole, and after
step 3 each DP owner broadcasts its updated shard over its TP column.

Bytes per step, per TP group of one DP owner: the gather and the scatter each carry the
matrix once (the whole tensor counted on every rank taking part, as count_comm counts).
A non-owner's TP shard is a DTensor whose local tensor is empty between uses (DTensor's
class cannot be swapped for placeholder.py's guarded one; reading it between uses gives
DTensor's own shape errors, not dmuon's named refusal).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .record import MatrixRecord

__all__ = ["find_tp_mesh", "require_grid", "shard_dim", "gather_gradients", "apply_updates", "full_tensor", "local_part"]


def _refuse(message: str) -> None:
    raise ValueError(message)


def find_tp_mesh(model: nn.Module, predicate, mesh: DeviceMesh, replicate_mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The TP axis of the selected matrices (None: no selected matrix is TP-sharded).

    Raises ValueError, on every rank alike (it reads only the meshes and placements, the
    same everywhere), for each layout dmuon does not support, naming what to do.
    """
    fix = ("build the mesh as init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp')), apply "
           "parallelize_module on mesh['tp'], and pass dedicate_params and fully_shard mesh['dp']")
    dp_names = set(mesh.mesh_dim_names or ()) | set(getattr(replicate_mesh, "mesh_dim_names", None) or ())
    found: tuple[str, DeviceMesh] | None = None
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or not predicate(name, p):
            continue
        names = p.device_mesh.mesh_dim_names
        if names is None:
            _refuse(f"{name} is a DTensor on a mesh without mesh_dim_names, so dmuon cannot tell its tensor-parallel "
                    f"axis from the data-parallel one: {fix}")
        if p.device_mesh.ndim != 1:
            _refuse(f"{name} is a DTensor on the {p.device_mesh.ndim}-D mesh {names}: dmuon supports one tensor-"
                    "parallel axis (a 1-D TP mesh, the public project's MVP); a 2-D TP layout is not supported")
        if not mesh.mesh_dim_names or names[0] in dp_names:
            _refuse(f"{name} is a DTensor sharded over the mesh dim {names[0]!r}, and the mesh passed to "
                    "dedicate_params is not the data-parallel axis beside it (a 1-D mesh over every rank, or the "
                    f"TP axis itself): {fix}")
        placement = p.placements[0]
        if not isinstance(placement, Shard) or p.device_mesh.size() == 1:
            continue  # replicated over TP (or TP of size 1): a matrix of the DP path, as in the public project
        if replicate_mesh is not None:
            _refuse(f"{name} is tensor-parallel and dedicate_params got a replicate_mesh: HSDP x TP (a 3-D mesh) is "
                    "not supported by dmuon_edu; use a (dp, tp) mesh with fully_shard on mesh['dp'], or HSDP "
                    "without tensor parallelism")
        if found is not None and (found[1].mesh_dim_names != p.device_mesh.mesh_dim_names or
                                  dist.get_process_group_ranks(found[1].get_group())
                                  != dist.get_process_group_ranks(p.device_mesh.get_group())):
            _refuse(f"{name} and {found[0]} are sharded over different tensor-parallel meshes: apply "
                    "parallelize_module with one mesh['tp'] to every layer")
        full = p.shape[placement.dim]
        if full % p.device_mesh.size():
            _refuse(f"{name} has {full} entries along its sharded dim {placement.dim}, which {p.device_mesh.size()} "
                    "TP ranks do not divide: dmuon gathers equal shards; choose a TP degree that divides it, or leave "
                    "the matrix out of the predicate")
        found = found or (name, p.device_mesh)
    return found[1] if found else None


def require_grid(mesh: DeviceMesh, tp_mesh: DeviceMesh) -> None:
    """Raise ValueError unless the data-parallel and the tensor-parallel mesh span the process group together."""
    world = dist.get_world_size()
    if mesh.size() * tp_mesh.size() != world:
        raise ValueError(
            f"the data-parallel mesh ({mesh.size()} ranks) times the tensor-parallel mesh ({tp_mesh.size()}) is not "
            f"the process group's {world} ranks: pass mesh['dp'] of the (dp, tp) mesh the TP plan used"
        )


def shard_dim(p: torch.Tensor, tp_mesh: DeviceMesh | None) -> int | None:
    """The sharded dim of a TP-sharded DTensor on ``tp_mesh``; None for any other tensor."""
    if tp_mesh is None or not isinstance(p, DTensor) or p.device_mesh != tp_mesh:
        return None
    placement = p.placements[0]
    return placement.dim if isinstance(placement, Shard) else None


def _proxies(state) -> list[tuple[str, MatrixRecord]]:
    """The trainable TP-sharded matrices this rank holds (it is their DP owner in its column), in model order, with
    their records. A frozen one takes no part in the step: no gradient to gather, and no weight decay."""
    return [(name, state.records[name]) for name, p in state.params.items()
            if state.records[name].tp is not None and p.requires_grad and state.receives_gradient(p)]


def _check_together(proxies: list[tuple[str, MatrixRecord]], descriptions: list[str]) -> list[int]:
    """The order check of collectives issued together on this rank's TP group (every proxy's), in one batch."""
    if not proxies:
        return []
    return proxies[0][1].tp.order.check_all(descriptions)


def gather_gradients(state) -> None:
    """Step 1: each TP group's averaged gradient shards to the TP owner, joined into ``tp.proxy_grad``;
    the proxy is zeroed, so that Muon leaves the update in it."""
    proxies = _proxies(state)
    shards = [r.reduced_grad if r.reduced_grad is not None else torch.zeros_like(r.master) for _, r in proxies]
    descriptions = [f"the TP gather of {name}'s gradient to TP rank {r.tp.owner} ({shard.numel()} values each)"
                    for (name, r), shard in zip(proxies, shards)]
    pending = []
    for (_, r), shard, event, description in zip(proxies, shards, _check_together(proxies, descriptions), descriptions):
        tp = r.tp
        pieces = [torch.empty_like(shard) for _ in range(tp.size)] if tp.index == tp.owner else None
        work = dist.gather(shard.contiguous(), pieces, group=tp.group, group_dst=tp.owner, async_op=True)
        pending.append((tp, pieces, event, description, work))
    for tp, pieces, event, description, work in pending:
        with tp.order.waiting(event, description):
            work.wait()
        if pieces is not None:
            tp.proxy.zero_()
            tp.proxy_grad = torch.cat(pieces, dim=tp.dim)


def apply_updates(state, hyper_of) -> None:
    """Step 3: the TP owner scatters the update's shards; each DP owner decays its shard and adds its part.
    ``hyper_of(p)`` gives (lr, weight_decay) of p's Muon group."""
    proxies = _proxies(state)
    descriptions = [f"the TP scatter of {name}'s update from TP rank {r.tp.owner} ({r.master.numel()} values each)"
                    for name, r in proxies]
    pending = []
    for (name, r), event, description in zip(proxies, _check_together(proxies, descriptions), descriptions):
        tp = r.tp
        received = torch.empty_like(r.master)
        pieces = list(tp.proxy.chunk(tp.size, dim=tp.dim)) if tp.index == tp.owner else None
        pieces = [piece.contiguous() for piece in pieces] if pieces is not None else None
        work = dist.scatter(received, pieces, group=tp.group, group_src=tp.owner, async_op=True)
        pending.append((name, r, received, event, description, work))
    for name, r, received, event, description, work in pending:
        with r.tp.order.waiting(event, description):
            work.wait()
        r.tp.proxy_grad = None
        lr, weight_decay = hyper_of(state.params[name])
        r.master.mul_(1 - lr * weight_decay).add_(received)


def full_tensor(state, p: nn.Parameter, value: torch.Tensor | None, shape, dtype) -> torch.Tensor:
    """A full copy on every rank of the TP-sharded matrix ``p`` (``shape`` None: its values, from the shards
    of the DP owners) or of a full-shape state tensor its TP owner keeps (its momentum: ``value`` there)."""
    name = state.name_of[p]
    record = state.records[name]
    tp = record.tp
    if shape is not None:  # the TP owner's full state: one broadcast over every rank
        buffer = (value.detach().clone() if state.steps(p)
                  else torch.empty(shape, dtype=dtype or record.dtype, device=state.mesh_device))
        with state.order.collective(f"the state dict's broadcast of {name}'s state from its TP owner"):
            dist.broadcast(buffer, src=record.owner_rank)
        return buffer
    shard = (record.master.detach().clone() if state.owns(p)
             else torch.empty(record.shape, dtype=record.dtype, device=state.mesh_device))
    with state.order.collective(f"the state dict's broadcast of {name}'s shard from rank {state.owner_of(p)}"):
        dist.broadcast(shard, group=state.group, group_src=state.owner_of(p))
    pieces = [torch.empty_like(shard) for _ in range(tp.size)]
    with tp.order.collective(f"the state dict's TP all-gather of {name}"):
        dist.all_gather(pieces, shard, group=tp.group)
    return torch.cat(pieces, dim=tp.dim)


def local_part(record: MatrixRecord, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a full tensor of a matrix (the tensor itself for a matrix that is not TP-sharded)."""
    tp = record.tp
    return full if tp is None else full.chunk(tp.size, dim=tp.dim)[tp.index]
