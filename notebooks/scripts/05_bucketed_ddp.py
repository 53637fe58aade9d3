"""Module 5b: DDP's bucketed all-reduce, built from hooks.

DDP does not wait for the backward to end before it communicates. Autograd calls
a parameter's *post-accumulate-grad hook* as soon as that parameter's gradient is
complete, and the backward goes on with the layers before it. DDP collects the
gradients, in the order the backward produces them (the last layer first), into
*buckets*; a full bucket is all-reduced at once with ``async_op=True``, which
returns a *work* handle instead of waiting, so the network sums one bucket while
autograd computes the next gradients. Before ``step()`` every work must be waited
on: until then the bucket may still be changing.

The bucketing rule here: the gradients, in backward order, are cut into buckets
of exactly ``bucket_bytes`` (a gradient that straddles a boundary is split over
two buckets) and the last bucket takes what is left. For P bytes of gradients
that is ceil(P / bucket_bytes) all-reduces per optimizer step.
(DDP itself keeps each parameter whole in one bucket, so its count can differ.)

With accumulation, only the window's last backward communicates
(``require_sync`` is False before it, as DDP's ``no_sync`` would make it).

Usage: torchrun --nproc-per-node=2 05_bucketed_ddp.py [results.json]
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dmuon_edu import distributed
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import (ADAMW_TOLERANCE, BackwardLog, Problem, Traffic, buckets_per_sync,
                                            overlap_problems, report)
from dmuon_edu.course.timeline import Timeline

BUCKET_BYTES = 128 * 1024


class BucketedAllReduce:
    """Averages a model's gradients over the ranks during the backward, bucket by bucket."""

    def __init__(self, model, bucket_bytes):
        self.bucket_bytes = bucket_bytes
        self.require_sync = True  # False for a window's micro-batches before its last: nothing is sent
        self.ready = []  # 1-D views of gradients (or of their unsent tails) not yet in a bucket, in backward order
        self.in_flight = []  # (work, bucket, the gradient views the bucket was copied from), in issue order
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self.gradient_ready)

    def gradient_ready(self, p):
        """Autograd's hook: p.grad now holds this backward's sum. Queue it and send every full bucket."""
        raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")

    def send(self, numel):
        """Start the all-reduce of the first ``numel`` queued gradient elements, without waiting for it (given)."""
        views, taken = [], 0
        while taken < numel:
            view = self.ready.pop(0)
            if taken + view.numel() > numel:  # it straddles the bucket's end: its tail waits for the next one
                self.ready.insert(0, view[numel - taken:])
                view = view[:numel - taken]
            views.append(view)
            taken += view.numel()
        bucket = torch.cat(views)  # a copy: the gradients stay as they are until the sum is back
        self.in_flight.append((dist.all_reduce(bucket, async_op=True), bucket, views))

    def finish(self):
        """After the backward: send what is queued, wait for every bucket, write the averages into the gradients."""
        raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")


