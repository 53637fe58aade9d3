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
  it when its wait times out. Cost: one blocking round trip to the one store per event,
  about 35 us between two processes on a 2-core CPU; events per step grow with layers x
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

On gloo, "per_step" also checks each event that runs a collective through the store, as
"strict" does, after the first step too. gloo aborts the whole process, natively, when a
collective's sizes differ between ranks (a rank evaluating on rank 0 only pairs its
forward's broadcast with its peer's backward one). With the store's first-writer check a
rank never issues a collective that differs from the one a peer already described for
that number: the second rank to get there raises at once, before its collective, and
leaves the message in the store; the first, waiting in its own collective, raises with
that message when the second one's process ends (its connection closes) or at the
collective timeout. One round trip per collective, no wait for the other ranks:
``benchmarks/order_check.py`` measures it. (An all-reduce of the events' hashes before
each collective, tried first, made the ranks wait for each other at every collective,
at gloo's latency each: 7% of a Z3 step on 2 CPU ranks.) NCCL does not abort on such a
mismatch (its watchdog times the collective out), so there "per_step" stays as above.

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
import json
import zlib
from collections import deque
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = ["CollectiveOrder", "MODES", "SLOTS", "group_timeout"]

SLOTS = 1024
MODES = ("strict", "per_step", "off")
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
    """

    def __init__(self, key: str, rank: int, ranks: Sequence[int]):
        self.store = dist.distributed_c10d._get_default_store()
        self.key, self.rank, self.ranks = key, rank, list(ranks)
        self.mode = "per_step"
        self.strict_steps = 1  # per_step: steps checked strictly before the running CRC takes over
        self.steps = 0  # steps whose order was verified
        self.issued = 0  # events so far
        self.crc = 0  # running CRC-32 of every description so far
        self.log: deque[tuple[int, str]] = deque(maxlen=SLOTS)  # the last SLOTS events, for a diagnosis
        self.round_trips = 0  # store round trips made by the checks (what "strict" costs)

    @property
    def strict(self) -> bool:
        return self.mode == "strict" or (self.mode == "per_step" and self.steps < self.strict_steps)

    @contextlib.contextmanager
    def collective(self, description: str, group: dist.ProcessGroup | None) -> Iterator[None]:
        """Bracket one synchronous collective over ``group`` (None: the default group): check it is every rank's
        next one, explain its failure."""
        with self.waiting(self.check(description, group or dist.group.WORLD), description):
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
                diverged = self.compare_logs() or self._divergence_report()
            if diverged is not None:
                raise RuntimeError(
                    f"{diverged} (this rank, {self.rank}, was waiting in its event #{event}, "
                    f"{description}, until the timeout)"
                ) from error
            raise

    def check(self, description: str, group: dist.ProcessGroup | None) -> int:
        """Record ``description`` as this rank's next event and return its number; in strict mode, and on gloo
        before a collective, raise unless it is what the first rank to get here described as this event.
        ``group``: the process group of the collective the event is about to run (None: an event without one)."""
        n = self.issued
        self.issued += 1
        if self.mode == "off":
            return n
        self.crc = zlib.crc32(description.encode(), self.crc)
        self.log.append((n, description))
        if not (self.strict or group is not None and dist.get_backend(group) == "gloo"):
            return n
        slot = f"{self.key}/{n % SLOTS}"
        mine = f"{n}|{self.rank}|{description}"
        current = self.store.compare_set(slot, "", mine).decode()
        self.round_trips += 1
        if not current.startswith(f"{n}|"):  # the slot still holds collective n - SLOTS: replace it
            current = self.store.compare_set(slot, current, mine).decode()
            self.round_trips += 1
        _, first_rank, first = current.split("|", 2)
        if first != description:
            message = _message(n, self.rank, description, first_rank, first)
            self.store.compare_set(f"{self.key}/diverged", "", message)
            # for a rank already waiting in its collective that times out before reading the message above
            self.store.set(f"{self.key}/log/{self.rank}", json.dumps(list(self.log)))
            raise RuntimeError(message)
        return n

    def digest(self) -> tuple[int, int]:
        """(events so far, their running CRC-32): equal on every rank exactly when the descriptions were (up to
        CRC collisions, 2^-32 per comparison)."""
        return self.issued, self.crc

    def step_checked(self) -> None:
        """A step's digests agreed on every rank."""
        self.steps += 1

    def compare_logs(self) -> str | None:
        """Publish this rank's recent events in the store, read the other ranks' (each waited for up to LOG_WAIT_S
        in all), and describe the first event where two ranks differ; None if every log that came agrees."""
        self.store.set(f"{self.key}/log/{self.rank}", json.dumps(list(self.log)))
        self.round_trips += 1
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=LOG_WAIT_S)
        mine, silent = dict(self.log), []
        first = None  # (event, other rank, its description)
        for rank in self.ranks:
            if rank == self.rank:
                continue
            key = f"{self.key}/log/{rank}"
            try:
                self.store.wait([key], max(datetime.timedelta(milliseconds=1), deadline - datetime.datetime.now()))
            except RuntimeError:  # DistStoreError: not there in time
                silent.append(rank)
                continue
            theirs = dict(json.loads(self.store.get(key)))
            for n in sorted(set(mine) | set(theirs)):
                if mine.get(n) != theirs.get(n):
                    if first is None or n < first[0]:
                        first = (n, rank, theirs.get(n, "nothing (it had not got there)"))
                    break
        if first is None:
            return None
        n, rank, theirs = first
        report = _message(n, self.rank, mine.get(n, "nothing (it had not got there)"), rank, theirs)
        if silent:
            report += f". Ranks {silent} sent no log within {LOG_WAIT_S:.0f} s (they are not waiting in dmuon)"
        return report

    def _divergence_report(self) -> str | None:
        """The first divergence message a rank left, if any."""
        key = f"{self.key}/diverged"
        return self.store.get(key).decode() if self.store.check([key]) else None


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
