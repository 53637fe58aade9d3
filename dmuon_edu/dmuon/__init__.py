r"""dmuon: distributed Muon for FSDP2, with dedicated owner ranks, no_sync and Z2/Z3.

    from dmuon_edu import dmuon

    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

Who owns what. Each matrix the predicate selects (a *dedicated* parameter) has one
owner rank, planned by Newton-Schulz time (plan.py). The owner keeps the full matrix,
its momentum, and receives its averaged gradient; between optimizer steps no other
rank holds any storage for it. Every other parameter is *symmetric*: fully_shard
shards it, AdamW steps the shards. fully_shard leaves dedicated matrices alone, even
when called without ignored_params (fsdp_exclusion.py: the one torch-internal patch).

When each collective happens (P_M = bytes of all dedicated matrices; N micro-batches
per optimizer step, the first N-1 inside no_sync):

- broadcast, for a layer's forward: each owner sends that layer's matrices that it
  owns, packed into one buffer per (owner, dtype), issued when the previous layer's
  forward starts (``dmuon.Muon(..., forward_prefetch_depth=1)``) and waited when this
  layer's starts. Z3 (reshard_after_forward=True, the default) frees them after the
  layer's forward and broadcasts them again when backward reaches the layer (issued,
  likewise, one layer ahead in backward order): 2N * P_M per step. Z2 (False) keeps
  them from the first forward until optimizer.step(), through all micro-batches:
  1 * P_M per step, for P_M of extra memory on every rank.
- reduce (op AVG), in backward: one per (layer, owner, dtype) bucket, issued as soon as
  the bucket's gradients are complete, to its owner, waited at the end of the backward,
  into the matrix's record (``dmuon.record_of(p).reduced_grad``). Inside no_sync there is
  none: gradients add into the record's ``accumulated_grad`` and FSDP2 skips its
  reduce-scatter; the next backward outside
  no_sync reduces everything: 1 * P_M per step (N * P_M without no_sync).
- step: owners run Muon on their matrices (same shapes batched through NS); AdamW
  steps the shards. The only communication is one all_reduce of six float64 numbers
  (48 bytes): a flag, so that if any gradient on any rank holds NaN or Inf, every rank
  skips the step; a flag for a clip that saw only the FSDP2 gradients; and the order
  check's event count and hash, each with its negation (step_agreement.py).
  Non-owner copies are dropped: the next forward's broadcast publishes the new values.

HSDP (``dedicate_params(model, mesh["shard"], predicate, replicate_mesh=mesh["replicate"])``
on a 2-D mesh, fully_shard on the 2-D mesh): one owner per matrix, planned over every
rank; in each replica the rank at the owner's shard index holds the matrix and does the
above within its replica; gradients are then averaged across replicas to the owner, and
after the step the owner publishes the result to the other replicas' holders (issued at
the end of step(), waited at the next forward with ``dmuon.Muon(...,
replicate_async=True)``, the default).

The DDP backend (``dedicate_params_ddp(model, mesh, predicate)``, then ``replicate(model,
mesh)`` instead of fully_shard; ddp.py): every rank keeps every matrix whole, the owner
receives its averaged gradient and runs Muon on it, and after the step broadcasts the result
to every rank; replicate all-reduces the other gradients, as DDP does. DDP + TP
(``dedicate_params_ddp_tp(model, mesh["dp"], predicate)``, then ``replicate_tp(model,
mesh["dp"])``, after parallelize_module): the same within each TP column, a TP-sharded
matrix's DP owners sending their shards to its TP owner for Newton-Schulz, as above.

Same order on every rank. A collective pairs the n-th call of every rank, so every
rank must run the same dedicated layers in the same order. Each rank describes every
collective of dmuon's and every forward of a layer with dedicated matrices, and the
ranks compare (order.py, ``dmuon.Muon(..., order_check=...)``): by default through the
process group's store before each event until the first optimizer step, then as a
running hash compared inside the step's one all-reduce, and event by event when a
collective times out. If a rank skipped a layer, the ranks raise, naming the layers and
the ranks, instead of mixing two layers' data or hanging.

Clipping: ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` sees only the
FSDP2 gradients (a dedicated matrix's gradient lives on its owner); use
``dmuon.clip_grad_norm_(model, max_norm)`` (clip.py). step() warns when it finds the
FSDP2 gradients scaled and the dedicated ones not.

Bytes are as count_comm counts them: the whole tensor's size on every rank taking
part, sender or receiver. The public dmuon's byte formulas, 2(W-1)/W * P_M (Z2) and
3(W-1)/W * P_M (Z3), W ranks (its documents write N), count what crosses the wire per rank.

What dmuon knows of each matrix is one record (record.py's MatrixRecord: placement,
shapes, dtypes, master, gradients, TP placement), held by the model's state and pointed
to by the parameter (``p._dmuon_record``, its one dmuon attribute).

Modules, each importing only those before it: plan.py (owners), names.py (names
without wrapper segments), order.py (the same collectives on every rank), policy.py
(per-parameter routes and dtypes), record.py (one record per matrix, its TP placement
included), tp.py (tensor parallelism's gathers and scatters), schedule.py (which units
to broadcast, land and release at each hook event), fsdp_exclusion.py, placeholder.py
(non-owners' guarded placeholders), residency.py (the schedule's executor: the hooks,
broadcasts, lands and releases), gradients.py (no_sync's accumulation, the reduces to the
owners), publish.py (a step's results to the ranks that did not step them), boundary.py
(hook boundaries), dedicate.py (dedicate_params, the model's state, no_sync, ownership),
dedicated_params.py (the public getters' snapshots), ddp.py (dedicate_params_ddp,
replicate, and their TP forms), clip.py (clip_grad_norm_), ns_backend.py (the
Newton-Schulz choice), step_agreement.py (the step's all-reduce), optim.py (Muon),
state.py (state dicts), diagnostics.py (summaries of the plan and the groups),
hardware.py (the machine: collective costs, matmul rates, calibrate(), GPU presets),
step_time.py (a step's predicted seconds, phase by phase, from the plan, the schedule
and the hardware; ``python -m dmuon_edu.dmuon`` prints one).
"""

