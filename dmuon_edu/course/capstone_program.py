"""Module 7b: run the training program a learner wrote, and grade it by what it does.

The learner's script (``solutions/scripts/07_train_capstone.py``) defines four functions:

- ``prepare(model, mesh, hyperparameters)``: the dmuon set-up for a layout of their choice
  (Z2, Z3, or the DDP backend); returns the ``dmuon.Muon`` built with ``hyperparameters``;
- ``train_step(model, optimizer, scheduler, window)``: one optimizer step over a window of
  micro-batches, with ``no_sync``, ``dmuon.clip_grad_norm_`` to :data:`MAX_NORM` and the
  scheduler stepped once; returns the window's mean loss;
- ``save(model, optimizer, scheduler, path, step)`` and ``resume(model, optimizer, scheduler,
  root)``: a checkpoint, and the run continued from it.

:func:`run_program` trains the capstone's GPT with them twice: once from the start to the
end, saving after step ``save_after``, and once in a fresh job (other weights, a fresh
optimizer and scheduler) that resumes and trains to the end. Beside them, in one process,
the reference: Muon and AdamW on the whole global batches, torch's clip over every
gradient, the same schedule. :func:`grade` compares, and names what a known mistake changes:

- every step's loss against the reference's;
- each step's learning rate against the schedule;
- the broadcast and reduce bytes per step against module 6's formulas;
- the resumed run against the uninterrupted one, bit for bit;
- the held-out loss against the floor.

Newton-Schulz runs in float32 on both sides, so that the comparison holds on any CPU: the
runs differ only in the order of floating-point sums (each rank sums its half of a
micro-batch, then the reduce adds the halves).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dmuon_edu import checkpoint, distributed, dmuon
from dmuon_edu.arguments import require_int
from dmuon_edu.course.capstone import (counted_bytes_per_step, evaluate, held_bytes, local_microbatches,
                                       single_process_optimizers)
from dmuon_edu.course.capstone_problem import Capstone
from dmuon_edu.course.checks import CheckResult
from dmuon_edu.course.dmuon_problem import ResidencyProbe, full_parameters, per_rank
from dmuon_edu.course.gpt import is_hidden_matrix
from dmuon_edu.course.threads import one_thread

__all__ = ["MAX_NORM", "WARMUP", "MARGIN", "LOSS_TOLERANCE", "ProgramRun", "lr_factor", "hyperparameters",
           "reference_run", "run_program", "layout_of", "grade", "report"]

MAX_NORM = 0.5  # the global gradient norm the program clips to
WARMUP = 10  # optimizer steps of linear warm-up, then a cosine down to a tenth of the rate
MARGIN = 0.05  # nats per token: how close to the floor the run must end
# Float32 throughout, the sums in another order: the runs measured up to 1.1e-6 apart over 120 steps.
# 1e-4 leaves a hundredfold margin for other CPUs' kernels; every known mistake crosses it within four steps.
LOSS_TOLERANCE = 1e-4


@dataclass(frozen=True)
class ProgramRun:
    """How long the program trains, and after which step it saves; the rest is ``Capstone()``'s."""

    steps: int = Capstone.steps
    save_after: int = 100

    def __post_init__(self):
        require_int("steps", self.steps, minimum=2, hint="the run saves after one step and resumes for another")
        require_int("save_after", self.save_after, minimum=1, maximum=self.steps - 1,
                    hint="a step before the last, so that the resumed run has steps to take")

    def capstone(self) -> Capstone:
        return Capstone(steps=self.steps)

    @property
    def margin(self) -> float | None:
        """How close to the floor the run must end: MARGIN for the whole run, nothing for a shorter one."""
        return MARGIN if self.steps >= Capstone.steps else None


def lr_factor(step: int, steps: int) -> float:
    """The schedule: the fraction of the base rate for optimizer step ``step + 1`` (``step`` taken so far)."""
    require_int("step", step, minimum=0, hint="the optimizer steps taken so far")
    require_int("steps", steps, minimum=1, hint="the optimizer steps of the whole run")
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def hyperparameters(capstone: Capstone) -> dict:
    """dmuon.Muon's arguments for the capstone: its rates, Keller Jordan's scale, float32 Newton-Schulz."""
    return dict(lr=capstone.muon_lr, adamw_lr=capstone.adamw_lr, adjust_lr_fn=capstone.muon_scale,
                ns_dtype=torch.float32)


def _scheduler(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps))


