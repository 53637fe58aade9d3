r"""Designing Newton-Schulz coefficients, seen one singular value at a time.

A Newton-Schulz step with coefficients (a, b, c) maps every singular value x of its
input to p(x) = a x + b x^3 + c x^5 and keeps the singular vectors
(:mod:`dmuon_edu.newton_schulz`), so five steps are judged by the composed scalar
polynomial p_5(...p_1(x)) on [0, 1], where normalising by the Frobenius norm puts
every singular value. This module evaluates that composition, the band it maps an
interval into, the published variants of the Polar Express coefficients, and what
Newton-Schulz costs next to a training step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dmuon_edu.newton_schulz import POLAR_EXPRESS, POLAR_EXPRESS_AS_PUBLISHED, POLAR_EXPRESS_PAPER, _fold_input_margin

__all__ = [
    "composed_polynomial",
    "band_reached",
    "design_grid",
    "POLAR_EXPRESS_VERSIONS",
    "newton_schulz_flops",
    "training_step_flops",
]

Coefficients = tuple[float, float, float]

# The Polar Express paper's (arXiv:2505.16932) Algorithm 1: the first five of its tuples as printed.
# Its code divides every tuple but the last of its eight by a 1.01 safety factor, p(x / 1.01), and
# the input by 1.01 ||G||_F.
PAPER_AS_PRINTED: tuple[Coefficients, ...] = POLAR_EXPRESS_PAPER
PAPER_SAFETY = 1.01
PUBLIC_DMUON_SAFETY = 1.05  # X-Square-Robot/dmuon: the paper's tuples, each p(x / 1.05); input / ||G||_F

_paper = tuple(_fold_input_margin(t, PAPER_SAFETY) for t in PAPER_AS_PRINTED)

# Each version as per-step tuples acting on X_0 = G / ||G||_F, input margins folded into step 1.
POLAR_EXPRESS_VERSIONS: dict[str, dict] = {
    "paper (arXiv:2505.16932, Algorithm 1)": {
        "printed": PAPER_AS_PRINTED[0],
        "folded in": "every tuple p(x / 1.01); input / (1.01 ||G||_F)",
        "per step": (_fold_input_margin(_paper[0], PAPER_SAFETY), *_paper[1:]),
    },
    "modded-nanogpt and microsoft/dion (this package's 'polar_express')": {
        "printed": POLAR_EXPRESS_AS_PUBLISHED[0],
        "folded in": "input / (1.02 ||G||_F), folded into the first tuple",
        "per step": POLAR_EXPRESS,
    },
    "public dmuon (X-Square-Robot/dmuon)": {
        "printed": PAPER_AS_PRINTED[0],
        "folded in": "every tuple p(x / 1.05); input / ||G||_F",
        "per step": tuple(_fold_input_margin(t, PUBLIC_DMUON_SAFETY) for t in PAPER_AS_PRINTED),
    },
}


def design_grid(smallest: float = 1e-3, points: int = 10_001) -> torch.Tensor:
    """Log-spaced singular values from ``smallest`` to 1 in float64: where a design is judged."""
    return torch.logspace(math.log10(smallest), 0.0, points, dtype=torch.float64)


def composed_polynomial(
    x: torch.Tensor, coefficients: Coefficients | Sequence[Coefficients], steps: int = 5
) -> torch.Tensor:
    """Where ``steps`` Newton-Schulz steps send singular values ``x``.

    ``coefficients`` is one (a, b, c) tuple for every step or one tuple per step (the last
    repeats when there are fewer tuples than steps), as in :func:`newton_schulz`.
    """
    per_step = [coefficients] if len(coefficients) == 3 and not isinstance(coefficients[0], Sequence) else coefficients
    for k in range(steps):
        a, b, c = per_step[min(k, len(per_step) - 1)]
        x = a * x + b * x**3 + c * x**5
    return x


def band_reached(
    coefficients: Coefficients | Sequence[Coefficients], steps: int = 5, smallest: float = 1e-3
) -> tuple[float, float]:
    """The smallest and largest value the composition takes on ``design_grid(smallest)``."""
    y = composed_polynomial(design_grid(smallest), coefficients, steps)
    return y.min().item(), y.max().item()  # NaN or inf when the iteration diverges


def newton_schulz_flops(m: int, n: int, steps: int = 5) -> int:
    """Multiply-adds times two of ``steps`` direct steps on an m x n matrix (computed on the short side)."""
    short, long = min(m, n), max(m, n)
    return steps * (4 * short**2 * long + 2 * short**3)  # X X^T and B X: 2 s^2 l each; A A: 2 s^3


def training_step_flops(params: int, tokens: int) -> int:
    """Forward (2) and backward (4) flops per parameter per token."""
    return 6 * params * tokens
