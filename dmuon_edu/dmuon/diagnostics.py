"""Diagnostics: this rank's facts and planned sizes, as JSON-friendly dicts, and a formatter for them.

The public dmuon project's ``summarize_param_groups`` and ``summarize_comm_plan``, with
its keys: neither communicates nor synchronises the device. A *group* of the comm plan
is a unit (the hook boundary of a layer, boundary.py), an *owner bucket* its matrices of
one owner. Bytes are planned as dmuon sends them: a matrix's broadcast in its compute
dtype (``bytes``), its gradient's reduce in its wire dtype (``reduce_bytes``), so that
one optimizer step of Z2 with no_sync moves, as count_comm counts it, the sum of
``bytes`` in broadcasts and of ``reduce_bytes`` in reduces (Z3 broadcasts 2k times). A
frozen matrix (``requires_grad=False``) has no gradient: its ``reduce_bytes`` are 0. The
DDP backend (ddp.py) broadcasts nothing before a forward: a row's ``bytes`` there are the
post-step broadcast of the matrix from its owner, in the master's dtype, once per
optimizer step, however many micro-batches (0 for a frozen matrix, which never changes). With tensor
parallelism (tp.py) a row is the matrix's TP shard, and the totals add the step's TP
gather of the gradient shards and scatter of the update, as count_comm counts them on
this rank (``tp_gather_tensor_bytes_this_rank``, ``tp_scatter_tensor_bytes_this_rank``:
the whole matrix on its TP owner, a shard on the others). A comm plan
row's ``route`` is the matrix's policy's; ``summarize_param_groups`` reports the
optimizer's, which a group's ``dmuon_route`` may have changed.
The ring figures are the public project's estimates: 2 (N - 1) / N of a payload per rank.
:func:`format_summary` prints either summary as text tables.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .dedicate import DMuonState, state_of
from .optim import require_built_for
from .record import record_of
from .residency import Unit

__all__ = ["summarize_param_groups", "summarize_comm_plan", "format_summary"]


def summarize_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                           max_rows: int = 128) -> dict[str, Any]:
    """How dmuon.Muon routed the trainable parameters: its groups, and one row per dedicated parameter.

    Args:
        model: the model the optimizer was built for.
        optimizer: its dmuon.Muon.
        max_rows: at most this many parameter rows (``parameters_truncated`` counts the rest).

    Returns:
        ``{"available", "num_groups", "dedicated_param_count",
        "owned_dedicated_param_count", "groups": [...], "parameters": [...],
        "parameters_truncated"}``; counts are this rank's where they say "owned".

    Raises:
        ValueError: the model has no dedicated parameters.
        TypeError: ``optimizer`` is not the dmuon.Muon built for ``model``.
    """
    state = state_of(model)
    require_built_for(optimizer, state)
    group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        dedicated = [p for p in group["params"] if p in state.name_of]
        routes: dict[str, int] = {}
        for p in dedicated:
            routes[group["subgroup_type"]] = routes.get(group["subgroup_type"], 0) + 1
        groups.append({
            "group_index": index, "group_name": group["group_name"],
            "semantic_group_name": group["semantic_group_name"], "subgroup_type": group["subgroup_type"],
            "use_muon": group["use_muon"], "optimizer_param_count": len(group["params"]),
            "dedicated_param_count": len(dedicated),
            "owned_dedicated_param_count": sum(state.steps(p) for p in dedicated),
            "dedicated_muon_param_count": len(dedicated) if group["use_muon"] else 0,
            "dedicated_adamw_param_count": 0 if group["use_muon"] else len(dedicated),
            "adamw_param_count": len(group["params"]) - len(dedicated), "route_param_counts": routes,
        })
    rows = []
    for name, p in list(state.params.items())[:max_rows]:
        record, index = state.records[name], group_of.get(id(p))
        policy = record.policy
        rows.append({
            "name": name, "param_name": name.rpartition(".")[2],
            "route": optimizer.param_groups[index]["subgroup_type"] if index is not None else None,
            "param_dtype": _dtype_name(policy.param_dtype), "grad_dtype": _dtype_name(policy.grad_dtype),
            "output_dtype": None, "master_dtype": _dtype_name(record.dtype), "optim_dtype": _dtype_name(record.dtype),
            "cast_forward_inputs": False, "matched_policy_overrides": list(policy.matched_overrides),
            "group_index": index, "group_name": optimizer.param_groups[index]["group_name"] if index is not None else None,
            "owner_rank": [record.holder, record.replica], "owner_global_rank": record.owner_rank,
            "is_owner": state.steps(p), "is_dtensor": False, "uses_sharded_adamw": False,
            "numel": record.shape.numel(), "shape": list(record.shape),
        })
    return {
        "available": True, "num_groups": len(optimizer.param_groups), "dedicated_param_count": len(state.params),
        "owned_dedicated_param_count": sum(state.steps(p) for p in state.params.values()),
        "groups": groups, "parameters": rows, "parameters_truncated": max(0, len(state.params) - max_rows),
    }


def summarize_comm_plan(model: nn.Module, *, max_groups: int = 64, max_params_per_group: int = 128) -> dict[str, Any]:
    """dmuon's planned collectives on this rank: per unit, its owner buckets and each matrix's roots and bytes.

    Call it after ``fully_shard`` (a mixed-precision policy decides the dtypes), or after ``replicate``.

    Args:
        model: a model prepared with ``dedicate_params`` or ``dedicate_params_ddp``.
        max_groups: at most this many units (``groups_truncated`` counts the rest).
        max_params_per_group: at most this many matrix rows per unit.

    Returns:
        ``{"available", "group_count", "groups": [...], "groups_truncated", "totals": {...}}``.

    Raises:
        ValueError: the model has no dedicated parameters.
    """
    state = state_of(model)
    totals = dict.fromkeys(("dedicated_local_bytes", "stage1_shard_reduce_tensor_bytes",
                            "stage1_shard_reduce_ring_bytes_per_rank", "stage2_replicate_reduce_tensor_bytes_this_rank",
                            "post_step_replicate_broadcast_tensor_bytes_this_rank", "owner_update_ring_bytes_per_rank",
                            "same_payload_allreduce_ring_bytes_per_rank", "max_owner_bucket_bytes",
                            "broadcast_tensor_bytes", "tp_gather_tensor_bytes_this_rank",
                            "tp_scatter_tensor_bytes_this_rank"), 0)
    for p in state.params.values():  # the DP owners of a TP-sharded matrix join its gather and scatter (tp.py)
        record = record_of(p)
        tp = record.tp
        if tp is not None and p.requires_grad and state.receives_gradient(p):  # a frozen matrix is not stepped
            shard = record.shape.numel() * record.dtype.itemsize
            for key in ("tp_gather_tensor_bytes_this_rank", "tp_scatter_tensor_bytes_this_rank"):
                totals[key] += shard * tp.size if tp.index == tp.owner else shard
    ring = 2 * (state.world_size - 1) / state.world_size
    groups = []
    for index, unit in enumerate(state.units):
        sizes = {id(p): _sizes(state, unit, p) for p in unit.params}
        owners: dict[int, list[nn.Parameter]] = {}
        for owner, params in unit.packs:
            owners.setdefault(owner, []).extend(params)
        buckets = [{"bucket_index": i, "owner_coord": [owner, state.replica], "bytes": sum(sizes[id(p)][0] for p in ps),
                    "param_count": len(ps), "stage1_shard_reduce_root_global_rank": dist.get_global_rank(state.group, owner)}
                   for i, (owner, ps) in enumerate(owners.items())]
        held_here = [p for p in unit.params if state.owns(p)]
        unit_bytes = sum(b["bytes"] for b in buckets)
        reduce_bytes = sum(sizes[id(p)][1] for p in unit.params)
        across = sum(sizes[id(p)][1] for p in held_here) if state.replicas > 1 else 0
        published = sum(sizes[id(p)][0] for p in held_here if p.requires_grad) if state.replicas > 1 else 0
        for key, value in (("dedicated_local_bytes", unit_bytes), ("broadcast_tensor_bytes", unit_bytes),
                           ("stage1_shard_reduce_tensor_bytes", reduce_bytes),
                           ("stage1_shard_reduce_ring_bytes_per_rank", round(reduce_bytes * ring)),
                           ("stage2_replicate_reduce_tensor_bytes_this_rank", across),
                           ("post_step_replicate_broadcast_tensor_bytes_this_rank", published),
                           ("owner_update_ring_bytes_per_rank", unit_bytes),
                           ("same_payload_allreduce_ring_bytes_per_rank", round(unit_bytes * ring))):
            totals[key] += value
        totals["max_owner_bucket_bytes"] = max([totals["max_owner_bucket_bytes"], *(b["bytes"] for b in buckets)])
        if index >= max_groups:
            continue
        rows = [{
            "param_index": i, "param_name": state.name_of[p], "owner_coord": [state.owner_of(p), record_of(p).replica],
            "bytes": sizes[id(p)][0], "reduce_bytes": sizes[id(p)][1], "route": record_of(p).policy.optimizer,
            "param_dtype": _dtype_name(state.compute_dtype(unit, p)), "grad_dtype": _dtype_name(state.wire_dtype(unit, p)),
            "stage1_shard_reduce_root_global_rank": dist.get_global_rank(state.group, state.owner_of(p)),
            "stage2_replicate_axis_active_on_this_rank": state.replicas > 1 and state.owns(p),
            "stage2_replicate_reduce_root_global_rank": record_of(p).owner_rank if state.replicas > 1 else None,
            "post_step_replicate_broadcast_root_global_rank": record_of(p).owner_rank if state.replicas > 1 else None,
        } for i, p in enumerate(unit.params[:max_params_per_group])]
        groups.append({
            "group_index": index, "debug_name": unit.path or "<root>", "shard_rank": state.rank,
            "replicate_rank": state.replica if state.replicas > 1 else None, "param_count": len(unit.params),
            "owner_bucket_count": len(buckets), "owner_bucket_bytes": [b["bytes"] for b in buckets],
            "owner_bucket_bytes_in_order": [b["bytes"] for b in buckets], "owner_buckets": buckets,
            "param_collectives": rows, "param_collectives_truncated": max(0, len(unit.params) - len(rows)),
        })
    return {"available": True, "group_count": len(state.units), "groups": groups,
            "groups_truncated": max(0, len(state.units) - max_groups), "totals": totals}


def format_summary(summary: dict[str, Any]) -> str:
    """Either summary as plain-text tables: its scalar facts, then one table per list of rows.

    Args:
        summary: what :func:`summarize_param_groups` or :func:`summarize_comm_plan` returned.

    Returns:
        The text, one table after another, columns aligned.
    """
    scalars = [[key, _cell(value)] for key, value in summary.items() if not isinstance(value, (list, dict))]
    tables = [_table(["fact", "value"], scalars)]
    if isinstance(summary.get("totals"), dict):
        tables.append(_table(["total", "bytes"], [[k, _cell(v)] for k, v in summary["totals"].items()]))
    for key in ("groups", "parameters"):
        rows = summary.get(key) or []
        if rows:
            columns = [c for c in rows[0] if not isinstance(rows[0][c], (list, dict)) or c in ("shape", "owner_coord",
                                                                                              "owner_rank",
                                                                                              "owner_bucket_bytes")]
            tables.append(f"{key}:\n" + _table(columns, [[_cell(row.get(c)) for c in columns] for row in rows]))
    return "\n\n".join(tables)


def _sizes(state: DMuonState, unit: Unit, p: nn.Parameter) -> tuple[int, int]:
    """(broadcast bytes, reduce bytes) of one matrix, as dmuon sends them (the module docstring)."""
    n = record_of(p).shape.numel()
    if state.holds_every_matrix:  # the DDP backend: only the post-step broadcast of a trainable matrix's master
        broadcast = n * record_of(p).dtype.itemsize if p.requires_grad else 0
    else:
        broadcast = n * state.compute_dtype(unit, p).itemsize
    return broadcast, n * state.wire_dtype(unit, p).itemsize if p.requires_grad else 0


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _cell(value) -> str:
    return "-" if value is None else str(value)


def _table(columns: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)), *(len(r[i]) for r in rows)) if rows else len(str(c)) for i, c in enumerate(columns)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
