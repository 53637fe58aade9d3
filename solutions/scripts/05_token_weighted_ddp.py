"""Module 5c, exercise: token-weighted accumulation under DDP.

A language model's loss averages over tokens. Each rank holds micro-batches of padded
sequences, and every rank and every micro-batch holds a different number of real
(non-padding) tokens. One optimizer step must equal one step of a single process that
sees every rank's sequences of the window as one batch: the sum of the per-token losses
over the window's real tokens on all ranks, divided by their count.

accumulate_window gets this rank's micro-batches of (tokens, targets), with targets
IGNORE_INDEX at padding. summed_token_loss(logits, targets) returns a micro-batch's
summed loss and its count of real tokens. DDP averages the ranks' gradients.

Usage: torchrun --nproc-per-node=2 05_token_weighted_ddp.py [results.json]
"""

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dmuon_edu import distributed
from dmuon_edu.accumulation import IGNORE_INDEX, summed_token_loss
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import TokenProblem, flat_gradient, report, weighting_findings


def accumulate_window(ddp_model, optimizer, microbatches):
    """One optimizer step over this rank's micro-batches, every real token of the window (all ranks) weighted equally."""
    optimizer.zero_grad()
    ### BEGIN SOLUTION
    # The divisor must be known before the first backward: count this rank's real tokens, add the ranks' counts.
    count = torch.tensor(sum(int((targets != IGNORE_INDEX).sum()) for _, targets in microbatches))
    dist.all_reduce(count)
    for i, (tokens, targets) in enumerate(microbatches):
        with contextlib.nullcontext() if i == len(microbatches) - 1 else ddp_model.no_sync():
            loss_sum, _ = summed_token_loss(ddp_model(tokens), targets)
            # DDP divides the ranks' summed gradients by the world size: multiply by it, so count divides once.
            (loss_sum * dist.get_world_size() / count).backward()
    ### END SOLUTION
    optimizer.step()


def main(ranks):
    """Train with accumulate_window; grade its parameters, the gradient of every step and its all-reduces."""
    problem = TokenProblem()
    reference = problem.reference_steps(ranks.world_size)
    model = DDP(problem.model())
    optimizer = problem.optimizer(model.parameters())
    stepped = []
    optimizer.register_step_pre_hook(lambda *_: stepped.append(flat_gradient(model.module.parameters()).clone()))
    differences = []
    with distributed.count_collectives() as counts:
        for window, expected in zip(problem.windows(ranks.world_size), reference):
            accumulate_window(model, optimizer, [batch[ranks.rank] for batch in window])
            differences.append(max_parameter_difference(model.module.parameters(), expected.parameters))
    calls = counts.calls["all_reduce"] / problem.n_windows
    distributed.print0(f"{problem.accum_steps} micro-batches per optimizer step, {ranks.world_size} ranks; "
                       f"all_reduce calls per optimizer step: {calls:g}")
    # The model's gradients fit DDP's first bucket: one all_reduce for them, one for the count.
    traffic = () if calls == 2 else (
        f"all_reduce ran {calls:g} time{'s' * (calls != 1)} per optimizer step where 2 do (the token count once, the gradients once, "
        "in the window's last backward): count the window's tokens once, before its first backward, and run every "
        "micro-batch but the last inside ddp_model.no_sync()",)
    return report(
        "05_token_weighted_ddp",
        differences,
        {"all_reduce": (counts.calls["all_reduce"] // problem.n_windows, counts.bytes["all_reduce"] // problem.n_windows)},
        hint="divide each micro-batch's summed token loss by the window's count of real tokens on all ranks, "
             "times the world size",
        findings=weighting_findings({"DDP": (stepped, reference)}) + traffic,
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
