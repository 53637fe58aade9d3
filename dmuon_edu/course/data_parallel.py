"""The shared problem of the data-parallel exercises, and its single-process baseline.

Every rank builds the same seeded model and the same *global* data. A global
micro-batch of ``global_microbatch`` samples is split evenly over the ranks, so
one optimizer step of W ranks with N micro-batches each sees exactly the
``N * global_microbatch`` samples that the baseline sees as one batch.
Distributed runs are right when their parameters equal the baseline's after
every step; that is what :meth:`Problem.baseline` and :func:`report` check.
"""

from __future__ import annotations

from dataclasses import dataclass

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmuon_edu.course.checks import CheckResult
from dmuon_edu.distributed import print0

__all__ = ["Problem", "Traffic", "report", "ADAMW_TOLERANCE", "GRADIENT_RATIO_TOLERANCE"]

# AdamW on both sides. The distributed gradient adds the same terms as the
# baseline's in another order (per rank, then across ranks): ~1e-7 relative.
# Adam divides by sqrt(v), which amplifies that where a gradient component
# nearly cancels; measured below 1e-7 here after 3 steps. A real mistake (a
# missing average, a dropped micro-batch) moves parameters by more than 1e-3.
ADAMW_TOLERANCE = 1e-5
# ||averaged gradient|| / ||full-batch gradient||: float32 sums in another order move it by
# ~1e-7; a sum left undivided makes it W (2 or 4), a gradient averaged twice 1/W.
GRADIENT_RATIO_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Traffic:
    """What one row of a script's collectives should cost per optimizer step, and the mistake that
    costs otherwise. ``calls`` None grades the bytes only."""

    row: str
    calls: int | None
    nbytes: int
    mistake: str

    def problem(self, calls: int, nbytes: int) -> str | None:
        """Why the measured (calls, bytes) per optimizer step are wrong, with their cost; None if right."""
        expected = f"{self.nbytes} bytes" + (f" in {self.calls} call{'s' * (self.calls != 1)}" if self.calls else "")
        if nbytes != self.nbytes:
            cost = f"{nbytes / self.nbytes:.2g}x the traffic" if self.nbytes else "traffic where none is needed"
            return f"{self.row} moved {nbytes} bytes in {calls} calls per optimizer step where {expected} would do ({cost}): {self.mistake}"
        if self.calls is not None and calls != self.calls:
            return (f"{self.row} made {calls} calls per optimizer step where {expected} would do (the same bytes in "
                    f"{calls / self.calls:.2g}x the messages, each paying the network's latency): {self.mistake}")
        return None


