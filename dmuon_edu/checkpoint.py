"""Checkpoints that are either complete or refused: torch.distributed.checkpoint plus a marker.

    from dmuon_edu import checkpoint, dmuon

    sharded = dmuon.StateDictOptions()       # torch.distributed.checkpoint's flow: shards stay shards
    state = {"model": dmuon.get_model_state_dict(model, sharded),
             "optim": dmuon.get_optimizer_state_dict(model, optimizer, sharded),
             "scheduler": scheduler.state_dict()}
    checkpoint.save(state, "ckpt/step-100")          # every rank calls it

    # resume: the same dict from a freshly built model and optimizer, filled in place
    state = {"model": dmuon.get_model_state_dict(model, sharded), ...}
    checkpoint.load(state, "ckpt/step-100")
    dmuon.set_model_state_dict(model, state["model"]) ...

``save`` is ``dcp.save`` followed, once every rank has finished writing, by a marker
file ``COMPLETE`` that rank 0 creates atomically (write, fsync, rename). Saving over an
existing checkpoint removes its marker first. ``load`` refuses a directory without the
marker, so a save that was killed half-way (a crash, a pre-empted job, Ctrl-C) is
never mistaken for a good checkpoint. ``latest(root)`` finds the newest complete one.
Works in one process without a process group too (single-device loops).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dmuon_edu import distributed

__all__ = ["save", "load", "is_complete", "latest", "IncompleteCheckpointError", "MARKER"]

MARKER = "COMPLETE"


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory without its completion marker: its save never finished."""


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a checkpoint whose save finished on every rank (it has the marker)."""
    return (Path(path) / MARKER).is_file()


def save(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Save ``state`` with torch.distributed.checkpoint into the directory ``path``, then mark it complete.

    A collective when a process group exists: every rank calls it with its own state
    dict. Saving over an existing checkpoint removes its marker first, so that an
    interrupted save never leaves a directory that looks complete.

    Args:
        state: a dict of state dicts, e.g. ``{"model": ..., "optim": ...}``, as
            ``torch.distributed.checkpoint.save`` takes it.
        path: the checkpoint directory (created if needed).

    Raises:
        TypeError: ``state`` is not a dict.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of state dicts, e.g. {{'model': ..., 'optim': ...}}; got {type(state).__name__}")
    path = Path(path)
    if _rank() == 0:
        (path / MARKER).unlink(missing_ok=True)  # from now on, until the end, this is not a good checkpoint
        path.mkdir(parents=True, exist_ok=True)
    _barrier()  # nobody writes before the old marker is gone
    with _one_process_is_fine():
        dcp.save(state, checkpoint_id=path)
    _barrier()  # every rank's files are written
    if _rank() == 0:
        partial = path / f".{MARKER}.partial"
        with open(partial, "w") as f:
            json.dump({"world_size": _world_size(), "keys": sorted(state)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path / MARKER)
    _barrier()  # nobody reads it back before it is marked


def load(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Fill ``state`` in place from the complete checkpoint at ``path`` (any world size's).

    A collective when a process group exists.

    Args:
        state: the dict to fill, already holding every entry to load, e.g. the state
            dicts of a freshly built model and optimizer (``torch.distributed.checkpoint.load``
            loads in place).
        path: a directory that :func:`save` wrote.

    Raises:
        TypeError: ``state`` is not a dict.
        FileNotFoundError: there is no directory at ``path``.
        IncompleteCheckpointError: the directory has no completion marker: its save
            never finished.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be the dict to fill in place, e.g. {{'model': ..., 'optim': ...}}; got {type(state).__name__}")
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}: pass the directory that checkpoint.save wrote")
    if not is_complete(path):
        raise IncompleteCheckpointError(
            f"{path} is not a complete checkpoint (no {MARKER} marker): its save was interrupted. "
            "Resume from an earlier checkpoint (checkpoint.latest(root) finds the newest complete one) and delete this one"
        )
    with _one_process_is_fine():
        dcp.load(state, checkpoint_id=path)


def latest(root: str | os.PathLike) -> Path | None:
    """The most recently completed checkpoint directory directly under ``root``.

    Returns:
        The directory whose marker is newest, or None if ``root`` holds no complete
        checkpoint (or does not exist).
    """
    root = Path(root)
    found = [d for d in root.iterdir() if d.is_dir() and is_complete(d)] if root.is_dir() else []
    return max(found, key=lambda d: (d / MARKER).stat().st_mtime_ns, default=None)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@contextlib.contextmanager
def _one_process_is_fine():
    """Without a process group dcp warns that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        distributed.barrier()
