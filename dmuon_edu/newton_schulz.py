r"""Newton-Schulz orthogonalisation: the "NS5" inside Muon.

Given a matrix G of shape (m, n) with m <= n (a tall matrix is transposed first, and
the result transposed back), Newton-Schulz approximates the orthogonal factor
U V^T of G's SVD  G = U S V^T  with a few odd matrix polynomials:

.. math::

    X_0 = G / (\lVert G \rVert_F + \varepsilon), \qquad
    X_{k+1} = a_k X_k + (b_k A_k + c_k A_k^2) X_k, \qquad A_k = X_k X_k^T .

Each step maps every singular value x of X_k to  p_k(x) = a_k x + b_k x^3 + c_k x^5
and leaves the singular vectors alone, so X_K = U p(S) V^T with p the composition of
the p_k. Dividing by the Frobenius norm puts every singular value in [0, 1], where the
coefficients are tuned to push them towards 1 quickly. They do not reach 1 exactly:
each coefficient set promises a band around 1 (measured in tests/test_newton_schulz.py).

Coefficient sets (one (a, b, c) tuple per step; the last tuple repeats when there
are more steps than tuples):

- ``"jordan"``: Keller Jordan's (3.4445, -4.7750, 2.0315) for every step, the default
  of Keller Jordan's Muon and torch.optim.Muon.
- ``"you"``: Jiacheng You's five per-step tuples (x.com/YouJiacheng/status/1905861218138804534),
  as used by microsoft/dion. (His earlier six-step set of Feb 2025 is a different one.)
- ``"polar_express"``: Amsel, Persson, Musco and Gower, "The Polar Express" (2025,
  arXiv:2505.16932), the five tuples of modded-nanogpt and microsoft/dion, which
  include a 2% safety factor. Those implementations divide G by 1.02 ||G||_F; dividing
  x by 1.02 inside the first polynomial is the same map, so that factor is folded into
  the first tuple here and every set shares one normalisation.

Two ways to compute the same iterates, chosen by shape:

- Direct, as written above: 4 m^2 n + 2 m^3 flops per step.
- Gram space, for large wide matrices (see GRAM_SPACE_MIN_ASPECT). Every iterate is a
  polynomial in R = X X^T times X, so two steps can be taken on m x m matrices only:

  .. math::

      R_0 = X_0 X_0^T,\quad B_1 = b_1 R_0 + c_1 R_0^2,\quad
      R_1 = (a_1 I + B_1)^2 R_0,\quad B_2 = b_2 R_1 + c_2 R_1^2,

      X_2 = (a_2 I + B_2)(a_1 I + B_1) X_0 .

  That is 4 m^2 n + 10 m^3 flops for two steps instead of 8 m^2 n + 4 m^3.
  Fusing more than two steps saves more but is not accurate in bf16: the accumulated
  polynomial multiplies rounding errors by up to ~1/sigma_min of X_0. Measured for
  512 x 2048 in bf16 (relative error against a float64 run, divided by the error of
  torch.optim.Muon's bf16 path on the same input; 2-core x86_64 CPU with native bf16, torch 2.13):

  ====================  ============  ==========  ===============  =============
  steps per segment     flops vs      error,      error, singular  error, rank 8
                        direct        Gaussian    values 1/k       + noise
  ====================  ============  ==========  ===============  =============
  1,1,1,1,1 (direct)    1.00          1.0x        0.8x             0.8x
  5 (all Gram space)    0.56          1.15x       233x             15x
  4,1                   0.67          1.1x        3.6x             1.0x
  3,2                   0.67          1.55x       0.75x            0.62x
  2,2,1 (chosen)        0.78          1.12x       0.69x            0.62x
  ====================  ============  ==========  ===============  =============

  So: pairs of steps in Gram space, and the last step always direct (it rounds like
  torch's last step). Measured step times are in benchmarks/README.md.

The input is normalised in its own precision (float32 for float32 gradients), without
overflow for any finite input (entries of 1e20 square past float32's range), and
rounded to ``dtype`` once; torch rounds first and divides in bf16, which costs
accuracy on ill-conditioned inputs (the 0.8x of the direct row comes from this alone).
Matrix products run in ``dtype``.

Which precision: ``dtype="auto"`` (the default here and in both Muons) takes
:func:`fast_dtype` of the input's device: bfloat16 where the hardware multiplies it
natively, float32 elsewhere. Newton-Schulz only needs a roughly orthogonal result, so
bf16's 8 significant bits (relative error about 1e-2 after five steps) are enough where
they are fast: on GPUs from Ampere on, bf16 products run twice as fast as TF32 and
about 15 times as fast as plain float32 (H200 datasheet, dense). A CPU without native
bf16 emulates it, and there it is the slow choice: on a 2-core AVX2 CPU a 512 x 512 bf16
matmul ran at 0.46 GFLOP/s against 22 in float32, and a 1024 x 1024 bf16 Newton-Schulz
call took 26.5 s against 0.3 s.
"""