@dataclass(frozen=True)
class Problem:
    n_windows: int = 3
    accum_steps: int = 4
    global_microbatch: int = 8
    seed: int = 0

    def model(self) -> nn.Module:
        """The same freshly initialised MLP on every call and every rank."""
        torch.manual_seed(self.seed)
        return nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))

    def optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    def loss_fn(self, predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(predictions, targets)

    def windows(self) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """``n_windows`` windows of ``accum_steps`` global micro-batches."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        teacher = torch.randn(16, 4, generator=generator)
        windows = []
        for _ in range(self.n_windows):
            window = []
            for _ in range(self.accum_steps):
                x = torch.randn(self.global_microbatch, 16, generator=generator)
                window.append((x, torch.sin(x @ teacher)))
            windows.append(window)
        return windows

    def local(self, batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int):
        """This rank's equal share of a global micro-batch."""
        return rank_share(batch, rank, world_size)

    def baseline(self) -> list[list[torch.Tensor]]:
        """Parameters after each optimizer step of one process that sees each whole window as one batch."""
        return [parameters for _, parameters in self.reference_steps()]

    def reference_steps(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """(full-batch gradients, parameters after the step) of each optimizer step of that one process."""
        model = self.model()
        optimizer = self.optimizer(model.parameters())
        steps = []
        for window in self.windows():
            x, y = (torch.cat(parts) for parts in zip(*window))
            optimizer.zero_grad()
            self.loss_fn(model(x), y).backward()
            gradients = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            steps.append((gradients, [p.detach().clone() for p in model.parameters()]))
        return steps


def report(
    exercise: str,
    differences: list[float],
    collectives: dict[str, tuple[int, int]],
    hint: str,
    measurements: dict | None = None,
    traffic: tuple[Traffic, ...] = (),
    gradient_ratios: list[float] | None = None,
    findings: tuple[str, ...] = (),
) -> CheckResult:
    """Print, on rank 0, how far each step is from the baseline and what was communicated; return the verdict.

    The verdict grades the lesson by its effects: the parameters against the
    baseline (``hint`` says what to do when they differ), every ``traffic`` row
    against what it should cost, and, where given, ``gradient_ratios`` (the norm of
    the gradient each step used over the full-batch gradient's) against 1; ``findings``
    are further problems the script measured (what a rank holds), each a FAIL.
    ``collectives`` maps a row label to (calls, bytes) per optimizer step.
    If the script was given a path as its first argument, rank 0 also writes
    everything, with any further ``measurements``, to that JSON file for plots
    and tests.
    """
    for step, difference in enumerate(differences, start=1):
        verdict = "matches" if difference < ADAMW_TOLERANCE else "DIFFERS from"
        print0(f"step {step}: {verdict} the single-process baseline (tolerance {ADAMW_TOLERANCE:.0e})")
    if collectives:
        width = max(len(label) for label in collectives)
        print0(f"{'per optimizer step':{width}}  calls     bytes")
        for label, (calls, nbytes) in collectives.items():
            print0(f"{label:{width}}  {calls:5d}  {nbytes:8d}")
    problems = []
    bad = [step for step, difference in enumerate(differences, start=1) if not difference < ADAMW_TOLERANCE]
    if bad:
        problems.append(f"parameters left the baseline at step {bad[0]}: {hint}")
    off = [ratio for ratio in gradient_ratios or () if not abs(ratio - 1) < GRADIENT_RATIO_TOLERANCE]
    if off:
        problems.append(_gradient_problem(off[0], dist.get_world_size()))
    problems += [problem for t in traffic if (problem := t.problem(*collectives[t.row])) is not None]
    problems += findings
    if problems:
        result = CheckResult(exercise, "FAIL", "; and ".join(problems))
    else:
        graded_traffic = ", with the traffic the exercise predicts" if traffic else ""
        result = CheckResult(exercise, "PASS", f"every step equals the single-process full-batch step "
                                               f"({len(differences)} steps){graded_traffic}")
    print0(result)
    if len(sys.argv) > 1 and dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps({
            "status": result.status,
            "differences": differences,
            "collectives": collectives,
            "measurements": measurements or {},
        }, indent=1))
    return result


def _gradient_problem(ratio: float, world_size: int) -> str:
    """What a gradient of ``ratio`` times the full-batch gradient's norm says about the averaging."""
    said = f"the averaged gradient is {ratio:.3g}x the full-batch gradient ({world_size} ranks): "
    if abs(ratio / world_size - 1) < GRADIENT_RATIO_TOLERANCE:
        return said + ("an all_reduce with SUM adds the ranks' gradients, so divide by the world size once (AdamW "
                       "hides a constant factor in the parameters; gradient clipping and eps do not)")
    if abs(ratio * world_size - 1) < GRADIENT_RATIO_TOLERANCE:
        return said + "it was divided by the world size twice (ReduceOp.AVG already averages): divide once"
    return said + ("it is not the average of the ranks' gradients: all-reduce every gradient over the ranks so that "
                   "each rank steps with the same average")


def rank_share(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """This rank's equal share of a global micro-batch: every tensor split along its first dimension."""
    size = batch[0].shape[0]
    if size % world_size:
        raise ValueError(
            f"a global micro-batch of {size} does not split evenly over {world_size} ranks; "
            "choose a world size that divides it"
        )
    return tuple(t.chunk(world_size)[rank] for t in batch)
