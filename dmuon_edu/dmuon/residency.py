"""Residency: the schedule's broadcasts, lands and releases of each layer's matrices, and the hooks that ask.

A *unit* is the dedicated matrices one layer uses, packed per (owner, dtype): one
broadcast each. ``Unit.resident`` is the one record of residency: set when the unit's
broadcasts are issued and cleared when it is released. A non-owner holds a matrix exactly
while some resident unit uses it (:meth:`Residency.release` drops it when the last one
goes); a non-owner's parameter is a guarded placeholder between uses (placeholder.py).

The hooks on each unit's module (:func:`before_forward`, :func:`after_forward`) raise the
unit's events; the executor (``DMuonState.run``) carries out what the schedule
(schedule.py) lists for each with this module: issue, land, release, and watch for the
unit's backward (:func:`watch_backward`: a hook on its outputs, which autograd runs before
the unit's own backward) and for its end (:func:`watch_backward_end`: a multi-grad hook on
its inputs, as FSDP2 does). A frozen matrix, which gets no gradient hook, is freed like any
other.

Every broadcast is asynchronous (``async_op=True``) and waited just before its result is
used, so it travels while the previous layer computes: on CUDA, NCCL runs it on its own
stream and ``work.wait()`` makes the compute stream wait for it; on CPU gloo runs it on its
worker threads. Mixed precision: the broadcast carries the matrix in its compute dtype, and
every rank, owner included, computes with that copy; the owner's master waits for the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from . import placeholder
from .record import record_of

__all__ = ["InFlight", "Unit", "Residency", "before_forward", "after_forward", "watch_backward", "watch_backward_end",
           "resident_before", "outside_dynamo"]


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


class Residency:
    """The schedule's residency actions for one model's state: its owners broadcast (FSDP2's backend; the DDP
    backend's, ddp.py, casts instead)."""

    def __init__(self, state):
        self.state = state

    def make_resident(self, unit: Unit) -> None:
        """The unit's dedicated parameters hold their values on every rank (issued now if not yet)."""
        self.issue_broadcasts(unit)
        self.land(unit)

    def issue_broadcasts(self, unit: Unit) -> None:
        """Each owner starts sending the unit's matrices it owns, packed in one buffer per (owner, dtype)."""
        if unit.resident:
            return
        state = self.state
        state.publisher.wait()
        flats, descriptions = [], []
        for owner, params in unit.packs:
            dtype = state.compute_dtype(unit, params[0])
            if owner == state.rank:
                flat = torch.cat([record_of(p).master.detach().reshape(-1).to(dtype) for p in params])
            else:
                flat = torch.empty(packed_numel(params), dtype=dtype, device=state.mesh_device)
            flats.append(flat)
            descriptions.append(f"the broadcast of {unit.path or 'the model'}'s matrices from rank {owner} "
                                f"({flat.numel()} values of {dtype})")
        events = state.order.check_all(descriptions)
        for (owner, params), flat, event, description in zip(unit.packs, flats, events, descriptions):
            work = dist.broadcast(flat, group=state.group, group_src=owner, async_op=True)
            unit.in_flight.append(InFlight(event, description, owner, params, flat, work))
        unit.resident = True

    def land(self, unit: Unit) -> None:
        """Wait for the unit's broadcasts in flight and point its parameters at the received values."""
        for sent in unit.in_flight:
            with self.state.order.waiting(sent.event, sent.description):
                sent.work.wait()
            for p, values in zip(sent.params, unpacked(sent)):
                if sent.owner == self.state.rank:
                    if values.dtype != record_of(p).dtype:  # compute with the policy's copy; the master waits
                        set_data(p, values)
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
            if not any(u.resident for u in self.state.units_of[p]):
                self.drop(p)

    def release_all(self) -> None:
        """Every non-owner copy is dropped and every owner computes from its master again."""
        for unit in self.state.units:
            self.release(unit)

    def drop(self, p: nn.Parameter) -> None:
        """``p``'s copy goes: an owner computes from its master again, a non-owner holds a placeholder."""
        if self.state.owns(p):
            set_data(p, record_of(p).master)
        elif placeholder.is_resident(p):
            placeholder.release(p)


# -- the hooks that raise the events ---------------------------------------------------------
def before_forward(state, unit: Unit, inputs) -> None:
    recomputing = torch._C._current_graph_task_id() != -1  # inside a backward: activation checkpointing's rerun
    if unit.index == 0 and not recomputing:  # a new forward
        state.microbatch += 1
    state.order.note(f"the forward of {unit.path or 'the model'} in micro-batch {state.microbatch} of the window, "
                     f"{'inside' if state.in_no_sync else 'outside'} no_sync")
    state.run("recompute" if recomputing else "forward", unit, inputs)


def after_forward(state, unit: Unit, output) -> None:
    if torch._C._current_graph_task_id() == -1:  # a rerun's end changes nothing: the unit's backward comes next
        state.run("forward_end", unit, output)


def watch_backward(state, unit: Unit, outputs) -> None:
    """Run the unit's "backward" event when autograd reaches it: a hook on an output's gradient runs before the
    backward of the operation that made the output, i.e. before the unit's backward."""
    if not torch.is_grad_enabled():
        return

    def before_backward(grad):
        state.gradients.queue_end_of_backward()
        state.run("backward", unit)

    for t in tree_leaves(outputs):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(before_backward)


def watch_backward_end(state, unit: Unit, inputs) -> None:
    """Run the unit's "backward_end" event once autograd has the gradients of all its inputs that need one. A unit
    whose inputs need none (the first layer's) ends with the backward ("end_of_backward")."""
    needing = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if needing and torch.is_grad_enabled():
        torch.autograd.graph.register_multi_grad_hook(
            needing, outside_dynamo(lambda _grads: state.run("backward_end", unit)))


def resident_before(residency: Residency, unit: Unit):
    """A forward pre-hook that makes ``unit`` resident unless it is. Inside a compiled block Dynamo traces the test
    (and guards on it) instead of breaking the graph: the unit's own hook, which runs outside, made it resident."""
    make_resident = outside_dynamo(residency.make_resident)

    def hook(_module, _args):
        if not unit.resident:
            make_resident(unit)
    return hook


def outside_dynamo(hook):
    """A hook torch.compile runs eagerly, between graphs: collectives and data swaps are not traced."""
    return torch.compiler.disable(hook, recursive=True)


# -- packed buffers ---------------------------------------------------------------------------
def packed_numel(params: list[nn.Parameter]) -> int:
    """The values of a packed buffer of these matrices (this rank's shards, under tensor parallelism)."""
    return sum(record_of(p).shape.numel() for p in params)


def unpacked(sent: InFlight) -> Iterator[torch.Tensor]:
    """Views of a packed buffer, one per matrix, in its order and of its shape."""
    offset = 0
    for p in sent.params:
        shape = record_of(p).shape
        yield sent.flat[offset : offset + shape.numel()].view(shape)
        offset += shape.numel()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def set_data(p: torch.Tensor, values: torch.Tensor) -> None:
    if isinstance(p, DTensor):  # a TP shard: DTensor reads its local tensor at each op
        p._local_tensor = values
        return
    with torch._C.DisableTorchFunctionSubclass():
        p.data = values
