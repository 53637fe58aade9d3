"""MatrixRecord: everything dmuon knows of one dedicated matrix on this rank, in one place.

``dedicate_params`` makes one record per matrix it selects. The model's state holds them
(``state.records``, by name); the parameter carries one attribute of dmuon's, the pointer
``p._dmuon_record``, and nothing else. So what dmuon knows of a matrix can be read in one
place, with its meaning written beside each field:

    record = dmuon.record_of(model.layers[0].attn.q_proj.weight)
    record.holder, record.replica, record.reduced_grad

A rank holds a record for every dedicated matrix, owned or not: the placement fields are
the same on every rank; ``master`` and the gradients are this rank's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .order import CollectiveOrder
from .policy import DMuonParamPolicy

__all__ = ["MatrixRecord", "TPShard", "record_of", "attach", "is_dedicated"]

RECORD_ATTRIBUTE = "_dmuon_record"


@dataclass(eq=False)
class TPShard:
    """Where tensor parallelism puts one dedicated matrix (its MatrixRecord's ``tp``; tp.py says how it is used)."""

    group: dist.ProcessGroup  # the TP group: the ranks of this rank's DP index
    index: int  # this rank's place in it
    size: int
    dim: int  # the tensor dim that is sharded
    owner: int  # the TP index of the rank that runs Muon on the full matrix
    full_shape: torch.Size
    order: CollectiveOrder  # the TP group's collectives, in the same order on each of its ranks
    proxy: torch.Tensor | None = None  # on the TP owner's DP owner: the full-shape tensor its Muon steps
    proxy_grad: torch.Tensor | None = None  # there, between the gather and the step: the whole matrix's gradient


@dataclass(eq=False)
class MatrixRecord:
    """One dedicated matrix, as this rank knows it. Live: dmuon reads and writes it at every step."""

    # Placement (the same on every rank)
    name: str  # its name, without wrapper segments
    holder: int  # the index in the mesh of the rank that keeps it whole between uses and broadcasts it
    replica: int  # the replica whose holder steps it (HSDP); 0 with one replica
    owner_rank: int  # the global rank that steps it (what ownership() reports)
    shape: torch.Size  # this rank's tensor's shape: the matrix's, or a tensor-parallel shard's
    dtype: torch.dtype  # the master's dtype, which gradients are accumulated in
    policy: DMuonParamPolicy  # its route and compute dtypes (policy.py)
    tp: TPShard | None = None  # its tensor-parallel placement, if tensor parallelism shards it (tp.py)

    # Values (this rank's)
    master: torch.Tensor | None = None  # the values the optimizer steps, on a rank that keeps it; None elsewhere
    accumulated_grad: torch.Tensor | None = None  # inside no_sync: this rank's sum of the window's gradients
    reduced_grad: torch.Tensor | None = None  # on its holder: the gradient averaged over the ranks, to step with

    # The parameter's guards (placeholder.py)
    own_class: type | None = None  # the parameter's class, which every class swap returns it to
    resident: bool = True  # a non-holder's tensor-parallel shard holds its values now
    land: Callable[[], None] | None = None  # while a step result is on its way here: waits for it

    @property
    def step_gradient(self) -> torch.Tensor | None:
        """The gradient the owner's optimizer steps with: the reduced one, or, for a tensor-parallel matrix, the
        whole matrix's, gathered from its shards (tp.py)."""
        return self.reduced_grad if self.tp is None else self.tp.proxy_grad

    def __reduce__(self):
        # The record describes this process's part in one job: a saved or copied parameter is a plain one.
        return _no_record, ()


def _no_record() -> None:
    return None


def attach(p: torch.Tensor, record: MatrixRecord) -> None:
    """Point ``p`` at its record: the one attribute of dmuon's on a dedicated parameter."""
    setattr(p, RECORD_ATTRIBUTE, record)


def is_dedicated(p: torch.Tensor) -> bool:
    """Whether ``p`` is a dedicated matrix of a model prepared by ``dedicate_params`` (or its DDP forms)."""
    return getattr(p, RECORD_ATTRIBUTE, None) is not None


def record_of(p: torch.Tensor) -> MatrixRecord:
    """The :class:`MatrixRecord` of the dedicated matrix ``p``.

    Raises:
        ValueError: ``p`` is not a dedicated matrix.
    """
    record = getattr(p, RECORD_ATTRIBUTE, None)
    if record is None:
        shape = tuple(p.shape) if isinstance(p, torch.Tensor) else None
        raise ValueError(f"this {type(p).__name__} (shape {shape}) is not a dedicated matrix: pass a parameter "
                         "that dmuon.dedicate_params selected (dmuon.get_dedicated_params(model) lists them)")
    return record
