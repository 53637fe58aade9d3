"""Checks for module 4: Newton-Schulz and the Muon step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dmuon_edu.muon import Muon
from dmuon_edu.newton_schulz import JORDAN

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
    expected = a * X + (b * A + c * A @ A) @ X
    if torch.allclose(got, expected, atol=ATOL, rtol=0):
        return "PASS", "one quintic Newton-Schulz step: X -> a X + (b A + c A^2) X with A = X X^T"
    mistakes = {
        "the a * X term is missing: X_next = a X + (b A + c A^2) X": (b * A + c * A @ A) @ X,
        "the quintic term needs A @ A, i.e. (X X^T)^2, not A": a * X + (b * A + c * A) @ X,
        "the coefficients are swapped: b goes with A, c with A @ A": a * X + (c * A + b * A @ A) @ X,
    }
    for hint, wrong in mistakes.items():
        if torch.allclose(got, wrong, atol=ATOL, rtol=0):
            return "FAIL", hint
    return "FAIL", f"off by up to {(got - expected).abs().max().item():.2g}: compute A = X @ X.T, then a * X + (b * A + c * A @ A) @ X"


def _reference_muon(W, G_steps, lr, momentum, nesterov):
    W = torch.nn.Parameter(W.clone())
    optimizer = Muon([W], lr=lr, momentum=momentum, nesterov=nesterov, ns_dtype=torch.float32)
    for G in G_steps:
        W.grad = G.clone()
        optimizer.step()
    return W.detach()


def _check_muon_step(candidate: Callable) -> tuple[str, str]:
    generator = torch.Generator().manual_seed(1)
    W0 = torch.randn(6, 3, generator=generator)  # tall: the shape factor sqrt(6/3) matters
    G_steps = [torch.randn(6, 3, generator=generator) for _ in range(3)]
    lr, momentum = 0.05, 0.9

    def run(step_fn):
        W, B = W0.clone(), torch.zeros_like(W0)
        for G in G_steps:
            W, B = step_fn(W, G.clone(), B, lr, momentum)
        return W

    got = run(lambda W, G, B, lr, mu: candidate(W, G, B, lr, momentum=mu, nesterov=True))
    if not isinstance(got, torch.Tensor) or got.shape != W0.shape:
        return "FAIL", "return (new_weights, new_momentum_buffer), the weights with W's shape"
    expected = _reference_muon(W0, G_steps, lr, momentum, nesterov=True)
    # float32 Newton-Schulz on both sides; the learner may order the arithmetic differently.
    if torch.allclose(got, expected, atol=1e-5, rtol=0):
        if torch.allclose(
            run(lambda W, G, B, lr, mu: candidate(W, G, B, lr, momentum=mu, nesterov=False)),
            _reference_muon(W0, G_steps, lr, momentum, nesterov=False),
            atol=1e-5,
            rtol=0,
        ):
            return "PASS", "momentum, Nesterov, Newton-Schulz and the shape factor, over three steps"
        return "FAIL", "with nesterov=False the update is the momentum buffer itself: U = B"
    if torch.allclose(got, _reference_muon(W0, G_steps, lr, momentum, nesterov=False), atol=1e-5, rtol=0):
        return "FAIL", "that is Muon without Nesterov; with nesterov=True use U = G + momentum * B"
    unscaled = _reference_muon(W0, G_steps, lr / 2**0.5, momentum, nesterov=True)
    if torch.allclose(got, unscaled, atol=1e-5, rtol=0):
        return "FAIL", "the shape factor is missing: multiply the step by sqrt(max(1, m / n)) (here sqrt(6 / 3))"
    return "FAIL", (
        f"after three steps the weights differ from Muon's by up to {(got - expected).abs().max().item():.2g}; "
        "B = momentum * B + G, U = G + momentum * B, O = newton_schulz(U), W = W - lr * sqrt(max(1, m/n)) * O"
    )


EXERCISES = {
    "ns_step": _check_ns_step,
    "muon_step": _check_muon_step,
}
