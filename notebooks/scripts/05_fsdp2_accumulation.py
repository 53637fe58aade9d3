"""Module 5, exercise 3: FSDP2 with accumulation, set_requires_gradient_sync and set_reshard_after_backward.

fully_shard splits every parameter over the ranks. A layer's forward first
all-gathers its full parameters; its backward reduce-scatters the gradient so
that each rank keeps only its shard. With accumulation, that reduce-scatter
happens on every micro-batch by default.

- `model.set_requires_gradient_sync(False)` skips it: each rank keeps the
  *unsharded* gradient and adds into it; the last micro-batch (with sync back
  on) reduce-scatters the sum once. Less communication, more memory.
- `model.set_reshard_after_backward(False)` also keeps the gathered parameters
  between micro-batches, saving the all-gathers of the following forwards.
FSDP2 modules have no no_sync(); these two switches are its equivalent.

Usage: torchrun --nproc-per-node=2 05_fsdp2_accumulation.py [results.json]
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_edu import distributed
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import Problem, Traffic, report


def accumulate_window(model, optimizer, microbatches, loss_fn, keep_parameters_gathered=False):
    """One optimizer step; gradients are reduce-scattered once, on the last micro-batch."""
    optimizer.zero_grad()
    for i, (x, y) in enumerate(microbatches):
        is_last = i == len(microbatches) - 1
        raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")
        if keep_parameters_gathered:
            model.set_reshard_after_backward(is_last)
        (loss_fn(model(x), y) / len(microbatches)).backward()
    optimizer.step()


def sync_every_microbatch(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    for x, y in microbatches:
        (loss_fn(model(x), y) / len(microbatches)).backward()
    optimizer.step()


VARIANTS = {
    "reduce-scatter every micro-batch": sync_every_microbatch,
    "gradient sync on the last only": lambda *args: accumulate_window(*args),
    "... and parameters kept gathered": lambda *args: accumulate_window(*args, keep_parameters_gathered=True),
}
LEARNERS = ["gradient sync on the last only", "... and parameters kept gathered"]  # the rows accumulate_window makes

def main(ranks):
    """Train three ways (the default, and accumulate_window with and without keeping parameters
    gathered); grade accumulate_window's numbers and reduce-scatters."""
    problem = Problem()
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    rows, differences = {}, {}
    for label, window_step in VARIANTS.items():
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
                window_step(model, optimizer, local, problem.loss_fn)
            full = [p.full_tensor() for p in model.parameters()]  # a collective itself: outside the count
            differences[label].append(max_parameter_difference(full, expected))
        steps = problem.n_windows
        for op in ("all_gather", "reduce_scatter"):
            rows[f"{op}, {label}"] = (counts.calls[op] // steps, counts.bytes[op] // steps)
    # What each rank keeps between micro-batches: its gradient shard after a reduce-scatter, the
    # whole gradient when the reduce-scatter is skipped (FSDP2 holds it internally until the window ends).
    sharded = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    unsharded = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = sum(isinstance(layer, torch.nn.Linear) for layer in model)
    distributed.print0(f"{problem.accum_steps} micro-batches per optimizer step, {ranks.world_size} ranks")
    distributed.print0(f"gradient bytes a rank keeps between micro-batches: {sharded} with sync (its shard), "
                       f"{unsharded} without (the whole gradient)")
    mistake = ("the gradients were reduce-scattered in more than the window's last backward (or in none): call "
               "model.set_requires_gradient_sync(is_last) before each micro-batch's forward")
    return report(
        "05_fsdp2_accumulation",
        [max(differences[label][step] for label in LEARNERS) for step in range(problem.n_windows)],
        rows,
        hint="call model.set_requires_gradient_sync(is_last) before each micro-batch's forward",
        measurements={"gradient bytes kept between micro-batches": {"with sync": sharded, "without sync": unsharded}},
        # One reduce-scatter per fully_shard-ed layer, of its whole gradient, once per window.
        traffic=tuple(Traffic(f"reduce_scatter, {label}", layers, unsharded, mistake) for label in LEARNERS),
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
