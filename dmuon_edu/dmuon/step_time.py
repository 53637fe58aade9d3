r"""A training step's seconds, phase by phase, for dmuon's layouts and their peers: predicted, not measured.

    workload = dmuon.Workload.from_model(model, predicate, tokens=8 * 64)   # or dmuon.MODELS["llama2-7b"]
    step = dmuon.predict_step(workload, dmuon.LAYOUTS["dmuon Z3"], world_size=8, micro_batches=4,
                              hardware=dmuon.HARDWARE["h100-sxm"])
    step.total, step.phases, step.collectives

The step: N micro-batches of forward and backward, the first N-1 under the layout's
``no_sync``, then the optimizer step. Per rank:

- **compute**: a forward costs 2 flops per token per entry of every matrix that
  multiplies activations (embedding tables only look up), plus attention's scores and
  mixing (:func:`attention_flops_per_token`), at ``compute_efficiency`` of the matmul
  rate; a backward twice that, and once more with activation checkpointing.
- **collectives**: the calls and bytes each layout issues, counted as count_comm counts
  them (the whole tensor, on every rank taking part), derived from what runs: FSDP2's
  units (each layer, then the root) with its padding, DDP's buckets, and dmuon's plan
  (plan_owners, one broadcast and one reduce per (layer, owner)), equal to
  summarize_comm_plan's totals. Each is priced by the hardware (hardware.py).
- **Newton-Schulz**: each owner's matrices, their flops as dmuon_edu.newton_schulz.ns_flops
  counts them for the backend used, at the matmul rate of ``ns_dtype``; the step waits
  for the slowest owner.
- **optimizer**: the elementwise passes of AdamW (28 bytes per fp32 entry: read the
  parameter, gradient and two moments, write three) and of Muon's momentum and update
  (24 bytes), at the memory bandwidth.

What overlaps with what is one rule, the hardware's ``overlap``. Without it (a CPU whose
ranks fill its cores) every part adds up. With it (GPUs) a collective issued
asynchronously during a pass, FSDP2's and dmuon's prefetched gathers and broadcasts,
the gradient reduces, the post-step broadcast (waited at the next forward), runs
beside that pass's compute: the pass pays its compute or its communication, whichever
is longer, plus the one collective nothing precedes (the first layer's gather in a
forward, the last bucket's reduce in a backward). A broadcast that is not prefetched
(``forward_prefetch_depth=0``), tensor parallelism's activation collectives (the next
product waits for them) and everything in the optimizer step are paid in full.

Ranks sharing a node's cores (``Hardware.cores``, one thread per rank) share its compute:
each runs at the part of its rate ``Hardware.share`` gives, what calibrate() measured
with that many ranks multiplying at once, else cores / ranks where the ranks outnumber
the cores. Collectives are priced at the world size a calibration measured, which
includes that sharing.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dmuon_edu.arguments import require_int
from dmuon_edu.newton_schulz import ns_flops

from .hardware import Hardware
from .plan import layer_of, plan_owners
from .schedule import Schedule

__all__ = ["Workload", "Layout", "LAYOUTS", "MODELS", "StepTime", "Collective", "predict_step", "planned_collectives",
           "counted",
           "attention_flops_per_token", "activation_entries_per_token", "transformer"]

ADAMW_BYTES_PER_ENTRY = 28  # fp32: read parameter, gradient, two moments; write parameter and moments
MUON_BYTES_PER_ENTRY = 24  # fp32: read gradient and momentum, write momentum, read and write the parameter and update
STEP_FLAG_BYTES = 48  # dmuon's step all-reduce: six float64 (the finite flag, the order hash, clipping's sample)
DDP_FIRST_BUCKET_BYTES = 2**20  # torch DDP's defaults: a 1 MiB first bucket, 25 MiB after it
DDP_BUCKET_BYTES = 25 * 2**20
REPLICATE_BUCKET_BYTES = 4 * 2**20  # dmuon.replicate's buckets (ddp.py)
# Every counted byte is copied into a collective's buffer and out of it (FSDP2's copy-in and copy-out, dmuon's
# packs, DDP's buckets): read and written twice.
COPIED_BYTES_PER_COUNTED_BYTE = 4
TP_STYLES = ("colwise", "colwise, gathered", "rowwise", "rowwise, from replicated")


# -- what is trained ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One data-parallel rank's work per micro-batch.

    Args:
        shapes: every trainable parameter's full shape, in model order, by name.
        dedicated: the names of the matrices Muon steps (dmuon's dedicated matrices).
        tokens: tokens per micro-batch on each data-parallel rank (TP ranks share theirs).
        lookups: tables read by index (embeddings): gathered and reduced, never multiplied.
        attention_flops_per_token: the forward's attention scores and mixing, per token.
        activation_entries_per_token: the entries that the normalisations, residual adds and
            the loss's softmax write per token in a forward (each priced at the hardware's
            ``elementwise_seconds`` for its forward and backward).
        nonlinearity_entries_per_token: the entries the MLP's activation function writes per
            token in a forward (``nonlinearity_seconds`` each, forward and backward).
        tensor_parallel: Megatron's style of each TP-split module by its name (the prefix of
            its ``.weight`` and ``.bias``): "colwise" (weight rows split, its bias too),
            "colwise, gathered" (and its output gathered), "rowwise" (weight columns split,
            its output all-reduced), "rowwise, from replicated" (and its input's gradient
            gathered). Modules absent are replicated over the TP group.
        attention_split: whether TP splits attention's heads (Megatron); False: every TP
            rank runs the whole attention.
        dtype: the parameters' and activations' dtype.
        activation_checkpointing: recompute each layer's forward in its backward.
    """

    shapes: Mapping[str, tuple[int, ...]]
    dedicated: frozenset[str]
    tokens: int
    lookups: frozenset[str] = frozenset()
    attention_flops_per_token: float = 0.0
    activation_entries_per_token: float = 0.0
    nonlinearity_entries_per_token: float = 0.0
    tensor_parallel: Mapping[str, str] = field(default_factory=dict)
    attention_split: bool = True
    dtype: str = "float32"
    activation_checkpointing: bool = False

    def __post_init__(self):
        for name in self.dedicated:
            if name not in self.shapes or len(self.shapes[name]) != 2:
                raise ValueError(f"dedicated matrix {name} is not a 2-D entry of shapes: name each Muon matrix as "
                                 "model.named_parameters() does")
        require_int("tokens", self.tokens, minimum=1, hint="tokens per micro-batch per data-parallel rank")
        for module, style in self.tensor_parallel.items():
            if style not in TP_STYLES:
                raise ValueError(f"{module}: tensor_parallel styles are {', '.join(TP_STYLES)}, got {style!r}")

    @classmethod
    def from_model(cls, model: nn.Module, predicate: Callable[[str, nn.Parameter], bool], *, tokens: int,
                   **options) -> Workload:
        """A workload from a model's trainable parameters (full shapes, DTensors included), ``predicate``
        choosing the dedicated matrices as dedicate_params does; its nn.Embedding weights are lookups."""
        shapes, dedicated = {}, set()
        for name, p in model.named_parameters():
            if p.requires_grad:
                shapes[name] = tuple(p.shape)
                if predicate(name, p):
                    dedicated.add(name)
        lookups = {f"{module}.weight".lstrip(".") for module, m in model.named_modules() if isinstance(m, nn.Embedding)}
        return cls(shapes, frozenset(dedicated), tokens, frozenset(lookups & set(shapes)), **options)

    def local_shape(self, name: str, tp: int) -> tuple[int, ...]:
        """A parameter's shape on one TP rank."""
        shape = self.shapes[name]
        module, _, kind = name.rpartition(".")
        style = self.tensor_parallel.get(module) if tp > 1 else None
        if style is None or (style.startswith("rowwise") and kind != "weight"):
            return shape
        dim = 0 if style.startswith("colwise") else 1
        if shape[dim] % tp:
            raise ValueError(f"{name} {shape}: dim {dim} does not split evenly over {tp} TP ranks")
        return tuple(d // tp if i == dim else d for i, d in enumerate(shape))


def attention_flops_per_token(n_layer: int, d_model: int, sequence: int) -> float:
    """A causal transformer's attention flops per token in a forward: Q K^T and the mix of V, 2 * 2 * T * d per
    layer (counted unmasked, as a dense kernel computes it; a kernel that skips masked blocks does about half)."""
    return 4.0 * n_layer * d_model * sequence


def activation_entries_per_token(n_layer: int, d_model: int, vocab: int) -> float:
    """A pre-norm transformer's norm and add entries per token in a forward: per layer two norms and two residual
    adds (4 d), then the final norm (d) and the loss's softmax over the vocabulary."""
    return n_layer * 4 * d_model + d_model + vocab


def transformer(*, vocab: int, d_model: int, n_layer: int, ffn: int, sequence: int, tokens: int,
                fused_qkv: bool = False, gated: bool = False, biases: bool = False, positions: bool = False,
                dtype: str = "float32", activation_checkpointing: bool = False) -> Workload:
    """A decoder-only transformer's workload: its layers named as ``layers.{i}.attn.*_proj`` and
    ``layers.{i}.mlp.*_proj`` (the hidden matrices, dedicated), embeddings and an untied head on AdamW."""
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (vocab, d_model)}
    if positions:
        shapes["pos_emb.weight"] = (sequence, d_model)
    matrices = {}
    for i in range(n_layer):
        attention = ({"qkv_proj": (3 * d_model, d_model)} if fused_qkv else
                     {f"{x}_proj": (d_model, d_model) for x in "qkv"})
        attention["out_proj"] = (d_model, d_model)
        mlp = {"gate_proj": (ffn, d_model), "up_proj": (ffn, d_model)} if gated else {"up_proj": (ffn, d_model)}
        mlp["down_proj"] = (d_model, ffn)
        shapes[f"layers.{i}.ln_1.weight"] = (d_model,)
        for block, layer_matrices in (("attn", attention), ("mlp", mlp)):
            for name, shape in layer_matrices.items():
                matrices[f"layers.{i}.{block}.{name}.weight"] = shape
                shapes[f"layers.{i}.{block}.{name}.weight"] = shape
                if biases:
                    shapes[f"layers.{i}.{block}.{name}.bias"] = (shape[0],)
        shapes[f"layers.{i}.ln_2.weight"] = (d_model,)
    shapes["ln_f.weight"] = (d_model,)
    shapes["lm_head.weight"] = (vocab, d_model)
    lookups = {"tok_emb.weight", "pos_emb.weight"} & set(shapes)
    return Workload(shapes, frozenset(matrices), tokens, frozenset(lookups),
                    attention_flops_per_token(n_layer, d_model, sequence),
                    activation_entries_per_token(n_layer, d_model, vocab),
                    n_layer * (2 if gated else 1) * ffn, dtype=dtype,  # SwiGLU: the SiLU and the product
                    activation_checkpointing=activation_checkpointing)


