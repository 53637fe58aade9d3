"""Optimizer step time of dmuon on W CPU ranks against replicated Muon, as a ratio.

    .venv/bin/python benchmarks/bench_dmuon.py          # W = 2 and 4; about a minute on a 2-core CPU

Replicated Muon is what plain data parallelism does: every rank all-reduces every
matrix gradient and runs Newton-Schulz on every matrix. dmuon reduces each gradient
to its owner only, each owner runs Newton-Schulz on its own matrices (a 1/W share of
the work, balanced by plan_owners) and broadcasts the results before the next forward.

The matrices: 4 layers of GPT-2-small's shapes at half width (d = 384): per layer
1152x384, 384x384, 1536x384, 384x1536; bf16 Newton-Schulz, the default. AdamW steps
the rest (embedding, norms, biases, head) in both. Two rows per W:

- step: optimizer.step() alone (dmuon: NS on owned matrices + AdamW on FSDP2 shards;
  replicated: NS on all matrices + AdamW on everything);
- step + its communication: dmuon: reduce of every matrix gradient to its owner, the
  step, and the broadcast of every matrix (what Z2 pays per optimizer step);
  replicated: all-reduce of every matrix gradient, then the step.

Each time is the slowest rank's (every rank waits for it at the next collective);
medians over repeats, the two variants interleaved so that drift hits both alike.
Ranks get one thread each (torchrun's OMP_NUM_THREADS = cores // W): on 2 cores, W = 4
oversubscribes the CPU, which slows replicated Muon (4 full copies of the work on
2 cores) more than dmuon.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

D, LAYERS, REPEATS = 384, 4, 11


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.qkv_proj = nn.Linear(D, 3 * D)
        self.out_proj = nn.Linear(D, D)
        self.fc_proj = nn.Linear(D, 4 * D)
        self.down_proj = nn.Linear(4 * D, D)

    def forward(self, x):
        h = self.ln(x)
        q, k, v = self.qkv_proj(h).chunk(3, dim=-1)
        x = x + self.out_proj(q * torch.sigmoid(k) * v)
        return x + self.down_proj(torch.relu(self.fc_proj(self.ln(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(64, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, 64)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def is_matrix(name, p):
    return "proj" in name and p.ndim == 2


def slowest(seconds: float) -> float:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - start)


def worker():
    from dmuon_edu import distributed, dmuon, muon

    with distributed.session() as ranks:
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        x = torch.randn(16, 64)

        torch.manual_seed(0)
        model = Net()
        dmuon.dedicate_params(model, mesh, is_matrix, reshard_after_forward=False)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = dmuon.Muon(model, adjust_lr_fn="original")  # the same update as the replicated Muon below
        model(x).square().mean().backward()  # gradients in place: the records' reduced_grad and FSDP2 shards
        state = model._dmuon
        grads = {p: g.clone() if (g := state.records[name].reduced_grad) is not None
                 else torch.randn(p.shape, dtype=p.dtype) for name, p in state.params.items()}

        torch.manual_seed(0)
        replica = Net()
        matrices = [p for n, p in replica.named_parameters() if is_matrix(n, p)]
        rest = [p for n, p in replica.named_parameters() if not is_matrix(n, p)]
        rep_muon, rep_adamw = muon.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)
        for p in replica.parameters():
            p.grad = torch.randn_like(p)

        def dmuon_step():
            opt.step()

        def dmuon_with_comm():
            for unit in state.units:  # what the forward does (Z2: once per step)
                state.residency.make_resident(unit)
            state.gradients.end_of_backward_queued = True  # no autograd engine to queue the end of backward on
            for p, g in grads.items():  # what the backward hooks do: reduce each gradient to its owner
                dmuon.record_of(p).reduced_grad = None
                p.grad = g.clone()
                state.gradients.on_grad(p)
            # finish_backward queues a callback on the autograd engine (its sample for the clip check), which
            # only a running backward accepts: call it from a hook of a one-element backward
            x = torch.zeros((), requires_grad=True)
            (y := x * 1).register_hook(lambda grad: state.gradients.finish_backward())
            y.backward()
            opt.step()

        def replicated_step():
            rep_muon.step()
            rep_adamw.step()

        def replicated_with_comm():
            for p in matrices:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            replicated_step()

        rows = {}
        for label, ours, theirs in (("step", dmuon_step, replicated_step),
                                    ("step + its communication", dmuon_with_comm, replicated_with_comm)):
            ours(), theirs()  # warm-up
            t_ours, t_theirs = [], []
            for r in range(REPEATS):
                pair = [(t_ours, ours), (t_theirs, theirs)]
                for times, fn in pair if r % 2 == 0 else pair[::-1]:
                    times.append(timed(fn))
            rows[label] = (statistics.median(t_ours), statistics.median(t_theirs))
        owned = sum(dmuon.ownership(model)[n] == ranks.rank for n in state.params)
        for label, (ours, theirs) in rows.items():
            distributed.print0(f"ROW | {ranks.world_size} | {label} | {ours * 1e3:.0f} | {theirs * 1e3:.0f} "
                               f"| {ours / theirs:.2f} |")
        distributed.print0(f"matrices: {len(state.params)}, rank 0 owns {owned}, threads per rank "
                           f"{torch.get_num_threads()}")


def measure(nproc: int) -> list[str]:
    """The table rows ("| W | what is timed | dmuon ms | replicated ms | ratio |") of one launch on nproc ranks."""
    from dmuon_edu.launch import torchrun

    result = torchrun(__file__, nproc=nproc, timeout=900, echo=False)
    rows = []
    for line in result.stdout(0).splitlines():
        if line.startswith("ROW "):
            rows.append(line[4:])
        elif line.startswith("matrices"):
            print(f"<!-- W={nproc}: {line} -->", file=sys.stderr)
    return rows


def main():
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; {LAYERS} layers of GPT-2-small shapes at d={D}, "
          "bf16 NS, median of slowest-rank times\n")
    print("| W ranks | what is timed | dmuon (ms) | replicated Muon (ms) | ratio dmuon / replicated |")
    print("|---|---|---|---|---|")
    for nproc in (2, 4):
        print("\n".join(measure(nproc)))


if __name__ == "__main__":
    worker() if "RANK" in os.environ else main()
