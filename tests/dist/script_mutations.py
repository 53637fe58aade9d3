"""Every known wrong answer to the torchrun script exercises, fed to their checks in one launch; then the
learner copies of the scripts, their exercises not done.

    torchrun --nproc-per-node=2 tests/dist/script_mutations.py [LEARNER_SCRIPT.py ...]

Each solution script defines the learner's function and ``main(ranks)``, which grades it.
For every wrong variant below this loads the script afresh, puts the variant in place of
the learner's function (or functions, where a mistake spans two, as a save and its resume),
and runs ``main`` (with SHORT_RUNS' arguments where a script has them); rank 0 prints ``MUTATION {json}`` with the
verdict (or the error the variant raised). Then it runs each learner copy's ``main``, and rank 0
prints ``RAISED <script stem> <exception type on each rank>``: what the grader reads to report
"not attempted" is a NotImplementedError. A prediction's script measures the given code in its
``measure(ranks)``, which neither a prediction nor a learner stub changes (a learner copy's measure
is checked to be the solution's, word for word): it runs once, and its result serves every run of
that script. tests/test_script_checks.py asserts that each wrong one FAILs with the hint that
names its mistake, each honest alternative PASSes, and each learner copy raises NotImplementedError.
"""

import contextlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

from dmuon_edu import checkpoint, distributed, dmuon
from dmuon_edu.accumulation import IGNORE_INDEX, accumulation_windows, summed_token_loss
from dmuon_edu.course.capstone_program import MAX_NORM, ProgramRun
from dmuon_edu.course.dmuon_problem import broadcast_from_owners, guide_loop, per_rank
from dmuon_edu.course.gpt import is_hidden_matrix
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


def sum_left_in_a_copy(model):
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])  # a copy: the gradients never see the sum
    dist.all_reduce(flat)
    flat /= dist.get_world_size()


# --------------------------------------------------------------- 05_ddp_no_sync: predicted
RIGHT_PLACEMENTS = {"backward_inside": (4, True), "forward_and_backward_inside": (1, True),
                    "forward_inside": (1, True), "every_micro_batch_inside": (0, False)}


def no_sync_read_in_backward():
    return RIGHT_PLACEMENTS | {"backward_inside": (1, True), "forward_inside": (4, True)}


def unsynced_ranks_agree():
    return RIGHT_PLACEMENTS | {"every_micro_batch_inside": (0, True)}


def extra_all_reduces_change_the_numbers():
    return RIGHT_PLACEMENTS | {"backward_inside": (4, False)}


# --------------------------------------------------------------- 05_fsdp2_accumulation: accumulate_window
def _fsdp2_window(model, optimizer, microbatches, loss_fn, sync_every, keep_gathered):
    """accumulate_window with the switches chosen whatever the budget."""
    optimizer.zero_grad()
    for i, (x, y) in enumerate(microbatches):
        is_last = i == len(microbatches) - 1
        model.set_requires_gradient_sync(sync_every or is_last)
        if keep_gathered:
            model.set_reshard_after_backward(is_last)
        (loss_fn(model(x), y) / len(microbatches)).backward()
    optimizer.step()


def fsdp2_syncs_every_micro_batch(model, optimizer, microbatches, loss_fn, budget):
    _fsdp2_window(model, optimizer, microbatches, loss_fn, sync_every=True, keep_gathered=False)


def fsdp2_syncs_the_last_whatever_the_budget(model, optimizer, microbatches, loss_fn, budget):
    _fsdp2_window(model, optimizer, microbatches, loss_fn, sync_every=False, keep_gathered=False)


def fsdp2_keeps_gathered_whatever_the_budget(model, optimizer, microbatches, loss_fn, budget):
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    _fsdp2_window(model, optimizer, microbatches, loss_fn, sync_every=budget < parameter_bytes, keep_gathered=True)


def fsdp2_never_syncs(model, optimizer, microbatches, loss_fn, budget):
    optimizer.zero_grad()
    for x, y in microbatches:
        model.set_requires_gradient_sync(False)
        (loss_fn(model(x), y) / len(microbatches)).backward()
    optimizer.step()


# --------------------------------------------------------------- 06_z2_z3_training: predicted
RIGHT_BYTES = {"Z3, no_sync": (8, 1), "Z3, no no_sync": (8, 4), "Z2, no_sync": (1, 1), "Z2, no no_sync": (1, 4)}


def z3_broadcasts_once_per_micro_batch():
    return RIGHT_BYTES | {"Z3, no_sync": (4, 1), "Z3, no no_sync": (4, 4)}


