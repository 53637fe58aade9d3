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

Language models average over *tokens*, and micro-batches of padded sequences
hold very different numbers of them. There the loss function returns
``(sum_loss, num_items)`` and the window's loss is ``sum_i S_i / sum_i c_i``.

In a real loop the rest follows from "one window = one optimizer step":
clip once after the last backward, step the scheduler once, and with AMP keep
one loss scale through the window and unscale once.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch.amp.grad_scaler import OptState
from tqdm.auto import tqdm

__all__ = ["train_step_with_accumulation", "accumulation_windows", "train", "summed_token_loss", "IGNORE_INDEX"]

Microbatch = tuple[object, torch.Tensor]
IGNORE_INDEX = -100  # the label of padding, as in torch.nn.functional.cross_entropy


def train_step_with_accumulation(
    model: Callable,
    optimizer: torch.optim.Optimizer,
    microbatches: Sequence[Microbatch],
    loss_fn: Callable,
    *,
    max_grad_norm: float | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    r"""One optimizer step accumulated over ``microbatches``; returns the window's mean loss.

    Runs forward and backward on each micro-batch, with its loss scaled so that the
    gradients add up to the gradient of the whole window's mean loss, then steps once.
    The update therefore equals one step on the concatenated batch:

    .. math::

        \nabla L = \sum_i \frac{n_i}{\sum_j n_j} \nabla L_i \quad\text{(mean losses)},
        \qquad
        \nabla L = \frac{\sum_i \nabla S_i}{\sum_j c_j} \quad\text{(summed losses)}

    where :math:`L_i` is micro-batch i's mean loss over its :math:`n_i` samples, and
    :math:`S_i` its summed loss over :math:`c_i` items.

    Args:
        model: anything that maps ``inputs`` to predictions (an nn.Module, or a function
            that wraps one, e.g. to add autocast).
        optimizer: the optimizer to step. Its gradients are zeroed first.
        microbatches: a list of ``(inputs, targets)`` pairs; the first dimension of
            ``inputs`` counts the micro-batch's samples (so targets may broadcast), or
            that of ``targets`` when ``inputs`` is not a tensor (a dict for a wrapped
            model, say).
        loss_fn: ``loss_fn(predictions, targets)`` returning either a scalar *mean* loss
            (each micro-batch is weighted by its share of the window's samples), or a
            pair ``(sum_loss, num_items)``, e.g. summed over non-padding tokens (see
            :func:`summed_token_loss`), in which case the window's loss is the total sum
            over the total count.
        max_grad_norm: if given, clip the window's gradient to this 2-norm once, after
            the last backward (and after unscaling, with a scaler).
        scheduler: if given, stepped once, after the optimizer step; it must have been
            built on ``optimizer``.
        scaler: an AMP ``torch.amp.GradScaler``: one loss scale for the whole window,
            ``unscale_`` once, then ``scaler.step`` and ``scaler.update`` once.

    Returns:
        The window's mean loss as a float: sample-weighted for mean losses, total sum
        over total count for summed losses.

    Raises:
        TypeError: ``loss_fn`` is not callable, ``microbatches`` is not a list of
            ``(inputs, targets)`` pairs whose batch size can be read, ``max_grad_norm``
            is not a number, ``scheduler`` is not a torch LRScheduler (or is
            ReduceLROnPlateau, which needs the loss), ``num_items`` is not a number, or
            the optimizer is a dmuon.Muon and the window needs clipping or an
            item-count correction (both act on p.grad, where dmuon.Muon keeps no matrix
            gradient).
        ValueError: ``microbatches`` or one of them is empty, ``max_grad_norm`` is not
            positive, ``scheduler`` was built on another optimizer, ``loss_fn`` returns
            a non-scalar, mixes means and pairs, or counts a fractional or negative
            number of items, or a window of summed losses counts no item.
        RuntimeError: ``scaler`` has already unscaled or stepped this optimizer since
            its last ``update()``.
    """
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable, got {type(loss_fn).__name__}; "
            "pass a function such as torch.nn.functional.mse_loss"
        )
    require_max_grad_norm(max_grad_norm)
    if max_grad_norm is not None and _gradients_outside_grad(optimizer):
        raise TypeError(
            "train_step_with_accumulation clips what p.grad holds, but dmuon.Muon keeps each matrix's gradient "
            "on its owner: clip with dmuon.clip_grad_norm_(model, max_norm) after the window's last backward, "
            "in the loop of dmuon's accumulation guide (micro-batches inside dmuon.no_sync, then step)"
        )
    if scheduler is not None:
        _require_scheduler_of(optimizer, scheduler)
    if scaler is not None:
        _require_fresh_scaler_window(scaler, optimizer)
    sample_counts = _sample_counts(microbatches)

    optimizer.zero_grad()  # once per window: every backward below must add up
    window = _Window(n_microbatches=len(microbatches), total_samples=sum(sample_counts))
    for (inputs, targets), n_samples in zip(microbatches, sample_counts):
        scaled_loss = window.add(loss_fn(model(inputs), targets), n_samples)
        (scaler.scale(scaled_loss) if scaler is not None else scaled_loss).backward()
    window.correct_gradients(optimizer)

    if scaler is not None:
        scaler.unscale_(optimizer)  # before clipping, so the norm is the true one
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(_parameters_with_grad(optimizer), max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)  # skips the step if unscale_ found inf/NaN
        scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return window.mean_loss()


