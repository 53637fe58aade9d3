"""Module 5a, exercise 1: data-parallel accumulation by hand, one collective per window.

Each rank runs the window's micro-batches on its share of the data, exactly
as on one device (loss / N, backward, no step). The ranks' gradients then
differ: each saw other samples. Their average over the ranks is the gradient
of the whole global batch, and it is enough to take it once per window, after
the last backward, because averaging and accumulating commute.

Usage: torchrun --nproc-per-node=2 05_allreduce_by_hand.py [results.json]
"""

import torch
import torch.distributed as dist

from dmuon_edu import distributed
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import Problem, Traffic, report


def average_gradients(model):
    """Make every p.grad of ``model`` hold the average over the ranks of that parameter's gradient, in place.

    When it returns, every rank holds the same p.grad. The whole window may cost one
    collective call, carrying each gradient byte once.
    """
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
    gradient, whether average_gradients changed the gradients at all, and the traffic."""
    problem = Problem()
    model = problem.model()
    optimizer = problem.optimizer(model.parameters())
    differences, ratios, unchanged = [], [], []
    with distributed.count_collectives() as counts:
        for window, (gradients, expected) in zip(problem.windows(), problem.reference_steps()):
            optimizer.zero_grad()
            for batch in window:
                x, y = problem.local(batch, ranks.rank, ranks.world_size)
                (problem.loss_fn(model(x), y) / len(window)).backward()
            local = [p.grad.clone() for p in model.parameters()]
            average_gradients(model)
            unchanged.append(all(p.grad.equal(g) for p, g in zip(model.parameters(), local)))
            ratios.append((norm([p.grad for p in model.parameters()]) / norm(gradients)).item())
            optimizer.step()
            differences.append(max_parameter_difference(model.parameters(), expected))
    steps = len(differences)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    calls, nbytes = counts.calls["all_reduce"] // steps, counts.bytes["all_reduce"] // steps
    # The ranks' gradients differ (each saw other samples), so an average changes every rank's.
    findings = ("average_gradients sent every gradient byte but left p.grad as it was: the sum went into a copy "
                "(torch.cat copies), so write the averaged buffer back into each p.grad",
                ) if nbytes and ranks.world_size > 1 and all(unchanged) else ()
    return report(
        "05_allreduce_by_hand",
        differences,
        {"all_reduce": (calls, nbytes)},
        hint="after average_gradients every p.grad must be the average of the ranks' gradients",
        traffic=(Traffic("all_reduce", 1, gradient_bytes,
                         "all-reduce every gradient byte once per window, all the gradients in one flat buffer"),),
        gradient_ratios=[] if findings else ratios,
        findings=findings,
    )


def norm(tensors):
    return torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]))


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