def z2_broadcasts_every_micro_batch():
    return RIGHT_BYTES | {"Z2, no_sync": (4, 1), "Z2, no no_sync": (4, 4)}


def no_sync_reduces_every_micro_batch():
    return RIGHT_BYTES | {"Z3, no_sync": (8, 4), "Z2, no_sync": (1, 4)}


def wire_bytes_predicted():
    return {config: (b / 2, r / 2) for config, (b, r) in RIGHT_BYTES.items()}


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


def packed_per_owner(dedicated, owners, muon):
    """An honest alternative, what dmuon itself does: one reduce and one broadcast per owner, its matrices packed."""
    for owner in sorted(set(owners.values())):
        params = [p for name, p in dedicated.items() if owners[name] == owner]
        flat = torch.cat([p.grad.flatten() for p in params])
        dist.reduce(flat, dst=owner, op=dist.ReduceOp.AVG)
        if dist.get_rank() == owner:
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p))
    muon.step()
    for owner in sorted(set(owners.values())):
        params = [p for name, p in dedicated.items() if owners[name] == owner]
        flat = torch.cat([p.detach().flatten() for p in params])
        dist.broadcast(flat, src=owner)
        for p, values in zip(params, flat.split([p.numel() for p in params])):
            p.detach().copy_(values.view_as(p))


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


def grad_left_set(p, owner):
    g = p.grad  # the reduce works on p.grad itself, and the next backward adds into it
    if p._accumulated_grad is not None:
        g, p._accumulated_grad = p._accumulated_grad.add_(g), None
    dist.reduce(g, dst=owner, op=dist.ReduceOp.AVG)
    if dist.get_rank() == owner:
        p._reduced_grad = g.clone() if p._reduced_grad is None else p._reduced_grad.add_(g)


# --------------------------------------------------------------- 06_owners_only: predicted
RIGHT_RESIDENCY = {"between steps": 1 / 2, "while a layer computes": 2 / 3, "in flight while a layer computes": 1 / 3}


def residency_replicated_at_rest():
    return RIGHT_RESIDENCY | {"between steps": 1.0}


def residency_whole_model_while_computing():
    return RIGHT_RESIDENCY | {"while a layer computes": 1.0}


def residency_without_prefetch():
    return RIGHT_RESIDENCY | {"in flight while a layer computes": 0.0}


def residency_receive_buffers_only():
    return RIGHT_RESIDENCY | {"in flight while a layer computes": 1 / 6}


# --------------------------------------------------------------- 06_save_and_resume: resume
def _sharded(model, optimizer, parts=("model", "optim")):
    sharded = dmuon.StateDictOptions()
    state = {"model": lambda: dmuon.get_model_state_dict(model, sharded),
             "optim": lambda: dmuon.get_optimizer_state_dict(model, optimizer, sharded)}
    return {part: state[part]() for part in parts}


def _step_of(path):
    return int(Path(path).name.removeprefix("step-"))


def resume_model_only(model, optimizer, root):
    state = _sharded(model, optimizer, ("model",))
    checkpoint.load(state, checkpoint.latest(root))
    dmuon.set_model_state_dict(model, state["model"])
    return _step_of(checkpoint.latest(root))


def resume_optimizer_only(model, optimizer, root):
    state = _sharded(model, optimizer, ("optim",))
    checkpoint.load(state, checkpoint.latest(root))
    dmuon.set_optimizer_state_dict(model, optimizer, state["optim"])
    return _step_of(checkpoint.latest(root))


def loaded_but_not_handed_back(model, optimizer, root):
    checkpoint.load(_sharded(model, optimizer), checkpoint.latest(root))
    return _step_of(checkpoint.latest(root))


def _resume_from(model, optimizer, path):
    state = _sharded(model, optimizer)
    checkpoint.load(state, path)
    dmuon.set_model_state_dict(model, state["model"])
    dmuon.set_optimizer_state_dict(model, optimizer, state["optim"])
    return _step_of(path)


def resume_newest_folder(model, optimizer, root):
    return _resume_from(model, optimizer, max(Path(root).iterdir()))  # step-4: its save was cut short


def resume_unmarked_folder(model, optimizer, root):
    # The newest folder, loaded with torch.distributed.checkpoint itself, which reads no marker
    state = _sharded(model, optimizer)
    dcp.load(state, checkpoint_id=max(Path(root).iterdir()))
    dmuon.set_model_state_dict(model, state["model"])
    dmuon.set_optimizer_state_dict(model, optimizer, state["optim"])
    return 4


