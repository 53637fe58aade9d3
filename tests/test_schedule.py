"""dmuon's schedule (schedule.py), tested in one process, as data: residency, then gradients.

A small model of the hooks runs windows of micro-batches through a schedule: the events
autograd would raise (a unit's backward events only where a watch action asked for them,
as a hook on its tensors does), and a model of the executor's residency (``issue`` starts a
broadcast unless the unit is resident; ``land`` completes it; ``release`` drops it). It
checks what the schedule promises: every unit is landed when it computes, forward or
backward; the broadcasts per step are the cost model's (Z3 2N per unit, Z2 one); Z3 holds a
unit only while it and the ``prefetch_depth`` units next to it run, Z2 from its first forward
to the step; nothing is held after the step. Each mutation of the schedule (a broadcast moved
to another event, a release or a watch dropped) fails one of them.

The gradient rows run through a model of the gradient actions over windows of micro-batches
(with no_sync on all but the last, or without it; one replica, or HSDP's two): every used
matrix's owner receives each micro-batch's gradient exactly once; a complete bucket is
reduced at once, not at the backward's end; inside no_sync every rank keeps every matrix's
gradient and sends nothing; one reduce per bucket and window with no_sync, one per
micro-batch without. Each wrong gradient schedule fails one of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from dmuon_edu import dmuon
from dmuon_edu.dmuon.schedule import GLOBAL_EVENTS, UNIT_EVENTS, Action, Schedule

UNITS = 4


@dataclasses.dataclass
class Run:
    """What a window's simulated hooks did, and what broke a promise (``faults``)."""

    schedule: Schedule
    checkpointed: str | None = None  # activation checkpointing: "non-reentrant" (checkpoint_wrapper's) or "reentrant"
    resident: set = dataclasses.field(default_factory=set)
    in_flight: set = dataclasses.field(default_factory=set)
    watched: set = dataclasses.field(default_factory=set)  # (verb, unit) hooks registered this micro-batch
    sends: dict = dataclasses.field(default_factory=lambda: {"forward": 0, "backward": 0})
    first_forward: set = dataclasses.field(default_factory=set)
    recomputed: set = dataclasses.field(default_factory=set)  # units rerun in this backward
    faults: list = dataclasses.field(default_factory=list)
    phase: str = "forward"

    def event(self, name, unit=None):
        for action in self.schedule.actions(name, unit):
            if action.verb == "issue" and action.unit not in self.resident:
                self.resident.add(action.unit)
                self.in_flight.add(action.unit)
                self.sends[self.phase] += 1
            elif action.verb == "land":
                self.in_flight.discard(action.unit)
            elif action.verb == "release":
                self.in_flight.discard(action.unit)
                self.resident.discard(action.unit)
            elif action.verb == "release_all":
                self.resident.clear()
                self.in_flight.clear()
            elif action.verb.startswith("watch") and not (self.checkpointed == "reentrant" and self.phase == "forward"):
                self.watched.add((action.verb, action.unit))  # (a reentrant checkpoint's forward runs without grad)

    def compute(self, unit, direction):
        """A unit's forward (direction +1) or backward (-1) runs now: it must be landed, and Z3 must hold no
        more than it and its prefetched neighbours."""
        if unit not in self.resident or unit in self.in_flight:
            self.faults.append(f"unit {unit} computed its {self.phase} without its matrices")
        depth = self.schedule.prefetch_depth
        # A unit rerun by a reentrant checkpoint has no hook to report its backward's end: held to the backward's end
        near = {unit + direction * i for i in range(depth + 1)} | self.recomputed
        if self.schedule.reshard_after_forward and not self.resident <= near:
            self.faults.append(f"Z3 held {sorted(self.resident - near)} while unit {unit} ran its {self.phase}")
        if not self.schedule.reshard_after_forward and not self.first_forward <= self.resident:
            self.faults.append(f"Z2 dropped {sorted(self.first_forward - self.resident)} before the step")

    def micro_batch(self):
        self.watched.clear()
        self.phase = "forward"
        for u in range(UNITS):
            self.event("forward", u)
            self.compute(u, +1)
            self.first_forward.add(u)
            self.event("forward_end", u)
        self.phase = "backward"
        for u in reversed(range(UNITS)):
            if ("watch_backward", u) in self.watched:  # a hook on the unit's outputs' gradients
                self.event("backward", u)
            if self.checkpointed:  # the unit's forward runs again, inside the backward
                self.event("recompute", u)
                if self.checkpointed == "reentrant":
                    self.recomputed.add(u)
            self.compute(u, -1)
            if ("watch_backward_end", u) in self.watched and u > 0:  # the first unit's inputs need no gradient
                self.event("backward_end", u)
        self.event("end_of_backward")
        self.recomputed.clear()
        if self.schedule.reshard_after_forward and self.resident:
            self.faults.append(f"Z3 held {sorted(self.resident)} after the backward")

    def step(self):
        self.event("step")
        if self.resident:
            self.faults.append(f"{sorted(self.resident)} still held after the step")
        self.first_forward.clear()


