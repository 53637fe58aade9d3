"""One torch thread for small problems."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["one_thread"]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread inside the block, then restore the thread count.

    On matrices this small, handing work to other threads costs more than the
    arithmetic (5x slower with 2 threads on a busy 2-core machine), and a torchrun
    rank gets one thread too, so runs compared side by side stay comparable.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
