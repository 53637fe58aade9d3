"""Module 5, exercise 2: DDP with no_sync, one all-reduce per window.

DistributedDataParallel all-reduces gradients during every backward (in
buckets, overlapped with the backward itself). With accumulation that is N
all-reduces per optimizer step where one would do: `ddp_model.no_sync()`
turns the all-reduce off for the micro-batches inside it, and the first
backward outside it all-reduces everything accumulated so far.

DDP decides in the *forward* whether the coming backward will synchronise,
so the forward must be inside no_sync too. With only the backward inside it,
every micro-batch still all-reduces: correct numbers, N times the traffic.

Usage: torchrun --nproc-per-node=2 05_ddp_no_sync.py [results.json]
"""

import contextlib

from torch.nn.parallel import DistributedDataParallel as DDP

from dmuon_edu import distributed
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import Problem, Traffic, report


def accumulate_window(ddp_model, optimizer, microbatches, loss_fn):
    """One optimizer step over the window, all-reducing only once (the last micro-batch)."""
    optimizer.zero_grad()
    for i, (x, y) in enumerate(microbatches):
        is_last = i == len(microbatches) - 1
        ### BEGIN SOLUTION
        with contextlib.nullcontext() if is_last else ddp_model.no_sync():
            loss = loss_fn(ddp_model(x), y) / len(microbatches)
            loss.backward()
        ### END SOLUTION
    optimizer.step()


def forward_outside_no_sync(ddp_model, optimizer, microbatches, loss_fn):
    """The wrong placement: no_sync around the backward only."""
    optimizer.zero_grad()
    for i, (x, y) in enumerate(microbatches):
        loss = loss_fn(ddp_model(x), y) / len(microbatches)
        with contextlib.nullcontext() if i == len(microbatches) - 1 else ddp_model.no_sync():
            loss.backward()
    optimizer.step()


def main(ranks):
    """Train with accumulate_window, and with the wrong placement beside it; grade accumulate_window."""
    problem = Problem()
    rows, differences = {}, {}
    for label, window_step in [("no_sync around forward+backward", accumulate_window),
                               ("no_sync around backward only", forward_outside_no_sync)]:
        model = DDP(problem.model())
        optimizer = problem.optimizer(model.parameters())
        differences[label] = []
        with distributed.count_collectives() as counts:
            for window, expected in zip(problem.windows(), problem.baseline()):
                local = [problem.local(batch, ranks.rank, ranks.world_size) for batch in window]
                window_step(model, optimizer, local, problem.loss_fn)
                differences[label].append(max_parameter_difference(model.module.parameters(), expected))
        steps = problem.n_windows
        rows[f"all_reduce, {label}"] = (counts.calls["all_reduce"] // steps, counts.bytes["all_reduce"] // steps)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    distributed.print0(f"{problem.accum_steps} micro-batches per optimizer step, {ranks.world_size} ranks")
    return report(
        "05_ddp_no_sync",
        differences["no_sync around forward+backward"],
        rows,
        hint="run forward and backward of every micro-batch but the last inside ddp_model.no_sync()",
        # The model's 285 KB of gradients fit DDP's first bucket (1 MiB): one all_reduce per backward that syncs.
        traffic=(Traffic("all_reduce, no_sync around forward+backward", 1, gradient_bytes,
                         "DDP all-reduced in more than the window's last backward. It decides in the forward "
                         "whether the backward syncs, so run forward and backward of every micro-batch but the "
                         "last inside ddp_model.no_sync(), the last outside it, then step"),),
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
