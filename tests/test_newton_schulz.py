"""Newton-Schulz orthogonalisation against an independent float64 implementation."""

import os

import pytest
import torch

from dmuon_edu import newton_schulz as ns_module
from dmuon_edu.newton_schulz import (
    COEFFICIENTS,
    JORDAN,
    NS_DTYPE_ENV,
    POLAR_EXPRESS_AS_PUBLISHED,
    YOU,
    _iterate,
    _normalise,
    cpu_bf16_flags,
    fast_dtype,
    newton_schulz,
)

# Relative Frobenius error allowed for float32 products against float64. fp32 rounds at
# 6e-8; through fifteen chained products with inner dimensions up to 768, amplified by
# the NS polynomials' slopes (up to ~8 near zero), the error measured here stays below
# 1e-5 (at most 6e-6). 1e-4 leaves room and is still 100x below what bf16 gives (~1e-2),
# so a product silently run in bf16 fails these tests.
FP32_RTOL = 1e-4


def reference(G, per_step, input_margin=1.0):
    """The iteration as specified, in float64, one explicit (a, b, c) per step."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (input_margin * torch.linalg.norm(X) + 1e-7)
    for a, b, c in per_step:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def relative_error(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


def with_singular_values(m, n, low, high, seed=0):
    """A random m x n matrix whose singular values are spread log-uniformly over [low, high]."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    left = torch.linalg.qr(torch.randn(m, k, generator=g))[0]
    right = torch.linalg.qr(torch.randn(n, k, generator=g))[0]
    s = torch.logspace(torch.log10(torch.tensor(low)), torch.log10(torch.tensor(high)), k)
    return left @ torch.diag(s) @ right.T


# Square, wide and tall; the last two take the Gram-space path (m >= 256, n >= 2m), the
# others the direct one, so both ways of computing the iterates are checked.
SHAPES = [(64, 64), (48, 64), (32, 128), (128, 32), (256, 512), (768, 256)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(COEFFICIENTS))
def test_matches_float64_reference_in_float32(shape, name):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    per_step = [COEFFICIENTS[name][min(k, len(COEFFICIENTS[name]) - 1)] for k in range(5)]
    out = newton_schulz(G, coefficients=name, dtype=torch.float32)
    assert out.shape == G.shape and out.dtype == torch.float32
    assert relative_error(out, reference(G, per_step)) < FP32_RTOL


