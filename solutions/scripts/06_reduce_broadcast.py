"""Module 6, exercise 1: distributed Muon by hand, ZeRO-1 style: reduce to the owner, step there, broadcast.

Every rank holds the whole model, as in module 5. Each Muon matrix gets one *owner*
rank (dmuon.plan_owners balances the Newton-Schulz work), and only the owner keeps
its momentum and runs Newton-Schulz on it: the optimizer's work and state are split,
the parameters are not (ZeRO stage 1). After the window's backward:

1. reduce: each matrix's gradient is averaged over the ranks onto its owner only;
2. step: each owner runs Muon on its own matrices (no communication);
3. broadcast: each owner sends the new values of its matrices to every rank.

The other parameters (biases, norms, embed, head) are all-reduced and stepped by
AdamW on every rank, as in module 5.

Usage: torchrun --nproc-per-node=2 06_reduce_broadcast.py [results.json]
"""

import torch.distributed as dist

from dmuon_edu import distributed, dmuon
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import ADAMW_TOLERANCE, Traffic, report
from dmuon_edu.course.dmuon_problem import (
    Problem,
    average_over_ranks,
    dedicated_parameters,
    owner_gradient_difference,
    per_rank,
    symmetric_parameters,
)


def reduce_step_broadcast(dedicated, owners, muon):
    """After the window's backward: average each matrix's gradient onto its owner, let the owners step, publish.

    dedicated: {name: parameter} of every Muon matrix, in the same order on every rank.
    owners: {name: owner rank}.
    muon: a Muon optimizer over the matrices this rank owns (it steps those only).

    Use dist.reduce(tensor, dst=..., op=dist.ReduceOp.AVG) and dist.broadcast(tensor, src=...);
    both work in place. After the reduce only the owner's p.grad is meaningful
    (gloo leaves partial sums on the other ranks).
    """
    ### BEGIN SOLUTION
    for name, p in dedicated.items():
        dist.reduce(p.grad, dst=owners[name], op=dist.ReduceOp.AVG)
    muon.step()
    for name, p in dedicated.items():
        dist.broadcast(p.detach(), src=owners[name])
    ### END SOLUTION


def main(ranks):
    """Train with reduce_step_broadcast after each window; grade the owners' gradients, every copy and the traffic."""
    problem = Problem()
    model = problem.model()
    dedicated = dedicated_parameters(model)
    owners = dmuon.plan_owners({name: tuple(p.shape) for name, p in dedicated.items()}, ranks.world_size)
    owned = {name: p for name, p in dedicated.items() if owners[name] == ranks.rank}
    muon = problem.muon(owned.values())
    symmetric = symmetric_parameters(model)
    adamw = problem.optimizer(symmetric)

    parameter_differences, gradient_differences = [], []
    counts = distributed.count_collectives()
    for window, expected in zip(problem.windows(), problem.baseline()):
        model.zero_grad()
        with counts:
            for batch in window:
                (model(problem.local(batch, ranks.rank, ranks.world_size)).loss / len(window)).backward()
            average_over_ranks(symmetric)
            reduce_step_broadcast(dedicated, owners, muon)
            adamw.step()
        stepped_with = {name: p.grad for name, p in owned.items()}
        gradient_differences.append(owner_gradient_difference(stepped_with, expected.gradients))
        # Each rank compares its own copy: a rank that missed a broadcast still holds old values.
        difference = max_parameter_difference(model.parameters(), expected.parameters)
        parameter_differences.append(max(per_rank(difference)))

    steps = problem.n_windows
    p_m = sum(p.numel() * p.element_size() for p in dedicated.values())
    distributed.print0(f"{len(dedicated)} Muon matrices, P_M = {p_m} bytes, owner of each: {list(owners.values())}")
    # Name the first mistake: at the first step that went wrong, was the owner's gradient already wrong?
    first = next((i for i, pair in enumerate(zip(parameter_differences, gradient_differences))
                  if not max(pair) < ADAMW_TOLERANCE), 0)
    if not gradient_differences[first] < ADAMW_TOLERANCE:
        hint = ("an owner stepped with the wrong gradient: reduce each p.grad to its owner with "
                "dist.reduce(p.grad, dst=owners[name], op=dist.ReduceOp.AVG) before muon.step(). (A sum "
                "instead of an average would hide in the parameters: Newton-Schulz normalises the update's scale)")
    else:
        hint = ("a rank holds stale values: after muon.step(), broadcast each matrix from its owner with "
                "dist.broadcast(p.detach(), src=owners[name])")
    symmetric_bytes = sum(p.numel() * p.element_size() for p in symmetric)
    return report(
        "06_reduce_broadcast",
        [max(pair) for pair in zip(parameter_differences, gradient_differences)],
        {op: (counts.calls[op] // steps, counts.bytes[op] // steps) for op in ("reduce", "broadcast", "all_reduce")},
        hint=hint,
        measurements={
            "P_M": p_m,
            "owners": owners,
            "parameter differences": parameter_differences,
            "gradient differences": gradient_differences,
            "dedicated bytes held between steps": per_rank(sum(p.untyped_storage().nbytes()
                                                                for p in dedicated.values())),
            "owned bytes": per_rank(sum(p.numel() * p.element_size() for p in owned.values())),
        },
        traffic=(
            Traffic("reduce", len(dedicated), p_m,
                    "reduce each matrix's gradient once per window, to its owner alone (dist.reduce, not all_reduce)"),
            Traffic("broadcast", len(dedicated), p_m, "broadcast each matrix once per window, from its owner, after muon.step()"),
            # The symmetric parameters' averaging is the only all_reduce: an all_reduce of the matrices would send
            # every average to every rank, where only its owner needs it.
            Traffic("all_reduce", None, symmetric_bytes,
                    "only the owner needs a matrix's average: dist.reduce(p.grad, dst=owners[name], op=AVG), not all_reduce"),
        ),
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
