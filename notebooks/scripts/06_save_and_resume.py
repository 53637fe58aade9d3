"""Module 6c, exercise 2: resume a dmuon run from the newest checkpoint that is complete and intact.

A dmuon checkpoint holds the model (FSDP2 shards, and every dedicated matrix as a
full tensor, whoever owns it), each matrix's Muon momentum keyed by the matrix's
name, and AdamW's state on the shards. ``main`` saves one after each of the first three
optimizer steps, in ``root / "step-<n>"``, with torch.distributed.checkpoint and dmuon's
state dicts, through ``dmuon_edu.checkpoint``, which marks a checkpoint complete only once
every rank has written it. Then two things go wrong, as they do in long runs: a storage
error flips bytes in one of step-3's files, and the job is killed while saving a fourth,
whose folder holds files but no marker. A fresh job (a new model with other weights, a
fresh optimizer) calls ``resume``, and trains on from the step it returns; every step
must equal the single-process reference. The check also compares what ``resume``
restored with what each checkpoint holds, part by part (weights, Muon momentum, AdamW
state), and names what was left out.

Usage: torchrun --nproc-per-node=2 06_save_and_resume.py [results.json]
"""

import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from dmuon_edu import checkpoint, distributed, dmuon
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import ADAMW_TOLERANCE, report
from dmuon_edu.course.dmuon_problem import Problem, full_parameters, guide_loop, prepare


def resume(model, optimizer, root) -> int:
    """Continue, in ``model`` and ``optimizer`` (freshly built: other weights, a fresh optimizer), the run whose
    checkpoints ``main`` saved under ``root``, from the newest one that can be trusted; return how many optimizer
    steps the restored state has taken.

    The script then trains on from the window after that many, and each step must be the one the saved run took.
    """
    raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")


def build(problem, mesh, device, scramble):
    model = problem.model().to(device)
    if scramble:  # a fresh run starts from other weights: only the checkpoint can make it continue
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)).to(device))
    return model, prepare(model, mesh)


def train_window(model, optimizer, problem, window, ranks):
    local = [tuple(t.to(ranks.device) for t in problem.local(batch, ranks.rank, ranks.world_size)) for batch in window]
    guide_loop(model, optimizer, local, len(window))


def sharded_state(model, optimizer):
    """What a checkpoint holds, as torch.distributed.checkpoint saves it: FSDP2's shards stay shards."""
    sharded = dmuon.StateDictOptions()
    return {"model": dmuon.get_model_state_dict(model, sharded),
            "optim": dmuon.get_optimizer_state_dict(model, optimizer, sharded)}


def full_state(model, optimizer):
    """Every value the run continues from, as full tensors on every rank: {"weights", "momentum", "AdamW state"},
    copied (a state dict may share the live tensors, which the next step changes)."""
    full = dmuon.StateDictOptions(full_state_dict=True)
    optim = dmuon.get_optimizer_state_dict(model, optimizer, full)["state"]
    parts = {"weights": dict(dmuon.get_model_state_dict(model, full)),
             "momentum": {name: s["momentum_buffer"] for name, s in optim.items() if "momentum_buffer" in s},
             "AdamW state": {f"{name}.{key}": value for name, s in optim.items()
                             for key, value in s.items() if key != "momentum_buffer"}}
    return {part: {name: torch.as_tensor(value).clone() for name, value in values.items()}
            for part, values in parts.items()}


# what hands each part of the loaded dictionary back to the run
RESTORED_BY = {"weights": "dmuon.set_model_state_dict", "momentum": "dmuon.set_optimizer_state_dict",
               "AdamW state": "dmuon.set_optimizer_state_dict"}


def differs(saved, resumed) -> dict[str, str]:
    """{part: how far the resumed state is from ``saved``} for each part that is not bit for bit the same."""
    far = {}
    for part, values in saved.items():
        missing = [name for name in values if name not in resumed[part]]
        worst = max((float((torch.as_tensor(resumed[part][name]).float() - torch.as_tensor(value).float()).abs().max())
                     for name, value in values.items() if name not in missing), default=0.0)
        if missing or worst > 0:
            far[part] = f"off by up to {worst:.3g}" + (f", {len(missing)} entries missing" if missing else "")
    return far


def unequal(saved, resumed) -> int:
    """How many entries of ``resumed`` are not bit for bit those of ``saved`` (a missing one counts)."""
    return sum(name not in resumed[part] or not torch.equal(torch.as_tensor(resumed[part][name]), torch.as_tensor(value))
               for part, values in saved.items() for name, value in values.items())