@pytest.mark.parametrize("shape", [(64, 64), (32, 128), (128, 32), (256, 1024)])
def test_bf16_is_close_to_float64(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    out = newton_schulz(G, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    # bf16 keeps 8 significant bits (rounding 2^-9 = 0.2%); fifteen chained products
    # compound that to 1-2% (torch.optim.Muon's own bf16 path measures 1.1-1.8% on these
    # shapes). 3% catches a wrong coefficient or a missed transpose (errors of 10-100%).
    assert relative_error(out, reference(G, JORDAN * 5)) < 0.03


def test_polar_express_folds_the_published_input_margin():
    # Published recipe: divide by 1.02 ||G||_F, then the published tuples unchanged.
    G = torch.randn(48, 96, generator=torch.Generator().manual_seed(3))
    expected = reference(G, POLAR_EXPRESS_AS_PUBLISHED, input_margin=1.02)
    out = newton_schulz(G, coefficients="polar_express", dtype=torch.float32)
    assert relative_error(out, expected) < FP32_RTOL


def test_the_published_coefficients():
    # Guard against typos: the values as published (see the module docstring for sources).
    assert JORDAN == ((3.4445, -4.7750, 2.0315),)
    assert YOU[0] == (4.0848, -6.8946, 2.9270) and YOU[-1] == (2.8366, -3.0525, 1.2012)
    assert len(YOU) == 5 and len(POLAR_EXPRESS_AS_PUBLISHED) == 5
    assert POLAR_EXPRESS_AS_PUBLISHED[0] == (8.156554524902461, -22.48329292557795, 15.878769915207462)


def test_more_steps_than_tuples_repeat_the_last_tuple():
    G = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    out = newton_schulz(G, steps=7, coefficients="you", dtype=torch.float32)
    assert relative_error(out, reference(G, list(YOU) + [YOU[-1]] * 2)) < FP32_RTOL


def test_fewer_steps_than_tuples_use_the_first_ones():
    G = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    out = newton_schulz(G, steps=3, coefficients="you", dtype=torch.float32)
    assert relative_error(out, reference(G, YOU[:3])) < FP32_RTOL


@pytest.mark.parametrize("coefficients", [(3.0, -3.2, 1.2), [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]])
def test_custom_coefficients(coefficients):
    G = torch.randn(40, 80, generator=torch.Generator().manual_seed(6))
    per_step = [coefficients] * 4 if isinstance(coefficients, tuple) else [coefficients[0]] + [coefficients[1]] * 3
    out = newton_schulz(G, steps=4, coefficients=coefficients, dtype=torch.float32)
    assert relative_error(out, reference(G, per_step)) < FP32_RTOL


# The band each set promises: composing its five scalar polynomials and evaluating on a
# fine grid of x in [0.01, 1] (every singular value of G / ||G||_F lies in (0, 1]; inputs
# with sigma_min / ||G||_F >= 0.01 are "well conditioned" here) gives these ranges,
# computed in float64. Jordan's set trades accuracy for speed on purpose; Jiacheng You's
# converges tightly; Polar Express overshoots up to 1.14 because of its safety margin.
BANDS = {
    "jordan": (0.6818, 1.1344),
    "you": (0.9778, 1.0318),
    "polar_express": (0.8589, 1.1411),
}


@pytest.mark.parametrize("name", sorted(BANDS))
def test_singular_values_lie_in_the_promised_band(name):
    # Singular values spread over a factor 10: normalised, they lie in about [0.02, 0.2].
    G = with_singular_values(64, 128, 1.0, 10.0)
    s = torch.linalg.svdvals(newton_schulz(G, coefficients=name, dtype=torch.float32).double())
    low, high = BANDS[name]
    # 1e-3: the grid's resolution and fp32 rounding move the extremes by < 1e-4.
    assert s.min() >= low - 1e-3 and s.max() <= high + 1e-3
    # The band is not vacuous: the result spreads over a good part of it.
    assert s.max() - s.min() > 0.3 * (high - low)


def test_singular_values_in_bf16_stay_near_the_band():
    s = torch.linalg.svdvals(newton_schulz(with_singular_values(64, 128, 1.0, 10.0), dtype=torch.bfloat16).double())
    # bf16 moves singular values by ~1% (see test_bf16_is_close_to_float64): widen by 0.03.
    assert s.min() >= 0.6818 - 0.03 and s.max() <= 1.1344 + 0.03


def test_input_scale_does_not_matter():
    G = torch.randn(32, 96, generator=torch.Generator().manual_seed(7))
    a = newton_schulz(G, dtype=torch.float32)
    b = newton_schulz(1000.0 * G, dtype=torch.float32)
    # Normalising by the norm removes the scale up to eps / ||G||_F ~ 1e-8 and rounding.
    assert relative_error(b, a.double()) < 1e-5


# Entries whose squares add up past float32's largest value (3.4e38): one of 1e20 does.
# (256, 512) takes the Gram-space path. float64 entries of 1e200 overflow float64's squares.
@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (256, 512)])
@pytest.mark.parametrize("scale, dtype", [(1e20, torch.float32), (1e30, torch.float32), (1e38, torch.float32),
                                          (1e200, torch.float64)])
def test_a_huge_finite_matrix_gives_its_direction_not_zero(shape, scale, dtype):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    G = G / G.abs().max()  # entries up to 1, so that 1e38 * G stays finite in float32
    out = newton_schulz((scale * G).to(dtype), dtype=torch.float32)
    # The reference is scale-free: it normalises G itself. The scale is exact up to one
    # float32 rounding of each entry (6e-8), and eps / ||G||_F changes the normalised
    # input by ~1e-8 relative; so the float32 tolerance of the tests above applies.
    assert out.isfinite().all()
    assert relative_error(out, reference(G, JORDAN * 5)) < FP32_RTOL


def test_a_huge_matrix_in_a_batch_leaves_the_others_bit_identical():
    # The batch is normalised again after dividing by a power of two, which only shifts
    # exponents: the ordinary matrix's quotient is the same, to the last bit.
    g = torch.Generator().manual_seed(12)
    ordinary, huge = torch.randn(24, 48, generator=g), 1e25 * torch.randn(24, 48, generator=g)
    together = newton_schulz(torch.stack([ordinary, huge]))
    assert torch.equal(together[0], newton_schulz(ordinary))
    assert together[1].isfinite().all() and together[1].abs().max() > 0.1


