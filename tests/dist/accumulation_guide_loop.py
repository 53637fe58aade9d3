"""The "Full Training Loop with Accumulation" of dmuon's gradient-accumulation guide, run as written (tests/test_dmuon.py runs it on 2 ranks).

The lines between GUIDE BEGIN and GUIDE END are the guide's text with exactly the changes
the course allows: ``from dmuon_edu import dmuon`` for ``import dmuon``, gloo for nccl,
"cpu" for "cuda" (so ``MyModel().cuda()`` is ``MyModel()``). The guide leaves ``MyModel``
and ``dataloader`` to the reader; they are defined above it: a small regression model
whose hidden matrices are named ``*_proj`` under ``model.layers``, returning an object
with ``.loss``, and a synthetic stream of batches from a fixed random teacher.
"""

# --- not in the guide: the model and the data ---------------------------------------
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

IN, D, H, OUT = 8, 32, 64, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up_proj = nn.Linear(D, H)
        self.down_proj = nn.Linear(H, D)

    def forward(self, x):
        return x + self.down_proj(F.gelu(self.up_proj(self.norm(x))))


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.embed = nn.Linear(IN, D)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, OUT)

    def forward(self, batch):
        x, y = batch
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return types.SimpleNamespace(loss=F.mse_loss(self.head(h), y))


class SyntheticBatches:
    """Batches of 32 from a fixed teacher; each rank draws its own (seeded by rank)."""

    def __init__(self, n_batches):
        self.n_batches = n_batches

    def __iter__(self):
        teacher = torch.Generator().manual_seed(7)
        w1, w2 = torch.randn(IN, 16, generator=teacher), torch.randn(16, OUT, generator=teacher) / 4
        g = torch.Generator().manual_seed(100 + dist.get_rank())
        for _ in range(self.n_batches):
            x = torch.randn(32, IN, generator=g)
            yield x, torch.tanh(x @ w1) @ w2


dataloader = SyntheticBatches(4 * 15)

# --- GUIDE BEGIN ------------------------------------------------------------------
import torch
import torch.distributed as dist
from contextlib import nullcontext
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from dmuon_edu import dmuon

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = MyModel()

dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
for layer in model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)

optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

accum_steps = 4
global_step = 0

for i, batch in enumerate(dataloader):
    is_accumulating = (i + 1) % accum_steps != 0
    ctx = dmuon.no_sync(model) if is_accumulating else nullcontext()

    with ctx:
        loss = model(batch).loss / accum_steps
        loss.backward()

    if not is_accumulating:
        optimizer.step()
        optimizer.zero_grad()
        global_step += 1

        if dist.get_rank() == 0:
            print(f"step {global_step}: loss={loss.item() * accum_steps:.4f}")
# --- GUIDE END --------------------------------------------------------------------

# Not in the guide: leave the process group once every rank is done. distributed.barrier(), not
# dist.barrier(): see dmuon_edu.distributed for why the latter can abort a gloo rank at exit.
from dmuon_edu import distributed

distributed.barrier()
dist.destroy_process_group()
