"""The residency schedule: at each hook event, which units to broadcast, land and release.

A *unit* is the dedicated matrices one layer uses (dedicate.py). Whether a unit's
matrices are on a rank that does not own them is decided here, as plain data, and
carried out by the hooks (dedicate.py's executor), which look up their event and run its
actions in order:

- ``issue u``: start unit u's broadcasts (nothing if u is resident already; under the
  DDP backend, which holds every matrix, a cast to the compute dtype);
- ``land u``: wait for them and point the parameters at the received values;
- ``release u``: drop u's copies (those no other resident unit uses);
- ``release_all``: every unit's;
- ``watch_backward u`` / ``watch_backward_end u``: have the hooks report when u's
  backward starts (a hook on its outputs' gradients) and ends (a hook on its inputs').

The events, per unit: ``forward`` (a forward starts, outside backward), ``recompute``
(activation checkpointing runs it again inside backward), ``forward_end``, ``backward``,
``backward_end``; and, once, ``end_of_backward`` and ``step``.

Z3 (``reshard_after_forward=True``) holds a unit only while it runs: released after its
forward and broadcast again for its backward, 2 broadcasts per micro-batch. Z2 holds it
from its first forward to the step, 1 broadcast per optimizer step. Each broadcast is
issued ``prefetch_depth`` units ahead, in forward and in backward order, so it travels
while the layers before it compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Action", "Schedule", "UNIT_EVENTS", "GLOBAL_EVENTS"]

UNIT_EVENTS = ("forward", "recompute", "forward_end", "backward", "backward_end")
GLOBAL_EVENTS = ("end_of_backward", "step")


@dataclass(frozen=True)
class Action:
    verb: str  # "issue", "land", "release", "release_all", "watch_backward", "watch_backward_end"
    unit: int | None = None

    def __repr__(self) -> str:
        return self.verb if self.unit is None else f"{self.verb} {self.unit}"


@dataclass(frozen=True)
class Schedule:
    """The residency actions of every event, for ``units`` units in model order.

    ``table[(event, unit)]`` (``unit`` None for the global events) lists the actions, in
    the order the hooks run them.
    """

    units: int
    reshard_after_forward: bool
    prefetch_depth: int = 1
    table: dict[tuple[str, int | None], tuple[Action, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "table", self._build())  # frozen: built once, here

    def actions(self, event: str, unit: int | None = None) -> tuple[Action, ...]:
        return self.table[(event, unit)]

    def _build(self) -> dict[tuple[str, int | None], tuple[Action, ...]]:
        zero3 = self.reshard_after_forward
        table = {}
        for u in range(self.units):
            ahead = [Action("issue", v) for v in range(u + 1, min(u + 1 + self.prefetch_depth, self.units))]
            behind = [Action("issue", v) for v in range(u - 1, max(u - 1 - self.prefetch_depth, -1), -1)]
            table["forward", u] = (Action("issue", u), *ahead, *[Action("watch_backward_end", u)] * zero3,
                                   Action("land", u))
            # inside backward the unit's own backward comes next: hold what it needs, prefetch nothing
            table["recompute", u] = (Action("issue", u), Action("land", u))
            table["forward_end", u] = (Action("release", u), Action("watch_backward", u)) if zero3 else ()
            table["backward", u] = (Action("issue", u), *behind, Action("land", u)) if zero3 else ()
            table["backward_end", u] = (Action("release", u),) if zero3 else ()
        # Z3: units whose inputs needed no gradient (the first layer's), and prefetched units whose backward
        # did not come, are released at the end of the backward; every copy goes before the step.
        table["end_of_backward", None] = (Action("release_all"),) if zero3 else ()
        table["step", None] = (Action("release_all"),)
        return table
