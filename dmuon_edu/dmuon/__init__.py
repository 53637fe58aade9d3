r"""dmuon: distributed Muon for FSDP2, with dedicated owner ranks, no_sync and Z2/Z3.

    from dmuon_edu import dmuon

    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

Who owns what. Each matrix the predicate selects (a *dedicated* parameter) has one
owner rank, planned by Newton-Schulz cost (plan.py). The owner keeps the full matrix,
its momentum, and receives its averaged gradient; between optimizer steps no other
rank holds any storage for it. Every other parameter is *symmetric*: fully_shard
shards it, AdamW steps the shards. fully_shard leaves dedicated matrices alone, even
when called without ignored_params (fsdp_exclusion.py: the one torch-internal patch).

When each collective happens (P_M = bytes of all dedicated matrices; k micro-batches
per optimizer step, the first k-1 inside no_sync):

- broadcast, for a layer's forward: each owner sends that layer's matrices that it
  owns, packed into one buffer per (owner, dtype), issued when the previous layer's
  forward starts (``dmuon.Muon(..., forward_prefetch_depth=1)``) and waited when this
  layer's starts. Z3 (reshard_after_forward=True, the default) frees them after the
  layer's forward and broadcasts them again when backward reaches the layer (issued,
  likewise, one layer ahead in backward order): 2k * P_M per step. Z2 (False) keeps
  them from the first forward until optimizer.step(), through all micro-batches:
  1 * P_M per step, for P_M of extra memory on every rank.
- reduce (op AVG), in backward: one per (layer, owner, dtype) bucket, issued as soon as
  the bucket's gradients are complete, to its owner, waited at the end of the backward,
  into ``p._reduced_grad``. Inside no_sync there is none: gradients add into
  ``p._accumulated_grad`` and FSDP2 skips its reduce-scatter; the next backward outside
  no_sync reduces everything: 1 * P_M per step (k * P_M without no_sync).
- step: owners run Muon on their matrices (same shapes batched through NS); AdamW
  steps the shards. The only communication is one all_reduce of a one-element flag:
  if any gradient on any rank holds NaN or Inf, every rank skips the step (optim.py).
  Non-owner copies are dropped: the next forward's broadcast publishes the new values.

HSDP (``dedicate_params(model, mesh["shard"], predicate, replicate_mesh=mesh["replicate"])``
on a 2-D mesh, fully_shard on the 2-D mesh): one owner per matrix, planned over every
rank; in each replica the rank at the owner's shard index holds the matrix and does the
above within its replica; gradients are then averaged across replicas to the owner, and
after the step the owner publishes the result to the other replicas' holders (issued at
the end of step(), waited at the next forward with ``dmuon.Muon(...,
replicate_async=True)``, the default).

Same order on every rank. A collective pairs the n-th call of every rank, so every
rank must run the same dedicated layers in the same order. Before each collective and
each forward of a layer with dedicated matrices, each rank checks through the process
group's store that all ranks are at the same event (order.py: one store round trip,
about 35 us between two processes on one 2-core CPU). If a rank skipped a layer, the
ranks raise, naming the layers and the ranks, instead of mixing two layers' data or
hanging.

Bytes are as count_comm counts them: the whole tensor's size on every rank taking
part, sender or receiver. The peer's byte formulas, 2(N-1)/N * P_M (Z2) and
3(N-1)/N * P_M (Z3), count what crosses the wire per rank.

Modules: plan.py (owners), fsdp_exclusion.py, placeholder.py (non-owners' guarded
placeholders), order.py (the same collectives on every rank), dedicate.py
(dedicate_params, residency and gradient hooks, no_sync, ownership), optim.py (Muon),
state.py (state dicts, clip_grad_norm_).
"""

from dmuon_edu.distributed import count_collectives as count_comm

from .dedicate import dedicate_params, held_bytes, no_sync, ownership
from .optim import Muon
from .plan import imbalance, plan_owners
from .state import (
    StateDictOptions,
    clip_grad_norm_,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "dedicate_params",
    "plan_owners",
    "imbalance",
    "no_sync",
    "Muon",
    "ownership",
    "held_bytes",
    "count_comm",
    "clip_grad_norm_",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "StateDictOptions",
]