def main(ranks):
    """Train with BucketedAllReduce; grade the parameters (against one process and against DDP), the
    averaged gradient, the all_reduce calls and bytes, and the order of the events in each backward."""
    problem = Problem()
    model = problem.model()
    log = BackwardLog(model)  # before the buckets' hooks, so that a gradient is logged ready before it is sent
    buckets = BucketedAllReduce(model, BUCKET_BYTES)
    optimizer = problem.optimizer(model.parameters())
    layers = [module for module in model if isinstance(module, nn.Linear)]
    differences, ratios, stepped = [], [], []
    with distributed.count_collectives() as counts, log:
        for step, (window, (gradients, expected)) in enumerate(zip(problem.windows(), problem.reference_steps()), 1):
            optimizer.zero_grad()
            for i, batch in enumerate(window):
                x, y = problem.local(batch, ranks.rank, ranks.world_size)
                last = i == len(window) - 1
                buckets.require_sync = last
                with Timeline(layers) if last and step == problem.n_windows else contextlib.nullcontext() as timeline:
                    if last:
                        log.mark("backward")
                    (problem.loss_fn(model(x), y) / len(window)).backward()
                    if last:
                        log.mark("backward done")
                        buckets.finish()
                        log.mark("step")
                        optimizer.step()
            if not differences or differences[-1] < ADAMW_TOLERANCE:  # computed from the baseline's parameters
                ratios.append((norm([p.grad for p in model.parameters()]) / norm(gradients)).item())
            differences.append(max_parameter_difference(model.parameters(), expected))
            stepped.append([p.detach().clone() for p in model.parameters()])
    events = sorted(log.events + [(t, name, str(nbytes)) for t, name, nbytes in counts.events])
    backwards = syncing_backwards(events)
    findings = next((problems for problems in map(overlap_problems, backwards) if problems), [])
    from_ddp = ddp_differences(problem, ranks, stepped)
    if not max(from_ddp) < ADAMW_TOLERANCE:
        findings.append(f"after step {[d < ADAMW_TOLERANCE for d in from_ddp].index(False) + 1} the parameters "
                        f"differ from DDP's by {max(from_ddp):.2g}: average every gradient element exactly once")
    else:
        distributed.print0(f"every step equals DDP's (bucket_cap_mb={BUCKET_BYTES / 2**20}, no_sync; "
                           f"tolerance {ADAMW_TOLERANCE:.0e})")
    steps = len(differences)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    calls = buckets_per_sync(gradient_bytes, BUCKET_BYTES)
    distributed.print0(f"{gradient_bytes} bytes of gradients in buckets of {BUCKET_BYTES}: "
                       f"ceil({gradient_bytes} / {BUCKET_BYTES}) = {calls} all_reduces per optimizer step")
    origin = timeline.spans[0][2] - timeline.relative()["spans"][0][2]  # the clock's zero in timeline.relative()
    return report(
        "05_bucketed_ddp",
        differences,
        {"all_reduce": (counts.calls["all_reduce"] // steps, counts.bytes["all_reduce"] // steps)},
        hint="average each bucket: all_reduce sums it over the ranks; divide it by the world size and copy it back "
             "into the gradients it came from",
        measurements={"timeline": timeline.relative(),
                      "last backward": [[t - origin, kind, detail] for t, kind, detail in backwards[-1]],
                      "bucket bytes": BUCKET_BYTES},
        traffic=(Traffic("all_reduce", calls, gradient_bytes,
                         "send only in the window's last backward (require_sync), every gradient byte once, in "
                         "buckets of exactly bucket_bytes: a gradient that straddles a bucket's end goes in two"),),
        gradient_ratios=ratios,
        findings=tuple(findings),
    )


def syncing_backwards(events):
    """The events of each backward that synchronises: from its mark "backward" to its mark "step"."""
    marks = [(t, label) for t, kind, label in events if kind == "mark"]
    starts = [t for t, label in marks if label == "backward"]
    ends = [t for t, label in marks if label == "step"]
    return [[e for e in events if start <= e[0] <= end] for start, end in zip(starts, ends)]


def ddp_differences(problem, ranks, stepped):
    """How far DDP with no_sync, trained on the same windows, is from ``stepped`` after each step."""
    ddp = DDP(problem.model(), bucket_cap_mb=BUCKET_BYTES / 2**20)
    optimizer = problem.optimizer(ddp.parameters())
    differences = []
    for window, parameters in zip(problem.windows(), stepped):
        optimizer.zero_grad()
        for i, batch in enumerate(window):
            x, y = problem.local(batch, ranks.rank, ranks.world_size)
            with contextlib.nullcontext() if i == len(window) - 1 else ddp.no_sync():
                (problem.loss_fn(ddp(x), y) / len(window)).backward()
        optimizer.step()
        differences.append(max_parameter_difference(ddp.module.parameters(), parameters))
    return differences


def norm(tensors):
    return torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]))


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
