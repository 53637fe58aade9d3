"""Checks for module 3: accumulation in real training loops."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from dmuon_edu.accumulation import IGNORE_INDEX, accumulation_windows
from dmuon_edu.course.data import MarkovSource, lm_batch
from dmuon_edu.course.threads import one_thread

# (number of batches, accum_steps): divisible, a leftover, fewer batches than N, nothing.
_WINDOW_CASES = [(8, 4), (10, 4), (3, 5), (7, 1), (0, 2)]


def _check_windows(candidate: Callable) -> tuple[str, str]:
    for n_batches, accum_steps in _WINDOW_CASES:
        batches = [f"batch{i}" for i in range(n_batches)]
        expected = list(accumulation_windows(batches, accum_steps))
        got = [list(window) for window in candidate(batches, accum_steps)]
        if got == expected:
            continue
        if got == [w for w in expected if len(w) == accum_steps]:
            return "FAIL", (f"with {n_batches} batches and accum_steps={accum_steps} the last, shorter window is "
                            "missing: after the loop, yield what is left if it is not empty")
        if sum(got, []) != batches:
            return "FAIL", f"with {n_batches} batches and accum_steps={accum_steps} your windows do not hold every batch once, in order: {got}"
        return "FAIL", f"with {n_batches} batches and accum_steps={accum_steps} expected windows {expected}, got {got}"
    return _check_windows_of_a_stream(candidate)


class _CountedBatches:
    """10 batches, counting how many have been read; the check hands over ``iter()`` of it, a generator."""

    def __init__(self):
        self.read = 0

    def __iter__(self):
        for i in range(10):
            self.read += 1
            yield f"batch{i}"


def _check_windows_of_a_stream(candidate: Callable) -> tuple[str, str]:
    """A generator and a DataLoader: no len(), no slicing, and each window yielded before the next is read."""
    stream = _CountedBatches()
    try:
        windows = iter(candidate(iter(stream), 4))
        first = list(next(windows))
        read_for_the_first = stream.read
        rest = [list(window) for window in windows]
        loader = [[int(b) for b in window] for window in candidate(DataLoader(torch.arange(10), batch_size=1), 4)]
    except TypeError as error:
        return "FAIL", (f"your function needs len() or slicing ({error}), which a generator or a DataLoader does not "
                        "have: walk the batches once, with a for loop")
    if [first, *rest] != [[f"batch{i}" for i in w] for w in _TEN_IN_FOURS]:
        return "FAIL", f"given a generator of 10 batches and accum_steps=4, your windows are {[first, *rest]}"
    if read_for_the_first > 4:
        return "FAIL", (f"your function read {read_for_the_first} batches before yielding the first window of 4: a "
                        "DataLoader's epoch need not fit in memory, so yield each window as soon as it is full")
    if loader != _TEN_IN_FOURS:
        return "FAIL", f"given a DataLoader of 10 batches and accum_steps=4, your windows are {loader}"
    return "PASS", ("windows of accum_steps batches, a shorter last window when the count does not divide, from a "
                    "list, a generator and a DataLoader, each window yielded as soon as it is full")


_TEN_IN_FOURS = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# Two z-loss weights: a large one where every mistake shows by far, and PaLM's 1e-4.
Z_WEIGHTS = (0.1, 1e-4)
# Sums of ~20 float32 terms of order 1-10, added in another order by an honest answer: ~1e-6 relative. The
# smallest mistake (PaLM's weight on padding's z-term) moves the sum by more than 1e-4 relative.
SUM_RTOL = 1e-5


def _z_loss_problem():
    """Logits with real and padded positions: two sequences padded after 3 and 1 tokens, one not padded."""
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 7, generator=generator)).requires_grad_()
    targets = torch.randint(0, 7, (3, 5), generator=generator)
    targets[0, 3:] = IGNORE_INDEX
    targets[2, 1:] = IGNORE_INDEX
    return logits, targets


def _z_loss_terms(logits, targets):
    """(cross-entropy per position, 0 at padding; (log Z)^2 per position; real positions): computed here, apart
    from any function of the package."""
    log_z = logits.logsumexp(-1)
    real = targets != IGNORE_INDEX
    picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(real, log_z - picked, 0.0), log_z**2, real


# Learners' answers, right count and wrong sum, and what each did.
_Z_LOSS_SUMS = [
    (lambda ce, z2, real, w: ce.sum() + w * z2.sum(),
     "the z-term of the padding positions entered the sum: ignore_index masks only F.cross_entropy's own term; "
     "sum w (log Z)^2 over the positions where targets != IGNORE_INDEX"),
    (lambda ce, z2, real, w: ce.sum() + w * z2[real].mean(),
     "the z-term was averaged within the micro-batch while the cross-entropy was summed: the window divides every "
     "term by its total count, so sum both"),
    (lambda ce, z2, real, w: ce.sum(), "the z-loss term is missing: add w (log Z)^2 for every real position"),
    (lambda ce, z2, real, w: ce.sum() + w * z2[real].sqrt().sum(),
     "the z-term is w (log Z)^2, the square of logsumexp over the vocabulary, not w log Z"),
]


def _check_summed_token_loss_with_z(candidate: Callable) -> tuple[str, str]:
    for z_weight in Z_WEIGHTS:
        logits, targets = _z_loss_problem()
        ce, z2, real = _z_loss_terms(logits, targets)
        count = int(real.sum())
        expected = (ce + z_weight * z2)[real].sum()
        result = candidate(logits, targets, z_weight)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            return "FAIL", "return a pair: (the loss summed over real tokens, the number of real tokens)"
        loss_sum, their_count = result
        if int(their_count) == targets.numel():
            return "FAIL", "the count includes padding: count only targets != IGNORE_INDEX"
        if int(their_count) != count:
            return "FAIL", f"the count should be the number of real (non-padding) targets, {count}, got {int(their_count)}"
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1:
            return "FAIL", "the summed loss must be a scalar tensor (so that it can be backpropagated)"
        if not loss_sum.requires_grad:
            return "FAIL", "the summed loss left the graph (an .item(), a detach or a no_grad): backward needs it"
        if torch.allclose(loss_sum, expected, rtol=SUM_RTOL, atol=0):
            continue
        if torch.allclose(loss_sum, expected / count, rtol=SUM_RTOL, atol=0):
            return "FAIL", "that is the mean over tokens; return the sum, so that the window can divide by its total"
        hint = next((hint for wrong, hint in _Z_LOSS_SUMS
                     if torch.allclose(loss_sum, wrong(ce, z2, real, z_weight), rtol=SUM_RTOL, atol=0)),
                    "sum cross-entropy + w (log Z)^2 over the real positions only")
        return "FAIL", (f"with z_weight {z_weight:g} the summed loss should be {expected.item():.6g}, got "
                        f"{loss_sum.item():.6g}: {hint}")
    return "PASS", (f"the loss summed over real tokens, z-loss included, and their count, at z_weight "
                    f"{' and '.join(f'{w:g}' for w in Z_WEIGHTS)}")


# Sequence lengths per micro-batch, chosen so that every weighting below gives other weights:
# sequences 1 : 4 : 2, predicted tokens 59 : 51 : 19, padded positions 59 : 156 : 22.
_PADDED_WINDOW = [[60], [5, 5, 5, 40], [12, 9]]
_VOCAB = 12
# Two correct weightings differ by float32 rounding of reordered sums (~1e-7 relative); the
# weightings below move the gradient by more than 10% (tests/test_checks.py measures each).
GRADIENT_RTOL = 1e-5


def _token_weights(microbatches):
    counts = [int((targets != IGNORE_INDEX).sum()) for _, targets in microbatches]
    return [count / sum(counts) for count in counts]


def _uniform_weights(microbatches):
    return [1 / len(microbatches)] * len(microbatches)


def _sequence_weights(microbatches):
    sequences = [targets.shape[0] for _, targets in microbatches]
    return [n / sum(sequences) for n in sequences]


def _position_weights(microbatches):
    positions = [targets.numel() for _, targets in microbatches]
    return [n / sum(positions) for n in positions]


# (weighting, the mistake it is): what a learner's weights are compared with, by their gradient.
_WEIGHT_MISTAKES = [
    (_uniform_weights, "every micro-batch weighs 1/N: that is the mean of micro-batch means, the 2024 transformers "
                       "bug, so a token of a short micro-batch counts more than a token of a long one"),
    (_sequence_weights, "you weight by sequences (module 1's share of the samples), but a token loss averages over "
                        "tokens, and these sequences hold different numbers of them"),
    (_position_weights, "you count padded positions too; only targets != IGNORE_INDEX are predicted tokens"),
]


def _padded_window() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    """The check's window: three micro-batches of padded sequences, and the same sequences as one batch."""
    source = MarkovSource.random(_VOCAB, seed=5)
    generator = torch.Generator().manual_seed(6)
    groups = [[source.sample(1, n, generator)[0] for n in lengths] for lengths in _PADDED_WINDOW]
    return [lm_batch(group) for group in groups], lm_batch([s for group in groups for s in group])


