"""A full training step of dmuon against FSDP2 + AdamW and DDP + replicated Muon, as ratios.

    .venv/bin/python benchmarks/bench_step.py           # 2 and 4 CPU ranks; a few minutes on 2 cores

The peer's headline number: N micro-batches of forward and backward, then the
optimizer step, on the same model, in one run per world size, the setups interleaved
(each repeat in a rotated order, so that drift hits all alike); medians of the slowest
rank's time. The model: the course's small GPT (d 256, 4 layers, vocab 256), 8 x 64
tokens per micro-batch per rank, 4 micro-batches per step, the first 3 without gradient
synchronisation in every setup (dmuon.no_sync, FSDP2's set_requires_gradient_sync,
DDP's no_sync).

- FSDP2 + AdamW: fully_shard on each layer and the model, AdamW on everything;
- dmuon Z2 / Z3: dedicated hidden matrices (Muon on their owners), FSDP2 + AdamW on the
  rest, the default schedule (broadcasts prefetched one layer ahead, bucketed reduces);
- dmuon Z3, no prefetch: the same with ``forward_prefetch_depth=0`` (each broadcast issued
  at its own layer, where it is waited for at once);
- DDP + replicated Muon: every rank all-reduces every gradient and runs Muon on every
  matrix;
- DDP + AdamW: the same layout with AdamW on everything;
- dmuon DDP backend: dedicate_params_ddp and replicate, every rank holding the whole
  model; each matrix reduced to its owner, stepped there, broadcast after the step (its
  ratio to DDP + replicated Muon is the one dmuon must win).

"blocked" is the time a rank spends waiting for dmuon's collectives (every wait goes
through the collective-order check's ``waiting``), averaged over ranks, and its share
of the step. On a 2-core CPU gloo's asynchronous work does not overlap compute (both
compete for the same cores), so prefetching shows here as a schedule (tests/test_dmuon.py
proves its order), not as time; the GPU is where it saves time.
"""

import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

REPEATS, MICRO_BATCHES, BATCH, TOKENS = 5, 4, 8, 64
SETUPS = ["FSDP2 + AdamW", "dmuon Z2", "dmuon Z3", "dmuon Z3, no prefetch", "DDP + replicated Muon", "DDP + AdamW",
          "dmuon DDP backend"]


def worker():
    from dmuon_edu import distributed, dmuon, muon
    from dmuon_edu.course.dmuon_problem import is_dedicated
    from dmuon_edu.course.gpt import GPT, GPTConfig
    from dmuon_edu.dmuon.order import CollectiveOrder

    with distributed.session() as ranks:
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        config = GPTConfig(vocab_size=256, block_size=TOKENS, n_layer=4, n_head=4, d_model=256)
        g = torch.Generator().manual_seed(ranks.rank)
        batches = [torch.randint(0, 256, (BATCH, TOKENS + 1), generator=g) for _ in range(MICRO_BATCHES)]

        blocked = [0.0]
        waiting = CollectiveOrder.waiting

        @contextlib.contextmanager
        def timed_waiting(self, event, description):
            start = time.perf_counter()
            try:
                with waiting(self, event, description):
                    yield
            finally:
                blocked[0] += time.perf_counter() - start

        CollectiveOrder.waiting = timed_waiting

        def fresh_gpt():
            torch.manual_seed(0)
            return GPT(config)

        def sharded(model):
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model

        def fsdp_no_sync(model):
            @contextlib.contextmanager
            def block():
                model.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    model.set_requires_gradient_sync(True)
            return block

        def setup(name):
            model = fresh_gpt()
            if name == "FSDP2 + AdamW":
                sharded(model)
                return model, [torch.optim.AdamW(model.parameters(), lr=1e-3)], fsdp_no_sync(model)
            if name == "dmuon DDP backend":
                dmuon.dedicate_params_ddp(model, mesh, is_dedicated)
                dmuon.replicate(model, mesh)
                return model, [dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)], lambda: dmuon.no_sync(model)
            if name.startswith("dmuon"):
                dmuon.dedicate_params(model, mesh, is_dedicated, reshard_after_forward="Z3" in name)
                sharded(model)
                depth = 0 if "no prefetch" in name else 1
                opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, forward_prefetch_depth=depth)
                return model, [opt], lambda: dmuon.no_sync(model)
            ddp = DistributedDataParallel(model)
            if name == "DDP + AdamW":
                return ddp, [torch.optim.AdamW(model.parameters(), lr=1e-3)], ddp.no_sync
            matrices = [p for n, p in model.named_parameters() if is_dedicated(n, p)]
            rest = [p for n, p in model.named_parameters() if not is_dedicated(n, p)]
            return ddp, [muon.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)], ddp.no_sync

        def train_step(model, optimizers, no_sync):
            for j, batch in enumerate(batches):
                with no_sync() if j < MICRO_BATCHES - 1 else contextlib.nullcontext():
                    model(batch[:, :-1], batch[:, 1:]).loss.div(MICRO_BATCHES).backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()

        runs = {name: setup(name) for name in SETUPS}
        for name in SETUPS:
            train_step(*runs[name])  # warm-up
        times = {name: [] for name in SETUPS}
        waits = {name: [] for name in SETUPS}
        for r in range(REPEATS):
            for name in SETUPS[r % len(SETUPS):] + SETUPS[: r % len(SETUPS)]:
                dist.barrier()
                blocked[0] = 0.0
                start = time.perf_counter()
                train_step(*runs[name])
                elapsed = torch.tensor([time.perf_counter() - start, blocked[0]], dtype=torch.float64)
                slowest = elapsed[:1].clone()
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                dist.all_reduce(elapsed, op=dist.ReduceOp.SUM)
                times[name].append(slowest.item())
                waits[name].append(elapsed[1].item() / ranks.world_size)
        reference = statistics.median(times["FSDP2 + AdamW"])
        for name in SETUPS:
            step, wait = statistics.median(times[name]), statistics.median(waits[name])
            blocked_cell = f"{wait * 1e3:.0f} ({wait / step:.0%})" if name.startswith("dmuon") else "-"
            distributed.print0(f"ROW | {ranks.world_size} | {name} | {step * 1e3:.0f} | {blocked_cell} | "
                               f"{step / reference:.2f} |")


def measure(nproc: int) -> list[str]:
    """The table rows ("| W | setup | step ms | blocked ms (share) | ratio to FSDP2 + AdamW |") of one launch."""
    from dmuon_edu.launch import torchrun

    result = torchrun(__file__, nproc=nproc, timeout=900, echo=False)
    return [line[4:] for line in result.stdout(0).splitlines() if line.startswith("ROW ")]


def main():
    from machine import describe

    print(f"{describe()}\nThe course's small GPT (d 256, 4 layers), {MICRO_BATCHES} micro-batches of {BATCH} x {TOKENS} "
          f"tokens per rank; medians of {REPEATS}, slowest rank\n")
    print("| W ranks | setup | step (ms) | blocked on dmuon's collectives (ms, share) | ratio to FSDP2 + AdamW |")
    print("|---|---|---|---|---|")
    for nproc in (2, 4):
        print("\n".join(measure(nproc)), flush=True)


if __name__ == "__main__":
    worker() if "RANK" in os.environ else main()
