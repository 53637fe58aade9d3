"""CollectiveOrder: every rank must issue dmuon's collectives in the same order; this checks it.

A broadcast or a reduce pairs the n-th call of every rank. If one rank skips a layer
(a data-dependent branch, LayerDrop with a per-rank draw, an early exit), its n-th
broadcast is another layer's: with equal sizes the collective silently mixes the two
layers' data, with unequal sizes it hangs or aborts natively. So before each of its
collectives, and at the start of each forward of a layer with dedicated matrices
(where, resident in Z2, no collective of dmuon's would notice), each rank compares a
description of the event (kind, layer, owner, size) with the first description any
rank left for that event's number in the process group's store: one ``compare_set``
round trip (about 35 us between two processes on one 2-core CPU).

The first rank that differs raises, naming both events and both ranks, and leaves its
message in the store: a rank already waiting in that collective reads it when its wait
times out. (fully_shard's own all-gather for a layer runs before dmuon's hooks and is
not checked: a rank that skips a layer can time out in it, with FSDP2's message.)

Descriptions live in a ring of ``SLOTS`` keys per model; ranks can never be that many
collectives apart, since every collective waits for all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["CollectiveOrder"]

SLOTS = 1024


class CollectiveOrder:
    """Checks, through the store, that every rank's n-th dmuon collective is the same one."""

    def __init__(self, key: str, rank: int):
        self.store = dist.distributed_c10d._get_default_store()
        self.key = key  # shared by every rank, unique to one dedicate_params call
        self.rank = rank
        self.issued = 0

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
            diverged = self._divergence_report()
            if diverged is not None:
                raise RuntimeError(
                    f"{diverged} (this rank, {self.rank}, was waiting in its event #{event}, "
                    f"{description}, until the timeout)"
                ) from error
            raise

    def check(self, description: str) -> int:
        """Raise unless ``description`` is what the first rank to get here described as this event;
        return the event's number."""
        n = self.issued
        self.issued += 1
        slot = f"{self.key}/{n % SLOTS}"
        mine = f"{n}|{self.rank}|{description}"
        current = self.store.compare_set(slot, "", mine).decode()
        if not current.startswith(f"{n}|"):  # the slot still holds collective n - SLOTS: replace it
            current = self.store.compare_set(slot, current, mine).decode()
        _, first_rank, first = current.split("|", 2)
        if first != description:
            message = (
                f"dmuon: the ranks diverged at their event #{n}: rank {self.rank} is about to run {description}, "
                f"but rank {first_rank} ran {first}. Every rank must run the same layers with dedicated matrices, "
                "in the same order, in every forward and backward: a branch that skips or repeats a layer on some "
                "ranks pairs one layer's collective with another's. Run every layer on every rank (to skip one, "
                "mask its output instead), and, accumulating, the same number of micro-batches per optimizer step "
                "on every rank, all but the last inside no_sync"
            )
            self.store.compare_set(f"{self.key}/diverged", "", message)
            raise RuntimeError(message)
        return n

    def _divergence_report(self) -> str | None:
        """The first divergence message a rank left, if any."""
        key = f"{self.key}/diverged"
        return self.store.get(key).decode() if self.store.check([key]) else None
