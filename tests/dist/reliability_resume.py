"""Checkpoint and resume across world sizes, and dmuon misuse on several ranks, in few launches.

    torchrun --nproc-per-node=W tests/dist/reliability_resume.py DIR ACTION [ACTION ...]

ACTION is one of (tests/test_reliability.py runs them):

- ``save``: train STEPS optimizer steps without interruption on W ranks; after SAVE_AT
  steps save a checkpoint to DIR/ckpt-wW (dmuon_edu.checkpoint, i.e. dcp.save plus a
  completion marker) and the full (world-size-free) state to DIR/state-wW.pt; at the
  end the full state to DIR/final-wW.pt. Then, in the same launch, resume from that
  checkpoint into a freshly built model and continue: the same world size.
- ``resume:V``: resume from DIR/ckpt-wV (saved on V ranks) on these W ranks: the loaded
  state is compared with DIR/state-wV.pt bit for bit, then training continues and the
  result is compared with DIR/final-wV.pt.
- ``corrupt:V``: a copy of DIR/ckpt-wV with one byte flipped in a file that rank 1 checks
  (the ranks share the checking): every rank must refuse it and change nothing.
- ``misuse``: dmuon misuse that needs several ranks: a mesh that does not span the
  process group, stepping inside no_sync, non-finite gradients on one rank only.

Rank 0 writes one JSON record per check into the file CHECKS_FILE names (check_channel.py). The global batch of every step is the
same whatever the world size (each rank takes a contiguous slice), and Newton-Schulz
runs in float32, so runs on different world sizes differ only by the order of sums.
"""

import contextlib
import json
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import check_channel
from dmuon_edu import checkpoint, distributed, dmuon
from dmuon_edu.course.dmuon_problem import is_dedicated as predicate, per_rank

IN, D, H, OUT, LAYERS = 6, 16, 24, 3, 2
GLOBAL_BATCH, MICRO = 24, 2  # samples per optimizer step; micro-batches per step on each rank
STEPS, SAVE_AT = 5, 2
FULL = dmuon.StateDictOptions(full_state_dict=True, cpu_offload=True)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up_proj = nn.Linear(D, H)
        self.down_proj = nn.Linear(H, D, bias=False)

    def forward(self, x):
        return x + self.down_proj(F.gelu(self.up_proj(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, OUT)  # 3 rows: uneven FSDP2 shards on 2 and 4 ranks

    def forward(self, x):
        for layer in [self.embed, *self.layers]:
            x = layer(x)
        return self.head(x)


def build(mesh, seed=0, ddp=False):
    """The model and its dmuon.Muon and scheduler: FSDP2, or (``ddp``) the DDP backend."""
    torch.manual_seed(seed)
    model = Net()
    if ddp:
        dmuon.dedicate_params_ddp(model, mesh, predicate)
        dmuon.replicate(model, mesh)
    else:
        dmuon.dedicate_params(model, mesh, predicate)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, adamw_lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))
    return model, opt, sched