def resume_first_checkpoint(model, optimizer, root):
    return _resume_from(model, optimizer, min(Path(root).iterdir()))  # step-1: complete, but not the newest


def resume_newest_marked_folder(model, optimizer, root):
    # the newest folder with a COMPLETE marker, step-3, whose files a storage error changed: checkpoint.load refuses it
    newest = max(path for path in Path(root).iterdir() if checkpoint.is_complete(path))
    return _resume_from(model, optimizer, newest)


def resume_damaged_unverified(model, optimizer, root):
    # step-3 again, through torch.distributed.checkpoint, which checks no checksum
    state = _sharded(model, optimizer)
    dcp.load(state, checkpoint_id=Path(root) / "step-3")
    dmuon.set_model_state_dict(model, state["model"])
    dmuon.set_optimizer_state_dict(model, optimizer, state["optim"])
    return 3


def resume_counting_the_saves(model, optimizer, root):
    _resume_from(model, optimizer, checkpoint.latest(root))
    return sum(checkpoint.is_complete(path) for path in Path(root).iterdir())  # 3 folders marked COMPLETE


def resume_step_from_adamw_state(model, optimizer, root):
    # an honest alternative: the step the restored AdamW state counts, not the folder's name
    _resume_from(model, optimizer, checkpoint.latest(root))
    state = dmuon.get_optimizer_state_dict(model, optimizer, dmuon.StateDictOptions())["state"]
    return int(next(entry["step"] for entry in state.values() if "step" in entry))


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
    guide_loop(model, optimizer, dataloader, accum_steps, no_sync)


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


def no_sync_left_out(model, optimizer, dataloader, accum_steps, no_sync):
    # The solution's weights, every window stepped, but every micro-batch synchronises its gradients.
    _uneven_train(model, optimizer, dataloader, accum_steps, lambda _: contextlib.nullcontext(),
                  lambda window, batch: len(batch[0]) * dist.get_world_size() / _over_ranks(_samples(window)))


def zero_grad_every_micro_batch(model, optimizer, dataloader, accum_steps, no_sync):
    for window in accumulation_windows(dataloader, accum_steps):
        count = _over_ranks(_samples(window))
        for i, batch in enumerate(window):
            optimizer.zero_grad()  # clears what the window's earlier micro-batches added
            with contextlib.nullcontext() if i == len(window) - 1 else no_sync(model):
                (model(batch).loss * len(batch[0]) * dist.get_world_size() / count).backward()
        optimizer.step()


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


# --------------------------------------------------------------- 06_time_collectives: slowest_median_seconds
def _timings(call, repeats, warm_up=True, over_ranks=dist.ReduceOp.MAX):
    """Each repeat's time; over_ranks None: this rank's own."""
    if warm_up:
        call()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        if over_ranks is not None:
            dist.all_reduce(elapsed, op=over_ranks)
        times.append(elapsed.item())
    return times


def timer_own_rank(call, repeats):
    return statistics.median(_timings(call, repeats, over_ranks=None))


def timer_fastest_rank(call, repeats):
    return statistics.median(_timings(call, repeats, over_ranks=dist.ReduceOp.MIN))


def timer_mean(call, repeats):
    return statistics.mean(_timings(call, repeats))


def timer_mean_without_warm_up(call, repeats):
    return statistics.mean(_timings(call, repeats, warm_up=False))


def timer_worst_repeat(call, repeats):
    return max(_timings(call, repeats))


def timer_total(call, repeats):
    return sum(_timings(call, repeats))


def timer_best_repeat(call, repeats):
    """Honest: the fastest of the repeats, each the slowest rank's (a common benchmark estimator)."""
    return min(_timings(call, repeats))


# --------------------------------------------------------------- 07_train_capstone: the training program
def _capstone_step(model, optimizer, scheduler, window, *, no_sync=True, scale=True, clip="dmuon",
                   schedule="per step"):
    total = 0.0
    for i, (inputs, targets) in enumerate(window):
        last = i == len(window) - 1
        with dmuon.no_sync(model) if no_sync and not last else contextlib.nullcontext():
            loss = model(inputs, targets).loss / (len(window) if scale else 1)
            loss.backward()
        total += loss.item() / (1 if scale else len(window))
        if schedule == "per micro-batch":
            scheduler.step()
    if clip == "dmuon":
        dmuon.clip_grad_norm_(model, MAX_NORM)
    elif clip == "torch":
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if schedule == "before step":
        scheduler.step()
    optimizer.step()
    if schedule == "per step":
        scheduler.step()
    optimizer.zero_grad()
    return total


