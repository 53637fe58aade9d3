"""Module 5a, exercise 3: FSDP2 with accumulation: choose its two switches for a memory budget.

fully_shard splits every parameter over the ranks. A layer's forward first
all-gathers its full parameters, and frees them after the forward
(``reshard_after_forward=True``, its default); its backward gathers them again and
reduce-scatters the gradient, so that each rank keeps only its shard of the
averaged gradient. FSDP2 modules have no no_sync(); they have two switches:

- ``model.set_requires_gradient_sync(False)``: the backward skips the
  reduce-scatter, and each rank keeps the *unsharded* gradient, adding into it,
  until a backward with sync on reduce-scatters the sum;
- ``model.set_reshard_after_backward(False)``: the backward keeps the gathered
  parameters instead of freeing them, so the next forward need not gather them.

Each switch sends fewer bytes for more memory. ``accumulate_window`` gets a
budget: the bytes a rank may keep between micro-batches besides its own shard of
the parameters (gradients, sharded or not, and gathered parameters). The script
runs it at three budgets and counts the all-gathers and reduce-scatters.

Usage: torchrun --nproc-per-node=2 05_fsdp2_accumulation.py [results.json]
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_edu import distributed
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import FSDP2_BUDGETS, Problem, fsdp2_budget_findings, report


def accumulate_window(model, optimizer, microbatches, loss_fn, budget):
    """One optimizer step over the window: the fewest bytes sent that keep at most ``budget`` bytes per rank
    between micro-batches, besides the rank's own shard of the parameters.

    ``model`` is fully_shard-ed, each linear layer and then the whole; its parameters are
    DTensors whose p.numel() is the whole parameter's.
    """
    optimizer.zero_grad()
    raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")
    optimizer.step()


def main(ranks):
    """Train with accumulate_window at each budget; grade its numbers, and its traffic against the budget."""
    problem = Problem()
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    parameter_bytes = sum(p.numel() * p.element_size() for p in problem.model().parameters())
    rows, differences = {}, {}
    for share in FSDP2_BUDGETS:
        label = f"budget {share:g} P"
        model = problem.model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = problem.optimizer(model.parameters())
        differences[label] = []
        counts = distributed.count_collectives()
        for window, expected in zip(problem.windows(), problem.baseline()):
            local = [problem.local(batch, ranks.rank, ranks.world_size) for batch in window]
            with counts:
                accumulate_window(model, optimizer, local, problem.loss_fn, budget=share * parameter_bytes)
            full = [p.full_tensor() for p in model.parameters()]  # a collective itself: outside the count
            differences[label].append(max_parameter_difference(full, expected))
        steps = problem.n_windows
        for op in ("all_gather", "reduce_scatter"):
            rows[f"{op}, {label}"] = (counts.calls[op] // steps, counts.bytes[op] // steps)
    layers = sum(isinstance(layer, torch.nn.Linear) for layer in problem.model())
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    distributed.print0(f"{problem.accum_steps} micro-batches per optimizer step, {ranks.world_size} ranks, "
                       f"P = {parameter_bytes} bytes of parameters (a rank's shard: {shard})")
    return report(
        "05_fsdp2_accumulation",
        [max(differences[label][step] for label in differences) for step in range(problem.n_windows)],
        rows,
        hint="every micro-batch's gradient must reach the step: the window's last backward at least must "
             "reduce-scatter",
        measurements={"parameter bytes": parameter_bytes, "shard bytes": shard},
        findings=fsdp2_budget_findings(rows, parameter_bytes, shard, problem.accum_steps, layers),
        passed="every step equals the single-process full-batch step (3 steps), and at each budget the window "
               "sent the fewest bytes that fit it",
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
