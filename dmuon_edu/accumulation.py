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
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.amp.grad_scaler import OptState
from tqdm.auto import tqdm

from .arguments import describe, require_callable, require_flag, require_iterable

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

    A gradient holding NaN or Inf (an infinite loss, a NaN in the data) never reaches the
    weights: without a ``scaler`` (or with a disabled one), the optimizer step is skipped
    (weights and optimizer state unchanged) with a RuntimeWarning, and the returned loss
    is NaN or Inf; with an enabled one, GradScaler skips it as usual. The scheduler still steps, as it does after a step
    GradScaler skips. (Only this process's dense, non-DTensor gradients are checked: a
    sharded gradient's verdict would differ between ranks; dmuon.Muon decides for all
    ranks itself.)

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
        TypeError: ``model`` or ``loss_fn`` is not callable, ``optimizer`` is not a
            torch.optim.Optimizer, ``scaler`` is not a GradScaler, ``microbatches`` is
            not a list of ``(inputs, targets)`` pairs whose batch size can be read (or
            holds plain lists of numbers), the inputs' dtype is not the model's (found
            when its forward fails), ``max_grad_norm`` is not a number, ``scheduler`` is
            not a torch LRScheduler (or is ReduceLROnPlateau, which needs the loss),
            ``num_items`` is not a number, or the optimizer is a dmuon.Muon and the
            window needs clipping or an item-count correction (both act on p.grad, where
            dmuon.Muon keeps no matrix gradient).
        ValueError: ``microbatches`` or one of them is empty, the model or the data is
            on the meta device, the inputs are on another device than the model (found
            when its forward fails), every parameter of the optimizer is frozen, none
            is the model's, a loss does not require grad, ``max_grad_norm`` is not
            positive, ``scheduler`` was built on another optimizer, ``loss_fn`` returns
            a non-scalar, mixes means and pairs, or counts a fractional or negative
            number of items, or a window of summed losses counts no item.
        RuntimeError: ``scaler`` has already unscaled or stepped this optimizer since
            its last ``update()``.
    """
    require_callable("model", model, "pass the model (an nn.Module) or a function of the inputs")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {describe(optimizer)}; build one on the "
                        "model's parameters, e.g. torch.optim.SGD(model.parameters(), lr=0.1)")
    require_callable("loss_fn", loss_fn, "pass a function such as torch.nn.functional.mse_loss")
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
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {describe(scaler)}; build one with "
                            "torch.amp.GradScaler('cuda'), or leave scaler out")
        _require_fresh_scaler_window(scaler, optimizer)
    _require_trainable(model, optimizer)
    sample_counts = _sample_counts(microbatches)

    optimizer.zero_grad()  # once per window: every backward below must add up
    window = _Window(n_microbatches=len(microbatches), total_samples=sum(sample_counts))
    for index, ((inputs, targets), n_samples) in enumerate(zip(microbatches, sample_counts)):
        scaled_loss = window.add(loss_fn(_forward(model, inputs, index), targets), n_samples, index)
        (scaler.scale(scaled_loss) if scaler is not None else scaled_loss).backward()
    window.correct_gradients(optimizer)

    if scaler is not None:
        scaler.unscale_(optimizer)  # before clipping, so the norm is the true one
    # An enabled GradScaler skips a step whose gradients hold inf or NaN itself; without one, it is done here.
    if (scaler is None or not scaler.is_enabled()) and not _gradients_finite(optimizer):
        warnings.warn(
            f"train_step_with_accumulation skipped this optimizer step: a gradient holds NaN or Inf (the window's "
            f"loss is {window.mean_loss()}). The weights and the optimizer state are unchanged. Look for the cause "
            "(a too-large learning rate, a NaN or Inf in the data, an fp16 overflow)",
            RuntimeWarning, stacklevel=2,
        )
    else:
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

    def add(self, loss_output, n_samples: int, index: int) -> torch.Tensor:
        summed = isinstance(loss_output, (tuple, list))
        if self.summed is not None and summed != self.summed:
            raise ValueError("loss_fn returned a mean for some micro-batches and a (sum, count) pair for others")
        self.summed = summed
        if not summed:
            loss = _differentiable(_scalar(loss_output, "loss_fn must return a scalar mean loss"), index)
            share = n_samples / self.total_samples
            self.loss_total += loss.item() * share
            return loss * share
        if len(loss_output) != 2:
            raise ValueError(f"loss_fn returned a {len(loss_output)}-tuple; return (sum_loss, num_items)")
        loss_sum = _differentiable(_scalar(loss_output[0], "the sum_loss of loss_fn's (sum_loss, num_items)"), index)
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

    Raises:
        TypeError: ``logits`` is not a floating-point tensor, or ``targets`` not an
            integer one.
        ValueError: ``targets`` does not hold one token id per row of ``logits``.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.ndim < 1:
        raise TypeError(f"logits must be a floating-point tensor of shape (..., vocab), got {describe(logits)}")
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex():
        raise TypeError(f"targets must be a tensor of integer token ids, got {describe(targets)}"
                        + (f" of {targets.dtype}; convert with targets.long()" if isinstance(targets, torch.Tensor) else ""))
    if targets.numel() * logits.shape[-1] != logits.numel():
        raise ValueError(f"targets have shape {tuple(targets.shape)} but logits {tuple(logits.shape)}: targets need "
                         "one token id per row of logits, e.g. the shape of logits without its last (vocabulary) "
                         "dimension")
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
        TypeError: ``batches`` is not iterable.
        ValueError: ``accum_steps`` is not an int >= 1.
    """
    require_iterable("batches", batches, "pass a list of micro-batches or a DataLoader")
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
        and :func:`accumulation_windows` do; TypeError too if ``loader`` is not iterable
        or ``progress`` not a bool.
    """
    require_iterable("loader", loader, "pass a DataLoader or a list of (inputs, targets) micro-batches")
    require_flag("progress", progress)
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


def _require_trainable(model: Callable, optimizer: torch.optim.Optimizer) -> None:
    """Refuse, before any backward, an optimizer that cannot train the model: all frozen, or another model's."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if params and not any(p.requires_grad for p in params):
        raise ValueError(
            "every parameter of the optimizer is frozen (requires_grad=False), so backward has nothing to compute: "
            "unfreeze the ones to train (p.requires_grad_(True)), or build the optimizer on those"
        )
    if isinstance(model, nn.Module):
        if any(p.is_meta for p in model.parameters()):
            raise ValueError("the model's parameters are on the meta device, which holds no values: materialise it "
                             "first (model.to_empty(device='cpu'), then initialise its weights)")
        own = {id(p) for p in model.parameters()}
        if own and not any(id(p) in own for p in params):
            raise ValueError("none of the optimizer's parameters is one of the model's, so its step would not train "
                             "the model: build the optimizer on model.parameters()")