def capstone_without_no_sync(model, optimizer, scheduler, window):
    return _capstone_step(model, optimizer, scheduler, window, no_sync=False)


def capstone_loss_not_divided(model, optimizer, scheduler, window):
    return _capstone_step(model, optimizer, scheduler, window, scale=False)


def capstone_torch_clip(model, optimizer, scheduler, window):
    return _capstone_step(model, optimizer, scheduler, window, clip="torch")


def capstone_no_clip(model, optimizer, scheduler, window):
    return _capstone_step(model, optimizer, scheduler, window, clip=None)


def capstone_scheduler_per_micro_batch(model, optimizer, scheduler, window):
    return _capstone_step(model, optimizer, scheduler, window, schedule="per micro-batch")


def capstone_scheduler_before_step(model, optimizer, scheduler, window):
    return _capstone_step(model, optimizer, scheduler, window, schedule="before step")


def capstone_scheduler_never_stepped(model, optimizer, scheduler, window):
    return _capstone_step(model, optimizer, scheduler, window, schedule=None)


def capstone_summed_loss_returned(model, optimizer, scheduler, window):
    return len(window) * _capstone_step(model, optimizer, scheduler, window)


def _capstone_state(model, optimizer):
    sharded = dmuon.StateDictOptions()
    return {"model": dmuon.get_model_state_dict(model, sharded),
            "optim": dmuon.get_optimizer_state_dict(model, optimizer, sharded)}


def capstone_save_without_scheduler(model, optimizer, scheduler, path, step):
    checkpoint.save(_capstone_state(model, optimizer), path, step=step)


def capstone_save_without_step(model, optimizer, scheduler, path, step):
    checkpoint.save({**_capstone_state(model, optimizer), "scheduler": scheduler.state_dict()}, path)


def capstone_resume_without_scheduler(model, optimizer, scheduler, root):
    path = checkpoint.latest(root)
    state = _capstone_state(model, optimizer)
    checkpoint.load(state, path)
    dmuon.set_model_state_dict(model, state["model"])
    dmuon.set_optimizer_state_dict(model, optimizer, state["optim"])
    return _step_of(path)