# GPT-2 small (Radford et al. 2019; HF "gpt2": 50257 tokens, d 768, 12 layers, fused qkv, biases, learned positions)
# and Llama-2-7B (Touvron et al. 2023: 32000 tokens, d 4096, 32 layers, SwiGLU 11008, no biases): sequence 4096,
# one sequence per GPU per micro-batch, bf16, activation checkpointing, as docs/benchmarks.md predicts them.
MODELS: dict[str, Workload] = {
    "gpt2-small": transformer(vocab=50257, d_model=768, n_layer=12, ffn=3072, sequence=4096, tokens=4096,
                              fused_qkv=True, biases=True, positions=True, dtype="bfloat16",
                              activation_checkpointing=True),
    "llama2-7b": transformer(vocab=32000, d_model=4096, n_layer=32, ffn=11008, sequence=4096, tokens=4096,
                             gated=True, dtype="bfloat16", activation_checkpointing=True),
}


# -- how it is laid out ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How the ranks share the model and who steps what.

    Args:
        sharding: "fsdp2" (fully_shard on each layer and the root) or "ddp" (every rank holds every parameter:
            torch's DDP, or dmuon's replicate for the DDP backend).
        optimizer: "adamw" (on everything), "muon" (replicated: every rank steps every matrix, AdamW the rest)
            or "dmuon" (each matrix on its owner).
        reshard_after_forward: dmuon's Z3 (True) or Z2 (False).
        prefetch: dmuon's broadcasts issued a layer ahead (forward_prefetch_depth=1) or at their layer (0).
        replicas: HSDP's replicate axis (1: none); the shard axis is the rest of the data-parallel ranks.
        tp: the tensor-parallel degree (1: none); data parallelism runs on world_size / tp ranks.
    """

    sharding: str
    optimizer: str
    reshard_after_forward: bool = True
    prefetch: bool = True
    replicas: int = 1
    tp: int = 1

    def __post_init__(self):
        if self.sharding not in ("fsdp2", "ddp"):
            raise ValueError(f"sharding must be 'fsdp2' or 'ddp', got {self.sharding!r}")
        if self.optimizer not in ("adamw", "muon", "dmuon"):
            raise ValueError(f"optimizer must be 'adamw', 'muon' or 'dmuon', got {self.optimizer!r}")
        require_int("replicas", self.replicas, minimum=1, hint="1 for no HSDP")
        require_int("tp", self.tp, minimum=1, hint="1 for no tensor parallelism")
        if self.replicas > 1 and self.sharding != "fsdp2":
            raise ValueError("replicas > 1 is HSDP, which is fully_shard on a 2-D mesh: use sharding='fsdp2'")
        if self.replicas > 1 and self.tp > 1:
            raise ValueError("HSDP with TP is not a layout dmuon builds (it refuses HSDP x TP): pick one")


LAYOUTS: dict[str, Layout] = {
    "FSDP2 + AdamW": Layout("fsdp2", "adamw"),
    "dmuon Z2": Layout("fsdp2", "dmuon", reshard_after_forward=False),
    "dmuon Z3": Layout("fsdp2", "dmuon"),
    "dmuon Z3, no prefetch": Layout("fsdp2", "dmuon", prefetch=False),
    "DDP + AdamW": Layout("ddp", "adamw"),
    "DDP + replicated Muon": Layout("ddp", "muon"),
    "dmuon DDP backend": Layout("ddp", "dmuon"),
    "HSDP + AdamW": Layout("fsdp2", "adamw", replicas=2),
    "dmuon HSDP Z2": Layout("fsdp2", "dmuon", reshard_after_forward=False, replicas=2),
    "dmuon HSDP Z3": Layout("fsdp2", "dmuon", replicas=2),
    "FSDP2 + TP + AdamW": Layout("fsdp2", "adamw", tp=2),
    "FSDP2 + TP + whole-matrix Muon": Layout("fsdp2", "muon", tp=2),
    "dmuon Z3 + TP": Layout("fsdp2", "dmuon", tp=2),
    "DDP + TP + AdamW": Layout("ddp", "adamw", tp=2),
    "DDP + TP + whole-matrix Muon": Layout("ddp", "muon", tp=2),
    "dmuon DDP backend + TP": Layout("ddp", "dmuon", tp=2),
}


# -- the prediction -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    """Calls of one collective in one step on one rank, over groups of ``group_size`` ranks spanning ``nodes``.

    ``when``: "forward", "backward" (issued asynchronously during that pass), "blocking" (in a pass, waited at
    once: tensor parallelism's activations), "step" (the optimizer step) or "after step" (the post-step
    broadcast, waited at the next forward). ``counted``: whether count_comm sees it (DTensor's tensor-parallel
    activations go through functional collectives, which it does not).
    """

    what: str
    collective: str
    calls: int
    bytes: int
    group_size: int
    when: str
    prefetched: bool = True
    nodes: int = 1
    counted: bool = True
    issued_by: str = ""  # "fsdp2" (a unit's gather) or a TP style: the framework whose host work comes with it
    parameters: int = 0  # the parameters FSDP2's gathers carry, summed over the calls


@dataclass(frozen=True)
class StepTime:
    """A predicted step: ``phases`` in seconds (each collective at its full cost), ``total`` (with what overlaps
    hidden), the ``collectives`` of the slowest rank, and the owners' Newton-Schulz balance (max / mean)."""

    phases: dict[str, float]
    total: float
    collectives: list[Collective]
    ns_balance: float