class _Window:
    """Weights and bookkeeping for one accumulation window.

    Mean losses: the sample counts are known before any forward, so each loss
    is scaled by its exact share before its backward. Summed losses: the total
    item count is known only after the last forward, so each sum is divided by
    a provisional total (first count x N, exact when micro-batches hold equal
    counts) and the gradients are rescaled once at the end.
    """

    def __init__(self, n_microbatches: int, total_samples: int):
        self.n_microbatches, self.total_samples = n_microbatches, total_samples
        self.summed: bool | None = None
        self.loss_total = 0.0
        self.item_total = 0
        self.provisional_total: int | None = None

    def add(self, loss_output, n_samples: int) -> torch.Tensor:
        summed = isinstance(loss_output, (tuple, list))
        if self.summed is not None and summed != self.summed:
            raise ValueError("loss_fn returned a mean for some micro-batches and a (sum, count) pair for others")
        self.summed = summed
        if not summed:
            loss = _scalar(loss_output, "loss_fn must return a scalar mean loss")
            share = n_samples / self.total_samples
            self.loss_total += loss.item() * share
            return loss * share
        if len(loss_output) != 2:
            raise ValueError(f"loss_fn returned a {len(loss_output)}-tuple; return (sum_loss, num_items)")
        loss_sum = _scalar(loss_output[0], "the sum_loss of loss_fn's (sum_loss, num_items)")
        count = _item_count(loss_output[1])
        if self.provisional_total is None:
            self.provisional_total = max(count, 1) * self.n_microbatches
        self.loss_total += loss_sum.item()
        self.item_total += count
        return loss_sum / self.provisional_total

    def correct_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.summed:
            return
        if self.item_total == 0:
            raise ValueError(
                "the window holds no items: loss_fn counted 0 for every micro-batch "
                "(are all targets padding?); skip such windows"
            )
        if self.item_total != self.provisional_total:
            if _gradients_outside_grad(optimizer):
                raise TypeError(
                    "the micro-batches hold different numbers of items, so their gradients need a correction "
                    "that train_step_with_accumulation applies to p.grad, and dmuon.Muon keeps each matrix's "
                    "gradient on its owner: with dmuon, divide each summed loss by the window's item count "
                    "yourself, in the loop of dmuon's accumulation guide"
                )
            correction = self.provisional_total / self.item_total
            for p in _parameters_with_grad(optimizer):
                p.grad.mul_(correction)

    def mean_loss(self) -> float:
        return self.loss_total / self.item_total if self.summed else self.loss_total


