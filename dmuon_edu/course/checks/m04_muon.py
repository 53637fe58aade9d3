"""Checks for module 4: the Newton-Schulz step, a coefficient design, and the Muon step on conv filters."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from dmuon_edu.course.ns_design import band_reached, composed_polynomial
from dmuon_edu.muon import Muon
from dmuon_edu.newton_schulz import JORDAN, newton_schulz

# Both sides run in float64 on matrices with entries O(1): only rounding differs.
ATOL = 1e-10


def _check_ns_step(candidate: Callable) -> tuple[str, str]:
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(4, 7, generator=generator, dtype=torch.float64)
    X = X / X.norm()
    a, b, c = JORDAN[0]
    try:
        got = candidate(X, a, b, c)
    except RuntimeError as error:
        if "size" not in str(error) and "shape" not in str(error):
            raise
        return "FAIL", f"the shapes do not fit ({error}); for a wide X (m <= n) use A = X @ X.T, which is m x m"
    if not isinstance(got, torch.Tensor) or got.shape != X.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return "FAIL", f"return a matrix of X's shape {tuple(X.shape)}, got {shape}; use A = X @ X.T (m x m) for a wide X"
    A = X @ X.T
    expected = _cheapest_ns_step(X, a, b, c)
    if torch.allclose(got, expected, atol=ATOL, rtol=0):
        return _check_ns_step_cost(candidate)
    mistakes = {
        "the a * X term is missing: X_next = a X + (b A + c A^2) X": (b * A + c * A @ A) @ X,
        "the quintic term needs A @ A, i.e. (X X^T)^2, not A": a * X + (b * A + c * A) @ X,
        "the coefficients are swapped: b goes with A, c with A @ A": a * X + (c * A + b * A @ A) @ X,
        "A * A squares each entry of A; the quintic term needs the matrix product A @ A": a * X + (b * A + c * A * A) @ X,
    }
    for hint, wrong in mistakes.items():
        if torch.allclose(got, wrong, atol=ATOL, rtol=0):
            return "FAIL", hint
    return "FAIL", f"off by up to {(got - expected).abs().max().item():.2g}: compute A = X @ X.T, then a * X + (b * A + c * A @ A) @ X"


# The design half: the flops of the step on a wide 8 x 32 X. Grouping with A = X X^T (8 x 8) costs 9216;
# honest variants cost up to 1.8x that (A @ X formed twice, or A (A X) instead of (A A) X), a left-to-right
# X X^T X X^T X 2.7x, and every grouping through X^T X (32 x 32) 10x or more.
FLOPS_SHAPE = (8, 32)
FLOPS_RATIO = 2.0


def _flops(step: Callable, X: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        step(X, *JORDAN[0])
    return counter.get_total_flops()


def _cheapest_ns_step(X, a, b, c):
    A = X @ X.T
    return a * X + (b * A + c * A @ A) @ X


def _check_ns_step_cost(candidate: Callable) -> tuple[str, str]:
    X = torch.randn(*FLOPS_SHAPE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ratio = _flops(candidate, X) / _flops(_cheapest_ns_step, X)
    if ratio > FLOPS_RATIO:
        m, n = FLOPS_SHAPE
        return "FAIL", (f"the right values at {ratio:.1f}x the flops of the cheapest grouping on the {m} x {n} X: form "
                        f"the {m} x {m} A = X X^T once (not the {n} x {n} X^T X) and apply b A + c A^2 to X once")
    return "PASS", ("one quintic Newton-Schulz step: X -> a X + (b A + c A^2) X with A = X X^T, at "
                    f"{ratio:.1f}x the flops of the cheapest grouping")


# A conv layer's filters, (out, in, kh, kw): as a matrix of rows per output channel, (16, 8), tall, so the shape
# factor sqrt(2) matters; as matrices per (out, in) kernel, (32, 4), another Newton-Schulz and factor sqrt(8).
CONV_SHAPE = (16, 2, 2, 2)


def _reference_muon(W, G_steps, lr, momentum, nesterov):
    """dmuon_edu.Muon on the filters as the matrix (out, in * kh * kw), Keller Jordan's muon.py's reading of a conv
    layer; back in W's shape."""
    matrix = torch.nn.Parameter(W.flatten(1).clone())
    optimizer = Muon([matrix], lr=lr, momentum=momentum, nesterov=nesterov, ns_dtype=torch.float32)
    for G in G_steps:
        matrix.grad = G.flatten(1).clone()
        optimizer.step()
    return matrix.detach().view(W.shape)


