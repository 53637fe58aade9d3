"""Peak memory of a piece of work, on CPU or CUDA.

Accumulation exists because activations, not weights, fill memory: a forward
pass keeps every intermediate its backward needs, and that grows with the
batch. ``peak_memory_bytes`` measures how far memory rises above where it
started while ``fn`` runs.

- CUDA: the caching allocator's statistics (``torch.cuda.max_memory_allocated``).
- CPU: there are no allocator statistics, so the autograd profiler records
  every allocation and free (``profile_memory=True``) and the peak of the
  running sum of the calling thread's records is taken.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import tempfile
from collections.abc import Callable

import torch
from torch.autograd import profiler

__all__ = ["peak_memory_bytes"]


def peak_memory_bytes(fn: Callable[[], object], device: str | torch.device = "cpu") -> int:
    """Largest number of bytes allocated on ``device`` above the level at the call, while ``fn`` runs.

    Args:
        fn: the work to measure, a callable taking no arguments (its result is dropped).
        device: "cpu" or a CUDA device. On CPU only the calling thread's allocations
            count.

    Returns:
        The peak, in bytes, above what was allocated when ``fn`` started.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``device`` is neither a CPU nor a CUDA device.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable taking no arguments, got {type(fn).__name__}")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    if device.type != "cpu":
        raise ValueError(f"peak_memory_bytes measures 'cpu' or 'cuda' devices, got {device.type!r}")
    # torch.autograd.profiler, not torch.profiler: the latter's start imports torch._inductor (seconds, the
    # first time in a process) to read a CUDA-graphs setting that a CPU measurement does not use.
    prof = profiler.profile(use_cpu=True, profile_memory=True, use_kineto=True)
    with _native_stderr_silenced():
        prof.__enter__()
    try:
        fn()
    finally:
        with _native_stderr_silenced():
            prof.__exit__(None, None, None)
    return _peak_of_running_sum(_cpu_allocation_deltas(prof))


@contextlib.contextmanager
def _native_stderr_silenced():
    # The profiler's C++ backend logs a time- and pid-stamped line to file
    # descriptor 2 at every start and stop, past Python's sys.stderr and past
    # any logging setting; in a notebook those lines land in the cell output.
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _cpu_allocation_deltas(prof: profiler.profile) -> list[int]:
    # The exported trace is the profiler's public view of its memory records:
    # one "[memory]" event per allocation (+bytes) or free (-bytes), in order.
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    # Only this thread's allocations: background threads (a process group's
    # communication threads, for one) allocate at times of their own.
    thread = threading.get_native_id()
    memory_events = [
        e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0 and e.get("tid") == thread
    ]
    memory_events.sort(key=lambda e: e["ts"])
    return [e["args"]["Bytes"] for e in memory_events]


def _peak_of_running_sum(deltas: list[int]) -> int:
    live = peak = 0
    for delta in deltas:
        live += delta
        peak = max(peak, live)
    return peak
