"""Module 6, exercise 4: the accumulation guide's training loop, under Z2 and Z3, with and without no_sync.

The loop of dmuon's gradient-accumulation guide (its "Gradient Accumulation" page): every micro-batch but
the last of a window runs forward and backward inside dmuon.no_sync(model); the last
runs outside it, which reduces everything accumulated; then optimizer.step() and
optimizer.zero_grad().

The script runs that loop four ways, each compared with the single-process step
after every optimizer step, and counts what each sends:

- Z3 (reshard_after_forward=True): broadcast before each layer's forward and again
  before its backward, 2k * P_M per step;
- Z2 (False): broadcast once, at the window's first forward, 1 * P_M per step;
- reduce: 1 * P_M per step with no_sync, k * P_M without.

Then the accumulation guide's loop itself, with its optimizer settings (lr=0.02, adamw_lr=1e-3,
Newton-Schulz in its default precision, "auto": bf16 where the CPU multiplies it natively), for 15 optimizer steps on a stream of batches each rank
draws for itself, as a real dataloader would: its loss must fall.

Usage: torchrun --nproc-per-node=2 06_z2_z3_training.py [results.json]
"""

from contextlib import nullcontext

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_edu import distributed, dmuon
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import Traffic, report
from dmuon_edu.course.timeline import Timeline
from dmuon_edu.course.dmuon_problem import (
    ADAMW_LR,
    MUON_HYPERPARAMETERS,
    Problem,
    ResidencyProbe,
    dedicated_parameters,
    full_parameters,
    is_dedicated,
    owner_gradient_difference,
    per_rank,
    guide_batches,
)


def train(model, optimizer, dataloader, accum_steps, no_sync=dmuon.no_sync):
    """The accumulation guide's loop over the micro-batches of ``dataloader``; return the loss of each optimizer step.

    A step's loss is its last micro-batch's, times accum_steps (as the guide prints it).
    Call ``no_sync(model)`` where the guide calls ``dmuon.no_sync(model)``: the script
    also passes a no_sync that does nothing, to measure what no_sync saves.
    """
    losses = []
    ### BEGIN SOLUTION
    for i, batch in enumerate(dataloader):
        is_accumulating = (i + 1) % accum_steps != 0
        ctx = no_sync(model) if is_accumulating else nullcontext()

        with ctx:
            loss = model(batch).loss / accum_steps
            loss.backward()

        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item() * accum_steps)
    ### END SOLUTION
    return losses


def prepare(model, mesh, zero3, **optimizer_settings):
    dmuon.dedicate_params(model, mesh, predicate=is_dedicated, reshard_after_forward=zero3)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return dmuon.Muon(model, **optimizer_settings)


def local_batches(problem, windows, ranks):
    """This rank's share of each micro-batch, in order: the stream a dataloader would give."""
    return [tuple(t.to(ranks.device) for t in problem.local(batch, ranks.rank, ranks.world_size))
            for window in windows for batch in window]


def record_owner_gradients(model, optimizer):
    """{name: the gradient this rank's owned matrix last stepped with}, kept up to date by a step pre-hook."""
    owners = dmuon.ownership(model)
    owned = {name: p for name, p in dedicated_parameters(model).items() if owners[name] == dist.get_rank()}
    recorded = dict.fromkeys(owned)

    def record(_optimizer, _args, _kwargs):
        recorded.update({name: None if p._reduced_grad is None else p._reduced_grad.clone()
                         for name, p in owned.items()})

    optimizer.register_step_pre_hook(record)
    return recorded


def sync_every_micro_batch(model):
    """A no_sync that does nothing: every backward reduces."""
    return nullcontext()