import functools
import math
import os
import platform
from collections.abc import Sequence

import torch

from .arguments import require_real

__all__ = [
    "newton_schulz",
    "ns_flops",
    "fast_dtype",
    "cpu_bf16_flags",
    "check_ns_dtype",
    "check_ns_steps",
    "check_coefficients",
    "overlaps_itself",
    "batching_pays",
    "MAX_STEPS",
    "NS_DTYPE_ENV",
    "COEFFICIENTS",
    "JORDAN",
    "YOU",
    "POLAR_EXPRESS",
]

Coefficients = tuple[float, float, float]

# The most steps newton_schulz takes. Every published coefficient set is tuned for five steps,
# and more do not converge further: the polynomials map [0, 1] into a band around 1 and keep the
# singular values moving inside it (Jordan's set: 0.68 to 1.13 after 100 steps of a 64 x 64
# Gaussian matrix, in float64). So 100, twenty times the usual count, is generous; a count
# such as 10**7 is a mistake, and would run for minutes even on a 4 x 4 matrix.
MAX_STEPS = 100

JORDAN: tuple[Coefficients, ...] = ((3.4445, -4.7750, 2.0315),)

YOU: tuple[Coefficients, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# Amsel, Persson, Musco and Gower, "The Polar Express" (arXiv:2505.16932), Algorithm 1: the first five of
# its tuples as printed. Every published set folds a safety factor into them: modded-nanogpt's below, the
# public dmuon project's (dmuon.POLAR_EXPRESS_COEFFICIENTS, at x / 1.05), the paper's own code's.
POLAR_EXPRESS_PAPER: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)

POLAR_EXPRESS_AS_PUBLISHED: tuple[Coefficients, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_INPUT_MARGIN = 1.02  # the published recipe divides G by 1.02 ||G||_F


def _fold_input_margin(coefficients: Coefficients, margin: float) -> Coefficients:
    """p(x / margin) as a polynomial in x."""
    a, b, c = coefficients
    return (a / margin, b / margin**3, c / margin**5)


POLAR_EXPRESS: tuple[Coefficients, ...] = (
    _fold_input_margin(POLAR_EXPRESS_AS_PUBLISHED[0], POLAR_EXPRESS_INPUT_MARGIN),
    *POLAR_EXPRESS_AS_PUBLISHED[1:],
)

COEFFICIENTS: dict[str, tuple[Coefficients, ...]] = {
    "jordan": JORDAN,
    "you": YOU,
    "polar_express": POLAR_EXPRESS,
}

# Take steps in Gram space when n >= GRAM_SPACE_MIN_ASPECT * m and m >= GRAM_SPACE_MIN_ROWS
# (after transposing to m <= n). A Gram pair needs fewer flops than two direct steps once
# n > 1.5 m; at n = 2 m five steps need 0.92x the flops of direct ones, at n = 4 m 0.78x.
# Small matrices stay direct: measured in bf16 on CPU, the Gram path's error is 1.45-1.6x
# torch's for m <= 128 but 1.07-1.2x for m >= 256 (Gaussian inputs, n = 2m to 4m), and
# small matrices cost little either way.
GRAM_SPACE_MIN_ASPECT = 2
GRAM_SPACE_MIN_ROWS = 256

# On CPU, torch.baddbmm over a batch beats a loop of torch.addmm for small matrices, where
# the loop's per-call overhead dominates, and loses for large ones, whose batch-sized fresh
# temporaries cost page faults. Muon steps on 8 matrices, bf16, 2-core CPU with native bf16, batched / loop:
# 0.25 at 64x64, 0.40 at 128x128, 1.02 (break-even) at 256x256, 1.43 at 256x1024, 1.17 at
# 512x512. GPUs always batch.
CPU_BATCH_MAX_ELEMENTS = 256 * 256  # on CPU, matrices of at most this many elements are batched


# Names the dtype that "auto" means on every device, overriding the hardware's flags: for a
# machine whose flags say more than its kernels do (ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA
# change the kernels torch runs, not the flags it reads), or to pin one precision everywhere.
NS_DTYPE_ENV = "DMUON_EDU_NS_DTYPE"
_NS_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "float64": torch.float64}


