"""Module 6a, exercise 2: owners only (Z3) with dmuon: what does a rank hold? A prediction, graded by the run.

In exercise 1 every rank held every matrix. With dmuon only the owner keeps a Muon
matrix between optimizer steps; the other ranks free their copies and receive it by
broadcast before a layer's forward, free it after, and receive it again for the
layer's backward (Z3, ``reshard_after_forward=True``, the default). Every other
parameter is sharded by FSDP2 (fully_shard) and stepped by AdamW on the shards.
The set-up is the accumulation guide's (``dmuon_problem.prepare``). The script
accumulates without no_sync.

The script measures (``measure``), on each rank, what ``predicted`` asks about: the bytes of Muon
matrices it holds between optimizer steps and when a layer's forward begins, and the
broadcast buffers it has in flight at that moment.

Usage: torchrun --nproc-per-node=2 06_owners_only.py [results.json]
"""

from torch.distributed.device_mesh import init_device_mesh

from dmuon_edu import distributed, dmuon
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import prediction_findings, report
from dmuon_edu.course.dmuon_problem import (
    RESIDENCY_REASONS,
    Problem,
    ResidencyProbe,
    dedicated_parameters,
    full_parameters,
    per_rank,
    prepare,
)


def predicted():
    """Your prediction, before the run, for this model on 2 ranks (3 layers, each with 2 matrices of equal size,
    one owned by each rank), in units of P_M, the bytes of all the Muon matrices.

    Returns:
        {"between steps": what a rank holds of the matrices between optimizer steps,
         "while a layer computes": what it holds when a layer's forward begins, at most,
         "in flight while a layer computes": the broadcast buffers it has in flight then, at most}
    """
    raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")


def measure(ranks):
    """Set up with dmuon's Z3 and accumulate without no_sync: the steps against one process, the collectives, and
    what each rank held (none of it depends on the prediction)."""
    problem = Problem()
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    model = problem.model().to(ranks.device)
    dedicated = dedicated_parameters(model)  # taken before fully_shard: plain tensors
    p_m = sum(p.numel() * p.element_size() for p in dedicated.values())
    optimizer = prepare(model, mesh)
    owners = dmuon.ownership(model)
    probe = ResidencyProbe(model)

    differences, held_between_steps = [], []
    counts = distributed.count_collectives()
    for window, expected in zip(problem.windows(), problem.baseline()):
        with counts:
            for batch in window:
                local = tuple(t.to(ranks.device) for t in problem.local(batch, ranks.rank, ranks.world_size))
                (model(local).loss / len(window)).backward()
            optimizer.step()
            optimizer.zero_grad()
        held_between_steps.append(probe.held_bytes())
        differences.append(max_parameter_difference(full_parameters(model), expected.parameters))

    steps = problem.n_windows
    owned_bytes = sum(p.numel() * p.element_size() for name, p in dedicated.items() if owners[name] == ranks.rank)
    symmetric_shard_bytes = sum(p.to_local().numel() * p.element_size()
                                for name, p in model.named_parameters() if name not in dedicated)
    return {
        "differences": differences,
        "collectives": {op: (counts.calls[op] // steps, counts.bytes[op] // steps)
                        for op in ("broadcast", "reduce", "all_gather", "reduce_scatter")},
        "measurements": {
            "P_M": p_m,
            "N": problem.accum_steps,
            "owners": owners,
            "owned bytes": per_rank(owned_bytes),
            "dedicated bytes held between steps": per_rank(max(held_between_steps)),
            "dedicated bytes held during a forward, at most": per_rank(probe.peak),
            "dedicated bytes in flight during a forward, at most": per_rank(probe.in_flight_peak),
            "dedicated bytes held and in flight during a forward, at most": per_rank(probe.total_peak),
            "AdamW parameter shard bytes": per_rank(symmetric_shard_bytes),
        },
    }


def main(ranks):
    """Measure, then grade predicted() against what each rank held."""
    run = measure(ranks)
    measured, p_m = run["measurements"], run["measurements"]["P_M"]
    distributed.print0(f"{len(measured['owners'])} Muon matrices, P_M = {p_m} bytes, {measured['N']} micro-batches "
                       f"per optimizer step, no no_sync")
    held = {"between steps": measured["dedicated bytes held between steps"],
            "while a layer computes": measured["dedicated bytes held during a forward, at most"],
            "in flight while a layer computes": measured["dedicated bytes in flight during a forward, at most"]}
    for what, per_rank_bytes in held.items():
        distributed.print0(f"{what}: {per_rank_bytes} bytes per rank = {[round(b / p_m, 3) for b in per_rank_bytes]} P_M")
    # The plan is balanced, so every rank holds the same; a prediction is right to 0.01 P_M (2/3 as 0.67).
    fractions = {what: (max(per_rank_bytes) / p_m,) for what, per_rank_bytes in held.items()}
    return report(
        "06_owners_only",
        run["differences"],
        run["collectives"],
        hint="the given code no longer matches one process: start the script over "
             "(python -m dmuon_edu.course restore 06_owners_only)",
        measurements=measured,
        findings=tuple(prediction_findings(predicted(), fractions, ("bytes per rank / P_M",), RESIDENCY_REASONS,
                                           tolerance=0.01)),
        passed="every prediction matches what each rank held, between steps and while a layer computes",
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