def reference_run(capstone: Capstone, *, clip: bool = True, scale_loss: bool = True) -> list[float]:
    """Each step's loss in one process: Muon on the hidden matrices, AdamW on the rest, torch's clip of every
    gradient, the schedule stepped once a step. ``clip`` and ``scale_loss`` off: two known mistakes, for hints."""
    model = capstone.model()
    optimizers = single_process_optimizers("Muon", model, capstone, ns_dtype=hyperparameters(capstone)["ns_dtype"])
    schedulers = [_scheduler(optimizer, capstone.steps) for optimizer in optimizers]
    microbatches, n = capstone.microbatches(), capstone.accum_steps
    losses = []
    with one_thread():
        for start in range(0, len(microbatches), n):
            window = microbatches[start:start + n]
            loss_sum = 0.0
            for inputs, targets in window:
                loss = model(inputs, targets).loss / (len(window) if scale_loss else 1)
                loss.backward()
                loss_sum += loss.item() / (1 if scale_loss else len(window))
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            for optimizer in optimizers:
                optimizer.step()
            for scheduler in schedulers:
                scheduler.step()
            for optimizer in optimizers:
                optimizer.zero_grad()
            losses.append(loss_sum)
    return losses


@dataclass
class _Run:
    """What one run of the learner's program did, step by step."""

    losses: list[float] = field(default_factory=list)  # the global mean loss of each step, as train_step returned it
    lrs: list[float] = field(default_factory=list)  # Muon's rate after each step's train_step
    seconds: list[float] = field(default_factory=list)
    warned: list[str] = field(default_factory=list)  # the warnings train_step raised (dmuon's, torch's), each once
    parameters: list[torch.Tensor] = field(default_factory=list)  # at the end, whole


def _train(program, model, optimizer, scheduler, windows, steps, ranks, run: _Run, counts=None, save=None):
    """Steps ``steps`` (1-based) of the program, recording each; ``save=(step, path)`` saves after that step."""
    for step in steps:
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with counts if counts is not None else contextlib.nullcontext():
                loss = program.train_step(model, optimizer, scheduler, windows[step - 1])
        run.seconds.append(time.perf_counter() - start)
        run.warned += [str(w.message) for w in caught if str(w.message) not in run.warned]
        if not isinstance(loss, (float, int, torch.Tensor)) or isinstance(loss, bool):
            raise TypeError(f"train_step returned {type(loss).__name__}: return the window's mean loss, a float")
        mean = torch.tensor(float(loss), dtype=torch.float64, device=ranks.device)  # NCCL takes GPU tensors
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)  # equal shares: the mean of the ranks' means
        run.losses.append(mean.item())
        run.lrs.append(float(optimizer.param_groups[0]["lr"]))
        if save is not None and step == save[0]:
            program.save(model, optimizer, scheduler, save[1], step)
    run.parameters = full_parameters(model)


def _fresh(capstone: Capstone, ranks, scramble: bool) -> nn.Module:
    model = capstone.model().to(ranks.device)
    if scramble:  # a new job starts from other weights: only the checkpoint can make it continue
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)).to(ranks.device))
    return model


def _prepared(program, model, mesh, capstone):
    optimizer = program.prepare(model, mesh, hyperparameters(capstone))
    if not isinstance(optimizer, dmuon.Muon):
        raise TypeError(f"prepare returned {type(optimizer).__name__}: return the dmuon.Muon you built for the model")
    return optimizer, _scheduler(optimizer, capstone.steps)


def _uninterrupted(program, ranks, mesh, capstone, windows, run, root):
    """The run from the start to the end, saving after ``run.save_after``: (record, counts, memory, held-out loss)."""
    model = _fresh(capstone, ranks, scramble=False)
    optimizer, scheduler = _prepared(program, model, mesh, capstone)
    probe = ResidencyProbe(model)
    whole, counts = _Run(), dmuon.count_comm()
    with one_thread():
        _train(program, model, optimizer, scheduler, windows, range(1, capstone.steps + 1), ranks, whole, counts,
               save=(run.save_after, root / f"step-{run.save_after}"))
        held_out_loss = evaluate(model, capstone.held_out().to(ranks.device))
    return whole, counts, per_rank((held_bytes(model, [optimizer]), probe.peak, probe.gradient_peak)), held_out_loss


