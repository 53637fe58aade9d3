"""Every known wrong answer to the torchrun script exercises, fed to their checks in one launch.

    torchrun --nproc-per-node=2 tests/dist/script_mutations.py

Each solution script defines the learner's function and ``main(ranks)``, which grades it.
For every wrong variant below this loads the script afresh, puts the variant in place of
the learner's function, and runs ``main``; rank 0 prints ``MUTATION {json}`` with the
verdict (or the error the variant raised). tests/test_script_checks.py asserts that each
one FAILs with the hint that names its mistake.
"""

import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dmuon_edu import distributed
from dmuon_edu.course.dmuon_problem import broadcast_from_owners

SCRIPTS = Path(__file__).resolve().parents[2] / "solutions" / "scripts"


# --------------------------------------------------------------- 05_allreduce_by_hand: average_gradients
def all_reduce_per_parameter(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def sum_not_divided(model):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))


def not_averaged(model):
    pass


# --------------------------------------------------------------- 05_ddp_no_sync: accumulate_window
def no_no_sync(ddp_model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    for x, y in microbatches:
        (loss_fn(ddp_model(x), y) / len(microbatches)).backward()
    optimizer.step()


def step_inside_no_sync(ddp_model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    with ddp_model.no_sync():
        for x, y in microbatches:
            (loss_fn(ddp_model(x), y) / len(microbatches)).backward()
        optimizer.step()


# --------------------------------------------------------------- 05_fsdp2_accumulation: accumulate_window
def fsdp2_syncs_every_micro_batch(model, optimizer, microbatches, loss_fn, keep_parameters_gathered=False):
    optimizer.zero_grad()
    for x, y in microbatches:
        (loss_fn(model(x), y) / len(microbatches)).backward()
    optimizer.step()


def fsdp2_never_syncs(model, optimizer, microbatches, loss_fn, keep_parameters_gathered=False):
    optimizer.zero_grad()
    for x, y in microbatches:
        model.set_requires_gradient_sync(False)
        (loss_fn(model(x), y) / len(microbatches)).backward()
    optimizer.step()


# --------------------------------------------------------------- 06_z2_z3_training: train
def train_without_no_sync(model, optimizer, dataloader, accum_steps, no_sync=None):
    losses = []
    for i, batch in enumerate(dataloader):
        loss = model(batch).loss / accum_steps
        loss.backward()
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item() * accum_steps)
    return losses


def train_steps_inside_no_sync(model, optimizer, dataloader, accum_steps, no_sync=None):
    from dmuon_edu import dmuon

    losses = []
    for i, batch in enumerate(dataloader):
        with (no_sync or dmuon.no_sync)(model):
            loss = model(batch).loss / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item() * accum_steps)
    return losses


# --------------------------------------------------------------- 06_reduce_broadcast: reduce_step_broadcast
def all_reduce_instead_of_reduce(dedicated, owners, muon):
    for p in dedicated.values():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    muon.step()
    broadcast_from_owners(dedicated, owners)


def summed_not_averaged(dedicated, owners, muon):
    for name, p in dedicated.items():
        dist.reduce(p.grad, dst=owners[name], op=dist.ReduceOp.SUM)
    muon.step()
    broadcast_from_owners(dedicated, owners)


def broadcast_before_step(dedicated, owners, muon):
    for name, p in dedicated.items():
        dist.reduce(p.grad, dst=owners[name], op=dist.ReduceOp.AVG)
    broadcast_from_owners(dedicated, owners)
    muon.step()


# --------------------------------------------------------------- 06_no_sync_merge: merge_and_reduce
def accumulated_not_merged(p, owner):
    g, p.grad = p.grad, None
    p._accumulated_grad = None
    dist.reduce(g, dst=owner, op=dist.ReduceOp.AVG)
    if dist.get_rank() == owner:
        p._reduced_grad = g if p._reduced_grad is None else p._reduced_grad.add_(g)


def stored_not_added(p, owner):
    g, p.grad = p.grad, None
    if p._accumulated_grad is not None:
        g, p._accumulated_grad = p._accumulated_grad.add_(g), None
    dist.reduce(g, dst=owner, op=dist.ReduceOp.AVG)
    if dist.get_rank() == owner:
        p._reduced_grad = g


# --------------------------------------------------------------- 06_owners_only: prepare
def _prepare(model, mesh, fully_shard_first=False, **dedicate_settings):
    from torch.distributed.fsdp import fully_shard

    from dmuon_edu import dmuon
    from dmuon_edu.course.dmuon_problem import ADAMW_LR, MUON_HYPERPARAMETERS, is_dedicated

    def shard():
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    if fully_shard_first:
        shard()
    dmuon.dedicate_params(model, mesh, predicate=is_dedicated, **dedicate_settings)
    if not fully_shard_first:
        shard()
    return dmuon.Muon(model, **MUON_HYPERPARAMETERS, adamw_lr=ADAMW_LR)


def prepare_z2(model, mesh):
    return _prepare(model, mesh, reshard_after_forward=False)


def prepare_fully_shard_first(model, mesh):
    return _prepare(model, mesh, fully_shard_first=True)


MUTATIONS = [
    ("05_allreduce_by_hand", "average_gradients", all_reduce_per_parameter),
    ("05_allreduce_by_hand", "average_gradients", sum_not_divided),
    ("05_allreduce_by_hand", "average_gradients", not_averaged),
    ("05_ddp_no_sync", "accumulate_window", "forward_outside_no_sync"),  # the script's own wrong placement
    ("05_ddp_no_sync", "accumulate_window", no_no_sync),
    ("05_ddp_no_sync", "accumulate_window", step_inside_no_sync),
    ("05_fsdp2_accumulation", "accumulate_window", fsdp2_syncs_every_micro_batch),
    ("05_fsdp2_accumulation", "accumulate_window", fsdp2_never_syncs),
    ("06_reduce_broadcast", "reduce_step_broadcast", all_reduce_instead_of_reduce),
    ("06_reduce_broadcast", "reduce_step_broadcast", summed_not_averaged),
    ("06_reduce_broadcast", "reduce_step_broadcast", broadcast_before_step),
    ("06_no_sync_merge", "merge_and_reduce", accumulated_not_merged),
    ("06_no_sync_merge", "merge_and_reduce", stored_not_added),
    ("06_owners_only", "prepare", prepare_z2),
    ("06_owners_only", "prepare", prepare_fully_shard_first),
    ("06_z2_z3_training", "train", train_without_no_sync),
    ("06_z2_z3_training", "train", train_steps_inside_no_sync),
]


def load(script: str):
    spec = importlib.util.spec_from_file_location(f"mutated_{script}", SCRIPTS / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines; main runs only under __main__
    return module


def main():
    sys.argv = sys.argv[:1]  # the scripts write a results file when given a path: not here
    with distributed.session() as ranks:
        for script, function, variant in MUTATIONS:
            module = load(script)
            wrong = getattr(module, variant) if isinstance(variant, str) else variant
            setattr(module, function, wrong)
            try:
                result = module.main(ranks)
                outcome = {"status": result.status, "message": result.message}
            except RuntimeError as error:
                outcome = {"status": "RAISED", "message": str(error)}
            distributed.barrier()
            distributed.print0("MUTATION " + json.dumps({"script": script, "variant": wrong.__name__, **outcome}))


if __name__ == "__main__":
    main()
