"""dmuon's schedule: at each hook event, which units to broadcast, land and release, and what to reduce.

A *unit* is the dedicated matrices one layer uses (residency.py). Whether a unit's
matrices are on a rank that does not own them, and what is reduced when, is decided here,
as plain data. The hooks (residency.py, gradients.py) raise the events, and the executor
(``DMuonState.run``, dedicate.py) looks each up and runs its actions in order:

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

Gradients (gradients.py carries them out): a matrix's gradient of a backward raises
``gradient`` (``gradient_in_no_sync`` inside no_sync), and its bucket (the matrices of one
unit with one owner, replica and dtype) ``bucket_full`` when it is complete:

- ``keep``: add the gradient into the matrix's ``accumulated_grad``, send nothing;
- ``merge_into_bucket``: add what was kept, and put the sum in the matrix's bucket;
- ``reduce``: start the full bucket's reduce (AVG) to its owner, in one packed buffer;
- ``reduce_partial``, at the end of a backward: the same for every bucket that holds a
  gradient (a matrix that got none leaves its bucket partial), in model order;
- ``wait_reduces``: wait for this backward's reduces; the owner adds what it received into
  the matrix's ``reduced_grad`` (HSDP: holds it for the next action);
- ``reduce_across_replicas`` (HSDP): the held averages on to the replica that steps them.

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
GLOBAL_EVENTS = ("end_of_backward", "step", "gradient", "gradient_in_no_sync", "bucket_full")


@dataclass(frozen=True)
class Action:
    verb: str  # "issue", "land", "release", "release_all", "watch_backward", "watch_backward_end", or a gradient's
    unit: int | None = None

    def __repr__(self) -> str:
        return self.verb if self.unit is None else f"{self.verb} {self.unit}"


@dataclass(frozen=True)
class Schedule:
    """The actions of every event, residency's and the gradients', for ``units`` units in model order.

    ``table[(event, unit)]`` (``unit`` None for the global events) lists the actions, in
    the order the hooks run them.
    """

    units: int
    reshard_after_forward: bool
    prefetch_depth: int = 1
    replicas: int = 1  # HSDP's: the averages go on across the replicas
    table: dict[tuple[str, int | None], tuple[Action, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "table", self._build())  # frozen: built once, here

    def actions(self, event: str, unit: int | None = None) -> tuple[Action, ...]:
        return self.table[(event, unit)]

    def broadcasts(self, micro_batches: int) -> dict[str, int]:
        """How often each unit is broadcast in one optimizer step of ``micro_batches`` forwards and backwards,
        ``{"forward": ..., "backward": ...}``: the table walked in the order the hooks raise its events (every
        unit's inputs but the first's need a gradient), an issue sending only for a unit not resident. The cost
        model (step_time.py) counts dmuon's broadcasts with it."""
        resident, sent = set(), {"forward": [0] * self.units, "backward": [0] * self.units}

        def run(event, unit, phase):
            for action in self.actions(event, unit):
                if action.verb == "issue" and action.unit not in resident:
                    resident.add(action.unit)
                    sent[phase][action.unit] += 1
                elif action.verb == "release":
                    resident.discard(action.unit)
                elif action.verb == "release_all":
                    resident.clear()

        for _ in range(micro_batches):
            watched = set()
            for u in range(self.units):
                run("forward", u, "forward")
                run("forward_end", u, "forward")
                watched |= {(a.verb, u) for a in self.actions("forward", u) + self.actions("forward_end", u)}
            for u in reversed(range(self.units)):
                if ("watch_backward", u) in watched:
                    run("backward", u, "backward")
                if ("watch_backward_end", u) in watched and u > 0:
                    run("backward_end", u, "backward")
            run("end_of_backward", None, "backward")
        run("step", None, "backward")
        if any(len(set(counts)) > 1 for counts in sent.values()):
            raise ValueError(f"this schedule broadcasts its units unevenly ({sent}): count them one by one")
        return {phase: counts[0] if counts else 0 for phase, counts in sent.items()}

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
        table["gradient_in_no_sync", None] = (Action("keep"),)
        table["gradient", None] = (Action("merge_into_bucket"),)
        table["bucket_full", None] = (Action("reduce"),)
        # Z3: units whose inputs needed no gradient (the first layer's), and prefetched units whose backward
        # did not come, are released at the end of the backward; every copy goes before the step.
        table["end_of_backward", None] = ((Action("release_all"),) if zero3 else ()) + (
            Action("reduce_partial"), Action("wait_reduces"),
            *[Action("reduce_across_replicas")] * (self.replicas > 1))
        table["step", None] = (Action("release_all"),)
        return table