def counted(collectives: Sequence[Collective]) -> dict[str, list[int]]:
    """{collective: [calls, bytes]} of ``collectives`` (:func:`planned_collectives`, ``StepTime.collectives``) as
    count_comm counts them on this rank in one step: those it sees."""
    totals: dict[str, list[int]] = {}
    for c in collectives:
        if c.counted and c.calls:
            calls, nbytes = totals.get(c.collective, [0, 0])
            totals[c.collective] = [calls + c.calls, nbytes + c.bytes]
    return totals


def predict_step(workload: Workload, layout: Layout, *, world_size: int, micro_batches: int, hardware: Hardware,
                 ns_dtype: str | torch.dtype = "bfloat16", ns_backend: str = "gram", ns_steps: int = 5) -> StepTime:
    """The seconds of one training step of ``workload`` in ``layout`` (the module docstring).

    Args:
        workload: what one data-parallel rank computes (:class:`Workload`, :data:`MODELS`).
        layout: :class:`Layout`, e.g. ``LAYOUTS["dmuon Z3"]``.
        world_size: every rank (data parallel times TP).
        micro_batches: N, the first N-1 under no_sync.
        hardware: :class:`Hardware` (``calibrate()`` or a preset).
        ns_dtype: the dtype Newton-Schulz's products run in.
        ns_backend: "gram" (dmuon's default) or "direct".
        ns_steps: Newton-Schulz steps.

    Returns:
        The :class:`StepTime` of the slowest rank.

    Raises:
        TypeError: a world size or micro-batch count that is not an int.
        ValueError: a world size the layout's degrees do not divide, a count below 1, or a hardware without a
            needed rate.
    """
    grid = _Grid.of(layout, world_size)
    require_int("micro_batches", micro_batches, minimum=1)
    if ns_backend not in ("gram", "direct"):
        raise ValueError(f"ns_backend must be 'gram' or 'direct', got {ns_backend!r}")
    on_node = min(world_size, hardware.ranks_per_node or world_size)
    share = hardware.share(on_node)
    compute_rate = hardware.rate(workload.dtype) * share * hardware.compute_efficiency
    # The elementwise work: a third of it in the forward, two thirds in the backward (twice the forward's). Under
    # TP a column-split MLP's activation runs on the rank's columns.
    mlp_split = layout.tp if any(s.startswith("colwise") for s in workload.tensor_parallel.values()) else 1
    elementwise = micro_batches * workload.tokens * (
        workload.activation_entries_per_token * hardware.elementwise_seconds
        + workload.nonlinearity_entries_per_token / mlp_split * hardware.nonlinearity_seconds) / share
    recompute = 1 if workload.activation_checkpointing else 0
    flops = _forward_flops(workload, layout.tp)
    forward = micro_batches * flops / compute_rate + elementwise / 3
    backward = micro_batches * (2 + recompute) * flops / compute_rate + elementwise * (2 + recompute) / 3
    plan = _owners(workload, layout, grid) if layout.optimizer == "dmuon" else None
    ns_rate = hardware.rate(ns_dtype) * share
    gram = ns_backend == "gram"
    ns_by_rank = [sum(ns_flops(workload.shapes[n], ns_steps, gram) for n in names) / ns_rate
                  for names in _ns_work(workload, layout, grid, plan)]
    ns_seconds = max(ns_by_rank)
    balance = ns_seconds / (sum(ns_by_rank) / len(ns_by_rank)) if sum(ns_by_rank) else 1.0
    optimizer = _optimizer_bytes(workload, layout, grid, plan) / (hardware.memory_bandwidth * share)

    ranks = [_collectives(workload, layout, grid, micro_batches, r, plan, hardware.ranks_per_node)
             for r in _representative_ranks(grid)]
    seconds = [{id(c): hardware.collective_seconds(c.collective, c.calls, c.bytes, c.group_size, c.nodes,
                                                   _host_work(c, hardware)) for c in cs} for cs in ranks]
    slowest = max(range(len(ranks)), key=lambda i: sum(seconds[i].values()))
    collectives, cost = ranks[slowest], seconds[slowest]

    phases = {"forward": forward, "backward": backward}
    for c in collectives:
        phases[c.what] = phases.get(c.what, 0.0) + cost[id(c)]
    copied = sum(c.bytes for c in collectives) * COPIED_BYTES_PER_COUNTED_BYTE
    phases["buffer copies"] = copied / (hardware.memory_bandwidth * share)
    phases["Newton-Schulz"] = ns_seconds
    phases["optimizer"] = optimizer
    compute = forward + backward + ns_seconds + optimizer + phases["buffer copies"]
    if not hardware.overlap:
        total = compute + sum(cost.values())
    else:
        total = compute + _exposed(collectives, cost, forward, backward, micro_batches)
    return StepTime(phases, total, collectives, balance)