@pytest.mark.parametrize("shape", [(4, 24, 24), (3, 16, 64), (2, 512, 256)])
def test_batch_equals_one_matrix_at_a_time(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(8))
    one_by_one = torch.stack([newton_schulz(g) for g in G])
    assert torch.equal(newton_schulz(G), one_by_one)
    as_list = newton_schulz(list(G))
    assert isinstance(as_list, list) and torch.equal(torch.stack(as_list), one_by_one)


@pytest.mark.parametrize("shape", [(3, 16, 16), (3, 16, 64), (2, 256, 512), (2, 512, 256)])
def test_the_batched_gpu_path_matches_one_matrix_at_a_time(shape):
    # GPUs, and CPUs for small matrices, take the whole batch through torch.baddbmm; larger
    # matrices on CPU go one at a time (newton_schulz.batching_pays).
    # CI has no GPU, so run the batched path's helpers on CPU here.
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(10))
    batched = _iterate(_normalise(G, 1e-7, torch.float32, torch.empty_like(G)), list(JORDAN) * 5)
    for g, b in zip(G, batched):
        assert relative_error(b, reference(g, JORDAN * 5)) < FP32_RTOL


@pytest.mark.parametrize("shape", [(96, 24), (512, 256)])
def test_tall_is_the_transpose_of_wide(shape):
    # The tall path runs the wide one on a transposed view, so the two agree exactly; how
    # close tall results are to the truth is checked against float64 above.
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(9))
    assert torch.equal(newton_schulz(G, dtype=torch.float32), newton_schulz(G.T, dtype=torch.float32).T)


def test_zero_matrix_maps_to_zero():
    assert torch.equal(newton_schulz(torch.zeros(8, 16), dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("G", [torch.randn(16, 48), torch.randn(3, 16, 48), list(torch.randn(3, 16, 48))],
                         ids=["matrix", "batch", "list"])
def test_input_is_not_modified_unless_overwrite_input(G):
    def matrices(x):
        return [x] if isinstance(x, torch.Tensor) and x.ndim == 2 else list(x)

    before = [g.clone() for g in matrices(G)]
    kept = newton_schulz(G)
    assert all(torch.equal(g, b) for g, b in zip(matrices(G), before))
    overwritten = newton_schulz(G, overwrite_input=True)
    assert all(torch.equal(o, k) for o, k in zip(matrices(overwritten), matrices(kept)))
    if isinstance(G, torch.Tensor):  # a list may be stacked into a copy first, which is what gets overwritten
        for g, b in zip(matrices(G), before):  # now G / ||G||_F, per matrix (the bf16 rounding comes after)
            assert torch.allclose(g, b / torch.linalg.vector_norm(b), rtol=1e-6, atol=1e-7)  # float32 norms


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(G=torch.randn(8)), ValueError, "reshape to 2-D"),
        (dict(G=torch.randn(2, 3, 4, 5)), ValueError, "reshape to 2-D"),
        (dict(G=torch.ones(4, 4, dtype=torch.int64)), TypeError, "floating-point"),
        (dict(G=[[1.0, 2.0], [3.0, 4.0]]), TypeError, "floating-point"),
        (dict(G=[torch.randn(4, 4), torch.randn(4, 5)]), ValueError, "one shape"),
        (dict(G=[]), ValueError, "at least one matrix"),
        (dict(G=torch.randn(4, 4), steps=0), ValueError, "steps must be >= 1"),
        (dict(G=torch.randn(4, 4), steps=2.5), TypeError, "steps must be an int"),
        (dict(G=torch.randn(4, 4), coefficients="newton"), ValueError, "unknown coefficient set"),
        (dict(G=torch.randn(4, 4), coefficients=(1.0, 2.0)), TypeError, r"\(a, b, c\)"),
        (dict(G=torch.randn(4, 4), coefficients=[]), TypeError, r"\(a, b, c\)"),
    ],
)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        newton_schulz(**kwargs)


# --- dtype="auto": the precision the hardware multiplies fast ---------------------------------

@pytest.mark.parametrize("flags, expected", [
    (frozenset(), torch.float32),                          # AVX2 only (most laptops), or no flag known
    (frozenset({"avx512_bf16"}), torch.bfloat16),          # Cooper Lake, Zen 4 and newer
    (frozenset({"amx_tile"}), torch.bfloat16),             # Sapphire Rapids and newer
    (frozenset({"avx512_bf16", "amx_tile"}), torch.bfloat16),
    (frozenset({"bf16"}), torch.bfloat16),                 # 64-bit Arm with FEAT_BF16 (Graviton3, Neoverse V1)
])
def test_auto_on_cpu_follows_the_bf16_flags(flags, expected, monkeypatch):
    monkeypatch.delenv(NS_DTYPE_ENV, raising=False)
    monkeypatch.setattr(ns_module, "cpu_bf16_flags", lambda: flags)
    assert fast_dtype("cpu") == expected
    assert newton_schulz(torch.randn(8, 16)).dtype == expected


