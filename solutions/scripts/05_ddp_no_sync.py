"""Module 5a, exercise 2: DDP and no_sync: where does it have to go? A prediction, graded by the run.

DistributedDataParallel all-reduces the gradients during the backward, in buckets,
overlapped with the backward itself. With accumulation that is an all-reduce per
micro-batch where one per window would do. ``ddp_model.no_sync()`` is DDP's context
manager for that: the micro-batches inside it are not all-reduced, and the first
backward that syncs again all-reduces everything accumulated since.

The script runs the same windows four ways, each placing no_sync differently (the
four functions in PLACEMENTS), counts DDP's all-reduces per optimizer step and
compares every step with one process that saw each whole window as one batch.
Before you run it, write down in ``predicted`` what each placement will do.

Usage: torchrun --nproc-per-node=2 05_ddp_no_sync.py [results.json]
"""

import contextlib

from torch.nn.parallel import DistributedDataParallel as DDP

from dmuon_edu import distributed
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import (ADAMW_TOLERANCE, DDP_NO_SYNC_REASONS, Problem, max_over_ranks,
                                            prediction_findings, report)


def backward_inside(ddp_model, optimizer, microbatches, loss_fn):
    """no_sync around the backward of every micro-batch but the last."""
    optimizer.zero_grad()
    for i, (x, y) in enumerate(microbatches):
        loss = loss_fn(ddp_model(x), y) / len(microbatches)
        with contextlib.nullcontext() if i == len(microbatches) - 1 else ddp_model.no_sync():
            loss.backward()
    optimizer.step()


def forward_and_backward_inside(ddp_model, optimizer, microbatches, loss_fn):
    """no_sync around the forward and the backward of every micro-batch but the last."""
    optimizer.zero_grad()
    for i, (x, y) in enumerate(microbatches):
        with contextlib.nullcontext() if i == len(microbatches) - 1 else ddp_model.no_sync():
            loss = loss_fn(ddp_model(x), y) / len(microbatches)
            loss.backward()
    optimizer.step()


def forward_inside(ddp_model, optimizer, microbatches, loss_fn):
    """no_sync around the forward of every micro-batch but the last; every backward outside it."""
    optimizer.zero_grad()
    for i, (x, y) in enumerate(microbatches):
        with contextlib.nullcontext() if i == len(microbatches) - 1 else ddp_model.no_sync():
            loss = loss_fn(ddp_model(x), y) / len(microbatches)
        loss.backward()
    optimizer.step()


def every_micro_batch_inside(ddp_model, optimizer, microbatches, loss_fn):
    """no_sync around the forward and the backward of every micro-batch, the last one too."""
    optimizer.zero_grad()
    with ddp_model.no_sync():
        for x, y in microbatches:
            (loss_fn(ddp_model(x), y) / len(microbatches)).backward()
    optimizer.step()


PLACEMENTS = {f.__name__: f for f in (backward_inside, forward_and_backward_inside, forward_inside,
                                      every_micro_batch_inside)}


def predicted():
    """Your prediction, before the run, for the 4 micro-batches of a window on 2 ranks.

    Returns:
        {placement: (all_reduce calls per optimizer step, whether every step equals the
        single process's)}, one entry for each name in PLACEMENTS.
    """
    ### BEGIN SOLUTION
    return {"backward_inside": (4, True),
            "forward_and_backward_inside": (1, True),
            "forward_inside": (1, True),
            "every_micro_batch_inside": (0, False)}
    ### END SOLUTION


def measure(ranks):
    """Train each placement: its all-reduces per optimizer step, and how far each step is from one process, over
    every rank (none of it depends on the prediction)."""
    problem = Problem()
    rows, differences = {}, {}
    for label, window_step in PLACEMENTS.items():
        model = DDP(problem.model())
        optimizer = problem.optimizer(model.parameters())
        differences[label] = []
        counts = distributed.count_collectives()
        for window, expected in zip(problem.windows(), problem.baseline()):
            local = [problem.local(batch, ranks.rank, ranks.world_size) for batch in window]
            with counts:
                window_step(model, optimizer, local, problem.loss_fn)
            # Outside the count, over every rank: a rank that stepped alone differs from the baseline.
            differences[label].append(max_over_ranks(max_parameter_difference(model.module.parameters(), expected)))
        steps = problem.n_windows
        rows[f"all_reduce, {label}"] = (counts.calls["all_reduce"] // steps, counts.bytes["all_reduce"] // steps)
    return {"collectives": rows, "differences": differences, "N": problem.accum_steps}


def main(ranks):
    """Measure, then grade predicted() against the all-reduces counted and the steps compared."""
    run = measure(ranks)
    rows, differences = run["collectives"], run["differences"]
    measured = {label: (rows[f"all_reduce, {label}"][0], max(differences[label]) < ADAMW_TOLERANCE)
                for label in PLACEMENTS}
    distributed.print0(f"{run['N']} micro-batches per optimizer step, {ranks.world_size} ranks")
    findings = prediction_findings(predicted(), measured, ("all_reduce calls per optimizer step", "equal to one process"),
                                   DDP_NO_SYNC_REASONS)
    return report(
        "05_ddp_no_sync",
        differences["forward_and_backward_inside"],
        rows,
        hint="the given code no longer matches one process: start the script over "
             "(python -m dmuon_edu.course restore 05_ddp_no_sync)",
        measurements={"equal to the single process": {label: equal for label, (_, equal) in measured.items()}},
        findings=tuple(findings),
        passed="every prediction matches the run: the all-reduces counted, and which placements equal one process",
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
