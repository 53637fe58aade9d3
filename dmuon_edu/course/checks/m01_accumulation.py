"""Checks for module 1: loss-scaled accumulation."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dmuon_edu.accumulation import train_step_with_accumulation
from dmuon_edu.course import pitfalls
from dmuon_edu.course.checks.problem import regression_model, regression_windows
from dmuon_edu.course.threads import one_thread
from dmuon_edu.memory import peak_memory_bytes

# Float32 parameters of size ~0.1-1 after a few additions: two correct
# implementations that order or group the scaling differently differ by a few
# ulps (~1e-7). Any real mistake moves them by more than 1e-3.
PARAMETER_ATOL = 1e-6
LOSS_RTOL = 1e-5

_STEP_MISTAKES = [
    (
        pitfalls.unscaled_loss,
        "the update is N times too large: each micro-batch loss must be divided by the number of "
        "micro-batches before .backward(), because .backward() adds into .grad",
    ),
    (
        pitfalls.zero_grad_inside_loop,
        "only the last micro-batch reached the step: optimizer.zero_grad() is inside the micro-batch loop; "
        "call it once, before the loop",
    ),
    (
        pitfalls.never_zero_grad,
        "the second window also applied the first window's gradient: .grad is never cleared; "
        "call optimizer.zero_grad() once at the start of every window",
    ),
    (
        pitfalls.step_every_microbatch,
        "optimizer.step() runs after every micro-batch; call it once, after the loop",
    ),
]


def _check_train_step(candidate: Callable) -> tuple[str, str]:
    # Equal micro-batches only: the exercise comes before unequal ones (microbatch_weights). Two
    # different N, so that a step hard-wired to N = 4 fails.
    for sizes in ([3, 3, 3, 3], [5, 5]):
        windows = regression_windows(sizes, n_windows=2, seed=1234)
        expected_params, expected_losses = _train(train_step_with_accumulation, windows)
        params, losses = _train(candidate, windows)
        if not torch.allclose(params, expected_params, atol=PARAMETER_ATOL, rtol=0):
            return "FAIL", _diagnose_update(params, windows, sizes)
        for loss, expected in zip(losses, expected_losses):
            if not isinstance(loss, float):
                return "FAIL", f"return the loss as a Python float (loss.item()), not {type(loss).__name__}"
            if abs(loss - expected) > LOSS_RTOL * abs(expected):
                return "FAIL", _diagnose_loss(loss, expected, len(sizes))
    peak, forwards, backwards = _memory_of(candidate)
    ratio = peak / _memory_of(train_step_with_accumulation)[0]
    if ratio > PEAK_RATIO:
        return "FAIL", _diagnose_memory(ratio, forwards, backwards)
    return "PASS", ("your step equals one full-batch step, for 4 and for 2 micro-batches, returns the mean loss, "
                    "and peaks at one micro-batch's memory")


# The memory lesson, graded: a window of 8 micro-batches of 256 samples on an MLP whose activations
# outweigh its weights. A step that frees each micro-batch's activations at its backward peaks at
# 1.00x the package's (measured, also keeping each loss tensor for logging); every step that keeps the
# window's activations alive peaks at 4x or more (one summed backward 4.1x, retain_graph=True 4.6x,
# the window as one batch 5.0x). 2x lies between, far from both.
PEAK_RATIO = 2.0
MEMORY_WINDOW = (8, 256)  # micro-batches, samples each


def _memory_of(step_fn: Callable) -> tuple[int, int, int]:
    """Peak bytes of one ``step_fn`` window on the activation-heavy MLP; its forwards and its backward passes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                    torch.nn.GELU(), torch.nn.Linear(512, 1))
    generator = torch.Generator().manual_seed(7)
    count, size = MEMORY_WINDOW
    window = [(torch.randn(size, 64, generator=generator), torch.randn(size, 1, generator=generator))
              for _ in range(count)]
    forwards, backwards = [], []
    model.register_forward_hook(lambda *_: forwards.append(1))
    model[0].weight.register_hook(lambda grad: backwards.append(1))  # once per backward pass through the model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with one_thread():  # the profiler counts the calling thread's allocations
        peak = peak_memory_bytes(lambda: step_fn(model, optimizer, window, torch.nn.functional.mse_loss))
    return peak, len(forwards), len(backwards)


def _diagnose_memory(ratio: float, forwards: int, backwards: int) -> str:
    cost = f"{ratio:.1f}x the peak memory of a backward per micro-batch"
    if forwards == 1:
        return f"you ran the window as one batch, the very step accumulation replaces: {cost}"
    if backwards == 1:
        return (f"you added the losses and called backward once, so every micro-batch's activations lived until "
                f"then ({cost}): call backward on each micro-batch's loss")
    return (f"each micro-batch's graph outlived its backward (retain_graph=True?), so the activations piled up: "
            f"{cost}")