def _resumed(program, ranks, mesh, capstone, windows, run, root):
    """A new job: other weights, a fresh optimizer and scheduler, the learner's resume, then on to the end."""
    model = _fresh(capstone, ranks, scramble=True)
    optimizer, scheduler = _prepared(program, model, mesh, capstone)
    resumed = _Run()
    returned = program.resume(model, optimizer, scheduler, root)
    if len({repr(value) for value in per_rank(returned)}) > 1:  # the ranks would train different steps, and hang
        returned = "a different step on each rank"
    start = returned if isinstance(returned, int) and 0 <= returned < capstone.steps else run.save_after
    with one_thread():
        _train(program, model, optimizer, scheduler, windows, range(start + 1, capstone.steps + 1), ranks, resumed)
    return resumed, returned


def run_program(program, ranks, mesh, run: ProgramRun = ProgramRun()) -> dict:
    """Run the learner's ``program`` (a module with prepare, train_step, save and resume) on these ranks:
    uninterrupted, saving after ``run.save_after``; then resumed in a fresh job. Returns, on every rank,
    what :func:`grade` reads."""
    capstone = run.capstone()
    folder = [tempfile.mkdtemp() if ranks.rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # every rank saves its shards into the same folder
    root = Path(folder[0])
    local = [tuple(t.to(ranks.device) for t in batch)
             for batch in local_microbatches(capstone.microbatches(), ranks.rank, ranks.world_size)]
    windows = [local[start:start + capstone.accum_steps] for start in range(0, len(local), capstone.accum_steps)]
    p_m = sum(p.numel() * p.element_size() for n, p in capstone.model().named_parameters() if is_hidden_matrix(n, p))

    try:
        whole, counts, memory, held_out_loss = _uninterrupted(program, ranks, mesh, capstone, windows, run, root)
        found = checkpoint.latest(root)  # what a new job would find: not a value the old one left in memory
        found = found is not None and found.name == f"step-{run.save_after}"
        resumed, returned = (_resumed(program, ranks, mesh, capstone, windows, run, root) if found else
                             (_Run(), "nothing: there was no checkpoint to resume from"))
        dist.barrier()  # no rank reads the folder any more
    finally:
        if ranks.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    steps = capstone.steps
    return {
        "steps": steps,
        "save_after": run.save_after,
        "resume_returned": returned if isinstance(returned, int) else str(returned),  # for JSON
        "checkpoint_found": found,
        "losses": whole.losses,
        "lrs": whole.lrs,
        "resumed_losses": resumed.losses,
        "resumed_lrs": resumed.lrs,
        "resumed_exactly": len(resumed.parameters) == len(whole.parameters) and all(
            torch.equal(a, b) for a, b in zip(whole.parameters, resumed.parameters)),
        "warnings": whole.warned + [w for w in resumed.warned if w not in whole.warned],
        "reference_losses": reference_run(capstone),
        "floor": capstone.floor(),
        "held_out_loss": held_out_loss,
        "step_seconds": statistics.median(whole.seconds[1:] or whole.seconds),  # the first creates the state
        "held_bytes_per_rank": [t[0] for t in memory],
        "matrix_bytes_during_forward_per_rank": [t[1] for t in memory],
        "matrix_gradient_bytes_during_forward_per_rank": [t[2] for t in memory],
        "comm_per_step": {op: [counts.calls[op] // steps, counts.bytes[op] // steps] for op in sorted(counts.calls)},
        "P_M": p_m,
        "accum_steps": capstone.accum_steps,
        "world_size": ranks.world_size,
    }


def layout_of(comm_per_step: dict, p_m: int, accum_steps: int) -> str | None:
    """The layout a run's traffic shows: FSDP2 all-gathers (Z3 broadcasts 2N P_M a step, Z2 P_M), the DDP
    backend all-reduces and broadcasts P_M after the step; None for any other traffic."""
    broadcast = comm_per_step.get("broadcast", [0, 0])[1]
    z3, z2 = (counted_bytes_per_step(p_m, accum_steps, zero3, no_sync=True)["broadcast"] for zero3 in (True, False))
    if "all_gather" in comm_per_step:
        return {z3: "Z3", z2: "Z2"}.get(broadcast)
    return "the DDP backend" if broadcast == z2 else None


def _first_apart(measured, expected, tolerance=0.0):
    """(step, difference) where ``measured`` first leaves ``expected`` by more than ``tolerance`` (0: any
    difference; a NaN always), or None."""
    return next(((step, abs(a - b)) for step, (a, b) in enumerate(zip(measured, expected), start=1)
                 if not abs(a - b) <= tolerance), None)


def grade(result: dict, capstone: Capstone, margin: float | None) -> list[str]:
    """What the run in ``result`` (from :func:`run_program`) got wrong, each with its cost; empty if nothing."""
    findings = []
    n, p_m, steps, saved = result["accum_steps"], result["P_M"], result["steps"], result["save_after"]
    base = capstone.muon_lr
    # The schedule, read from the rate after each step: LambdaLR computes the same product, base * factor;
    # 1e-9 of the rate allows it another rounding, and every wrong schedule moves a rate by 10% or more.
    scheduled = [base * lr_factor(step, steps) for step in range(1, steps + 1)]
    if off_schedule := _first_apart(result["lrs"], scheduled, 1e-9 * base):
        per_micro_batch = [base * lr_factor(n * step, steps) for step in range(1, steps + 1)]
        if not _first_apart(result["lrs"], per_micro_batch, 1e-9 * base):
            smallest = next(step for step, lr in enumerate(per_micro_batch, start=1) if lr == min(per_micro_batch))
            findings.append(f"the scheduler stepped once per micro-batch, {n} times a step: the warm-up ended "
                            f"{n} times too early, and from step {smallest} of {steps} the run crawled at the "
                            f"schedule's last rate. Step it once per optimizer step, after optimizer.step()")
        elif len(set(result["lrs"])) == 1:
            findings.append("the learning rate never changed: call scheduler.step() once per optimizer step, after "
                            "optimizer.step()")
        else:
            step, _ = off_schedule
            findings.append(f"after step {step} the rate was {result['lrs'][step - 1]:.3g}, where the schedule gives "
                            f"{scheduled[step - 1]:.3g}: step the scheduler once per optimizer step")
    # Every step's loss against the single-process reference.
    apart = _first_apart(result["losses"], result["reference_losses"], LOSS_TOLERANCE)
    if apart and not findings:
        step, difference = apart
        ratio = result["losses"][step - 1] / result["reference_losses"][step - 1]
        if abs(ratio - n) < 0.1:
            findings.append(f"train_step returned {n}x the window's loss: return this rank's mean of its "
                            "micro-batches' losses (not their sum, nor a sum over ranks: the check averages the ranks)")
        elif any("before `optimizer.step()`" in warning for warning in result["warnings"]):
            findings.append(f"the scheduler moved before optimizer.step(): every step ran at the next step's rate, "
                            f"and step {step}'s loss is {difference:.2g} from the reference. Call scheduler.step() "
                            "after optimizer.step()")
        elif any("clip" in warning for warning in result["warnings"]):
            findings.append(f"torch.nn.utils.clip_grad_norm_ saw only the gradients in p.grad, not the matrices' (they "
                            f"live on their owners): the clip measured too small a norm, and step {step}'s loss is "
                            f"{difference:.2g} from the reference. Clip with dmuon.clip_grad_norm_(model, MAX_NORM)")
        elif not _first_apart(result["losses"], reference_run(capstone, clip=False), LOSS_TOLERANCE):
            findings.append(f"no clipping: the global gradient norm is above {MAX_NORM} at step 1, and step {step}'s "
                            f"loss is {difference:.2g} from the reference. Clip with dmuon.clip_grad_norm_(model, "
                            f"MAX_NORM) after the window's last backward")
        elif not _first_apart(result["losses"], reference_run(capstone, scale_loss=False), LOSS_TOLERANCE):
            findings.append(f"each micro-batch's loss was not divided by the window's length: the gradient is {n}x "
                            f"the window's mean, the clip scales it otherwise, and step {step}'s loss is "
                            f"{difference:.2g} from the reference. Divide by len(window) before backward")
        else:
            findings.append(f"step {step}'s loss is {difference:.2g} from the single-process reference (tolerance "
                            f"{LOSS_TOLERANCE:g}): the window's forward and backward, the clip and the step must be "
                            "the reference's")
    # The traffic.
    comm = result["comm_per_step"]
    reduce = comm.get("reduce", [0, 0])[1]
    if reduce == n * p_m:
        findings.append(f"the reduce to the owners ran every micro-batch: {n} x P_M = {reduce} bytes a step where "
                        f"one, {p_m}, is enough. Run all but the window's last micro-batch inside dmuon.no_sync(model)")
    elif reduce != p_m:
        findings.append(f"the reduce sent {reduce} bytes a step, where dmuon with no_sync sends P_M = {p_m}")
    if layout_of(comm, p_m, n) is None:
        findings.append(f"the broadcasts sent {comm.get('broadcast', [0, 0])[1]} bytes a step, which is no layout's: "
                        f"Z3 sends 2N P_M = {2 * n * p_m}, Z2 and the DDP backend P_M = {p_m}, for the matrices "
                        "is_hidden_matrix picks: dedicate those")
    # The resume.
    returned = result["resume_returned"]
    if not result["checkpoint_found"]:
        findings.append(f"checkpoint.latest(root) finds no checkpoint of step {saved}: a new job could not resume. "
                        "Save with dmuon_edu.checkpoint.save(state, path, step=step), which marks it complete")
    elif not isinstance(returned, int) or isinstance(returned, bool):
        findings.append(f"resume returned {returned}, where the checkpoint holds step {saved}: return that step, "
                        "an int")
    elif returned != saved:
        findings.append(f"resume returned {returned}, where the checkpoint holds step {saved}: the run would go on "
                        f"from the wrong window. Return the step the checkpoint was saved at")
    elif restarted := _first_apart(result["resumed_lrs"], result["lrs"][saved:]):  # bit for bit
        step, _ = restarted
        findings.append(f"after resuming, step {saved + step}'s rate was {result['resumed_lrs'][step - 1]:.3g} where "
                        f"the run's was {result['lrs'][saved + step - 1]:.3g}: the schedule started over. Save "
                        "scheduler.state_dict() with the checkpoint and load it in resume")
    elif not result["resumed_exactly"] or result["resumed_losses"] != result["losses"][saved:]:
        apart = _first_apart(result["resumed_losses"], result["losses"][saved:]) or (steps - saved, 0.0)
        findings.append(f"the resumed run is not the uninterrupted one: step {saved + apart[0]}'s loss is "
                        f"{apart[1]:.2g} from it. Restore the model and the optimizer's state, as module 6c does")
    # The target.
    if margin is not None and not result["held_out_loss"] - result["floor"] < margin:
        findings.append(f"the held-out loss ended {result['held_out_loss'] - result['floor']:.2f} above the floor, "
                        f"outside the margin of {margin}")
    return findings


def report(result: dict, run: ProgramRun, argv: list[str]) -> CheckResult:
    """Print, on rank 0, what the run did and the verdict; write ``result`` to ``argv[0]`` where given."""
    capstone = run.capstone()
    findings = grade(result, capstone, run.margin)
    n, p_m, comm = result["accum_steps"], result["P_M"], result["comm_per_step"]
    layout = layout_of(comm, p_m, n)
    worst = max(abs(a - b) for a, b in zip(result["losses"], result["reference_losses"]))
    shown = layout or "not one of dmuon's"
    distributed.print0(f"layout: {shown}; {result['steps']} optimizer steps of {n} micro-batches")
    distributed.print0(f"every step's loss within {LOSS_TOLERANCE:g} of single-process Muon's: "
                       f"{'yes' if worst < LOSS_TOLERANCE else 'no, up to ' + format(worst, '.2g')}")
    for op in ("broadcast", "reduce"):
        calls, nbytes = comm.get(op, [0, 0])
        distributed.print0(f"{op} per step: {calls} calls, {nbytes} bytes = {nbytes / p_m:g} P_M")
    exact = "bit for bit" if result["resumed_exactly"] else "NOT"
    distributed.print0(f"saved after step {result['save_after']}, resume returned {result['resume_returned']}: "
                       f"the next {len(result['resumed_losses'])} steps {exact} the uninterrupted run's")
    distributed.print0(f"held-out loss {result['held_out_loss']:.2f}, "
                       f"{result['held_out_loss'] - result['floor']:.2f} above the floor")
    if findings:
        verdict = CheckResult("07_train_capstone", "FAIL", "; and ".join(findings[:2])
                              + (f" (and {len(findings) - 2} more)" if len(findings) > 2 else ""))
    else:
        verdict = CheckResult("07_train_capstone", "PASS", f"{layout}: every step as single-process Muon's, the "
                              "bytes module 6 predicts, an exact resume" +
                              (", and the floor reached" if run.margin is not None else ""))
    distributed.print0(verdict)
    if argv and dist.get_rank() == 0:
        Path(argv[0]).write_text(json.dumps({"status": verdict.status, "measurements": result}, indent=1))
    return verdict
