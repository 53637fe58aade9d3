"""Rank 1 raises mid-step while rank 0 waits in a collective: the launcher must report rank 1."""

import torch
import torch.distributed as dist

from dmuon_edu import distributed

# A long collective timeout: if the launcher waited for rank 0 instead of ending the job, the test would
# see this 300 s wait, far from the few seconds a launch takes.
with distributed.session(timeout_s=300) as ranks:
    if ranks.rank == 1:
        raise ValueError("injected failure on rank 1")
    dist.all_reduce(torch.ones(4))
