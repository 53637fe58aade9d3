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


def fit_least_absolute(sizes, seconds):
    """The least sum of absolute relative errors, by iteratively reweighted least squares: a stalled median pulls
    it less than it pulls a least-squares fit."""
    weights = [1.0] * len(sizes)
    for _ in range(50):
        rows = [(w / t, w * s / t, w) for s, t, w in zip(sizes, seconds, weights)]
        aa, ab, bb = (sum(u * u for u, _, _ in rows), sum(u * v for u, v, _ in rows), sum(v * v for _, v, _ in rows))
        ya, yb = sum(u * w for u, _, w in rows), sum(v * w for _, v, w in rows)
        d = aa * bb - ab * ab
        alpha, per_byte = (ya * bb - yb * ab) / d, (aa * yb - ab * ya) / d
        weights = [1 / max(abs((alpha + per_byte * s) / t - 1), 1e-3) ** 0.5 for s, t in zip(sizes, seconds)]
    return alpha, per_byte
