"""What dmuon's collective-order check (dmuon_edu/dmuon/order.py) costs a training step, per mode, and a model for more ranks.

    .venv/bin/python benchmarks/order_check.py          # 2 and 4 CPU ranks; a few minutes

A full training step (4 micro-batches, the first 3 under no_sync, then the optimizer
step) of the course's small GPT (d 256, 4 layers, vocab 256, 8 x 64 tokens per
micro-batch per rank), dmuon Z3 and Z2, with ``order_check`` "strict" (a store round
trip before every event), "per_step" (the default, after its first step: a running
CRC, compared inside the step's all-reduce) and "off", interleaved, "per_step" always
after "strict" (it compares each step with the last one recorded). On gloo "per_step"
also compares each event with the last step's at the same place and tells the store
how far it got, in a one-way write (order.py: gloo aborts natively on a mismatch);
these steps repeat, so it waits for no other rank. Per mode, one step's events and
store round trips (CollectiveOrder.issued and .round_trips), the time spent inside the
check (CollectiveOrder.check_all, timed on every rank, the slowest rank's) and the
step's time, medians. The time inside the check is the cost: on a shared machine the
step times move by more than it.

Events per step, for L layers with O owners each and N micro-batches with no_sync:
N (L + 2 L O) + L O + 1 in Z3 (each forward: a check per layer and a broadcast per
(layer, owner); each backward: the broadcasts again; the window's reduces; the step's
all-reduce), N L + 2 L O + 1 in Z2; the rows print the formula beside the count.

The model for more ranks: every rank makes one blocking round trip per event to the
one store, whose server answers them one at a time, so "strict" queues W E requests
per step on W ranks, at one thread: at t_s per request, up to W E t_s of serialised
store time per step, however fast each rank is. t_s is measured as one compare_set round trip to a
TCPStore served by this process (an upper bound: it includes the client's side).
"per_step" queues no round trip after its first step (on gloo, a one-way write per event).
"""

import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

REPEATS, MICRO_BATCHES = 5, 4
LAYERS = 4
MODES = ("strict", "per_step", "off")
# The model's large job: 64 GPUs, 32 layers of 4 dedicated matrices (O = 4 owners per layer), 8 micro-batches.
LARGE = dict(ranks=64, layers=32, owners=4, micro_batches=8)


def worker():
    from dmuon_edu import distributed, dmuon
    from dmuon_edu.course.dmuon_problem import is_dedicated
    from dmuon_edu.course.gpt import GPT, GPTConfig

    with distributed.session() as ranks:
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        config = GPTConfig(vocab_size=256, block_size=64, n_layer=LAYERS, n_head=4, d_model=256)
        g = torch.Generator().manual_seed(ranks.rank)
        batches = [torch.randint(0, 256, (8, 65), generator=g) for _ in range(MICRO_BATCHES)]

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
            order = model._dmuon.order
            in_check = [0.0]
            record = order._record  # check(), check_all() and note() call it

            def timed_check(descriptions, collective):
                start = time.perf_counter()
                try:
                    return record(descriptions, collective)
                finally:
                    in_check[0] += time.perf_counter() - start

            order._record = timed_check
            train_step(model, opt)  # warm-up: the first step, strict in every mode but "off"
            times, checking, counts = {m: [] for m in MODES}, {m: [] for m in MODES}, {}
            for r in range(REPEATS):
                # per_step compares a step with the last one: it always follows a recorded (strict) step
                for mode in ("strict", "per_step", "off") if r % 2 == 0 else ("off", "strict", "per_step"):
                    order.mode = mode
                    events, trips, in_check[0] = order.issued, order.round_trips, 0.0
                    dist.barrier()
                    start = time.perf_counter()
                    train_step(model, opt)
                    measured = torch.tensor([time.perf_counter() - start, in_check[0]], dtype=torch.float64)
                    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
                    times[mode].append(measured[0].item())
                    checking[mode].append(measured[1].item())
                    counts[mode] = (order.issued - events, order.round_trips - trips)
            owners = ranks.world_size if ranks.world_size <= 4 else 4  # the GPT's 4 matrices per layer
            k, L = MICRO_BATCHES, LAYERS
            formula = k * (L + 2 * L * owners) + L * owners + 1 if zero3 else k * L + 2 * L * owners + 1
            for mode in MODES:
                step, spent = statistics.median(times[mode]), statistics.median(checking[mode])
                distributed.print0(f"| {ranks.world_size} | {'Z3' if zero3 else 'Z2'} | {mode} | {counts[mode][0]} "
                                   f"({formula}) | {counts[mode][1]} | {spent * 1e3:.2f} | {step * 1e3:.0f} | "
                                   f"{spent / step:.4f} |")


def measure(nproc: int) -> list[str]:
    """The rows ("| ranks | mode | order_check | events (formula) | round trips | check ms | step ms | share |") of
    one launch."""
    from dmuon_edu.launch import torchrun

    result = torchrun(__file__, nproc=nproc, timeout=900, echo=False)
    return [line for line in result.stdout(0).splitlines() if line.startswith(f"| {nproc} | Z")]


def machine() -> str:
    """The machine, as the rows depend on it: CPU capability, cores, torch."""
    return (f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{os.cpu_count()} cores, gloo ranks on one machine")


def store_round_trip_s(calls: int = 2000) -> float:
    """Seconds per compare_set round trip to a TCPStore served by this process (median of 5 runs)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(calls):
            store.compare_set(f"k{i % 64}", "", "x")
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def model_rows(rows: list[str]) -> list[str]:
    """Per-event cost of each mode measured here, and the store's queue per step for LARGE."""
    lines = []
    for row in rows:
        _, world, zmode, mode, events, _, check_ms, _, _, _ = (cell.strip() for cell in row.split("|"))
        per_event_us = float(check_ms) * 1e3 / int(events.split()[0])
        lines.append(f"{zmode}, {world} ranks, {mode}: {per_event_us:.1f} us per event")
    n, L, o, k = LARGE["ranks"], LARGE["layers"], LARGE["owners"], LARGE["micro_batches"]
    events, t_s = k * (L + 2 * L * o) + L * o + 1, store_round_trip_s()
    lines.append(f"model, Z3, {n} ranks x {L} layers x {o} owners, {k} micro-batches: {events} events per rank per step; "
                 f"strict queues {n * events:.1e} round trips per step at one store, up to "
                 f"{n * events * t_s:.1f} s of store time at {t_s * 1e6:.0f} us each (one round trip measured here); "
                 "per_step queues 0 after its first step (on gloo, a one-way write per event)")
    return lines


def main():
    print(f"{machine()}; the course's small GPT, {MICRO_BATCHES} micro-batches per step; medians of {REPEATS}\n")
    print("| ranks | mode | order_check | events per step (formula) | store round trips per step | "
          "in the check (ms per step) | step (ms) | check / step |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [row for nproc in (2, 4) for row in measure(nproc)]
    print("\n".join(rows))
    print()
    print("\n".join(model_rows(rows)))


if __name__ == "__main__":
    worker() if "RANK" in os.environ else main()
