"""Joining torchrun's process group, printing once, and counting collectives.

    from dmuon_edu import distributed

    with distributed.session() as ranks:      # gloo on CPU, NCCL with a GPU per rank
        ...
        distributed.print0(f"world size {ranks.world_size}")

:func:`count_collectives` sees every c10d collective this process takes part in,
including those that DDP and FSDP2 issue from C++ (they all pass through the
dispatcher's ``c10d`` ops): the way to check "one all-reduce per optimizer step".

Why :func:`barrier` and not ``torch.distributed.barrier`` at the end of a script: a
gloo collective runs on one of the process group's two worker threads, which drops its
reference to the work just *after* telling the caller that the work is done, and
dropping a tensor that has a Python object needs the GIL. Once the interpreter has begun
to finalize, Python 3.11 ends a thread that asks for the GIL with pthread_exit, whose
forced unwind reaches a noexcept C++ frame, and std::terminate aborts the rank
("terminate called without an active exception", SIGABRT) after all its work is done.
gloo's barrier makes that likely: its work holds every collective still in progress when
it was issued, until a worker destroys it right after the script was told to go on.
``destroy_process_group`` does not stop the workers while a DeviceMesh or FSDP2 state
still refers to the group, so the interpreter's exit is where it happens.
:func:`barrier` all-reduces a tensor of its own instead, then waits, with the GIL
released, until the worker has dropped that work, and a moment more for the other
worker (benchmarks/README.md has the core dumps' stacks and the rates measured).
A script that ends as torch's examples do (``destroy_process_group()`` after its last
collective) gets the same moment from :func:`release_gloo_workers_at_exit`, which dmuon
registers for a gloo group: an atexit handler, and atexit handlers run before the
interpreter begins to finalize.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Ranks", "session", "barrier", "release_gloo_workers_at_exit", "print0", "count_collectives",
           "CollectiveCounts", "COLLECTIVE_TIMEOUT_S"]

# Every collective wait gives up after this long instead of hanging forever.
COLLECTIVE_TIMEOUT_S = 60

# barrier()'s tensors, one per (group, device), kept until the process ends (see the module docstring).
_BARRIER_TENSORS: dict[tuple[str, torch.device], torch.Tensor] = {}
# How long barrier() waits for gloo's workers to drop their works: at most, and then a moment more.
_RELEASE_WAIT_S = 5.0
_RELEASE_GRACE_S = 0.05
# How long the atexit handler of release_gloo_workers_at_exit() leaves the GIL to gloo's workers: it cannot see
# which work is still held, so it gives a worker that was told "done" but not yet scheduled several time slices.
_EXIT_GRACE_S = 0.2
_exit_handler_registered = False


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in the job: what :func:`session` yields."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


@contextlib.contextmanager
def session(timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Iterator[Ranks]:
    """Join torchrun's process group for the duration of the block.

    The backend follows the hardware: NCCL when CUDA has a GPU for every local rank
    (each rank then uses ``cuda:LOCAL_RANK``), gloo on the CPU otherwise. Every
    collective gives up after ``timeout_s`` instead of hanging.

    When the block ends cleanly, the ranks wait for each other (:func:`barrier`, so
    that no rank leaves while a peer still finishes its last collective) and the
    process group is destroyed. When the block raises, the exception propagates at once,
    without waiting: the failing rank exits and torchrun stops the others.
    Nothing else about the process changes: exception hooks, atexit handlers and
    the interpreter's exit are the script's own.

    Args:
        timeout_s: seconds a collective may wait for the other ranks (> 0).

    Yields:
        :class:`Ranks`: this process's rank, the world size, its local rank, its
        device and the backend.

    Raises:
        RuntimeError: the script was not started by torchrun (no ``RANK`` in the
            environment, or ``RANK`` without ``WORLD_SIZE``, ``MASTER_ADDR`` or ``MASTER_PORT``).
        ValueError: ``timeout_s`` is not a positive, finite number.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive number of seconds, finite, got {timeout_s!r}; "
                         f"{COLLECTIVE_TIMEOUT_S} is the default")
    if "RANK" not in os.environ:
        raise RuntimeError(
            "not started by torchrun: run this script with dmuon_edu.launch.torchrun(path, nproc=2) "
            "or `torchrun --nproc-per-node=2 script.py`"
        )
    missing = [name for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"RANK is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: a launcher other than "
            "torchrun, or a RANK left in the environment. Start the script with torchrun (it sets them all), or set "
            "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT together"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    yield Ranks(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)
    # Reached only when the block ended cleanly.
    barrier()
    dist.destroy_process_group()


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` (the default group if None) has reached this call.

    Like ``torch.distributed.barrier``, but meant to be a gloo script's last collective
    (see the module docstring): it all-reduces a one-element tensor of its own (on the
    CPU for gloo, on the current GPU for NCCL) and, on gloo, then waits up to 5 s, with
    the GIL released, for the group's workers to drop their works.

    Raises:
        RuntimeError: there is no process group.
    """
    if not dist.is_initialized():
        raise RuntimeError("distributed.barrier() needs a process group: call it inside distributed.session()")
    group = group or dist.group.WORLD
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    key = (group.group_name, device)
    if key not in _BARRIER_TENSORS:
        _BARRIER_TENSORS[key] = torch.zeros(1, device=device)
    tensor = _BARRIER_TENSORS[key]
    dist.all_reduce(tensor, group=group)
    if backend == "gloo":
        _let_gloo_workers_release(tensor)


def _let_gloo_workers_release(tensor: torch.Tensor) -> None:
    """Wait, with the GIL released, until gloo's workers have let go of their last works.

    The worker that ran ``tensor``'s all-reduce has dropped it once the tensor's use count
    is back to Python's one reference; the group's other worker gets a moment more to drop
    the work it ran before. Both waits are bounded: this never hangs.
    """
    deadline = time.monotonic() + _RELEASE_WAIT_S
    while tensor._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(_RELEASE_GRACE_S)


def release_gloo_workers_at_exit() -> None:
    """Before the interpreter finalizes, give gloo's workers 0.2 s, with the GIL released, to drop their
    last works, so that a rank does not abort at its exit (see the module docstring).

    Registers one atexit handler per process, however often it is called; dmuon calls it
    when it is set up on a gloo group. It does not wait for anything to finish: a script's
    collectives are done when it exits, and only the release of their works remains.
    """
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(time.sleep, _EXIT_GRACE_S)
        _exit_handler_registered = True


def print0(*args, **kwargs) -> None:
    """``print(*args, **kwargs, flush=True)`` on rank 0 only (everywhere without a process group),
    so that output does not interleave across ranks."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


# c10d op -> the collective's usual name
_COLLECTIVE_NAMES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "reduce_": "reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "gather_": "gather",
    "scatter_": "scatter",
}


class CollectiveCounts(TorchDispatchMode):
    """Counts collectives by name: ``.calls[name]`` and ``.bytes[name]``.

    Bytes are the *full* tensor's (numel x element size), whether this rank
    sends or receives: the largest argument of the call, i.e. the gathered
    output of an all-gather and the input of a reduce-scatter.

    ``.events`` is the timeline: one ``(seconds, name, bytes)`` per call, in issue order,
    ``seconds`` from ``time.perf_counter()`` when the call was issued (an async call
    is issued, not finished, at that time).
    """

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.events: list[tuple[float, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = _COLLECTIVE_NAMES.get(func.overloadpacket.__name__)
            if name is not None:
                nbytes = max((sum(map(_nbytes, _tensors(arg))) for arg in args), default=0)
                self.calls[name] += 1
                self.bytes[name] += nbytes
                self.events.append((time.perf_counter(), name, nbytes))
        return func(*args, **(kwargs or {}))


def count_collectives() -> CollectiveCounts:
    """A fresh :class:`CollectiveCounts`: ``with count_collectives() as counts: ...``, then read
    ``counts.calls[name]`` and ``counts.bytes[name]`` (names such as "all_reduce", "broadcast",
    "reduce", "all_gather", "reduce_scatter"). A counter can be entered several times; its counts add up."""
    return CollectiveCounts()


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
