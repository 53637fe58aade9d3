"""The GradScaler mistakes of an accumulation loop, written out so that they can be run.

Each function takes one window of equal micro-batches with the arguments
``(model, optimizer, microbatches, loss_fn, scaler, max_grad_norm)`` and makes
exactly one mistake of the AMP recipe that
:func:`dmuon_edu.accumulation.train_step_with_accumulation` follows (one loss
scale through the window, ``unscale_`` once after the last backward and before
clipping, ``scaler.step`` and ``scaler.update`` once). Module 3 runs them next to
the right loop to show what each mistake does.
"""

from __future__ import annotations

import torch

__all__ = ["clip_before_unscale", "unscale_every_microbatch", "update_every_microbatch", "step_without_scaler"]


def clip_before_unscale(model, optimizer, microbatches, loss_fn, scaler, max_grad_norm) -> None:
    """Clips while the gradients still carry the loss scale s; ``scaler.step`` unscales afterwards.

    The clip sees a norm of s * ||g||, so whenever that passes ``max_grad_norm``
    the step applies max_grad_norm / (s * ||g||) of the right update.
    """
    _scaled_backward(model, optimizer, microbatches, loss_fn, scaler)
    torch.nn.utils.clip_grad_norm_(_parameters(optimizer), max_grad_norm)
    scaler.step(optimizer)
    scaler.update()


def unscale_every_microbatch(model, optimizer, microbatches, loss_fn, scaler, max_grad_norm) -> None:
    """Unscales and clips after every backward, as if each micro-batch were a step.

    GradScaler allows one ``unscale_`` per optimizer between two ``update()``
    calls: the second micro-batch raises RuntimeError.
    """
    optimizer.zero_grad()
    for inputs, targets in microbatches:
        scaler.scale(loss_fn(model(inputs), targets) / len(microbatches)).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(_parameters(optimizer), max_grad_norm)
    scaler.step(optimizer)
    scaler.update()


def update_every_microbatch(model, optimizer, microbatches, loss_fn, scaler, max_grad_norm) -> None:
    """Calls ``scaler.update()`` after every backward and steps once at the end.

    ``update()`` adjusts the scale from the inf checks of a step; before any
    step there is none, and the first call raises AssertionError.
    """
    optimizer.zero_grad()
    for inputs, targets in microbatches:
        scaler.scale(loss_fn(model(inputs), targets) / len(microbatches)).backward()
        scaler.update()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(_parameters(optimizer), max_grad_norm)
    scaler.step(optimizer)


def step_without_scaler(model, optimizer, microbatches, loss_fn, scaler, max_grad_norm) -> None:
    """Unscales and clips once, then calls ``optimizer.step()`` instead of ``scaler.step(optimizer)``.

    Only ``scaler.step`` skips a window whose gradients overflowed: this loop
    applies the inf and NaN to the weights.
    """
    _scaled_backward(model, optimizer, microbatches, loss_fn, scaler)
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(_parameters(optimizer), max_grad_norm)
    optimizer.step()
    scaler.update()


def _scaled_backward(model, optimizer, microbatches, loss_fn, scaler) -> None:
    optimizer.zero_grad()
    for inputs, targets in microbatches:
        scaler.scale(loss_fn(model(inputs), targets) / len(microbatches)).backward()


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
