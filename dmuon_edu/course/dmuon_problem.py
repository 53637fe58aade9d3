"""The shared problem of module 6's dmuon exercises, and its single-process reference.

Module 5's problem (:class:`dmuon_edu.course.data_parallel.Problem`: the same seeded global
data on every rank, each rank taking its equal share of each micro-batch) with a model
that has Muon matrices: blocks under ``model.layers`` whose hidden matrices are named
``*_proj``, as in dmuon's accumulation guide. The model returns an object with ``.loss``, so every loop
of the module reads like the guide's (``model(batch).loss / accum_steps``).

The reference is one process that sees each whole window as one batch:
dmuon_edu.muon.Muon (float32 Newton-Schulz) on the dedicated matrices, AdamW on the
rest. A distributed run is right when, after every optimizer step, its parameters
equal the reference's, and the gradient each owner stepped with equals the
reference's gradient. The second check is needed because Newton-Schulz first
divides the update by its norm: a gradient summed over the ranks instead of averaged
gives the same Muon step, so parameters alone would not reveal a missing average.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmuon_edu import dmuon, muon
from dmuon_edu.course import data_parallel
from dmuon_edu.course.gpt import is_hidden_matrix

__all__ = [
    "Problem",
    "ReferenceStep",
    "is_dedicated",
    "dedicated_parameters",
    "seed_batches",
    "symmetric_parameters",
    "MUON_HYPERPARAMETERS",
    "ADAMW_LR",
    "full_parameters",
    "average_over_ranks",
    "broadcast_from_owners",
    "owner_gradient_difference",
    "per_rank",
    "ResidencyProbe",
]

WIDTH, HIDDEN, LAYERS = 32, 64, 3
# float32 Newton-Schulz on both sides, so that only the order of floating-point sums differs.
# adjust_lr_fn is given on both sides: dmuon.Muon's default scale (the public project's) is not
# dmuon_edu.muon.Muon's, and the reference must take the same step.
MUON_HYPERPARAMETERS = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype=torch.float32,
                            adjust_lr_fn="original")
ADAMW_LR = 1e-2  # module 5's AdamW learning rate, for everything that is not a Muon matrix


# The accumulation guide's predicate, as for the capstone's GPT: the hidden matrices get an owner rank and Muon.
is_dedicated = is_hidden_matrix


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up_proj = nn.Linear(WIDTH, HIDDEN)  # its bias stays with AdamW
        self.down_proj = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.down_proj(F.gelu(self.up_proj(self.norm(x))))


class Net(nn.Module):
    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.embed = nn.Linear(inputs, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, outputs)

    def forward(self, batch):
        x, y = batch
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return types.SimpleNamespace(loss=F.mse_loss(self.head(h), y))


@dataclass(frozen=True)
class ReferenceStep:
    parameters: list[torch.Tensor]  # after the step, in model.parameters() order
    gradients: dict[str, torch.Tensor]  # of the dedicated matrices, the step's full-batch gradient


@dataclass(frozen=True)
class Problem(data_parallel.Problem):
    def model(self) -> Net:
        """The same freshly initialised model on every call and every rank."""
        torch.manual_seed(self.seed)
        return Net(inputs=16, outputs=4)  # the shapes of module 5's data

    def muon(self, params) -> muon.Muon:
        return muon.Muon(list(params), **MUON_HYPERPARAMETERS)

    def optimizer(self, params) -> torch.optim.Optimizer:
        """AdamW, for the parameters that are not Muon matrices."""
        return torch.optim.AdamW(params, lr=ADAMW_LR)

    def baseline(self) -> list[ReferenceStep]:
        """One process, each window as one batch: parameters and dedicated gradients of every step."""
        model = self.model()
        dedicated = dedicated_parameters(model)
        optimizers = [self.muon(dedicated.values()), self.optimizer(symmetric_parameters(model))]
        steps = []
        for window in self.windows():
            batch = tuple(torch.cat(parts) for parts in zip(*window))
            model(batch).loss.backward()
            gradients = {name: p.grad.clone() for name, p in dedicated.items()}
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            steps.append(ReferenceStep([p.detach().clone() for p in model.parameters()], gradients))
        return steps


def seed_batches(n_batches: int, rank: int, batch_size: int = 32):
    """A dataloader for the accumulation guide's loop: this rank's own batches, from a fixed teacher the model can learn.

    (Module 5's data, sin(x @ teacher), is a fine test of equivalence but too hard a
    target to see a loss fall within a few steps at the accumulation guide's learning rates.)
    """
    teacher = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(16, 16, generator=teacher), torch.randn(16, 4, generator=teacher) / 4
    samples = torch.Generator().manual_seed(100 + rank)
    for _ in range(n_batches):
        x = torch.randn(batch_size, 16, generator=samples)
        yield x, torch.tanh(x @ w1) @ w2


def dedicated_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``{name: parameter}`` of the Muon matrices, in model order (the same on every rank)."""
    return {name: p for name, p in model.named_parameters() if is_dedicated(name, p)}


def symmetric_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if not is_dedicated(name, p)]


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter of a dmuon model, whole, in model.parameters() order, on every rank (a collective)."""
    full = dmuon.get_model_state_dict(model, dmuon.StateDictOptions(full_state_dict=True))
    return [full[name] for name, _ in model.named_parameters()]


def average_over_ranks(params) -> None:
    """Replace every p.grad by its mean over the ranks, with one all_reduce (module 5's exercise 1)."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    for g, averaged in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(averaged.view_as(g))


def broadcast_from_owners(dedicated: dict[str, nn.Parameter], owners: dict[str, int]) -> None:
    """Every rank receives each matrix's new values from its owner (in place)."""
    for name, p in dedicated.items():
        dist.broadcast(p.detach(), src=owners[name])


def owner_gradient_difference(stepped_with: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Largest |difference| between the gradient each owner stepped with and the reference's, over all ranks.

    ``stepped_with`` holds this rank's owned matrices only; None (no gradient arrived) counts
    as infinitely far. A collective: every rank calls it.
    """
    largest = max((float("inf") if g is None else (g - expected[name]).abs().max().item()
                   for name, g in stepped_with.items()), default=0.0)
    largest = torch.tensor(largest)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def per_rank(value):
    """``[value of rank 0, value of rank 1, ...]`` on every rank (a collective)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


class ResidencyProbe:
    """The most bytes of dedicated matrices this rank holds while any layer runs its forward.

    A forward pre-hook on each layer, registered after dmuon's own (so the layer's
    matrices have just been made resident), reads ``dmuon.held_bytes(model)`` at that
    moment. Exact and deterministic, unlike a profiler's peak.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.peak = 0
        for layer in model.layers:
            layer.register_forward_pre_hook(self._measure)

    def held_bytes(self) -> int:
        return dmuon.held_bytes(self.model)

    def _measure(self, _module, _args) -> None:
        self.peak = max(self.peak, self.held_bytes())
