"""The public dmuon's getters of dedicated parameters: one record per matrix.

    for record in dmuon.get_owned_params(model, rank=0):
        print(record.param_name, tuple(record.full_shape), record.numel)

A :class:`DedicatedParam` is a snapshot, built at each call from the matrix's live record
(record.py's ``MatrixRecord``): nothing in it is live, and changing it changes nothing.
Its names carry the public project's meanings: ``owner_rank`` is the owner's coordinate
``(shard index, replica index)`` on the data-parallel mesh (the replica index is 0 without
HSDP), ``numel`` counts this rank's local elements (a tensor-parallel shard's), and
``_orig_size`` is their shape.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dmuon_edu.arguments import describe

from .dedicate import state_of

__all__ = ["DedicatedParam", "get_dedicated_params", "get_owned_params"]


@dataclass(frozen=True, eq=False)  # eq would compare the parameters' values
class DedicatedParam:
    """One dedicated matrix, as this rank sees it."""

    param_name: str  # its name, without wrapper segments
    param: nn.Parameter
    owner_rank: tuple[int, int]  # (shard index, replica index) of the rank that steps it
    is_owner: bool  # whether this rank steps it
    full_shape: torch.Size  # the whole matrix's shape
    local_shape: torch.Size  # this rank's part of it: a TP shard's shape, else the whole
    shard_dim: int | None  # the dim tensor parallelism shards, or None
    tp_group: dist.ProcessGroup | None  # the TP group its shards are gathered over, or None
    is_tp_owner: bool  # whether this rank orthogonalises the gathered matrix (False without TP)

    @property
    def owner_shard(self) -> int:
        return self.owner_rank[0]

    @property
    def owner_replicate(self) -> int:
        return self.owner_rank[1]

    @property
    def numel(self) -> int:
        """This rank's local elements, as the public project counts them."""
        return self.local_shape.numel()

    @property
    def _orig_size(self) -> torch.Size:
        """The public project's name for :attr:`local_shape` (its examples print it)."""
        return self.local_shape


def get_dedicated_params(model: nn.Module) -> list[DedicatedParam]:
    """One :class:`DedicatedParam` per dedicated matrix of ``model``, in the order they were selected.

    Raises:
        ValueError: ``dedicate_params`` (or ``dedicate_params_ddp``) was never called on ``model``.
    """
    state = state_of(model)
    records = []
    for name, p in state.params.items():
        record = state.records[name]
        tp = record.tp
        records.append(DedicatedParam(
            param_name=name, param=p, owner_rank=(record.holder, record.replica),
            is_owner=state.steps(p), full_shape=state.full_shape(p), local_shape=record.shape,
            shard_dim=tp.dim if tp else None, tp_group=tp.group if tp else None,
            is_tp_owner=bool(tp and tp.index == tp.owner)))
    return records


def get_owned_params(model: nn.Module, rank: int | tuple[int, int]) -> list[DedicatedParam]:
    """The :class:`DedicatedParam` records owned at ``rank``: an int is a shard index on the data-parallel
    mesh (on a 1-D mesh over every rank, the global rank), a ``(shard, replica)`` pair a full coordinate.

    Raises:
        TypeError: ``rank`` is neither an int nor a pair of ints.
        ValueError: ``dedicate_params`` was never called on ``model``.
    """
    is_index = lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if is_index(rank):
        return [record for record in get_dedicated_params(model) if record.owner_shard == rank]
    if isinstance(rank, tuple) and len(rank) == 2 and all(map(is_index, rank)):
        return [record for record in get_dedicated_params(model) if record.owner_rank == tuple(rank)]
    raise TypeError(f"rank must be a shard index (an int, e.g. rank=0) or a (shard, replica) pair, got {describe(rank)}")
