"""Module 7, the capstone: a small GPT on a noisy copy task, trained with AdamW, Muon and dmuon (Z2, Z3).

Notebook 7a trains in one process here. Notebook 7b's dmuon run is the learner's own
program, which :mod:`dmuon_edu.course.capstone_program` runs and grades with the
measurements here; this module's dmuon runs (``main``) give ``make bench`` its rows of
counted bytes (benchmarks/run_all.py).

Every run sees the same global batches: ``steps`` optimizer steps of ``accum_steps``
micro-batches of ``global_microbatch`` sequences. A single process takes each
micro-batch whole; on W ranks each rank takes its 1/W share of it, so that one
optimizer step covers the same tokens either way. The loop is the accumulation guide's,
corrected where the guide drops a leftover window (see :func:`train`): every
micro-batch but the last of a window runs inside ``dmuon.no_sync(model)`` (none on one
process), each loss divided by its window's length, then ``step`` and ``zero_grad``.

The problem (:mod:`dmuon_edu.course.capstone_problem`): text from a Markov source of
order 3 in which each token mostly repeats the one three before it, so a model must
attend three tokens back. Its floor, the lowest mean loss any model can reach on these
sequences, is computed exactly from the transition table (:meth:`Capstone.floor`). The
held-out loss is measured on ``eval_sequences`` fresh sequences, the same for every run.

One process (in a notebook)::

    result = run_single_process(Capstone(), "Muon")

dmuon on 2 ranks, from a notebook (``launch.torchrun(capstone.__file__, args=[...])``)
or a shell::

    torchrun --nproc-per-node=2 dmuon_edu/course/capstone.py results.json [--steps N] [--accum-steps K] [--modes Z2 Z3]

Rank 0 writes ``{mode: result}`` to the JSON file: the same fields as
:func:`run_single_process` returns, plus communication per optimizer step.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from dmuon_edu import distributed, dmuon
from dmuon_edu.accumulation import accumulation_windows
from dmuon_edu.course.capstone_problem import Capstone
from dmuon_edu.course.data import MarkovSource
from dmuon_edu.course.data_parallel import rank_share
from dmuon_edu.course.dmuon_problem import ResidencyProbe, per_rank
from dmuon_edu.course.gpt import is_hidden_matrix
from dmuon_edu.memory import peak_memory_bytes
from dmuon_edu.muon import Muon
from dmuon_edu.course.threads import one_thread

__all__ = [
    "RunResult",
    "OPTIMIZERS",
    "MODES",
    "single_process_optimizers",
    "train",
    "evaluate",
    "predictions",
    "learned_rows",
    "excess_loss",
    "local_microbatches",
    "run_single_process",
    "counted_bytes_per_step",
    "held_bytes",
]

OPTIMIZERS = ("AdamW", "Muon")  # in one process; dmuon runs under torchrun
# dmuon's modes: Z3 (reshard_after_forward=True) or Z2, with the accumulation guide's no_sync or without it.
MODES = ("Z2", "Z3", "Z2 without no_sync", "Z3 without no_sync")


@dataclass
class RunResult:
    losses: list[float]  # training loss of each optimizer step (the window's mean over the global batch)
    held_out_loss: float  # after training, on Capstone.held_out()
    step_seconds: float  # median wall time of an optimizer step (window + step), first and last excluded
    peak_bytes: int  # peak memory of the last optimizer step above its start (dmuon: per rank)
    held_bytes: int  # parameters + optimizer state a rank holds between steps (dmuon: per rank)
    learned_rows: list[list[float]]  # after training, on Capstone.held_out(): see learned_rows()
    excess: dict[str, float]  # after training, on Capstone.held_out(): see excess_loss()


def single_process_optimizers(name: str, model: nn.Module, capstone: Capstone,
                              predicate: Callable[[str, nn.Parameter], bool] = is_hidden_matrix,
                              ns_dtype: torch.dtype | str = "auto"):
    """AdamW on everything, or Muon on the matrices ``predicate`` selects (Newton-Schulz in ``ns_dtype``) and
    AdamW on the rest."""
    if name == "AdamW":
        return [torch.optim.AdamW(model.parameters(), lr=capstone.adamw_lr)]
    if name != "Muon":
        raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS} (dmuon runs under torchrun)")
    matrices = [p for n, p in model.named_parameters() if predicate(n, p)]
    others = [p for n, p in model.named_parameters() if not predicate(n, p)]
    return [Muon(matrices, lr=capstone.muon_lr, adjust_lr_fn=capstone.muon_scale, ns_dtype=ns_dtype),
            torch.optim.AdamW(others, lr=capstone.adamw_lr)]


def train(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], microbatches, accum_steps: int, *,
          no_sync: Callable | None = None, progress: bool = False) -> tuple[list[float], list[float], int]:
    """The accumulation guide's loop over ``microbatches``, corrected where the guide drops data; returns
    (loss per step, seconds per step, peak bytes of the last step).

    The guide steps only after each full window of ``accum_steps``, so micro-batches after
    the last full window are never stepped; here ``accumulation_windows`` keeps that short
    window and steps it, each loss divided by its own window's length.
    ``no_sync(model)`` wraps every micro-batch but the last of a window (dmuon.no_sync;
    None on one process, where there is nothing to hold back). A step's loss is the
    mean of its micro-batches' losses.
    """
    windows = list(accumulation_windows(microbatches, accum_steps))
    losses, seconds = [], []

    def optimizer_step(window):
        start = time.perf_counter()
        loss_sum = 0.0
        for i, (inputs, targets) in enumerate(window):
            is_accumulating = i < len(window) - 1
            with no_sync(model) if no_sync is not None and is_accumulating else nullcontext():
                loss = model(inputs, targets).loss / len(window)
                loss.backward()
            loss_sum += loss.item()
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()
        losses.append(loss_sum)
        seconds.append(time.perf_counter() - start)

    with tqdm(windows[:-1], total=len(windows), desc="optimizer steps", disable=not progress) as bar:
        for window in bar:
            optimizer_step(window)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        # The last step under the memory profiler (it slows that step, which the timing skips),
        # on the device the model lives on: a rank's GPU when torchrun runs on GPUs.
        peak = peak_memory_bytes(lambda: optimizer_step(windows[-1]), next(model.parameters()).device)
        bar.update()
    return losses, seconds, peak


@torch.no_grad()
def evaluate(model: nn.Module, tokens: torch.Tensor, batch: int = 256) -> float:
    """Mean next-token loss over ``tokens`` (sequences of seq_len + 1)."""
    total = sum(model(chunk[:, :-1], chunk[:, 1:]).loss.item() * chunk.shape[0] for chunk in tokens.split(batch))
    return total / tokens.shape[0]


@torch.no_grad()
def predictions(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T, V), float64: the model's next-token distribution at every input position of ``tokens``."""
    return torch.softmax(model(tokens[:, :-1]).logits.double(), dim=-1).cpu()


