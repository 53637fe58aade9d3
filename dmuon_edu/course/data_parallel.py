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
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmuon_edu.accumulation import IGNORE_INDEX, summed_token_loss
from dmuon_edu.course.checks import CheckResult
from dmuon_edu.distributed import print0

__all__ = ["Problem", "Traffic", "report", "max_over_ranks", "prediction_findings", "DDP_NO_SYNC_REASONS",
           "FSDP2_BUDGETS", "fsdp2_budget_findings", "ADAMW_TOLERANCE", "GRADIENT_RATIO_TOLERANCE", "BackwardLog",
           "buckets_per_sync", "overlap_problems", "optimizer_state_bytes",
           "TokenProblem", "WeightedStep", "weighting_findings"]

# AdamW on both sides. The distributed gradient adds the same terms as the
# baseline's in another order (per rank, then across ranks): ~1e-7 relative.
# Adam divides by sqrt(v), which amplifies that where a gradient component
# nearly cancels; measured below 1e-7 here after 3 steps. A real mistake (a
# missing average, a dropped micro-batch) moves parameters by more than 1e-3.
ADAMW_TOLERANCE = 1e-5
# ||averaged gradient|| / ||full-batch gradient||: float32 sums in another order move it by
# ~1e-7; a sum left undivided makes it W (2 or 4), a gradient averaged twice 1/W.
GRADIENT_RATIO_TOLERANCE = 1e-4
VERDICT_PROBLEMS = 2  # a verdict names the first two problems a check found; the rest print above it


