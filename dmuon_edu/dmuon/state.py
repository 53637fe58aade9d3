"""State dicts: the model's and the optimizer's, full or sharded, keyed by wrapper-free names.

Two ways to checkpoint, as in the public dmuon project:

- **Full state dicts** (the default): ``get_model_state_dict(model)`` returns full
  tensors, on the CPU, on rank 0 only (an empty dict elsewhere); every rank still takes
  part in the collectives. The documented flow: ``torch.save`` on rank 0, ``torch.load``
  on every rank, ``set_model_state_dict``. ``cpu_offload=`` and ``rank0_only=`` choose
  otherwise.
- **torch.distributed.checkpoint**: pass ``StateDictOptions`` explicitly. FSDP2
  parameters are then DTensor shards (full tensors with ``full_state_dict=True``), and
  DCP reshards them across world sizes.

Either way keys are parameter names (FQNs, without the segments that checkpoint_wrapper
and torch.compile insert: names.py, as torch.distributed.checkpoint does; a checkpoint
saved with the wrappers loads without them and the reverse) and dedicated matrices are
full plain tensors (their owner broadcasts them), i.e. replicated, which
torch.distributed.checkpoint saves once. The optimizer's: ``{"state": {fqn: {...}},
"param_groups": [...]}``, dmuon.Muon's groups in order (a Muon and an AdamW group per
``param_groups`` entry), each with its hyperparameters and ``"params": [fqn, ...]``. A
dedicated matrix's state (``momentum_buffer``; with route "adamw", AdamW's ``exp_avg``,
``exp_avg_sq`` and ``step``) is keyed by its name and full, whoever owns it, so a
checkpoint does not depend on the world size or the plan: after a resume on another
number of ranks each new owner picks up its matrices' state. AdamW's
``exp_avg``/``exp_avg_sq`` of the other parameters follow the model's parameters (shards
or full), ``step`` is a scalar.

Getting a state dict is a collective: every rank must call it, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.optimizer import _get_scalar_dtype

from dmuon_edu.arguments import describe

from . import tp
from .dedicate import DMuonState, state_of
from .names import fqn
from .optim import Muon, require_built_for
from .record import record_of

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
]


def _options(options: StateDictOptions | None, cpu_offload: bool | None = None,
             rank0_only: bool | None = None) -> tuple[StateDictOptions, bool]:
    """The StateDictOptions to follow, and whether only rank 0 keeps the result."""
    if options is not None and (cpu_offload is not None or rank0_only is not None):
        raise TypeError(
            "pass either options=StateDictOptions(...) (the torch.distributed.checkpoint flow) or "
            "cpu_offload=/rank0_only= (a full state dict), not both"
        )
    if options is None:  # the public project's defaults: full tensors, on the CPU, on rank 0
        cpu_offload = True if cpu_offload is None else cpu_offload
        rank0_only = True if rank0_only is None else rank0_only
        for name, flag in (("cpu_offload", cpu_offload), ("rank0_only", rank0_only)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload), rank0_only
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"options must be a torch.distributed.checkpoint StateDictOptions, got {type(options).__name__}")
    unsupported = [
        name
        for name, default in (("broadcast_from_rank0", False), ("flatten_optimizer_state_dict", False),
                              ("ignore_frozen_params", False), ("keep_submodule_prefixes", True))
        if getattr(options, name) != default
    ]
    if unsupported:
        raise ValueError(
            f"dmuon's state dicts do not support StateDictOptions({', '.join(unsupported)}); "
            "use full_state_dict, cpu_offload and strict (every rank passes the whole state dict)"
        )
    return options, False


def _kept(state: DMuonState, rank0_only: bool) -> bool:
    return not rank0_only or dist.get_rank() == 0


def _full(state: DMuonState, p: nn.Parameter, value: torch.Tensor | None, shape=None, dtype=None) -> torch.Tensor:
    """A full copy of a tensor of a dedicated parameter's on every rank, on the mesh's device: ``value`` is the
    owner's (ignored elsewhere), of ``shape`` and ``dtype`` (default: the parameter's).
    With a replicate mesh the owner first sends it to the holders of the other replicas."""
    record = record_of(p)
    if record.tp is not None:
        return tp.full_tensor(state, p, value, shape, dtype)
    owner = state.owner_of(p)
    shape = record.shape if shape is None else shape
    buffer = (value.detach().to(state.mesh_device, copy=True) if state.steps(p)
              else torch.empty(shape, dtype=dtype or record.dtype, device=state.mesh_device))
    if state.replicas > 1 and state.owns(p):
        with state.replicate_order.collective(f"the state dict's broadcast of {record.name} from replica "
                                              f"{record.replica}"):
            dist.broadcast(buffer, group=state.replicate_group, group_src=record.replica)
    with state.order.collective(f"the state dict's broadcast of {state.name_of[p]} from rank {owner}"):
        dist.broadcast(buffer, group=state.group, group_src=owner)
    return buffer


def _out(value: torch.Tensor, options: StateDictOptions) -> torch.Tensor:
    if isinstance(value, DTensor) and options.full_state_dict:
        value = value.full_tensor()
    return value.cpu() if options.cpu_offload else value


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """target <- value, where target may be a DTensor shard and value a DTensor or a full tensor."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            if isinstance(value, DTensor):
                value = value.redistribute(target.device_mesh, target.placements)
            else:  # a full tensor on every rank: keep this rank's piece, no communication
                value = distribute_tensor(value.to(target.device), target.device_mesh, target.placements,
                                          src_data_rank=None)
            target.to_local().copy_(value.to_local())
        else:
            target.copy_(value.full_tensor() if isinstance(value, DTensor) else value)


