"""The public dmuon tp-dp example's call order (TP, dedicate_params(model, mesh["dp"]), fully_shard(mesh["dp"]),
dmuon.Muon), unchanged but for "cpu" and gloo, on 4 ranks (2 dp x 2 tp), next to one process on the same batch
(every replica gets the same batch, so its average is the full batch): rank 0 prints each step's max |difference|.

After it, beyond the public example, on the same layout: one step's collectives as count_comm counts them and as
summarize_comm_plan plans them, and the order check's store round trips in it (every rank prints a "plan" line);
the public API issue 24 added (param_groups, the Polar Express ns_backend, clip_grad_norm_ in both forms, a hook
boundary predicate, order_check="off") against one process with the same groups, coefficients and clipping (rank 0
prints an "api" line).
"""
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from dmuon_edu import dmuon
class Attn(nn.Module):
    def __init__(s, d=16):
        super().__init__(); s.q_proj=nn.Linear(d,d,bias=False); s.k_proj=nn.Linear(d,d,bias=False); s.v_proj=nn.Linear(d,d,bias=False); s.o_proj=nn.Linear(d,d,bias=False)
    def forward(s,x): return s.o_proj(torch.tanh(s.q_proj(x))*s.k_proj(x)+s.v_proj(x))
class MLP(nn.Module):
    def __init__(s,d=16,f=32):
        super().__init__(); s.gate_proj=nn.Linear(d,f,bias=False); s.up_proj=nn.Linear(d,f,bias=False); s.down_proj=nn.Linear(f,d,bias=False)
    def forward(s,x): return s.down_proj(torch.nn.functional.silu(s.gate_proj(x))*s.up_proj(x))
class Block(nn.Module):
    def __init__(s): super().__init__(); s.attn=Attn(); s.mlp=MLP(); s.n=nn.LayerNorm(16)
    def forward(s,x): x = x + s.attn(s.n(x)); return x + s.mlp(s.n(x))
