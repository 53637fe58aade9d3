"""Module 6c, exercise 1: uneven micro-batches and a short last window, under DDP and under dmuon.

Every rank runs the same number of micro-batches, but of different sizes: the ranks
split each global micro-batch of 8 samples at random, rank 1 taking more on average.
And the data does not divide into whole windows: the stream ends with a window of 3
micro-batches where accum_steps is 4.

train gets this rank's stream of (x, y) micro-batches, in order, and steps once per
window, the short last one included. Each optimizer step must equal one step of a
single process on the window's samples of all ranks as one batch. model(batch).loss
is a micro-batch's mean loss. The same train runs under DDP (no_sync is
ddp_no_sync below) and under dmuon (``dmuon.no_sync``); both average the ranks'
gradients.

The script also measures what a different *number* of micro-batches does: rank 1 with
one more than rank 0, under DDP and the loop of dmuon's accumulation guide.

Usage: torchrun --nproc-per-node=2 06_uneven_windows.py [results.json]
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from dmuon_edu import distributed, dmuon
from dmuon_edu.accumulation import accumulation_windows
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import Traffic, flat_gradient, report, weighting_findings
from dmuon_edu.course.dmuon_problem import (UnevenProblem, dedicated_parameters, full_parameters, guide_loop, per_rank,
                                            prepare)


def train(model, optimizer, dataloader, accum_steps, no_sync):
    """One optimizer step per window of ``accum_steps`` micro-batches of ``dataloader``, the short last one included."""
    ### BEGIN SOLUTION
    for window in accumulation_windows(dataloader, accum_steps):
        # Each sample of the window, on any rank, weighs 1 / (the window's samples on all ranks): count them first.
        count = torch.tensor(sum(len(x) for x, _ in window))
        dist.all_reduce(count)
        for i, batch in enumerate(window):
            with nullcontext() if i == len(window) - 1 else no_sync(model):
                # The mean loss times its samples is their summed loss; the world size undoes the ranks' average.
                loss = model(batch).loss * len(batch[0]) * dist.get_world_size() / count
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ### END SOLUTION


def ddp_no_sync(model):
    return model.no_sync()


def counting_all_reduce(counted):
    """A DDP communication hook: DDP's own all-reduce of each gradient bucket, counted in ``counted`` (calls,
    bytes). It counts the gradients' traffic alone, whatever other collectives train makes."""
    def hook(process_group, bucket):
        counted[0] += 1
        counted[1] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(process_group, bucket)
    return hook


def run(problem, ranks, mesh, with_dmuon):
    """Train under DDP or dmuon; return (the flat gradient each step stepped with, the parameters after it, the
    gradients' (calls, bytes) in all: DDP's bucket all-reduces, or dmuon's reduces to the owners)."""
    model = problem.model().to(ranks.device)
    if with_dmuon:
        optimizer = prepare(model, mesh)
        owned = {name: p for name, p in dedicated_parameters(model).items()
                 if dmuon.ownership(model)[name] == ranks.rank}

        def gradient():  # this rank's owned matrices' gradients, zeros elsewhere; the ranks' sum is everything
            return torch.cat([dmuon.record_of(p).reduced_grad.flatten() if name in owned else torch.zeros(p.numel())
                              for name, p in dedicated_parameters(model).items()])

        def parameters():
            return full_parameters(model)
    else:
        model = DDP(model)
        optimizer = problem.optimizer(model.parameters())
        ddp_traffic = [0, 0]
        model.register_comm_hook(None, counting_all_reduce(ddp_traffic))

        def gradient():
            return flat_gradient(model.module.parameters()).clone()

        def parameters():
            return [p.detach().clone() for p in model.module.parameters()]

    stepped, after = [], []
    optimizer.register_step_pre_hook(lambda *_: stepped.append(gradient()))
    optimizer.register_step_post_hook(lambda *_: after.append(parameters()))
    stream = [tuple(t.to(ranks.device) for t in batch) for batch in problem.stream(ranks.rank, ranks.world_size)]
    counts = distributed.count_collectives()
    with counts:
        train(model, optimizer, stream, problem.accum_steps, dmuon.no_sync if with_dmuon else ddp_no_sync)
    traffic = (counts.calls["reduce"], counts.bytes["reduce"]) if with_dmuon else tuple(ddp_traffic)
    if with_dmuon:
        for g in stepped:
            dist.all_reduce(g)
    return stepped, after, traffic


