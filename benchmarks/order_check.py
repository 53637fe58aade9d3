"""What dmuon's collective-order check (dmuon_edu/dmuon/order.py) costs a training step, as a ratio.

    .venv/bin/python benchmarks/order_check.py          # 2 CPU ranks; about a minute

Before each of its collectives and each forward of a layer with dedicated matrices,
every rank makes one store round trip to check that all ranks are at the same event.
Here: a full training step (4 micro-batches, the first 3 under no_sync, then the
optimizer step) of the course's small GPT (d 256, 4 layers, vocab 256, 8 x 64 tokens
per micro-batch per rank), dmuon Z3 and Z2, with the check and with it replaced by a
no-op, interleaved; medians of the slowest rank's time.
"""

import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

REPEATS, MICRO_BATCHES = 9, 4


def worker():
    from dmuon_edu import distributed, dmuon
    from dmuon_edu.course.dmuon_problem import is_dedicated
    from dmuon_edu.course.gpt import GPT, GPTConfig
    from dmuon_edu.dmuon.order import CollectiveOrder

    with distributed.session() as ranks:
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        config = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=256)
        g = torch.Generator().manual_seed(ranks.rank)
        batches = [torch.randint(0, 256, (8, 65), generator=g) for _ in range(MICRO_BATCHES)]
        checked, events = CollectiveOrder.check, {"n": 0}

        def counting(self, description):
            events["n"] += 1
            checked(self, description)

        def train_step(model, opt):
            for j, batch in enumerate(batches):
                with dmuon.no_sync(model) if j < MICRO_BATCHES - 1 else contextlib.nullcontext():
                    model(batch[:, :-1], batch[:, 1:]).loss.div(MICRO_BATCHES).backward()
            opt.step()
            opt.zero_grad()

        for zero3 in (True, False):
            torch.manual_seed(0)
            model = GPT(config)
            dmuon.dedicate_params(model, mesh, is_dedicated, reshard_after_forward=zero3)
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
            CollectiveOrder.check = counting
            train_step(model, opt)  # warm-up, and the events of one step
            per_step, events["n"] = events["n"], 0
            times = {"checked": [], "unchecked": []}
            for r in range(REPEATS):
                for label in ("checked", "unchecked") if r % 2 == 0 else ("unchecked", "checked"):
                    CollectiveOrder.check = checked if label == "checked" else (lambda self, description: None)
                    dist.barrier()
                    start = time.perf_counter()
                    train_step(model, opt)
                    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    times[label].append(elapsed.item())
            CollectiveOrder.check = checked
            with_check, without = (statistics.median(times[k]) for k in ("checked", "unchecked"))
            distributed.print0(f"| {'Z3' if zero3 else 'Z2'} | {per_step} | {with_check * 1e3:.0f} | "
                               f"{without * 1e3:.0f} | {with_check / without:.3f} |")


def measure() -> list[str]:
    """The table rows ("| mode | events per step | with check ms | without ms | ratio |") of one 2-rank launch."""
    from dmuon_edu.launch import torchrun

    result = torchrun(__file__, nproc=2, timeout=600, echo=False)
    return [line for line in result.stdout(0).splitlines() if line.startswith("| Z")]


def main():
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, 2 gloo ranks; the course's small GPT, "
          f"{MICRO_BATCHES} micro-batches per step; medians of {REPEATS}\n")
    print("| mode | checked events per step | step with check (ms) | without (ms) | ratio |")
    print("|---|---|---|---|---|")
    print("\n".join(measure()))


if __name__ == "__main__":
    worker() if "RANK" in os.environ else main()
