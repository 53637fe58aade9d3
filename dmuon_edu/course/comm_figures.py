"""Module 6d's pictures: the timing script's measurements (scripts/06_time_collectives.py), drawn.

A module of its own because the checks import :mod:`dmuon_edu.course.comm_seconds`, and the checks are
imported where matplotlib is not installed (the GPU machine's ``make gpu-check``).
"""

from __future__ import annotations

from matplotlib.figure import Figure

__all__ = ["timings_figure", "sweep_figure"]


def timings_figure(measured: dict) -> Figure:
    """Each collective's medians against its size, with its fitted line (the timing script's ``measurements``)."""
    figure = Figure(figsize=(6, 3.6), layout="constrained")
    axes = figure.subplots()
    for name, row in measured["timings"].items():
        sizes = [int(size) for size in row]
        alpha, per_byte = measured["fits"][name]
        sensible = alpha > 0 and per_byte > 0  # only the all_reduce's fit was graded
        label = f"alpha {alpha * 1e6:.0f} us, {1 / per_byte / 1e9:.2f} GB/s" if sensible else "no line: a fit <= 0"
        points = axes.loglog(sizes, list(row.values()), "o", label=f"{name}: {label}")
        if sensible:
            axes.loglog(sizes, [alpha + per_byte * size for size in sizes], "-", color=points[0].get_color())
    axes.set(xlabel="message size (bytes)", ylabel="seconds per call (slowest rank, median)", title="your gloo ranks")
    axes.legend(fontsize=8)
    return figure


def sweep_figure(measured: dict) -> Figure:
    """One backward with the learner's BucketedAllReduce at each bucket size, against the no-overlap prediction:
    the backward alone, plus each call's alpha, plus beta P (the all_reduce fit)."""
    sweep = measured["sweep"]
    alpha, per_byte = measured["fits"]["all_reduce"]
    rows = {int(size): row for size, row in sweep["rows"].items() if size != "no communication"}
    alone = sweep["rows"]["no communication"]["seconds"]
    sizes = sorted(rows)
    figure = Figure(figsize=(6, 3.4), layout="constrained")
    axes = figure.subplots()
    axes.semilogx(sizes, [rows[b]["seconds"] * 1e3 for b in sizes], "o-", label="measured: one backward + finish()")
    axes.semilogx(sizes, [(alone + rows[b]["calls"] * alpha + per_byte * sweep["gradient bytes"]) * 1e3 for b in sizes],
                  "--", label="no overlap: backward + calls x alpha + beta P")
    for b in sizes:
        axes.annotate(f"{rows[b]['calls']} calls", (b, rows[b]["seconds"] * 1e3), fontsize=7)
    axes.set(xlabel="bucket size (bytes)", ylabel="ms", title="your BucketedAllReduce on 2 gloo ranks")
    axes.legend(fontsize=8)
    return figure
