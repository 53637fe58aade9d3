"""What each data-parallel scheme holds and sends per rank, from first principles: predict, then measure.

Notation, the course's letters: P bytes of parameters (for dmuon, P_M of them in Muon's
matrices, the only part these rows follow), W ranks (the world size), N micro-batches per
optimizer step, L layers (FSDP2 gathers, and dmuon broadcasts, one layer at a time), s bytes
of optimizer state per parameter byte (AdamW: 2, its two moments; Muon: 1, its momentum).
(The public dmuon's documents write N for the ranks.)

Bytes per optimizer step, two ways:

- **counted**: each call's whole tensor, once per call, on every rank, by collective:
  what ``dmuon_edu.distributed.count_collectives`` measures;
- **wire**: what one rank sends. A ring all-reduce sends 2(W-1)/W of its tensor per
  rank (a reduce-scatter, then an all-gather); a broadcast, reduce, all-gather or
  reduce-scatter (W-1)/W. gloo cannot measure wire bytes; they follow from the counted
  bytes by these factors.

Memory is per rank, at its peak during the window, activations aside: parameters
(whole, shards, and gathered or broadcast copies), gradients (including what
``no_sync`` keeps between micro-batches) and optimizer state. Two simplifications, both
stated where the notebooks use a row: every layer holds P / L (a real model's layers
differ: in module 5's MLP one layer holds 92% of P), and an owner's share of dmuon's
matrices is P_M / W (plan_owners balances Newton-Schulz work, so a rank's real share is
close to it, not equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dmuon_edu.arguments import require_flag

__all__ = ["Cost", "SCHEMES", "cost", "wire_factor"]

SCHEMES = ("DDP", "ZeRO-1", "FSDP2", "FSDP2, no reshard after forward", "dmuon Z3", "dmuon Z2", "dmuon DDP backend")


def wire_factor(collective: str, world_size: int) -> float:
    """Bytes one rank sends per counted byte of ``collective`` on ``world_size`` ranks (ring or tree)."""
    return 2 * (world_size - 1) / world_size if collective == "all_reduce" else (world_size - 1) / world_size


@dataclass(frozen=True)
class Cost:
    """One scheme's per-rank bytes: memory at its peak, and communication per optimizer step."""

    parameters: float  # resident: whole, shards, and the gathered or broadcast copies in use
    gradients: float
    optimizer_state: float
    counted: dict[str, float] = field(default_factory=dict)  # per optimizer step, by collective
    world_size: int = 1
    # dmuon: the packed broadcast buffers of the prefetched layer, on their way while a layer computes
    in_flight: float = 0.0

    @property
    def memory(self) -> float:
        return self.parameters + self.in_flight + self.gradients + self.optimizer_state

    @property
    def wire(self) -> float:
        """Bytes one rank sends per optimizer step."""
        return sum(nbytes * wire_factor(op, self.world_size) for op, nbytes in self.counted.items())


