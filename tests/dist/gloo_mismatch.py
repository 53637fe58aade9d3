"""Rank 0 all-reduces 4 floats, rank 1 all-reduces 8: gloo aborts rank 0 natively (SIGABRT).

What it prints (torch 2.13, measured), on rank 0 only:

    terminate called after throwing an instance of 'gloo::EnforceNotMet'
      what():  [enforce fail at .../gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 8 vs 4.
      Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?

Rank 1 then raises "Connection reset by peer". tests/test_data_parallel.py checks that the
launcher names rank 0's abort as a collective mismatch.
"""

import resource

import torch
import torch.distributed as dist

from dmuon_edu import distributed

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # where core dumps are on, the abort would leave one in the cwd
with distributed.session(timeout_s=10) as ranks:
    dist.all_reduce(torch.ones(4 if ranks.rank == 0 else 8))
