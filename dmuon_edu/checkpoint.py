"""Checkpoints that are complete and intact, or refused: torch.distributed.checkpoint plus a marker.

    from dmuon_edu import checkpoint, dmuon

    sharded = dmuon.StateDictOptions()       # torch.distributed.checkpoint's flow: shards stay shards
    state = {"model": dmuon.get_model_state_dict(model, sharded),
             "optim": dmuon.get_optimizer_state_dict(model, optimizer, sharded),
             "scheduler": scheduler.state_dict()}
    checkpoint.save(state, "ckpt/step-100", step=100)          # every rank calls it

    # resume: the same dict from a freshly built model and optimizer, filled in place
    path = checkpoint.latest("ckpt")                 # the highest step whose files verify, or None
    state = {"model": dmuon.get_model_state_dict(model, sharded), ...}
    checkpoint.load(state, path)
    dmuon.set_model_state_dict(model, state["model"]) ...

``save`` is ``dcp.save`` followed, once every rank has finished writing, by a marker
file ``COMPLETE`` that rank 0 creates atomically (write, fsync, rename). The marker holds
the step and the sha256 of every file the save wrote. Saving over an existing checkpoint
removes its marker first.

``load`` refuses a directory without the marker (a save killed half-way: a crash, a
pre-empted job, Ctrl-C) and one whose files differ from their checksums (a disk, copy or
storage error). It reads into new tensors and copies them into ``state`` only once every
tensor has been read, so a load that raises leaves ``state``, and the model whose tensors
it holds, exactly as they were. Every error of a save or a load is a
:class:`CheckpointError`. ``latest(root)`` finds the highest step among the checkpoints
that verify. Works in one process without a process group too (single-device loops).

A checkpoint is trusted code, whatever its marker says: torch.distributed.checkpoint
unpickles its ``.metadata`` file, and unpickling runs whatever code the file names. The
checksums catch a storage error, not an attacker who can write the directory; load only
checkpoints that you or your job wrote. The marker never makes the loader read a file but
the checkpoint's own: a name that is absolute, climbs out with ``..``, or is not a
regular file inside the directory once symlinks are resolved (``/dev/zero``, a FIFO, a
link to a file elsewhere) makes the marker corrupt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import numbers
import os
import stat
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from dmuon_edu import distributed

__all__ = ["save", "load", "is_complete", "latest", "CheckpointError", "IncompleteCheckpointError",
           "CorruptCheckpointError", "MARKER"]

MARKER = "COMPLETE"
# The file in which torch.distributed.checkpoint's FileSystemWriter keeps the checkpoint's layout.
_DCP_METADATA = ".metadata"
_ANOTHER_CHECKPOINT = "resume from another checkpoint (checkpoint.latest(root) finds the newest one that verifies)"


class CheckpointError(RuntimeError):
    """A checkpoint that could not be saved or loaded. A :func:`load` that raises it changed nothing."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint directory without its completion marker: its save never finished."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose marker is unreadable, or whose files are missing or differ from their checksums."""


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a checkpoint whose save finished on every rank (it has the marker).

    Reads no checkpoint file: :func:`load` and :func:`latest` verify the checksums as well.
    """
    return (Path(path) / MARKER).is_file()


