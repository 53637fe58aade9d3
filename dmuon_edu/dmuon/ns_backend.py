"""The Newton-Schulz choice of dmuon.Muon: the public dmuon project's ``ns_backend``, on dmuon_edu.newton_schulz.

    dmuon.Muon(model, ns_backend="gram")                  # the default
    dmuon.Muon(model, ns_backend="direct")
    dmuon.Muon(model, ns_backend=dmuon.NewtonSchulz("gram", coefficients=dmuon.POLAR_EXPRESS_COEFFICIENTS))

What each part becomes here:

- ``backend="gram"``: dmuon_edu.newton_schulz as it is: pairs of steps in Gram space
  where the matrix's shape makes them pay, the last step direct (its docstring measures
  the choice); ``"direct"``: every step directly, ``X <- a X + (b A + c A^2) X``.
- ``coefficients``: one (a, b, c) per step; with more ``ns_steps`` than tuples the
  last one repeats, with fewer only the first ``ns_steps`` are used. None is Keller
  Jordan's tuple (torch.optim.Muon's), where the public project's None is
  :data:`POLAR_EXPRESS_COEFFICIENTS`: dmuon equals dmuon_edu.Muon and torch.optim.Muon
  by default. Pass :data:`POLAR_EXPRESS_COEFFICIENTS` for the public default's numbers.
- ``kernel``: "auto" and "cublas" are torch's matmul, which is what runs; the public
  project's CUDA SYRK kernels ("quack", "cute_sm80") are not here and are refused.
  ``deterministic=True`` is the public alias of ``kernel="cublas"``.
- ``restart_iterations``: None only; the Gram-space segments here are the pairs above.
- The products run in ``ns_dtype`` ("auto": bf16 where the hardware multiplies it
  natively, float32 elsewhere), where the public project uses fp16.

The public project's module-level names are here too: :func:`newton_schulz` and
:func:`gram_newton_schulz` (Gram space, as its defaults), :func:`get_ns_backend` (a line
for a log) and :func:`get_backend_status` (its keys, with what this machine has).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon_edu import newton_schulz as ns
from dmuon_edu.newton_schulz import POLAR_EXPRESS_PAPER, YOU, _fold_input_margin, check_coefficients

__all__ = ["NewtonSchulz", "POLAR_EXPRESS_COEFFICIENTS", "YOU_COEFFICIENTS", "as_backend", "newton_schulz",
           "gram_newton_schulz", "get_ns_backend", "get_backend_status"]

# The public dmuon project's POLAR_EXPRESS_COEFFICIENTS: the Polar Express paper's five tuples, each scaled by a
# 1.05 safety factor, p(x / 1.05).
SAFETY_FACTOR = 1.05
POLAR_EXPRESS_COEFFICIENTS = [_fold_input_margin(t, SAFETY_FACTOR) for t in POLAR_EXPRESS_PAPER]
YOU_COEFFICIENTS = [list(t) for t in YOU]  # Jiacheng You's five tuples, as the public project lists them

KERNELS = ("auto", "cublas")  # torch's matmul; the public project's SYRK kernels are absent


class NewtonSchulz:
    """The Newton-Schulz configuration of dmuon.Muon (see the module docstring).

    Args:
        backend: "gram" (the default) or "direct".
        kernel: "auto" or "cublas" (both: torch's matmul).
        coefficients: (a, b, c) tuples, one per step; None: Keller Jordan's.
        restart_iterations: None.
        deterministic: accepted, as the public alias of ``kernel="cublas"``.

    Raises:
        ValueError: an unknown backend or kernel, a SYRK kernel, restart iterations,
            coefficients that are empty, not finite, or diverge (newton_schulz.check_coefficients).
        TypeError: ``deterministic`` is not a bool, or ``coefficients`` are not (a, b, c)
            tuples of numbers.
    """

    def __init__(self, backend: str = "gram", kernel: str = "auto",
                 coefficients: Sequence[Sequence[float]] | None = None,
                 restart_iterations: Sequence[int] | None = None, deterministic: bool = False):
        if backend not in ("gram", "direct"):
            raise ValueError(f"backend must be 'gram' or 'direct', got {backend!r}")
        if kernel not in KERNELS:
            absent = kernel in ("quack", "cute_sm80")
            raise ValueError(
                f"kernel={kernel!r}: " + ("the public project's CUDA SYRK kernels are not part of dmuon_edu; "
                                          if absent else "unknown kernel; ") + "use 'auto' (torch's matmul)"
            )
        if restart_iterations is not None:
            raise ValueError(
                "restart_iterations cannot be chosen here: Gram-space steps run in pairs, the last step direct "
                "(dmuon_edu.newton_schulz); pass None"
            )
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
        if coefficients is not None:  # the per-step checks of newton_schulz, now rather than at the first step
            if isinstance(coefficients, str) or not isinstance(coefficients, Sequence) or not coefficients:
                raise ValueError(f"coefficients must be a non-empty sequence of (a, b, c) numbers, got {coefficients!r}")
            coefficients = check_coefficients(coefficients, len(coefficients))
        self.backend, self.kernel, self.deterministic = backend, kernel, deterministic
        self.coefficients, self.restart_iterations = coefficients, restart_iterations

    def orthogonalise(self, G: torch.Tensor, steps: int, dtype: torch.dtype | str, overwrite_input: bool = False):
        """dmuon_edu.newton_schulz of ``G`` (a matrix or a batch) with this configuration."""
        return ns.newton_schulz(G, steps, coefficients=self.coefficients or "jordan", dtype=dtype,
                                overwrite_input=overwrite_input, gram_space=self.backend == "gram")

    def __repr__(self) -> str:
        coefficients = "Keller Jordan's" if self.coefficients is None else f"{len(self.coefficients)} tuples"
        return f"NewtonSchulz(backend={self.backend!r}, kernel={self.kernel!r}, coefficients={coefficients})"


def as_backend(ns_backend: str | NewtonSchulz) -> NewtonSchulz:
    """``ns_backend`` of dmuon.Muon as a :class:`NewtonSchulz`.

    Raises:
        TypeError: neither "gram", "direct" nor a NewtonSchulz.
    """
    if isinstance(ns_backend, str):
        return NewtonSchulz(ns_backend)
    if not isinstance(ns_backend, NewtonSchulz):
        raise TypeError(f"ns_backend must be 'gram', 'direct' or a dmuon.NewtonSchulz, got {type(ns_backend).__name__}")
    return ns_backend


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients: Sequence[Sequence[float]] | None = None,
                  restart_iterations: Sequence[int] | None = None) -> torch.Tensor:
    """The public dmuon's ``newton_schulz``: G orthogonalised in Gram space (its default), with
    ``NewtonSchulz("gram", coefficients=..., restart_iterations=...)``'s checks and meanings
    (None: Keller Jordan's coefficients), in newton_schulz's "auto" dtype for G's device.

    Raises:
        ValueError, TypeError: as :class:`NewtonSchulz` and dmuon_edu.newton_schulz do.
    """
    return gram_newton_schulz(G, steps, eps, coefficients, restart_iterations)


def gram_newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                       coefficients: Sequence[Sequence[float]] | None = None,
                       restart_iterations: Sequence[int] | None = None, deterministic: bool = False) -> torch.Tensor:
    """The public dmuon's ``gram_newton_schulz``: :func:`newton_schulz`, ``deterministic`` accepted as in
    :class:`NewtonSchulz` (torch's matmul is what runs either way)."""
    backend = NewtonSchulz("gram", coefficients=coefficients, restart_iterations=restart_iterations,
                           deterministic=deterministic)
    return ns.newton_schulz(G, steps, eps=eps, coefficients=backend.coefficients or "jordan", dtype="auto")


def get_ns_backend() -> str:
    """A line for a start-up log, in the public project's form: what runs Newton-Schulz here."""
    sm_version = get_backend_status()["sm_version"]
    where = f"SM{sm_version}" if sm_version else "CPU"
    return f"Gram NS · kernel=cublas ({where}, torch.matmul; the public project's SYRK kernels are absent)"


def get_backend_status() -> dict:
    """The public project's status keys: ``sm_version`` (0 on a CPU), ``auto_choice`` ("cublas": torch's matmul,
    the one kernel here), and whether its SYRK kernels are available (never, here)."""
    major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    return {"sm_version": 10 * major + minor, "auto_choice": "cublas", "quack_available": False,
            "cute_sm80_available": False, "cublas_always_available": True}
