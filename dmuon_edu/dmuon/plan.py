"""Who owns which matrix: greedy load balancing by Newton-Schulz time, whole layers where they balance.

What the owners must share evenly is the time of their Newton-Schulz calls, not the
number of entries: the step waits for the slowest owner. The time model
(step_time.py) predicts a matrix's Newton-Schulz time as its flops, as
dmuon_edu.newton_schulz.ns_flops counts them for the steps it takes (4 m^2 n + 2 m^3 per
direct step with m <= n, Gram-space pairs for wide matrices), over one matmul rate: on
one kind of device the rate is common to every matrix, so balancing flops balances the
predicted time, and the plan does not depend on a calibration that differs from rank to
rank. (4096, 4096) costs 2.4x the flops of (65536, 1024), though both have the same
max(m, n) min(m, n)^2: the square matrix pays the m^3 terms and cannot take Gram-space pairs.
The rule is the classic greedy
"longest processing time first": take the items from the most to the least expensive
and give each to the rank with the least work so far.

Each (layer, owner) pair costs collectives, whatever its bytes: one broadcast per
forward (and per backward in Z3) and one reduce per window, each paying a collective's
fixed cost. So whole layers go to owners (largest first, each to the least loaded
rank) whenever that balances the work at least as well as placing matrix by matrix,
as it does when equal layers divide evenly over the ranks. Otherwise each matrix is
placed on its own, and among equally loaded ranks it goes to the one that already
holds most of its layer. The plan depends on names and shapes only: every rank
computes the same plan without communicating.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

from dmuon_edu.newton_schulz import ns_flops

__all__ = ["plan_owners", "layer_of", "imbalance"]


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
        TypeError: ``shapes`` is not a mapping of names to shapes.
        ValueError: ``world_size`` is not an int >= 1, or a shape is not two ints >= 0.
    """
    _require_world_size(world_size)
    _require_shapes(shapes)
    by_matrix = _matrix_by_matrix(shapes, world_size)
    by_layer = _whole_layers(shapes, world_size)
    if imbalance(by_layer, shapes, world_size) <= imbalance(by_matrix, shapes, world_size) * (1 + 1e-9):
        return {name: by_layer[name] for name in shapes}
    return {name: by_matrix[name] for name in shapes}


def _whole_layers(shapes: Mapping[str, Sequence[int]], world_size: int) -> dict[str, int]:
    """Each layer whole, from the most to the least expensive, to the least loaded rank."""
    layers: dict[str, list[str]] = defaultdict(list)
    for name in shapes:
        layers[layer_of(name)].append(name)
    cost = {layer: sum(ns_flops(shapes[name]) for name in names) for layer, names in layers.items()}
    load, owner = [0] * world_size, {}
    for layer in sorted(layers, key=lambda layer: -cost[layer]):  # stable: equal layers in model order
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner.update(dict.fromkeys(layers[layer], rank))
        load[rank] += cost[layer]
    return owner


def _matrix_by_matrix(shapes: Mapping[str, Sequence[int]], world_size: int) -> dict[str, int]:
    """Each matrix, from the most to the least expensive, to the least loaded rank; among equally loaded ranks, the
    one holding most matrices of its layer."""
    load, owner = [0] * world_size, {}
    held: dict[str, Counter] = defaultdict(Counter)
    # sorted() is stable: matrices of equal cost keep the caller's order.
    for name in sorted(shapes, key=lambda name: -ns_flops(shapes[name])):
        layer = layer_of(name)
        rank = min(range(world_size), key=lambda r: (load[r], -held[layer][r], r))
        owner[name] = rank
        load[rank] += ns_flops(shapes[name])
        held[layer][rank] += 1
    return owner


def imbalance(owners: Mapping[str, int], shapes: Mapping[str, Sequence[int]], world_size: int) -> float:
    """How uneven a plan is: max over mean of the predicted Newton-Schulz time per rank (its flops at one rate).

    Returns:
        A float >= 1.0; 1.0 is a perfect balance (and so is no work at all).

    Raises:
        TypeError: ``owners`` or ``shapes`` is not a mapping, or an owner is not an int.
        ValueError: ``world_size`` is not an int >= 1, an owner lies outside it, a matrix has
            no shape, or a shape is not two ints >= 0.
    """
    _require_world_size(world_size)
    _require_shapes(shapes)
    if not isinstance(owners, Mapping):
        raise TypeError(f"owners must be a dict {{name: rank}}, as plan_owners returns, got {type(owners).__name__}")
    load = [0] * world_size
    for name, rank in owners.items():
        if name not in shapes:
            raise ValueError(f"{name} has an owner but no shape: pass the shapes the plan was made from")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"the owner of {name} must be an int rank, got {rank!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"{name} is owned by rank {rank}, outside 0..{world_size - 1}: pass the world size the plan was made for")
        load[rank] += ns_flops(shapes[name])
    return max(load) / (sum(load) / world_size) if sum(load) else 1.0


def _require_shapes(shapes) -> None:
    if not isinstance(shapes, Mapping):
        raise TypeError(f"shapes must be a dict {{name: (m, n)}}, e.g. {{n: tuple(p.shape) for n, p in "
                        f"model.named_parameters()}}, got {type(shapes).__name__}")
    for name, shape in shapes.items():
        if not isinstance(name, str):
            raise TypeError(f"the names in shapes must be parameter names (strings), got {name!r}")
        if not isinstance(shape, Sequence) or isinstance(shape, str) or len(shape) != 2:
            shown = tuple(shape) if isinstance(shape, Sequence) and not isinstance(shape, str) else repr(shape)
            raise ValueError(f"{name} has shape {shown}: only 2-D matrices have owners, pass (m, n)")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"{name} has shape {tuple(shape)}: a shape is two ints >= 0, such as tuple(p.shape)")


def _require_world_size(world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