def train_step(model, opt, sched, step, poison=None):
    """One optimizer step on the global batch of ``step``: this rank's slice, MICRO micro-batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)
    per_rank = GLOBAL_BATCH // world
    x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    if poison == "inf_input" and rank == 1:
        x[0, 0] = float("inf")
    for j, (xs, ys) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
        last = j == MICRO - 1
        with dmuon.no_sync(model) if not last else contextlib.nullcontext():
            loss = F.mse_loss(model(xs), ys, reduction="sum") * world / (GLOBAL_BATCH * OUT)
            loss.backward()
    dmuon.clip_grad_norm_(model, 1.0)
    if poison == "nan_in_one_shard" and rank == 1:  # after clipping, which would spread it to every rank
        grad = model.head.weight.grad.to_local()  # an AdamW shard: only rank 1 sees the NaN
        grad.view(-1)[0] = float("nan")
    opt.step()
    sched.step()
    opt.zero_grad()


def full_state(model, opt, sched):
    """Everything a resume must restore, as full tensors: the same layout at every world size."""
    return {"model": dmuon.get_model_state_dict(model, FULL), "optim": dmuon.get_optimizer_state_dict(model, opt, FULL),
            "scheduler": sched.state_dict()}


def sharded_state(model, opt, sched):
    sharded = dmuon.StateDictOptions()
    return {"model": dmuon.get_model_state_dict(model, sharded), "optim": dmuon.get_optimizer_state_dict(model, opt, sharded),
            "scheduler": sched.state_dict()}


def differences(a, b, path=""):
    """(max |a - b| over tensors, tensors not bit-identical, non-tensor entries that differ)."""
    if isinstance(a, torch.Tensor):
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape and a.numel() else 0.0
        return diff, [] if same else [path], []
    if isinstance(a, dict):
        if set(a) != set(b):
            return 0.0, [], [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        parts = [differences(a[k], b[k], f"{path}/{k}") for k in a]
    elif isinstance(a, (list, tuple)) and len(a) == len(b):
        parts = [differences(x, z, f"{path}/{i}") for i, (x, z) in enumerate(zip(a, b))]
    else:
        return 0.0, [], [] if a == b else [path]
    return (max([p[0] for p in parts], default=0.0), [x for p in parts for x in p[1]], [x for p in parts for x in p[2]])


def report(name, **measured):
    record = {"name": name, "nproc": dist.get_world_size(), **measured}
    if dist.get_rank() == 0:
        check_channel.report(record)
    return record


def resume(mesh, directory, saved_on):
    """A fresh model and optimizer (other seed), filled from the checkpoint saved on ``saved_on`` ranks."""
    model, opt, sched = build(mesh, seed=123)
    state = sharded_state(model, opt, sched)  # a fresh optimizer already holds every entry
    checkpoint.load(state, directory / f"ckpt-w{saved_on}")
    dmuon.set_model_state_dict(model, state["model"])
    dmuon.set_optimizer_state_dict(model, opt, state["optim"])
    sched.load_state_dict(state["scheduler"])
    loaded = full_state(model, opt, sched)
    expected = torch.load(directory / f"state-w{saved_on}.pt", weights_only=False)
    diff_loaded, not_identical, other = differences(loaded, expected)
    for step in range(SAVE_AT, STEPS):
        train_step(model, opt, sched, step)
    final = full_state(model, opt, sched)
    reference = torch.load(directory / f"final-w{saved_on}.pt", weights_only=False)
    diff_final, final_not_identical, final_other = differences(final["model"], reference["model"])
    diff_optim, _, _ = differences(final["optim"], reference["optim"])
    return report(f"resume_w{saved_on}_to_w{dist.get_world_size()}", loaded_max_diff=diff_loaded,
           loaded_not_identical=not_identical, loaded_other_differences=other, final_max_diff=diff_final,
           final_optim_max_diff=diff_optim, final_not_identical=len(final_not_identical),
           final_other_differences=final_other, lr=[g["lr"] for g in opt.param_groups],
           lr_expected=[g["lr"] for g in reference["optim"]["param_groups"]],
           owners=dmuon.ownership(model), finite=all(torch.isfinite(v).all().item() for v in final["model"].values()))


def save(mesh, directory):
    """The uninterrupted run, checkpointed at SAVE_AT on the way; then the same-size resume."""
    world = dist.get_world_size()
    model, opt, sched = build(mesh)
    for step in range(STEPS):
        if step == SAVE_AT:
            checkpoint.save(sharded_state(model, opt, sched), directory / f"ckpt-w{world}", step=SAVE_AT)
            at_save = full_state(model, opt, sched)
            if dist.get_rank() == 0:
                torch.save(at_save, directory / f"state-w{world}.pt")
        train_step(model, opt, sched, step)
    final = full_state(model, opt, sched)
    if dist.get_rank() == 0:
        torch.save(final, directory / f"final-w{world}.pt")
    dist.barrier()
    marker = json.loads((directory / f"ckpt-w{world}" / checkpoint.MARKER).read_text())
    report(f"saved_w{world}", complete=checkpoint.is_complete(directory / f"ckpt-w{world}"), step=marker["step"],
           owners=dmuon.ownership(model))
    resume(mesh, directory, world)


def corrupt(mesh, directory, saved_on):
    """Load a copy of the checkpoint saved on ``saved_on`` ranks with one byte flipped: refused, nothing changed."""
    source, target = directory / f"ckpt-w{saved_on}", directory / f"corrupt-w{saved_on}"
    # The ranks share the checking round-robin over the sorted file names (.metadata first): flip a byte in
    # a file that rank 1 checks, so that rank 0 has to learn of it from rank 1.
    names = sorted(p.name for p in source.iterdir() if p.name != checkpoint.MARKER)
    flipped = names[1::dist.get_world_size()][-1]
    if dist.get_rank() == 0:
        shutil.copytree(source, target)
        with open(target / flipped, "r+b") as f:
            f.seek(f.seek(0, 2) // 2)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0xFF]))
    dist.barrier()
    model, opt, sched = build(mesh, seed=123)
    before = full_state(model, opt, sched)
    error = error_of(lambda: checkpoint.load(sharded_state(model, opt, sched), target))
    _, not_identical, other = differences(before, full_state(model, opt, sched))
    report(f"corrupt_w{saved_on}_on_w{dist.get_world_size()}", flipped=flipped, errors=per_rank(error),
           unchanged=not_identical == [] and other == [])


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported, and asserted on by the test
        return {"type": type(e).__name__, "message": str(e)}
    return None


def misuse(mesh):
    # A mesh over fewer ranks than the process group (init_device_mesh accepts it without a word).
    small = init_device_mesh(mesh.device_type, (1,))
    errors = per_rank(error_of(lambda: dmuon.dedicate_params(Net(), small, predicate)))
    report("misuse_mesh_not_matching_process_group", errors=errors)

    # optimizer.step() inside no_sync.
    model, opt, sched = build(mesh)
    def step_inside_no_sync():
        with dmuon.no_sync(model):
            model(torch.randn(4, IN)).sum().backward()
            opt.step()
    report("misuse_step_inside_no_sync", errors=per_rank(error_of(step_inside_no_sync)))
    opt.zero_grad()

    # Non-finite gradients, on one rank only: every rank skips the step; weights never become NaN. On the DDP
    # backend too, where it used to add a false warning that torch's clip had scaled part of the gradient.
    for poison, ddp in (("inf_input", False), ("nan_in_one_shard", False), ("inf_input", True)):
        model, opt, sched = build(mesh, ddp=ddp)
        train_step(model, opt, sched, 0)
        before = full_state(model, opt, sched)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_step(model, opt, sched, 1, poison=poison)
        after = full_state(model, opt, sched)
        weights_same = differences(before["model"], after["model"])[1] == []
        optim_same = differences(before["optim"]["state"], after["optim"]["state"])[1] == []
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        train_step(model, opt, sched, 2)
        final = full_state(model, opt, sched)
        moved = differences(after["model"], final["model"])[0]
        report(f"misuse_non_finite_gradients_{poison}{'_ddp' if ddp else ''}", warned_every_rank=per_rank(messages),
               skipped_steps=per_rank(opt.skipped_steps), weights_unchanged=weights_same,
               optimizer_state_unchanged=optim_same, next_step_moved=moved,
               finite_after_next_step=all(torch.isfinite(v).all().item() for v in final["model"].values()))


def main():
    directory, actions = Path(sys.argv[1]), sys.argv[2:]
    with distributed.session() as ranks:
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        for action in actions:
            if action == "save":
                save(mesh, directory)
            elif action.startswith("resume:"):
                resume(mesh, directory, int(action.split(":")[1]))
            elif action.startswith("corrupt:"):
                corrupt(mesh, directory, int(action.split(":")[1]))
            elif action == "misuse":
                misuse(mesh)
            else:
                raise ValueError(f"unknown action {action!r}")
        if dist.get_rank() == 0:
            check_channel.done()


if __name__ == "__main__":
    main()
