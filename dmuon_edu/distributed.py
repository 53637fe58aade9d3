"""What every torchrun script of the course needs: a process group, a rank-0 print, a collective counter.

    from dmuon_edu import distributed

    with distributed.session() as ranks:      # gloo on CPU, NCCL with a GPU per rank
        ...
        distributed.print0(f"world size {ranks.world_size}")

Counting collectives is how the course proves "one all-reduce per window":
:func:`count_collectives` sees every c10d collective this process takes part
in, including those that DDP and FSDP2 issue from C++ (they all pass through
the dispatcher's ``c10d`` ops).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Ranks", "session", "leave_together", "print0", "count_collectives", "CollectiveCounts"]

# Every collective wait gives up after this long instead of hanging forever.
COLLECTIVE_TIMEOUT_S = 60


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


@contextlib.contextmanager
def session(timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Iterator[Ranks]:
    """Join torchrun's process group for the duration of the block.

    The backend follows the hardware: NCCL when CUDA has a GPU for every local
    rank, gloo (CPU) otherwise. Collectives time out after ``timeout_s``.
    After a clean end of the block the ranks wait for each other, and the
    process exits without tearing the group down when the script ends (see
    _exit_without_native_teardown): keep the work inside the block.
    """
    if "RANK" not in os.environ:
        raise RuntimeError(
            "not started by torchrun: run this script with dmuon_edu.launch.torchrun(path, nproc=2) "
            "or `torchrun --nproc-per-node=2 script.py`"
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
    # An exception skips this, so the failing rank exits at once and torchrun stops the others.
    leave_together()


def leave_together() -> None:
    """Wait for every rank, then let the script end without tearing the process group down.

    ``session()`` calls this when its block ends cleanly. A script that opens its
    process group itself (as seed 000's loop does) calls it as its last line
    instead of ``dist.destroy_process_group()``.

    Waiting first matters: a rank that exits while a peer is still finishing its
    last collective can abort that peer.
    """
    dist.barrier()
    _exit_without_native_teardown()


def _exit_without_native_teardown() -> None:
    """At the end of the script, end the process without tearing the process group down.

    With torch 2.13 and gloo, tearing down a process group (destroy_process_group,
    or the interpreter destroying what still refers to it: a device mesh, FSDP2's
    state) now and then aborts a rank after all its work is done ("terminate
    called without an active exception", SIGABRT): about one run in ten of the
    module 6 scripts. Exiting the process releases everything anyway, so once
    the session has ended cleanly the script's end exits with os._exit, after
    flushing its output: status 0, or 1 if the script raised afterwards.
    """
    raised = []
    previous_hook = sys.excepthook

    def remember_failure(*exc_info):
        raised.append(exc_info[0])
        previous_hook(*exc_info)

    def exit_now():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if raised else 0)

    sys.excepthook = remember_failure
    atexit.register(exit_now)


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only, so that output does not interleave across ranks."""
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
    """

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = _COLLECTIVE_NAMES.get(func.overloadpacket.__name__)
            if name is not None:
                self.calls[name] += 1
                self.bytes[name] += max((sum(map(_nbytes, _tensors(arg))) for arg in args), default=0)
        return func(*args, **(kwargs or {}))


def count_collectives() -> CollectiveCounts:
    """``with count_collectives() as counts: ...`` then read ``counts.calls`` and ``counts.bytes``."""
    return CollectiveCounts()


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