def save(state: dict[str, Any], path: str | os.PathLike, *, step: int | None = None) -> None:
    """Save ``state`` with torch.distributed.checkpoint into the directory ``path``, then mark it complete.

    A collective when a process group exists: every rank calls it with its own state
    dict. Saving over an existing checkpoint removes its marker first, so that an
    interrupted save never leaves a directory that looks complete. Once every file is
    written, the ranks read them back (each a share of them) to checksum them, and rank 0
    writes the marker with the checksums and ``step``.

    Args:
        state: a dict of state dicts, e.g. ``{"model": ..., "optim": ...}``, as
            ``torch.distributed.checkpoint.save`` takes it.
        path: the checkpoint directory (created if needed).
        step: the training step ``state`` is at, an int >= 0. :func:`latest` orders
            checkpoints by it and passes over those saved without it.

    Raises:
        TypeError: ``state`` is not a dict, ``path`` is not a path, or ``step`` is not an int.
        ValueError: ``step`` is negative.
        CheckpointError: ``path`` or a directory above it is a file; an entry of
            ``state`` is empty on some ranks and not on others (a state dict gathered to
            rank 0 only: save ``StateDictOptions()``'s sharded state dicts), checked
            before anything is written; torch.distributed.checkpoint could not write the
            files, or a written file could not be read back (the disk is full, the
            storage failed): the directory then has no marker, so :func:`load` refuses it.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of state dicts, e.g. {{'model': ..., 'optim': ...}}; got {type(state).__name__}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
        raise TypeError(f"step must be an int, the training step the state is at (e.g. step=100); got {step!r}")
    if step is not None and step < 0:
        raise ValueError(f"step must be >= 0, the training step the state is at; got {step}")
    path = _path("path", path)
    _require_directory_path(path)
    _require_state_on_every_rank(state, path)
    if _rank() == 0:
        (path / MARKER).unlink(missing_ok=True)  # from now on, until the end, this is not a good checkpoint
        path.mkdir(parents=True, exist_ok=True)
    _barrier()  # nobody writes before the old marker is gone
    with _calling_dcp(lambda cause: f"could not save {path}: {cause}. It has no {MARKER} marker, so checkpoint.load "
                                    "refuses it and checkpoint.latest passes over it; remove the cause and save again"):
        dcp.save(state, checkpoint_id=path)
    _barrier()  # every rank's files are written
    # Only the files this save wrote: those of an earlier save into the same directory may remain.
    written = {info.relative_path for info in dcp.FileSystemReader(path).read_metadata().storage_data.values()}
    digests = _shared_digests(path, sorted({_DCP_METADATA, *written}))
    unreadable = sorted(name for name, digest in digests.items() if digest is None)
    if unreadable:  # every rank has the same digests, so every rank raises
        raise CheckpointError(f"could not read back {', '.join(unreadable)} in {path} after writing it: check the "
                              "storage and save again (the directory has no marker, so checkpoint.load refuses it)")
    if _rank() == 0:
        partial = path / f".{MARKER}.partial"
        with open(partial, "w") as f:
            json.dump({"step": None if step is None else int(step), "world_size": _world_size(),
                       "keys": sorted(state), "sha256": digests}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path / MARKER)
    _barrier()  # nobody reads it back before it is marked


def _require_directory_path(path: Path) -> None:
    """Refuse a checkpoint path that is a file or lies under one (every rank sees the same file system)."""
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                where = "is a file" if place == path else f"lies under {place}, which is a file"
                raise CheckpointError(f"cannot save a checkpoint at {path}: it {where}, and a checkpoint is a "
                                      "directory; choose a path whose existing parts are directories")
            return


def _require_state_on_every_rank(state: dict[str, Any], path: Path) -> None:
    """Refuse a state with an entry that is empty on some ranks and not on others, before anything is written.

    That is a state dict gathered to rank 0 only (``rank0_only``, the public dmuon's default
    for a full state dict): saved, it would be marked complete, and the resume would find
    nothing for the other ranks.
    """
    empty_on = _from_every_rank(sorted(key for key, value in state.items() if isinstance(value, dict) and not value))
    for key in state:
        empty = [rank for rank, keys in enumerate(empty_on) if key in keys]
        if empty and len(empty) < len(empty_on):
            raise CheckpointError(
                f"cannot save {path}: state[{key!r}] is empty on rank(s) {', '.join(map(str, empty))} and not on the "
                "others, as a state dict gathered to rank 0 only is (rank0_only, the default of a full state dict). "
                "Saved, it would be marked complete and the resume would find nothing for those ranks. Save the "
                "sharded state dicts of dmuon.StateDictOptions(), which every rank holds its part of")


def load(state: dict[str, Any], path: str | os.PathLike | None) -> None:
    """Fill ``state`` in place from the checkpoint at ``path``, or change nothing and raise.

    A collective when a process group exists, on any world size (the checksums are of
    files, so a checkpoint saved on another number of ranks verifies too). First every
    file is checked against its checksum in the marker (each rank reads a share of them;
    every rank raises the same error). Then torch.distributed.checkpoint reads into new
    tensors, and only once every one of them has been read are they copied into
    ``state``'s: meanwhile ``state``'s tensors take twice their memory.

    Args:
        state: the dict to fill, already holding every entry to load, e.g. the state
            dicts of a freshly built model and optimizer. Its tensors are filled in
            place; its other values are replaced with the saved ones.
        path: a directory that :func:`save` wrote.

    A checkpoint written by an older ``checkpoint.save`` (its marker holds no step and no
    checksums) is loaded too, with a RuntimeWarning: its files cannot be verified, but a
    key or a shape that differs is still refused and nothing is changed then.

    Raises:
        TypeError: ``state`` is not a dict, or one of its values is an object with a
            ``state_dict`` method (a module, an optimizer) instead of a state dict, or
            ``path`` is neither a path nor None.
        FileNotFoundError: there is no directory at ``path`` (or it is None, as from a
            :func:`latest` that found none).
        IncompleteCheckpointError: the directory has no completion marker: its save
            never finished.
        CorruptCheckpointError: the marker is unreadable, or a file is missing or differs
            from its checksum.
        CheckpointError: the checkpoint does not fit ``state`` (a key or a shape differs),
            or a file could not be read.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be the dict to fill in place, e.g. {{'model': ..., 'optim': ...}}; got {type(state).__name__}")
    for key, value in state.items():
        # torch.distributed.checkpoint would load into such an object's own tensors, part by part.
        if isinstance(value, Stateful):
            raise TypeError(f"state[{key!r}] is a {type(value).__name__}: pass its state dict instead (e.g. "
                            "dmuon.get_model_state_dict(model, options)), so that a load that fails changes nothing")
    if path is None:
        raise FileNotFoundError("no checkpoint: path is None, which checkpoint.latest(root) returns when root holds "
                                "no checkpoint that verifies; test for None and start from the beginning instead")
    path = _path("path", path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}: pass the directory that checkpoint.save wrote")
    if not is_complete(path):
        raise IncompleteCheckpointError(
            f"{path} is not a complete checkpoint (no {MARKER} marker): its save was interrupted. "
            "Resume from an earlier checkpoint (checkpoint.latest(root) finds the newest complete one) and delete this one"
        )
    marker, problem = _read_marker(path)
    if problem:
        raise CorruptCheckpointError(f"{path / MARKER} {problem}; {_ANOTHER_CHECKPOINT}. If you trust its files, "
                                     "torch.distributed.checkpoint.load reads them without any check")
    if _older_format(marker):
        warnings.warn(f"{path} was written by an older checkpoint.save, whose marker holds no checksums: its files "
                      "are loaded unverified (a key or a shape that differs is still refused). Save it again, "
                      "checkpoint.save(state, path, step=N), to have it verified from then on",
                      RuntimeWarning, stacklevel=2)
    problems = _file_problems(marker.get("sha256", {}), _shared_digests(path, sorted(marker.get("sha256", {}))))
    if problems:
        raise CorruptCheckpointError(f"{path} is corrupt: {'; '.join(problems)}: its files changed after "
                                     f"checkpoint.save wrote them, and nothing was loaded; {_ANOTHER_CHECKPOINT}")
    loaded = _empty_copy(state)
    with _calling_dcp(lambda cause: f"could not load {path}: {cause}. Nothing in state was changed. If a key or a "
                                    "shape differs, build state from a model and optimizer constructed as they were "
                                    "for the save; if a file could not be read, check the storage and load again"):
        dcp.load(loaded, checkpoint_id=path)
    mismatches = [where for _, _, where, old, new in _leaves(state, loaded, "state")
                  if isinstance(old, torch.Tensor) and not isinstance(new, torch.Tensor)]
    # Gathered, so that no rank copies while another raises.
    mismatches = [where for rank_mismatches in _from_every_rank(mismatches) for where in rank_mismatches]
    if mismatches:
        raise CheckpointError(f"could not load {path}: it holds a value that is not a tensor where state holds a "
                              f"tensor, at {mismatches[0]}. Nothing in state was changed; build state from a model "
                              "and optimizer constructed as they were for the save")
    with torch.no_grad():
        for container, key, _, old, new in _leaves(state, loaded, "state"):
            if isinstance(old, torch.Tensor):
                old.copy_(new)
            else:
                container[key] = new


def latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint directly under ``root`` with the highest step among those that verify.

    Not a collective: any rank may call it. Checkpoints are tried from the highest step
    down, reading their files, and the first whose files all match their checksums is
    returned. A directory without a marker (a save still running, or cut short) is passed
    over in silence; one with a marker but no step (saved without ``step=``), an
    unreadable marker, or a file that is missing or differs from its checksum is passed
    over with a RuntimeWarning that names it and says why.

    Args:
        root: the directory holding one directory per checkpoint, e.g. ``ckpt`` for
            ``ckpt/step-100``.

    Returns:
        That checkpoint's directory, or None if ``root`` holds no checkpoint that
        verifies (or does not exist).

    Raises:
        TypeError: ``root`` is not a path.
    """
    root = _path("root", root)
    candidates = []
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        if not (directory / MARKER).is_file():
            continue
        marker, problem = _read_marker(directory)
        step = marker.get("step")
        if problem:
            _passed_over(directory, f"{MARKER} {problem}")
        elif _older_format(marker):
            _passed_over(directory, "it was written by an older checkpoint.save, without a step or checksums, so it "
                                    "has no place in the order: load it by its path, checkpoint.load(state, path)")
        elif step is None:
            _passed_over(directory, "it was saved without a step (checkpoint.save(state, path, step=N)), so it has "
                                    "no place in the order")
        else:
            candidates.append((step, directory.name, directory, marker["sha256"]))
    for _, _, directory, expected in sorted(candidates, reverse=True):
        problems = _file_problems(expected, {name: _sha256(directory / name) for name in expected})
        if not problems:
            return directory
        _passed_over(directory, "; ".join(problems))
    return None


def _read_marker(path: Path) -> tuple[dict[str, Any], str | None]:
    """The marker's contents, and None; or what is wrong with them (then the contents are empty)."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as error:  # a UnicodeDecodeError is a ValueError
        return {}, f"cannot be read ({error})"
    if _older_format(marker):
        return marker, None
    digests = marker.get("sha256") if isinstance(marker, dict) else None
    if not (isinstance(digests, dict) and digests and all(isinstance(d, str) for d in digests.values())):
        return {}, "lists no file checksums: checkpoint.save did not write it"
    for name in digests:
        outside = _outside_the_checkpoint(path, name)
        if outside:
            return {}, (f"lists {name!r}, which {outside}: a marker lists only the checkpoint's own files, so "
                        "checkpoint.save did not write it (nothing was read)")
    step = marker.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        return {}, f"holds {step!r} as its step, not an int >= 0: checkpoint.save did not write it"
    return marker, None


