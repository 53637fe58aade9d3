"""Module 6b, exercise 1: no_sync for owned matrices: accumulate locally, reduce once per window.

dmuon reduces a gradient to its owner from a hook that autograd calls as soon as the
parameter's gradient of this backward is complete (register_post_accumulate_grad_hook).
Inside no_sync the hook only adds the local gradient into the matrix's record
(``dmuon.record_of(p).accumulated_grad``) and sends nothing (``accumulate_locally``,
given); outside it, ``merge_and_reduce`` runs.

This script is that hook in miniature, on a replicated model (as in module 6a's first
exercise). The miniature has no records: it keeps the two gradients on the parameter, as
``p._accumulated_grad`` and ``p._reduced_grad``. The window runs with no_sync on the first N-1 micro-batches, then again
without no_sync at all: both must equal the single-process step, the first with N times
fewer reduce bytes.

Usage: torchrun --nproc-per-node=2 06_no_sync_merge.py [results.json]
"""

import contextlib

import torch.distributed as dist

from dmuon_edu import distributed, dmuon
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import ADAMW_TOLERANCE, Traffic, report
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
    """Outside no_sync, once p.grad holds this backward's local gradient of p.

    What the state means: p._accumulated_grad is None, or this rank's sum of the gradients
    that no_sync kept since the window began; p._reduced_grad, on the owner, is what the
    owner will step with (None until something arrives). Both start the window as None.

    When the window's last backward is done, the owner's p._reduced_grad must be the
    average over the ranks of the whole window's gradient of p: with the earlier
    micro-batches inside no_sync, and with none of them inside it (then every micro-batch
    calls this). One collective per call.
    """
    raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")


class OwnerGradients:
    """The gradient side of dmuon on a replicated model: a hook per matrix, and no_sync."""

    def __init__(self, dedicated, owners):
        self.in_no_sync = False
        self.grad_left_set = False  # merge_and_reduce left a gradient in p.grad
        for name, p in dedicated.items():
            p._accumulated_grad = p._reduced_grad = None
            p.register_post_accumulate_grad_hook(lambda p, owner=owners[name]: self.on_grad(p, owner))

    def on_grad(self, p, owner):
        if self.in_no_sync:
            accumulate_locally(p)
        else:
            merge_and_reduce(p, owner)
            self.grad_left_set |= p.grad is not None

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
    """Train with and without no_sync through the hooks; grade the owners' gradients, the reduces, and what the
    hook leaves in p.grad."""
    problem = Problem()
    last_only = problem.last_microbatch_gradients()  # what an owner steps with at step 1 if only the last arrived
    runs = {"no_sync on the first N-1": True, "no no_sync": False}
    rows, differences, measurements, only_the_last, grad_left_set = {}, [], {}, {}, False
    for label, use_no_sync in runs.items():
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
            if len(gradient_differences) == 1:  # at step 1 the parameters are still the reference's
                only_the_last[label] = owner_gradient_difference(stepped_with, last_only) < ADAMW_TOLERANCE
            difference = max_parameter_difference(model.parameters(), expected.parameters)
            parameter_differences.append(max(per_rank(difference)))
            model.zero_grad()
            for p in dedicated.values():  # what dmuon's optimizer.zero_grad() does too
                p._reduced_grad = p._accumulated_grad = None
        grad_left_set |= any(per_rank(hooks.grad_left_set))
        steps = problem.n_windows
        rows[f"reduce, {label}"] = (counts.calls["reduce"] // steps, counts.bytes["reduce"] // steps)
        differences.append([max(pair) for pair in zip(parameter_differences, gradient_differences)])
        measurements[f"gradient differences, {label}"] = gradient_differences

    p_m = sum(p.numel() * p.element_size() for p in dedicated.values())
    distributed.print0(f"P_M = {p_m} bytes, N = {problem.accum_steps} micro-batches per optimizer step")
    n, matrices = problem.accum_steps, len(dedicated)
    # Each known mistake by what it leaves behind: checked in this order, the first that fits names it.
    if grad_left_set:
        hint = ("merge_and_reduce left a gradient in p.grad: the next backward adds into it, so a micro-batch "
                "already sent is sent again")
    elif only_the_last["no no_sync"]:
        hint = ("without no_sync every micro-batch's reduce arrives on its own, and the owner kept only the last: "
                "add each arrival into p._reduced_grad")
    elif only_the_last["no_sync on the first N-1"]:
        hint = ("the gradients no_sync kept in p._accumulated_grad never left their rank, so the owner received only "
                "the last micro-batch's: merge them into this backward's gradient before the reduce")
    else:
        hint = ("an owner stepped with the wrong gradient: at the window's end its p._reduced_grad must be the "
                "ranks' average of the whole window's gradient")
    mistake = "one reduce per matrix in each backward outside no_sync, none inside it"
    return report(
        "06_no_sync_merge",
        [max(step) for step in zip(*differences)],
        rows,
        hint=hint,
        measurements={"P_M": p_m, **measurements},
        traffic=(Traffic("reduce, no_sync on the first N-1", matrices, p_m, mistake),
                 Traffic("reduce, no no_sync", n * matrices, n * p_m, mistake)),
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
