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
