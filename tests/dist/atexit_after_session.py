"""A user's atexit handler (a logger's flush, an async checkpoint's wait) must run on every rank.

Usage: torchrun --nproc-per-node=N atexit_after_session.py OUT_DIR [session|public]
Each rank registers a handler that writes OUT_DIR/rank<r>.atexit, then trains two
steps under FSDP2 and dmuon, whose objects keep references to the process group
until the interpreter exits, inside distributed.session() ("session", the default), or
as torch's and the public dmuon's examples do ("public"): init_process_group, the
steps, a full state dict gathered (the last collectives), destroy_process_group().
"""

import atexit
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_edu import distributed, dmuon

out = Path(sys.argv[1])
ending = sys.argv[2] if len(sys.argv) > 2 else "session"


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x



@contextlib.contextmanager
def public_ending():
    dist.init_process_group("gloo")
    yield distributed.Ranks(dist.get_rank(), dist.get_world_size(), 0, torch.device("cpu"), "gloo")
    dmuon.get_model_state_dict(model, dmuon.StateDictOptions(full_state_dict=True))
    dist.destroy_process_group()


with (distributed.session() if ending == "session" else public_ending()) as ranks:
    atexit.register(lambda: (out / f"rank{ranks.rank}.atexit").write_text("ran"))
    mesh = init_device_mesh("cpu", (ranks.world_size,))
    torch.manual_seed(0)
    model = Model()
    dmuon.dedicate_params(model, mesh, predicate=lambda name, p: p.ndim == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02)
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
