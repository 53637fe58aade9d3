"""Tensor parallelism for bench_step's GPT: its TP plan, and the naive whole-matrix Muon that dmuon's TP step must beat.

The plan is Megatron's on the course GPT's names (dmuon_edu/course/gpt.py): column-parallel
``qkv_proj`` and ``up_proj`` (weights ``Shard(0)``), row-parallel ``out_proj`` and
``down_proj`` (``Shard(1)``). One departure: the GPT fuses q, k and v into one ``qkv_proj``
whose forward splits the *full* width into three, so a rank's column shard (q and half of k)
is not a set of heads; its output is gathered back (``Replicate``) and every TP rank runs
the whole attention, and ``out_proj`` takes its input columns from that replicated
activation. The MLP is Megatron's exactly (the up_proj activation stays sharded). The
parameters are laid out as Megatron's, which is what the optimizers compared here see;
the extra activation traffic is the same in every TP setup.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dmuon_edu import muon

TP = 2  # the TP degree: (dp, tp) = (W / 2, 2)


# Each module's TP style: torch's, and the time model's name for it (dmuon_edu/dmuon/step_time.py).
PLAN = {
    "attn.qkv_proj": (lambda: ColwiseParallel(output_layouts=Replicate()), "colwise, gathered"),
    "attn.out_proj": (lambda: RowwiseParallel(input_layouts=Replicate()), "rowwise, from replicated"),
    "mlp.up_proj": (ColwiseParallel, "colwise"),
    "mlp.down_proj": (RowwiseParallel, "rowwise"),
}


def parallelize(model: nn.Module, tp_mesh) -> None:
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {module: style() for module, (style, _) in PLAN.items()})


def time_model_styles(n_layer: int) -> dict[str, str]:
    """The plan in the time model's words, {module name: style}; every TP rank runs the whole attention."""
    return {f"layers.{i}.{module}": name for i in range(n_layer) for module, (_, name) in PLAN.items()}


def _layout(p: torch.Tensor):
    """(mesh, placements, shape, stride) of a TP matrix: a DTensor (FSDP2 + TP), or the local shard that DDP's
    TP transform (torch.distributed.tensor.parallel.ddp) keeps, with the DTensor's spec in ``_st_info``."""
    spec = p._spec if isinstance(p, DTensor) else p._st_info
    return spec.mesh, spec.placements, spec.shape, spec.stride


class WholeMatrixMuon:
    """Muon whose every rank orthogonalises the whole matrix: the naive TP baseline.

    After the DP reduction (DDP's all-reduce or FSDP2's reduce-scatter) every rank gathers
    each TP-sharded gradient's full matrix (``full_tensor()``: over the TP group, and the DP
    group too under FSDP2), runs dmuon_edu.muon.Muon on the whole logical matrix (momentum,
    Newton-Schulz, the full shape's scale) and adds its own shard of the update. Every rank
    does every matrix's Newton-Schulz, where dmuon does each once, on its TP owner.
    """

    def __init__(self, params, **hyper):
        self.params = list(params)
        self.layouts = [_layout(p) for p in self.params]
        # Full-shape proxies, zero before each step, so that Muon leaves the update in them (as dmuon's tp.py does).
        self.proxies = [torch.zeros(shape, dtype=p.dtype, device=(p.to_local() if isinstance(p, DTensor) else p).device)
                        for p, (_, _, shape, _) in zip(self.params, self.layouts)]
        self.muon = muon.Muon(self.proxies, **hyper)

    def gather_gradients(self) -> None:
        for p, proxy, (mesh, placements, shape, stride) in zip(self.params, self.proxies, self.layouts):
            grad = p.grad if isinstance(p.grad, DTensor) else DTensor.from_local(
                p.grad, mesh, placements, run_check=False, shape=shape, stride=stride)
            proxy.zero_()
            proxy.grad = grad.full_tensor()

    def apply_updates(self) -> None:
        for p, proxy, (mesh, placements, _, _) in zip(self.params, self.proxies, self.layouts):
            # src_data_rank=None: each rank cuts its shard from its own copy, no communication
            mine = distribute_tensor(proxy, mesh, placements, src_data_rank=None).to_local()
            (p.to_local() if isinstance(p, DTensor) else p).add_(mine)
            proxy.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.gather_gradients()
        self.muon.step()
        self.apply_updates()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
