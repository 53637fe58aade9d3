"""A full training step of each dmuon layout against its floor and its peers, and where the time goes.

    .venv/bin/python benchmarks/bench_step.py           # 2 and 4 CPU ranks; a few minutes on 2 cores

The peer's headline number: N micro-batches of forward and backward, then the
optimizer step, on the same model, in one run per world size, the setups interleaved.
The model: the course's small GPT (d 256, 4 layers, vocab 256), 8 x 64 tokens per
micro-batch per rank, 4 micro-batches per step, the first 3 without gradient
synchronisation in every setup (dmuon.no_sync, FSDP2's set_requires_gradient_sync,
DDP's no_sync).

- FSDP2 + AdamW: fully_shard on each layer and the model, AdamW on everything;
- dmuon Z2 / Z3: dedicated hidden matrices (Muon on their owners), FSDP2 + AdamW on the
  rest, the default schedule (broadcasts prefetched one layer ahead, bucketed reduces);
- DDP + AdamW: DDP and AdamW on everything;
- dmuon DDP backend: dedicate_params_ddp and replicate, every rank holding the whole
  model; each matrix reduced to its owner, stepped there, broadcast after the step;
- on 2 ranks, natively, dmuon Z3, no prefetch: Z3 with ``forward_prefetch_depth=0`` (each
  broadcast issued at its own layer, where it is waited for at once); and torchtitan's
  recipe under Z3, each block in a checkpoint_wrapper, eager and torch.compile'd
  (inductor).

DDP + replicated Muon, the DDP backend's naive peer, is measured by user_step.py, the
same step written as a user would write it (run_all.py runs both and compares them).

On 4 ranks, HSDP as (replicate, shard) = (2, 2): fully_shard on the 2-D mesh, AdamW on
everything (HSDP + AdamW), and dmuon Z3 on the shard axis with the replicate axis beside
it (dmuon HSDP Z3: each holder's reduced gradients go on to the owner's replica, and the
owner publishes the step to the other replica's holder).

On 4 ranks, as (dp, tp) = (2, 2) with tp_setups.py's Megatron plan (TP first, then data
parallelism on the DP axis, as the public tp-dp example orders them; the two ranks of a
TP group get the same batch):

- FSDP2 + TP + AdamW, DDP + TP + AdamW: fully_shard, or DDP, on the DP axis, AdamW on
  everything (torch's DDP turns the TP DTensors into local shards);
- FSDP2 + TP + whole-matrix Muon, DDP + TP + whole-matrix Muon: the same layouts with the
  naive TP Muon (tp_setups.WholeMatrixMuon): every rank gathers each matrix's whole
  gradient and runs Newton-Schulz on it (natively only);
- dmuon Z3 + TP: dedicate_params and fully_shard on the DP axis; dmuon DDP backend + TP:
  dedicate_params_ddp_tp and replicate_tp. Each TP-sharded matrix's TP owner gathers it,
  runs Newton-Schulz once, and scatters the update (dmuon_edu/dmuon/tp.py).

Every row is also predicted by dmuon's time model (dmuon_edu/dmuon/step_time.py) from
a calibration made at the start of the same launch (dmuon.calibrate(): each collective
alone over message sizes, matmuls alone; never a step), with the model's and its
phases printed beside the measurement.

Each round runs one step of every setup, in an order rotated by one at each round;
fresh random tokens at every step. A step ends when every rank is done with it, its
communication included (the DDP backend's post-step broadcast, which the next forward
would otherwise wait for). Per setup: the median step, its
ratio to the AdamW step of its own layout (the median of the rounds' ratios, with their
interquartile range), and where the time goes (phases.py: forward, backward, the waits
for dmuon's reduces and broadcasts, the step's all-reduce, Muon's local steps, the TP
gather and scatter, AdamW, the order check, dmuon's hooks and copies), per rank, the
medians over rounds averaged over ranks. On a 2-core CPU gloo's asynchronous work does
not overlap compute (both compete for the same cores), so prefetching shows here as a
schedule (tests/test_dmuon.py proves its order), not as time; the GPU is where it saves
time.

Each dmuon layout's *floor* is what its design cannot avoid on top of the AdamW step of
its layout: the AdamW step itself (measured in the same rounds), plus its owners' share of
Muon's local steps (the slowest rank's Muon and TP phases, measured in the rounds: the
step waits for it), plus the collectives that AdamW does not need, each timed alone
after the rounds on the same ranks (the step's all-reduce of six numbers; for the DDP
backend the post-step broadcast of the updated matrices; FSDP2's all-gathers and DDP's
all-reduces of the matrices are in the AdamW step, where dmuon's broadcasts and reduces
replace them). Step over floor is the median over rounds of a round's step over that
round's AdamW step plus the two other parts: a step within 3% of its floor spends
nothing that its design could save.
"""

