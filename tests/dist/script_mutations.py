"""Every known wrong answer to the torchrun script exercises, fed to their checks in one launch.

    torchrun --nproc-per-node=2 tests/dist/script_mutations.py

Each solution script defines the learner's function and ``main(ranks)``, which grades it.
For every wrong variant below this loads the script afresh, puts the variant in place of
the learner's function, and runs ``main``; rank 0 prints ``MUTATION {json}`` with the
verdict (or the error the variant raised). tests/test_script_checks.py asserts that each
one FAILs with the hint that names its mistake.
"""

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dmuon_edu import checkpoint, distributed, dmuon
from dmuon_edu.accumulation import IGNORE_INDEX, accumulation_windows, summed_token_loss
from dmuon_edu.course.dmuon_problem import broadcast_from_owners
from run_scripts import load

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


def train_steps_every_micro_batch(model, optimizer, dataloader, accum_steps, no_sync=None):
    # Every step releases the broadcast copies, so Z2 broadcasts again in every micro-batch.
    losses = []
    for i, batch in enumerate(dataloader):
        loss = model(batch).loss / accum_steps
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if (i + 1) % accum_steps == 0:
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


# --------------------------------------------------------------- 06_save_and_resume: resume
def resume_model_only(model, optimizer, path):
    state = {"model": dmuon.get_model_state_dict(model, dmuon.StateDictOptions())}
    checkpoint.load(state, path)
    dmuon.set_model_state_dict(model, state["model"])


def resume_optimizer_only(model, optimizer, path):
    state = {"optim": dmuon.get_optimizer_state_dict(model, optimizer, dmuon.StateDictOptions())}
    checkpoint.load(state, path)
    dmuon.set_optimizer_state_dict(model, optimizer, state["optim"])


def loaded_but_not_handed_back(model, optimizer, path):
    sharded = dmuon.StateDictOptions()
    checkpoint.load({"model": dmuon.get_model_state_dict(model, sharded),
                     "optim": dmuon.get_optimizer_state_dict(model, optimizer, sharded)}, path)


# --------------------------------------------------------------- 05_token_weighted_ddp: accumulate_window
def _token_window(ddp_model, optimizer, microbatches, loss_of):
    """accumulate_window's steps (no_sync around all but the last micro-batch) with the loss loss_of(loss_sum, targets)."""
    optimizer.zero_grad()
    for i, (tokens, targets) in enumerate(microbatches):
        with contextlib.nullcontext() if i == len(microbatches) - 1 else ddp_model.no_sync():
            loss_sum, _ = summed_token_loss(ddp_model(tokens), targets)
            loss_of(loss_sum, targets).backward()
    optimizer.step()


def _over_ranks(count):
    total = torch.tensor(count)
    dist.all_reduce(total)
    return total


def _real_tokens(targets):
    return int((targets != IGNORE_INDEX).sum())


def token_mean_per_micro_batch(ddp_model, optimizer, microbatches):
    _token_window(ddp_model, optimizer, microbatches,
                  lambda loss_sum, targets: loss_sum / _real_tokens(targets) / len(microbatches))


def token_local_count(ddp_model, optimizer, microbatches):
    count = sum(_real_tokens(targets) for _, targets in microbatches)
    _token_window(ddp_model, optimizer, microbatches, lambda loss_sum, _: loss_sum / count)


def token_average_not_undone(ddp_model, optimizer, microbatches):
    count = _over_ranks(sum(_real_tokens(targets) for _, targets in microbatches))
    _token_window(ddp_model, optimizer, microbatches, lambda loss_sum, _: loss_sum / count)


def token_padding_counted(ddp_model, optimizer, microbatches):
    count = _over_ranks(sum(targets.numel() for _, targets in microbatches))
    _token_window(ddp_model, optimizer, microbatches, lambda loss_sum, _: loss_sum * dist.get_world_size() / count)


# --------------------------------------------------------------- 06_uneven_windows: train
def guide_loop_drops_leftover(model, optimizer, dataloader, accum_steps, no_sync):
    """The loop of dmuon's accumulation guide, with the no_sync it is given."""
    for i, batch in enumerate(dataloader):
        is_accumulating = (i + 1) % accum_steps != 0
        with no_sync(model) if is_accumulating else contextlib.nullcontext():
            loss = model(batch).loss / accum_steps
            loss.backward()
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()