def fast_dtype(device: torch.device | str) -> torch.dtype:
    """The precision that ``dtype="auto"`` gives Newton-Schulz on ``device``.

    The rule, decided from the hardware's feature flags (no timing, so every rank of a
    job and every run on one machine decide alike):

    - the environment variable ``DMUON_EDU_NS_DTYPE`` (NS_DTYPE_ENV), if set, wins on
      every device: ``float32``, ``bfloat16``, ``float16`` or ``float64``;
    - CUDA (and ROCm): bfloat16 if the device multiplies it natively (compute
      capability 8.0 or newer: ``torch.cuda.is_bf16_supported(including_emulation=False)``),
      else float32;
    - CPU: bfloat16 if its bf16 matrix products are native: on x86, the AVX512-BF16 or
      AMX flags (``torch.cpu._is_avx512_bf16_supported()``, ``_is_amx_tile_supported()``);
      on 64-bit Arm Linux, the ``bf16`` feature in /proc/cpuinfo. Else float32, which on
      such a CPU is the faster one by tens of times;
    - any other device: float32.

    Args:
        device: a torch.device or its name ("cpu", "cuda:0").

    Returns:
        torch.bfloat16 or torch.float32 (or the override's dtype).

    Raises:
        ValueError: DMUON_EDU_NS_DTYPE names no dtype of the list above.
    """
    override = os.environ.get(NS_DTYPE_ENV)
    if override is not None:
        if override not in _NS_DTYPE_NAMES:
            raise ValueError(
                f"{NS_DTYPE_ENV}={override!r} names no Newton-Schulz dtype; set it to one of "
                f"{', '.join(_NS_DTYPE_NAMES)}, or unset it to let the hardware decide"
            )
        return _NS_DTYPE_NAMES[override]
    device_type = torch.device(device).type
    if device_type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    elif device_type == "cpu":
        native = bool(cpu_bf16_flags())
    else:
        native = False
    return torch.bfloat16 if native else torch.float32


_CPUINFO = "/proc/cpuinfo"


