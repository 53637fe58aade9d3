"""Every benchmark of the package in one run, as one markdown table of ratios: `make bench`.

    .venv/bin/python benchmarks/run_all.py              # CPU rows, + GPU rows where CUDA is present
    .venv/bin/python benchmarks/run_all.py --gpu-only   # the GPU rows alone (make gpu-check)

Each row sets a measured number beside what it is judged against, both from this run:

- dmuon_edu.Muon's step against torch.optim.Muon's (bench_muon.step_times);
- Newton-Schulz batched over same-shape matrices (torch.baddbmm: GPUs, and small
  matrices on CPU) against one matrix at a time (large matrices on CPU) (bench_muon.ns_times);
- dmuon's optimizer step on 2 ranks against replicated Muon (bench_dmuon.measure);
- a full training step (4 micro-batches, then the optimizer step) of each dmuon layout
  against its floor (bench_step.measure: the AdamW step of the layout, plus the owners'
  share of Muon, plus the collectives AdamW does not need, each measured in the same
  launch), natively and emulating a CPU without native bf16 (machine.EMULATED_AVX2),
  on 2 and 4 ranks (4 as (dp, tp) = (2, 2) for the TP layouts); each layout against its
  naive peer (DDP + replicated Muon, from user_step.py; whole-matrix Muon under TP); and
  torchtitan's compiled recipe against the same blocks eager. After the table, where
  each step's time goes, phase by phase, and user_step.py (a plain script written from
  docs/dmuon.md) against bench_step.py, setup by setup. The cost of dmuon's order
  check in its default mode is one of the phases; benchmarks/order_check.py compares
  the three modes (run it alone: it is not part of make bench, whose training steps
  take most of its 15 minutes);
- communication per optimizer step, counted by count_comm in the capstone's dmuon runs,
  against the published formulas: 2(W-1)/W P_M (Z2) and 3(W-1)/W P_M (Z3) on W ranks for one
  micro-batch per step, and one reduce per window with no_sync. count_comm counts every
  call's whole tensor; in a ring or tree broadcast (or reduce) of P bytes each rank puts
  (W-1)/W P on the wire, so wire bytes per rank = (W-1)/W x counted bytes (module 6);
- peak memory of one accumulated step (4 micro-batches) against the same step on the
  full batch (dmuon_edu.peak_memory_bytes);
- Newton-Schulz throughput in bf16 against bf16 matmul throughput (X @ X^T on the same
  matrices), GFLOP/s on CPU; with CUDA, TFLOP/s on the GPU, against large bf16 matmuls,
  and both against the time model's GPU preset (compute rates only);
- every training-step row, in both benchmarks, against dmuon's time model, predicted from a
  calibration made at the start of the same launch (a section of its own, with the
  calibrations); and the model's predictions for GPT-2 small and Llama-2-7B on 8 to 1024
  H100s (gpu_predictions.py).

The table goes to benchmarks/results.md (or --out) and to stdout, with the machine,
the torch version, the date and the load average: timings on a shared machine move,
ratios of interleaved measurements much less.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark scripts

import bench_dmuon  # noqa: E402
import bench_muon  # noqa: E402
import bench_step  # noqa: E402
import gpu_predictions  # noqa: E402
import machine  # noqa: E402
import user_step  # noqa: E402

from dmuon_edu.course import capstone  # noqa: E402
from dmuon_edu.accumulation import train_step_with_accumulation  # noqa: E402
from dmuon_edu.course.gpt import GPT, GPTConfig  # noqa: E402
from dmuon_edu.launch import RankFailedError, torchrun  # noqa: E402
from dmuon_edu.memory import peak_memory_bytes  # noqa: E402
from dmuon_edu.newton_schulz import batching_pays, fast_dtype, newton_schulz, ns_flops  # noqa: E402

HEADER = "| benchmark | measured | against | ratio |\n|---|---|---|---|"
GPU_NS_SHAPES = {"square 4096x4096": (4096, 4096), "4:1 2048x8192": (2048, 8192)}
GPU_NS_MATRICES = 16
GPU_MATMUL_SIZE = 8192


def row(benchmark: str, measured: str, against: str, ratio: float) -> str:
    return f"| {benchmark} | {measured} | {against} | {ratio:.2f} |"


def muon_step_rows() -> list[str]:
    """Both in bf16 (torch always is), then ours with its default dtype "auto" on one shape."""
    rows = []
    for label, shape in bench_muon.SHAPES.items():
        ours, theirs, ratio = bench_muon.step_times(shape)
        rows.append(row(f"Muon step, {label}, {bench_muon.MATRICES} matrices, both bf16", f"dmuon_edu.Muon {ours * 1e3:.1f} ms",
                        f"torch.optim.Muon {theirs * 1e3:.1f} ms", ratio))
    label = "square 512x512"
    ours, theirs, ratio = bench_muon.step_times(bench_muon.SHAPES[label], "auto")
    chosen = str(fast_dtype("cpu"))[6:]
    rows.append(row(f'Muon step, {label}, {bench_muon.MATRICES} matrices, ours ns_dtype="auto" ({chosen} here)',
                    f"dmuon_edu.Muon {ours * 1e3:.1f} ms", f"torch.optim.Muon, bf16, {theirs * 1e3:.1f} ms", ratio))
    return rows


def newton_schulz_rows() -> list[str]:
    """Batched against per-matrix NS, and NS throughput against bf16 matmul, per shape."""
    batched_rows, throughput_rows = [], []
    for label, shape in bench_muon.SHAPES.items():
        times = bench_muon.ns_times(shape)
        per_matrix_s, per_matrix_gflops = times["ours, one matrix at a time"]
        batched_s, batched_gflops = times["ours, batched torch.baddbmm"]
        batched_rows.append(row(f"Newton-Schulz, {label}: batched vs per matrix", f"batched {batched_s * 1e3:.1f} ms",
                                f"per matrix {per_matrix_s * 1e3:.1f} ms", batched_s / per_matrix_s))
        # the path newton_schulz takes for this shape on CPU
        gflops = batched_gflops if batching_pays(torch.empty(shape)) else per_matrix_gflops
        matmul_gflops = _cpu_matmul_gflops(shape)
        throughput_rows.append(row(f"Newton-Schulz throughput, {label}, bf16, CPU", f"{gflops:.0f} GFLOP/s",
                                   f"bf16 X @ X^T {matmul_gflops:.0f} GFLOP/s", gflops / matmul_gflops))
    return batched_rows + throughput_rows


def _cpu_matmul_gflops(shape) -> float:
    m, n = sorted(shape)
    X = torch.randn(bench_muon.MATRICES, m, n).to(torch.bfloat16)
    products = lambda: [x @ x.T for x in X]  # noqa: E731 - the product NS spends most of its time in
    products()
    seconds = statistics.median(bench_muon.timed(products) for _ in range(5))
    return bench_muon.MATRICES * 2 * m * m * n / seconds / 1e9


def dmuon_rows() -> list[str]:
    rows = []
    for line in bench_dmuon.measure(2):
        _, world, what, ours, theirs, ratio, _ = (cell.strip() for cell in line.split("|"))
        rows.append(row(f"dmuon optimizer {what}, {world} ranks (GPT-2-small shapes at d={bench_dmuon.D})",
                        f"dmuon {ours} ms", f"replicated Muon {theirs} ms", float(ratio)))
    return rows


MACHINES = {"native": None, "emulated AVX2": machine.EMULATED_AVX2}
USER_PEERS = {"dmuon DDP backend": "DDP + replicated Muon"}  # a 1-D layout's naive peer, from the user's script
SECTIONS: list[str] = []  # markdown sections that follow the table in results.md


def user_step_rows(nproc: int, env: dict | None) -> dict[str, list[str]]:
    """The user-written script's rows, {setup: [W, setup, step ms, AdamW peer, ratio, q1, q3]}."""
    result = torchrun(user_step.__file__, nproc=nproc, timeout=900, echo=False, env=env)
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout(0).splitlines()
            if line.startswith("ROW ")]
    return {cells[1]: cells for cells in rows}