def learned_rows(source: MarkovSource, tokens: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """(V^k, V): the mean of ``predicted`` over the positions whose last k tokens are each context.

    The positions before the k-th token have no full context and are left out. For a
    Markov source of order k the best model predicts ``source.rows()[c]`` in context c,
    whatever came before: compare the two.
    """
    k, inputs = source.order, tokens[:, :-1].cpu()
    contexts = source.context_index(inputs).flatten()
    full = predicted[:, k - 1:].flatten(0, 1)
    sums = torch.zeros(source.vocab_size**k, source.vocab_size, dtype=torch.float64)
    sums.index_add_(0, contexts, full)
    return sums / sums.sum(dim=1, keepdim=True).clamp_min(1e-12)


def excess_loss(source: MarkovSource, tokens: torch.Tensor, predicted: torch.Tensor) -> dict[str, float]:
    """How far the model's predictions are from the source's, measured three ways on ``tokens``, nats per prediction.

    - ``model_minus_truth``: the model's loss minus the true distributions' loss on this
      very text. Its expectation given the contexts is ``mean_kl``; what remains is the
      text's noise, of standard error ``noise_se``.
    - ``mean_kl``: KL(truth || model) at each prediction, averaged over all of them.
    - ``kl_of_mean_rows`` and ``mean_kl_full_context``: over the predictions that have
      seen k tokens only, the KL of ``learned_rows`` (the model's predictions averaged
      within each context) against the true rows, and the mean KL of the same predictions
      unaveraged. KL is convex in the model's distribution, so averaging first can only
      lower it (Jensen): the difference is the averaging bias.
    """
    inputs, targets = tokens[:, :-1].cpu(), tokens[:, 1:].cpu()
    truth = source.next_token_distributions(inputs)
    kl = (truth * (truth.clamp_min(1e-300).log() - predicted.clamp_min(1e-300).log())).sum(dim=-1)
    log_ratio = (truth.gather(-1, targets.unsqueeze(-1)).log() - predicted.gather(-1, targets.unsqueeze(-1)).log()).squeeze(-1)
    k = source.order
    contexts = source.context_index(inputs).flatten()
    weights = torch.bincount(contexts, minlength=source.vocab_size**k).double() / contexts.numel()
    rows, mean_rows = source.rows(), learned_rows(source, tokens, predicted)
    row_kl = (rows * (rows.clamp_min(1e-300).log() - mean_rows.clamp_min(1e-300).log())).sum(dim=-1)
    return {
        "model_minus_truth": log_ratio.mean().item(),
        "noise_se": ((log_ratio - kl).std() / math.sqrt(kl.numel())).item(),
        "mean_kl": kl.mean().item(),
        "mean_kl_full_context": kl[:, k - 1:].mean().item(),
        "kl_of_mean_rows": (weights @ row_kl).item(),
    }


def local_microbatches(microbatches, rank: int, world_size: int):
    """This rank's equal share of each global micro-batch."""
    return [rank_share(batch, rank, world_size) for batch in microbatches]


def held_bytes(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes of parameters and optimizer state this rank holds between optimizer steps.

    A parameter counts with its local storage: an FSDP2 shard, a dedicated matrix only
    on its owner (``dmuon.held_bytes``: elsewhere it holds nothing between steps).
    """
    dedicated = getattr(model, "_dmuon", None)
    tensors = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()
               if dedicated is None or all(p is not q for q in dedicated.params.values())]
    for optimizer in optimizers:
        # dmuon.Muon keeps its state in its inner optimizers (Muon and AdamW on owned matrices, AdamW on shards).
        inner = optimizer._inner if isinstance(optimizer, dmuon.Muon) else (optimizer,)
        for state in (o.state for o in inner):
            for value in (v for entry in state.values() for v in entry.values()):
                if isinstance(value, torch.Tensor):
                    tensors.append(value.to_local() if isinstance(value, DTensor) else value)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) + (dmuon.held_bytes(model) if dedicated is not None else 0)


def run_single_process(capstone: Capstone, optimizer: str, predicate=is_hidden_matrix,
                       progress: bool = True) -> RunResult:
    """Train ``capstone.model()`` in this process with "AdamW" or "Muon" (matrices chosen by ``predicate``)."""
    model = capstone.model()
    optimizers = single_process_optimizers(optimizer, model, capstone, predicate)
    with one_thread():  # like each torchrun rank
        losses, seconds, peak = train(model, optimizers, capstone.microbatches(), capstone.accum_steps,
                                      progress=progress)
        held_out_loss, learned, excess = _examine(model, capstone)
    return RunResult(losses, held_out_loss, _typical(seconds), peak, held_bytes(model, optimizers), learned, excess)


def _examine(model: nn.Module, capstone: Capstone) -> tuple[float, list[list[float]], dict[str, float]]:
    """The trained model's held-out loss, learned rows and excess loss."""
    source, held_out = capstone.source(), capstone.held_out()
    device = next(model.parameters()).device
    predicted = predictions(model, held_out.to(device))
    return (evaluate(model, held_out.to(device)), learned_rows(source, held_out, predicted).tolist(),
            excess_loss(source, held_out, predicted))


def counted_bytes_per_step(p_m: int, accum_steps: int, zero3: bool, no_sync: bool) -> dict[str, int]:
    """dmuon's broadcast and reduce bytes per optimizer step, as count_comm counts them (whole tensor per call).

    With N = ``accum_steps`` micro-batches, Z3 broadcasts before every forward and every
    backward (2N P_M), Z2 once per step; the reduce runs once per step with no_sync, every
    micro-batch (N P_M) without. Times (W - 1) / W, on W ranks, these are the wire bytes per
    rank of the published formulas: with N = 1, 3 (W - 1)/W P_M for Z3 and 2 (W - 1)/W P_M for Z2.
    """
    n = accum_steps
    return {"broadcast": (2 * n if zero3 else 1) * p_m, "reduce": (1 if no_sync else n) * p_m}


def _typical(seconds: list[float]) -> float:
    # The first step creates optimizer state and warms caches; the last ran under the profiler.
    return statistics.median(seconds[1:-1] if len(seconds) > 2 else seconds)


def _run_dmuon(capstone: Capstone, mode: str, ranks, mesh) -> dict:
    zero3, uses_no_sync = mode.startswith("Z3"), "without" not in mode
    model = capstone.model().to(ranks.device)
    p_m = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if is_hidden_matrix(n, p))
    dmuon.dedicate_params(model, mesh, predicate=is_hidden_matrix, reshard_after_forward=zero3)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=capstone.muon_lr, adamw_lr=capstone.adamw_lr, adjust_lr_fn=capstone.muon_scale)
    probe = ResidencyProbe(model)
    microbatches = [tuple(t.to(ranks.device) for t in batch)
                    for batch in local_microbatches(capstone.microbatches(), ranks.rank, ranks.world_size)]
    with dmuon.count_comm() as counts:
        local_losses, seconds, peak = train(model, [optimizer], microbatches, capstone.accum_steps,
                                            no_sync=dmuon.no_sync if uses_no_sync else None)
    # Each rank's loss is its share's mean; the shares are equal, so the global loss is their mean.
    losses = torch.tensor(local_losses, dtype=torch.float64, device=ranks.device)
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)
    memory = per_rank((held_bytes(model, [optimizer]), peak, probe.peak, probe.gradient_peak))
    steps = len(local_losses)
    held_out_loss, learned, excess = _examine(model, capstone)
    return {
        **asdict(RunResult(losses.tolist(), held_out_loss, _typical(seconds), max(t[1] for t in memory),
                           max(t[0] for t in memory), learned, excess)),
        "held_bytes_per_rank": [t[0] for t in memory],
        "peak_bytes_per_rank": [t[1] for t in memory],
        "matrix_bytes_during_forward_per_rank": [t[2] for t in memory],
        "matrix_gradient_bytes_during_forward_per_rank": [t[3] for t in memory],
        "comm_per_step": {op: [counts.calls[op] // steps, counts.bytes[op] // steps] for op in sorted(counts.calls)},
        "predicted_per_step": counted_bytes_per_step(p_m, capstone.accum_steps, zero3, uses_no_sync),
        "P_M": p_m,
        "world_size": ranks.world_size,
        "backend": ranks.backend,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The capstone's dmuon runs, on the ranks torchrun starts.")
    parser.add_argument("results", type=Path, help="JSON file rank 0 writes the results to")
    parser.add_argument("--steps", type=int, default=Capstone.steps, help="optimizer steps per run")
    parser.add_argument("--accum-steps", type=int, default=Capstone.accum_steps, help="micro-batches per step")
    parser.add_argument("--modes", nargs="+", default=["Z2", "Z3"], choices=MODES)
    args = parser.parse_args(argv)

    capstone = Capstone(steps=args.steps, accum_steps=args.accum_steps)
    with distributed.session() as ranks:
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        results = {}
        for mode in args.modes:
            result = results[mode] = _run_dmuon(capstone, mode, ranks, mesh)
            # Two decimals of the first loss and the held-out loss only: they hold under other CPU kernels.
            distributed.print0(f"dmuon {mode} on {ranks.world_size} ranks: {len(result['losses'])} optimizer steps, "
                               f"loss {result['losses'][0]:.2f} at the first; held-out loss {result['held_out_loss']:.2f}")
        if dist.get_rank() == 0:
            args.results.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