def cpu_bf16_flags() -> frozenset[str]:
    """The CPU's features that make bf16 matrix products native (empty: bf16 is emulated).

    x86: ``avx512_bf16`` and ``amx_tile`` as torch detects them; 64-bit Arm Linux: ``bf16``
    from the Features line of /proc/cpuinfo. Other systems report none.
    """
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        flags = {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx_tile": torch.cpu._is_amx_tile_supported()}
        return frozenset(name for name, present in flags.items() if present)
    if machine in ("aarch64", "arm64") and os.path.exists(_CPUINFO):
        with open(_CPUINFO) as info:
            features = {word for line in info if line.startswith("Features") for word in line.split(":", 1)[1].split()}
        return frozenset(features & {"bf16"})
    return frozenset()


@torch.no_grad()  # not differentiated through, so G may require grad
def newton_schulz(
    G: torch.Tensor | Sequence[torch.Tensor],
    steps: int = 5,
    coefficients: str | Coefficients | Sequence[Coefficients] = "jordan",
    eps: float = 1e-7,
    dtype: torch.dtype | str = "auto",
    overwrite_input: bool = False,
    gram_space: bool = True,
) -> torch.Tensor | list[torch.Tensor]:
    """Approximately orthogonalise G: one matrix (m, n), or a batch of same-shape matrices.

    Args:
        G: a matrix (m, n), or a batch: a (batch, m, n) tensor or a list of (m, n)
            matrices. Not modified unless ``overwrite_input``.
        steps: how many Newton-Schulz steps, from 1 to MAX_STEPS (100).
        coefficients: a name in COEFFICIENTS, one (a, b, c) tuple used for every step,
            or a sequence of tuples, one per step. When ``steps`` exceeds the number of
            tuples the last tuple is repeated; when it is smaller only the first
            ``steps`` tuples are used.
        eps: added to the Frobenius norm so that a zero matrix maps to zero (finite, >= 0).
        dtype: precision of the matrix products: ``"auto"`` for :func:`fast_dtype` of
            G's device (bf16 where the hardware multiplies it natively, as every peer
            does on GPUs; float32 elsewhere), or a floating torch.dtype (float32 or
            float64 for reference computations).
        overwrite_input: allow G to be overwritten (normalised in place), which saves a
            temporary of G's size, as scipy.linalg's ``overwrite_a`` does. Muon passes
            its own scratch tensor this way. G's entries must not share memory (an
            ``expand()``-ed view cannot be written into).
        gram_space: take pairs of steps in Gram space where the shape makes them pay
            (see GRAM_SPACE_MIN_ASPECT; True, the default), or every step directly.

    Newton-Schulz is not differentiated through: G may require grad (a Parameter, say),
    and the result never does. A matrix on the meta device gives a meta result of the
    same shape and dtype.

    Returns:
        In ``dtype`` (for ``"auto"``, the dtype chosen): a tensor of G's shape, or a
        list of matrices for a list.

    Raises:
        TypeError: ``G`` holds something other than floating-point tensors, or
            ``steps``, ``coefficients``, ``dtype`` (a string other than "auto" included),
            ``overwrite_input`` or ``gram_space`` has the wrong type.
        ValueError: ``steps`` is not between 1 and MAX_STEPS, ``eps`` is negative or not
            finite, a coefficient is not finite or the set does not keep singular values
            bounded (check_coefficients), a coefficient name is unknown, the batch is
            empty, a matrix is not 2-D, a batch mixes shapes or devices, or
            ``overwrite_input`` is True for a G whose entries share memory.
    """
    check_ns_steps(steps, "steps")
    check_ns_dtype(dtype, "dtype")
    require_real("eps", eps, positive=False, hint="1e-7 is the usual value")
    per_step = check_coefficients(coefficients, steps)
    if not isinstance(overwrite_input, bool):
        raise TypeError(f"overwrite_input must be True or False, got {type(overwrite_input).__name__}")
    if not isinstance(gram_space, bool):
        raise TypeError(f"gram_space must be True or False, got {type(gram_space).__name__}")
    single = isinstance(G, torch.Tensor) and G.ndim != 3
    matrices = [G] if single else list(G) if isinstance(G, (torch.Tensor, Sequence)) else [G]
    _check_matrices(matrices)
    if overwrite_input and any(map(overlaps_itself, [G] if isinstance(G, torch.Tensor) else matrices)):
        raise ValueError(
            "overwrite_input=True, but G's entries share memory (an expand()-ed or as_strided view), so "
            "Newton-Schulz cannot write into it: pass overwrite_input=False, or G.clone()"
        )
    if dtype == "auto":
        dtype = fast_dtype(matrices[0].device)
    if single or not batching_pays(matrices[0]):
        shared = None if overwrite_input else torch.empty_like(matrices[0])
        O = [_iterate(_normalise(g, eps, dtype, g if overwrite_input else shared), per_step, gram_space)
             for g in matrices]
        return O[0] if single else torch.stack(O) if isinstance(G, torch.Tensor) else O
    batch = G if isinstance(G, torch.Tensor) else torch.stack(matrices)
    in_place = overwrite_input or batch is not G  # a stacked copy is ours to overwrite
    O = _iterate(_normalise(batch, eps, dtype, batch if in_place else torch.empty_like(batch)), per_step, gram_space)
    return O if isinstance(G, torch.Tensor) else list(O)


def ns_flops(shape: Sequence[int], steps: int = 5, gram_space: bool = True) -> int:
    """The floating-point operations of :func:`newton_schulz` on one matrix of ``shape``, as it runs.

    With m <= n (a tall matrix is transposed), a direct step costs 4 m^2 n + 2 m^3 (X X^T,
    then A^2, then B X) and a pair of steps in Gram space 4 m^2 n + 10 m^3; the steps are
    taken as :func:`newton_schulz` takes them (pairs in Gram space where the shape makes
    them pay, the last step direct). The normalisation and the additions are left out:
    they are O(m n) against the products' O(m^2 n).

    Args:
        shape: (m, n), two ints >= 0.
        steps: Newton-Schulz steps, as for :func:`newton_schulz`.
        gram_space: as for :func:`newton_schulz` (False: every step direct).

    Returns:
        The flops (a multiply-add counts 2).

    Raises:
        ValueError: ``shape`` is not two ints >= 0, or ``steps`` is out of range.
    """
    if (isinstance(shape, str) or not isinstance(shape, Sequence) or len(shape) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ValueError(f"shape must be (m, n), two ints >= 0, such as tuple(p.shape); got {shape!r}")
    check_ns_steps(steps, "steps")
    m, n = sorted(shape)
    direct, pair = 4 * m * m * n + 2 * m**3, 4 * m * m * n + 10 * m**3
    if gram_space and m >= GRAM_SPACE_MIN_ROWS and n >= GRAM_SPACE_MIN_ASPECT * m:
        pairs = (steps - 1) // 2  # as _iterate: pairs while three or more steps remain
        return pairs * pair + (steps - 2 * pairs) * direct
    return steps * direct


def check_ns_steps(steps, name: str) -> None:
    """Raise unless ``steps`` is an int from 1 to MAX_STEPS; ``name`` is the argument's name."""
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"{name} must be an int, got {type(steps).__name__}")
    if steps < 1:
        raise ValueError(f"{name} must be >= 1, got {steps}; 5 is the usual value")
    if steps > MAX_STEPS:
        raise ValueError(
            f"{name} must be at most {MAX_STEPS}, got {steps}: more steps do not converge further "
            "(newton_schulz.MAX_STEPS says why); 5 is the usual value"
        )


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether two entries of ``tensor`` are one memory location (an expand()-ed view), so that it
    cannot be written into in place."""
    return torch._debug_has_internal_overlap(tensor) == 1  # 0: none, 2: too hard to tell (then torch checks)


def check_ns_dtype(dtype, name: str) -> None:
    """Raise unless ``dtype`` is "auto" or a floating torch.dtype; ``name`` is the argument's name."""
    if isinstance(dtype, str):
        if dtype != "auto":
            named = isinstance(getattr(torch, dtype, None), torch.dtype)
            raise TypeError(
                f'{name} must be "auto" or a floating torch.dtype such as torch.bfloat16, got the string '
                f"{dtype!r}" + (f"; pass torch.{dtype} for that dtype" if named else "")
            )
    elif not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f'{name} must be "auto" or a floating torch.dtype such as torch.bfloat16, got {dtype!r}')