def training_step_rows() -> list[str]:
    """Each training step against its floor (bench_step), against its naive peer, and a user's script against
    bench_step, natively and emulated, on 2 and 4 ranks; the phases and floors go to a section of their own."""
    rows, phase_tables, agreement, predictions = [], [], [], []
    for machine_name, env in MACHINES.items():
        for nproc in (2, 4):
            bench, alone, predicted, calibration = bench_step.measure(nproc, env)
            user = user_step_rows(nproc, env)
            cells = {c[1]: dict(zip(bench_step.COLUMNS, c)) for c in bench}
            where = lambda setup: f"{bench_step.where(setup, nproc)}, {machine_name}"  # noqa: E731
            for setup, c in cells.items():
                if c["floor (ms)"] != "-":
                    rows.append(row(f"training step, {setup}, {where(setup)}: against its floor",
                                    f"{c['step (ms)']} ms", f"floor {c['floor (ms)']} ms = {c['AdamW peer']} "
                                    f"{cells[c['AdamW peer']]['step (ms)']} + owners' Muon "
                                    f"{c[bench_step.COLUMNS[7]]} + {c[bench_step.COLUMNS[8]]}",
                                    float(c["step / floor"])))
            naive = {ours: (peer, cells[ours]["step (ms)"], cells[peer]["step (ms)"])
                     for ours, peer in bench_step.PEERS.items() if ours in cells and peer in cells}
            naive.update({ours: (peer, user[ours][2], user[peer][2]) for ours, peer in USER_PEERS.items()})
            for ours, (peer, mine, theirs) in naive.items():
                rows.append(row(f"training step, {ours}, {where(ours)}: against {peer}", f"{mine} ms",
                                f"{peer} {theirs} ms", float(mine) / float(theirs)))
            phase_tables.append((machine_name, nproc, bench, alone))
            predictions.append((machine_name, nproc, cells, user, predicted, calibration))
            for setup, u in user.items():
                if setup not in cells or u[3] == "-":
                    continue
                b = cells[setup]
                overlap = float(u[5]) <= float(b["q3"]) and float(b["q1"]) <= float(u[6])
                floor_cell, within = "-", ""
                if b["floor (ms)"] != "-":  # the floor as a ratio to the AdamW peer, from bench_step's parts
                    floor_ratio = float(b["floor (ms)"]) / float(cells[b["AdamW peer"]]["step (ms)"])
                    floor_cell = f"{floor_ratio:.3f}"
                    within = f"{float(u[4]) / floor_ratio:.3f}"
                agreement.append(f"| {machine_name} | {nproc} | {setup} | {u[3]} | {u[4]} ({u[5]}-{u[6]}) | "
                                 f"{b['step / peer']} ({b['q1']}-{b['q3']}) | {'yes' if overlap else 'NO'} | "
                                 f"{floor_cell} | {within} |")
    SECTIONS.append(_training_step_sections(phase_tables, agreement))
    model_rows, section = time_model_section(predictions)
    SECTIONS.append(section)
    return rows + model_rows