import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

# siblings: run as a script, or imported by run_all.py with this folder on sys.path
import tp_setups
from machine import emulation
from phases import PHASES, Phases, instrument

from dmuon_edu.newton_schulz import fast_dtype

MICRO_BATCHES, BATCH, TOKENS = 4, 8, 64
# Rounds per world size: a 4-rank step takes twice as long on 2 cores and moves more between rounds (the rounds'
# interquartile range of a ratio spans 3 to 8% there, 2 to 5% on 2 ranks); make bench's 15 minutes bound both.
ROUNDS = {2: 8, 4: 8}
SETUPS = ["FSDP2 + AdamW", "dmuon Z2", "dmuon Z3", "DDP + AdamW", "dmuon DDP backend"]
# Prefetching is a schedule on a CPU (its time is a GPU's, docs/gpu.md): shown on 2 ranks, natively.
PREFETCH_SETUPS = ["dmuon Z3, no prefetch"]
# On (dp, tp) = (W / 2, 2) (tp_setups.py): each dmuon TP backend beside its layout's AdamW and whole-matrix Muon.
TP_SETUPS = ["FSDP2 + TP + AdamW", "dmuon Z3 + TP", "DDP + TP + AdamW", "dmuon DDP backend + TP"]
# The naive TP peers, natively only: make bench's 15 minutes leave no room for them twice.
WHOLE_MATRIX_SETUPS = ["FSDP2 + TP + whole-matrix Muon", "DDP + TP + whole-matrix Muon"]
TP_WORLD_SIZES = (4,)
# HSDP as (replicate, shard) = (2, W / 2), natively and emulated.
HSDP_SETUPS = ["HSDP + AdamW", "dmuon HSDP Z3"]
HSDP_WORLD_SIZES = (4,)
# torchtitan's recipe on 2 ranks, natively (inductor's kernels ignore the emulation's variables): each block in a
# checkpoint_wrapper, then torch.compile'd (inductor, the default), then dmuon; against the same blocks eager.
COMPILE_SETUPS = ["dmuon Z3, checkpointed", "dmuon Z3, checkpointed + compiled"]
COMPILE_WORLD_SIZES = (2,)
# The AdamW step of each setup's own layout: its floor's first part, and the ratio every setup is shown at.
ADAMW_PEER = {"dmuon Z2": "FSDP2 + AdamW", "dmuon Z3": "FSDP2 + AdamW", "dmuon Z3, no prefetch": "FSDP2 + AdamW",
              "dmuon DDP backend": "DDP + AdamW", "dmuon HSDP Z3": "HSDP + AdamW",
              "FSDP2 + TP + whole-matrix Muon": "FSDP2 + TP + AdamW", "dmuon Z3 + TP": "FSDP2 + TP + AdamW",
              "DDP + TP + whole-matrix Muon": "DDP + TP + AdamW", "dmuon DDP backend + TP": "DDP + TP + AdamW"}
# Each TP layout's naive peer, the ratio it must win: whole-matrix Muon on the same layout (the 1-D layouts' peer,
# DDP + replicated Muon, is user_step.py's); and the compiled recipe against the same blocks eager.
PEERS = {"dmuon Z3 + TP": "FSDP2 + TP + whole-matrix Muon", "dmuon DDP backend + TP": "DDP + TP + whole-matrix Muon",
         "dmuon Z3, checkpointed + compiled": "dmuon Z3, checkpointed"}
FLOOR_TOLERANCE = 0.03  # a step within 3% of its floor spends nothing its design could save
ISOLATED_REPEATS = 15


def where(setup: str, world_size: int) -> str:
    """Where a setup ran: "4 ranks", or "4 ranks as (dp, tp) = (2, 2)" for a TP setup (and HSDP's grid)."""
    grid = f" as (dp, tp) = ({world_size // tp_setups.TP}, {tp_setups.TP})" if "TP" in setup else ""
    if "HSDP" in setup:
        grid = f" as (replicate, shard) = (2, {world_size // 2})"
    return f"{world_size} ranks{grid}"


