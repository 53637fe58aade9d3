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

from dmuon_edu import dmuon
from dmuon_edu.arguments import require_flag
from dmuon_edu.course.cost_model import SCHEMES, cost
from dmuon_edu.course.pitfalls import (
    DEFAULT_LR,
    OPTIMIZERS,
    effective_lr_multiplier,
    require_optimizer_name,
    training_curve,
)

__all__ = ["lr_scaling_widget", "lr_scaling_figure", "LrScalingWidget", "cost_widget", "cost_figure",
           "step_time_widget", "step_time_figure", "predicted_steps"]

MAX_ACCUM_STEPS = 64
# The cost widget's slider ranges: ranks W, micro-batches N, layers L.
COST_SLIDERS = {"W": 64, "N": 32, "L": 48}
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
    _require_slider_value("accum_steps", accum_steps, MAX_ACCUM_STEPS)
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
        require_optimizer_name(optimizer)
        _require_slider_value("accum_steps", accum_steps, MAX_ACCUM_STEPS)
        require_flag("scale_loss", scale_loss)
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
        self.plot.value = _png(self.figure)

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


def _png(figure: Figure) -> bytes:
    png = io.BytesIO()
    figure.savefig(png, format="png")
    return png.getvalue()


def _require_slider_value(name: str, value, largest: int) -> None:
    # A slider would silently clamp a value outside its range.
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= largest:
        raise ValueError(f"{name} must be between 1 and {largest} (an int), got {value!r}")


MEMORY_PARTS = ("parameters", "gradients", "optimizer state")


