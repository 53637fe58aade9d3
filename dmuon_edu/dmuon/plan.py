"""Who owns which matrix: greedy load balancing by Newton-Schulz cost.

Newton-Schulz on an (m, n) matrix costs about max(m, n) * min(m, n)^2 multiply-adds
per step (the products run in the smaller dimension), so that, not the number of
entries, is what the owners must share evenly. The plan is the classic greedy
"longest processing time first" rule: take the matrices from the most to the least
expensive and give each to the rank with the least work so far. Among equally loaded
ranks, prefer the one holding the fewest matrices of the same layer, so that one
layer's matrices are spread over different owners (their broadcasts and Newton-Schulz
work then run in parallel). The plan depends on names and shapes only: every rank
computes the same plan without communicating.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

__all__ = ["plan_owners", "ns_cost", "layer_of", "imbalance"]


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz cost of one matrix, max(m, n) * min(m, n)^2 (multiply-adds per step, up to a constant)."""
    m, n = shape
    return max(m, n) * min(m, n) ** 2


def layer_of(name: str) -> str:
    """The layer a parameter belongs to, from its name.

    The prefix up to the first numeric component ("layers.3.attn.q_proj.weight" ->
    "layers.3", the usual nn.ModuleList of blocks); a name without one belongs to
    its module ("proj.weight" -> "proj"; a parameter of the root module -> "").
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


def plan_owners(shapes: Mapping[str, Sequence[int]], world_size: int) -> dict[str, int]:
    """Owners for matrices ``{name: (m, n)}`` over ``world_size`` ranks (see the module docstring).

    Deterministic: the same input gives the same plan on every rank.

    Returns:
        ``{name: owner rank}``, listing the names in the order they were given.

    Raises:
        ValueError: ``world_size`` is not an int >= 1, or a shape is not 2-D.
    """
    _require_world_size(world_size)
    for name, shape in shapes.items():
        if len(shape) != 2:
            raise ValueError(f"{name} has shape {tuple(shape)}: only 2-D matrices have owners")

    load = [0] * world_size
    per_layer: dict[str, Counter] = defaultdict(Counter)
    owner: dict[str, int] = {}
    # sorted() is stable: matrices of equal cost keep the caller's order.
    for name in sorted(shapes, key=lambda name: -ns_cost(shapes[name])):
        layer = layer_of(name)
        rank = min(range(world_size), key=lambda r: (load[r], per_layer[layer][r], r))
        owner[name] = rank
        load[rank] += ns_cost(shapes[name])
        per_layer[layer][rank] += 1
    return {name: owner[name] for name in shapes}


def imbalance(owners: Mapping[str, int], shapes: Mapping[str, Sequence[int]], world_size: int) -> float:
    """How uneven a plan is: max over mean of the Newton-Schulz work per rank.

    Returns:
        A float >= 1.0; 1.0 is a perfect balance (and so is no work at all).

    Raises:
        ValueError: ``world_size`` is not an int >= 1, or an owner lies outside it.
    """
    _require_world_size(world_size)
    load = [0] * world_size
    for name, rank in owners.items():
        if not 0 <= rank < world_size:
            raise ValueError(f"{name} is owned by rank {rank}, outside 0..{world_size - 1}: pass the world size the plan was made for")
        load[rank] += ns_cost(shapes[name])
    return max(load) / (sum(load) / world_size) if sum(load) else 1.0


def _require_world_size(world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