def main(ranks):
    """Run train under Z2 and Z3, with and without no_sync, then the guide's loop; grade train."""
    problem = Problem()
    k = problem.accum_steps
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    rows, differences, held_during_forward, gradients_held, timelines = {}, [], {}, {}, {}
    for zero3 in (True, False):
        for label, no_sync in [("no_sync", dmuon.no_sync), ("no no_sync", sync_every_micro_batch)]:
            config = f"{'Z3' if zero3 else 'Z2'}, {label}"
            model = problem.model().to(ranks.device)
            p_m = sum(p.numel() * p.element_size() for p in dedicated_parameters(model).values())
            optimizer = prepare(model, mesh, zero3, **MUON_HYPERPARAMETERS, adamw_lr=ADAMW_LR)
            probe = ResidencyProbe(model)
            stepped_with = record_owner_gradients(model, optimizer)
            counts = distributed.count_collectives()
            config_differences = []
            for step, (window, expected) in enumerate(zip(problem.windows(), problem.baseline())):
                # The second window's timeline: the first one's also holds the optimizer's lazy set-up.
                with counts, Timeline(model.layers) if step == 1 else nullcontext() as timeline:
                    train(model, optimizer, local_batches(problem, [window], ranks), k, no_sync=no_sync)
                if timeline is not None:
                    timelines[config] = per_rank(timeline.relative())
                config_differences.append(max(max_parameter_difference(full_parameters(model), expected.parameters),
                                              owner_gradient_difference(stepped_with, expected.gradients)))
            differences.append(config_differences)
            for op in ("broadcast", "reduce"):
                rows[f"{op}, {config}"] = (counts.calls[op] // problem.n_windows, counts.bytes[op] // problem.n_windows)
            held_during_forward[config] = per_rank(probe.peak)
            gradients_held[config] = per_rank(probe.gradient_peak)

    # The accumulation guide's loop as written: its optimizer settings, 15 optimizer steps of its own stream of batches.
    model = problem.model().to(ranks.device)
    optimizer = prepare(model, mesh, zero3=True, lr=0.02, adamw_lr=1e-3)
    dataloader = ((x.to(ranks.device), y.to(ranks.device)) for x, y in guide_batches(15 * k, ranks.rank))
    guide_losses = train(model, optimizer, dataloader, k)
    distributed.print0(f"the accumulation guide's loop on {ranks.world_size} ranks, Z3, {k} micro-batches per optimizer step:")
    for step, loss in enumerate(guide_losses, start=1):
        # The guide prints .4f; other CPUs, and "auto" taking float32 instead of bf16, move those last digits.
        distributed.print0(f"  step {step}: loss={loss:.2f}")

    distributed.print0(f"Z2 and Z3, with and without no_sync, against the single-process step "
                       f"(P_M = {p_m} bytes, k = {k}):")
    traffic = []
    for zero3 in (True, False):
        mode = "Z3" if zero3 else "Z2"
        broadcast = 2 * k * p_m if zero3 else p_m  # Z3: before each forward and each backward; Z2: once
        for label, reduced in (("no_sync", p_m), ("no no_sync", k * p_m)):
            traffic += [
                Traffic(f"reduce, {mode}, {label}", None, reduced,
                        "train reduced a different number of times than its no_sync allows: run forward and "
                        "backward of every micro-batch but the window's last inside the no_sync(model) it is "
                        "given, the last outside it"),
                Traffic(f"broadcast, {mode}, {label}", None, broadcast,
                        "the matrices were broadcast more often than once per window (Z2) or twice per "
                        "micro-batch (Z3): call optimizer.step() and zero_grad() once per window, after its last "
                        "micro-batch; each step releases the copies, so the next forward broadcasts again"),
            ]
    return report(
        "06_z2_z3_training",
        [max(step) for step in zip(*differences)],
        rows,
        hint="run forward and backward of every micro-batch but the last inside no_sync(model), divide each loss "
             "by accum_steps (Muon hides a missing division in the parameters, not in the gradient it steps with), "
             "and call optimizer.step() then optimizer.zero_grad() after the last",
        measurements={"P_M": p_m, "k": k, "world size": ranks.world_size,
                      "dedicated bytes held during a forward, at most": held_during_forward,
                      "dedicated gradient bytes held during a forward, at most": gradients_held,
                      "timeline of the second window": timelines,
                      "guide loop losses": guide_losses},
        traffic=tuple(traffic),
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