def _host_work(c: Collective, hardware: Hardware) -> float | None:
    """The fixed cost of ``c``'s calls where calibrate() measured the framework that issues them: an FSDP2 unit's
    host work per micro-batch comes with its two gathers (half with each), a TP module's with its collectives."""
    if c.issued_by == "fsdp2":
        return hardware.framework_seconds("fsdp2 unit", c.group_size, c.calls / 2, c.parameters / 2)
    if c.issued_by:
        per_module = len(list(_tp_activation_collectives(c.issued_by, 0, 0)))
        return hardware.framework_seconds(c.issued_by, c.group_size, c.calls / per_module)
    return None


def _exposed(collectives, cost, forward, backward, micro_batches) -> float:
    """Communication left over once what overlaps is hidden (the module docstring's rule)."""
    hidden = {"forward": 0.0, "backward": 0.0}
    exposed = 0.0
    for c in collectives:
        seconds = cost[id(c)]
        if c.when in ("forward", "after step") and c.prefetched:
            hidden["forward"] += seconds
            exposed += seconds / max(c.calls, 1) * min(c.calls, micro_batches)  # the first unit's, each forward
        elif c.when == "backward":
            hidden["backward"] += seconds
            exposed += seconds / max(c.calls, 1) * min(c.calls, micro_batches)  # the last bucket's, each backward
        else:
            exposed += seconds
    exposed += max(0.0, hidden["forward"] - forward) + max(0.0, hidden["backward"] - backward)
    return exposed