def cost(scheme: str, *, P: float, W: int, N: int, L: int, no_sync: bool = True, s: float = 2.0,
         T: int = 1) -> Cost:
    """Per-rank memory and bytes per optimizer step of ``scheme`` (one of SCHEMES).

    With tensor parallelism (``T`` > 1, dmuon's rows) each rank holds 1/T of every matrix
    and W counts the data-parallel ranks (W T in all): the rank's TP shards follow the row
    as if they were its matrices (P / T of them), and at the step each matrix's DP owners
    gather their gradient shards to its TP owner and receive the update's shards back. The
    TP owner counts the whole matrix, the others their shard: on average (2T - 1) / T^2 of
    the matrix per DP owner, i.e. (2T - 1) / (W T^2) P per rank for each of the gather and
    the scatter. The TP owner's full-shape proxy and its momentum are in the average
    optimizer state, s P / (W T); the proxy itself, P / (W T) on average, is added to the
    parameters.

    Args:
        scheme: one of SCHEMES.
        P: bytes of parameters (for the dmuon rows, P_M: the dedicated matrices').
        W: ranks.
        N: micro-batches per optimizer step.
        L: layers, each taken to hold P / L.
        no_sync: gradients are synchronised once per window (DDP's no_sync, FSDP2's
            set_requires_gradient_sync(False) on all but the last micro-batch, dmuon.no_sync);
            False: after every micro-batch.
        s: bytes of optimizer state per parameter byte (AdamW 2, Muon 1).
        T: the tensor-parallel degree (the dmuon rows only); 1 without TP.

    Returns:
        The scheme's :class:`Cost`.

    Raises:
        ValueError: an unknown scheme, W, N, L or T not an int >= 1, T > 1 on a row that is not
            dmuon's, or P not positive.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    for name, value in (("W", W), ("N", N), ("L", L), ("T", T)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if T > 1 and not scheme.startswith("dmuon"):
        raise ValueError(f"T > 1 (tensor parallelism) is modelled for dmuon's rows only, not {scheme!r}")
    if not P > 0:
        raise ValueError(f"P must be a positive number of bytes, got {P!r}")
    require_flag("no_sync", no_sync)
    syncs = 1 if no_sync else N  # backwards per window that communicate gradients
    layer = P / L
    if scheme == "DDP":
        return Cost(P, P, s * P, {"all_reduce": syncs * P}, W)
    if scheme == "ZeRO-1":  # as module 6a builds it: reduce each gradient to its owner, broadcast the update
        return Cost(P, P, s * P / W, {"reduce": syncs * P, "broadcast": P}, W)
    if scheme.startswith("FSDP2"):
        reshard = scheme == "FSDP2"
        # Resharded after forward, a layer is gathered again for its backward; otherwise it stays
        # gathered from its forward to its backward, every layer at once at the turn.
        gathered, all_gathers = (layer, 2 * N * P) if reshard else (P, N * P)
        # Without sync a rank keeps the whole unsharded gradient until the window's last backward.
        gradients = P if no_sync else P / W + layer
        return Cost(P / W + gathered, gradients, s * P / W,
                    {"all_gather": all_gathers, "reduce_scatter": syncs * P}, W)
    if T > 1:  # this rank's TP shards as its matrices, plus the TP gather and scatter at the step
        shards = cost(scheme, P=P / T, W=W, N=N, L=L, no_sync=no_sync, s=s)
        tp_bytes = (2 * T - 1) / (W * T * T) * P
        return Cost(shards.parameters + P / (W * T), shards.gradients, shards.optimizer_state,
                    {**shards.counted, "gather": tp_bytes, "scatter": tp_bytes}, W, shards.in_flight)
    if scheme == "dmuon DDP backend":
        # Every rank keeps every matrix; no_sync: its own accumulated gradient, and the owner's reduced share.
        gradients = P + P / W if no_sync else P / W + layer
        return Cost(P, gradients, s * P / W, {"reduce": syncs * P, "broadcast": P}, W)
    zero3 = scheme == "dmuon Z3"
    # Held: Z3, the owner's share plus the other owners' part of the layer in use; Z2, every matrix.
    parameters = P / W + (W - 1) / W * layer if zero3 else P
    # In flight while a layer computes: the next layer's packed broadcasts, the other owners' part
    # being received and this rank's own part copied into its send buffer. Z3 does this at every
    # layer; Z2 only in the window's first forward, where its peak is P and its own part of the
    # layer after (reached one layer before the last, when there is one).
    in_flight = (layer if zero3 else layer / W) if L > 1 else 0.0
    # no_sync: every rank accumulates its own gradient of every matrix; otherwise each reduce hands
    # a layer's gradients to their owners, and only the owner's reduced share stays.
    gradients = P + P / W if no_sync else P / W + layer
    return Cost(parameters, gradients, s * P / W,
                {"broadcast": (2 * N if zero3 else 1) * P, "reduce": syncs * P}, W, in_flight)
