"""A training step timed as a user would time it: a plain script written from docs/dmuon.md.

    torchrun --nproc-per-node=2 benchmarks/user_step.py          # or 4; run_all.py runs both

Nothing here reaches inside dmuon_edu or patches it: each layout is set up with the calls
docs/dmuon.md shows, and the loop is the accumulation loop of any training script (the
first N-1 micro-batches under the layout's no_sync, then the optimizer step). On 4 ranks, HSDP
too, as (replicate, shard) = (2, 2). The model is
the course's small GPT (d 256, 4 layers, vocab 256), N = 4 micro-batches of 8 x 64 fresh
random tokens per rank at every step. Every setup is built once and warmed up; then each
round runs one step of every setup, in an order rotated by one at each round, so that a
drift of the machine falls on all alike. A step ends when every rank is done with it, its
communication included (a barrier: it waits for the collectives still in flight, such as
the DDP backend's post-step broadcast, which the next step's forward would wait for). The script
prints, per setup, the median step and the interquartile range of its ratio to its AdamW
peer, round by round (benchmarks/run_all.py compares these with bench_step.py's).
"""

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon_edu
from dmuon_edu import distributed, dmuon
from dmuon_edu.course.gpt import GPT, GPTConfig, is_hidden_matrix

MICRO_BATCHES, BATCH, TOKENS = 4, 8, 64
CONFIG = GPTConfig(vocab_size=256, block_size=TOKENS, n_layer=4, n_head=4, d_model=256)
# Each setup beside the AdamW step of its own layout.
PEER = {"dmuon Z2": "FSDP2 + AdamW", "dmuon Z3": "FSDP2 + AdamW", "dmuon DDP backend": "DDP + AdamW",
        "DDP + replicated Muon": "DDP + AdamW", "dmuon HSDP Z3": "HSDP + AdamW"}
SETUPS = ["FSDP2 + AdamW", "dmuon Z2", "dmuon Z3", "DDP + AdamW", "DDP + replicated Muon", "dmuon DDP backend"]
HSDP_SETUPS = ["HSDP + AdamW", "dmuon HSDP Z3"]  # on 4 ranks, as (replicate, shard) = (2, 2)


def fsdp_no_sync(model):
    @contextlib.contextmanager
    def no_sync():  # FSDP2's switch: no reduce-scatter until the last micro-batch
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    return no_sync


def build(name, mesh):
    """(the module to call, the optimizers, the no_sync context of the layout), as docs/dmuon.md sets them up."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if "HSDP" in name:  # a 2-D (replicate, shard) mesh, FSDP2 on both axes, dmuon on the shard axis
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
        if name == "dmuon HSDP Z3":
            dmuon.dedicate_params(model, mesh["shard"], is_hidden_matrix, replicate_mesh=mesh["replicate"])
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if name == "dmuon HSDP Z3":
            return model, [dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)], lambda: dmuon.no_sync(model)
        return model, [torch.optim.AdamW(model.parameters(), lr=1e-3)], fsdp_no_sync(model)
    if name in ("dmuon Z2", "dmuon Z3"):
        dmuon.dedicate_params(model, mesh, is_hidden_matrix, reshard_after_forward=name == "dmuon Z3")
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, [dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)], lambda: dmuon.no_sync(model)
    if name == "dmuon DDP backend":
        dmuon.dedicate_params_ddp(model, mesh, is_hidden_matrix)
        dmuon.replicate(model, mesh)
        return model, [dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)], model.no_sync
    if name == "FSDP2 + AdamW":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, [torch.optim.AdamW(model.parameters(), lr=1e-3)], fsdp_no_sync(model)
    ddp = DistributedDataParallel(model)
    if name == "DDP + AdamW":
        return ddp, [torch.optim.AdamW(model.parameters(), lr=1e-3)], ddp.no_sync
    matrices = [p for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
    others = [p for n, p in model.named_parameters() if not is_hidden_matrix(n, p)]
    return ddp, [dmuon_edu.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=1e-3)], ddp.no_sync


def train_step(model, optimizers, no_sync, tokens):
    for j in range(MICRO_BATCHES):
        batch = tokens()
        with no_sync() if j < MICRO_BATCHES - 1 else contextlib.nullcontext():
            loss = model(batch[:, :-1], batch[:, 1:]).loss / MICRO_BATCHES
            loss.backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def main():
    with distributed.session() as ranks:
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        generator = torch.Generator().manual_seed(ranks.rank)
        tokens = lambda: torch.randint(0, CONFIG.vocab_size, (BATCH, TOKENS + 1), generator=generator)  # noqa: E731
        setups = SETUPS + (HSDP_SETUPS if ranks.world_size == 4 else [])
        runs = {name: build(name, mesh) for name in setups}
        for name in setups:  # warm-up: the first step allocates the optimizer state and FSDP2's buffers
            train_step(*runs[name], tokens)
        seconds = {name: [] for name in setups}
        rounds = 10 if ranks.world_size <= 2 else 7  # a step of 4 ranks on 2 cores takes twice as long
        for r in range(rounds):
            for name in setups[r % len(setups):] + setups[: r % len(setups)]:
                dist.barrier()
                start = time.perf_counter()
                train_step(*runs[name], tokens)
                # The step ends when every rank is done with it, its communication included: the barrier waits
                # for the collectives still in flight (the DDP backend's post-step broadcast) and the slowest rank.
                dist.barrier()
                seconds[name].append(time.perf_counter() - start)
        for name in setups:
            step = statistics.median(seconds[name])
            peer = PEER.get(name)
            ratios = [a / b for a, b in zip(seconds[name], seconds[peer])] if peer else [1.0] * rounds
            low, _, high = statistics.quantiles(ratios, n=4)
            distributed.print0(f"ROW | {ranks.world_size} | {name} | {step * 1e3:.0f} | {peer or '-'} | "
                               f"{statistics.median(ratios):.3f} | {low:.3f} | {high:.3f} |")


if __name__ == "__main__":
    main()
