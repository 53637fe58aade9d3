"""Module 6, exercise 2: owners only (Z3) with dmuon: the set-up, then what each rank holds and sends.

In exercise 1 every rank held every matrix. With dmuon only the owner keeps a Muon
matrix between optimizer steps; the other ranks free their copies and receive it by
broadcast just before a layer's forward, free it after, and receive it again for the
layer's backward (Z3, ``reshard_after_forward=True``, the default). Every other
parameter is sharded by FSDP2 (fully_shard) and stepped by AdamW on the shards.

The order of the set-up matters: dedicate_params must see the plain model, so that
the fully_shard calls after it leave the dedicated matrices alone.

This script accumulates without no_sync: every micro-batch's backward reduces each
gradient to its owner (exercise 3 fixes that).

Usage: torchrun --nproc-per-node=2 06_owners_only.py [results.json]
"""

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_edu import distributed, dmuon
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import Traffic, report
from dmuon_edu.course.dmuon_problem import (
    ADAMW_LR,
    MUON_HYPERPARAMETERS,
    Problem,
    ResidencyProbe,
    dedicated_parameters,
    full_parameters,
    is_dedicated,
    per_rank,
)


def prepare(model, mesh):
    """Set the model up for dmuon, in the accumulation guide's order, and return its optimizer.

    Dedicate the matrices that is_dedicated(name, p) selects (Z3 is the default), then
    fully_shard each of model.layers and the model itself on the mesh, then build
    dmuon.Muon(model, **MUON_HYPERPARAMETERS, adamw_lr=ADAMW_LR).
    """
    raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")


def main(ranks):
    """Set up with prepare, accumulate without no_sync; grade what each rank sends and holds."""
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
    distributed.print0(f"{len(dedicated)} Muon matrices, P_M = {p_m} bytes, {problem.accum_steps} micro-batches "
                       f"per optimizer step, no no_sync")
    k, held = problem.accum_steps, max(held_between_steps)
    # Between steps a rank holds exactly the matrices it owns: every rank's copies of the others are gone.
    held_per_rank, owned_per_rank = per_rank(held), per_rank(owned_bytes)
    findings = () if held_per_rank == owned_per_rank else (
        f"between optimizer steps the ranks held {held_per_rank} bytes of Muon matrices where they own "
        f"{owned_per_rank}: non-owners must not keep copies; dedicate_params(model, mesh, predicate=is_dedicated) "
        "before any fully_shard",)
    return report(
        "06_owners_only",
        differences,
        {op: (counts.calls[op] // steps, counts.bytes[op] // steps)
         for op in ("broadcast", "reduce", "all_gather", "reduce_scatter")},
        hint="dedicate_params(model, mesh, predicate=is_dedicated) first, then fully_shard each layer and the model",
        measurements={
            "P_M": p_m,
            "owners": owners,
            "owned bytes": per_rank(owned_bytes),
            "dedicated bytes held between steps": per_rank(max(held_between_steps)),
            "dedicated bytes held during a forward, at most": per_rank(probe.peak),
            "AdamW parameter shard bytes": per_rank(symmetric_shard_bytes),
        },
        traffic=(
            Traffic("broadcast", None, 2 * k * p_m,
                    "Z3 broadcasts every matrix before each layer's forward and again before its backward, "
                    "2k P_M per step: leave reshard_after_forward=True (the default) in dedicate_params"),
            Traffic("reduce", None, k * p_m,
                    "without no_sync every micro-batch reduces every matrix gradient to its owner, k P_M per step"),
        ),
        findings=findings,
    )


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