def _uneven_train(model, optimizer, dataloader, accum_steps, no_sync, weight):
    """train's steps (every window, the short one too) with each mean loss times weight(window, batch)."""
    for window in accumulation_windows(dataloader, accum_steps):
        weights = [weight(window, batch) for batch in window]
        for i, (batch, w) in enumerate(zip(window, weights)):
            with contextlib.nullcontext() if i == len(window) - 1 else no_sync(model):
                (model(batch).loss * w).backward()
        optimizer.step()
        optimizer.zero_grad()


def _samples(window):
    return sum(len(x) for x, _ in window)


def equal_weights(model, optimizer, dataloader, accum_steps, no_sync):
    _uneven_train(model, optimizer, dataloader, accum_steps, no_sync, lambda window, _: 1 / len(window))


def short_window_over_accum_steps(model, optimizer, dataloader, accum_steps, no_sync):
    # Each micro-batch weighted within its global micro-batch, and the window taken as accum_steps of them.
    _uneven_train(model, optimizer, dataloader, accum_steps, no_sync,
                  lambda _, batch: len(batch[0]) * dist.get_world_size() / _over_ranks(len(batch[0])) / accum_steps)


def local_sample_count(model, optimizer, dataloader, accum_steps, no_sync):
    _uneven_train(model, optimizer, dataloader, accum_steps, no_sync,
                  lambda window, batch: len(batch[0]) / _samples(window))


def sample_average_not_undone(model, optimizer, dataloader, accum_steps, no_sync):
    _uneven_train(model, optimizer, dataloader, accum_steps, no_sync,
                  lambda window, batch: len(batch[0]) / _over_ranks(_samples(window)))


# --------------------------------------------------------------- 05_bucketed_ddp: BucketedAllReduce
def wait_right_away(model, bucket_bytes):
    class Wrong(load(SCRIPTS / "05_bucketed_ddp.py").BucketedAllReduce):
        def send(self, numel):
            super().send(numel)
            self.in_flight[-1][0].wait()
    return Wrong(model, bucket_bytes)


def all_reduce_every_parameter(model, bucket_bytes):
    class Wrong(load(SCRIPTS / "05_bucketed_ddp.py").BucketedAllReduce):
        def gradient_ready(self, p):
            if self.require_sync:
                self.ready.append(p.grad.view(-1))
                self.send(p.grad.numel())
    return Wrong(model, bucket_bytes)


def _finish_without(wait=True, divide=True):
    """The solution's BucketedAllReduce whose finish() skips its waits, or its division by the world size."""
    class Wrong(load(SCRIPTS / "05_bucketed_ddp.py").BucketedAllReduce):
        def finish(self):
            if self.ready:
                self.send(sum(view.numel() for view in self.ready))
            for work, bucket, views in self.in_flight:
                if wait:
                    work.wait()
                for view, part in zip(views, bucket.split([view.numel() for view in views])):
                    view.copy_(part / dist.get_world_size() if divide else part)
            self.in_flight = []
    return Wrong


def not_waited_before_step(model, bucket_bytes):
    return _finish_without(wait=False)(model, bucket_bytes)


def bucket_sum_not_divided(model, bucket_bytes):
    return _finish_without(divide=False)(model, bucket_bytes)


def sends_every_micro_batch(model, bucket_bytes):
    class Wrong(load(SCRIPTS / "05_bucketed_ddp.py").BucketedAllReduce):
        def gradient_ready(self, p):
            self.require_sync = True
            super().gradient_ready(p)
    return Wrong(model, bucket_bytes)


# --------------------------------------------------------------- 05_zero1_adamw: ShardedAdamW, shard_bounds
def full_state_on_every_rank(params, adamw):
    class Wrong(load(SCRIPTS / "05_zero1_adamw.py").ShardedAdamW):
        def __init__(self, params, adamw):
            super().__init__(params, adamw)
            self.inner = adamw(self.params)

        def step(self):
            for p in self.params:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            self.inner.step()
    return Wrong(params, adamw)