def restoration_findings(saved, resumed, returned) -> list[str]:
    """What the resume got wrong: the checkpoint it read, the parts of the state it left out, or the step it said."""
    exact = [step for step, state in saved.items() if unequal(state, resumed) == 0]
    if exact == [CUT_SHORT]:
        return [CUT_SHORT_READ.format("it has no COMPLETE marker, which torch.distributed.checkpoint does not read; "
                                      "checkpoint.latest(root) and checkpoint.load do")]
    if exact and exact[0] < TRUSTED:
        return [f"resume restored an older checkpoint (step {exact[0]}) where a newer one (step {TRUSTED}) is "
                "complete and intact: checkpoint.latest(root) finds the newest that verifies"]
    if exact == [TRUSTED]:
        return [] if returned == TRUSTED else [
            f"resume restored step {TRUSTED}'s state but returned {returned!r}: the run would go on after window "
            f"{returned!r} where window {TRUSTED + 1} is due. Return the step the checkpoint holds (its folder's "
            "name, or AdamW's state['step']), not the number of saves"]
    if unequal(saved[CORRUPT], resumed) < unequal(saved[TRUSTED], resumed):  # all of step 3 but the damaged bytes
        return [f"resume read step-{CORRUPT} with torch.distributed.checkpoint, whose files differ from their "
                "checksums (a storage error): some of what it loaded is not what the run saved. checkpoint.load "
                "refuses it, and checkpoint.latest(root) passes over it"]
    by_function = {}
    for part, far in differs(saved[TRUSTED], resumed).items():
        by_function.setdefault(RESTORED_BY[part], []).append(f"the {part} ({far})")
    return [f"{' and '.join(parts)} did not come back: checkpoint.load only fills the dictionary, and {function} "
            "hands it to the run" for function, parts in by_function.items()]


TRUSTED, CORRUPT, CUT_SHORT = 2, 3, 4  # the checkpoints main leaves: the newest intact, a damaged one, a cut short
CUT_SHORT_READ = ("resume read step-4, whose save was cut short ({}): resume from the newest checkpoint that "
                  "verifies")


def damage(path: Path) -> None:
    """A storage error: flip the bytes of the middle of the largest file a checkpoint holds (rank 0's data)."""
    victim = max((f for f in path.iterdir() if f.name.endswith(".distcp")), key=lambda f: (f.stat().st_size, f.name))
    data = bytearray(victim.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    victim.write_bytes(bytes(data))


def main(ranks):
    """Train three steps saving each, damage the third save, cut a fourth short; resume a fresh model with the
    learner's resume and train on from the step it returns; grade the steps and what resume restored."""
    problem = Problem(n_windows=CUT_SHORT)
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    folder = [tempfile.mkdtemp() if ranks.rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # every rank saves its shards into the same folder
    root = Path(folder[0])
    windows, reference = problem.windows(), problem.baseline()

    model, optimizer = build(problem, mesh, ranks.device, scramble=False)
    saved, differences = {}, []  # the steps up to the checkpoint to resume from, then the resumed run's
    for step in range(1, CUT_SHORT + 1):
        train_window(model, optimizer, problem, windows[step - 1], ranks)
        if step <= TRUSTED:
            differences.append(max_parameter_difference(full_parameters(model), reference[step - 1].parameters))
        if step < CUT_SHORT:
            checkpoint.save(sharded_state(model, optimizer), root / f"step-{step}", step=step)
        else:  # what a job killed while saving leaves behind: the files, and no marker
            dcp.save(sharded_state(model, optimizer), checkpoint_id=root / f"step-{step}")
        saved[step] = full_state(model, optimizer)
    dist.barrier()
    if ranks.rank == 0:
        damage(root / f"step-{CORRUPT}")
    dist.barrier()
    distributed.print0(f"saved after optimizer steps 1 to {CORRUPT}; a storage error damaged step-{CORRUPT}, the save "
                       f"of step {CUT_SHORT} was cut short; resuming in a new model with other weights")

    model, optimizer = build(problem, mesh, ranks.device, scramble=True)
    findings = []
    try:
        with warnings.catch_warnings(record=True) as passed_over:  # shown below, without the temporary folder
            warnings.simplefilter("always")
            returned = resume(model, optimizer, root)
        for warning in passed_over:
            distributed.print0(f"{warning.category.__name__}: {str(warning.message).replace(str(root), '<root>')}")
    except checkpoint.IncompleteCheckpointError:
        findings.append(CUT_SHORT_READ.format("checkpoint.load refuses it"))
    except checkpoint.CorruptCheckpointError:
        findings.append(f"resume read step-{CORRUPT}, whose files differ from their checksums (checkpoint.load "
                        "refuses it): resume from the newest checkpoint that verifies, checkpoint.latest(root)")
    if not findings:
        # Bit for bit: a checkpoint holds the exact values, so anything but 0 is a part left out.
        findings = restoration_findings(saved, full_state(model, optimizer), returned)
        start = returned if isinstance(returned, int) and 0 <= returned < CUT_SHORT else TRUSTED
        for step in range(start + 1, CUT_SHORT + 1):  # train on, from the window after the one resume returned
            train_window(model, optimizer, problem, windows[step - 1], ranks)
            differences.append(max_parameter_difference(full_parameters(model), reference[step - 1].parameters))
        worst = max(differences[TRUSTED:], default=0.0)
        if findings and worst >= ADAMW_TOLERANCE:
            findings[-1] += f"; it costs the run: its next steps are up to {worst:.3g} from the reference"
    else:
        differences.append(float("inf"))
    result = report(
        "06_save_and_resume",
        differences,
        {},
        hint="after resume, the next step must be the saved run's next step",
        findings=tuple(findings),
    )
    dist.barrier()
    if ranks.rank == 0:
        shutil.rmtree(root)
    return result


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