def run_window(schedule: Schedule, micro_batches: int, checkpointed: str | None = None) -> Run:
    run = Run(schedule, checkpointed)
    for _ in range(micro_batches):
        run.micro_batch()
    run.step()
    return run


def cost_model_passes(zero3: bool, micro_batches: int) -> dict[str, int]:
    """Broadcasts of every unit per step, forward and backward, as step_time's cost model plans them: its
    broadcast bytes in each pass over P_M, times the units."""
    workload = dmuon.transformer(vocab=32, d_model=8, n_layer=UNITS, ffn=16, sequence=4, tokens=8)
    layout = dmuon.Layout("fsdp2", "dmuon", reshard_after_forward=zero3)
    planned = [c for c in dmuon.planned_collectives(workload, layout, world_size=2, micro_batches=micro_batches)
               if c.what == "dmuon broadcasts"]
    p_m = sum(math.prod(workload.shapes[name]) * 4 for name in workload.dedicated)
    return {when: sum(c.bytes for c in planned if c.when == when) * UNITS // p_m for when in ("forward", "backward")}


@pytest.mark.parametrize("zero3", [True, False], ids=["Z3", "Z2"])
@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("checkpointed", [None, "non-reentrant", "reentrant"])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_the_schedule_keeps_its_promises_and_sends_what_the_cost_model_plans(zero3, depth, checkpointed, micro_batches):
    run = run_window(Schedule(UNITS, zero3, depth), micro_batches, checkpointed)
    assert run.faults == []
    # The closed forms pin the counts; the cost model (which walks the same table) must agree with them too.
    assert run.sends == ({"forward": micro_batches * UNITS, "backward": micro_batches * UNITS} if zero3 else
                         {"forward": UNITS, "backward": 0})
    assert run.sends == cost_model_passes(zero3, micro_batches)


def test_the_cost_model_counts_two_broadcasts_per_micro_batch_in_z3_and_one_per_step_in_z2():
    # The cost model counts dmuon's broadcasts by walking the schedule (Schedule.broadcasts): written out, its
    # passes over P_M per step, whatever the depth and the number of units.
    assert cost_model_passes(True, 4) == {"forward": 4 * UNITS, "backward": 4 * UNITS}
    assert cost_model_passes(False, 4) == {"forward": UNITS, "backward": 0}
    for units, depth in itertools.product((1, 2, 5), (0, 1, 3)):
        assert Schedule(units, True, depth).broadcasts(3) == {"forward": 3, "backward": 3}
        assert Schedule(units, False, depth).broadcasts(3) == {"forward": 1, "backward": 0}


def test_prefetch_issues_a_units_broadcast_while_the_one_before_it_runs():
    forward = Schedule(UNITS, True, prefetch_depth=1).actions("forward", 1)
    assert forward == (Action("issue", 1), Action("issue", 2), Action("watch_backward_end", 1), Action("land", 1))
    backward = Schedule(UNITS, True, prefetch_depth=2).actions("backward", 2)
    assert backward == (Action("issue", 2), Action("issue", 1), Action("issue", 0), Action("land", 2))
    assert Schedule(UNITS, True, prefetch_depth=0).actions("forward", 3) == (
        Action("issue", 3), Action("watch_backward_end", 3), Action("land", 3))


def _mutated(schedule: Schedule, event: str, unit: int | None, change) -> Schedule:
    table = dict(schedule.table)
    table[event, unit] = tuple(change(list(table[event, unit])))
    mutant = dataclasses.replace(schedule)
    object.__setattr__(mutant, "table", table)
    return mutant


def _without(verb):
    return lambda actions: [a for a in actions if a.verb != verb]


MUTANTS = {
    # Z3's backward broadcast issued at the backward's end instead of its start
    "backward broadcast moved to backward_end": (True, lambda s: _mutated(
        _mutated(s, "backward", 2, _without("issue")), "backward_end", 2, lambda a: [Action("issue", 2), *a])),
    "forward broadcast moved to forward_end": (True, lambda s: _mutated(
        _mutated(s, "forward", 1, lambda a: [x for x in a if x != Action("issue", 1)]), "forward_end", 1,
        lambda a: [Action("issue", 1), *a])),
    "Z3's release after the forward dropped": (True, lambda s: _mutated(s, "forward_end", 1, _without("release"))),
    "Z3's release after the backward dropped": (True, lambda s: _mutated(s, "backward_end", 2, _without("release"))),
    "the step's release dropped": (False, lambda s: _mutated(s, "step", None, _without("release_all"))),
    "Z2 released after a forward": (False, lambda s: _mutated(s, "forward_end", 0, lambda a: [Action("release", 0)])),
    "no watch of the backward": (True, lambda s: _mutated(s, "forward_end", 3, _without("watch_backward"))),
    "the land before a forward dropped": (True, lambda s: _mutated(s, "forward", 2, _without("land"))),
    "the recompute's broadcast dropped": (True, lambda s: _mutated(s, "recompute", 1, _without("issue"))),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_every_wrong_schedule_breaks_a_promise(name):
    zero3, mutate = MUTANTS[name]
    wrong = [run_window(mutate(Schedule(UNITS, zero3, depth)), 2, checkpointed)
             for depth in (0, 1) for checkpointed in (None, "non-reentrant", "reentrant")]
    # a mutation may go unnoticed in one setting (a prefetch may cover a moved broadcast), never in all of them
    assert any(run.faults or run.sends != cost_model_passes(zero3, 2) for run in wrong), name


def test_every_event_of_every_unit_has_a_row_and_nothing_else_does():
    schedule = Schedule(3, reshard_after_forward=True)
    assert set(schedule.table) == {(e, u) for e in UNIT_EVENTS for u in range(3)} | {(e, None) for e in GLOBAL_EVENTS}


def test_a_model_without_dedicated_matrices_is_planned_without_dmuon_broadcasts():
    # A workload whose predicate selects nothing: the cost model plans FSDP2's collectives and the step's
    # all-reduce, and no broadcast (a schedule of no units sends nothing).
    workload = dataclasses.replace(dmuon.transformer(vocab=32, d_model=8, n_layer=2, ffn=16, sequence=4, tokens=8),
                                   dedicated=frozenset())
    planned = dmuon.planned_collectives(workload, dmuon.Layout("fsdp2", "dmuon"), world_size=2, micro_batches=2)
    assert not [c for c in planned if c.what == "dmuon broadcasts"] and any(c.what == "FSDP2 gathers" for c in planned)
    assert Schedule(0, True).broadcasts(2) == {"forward": 0, "backward": 0}


def test_the_table_is_plain_data_a_reader_can_print():
    z2 = Schedule(2, reshard_after_forward=False, prefetch_depth=1)
    assert {key: list(map(repr, actions)) for key, actions in z2.table.items() if actions} == {
        ("forward", 0): ["issue 0", "issue 1", "land 0"], ("forward", 1): ["issue 1", "land 1"],
        ("recompute", 0): ["issue 0", "land 0"], ("recompute", 1): ["issue 1", "land 1"],
        ("step", None): ["release_all"],
        ("gradient_in_no_sync", None): ["keep"], ("gradient", None): ["merge_into_bucket"],
        ("bucket_full", None): ["reduce"], ("end_of_backward", None): ["reduce_partial", "wait_reduces"],
    }


# ---------------------------------------------------------------------------- gradients
# Each unit's two matrices form its bucket; matrix (0, 1) gets no gradient (a frozen or unused matrix), which
# leaves the first unit's bucket partial until the backward's end.
MATRICES = [(u, i) for u in range(UNITS) for i in range(2)]
UNUSED = (0, 1)


RESIDENCY_VERBS = {"issue", "land", "release", "release_all", "watch_backward", "watch_backward_end"}


@dataclasses.dataclass
class GradientRun:
    """A model of the gradient actions over a window: which micro-batches each matrix keeps, each bucket holds,
    each reduce carries, and its owner receives."""

    schedule: Schedule
    kept: dict = dataclasses.field(default_factory=dict)  # matrix -> micro-batches in accumulated_grad
    ready: dict = dataclasses.field(default_factory=dict)  # bucket (unit) -> {matrix: micro-batches}
    in_flight: list = dataclasses.field(default_factory=list)
    held: list = dataclasses.field(default_factory=list)
    received: dict = dataclasses.field(default_factory=lambda: {m: [] for m in MATRICES})
    reduces: int = 0
    faults: list = dataclasses.field(default_factory=list)

    def event(self, name, subject=None):
        for action in self.schedule.actions(name):
            if action.verb not in RESIDENCY_VERBS:  # modelled by Run above; a verb unknown to both fails here
                getattr(self, action.verb)(subject)

    def keep(self, subject):
        matrix, micro_batch = subject
        self.kept.setdefault(matrix, set()).add(micro_batch)

    def merge_into_bucket(self, subject):
        matrix, micro_batch = subject
        bucket = self.ready.setdefault(matrix[0], {})
        bucket[matrix] = self.kept.pop(matrix, set()) | {micro_batch}
        if len(bucket) == 2:
            self.event("bucket_full", matrix[0])

    def reduce(self, unit):
        self.in_flight.append(self.ready.pop(unit))
        self.reduces += 1

    def reduce_partial(self, _):
        for unit in sorted(self.ready):
            self.reduce(unit)

    def wait_reduces(self, _):
        if self.schedule.replicas > 1:  # HSDP: the holder's average goes on across the replicas
            self.held += self.in_flight
        else:
            self.in_flight_landed(self.in_flight)
        self.in_flight = []

    def in_flight_landed(self, sent):
        for bucket in sent:
            for matrix, micro_batches in bucket.items():
                self.received[matrix] += sorted(micro_batches)

    def reduce_across_replicas(self, _):
        self.in_flight_landed(self.held)
        self.held = []


def run_gradients(schedule: Schedule, micro_batches: int, use_no_sync: bool) -> GradientRun:
    run = GradientRun(schedule)
    for micro_batch in range(micro_batches):
        inside = use_no_sync and micro_batch < micro_batches - 1
        for matrix in reversed(MATRICES):  # backward order
            if matrix != UNUSED:
                run.event("gradient_in_no_sync" if inside else "gradient", (matrix, micro_batch))
                full = [unit for unit, bucket in run.ready.items() if len(bucket) == 2]
                if full:
                    run.faults.append(f"bucket {full[0]} complete and not reduced: its reduce waits for nothing")
        run.event("end_of_backward")
        if inside and set(run.kept) != set(MATRICES) - {UNUSED}:
            run.faults.append(f"inside no_sync the rank keeps {sorted(run.kept)}, not every matrix's gradient")
    everything = list(range(micro_batches))
    for matrix in MATRICES:
        if matrix != UNUSED and run.received[matrix] != everything:
            run.faults.append(f"{matrix}'s owner received micro-batches {run.received[matrix]}, not {everything}")
    if run.kept:
        run.faults.append(f"{sorted(run.kept)} still kept after the window: never reduced")
    return run


@pytest.mark.parametrize("replicas", [1, 2], ids=["FSDP2", "HSDP"])
@pytest.mark.parametrize("zero3", [True, False], ids=["Z3", "Z2"])
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_every_gradient_reaches_its_owner_once_one_reduce_per_bucket_and_window_under_no_sync(replicas, zero3,
                                                                                            micro_batches):
    buckets = UNITS
    with_no_sync = run_gradients(Schedule(UNITS, zero3, replicas=replicas), micro_batches, use_no_sync=True)
    without = run_gradients(Schedule(UNITS, zero3, replicas=replicas), micro_batches, use_no_sync=False)
    assert with_no_sync.faults == [] and without.faults == []
    # no_sync: one reduce per bucket per window (P_M); without it, one per micro-batch (N P_M)
    assert (with_no_sync.reduces, without.reduces) == (buckets, micro_batches * buckets)


GRADIENT_MUTANTS = {
    "reduce inside no_sync": (1, lambda s: _mutated(s, "gradient_in_no_sync", None,
                                                   lambda _: [Action("merge_into_bucket")])),
    "kept gradients never merged": (1, lambda s: _mutated(s, "gradient", None, lambda _: [Action("keep")])),
    "a full bucket waits for the backward's end": (1, lambda s: _mutated(s, "bucket_full", None, lambda _: [])),
    "partial buckets never reduced": (1, lambda s: _mutated(s, "end_of_backward", None, _without("reduce_partial"))),
    "reduces never waited": (1, lambda s: _mutated(s, "end_of_backward", None, _without("wait_reduces"))),
    "HSDP's stage 2 dropped": (2, lambda s: _mutated(s, "end_of_backward", None,
                                                    _without("reduce_across_replicas"))),
}


@pytest.mark.parametrize("name", list(GRADIENT_MUTANTS))
def test_every_wrong_gradient_schedule_breaks_a_promise(name):
    replicas, mutate = GRADIENT_MUTANTS[name]
    runs = [run_gradients(mutate(Schedule(UNITS, True, replicas=replicas)), 3, use_no_sync)
            for use_no_sync in (True, False)]
    assert any(run.faults or run.reduces != (UNITS if use_no_sync else 3 * UNITS)
               for run, use_no_sync in zip(runs, (True, False))), name