def time_model_setup(name: str, config, world_size: int):
    """(workload, layout) of a setup for dmuon's time model: the course GPT's shapes, 8 x 64 tokens per rank,
    attention over 64 tokens, checkpointed blocks where the setup checkpoints (compiled or not: inductor's
    kernels are not modelled)."""
    from dmuon_edu import dmuon
    from dmuon_edu.course.dmuon_problem import is_dedicated
    from dmuon_edu.course.gpt import GPT
    from dmuon_edu.dmuon.step_time import activation_entries_per_token, attention_flops_per_token

    layout = dmuon.LAYOUTS[name.split(",")[0] if "checkpointed" in name else name]
    workload = dmuon.Workload.from_model(
        GPT(config), is_dedicated, tokens=BATCH * TOKENS,
        attention_flops_per_token=attention_flops_per_token(config.n_layer, config.d_model, TOKENS),
        activation_entries_per_token=activation_entries_per_token(config.n_layer, config.d_model, config.vocab_size),
        nonlinearity_entries_per_token=config.n_layer * 4 * config.d_model,  # the MLP's GELU
        tensor_parallel=tp_setups.time_model_styles(config.n_layer), attention_split=False,
        activation_checkpointing="checkpointed" in name)
    return workload, layout


def isolated_seconds(collective) -> float:
    """The slowest rank's time of ``collective()`` alone, every rank starting together: the median of a few."""
    times = []
    for _ in range(ISOLATED_REPEATS):
        dist.barrier()
        start = time.perf_counter()
        collective()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def worker():
    from dmuon_edu import distributed, dmuon
    from dmuon_edu.course.dmuon_problem import is_dedicated
    from dmuon_edu.course.gpt import GPT, GPTConfig

    phases = Phases()
    instrument(phases)  # before any model is prepared: dmuon registers bound methods as hooks
    for attribute in ("gather_gradients", "apply_updates"):
        phases.wrap(tp_setups.WholeMatrixMuon, attribute, "TP gather + scatter")

    with distributed.session() as ranks:
        started = time.perf_counter()
        hardware = dmuon.calibrate()  # this launch's ranks, before any setup: collectives alone, matmuls alone
        calibration_seconds = time.perf_counter() - started
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        with_tp = ranks.world_size in TP_WORLD_SIZES
        if with_tp:
            mesh2d = init_device_mesh(ranks.device.type, (ranks.world_size // tp_setups.TP, tp_setups.TP),
                                      mesh_dim_names=("dp", "tp"))
        with_hsdp = ranks.world_size in HSDP_WORLD_SIZES
        if with_hsdp:
            hsdp_mesh = init_device_mesh(ranks.device.type, (2, ranks.world_size // 2),
                                         mesh_dim_names=("replicate", "shard"))
        with_compile = ranks.world_size in COMPILE_WORLD_SIZES and not emulation()  # inductor ignores the emulation
        natively = not emulation()
        setups = (SETUPS + (PREFETCH_SETUPS if ranks.world_size == 2 and natively else [])
                  + (HSDP_SETUPS if with_hsdp else [])
                  + (TP_SETUPS if with_tp else []) + (WHOLE_MATRIX_SETUPS if with_tp and natively else [])
                  + (COMPILE_SETUPS if with_compile else []))
        rounds = ROUNDS.get(ranks.world_size, 6)
        config = GPTConfig(vocab_size=256, block_size=TOKENS, n_layer=4, n_head=4, d_model=256)
        # Fresh tokens at every step, one stream per data-parallel index: the ranks of a TP group share theirs.
        streams = {tp: torch.Generator().manual_seed(ranks.rank // tp_setups.TP if tp else ranks.rank)
                   for tp in (False, True)}

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
            if "checkpointed" in name:  # then activation checkpointing, then torch.compile of each block
                for i, layer in enumerate(model.layers):
                    layer = checkpoint_wrapper(layer)
                    model.layers[i] = torch.compile(layer) if "compiled" in name else layer
            if name.startswith("dmuon DDP backend"):
                if "TP" in name:
                    dmuon.dedicate_params_ddp_tp(model, dp_mesh, is_dedicated)
                    dmuon.replicate_tp(model, dp_mesh)
                else:
                    dmuon.dedicate_params_ddp(model, dp_mesh, is_dedicated)
                    dmuon.replicate(model, dp_mesh)
            elif "HSDP" in name:  # fully_shard on the 2-D mesh; dmuon on its shard axis, the replicate axis beside
                if name.startswith("dmuon"):
                    dmuon.dedicate_params(model, hsdp_mesh["shard"], is_dedicated, reshard_after_forward=True,
                                          replicate_mesh=hsdp_mesh["replicate"])
                dp_mesh = hsdp_mesh
                sharded(model, dp_mesh)
            elif name.startswith("dmuon"):
                dmuon.dedicate_params(model, dp_mesh, is_dedicated, reshard_after_forward="Z3" in name)
                sharded(model, dp_mesh)
            if name.startswith("dmuon"):
                depth = 0 if "no prefetch" in name else 1
                opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, forward_prefetch_depth=depth)
                return model, [opt], lambda: dmuon.no_sync(model)
            if name.startswith("HSDP"):
                called, no_sync = model, fsdp_no_sync(model)
            elif name.startswith("FSDP2"):
                called, no_sync = sharded(model, dp_mesh), fsdp_no_sync(model)
            else:  # DDP; on a TP mesh's DP axis torch turns the DTensor parameters into local shards first (and
                # after the first forward its hooks leave the TP weights out of named_parameters: read them now)
                called = DistributedDataParallel(model, device_mesh=dp_mesh)
                no_sync = called.no_sync
            if name.endswith("AdamW"):
                return called, [torch.optim.AdamW(model.parameters(), lr=1e-3)], no_sync
            matrices = [p for n, p in model.named_parameters() if is_dedicated(n, p)]
            rest = [p for n, p in model.named_parameters() if not is_dedicated(n, p)]
            return called, [tp_setups.WholeMatrixMuon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)], no_sync

        def train_step(name):
            model, optimizers, no_sync = runs[name]
            tokens = streams["TP" in name]
            for j in range(MICRO_BATCHES):
                batch = torch.randint(0, config.vocab_size, (BATCH, TOKENS + 1), generator=tokens)
                with no_sync() if j < MICRO_BATCHES - 1 else contextlib.nullcontext():
                    with phases.phase("forward"):
                        loss = model(batch[:, :-1], batch[:, 1:]).loss.div(MICRO_BATCHES)
                    with phases.phase("backward"):
                        loss.backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()

        runs = {name: setup(name) for name in setups}
        for name in setups:  # warm-up: optimizer state, FSDP2's buffers, torch.compile's graphs
            for _ in range(2 if "compiled" in name else 1):
                train_step(name)
        times = {name: [] for name in setups}
        spent = {name: [] for name in setups}  # per round: this rank's seconds per phase
        for r in range(rounds):
            for name in setups[r % len(setups):] + setups[: r % len(setups)]:
                dist.barrier()
                phases.reset()
                start = time.perf_counter()
                train_step(name)
                # The step ends when every rank is done with it, its communication included: the post-step
                # broadcast of the DDP backend (on the DP axis's group under TP: the barrier would not wait for it),
                # then the barrier, which waits for the slowest rank.
                if name.startswith("dmuon"):
                    runs[name][0]._dmuon.publisher.wait()
                dist.barrier()
                times[name].append(time.perf_counter() - start)
                spent[name].append(dict(phases.spent))

        # The collectives that AdamW does not need, each alone on the same ranks.
        flag = torch.zeros(6, dtype=torch.float64)
        alone = {"the step's all-reduce": isolated_seconds(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX))}
        for name in setups:
            if name.startswith("dmuon DDP backend") or name.startswith("dmuon HSDP"):
                state = runs[name][0]._dmuon
                for order in state.orders:  # the collective alone: its order check is the step's cost, not the floor's
                    order.mode = "off"
                alone[f"{name}: post-step broadcast"] = isolated_seconds(
                    lambda state=state: (state.publisher.publish(), state.publisher.wait()))

        def per_rank(values):
            gathered = [None] * ranks.world_size
            dist.all_gather_object(gathered, values)
            return gathered

        # Per rank and phase: the median over rounds; then every rank's, for the mean and the slowest.
        medians = {name: {phase: statistics.median(s[phase] for s in spent[name]) for phase in PHASES}
                   for name in setups}
        everyone = per_rank(medians)
        for name in setups:
            step = statistics.median(times[name])
            peer = ADAMW_PEER.get(name)
            # Ratios round by round (the setups of a round ran side by side): drift between rounds cancels.
            ratios = [a / b for a, b in zip(times[name], times[peer])] if peer else [1.0] * rounds
            low, _, high = statistics.quantiles(ratios, n=4)
            mean = {phase: statistics.fmean(rank[name][phase] for rank in everyone) for phase in PHASES}
            floor_cells = ["-"] * 4
            if name.startswith("dmuon") and peer:
                owners_share = max(rank[name]["Muon"] + rank[name]["TP gather + scatter"] for rank in everyone)
                collectives = alone["the step's all-reduce"] + alone.get(f"{name}: post-step broadcast", 0.0)
                floor = statistics.median(times[peer]) + owners_share + collectives
                over_floor = statistics.median(a / (b + owners_share + collectives)
                                               for a, b in zip(times[name], times[peer]))
                floor_cells = [f"{owners_share * 1e3:.0f}", f"{collectives * 1e3:.1f}", f"{floor * 1e3:.0f}",
                               f"{over_floor:.3f}"]
            distributed.print0(
                f"ROW | {ranks.world_size} | {name} | {step * 1e3:.0f} | {peer or '-'} | {statistics.median(ratios):.3f} "
                f"| {low:.3f} | {high:.3f} | " + " | ".join(floor_cells) + " | "
                + " | ".join(f"{mean[phase] * 1e3:.1f}" for phase in PHASES) + " |")
        for what, seconds in alone.items():
            distributed.print0(f"ALONE | {ranks.world_size} | {what} | {seconds * 1e3:.2f} |")
        if ranks.rank == 0:
            print_predictions(hardware, calibration_seconds, config, ranks.world_size,
                              setups + ["DDP + replicated Muon"])  # user_step.py's naive peer