def get_model_state_dict(model: nn.Module, options: StateDictOptions | None = None, *,
                         cpu_offload: bool | None = None, rank0_only: bool | None = None) -> dict[str, Any]:
    """The model's state dict, keyed by parameter and buffer names; a collective.

    Args:
        model: a model prepared with ``dedicate_params`` (and ``fully_shard``).
        options: ``StateDictOptions`` for the torch.distributed.checkpoint flow: FSDP2
            parameters as DTensor shards, or full tensors with ``full_state_dict=True``;
            ``cpu_offload`` moves every tensor to the CPU. None: a full state dict.
        cpu_offload: for a full state dict (``options`` None), move it to the CPU
            (default True).
        rank0_only: for a full state dict, keep it on rank 0 only (default True); the
            other ranks get an empty dict.

    Returns:
        ``{name: tensor}``, dedicated parameters always as full plain tensors.

    Raises:
        ValueError: the model has no dedicated parameters, or ``options`` asks for
            something unsupported.
        TypeError: both ``options`` and ``cpu_offload``/``rank0_only`` were given.
    """
    state = state_of(model)
    options, rank0_only = _options(options, cpu_offload, rank0_only)
    state.publisher.wait()
    result, fetched = {}, {}
    for name, value in model.state_dict(keep_vars=True).items():  # keep_vars: no read of a placeholder
        if _is_dedicated(state, value):  # by identity: a tied matrix appears under each of its names
            if id(value) not in fetched:
                fetched[id(value)] = _full(state, value, record_of(value).master if state.steps(value) else None)
            value = fetched[id(value)]
        result[fqn(name)] = _out(value.detach(), options)
    return result if _kept(state, rank0_only) else {}


def _is_dedicated(state: DMuonState, tensor: torch.Tensor) -> bool:
    return any(tensor is p for p in state.params.values())


def set_model_state_dict(model: nn.Module, state_dict: dict[str, Any], options: StateDictOptions | None = None):
    """Load ``state_dict`` (sharded or full, any world size's) into the model; a collective in effect.

    Each owner copies in its dedicated matrices, every rank its FSDP2 shards; non-owner
    copies are dropped, so the next forward broadcasts the loaded values.

    Args:
        model: a model prepared with ``dedicate_params`` (and ``fully_shard``).
        state_dict: as :func:`get_model_state_dict` returns it, on any world size (keys
            with wrapper segments are read without them).
        options: ``StateDictOptions``; with ``strict`` (the default) the keys must match.

    Returns:
        ``_IncompatibleKeys(missing_keys, unexpected_keys)``, as nn.Module.load_state_dict.

    Raises:
        RuntimeError: with ``strict``, the keys differ from the model's.
        TypeError: ``state_dict`` is not a dict of tensors.
        ValueError: the model has no dedicated parameters, ``options`` asks for
            something unsupported, or a tensor's shape is not the model's. Nothing is
            loaded then.
    """
    options, _ = _options(options)
    state = state_of(model)
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict {{name: tensor}}, as dmuon.get_model_state_dict returns, "
                        f"got {describe(state_dict)}")
    state.publisher.wait()  # or a publish still on its way would overwrite the loaded values
    # the parameters themselves (keep_vars: no read of a placeholder)
    targets = {fqn(k): v for k, v in model.state_dict(keep_vars=True).items()}
    incoming = {fqn(k): v for k, v in state_dict.items()}
    missing = [k for k in targets if k not in incoming]
    unexpected = [k for k in incoming if k not in targets]
    if options.strict and (missing or unexpected):
        raise RuntimeError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    for name, target in targets.items():  # every value checked before the first copy
        if name in incoming:
            _require_tensor_like(incoming[name], target.shape, name)
    for name, target in targets.items():
        if name not in incoming:
            continue
        value = incoming[name].detach()  # a state dict of parameters may track gradients
        if _is_dedicated(state, target):
            if state.owns(target):
                _copy_into(record_of(target).master, tp.local_part(record_of(target), value))
        else:
            _copy_into(target, value)
    state.residency.release_all()  # non-owner copies may be stale now
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: fqn(name) for name, p in model.named_parameters()}


