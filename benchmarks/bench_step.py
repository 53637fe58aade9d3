"""A full training step of dmuon against FSDP2 + AdamW, DDP + replicated Muon and its TP peers, as ratios.

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

On 4 ranks, as (dp, tp) = (2, 2) with tp_setups.py's Megatron plan (TP first, then data
parallelism on the DP axis, as the public tp-dp example orders them; the two ranks of a
TP group get the same batch):

- FSDP2 + TP + AdamW, DDP + TP + AdamW: fully_shard, or DDP, on the DP axis, AdamW on
  everything (torch's DDP turns the TP DTensors into local shards);
- FSDP2 + TP + whole-matrix Muon, DDP + TP + whole-matrix Muon: the same layouts with the
  naive TP Muon (tp_setups.WholeMatrixMuon): every rank gathers each matrix's whole
  gradient and runs Newton-Schulz on it;
- dmuon Z3 + TP: dedicate_params and fully_shard on the DP axis; dmuon DDP backend + TP:
  dedicate_params_ddp_tp and replicate_tp. Each TP-sharded matrix's TP owner gathers it,
  runs Newton-Schulz once, and scatters the update (dmuon_edu/dmuon/tp.py).

"blocked" is the time a rank spends waiting for dmuon's collectives (every wait goes
through the collective-order check's ``waiting``), averaged over ranks, and its share of
the step. Two more phases, averaged over ranks: the TP gather and scatter around the
optimizer step (dmuon's tp.gather_gradients and tp.apply_updates, or WholeMatrixMuon's
full_tensor gathers and shard cuts; waits included, so a rank that waits there for its
TP owner's Newton-Schulz counts that time too), and Muon's local steps (momentum,
Newton-Schulz, the update: dmuon_edu.muon.Muon's, inside dmuon as in the baselines). On
a 2-core CPU gloo's asynchronous work does not overlap compute (both compete for the
same cores), so prefetching shows here as a schedule (tests/test_dmuon.py proves its
order), not as time; the GPU is where it saves time.
"""

import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import tp_setups  # a sibling: run as a script, or imported by run_all.py with this folder on sys.path

REPEATS, MICRO_BATCHES, BATCH, TOKENS = 5, 4, 8, 64
SETUPS = ["FSDP2 + AdamW", "dmuon Z2", "dmuon Z3", "dmuon Z3, no prefetch", "DDP + replicated Muon", "DDP + AdamW",
          "dmuon DDP backend"]
# On (dp, tp) = (W / 2, 2) (tp_setups.py): each dmuon TP backend beside its layout's AdamW and whole-matrix Muon.
TP_SETUPS = ["FSDP2 + TP + AdamW", "FSDP2 + TP + whole-matrix Muon", "dmuon Z3 + TP", "DDP + TP + AdamW",
             "DDP + TP + whole-matrix Muon", "dmuon DDP backend + TP"]
TP_WORLD_SIZES = (4,)
# Each dmuon layout's own peers, the ratios it must win: replicated Muon (and AdamW) on the same layout.
PEERS = {"dmuon DDP backend": ["DDP + replicated Muon"],
         "dmuon Z3 + TP": ["FSDP2 + TP + AdamW", "FSDP2 + TP + whole-matrix Muon"],
         "dmuon DDP backend + TP": ["DDP + TP + AdamW", "DDP + TP + whole-matrix Muon"]}


def where(setup: str, world_size: int) -> str:
    """Where a setup ran: "4 ranks", or "4 ranks as (dp, tp) = (2, 2)" for a TP setup."""
    grid = f" as (dp, tp) = ({world_size // tp_setups.TP}, {tp_setups.TP})" if "TP" in setup else ""
    return f"{world_size} ranks{grid}"


