"""The small regression problem that the module 1 and 2 checkers train learners' loops on."""

from __future__ import annotations

import torch

Window = list[tuple[torch.Tensor, torch.Tensor]]


def regression_windows(sizes, n_windows: int, seed: int) -> list[Window]:
    """``n_windows`` windows of micro-batches of the given ``sizes``: 4 features in, 2 targets out."""
    generator = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(size, 4, generator=generator), torch.randn(size, 2, generator=generator)) for size in sizes]
        for _ in range(n_windows)
    ]


def regression_model(bias: bool = True) -> torch.nn.Module:
    """The same small MLP every time (4 -> 8 -> 2), whatever the global random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8, bias=bias), torch.nn.Tanh(), torch.nn.Linear(8, 2, bias=bias))