class Net(nn.Module):
    def __init__(s): super().__init__(); s.layers=nn.ModuleList(Block() for _ in range(2)); s.head=nn.Linear(16,1,bias=False)
    def forward(s,x):
        for l in s.layers: x=l(x)
        return s.head(x).sum()
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(42); model = Net()
for layer in model.layers:
    parallelize_module(layer.attn, mesh["tp"], {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    parallelize_module(layer.mlp, mesh["tp"], {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
dmuon.dedicate_params(model, mesh["dp"], predicate=lambda n, p: "proj" in n and p.ndim == 2)
for layer in model.layers: fully_shard(layer, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
opt = dmuon.Muon(model, lr=0.02, momentum=0.95, adamw_lr=1e-3, ns_dtype=torch.float32)
from dmuon_edu import muon
torch.manual_seed(42); ref = Net()
sel = lambda n, p: "proj" in n and p.ndim == 2
ro = [muon.Muon([p for n, p in ref.named_parameters() if sel(n, p)], lr=0.02, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32),
      torch.optim.AdamW([p for n, p in ref.named_parameters() if not sel(n, p)], lr=1e-3, weight_decay=0.01)]
for step in range(3):
    opt.zero_grad(); torch.manual_seed(step); x = torch.randn(4, 8, 16)
    loss = model(x); loss.backward(); opt.step()
    ref(x).backward()
    for o in ro: o.step(); o.zero_grad()
    sd = dmuon.get_model_state_dict(model, dmuon.StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        diff = max((sd[n].cpu() - p.detach()).abs().max().item() for n, p in ref.named_parameters())
        print(f"step {step} max_abs_diff={diff}", flush=True)

# ---- beyond the public example (tests/test_dmuon.py reads the "plan" and "api" lines) ----
import json
from functools import partial
from dmuon_edu.newton_schulz import newton_schulz
plan = dmuon.summarize_comm_plan(model)["totals"]
trips = [o.round_trips for o in model._dmuon.orders]  # the order check's store round trips (order.py), per axis
first = [o.issued for o in model._dmuon.orders]
with dmuon.count_comm() as counted:
    opt.zero_grad(); loss = model(torch.randn(4, 8, 16)); loss.backward(); opt.step()
collective_events = [sum(1 for n, what in o.log if n >= f and not what.startswith("the forward of"))
                     for o, f in zip(model._dmuon.orders, first)]
print("plan " + json.dumps({"planned": {k: plan[k] for k in ("broadcast_tensor_bytes", "stage1_shard_reduce_tensor_bytes",
                                                              "tp_gather_tensor_bytes_this_rank", "tp_scatter_tensor_bytes_this_rank")},
                            "counted": {k: counted.bytes.get(k, 0) for k in ("broadcast", "reduce", "gather", "scatter")},
                            "round_trips_in_step_4": [o.round_trips - t for o, t in zip(model._dmuon.orders, trips)],
                            "collective_events_in_step_4": collective_events,
                            "round_trips_in_steps_1_to_3": trips}), flush=True)
class PolarExpressMuon(muon.Muon):  # the reference of ns_backend=POLAR_EXPRESS
    def _orthogonaliser(self, group):
        return partial(newton_schulz, steps=group["ns_steps"], coefficients=dmuon.POLAR_EXPRESS_COEFFICIENTS, dtype=group["ns_dtype"], gram_space=False)
torch.manual_seed(42); model = Net()
for layer in model.layers:
    parallelize_module(layer.attn, mesh["tp"], {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    parallelize_module(layer.mlp, mesh["tp"], {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
dmuon.dedicate_params(model, mesh["dp"], sel, hook_boundary_predicate=lambda m: isinstance(m, Block))
for layer in model.layers: fully_shard(layer, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
groups = lambda m: [{"params": [p for p in m.parameters() if p.ndim < 2], "group_name": "no_decay", "weight_decay": 0.0},
                    {"params": [p for p in m.parameters() if p.ndim == 2], "group_name": "rest", "muon_lr": 0.01, "adamw_lr": 5e-3}]
opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, param_groups=groups(model), ns_dtype=torch.float32, order_check="off",
                 ns_backend=dmuon.NewtonSchulz("direct", coefficients=dmuon.POLAR_EXPRESS_COEFFICIENTS))
torch.manual_seed(42); ref = Net()
named = dict(ref.named_parameters())
ro = [PolarExpressMuon([p for n, p in named.items() if sel(n, p)], lr=0.01, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32),
      torch.optim.AdamW([{"params": [p for p in named.values() if p.ndim < 2], "weight_decay": 0.0},
                         {"params": [p for n, p in named.items() if p.ndim == 2 and not sel(n, p)], "lr": 5e-3}], lr=1e-3, weight_decay=0.01)]
diffs, norms = [], []
for step in range(2):
    opt.zero_grad(); torch.manual_seed(step); x = torch.randn(4, 8, 16)
    model(x).backward()
    muon_norm = opt.clip_grad_norm_(None).total_norm.item()  # measured only: the Muon gradients
    clipped = dmuon.clip_grad_norm_(model, 1.0).total_norm.item()  # every gradient, clipped to 1
    opt.step()
    ref(x).backward()
    ref_muon_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for n, p in named.items() if sel(n, p)])).item()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
    for o in ro: o.step(); o.zero_grad()
    norms.append([abs(muon_norm - ref_muon_norm) / ref_muon_norm, abs(clipped - ref_norm) / ref_norm, ref_norm])
    sd = dmuon.get_model_state_dict(model, dmuon.StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        diffs.append(max((sd[n].cpu() - p.detach()).abs().max().item() for n, p in ref.named_parameters()))
if dist.get_rank() == 0:
    torch.manual_seed(42)
    moved = max((p.detach() - q).abs().max().item() for p, q in zip(ref.parameters(), Net().parameters()))
    print("api " + json.dumps({"max_abs_diff": max(diffs), "largest_change": moved, "norm_rel_diffs": norms,
                               "groups": [g["group_name"] for g in opt.param_groups],
                               "units": [u.path for u in model._dmuon.units],
                               "round_trips_with_order_check_off": [o.round_trips for o in model._dmuon.orders]}), flush=True)
dist.destroy_process_group()