def worker():
    from dmuon_edu import distributed, dmuon, muon
    from dmuon_edu.course.dmuon_problem import is_dedicated
    from dmuon_edu.course.gpt import GPT, GPTConfig
    from dmuon_edu.dmuon import tp
    from dmuon_edu.dmuon.order import CollectiveOrder

    with distributed.session() as ranks:
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        with_tp = ranks.world_size in TP_WORLD_SIZES
        if with_tp:
            mesh2d = init_device_mesh(ranks.device.type, (ranks.world_size // tp_setups.TP, tp_setups.TP),
                                      mesh_dim_names=("dp", "tp"))
        setups = SETUPS + (TP_SETUPS if with_tp else [])
        config = GPTConfig(vocab_size=256, block_size=TOKENS, n_layer=4, n_head=4, d_model=256)

        def batches_of(replica):  # one rank's micro-batches; the ranks of a TP group share theirs
            g = torch.Generator().manual_seed(replica)
            return [torch.randint(0, 256, (BATCH, TOKENS + 1), generator=g) for _ in range(MICRO_BATCHES)]
        batches, tp_batches = batches_of(ranks.rank), batches_of(ranks.rank // tp_setups.TP)

        # Seconds per phase of a step on this rank: "blocked" (waiting for dmuon's collectives), "tp" (the TP
        # gather and scatter around the optimizer step), "muon" (Muon's local steps: momentum, Newton-Schulz, update).
        spent = dict.fromkeys(("blocked", "tp", "muon"), 0.0)
        waiting = CollectiveOrder.waiting

        @contextlib.contextmanager
        def timed_waiting(self, event, description):
            start = time.perf_counter()
            try:
                with waiting(self, event, description):
                    yield
            finally:
                spent["blocked"] += time.perf_counter() - start

        CollectiveOrder.waiting = timed_waiting

        def timed(owner, attribute, phase):
            function = getattr(owner, attribute)

            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return function(*args, **kwargs)
                finally:
                    spent[phase] += time.perf_counter() - start
            setattr(owner, attribute, wrapper)

        for owner in (tp, tp_setups.WholeMatrixMuon):
            timed(owner, "gather_gradients", "tp")
            timed(owner, "apply_updates", "tp")
        timed(muon.Muon, "_step_same_shape", "muon")

        def sharded(model, dp_mesh):
            for layer in model.layers:
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
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
            """(model to call, optimizers, no_sync) of a setup: its TP layout, its data parallelism, its optimizer."""
            torch.manual_seed(0)
            model = GPT(config)
            dp_mesh = mesh
            if "TP" in name:  # the public tp-dp order: TP first, then data parallelism on the DP axis
                tp_setups.parallelize(model, mesh2d["tp"])
                dp_mesh = mesh2d["dp"]
            if name.startswith("dmuon DDP backend"):
                if "TP" in name:
                    dmuon.dedicate_params_ddp_tp(model, dp_mesh, is_dedicated)
                    dmuon.replicate_tp(model, dp_mesh)
                else:
                    dmuon.dedicate_params_ddp(model, dp_mesh, is_dedicated)
                    dmuon.replicate(model, dp_mesh)
            elif name.startswith("dmuon"):
                dmuon.dedicate_params(model, dp_mesh, is_dedicated, reshard_after_forward="Z3" in name)
                sharded(model, dp_mesh)
            if name.startswith("dmuon"):
                depth = 0 if "no prefetch" in name else 1
                opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, forward_prefetch_depth=depth)
                return model, [opt], lambda: dmuon.no_sync(model)
            if name.startswith("FSDP2"):
                called, no_sync = sharded(model, dp_mesh), fsdp_no_sync(model)
            else:  # DDP; on a TP mesh's DP axis torch turns the DTensor parameters into local shards first (and
                # after the first forward its hooks leave the TP weights out of named_parameters: read them now)
                called = DistributedDataParallel(model, device_mesh=dp_mesh)
                no_sync = called.no_sync
            if name.endswith("AdamW"):
                return called, [torch.optim.AdamW(model.parameters(), lr=1e-3)], no_sync
            matrices = [p for n, p in model.named_parameters() if is_dedicated(n, p)]
            rest = [p for n, p in model.named_parameters() if not is_dedicated(n, p)]
            replicated = tp_setups.WholeMatrixMuon if "TP" in name else muon.Muon
            return called, [replicated(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)], no_sync

        def train_step(model, optimizers, no_sync, batches):
            for j, batch in enumerate(batches):
                with no_sync() if j < MICRO_BATCHES - 1 else contextlib.nullcontext():
                    model(batch[:, :-1], batch[:, 1:]).loss.div(MICRO_BATCHES).backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()

        runs = {name: (*setup(name), tp_batches if "TP" in name else batches) for name in setups}
        for name in setups:
            train_step(*runs[name])  # warm-up
        times = {name: [] for name in setups}
        phases = {name: [] for name in setups}
        for r in range(REPEATS):
            for name in setups[r % len(setups):] + setups[: r % len(setups)]:
                dist.barrier()
                for phase in spent:
                    spent[phase] = 0.0
                start = time.perf_counter()
                train_step(*runs[name])
                elapsed = torch.tensor([time.perf_counter() - start, *spent.values()], dtype=torch.float64)
                slowest = elapsed[:1].clone()
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                dist.all_reduce(elapsed, op=dist.ReduceOp.SUM)
                times[name].append(slowest.item())
                phases[name].append((elapsed[1:] / ranks.world_size).tolist())
        reference = statistics.median(times["FSDP2 + AdamW"])
        for name in setups:
            step = statistics.median(times[name])
            blocked, in_tp, in_muon = (statistics.median(phase) for phase in zip(*phases[name]))
            blocked_cell = f"{blocked * 1e3:.0f} ({blocked / step:.0%})" if name.startswith("dmuon") else "-"
            tp_cell = f"{in_tp * 1e3:.0f} ({in_tp / step:.0%})" if "TP" in name and in_tp else "-"
            muon_cell = f"{in_muon * 1e3:.0f} ({in_muon / step:.0%})" if in_muon else "-"
            distributed.print0(f"ROW | {ranks.world_size} | {name} | {step * 1e3:.0f} | {blocked_cell} | {tp_cell} | "
                               f"{muon_cell} | {step / reference:.2f} |")


def measure(nproc: int) -> list[str]:
    """The table rows ("| W | setup | step ms | blocked ms (share) | TP gather + scatter ms (share) | Muon's local
    steps ms (share) | ratio to FSDP2 + AdamW |") of one launch."""
    from dmuon_edu.launch import torchrun

    result = torchrun(__file__, nproc=nproc, timeout=900, echo=False)
    return [line[4:] for line in result.stdout(0).splitlines() if line.startswith("ROW ")]


def main():
    from machine import describe

    print(f"{describe()}\nThe course's small GPT (d 256, 4 layers), {MICRO_BATCHES} micro-batches of {BATCH} x {TOKENS} "
          f"tokens per rank; medians of {REPEATS}, slowest rank\n")
    print("| W ranks | setup | step (ms) | blocked on dmuon's collectives (ms, share) | TP gather + scatter (ms, share) "
          "| Muon's local steps (ms, share) | ratio to FSDP2 + AdamW |")
    print("|---|---|---|---|---|---|---|")
    for nproc in (2, 4):
        start = time.perf_counter()
        rows = measure(nproc)
        print("\n".join(rows), flush=True)
        print(f"({nproc} ranks: {time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.1f})",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    worker() if "RANK" in os.environ else main()
