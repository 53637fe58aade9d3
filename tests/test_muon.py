"""Muon against the contract (field notes, section 1), evaluated independently in float64."""

import io
import math

import warnings

import pytest
import torch
from torch import nn

import dmuon_edu.muon as muon_module
import dmuon_edu.newton_schulz as newton_schulz_module
from dmuon_edu.muon import Muon, muon_param_groups

JORDAN = (3.4445, -4.7750, 2.0315)

# Relative error allowed between a float32 Muon step and the float64 contract: the
# Newton-Schulz part alone stays below 1e-5 in float32 (tests/test_newton_schulz.py);
# momentum and the update add a few roundings of 6e-8 each. 1e-4 leaves room and is 100x
# below a bf16 step (~1e-2), so a bf16 product where float32 was asked for fails.
FP32_RTOL = 1e-4

# Relative difference allowed between two bf16 implementations (ours, torch's), or
# between a bf16 step and the float64 contract. bf16 keeps 8 significant bits (rounding
# 2^-9 = 0.2%); the fifteen chained products of NS5 compound that to ~1% per
# implementation (measured 0.8-1.2% for each against float64), so two of them differ by
# at most ~2%. Measured on these tests' data, 3% still catches the other shape factor
# (>= 9%), Nesterov on vs off (>= 13%) and a missing weight decay (>= 55%); finer
# mistakes (momentum 0.9 for 0.95 moves the result 2-5%) are for the float32 tests.
BF16_RTOL = 0.03


def ns5_float64(U):
    X = U.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (torch.linalg.norm(X) + 1e-7)
    a, b, c = JORDAN
    for _ in range(5):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def contract_float64(W0, grads, lrs, momentum=0.95, nesterov=True, weight_decay=0.0, adjust_lr_fn="original"):
    """The Muon update as specified, step by step, in float64 (lrs: one per step)."""
    W = W0.double().clone()
    B = torch.zeros_like(W)
    m, n = W.shape
    s = math.sqrt(max(1, m / n)) if adjust_lr_fn == "original" else 0.2 * math.sqrt(max(m, n))
    for G, lr in zip(grads, lrs):
        G = G.double()
        B = momentum * B + G
        U = G + momentum * B if nesterov else B
        W = W * (1 - lr * weight_decay) - lr * s * ns5_float64(U)
    return W


def relative_error(W, W0, expected):
    """Error of the total change W - W0, relative to the expected change."""
    change, expected_change = W.detach().double() - W0.double(), expected - W0.double()
    return ((change - expected_change).norm() / expected_change.norm()).item()