@dataclass(frozen=True)
class Traffic:
    """What one row of a script's collectives should cost per optimizer step, and the mistake that
    costs otherwise. ``calls`` None grades the bytes only; with ``at_most``, ``calls`` is a ceiling:
    the same bytes packed into fewer calls are right too."""

    row: str
    calls: int | None
    nbytes: int
    mistake: str
    at_most: bool = False

    def problem(self, calls: int, nbytes: int) -> str | None:
        """Why the measured (calls, bytes) per optimizer step are wrong, with their cost; None if right."""
        expected = f"{self.nbytes} bytes" + (
            f" in {'at most ' if self.at_most else ''}{self.calls} call{'s' * (self.calls != 1)}" if self.calls else "")
        if nbytes != self.nbytes:
            cost = f"{nbytes / self.nbytes:.2g}x the traffic" if self.nbytes else "traffic where none is needed"
            return f"{self.row} moved {nbytes} bytes in {calls} calls per optimizer step where {expected} would do ({cost}): {self.mistake}"
        if self.calls is not None and (calls > self.calls if self.at_most else calls != self.calls):
            return (f"{self.row} made {calls} calls per optimizer step where {expected} would do (the same bytes in "
                    f"{calls / self.calls:.2g}x the calls, and each call has a fixed cost whatever its size): {self.mistake}")
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
    passed: str | None = None,
) -> CheckResult:
    """Print, on rank 0, how far each step is from the baseline and what was communicated; return the verdict.

    The verdict grades the lesson by its effects: the parameters against the
    baseline (``hint`` says what to do when they differ), every ``traffic`` row
    against what it should cost, and, where given, ``gradient_ratios`` (the norm of
    the gradient each step used over the full-batch gradient's) against 1; ``findings``
    are further problems the script measured (what a rank holds), each a FAIL, named
    first. The verdict names the first two problems; where there are more, all are
    printed above it. ``passed``
    replaces the PASS message where the exercise is not the steps themselves (a prediction).
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
    # The lesson's own measurements first, then the gradient, then the traffic it causes.
    problems = list(findings)
    off = [ratio for ratio in gradient_ratios or () if not abs(ratio - 1) < GRADIENT_RATIO_TOLERANCE]
    if off:
        problems.append(_gradient_problem(off[0], dist.get_world_size()))
    problems += [problem for t in traffic if (problem := t.problem(*collectives[t.row])) is not None]
    bad = [step for step, difference in enumerate(differences, start=1) if not difference < ADAMW_TOLERANCE]
    if bad and not problems:  # the hint only where nothing more specific says why
        problems = [f"parameters left the baseline at step {bad[0]}: {hint}"]
    if len(problems) > VERDICT_PROBLEMS:  # the verdict stays short; every problem is still shown
        print0("the check found:")
        for problem in problems:
            print0(f"  - {problem}")
    if problems:
        more = len(problems) - VERDICT_PROBLEMS
        result = CheckResult(exercise, "FAIL", "; and ".join(problems[:VERDICT_PROBLEMS])
                             + (f" (and {more} more above)" if more > 0 else ""))
    elif passed is not None:
        result = CheckResult(exercise, "PASS", passed)
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


def prediction_findings(prediction, measured: dict[str, tuple], fields: tuple[str, ...],
                        why: dict[tuple[str, int], str], tolerance: float = 0.0) -> list[str]:
    """What a learner's prediction got wrong, entry by entry, each with the reason the run behaved as it did.

    ``measured`` maps each key to one value per field (a bool, or a number); ``prediction``
    must map the same keys to as many values. A number is right within ``tolerance``, a bool
    when equal. ``why[key, field index]`` says why the measured value is what it is.
    """
    if not isinstance(prediction, dict) or sorted(map(str, prediction)) != sorted(measured):
        return [f"the prediction must be a dict with an entry for each of: {', '.join(measured)}"]
    findings = []
    for key, values in measured.items():
        guess = prediction[key] if isinstance(prediction[key], (tuple, list)) else (prediction[key],)
        if len(guess) != len(values):
            findings.append(f"{key}: predict {len(values)} values ({', '.join(fields)}), not {guess!r}")
            continue
        for index, (field, value, guessed) in enumerate(zip(fields, values, guess)):
            wrong = (bool(guessed) != value if isinstance(value, bool)
                     else not abs(float(guessed) - value) <= tolerance)
            if wrong:
                shown, said = ((value, guessed) if isinstance(value, bool) else
                               (f"{value:.3g}", f"{guessed:.3g}" if isinstance(guessed, float) else repr(guessed)))
                findings.append(f"{key}: {field} {shown}, not {said}: {why[key, index]}")
    return findings


# Why each no_sync placement of module 5a's DDP exercise does what it does (its fields: calls, equal to one process).
DDP_NO_SYNC_REASONS = {
    ("backward_inside", 0): "DDP decides in the forward whether the coming backward syncs, so no_sync around the "
                            "backward alone turns nothing off",
    ("backward_inside", 1): "the extra all-reduces average partial sums, and averaging commutes with adding",
    ("forward_and_backward_inside", 0): "only the last micro-batch, outside no_sync, all-reduces: once, the sum of all",
    ("forward_and_backward_inside", 1): "the one all-reduce averages the window's whole sum",
    ("forward_inside", 0): "DDP decides in the forward whether the coming backward syncs: a forward inside no_sync "
                           "turns its backward's all-reduce off",
    ("forward_inside", 1): "the last backward all-reduces the sum of all four micro-batches",
    ("every_micro_batch_inside", 0): "no micro-batch left no_sync, so nothing was all-reduced",
    ("every_micro_batch_inside", 1): "nothing was averaged: each rank stepped with its own gradient, and the ranks "
                                     "drifted apart",
}


# Module 5a's FSDP2 exercise: the memory budgets it is run at, in units of P (the parameter bytes), each
# between two of the switches' costs (P / W, P, 2 P on 2 ranks), so that no answer sits on a boundary.
FSDP2_BUDGETS = (0.75, 1.25, 2.5)


def fsdp2_budget_findings(rows: dict[str, tuple[int, int]], parameter_bytes: int, shard_bytes: int,
                          microbatches: int, layers: int) -> tuple[str, ...]:
    """What module 5a's FSDP2 exercise did wrong at each of FSDP2_BUDGETS, read from its collectives.

    ``rows`` holds "all_gather, budget B P" and "reduce_scatter, budget B P": (calls, bytes) per
    optimizer step. The two switches show in the counts: a reduce-scatter per layer in every
    backward (sync on every micro-batch) or only in the last; an all-gather per layer in every
    forward and backward, or, with the parameters kept gathered after backward, only in the
    first forward and the backwards. Between micro-batches a rank then keeps its gradient shard
    or the whole gradient, and the gathered parameters (P bytes) or not.
    """
    P = parameter_bytes
    options = {}  # (sync every micro-batch, keep gathered) -> (bytes kept between micro-batches, bytes sent)
    for every in (True, False):
        for kept in (True, False):
            gathers = (microbatches + 1 if kept else 2 * microbatches) * P
            options[every, kept] = ((shard_bytes if every else P) + (P if kept else 0),
                                    gathers + (microbatches if every else 1) * P)
    findings = []
    for share in FSDP2_BUDGETS:
        label, budget = f"budget {share:g} P", share * P
        (gather_calls, gathered), (scatter_calls, scattered) = rows[f"all_gather, {label}"], rows[f"reduce_scatter, {label}"]
        if scatter_calls == 0:
            continue  # never synced: the parameters' own hint says it
        every, kept = scatter_calls == microbatches * layers, gather_calls < 2 * microbatches * layers
        if gather_calls not in (2 * microbatches * layers, (microbatches + 1) * layers) or \
                scatter_calls not in (layers, microbatches * layers):
            findings.append(f"{label}: {gather_calls} all-gathers and {scatter_calls} reduce-scatters per optimizer "
                            "step, which no setting of the two switches gives: set both before each micro-batch's forward")
            continue
        held, sent = options[every, kept]
        best = min(sent for memory, sent in options.values() if memory <= budget)
        if held > budget:
            what = ("the gathered parameters too (P bytes more)" if kept and options[every, False][0] <= budget
                    else "the whole unsharded gradient (P bytes), since the reduce-scatter waited for the last micro-batch")
            findings.append(f"{label}: a rank kept {held} bytes between micro-batches where the budget is {budget:.0f}: "
                            f"it kept {what}")
        elif sent > best:
            why = ("the whole gradient fits: skip the reduce-scatter until the window's last micro-batch" if every
                   and options[False, kept][0] <= budget else
                   "the gathered parameters fit too: keep them after every backward but the last")
            findings.append(f"{label}: {sent} bytes sent per optimizer step where {best} fit the budget "
                            f"({sent / best:.2g}x the traffic): {why}")
    return tuple(findings)


def max_over_ranks(value: float) -> float:
    """The largest of every rank's ``value``, on every rank (a collective)."""
    largest = torch.tensor(float(value))
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def _gradient_problem(ratio: float, world_size: int) -> str:
    """What a gradient of ``ratio`` times the full-batch gradient's norm says about the averaging."""
    said = f"the averaged gradient is {ratio:.3g}x the full-batch gradient ({world_size} ranks): "
    if abs(ratio / world_size - 1) < GRADIENT_RATIO_TOLERANCE:
        return said + ("a SUM adds the ranks' gradients, so divide by the world size once (AdamW hides most of "
                       "the factor; clipping and SGD do not)")
    if abs(ratio * world_size - 1) < GRADIENT_RATIO_TOLERANCE:
        return said + "it was divided by the world size twice (ReduceOp.AVG already averages): divide once"
    return said + "it is not the average of the ranks' gradients, which every rank must step with"


