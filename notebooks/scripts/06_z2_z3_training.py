"""Module 6b, exercise 2: Z2 against Z3, with and without no_sync: what does each send? A prediction, graded by the run.

The script trains with the loop of dmuon's accumulation guide (``dmuon_problem.guide_loop``:
no_sync around every micro-batch but the last of a window, step and zero_grad after the
last) four ways, each compared with the single-process step after every optimizer step,
and counts the broadcasts and reduces of each:

- Z3 (``reshard_after_forward=True``, dmuon's default) or Z2 (False);
- with dmuon.no_sync, or with a no_sync that does nothing (every backward reduces).

Then the accumulation guide's loop itself, with its optimizer settings (lr=0.02,
adamw_lr=1e-3, Newton-Schulz in its default precision, "auto": bf16 where the CPU
multiplies it natively), for 15 optimizer steps on a stream of batches each rank draws
for itself, as a real dataloader would: its loss must fall.

Usage: torchrun --nproc-per-node=2 06_z2_z3_training.py [results.json]
"""

from contextlib import nullcontext

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dmuon_edu import distributed, dmuon
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import prediction_findings, report
from dmuon_edu.course.timeline import Timeline
from dmuon_edu.course.dmuon_problem import (
    Z2_Z3_REASONS,
    Problem,
    ResidencyProbe,
    dedicated_parameters,
    full_parameters,
    guide_batches,
    guide_loop,
    owner_gradient_difference,
    per_rank,
    prepare,
)

CONFIGS = ("Z3, no_sync", "Z3, no no_sync", "Z2, no_sync", "Z2, no no_sync")


def predicted():
    """Your prediction, before the run: per optimizer step of N = 4 micro-batches, the bytes of broadcast and of
    reduce, as count_comm counts them (every call's whole tensor, on every rank taking part), in units of P_M.

    Returns:
        {config: (broadcast, reduce)} for each config in CONFIGS.
    """
    raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")


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
        gradients = {name: dmuon.record_of(p).reduced_grad for name, p in owned.items()}
        recorded.update({name: None if g is None else g.clone() for name, g in gradients.items()})

    optimizer.register_step_pre_hook(record)
    return recorded


def sync_every_micro_batch(model):
    """A no_sync that does nothing: every backward reduces."""
    return nullcontext()


def measure(ranks):
    """Run the guide's loop under Z2 and Z3, with and without no_sync, then as the guide sets it up: the steps
    against one process, the collectives, what each rank held, and the guide's losses (none of it depends on the
    prediction)."""
    problem = Problem()
    n = problem.accum_steps
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    rows, differences, held_during_forward, total_during_forward, gradients_held, timelines = {}, [], {}, {}, {}, {}
    for config in CONFIGS:
        model = problem.model().to(ranks.device)
        p_m = sum(p.numel() * p.element_size() for p in dedicated_parameters(model).values())
        optimizer = prepare(model, mesh, zero3=config.startswith("Z3"))
        no_sync = dmuon.no_sync if config.endswith(", no_sync") else sync_every_micro_batch
        probe = ResidencyProbe(model)
        stepped_with = record_owner_gradients(model, optimizer)
        counts = distributed.count_collectives()
        config_differences = []
        for step, (window, expected) in enumerate(zip(problem.windows(), problem.baseline())):
            # The second window's timeline: the first one's also holds the optimizer's lazy set-up.
            with counts, Timeline(model.layers) if step == 1 else nullcontext() as timeline:
                guide_loop(model, optimizer, local_batches(problem, [window], ranks), n, no_sync=no_sync)
            if timeline is not None:
                timelines[config] = per_rank(timeline.relative())
            config_differences.append(max(max_parameter_difference(full_parameters(model), expected.parameters),
                                          owner_gradient_difference(stepped_with, expected.gradients)))
        differences.append(config_differences)
        for op in ("broadcast", "reduce"):
            rows[f"{op}, {config}"] = (counts.calls[op] // problem.n_windows, counts.bytes[op] // problem.n_windows)
        held_during_forward[config] = per_rank(probe.peak)
        total_during_forward[config] = per_rank(probe.total_peak)
        gradients_held[config] = per_rank(probe.gradient_peak)

    # The accumulation guide's loop as written: its optimizer settings, 15 optimizer steps of its own stream of batches.
    model = problem.model().to(ranks.device)
    optimizer = prepare(model, mesh, lr=0.02, adamw_lr=1e-3)
    dataloader = ((x.to(ranks.device), y.to(ranks.device)) for x, y in guide_batches(15 * n, ranks.rank))
    guide_losses = guide_loop(model, optimizer, dataloader, n)
    return {"collectives": rows, "differences": [max(step) for step in zip(*differences)],
            "measurements": {"P_M": p_m, "N": n, "world size": ranks.world_size,
                             "dedicated bytes held during a forward, at most": held_during_forward,
                             "dedicated bytes held and in flight during a forward, at most": total_during_forward,
                             "dedicated gradient bytes held during a forward, at most": gradients_held,
                             "timeline of the second window": timelines,
                             "guide loop losses": guide_losses}}


def main(ranks):
    """Measure, then grade predicted() against the bytes counted."""
    run = measure(ranks)
    rows, measured = run["collectives"], run["measurements"]
    p_m, n = measured["P_M"], measured["N"]
    distributed.print0(f"the accumulation guide's loop on {ranks.world_size} ranks, Z3, {n} micro-batches per optimizer step:")
    for step, loss in enumerate(measured["guide loop losses"], start=1):
        # The guide prints .4f; other CPUs, and "auto" taking float32 instead of bf16, move those last digits.
        distributed.print0(f"  step {step}: loss={loss:.2f}")
    distributed.print0(f"Z2 and Z3, with and without no_sync, against the single-process step "
                       f"(P_M = {p_m} bytes, N = {n}):")
    counted = {config: tuple(rows[f"{op}, {config}"][1] / p_m for op in ("broadcast", "reduce")) for config in CONFIGS}
    fields, prediction = ("broadcast / P_M", "reduce / P_M"), predicted()
    findings = prediction_findings(prediction, counted, fields, Z2_Z3_REASONS, tolerance=0.01)
    wire = (ranks.world_size - 1) / ranks.world_size
    if findings and not prediction_findings(prediction, {config: tuple(wire * v for v in values)
                                                         for config, values in counted.items()},
                                            fields, Z2_Z3_REASONS, tolerance=0.01):
        findings = [f"every prediction is {wire:g}x the count: count_comm counts each call's whole tensor once on "
                    f"every rank; what one rank sends over the wire, (W-1)/W of that, comes next"]
    return report(
        "06_z2_z3_training",
        run["differences"],
        rows,
        hint="the given code no longer matches one process: start the script over "
             "(python -m dmuon_edu.course restore 06_z2_z3_training)",
        measurements=measured,
        findings=tuple(findings),
        passed="every prediction matches the bytes counted, and every step equals the single-process full-batch step",
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