# -- who does what --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Grid:
    world: int
    tp: int
    dp: int
    shards: int
    replicas: int

    @classmethod
    def of(cls, layout: Layout, world: int) -> _Grid:
        require_int("world_size", world, minimum=1)
        if world % (layout.tp * layout.replicas):
            raise ValueError(f"world_size {world} is not a multiple of tp ({layout.tp}) x replicas "
                             f"({layout.replicas}): pick a world size the layout's degrees divide")
        dp = world // layout.tp
        return cls(world, layout.tp, dp, dp // layout.replicas, layout.replicas)


def _representative_ranks(grid: _Grid) -> range:
    """Ranks whose collectives differ: by shard index under HSDP (its stage 2 and publish), by DP and TP index
    under TP (the TP gathers); otherwise every rank counts the same calls and bytes."""
    return range(grid.shards * grid.tp) if grid.replicas > 1 or grid.tp > 1 else range(1)


def _owners(workload: Workload, layout: Layout, grid: _Grid) -> tuple[dict[str, int], dict[str, int]]:
    """dmuon's plan, as dedicate_params makes it: {name: DP owner over shards x replicas}, {name: TP owner}."""
    full = {name: tuple(workload.shapes[name]) for name in workload.shapes if name in workload.dedicated}
    plan = plan_owners(full, grid.shards * grid.replicas)
    tp_owner: dict[str, int] = {}
    if grid.tp > 1:
        split = {n for n in full if workload.local_shape(n, grid.tp) != full[n]}
        for d in range(grid.shards):
            tp_owner.update(plan_owners({n: full[n] for n in split if plan[n] == d}, grid.tp))
    return plan, tp_owner


def _ns_work(workload: Workload, layout: Layout, grid: _Grid, plan) -> list[list[str]]:
    """The matrices whose Newton-Schulz each rank runs, one list per (DP index, TP index) that steps any."""
    matrices = [n for n in workload.shapes if n in workload.dedicated]
    if layout.optimizer == "adamw":
        return [[]]
    if layout.optimizer == "muon":  # every rank, every matrix (whole, after gathering it under TP)
        return [matrices]
    owners, tp_owner = plan
    work: dict[tuple[int, int], list[str]] = defaultdict(list)
    for n in matrices:  # a matrix TP does not split is stepped in every TP column by its DP owner there
        for t in [tp_owner[n]] if n in tp_owner else range(grid.tp):
            work[(owners[n], t)].append(n)
    return list(work.values()) + [[]] * (grid.shards * grid.replicas * grid.tp - len(work))


def _optimizer_bytes(workload: Workload, layout: Layout, grid: _Grid, plan) -> float:
    """Bytes the slowest rank's optimizers stream in a step."""
    rest = sum(math.prod(workload.local_shape(n, grid.tp)) for n in workload.shapes
               if layout.optimizer == "adamw" or n not in workload.dedicated)
    adamw = rest / grid.shards if layout.sharding == "fsdp2" else rest
    muon = max(sum(math.prod(workload.shapes[n]) for n in names) for names in _ns_work(workload, layout, grid, plan))
    return ADAMW_BYTES_PER_ENTRY * adamw + MUON_BYTES_PER_ENTRY * muon


def _forward_flops(workload: Workload, tp: int) -> float:
    products = sum(math.prod(workload.local_shape(n, tp)) for n, shape in workload.shapes.items()
                   if len(shape) == 2 and n not in workload.lookups)
    attention = workload.attention_flops_per_token / (tp if workload.attention_split and tp > 1 else 1)
    return workload.tokens * (2 * products + attention)


# -- the collectives ------------------------------------------------------------------------------------------------
def _unit_of(name: str) -> str:
    """FSDP2's unit (and dmuon's hook boundary) of a parameter: its layer ``layers.N``, else the root ("")."""
    layer = layer_of(name)
    return layer if any(part.isdigit() for part in layer.split(".")) else ""


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def planned_collectives(workload: Workload, layout: Layout, *, world_size: int, micro_batches: int, rank: int = 0,
                        ranks_per_node: int | None = None) -> list[Collective]:
    """Every collective one rank takes part in during one step of ``layout``, with its calls and counted bytes.

    They follow from what runs: FSDP2 gathers each unit (each layer, then the root: every
    parameter outside a ``layers.N``) in every forward and each layer again in every
    backward (the root stays gathered), padding each parameter's first dim to a multiple of
    the shards, and reduce-scatters every unit once per window (HSDP then all-reduces each
    unit's shard across replicas); torch's DDP all-reduces once per window in buckets
    formed in backward order (1 MiB, then 25 MiB); dmuon broadcasts one pack per (layer,
    owner) per forward (and per backward in Z3; Z2 once per step) and reduces one per
    (layer, owner) per window, its step all-reduces 48 bytes, its DDP backend broadcasts
    each owner's matrices after the step, HSDP reduces each holder's packs to the owner's
    replica and publishes the step across replicas, and under TP each owned TP-sharded
    matrix is gathered to its TP owner and scattered back. Equal, layout by layout, to what
    count_comm counts and summarize_comm_plan plans (tests/test_dmuon.py).

    Args:
        rank: the global rank (ranks are numbered DP-major: rank = dp_index * tp + tp_index, and for HSDP
            dp_index = replica * shards + shard).
        ranks_per_node: ranks per node, for the nodes a group spans (None: one node).
    """
    grid = _Grid.of(layout, world_size)
    require_int("rank", rank, minimum=0, maximum=world_size - 1)
    require_int("micro_batches", micro_batches, minimum=1)
    plan = _owners(workload, layout, grid) if layout.optimizer == "dmuon" else None
    return _collectives(workload, layout, grid, micro_batches, rank, plan, ranks_per_node)


def _collectives(workload: Workload, layout: Layout, grid: _Grid, N: int, rank: int, owners_plan,
                 ranks_per_node: int | None) -> list[Collective]:
    plan = _StepCollectives(workload, layout, grid, N, rank, ranks_per_node)
    plan.symmetric()
    if layout.optimizer == "dmuon":
        plan.dmuon(*owners_plan)
    elif layout.optimizer == "muon" and grid.tp > 1:  # whole-matrix Muon: every rank gathers every split matrix
        split = [n for n in workload.dedicated if workload.local_shape(n, grid.tp) != workload.shapes[n]]
        whole = sum(math.prod(workload.shapes[n]) * plan.size for n in split)
        group = grid.tp * (grid.shards if layout.sharding == "fsdp2" else 1)
        plan.add("TP gather + scatter", "all_gather", len(split), whole, group, "step", counted=False)
    if grid.tp > 1:
        plan.tp_activations()
    return plan.out


class _StepCollectives:
    """The collectives of one rank's step, gathered part by part: the symmetric parameters' (FSDP2's gathers and
    reduce-scatters, or the all-reduces of DDP and of dmuon's replicate), dmuon's, tensor parallelism's."""

    def __init__(self, workload: Workload, layout: Layout, grid: _Grid, N: int, rank: int,
                 ranks_per_node: int | None):
        self.workload, self.layout, self.grid, self.N = workload, layout, grid, N
        self.dp_index, self.tp_index = divmod(rank, grid.tp)
        self.shard = self.dp_index % grid.shards
        self.size = _itemsize(workload.dtype)
        self.ranks_per_node = ranks_per_node
        self.out: list[Collective] = []

    def nodes(self, group: int, stride: int = 1) -> int:  # ranks of a group sit stride apart in the global numbering
        if not self.ranks_per_node:
            return 1
        return max(1, min(group, math.ceil(group * stride / self.ranks_per_node)))

    def local_bytes(self, name: str) -> int:
        return math.prod(self.workload.local_shape(name, self.grid.tp)) * self.size

    def add(self, what, collective, calls, nbytes, group, when, stride=1, **kw) -> None:
        if calls and group > 1:
            self.out.append(Collective(what, collective, calls, int(nbytes), group, when,
                                       nodes=self.nodes(group, stride), **kw))

    def symmetric(self) -> None:
        workload, grid, N, add = self.workload, self.grid, self.N, self.add
        dedicated = workload.dedicated if self.layout.optimizer == "dmuon" else frozenset()
        sym = [n for n in workload.shapes if n not in dedicated]
        if self.layout.sharding != "fsdp2":
            sizes = [self.local_bytes(n) for n in reversed(sym)]  # backward order
            if self.layout.optimizer == "dmuon":
                buckets = _buckets(sizes, [REPLICATE_BUCKET_BYTES], closes_before=True)
            else:
                buckets = _buckets(sizes, [DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES], closes_before=False)
            add("gradient reduces", "all_reduce", len(buckets), sum(buckets), grid.dp, "backward", grid.tp)
            return

        def padded(name):  # FSDP2 pads dim 0 to a multiple of the shards
            shape = workload.local_shape(name, grid.tp)
            rows = math.ceil(shape[0] / grid.shards) * grid.shards
            return rows * math.prod(shape[1:]) * self.size
        units = list(dict.fromkeys(_unit_of(n) for n in workload.shapes))
        unit_bytes = {u: sum(padded(n) for n in sym if _unit_of(n) == u) for u in units}
        unit_parameters = Counter(_unit_of(n) for n in sym)
        fsdp_units = [u for u in units if unit_bytes[u]]
        stride = grid.tp
        gathered_forward = sum(unit_bytes[u] for u in fsdp_units)
        gathered_backward = sum(unit_bytes[u] for u in fsdp_units if u)
        add("FSDP2 gathers", "all_gather", N * len(fsdp_units), N * gathered_forward, grid.shards, "forward", stride,
            issued_by="fsdp2", parameters=N * sum(unit_parameters[u] for u in fsdp_units))
        add("FSDP2 gathers", "all_gather", N * sum(1 for u in fsdp_units if u), N * gathered_backward, grid.shards,
            "backward", stride, issued_by="fsdp2", parameters=N * sum(unit_parameters[u] for u in fsdp_units if u))
        add("gradient reduces", "reduce_scatter", len(fsdp_units), gathered_forward, grid.shards, "backward", stride)
        add("gradient reduces", "all_reduce", len(fsdp_units), gathered_forward / grid.shards, grid.replicas,
            "backward", stride * grid.shards)

    def dmuon(self, plan: dict[str, int], tp_owner: dict[str, int]) -> None:
        workload, layout, grid, add, local_bytes = self.workload, self.layout, self.grid, self.add, self.local_bytes
        owner_shard = {n: plan[n] % grid.shards for n in plan}
        packs = Counter()  # (unit, owner's shard index) -> bytes: a broadcast within each replica
        buckets = Counter()  # (unit, owner) -> bytes: a reduce (HSDP: owners of two replicas share a shard index)
        for n in plan:
            packs[(_unit_of(n), owner_shard[n])] += local_bytes(n)
            buckets[(_unit_of(n), plan[n])] += local_bytes(n)
        P = sum(packs.values())
        group = grid.shards
        if layout.sharding == "fsdp2" and packs:
            # each unit's broadcasts per step, as dmuon's schedule (schedule.py) issues them: Z3 2N, Z2 one
            schedule = Schedule(len({unit for unit, _ in packs}), layout.reshard_after_forward, int(layout.prefetch))
            for when, passes in schedule.broadcasts(self.N).items():
                add("dmuon broadcasts", "broadcast", passes * len(packs), passes * P, group, when, grid.tp,
                    prefetched=layout.prefetch)
        add("gradient reduces", "reduce", len(buckets), P, group, "backward", grid.tp)
        if grid.replicas > 1:  # stage 2: this holder's buckets on to the owner's replica; after the step, the publish
            held = [n for n in plan if owner_shard[n] == self.shard]
            add("gradient reduces", "reduce", len({(_unit_of(n), plan[n]) for n in held}),
                sum(local_bytes(n) for n in held), grid.replicas, "backward", grid.shards)
            publishing = {plan[n] // grid.shards for n in held}
            add("post-step broadcast", "broadcast", len(publishing), sum(local_bytes(n) for n in held),
                grid.replicas, "after step", grid.shards)
        add("step all-reduce", "all_reduce", 1, STEP_FLAG_BYTES, grid.world, "step")
        if layout.sharding == "ddp":  # each owner's updated matrices to every rank, one pack per owner
            add("post-step broadcast", "broadcast", len(set(plan.values())), P, grid.dp, "after step", grid.tp)
        if grid.tp > 1:  # the gradient shards this rank owns (DP), to their TP owner, and the update back
            mine = [n for n in plan if plan[n] == self.dp_index
                    and workload.local_shape(n, grid.tp) != workload.shapes[n]]
            nbytes = sum(local_bytes(n) * (grid.tp if tp_owner[n] == self.tp_index else 1) for n in mine)
            add("TP gather + scatter", "gather", len(mine), nbytes, grid.tp, "step")
            add("TP gather + scatter", "scatter", len(mine), nbytes, grid.tp, "step")

    def tp_activations(self) -> None:
        """The activations of each TP-split module, per micro-batch (DTensor's functional collectives)."""
        act = self.workload.tokens * self.size
        for module, style in self.workload.tensor_parallel.items():
            out_features, in_features = self.workload.shapes[f"{module}.weight"]
            for collective, elements, when in _tp_activation_collectives(style, out_features, in_features):
                self.add("TP activations", collective, self.N, self.N * act * elements, self.grid.tp, when,
                         counted=False, prefetched=False, issued_by=style)


def _tp_activation_collectives(style: str, out_features: int, in_features: int):
    """(collective, elements per token, "blocking") of one TP-split module in a forward and its backward."""
    if style.startswith("colwise"):
        yield "all_reduce", in_features, "blocking"  # backward: the input's partial gradients
        if style == "colwise, gathered":
            yield "all_gather", out_features, "blocking"  # forward: the output, gathered
    else:
        yield "all_reduce", out_features, "blocking"  # forward: the partial outputs
        if style == "rowwise, from replicated":
            yield "all_gather", in_features, "blocking"  # backward: the input's gradient, from its shards


def _buckets(sizes: Sequence[int], limits: Sequence[int], closes_before: bool) -> list[int]:
    """Bucket bytes. torch's DDP (closes_before=False) adds a tensor, then closes the bucket once it reaches its
    limit (the first limit, then the next); dmuon.replicate (True) starts a new bucket when a tensor would
    overflow the current one."""
    buckets: list[int] = []
    current, limit_index = 0, 0
    for nbytes in sizes:
        limit = limits[min(limit_index, len(limits) - 1)]
        if closes_before:
            if current and current + nbytes > limit:
                buckets.append(current)
                current = 0
            current += nbytes
        else:
            current += nbytes
            if current >= limit:
                buckets.append(current)
                current, limit_index = 0, limit_index + 1
    if current:
        buckets.append(current)
    return buckets