def batching_pays(matrix: torch.Tensor) -> bool:
    """Whether same-shape matrices like ``matrix`` should go through one batched call.

    True on every device but the CPU, and on the CPU for matrices of at most
    CPU_BATCH_MAX_ELEMENTS entries. Decided by whole Muon steps, where batching large
    CPU matrices means forming all their updates at once; Newton-Schulz alone on a
    ready batch gains a little from batching at most sizes on CPU.

    Args:
        matrix: one matrix of the batch (only its device and size are read).

    Returns:
        True to batch, False to go one matrix at a time.
    """
    return matrix.device.type != "cpu" or matrix.numel() <= CPU_BATCH_MAX_ELEMENTS


def _check_matrices(matrices: list) -> None:
    if not matrices:
        raise ValueError("newton_schulz got an empty batch; pass at least one matrix")
    for g in matrices:
        if not isinstance(g, torch.Tensor) or not g.is_floating_point():
            raise TypeError(
                "newton_schulz expects floating-point torch.Tensors, got "
                + (f"a tensor of dtype {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__)
            )
        if g.ndim != 2:
            raise ValueError(
                f"newton_schulz expects a matrix (m, n) or a batch (batch, m, n) of them, got a "
                f"{g.ndim}-D tensor of shape {tuple(g.shape)}; reshape to 2-D first"
            )
    shapes = {(tuple(g.shape), g.device) for g in matrices}
    if len(shapes) > 1:
        raise ValueError(f"a batch must hold matrices of one shape on one device, got {sorted(map(str, shapes))}")


def _iterate(X: torch.Tensor, per_step: list[Coefficients], gram_space: bool = True) -> torch.Tensor:
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT  # a view: the products read it transposed, with no copy
    m, n = X.shape[-2:]
    use_gram_space = gram_space and m >= GRAM_SPACE_MIN_ROWS and n >= GRAM_SPACE_MIN_ASPECT * m
    k = 0
    while k < len(per_step):
        if use_gram_space and len(per_step) - k >= 3:  # pairs, but keep the last step direct
            X = _two_steps_in_gram_space(X, per_step[k], per_step[k + 1])
            k += 2
        else:
            X = _one_step(X, per_step[k])
            k += 1
    return X.mT if tall else X


# A set whose steps take a normalised matrix's singular values (all in [0, 1]) above this diverges: every
# published set peaks below 2 (Polar Express's first step), and one that reaches 100 overflows within a few steps.
_DIVERGED = 100.0
# The singular values the scalar check follows through the steps: evenly over [0, 1] and log-spaced near 0.
_PROBES = tuple(k / 200 for k in range(201)) + tuple(10.0 ** (-k / 10) for k in range(10, 61))


def check_coefficients(coefficients, steps: int) -> list[Coefficients]:
    """``steps`` (a, b, c) tuples, one per step (the last repeated), from a set's name, one tuple or a sequence.

    Refuses a set that cannot orthogonalise: one with a non-finite number, or one whose
    polynomials, followed step by step on singular values in [0, 1] (where the
    normalised matrix's lie), leave [-100, 100] (1e30 as a coefficient would make the
    update, and then the weights, non-finite at the first step).

    Raises:
        TypeError: ``coefficients`` is none of the three forms.
        ValueError: an unknown name, a non-finite number, or a diverging set.
    """
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENTS:
            raise ValueError(
                f"unknown coefficient set {coefficients!r}; use one of {sorted(COEFFICIENTS)} "
                "or pass (a, b, c) tuples"
            )
        tuples = COEFFICIENTS[coefficients]
    elif _is_triple(coefficients):
        tuples = (tuple(coefficients),)
    elif isinstance(coefficients, Sequence) and len(coefficients) > 0 and all(map(_is_triple, coefficients)):
        tuples = tuple(tuple(t) for t in coefficients)
    else:
        raise TypeError(
            "coefficients must be a name (e.g. 'jordan'), one (a, b, c) tuple of numbers, "
            f"or a non-empty sequence of such tuples; got {coefficients!r}"
        )
    if not all(math.isfinite(v) for t in tuples for v in t):
        raise ValueError(f"coefficients must be finite numbers, got {coefficients!r}; 'jordan' is the usual set")
    per_step = [tuples[min(k, len(tuples) - 1)] for k in range(steps)]
    _require_bounded(tuple(per_step))
    return per_step


@functools.lru_cache(maxsize=64)
def _require_bounded(per_step: tuple[Coefficients, ...]) -> None:
    values = _PROBES
    for k, (a, b, c) in enumerate(per_step):
        values = tuple(s * (a + s * s * (b + c * s * s)) for s in values)
        peak = max(map(abs, values))
        if not peak <= _DIVERGED:  # also NaN, from inf - inf
            raise ValueError(
                f"coefficients {per_step[k]} at step {k + 1} take a normalised matrix's singular values (in [0, 1]) "
                f"to {peak:.3g}, beyond {_DIVERGED:g}: such a set diverges and would make the update, then the "
                "weights, non-finite. Use a published set ('jordan', 'you', 'polar_express') or check the numbers"
            )


def _is_triple(x) -> bool:
    return (
        isinstance(x, Sequence)
        and not isinstance(x, str)
        and len(x) == 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x)
    )


