"""Module 6, exercise 3: no_sync for owned matrices: accumulate locally, merge, reduce once.

dmuon reduces a gradient to its owner from a hook that autograd calls as soon as the
parameter's gradient of this backward is complete (register_post_accumulate_grad_hook).
Without no_sync that is one reduce per micro-batch: k * P_M per optimizer step.
Inside no_sync the hook only adds the local gradient into ``p._accumulated_grad``; the
first backward outside no_sync must *merge* it into the new gradient before the one
reduce of the window: 1 * P_M per step.

This script is that hook in miniature, on a replicated model (as in exercise 1);
dmuon's own is DMuonState.on_grad in dmuon_edu/dmuon/dedicate.py. The window runs with
no_sync on the first k-1 micro-batches, then again without no_sync at all: both must
equal the single-process step, with k times fewer reduce bytes for the first.

Usage: torchrun --nproc-per-node=2 06_no_sync_merge.py [results.json]
"""

import contextlib

import torch.distributed as dist

from dmuon_edu import distributed, dmuon
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import Traffic, report
from dmuon_edu.course.dmuon_problem import (
    Problem,
    average_over_ranks,
    broadcast_from_owners,
    dedicated_parameters,
    owner_gradient_difference,
    per_rank,
    symmetric_parameters,
)


def accumulate_locally(p):
    """Inside no_sync: keep this micro-batch's local gradient, add it to the ones before, send nothing."""
    g, p.grad = p.grad, None
    p._accumulated_grad = g if p._accumulated_grad is None else p._accumulated_grad.add_(g)


def merge_and_reduce(p, owner):
    """Outside no_sync: p.grad holds this backward's local gradient of p.

    Merge p._accumulated_grad (None when nothing was accumulated) into it, and set
    p._accumulated_grad to None, since that gradient is now on its way. Average the
    result over the ranks onto the owner with dist.reduce(..., op=dist.ReduceOp.AVG).
    On the owner, add it into p._reduced_grad (or store it there when that is None):
    without no_sync every micro-batch arrives this way. Leave p.grad None on every rank.
    """
    raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")


class OwnerGradients:
    """The gradient side of dmuon on a replicated model: a hook per matrix, and no_sync."""

    def __init__(self, dedicated, owners):
        self.in_no_sync = False
        for name, p in dedicated.items():
            p._accumulated_grad = p._reduced_grad = None
            p.register_post_accumulate_grad_hook(lambda p, owner=owners[name]: self.on_grad(p, owner))

    def on_grad(self, p, owner):
        if self.in_no_sync:
            accumulate_locally(p)
        else:
            merge_and_reduce(p, owner)

    @contextlib.contextmanager
    def no_sync(self):
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False


def train_window(model, hooks, microbatches, use_no_sync):
    for i, batch in enumerate(microbatches):
        is_accumulating = i < len(microbatches) - 1
        with hooks.no_sync() if use_no_sync and is_accumulating else contextlib.nullcontext():
            (model(batch).loss / len(microbatches)).backward()


def main(ranks):
    """Train with and without no_sync through the hooks; grade the owners' gradients and the reduces."""
    problem = Problem()
    rows, differences, measurements = {}, [], {}
    for label, use_no_sync in [("no_sync on the first k-1", True), ("no no_sync", False)]:
        model = problem.model()
        dedicated = dedicated_parameters(model)
        owners = dmuon.plan_owners({name: tuple(p.shape) for name, p in dedicated.items()}, ranks.world_size)
        owned = {name: p for name, p in dedicated.items() if owners[name] == ranks.rank}
        hooks = OwnerGradients(dedicated, owners)
        muon, symmetric = problem.muon(owned.values()), symmetric_parameters(model)
        adamw = problem.optimizer(symmetric)
        parameter_differences, gradient_differences = [], []
        counts = distributed.count_collectives()
        for window, expected in zip(problem.windows(), problem.baseline()):
            local = [problem.local(batch, ranks.rank, ranks.world_size) for batch in window]
            with counts:
                train_window(model, hooks, local, use_no_sync)
                stepped_with = {name: p._reduced_grad for name, p in owned.items()}
                for p in owned.values():
                    p.grad = p._reduced_grad
                muon.step()
                broadcast_from_owners(dedicated, owners)
                average_over_ranks(symmetric)
                adamw.step()
            gradient_differences.append(owner_gradient_difference(stepped_with, expected.gradients))
            difference = max_parameter_difference(model.parameters(), expected.parameters)
            parameter_differences.append(max(per_rank(difference)))
            model.zero_grad()
            for p in dedicated.values():  # what dmuon's optimizer.zero_grad() does too
                p._reduced_grad = p._accumulated_grad = None
        steps = problem.n_windows
        rows[f"reduce, {label}"] = (counts.calls["reduce"] // steps, counts.bytes["reduce"] // steps)
        differences.append([max(pair) for pair in zip(parameter_differences, gradient_differences)])
        measurements[f"gradient differences, {label}"] = gradient_differences

    p_m = sum(p.numel() * p.element_size() for p in dedicated.values())
    distributed.print0(f"P_M = {p_m} bytes, k = {problem.accum_steps} micro-batches per optimizer step")
    k, matrices = problem.accum_steps, len(dedicated)
    mistake = ("merge_and_reduce runs once per matrix in each backward outside no_sync: one dist.reduce of the merged "
               "gradient there, none inside no_sync (accumulate_locally keeps it)")
    return report(
        "06_no_sync_merge",
        [max(step) for step in zip(*differences)],
        rows,
        hint="an owner stepped with the wrong gradient: in merge_and_reduce, add p._accumulated_grad into the new "
             "gradient (then set it to None), dist.reduce the sum to the owner with op=dist.ReduceOp.AVG, and add "
             "the result into the owner's p._reduced_grad; leave p.grad None",
        measurements={"P_M": p_m, **measurements},
        traffic=(Traffic("reduce, no_sync on the first k-1", matrices, p_m, mistake),
                 Traffic("reduce, no no_sync", k * matrices, k * p_m, mistake)),
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
