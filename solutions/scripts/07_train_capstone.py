"""Module 7b: the capstone's training program, written by you.

Four functions train the capstone's GPT with dmuon on the ranks torchrun starts. ``main``
calls them twice. First it trains from the start, and calls ``save`` after step 100. Then a
new job starts with other weights and a fresh optimizer and scheduler; it calls ``resume``
and trains on to the end. The check compares every step with single-process Muon, counts
the bytes dmuon sends, and compares the resumed run with the uninterrupted one, bit for bit.

Usage: torchrun --nproc-per-node=2 07_train_capstone.py [results.json]
"""

import sys
from contextlib import nullcontext
from types import SimpleNamespace

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_edu import checkpoint, distributed, dmuon
from dmuon_edu.course import capstone_program
from dmuon_edu.course.capstone_program import MAX_NORM
from dmuon_edu.course.gpt import is_hidden_matrix


def prepare(model, mesh, hyperparameters):
    """Set ``model`` up for dmuon on ``mesh`` in the layout you choose (Z2, Z3 or the DDP backend), with
    ``is_hidden_matrix`` choosing the matrices; return ``dmuon.Muon(model, **hyperparameters)``.

    ``model.layers`` holds the GPT's blocks."""
    ### BEGIN SOLUTION
    dmuon.dedicate_params(model, mesh, predicate=is_hidden_matrix, reshard_after_forward=True)  # Z3
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return dmuon.Muon(model, **hyperparameters)
    ### END SOLUTION


def train_step(model, optimizer, scheduler, window):
    """One optimizer step over ``window``, a list of this rank's (inputs, targets) micro-batches.

    The gradient is the window's mean; all but its last micro-batch run inside
    ``dmuon.no_sync(model)``. Clip to a global norm of MAX_NORM, step, then move the
    scheduler once. ``model(inputs, targets).loss`` is a micro-batch's mean loss. Return
    this rank's mean of the micro-batches' losses, a float (the check averages the ranks).
    """
    ### BEGIN SOLUTION
    total = 0.0
    for i, (inputs, targets) in enumerate(window):
        last = i == len(window) - 1
        with dmuon.no_sync(model) if not last else nullcontext():
            loss = model(inputs, targets).loss / len(window)
            loss.backward()
        total += loss.item()
    dmuon.clip_grad_norm_(model, MAX_NORM)  # every gradient: the owners' matrices and the FSDP2 shards
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return total
    ### END SOLUTION


def save(model, optimizer, scheduler, path, step):
    """Save everything the run needs to go on after ``step`` into the folder ``path``, with dmuon_edu.checkpoint
    (``help(checkpoint)`` shows the flow), so that ``checkpoint.latest`` finds it."""
    ### BEGIN SOLUTION
    sharded = dmuon.StateDictOptions()
    state = {"model": dmuon.get_model_state_dict(model, sharded),
             "optim": dmuon.get_optimizer_state_dict(model, optimizer, sharded),
             "scheduler": scheduler.state_dict()}
    checkpoint.save(state, path, step=step)
    ### END SOLUTION


def resume(model, optimizer, scheduler, root):
    """Restore, into the fresh ``model``, ``optimizer`` and ``scheduler``, the newest checkpoint that ``save``
    wrote under ``root``; return the step it was saved at, an int (``main`` trains on from the next)."""
    ### BEGIN SOLUTION
    path = checkpoint.latest(root)
    sharded = dmuon.StateDictOptions()
    state = {"model": dmuon.get_model_state_dict(model, sharded),
             "optim": dmuon.get_optimizer_state_dict(model, optimizer, sharded),
             "scheduler": scheduler.state_dict()}
    checkpoint.load(state, path)
    dmuon.set_model_state_dict(model, state["model"])
    dmuon.set_optimizer_state_dict(model, optimizer, state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return scheduler.last_epoch  # the scheduler counts the optimizer steps taken
    ### END SOLUTION


def main(ranks, run=capstone_program.ProgramRun()):
    """Train with the four functions above, save, resume in a fresh job, and grade both runs."""
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    program = SimpleNamespace(prepare=prepare, train_step=train_step, save=save, resume=resume)
    return capstone_program.report(capstone_program.run_program(program, ranks, mesh, run), run, sys.argv[1:])


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
