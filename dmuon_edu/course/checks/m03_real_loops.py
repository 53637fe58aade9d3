"""Checks for module 3: accumulation in real training loops."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dmuon_edu.accumulation import IGNORE_INDEX, accumulation_windows, summed_token_loss

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
            return "FAIL", (
                f"with {n_batches} batches and accum_steps={accum_steps} the last, shorter window is missing: "
                "after the loop, yield what is left if it is not empty"
            )
        if sum(got, []) != batches:
            return "FAIL", f"with {n_batches} batches and accum_steps={accum_steps} your windows do not hold every batch once, in order: {got}"
        return "FAIL", f"with {n_batches} batches and accum_steps={accum_steps} expected windows {expected}, got {got}"
    return "PASS", "windows of accum_steps batches, and a shorter last window when the count does not divide"


def _check_summed_token_loss(candidate: Callable) -> tuple[str, str]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=generator)
    targets = torch.randint(0, 7, (3, 5), generator=generator)
    targets[0, 3:] = IGNORE_INDEX
    targets[2, 1:] = IGNORE_INDEX
    expected_sum, expected_count = summed_token_loss(logits, targets)
    result = candidate(logits, targets)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return "FAIL", "return a pair: (the summed loss tensor, the number of non-padding tokens)"
    loss_sum, count = result
    if int(count) == targets.numel():
        return "FAIL", "the count includes padding: count only targets != IGNORE_INDEX"
    if int(count) != expected_count:
        return "FAIL", f"the count should be the number of non-padding targets, {expected_count}, got {int(count)}"
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1:
        return "FAIL", "the summed loss must be a scalar tensor (so that it can be backpropagated)"
    if torch.allclose(loss_sum, expected_sum / expected_count):
        return "FAIL", "that is the mean over tokens; return the sum (reduction='sum'), so windows can divide by their total"
    if not torch.allclose(loss_sum, expected_sum):
        return "FAIL", f"the summed loss should be {expected_sum.item():.4f}, got {loss_sum.item():.4f}; ignore padding (ignore_index)"
    return "PASS", "the summed loss over real tokens, and their count"


EXERCISES = {
    "accumulation_windows": _check_windows,
    "summed_token_loss": _check_summed_token_loss,
}