def _training_step_sections(phase_tables, agreement) -> str:
    lines = ["## Training steps: where the time goes, and each layout's floor", "",
             "bench_step.py, medians of the rounds; phases per rank, averaged over ranks (benchmarks/phases.py); "
             "floor = the AdamW step of the layout + the slowest rank's Muon (and TP) phase + the collectives that "
             "AdamW does not need, timed alone.", ""]
    for machine_name, nproc, bench, alone in phase_tables:
        lines += [f"### {nproc} ranks, {machine_name}", "", "| " + " | ".join(bench_step.COLUMNS) + " |",
                  "|" + "---|" * len(bench_step.COLUMNS), *("| " + " | ".join(c) + " |" for c in bench), "",
                  "Timed alone: " + "; ".join(f"{what} {ms:.2f} ms" for what, ms in alone.items()) + ".", ""]
    lines += ["## A user's script against bench_step", "",
              "benchmarks/user_step.py, a plain script written from docs/dmuon.md, against bench_step.py in the same "
              "run: each setup's step over the AdamW step of its layout, the median of the rounds' ratios (and their "
              "interquartile range). They agree when the two ranges overlap. The floor ratio is bench_step's floor "
              "over the same AdamW step; the user's step over it is its distance from the floor.", "",
              "| machine | W ranks | setup | AdamW peer | user's script | bench_step | agree | floor / peer | "
              "user's step / floor |", "|---|---|---|---|---|---|---|---|---|", *agreement, ""]
    return "\n".join(lines)