def cost_figure(W: int, N: int, L: int, no_sync: bool) -> Figure:
    """Every scheme of the cost model side by side, in units of P (P_M for dmuon): memory and wire bytes per rank.

    W ranks, N micro-batches per optimizer step, L layers. AdamW's two moments (s = 2) for
    DDP, ZeRO-1 and FSDP2; Muon's momentum (s = 1) for dmuon.
    """
    costs = {scheme: cost(scheme, P=1.0, W=W, N=N, L=L, no_sync=no_sync, s=1.0 if scheme.startswith("dmuon") else 2.0)
             for scheme in SCHEMES}
    figure = Figure(figsize=(9, 3.4), layout="constrained")
    memory, wire = figure.subplots(1, 2)
    labels = [scheme.replace(", ", ",\n") for scheme in SCHEMES]
    bottom = [0.0] * len(SCHEMES)
    for part in MEMORY_PARTS:
        heights = [getattr(c, part.replace(" ", "_")) + (c.in_flight if part == "parameters" else 0.0)
                   for c in costs.values()]
        memory.bar(labels, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    memory.set(ylabel="bytes per rank / P", title="memory at the peak (activations aside)")
    memory.legend(fontsize=8)
    wire.bar(labels, [c.wire for c in costs.values()], color="tab:gray")
    wire.set(ylabel="bytes sent per rank / P", title="wire bytes per optimizer step")
    for axes in (memory, wire):
        axes.tick_params(axis="x", labelsize=7)
    figure.suptitle(f"W = {W} ranks, N = {N} micro-batches, L = {L} layers, "
                    f"{'no_sync' if no_sync else 'sync every micro-batch'}", fontsize=10)
    return figure


class CostWidget(widgets.VBox):
    """Sliders for W, N and L and a no_sync switch, over :func:`cost_figure`."""

    def __init__(self, W: int, N: int, L: int, no_sync: bool):
        for name, value in (("W", W), ("N", N), ("L", L)):
            _require_slider_value(name, value, COST_SLIDERS[name])
        require_flag("no_sync", no_sync)
        self.W = widgets.IntSlider(value=W, min=1, max=COST_SLIDERS["W"], description="W ranks")
        self.N = widgets.IntSlider(value=N, min=1, max=COST_SLIDERS["N"], description="N micro")
        self.L = widgets.IntSlider(value=L, min=1, max=COST_SLIDERS["L"], description="L layers")
        self.no_sync = widgets.Checkbox(value=no_sync, description="no_sync")
        self.plot = widgets.Image(format="png")
        self.figure: Figure | None = None
        super().__init__([widgets.HBox([self.W, self.N]), widgets.HBox([self.L, self.no_sync]), self.plot])
        for control in (self.W, self.N, self.L, self.no_sync):
            control.observe(lambda _: self.redraw(), names="value")
        self.redraw()

    def redraw(self) -> None:
        self.figure = cost_figure(self.W.value, self.N.value, self.L.value, self.no_sync.value)
        self.plot.value = _png(self.figure)


def cost_widget(W: int = 8, N: int = 4, L: int = 12, no_sync: bool = True) -> CostWidget:
    """An app: per-rank memory and wire bytes of DDP, ZeRO-1, FSDP2 and dmuon Z2/Z3 as W, N and L change."""
    return CostWidget(W, N, L, no_sync)


# The time model's GPU prediction: each dmuon layout beside the AdamW step of its own layout.
STEP_TIME_LAYOUTS = {"dmuon Z2": "FSDP2 + AdamW", "dmuon Z3": "FSDP2 + AdamW", "dmuon DDP backend": "DDP + AdamW"}
GPUS_PER_NODE = 8
MAX_NODES = 128
# The public dmuon's README: its step against AdamW's on 16 nodes of 8 GPUs, +1.7% to +3.4%.
PUBLISHED_OVERHEAD = (0.017, 0.034)


def _require_step_time_inputs(model: str, nodes: int, micro_batches: int) -> None:
    if model not in dmuon.MODELS:
        raise ValueError(f"model must be one of {', '.join(dmuon.MODELS)}, got {model!r}")
    _require_slider_value("nodes", nodes, MAX_NODES)
    _require_slider_value("micro_batches", micro_batches, COST_SLIDERS["N"])


def predicted_steps(model: str, nodes: int, micro_batches: int) -> dict[str, tuple[float, float]]:
    """{dmuon layout: (its predicted step, its AdamW peer's)} in seconds, on ``nodes`` nodes of 8 H100s (the time
    model, dmuon.predict_step, with its H100 SXM preset)."""
    _require_step_time_inputs(model, nodes, micro_batches)

    def step(layout):
        return dmuon.predict_step(dmuon.MODELS[model], dmuon.LAYOUTS[layout], world_size=nodes * GPUS_PER_NODE,
                                  micro_batches=micro_batches, hardware=dmuon.HARDWARE["h100-sxm"]).total

    return {name: (step(name), step(peer)) for name, peer in STEP_TIME_LAYOUTS.items()}


def step_time_figure(model: str, nodes: int, micro_batches: int) -> Figure:
    """dmuon's predicted step (:func:`predicted_steps`) beside the AdamW step of the same layout, and the public
    dmuon's published overhead over AdamW."""
    steps = predicted_steps(model, nodes, micro_batches)
    figure = Figure(figsize=(8, 3.2), layout="constrained")
    seconds, overhead = figure.subplots(1, 2)
    labels = [name.removeprefix("dmuon ") for name in steps]
    positions = range(len(labels))
    seconds.bar([x - 0.2 for x in positions], [peer for _, peer in steps.values()], width=0.4,
                label="AdamW, same layout", color="tab:gray")
    seconds.bar([x + 0.2 for x in positions], [ours for ours, _ in steps.values()], width=0.4, label="dmuon (Muon)",
                color="tab:blue")
    seconds.set_xticks(list(positions), labels)
    seconds.set(ylabel="seconds per optimizer step", title="predicted step")
    seconds.legend(fontsize=8)
    overhead.bar(labels, [100 * (ours / peer - 1) for ours, peer in steps.values()], color="tab:blue")
    overhead.axhspan(100 * PUBLISHED_OVERHEAD[0], 100 * PUBLISHED_OVERHEAD[1], color="tab:orange", alpha=0.3,
                     label="public dmuon, published (16 nodes)")
    overhead.axhline(0, color="black", linewidth=0.8)
    overhead.set(ylabel="% over AdamW", title="overhead over AdamW")
    overhead.legend(fontsize=8)
    figure.suptitle(f"{model} on {nodes} x {GPUS_PER_NODE} H100 SXM (W = {nodes * GPUS_PER_NODE}), N = "
                    f"{micro_batches} micro-batches: predicted by dmuon's time model", fontsize=10)
    return figure


class StepTimeWidget(widgets.VBox):
    """A model, a node count and N, over :func:`step_time_figure`."""

    def __init__(self, model: str, nodes: int, micro_batches: int):
        _require_step_time_inputs(model, nodes, micro_batches)  # before any control is built
        self.model = widgets.Dropdown(options=list(dmuon.MODELS), value=model, description="model")
        self.nodes = widgets.IntSlider(value=nodes, min=1, max=MAX_NODES, description="nodes",
                                       continuous_update=False)
        self.micro_batches = widgets.IntSlider(value=micro_batches, min=1, max=COST_SLIDERS["N"],
                                               description="N micro", continuous_update=False)
        self.plot = widgets.Image(format="png")
        self.figure: Figure | None = None
        super().__init__([widgets.HBox([self.model, self.nodes, self.micro_batches]), self.plot])
        for control in (self.model, self.nodes, self.micro_batches):
            control.observe(lambda _: self.redraw(), names="value")
        self.redraw()

    def redraw(self) -> None:
        self.figure = step_time_figure(self.model.value, self.nodes.value, self.micro_batches.value)
        self.plot.value = _png(self.figure)


def step_time_widget(model: str = "llama2-7b", nodes: int = 16, micro_batches: int = 8) -> StepTimeWidget:
    """An app: dmuon's step on a GPU cluster, predicted by its time model, against AdamW and the published overhead."""
    return StepTimeWidget(model, nodes, micro_batches)
