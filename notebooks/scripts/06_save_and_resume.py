"""Module 6c, exercise 2: resume a dmuon run from the newest checkpoint that is complete.

A dmuon checkpoint holds the model (FSDP2 shards, and every dedicated matrix as a
full tensor, whoever owns it), each matrix's Muon momentum keyed by the matrix's
name, and AdamW's state on the shards. ``main`` saves one after each of the first two
optimizer steps, with torch.distributed.checkpoint and dmuon's state dicts, through
``dmuon_edu.checkpoint``, which marks a checkpoint complete only once every rank has
written it. Then the job is killed while saving a third: that folder holds files but no
marker. A fresh job (a new model with other weights, a fresh optimizer) calls
``resume``, and trains on; every step must equal the single-process reference. The
check also compares what ``resume`` restored with what the newest complete checkpoint
holds, part by part (weights, Muon momentum, AdamW state), and names what was left out.

Usage: torchrun --nproc-per-node=2 06_save_and_resume.py [results.json]
"""

import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from dmuon_edu import checkpoint, distributed, dmuon
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import ADAMW_TOLERANCE, report
from dmuon_edu.course.dmuon_problem import Problem, full_parameters, guide_loop, prepare


def resume(model, optimizer, root):
    """Continue, in ``model`` and ``optimizer`` (freshly built: other weights, a fresh optimizer), the run whose
    checkpoints ``main`` saved under ``root``.

    When it returns, the next optimizer step must be the one the saved run would have taken
    after its newest complete checkpoint.
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


def restoration_findings(newest, older, resumed) -> list[str]:
    """What the resume got wrong: the checkpoint it read, or the parts of the state it left out."""
    left_out = differs(newest, resumed)
    if left_out and not differs(older, resumed):
        return ["resume restored an older checkpoint (step 1) where a newer one (step 2) is complete: "
                "checkpoint.latest(root) finds the newest that verifies"]
    by_function = {}
    for part, far in left_out.items():
        by_function.setdefault(RESTORED_BY[part], []).append(f"the {part} ({far})")
    return [f"{' and '.join(parts)} did not come back: checkpoint.load only fills the dictionary, and {function} "
            "hands it to the run" for function, parts in by_function.items()]


def main(ranks):
    """Train two steps saving each, cut a third save short, resume a fresh model with the learner's resume, train on;
    grade the steps and what resume restored."""
    problem = Problem()
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    folder = [tempfile.mkdtemp() if ranks.rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # every rank saves its shards into the same folder
    root = Path(folder[0])
    windows, reference = problem.windows(), problem.baseline()

    model, optimizer = build(problem, mesh, ranks.device, scramble=False)
    differences, saved = [], []
    for step in (1, 2):
        train_window(model, optimizer, problem, windows[step - 1], ranks)
        differences.append(max_parameter_difference(full_parameters(model), reference[step - 1].parameters))
        checkpoint.save(sharded_state(model, optimizer), root / f"step-{step}", step=step)
        saved.append(full_state(model, optimizer))
    # What a job killed while saving step 3 leaves behind: step 3's files, and no marker.
    train_window(model, optimizer, problem, windows[2], ranks)
    dcp.save(sharded_state(model, optimizer), checkpoint_id=root / "step-3")
    cut_short = full_state(model, optimizer)
    distributed.print0("saved after optimizer steps 1 and 2, the save of step 3 cut short; resuming in a new model "
                       "with other weights")

    model, optimizer = build(problem, mesh, ranks.device, scramble=True)
    findings = []
    cut_short_read = ("resume read step-3, whose save was cut short ({}): resume from the newest checkpoint that "
                      "verifies")
    try:
        resume(model, optimizer, root)
    except checkpoint.IncompleteCheckpointError:
        findings.append(cut_short_read.format("checkpoint.load refuses it"))
    if not findings:
        # Bit for bit: a checkpoint holds the exact values, so anything but 0 is a part left out.
        resumed = full_state(model, optimizer)
        findings = ([cut_short_read.format("it has no COMPLETE marker, which torch.distributed.checkpoint does not "
                                           "read; checkpoint.latest(root) and checkpoint.load do")]
                    if not differs(cut_short, resumed) else restoration_findings(saved[1], saved[0], resumed))
        train_window(model, optimizer, problem, windows[2], ranks)
        differences.append(max_parameter_difference(full_parameters(model), reference[2].parameters))
        if findings and differences[-1] >= ADAMW_TOLERANCE:
            findings[-1] += f"; it costs the run: step 3 is {differences[-1]:.3g} from the reference"
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