PREDICTION_TOLERANCE = 0.20  # every predicted step within 20% of its measurement
ORDERED_APART = 0.10  # two measured rows more than 10% apart must be predicted in the same order


def time_model_section(predictions) -> tuple[list[str], str]:
    """Each row of both benchmarks against the time model's prediction from the same launch's calibration: the
    farthest per machine and world size as table rows, every row and the calibrations as a section."""
    rows, lines = [], ["## The time model: predicted against measured", "",
                       "dmuon's time model (dmuon_edu/dmuon/step_time.py) predicts every setup's step from a "
                       "calibration made at the start of the same bench_step.py launch (dmuon.calibrate(): each "
                       "collective alone over message sizes, the frameworks' own work on tiny modules, matmuls and "
                       "elementwise passes alone; on a CPU each rank computes at the part of its alone rate it kept "
                       "while every rank multiplied at once in calibrate(), the rates' column 'shared'). predicted / "
                       "measured within 20% passes; pairs of measured rows more than 10% apart must be predicted in "
                       "the same order.", ""]
    calibrations = []
    for machine_name, nproc, cells, user, predicted, (seconds, hardware) in predictions:
        table, ratios, measured = [], [], {"bench_step": {}, "user's script": {}}
        for setup, (ms, phases) in predicted.items():
            bench_ms = float(cells[setup]["step (ms)"]) if setup in cells else None
            user_ms = float(user[setup][2]) if setup in user else None
            for benchmark, value in (("bench_step", bench_ms), ("user's script", user_ms)):
                if value is not None:
                    measured[benchmark][setup] = value
                    ratios.append((ms / value, f"{setup} ({benchmark})"))
            cell = lambda value: "-" if value is None else f"{value:.0f} | {ms / value:.2f}"  # noqa: E731
            table.append(f"| {setup} | {ms:.0f} | {cell(bench_ms)} | {cell(user_ms)} | "
                         f"{'yes' if all(abs(r - 1) <= PREDICTION_TOLERANCE for r, w in ratios if w.startswith(setup + ' (')) else 'NO'} |")
        misordered, apart = [], 0
        for benchmark, values in measured.items():
            for a in values:
                for b in values:
                    if values[a] > values[b] * (1 + ORDERED_APART):
                        apart += 1
                        if not predicted[a][0] > predicted[b][0]:
                            misordered.append(f"{a} > {b} ({benchmark})")
        worst_ratio, worst = max(ratios, key=lambda r: abs(r[0] - 1))
        rows.append(row(f"time model, {nproc} ranks, {machine_name}: predicted / measured, the farthest of "
                        f"{len(ratios)} rows ({worst}); {apart - len(misordered)} of {apart} pairs 10% apart in order",
                        f"within {max(abs(r - 1) for r, _ in ratios) * 100:.0f}%", "20%", worst_ratio))
        lines += [f"### {nproc} ranks, {machine_name}", "",
                  "| setup | predicted (ms) | measured, bench_step (ms) | predicted / measured | measured, user's "
                  "script (ms) | predicted / measured | within 20% |", "|---|---|---|---|---|---|---|", *table, "",
                  f"Pairs of measured rows more than 10% apart: {apart}, predicted in another order: "
                  + (", ".join(misordered) if misordered else "none") + ".", ""]
        links = hardware["calibrated"][str(nproc)]
        calibrations.append(f"| {machine_name} | {nproc} | {seconds:.1f} | "
                            + " | ".join(f"{hardware['matmul_flops'][d] / 1e9:.0f}" for d in ("float32", "bfloat16"))
                            + f" | {hardware['memory_bandwidth'] / 1e9:.1f} | {hardware['elementwise_seconds'] * 1e9:.2f} | "
                            + f"{hardware['nonlinearity_seconds'] * 1e9:.2f} | {hardware['concurrent_share']:.2f} | "
                            + " | ".join(f"{links[c]['alpha'] * 1e6:.0f} us, {1 / links[c]['beta'] / 1e9 if links[c]['beta'] else float('inf'):.2f} GB/s"
                                         for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"))
                            + " |")
    lines += ["### The calibrations", "", "Per launch: its seconds, the matmul rates of one rank (GFLOP/s), the memory "
              "bandwidth of an elementwise pass (GB/s), an activation entry's cost through a norm or an add and "
              "through a GELU, forward and backward (ns), the part of its float32 rate a rank kept, on average, while "
              "every rank multiplied at once (shared), and each collective's alpha and 1 / beta (wire bytes per "
              "second) over the whole world.", "",
              "| machine | W ranks | seconds | float32 | bfloat16 | memory GB/s | norm, add ns | GELU ns | shared | "
              "all_reduce | all_gather | reduce_scatter | broadcast | reduce |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
              *calibrations, ""]
    return rows, "\n".join(lines)


def communication_rows() -> list[str]:
    """Counted bytes of the capstone's dmuon runs on 2 ranks, turned into wire bytes, against the formulas."""
    with tempfile.TemporaryDirectory() as directory:
        one, four = Path(directory) / "k1.json", Path(directory) / "k4.json"
        torchrun(capstone.__file__, nproc=2, args=[one, "--steps", 2, "--accum-steps", 1, "--modes", "Z2", "Z3"],
                 echo=False)
        torchrun(capstone.__file__, nproc=2, echo=False,
                 args=[four, "--steps", 2, "--accum-steps", 4, "--modes", "Z3", "Z3 without no_sync"])
        k1, k4 = json.loads(one.read_text()), json.loads(four.read_text())

    def wire(run, *ops):
        n = run["world_size"]
        return sum(run["comm_per_step"][op][1] for op in ops) * (n - 1) // n

    rows = []
    for mode, factor in (("Z2", 2), ("Z3", 3)):
        run = k1[mode]
        n, p_m = run["world_size"], run["P_M"]
        formula = factor * (n - 1) * p_m // n
        rows.append(row(f"dmuon bytes per step, {mode}, 1 micro-batch, {n} ranks (wire per rank = (W-1)/W x counted)",
                        f"{wire(run, 'broadcast', 'reduce')} B", f"{factor}(W-1)/W P_M = {formula} B",
                        wire(run, "broadcast", "reduce") / formula))
    for mode in ("Z3", "Z3 without no_sync"):
        run = k4[mode]
        n, p_m = run["world_size"], run["P_M"]
        per_window = (n - 1) * p_m // n  # no_sync: one reduce per window, whatever the number of micro-batches
        rows.append(row(f"dmuon reduce bytes per step, {mode}, 4 micro-batches", f"{wire(run, 'reduce')} B",
                        f"one reduce per window, (W-1)/W P_M = {per_window} B", wire(run, "reduce") / per_window))
    return rows


def memory_rows() -> list[str]:
    """Peak memory of a step accumulated over 4 micro-batches against the same step on the whole batch."""
    config = GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=4, d_model=128)
    tokens = torch.randint(0, config.vocab_size, (32, config.block_size + 1), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])

    def loss_fn(logits, targets):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def peak(accum_steps: int) -> int:
        torch.manual_seed(0)
        model = GPT(config)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        microbatches = list(zip(batch[0].chunk(accum_steps), batch[1].chunk(accum_steps)))
        return peak_memory_bytes(lambda: train_step_with_accumulation(lambda x: model(x).logits, optimizer,
                                                                      microbatches, loss_fn))

    accumulated, full = peak(4), peak(1)
    return [row("peak memory of one step, GPT d=128 T=128, 4 x 8 sequences vs 32", f"{accumulated / 2**20:.1f} MiB",
                f"full batch {full / 2**20:.1f} MiB", accumulated / full)]


