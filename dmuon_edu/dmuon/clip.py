r"""Gradient clipping for a dmuon model: the norm over every rank, and what torch's clip misses.

A dedicated matrix's gradient lives on its owner, in its record's ``reduced_grad``; ``p.grad`` is
None on every rank. So ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``
sees only the symmetric (FSDP2) gradients: it measures their norm, not the global one
(1.999 against 5.826 in the measurement that found it), and scales them alone.
dmuon.Muon.step notices when such a call scaled the FSDP2 gradients while no
:func:`clip_grad_norm_` scaled the dedicated ones, and warns; a call that measured
under ``max_norm`` changes nothing, and cannot be noticed.

Two forms:

- ``clip_grad_norm_(optimizer, max_norm)``, the public dmuon project's: the Muon
  gradients only (dedicated matrices routed to Muon); clip the others with torch's
  clip_grad_norm_, as the public project's docs say.
- ``clip_grad_norm_(model, max_norm)``: every gradient: the owners' dedicated ones and
  every FSDP2 shard (a plain replicated gradient counts once). The same norm and
  scaling as torch.nn.utils.clip_grad_norm_ in one process with the full gradients.

.. math::

    \lVert g \rVert_p = \Bigl(\sum_{\text{ranks}} \sum_{g \text{ counted}} \lVert g \rVert_p^p\Bigr)^{1/p},
    \qquad g \leftarrow g \cdot \min\Bigl(1, \frac{\text{max\_norm}}{\lVert g \rVert_p + 10^{-6}}\Bigr)

(the maximum over ranks for ``norm_type=inf``). Norms accumulate in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _has_foreach_support

from ..arguments import describe
from .dedicate import DMuonState, state_of

__all__ = ["clip_grad_norm_", "MuonGradClipStats"]

STRATEGIES = ("global_norm",)


@dataclass(frozen=True)
class MuonGradClipStats:
    """What :func:`clip_grad_norm_` measured and did; the tensors are 0-dim, on the gradients' device.

    Attributes:
        total_norm: the global norm before clipping (float32, the same on every rank).
        max_norm: the ``max_norm`` given; None: measured only.
        norm_type: the norm's order.
        clip_coef: the factor the gradients were multiplied by, min(1, max_norm / (norm +
            1e-6)); 1.0 when only measured.
        clipped: whether that factor was below 1 for a finite norm (a bool tensor; False
            when only measured).
        param_count: how many gradients this rank counted.
        found_inf: whether the norm is Inf or NaN (a bool tensor).
        strategy: "global_norm".
    """

    total_norm: torch.Tensor
    max_norm: float | None
    norm_type: float
    clip_coef: torch.Tensor | float
    clipped: torch.Tensor | bool
    param_count: int
    found_inf: torch.Tensor
    strategy: str = "global_norm"

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@torch.no_grad()
def clip_grad_norm_(optimizer: torch.optim.Optimizer | nn.Module, max_norm: float | None, *,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None,
                    strategy: str = "global_norm") -> MuonGradClipStats:
    """Measure the global gradient norm and scale the gradients so that it is at most ``max_norm``; a collective.

    Call it after the last backward of the window, outside no_sync, on every rank.

    Args:
        optimizer: a dmuon.Muon (the Muon gradients only: the public project's form and
            keyword), or the model it was built for (every gradient; see the module docstring).
        max_norm: the largest allowed norm, a finite number > 0; None measures only.
        norm_type: the norm's order p > 0, or ``inf``.
        error_if_nonfinite: raise if the norm is NaN or Inf (on every rank alike),
            before scaling anything.
        foreach: compute the per-tensor norms with torch's fused foreach kernels (True),
            one tensor at a time (False), or where the device supports them (None).
        strategy: "global_norm", the public project's default and only built-in.

    Returns:
        A :class:`MuonGradClipStats`; dmuon.Muon keeps the last one of its form as
        ``optimizer.last_muon_grad_clip_stats``.

    Raises:
        ValueError: ``max_norm`` is not None and not a finite number > 0, ``norm_type``
            is not > 0, ``strategy`` is unknown, or the model has no dedicated parameters.
        TypeError: neither a model nor a dmuon.Muon was given, or ``max_norm`` is not a number.
        RuntimeError: called inside no_sync, with gradients not reduced yet, with
            ``error_if_nonfinite`` and a non-finite norm, or with ``foreach=True`` where the
            device has no foreach kernels.
    """
    if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))):
        raise TypeError(f"max_norm must be a number or None (measure only), got {describe(max_norm)}; "
                        "1.0 is the usual value")
    if max_norm is not None and not 0 < max_norm < math.inf:
        raise ValueError(
            f"max_norm must be a finite number > 0 or None (measure only), got {max_norm!r}: 0 would zero every "
            "gradient and a negative one would flip every gradient; 1.0 is the usual value"
        )
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"norm_type must be a number > 0 or math.inf, got {norm_type!r}; 2.0 is the usual one")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown clipping strategy {strategy!r}: dmuon has {', '.join(map(repr, STRATEGIES))}")
    if isinstance(optimizer, nn.Module):
        state, model, optimizer = state_of(optimizer), optimizer, None
    elif isinstance(optimizer, torch.optim.Optimizer) and isinstance(getattr(optimizer, "_dmuon", None), DMuonState):
        state, model = optimizer._dmuon, None
    else:
        raise TypeError(f"clip_grad_norm_ takes the model or its dmuon.Muon, got {type(optimizer).__name__}")
    if state.in_no_sync or any(r.accumulated_grad is not None for r in state.records.values()):
        raise RuntimeError(
            "clip_grad_norm_ needs reduced gradients: call it after the last backward of the window, "
            "which runs outside no_sync"
        )
    scaled, counted = _gradients(state, model, optimizer)
    total = _global_norm(state, counted, float(norm_type), foreach)
    found_inf = ~total.isfinite()
    if error_if_nonfinite and bool(found_inf):
        raise RuntimeError(
            f"the global gradient norm of order {norm_type} is non-finite ({total.item()}), so it cannot be clipped; "
            "pass error_if_nonfinite=False to scale the gradients by it anyway"
        )
    clip_coef, clipped = 1.0, False
    if max_norm is not None:
        coefficient = max_norm / (total + 1e-6)
        clip_coef = torch.clamp(coefficient, max=1.0)
        for g in scaled:
            g.mul_(clip_coef.to(g.device, g.dtype))
        clipped = ~found_inf & (coefficient < 1.0)
        state.gradients.clipped = True
    stats = MuonGradClipStats(total, max_norm, float(norm_type), clip_coef, clipped, len(counted), found_inf)
    if optimizer is not None:
        optimizer.last_muon_grad_clip_stats = stats
    return stats


def _gradients(state: DMuonState, model: nn.Module | None,
               optimizer: torch.optim.Optimizer | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the local gradient tensors to scale, those to count in the norm): each gradient counts once over ranks.
    The model form takes every gradient; the optimizer form the matrices of its Muon groups."""
    on_muon = None if optimizer is None else {id(p) for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    holders = [state.records[name] for name, p in state.params.items()  # its owner (with TP: in each TP column)
               if state.records[name].reduced_grad is not None and (on_muon is None or id(p) in on_muon)]
    dedicated = [r.reduced_grad for r in holders]
    shards, replicated = [], []
    for p in model.parameters() if model is not None else ():
        if p not in state.name_of and p.grad is not None:
            (shards if isinstance(p.grad, DTensor) else replicated).append(p.grad)
    local = dedicated + [g.to_local() for g in shards] + replicated
    # A shard is the same in every replica (and, unless it is tensor-parallel too, in every TP column: tp.py), a
    # plain gradient on every rank. A TP-sharded dedicated matrix's shards are disjoint: each counts. A dedicated
    # matrix that is not TP-sharded in a TP model (an nn.MultiheadAttention, which has no TP plan) has an owner in
    # every TP column, each with the same gradient: the one in TP column 0 counts. The DDP backend's DTensors are
    # TP shards, whole on every DP rank: those of DP index 0 count.
    first_copy = state.rank == 0 if state.holds_every_matrix else state.replica == 0
    counted = [r.reduced_grad for r in holders if state.tp_index == 0 or r.tp is not None]
    counted += [g.to_local() for g in shards if state.tp_index == 0
                or state.tp_name in (g.device_mesh.mesh_dim_names or ())] if first_copy else []
    counted += replicated if dist.get_rank() == 0 else []
    return local, counted


def _global_norm(state: DMuonState, grads: list[torch.Tensor], norm_type: float,
                 foreach: bool | None) -> torch.Tensor:
    device = state.mesh_device
    grads = [g for g in grads if g.numel() > 0]
    if foreach is True and grads and not _has_foreach_support(grads, device):
        raise RuntimeError(f"foreach=True, but torch has no foreach kernels for these {device.type} tensors")
    if not grads:
        norms = []
    elif foreach is not False and _has_foreach_support(grads, device):
        norms = list(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
    else:
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    local = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros((), device=device)
    if math.isinf(norm_type):
        with state.order.collective("clip_grad_norm_'s all-reduce (max) of the largest gradient entry"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=state.everyone)
        return local
    powered = local.pow(norm_type)
    with state.order.collective(f"clip_grad_norm_'s all-reduce of gradient norms to the power {norm_type}"):
        dist.all_reduce(powered, group=state.everyone)
    return powered.pow(1.0 / norm_type)
