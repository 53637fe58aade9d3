"""Step time and accuracy of dmuon_edu's Muon against torch.optim.Muon, in one run.

    .venv/bin/python benchmarks/bench_muon.py        # about 2 minutes on a 2-core CPU

Both optimizers get the same parameters and the same gradients, with the same
hyperparameters and bf16 Newton-Schulz: torch.optim.Muon always multiplies in bf16, so
ours is given ``ns_dtype=torch.bfloat16`` (like with like), not its default "auto",
which on a CPU without native bf16 takes float32 (``step_times(shape, "auto")`` times
that default against torch's bf16 step). Method: warm-up steps first; then the two
optimizers' steps are interleaved (alternating which goes first) so that drift in the
machine's speed hits both alike. Each row reports the median step times and the
median of the per-repeat ratios ours / torch (< 1: we are faster), which is robust
to load that comes and goes.

Accuracy: the relative Frobenius error of W_3 - W_0 after three steps, against the same
three steps evaluated in float64 straight from the contract (written out below, not
taken from the package), averaged over two matrices. Two kinds of gradient: Gaussian,
and one with singular values 1, 1/2, 1/3, ... (ill-conditioned, closer to real ones).
"""

import statistics
import time

import torch

from dmuon_edu.muon import Muon
from dmuon_edu.newton_schulz import _iterate, _normalise, newton_schulz

SHAPES = {
    "small 128x128": (128, 128),
    "square 512x512": (512, 512),
    "4:1 512x2048": (512, 2048),
    "1:4 2048x512 (tall)": (2048, 512),
}
MATRICES = 8
MATRICES_FOR_ERROR = 2  # the float64 reference is the slow part
REPEATS = 30  # fewer let the square rows' ratio wander by +-0.05 between runs here
HYPER = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)
JORDAN = (3.4445, -4.7750, 2.0315)


def contract_float64(W, grads, lr, momentum, nesterov, weight_decay):
    """The Muon update as specified, in float64, for one matrix and a gradient sequence."""
    W, B = W.double().clone(), torch.zeros_like(W, dtype=torch.float64)
    m, n = W.shape
    for G in grads:
        G = G.double()
        B = momentum * B + G
        U = G + momentum * B if nesterov else B
        X = U.T if m > n else U
        X = X / (X.norm() + 1e-7)
        for _ in range(5):
            A = X @ X.T
            X = JORDAN[0] * X + (JORDAN[1] * A + JORDAN[2] * A @ A) @ X
        O = X.T if m > n else X
        W = W * (1 - lr * weight_decay) - lr * max(1, m / n) ** 0.5 * O
    return W


def ill_conditioned(m, n):
    k = min(m, n)
    left = torch.linalg.qr(torch.randn(m, k))[0]
    right = torch.linalg.qr(torch.randn(n, k))[0]
    return left @ torch.diag(1 / torch.arange(1, k + 1, dtype=torch.float32)) @ right.T


def update_error(make_optimizer, shape, make_grad):
    torch.manual_seed(1)
    W0 = [torch.randn(shape) for _ in range(MATRICES_FOR_ERROR)]
    grads = [[make_grad(*shape) for _ in range(MATRICES_FOR_ERROR)] for _ in range(3)]
    params = [torch.nn.Parameter(w.clone()) for w in W0]
    opt = make_optimizer(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    errors = []
    for i, p in enumerate(params):
        ref = contract_float64(W0[i], [step_grads[i] for step_grads in grads], **HYPER) - W0[i].double()
        errors.append(((p.detach().double() - W0[i].double()) - ref).norm() / ref.norm())
    return statistics.mean(e.item() for e in errors)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_times(shape, ns_dtype=torch.bfloat16):
    torch.manual_seed(0)
    W0 = [torch.randn(shape) for _ in range(MATRICES)]
    ours = [torch.nn.Parameter(w.clone()) for w in W0]
    theirs = [torch.nn.Parameter(w.clone()) for w in W0]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(shape)
        b.grad = a.grad.clone()
    opt_ours, opt_torch = Muon(ours, **HYPER, ns_dtype=ns_dtype), torch.optim.Muon(theirs, **HYPER)
    for _ in range(3):
        opt_ours.step()
        opt_torch.step()
    t_ours, t_torch = [], []
    for r in range(REPEATS):
        if r % 2:
            t_torch.append(timed(opt_torch.step))
            t_ours.append(timed(opt_ours.step))
        else:
            t_ours.append(timed(opt_ours.step))
            t_torch.append(timed(opt_torch.step))
    ratio = statistics.median(a / b for a, b in zip(t_ours, t_torch))
    return statistics.median(t_ours), statistics.median(t_torch), ratio


def ns_times(shape):
    G = torch.randn(MATRICES, *shape)
    per_step = [JORDAN] * 5
    variants = {
        "ours, one matrix at a time": lambda: [newton_schulz(g, dtype=torch.bfloat16) for g in G],
        "ours, batched torch.baddbmm": lambda: _iterate(_normalise(G, 1e-7, torch.bfloat16, torch.empty_like(G)), per_step),
        "torch, one matrix at a time": lambda: [torch.optim._muon._zeropower_via_newtonschulz(g, JORDAN, 5, 1e-7) for g in G],
    }
    for fn in variants.values():
        fn()
    samples = {name: [] for name in variants}
    names = list(variants)
    for r in range(REPEATS):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each goes first in turn
            samples[name].append(timed(variants[name]))
    m, n = sorted(shape)
    flops = MATRICES * 5 * (4 * m * m * n + 2 * m**3)  # direct NS5
    return {name: (statistics.median(s), flops / statistics.median(s) / 1e9) for name, s in samples.items()}


def main():
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {MATRICES} matrices per shape, bf16 NS\n")
    print("| shape | dmuon_edu step (ms) | torch step (ms) | time ratio | error vs f64, Gaussian G: ours / torch "
          "| error vs f64, singular values 1/k: ours / torch |")
    print("|---|---|---|---|---|---|")
    for label, shape in SHAPES.items():
        ours, theirs, ratio = step_times(shape)
        errors = []
        for make_grad in (torch.randn, ill_conditioned):
            e_ours = update_error(lambda p: Muon(p, **HYPER, ns_dtype=torch.bfloat16), shape, make_grad)
            e_torch = update_error(lambda p: torch.optim.Muon(p, **HYPER), shape, make_grad)
            errors.append(f"{e_ours:.4f} / {e_torch:.4f} ({e_ours / e_torch:.2f}x)")
        print(f"| {label} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {ratio:.2f} | {errors[0]} | {errors[1]} |")

    print("\nNewton-Schulz alone, 8 matrices (GFLOP/s counted as the direct algorithm's flops):\n")
    print("| shape | variant | ms | effective GFLOP/s |")
    print("|---|---|---|---|")
    for label, shape in SHAPES.items():
        for name, (seconds, gflops) in ns_times(shape).items():
            print(f"| {label} | {name} | {seconds * 1e3:.1f} | {gflops:.0f} |")


if __name__ == "__main__":
    main()