def rank_share(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """This rank's equal share of a global micro-batch: every tensor split along its first dimension."""
    size = batch[0].shape[0]
    if size % world_size:
        raise ValueError(
            f"a global micro-batch of {size} does not split evenly over {world_size} ranks; "
            "choose a world size that divides it"
        )
    return tuple(t.chunk(world_size)[rank] for t in batch)


# --------------------------------------------------------------- windows weighted by their items (tokens, samples)
# Module 5's token-weighted exercise and module 6's uneven windows grade how a run weighted
# its micro-batches. Each known way of weighting them is a weight per (rank, micro-batch) on
# that micro-batch's gradient; the run's gradient is named by the way whose gradient it is.


@dataclass(frozen=True)
class WeightedStep:
    """One optimizer step of a single-process reference, and what each known mistake would have stepped with.

    ``gradient`` is the step's full-batch gradient (one backward of the whole window) and
    ``mistakes`` maps a mistake's description to the gradient it gives, all flattened and at
    the parameters before the step (the run's own, until its first wrong step).
    """

    parameters: list[torch.Tensor]  # after the step
    gradient: torch.Tensor
    mistakes: dict[str, torch.Tensor]


def flat_gradient(params) -> torch.Tensor:
    """Every parameter's ``.grad``, flattened and concatenated in order."""
    return torch.cat([p.grad.flatten() for p in params])


def microbatch_gradients(params: list[torch.Tensor], losses: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """The flat gradient of each loss in ``losses[rank][micro-batch]``, with respect to ``params``."""
    return [[torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]) for loss in rank] for rank in losses]


def weighted(gradients: list[list[torch.Tensor]], weights: list[list[float]]) -> torch.Tensor:
    """sum over ranks r and micro-batches i of weights[r][i] * gradients[r][i]."""
    return sum(w * g for rank_g, rank_w in zip(gradients, weights) for g, w in zip(rank_g, rank_w))


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return ((a - b).norm() / b.norm()).item()