def _check_muon_conv_step(candidate: Callable) -> tuple[str, str]:
    generator = torch.Generator().manual_seed(1)
    W0 = torch.randn(*CONV_SHAPE, generator=generator)
    G_steps = [torch.randn(*CONV_SHAPE, generator=generator) for _ in range(3)]
    lr, momentum = 0.05, 0.9

    def run(nesterov):
        W, B = W0.clone(), torch.zeros_like(W0)
        for G in G_steps:
            W, B = candidate(W, G.clone(), B, lr, momentum=momentum, nesterov=nesterov)
        return W

    got = run(nesterov=True)
    if not isinstance(got, torch.Tensor) or got.shape != W0.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return "FAIL", f"return (new_W, new_B) with W's shape {CONV_SHAPE}, got {shape}: reshape the update back"
    expected = _reference_muon(W0, G_steps, lr, momentum, nesterov=True)
    # float32 Newton-Schulz on both sides; the learner may order the arithmetic differently.
    if torch.allclose(got, expected, atol=1e-5, rtol=0):
        if torch.allclose(run(nesterov=False), _reference_muon(W0, G_steps, lr, momentum, nesterov=False),
                          atol=1e-5, rtol=0):
            return "PASS", ("each output channel's filters as one row of a (16, 8) matrix: momentum, Nesterov, "
                            "Newton-Schulz and the shape factor, over three steps")
        return "FAIL", "with nesterov=False the update is the momentum buffer itself: U = B"
    cost = f"(after three steps the weights are up to {(got - expected).abs().max().item():.2g} off Muon's)"
    for variant, hint in _MUON_MISTAKES.items():
        if torch.allclose(got, _muon_variant(W0, G_steps, lr, momentum, *variant), atol=1e-5, rtol=0):
            return "FAIL", f"{hint} {cost}"
    return "FAIL", (f"your step is not Muon's on the matrix (out, in * kh * kw) {cost}: compare it, line by line, "
                    "with the contract in help(dmuon_edu.Muon)")


_LOOK_AHEADS = {"nesterov": lambda G, B, mu: G + mu * B, "none": lambda G, B, mu: B,
                "swapped": lambda G, B, mu: B + mu * G}
_MATRICES = {"rows per output channel": lambda X: X.flatten(1), "a matrix per kernel": lambda X: X.flatten(0, 1)}
# (look-ahead, shape factor, orthogonalised, matrix), with nesterov=True: each known mistake's own hint.
_MUON_MISTAKES = {
    ("nesterov", "matrix", True, "a matrix per kernel"): (
        "Newton-Schulz ran on each (out, in) pair's kh x kw kernel as a matrix of its own: orthogonalise the layer's "
        "map, the (out, in * kh * kw) matrix, one row per output channel (W.flatten(1))"),
    ("nesterov", "4-D", True, "rows per output channel"): (
        "the shape factor is sqrt(max(1, m / n)) of the matrix Newton-Schulz ran on, (16, 8): sqrt(2); out / in of the "
        "4-D shape, 16 / 2, gives sqrt(8)"),
    ("nesterov", "none", True, "rows per output channel"): (
        "the shape factor sqrt(max(1, m / n)) of the (16, 8) matrix, sqrt(2), is missing"),
    ("none", "matrix", True, "rows per output channel"): (
        "that is Muon without Nesterov: with nesterov=True the update is U = G + momentum * B"),
    ("swapped", "matrix", True, "rows per output channel"): (
        "the look-ahead is swapped: Nesterov's U is the gradient plus momentum times the new buffer, "
        "G + momentum * B, not B + momentum * G"),
    ("nesterov", "matrix", False, "rows per output channel"): (
        "the update is not orthogonalised: O = newton_schulz(U) is what makes it Muon, every direction moved by the "
        "same amount"),
}


def _muon_variant(W0, G_steps, lr, momentum, look_ahead: str, factor: str, orthogonalised: bool, matrix: str):
    """Muon's step on conv filters with known changes: the look-ahead, the shape factor (of the matrices Newton-Schulz
    sees, of the 4-D shape's out / in, or none), whether the update goes through Newton-Schulz, and those matrices."""
    W, B = W0.clone(), torch.zeros_like(W0)
    m, n = _MATRICES[matrix](W0).shape[-2:]
    scale = {"matrix": max(1.0, m / n) ** 0.5, "4-D": max(1.0, W0.shape[0] / W0.shape[1]) ** 0.5, "none": 1.0}[factor]
    for G in G_steps:
        B = momentum * B + G
        U = _MATRICES[matrix](_LOOK_AHEADS[look_ahead](G, B, momentum))
        O = newton_schulz(U, dtype=torch.float32) if orthogonalised else U
        W = W - lr * scale * O.reshape(W.shape)
    return W


