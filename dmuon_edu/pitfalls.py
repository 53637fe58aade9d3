"""The classic gradient-accumulation bugs, written out so that they can be run.

Each window-level function has the signature of
:func:`dmuon_edu.accumulation.train_step_with_accumulation`; each epoch-level
one (``*_leftover_window``) runs a whole list of batches with ``accum_steps``.
Each makes exactly one mistake. The course runs them to show what each mistake does to the
update, and :mod:`dmuon_edu.checks` runs them to recognise a learner's mistake
by its effect.
"""

from __future__ import annotations

__all__ = [
    "unscaled_loss",
    "zero_grad_inside_loop",
    "never_zero_grad",
    "step_every_microbatch",
    "mean_of_microbatch_means",
    "drop_leftover_window",
    "underweight_leftover_window",
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
    """Never clears ``.grad``: every window also applies all earlier windows' gradients."""
    n = len(microbatches)
    losses = []
    for inputs, targets in microbatches:
        loss = loss_fn(model(inputs), targets) / n
        loss.backward()
        losses.append(loss.item() * n)
    optimizer.step()
    return sum(losses) / n


def step_every_microbatch(model, optimizer, microbatches, loss_fn) -> float:
    """Steps after every micro-batch: N small steps instead of one accumulated step."""
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
    for i, (inputs, targets) in enumerate(batches):
        (loss_fn(model(inputs), targets) / accum_steps).backward()
        if (i + 1) % accum_steps == 0 or i + 1 == len(batches):
            optimizer.step()
            optimizer.zero_grad()
