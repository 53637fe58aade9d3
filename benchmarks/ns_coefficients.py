"""Newton-Schulz coefficient sets side by side: how close 5 steps get to the orthogonal factor.

    .venv/bin/python benchmarks/ns_coefficients.py

For each input, the singular values of the result (ideal: all 1) and its distance to the
exact polar factor U V^T, relative, for: Keller Jordan's tuple (dmuon_edu's and
torch.optim.Muon's default), this package's "polar_express" (modded-nanogpt's tuples with
their 1.02 margin), and the public dmuon project's default, the Polar Express paper's
tuples with every step rescaled by a 1.05 safety factor (p(x / 1.05) for each step).
bf16 products, as in Muon; the input is normalised in float32.
"""

from __future__ import annotations

import torch

from dmuon_edu.course.ns_design import POLAR_EXPRESS_VERSIONS
from dmuon_edu.newton_schulz import COEFFICIENTS, newton_schulz

PUBLIC_DMUON = POLAR_EXPRESS_VERSIONS["public dmuon (X-Square-Robot/dmuon)"]["per step"]
SETS = {"jordan (ours, torch's)": COEFFICIENTS["jordan"], "polar_express (ours)": COEFFICIENTS["polar_express"],
        "public dmuon (paper / 1.05)": PUBLIC_DMUON}


def inputs(m: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    gaussian = torch.randn(m, n, generator=g)
    u, _, v = torch.linalg.svd(torch.randn(m, n, generator=g, dtype=torch.float64), full_matrices=False)
    decaying = (u * (1.0 / torch.arange(1, m + 1, dtype=torch.float64))) @ v  # singular values 1/k
    return {"Gaussian": gaussian, "singular values 1/k": decaying.float()}


def main() -> None:
    print("| input | coefficients | singular values after 5 steps | distance to U V^T |")
    print("|---|---|---|---|")
    for name, G in inputs(512, 2048).items():
        u, _, v = torch.linalg.svd(G.double(), full_matrices=False)
        polar = u @ v
        for label, coefficients in SETS.items():
            O = newton_schulz(G, steps=5, coefficients=list(coefficients), dtype=torch.bfloat16).double()
            s = torch.linalg.svdvals(O)
            distance = (O - polar).norm() / polar.norm()
            print(f"| {name} | {label} | {s.min():.2f} to {s.max():.2f} | {distance:.3f} |")


if __name__ == "__main__":
    main()