from dmuon_edu.distributed import count_collectives as count_comm

from .clip import MuonGradClipStats, clip_grad_norm_
from .ddp import dedicate_params_ddp, dedicate_params_ddp_tp, replicate, replicate_tp
from .dedicate import dedicate_params, held_bytes, in_flight_bytes, no_sync, ownership
from .diagnostics import format_summary, summarize_comm_plan, summarize_param_groups
from .hardware import HARDWARE, Hardware, LinkCost, calibrate
from .dedicated_params import DedicatedParam, get_dedicated_params, get_owned_params
from .ns_backend import (POLAR_EXPRESS_COEFFICIENTS, YOU_COEFFICIENTS, NewtonSchulz, get_backend_status, get_ns_backend,
                         gram_newton_schulz, newton_schulz)
from .optim import Muon
from .plan import imbalance, plan_owners
from .policy import DMuonParamPolicy
from .record import MatrixRecord, record_of
from .step_time import LAYOUTS, MODELS, Layout, StepTime, Workload, planned_collectives, predict_step, transformer
from .state import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "dedicate_params",
    "dedicate_params_ddp",
    "dedicate_params_ddp_tp",
    "replicate",
    "replicate_tp",
    "plan_owners",
    "imbalance",
    "no_sync",
    "Muon",
    "ownership",
    "held_bytes",
    "in_flight_bytes",
    "count_comm",
    "clip_grad_norm_",
    "MuonGradClipStats",
    "DMuonParamPolicy",
    "MatrixRecord",
    "record_of",
    "NewtonSchulz",
    "newton_schulz",
    "gram_newton_schulz",
    "get_ns_backend",
    "get_backend_status",
    "get_dedicated_params",
    "get_owned_params",
    "DedicatedParam",
    "POLAR_EXPRESS_COEFFICIENTS",
    "YOU_COEFFICIENTS",
    "summarize_comm_plan",
    "summarize_param_groups",
    "format_summary",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "StateDictOptions",
    "Workload",
    "Layout",
    "LAYOUTS",
    "MODELS",
    "transformer",
    "predict_step",
    "planned_collectives",
    "StepTime",
    "Hardware",
    "LinkCost",
    "HARDWARE",
    "calibrate",
]
