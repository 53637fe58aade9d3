"""Module 5d: ZeRO-1 by hand, an AdamW whose state is sharded over the ranks.

Under DDP every rank keeps AdamW's two moments for every parameter: 2 P bytes
of optimizer state per rank for P bytes of fp32 parameters, the same numbers on
every rank. ZeRO stage 1 keeps them once in the whole job. The parameters are
seen as one flat vector, padded with zeros to a multiple of the world size W
and cut into W equal *shards*; rank r keeps AdamW state only for shard r
(2 P / W bytes) and steps only that shard. One optimizer step:

1. reduce-scatter the flat gradient (``dist.reduce_scatter_single``): rank r
   receives the sum over the ranks of shard r only, (W-1)/W of the gradient's
   bytes on the wire instead of an all-reduce's 2(W-1)/W; divide it by W;
2. AdamW steps the shard with that averaged gradient;
3. all-gather the stepped shards (``dist.all_gather_single``), so that every
   rank holds all the new parameters: (W-1)/W more on the wire.

Usage: torchrun --nproc-per-node=2 05_zero1_adamw.py [results.json]
"""

import torch
import torch.distributed as dist

from dmuon_edu import distributed
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course import cost_model
from dmuon_edu.course.data_parallel import ADAMW_TOLERANCE, Problem, Traffic, optimizer_state_bytes, report


def shard_bounds(numel, rank, world_size):
    """(start, stop) of ``rank``'s shard of a flat vector of ``numel`` elements padded to a multiple of
    ``world_size``: equal shards, in rank order, that together cover the padded vector exactly once."""
    raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")


class ShardedAdamW:
    """AdamW with its state sharded over the ranks (ZeRO-1). ``self.inner`` is the torch AdamW that holds
    this rank's state and steps its shard; the check measures its state. ``adamw(params)`` makes a torch AdamW."""

    def __init__(self, params, adamw):
        self.params = list(params)
        numel = sum(p.numel() for p in self.params)
        self.start, self.stop = shard_bounds(numel, dist.get_rank(), dist.get_world_size())
        self.padded = dist.get_world_size() * (self.stop - self.start)
        raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        """Average this rank's shard of the gradient, step the shard, gather every shard into the parameters."""
        raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")


def flatten(tensors, padded):
    """The tensors' elements, one after another, padded with zeros to ``padded`` elements."""
    flat = torch.cat([t.flatten() for t in tensors])
    return torch.cat([flat, flat.new_zeros(padded - flat.numel())])


