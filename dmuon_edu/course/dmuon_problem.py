"""The shared problem of module 6's dmuon exercises, its single-process reference, and the code they share.

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

Shared by the scripts: the accumulation guide's set-up (:func:`prepare`) and training loop
(:func:`guide_loop`), a probe of what each rank holds (:class:`ResidencyProbe`), and why each
quantity of the module's predictions is what the runs measure (``RESIDENCY_REASONS``,
``Z2_Z3_REASONS``).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from dmuon_edu import dmuon, muon
from dmuon_edu.course import data_parallel
from dmuon_edu.course.gpt import is_hidden_matrix

__all__ = [
    "Problem",
    "ReferenceStep",
    "is_dedicated",
    "dedicated_parameters",
    "guide_batches",
    "guide_loop",
    "symmetric_parameters",
    "MUON_HYPERPARAMETERS",
    "ADAMW_LR",
    "full_parameters",
    "average_over_ranks",
    "broadcast_from_owners",
    "owner_gradient_difference",
    "per_rank",
    "ResidencyProbe",
    "RESIDENCY_REASONS",
    "Z2_Z3_REASONS",
    "UnevenProblem",
    "prepare",
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

# Why each quantity of module 6a's owners-only prediction is what the run measures (one field each).
RESIDENCY_REASONS = {
    ("between steps", 0): "between optimizer steps a non-owner keeps none of a matrix: a rank holds only the "
                          "matrices it owns",
    ("while a layer computes", 0): "a layer's forward needs its matrices whole: a rank holds its own and the "
                                   "running layer's matrices that other ranks own, no other layer's",
    ("in flight while a layer computes", 0): "the next layer's broadcast is issued before this layer computes "
                                             "(forward_prefetch_depth=1), into packed buffers: the other owners' part "
                                             "received, and the rank's own part copied to send",
}

# Why each count of module 6b's Z2/Z3 prediction is what the run counts (fields: broadcast, reduce, in P_M).
Z2_Z3_REASONS = {
    **{(f"Z3, {mode}", 0): "Z3 frees a layer's copies after its forward and broadcasts them again for its "
                           "backward: twice per micro-batch" for mode in ("no_sync", "no no_sync")},
    **{(f"Z2, {mode}", 0): "Z2 keeps the copies from the window's first forward until step(): once per window"
       for mode in ("no_sync", "no no_sync")},
    **{(f"Z{z}, no_sync", 1): "no_sync keeps each gradient on its rank until the window's last backward, which "
                              "reduces the sum once" for z in (2, 3)},
    **{(f"Z{z}, no no_sync", 1): "without no_sync every backward reduces its gradients to their owners: once "
                                 "per micro-batch" for z in (2, 3)},
}


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


    def last_microbatch_gradients(self) -> dict[str, torch.Tensor]:
        """The dedicated matrices' gradient of the first window's last micro-batch alone, divided by the window's
        micro-batches, at the initial parameters: what an owner steps with at step 1 when only the last
        micro-batch's gradient reached it."""
        model = self.model()
        window = self.windows()[0]
        (model(window[-1]).loss / len(window)).backward()
        return {name: p.grad.clone() for name, p in dedicated_parameters(model).items()}


def guide_loop(model: nn.Module, optimizer, dataloader, accum_steps: int, no_sync=dmuon.no_sync) -> list[float]:
    """The training loop of dmuon's accumulation guide ("Full Training Loop with Accumulation"), as written there.

    Every micro-batch but the last of each window runs inside ``no_sync(model)``, each
    loss divided by ``accum_steps``; after the last, ``optimizer.step()`` and
    ``optimizer.zero_grad()``. It steps when ``(i + 1) % accum_steps == 0``, so the
    micro-batches after the last whole window are never stepped (module 6c). Returns the loss
    it logs at each optimizer step: the last micro-batch's, times ``accum_steps``.
    """
    losses = []
    for i, batch in enumerate(dataloader):
        is_accumulating = (i + 1) % accum_steps != 0
        with no_sync(model) if is_accumulating else contextlib.nullcontext():
            loss = model(batch).loss / accum_steps
            loss.backward()
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item() * accum_steps)
    return losses