def _weighted_gradient(weights, microbatches) -> torch.Tensor:
    """The gradient of sum_i w_i L_i, L_i micro-batch i's mean token loss, for a seeded tiny language model."""
    with torch.random.fork_rng(devices=[]):  # seeded, without moving the notebook's random stream
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(_VOCAB, 16), torch.nn.Tanh(), torch.nn.Linear(16, _VOCAB))
    with one_thread():
        loss = sum(float(w) * _mean_token_loss(model(x), y) for w, (x, y) in zip(weights, microbatches))
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])


def _mean_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _multiple(got: torch.Tensor, reference: torch.Tensor) -> float | None:
    """k where ``got`` is k times ``reference`` (up to GRADIENT_RTOL), else None."""
    k = (got @ reference / reference.norm() ** 2).item()
    return k if _relative(got, k * reference) < GRADIENT_RTOL else None


def _check_mean_loss_weights(candidate: Callable) -> tuple[str, str]:
    microbatches, (x, y) = _padded_window()
    weights = candidate(microbatches)
    try:
        weights = [float(w) for w in weights]
    except (TypeError, ValueError):
        return "FAIL", f"return one number per micro-batch (a list of floats), got {type(weights).__name__}"
    if len(weights) != len(microbatches):
        return "FAIL", f"return one weight per micro-batch: {len(microbatches)} micro-batches, got {len(weights)} weights"
    if not any(weights):
        return "FAIL", "every weight is 0: no micro-batch reaches the gradient"
    full = _weighted_gradient([1.0], [(x, y)])
    got = _weighted_gradient(weights, microbatches)
    for weighting, mistake in _WEIGHT_MISTAKES:
        wrong = _weighted_gradient(weighting(microbatches), microbatches)
        if _multiple(got, wrong) is not None:
            return "FAIL", f"{mistake}: the window's gradient is {_relative(wrong, full):.0%} off the full batch's"
    k = _multiple(got, _weighted_gradient(_token_weights(microbatches), microbatches))
    if k is not None and abs(k - 1) < GRADIENT_RTOL:
        return "PASS", "the weighted micro-batch means give the full batch's token-mean gradient"
    if k is not None:
        return "FAIL", (f"the right proportions, but your weights add up to {sum(weights):.4g}: the gradient is "
                        f"{k:.4g} times the full batch's; the weights of a mean must add up to 1")
    return "FAIL", (f"the window's gradient is {_relative(got, full):.0%} off the full batch's token mean: "
                    "how many tokens does each micro-batch's mean average over, and how many does the window's?")


EXERCISES = {
    "accumulation_windows": _check_windows,
    "mean_loss_weights": _check_mean_loss_weights,
    "summed_token_loss_with_z": _check_summed_token_loss_with_z,
}