@pytest.mark.parametrize("machine, x86_flags, cpuinfo, expected", [
    ("x86_64", (False, False), None, frozenset()),
    ("x86_64", (True, False), None, frozenset({"avx512_bf16"})),
    ("x86_64", (False, True), None, frozenset({"amx_tile"})),
    ("aarch64", (False, False), "Features\t: fp asimd sve bf16 i8mm\n", frozenset({"bf16"})),
    ("aarch64", (False, False), "Features\t: fp asimd evtstrm crc32\n", frozenset()),
    ("arm64", (False, False), None, frozenset()),  # macOS: no /proc/cpuinfo, no flag read
])
def test_cpu_bf16_flags_read_the_cpu_and_nothing_else(machine, x86_flags, cpuinfo, expected, monkeypatch, tmp_path):
    monkeypatch.setattr(ns_module.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: x86_flags[0])
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: x86_flags[1])
    info = tmp_path / "cpuinfo"  # absent where cpuinfo is None
    if cpuinfo is not None:
        info.write_text("processor\t: 0\n" + cpuinfo)
    monkeypatch.setattr(ns_module, "_CPUINFO", str(info))
    assert cpu_bf16_flags() == expected


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cuda_asks_for_native_bf16(native, expected, monkeypatch):
    asked = []
    monkeypatch.delenv(NS_DTYPE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: asked.append(including_emulation) or native)
    assert fast_dtype("cuda:0") == expected
    assert asked == [False]  # an emulated bf16 (before compute capability 8.0) is the slow choice


def test_auto_on_other_devices_is_float32(monkeypatch):
    monkeypatch.delenv(NS_DTYPE_ENV, raising=False)
    assert fast_dtype(torch.device("meta")) == torch.float32


@pytest.mark.parametrize("value, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                             ("float16", torch.float16), ("float64", torch.float64)])
def test_the_environment_variable_overrides_the_flags_on_every_device(value, expected, monkeypatch):
    monkeypatch.setattr(ns_module, "cpu_bf16_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setenv(NS_DTYPE_ENV, value)
    assert fast_dtype("cpu") == fast_dtype("cuda") == expected
    assert newton_schulz(torch.randn(8, 16)).dtype == expected


def test_a_bad_environment_variable_names_the_choices(monkeypatch):
    monkeypatch.setenv(NS_DTYPE_ENV, "bf16")
    with pytest.raises(ValueError, match=f"{NS_DTYPE_ENV}='bf16' names no Newton-Schulz dtype.*bfloat16"):
        newton_schulz(torch.randn(4, 4))


def test_an_explicit_dtype_wins_over_auto(monkeypatch):
    monkeypatch.setenv(NS_DTYPE_ENV, "float32")
    assert newton_schulz(torch.randn(8, 16), dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype, match", [("bfloat16", "pass torch.bfloat16"), ("fast", "got the string 'fast'"),
                                          (torch.int32, "floating torch.dtype")])
def test_a_dtype_that_is_neither_auto_nor_floating_is_refused(dtype, match):
    with pytest.raises(TypeError, match=match):
        newton_schulz(torch.randn(4, 4), dtype=dtype)


@pytest.mark.skipif(os.environ.get("ATEN_CPU_CAPABILITY") != "avx2",
                    reason="checks make test's emulated AVX2 stage (tests/stages.sh), which sets ATEN_CPU_CAPABILITY=avx2")
def test_the_avx2_emulation_took_effect():
    # torch dispatches to its AVX2 kernels, and "auto" takes float32 as on a CPU without native bf16.
    # (The stage prints the matmul rates: bf16 falls from ~200 to ~2 GFLOP/s on a CPU with AVX512-BF16.)
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2"  # oneDNN's bf16 kernels too
    assert fast_dtype("cpu") == torch.float32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_this_gpu_is_bf16_from_ampere_on(monkeypatch):
    monkeypatch.delenv(NS_DTYPE_ENV, raising=False)
    native = torch.version.hip is not None or torch.cuda.get_device_properties(0).major >= 8
    assert fast_dtype("cuda") == (torch.bfloat16 if native else torch.float32)
    assert newton_schulz(torch.randn(64, 128, device="cuda")).dtype == fast_dtype("cuda")