def gpu_rows() -> list[str]:
    """NS throughput in bf16 on the GPU against bf16 matmul throughput, both measured now; and each beside the
    time model's prediction from its GPU preset (the compute rates: one GPU cannot check alpha, beta or overlap)."""
    from dmuon_edu import dmuon

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    preset = "h200" if "H200" in name else "h100-sxm"  # another GPU is compared with the H100's rates, and says so
    hardware = dmuon.HARDWARE[preset]
    a = torch.randn(GPU_MATMUL_SIZE, GPU_MATMUL_SIZE, device=device, dtype=torch.bfloat16)
    matmul_s = _cuda_seconds(lambda: a @ a)
    matmul_tflops = 2 * GPU_MATMUL_SIZE**3 / matmul_s / 1e12
    predicted_tflops = hardware.rate("bfloat16") / 1e12
    rows = [row(f"time model: bf16 matmul {GPU_MATMUL_SIZE}^3 on {name}, measured against the {preset} preset "
                "(compute rates only: one GPU checks neither alpha, beta nor overlap)", f"{matmul_tflops:.0f} TFLOP/s",
                f"predicted {predicted_tflops:.0f} TFLOP/s", matmul_tflops / predicted_tflops)]
    for label, shape in GPU_NS_SHAPES.items():
        G = torch.randn(GPU_NS_MATRICES, *shape, device=device)
        ns_s = _cuda_seconds(lambda: newton_schulz(G, dtype=torch.bfloat16))
        flops = GPU_NS_MATRICES * ns_flops(shape)  # as newton_schulz runs them (Gram-space pairs for wide shapes)
        ns_tflops = flops / ns_s / 1e12
        rows.append(row(f"Newton-Schulz throughput, {label} x {GPU_NS_MATRICES}, bf16, {name}",
                        f"{ns_tflops:.0f} TFLOP/s", f"bf16 matmul {GPU_MATMUL_SIZE}^3 {matmul_tflops:.0f} TFLOP/s",
                        ns_tflops / matmul_tflops))
        predicted_s = flops / hardware.rate("bfloat16")
        rows.append(row(f"time model: Newton-Schulz {label} x {GPU_NS_MATRICES}, bf16, {name}, measured against the "
                        f"{preset} preset", f"{ns_s * 1e3:.2f} ms", f"predicted {predicted_s * 1e3:.2f} ms",
                        ns_s / predicted_s))
    return rows


