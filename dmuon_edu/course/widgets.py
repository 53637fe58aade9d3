"""Interactive pictures for the notebooks (ipywidgets, drawn with matplotlib).

Each widget is a thin shell: its controls call a plain function that returns a
matplotlib figure, and that function is what the tests exercise. The figure is
shown as a PNG in an ``ipywidgets.Image``: no interactive backend (ipympl) is
needed, and the cell's output is the same with or without a browser attached.

    from dmuon_edu.course.widgets import lr_scaling_widget
    lr_scaling_widget()       # the last line of a notebook cell
"""

from __future__ import annotations

import functools
import io
import math

import ipywidgets as widgets
from matplotlib.figure import Figure

from dmuon_edu.course.pitfalls import DEFAULT_LR, OPTIMIZERS, effective_lr_multiplier, training_curve

__all__ = ["lr_scaling_widget", "lr_scaling_figure", "LrScalingWidget"]

MAX_ACCUM_STEPS = 64
# Where the multiplier is drawn, besides the chosen N.
ACCUM_STEPS_GRID = (1, 2, 4, 8, 16, 32, 64)

# Moving one control asks again for numbers the others already gave; they are deterministic.
_multiplier = functools.lru_cache(maxsize=1024)(effective_lr_multiplier)
_curve = functools.lru_cache(maxsize=256)(training_curve)

CORRECT_LABEL = "loss / N (correct)"
UNSCALED_LABEL = "loss not scaled"
MULTIPLIER_LABEL = "your loop"


def lr_scaling_figure(optimizer: str, accum_steps: int, *, lr: float, scale_loss: bool) -> Figure:
    """Two panels: the effective learning-rate multiplier against N, and a short training run.

    Left: :func:`dmuon_edu.course.pitfalls.effective_lr_multiplier` of ``optimizer``
    for each N, with the loss scaled or not as ``scale_loss`` says, the chosen
    N marked. Right: :func:`dmuon_edu.course.pitfalls.training_curve` with correct and
    with unscaled losses at learning rate ``lr``; the one ``scale_loss``
    selects is drawn bold.
    """
    _require_slider_accum_steps(accum_steps)
    hyper = {"lr": lr}
    grid = sorted({*ACCUM_STEPS_GRID, accum_steps})
    multipliers = [_multiplier(optimizer, n, scale_loss=scale_loss, **hyper) for n in grid]
    chosen = multipliers[grid.index(accum_steps)]

    figure = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = figure.subplots(1, 2)
    left.plot(grid, grid, ":", color="gray", label="N (an N-times learning rate)")
    left.plot(grid, multipliers, "o-", color="C3" if chosen > 1.5 else "C2", lw=2, label=MULTIPLIER_LABEL)
    left.plot([accum_steps], [chosen], "o", ms=12, mfc="none", mec="black", label=f"N = {accum_steps}: x{chosen:.2f}")
    left.set(
        xscale="log", yscale="log", xlabel="accumulation steps N", ylabel="update size / correct update size",
        title=f"{optimizer}, {'loss / N' if scale_loss else 'loss not scaled'}",
    )
    left.set_xticks(ACCUM_STEPS_GRID, [str(n) for n in ACCUM_STEPS_GRID])
    left.set_yticks(ACCUM_STEPS_GRID, [str(n) for n in ACCUM_STEPS_GRID])
    left.legend(loc="upper left")
    left.minorticks_off()

    lowest = 10.0
    for label, scaled, style in [(CORRECT_LABEL, True, "-"), (UNSCALED_LABEL, False, "--")]:
        losses = _curve(optimizer, accum_steps, scale_loss=scaled, **hyper)
        selected = scaled == scale_loss
        color = "C2" if scaled else "C3"
        diverged = " (diverged)" if any(math.isnan(loss) for loss in losses) else ""
        right.plot(losses, style, color=color, lw=2.5 if selected else 1.2, alpha=1 if selected else 0.6,
                   label=label + diverged)
        lowest = min([lowest, *(loss for loss in losses if math.isfinite(loss))])
    right.set(
        yscale="log", ylim=(lowest / 2, 10), xlabel="optimizer step", ylabel="loss on the whole data set",
        title=f"training, lr = {lr:.3g}, N = {accum_steps}",
    )
    right.legend(loc="upper right")
    return figure


class LrScalingWidget(widgets.VBox):
    """The controls of :func:`lr_scaling_figure`, its latest figure (``.figure``) and that figure's PNG (``.plot``)."""

    def __init__(self, optimizer: str = "sgd", accum_steps: int = 8, scale_loss: bool = False):
        _require_slider_accum_steps(accum_steps)  # the slider would silently clamp it
        style = {"description_width": "initial"}
        self.optimizer = widgets.ToggleButtons(options=OPTIMIZERS, value=optimizer, description="optimizer", style=style)
        self.accum_steps = widgets.IntSlider(
            value=accum_steps, min=1, max=MAX_ACCUM_STEPS, description="accumulation steps N",
            continuous_update=False, style=style,
        )
        self.lr = widgets.FloatLogSlider(
            value=DEFAULT_LR[optimizer], base=10, min=-4, max=0, step=0.1, description="learning rate",
            readout_format=".3g", continuous_update=False, style=style,
        )
        self.scale_loss = widgets.Checkbox(value=scale_loss, description="scale each loss by 1/N", style=style)
        self.plot = widgets.Image(format="png")
        self.figure: Figure | None = None
        super().__init__([
            self.optimizer,
            widgets.HBox([self.accum_steps, self.lr, self.scale_loss]),
            self.plot,
        ])
        self.optimizer.observe(self._optimizer_changed, names="value")
        for control in (self.accum_steps, self.lr, self.scale_loss):
            control.observe(lambda _: self.redraw(), names="value")
        self.redraw()

    def redraw(self) -> None:
        self.figure = lr_scaling_figure(
            self.optimizer.value, self.accum_steps.value, lr=self.lr.value, scale_loss=self.scale_loss.value
        )
        png = io.BytesIO()
        self.figure.savefig(png, format="png")
        self.plot.value = png.getvalue()

    def _optimizer_changed(self, change) -> None:
        # Each optimizer gets its usual learning rate. Setting the slider redraws through
        # its own observer; when it already holds that value nothing fires, so redraw here.
        lr = DEFAULT_LR[change.new]
        if self.lr.value == lr:
            self.redraw()
        else:
            self.lr.value = lr


def lr_scaling_widget(optimizer: str = "sgd", accum_steps: int = 8, scale_loss: bool = False) -> LrScalingWidget:
    """An app: how an unscaled loss changes the learning rate of SGD, momentum, AdamW and Muon."""
    return LrScalingWidget(optimizer, accum_steps, scale_loss)


def _require_slider_accum_steps(accum_steps) -> None:
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or not 1 <= accum_steps <= MAX_ACCUM_STEPS:
        raise ValueError(f"accum_steps must be between 1 and {MAX_ACCUM_STEPS} (an int), got {accum_steps!r}")
