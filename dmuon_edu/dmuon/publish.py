"""Publishing a step's results to the ranks that hold a matrix but did not step it.

HSDP: the owner steps a matrix in its replica; the holders at its shard index in the other
replicas receive the result after ``step()``, one packed broadcast per (owner's replica,
dtype) along the replicate axis. The DDP backend (ddp.py) broadcasts each owner's results to
every rank. Until a receiver's broadcast lands, its matrices hold the previous values, so
their first read waits for it (placeholder.publishing); the next forward waits for all
(``dmuon.Muon(..., replicate_async=True)``, the default; False: ``step()`` waits).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from . import placeholder
from .order import CollectiveOrder
from .record import record_of
from .residency import InFlight, packed_numel, unpacked

__all__ = ["Publisher", "start_packed_broadcasts", "finish_packed_broadcasts"]


class Publisher:
    """HSDP's publish: each owner's updated matrices to their holders in the other replicas (nothing to do with
    one replica)."""

    def __init__(self, state):
        self.state = state
        self.started: list[InFlight] = []  # the step's broadcasts on their way

    def publish(self) -> None:
        """After the step: start sending, one packed buffer per (owner's replica, dtype)."""
        state = self.state
        if state.replicas == 1:
            return
        packs: dict[tuple[int, str], list[nn.Parameter]] = {}
        for p in state.params.values():
            if state.owns(p) and p.requires_grad:  # a frozen matrix never changes
                packs.setdefault((record_of(p).replica, str(record_of(p).dtype)), []).append(p)
        self.started += start_packed_broadcasts(packs, state.replica, state.replicate_group, state.mesh_device,
                                                state.replicate_order, "the publish of {n} matrices from replica "
                                                "{source}", self.wait)

    def wait(self) -> None:
        """Wait for the step's published matrices and copy them into this replica's holders' masters."""
        finish_packed_broadcasts(self.started, self.state.replica, self.state.replicate_order)


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
            flat = torch.empty(packed_numel(params), dtype=record_of(params[0]).dtype, device=device)
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
        for p, values in zip(sent.params, unpacked(sent)):
            record_of(p).master.copy_(values)
            placeholder.landed(p)
    started.clear()