def weighting_findings(runs: dict[str, tuple[list[torch.Tensor], list[WeightedStep]]]) -> tuple[str, ...]:
    """Each run's first step whose gradient is not the full-batch one, its cost, and the known mistake it is.

    ``runs`` maps a run's name to (the flat gradient each of its optimizer steps stepped
    with, its reference). A gradient is right within GRADIENT_RATIO_TOLERANCE of the
    reference's norm (float32 sums in another order: ~1e-7), and a known mistake's when as
    close to that one's. Runs wrong at the same step by the same mistake share one finding.
    """
    costs: dict[tuple[int, str], list[str]] = {}
    for run, (stepped, reference) in runs.items():
        for step, (gradient, expected) in enumerate(zip(stepped, reference), start=1):
            off = relative_distance(gradient, expected.gradient)
            if off < GRADIENT_RATIO_TOLERANCE:
                continue
            ratio = (gradient.norm() / expected.gradient.norm()).item()
            named = [mistake for mistake, wrong in expected.mistakes.items()
                     if relative_distance(gradient, wrong) < GRADIENT_RATIO_TOLERANCE]
            diagnosis = named[0] if named else ("no known weighting gives it: weight each micro-batch by its share of "
                                                "the window's items over all ranks, counted with one all_reduce")
            costs.setdefault((step, diagnosis), []).append(f"{ratio:.2f}x its norm, {off:.0%} of its norm away ({run})")
            break
    return tuple(f"step {step}'s gradient against the full-batch one: {'; '.join(cost)}: {diagnosis}"
                 for (step, diagnosis), cost in costs.items())


@dataclass(frozen=True)
class TokenProblem:
    """Module 5's token-weighted exercise: micro-batches of padded sequences, uneven in tokens.

    Every rank holds ``sequences`` sequences per micro-batch, each padded to ``max_length``
    and of a random length from 1 to ``max_length * (rank + 1) / world_size`` tokens (so
    the ranks differ in tokens by design, not only by chance); the targets of padding are
    IGNORE_INDEX. So every rank and every micro-batch holds a different number of real
    tokens. The model predicts each token's successor (3 t + 1 mod vocab) from the token alone.
    """

    n_windows: int = 3
    accum_steps: int = 4
    sequences: int = 3
    max_length: int = 12
    vocab: int = 16
    seed: int = 0

    def model(self) -> nn.Module:
        """The same freshly initialised model on every call and every rank."""
        torch.manual_seed(self.seed)
        return nn.Sequential(nn.Embedding(self.vocab, 32), nn.Tanh(), nn.Linear(32, self.vocab))

    optimizer = Problem.optimizer  # module 5's AdamW

    def windows(self, world_size: int) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
        """``windows[w][i][r]``: rank r's (tokens, targets) of micro-batch i of window w."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        positions = torch.arange(self.max_length)

        def sequences(rank):
            longest = self.max_length * (rank + 1) // world_size
            tokens = torch.randint(self.vocab, (self.sequences, self.max_length), generator=generator)
            padding = positions >= torch.randint(1, longest + 1, (self.sequences, 1), generator=generator)
            targets = (3 * tokens + 1) % self.vocab
            return tokens.masked_fill(padding, 0), targets.masked_fill(padding, IGNORE_INDEX)

        return [[[sequences(rank) for rank in range(world_size)] for _ in range(self.accum_steps)]
                for _ in range(self.n_windows)]

    def reference_steps(self, world_size: int) -> list[WeightedStep]:
        """One process that sees each whole window (every rank's sequences) as one batch, every token weighted equally."""
        model = self.model()
        params = list(model.parameters())
        optimizer = self.optimizer(params)
        steps = []
        for window in self.windows(world_size):
            by_rank = list(zip(*window))  # by_rank[r][i]
            sums = [[summed_token_loss(model(x), y)[0] for x, y in rank] for rank in by_rank]
            gradients = microbatch_gradients(params, sums)
            tokens, targets = (torch.cat(parts) for parts in zip(*(part for batch in window for part in batch)))
            optimizer.zero_grad()
            loss_sum, count = summed_token_loss(model(tokens), targets)
            (loss_sum / count).backward()
            mistakes = {mistake: weighted(gradients, weights)
                        for mistake, weights in token_mistakes(by_rank, world_size).items()}
            gradient = flat_gradient(params)
            optimizer.step()
            steps.append(WeightedStep([p.detach().clone() for p in params], gradient, mistakes))
        return steps


def token_mistakes(by_rank, world_size: int) -> dict[str, list[list[float]]]:
    """{mistake: the weight it gives each (rank, micro-batch)'s summed token loss}, once DDP has averaged over the ranks.

    Right is 1 / C for every micro-batch, C the window's non-padding tokens on all ranks.
    """
    tokens = [[int((y != IGNORE_INDEX).sum()) for _, y in rank] for rank in by_rank]
    total = sum(map(sum, tokens))
    positions = sum(y.numel() for rank in by_rank for _, y in rank)
    n = len(tokens[0])
    return {
        "each micro-batch's mean token loss was weighted equally, the 2024 transformers bug: divide each "
        "micro-batch's summed loss by the window's token count":
            [[1 / (world_size * n * c) for c in rank] for rank in tokens],
        "each rank divided by its own token count: all_reduce the count, so that every rank divides by the "
        "window's count over all ranks":
            [[1 / (world_size * sum(rank))] * n for rank in tokens],
        f"DDP averaged the ranks' gradients, dividing by the world size ({world_size}) after the division by the "
        "window's token count: multiply each loss by dist.get_world_size()":
            [[1 / (world_size * total)] * n for _ in tokens],
        "the count includes padding: count only the targets that are not IGNORE_INDEX":
            [[1 / positions] * n for _ in tokens],
    }


def buckets_per_sync(gradient_bytes: int, bucket_bytes: int) -> int:
    """All-reduces per synchronising backward when gradients, in the order the backward produces them,
    are cut into buckets of exactly ``bucket_bytes`` (a gradient may straddle two buckets) and the
    last bucket takes what is left: ceil(gradient bytes / bucket bytes)."""
    return math.ceil(gradient_bytes / bucket_bytes)


class BackwardLog:
    """When, on this rank, each gradient became ready and each collective's work was waited on.

    ``events`` holds ``(time.perf_counter() seconds, "gradient", parameter name)`` from a
    post-accumulate-grad hook on every parameter, ``(seconds, "wait", "")`` for every
    ``Work.wait()`` called from Python inside ``with``, and the script's own
    ``mark(label)`` as ``(seconds, "mark", label)``. The clock is the one
    ``count_collectives`` stamps its calls with, so the lists merge into one order. Create it
    before any other hooks on the parameters: hooks run in the order they were registered, and
    a gradient must be logged as ready before the hook that sends it runs.
    """

    def __init__(self, model: nn.Module):
        self.events: list[tuple[float, str, str]] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._ready(name))
                         for name, p in model.named_parameters()]
        self._wait = None

    def _ready(self, name: str):
        def hook(_parameter):
            self.events.append((time.perf_counter(), "gradient", name))
        return hook

    def mark(self, label: str) -> None:
        self.events.append((time.perf_counter(), "mark", label))

    def __enter__(self) -> BackwardLog:
        # Work is a C++ class: a wrapper on its Python attribute sees the waits that Python code calls.
        work = torch.distributed.distributed_c10d.Work
        self._wait = work.wait

        def logged_wait(this, *args, **kwargs):
            self.events.append((time.perf_counter(), "wait", ""))
            return self._wait(this, *args, **kwargs)

        work.wait = logged_wait
        return self

    def __exit__(self, *exc_info) -> None:
        torch.distributed.distributed_c10d.Work.wait = self._wait
        for handle in self._handles:
            handle.remove()