def _forward(model: Callable, inputs, index: int):
    """``model(inputs)``; where it fails because the inputs' device or dtype is not the model's, say so."""
    try:
        return model(inputs)
    except RuntimeError as error:
        params = list(model.parameters()) if isinstance(model, nn.Module) else []
        if not isinstance(inputs, torch.Tensor) or not params:
            raise
        devices = {p.device for p in params}
        dtypes = {p.dtype for p in params if p.is_floating_point()}
        if len(devices) == 1 and inputs.device not in devices:
            [device] = devices
            raise ValueError(f"the inputs of microbatch {index} are on {inputs.device} but the model's parameters are "
                             f"on {device}: move them first, e.g. inputs.to('{device}')") from error
        if inputs.is_floating_point() and len(dtypes) == 1 and inputs.dtype not in dtypes:
            [dtype] = dtypes
            raise TypeError(f"the inputs of microbatch {index} are {inputs.dtype} but the model's parameters are "
                            f"{dtype}: convert them (inputs.to({dtype})), or keep the model in float32 and compute "
                            "in lower precision under torch.autocast") from error
        raise


def _gradients_finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient this process steps with is finite (one host sync).

    Dense plain tensors only: a DTensor shard's verdict would differ between ranks, and a
    step skipped on some ranks only would leave the shards out of step (dmuon.Muon decides
    for every rank itself). min and max are finite exactly when every entry is.
    """
    grads = [p.grad for p in _parameters_with_grad(optimizer)
             if type(p.grad) is torch.Tensor and p.grad.layout == torch.strided and p.grad.numel() > 0]
    extremes = [torch.stack(torch.aminmax(g)).float() for g in grads]
    return not extremes or bool(torch.cat(extremes).isfinite().all())


def _differentiable(loss: torch.Tensor, index: int) -> torch.Tensor:
    if not loss.requires_grad:
        cause = ("train_step_with_accumulation runs under torch.no_grad(): call it outside" if not torch.is_grad_enabled()
                 else "does loss_fn or the model cut it off from the parameters (.detach(), .item(), torch.no_grad(), "
                      "a new tensor built from numbers)? Compute the loss from the predictions with tensor operations")
        raise ValueError(f"the loss of microbatch {index} does not require grad, so backward cannot reach the "
                         f"parameters; {cause}")
    return loss


def _item_count(num_items) -> int:
    """The ``num_items`` of a ``(sum_loss, num_items)`` pair as an int >= 0: a whole number, maybe a tensor."""
    value = num_items.item() if isinstance(num_items, torch.Tensor) and num_items.numel() == 1 else num_items
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"num_items must be a number (an int or a one-element tensor), got {describe(num_items)}; "
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
                f"microbatch {index} must be an (inputs, targets) pair, got {describe(microbatch)}; "
                "build the list as [(x0, y0), (x1, y1), ...]"
            )
        # The inputs count the samples: targets may broadcast (one row for the whole batch).
        inputs, targets = microbatch
        for name, value in (("inputs", inputs), ("targets", targets)):
            if _numbers_only(value):
                what = f"{describe(value)} of numbers" if isinstance(value, (list, tuple)) else f"the number {value!r}"
                raise TypeError(f"the {name} of microbatch {index} are {what}, not a tensor: "
                                f"pass torch.tensor({name}) (on the model's device)")
            # A numpy (or other) array would reach the loss, whose torch code fails on it with words such as
            # "'int' object is not callable" (an array's size is an int, a tensor's a method).
            if hasattr(value, "__array__") and not isinstance(value, torch.Tensor):
                kind = f"{type(value).__module__}.{type(value).__name__}"
                raise TypeError(f"the {name} of microbatch {index} are a {kind} of shape {tuple(value.shape)}, not a "
                                f"tensor: pass torch.as_tensor({name}) (on the model's device)")
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise ValueError(f"the {name} of microbatch {index} are on the meta device, which holds no values: "
                                 "pass real tensors")
        batched, name = (inputs, "inputs") if isinstance(inputs, torch.Tensor) else (targets, "targets")
        if not isinstance(batched, torch.Tensor) or batched.dim() == 0:
            raise TypeError(
                f"the {name} of microbatch {index} must be a tensor with a batch dimension, "
                f"got {describe(batched)}; its first dimension counts the samples"
            )
        if batched.shape[0] == 0:
            raise ValueError(f"microbatch {index} is empty: drop it, or give it at least one sample")
        counts.append(batched.shape[0])
    return counts


def _numbers_only(value: object) -> bool:
    """Whether ``value`` is a (nested) list or tuple of plain numbers: data that should be a tensor."""
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and all(map(_numbers_only, value))
    return isinstance(value, numbers.Number)