def run(optimizer_class, W0s, grads, **kwargs):
    """Apply len(grads) steps; grads[t][i] is the gradient of parameter i at step t."""
    params = [nn.Parameter(w.clone()) for w in W0s]
    opt = optimizer_class(params, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return params, opt


def random(shapes, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    W0s = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    return W0s, grads


# Square, wide and tall, with two matrices of one shape (batched NS); (256, 512) takes
# newton_schulz's Gram-space path.
SHAPES = [(32, 32), (32, 32), (24, 96), (80, 20), (256, 512)]


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_float32_step_matches_the_float64_contract(adjust_lr_fn, nesterov, weight_decay):
    # The hyperparameters act outside Newton-Schulz, so one combination carries the Gram-space shape
    # (the float64 contract on it is most of this test's time); the others prove the step's algebra.
    gram_case = (adjust_lr_fn, nesterov, weight_decay) == ("match_rms_adamw", True, 0.1)
    W0s, grads = random(SHAPES if gram_case else SHAPES[:-1], steps=4)
    hyper = dict(momentum=0.9, nesterov=nesterov, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn)
    params, _ = run(Muon, W0s, grads, lr=0.05, ns_dtype=torch.float32, **hyper)
    for i, (p, W0) in enumerate(zip(params, W0s)):
        expected = contract_float64(W0, [g[i] for g in grads], [0.05] * 4, **hyper)
        assert relative_error(p, W0, expected) < FP32_RTOL


def test_bf16_step_is_close_to_the_float64_contract():
    W0s, grads = random(SHAPES, steps=3, seed=1)
    params, _ = run(Muon, W0s, grads, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
    for i, (p, W0) in enumerate(zip(params, W0s)):
        expected = contract_float64(W0, [g[i] for g in grads], [0.02] * 3, weight_decay=0.1)
        assert relative_error(p, W0, expected) < BF16_RTOL


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_agrees_with_torch_optim_muon(adjust_lr_fn, nesterov):
    # torch's momentum is an EMA, (1 - mu) times ours; NS normalisation removes the factor.
    # torch always multiplies in bf16, so ours does too here: like with like.
    W0s, grads = random(SHAPES, steps=3, seed=2)
    hyper = dict(lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn)
    ours, _ = run(Muon, W0s, grads, ns_dtype=torch.bfloat16, **hyper)
    theirs, _ = run(torch.optim.Muon, W0s, grads, **hyper)
    for p, q, W0 in zip(ours, theirs, W0s):
        assert relative_error(p, W0, q.detach().double()) < BF16_RTOL


@pytest.mark.parametrize("machine, expected", [
    (dict(flags=frozenset()), torch.float32),                        # a CPU without native bf16
    (dict(flags=frozenset({"avx512_bf16"})), torch.bfloat16),         # one with it
    (dict(flags=frozenset({"avx512_bf16"}), env="float32"), torch.float32),  # the override wins
])
def test_the_default_ns_dtype_is_the_fast_one_for_the_machine(machine, expected, monkeypatch):
    monkeypatch.setattr(newton_schulz_module, "cpu_bf16_flags", lambda: machine["flags"])
    if "env" in machine:
        monkeypatch.setenv(newton_schulz_module.NS_DTYPE_ENV, machine["env"])
    else:
        monkeypatch.delenv(newton_schulz_module.NS_DTYPE_ENV, raising=False)
    W0s, grads = random(SHAPES, steps=2, seed=4)
    default, opt = run(Muon, W0s, grads, lr=0.02)
    explicit, _ = run(Muon, W0s, grads, lr=0.02, ns_dtype=expected)
    assert all(torch.equal(p, q) for p, q in zip(default, explicit))
    assert opt.param_groups[0]["ns_dtype"] == "auto"  # decided per step and device, not frozen at construction


def test_gradient_scale_does_not_change_the_update():
    W0s, grads = random(SHAPES, steps=3, seed=3)
    plain, _ = run(Muon, W0s, grads, lr=0.02, ns_dtype=torch.float32)
    scaled, _ = run(Muon, W0s, [[1000.0 * g for g in gs] for gs in grads], lr=0.02, ns_dtype=torch.float32)
    for p, q, W0 in zip(plain, scaled, W0s):
        # Only eps / ||U||_F (~1e-9 here) and float32 rounding of the scaled numbers differ.
        assert relative_error(q, W0, p.detach().double()) < 1e-5


@pytest.mark.parametrize("scale", [1e20, 1e30])
def test_a_huge_finite_gradient_gives_the_update_of_its_direction(scale):
    # torch.optim.Muon (torch 2.13) moves nothing here: its bf16 norm of 1e20-sized entries
    # overflows to inf and G / inf = 0, and its momentum keeps it there for the next 41 to
    # 88 steps after 1e20 and 490 to 537 after 1e30 on these shapes (measured, weight
    # decay off). Ours gives the update of the gradient's direction at once.
    W0s, grads = random(SHAPES, steps=1, seed=12)
    huge = [[scale * g for g in grads[0]]]
    params, opt = run(Muon, W0s, huge, lr=0.02, ns_dtype=torch.float32)
    plain, _ = run(Muon, W0s, grads, lr=0.02, ns_dtype=torch.float32)
    for i, (p, q, W0) in enumerate(zip(params, plain, W0s)):
        assert p.isfinite().all() and not torch.equal(p, W0)
        # float64 squares 1e30 without overflow, so the contract is evaluated on the huge gradient itself
        assert relative_error(p, W0, contract_float64(W0, [huge[0][i]], [0.02])) < FP32_RTOL
        # and it is the update of the gradient scaled down: the two differ by eps / ||U||_F
        # (~1e-9) and by float32 rounding, of the scaled entries too, amplified through NS as
        # in the contract comparison (measured 1e-5 here), so FP32_RTOL applies.
        assert relative_error(p, W0, q.detach().double()) < FP32_RTOL


@pytest.mark.parametrize("path", ["one matrix at a time", "batched"])
@pytest.mark.parametrize("scale, momentum, steps", [(1e20, 0.95, 6), (1e30, 0.95, 6), (1e20, 0.5, 90)])
def test_after_a_huge_gradient_every_step_moves_the_weights_as_momentum_says(scale, momentum, steps, path, monkeypatch):
    # Momentum carries the huge gradient: B_k = mu^k B_0 + ..., so its direction leads until
    # mu^k scale falls to the ordinary gradients' size, k = ln(scale) / ln(1 / mu): about 900
    # steps at 0.95, 66 at 0.5 for 1e20. The 90 steps at 0.5 reach the ordinary gradients'
    # own updates, all of it against the float64 contract.
    monkeypatch.setattr(muon_module, "batching_pays", lambda matrix: path == "batched")
    W0s, grads = random([(24, 96), (80, 20)], steps=steps, seed=13)
    grads[0] = [scale * g for g in grads[0]]
    params = [nn.Parameter(w.clone()) for w in W0s]
    opt = Muon(params, lr=0.02, momentum=momentum, ns_dtype=torch.float32)
    for step_grads in grads:
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        for p, b in zip(params, before):
            assert p.isfinite().all() and (p - b).norm() > 0.01  # an update of unit scale moves them by lr * s * ~||O||
    for i, (p, W0) in enumerate(zip(params, W0s)):
        expected = contract_float64(W0, [g[i] for g in grads], [0.02] * steps, momentum=momentum)
        assert relative_error(p, W0, expected) < FP32_RTOL


def test_a_buffer_that_would_overflow_saturates_and_keeps_stepping():
    # One entry of 3e38 (the sum stays finite): U = G + 0.95 B = 1.95 G overflows float32 at
    # the first step, and B = 0.95 B + G at the second. Both are held at the largest float32;
    # the other entries are ~1, 1e-38 of it, so the direction is still the contract's.
    W0s, grads = random([(8, 16)], steps=5, seed=14)
    for step in (0, 1):
        grads[step][0][3, 5] = 3e38
    params, opt = run(Muon, W0s, grads[:2], lr=0.02, ns_dtype=torch.float32)
    buffer = opt.state[params[0]]["momentum_buffer"]
    assert buffer.abs().max() == torch.finfo(torch.float32).max  # it did saturate
    for g in grads[2:]:
        before = params[0].detach().clone()
        params[0].grad = g[0].clone()
        opt.step()
        assert params[0].isfinite().all() and (params[0] - before).norm() > 0.01
    assert buffer.isfinite().all()
    expected = contract_float64(W0s[0], [g[0] for g in grads], [0.02] * 5)
    assert relative_error(params[0], W0s[0], expected) < FP32_RTOL


def test_an_fp16_buffer_saturates_instead_of_turning_the_weights_to_nan():
    # fp16's largest value is 65504: a steady gradient of 2e4 takes B towards 2e4 / (1 - 0.95)
    # = 4e5. U = G + 0.95 B would overflow to inf at the third step (7.4e4), B at the fourth,
    # and NaN would follow.
    p = nn.Parameter(torch.zeros(16, 16, dtype=torch.float16))
    gradient = 20000 * torch.randn(16, 16, generator=torch.Generator().manual_seed(15)).sign().half()
    opt = Muon([p], lr=0.02)
    for _ in range(8):
        before = p.detach().clone()
        p.grad = gradient.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no step is skipped either
            opt.step()
        assert p.isfinite().all() and not torch.equal(p, before)
    assert opt.state[p]["momentum_buffer"].abs().max() == 65504


def test_grad_is_not_modified():
    W0s, grads = random([(16, 32)], steps=2, seed=4)
    p = nn.Parameter(W0s[0].clone())
    opt = Muon([p], lr=0.02)
    for (g,) in grads:
        p.grad = g.clone()
        opt.step()
        assert torch.equal(p.grad, g)  # Keller Jordan's version leaves the Nesterov blend here


def _newton_schulz_calls(monkeypatch, W0s, grads, batched, **hyper):
    calls, newton_schulz = [], muon_module.newton_schulz

    def spy(G, **kwargs):
        calls.append(len(G) if isinstance(G, list) or G.ndim == 3 else 1)  # a list or a (batch, m, n) tensor
        return newton_schulz(G, **kwargs)

    monkeypatch.setattr(muon_module, "newton_schulz", spy)
    monkeypatch.setattr(muon_module, "batching_pays", lambda matrix: batched)
    final, _ = run(Muon, W0s, grads, lr=0.02, **hyper)
    monkeypatch.undo()
    return calls, final


@pytest.mark.parametrize("nesterov", [True, False])
def test_same_shapes_are_batched_or_go_one_at_a_time_with_equal_results(monkeypatch, nesterov):
    W0s, grads = random([(8, 8), (8, 16), (8, 8), (8, 8), (8, 16)], steps=3, seed=4)
    one_at_a_time, one_by_one = _newton_schulz_calls(monkeypatch, W0s, grads, batched=False, nesterov=nesterov)
    assert one_at_a_time == [1] * 15
    batched, together = _newton_schulz_calls(monkeypatch, W0s, grads, batched=True, nesterov=nesterov)
    assert batched == [3, 2] * 3  # per step: the three 8 x 8, then the two 8 x 16
    for a, b in zip(one_by_one, together):
        assert torch.equal(a, b)


def test_batching_pays_for_small_matrices_on_cpu_only():
    assert muon_module.batching_pays(torch.empty(64, 64)) and muon_module.batching_pays(torch.empty(128, 512))
    assert not muon_module.batching_pays(torch.empty(256, 257))
    assert not muon_module.batching_pays(torch.empty(2048, 512))


def test_grouping_by_shape_does_not_change_the_result():
    W0s, grads = random([(8, 8), (8, 16), (8, 8)], steps=3, seed=5)
    together, _ = run(Muon, W0s, grads, lr=0.02)
    for i, W0 in enumerate(W0s):
        (alone,), _ = run(Muon, [W0], [[g[i]] for g in grads], lr=0.02)
        assert torch.equal(alone, together[i])


def test_state_dict_round_trip_continues_bit_identically():
    W0s, grads = random(SHAPES, steps=6, seed=6)
    uninterrupted, _ = run(Muon, W0s, grads, lr=0.02, weight_decay=0.1)

    first_half, opt = run(Muon, W0s, grads[:3], lr=0.02, weight_decay=0.1)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first_half], "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed = [nn.Parameter(w.clone()) for w in checkpoint["params"]]
    opt = Muon(resumed, lr=0.5)  # the checkpoint's lr must win
    opt.load_state_dict(checkpoint["optimizer"])
    for step_grads in grads[3:]:
        for p, g in zip(resumed, step_grads):
            p.grad = g.clone()
        opt.step()
    for p, q in zip(resumed, uninterrupted):
        assert torch.equal(p, q)


def test_lr_scheduler_sets_each_steps_lr():
    W0s, grads = random([(16, 32)], steps=4, seed=7)
    p = nn.Parameter(W0s[0].clone())
    opt = Muon([p], lr=0.1, weight_decay=0.1, ns_dtype=torch.float32)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for (g,) in grads:
        p.grad = g.clone()
        opt.step()
        scheduler.step()
    expected = contract_float64(W0s[0], [g[0] for g in grads], [0.1, 0.05, 0.025, 0.0125], weight_decay=0.1)
    assert relative_error(p, W0s[0], expected) < FP32_RTOL


@pytest.mark.parametrize("path", ["one matrix at a time", "batched"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 3e38])
def test_non_finite_gradient_skips_that_parameter_and_warns(bad, path, monkeypatch):
    monkeypatch.setattr(muon_module, "batching_pays", lambda matrix: path.startswith("batched"))
    W0s, grads = random([(8, 16), (8, 16), (12, 4)], steps=2, seed=8)
    params, opt = run(Muon, W0s, grads[:1], lr=0.02)
    before = [p.detach().clone() for p in params]
    buffer_before = opt.state[params[0]]["momentum_buffer"].clone()

    poisoned = grads[1][0].clone()
    poisoned[3, 5:7] = bad  # 2 x 3e38 is finite but overflows a float32 sum (and norm)
    for p, g in zip(params, [poisoned, grads[1][1], grads[1][2]]):
        p.grad = g
    with pytest.warns(RuntimeWarning, match=r"shape \(8, 16\).*NaN or Inf"):
        opt.step()

    assert torch.equal(params[0], before[0])
    assert torch.equal(opt.state[params[0]]["momentum_buffer"], buffer_before)
    # The others stepped exactly as they would have without the poisoned neighbour.
    clean, _ = run(Muon, W0s[1:], [g[1:] for g in grads], lr=0.02)
    assert torch.equal(params[1], clean[0]) and torch.equal(params[2], clean[1])


def test_a_large_finite_fp16_gradient_is_stepped_not_skipped():
    # 300 x 300 entries of 300: its sum (2.7e7) and its norm (9e4) overflow fp16 (max 65504),
    # so the finite check and Newton-Schulz's norm must accumulate in float32.
    half, single = nn.Parameter(torch.zeros(300, 300, dtype=torch.float16)), nn.Parameter(torch.zeros(300, 300))
    half.grad, single.grad = torch.full((300, 300), 300.0, dtype=torch.float16), torch.full((300, 300), 300.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([half], lr=0.02).step()
    Muon([single], lr=0.02).step()
    # fp16 keeps 11 bits: the step agrees with float32's to fp16 rounding (2^-11 relative)
    assert torch.allclose(half.float(), single, rtol=2**-10, atol=0) and single.abs().max() > 0


def test_same_shape_parameters_of_different_dtypes_do_not_share_a_precision():
    W0s, grads = random([(300, 300)], steps=2, seed=11)
    alone, _ = run(Muon, [W0s[0].double()], [[g[0].double()] for g in grads], lr=0.02, ns_dtype=torch.float64)
    low = nn.Parameter(W0s[0].bfloat16())
    high = nn.Parameter(W0s[0].double())
    opt = Muon([low, high], lr=0.02, ns_dtype=torch.float64)
    for (g,) in grads:
        low.grad, high.grad = g.bfloat16(), g.double()
        opt.step()
    assert torch.equal(high, alone[0])


def test_parameters_without_grad_are_left_alone():
    a, b = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
    before = b.detach().clone()
    a.grad = torch.randn(8, 8)
    opt = Muon([a, b], lr=0.02)
    opt.step()
    assert torch.equal(b, before) and b not in opt.state


DUPLICATED = nn.Parameter(torch.randn(4, 4))


@pytest.mark.parametrize(
    "params, kwargs, error, match",
    [
        ([nn.Parameter(torch.randn(8))], {}, ValueError, "1-D parameter belongs to AdamW.*muon_param_groups"),
        ([nn.Parameter(torch.randn(2, 3, 4))], {}, ValueError, "3-D parameter belongs to AdamW"),
        ([nn.Parameter(torch.randn(4, 4))], dict(lr=-0.1), ValueError, "lr must be >= 0"),
        ([nn.Parameter(torch.randn(4, 4))], dict(lr=float("nan")), ValueError, "lr must be >= 0 and finite.*e.g. 0.02"),
        ([nn.Parameter(torch.randn(4, 4))], dict(lr=float("inf")), ValueError, "lr must be >= 0 and finite.*e.g. 0.02"),
        ([nn.Parameter(torch.randn(4, 4))], dict(weight_decay=float("nan")), ValueError,
         "weight_decay must be >= 0 and finite.*0.1 is a usual value"),
        ([nn.Parameter(torch.randn(4, 4))], dict(weight_decay=float("inf")), ValueError, "weight_decay must be >= 0 and finite"),
        ([nn.Parameter(torch.randn(4, 4))], dict(momentum=float("nan")), ValueError, "momentum must be in.*0.95 is the usual"),
        ([nn.Parameter(torch.randn(4, 4))], dict(lr=0.5, weight_decay=2.0), ValueError, r"lr \* weight_decay must be < 1"),
        ([nn.Parameter(torch.randn(4, 4))], dict(ns_steps=0), ValueError, "ns_steps must be >= 1"),
        ([nn.Parameter(torch.randn(4, 4))], dict(adjust_lr_fn="spectral"), ValueError, "unknown adjust_lr_fn"),
        ([nn.Parameter(torch.randn(4, 4))], dict(momentum=1.0), ValueError, r"momentum must be in \[0, 1\)"),
        ([nn.Parameter(torch.randn(4, 4))], dict(weight_decay=-1.0), ValueError, "weight_decay must be >= 0"),
        ([nn.Parameter(torch.randn(4, 4))], dict(lr="0.02"), TypeError, "lr must be a number"),
        ([nn.Parameter(torch.randn(4, 4))], dict(nesterov="yes"), TypeError, "nesterov must be True or False"),
        ([nn.Parameter(torch.randn(4, 4))], dict(ns_steps=5.0), TypeError, "ns_steps must be an int"),
        ([nn.Parameter(torch.randn(4, 4))], dict(adjust_lr_fn=1), TypeError, "adjust_lr_fn must be a string or None"),
        ([nn.Parameter(torch.randn(4, 4))], dict(ns_dtype=torch.int32), TypeError, "ns_dtype"),
        (["not a tensor"], {}, TypeError, "Tensor"),
        ([DUPLICATED] * 2, {}, ValueError, "parameter 1 of the group is parameter 0 again; Muon would step it twice"),
        ([("a", DUPLICATED), ("b", DUPLICATED)], {}, ValueError, "parameter 1 of the group is parameter 0 again"),
        (list(nn.Linear(4, 4).named_parameters()), {}, ValueError, "1-D parameter belongs to AdamW"),
        ([{"params": {nn.Parameter(torch.randn(4, 4))}}], {}, TypeError, "not a set"),
        ([nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))], {}, TypeError, "real floating-point"),
    ],
)
def test_bad_input(params, kwargs, error, match):
    with pytest.raises(error, match=match):
        Muon(params, **{"lr": 0.02, **kwargs})


def test_a_rejected_param_group_leaves_the_optimizer_unchanged():
    opt = Muon([nn.Parameter(torch.randn(4, 4))], lr=0.02)
    with pytest.raises(ValueError, match="1-D parameter"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4))]})
    with pytest.raises(ValueError, match="lr must be >= 0"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], "lr": -1.0})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("key, value, match", [
    ("lr", float("nan"), "lr must be >= 0 and finite"),
    ("lr", -1.0, "lr must be >= 0"),
    ("momentum", 1.0, r"momentum must be in \[0, 1\)"),
    ("weight_decay", float("inf"), "weight_decay must be >= 0 and finite"),
    ("ns_steps", 0, "ns_steps must be >= 1"),
])
def test_a_hyperparameter_changed_after_construction_is_refused_at_step(key, value, match):
    good, changed = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    opt = Muon([{"params": [good]}, {"params": [changed]}], lr=0.02)
    opt.param_groups[1][key] = value
    before = [good.detach().clone(), changed.detach().clone()]
    good.grad, changed.grad = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(ValueError, match="param group 1: " + match):
        opt.step()
    # Checked before any parameter steps: the well-set group has not moved either.
    assert torch.equal(good, before[0]) and torch.equal(changed, before[1]) and not opt.state


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("named", [False, True])
def test_a_state_dict_with_a_non_finite_momentum_buffer_is_refused(bad, named):
    W0s, grads = random([(4, 4), (4, 8)], steps=1, seed=16)
    params = [nn.Parameter(w.clone()) for w in W0s]
    opt = Muon(list(zip(["up", "down"], params)) if named else params, lr=0.02)
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()
    saved = opt.state_dict()
    saved["state"][1]["momentum_buffer"][2, 3] = bad

    fresh = Muon(list(zip(["up", "down"], params)) if named else params, lr=0.02)
    with pytest.raises(ValueError, match=r"momentum buffer of parameter 1 \(down\)" if named else "momentum buffer of parameter 1 "):
        fresh.load_state_dict(saved)
    assert not fresh.state  # refused before anything was loaded