def _cuda_seconds(fn, repeats: int = 10) -> float:
    for _ in range(3):  # warm-up: kernel selection, allocator
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU rows (needs CUDA)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results.md")
    args = parser.parse_args(argv)
    if args.gpu_only and not torch.cuda.is_available():
        sys.exit(f"the GPU rows need a CUDA GPU, and torch {torch.__version__} sees none "
                 "(on a GPU machine install a CUDA build: make install CONSTRAINTS=)")

    start, load_before = time.perf_counter(), os.getloadavg()[0]
    sections = [] if args.gpu_only else [muon_step_rows, newton_schulz_rows, dmuon_rows, training_step_rows,
                                        communication_rows, memory_rows]
    if not args.gpu_only:
        SECTIONS.append(gpu_predictions.section())
    if torch.cuda.is_available():
        sections.append(gpu_rows)
    rows = []
    for section in sections:
        print(f"running {section.__name__} ...", file=sys.stderr, flush=True)
        began = time.perf_counter()
        try:
            rows += section()
        except RankFailedError as error:
            print(f"{section.__name__} failed; the ranks' last lines:\n{error.output}", file=sys.stderr)
            raise
        # make bench must stay within 15 minutes: where they go
        print(f"{section.__name__}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    minutes = (time.perf_counter() - start) / 60
    table = "\n".join([
        f"Measured {datetime.date.today().isoformat()} on a {machine.describe()}; {torch.get_num_threads()} threads "
        f"in this process, one per rank under torchrun; load average {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end; {minutes:.1f} minutes. ratio = measured / against: below 1, less time, memory "
        "or bytes; for throughput, the fraction of matmul speed that Newton-Schulz reaches.",
        "",
        HEADER,
        *rows,
        "",
        *SECTIONS,
    ])
    args.out.write_text(table + "\n")
    print(table)
    print(f"\nwritten to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