def print_predictions(hardware, seconds: float, config, world_size: int, setups: list[str]) -> None:
    """The calibration, then each setup's predicted step (and its phases) from it."""
    import dataclasses
    import json

    from dmuon_edu import dmuon

    print(f"CALIBRATION | {world_size} | {seconds:.1f} | {json.dumps(dataclasses.asdict(hardware))} |", flush=True)
    for name in setups:
        workload, layout = time_model_setup(name, config, world_size)
        step = dmuon.predict_step(workload, layout, world_size=world_size, micro_batches=MICRO_BATCHES,
                                  hardware=hardware, ns_dtype=fast_dtype("cpu"))
        phases = {phase: round(s * 1e3, 1) for phase, s in step.phases.items()}
        print(f"PREDICTED | {world_size} | {name} | {step.total * 1e3:.0f} | {json.dumps(phases)} |", flush=True)


COLUMNS = ["W ranks", "setup", "step (ms)", "AdamW peer", "step / peer", "q1", "q3", "owners' Muon + TP (ms)",
           "collectives AdamW does not need (ms)", "floor (ms)", "step / floor", *(f"{p} (ms)" for p in PHASES)]


def measure(nproc: int, env: dict | None = None):
    """One launch on ``nproc`` ranks (``env``: e.g. the emulation's variables): the rows (cells as COLUMNS), the
    collectives timed alone ({what: ms}), the time model's predictions ({setup: (ms, {phase: ms})}) and its
    calibration ((seconds taken, Hardware's fields))."""
    import json

    from dmuon_edu.launch import torchrun

    result = torchrun(__file__, nproc=nproc, timeout=900, echo=False, env=env)
    rows, alone, predicted, calibration = [], {}, {}, None
    for line in result.stdout(0).splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if line.startswith("ROW "):
            rows.append(cells)
        elif line.startswith("ALONE "):
            alone[cells[1]] = float(cells[2])
        elif line.startswith("PREDICTED "):
            predicted[cells[1]] = (float(cells[2]), json.loads(cells[3]))
        elif line.startswith("CALIBRATION "):
            calibration = (float(cells[1]), json.loads(cells[2]))
    return rows, alone, predicted, calibration


def main():
    from machine import describe

    print(f"{describe()}\nThe course's small GPT (d 256, 4 layers), {MICRO_BATCHES} micro-batches of {BATCH} x {TOKENS} "
          f"tokens per rank; medians of {ROUNDS} rounds (by world size), each step until every rank is done\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for nproc in (2, 4):
        start = time.perf_counter()
        rows, alone, _, _ = measure(nproc)
        print("\n".join("| " + " | ".join(cells) + " |" for cells in rows), flush=True)
        print(f"({nproc} ranks: {time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.1f}; "
              f"alone: {alone})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    worker() if "RANK" in os.environ else main()