def main(ranks):
    """Train with ShardedAdamW; grade the parameters (against one process, and across the ranks), the gradient
    each shard stepped with, the shard boundaries, the optimizer state each rank holds and the traffic."""
    problem = Problem()
    model = problem.model()
    numel = sum(p.numel() for p in model.parameters())
    findings = shard_problems(numel, ranks.world_size)  # before any collective: unequal shards would hang one
    optimizer = ShardedAdamW(model.parameters(), problem.optimizer)  # the baseline's AdamW, on the shard
    differences, ratios, disagreements = [], [], []
    counts = distributed.count_collectives()
    for window, (gradients, expected) in zip(problem.windows(), problem.reference_steps()):
        with counts:
            optimizer.zero_grad()
            for batch in window:
                x, y = problem.local(batch, ranks.rank, ranks.world_size)
                (problem.loss_fn(model(x), y) / len(window)).backward()
            optimizer.step()
        # Outside the counter: the check's own collectives are not the exercise's traffic. The gradient is
        # graded while the parameters it was computed from still were the baseline's, on every rank.
        if not differences or (differences[-1] < ADAMW_TOLERANCE and disagreements[-1] == 0):
            ratios.append(stepped_gradient_ratio(optimizer.inner, gradients, optimizer.padded))
        disagreements.append(max_disagreement(model))
        differences.append(max_parameter_difference(model.parameters(), expected))
    parameter_bytes = numel * 4
    state = gathered_ints(optimizer_state_bytes(optimizer.inner))
    held = gathered_ints(sum(p.numel() * p.element_size() for group in optimizer.inner.param_groups
                             for p in group["params"]))
    predicted = cost_model.cost("ZeRO-1", P=parameter_bytes, W=ranks.world_size, N=problem.accum_steps, L=3)
    moments = 2 * optimizer.padded * 4 // ranks.world_size  # exp_avg and exp_avg_sq, fp32, of one shard
    expected_state = moments + 4  # and AdamW's step counter, one fp32 scalar
    distributed.print0(f"optimizer state per rank: {state} bytes; the formula 2 P / W = {moments} bytes of moments "
                       f"(the cost model's ZeRO-1 row: {predicted.optimizer_state:.0f}) + 4 bytes of step counter")
    distributed.print0(f"and each rank's fp32 copy of its shard, which AdamW steps: {held} bytes (P / W)")
    findings += [f"rank {rank} holds {nbytes} bytes of optimizer state where {expected_state} would do "
                f"({nbytes / expected_state:.2g}x the memory): keep AdamW state only for this rank's shard"
                for rank, nbytes in enumerate(state) if nbytes > expected_state][:1]
    if max(disagreements) > 0:
        findings.append(f"after step {[d > 0 for d in disagreements].index(True) + 1} the ranks hold different "
                        f"parameters (by up to {max(disagreements):.2g}): each rank stepped only its own shard; "
                        f"all-gather the stepped shards into every rank's parameters")
    steps = len(differences)
    rows = {op: (counts.calls[op] // steps, counts.bytes[op] // steps) for op in ("reduce_scatter", "all_gather")}
    padded_bytes = optimizer.padded * 4
    return report(
        "05_zero1_adamw",
        differences,
        rows,
        hint="reduce-scatter the flat gradient and divide by the world size, step the shard, all-gather the shards",
        measurements={"optimizer state bytes per rank": state, "shard bytes per rank": held,
                      "formula 2 P / W": moments, "cost model ZeRO-1": predicted.optimizer_state,
                      "parameter bytes": parameter_bytes},
        traffic=(Traffic("reduce_scatter", 1, padded_bytes,
                         "reduce-scatter the whole flat gradient once per optimizer step: each rank receives the "
                         "sum of its own shard only"),
                 Traffic("all_gather", 1, padded_bytes,
                         "all-gather the stepped shards once per optimizer step, so that every rank holds every "
                         "new parameter")),
        gradient_ratios=[r for r in ratios if r is not None],
        findings=tuple(findings),
    )


def stepped_gradient_ratio(inner, gradients, padded):
    """||the gradient the shards stepped with, over all ranks|| / ||full-batch gradient||; None unless the ranks'
    shards together hold the padded vector once (then the state and shard findings say what is wrong)."""
    held = [p for group in inner.param_groups for p in group["params"]]
    totals = torch.tensor([float(sum(p.numel() for p in held)),
                           sum(p.grad.double().pow(2).sum().item() for p in held if p.grad is not None)],
                          dtype=torch.float64)
    dist.all_reduce(totals)
    if totals[0] != padded:
        return None
    full = torch.cat([g.flatten() for g in gradients]).double()
    return (totals[1].sqrt() / torch.linalg.vector_norm(full)).item()


def max_disagreement(model):
    """The largest difference of any parameter element between two ranks (0 when all hold the same)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).max().item()


def gathered_ints(value):
    """``value`` from every rank, in rank order."""
    values = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value]))
    return [int(v) for v in values]


def shard_problems(numel, world_size):
    """Which parameter elements shard_bounds leaves out or gives to two ranks. Unequal shards raise on every
    rank alike: the collectives need equal ones, and a rank that cannot run them would leave the others waiting."""
    stepped = torch.zeros(numel, dtype=torch.int64)
    sizes = set()
    for rank in range(world_size):
        start, stop = shard_bounds(numel, rank, world_size)
        stepped[start:stop] += 1
        sizes.add(stop - start)
    if len(sizes) > 1:
        raise ValueError(f"shard_bounds gives shards of {sorted(sizes)} elements: reduce_scatter_single and "
                         f"all_gather_single need equal shards (pad the vector to a multiple of the world size)")
    problems = []
    for wrong, by in ((stepped > 1, "by two ranks or more"), (stepped == 0, "by no rank")):
        if wrong.any():
            problems.append(f"shard_bounds: {int(wrong.sum())} parameter element(s) stepped {by} (the first is "
                            f"element {int(wrong.nonzero()[0])}): the shards must cover the vector exactly once")
    return problems


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
