"""Module 6c: one rank runs one micro-batch more than the other, in the loop of dmuon's accumulation guide, under DDP.

    run((8, 9))   # rank 1's ninth micro-batch falls inside no_sync: the job finishes, silently wrong
    run((3, 4))   # rank 1's fourth closes a window: its backward all-reduces with nothing, the job fails

Windows of ``ACCUM_STEPS`` micro-batches, every one but the last of a window inside
``no_sync``. Each rank launched here (gloo, 2 CPU ranks, one thread each) runs its count of
micro-batches of the module's problem and writes what it did; :func:`run` launches the job
and says how it ended, in words that do not depend on how gloo reports the failure (an
abort on a mismatched size, or a connection reset when the other rank exits).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ACCUM_STEPS = 4
TIMEOUT_S = 20  # a rank left waiting gives up after this (it should fail at once: the other one has left)


def run(counts: tuple[int, int]) -> str:
    """Launch 2 ranks, rank r running ``counts[r]`` micro-batches; one line on how the job ended."""
    from dmuon_edu.launch import RankFailedError, torchrun

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ranks.json"
        head = f"rank 0 runs {counts[0]} micro-batches, rank 1 runs {counts[1]}, windows of {ACCUM_STEPS}: "
        try:
            torchrun(__file__, nproc=2, args=[path, *counts], echo=False, timeout=3 * TIMEOUT_S)
        except RankFailedError:
            return head + "the job failed (rank 1's extra backward synchronised with nothing on rank 0)"
        steps = [json.loads(line)["steps"] for line in path.read_text().splitlines()]
        return head + f"the job finished; optimizer steps per rank: {steps}"


def main(path: Path, counts: tuple[int, int]) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon_edu import distributed
    from dmuon_edu.course.dmuon_problem import UnevenProblem, guide_loop

    with distributed.session(timeout_s=TIMEOUT_S) as ranks:
        problem = UnevenProblem()
        stream = [tuple(t.to(ranks.device) for t in batch) for batch in problem.stream(ranks.rank, ranks.world_size)]
        stream = (stream * 2)[:counts[ranks.rank]]
        model = DDP(problem.model().to(ranks.device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = len(guide_loop(model, optimizer, stream, ACCUM_STEPS, no_sync=lambda m: m.no_sync()))
        with path.open("a") as out:  # each rank its own line
            out.write(json.dumps({"rank": ranks.rank, "steps": steps}) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), (int(sys.argv[2]), int(sys.argv[3])))