def _normalise(X: torch.Tensor, eps: float, dtype: torch.dtype, scratch: torch.Tensor) -> torch.Tensor:
    r"""X / (||X||_F + eps) per matrix, computed in X's precision in ``scratch``, rounded to dtype once.

    ``scratch`` has X's shape and dtype, and may be X itself. Dividing straight into a
    ``dtype`` tensor would make torch allocate a hidden temporary in X's precision at
    every call, and on CPU each fresh megabyte costs page faults (a 512 x 512 float32
    matrix: about 0.2 ms, 4% of its Muon step).

    The norm is accumulated in at least float32: in fp16 it would overflow once it
    passed 65504. In float32 it still overflows to inf once the squares add up past
    3.4e38 (one entry of 1e20 is enough), and X / inf would be a zero update. Such a
    batch is normalised again, first divided by :math:`2^k`, the power of two with
    :math:`2^k \le \max_{ij} |X_{ij}| < 2^{k+1}`, which puts every entry below 2 in
    absolute value, then by :math:`\lVert X / 2^k \rVert_F + \varepsilon / 2^k`. A
    power of two only shifts exponents, so that is the same quotient, finite for every
    finite X. It costs two passes over X more than the direct quotient (measured: 2% to
    7% of a bf16 Newton-Schulz call on CPU, 8 x 128 x 128 to 384 x 1536), so it runs
    only after the direct norm came out non-finite. Finding that out costs one host
    sync (about 5 us on CPU).
    """
    accumulate = torch.promote_types(X.dtype, torch.float32)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=accumulate)
    if X.is_meta or math.isfinite(norm.max().item()):  # max propagates NaN; a meta tensor holds no values
        return torch.div(X, norm + eps, out=scratch).to(dtype)
    # max |X| without a temporary of X's size (X.abs() would be one)
    largest = torch.maximum(X.amax(dim=(-2, -1), keepdim=True), X.amin(dim=(-2, -1), keepdim=True).neg_())
    largest = largest.to(accumulate).clamp_min_(torch.finfo(X.dtype).tiny)  # a zero matrix of the batch stays 0
    power = largest / (2 * torch.frexp(largest).mantissa)  # 2^k exactly: frexp writes largest = m 2^(k+1), m in [1/2, 1)
    torch.div(X, power, out=scratch)
    norm = torch.linalg.vector_norm(scratch, dim=(-2, -1), keepdim=True, dtype=accumulate)
    return torch.div(scratch, norm + eps / power, out=scratch).to(dtype)


