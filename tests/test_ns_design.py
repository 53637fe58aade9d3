"""The coefficient-design helpers of module 4: each Polar Express version, margins folded in, is its recipe."""

import pytest
import torch

from dmuon_edu.course.ns_design import (
    PAPER_AS_PRINTED,
    POLAR_EXPRESS_VERSIONS,
    composed_polynomial,
    newton_schulz_flops,
)
from dmuon_edu.newton_schulz import POLAR_EXPRESS_AS_PUBLISHED, newton_schulz


def _recipe(x, tuples, input_margin, step_margin):
    """A published recipe as its code runs it: x / input_margin, then p(x / step_margin) for each tuple."""
    x = x / input_margin
    for a, b, c in tuples:
        y = x / step_margin
        x = a * y + b * y**3 + c * y**5
    return x


@pytest.mark.parametrize(
    "version, tuples, input_margin, step_margin",
    [
        ("paper", PAPER_AS_PRINTED, 1.01, 1.01),
        ("modded-nanogpt", POLAR_EXPRESS_AS_PUBLISHED, 1.02, 1.0),
        ("public dmuon", PAPER_AS_PRINTED, 1.0, 1.05),
    ],
)
def test_each_polar_express_version_is_its_recipe(version, tuples, input_margin, step_margin):
    (name,) = [name for name in POLAR_EXPRESS_VERSIONS if name.startswith(version)]
    x = torch.logspace(-4, 0, 1001, dtype=torch.float64)
    folded = composed_polynomial(x, POLAR_EXPRESS_VERSIONS[name]["per step"])
    # float64 on values O(1): the two orders of evaluation differ by rounding only
    torch.testing.assert_close(folded, _recipe(x, tuples, input_margin, step_margin), rtol=0, atol=1e-12)


def test_composed_polynomial_is_newton_schulz_on_the_singular_values():
    torch.manual_seed(0)
    Q1, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))
    Q2, _ = torch.linalg.qr(torch.randn(40, 16, dtype=torch.float64))
    s = torch.logspace(-3, 0, 16, dtype=torch.float64)
    G = (Q1 * s) @ Q2.T
    O = newton_schulz(G, coefficients="polar_express", dtype=torch.float64, eps=0.0)
    (package_set,) = [v["per step"] for name, v in POLAR_EXPRESS_VERSIONS.items() if name.startswith("modded-nanogpt")]
    expected = composed_polynomial(s / s.norm(), package_set)  # NS starts from G / ||G||_F
    torch.testing.assert_close(torch.diagonal(Q1.T @ O @ Q2), expected, rtol=0, atol=1e-10)


def test_newton_schulz_flops_count_the_three_products():
    m, n = 3, 5  # X X^T: m*m outputs of n multiply-adds; A A: m*m of m; B X: m*n of m
    multiply_adds = m * m * n + m * m * m + m * n * m
    assert newton_schulz_flops(m, n, steps=1) == 2 * multiply_adds
    assert newton_schulz_flops(n, m, steps=5) == 5 * 2 * multiply_adds  # a tall matrix runs on its short side
