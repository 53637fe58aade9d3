"""Rank 1 raises mid-step while rank 0 waits in a collective: the launcher must report rank 1."""

import torch
import torch.distributed as dist

from dmuon_edu import distributed

with distributed.session() as ranks:
    if ranks.rank == 1:
        raise ValueError("injected failure on rank 1")
    dist.all_reduce(torch.ones(4))