def _addmm(input, mat1, mat2, beta: float = 1.0, alpha: float = 1.0) -> torch.Tensor:
    """beta * input + alpha * mat1 @ mat2, for matrices or batches of them."""
    addmm = torch.addmm if mat1.ndim == 2 else torch.baddbmm
    return addmm(input, mat1, mat2, beta=beta, alpha=alpha)


def _one_step(X: torch.Tensor, coefficients: Coefficients) -> torch.Tensor:
    a, b, c = coefficients
    A = X @ X.mT
    B = _addmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
    return _addmm(X, B, X, beta=a)  # a X + B X


def _two_steps_in_gram_space(X: torch.Tensor, first: Coefficients, second: Coefficients) -> torch.Tensor:
    (a1, b1, c1), (a2, b2, c2) = first, second
    R = X @ X.mT
    B1 = _addmm(R, R, R, beta=b1, alpha=c1)  # b1 R + c1 R^2
    P1R = _addmm(R, B1, R, beta=a1)  # (a1 I + B1) R
    R = _addmm(P1R, B1, P1R, beta=a1)  # (a1 I + B1)^2 R: the Gram matrix of X_1
    B2 = _addmm(R, R, R, beta=b2, alpha=c2)
    P1 = B1 + a1 * torch.eye(R.size(-1), dtype=R.dtype, device=R.device)
    Q = _addmm(P1, B2, P1, beta=a2)  # (a2 I + B2)(a1 I + B1)
    return Q @ X
