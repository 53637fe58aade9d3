"""Gradients of the dedicated matrices: kept under no_sync, reduced to their owners in buckets.

On each trainable dedicated parameter, a post-accumulate-grad hook (:meth:`Gradients.on_grad`)
raises the schedule's gradient event (schedule.py), whose actions this module carries out:
inside no_sync it moves ``p.grad`` into its record's ``accumulated_grad``; outside, it adds
that and puts the gradient in its *bucket* (the matrices of one unit with one owner, replica
and dtype). A complete bucket is reduced (AVG) to its owner at once, asynchronously, in one
packed buffer, in the policy's ``reduce_dtype`` (or the parameter's ``grad_dtype``); a
callback at the end of the backward reduces partial buckets (matrices that got no gradient),
waits for every reduce and adds the results into the owners' records' ``reduced_grad``
(HSDP: first on across the replicas, to the replica that steps them). Either way ``p.grad``
is left None; gradients are accumulated in the master's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .record import record_of
from .residency import InFlight, Unit, local, outside_dynamo, unpacked

__all__ = ["Bucket", "Gradients"]


@dataclass(eq=False)
class Bucket:
    """The gradients one reduce carries: a unit's matrices of one (owner, replica, dtype), each matrix in the
    first unit (in model order) that uses it, whose backward is the last to add to its gradient."""

    unit: Unit
    owner: int
    replica: int
    params: list[nn.Parameter]
    ready: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)  # this backward's gradients so far


class Gradients:
    """One model's dedicated gradients: the buckets, the reduces in flight, and what the clip check samples."""

    def __init__(self, state):
        self.state = state
        self.buckets: list[Bucket] = []  # in model order, the same on every rank
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        self.reducing: list[InFlight] = []  # this backward's reduces, waited at its end
        self.held: list[InFlight] = []  # HSDP: the reduces this rank holds, on their way to the stepping replica
        self.end_of_backward_queued = False
        # Whether a clip touched this window's gradients, for dmuon.Muon.step's check that a clip saw them all:
        self.symmetric_sample: torch.Tensor | None = None  # entries of the FSDP2 gradients after the last backward
        self.clipped = False  # dmuon.clip_grad_norm_ scaled the gradients since the last backward

    def require_reduced(self) -> None:
        """Refuse a step before the window's gradients are reduced: inside no_sync, or after a window whose every
        backward ran inside it."""
        if self.state.in_no_sync:
            raise RuntimeError(
                "optimizer.step() inside dmuon.no_sync(model): the gradients are not reduced yet. "
                "Run the last micro-batch's forward and backward outside no_sync, then step"
            )
        pending = next((name for name, r in self.state.records.items() if r.accumulated_grad is not None), None)
        if pending is not None:
            raise RuntimeError(
                f"optimizer.step() after a window whose every backward ran inside dmuon.no_sync(model): {pending} "
                "(and every other gradient) was accumulated but never reduced, and FSDP2 has not reduce-scattered "
                "its own. Run the window's last forward and backward outside no_sync, then step"
            )

    def on_grad(self, p: nn.Parameter) -> None:
        """Called once p.grad holds this backward's whole gradient: raises the schedule's "gradient" event
        ("gradient_in_no_sync" inside no_sync) with the gradient, in the master's precision."""
        g, p.grad = local(p.grad), None
        g = g.to(record_of(p).dtype)  # accumulate and keep in the master's precision
        self.queue_end_of_backward()
        self.state.run("gradient_in_no_sync" if self.state.in_no_sync else "gradient", subject=(p, g))

    def keep(self, p: nn.Parameter, g: torch.Tensor) -> None:
        record = record_of(p)
        record.accumulated_grad = g if record.accumulated_grad is None else record.accumulated_grad.add_(g)

    def merge_into_bucket(self, p: nn.Parameter, g: torch.Tensor) -> None:
        """Add what no_sync kept, put the sum in the bucket, and raise "bucket_full" once the bucket is complete."""
        record = record_of(p)
        if record.accumulated_grad is not None:
            g, record.accumulated_grad = record.accumulated_grad.add_(g), None
        bucket = self.bucket_of[p]
        bucket.ready[p] = g
        if len(bucket.ready) == len(bucket.params):
            self.state.run("bucket_full", subject=bucket)

    def queue_end_of_backward(self) -> None:
        """Have :meth:`finish_backward` run when the backward running now ends (once)."""
        if not self.end_of_backward_queued:
            torch.autograd.Variable._execution_engine.queue_callback(outside_dynamo(self.finish_backward))
            self.end_of_backward_queued = True

    def issue_reduce(self, bucket: Bucket) -> None:
        """Start reducing (AVG) the bucket's gradients to their owner, in one packed buffer."""
        state = self.state
        params = [p for p in bucket.params if p in bucket.ready]  # all of them, unless the backward ended first
        wire_dtype = state.wire_dtype(bucket.unit, params[0])
        flat = torch.cat([bucket.ready[p].to(wire_dtype).reshape(-1) for p in params])
        bucket.ready.clear()
        description = (f"the reduce of {bucket.unit.path or 'the model'}'s gradients to rank {bucket.owner} "
                       f"({len(params)} matrices, {flat.numel()} values of {wire_dtype})")
        event = state.order.check(description)
        work = dist.reduce(flat, group=state.group, group_dst=bucket.owner, op=dist.ReduceOp.AVG, async_op=True)
        self.reducing.append(InFlight(event, description, bucket.owner, params, flat, work, bucket.replica))

    def finish_backward(self) -> None:
        """At the end of a backward: the schedule's end-of-backward actions (Z3 releases every unit still
        resident; every partial bucket is reduced, and every reduce waited and added where it landed)."""
        self.end_of_backward_queued = False
        self.state.run("end_of_backward")
        if not self.state.in_no_sync:
            # After every callback queued so far: FSDP2's final one assigns the root's gradients.
            torch.autograd.Variable._execution_engine.queue_callback(outside_dynamo(self._sample_after_backward))

    def reduce_partial(self) -> None:
        for bucket in self.buckets:  # model order on every rank: a matrix without a gradient leaves a bucket partial
            if bucket.ready:
                self.issue_reduce(bucket)

    def wait_reduces(self) -> None:
        """Wait for this backward's reduces; the owner adds each into its records' ``reduced_grad`` (HSDP: holds it
        for :meth:`reduce_across_replicas`)."""
        state = self.state
        for sent in self.reducing:
            with state.order.waiting(sent.event, sent.description):
                sent.work.wait()
            if sent.owner != state.rank:
                continue
            if state.replicas == 1:
                _add_reduced(sent)
            else:
                self.held.append(sent)
        self.reducing.clear()

    def reduce_across_replicas(self) -> None:
        """HSDP: each holder's replica averages on to the replica that steps them, checked as one batch."""
        state, held = self.state, self.held
        self.held = []
        if not held:
            return
        descriptions = [f"the reduce of {len(sent.params)} matrices' replica gradients to replica {sent.replica} "
                        f"({sent.flat.numel()} values)" for sent in held]
        events = state.replicate_order.check_all(descriptions)
        across = []
        for sent, event, description in zip(held, events, descriptions):
            work = dist.reduce(sent.flat, group=state.replicate_group, group_dst=sent.replica,
                               op=dist.ReduceOp.AVG, async_op=True)
            across.append(InFlight(event, description, sent.replica, sent.params, sent.flat, work, sent.replica))
        for sent in across:
            with state.replicate_order.waiting(sent.event, sent.description):
                sent.work.wait()
            if sent.replica == state.replica:
                _add_reduced(sent)

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
                   for g in (local(p.grad) for p in self.state.model.parameters()
                             if p.grad is not None and p not in self.state.name_of)
                   if g.numel() > 0]
        return torch.cat(entries) if entries else None


def _add_reduced(sent: InFlight) -> None:
    for p, g in zip(sent.params, unpacked(sent)):
        record = record_of(p)
        g = g.to(record.dtype)
        record.reduced_grad = g if record.reduced_grad is None else record.reduced_grad.add_(g)
