"""A timeline of one rank: when each layer's forward and backward ran, and when each collective was issued.

    with Timeline(model.layers) as timeline:
        loss = model(batch).loss
        loss.backward()
    timeline.spans      # [("forward" | "backward", layer index, start, end)], seconds
    timeline.events     # [(seconds, collective name, bytes)], as count_collectives records them

Every time is ``time.perf_counter()`` on this rank, the clock the collective counter uses, so
the two lists share one axis. A layer's forward spans its forward pre-hook to its forward
hook. Its backward starts when the gradient of its output is ready (a hook on the output)
and ends when the gradient of its input is (a hook on the input), which is when autograd
has finished the layer (a layer whose input needs no gradient, such as a first layer fed
the data itself, has no backward span). The order of the events is what proves overlap: a collective
issued inside a span ran while that layer computed, if the hardware lets the two run at
once (not on a 2-core CPU, where gloo's collectives share the cores with the compute; the
timing of overlap needs a GPU).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from dmuon_edu import distributed
from dmuon_edu.arguments import require_iterable, require_module

__all__ = ["Timeline", "collectives_by_phase", "plot_timeline"]

PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange"}
COLLECTIVE_COLOURS = {"broadcast": "tab:green", "reduce": "tab:red", "all_reduce": "tab:purple",
                      "all_gather": "tab:cyan", "reduce_scatter": "tab:brown"}


class Timeline:
    """Layer spans and collectives of the code run inside ``with``; usable once."""

    def __init__(self, layers: Sequence[nn.Module]):
        require_iterable("layers", layers, "pass the modules to time, e.g. model.layers")
        self.layers = list(layers)
        for index, layer in enumerate(self.layers):
            require_module(f"Timeline (layer {index})", layer, "pass the modules to time, e.g. model.layers")
        self.spans: list[tuple[str, int, float, float]] = []
        self.events: list[tuple[float, str, int]] = []
        self._started: dict[tuple[str, int], float] = {}
        self._handles = []
        self._counter = distributed.count_collectives()

    def __enter__(self) -> Timeline:
        for index, layer in enumerate(self.layers):
            # Ahead of FSDP2's and dmuon's own hooks: the collectives they issue for a layer's forward
            # fall inside its span, and what they issue once it has run falls after it.
            self._handles.append(layer.register_forward_pre_hook(self._forward_starts(index), prepend=True))
            self._handles.append(layer.register_forward_hook(self._forward_ends(index), prepend=True))
        self._counter.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._counter.__exit__(*exc_info)
        for handle in self._handles:
            handle.remove()
        self.events = list(self._counter.events)

    def _forward_starts(self, index: int):
        def hook(_module, args):
            self._started["forward", index] = time.perf_counter()
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(self._closes("backward", index))
        return hook

    def _forward_ends(self, index: int):
        def hook(_module, _args, output):
            self._close("forward", index)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._opens("backward", index))
        return hook

    def _opens(self, phase: str, index: int):
        def hook(_grad):
            # The layer above's input is this layer's output: one gradient ends that layer's backward and
            # starts this one's, and this hook, registered first, runs first.
            for open_phase, open_index in [key for key in self._started if key[0] == phase]:
                self._close(open_phase, open_index)
            self._started[phase, index] = time.perf_counter()
        return hook

    def _closes(self, phase: str, index: int):
        def hook(_grad):
            self._close(phase, index)
        return hook

    def _close(self, phase: str, index: int) -> None:
        start = self._started.pop((phase, index), None)
        if start is not None:
            self.spans.append((phase, index, start, time.perf_counter()))

    def relative(self) -> dict:
        """Spans and events as JSON-ready lists, in seconds from this timeline's first record."""
        origin = min([start for _, _, start, _ in self.spans] + [t for t, _, _ in self.events], default=0.0)
        return {"spans": [[phase, index, start - origin, end - origin] for phase, index, start, end in self.spans],
                "events": [[t - origin, name, nbytes] for t, name, nbytes in self.events]}


def collectives_by_phase(timeline: dict) -> dict[str, dict[str, int]]:
    """Calls of each collective issued during the forwards, and after them, of a ``Timeline.relative()``.

    A micro-batch's forward runs from its first layer's forward start to its last layer's
    forward end; everything issued from then until the next micro-batch's forward starts
    (its backward, and the step) counts as "backward".
    """
    spans = [(start, end) for phase, _index, start, end in timeline["spans"] if phase == "forward"]
    layers = 1 + max(index for phase, index, _start, _end in timeline["spans"] if phase == "forward")
    forwards = [(spans[i][0], spans[i + layers - 1][1]) for i in range(0, len(spans), layers)]
    counts: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    for t, name, _nbytes in timeline["events"]:
        phase = "forward" if any(start <= t <= end for start, end in forwards) or t < forwards[0][0] else "backward"
        counts[phase][name] = counts[phase].get(name, 0) + 1
    return counts


def plot_timeline(ax, timelines: dict[str, dict], title: str = "", collectives: Sequence[str] | None = None) -> None:
    """One lane per timeline (``{label: Timeline.relative()}``): layer spans as bars, collectives as ticks above.

    ``collectives`` names the collectives to draw (all of them when None).
    """
    from matplotlib.lines import Line2D  # here, not at the top: the ranks that record a timeline never plot
    from matplotlib.patches import Patch

    shown = [(t, name) for timeline in timelines.values() for t, name, _ in timeline["events"]
             if collectives is None or name in collectives]
    for lane, (label, timeline) in enumerate(timelines.items()):
        y = -lane
        for phase, index, start, end in timeline["spans"]:
            ax.barh(y, end - start, left=start, height=0.5, color=PHASE_COLOURS[phase], alpha=0.35,
                    edgecolor=PHASE_COLOURS[phase])
            ax.text((start + end) / 2, y, str(index), ha="center", va="center", fontsize=7)
        for t, name, _nbytes in timeline["events"]:
            if collectives is None or name in collectives:
                ax.plot([t, t], [y + 0.28, y + 0.48], color=COLLECTIVE_COLOURS.get(name, "black"), linewidth=1.5)
    handles = [Patch(color=PHASE_COLOURS[phase], alpha=0.35, label=f"{phase} (layer number)") for phase in PHASE_COLOURS]
    handles += [Line2D([], [], color=COLLECTIVE_COLOURS.get(name, "black"), label=f"{name} issued")
                for name in sorted({name for _, name in shown})]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_yticks([-lane for lane in range(len(timelines))], list(timelines))
    ax.set(xlabel="seconds from the first record", title=title)
