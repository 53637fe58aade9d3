"""The capstone's optimizer comparison: AdamW and Muon over a small learning-rate sweep, several seeds each.

One run of the notebook is one seed at one learning rate; whether one optimizer beats
the other needs more. Every point of ``GRID`` trains the capstone's GPT in one process
(``capstone.run_single_process``) with each of ``SEEDS``: the seed sets the model's
initialisation and the training text; the chain and the held-out text stay the same,
so every run has the same floor. For AdamW the swept rate is AdamW's; for Muon it is
Muon's, with AdamW's share (embeddings, norms, biases, head) at ``Capstone.adamw_lr``.

Which points can be compared with a fresh run. At a high learning rate the training
is chaotic: the rounding of one CPU's kernels against another's grows over the
steps, until the held-out loss moves by up to 0.02 (measured: AdamW at 0.01 and 0.03
between AVX-512 and AVX2 kernels), while at low rates it moves by less than 4e-5
(AdamW) or 1.3e-3 (Muon, whose Newton-Schulz runs in bf16 on one CPU and in float32 on
the other).
So every point runs on two kernel sets (``KERNEL_SETS``): this machine's own, and
torch's AVX2 kernels with float32 Newton-Schulz, which is what a CPU without native
bf16 computes. Each run stores both results with each set's CPU capability and
Newton-Schulz dtype; a point is *stable* when they agree within STABLE_TOLERANCE.
Only stable points are compared with a fresh run, and a claim the notebook makes
from the sweep must hold on both kernel sets.

Its 21 runs take about 2 minutes per kernel set on 2 cores, so the notebook reads the stored results::

    python -m dmuon_edu.course.capstone_sweep            # rewrites capstone_sweep.json next to this file

Run it on a machine whose own kernels differ from the AVX2 set (native bf16, or AVX-512),
or both sets compute the same numbers and every point looks stable.
``tests/test_capstone.py`` re-runs the first steps of one stored run and compares.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from dmuon_edu.course.capstone import run_single_process
from dmuon_edu.course.capstone_problem import Capstone
from dmuon_edu.newton_schulz import NS_DTYPE_ENV, fast_dtype

__all__ = ["GRID", "SEEDS", "RESULTS", "KERNEL_SETS", "STABLE_TOLERANCE", "run_point", "load", "kernel_set"]

# Each optimizer's rates, about 3x apart around its default (AdamW 1e-2, Muon 0.02); AdamW's reach one lower,
# because its best rate would otherwise sit at the edge of the grid.
GRID = {"AdamW": (1e-3, 3e-3, 1e-2, 3e-2), "Muon": (0.01, 0.02, 0.05)}
SEEDS = (0, 1, 2)
RESULTS = Path(__file__).with_name("capstone_sweep.json")

# The environment of each kernel set. ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA make torch run its AVX2
# kernels (bf16 products then run emulated, ~50x slower); the CPU's flags still say bf16 is native, so
# DMUON_EDU_NS_DTYPE tells Newton-Schulz what such a CPU's "auto" chooses.
KERNEL_SETS = {
    "this machine": {},
    "AVX2, no native bf16": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", NS_DTYPE_ENV: "float32"},
}
# Stable points' held-out losses agree across the two kernel sets within 1.3e-3 (Muon at 0.02: bf16 against
# float32 Newton-Schulz) and 4e-5 (AdamW up to 1e-2, two of three seeds); chaotic ones differ by 5.6e-3 to 0.022.
STABLE_TOLERANCE = 5e-3


def settings(optimizer: str, lr: float, seed: int, steps: int = Capstone.steps) -> Capstone:
    """The capstone's settings for one run of the sweep."""
    rate = {"AdamW": "adamw_lr", "Muon": "muon_lr"}[optimizer]
    return replace(Capstone(steps=steps, seed=seed), **{rate: lr})


def run_point(optimizer: str, lr: float, seed: int, steps: int = Capstone.steps) -> dict:
    """One run on this process's kernels: its settings, training loss per step and held-out loss."""
    result = run_single_process(settings(optimizer, lr, seed, steps), optimizer, progress=False)
    return {"optimizer": optimizer, "lr": lr, "seed": seed, "losses": result.losses,
            "held_out_loss": result.held_out_loss}


def kernel_set() -> dict:
    """What this process computes with: torch's CPU capability and the Newton-Schulz dtype "auto" takes."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "ns_dtype": str(fast_dtype("cpu"))[6:]}


def load(path: Path = RESULTS) -> dict:
    """The stored sweep: ``{"floor": ..., "kernel_sets": {name: kernel_set()}, "runs": [...]}``.

    Each run holds ``optimizer``, ``lr``, ``seed``, this machine's ``losses`` and
    ``held_out_loss``, ``held_out_by_kernel_set`` ({name: loss}) and ``stable``.
    """
    return json.loads(path.read_text())


def _run_points(points: list[tuple[str, float, int]], jobs: int) -> list[dict]:
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(run_point, *zip(*points)))


def _one_kernel_set(name: str, jobs: int) -> dict:
    """Every point, run in a fresh interpreter with the kernel set's environment (it is read at import)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "runs.json"
        subprocess.run([sys.executable, "-m", __spec__.name, "--only-here", str(out), "--jobs", str(jobs)],
                       env={**os.environ, **KERNEL_SETS[name]}, check=True)
        return json.loads(out.read_text())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (each takes one thread)")
    parser.add_argument("--only-here", type=Path, help=argparse.SUPPRESS)  # one kernel set: this process's
    args = parser.parse_args(argv)
    points = [(name, lr, seed) for name, rates in GRID.items() for lr in rates for seed in SEEDS]
    if args.only_here:
        args.only_here.write_text(json.dumps({"kernel_set": kernel_set(), "runs": _run_points(points, args.jobs)}))
        return
    by_set = {name: _one_kernel_set(name, args.jobs) for name in KERNEL_SETS}
    mine, *_ = by_set.values()
    runs = []
    for i, run in enumerate(mine["runs"]):
        held_out = {name: result["runs"][i]["held_out_loss"] for name, result in by_set.items()}
        runs.append({**run, "held_out_by_kernel_set": held_out,
                     "stable": max(held_out.values()) - min(held_out.values()) < STABLE_TOLERANCE})
    kernel_sets = {name: result["kernel_set"] for name, result in by_set.items()}
    args.out.write_text(json.dumps({"floor": Capstone().floor(), "kernel_sets": kernel_sets, "runs": runs},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