def one_more_micro_batch(problem, ranks):
    """The guide's loop under DDP with rank 1 given one micro-batch more, at the start of its stream, than rank 0:
    does it finish, how many steps each rank takes, and what it trains on, against the same run without the extra."""
    stream = [tuple(t.to(ranks.device) for t in batch)
              for batch in problem.stream(ranks.rank, ranks.world_size)][:2 * problem.accum_steps]
    runs = {}
    for extra in (False, True):
        model = DDP(problem.model().to(ranks.device))
        optimizer = problem.optimizer(model.parameters())
        batches = stream[:1] + stream if extra and ranks.rank == 1 else stream
        steps = len(guide_loop(model, optimizer, batches, problem.accum_steps, no_sync=ddp_no_sync))
        left = any(p.grad is not None and bool(p.grad.any()) for p in model.parameters())
        runs[extra] = (len(batches), steps, left, [p.detach().clone() for p in model.module.parameters()])
    count, steps, left, parameters = runs[True]
    flat = torch.cat([p.flatten() for p in parameters])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return {"micro-batches per rank": per_rank(count), "optimizer steps per rank": per_rank(steps),
            "a gradient never stepped, per rank": per_rank(left),
            "largest difference between the ranks' parameters": (high - low).max().item(),
            "largest difference from the run without the extra micro-batch":
                max(per_rank(max_parameter_difference(parameters, runs[False][3])))}


def main(ranks):
    """Run train under DDP and under dmuon; grade the steps taken, each step's gradient and its parameters."""
    problem = UnevenProblem()
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    differences, runs, dropped, rows = [], {}, {}, {}
    steps = len(problem.windows())
    for with_dmuon in (False, True):
        name = "dmuon" if with_dmuon else "DDP"
        reference = problem.reference_steps(ranks.world_size, with_muon=with_dmuon)
        stepped, after, (calls, nbytes) = run(problem, ranks, mesh, with_dmuon)
        rows["dmuon's reduces of the matrices" if with_dmuon else "DDP's all-reduces of the gradients"] = (
            calls // steps, nbytes // steps)
        runs[name] = stepped, reference
        differences.append([max_parameter_difference(parameters, expected.parameters) for parameters, expected
                            in zip(after, reference)] + [float("inf")] * (len(reference) - len(after)))
        if (never_trained := problem.never_trained(len(stepped))) is not None:
            dropped.setdefault(never_trained, []).append(name)
    findings = weighting_findings(runs) + tuple(f"{' and '.join(names)}: {never_trained}"
                                                for never_trained, names in dropped.items())
    sizes = [sum(map(len, (x for x, _ in window))) for window in problem.windows()]
    distributed.print0(f"{ranks.world_size} ranks, windows of {problem.accum_steps} micro-batches, the last of "
                       f"{problem.leftover}: {sizes} samples per window")
    one_more = one_more_micro_batch(problem, ranks)
    model = problem.model()
    p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    p_m = sum(p.numel() * p.element_size() for p in dedicated_parameters(model).values())
    mistake = "every micro-batch of a window but its last runs inside no_sync: one gradient sync per window"
    return report(
        "06_uneven_windows",
        [max(step) for step in zip(*differences)],
        rows,
        hint="every sample of a window, on any rank, must weigh the same, and every window must be stepped",
        measurements={"one more micro-batch on rank 1": one_more},
        traffic=(Traffic("DDP's all-reduces of the gradients", None, p_bytes, mistake),
                 Traffic("dmuon's reduces of the matrices", None, p_m, mistake)),
        findings=findings,
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