def _diagnose_update(params: torch.Tensor, windows, sizes) -> str:
    initial, _ = _train(lambda *args: 0.0, windows)
    if torch.equal(params, initial):
        return "the parameters did not change: call optimizer.step() once, after the micro-batch loop"
    for mistake, hint in _STEP_MISTAKES:
        mistaken, _ = _train(mistake, windows)
        if torch.allclose(params, mistaken, atol=PARAMETER_ATOL, rtol=0):
            return hint
    expected, _ = _train(train_step_with_accumulation, windows)
    return (
        f"with micro-batch sizes {sizes} your parameters differ from one full-batch step by up to "
        f"{(params - expected).abs().max().item():.2g}; zero_grad once, divide each loss by N, "
        "backward every micro-batch, step once"
    )


def _diagnose_loss(loss: float, expected: float, n_microbatches: int) -> str:
    if abs(loss * n_microbatches - expected) <= LOSS_RTOL * abs(expected):
        return "the returned loss is N times too small: undo the scaling when logging, loss.item() * N"
    return f"the returned loss {loss:.4f} is not the window's mean loss {expected:.4f}"


def _train(step_fn: Callable, windows) -> tuple[torch.Tensor, list]:
    """Parameters after calling ``step_fn`` once per window from a fixed start, and its returns."""
    model = regression_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [step_fn(model, optimizer, window, torch.nn.functional.mse_loss) for window in windows]
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return params, losses


# --- microbatch_weights -----------------------------------------------------------------------

# Gradients of size ~0.1-1 added in float32: the right weights, however computed (n_i / n, or
# 1 / n times n_i), land within ~1e-7 of the full batch's gradient, relative. The smallest known
# mistake here is more than 10% off.
GRADIENT_RTOL = 1e-5

# The notebook's example first, then sizes that a weight list written out for it gets wrong, then
# equal sizes (where 1/N is right) and a single micro-batch (where the weight must be 1).
WEIGHT_CASES = ([3, 5, 8], [1, 2, 7, 6], [4, 4, 4], [5])

# (wrong weights for the sizes, what the mistake is), in the order tried.
_WEIGHT_MISTAKES = [
    (
        lambda sizes: [1 / len(sizes)] * len(sizes),
        "every micro-batch has weight 1/N, so this averages the micro-batch means and a sample of a small "
        "micro-batch counts more than a sample of a large one",
    ),
    (
        lambda sizes: list(sizes),
        "the weights are the sample counts n_i: that adds up the summed loss, n times the mean's gradient "
        "(n = all the window's samples); the weights of a mean add up to 1",
    ),
    (
        lambda sizes: [size / len(sizes) for size in sizes],
        "the weights are n_i / N (N = number of micro-batches): they follow the sizes, but add up to "
        "n / N instead of 1",
    ),
    (
        lambda sizes: [1 / size for size in sizes],
        "the weights are 1 / n_i: a micro-batch's mean loss already divides by n_i, so this divides twice "
        "and small micro-batches count most",
    ),
]


def _check_microbatch_weights(candidate: Callable) -> tuple[str, str]:
    for sizes in WEIGHT_CASES:
        weights = candidate(list(sizes))
        if not hasattr(weights, "__len__") or len(weights) != len(sizes):
            return "FAIL", f"return one weight per micro-batch: for sizes {sizes}, a list of {len(sizes)} numbers"
        accumulated, full = _window_gradients(sizes, [float(w) for w in weights])
        if (accumulated - full).norm() > GRADIENT_RTOL * full.norm():
            return "FAIL", _diagnose_weights(sizes, accumulated, full)
    tried = "; ".join(", ".join(map(str, sizes)) for sizes in WEIGHT_CASES)
    return "PASS", f"with your weights the accumulated gradient is the full batch's mean gradient, for micro-batch sizes {tried}"


def _diagnose_weights(sizes: list[int], accumulated: torch.Tensor, full: torch.Tensor) -> str:
    cost = f"with sizes {sizes} your accumulated gradient is {((accumulated - full).norm() / full.norm()).item():.0%} off the full batch's"
    for mistake, what in _WEIGHT_MISTAKES:
        mistaken, _ = _window_gradients(sizes, mistake(sizes))
        if (accumulated - mistaken).norm() <= GRADIENT_RTOL * mistaken.norm():
            return f"{cost}: {what}"
    return f"{cost}; write the full-batch mean loss as a sum over the micro-batches' mean losses"


def _window_gradients(sizes: list[int], weights: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_i w_i grad(mean loss of micro-batch i), and the gradient of the whole window's mean loss."""
    [window] = regression_windows(sizes, n_windows=1, seed=99)
    model = regression_model()

    def gradient(loss):
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])

    mse = torch.nn.functional.mse_loss
    full = gradient(mse(model(torch.cat([x for x, _ in window])), torch.cat([y for _, y in window])))
    return sum(w * gradient(mse(model(x), y)) for w, (x, y) in zip(weights, window)), full


EXERCISES = {
    "train_step_with_accumulation": _check_train_step,
    "microbatch_weights": _check_microbatch_weights,
}
