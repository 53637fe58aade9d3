"""Small things several test files share."""

import os
from pathlib import Path

from torch import nn


class Tiny(nn.Module):
    """Two layers with a "proj" matrix and a norm each: the smallest model dmuon can dedicate."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"up_proj": nn.Linear(4, 4), "norm": nn.LayerNorm(4)})
                                    for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer["norm"](layer["up_proj"](x))
        return x


def processes_running(script_name):
    """Pids of this machine's processes whose command line names ``script_name`` (other than this one)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # /proc/PID/cmdline separates the arguments with NUL bytes
                if script_name in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return [pid for pid in found if pid != os.getpid()]


# Two honest answers to module 6d's fit_alpha_beta, for its checks' tests.
def fit_relative(sizes, seconds):
    """Least squares on the relative error, by the normal equations of the 2 x 2 system."""
    rows = [(1 / t, s / t) for s, t in zip(sizes, seconds)]
    aa, ab, bb = (sum(u * u for u, _ in rows), sum(u * v for u, v in rows), sum(v * v for _, v in rows))
    ya, yb = sum(u for u, _ in rows), sum(v for _, v in rows)
    d = aa * bb - ab * ab
    return (ya * bb - yb * ab) / d, (aa * yb - ab * ya) / d


def fit_median_search(sizes, seconds):
    """The (alpha, slope) of a log-spaced grid whose median relative error is least: robust to a stalled median."""
    def median_error(alpha, per_byte):
        errors = sorted(abs((alpha + per_byte * s) / t - 1) for s, t in zip(sizes, seconds))
        return errors[len(errors) // 2]
    grid = [(10 ** (-6 + i / 12), 10 ** (-12 + j / 12)) for i in range(61) for j in range(73)]
    return min(grid, key=lambda point: median_error(*point))