def overlap_problems(events: list[tuple[float, str, str]], collective: str = "all_reduce") -> list[str]:
    """What one synchronising backward did wrong, read from the order of its events alone.

    ``events``: a :class:`BackwardLog`'s events merged with the collectives issued
    (``(seconds, name, detail)``), from the mark "backward" to the mark "step" (the script marks
    "backward done" when ``backward()`` returns). Right: every ``collective`` is waited before
    ``step()``, and at least one is issued during the backward and still unwaited when the backward
    produces its next gradient (the communication overlaps what is left of the backward).
    """
    kinds = [kind if kind != "mark" else detail for _, kind, detail in sorted(events)]
    issued = [i for i, kind in enumerate(kinds) if kind == collective]
    step, done = kinds.index("step"), kinds.index("backward done")
    problems = []
    waited = sum(kind == "wait" for kind in kinds[:step])
    if waited < len(issued):
        problems.append(f"only {waited} of the {len(issued)} {collective}s issued were waited before step(): the "
                        "optimizer may read a bucket the ranks are still summing; wait every work before step()")
    during = [i for i in issued if i < done]
    if not during:
        problems.append(f"no {collective} was issued during the backward: the communication cannot overlap the "
                        "backward; send each bucket from the gradient hook as soon as it is full")
    elif not any(_gradient_before_next_wait(kinds[i + 1:step]) for i in during):
        problems.append(f"every {collective} issued during the backward was waited before the backward produced "
                        "another gradient: a work waited right away blocks the backward until the ranks have summed "
                        "it, so nothing overlaps; keep the works and wait them after the backward, before step()")
    return problems


def _gradient_before_next_wait(kinds: list[str]) -> bool:
    """Whether the backward produced a gradient before the next wait (or before step, with no wait)."""
    until = kinds.index("wait") if "wait" in kinds else len(kinds)
    return "gradient" in kinds[:until]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state``, measured from the tensors themselves."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))