def guide_batches(n_batches: int, rank: int, batch_size: int = 32):
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
    """Replace every p.grad by its mean over the ranks, with one all_reduce."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    for g, averaged in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(averaged.view_as(g))


def broadcast_from_owners(dedicated: dict[str, nn.Parameter], owners: dict[str, int]) -> None:
    """Every rank receives each matrix's new values from its owner (in place)."""
    for name, p in dedicated.items():
        dist.broadcast(p.detach(), src=owners[name])


def owner_gradient_difference(stepped_with: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                              scale: float = 1.0) -> float:
    """Largest |difference| between the gradient each owner stepped with and ``scale`` times the reference's, over all ranks.

    ``stepped_with`` holds this rank's owned matrices only; None (no gradient arrived) counts
    as infinitely far. ``scale`` names a mistake by its factor (the world size: a sum for an
    average). A collective: every rank calls it.
    """
    largest = max((float("inf") if g is None else (g - scale * expected[name]).abs().max().item()
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
    """The most bytes of dedicated matrices, and of their gradients, this rank holds while any layer runs its forward.

    A forward pre-hook on each layer, registered after dmuon's own (so the layer's
    matrices have just been made resident, and the next layer's broadcast issued),
    reads at that moment ``dmuon.held_bytes(model)`` (``peak``), the broadcast buffers
    still in flight, ``dmuon.in_flight_bytes(model)`` (``in_flight_peak``, and the two
    together, ``total_peak``), and the gradients dmuon keeps for the dedicated matrices
    between backwards, in each matrix's record: ``accumulated_grad`` (inside no_sync, on
    every rank) and ``reduced_grad`` (on the owner). Exact and deterministic, unlike a
    profiler's peak.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.peak = self.in_flight_peak = self.total_peak = 0
        self.gradient_peak = 0
        for layer in model.layers:
            layer.register_forward_pre_hook(self._measure)

    def held_bytes(self) -> int:
        return dmuon.held_bytes(self.model)

    def held_gradient_bytes(self) -> int:
        records = [dmuon.record_of(p) for p in dedicated_parameters(self.model).values()]
        kept = [g for r in records for g in (r.accumulated_grad, r.reduced_grad)]
        return sum(g.numel() * g.element_size() for g in kept if g is not None)

    def _measure(self, _module, _args) -> None:
        held, in_flight = self.held_bytes(), dmuon.in_flight_bytes(self.model)
        self.peak = max(self.peak, held)
        self.in_flight_peak = max(self.in_flight_peak, in_flight)
        self.total_peak = max(self.total_peak, held + in_flight)
        self.gradient_peak = max(self.gradient_peak, self.held_gradient_bytes())


@dataclass(frozen=True)
class UnevenProblem(Problem):
    """Module 6's uneven windows: ranks with micro-batches of different sizes, and a short last window.

    The data of :class:`Problem`, cut short: its last window keeps only ``leftover`` of its
    ``accum_steps`` micro-batches, as when the data does not divide into whole windows. Each
    global micro-batch of ``global_microbatch`` samples is split over the ranks at random,
    every rank getting at least one sample and rank r a share that grows with r, so every
    rank runs the same number of micro-batches, of different sizes.
    """

    # 3 of accum_steps = 4: a short window divided by accum_steps (3/4x) must not look like a missing 1/W (1/2x).
    leftover: int = 3

    def windows(self) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        full = super().windows()
        return full[:-1] + [full[-1][:self.leftover]]

    def splits(self, world_size: int) -> list[list[list[int]]]:
        """``splits[w][i][r]``: how many samples of micro-batch i of window w rank r holds."""
        generator = torch.Generator().manual_seed(self.seed + 2)
        odds = torch.arange(1.0, world_size + 1)

        def split():
            # One sample each, then the rest drawn with odds rising by rank: ranks differ by design, not only by chance.
            drawn = torch.multinomial(odds, self.global_microbatch - world_size, replacement=True, generator=generator)
            return (1 + drawn.bincount(minlength=world_size)).tolist()

        return [[split() for _ in window] for window in self.windows()]

    def rank_windows(self, world_size: int) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
        """``rank_windows(W)[w][i][r]``: rank r's part (x, y) of micro-batch i of window w."""
        return [[tuple(zip(x.split(sizes), y.split(sizes))) for (x, y), sizes in zip(window, window_splits)]
                for window, window_splits in zip(self.windows(), self.splits(world_size))]

    def stream(self, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rank ``rank``'s micro-batches, in order: what its dataloader yields."""
        return [batch[rank] for window in self.rank_windows(world_size) for batch in window]

    def reference_steps(self, world_size: int, with_muon: bool) -> list[data_parallel.WeightedStep]:
        """One process that sees each whole window, short or not, as one batch.

        With ``with_muon``, Muon on the dedicated matrices and AdamW on the rest, and the
        gradients are the dedicated matrices' (what dmuon's owners step with); otherwise
        AdamW on everything (as under DDP), and the gradients are every parameter's.
        """
        model = self.model()
        params = list(model.parameters())
        dedicated = list(dedicated_parameters(model).values())
        graded = dedicated if with_muon else params
        optimizers = ([self.muon(dedicated), self.optimizer(symmetric_parameters(model))] if with_muon
                      else [self.optimizer(params)])
        steps = []
        for window, by_batch, window_splits in zip(self.windows(), self.rank_windows(world_size),
                                                  self.splits(world_size)):
            by_rank = list(zip(*by_batch))  # by_rank[r][i]
            means = [[model(batch).loss for batch in rank] for rank in by_rank]
            gradients = data_parallel.microbatch_gradients(graded, means)
            mistakes = {mistake: data_parallel.weighted(gradients, weights)
                        for mistake, weights in self.mistakes(list(zip(*window_splits)))}
            model(tuple(torch.cat(parts) for parts in zip(*window))).loss.backward()
            gradient = data_parallel.flat_gradient(graded)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            steps.append(data_parallel.WeightedStep([p.detach().clone() for p in params], gradient, mistakes))
        return steps

    def mistakes(self, sizes: list[list[int]]) -> list[tuple[str, list[list[float]]]]:
        """(mistake, the weight it gives each (rank, micro-batch)'s mean loss once the ranks are averaged).

        ``sizes[r][i]`` counts rank r's samples in micro-batch i. Right is n_ri / n, n the
        window's samples on all ranks.
        """
        world_size, microbatches = len(sizes), len(sizes[0])
        window = sum(map(sum, sizes))
        full = self.accum_steps * self.global_microbatch
        return [
            ("every micro-batch weighted equally, but the ranks' micro-batches hold different numbers of samples: "
             "weight each by its share of the window's samples on all ranks",
             [[1 / (world_size * microbatches)] * microbatches for _ in sizes]),
            (f"the short window was divided as if it held accum_steps = {self.accum_steps} micro-batches "
             f"({full} samples) where it holds {microbatches} ({window}): divide by the samples it holds",
             [[n / full for n in rank] for rank in sizes]),
            ("each rank divided by its own sample count: divide by the window's count over all ranks (one "
             "all_reduce)",
             [[n / (world_size * sum(rank)) for n in rank] for rank in sizes]),
            (f"the ranks' gradients were averaged, divided by the world size ({world_size}), after the division by "
             "the window's sample count: multiply each loss by dist.get_world_size()",
             [[n / (world_size * window) for n in rank] for rank in sizes]),
            ("only each window's last micro-batch reached the step: a zero_grad() inside the micro-batch loop "
             "cleared the others",
             [[0.0] * (microbatches - 1) + [rank[-1] / window] for rank in sizes]),
        ]

    def never_trained(self, steps: int) -> str | None:
        """Which samples a run of ``steps`` optimizer steps never trained on; None if it took every step."""
        windows = self.windows()
        if steps >= len(windows):
            return None
        sizes = [sum(len(x) for x, _ in window) for window in windows]
        first, total = sum(sizes[:steps]), sum(sizes)
        said = (f"{steps} optimizer steps where the data holds {len(windows)} windows: samples {first}-{total - 1} "
                f"({total - first} of {total}) were never trained on")
        if steps < len(windows) - 1:
            return said
        return (said + f", the short last window's {len(windows[-1])} micro-batches: a loop that steps when "
                "(i + 1) % accum_steps == 0, as the accumulation guide's does, never reaches it")


def prepare(model: nn.Module, mesh, zero3: bool = True, **optimizer_settings) -> dmuon.Muon:
    """The accumulation guide's set-up: dedicate the matrices, fully_shard each layer then the model, dmuon.Muon.

    ``optimizer_settings`` default to the reference's (MUON_HYPERPARAMETERS, ADAMW_LR).
    """
    dmuon.dedicate_params(model, mesh, predicate=is_dedicated, reshard_after_forward=zero3)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return dmuon.Muon(model, **(optimizer_settings or dict(MUON_HYPERPARAMETERS, adamw_lr=ADAMW_LR)))