class TinyLM(nn.Module):
    def __init__(self, vocab=50, dim=16, tie=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.lm_head(self.norm(x + self.down(torch.relu(self.up(x)))))


def test_muon_param_groups_keeps_hidden_matrices_only():
    model = TinyLM()
    muon, adamw = muon_param_groups(model)
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(muon) == {id(model.up.weight), id(model.down.weight)}
    assert ids(adamw) == {id(p) for p in model.parameters()} - ids(muon)
    assert len(muon) + len(adamw) == len(list(model.parameters()))


def test_muon_param_groups_with_tied_head():
    model = TinyLM(tie=True)
    muon, adamw = muon_param_groups(model)
    assert {id(p) for p in muon} == {id(model.up.weight), id(model.down.weight)}
    assert sum(p is model.embed.weight for p in adamw) == 1


def test_muon_param_groups_mlp_head_is_the_last_linear():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    muon, _ = muon_param_groups(model)
    assert [tuple(p.shape) for p in muon] == [(8, 4), (8, 8)]


def final_loss(muon_lr, steps=15):
    torch.manual_seed(0)
    model = TinyLM()
    tokens = torch.randint(0, 50, (8, 12))
    hidden, rest = muon_param_groups(model)
    optimizers = [Muon(hidden, lr=muon_lr), torch.optim.AdamW(rest, lr=1e-2)]
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return loss.item()


def test_hybrid_training_lowers_the_loss_and_muon_helps():
    # Measured: 4.03 at the start; 2.63 with the hidden matrices frozen, 2.19 with Muon.
    with_muon, frozen_hidden = final_loss(muon_lr=0.05), final_loss(muon_lr=0.0)
    assert with_muon < 0.6 * 4.03
    assert with_muon < frozen_hidden - 0.2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ns_dtype, rtol", [(torch.bfloat16, BF16_RTOL), (torch.float32, FP32_RTOL)])
def test_cuda_step_matches_the_float64_contract(ns_dtype, rtol):
    # TF32 would turn float32 products into 10-bit-mantissa ones; the comparison is with
    # true float32, so make sure it is off (it is by default).
    torch.backends.cuda.matmul.allow_tf32 = False
    W0s, grads = random(SHAPES, steps=3, seed=9)
    cuda_grads = [[g.cuda() for g in gs] for gs in grads]
    params, _ = run(Muon, [w.cuda() for w in W0s], cuda_grads, lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype)
    for i, (p, W0) in enumerate(zip(params, W0s)):
        assert p.is_cuda
        expected = contract_float64(W0, [g[i] for g in grads], [0.02] * 3, weight_decay=0.1)
        assert relative_error(p.cpu(), W0, expected) < rtol