# The coefficient-design exercise: five steps of one tuple must lift every singular value in
# [SMALLEST, 1] into a band [lo, hi] that the learner states, with 1 inside, lo >= LOWEST_FLOOR
# (above the 0.47 that Keller Jordan's tuple leaves at 0.001) and hi <= HIGHEST_TOP.
SMALLEST, LOWEST_FLOOR, HIGHEST_TOP, STEPS = 1e-3, 0.5, 1.5, 5


def _check_ns_coefficients(candidate: Callable) -> tuple[str, str]:
    answer = candidate()
    try:
        (a, b, c), (lo, hi) = answer
        a, b, c, lo, hi = (float(v) for v in (a, b, c, lo, hi))
    except (TypeError, ValueError):
        return "FAIL", f"return ((a, b, c), (lo, hi)): three coefficients and the band you promise, got {answer!r}"
    if not lo <= 1 <= hi:
        return "FAIL", (
            f"your band [{lo:.2f}, {hi:.2f}] excludes 1: every direction would move {(lo + hi) / 2:.2f}x as far as "
            "the orthogonal update, a change of learning rate, not orthogonalisation; aim the band at 1"
        )
    if lo < LOWEST_FLOOR or hi > HIGHEST_TOP:
        jordan_lo, jordan_hi = band_reached(JORDAN, STEPS, SMALLEST)
        return "FAIL", (
            f"your band [{lo:.2f}, {hi:.2f}] is too wide: promise at least {LOWEST_FLOOR} and at most {HIGHEST_TOP} "
            f"(Keller Jordan's tuple already reaches [{jordan_lo:.2f}, {jordan_hi:.2f}])"
        )
    reached_lo, reached_hi = band_reached((a, b, c), STEPS, SMALLEST)
    # past 10 the x^5 term has taken over: the next steps only grow it, far beyond any allowed band
    if not torch.isfinite(torch.tensor([reached_lo, reached_hi])).all() or reached_hi > 10:
        xs = torch.linspace(0, 3, 3001, dtype=torch.float64)
        one_step = composed_polynomial(xs, (a, b, c), steps=1)
        escape = xs[one_step <= xs].max().item()  # beyond it p(x) > x: values climb at every step
        peak = one_step[:1001].max().item()  # on [0, 1]
        return "FAIL", (
            f"the iteration diverges: after {STEPS} steps the largest singular value is {reached_hi:.1e}. One step "
            f"sends x above {escape:.2f} further up (p(x) > x there), and p's peak on [0, 1] is {peak:.2f}: "
            "p must map your band into itself, so keep its peak below your band's top"
        )
    lifted = composed_polynomial(torch.tensor(SMALLEST, dtype=torch.float64), (a, b, c), STEPS).item()
    if reached_lo < lo and a**STEPS * SMALLEST < lo:
        return "FAIL", (
            f"the slope at zero is too small: near 0, p(x) = a x, so {STEPS} steps multiply a tiny singular value by "
            f"a^{STEPS} = {a**STEPS:.0f} and {SMALLEST} ends at {lifted:.2f}, below your floor {lo:.2f}; "
            f"you need a^{STEPS} * {SMALLEST} >= {lo:.2f}"
        )
    if reached_lo < lo or reached_hi > hi:
        return "FAIL", (
            f"your tuple maps [{SMALLEST}, 1] into [{reached_lo:.2f}, {reached_hi:.2f}], outside the band "
            f"[{lo:.2f}, {hi:.2f}] you promised; move the band, or p's peak and its value at the band's top"
        )
    return "PASS", (
        f"{STEPS} steps of ({a}, {b}, {c}) map [{SMALLEST}, 1] into [{reached_lo:.2f}, {reached_hi:.2f}], "
        f"inside your band [{lo:.2f}, {hi:.2f}]"
    )


EXERCISES = {
    "ns_step": _check_ns_step,
    "ns_coefficients": _check_ns_coefficients,
    "muon_conv_step": _check_muon_conv_step,
}
