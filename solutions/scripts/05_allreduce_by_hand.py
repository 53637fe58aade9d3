"""Module 5, exercise 1: data-parallel accumulation by hand, one all_reduce per window.

Each rank runs the window's micro-batches on its share of the data, exactly
as on one device (loss / N, backward, no step). The ranks' gradients then
differ: each saw other samples. Averaging them across ranks gives the gradient
of the whole global batch, and it is enough to do that once per window,
after the last backward, because averaging and accumulating commute.

Usage: torchrun --nproc-per-node=2 05_allreduce_by_hand.py [results.json]
"""

import torch
import torch.distributed as dist

from dmuon_edu import distributed
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import Problem, Traffic, report


def average_gradients(model):
    """Replace every p.grad by its average over all ranks, with a single all_reduce."""
    ### BEGIN SOLUTION
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])  # one buffer: one collective instead of one per tensor
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    for g, averaged in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(averaged.view_as(g))
    ### END SOLUTION


def main(ranks):
    """Train the problem with average_gradients after each window; grade the parameters, the averaged
    gradient and the all_reduce traffic."""
    problem = Problem()
    model = problem.model()
    optimizer = problem.optimizer(model.parameters())
    differences, ratios = [], []
    with distributed.count_collectives() as counts:
        for window, (gradients, expected) in zip(problem.windows(), problem.reference_steps()):
            optimizer.zero_grad()
            for batch in window:
                x, y = problem.local(batch, ranks.rank, ranks.world_size)
                (problem.loss_fn(model(x), y) / len(window)).backward()
            average_gradients(model)
            ratios.append((norm([p.grad for p in model.parameters()]) / norm(gradients)).item())
            optimizer.step()
            differences.append(max_parameter_difference(model.parameters(), expected))
    steps = len(differences)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return report(
        "05_allreduce_by_hand",
        differences,
        {"all_reduce": (counts.calls["all_reduce"] // steps, counts.bytes["all_reduce"] // steps)},
        hint="sum every gradient over the ranks with dist.all_reduce, then divide by the world size",
        traffic=(Traffic("all_reduce", 1, gradient_bytes,
                         "average every gradient once per window, after its last backward, in one flat buffer "
                         "(torch.cat of the flattened gradients): one all_reduce of all the gradient bytes"),),
        gradient_ratios=ratios,
    )


def norm(tensors):
    return torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]))


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
