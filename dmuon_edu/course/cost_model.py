"""What each data-parallel scheme holds and sends per rank, from first principles: predict, then measure.

Notation: P bytes of parameters (for dmuon, P_M of them in Muon's matrices, the only
part these rows follow), N ranks, k micro-batches per optimizer step, L layers (FSDP2
gathers, and dmuon broadcasts, one layer at a time), s bytes of optimizer state per
parameter byte (AdamW: 2, its two moments; Muon: 1, its momentum).

Bytes per optimizer step, two ways:

- **counted**: each call's whole tensor, once per call, on every rank, by collective:
  what ``dmuon_edu.distributed.count_collectives`` measures;
- **wire**: what one rank sends. A ring all-reduce sends 2(N-1)/N of its tensor per
  rank (a reduce-scatter, then an all-gather); a broadcast, reduce, all-gather or
  reduce-scatter (N-1)/N. gloo cannot measure wire bytes; they follow from the counted
  bytes by these factors.

Memory is per rank, at its peak during the window, activations aside: parameters
(whole, shards, and gathered or broadcast copies), gradients (including what
``no_sync`` keeps between micro-batches) and optimizer state. An owner's share of
dmuon's matrices is taken as P_M / N (plan_owners balances Newton-Schulz work, so a
rank's real share is close to it, not equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dmuon_edu.arguments import require_flag

__all__ = ["Cost", "SCHEMES", "cost", "wire_factor"]

SCHEMES = ("DDP", "ZeRO-1", "FSDP2", "FSDP2, no reshard after forward", "dmuon Z3", "dmuon Z2")


def wire_factor(collective: str, n: int) -> float:
    """Bytes one rank sends per counted byte of ``collective`` on ``n`` ranks (ring or tree)."""
    return 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


@dataclass(frozen=True)
class Cost:
    """One scheme's per-rank bytes: memory at its peak, and communication per optimizer step."""

    parameters: float  # resident: whole, shards, and the gathered or broadcast copies in use
    gradients: float
    optimizer_state: float
    counted: dict[str, float] = field(default_factory=dict)  # per optimizer step, by collective
    n: int = 1
    in_flight: float = 0.0  # dmuon Z3: the prefetched layer's buffer, travelling while a layer computes

    @property
    def memory(self) -> float:
        return self.parameters + self.in_flight + self.gradients + self.optimizer_state

    @property
    def wire(self) -> float:
        """Bytes one rank sends per optimizer step."""
        return sum(nbytes * wire_factor(op, self.n) for op, nbytes in self.counted.items())


def cost(scheme: str, *, P: float, N: int, k: int, L: int, no_sync: bool = True, s: float = 2.0) -> Cost:
    """Per-rank memory and bytes per optimizer step of ``scheme`` (one of SCHEMES).

    ``no_sync``: gradients are synchronised once per window (DDP's no_sync, FSDP2's
    set_requires_gradient_sync(False) on all but the last micro-batch, dmuon.no_sync);
    False: after every micro-batch. For the dmuon rows, P is P_M and s is Muon's 1.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    for name, value in (("N", N), ("k", k), ("L", L)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not P > 0:
        raise ValueError(f"P must be a positive number of bytes, got {P!r}")
    require_flag("no_sync", no_sync)
    syncs = 1 if no_sync else k  # backwards per window that communicate gradients
    layer = P / L
    if scheme == "DDP":
        return Cost(P, P, s * P, {"all_reduce": syncs * P}, N)
    if scheme == "ZeRO-1":  # as module 6 builds it: reduce each gradient to its owner, broadcast the update
        return Cost(P, P, s * P / N, {"reduce": syncs * P, "broadcast": P}, N)
    if scheme.startswith("FSDP2"):
        reshard = scheme == "FSDP2"
        # Resharded after forward, a layer is gathered again for its backward; otherwise it stays
        # gathered from its forward to its backward, every layer at once at the turn.
        gathered, all_gathers = (layer, 2 * k * P) if reshard else (P, k * P)
        # Without sync a rank keeps the whole unsharded gradient until the window's last backward.
        gradients = P if no_sync else P / N + layer
        return Cost(P / N + gathered, gradients, s * P / N,
                    {"all_gather": all_gathers, "reduce_scatter": syncs * P}, N)
    zero3 = scheme == "dmuon Z3"
    # Z3: the owner's share, plus the other owners' part of the layer in use (and of the one
    # prefetched, in flight); Z2: every matrix, the whole window.
    others = (N - 1) / N * layer
    parameters = P / N + others if zero3 else P
    # no_sync: every rank accumulates its own gradient of every matrix; otherwise each reduce hands
    # a layer's gradients to their owners, and only the owner's reduced share stays.
    gradients = P + P / N if no_sync else P / N + layer
    return Cost(parameters, gradients, s * P / N,
                {"broadcast": (2 * k if zero3 else 1) * P, "reduce": syncs * P}, N, others if zero3 else 0.0)
