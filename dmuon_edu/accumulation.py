"""Loss-scaled gradient accumulation on one device.

``loss.backward()`` *adds* into ``p.grad``. Gradient accumulation uses that:
run forward and backward on several micro-batches, then step once. For the
step to equal one full-batch step, the gradient left in ``p.grad`` must be the
gradient of the full-batch mean loss::

    L_full = sum_i n_i * L_i / sum_i n_i          (L_i: micro-batch i's mean loss)
    grad L_full = sum_i (n_i / n) * grad L_i       (n = sum_i n_i)

so micro-batch ``i``'s loss is scaled by its share ``n_i / n`` of the window's
samples before its backward. With equal micro-batches that share is the
familiar ``1 / N``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["train_step_with_accumulation"]

Microbatch = tuple[object, torch.Tensor]


def train_step_with_accumulation(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    microbatches: Sequence[Microbatch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> float:
    """One optimizer step accumulated over ``microbatches``.

    ``microbatches`` is a list of ``(inputs, targets)`` pairs; ``targets`` is a
    tensor whose first dimension counts the micro-batch's samples. ``loss_fn``
    returns the micro-batch's *mean* loss. Each loss is scaled by the
    micro-batch's share of the window's samples, so the update equals one
    step on the concatenated batch, also when the micro-batches differ in
    size.

    Returns the window's mean loss (the full-batch mean), as a float.
    """
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable, got {type(loss_fn).__name__}; "
            "pass a function such as torch.nn.functional.mse_loss"
        )
    sample_counts = _sample_counts(microbatches)
    total_samples = sum(sample_counts)

    optimizer.zero_grad()  # once per window: every backward below must add up
    window_loss = 0.0
    for (inputs, targets), n_samples in zip(microbatches, sample_counts):
        loss = loss_fn(model(inputs), targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return a scalar mean loss, got {shape}; "
                "use reduction='mean' (or call .mean() on the per-sample losses)"
            )
        share = n_samples / total_samples
        (loss * share).backward()
        window_loss += loss.item() * share  # the unscaled loss, weighted for logging
    optimizer.step()
    return window_loss


def _sample_counts(microbatches: Sequence[Microbatch]) -> list[int]:
    if isinstance(microbatches, (torch.Tensor, str, bytes)) or not isinstance(microbatches, Sequence):
        raise TypeError(
            f"microbatches must be a list of (inputs, targets) pairs, got {type(microbatches).__name__}"
        )
    if len(microbatches) == 0:
        raise ValueError("microbatches is empty: pass at least one (inputs, targets) pair")
    counts = []
    for index, microbatch in enumerate(microbatches):
        if not isinstance(microbatch, (tuple, list)) or len(microbatch) != 2:
            raise TypeError(
                f"microbatch {index} must be an (inputs, targets) pair, got {_describe(microbatch)}; "
                "build the list as [(x0, y0), (x1, y1), ...]"
            )
        targets = microbatch[1]
        if not isinstance(targets, torch.Tensor) or targets.dim() == 0:
            raise TypeError(
                f"the targets of microbatch {index} must be a tensor with a batch dimension, "
                f"got {_describe(targets)}"
            )
        if targets.shape[0] == 0:
            raise ValueError(f"microbatch {index} is empty: drop it, or give it at least one sample")
        counts.append(targets.shape[0])
    return counts


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"a {type(value).__name__}"
