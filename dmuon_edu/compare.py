"""Comparing two runs parameter by parameter: the measure of every equivalence between two training runs."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

__all__ = ["max_parameter_difference"]


def max_parameter_difference(
    a: torch.nn.Module | Iterable[torch.Tensor], b: torch.nn.Module | Iterable[torch.Tensor]
) -> float:
    r"""Largest absolute difference between corresponding parameters of two models.

    .. math::  \max_k \max_{ij} |a_{k,ij} - b_{k,ij}|

    computed in float32, on ``a``'s device.

    Args:
        a, b: two nn.Modules (their ``parameters()``, in order), two state_dicts
            (matched by key), or two sequences of tensors (matched by position).

    Returns:
        The largest difference, as a float (0.0 for identical runs); ``inf`` where
        either side holds a NaN or an infinity: a run that diverged never compares
        as equal, nor drops out of a ``max`` over steps.

    Raises:
        TypeError: a single tensor, or something that holds non-tensors, was passed.
        ValueError: the state_dicts' keys differ, or the two sides hold different
            numbers or shapes of tensors.
    """
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if a.keys() != b.keys():
            raise ValueError(f"the state_dicts differ in their keys: {sorted(a.keys() ^ b.keys())[:5]}")
        b = {key: b[key] for key in a}
    tensors_a, tensors_b = _tensors(a), _tensors(b)
    if len(tensors_a) != len(tensors_b):
        raise ValueError(f"cannot compare {len(tensors_a)} parameters with {len(tensors_b)}: build both models the same way")
    largest = 0.0
    for index, (x, y) in enumerate(zip(tensors_a, tensors_b)):
        if x.shape != y.shape:
            raise ValueError(f"parameter {index} has shape {tuple(x.shape)} in one model and {tuple(y.shape)} in the other")
        difference = (x.detach().float() - y.detach().float().to(x.device)).abs().max().item()
        if math.isnan(difference):  # NaN - anything, or inf - inf
            return math.inf
        largest = max(largest, difference)
    return largest


def _tensors(model_or_tensors) -> list[torch.Tensor]:
    if isinstance(model_or_tensors, torch.nn.Module):
        return list(model_or_tensors.parameters())
    if isinstance(model_or_tensors, torch.Tensor):
        raise TypeError("pass a model or a list of tensors, not a single tensor")
    tensors = list(model_or_tensors.values() if isinstance(model_or_tensors, Mapping) else model_or_tensors)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("pass a model, a state_dict or a list of tensors")
    return tensors
