"""Module 6, exercise 5: save a dmuon run at a step boundary and resume it in a fresh model.

A dmuon checkpoint holds the model (FSDP2 shards, and every dedicated matrix as a
full tensor, whoever owns it), each matrix's Muon momentum keyed by the matrix's
name, and AdamW's state on the shards. Saving goes through
torch.distributed.checkpoint, with dmuon's state dicts:

    sharded = dmuon.StateDictOptions()  # torch.distributed.checkpoint's flow: FSDP2 shards stay shards
    checkpoint.save({"model": dmuon.get_model_state_dict(model, sharded),
                     "optim": dmuon.get_optimizer_state_dict(model, optimizer, sharded)}, path)

Resuming builds the same dictionary from a freshly built model and optimizer (a
fresh dmuon.Muon already holds every state entry, zeros), lets
``checkpoint.load`` fill it in place, then hands it back with
``dmuon.set_model_state_dict`` and ``dmuon.set_optimizer_state_dict``. On another
number of ranks the owners are planned anew and each momentum follows its matrix.
``checkpoint.save`` writes a COMPLETE marker last; ``checkpoint.load`` refuses a
checkpoint whose save was cut short.

The script trains one optimizer step, saves, builds a new model with other
weights, resumes, trains two more steps, and compares every step with the
single-process reference. It also compares what the resume restored with what
was saved, part by part (weights, Muon momentum, AdamW state): each part left
out is named, with its size and what it cost the run.

Usage: torchrun --nproc-per-node=2 06_save_and_resume.py [results.json]
"""

import shutil
import tempfile
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_edu import checkpoint, distributed, dmuon
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data_parallel import ADAMW_TOLERANCE, report
from dmuon_edu.course.dmuon_problem import ADAMW_LR, MUON_HYPERPARAMETERS, Problem, full_parameters, is_dedicated


def resume(model, optimizer, path):
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (freshly built, other weights)."""
    raise NotImplementedError("Exercise: replace this line with your code (the docstrings say what to do), then run the notebook's check cell.")


def build(problem, mesh, device, scramble):
    model = problem.model().to(device)
    if scramble:  # a fresh run starts from other weights: only the checkpoint can make it continue
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)).to(device))
    dmuon.dedicate_params(model, mesh, predicate=is_dedicated)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, **MUON_HYPERPARAMETERS, adamw_lr=ADAMW_LR)


def train_window(model, optimizer, problem, window, ranks):
    for i, batch in enumerate(window):
        x, y = (t.to(ranks.device) for t in problem.local(batch, ranks.rank, ranks.world_size))
        with dmuon.no_sync(model) if i < len(window) - 1 else nullcontext():
            (model((x, y)).loss / len(window)).backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model, optimizer):
    """Every value the run continues from, as full tensors on every rank: {"weights", "momentum", "AdamW state"}."""
    full = dmuon.StateDictOptions(full_state_dict=True)
    optim = dmuon.get_optimizer_state_dict(model, optimizer, full)["state"]
    return {"weights": dict(dmuon.get_model_state_dict(model, full)),
            "momentum": {name: s["momentum_buffer"] for name, s in optim.items() if "momentum_buffer" in s},
            "AdamW state": {f"{name}.{key}": value for name, s in optim.items()
                            for key, value in s.items() if key != "momentum_buffer"}}


# what hands each part of the loaded dictionary back to the run
RESTORED_BY = {"weights": "dmuon.set_model_state_dict(model, state['model'])",
               "momentum": "dmuon.set_optimizer_state_dict(model, optimizer, state['optim'])",
               "AdamW state": "dmuon.set_optimizer_state_dict(model, optimizer, state['optim'])"}


def restoration_findings(saved, resumed) -> list[str]:
    """What the resume left out: each part of the state that differs from the saved one, with its size."""
    findings = []
    for part, values in saved.items():
        missing = [name for name in values if name not in resumed[part]]
        worst = max((float((torch.as_tensor(resumed[part][name]).float() - torch.as_tensor(value).float()).abs().max())
                     for name, value in values.items() if name not in missing), default=0.0)
        if missing or worst > 0:
            norm = max(float(torch.as_tensor(value).float().norm()) for value in values.values())
            findings.append(f"the {part} did not come back from the checkpoint (largest difference {worst:.3g}, "
                            f"against saved values of norm up to {norm:.3g}"
                            f"{f'; {len(missing)} entries missing' if missing else ''}): load it and hand it back with "
                            f"{RESTORED_BY[part]} (checkpoint.load only fills the dictionary)")
    return findings


def main(ranks):
    """Train a step, save, resume in a model with other weights with the learner's resume, train on; grade resume."""
    problem = Problem()
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    folder = [tempfile.mkdtemp() if ranks.rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # every rank saves its shards into the same folder
    path = f"{folder[0]}/step-1"
    windows, reference = problem.windows(), problem.baseline()

    model, optimizer = build(problem, mesh, ranks.device, scramble=False)
    train_window(model, optimizer, problem, windows[0], ranks)
    differences = [max_parameter_difference(full_parameters(model), reference[0].parameters)]
    sharded = dmuon.StateDictOptions()
    checkpoint.save({"model": dmuon.get_model_state_dict(model, sharded),
                     "optim": dmuon.get_optimizer_state_dict(model, optimizer, sharded)}, path)
    saved = full_state(model, optimizer)
    distributed.print0("saved after optimizer step 1; resuming in a new model with other weights")

    model, optimizer = build(problem, mesh, ranks.device, scramble=True)
    resume(model, optimizer, path)
    # Bit for bit: a checkpoint holds the exact values, so anything but 0 is a part left out.
    findings = restoration_findings(saved, full_state(model, optimizer))
    for window, expected in zip(windows[1:], reference[1:]):
        train_window(model, optimizer, problem, window, ranks)
        differences.append(max_parameter_difference(full_parameters(model), expected.parameters))
    if findings and differences[-1] >= ADAMW_TOLERANCE:
        findings[-1] += f"; it costs the run: step {len(differences)} is {differences[-1]:.3g} from the reference"
    result = report(
        "06_save_and_resume",
        differences,
        {},
        hint="build the state dict from the fresh model and optimizer, checkpoint.load it in place, then "
        "dmuon.set_model_state_dict and dmuon.set_optimizer_state_dict (the momentum must come back too)",
        findings=tuple(findings),
    )
    dist.barrier()
    if ranks.rank == 0:
        shutil.rmtree(folder[0])
    return result


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