def _outside_the_checkpoint(directory: Path, name: str) -> str | None:
    """Why the marker's entry ``name`` is not a file of the checkpoint's own, or None if it is one (or is missing,
    which the checksums then report). Nothing is read: a device or a FIFO would never end."""
    relative = Path(name)
    if not name or relative.is_absolute() or ".." in relative.parts:
        return "is not a plain name inside the checkpoint directory (an absolute path, or '..')"
    try:
        resolved = (directory / relative).resolve()
        if not resolved.is_relative_to(directory.resolve()):
            return f"leads outside the checkpoint directory (to {resolved}) through a symlink"
        if resolved.exists() and not stat.S_ISREG(resolved.stat().st_mode):
            return "is not a regular file (a directory, a device or a FIFO)"
    except (OSError, RuntimeError) as error:  # a symlink loop is a RuntimeError before Python 3.13
        return f"cannot be resolved ({error})"
    return None


def _older_format(marker: object) -> bool:
    """Whether a marker is the older save's, which held only the world size and the state's keys."""
    return isinstance(marker, dict) and set(marker) == {"world_size", "keys"}


def _path(name: str, path: object) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a directory's path (a str or a Path), got {path!r}")
    return Path(path)


def _sha256(file: Path) -> str | None:
    """The file's sha256 in hex, or None if it is missing or cannot be read."""
    try:
        with open(file, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def _shared_digests(path: Path, names: list[str]) -> dict[str, str | None]:
    """:func:`_sha256` of each named file in ``path``, every rank reading a share of them; every rank gets all."""
    share = {name: _sha256(path / name) for name in names[_rank()::_world_size()]}
    return {name: digest for rank_share in _from_every_rank(share) for name, digest in rank_share.items()}


def _file_problems(expected: dict[str, str], found: dict[str, str | None]) -> list[str]:
    return [f"{name} is missing or unreadable" if found[name] is None else f"{name} differs from its checksum"
            for name in sorted(expected) if found[name] != expected[name]]


def _passed_over(directory: Path, reason: str) -> None:
    warnings.warn(f"checkpoint.latest passed over {directory}: {reason}", RuntimeWarning, stacklevel=3)


def _empty_copy(value: Any) -> Any:
    """What torch.distributed.checkpoint loads into: new dicts, lists and tensors (``empty_like``); other values shared."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {key: _empty_copy(entry) for key, entry in value.items()}
    if isinstance(value, list):
        return [_empty_copy(entry) for entry in value]
    return value  # torch.distributed.checkpoint replaces a value that is not a tensor; it never changes it


def _leaves(live: dict | list, loaded: dict | list, where: str) -> Iterator[tuple[dict | list, Any, str, Any, Any]]:
    """(container, key, where, live value, loaded value) for each entry of ``live`` that is not a dict or list.

    A list that torch.distributed.checkpoint replaced whole (it holds no tensor) and whose
    length changed is one entry.
    """
    for key in list(live) if isinstance(live, dict) else range(len(live)):
        old, new = live[key], loaded[key]
        place = f"{where}[{key!r}]"
        if isinstance(old, dict) and isinstance(new, dict) or (
                isinstance(old, list) and isinstance(new, list) and len(old) == len(new)):
            yield from _leaves(old, new, place)
        else:
            yield live, key, place, old, new




def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _from_every_rank(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order; ``[value]`` without a process group."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@contextlib.contextmanager
def _calling_dcp(message: Callable[[str], str]) -> Iterator[None]:
    """Around a dcp call: its CheckpointException becomes a CheckpointError with ``message(cause)``.

    CheckpointException is a BaseException, which ``except Exception`` misses; its text is
    every failing rank's traceback, the cause here is the lowest failing rank's exception.
    Without a process group dcp warns that it assumes one process: that is the intent here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            yield
        except dcp.CheckpointException as error:
            rank, (exception, _) = min(error.failures.items())
            where = f" (on rank {rank})" if _world_size() > 1 else ""
            raise CheckpointError(message(f"{type(exception).__name__}: {exception}{where}")) from error


def _barrier() -> None:
    if dist.is_initialized():
        distributed.barrier()