def _zero1_step(all_gather=True, average=True):
    """The solution's step, without its all-gather (each rank keeps its own shard's update only) or its 1/N."""
    script = load(SCRIPTS / "05_zero1_adamw.py")

    class Wrong(script.ShardedAdamW):
        def step(self):
            self.shard.grad = torch.empty_like(self.shard)
            dist.reduce_scatter_single(self.shard.grad, script.flatten([p.grad for p in self.params], self.padded))
            if average:
                self.shard.grad /= dist.get_world_size()
            self.inner.step()
            flat = script.flatten([p.detach() for p in self.params], self.padded)
            if all_gather:
                dist.all_gather_single(flat, self.shard.detach())
            else:
                flat[self.start:self.stop] = self.shard.detach()
            with torch.no_grad():
                for p, new in zip(self.params, flat.split([p.numel() for p in self.params])):
                    p.copy_(new.view_as(p))
    return Wrong


def no_all_gather(params, adamw):
    return _zero1_step(all_gather=False)(params, adamw)


def shard_gradient_summed(params, adamw):
    return _zero1_step(average=False)(params, adamw)


def overlapping_shards(numel, rank, world_size):
    size = -(-numel // world_size)
    return rank * (size - 1), rank * (size - 1) + size


MUTATIONS = [
    ("05_allreduce_by_hand", "average_gradients", all_reduce_per_parameter),
    ("05_allreduce_by_hand", "average_gradients", sum_not_divided),
    ("05_allreduce_by_hand", "average_gradients", not_averaged),
    ("05_ddp_no_sync", "accumulate_window", "forward_outside_no_sync"),  # the script's own wrong placement
    ("05_ddp_no_sync", "accumulate_window", no_no_sync),
    ("05_ddp_no_sync", "accumulate_window", step_inside_no_sync),
    ("05_fsdp2_accumulation", "accumulate_window", fsdp2_syncs_every_micro_batch),
    ("05_fsdp2_accumulation", "accumulate_window", fsdp2_never_syncs),
    ("05_bucketed_ddp", "BucketedAllReduce", wait_right_away),
    ("05_bucketed_ddp", "BucketedAllReduce", all_reduce_every_parameter),
    ("05_bucketed_ddp", "BucketedAllReduce", not_waited_before_step),
    ("05_bucketed_ddp", "BucketedAllReduce", bucket_sum_not_divided),
    ("05_bucketed_ddp", "BucketedAllReduce", sends_every_micro_batch),
    ("05_zero1_adamw", "ShardedAdamW", full_state_on_every_rank),
    ("05_zero1_adamw", "ShardedAdamW", no_all_gather),
    ("05_zero1_adamw", "ShardedAdamW", shard_gradient_summed),
    ("05_zero1_adamw", "shard_bounds", overlapping_shards),
    ("06_reduce_broadcast", "reduce_step_broadcast", all_reduce_instead_of_reduce),
    ("06_reduce_broadcast", "reduce_step_broadcast", summed_not_averaged),
    ("06_reduce_broadcast", "reduce_step_broadcast", broadcast_before_step),
    ("06_no_sync_merge", "merge_and_reduce", accumulated_not_merged),
    ("06_no_sync_merge", "merge_and_reduce", stored_not_added),
    ("06_owners_only", "prepare", prepare_z2),
    ("06_owners_only", "prepare", prepare_fully_shard_first),
    ("06_z2_z3_training", "train", train_without_no_sync),
    ("06_z2_z3_training", "train", train_steps_inside_no_sync),
    ("06_z2_z3_training", "train", train_steps_every_micro_batch),
    ("06_save_and_resume", "resume", resume_model_only),
    ("06_save_and_resume", "resume", resume_optimizer_only),
    ("06_save_and_resume", "resume", loaded_but_not_handed_back),
    ("05_token_weighted_ddp", "accumulate_window", token_mean_per_micro_batch),
    ("05_token_weighted_ddp", "accumulate_window", token_local_count),
    ("05_token_weighted_ddp", "accumulate_window", token_average_not_undone),
    ("05_token_weighted_ddp", "accumulate_window", token_padding_counted),
    ("06_uneven_windows", "train", guide_loop_drops_leftover),
    ("06_uneven_windows", "train", equal_weights),
    ("06_uneven_windows", "train", short_window_over_accum_steps),
    ("06_uneven_windows", "train", local_sample_count),
    ("06_uneven_windows", "train", sample_average_not_undone),
]


def main():
    sys.argv = sys.argv[:1]  # the scripts write a results file when given a path: not here
    with distributed.session() as ranks:
        for script, function, variant in MUTATIONS:
            module = load(SCRIPTS / f"{script}.py")
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
