"""The capstone's optimizer comparison: AdamW and Muon over a small learning-rate sweep, several seeds each.

One run of the notebook is one seed at one learning rate; whether one optimizer beats
the other needs more. Every point of ``GRID`` trains the capstone's GPT in one process
(``capstone.run_single_process``) with each of ``SEEDS``: the seed sets the model's
initialisation and the training text; the chain and the held-out text stay the same,
so every run has the same floor. For AdamW the swept rate is AdamW's; for Muon it is
Muon's, with AdamW's share (embeddings, norms, biases, head) at ``Capstone.adamw_lr``.

Its 21 runs take about 8 minutes on 2 cores, so the notebook plots the stored results::

    python -m dmuon_edu.course.capstone_sweep            # rewrites capstone_sweep.json next to this file

``tests/test_capstone.py`` re-runs the first steps of one stored run and compares.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from dmuon_edu.course.capstone import Capstone, run_single_process

__all__ = ["GRID", "SEEDS", "RESULTS", "run_point", "load"]

# Each optimizer's rates, about 3x apart around its default (AdamW 1e-2, Muon 0.02); AdamW's reach one lower,
# because its best rate would otherwise sit at the edge of the grid.
GRID = {"AdamW": (1e-3, 3e-3, 1e-2, 3e-2), "Muon": (0.01, 0.02, 0.05)}
SEEDS = (0, 1, 2)
RESULTS = Path(__file__).with_name("capstone_sweep.json")


def settings(optimizer: str, lr: float, seed: int, steps: int = Capstone.steps) -> Capstone:
    """The capstone's settings for one run of the sweep."""
    rate = {"AdamW": "adamw_lr", "Muon": "muon_lr"}[optimizer]
    return replace(Capstone(steps=steps, seed=seed), **{rate: lr})


def run_point(optimizer: str, lr: float, seed: int, steps: int = Capstone.steps) -> dict:
    """One run: its settings, training loss per step and held-out loss."""
    result = run_single_process(settings(optimizer, lr, seed, steps), optimizer, progress=False)
    return {"optimizer": optimizer, "lr": lr, "seed": seed, "losses": result.losses,
            "held_out_loss": result.held_out_loss}


def load(path: Path = RESULTS) -> dict:
    """The stored sweep: ``{"floor": ..., "runs": [run_point(...), ...]}``."""
    return json.loads(path.read_text())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (each takes one thread)")
    args = parser.parse_args(argv)
    points = [(name, lr, seed) for name, rates in GRID.items() for lr in rates for seed in SEEDS]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(run_point, *zip(*points)))
    args.out.write_text(json.dumps({"floor": Capstone().floor(), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