def summed_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cross-entropy summed over the non-padding tokens, and their count.

    Pass it as ``loss_fn`` to :func:`train_step_with_accumulation` to weight every token
    of a window equally, whatever the number of tokens per micro-batch.

    Args:
        logits: predictions of shape (..., vocab).
        targets: token ids of shape (...), with padding marked ``IGNORE_INDEX`` (-100).

    Returns:
        ``(sum_loss, num_items)``: the summed cross-entropy (a scalar tensor) and the
        number of non-padding targets (an int).
    """
    loss_sum = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, int((targets != IGNORE_INDEX).sum())


def accumulation_windows(batches: Iterable, accum_steps: int) -> Iterator[list]:
    """Group ``batches`` into lists of ``accum_steps``; the last list may be shorter.

    A short last window is kept, not dropped: with the weighting of
    :func:`train_step_with_accumulation` it gets its full weight.

    Args:
        batches: any iterable of micro-batches (a DataLoader, a list, a generator).
        accum_steps: micro-batches per optimizer step, an int >= 1.

    Returns:
        An iterator of lists of micro-batches, lazily: ``batches`` is read as it goes.

    Raises:
        ValueError: ``accum_steps`` is not an int >= 1.
    """
    require_accum_steps(accum_steps)
    return _windows(iter(batches), accum_steps)


def require_accum_steps(accum_steps) -> None:
    """Raise ValueError unless ``accum_steps`` (micro-batches per optimizer step) is an int >= 1."""
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an int >= 1 (micro-batches per optimizer step), got {accum_steps!r}")


def require_max_grad_norm(max_grad_norm) -> None:
    """Raise TypeError or ValueError unless ``max_grad_norm`` is a positive number or None (no clipping)."""
    if max_grad_norm is None:
        return
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
        raise TypeError(
            f"max_grad_norm must be a number (or None for no clipping), got {type(max_grad_norm).__name__}; "
            "1.0 is a usual value"
        )
    if not max_grad_norm > 0:  # 0 would zero every gradient; NaN fails the comparison too
        raise ValueError(f"max_grad_norm must be positive (or None for no clipping), got {max_grad_norm}; "
                         "1.0 is a usual value")


def _windows(batches: Iterator, accum_steps: int) -> Iterator[list]:
    window = []
    for batch in batches:
        window.append(batch)
        if len(window) == accum_steps:
            yield window
            window = []
    if window:
        yield window


def train(
    model: Callable,
    optimizer: torch.optim.Optimizer,
    loader: Iterable,
    loss_fn: Callable,
    accum_steps: int,
    *,
    max_grad_norm: float | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    scaler: torch.amp.GradScaler | None = None,
    progress: bool = True,
) -> list[float]:
    """One pass over ``loader``, ``accum_steps`` batches per optimizer step.

    Each window goes through :func:`train_step_with_accumulation`; the last window may
    be short and still counts fully.

    Args:
        model, optimizer, loss_fn, max_grad_norm, scheduler, scaler: as in
            :func:`train_step_with_accumulation`.
        loader: an iterable of ``(inputs, targets)`` micro-batches.
        accum_steps: micro-batches per optimizer step, an int >= 1.
        progress: show a tqdm bar (a widget in Jupyter, text in a terminal).

    Returns:
        Each optimizer step's mean loss, in order.

    Raises:
        ValueError, TypeError, RuntimeError: as :func:`train_step_with_accumulation`
        and :func:`accumulation_windows` do.
    """
    windows = accumulation_windows(loader, accum_steps)
    total = math.ceil(len(loader) / accum_steps) if hasattr(loader, "__len__") else None
    losses = []
    with tqdm(windows, total=total, desc="optimizer steps", disable=not progress) as bar:
        for window in bar:
            losses.append(
                train_step_with_accumulation(
                    model, optimizer, window, loss_fn, max_grad_norm=max_grad_norm, scheduler=scheduler, scaler=scaler
                )
            )
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def _require_fresh_scaler_window(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    # GradScaler tracks, per optimizer, whether unscale_/step already ran since
    # the last update() (private state; torch has no public query). A window
    # that starts in that state would unscale twice or reuse a stale scale.
    stage = scaler._per_optimizer_states[id(optimizer)]["stage"] if scaler.is_enabled() else OptState.READY
    if stage is not OptState.READY:
        raise RuntimeError(
            "the GradScaler already unscaled or stepped this optimizer inside the current window "
            "(scaler.update() has not run since): let train_step_with_accumulation do unscale_, step "
            "and update, once per window"
        )


def _require_scheduler_of(optimizer: torch.optim.Optimizer, scheduler) -> None:
    # Checked before any backward: a scheduler that fails at its step() would do so
    # after the weights had moved.
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            f"scheduler must be a torch.optim.lr_scheduler.LRScheduler, got {type(scheduler).__name__}; "
            "build one on the optimizer, e.g. LambdaLR(optimizer, lambda step: ...)"
        )
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError(
            "ReduceLROnPlateau steps on a metric, which train_step_with_accumulation cannot know: leave scheduler "
            "out and call scheduler.step(loss) yourself with the loss it returns"
        )
    if scheduler.optimizer is not optimizer:
        raise ValueError(
            f"the scheduler was built on another optimizer ({type(scheduler.optimizer).__name__}), so stepping it "
            "would change that one's learning rate, not this one's: build the scheduler on the optimizer you pass"
        )


def _item_count(num_items) -> int:
    """The ``num_items`` of a ``(sum_loss, num_items)`` pair as an int >= 0: a whole number, maybe a tensor."""
    value = num_items.item() if isinstance(num_items, torch.Tensor) and num_items.numel() == 1 else num_items
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"num_items must be a number (an int or a one-element tensor), got {_describe(num_items)}; "
            "return (sum_loss, number of items summed)"
        )
    if not float(value).is_integer() or value < 0:
        raise ValueError(
            f"num_items must be a whole number >= 0, got {value}: it counts the items sum_loss adds up, "
            "e.g. int((targets != IGNORE_INDEX).sum()); to weight items, weight the sum, not the count"
        )
    return int(value)


def _gradients_outside_grad(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer is a dmuon.Muon, whose matrices' gradients are not in p.grad (duck-typed:
    this module sits below dmuon)."""
    return getattr(optimizer, "_dmuon", None) is not None


def _parameters_with_grad(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _scalar(value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{what}, got {shape}; use reduction='mean' (or .mean()) for a mean loss, "
            "or return (loss.sum(), count) to weight by items"
        )
    return value


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
        # The inputs count the samples: targets may broadcast (one row for the whole batch).
        inputs, targets = microbatch
        batched, name = (inputs, "inputs") if isinstance(inputs, torch.Tensor) else (targets, "targets")
        if not isinstance(batched, torch.Tensor) or batched.dim() == 0:
            raise TypeError(
                f"the {name} of microbatch {index} must be a tensor with a batch dimension, "
                f"got {_describe(batched)}; its first dimension counts the samples"
            )
        if batched.shape[0] == 0:
            raise ValueError(f"microbatch {index} is empty: drop it, or give it at least one sample")
        counts.append(batched.shape[0])
    return counts


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"a {type(value).__name__}"