def get_optimizer_state_dict(model: nn.Module, optimizer: Muon, options: StateDictOptions | None = None, *,
                             cpu_offload: bool | None = None, rank0_only: bool | None = None) -> dict:
    """The optimizer's state dict, keyed by parameter names; a collective.

    Args:
        model: the model the optimizer was built for.
        optimizer: its dmuon.Muon.
        options, cpu_offload, rank0_only: as in :func:`get_model_state_dict`.

    Returns:
        ``{"state": {name: {...}}, "param_groups": [...]}``: each dedicated matrix's state
        (``momentum_buffer``, or AdamW's for one routed to AdamW) as full tensors, AdamW's
        moments of the other parameters like the model's parameters (shards, or full
        tensors), each group's hyperparameters with ``"params"`` as names. An empty dict
        on ranks other than 0 with ``rank0_only``.

    Raises:
        TypeError: ``optimizer`` is not the dmuon.Muon built for ``model``, or both
            ``options`` and ``cpu_offload``/``rank0_only`` were given.
    """
    state = state_of(model)
    options, rank0_only = _options(options, cpu_offload, rank0_only)
    require_built_for(optimizer, state)
    names = _names(model)
    result: dict[str, dict] = {}
    for group in optimizer.param_groups:  # the same order on every rank: the groups look alike everywhere
        for p in group["params"]:
            if p not in state.name_of:
                result[names[p]] = {k: _out(v, options) for k, v in optimizer._adamw.state[p].items()}
                continue
            mine = optimizer.inner_optimizer_of(p).state[state.stepped(p)] if state.steps(p) else {}
            templates = _DEDICATED_STATE[group["subgroup_type"]](p)
            result[state.name_of[p]] = {key: _out(_full(state, p, mine.get(key), shape, dtype), options)
                                        for key, (shape, dtype) in templates.items()}
    groups = [
        {**{k: group[k] for k in group if k != "params"}, "params": [names[p] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    return {"state": result, "param_groups": groups} if _kept(state, rank0_only) else {}


# A dedicated matrix's optimizer state, by its group's optimizer: {key: (shape, dtype)}.
_DEDICATED_STATE = {
    "muon": lambda p: {"momentum_buffer": (DMuonState.full_shape(p), record_of(p).dtype)},
    "adamw": lambda p: {"step": ((), _get_scalar_dtype()), "exp_avg": (record_of(p).shape, record_of(p).dtype),
                        "exp_avg_sq": (record_of(p).shape, record_of(p).dtype)},
}


def set_optimizer_state_dict(model: nn.Module, optimizer: Muon, state_dict: dict,
                             options: StateDictOptions | None = None) -> None:
    """Load ``state_dict`` (as :func:`get_optimizer_state_dict` returns it, any world size's) in place.

    Each owner takes its matrices' state, whoever owned them when it was saved; every
    rank takes its AdamW shards; the groups take the saved hyperparameters.

    Raises:
        TypeError: ``optimizer`` is not the dmuon.Muon built for ``model``, or
            ``state_dict`` is not an optimizer state dict.
        RuntimeError: with ``strict`` (the default), a parameter's state is missing, or
            the state dict has another number of param groups.
        ValueError: a momentum buffer holds NaN or Inf, a state tensor's shape is not
            its parameter's, or a saved group's route (``use_muon``, ``subgroup_type``,
            ``group_name``) or parameters are not those of this optimizer's group at its
            place. Nothing is loaded then.
    """
    options, _ = _options(options)
    state = state_of(model)
    require_built_for(optimizer, state)
    if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
            and isinstance(state_dict.get("param_groups"), list)):
        raise TypeError("state_dict must be what dmuon.get_optimizer_state_dict returns, a dict with 'state' "
                        f"and 'param_groups', got {describe(state_dict)}")
    names = _names(model)
    saved = {fqn(k): v for k, v in state_dict["state"].items()}
    expected = [names[p] for group in optimizer.param_groups for p in group["params"]]
    missing = [n for n in expected if n not in saved]
    if missing and options.strict:
        raise RuntimeError(f"optimizer state dict lacks the state of {missing}")
    if len(state_dict["param_groups"]) != len(optimizer.param_groups) and options.strict:
        raise RuntimeError(
            f"the optimizer state dict has {len(state_dict['param_groups'])} param groups and this optimizer "
            f"{len(optimizer.param_groups)}: build dmuon.Muon with the param_groups it was saved with"
        )
    for index, (group, saved_group) in enumerate(zip(optimizer.param_groups, state_dict["param_groups"])):
        _require_same_group(index, group, saved_group, [names[p] for p in group["params"]] if options.strict else None)
    for name, p in state.params.items():  # full tensors, the same on every rank: every rank refuses alike, before any copy
        buffer = saved.get(name, {}).get("momentum_buffer")
        if isinstance(buffer, torch.Tensor) and not bool(buffer.isfinite().all()):
            raise ValueError(
                f"the momentum buffer of {name} in this optimizer state dict holds NaN or Inf, so every later update "
                "of it would be NaN. Load a checkpoint from before the divergence, or leave the optimizer state out "
                "(momentum restarts from zero)"
            )
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):  # a dedicated matrix's state is the whole matrix's
            if key in saved.get(name, {}):
                _require_tensor_like(saved[name][key], state.full_shape(p), f"the {key.replace('_', ' ')} of {name}")
    loads = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[p]
            if name not in saved or (p in state.name_of and not state.steps(p)):
                continue
            inner = optimizer._adamw if p not in state.name_of else optimizer.inner_optimizer_of(p)
            for key, target in inner.state[state.stepped(p) if p in state.name_of else p].items():
                _require_tensor_like(saved[name].get(key), target.shape, f"the {key.replace('_', ' ')} of {name}")
                loads.append((target, saved[name][key]))
    for target, value in loads:
        _copy_into(target, value)
    for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def _require_same_group(index: int, group: dict, saved: object, names: list[str] | None) -> None:
    """Refuse a saved group whose route, or (given ``names``, the live group's) parameters, differ from the live
    group's: its hyperparameters would be copied over a group of other parameters (a Muon group told
    use_muon=False is skipped by the optimizer-form clip, silently)."""
    if not isinstance(saved, dict):
        raise TypeError(f"param group {index} of the optimizer state dict is {describe(saved)}, not a dict; "
                        "nothing was loaded")
    fix = ("the state dict's groups are not this optimizer's, and nothing was loaded: build dmuon.Muon with the "
           "param_groups (and param_policy) it was saved with")
    for key in ("use_muon", "subgroup_type", "group_name"):
        if key in saved and saved[key] != group.get(key):
            raise ValueError(f"param group {index} of the optimizer state dict has {key}={saved[key]!r}, this "
                             f"optimizer's group {index} has {key}={group.get(key)!r}: {fix}")
    saved_names = saved.get("params")
    if names is not None and isinstance(saved_names, list) and all(isinstance(n, str) for n in saved_names) and \
            sorted(map(fqn, saved_names)) != sorted(names):
        raise ValueError(f"param group {index} of the optimizer state dict holds other parameters than this "
                         f"optimizer's group {index} ({sorted(set(map(fqn, saved_names)) ^ set(names))[:3]} are in "
                         f"one only): {fix}")


def _require_tensor_like(value, shape: torch.Size, where: str) -> None:
    """Refuse, before anything is loaded, a state dict entry that is no tensor or has another shape."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} in the state dict is {describe(value)}, not a tensor; nothing was loaded")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where} in the state dict has shape {tuple(value.shape)}, but the model's has shape "
                         f"{tuple(shape)}: the state dict is another model's, and nothing was loaded. Load it into "
                         "a model built as the saved one was")

