"""Module 6d's models of communication time, behind its exercises and checks.

- :func:`link_timings`: what a link of latency ``alpha`` and ``seconds_per_byte`` gives over message
  sizes, with the noise a real machine adds (the alpha-beta fit's check);
- :func:`bucketed_exposed_seconds`: what a bucketed all-reduce leaves after the backward when it runs
  beside it, one call at a time, each bucket sent as soon as it is full;
- :class:`Ring`: W ranks in one process whose sends are counted (the ring all-reduce's check);
- :class:`SlowRankCall`: a call whose time is known on every rank (the timing function's check).

The timing script's measurements are drawn by :mod:`dmuon_edu.course.comm_figures`.

A collective of S counted bytes (count_comm's unit: the whole tensor) is modelled as
``alpha + seconds_per_byte * S``: ``alpha`` the fixed cost of a call, ``seconds_per_byte``
the bandwidth term, the wire factor of the collective included (module 6d derives it for the
ring all-reduce).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

__all__ = ["link_timings", "bucketed_exposed_seconds", "Ring", "SlowRankCall"]


def link_timings(sizes: list[int], alpha: float, seconds_per_byte: float, noise: float, seed: int) -> list[float]:
    """Seconds per call at each of ``sizes`` bytes: ``alpha + seconds_per_byte * size``, each times a factor drawn
    uniformly from [1 - noise, 1 + noise] (a median's scatter on a real machine)."""
    generator = torch.Generator().manual_seed(seed)
    factors = 1 + noise * (2 * torch.rand(len(sizes), generator=generator, dtype=torch.float64) - 1)
    return [(alpha + seconds_per_byte * size) * factor for size, factor in zip(sizes, factors.tolist())]


def bucketed_exposed_seconds(parameter_bytes: float, bucket_bytes: float, alpha: float, seconds_per_byte: float,
                             backward_seconds: float) -> float:
    """Seconds from the backward's end to the end of its last bucket's all-reduce.

    The backward produces ``parameter_bytes`` (P) of gradients at a steady rate over
    ``backward_seconds`` (T); every ``bucket_bytes`` (b; the last bucket takes what is left) one
    all-reduce of ``alpha + seconds_per_byte * bucket`` starts, as soon as its bucket is full and
    the previous call is done (one call at a time, beside the compute: a GPU's communication
    stream). The last call ends at the latest, over the buckets j, of bucket j's ready time plus
    every call from j on: bucket j is ready at j b T / P (the last at T), a straight line in j
    before the last bucket, so the latest is at the first bucket, the one before the last, or the last.
    """
    for name, value in (("parameter_bytes", parameter_bytes), ("bucket_bytes", bucket_bytes),
                        ("backward_seconds", backward_seconds)):
        if not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    P, b, T = parameter_bytes, min(bucket_bytes, parameter_bytes), backward_seconds
    n = math.ceil(P / b)
    full, last = alpha + seconds_per_byte * b, alpha + seconds_per_byte * (P - (n - 1) * b)
    ends = [T + last]  # from the last bucket alone
    for j in {1, n - 1} - {0}:  # from the first full bucket, and the one before the last
        ends.append(j * b * T / P + (n - j) * full + last)
    return max(ends) - T


class Ring:
    """``world_size`` ranks in one process: ``send(src, dst, tensor)`` hands ``dst`` a copy of ``tensor`` and
    counts the bytes each rank sent and to whom."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.sent_bytes = [0] * world_size
        self.destinations = [set() for _ in range(world_size)]

    def send(self, src: int, dst: int, tensor: torch.Tensor) -> torch.Tensor:
        for name, rank in (("src", src), ("dst", dst)):
            if not (isinstance(rank, int) and 0 <= rank < self.world_size):
                raise ValueError(f"{name} must be a rank from 0 to {self.world_size - 1}, got {rank!r}")
        if src == dst:
            raise ValueError(f"rank {src} sends to itself: a rank needs no message to read its own buffer")
        self.sent_bytes[src] += tensor.numel() * tensor.element_size()
        self.destinations[src].add(dst)
        return tensor.detach().clone()


class SlowRankCall:
    """A call of known seconds: ``fast`` on rank 0 and ``slow`` on the other ranks; the very first call
    ``first`` on every rank (a connection's set-up); and the ``hiccup_call``-th call on the last rank
    ``hiccup`` (another process took the core)."""

    def __init__(self, rank: int, world_size: int, fast: float = 0.004, slow: float = 0.012, first: float = 0.3,
                 hiccup: float = 0.08, hiccup_call: int = 4):
        self.rank, self.world_size = rank, world_size
        self.fast, self.slow, self.first, self.hiccup, self.hiccup_call = fast, slow, first, hiccup, hiccup_call
        self.took: list[float] = []  # each call's seconds, as timed here (time.sleep overshoots on a busy machine)

    @property
    def calls(self) -> int:
        return len(self.took)

    def __call__(self) -> None:
        call = self.calls + 1
        if call == 1:
            seconds = self.first
        elif call == self.hiccup_call and self.rank == self.world_size - 1:
            seconds = self.hiccup
        else:
            seconds = self.fast if self.rank == 0 else self.slow
        start = time.perf_counter()
        time.sleep(seconds)
        self.took.append(time.perf_counter() - start)

    def typical(self) -> float:
        """This rank's median call after the first: what a right answer returns on the slowest rank."""
        return statistics.median(self.took[1:])

