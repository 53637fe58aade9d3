"""CollectiveOrder: every rank must issue dmuon's collectives in the same order; this checks it.

A broadcast or a reduce pairs the n-th call of every rank. If one rank skips a layer
(a data-dependent branch, LayerDrop with a per-rank draw, an early exit), its n-th
broadcast is another layer's: with equal sizes the collective silently mixes the two
layers' data, with unequal sizes it hangs or aborts natively. So each rank describes
every *event* (each of dmuon's collectives, and the start of each forward of a layer
with dedicated matrices, where, resident in Z2, no collective of dmuon's would notice)
by its kind, layer, owner and size, and the ranks compare the descriptions. How, is the
``order_check`` of ``dmuon.Muon``:

- ``"strict"``: before each event, one store round trip (``compare_set``) compares its
  description with the first one any rank left for that event's number. The first rank
  that differs raises before the collective runs, naming both events and both ranks, and
  leaves its message in the store, where a rank already waiting in that collective reads
  it when its wait times out. Collectives issued together (a layer's broadcasts from
  its owners, the TP gathers of a step) are checked as one batch, in one round trip.
  Cost: one blocking round trip to the one store per event or batch, about 35 us
  between two processes on a 2-core CPU; events per step grow with layers x
  micro-batches, and every rank of the job queues at the same store
  (benchmarks/order_check.py measures it and models it for more ranks).
- ``"per_step"`` (the default): strict until the first ``step()`` has checked, which
  catches an order that differs from the start (a rank-dependent branch). From then on
  each rank keeps a running CRC-32 of its descriptions and a log of its last ``SLOTS``
  events, at no communication: ``step()`` compares the CRCs and counts of every rank in
  the all-reduce it makes anyway (its finite-gradient flag), and refuses the step on
  every rank before any update if they differ. A rank whose collective times out (a
  divergence that made the ranks wait in different collectives) publishes its log
  through the store and compares it with the others': the error names the first event
  where two ranks differ. On NCCL, a divergence whose collectives differ in size ends
  at NCCL's timeout; on gloo, which would abort natively, see below.
- ``"off"``: nothing is checked or recorded.

On gloo, "per_step" also makes sure, before every event after the first step, that no
rank issues a collective another rank does not: gloo aborts the whole process, natively,
when a collective's sizes differ between ranks (a rank evaluating on rank 0 only pairs
its forward's broadcast with its peer's backward one). Steps repeat: the ranks agreed on
the last step's events, so a rank whose next event (or batch) is the one at the same
place in the last step's list issues it at once, and only tells the store how far it got
(a one-way write: no reply awaited), before each of its collectives, and before each
forward it notes where collectives that are not dmuon's can follow (FSDP2's all-gathers,
tensor parallelism's: waiting in one, a rank could report nothing; the DDP backend's
forwards are reported by its next collective). A rank whose next event differs from the
list (an evaluation, an uneven last window, a new branch) *meets*: it leaves its
description in the store under that place, and waits until every rank has left one there
(they all took the same turn: it goes on) or one has reported a later place without
leaving one (that rank ran the listed event instead: it raises at once, naming both, and
leaves the message for the other, which reads it when its collective fails as this
process ends, or at the timeout). A refusal any rank left in the store ends the wait at
once; a rank that never reports (it stopped calling dmuon) is named at the collective
timeout. So the steady state costs one write per collective (and per forward, with FSDP2
or TP) and no wait; a step that differs from the last one, and the step after it, wait
once per event for the slowest rank (as does every event past the first
``STEP_EVENTS_KEPT`` of a step, the most a rank keeps to compare the next step with).
``benchmarks/order_check.py`` measures it. (Tried first, and dropped for their cost: an
all-reduce of the events' hashes before each collective, 7% of a Z3 step on 2 CPU ranks;
a first-writer ``compare_set`` per collective, as "strict" does, up to 2.9% of an HSDP
Z3 step on 4 ranks over 2 cores.) NCCL does not abort on such a mismatch (its watchdog
times the collective out), so there "per_step" stays as above.

With HSDP the replicate axis has an order of its own per shard index, and with tensor
parallelism each TP group one (tp.py), in the same mode; their events follow from the
shard axis's, so the step's comparison covers them.

(fully_shard's own collectives for a layer run before dmuon's hooks and are not
checked: a rank that skips a layer can time out in one of them, with FSDP2's message.)
Descriptions live in a ring of ``SLOTS`` keys per model; ranks can never be that many
collectives apart, since every collective waits for all of them.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import time
import zlib
from collections import deque
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = ["CollectiveOrder", "MODES", "SLOTS", "group_timeout", "compare_logs"]

SLOTS = 1024
MODES = ("strict", "per_step", "off")
# per_step on gloo: the events of a step kept to compare the next step with. A loop of forwards between two steps (an
# evaluation, or inference after training) can be any length; past this many events each one meets the others.
STEP_EVENTS_KEPT = 1 << 16
LOG_WAIT_S = 15.0  # how long a rank that timed out waits for the others' logs (they time out too, about then)


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """How long a collective on ``group`` waits: the timeout it was created with (init_process_group's or
    new_group's), which a wait in the store that stands in for one of its collectives takes too."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    return group._get_backend(device).options._timeout


class CollectiveOrder:
    """Checks that every rank's n-th dmuon event is the same one (see the module docstring).

    Args:
        key: a store key prefix shared by every rank that takes part, unique to one
            dedicate_params call.
        rank: this rank's global rank.
        ranks: the global ranks that share ``key``.
        group: the process group whose backend the events' collectives run on and whose
            timeout a wait in the store takes.
        report_notes: whether, on gloo after the first step, a rank reports how far it got at
            each :meth:`note` too: needed where collectives that are not checked here (FSDP2's,
            tensor parallelism's) can follow one, since a rank waiting in one of them could not
            report that it passed the note.
    """

    def __init__(self, key: str, rank: int, ranks: Sequence[int], group: dist.ProcessGroup,
                 report_notes: bool = True):
        self.store = dist.distributed_c10d._get_default_store()
        self.key, self.rank, self.ranks = key, rank, list(ranks)
        self.gloo = dist.get_backend(group) == "gloo"
        self.timeout = group_timeout(group)
        self.report_notes = report_notes
        self.mode = "per_step"
        self.strict_steps = 1  # per_step: steps checked strictly before the running CRC takes over
        self.steps = 0  # steps whose order was verified
        self.issued = 0  # events so far
        self.checked = 0  # batches of events checked through the store so far (strict)
        self.crc = 0  # running CRC-32 of every description so far
        self.log: deque[tuple[int, str]] = deque(maxlen=SLOTS)  # the last SLOTS events, for a diagnosis
        self.round_trips = 0  # store round trips made by the checks
        self.expected: list[str] = []  # per_step on gloo: the events of the last verified step, in order
        self.this_step: list[str] = []  # ... and those of this step so far (the first STEP_EVENTS_KEPT)
        self.step_events = 0  # events so far in this step
        self.meetings: list[str] = []  # store keys this rank wrote in meetings (deleted once every rank is past them)

    @property
    def strict(self) -> bool:
        return self.mode == "strict" or (self.mode == "per_step" and self.steps < self.strict_steps)

    @contextlib.contextmanager
    def collective(self, description: str) -> Iterator[None]:
        """Bracket one synchronous collective: check it is every rank's next one, explain its failure."""
        with self.waiting(self.check(description), description):
            yield

    @contextlib.contextmanager
    def waiting(self, event: int, description: str) -> Iterator[None]:
        """Bracket the wait for event ``event``: if it fails and the ranks diverged, say so."""
        try:
            yield
        except RuntimeError as error:
            diverged = self._divergence_report() if self.mode != "off" else None
            if diverged is None and self.mode != "off":
                # a rank behind may refuse its event while this one compares logs: its report comes first
                diverged = compare_logs(self) or self._divergence_report()
            if diverged is not None:
                raise RuntimeError(
                    f"{diverged} (this rank, {self.rank}, was waiting in its event #{event}, "
                    f"{description}, until the timeout)"
                ) from error
            raise

    def check(self, description: str) -> int:
        """Record ``description`` as this rank's next event and return its number; raise if it is not every
        rank's, as the mode can tell before the event's collective runs (module docstring)."""
        return self.check_all([description])[0]

    def check_all(self, descriptions: Sequence[str]) -> list[int]:
        """:meth:`check` for events issued together, as one batch; returns their event numbers."""
        return self._record(descriptions, collective=True)

    def note(self, description: str) -> None:
        """Record ``description``, an event that issues no collective (a layer's forward), as :meth:`check`
        does. On gloo after the first step, one like the last step's is reported only with ``report_notes``:
        otherwise the rank's next collective or meeting reports that it passed it."""
        self._record([description], collective=False)

    def _record(self, descriptions: Sequence[str], collective: bool) -> list[int]:
        first = self.issued
        events = list(range(first, first + len(descriptions)))
        self.issued += len(descriptions)
        if self.mode == "off" or not descriptions:
            return events
        for n, description in zip(events, descriptions):
            self.crc = zlib.crc32(description.encode(), self.crc)
            self.log.append((n, description))
        index = self.step_events  # the batch's place in this step: the same on every rank that agrees
        self.step_events += len(descriptions)
        if index < STEP_EVENTS_KEPT:
            self.this_step += descriptions
        if self.strict:
            self._first_writer(first, descriptions)
        elif self.gloo:
            if list(descriptions) == self.expected[index : index + len(descriptions)]:
                if collective or self.report_notes:  # as every rank did last step: only say how far it got
                    self._report(index + len(descriptions))
            else:
                self._meet(index, first, descriptions)
        return events

    def _first_writer(self, first: int, descriptions: Sequence[str]) -> None:
        """Strict: compare the batch with the first one any rank left in its slot, in one round trip."""
        batch = self.checked
        self.checked += 1
        slot = f"{self.key}/{batch % SLOTS}"
        mine = f"{batch}|{self.rank}|{json.dumps(list(descriptions))}"
        current = self.store.compare_set(slot, "", mine).decode()
        self.round_trips += 1
        if not current.startswith(f"{batch}|"):  # the slot still holds batch - SLOTS: replace it
            current = self.store.compare_set(slot, current, mine).decode()
            self.round_trips += 1
        _, first_rank, theirs = current.split("|", 2)
        self._compare(first, descriptions, json.loads(theirs), first_rank)

    def _meet(self, index: int, first: int, descriptions: Sequence[str]) -> None:
        """per_step on gloo, a batch unlike last step's at ``index``: wait until every rank has left the same batch
        there. A rank that reported a later place without leaving one ran last step's events there instead."""
        place = f"{self.key}/met/{self.steps}/{index}"
        # first how far it got (past events it noted without a report): a rank waiting at an earlier place then
        # knows this one passed it, where the two would otherwise wait for each other until the timeout
        self._report(index)
        self.store.set(f"{place}/{self.rank}", json.dumps(list(descriptions)))
        self.meetings.append(f"{place}/{self.rank}")
        _wait_for_the_others(self, place, index, first, descriptions)
        self._report(index + len(descriptions))

    def _report(self, passed: int) -> None:
        """Tell the store (one way, no reply awaited) that this rank is past the first ``passed`` events of this
        step, so a rank meeting at one of them knows this one ran the last step's event there."""
        self.store.set(f"{self.key}/at/{self.rank}", f"{self.steps} {passed}")

    def _get(self, key: str) -> bytes | None:
        """The value at ``key``, or None if there is none yet (the store's get would wait for it)."""
        self.round_trips += 1
        if not self.store.check([key]):
            return None
        self.round_trips += 1
        return self.store.get(key)

    def _compare(self, first: int, mine: Sequence[str], theirs: Sequence[str], their_rank) -> None:
        """Raise, naming the first event where ``mine`` and ``theirs`` differ, unless they are the same."""
        if list(mine) == list(theirs):
            return
        i = next(i for i, pair in enumerate(itertools.zip_longest(mine, theirs)) if pair[0] != pair[1])
        ended = "no further collective in this batch"
        self._refuse(_message(first + i, self.rank, mine[i] if i < len(mine) else ended,
                              their_rank, theirs[i] if i < len(theirs) else ended))

    def _refuse(self, message: str) -> None:
        self.store.compare_set(f"{self.key}/diverged", "", message)
        # for a rank already waiting in its collective that times out before reading the message above
        self.store.set(f"{self.key}/log/{self.rank}", json.dumps(list(self.log)))
        raise RuntimeError(message)

    def digest(self) -> tuple[int, int]:
        """(events so far, their running CRC-32): equal on every rank exactly when the descriptions were (up to
        CRC collisions, 2^-32 per comparison)."""
        return self.issued, self.crc

    def meetings_passed(self) -> None:
        """Every rank is past the meetings this rank has held so far (it returned from a collective of every rank,
        the step's all-reduce): their keys can go."""
        for key in self.meetings:
            self.store.delete_key(key)
        self.meetings.clear()

    def step_checked(self) -> None:
        """A step's digests agreed on every rank: its events, up to the end of its ``step()``, are what the next
        step is checked against."""
        self.steps += 1
        self.expected, self.this_step, self.step_events = self.this_step, [], 0

    def _divergence_report(self) -> str | None:
        """The first divergence message a rank left, if any."""
        report = self._get(f"{self.key}/diverged")
        return report.decode() if report is not None else None


def _wait_for_the_others(order: CollectiveOrder, place: str, index: int, first: int,
                         descriptions: Sequence[str]) -> None:
    """Until every other rank has left its batch at ``place`` (compared with this one) or reported that it ran
    last step's batch there; raise if a rank refused elsewhere, or at the collective timeout."""
    deadline = time.monotonic() + order.timeout.total_seconds()
    waiting, pause = [r for r in order.ranks if r != order.rank], 1e-4
    while True:
        for rank in list(waiting):
            # how far it got, read before its key here: a rank writes that one first
            report = order._get(f"{order.key}/at/{rank}")
            theirs = order._get(f"{place}/{rank}")
            if theirs is not None:
                order._compare(first, descriptions, json.loads(theirs), rank)
                waiting.remove(rank)
            elif report is not None and _passed(report, order.steps, index):
                order._compare(first, descriptions, order.expected[index : index + len(descriptions)], rank)
        if not waiting:
            return
        refused = order._divergence_report()
        if refused is not None:  # a rank refused elsewhere: it will not come here
            raise RuntimeError(f"{refused} (this rank, {order.rank}, was waiting for the others at its event "
                               f"#{first}, {descriptions[0]})")
        if time.monotonic() > deadline:
            order._refuse(f"dmuon: timed out waiting {order.timeout} (the collective timeout) for ranks {waiting} "
                          f"at this rank's event #{first}, {descriptions[0]}: their last report puts them before "
                          "it. A rank that stopped calling dmuon's collectives (an exception, an evaluation or "
                          "an early exit on some ranks only) leaves the others waiting")
        time.sleep(pause)
        pause = min(2 * pause, 5e-3)


def compare_logs(order: CollectiveOrder) -> str | None:
    """After a failed wait or a refused step: publish this rank's recent events in the store, read the other
    ranks' (each waited for up to LOG_WAIT_S in all), and describe the first event where two ranks differ; None if
    every log that came agrees."""
    order.store.set(f"{order.key}/log/{order.rank}", json.dumps(list(order.log)))
    order.round_trips += 1
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=LOG_WAIT_S)
    mine, silent = dict(order.log), []
    first = None  # (event, other rank, its description)
    for rank in order.ranks:
        if rank == order.rank:
            continue
        key = f"{order.key}/log/{rank}"
        try:
            order.store.wait([key], max(datetime.timedelta(milliseconds=1), deadline - datetime.datetime.now()))
        except RuntimeError:  # DistStoreError: not there in time
            silent.append(rank)
            continue
        theirs = dict(json.loads(order.store.get(key)))
        for n in sorted(set(mine) | set(theirs)):
            if mine.get(n) != theirs.get(n):
                if first is None or n < first[0]:
                    first = (n, rank, theirs.get(n, "nothing (it had not got there)"))
                break
    if first is None:
        return None
    n, rank, theirs = first
    report = _message(n, order.rank, mine.get(n, "nothing (it had not got there)"), rank, theirs)
    if silent:
        report += f". Ranks {silent} sent no log within {LOG_WAIT_S:.0f} s (they are not waiting in dmuon)"
    return report


def _passed(report: bytes, steps: int, index: int) -> bool:
    """Whether a rank's report of how far it got ("steps next_index") is past event ``index`` of step ``steps``."""
    their_steps, their_next = map(int, report.split())
    return (their_steps, their_next) > (steps, index)


def _message(n: int, rank, description: str, other_rank, other: str) -> str:
    return (
        f"dmuon: the ranks diverged at their event #{n}: rank {rank} is about to run {description}, "
        f"but rank {other_rank} ran {other}. Every rank must run the same layers with dedicated matrices, "
        "in the same order, in every forward and backward: a branch that skips or repeats a layer on some "
        "ranks (LayerDrop, an early exit, an evaluation under `if rank == 0:`) pairs one layer's collective "
        "with another's. Run every layer on every rank (to skip one, mask its output instead; evaluate on "
        "every rank), and, accumulating, the same number of micro-batches per optimizer step on every rank, "
        "all but the last inside no_sync"
    )
