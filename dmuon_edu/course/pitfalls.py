"""The classic gradient-accumulation bugs, written out so that they can be run.

Each window-level function has the signature of
:func:`dmuon_edu.accumulation.train_step_with_accumulation`; each epoch-level
one (``*_leftover_window``) runs a whole list of batches with ``accum_steps``.
Each makes exactly one mistake. The course runs them to show what each mistake does to the
update, and :mod:`dmuon_edu.course.checks` runs them to recognise a learner's mistake
by its effect. :func:`step_gradient_norms` is what a training log that records
the gradient norm at every step would show for any of them.

:class:`GradOverwritingMuon` is a Muon that writes its Nesterov blend into
``p.grad``, as Keller Jordan's does: with it, a misplaced ``zero_grad`` leaks
the blend, not the raw gradient, into the next window.

:func:`effective_lr_multiplier` measures the most surprising effect of the
unscaled loss: an N-times learning rate for SGD, almost nothing for AdamW and
Muon. :func:`relative_decay_strength` measures what it does to weight decay,
and :func:`training_curve` shows it over a short run.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dmuon_edu.accumulation import require_accum_steps, require_max_grad_norm, train_step_with_accumulation
from dmuon_edu.arguments import require_flag, require_int, require_real
from dmuon_edu.muon import ADJUST_LR_FNS, Muon, check_hyperparameters
from dmuon_edu.newton_schulz import newton_schulz
from dmuon_edu.course.threads import one_thread

__all__ = [
    "unscaled_loss",
    "scale_after_backward",
    "zero_grad_inside_loop",
    "never_zero_grad",
    "zero_grad_between_backward_and_step",
    "step_every_microbatch",
    "mean_of_microbatch_means",
    "drop_leftover_window",
    "underweight_leftover_window",
    "GradOverwritingMuon",
    "colleague_muon_step",
    "step_gradient_norms",
    "OPTIMIZERS",
    "make_optimizer",
    "require_optimizer_name",
    "effective_lr_multiplier",
    "relative_decay_strength",
    "training_curve",
]


def unscaled_loss(model, optimizer, microbatches, loss_fn) -> float:
    """Forgets the 1/N: the accumulated gradient is N times the full-batch one.

    For plain SGD that is an N-times learning rate.
    """
    optimizer.zero_grad()
    losses = []
    for inputs, targets in microbatches:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        losses.append(loss.item())
    optimizer.step()
    return sum(losses) / len(losses)


def scale_after_backward(model, optimizer, microbatches, loss_fn) -> float:
    """Divides each loss by N *after* its backward: too late, the gradient is already in ``.grad``.

    The update is the one of :func:`unscaled_loss`; only the logged loss looks right.
    """
    n = len(microbatches)
    optimizer.zero_grad()
    losses = []
    for inputs, targets in microbatches:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        loss = loss / n
        losses.append(loss.item() * n)
    optimizer.step()
    return sum(losses) / n


def zero_grad_inside_loop(model, optimizer, microbatches, loss_fn) -> float:
    """Clears ``.grad`` before every micro-batch: only the last one survives."""
    n = len(microbatches)
    losses = []
    for inputs, targets in microbatches:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets) / n
        loss.backward()
        losses.append(loss.item() * n)
    optimizer.step()
    return sum(losses) / n


def never_zero_grad(model, optimizer, microbatches, loss_fn) -> float:
    """Never clears ``.grad``: every window also applies all earlier windows' gradients.

    With :class:`GradOverwritingMuon` what leaks is the Nesterov blend that its
    step wrote into ``.grad``: momentum gets counted twice.
    """
    n = len(microbatches)
    losses = []
    for inputs, targets in microbatches:
        loss = loss_fn(model(inputs), targets) / n
        loss.backward()
        losses.append(loss.item() * n)
    optimizer.step()
    return sum(losses) / n


def zero_grad_between_backward_and_step(model, optimizer, microbatches, loss_fn) -> float:
    """Clears ``.grad`` after the last backward, just before the step: the step sees no gradient.

    With the default ``zero_grad(set_to_none=True)`` every optimizer skips the
    parameters, so nothing moves and the loss curve is flat.
    """
    n = len(microbatches)
    losses = []
    for inputs, targets in microbatches:
        loss = loss_fn(model(inputs), targets) / n
        loss.backward()
        losses.append(loss.item() * n)
    optimizer.zero_grad()
    optimizer.step()
    return sum(losses) / n


def step_every_microbatch(model, optimizer, microbatches, loss_fn) -> float:
    """Steps after every micro-batch: N small steps instead of one accumulated step.

    ``.grad`` is cleared only once, so step k sees the first k micro-batches'
    gradients; with :class:`GradOverwritingMuon` it sees the previous step's
    blend plus one new micro-batch.
    """
    n = len(microbatches)
    optimizer.zero_grad()
    losses = []
    for inputs, targets in microbatches:
        loss = loss_fn(model(inputs), targets) / n
        loss.backward()
        optimizer.step()
        losses.append(loss.item() * n)
    return sum(losses) / n


def mean_of_microbatch_means(model, optimizer, microbatches, loss_fn) -> float:
    """Scales every loss by 1/N whatever its size (the textbook loop).

    Right for equal micro-batches. With unequal ones it gives each sample of a
    small micro-batch more weight than a sample of a large one, so the update
    is not the full-batch update.
    """
    n = len(microbatches)
    optimizer.zero_grad()
    losses = []
    for inputs, targets in microbatches:
        loss = loss_fn(model(inputs), targets) / n
        loss.backward()
        losses.append(loss.item() * n)
    optimizer.step()
    return sum(losses) / n


def drop_leftover_window(model, optimizer, batches, loss_fn, accum_steps) -> None:
    """Steps only when ``(i + 1) % accum_steps == 0``: a last window of r < N batches is never applied.

    Its gradient stays in ``.grad`` and leaks into whatever runs next.
    """
    optimizer.zero_grad()
    for i, (inputs, targets) in enumerate(batches):
        (loss_fn(model(inputs), targets) / accum_steps).backward()
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()


def underweight_leftover_window(model, optimizer, batches, loss_fn, accum_steps) -> None:
    """Steps on the last window too, but divides every loss by the configured ``accum_steps``.

    A last window of r < N batches is applied with weight r/N instead of 1:
    what Accelerate and Lightning do.
    """
    optimizer.zero_grad()
    in_window = 0
    for inputs, targets in batches:
        (loss_fn(model(inputs), targets) / accum_steps).backward()
        in_window += 1
        if in_window == accum_steps:
            optimizer.step()
            optimizer.zero_grad()
            in_window = 0
    if in_window:  # the last window, short
        optimizer.step()
        optimizer.zero_grad()


def step_gradient_norms(step_fn: Callable, model, optimizer, windows, loss_fn) -> list[float]:
    """The gradient norm each ``optimizer.step()`` call sees while ``step_fn`` runs ``windows``: what a training log records.

    A parameter whose ``.grad`` is None (after ``zero_grad``) counts as a zero gradient.
    """
    norms = []

    def log_norm(*_):
        norms.append(math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters() if p.grad is not None)))

    handle = optimizer.register_step_pre_hook(log_norm)
    try:
        for window in windows:
            step_fn(model, optimizer, window, loss_fn)
    finally:
        handle.remove()
    return norms


# --- a Muon that overwrites p.grad --------------------------------------------------------


class GradOverwritingMuon(torch.optim.Optimizer):
    """Muon as Keller Jordan publishes it: the Nesterov blend is written into ``p.grad``.

    Per 2-D parameter, with gradient G and momentum buffer B (an EMA)::

        B <- lerp(B, G, 1 - momentum)
        G <- lerp(G, B, momentum)        # in place: p.grad now holds the blend
        W <- W - lr * sqrt(max(1, m/n)) * NS5(G)

    Its updates equal :class:`dmuon_edu.muon.Muon`'s (NS5 removes the EMA's
    constant factor) as long as ``.grad`` is cleared before every window. A
    loop that does not clear it accumulates the next window onto the blend.
    """

    def __init__(self, params, lr: float, momentum: float = 0.95, ns_steps: int = 5, ns_dtype="auto"):
        check_hyperparameters(dict(lr=lr, momentum=momentum, nesterov=True, weight_decay=0.0,
                                    adjust_lr_fn="original", ns_steps=ns_steps, ns_dtype=ns_dtype))
        super().__init__(params, dict(lr=lr, momentum=momentum, ns_steps=ns_steps, ns_dtype=ns_dtype))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, got shape {tuple(p.shape)}; give it to AdamW")

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buffer.lerp_(p.grad, 1 - mu)
                blend = p.grad.lerp_(buffer, mu)
                update = newton_schulz(blend, steps=group["ns_steps"], dtype=group["ns_dtype"])
                p.add_(update.to(p.dtype), alpha=-group["lr"] * ADJUST_LR_FNS["original"](*p.shape))


def colleague_muon_step(W, G, B, lr, momentum=0.95, nesterov=True):
    """A colleague's Muon step for one matrix, said to match dmuon_edu.Muon: module 4b's exercise finds its two mistakes."""
    B = momentum * B + G
    U = B + momentum * G if nesterov else B
    O = newton_schulz(U, dtype=torch.float32)
    m, n = W.shape
    return W - lr * max(1.0, n / m) ** 0.5 * O, B


# --- what an unscaled loss does to the learning rate ------------------------------------------

OPTIMIZERS = ("sgd", "momentum", "adamw", "muon")

# A learning rate at which each optimizer trains the small problem below well.
DEFAULT_LR = {"sgd": 0.1, "momentum": 0.05, "adamw": 0.01, "muon": 0.02}

MICROBATCH_SIZE = 4
IN_FEATURES, HIDDEN, OUT_FEATURES = 16, 32, 4


def make_optimizer(name: str, params, **hyper) -> torch.optim.Optimizer:
    """The optimizer called ``name`` (one of :data:`OPTIMIZERS`) over ``params``.

    "momentum" is SGD with momentum 0.9, "muon" is :class:`dmuon_edu.muon.Muon`
    (2-D parameters only). ``hyper`` goes to the constructor; ``lr`` defaults
    to :data:`DEFAULT_LR`.
    """
    require_optimizer_name(name)
    hyper = {"lr": DEFAULT_LR[name], **hyper}
    constructor, fixed = {
        "sgd": (torch.optim.SGD, {}),
        "momentum": (torch.optim.SGD, {"momentum": 0.9}),
        "adamw": (torch.optim.AdamW, {}),
        "muon": (Muon, {}),
    }[name]
    try:
        return constructor(params, **{**fixed, **hyper})
    except TypeError as error:
        raise TypeError(f"{name!r} does not take the hyperparameters {sorted(hyper)}: {error}") from None


def effective_lr_multiplier(
    optimizer: str, accum_steps: int, *, scale_loss: bool = False, max_grad_norm: float | None = None, **hyper
) -> float:
    """How much larger the first update is under the given loss handling than the correct one.

    A seeded two-layer network (bias-free, so that Muon can take every
    parameter) takes one step from a fixed start, accumulated over
    ``accum_steps`` micro-batches of :data:`MICROBATCH_SIZE` samples, with each
    loss divided by N (``scale_loss=True``) or not. The result is
    ``||update|| / ||full-batch update||``; the full-batch update is what correct
    1/N scaling reproduces. Unscaled, SGD and momentum give N and AdamW and Muon
    about 1, because they normalise the gradient. ``max_grad_norm`` clips the
    gradient before the step; ``hyper`` goes to the optimizer (``lr``,
    ``weight_decay``, ``eps``, ...).
    """
    require_optimizer_name(optimizer)
    require_accum_steps(accum_steps)
    require_flag("scale_loss", scale_loss)
    require_max_grad_norm(max_grad_norm)
    _require_lr(hyper)
    full_batch, microbatches = _first_step_data(accum_steps)
    step_fn = train_step_with_accumulation if scale_loss else unscaled_loss
    with one_thread():
        full_batch_update = _first_update(train_step_with_accumulation, full_batch, optimizer, max_grad_norm, hyper)
        measured = _first_update(step_fn, microbatches, optimizer, max_grad_norm, hyper)
    return (measured.norm() / full_batch_update.norm()).item()


def relative_decay_strength(optimizer: str, accum_steps: int, weight_decay: float, **hyper) -> float:
    """Weight decay's strength next to the gradient with unscaled losses, as a fraction of its strength with correct ones.

    The first update of :func:`effective_lr_multiplier`'s problem splits into a
    gradient part (the update with ``weight_decay=0``) and a decay part (the
    update with ``weight_decay`` minus the gradient part); the strength is
    ``||decay part|| / ||gradient part||``. SGD's decay is added to the gradient
    after the backward, so the unscaled loss multiplies only the gradient part:
    about 1/N. AdamW's and Muon's decay is decoupled and their gradient part is
    normalised: about 1.
    """
    require_optimizer_name(optimizer)
    require_accum_steps(accum_steps)
    require_real("weight_decay", weight_decay, positive=True, hint="with no decay there is no strength to compare")
    _require_lr(hyper)
    full_batch, microbatches = _first_step_data(accum_steps)

    def strength(step_fn, window):
        gradient_part = _first_update(step_fn, window, optimizer, None, {**hyper, "weight_decay": 0.0})
        decayed = _first_update(step_fn, window, optimizer, None, {**hyper, "weight_decay": weight_decay})
        return (decayed - gradient_part).norm() / gradient_part.norm()

    with one_thread():
        return (strength(unscaled_loss, microbatches) / strength(train_step_with_accumulation, full_batch)).item()


def training_curve(
    optimizer: str, accum_steps: int, *, scale_loss: bool, steps: int = 30, batch_size: int = 64, **hyper
) -> list[float]:
    """The loss on a fixed data set after each of ``steps`` accumulated steps.

    Every step takes a batch of ``batch_size`` samples split into
    ``accum_steps`` micro-batches, so with ``scale_loss=True`` the curve does
    not depend on ``accum_steps`` at all. A run that diverges is cut short:
    its remaining losses are ``nan``.
    """
    require_optimizer_name(optimizer)
    require_accum_steps(accum_steps)
    require_flag("scale_loss", scale_loss)
    require_int("steps", steps, 1, hint="30 is the default")
    require_int("batch_size", batch_size, 1, hint="64 is the default")
    _require_lr(hyper)
    if accum_steps > batch_size:
        raise ValueError(
            f"cannot split a batch of {batch_size} samples into {accum_steps} micro-batches; "
            f"use accum_steps <= batch_size"
        )
    inputs, targets = _regression_data(4 * batch_size, seed=0)
    batches = list(zip(inputs.split(batch_size), targets.split(batch_size)))
    model = _regression_model()
    opt = make_optimizer(optimizer, model.parameters(), **hyper)
    step_fn = train_step_with_accumulation if scale_loss else unscaled_loss
    losses = []
    with one_thread(), warnings.catch_warnings():
        # A diverging run is the expected outcome here: it is cut short below, not warned about at every step.
        warnings.filterwarnings("ignore", message="train_step_with_accumulation skipped", category=RuntimeWarning)
        for step in range(steps):
            x, y = batches[step % len(batches)]
            step_fn(model, opt, list(zip(x.tensor_split(accum_steps), y.tensor_split(accum_steps))), F.mse_loss)
            with torch.no_grad():
                losses.append(F.mse_loss(model(inputs), targets).item())
            if not math.isfinite(losses[-1]):
                return losses + [math.nan] * (steps - len(losses))
    return losses


def _first_step_data(accum_steps: int):
    """One window of ``accum_steps`` micro-batches of :data:`MICROBATCH_SIZE` samples, as one full batch and as micro-batches."""
    inputs, targets = _regression_data(accum_steps * MICROBATCH_SIZE, seed=accum_steps)
    return [(inputs, targets)], list(zip(inputs.split(MICROBATCH_SIZE), targets.split(MICROBATCH_SIZE)))


def _first_update(step_fn: Callable, microbatches, optimizer: str, max_grad_norm, hyper) -> torch.Tensor:
    model = _regression_model()
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    opt = make_optimizer(optimizer, model.parameters(), **hyper)
    if max_grad_norm is not None:

        def clip(*_):  # a step pre-hook must return None
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)

        opt.register_step_pre_hook(clip)
    step_fn(model, opt, microbatches, F.mse_loss)
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def _regression_model() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(IN_FEATURES, HIDDEN, bias=False), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT_FEATURES, bias=False)
        )


def _regression_data(n_samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and a smooth target that the small network can learn (the same teacher for every seed)."""
    teacher = torch.randn(IN_FEATURES, OUT_FEATURES, generator=torch.Generator().manual_seed(12345))
    inputs = torch.randn(n_samples, IN_FEATURES, generator=torch.Generator().manual_seed(seed))
    return inputs, torch.sin(inputs @ teacher / math.sqrt(IN_FEATURES))


def _require_lr(hyper: dict) -> None:
    # An infinite learning rate gives NaN weights, and a multiplier or a curve of NaN.
    if "lr" in hyper:
        require_real("lr", hyper["lr"], positive=True,
                     hint="pass a positive number such as 0.1: the measures compare update sizes, and lr = 0 moves nothing")


def require_optimizer_name(name) -> None:
    """Raise unless ``name`` is one of :data:`OPTIMIZERS`."""
    if not isinstance(name, str):
        raise TypeError(f"optimizer must be a name such as 'sgd', got {type(name).__name__}")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")