def _capstone_resume(model, optimizer, scheduler, root, parts=("model", "optim", "scheduler")):
    path = checkpoint.latest(root)
    state = {**_capstone_state(model, optimizer), "scheduler": scheduler.state_dict()}
    checkpoint.load(state, path)
    if "model" in parts:
        dmuon.set_model_state_dict(model, state["model"])
    if "optim" in parts:
        dmuon.set_optimizer_state_dict(model, optimizer, state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return _step_of(path)


def capstone_resume_weights_only(model, optimizer, scheduler, root):
    return _capstone_resume(model, optimizer, scheduler, root, parts=("model",))


def capstone_resume_counting_saves(model, optimizer, scheduler, root):
    _capstone_resume(model, optimizer, scheduler, root)
    return len([path for path in Path(root).iterdir() if checkpoint.is_complete(path)])


def capstone_z2(model, mesh, hyperparameters):
    """Honest: Z2, the matrices kept from the first forward to the step."""
    dmuon.dedicate_params(model, mesh, predicate=is_hidden_matrix, reshard_after_forward=False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return dmuon.Muon(model, **hyperparameters)


def capstone_ddp_backend(model, mesh, hyperparameters):
    """Honest: the DDP backend, every matrix whole on every rank, stepped by its owner."""
    dmuon.dedicate_params_ddp(model, mesh, predicate=is_hidden_matrix)
    dmuon.replicate(model, mesh)
    return dmuon.Muon(model, **hyperparameters)


def capstone_resume_step_from_folder(model, optimizer, scheduler, root):
    """Honest: the step read from the folder's name."""
    return _capstone_resume(model, optimizer, scheduler, root)


def capstone_zero_grad_first(model, optimizer, scheduler, window):
    """Honest: the gradients zeroed at the start of the window, not at its end."""
    optimizer.zero_grad()
    loss = 0.0
    for inputs, targets in window[:-1]:
        with dmuon.no_sync(model):
            micro = model(inputs, targets).loss / len(window)
            micro.backward()
        loss += micro.item()
    inputs, targets = window[-1]
    micro = model(inputs, targets).loss / len(window)
    micro.backward()
    dmuon.clip_grad_norm_(model, MAX_NORM)
    optimizer.step()
    scheduler.step()
    return loss + micro.item()


def capstone_one_no_sync_block(model, optimizer, scheduler, window):
    """Honest: one no_sync block around the first N - 1 micro-batches, the losses summed as a tensor."""
    losses = []
    with dmuon.no_sync(model):
        for inputs, targets in window[:-1]:
            losses.append(model(inputs, targets).loss / len(window))
            losses[-1].backward()
    losses.append(model(*window[-1]).loss / len(window))
    losses[-1].backward()
    dmuon.clip_grad_norm_(model, MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return torch.stack(losses).detach().sum()


def capstone_save_step_in_the_state(model, optimizer, scheduler, path, step):
    """Honest: the step saved in the checkpoint itself, beside the scheduler's state."""
    state = {**_capstone_state(model, optimizer), "scheduler": scheduler.state_dict(), "step": torch.tensor(step)}
    checkpoint.save(state, path, step=step)


def capstone_resume_step_in_the_state(model, optimizer, scheduler, root):
    """Honest: the step read back from the checkpoint's own state."""
    state = {**_capstone_state(model, optimizer), "scheduler": scheduler.state_dict(), "step": torch.tensor(-1)}
    checkpoint.load(state, checkpoint.latest(root))
    dmuon.set_model_state_dict(model, state["model"])
    dmuon.set_optimizer_state_dict(model, optimizer, state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


MUTATIONS = [
    ("05_allreduce_by_hand", "average_gradients", all_reduce_per_parameter),
    ("05_allreduce_by_hand", "average_gradients", sum_not_divided),
    ("05_allreduce_by_hand", "average_gradients", not_averaged),
    ("05_allreduce_by_hand", "average_gradients", sum_left_in_a_copy),
    ("05_ddp_no_sync", "predicted", no_sync_read_in_backward),
    ("05_ddp_no_sync", "predicted", unsynced_ranks_agree),
    ("05_ddp_no_sync", "predicted", extra_all_reduces_change_the_numbers),
    ("05_fsdp2_accumulation", "accumulate_window", fsdp2_syncs_every_micro_batch),
    ("05_fsdp2_accumulation", "accumulate_window", fsdp2_syncs_the_last_whatever_the_budget),
    ("05_fsdp2_accumulation", "accumulate_window", fsdp2_keeps_gathered_whatever_the_budget),
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
    ("06_reduce_broadcast", "reduce_step_broadcast", packed_per_owner),
    ("06_no_sync_merge", "merge_and_reduce", accumulated_not_merged),
    ("06_no_sync_merge", "merge_and_reduce", stored_not_added),
    ("06_no_sync_merge", "merge_and_reduce", grad_left_set),
    ("06_owners_only", "predicted", residency_replicated_at_rest),
    ("06_owners_only", "predicted", residency_whole_model_while_computing),
    ("06_owners_only", "predicted", residency_without_prefetch),
    ("06_owners_only", "predicted", residency_receive_buffers_only),
    ("06_z2_z3_training", "predicted", z3_broadcasts_once_per_micro_batch),
    ("06_z2_z3_training", "predicted", z2_broadcasts_every_micro_batch),
    ("06_z2_z3_training", "predicted", no_sync_reduces_every_micro_batch),
    ("06_z2_z3_training", "predicted", wire_bytes_predicted),
    ("06_save_and_resume", "resume", resume_model_only),
    ("06_save_and_resume", "resume", resume_optimizer_only),
    ("06_save_and_resume", "resume", loaded_but_not_handed_back),
    ("06_save_and_resume", "resume", resume_newest_folder),
    ("06_save_and_resume", "resume", resume_first_checkpoint),
    ("06_save_and_resume", "resume", resume_unmarked_folder),
    ("06_save_and_resume", "resume", resume_newest_marked_folder),
    ("06_save_and_resume", "resume", resume_damaged_unverified),
    ("06_save_and_resume", "resume", resume_counting_the_saves),
    ("06_save_and_resume", "resume", resume_step_from_adamw_state),
    ("05_token_weighted_ddp", "accumulate_window", token_mean_per_micro_batch),
    ("05_token_weighted_ddp", "accumulate_window", token_local_count),
    ("05_token_weighted_ddp", "accumulate_window", token_average_not_undone),
    ("05_token_weighted_ddp", "accumulate_window", token_padding_counted),
    ("06_uneven_windows", "train", guide_loop_drops_leftover),
    ("06_uneven_windows", "train", equal_weights),
    ("06_uneven_windows", "train", short_window_over_accum_steps),
    ("06_uneven_windows", "train", local_sample_count),
    ("06_uneven_windows", "train", sample_average_not_undone),
    ("06_uneven_windows", "train", zero_grad_every_micro_batch),
    ("06_uneven_windows", "train", no_sync_left_out),
    ("06_time_collectives", "slowest_median_seconds", timer_own_rank),
    ("06_time_collectives", "slowest_median_seconds", timer_fastest_rank),
    ("06_time_collectives", "slowest_median_seconds", timer_mean),
    ("06_time_collectives", "slowest_median_seconds", timer_mean_without_warm_up),
    ("06_time_collectives", "slowest_median_seconds", timer_worst_repeat),
    ("06_time_collectives", "slowest_median_seconds", timer_total),
    ("06_time_collectives", "slowest_median_seconds", timer_best_repeat),
    ("07_train_capstone", "train_step", capstone_without_no_sync),
    ("07_train_capstone", "train_step", capstone_loss_not_divided),
    ("07_train_capstone", "train_step", capstone_torch_clip),
    ("07_train_capstone", "train_step", capstone_no_clip),
    ("07_train_capstone", "train_step", capstone_scheduler_per_micro_batch),
    ("07_train_capstone", "train_step", capstone_scheduler_before_step),
    ("07_train_capstone", "train_step", capstone_scheduler_never_stepped),
    ("07_train_capstone", "train_step", capstone_summed_loss_returned),
    ("07_train_capstone", ("save", "resume"), (capstone_save_without_scheduler, capstone_resume_without_scheduler)),
    ("07_train_capstone", "save", capstone_save_without_step),
    ("07_train_capstone", "resume", capstone_resume_weights_only),
    ("07_train_capstone", "resume", capstone_resume_counting_saves),
    # Honest: each function two other ways, three runs (the verdict is named for the last function replaced).
    ("07_train_capstone", ("train_step", "prepare"), (capstone_zero_grad_first, capstone_z2)),
    ("07_train_capstone", ("prepare", "resume"), (capstone_ddp_backend, capstone_resume_step_from_folder)),
    ("07_train_capstone", ("train_step", "save", "resume"),
     (capstone_one_no_sync_block, capstone_save_step_in_the_state, capstone_resume_step_in_the_state)),
]
# A script's main(ranks) runs with these arguments here: the capstone's program on a short run (its
# warm-up, its clipped first steps, a save and a resume), where every known mistake shows.
SHORT_RUNS = {"07_train_capstone": {"run": ProgramRun(steps=12, save_after=8)}}


def measured(module, script, runs, ranks):
    """``module``, a copy of solutions/scripts/<script>.py whose measure() (if it has one) is the solution's, with
    measure() replaced by its result: run once per script, and kept in ``runs``."""
    if hasattr(module, "measure"):
        if script not in runs:
            runs[script] = module.measure(ranks)
        module.measure = lambda ranks, run=runs[script]: run
    return module


def main():
    learner_copies = [Path(arg) for arg in sys.argv[1:]]
    sys.argv = sys.argv[:1]  # the scripts write a results file when given a path: not here
    runs = {}  # a prediction's script: what its measure() ran
    with distributed.session() as ranks:
        for script, function, variant in MUTATIONS:
            module = measured(load(SCRIPTS / f"{script}.py"), script, runs, ranks)
            names, variants = (function, variant) if isinstance(function, tuple) else ((function,), (variant,))
            for name, replacement in zip(names, variants):
                setattr(module, name, replacement)
            variant = variants[-1]
            try:
                result = module.main(ranks, **SHORT_RUNS.get(script, {}))
                outcome = {"status": result.status, "message": result.message}
            except RuntimeError as error:
                outcome = {"status": "RAISED", "message": str(error)}
            distributed.barrier()
            distributed.print0("MUTATION " + json.dumps({"script": script, "variant": variant.__name__, **outcome}))
        for path in learner_copies:
            module = load(path)
            if hasattr(module, "measure"):  # measure() is given code, the solution's: a stub there would not show
                assert inspect.getsource(module.measure) == inspect.getsource(load(SCRIPTS / path.name).measure), path
            try:
                measured(module, path.stem, runs, ranks).main(ranks)
                raised = "nothing"
            except Exception as error:  # the grader's test is the type; anything else is reported as such
                raised = type(error).__name__
            distributed.print0(f"RAISED {path.stem} " + " ".join(per_rank(raised)))


if __name__ == "__main__":
    main()
