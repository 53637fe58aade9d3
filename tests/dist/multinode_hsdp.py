"""HSDP across two "machines": one torchrun agent per node, the replicate axis across the nodes.

    AGENT=a CHECKS_FILE=checks.jsonl torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:PORT tests/dist/multinode_hsdp.py      (and the same with AGENT=b)

tests/test_dmuon.py starts both agents on this machine. Ranks are numbered node rank * 2 +
local rank, so the rows of the (replicate, shard) mesh are the nodes: each shard group lies
within a node, each replicate group spans both. Every rank reports where it is; rank 0
then trains dmuon's HSDP (Z3, no_sync) against the single-process reference of
dmuon_checks.py and reports the difference.
"""

import os

import torch.distributed as dist

import check_channel
import dmuon_checks
from dmuon_edu import distributed
from dmuon_edu.course.dmuon_problem import per_rank


def main():
    with distributed.session() as ranks:
        dmuon_checks.DEVICE[0] = ranks.device
        mesh = dmuon_checks.hsdp_mesh(ranks.device.type)
        where = {"rank": ranks.rank, "agent": os.environ["AGENT"], "node_rank": int(os.environ["GROUP_RANK"]),
                 "local_rank": int(os.environ["LOCAL_RANK"]),
                 "shard_group": dist.get_process_group_ranks(mesh["shard"].get_group()),
                 "replicate_group": dist.get_process_group_ranks(mesh["replicate"].get_group())}
        dmuon_checks.report("placement", ranks=per_rank(where))
        dmuon_checks.check_equivalence(mesh["shard"], zero3=True, use_no_sync=True, hsdp=True)
        if ranks.rank == 0:
            check_channel.done()


if __name__ == "__main__":
    main()
