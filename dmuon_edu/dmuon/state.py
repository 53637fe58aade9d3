"""State dicts, and clip_grad_norm_.

Two ways to checkpoint, as in the public dmuon project:

- **Full state dicts** (the default): ``get_model_state_dict(model)`` returns full
  tensors, on the CPU, on rank 0 only (an empty dict elsewhere); every rank still takes
  part in the collectives. The documented flow: ``torch.save`` on rank 0, ``torch.load``
  on every rank, ``set_model_state_dict``. ``cpu_offload=`` and ``rank0_only=`` choose
  otherwise.
- **torch.distributed.checkpoint**: pass ``StateDictOptions`` explicitly. FSDP2
  parameters are then DTensor shards (full tensors with ``full_state_dict=True``), and
  DCP reshards them across world sizes.

Either way keys are parameter names (FQNs) and dedicated matrices are full plain tensors
(their owner broadcasts them), i.e. replicated, which torch.distributed.checkpoint saves
once. The optimizer's: ``{"state": {fqn: {...}}, "param_groups": [muon group, adamw
group]}``, each group with its hyperparameters and ``"params": [fqn, ...]``. A dedicated
matrix's ``momentum_buffer`` is keyed by its name, whoever owns it, so a checkpoint does
not depend on the world size or the plan: after a resume on another number of ranks each
new owner picks up its matrices' momentum. AdamW's ``exp_avg``/``exp_avg_sq`` follow the
model's parameters (shards or full), ``step`` is a scalar.

Getting a state dict is a collective: every rank must call it, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, distribute_tensor

from dmuon_edu.arguments import describe

from .dedicate import DMuonState, state_of
from .optim import Muon

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "clip_grad_norm_",
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


def _full(state: DMuonState, p: nn.Parameter, value: torch.Tensor | None) -> torch.Tensor:
    """A full copy of a dedicated tensor on every rank: ``value`` is the owner's (ignored elsewhere).
    With a replicate mesh the owner first sends it to the holders of the other replicas."""
    owner = state.owner_of(p)
    buffer = (value.detach().clone() if state.runs_muon(p)
              else torch.empty(p._dmuon_shape, dtype=p._dmuon_dtype, device=state.mesh_device))
    if state.replicas > 1 and state.owns(p):
        with state.replicate_order.collective(f"the state dict's broadcast of {state.name_of[p]} from replica "
                                              f"{p._dmuon_replica}"):
            dist.broadcast(buffer, group=state.replicate_group, group_src=p._dmuon_replica)
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
    state.wait_published()
    result, fetched = {}, {}
    for name, value in model.state_dict(keep_vars=True).items():  # keep_vars: no read of a placeholder
        if _is_dedicated(state, value):  # by identity: a tied matrix appears under each of its names
            if id(value) not in fetched:
                fetched[id(value)] = _full(state, value, value._dmuon_master if state.runs_muon(value) else None)
            value = fetched[id(value)]
        result[name] = _out(value.detach(), options)
    return result if _kept(state, rank0_only) else {}


def _is_dedicated(state: DMuonState, tensor: torch.Tensor) -> bool:
    return any(tensor is p for p in state.params.values())


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], options: StateDictOptions | None = None):
    """Load ``model_state_dict`` (sharded or full, any world size's) into the model; a collective in effect.

    Each owner copies in its dedicated matrices, every rank its FSDP2 shards; non-owner
    copies are dropped, so the next forward broadcasts the loaded values.

    Args:
        model: a model prepared with ``dedicate_params`` (and ``fully_shard``).
        model_state_dict: as :func:`get_model_state_dict` returns it, on any world size.
        options: ``StateDictOptions``; with ``strict`` (the default) the keys must match.

    Returns:
        ``_IncompatibleKeys(missing_keys, unexpected_keys)``, as nn.Module.load_state_dict.

    Raises:
        RuntimeError: with ``strict``, the keys differ from the model's.
        TypeError: ``model_state_dict`` is not a dict of tensors.
        ValueError: the model has no dedicated parameters, ``options`` asks for
            something unsupported, or a tensor's shape is not the model's. Nothing is
            loaded then.
    """
    options, _ = _options(options)
    state = state_of(model)
    if not isinstance(model_state_dict, dict):
        raise TypeError(f"model_state_dict must be a dict {{name: tensor}}, as dmuon.get_model_state_dict returns, "
                        f"got {describe(model_state_dict)}")
    state.wait_published()  # or a publish still on its way would overwrite the loaded values
    targets = model.state_dict(keep_vars=True)  # the parameters themselves: no read of a placeholder
    missing = [k for k in targets if k not in model_state_dict]
    unexpected = [k for k in model_state_dict if k not in targets]
    if options.strict and (missing or unexpected):
        raise RuntimeError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    for name, target in targets.items():  # every value checked before the first copy
        if name in model_state_dict:
            _require_tensor_like(model_state_dict[name], target.shape, name)
    for name, target in targets.items():
        if name not in model_state_dict:
            continue
        value = model_state_dict[name].detach()  # a state dict of parameters may track gradients
        if _is_dedicated(state, target):
            if state.owns(target):
                _copy_into(target._dmuon_master, value)
        else:
            _copy_into(target, value)
    state.release_all()  # non-owner copies may be stale now
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: name for name, p in model.named_parameters()}


def get_optimizer_state_dict(model: nn.Module, optimizer: Muon, options: StateDictOptions | None = None, *,
                             cpu_offload: bool | None = None, rank0_only: bool | None = None) -> dict:
    """The optimizer's state dict, keyed by parameter names; a collective.

    Args:
        model: the model the optimizer was built for.
        optimizer: its dmuon.Muon.
        options, cpu_offload, rank0_only: as in :func:`get_model_state_dict`.

    Returns:
        ``{"state": {name: {...}}, "param_groups": [muon group, adamw group]}``: each
        dedicated matrix's ``momentum_buffer`` as a full tensor, AdamW's moments like the
        model's parameters (shards, or full tensors), each group's hyperparameters with
        ``"params"`` as names. An empty dict on ranks other than 0 with ``rank0_only``.

    Raises:
        TypeError: ``optimizer`` is not the dmuon.Muon built for ``model``, or both
            ``options`` and ``cpu_offload``/``rank0_only`` were given.
    """
    state = state_of(model)
    options, rank0_only = _options(options, cpu_offload, rank0_only)
    _check_optimizer(optimizer, state)
    names = _names(model)
    result: dict[str, dict] = {}
    for name, p in state.params.items():
        buf = optimizer._muon.state[p]["momentum_buffer"] if state.runs_muon(p) else None
        result[name] = {"momentum_buffer": _out(_full(state, p, buf), options)}
    for p in optimizer.adamw_group["params"]:
        result[names[p]] = {k: _out(v, options) for k, v in optimizer._adamw.state[p].items()}
    groups = [
        {**{k: group[k] for k in group if k != "params"}, "params": [names[p] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    return {"state": result, "param_groups": groups} if _kept(state, rank0_only) else {}


def set_optimizer_state_dict(model: nn.Module, optimizer: Muon, optim_state_dict: dict,
                             options: StateDictOptions | None = None) -> None:
    """Load ``optim_state_dict`` (as :func:`get_optimizer_state_dict` returns it, any world size's) in place.

    Each owner takes its matrices' momentum, whoever owned them when it was saved;
    every rank takes its AdamW shards; both groups take the saved hyperparameters.

    Raises:
        TypeError: ``optimizer`` is not the dmuon.Muon built for ``model``, or
            ``optim_state_dict`` is not an optimizer state dict.
        ValueError: a momentum buffer holds NaN or Inf, or a state tensor's shape is not
            its parameter's. Nothing is loaded then.
        RuntimeError: with ``strict`` (the default), a parameter's state is missing.
    """
    options, _ = _options(options)
    state = state_of(model)
    _check_optimizer(optimizer, state)
    if not (isinstance(optim_state_dict, dict) and isinstance(optim_state_dict.get("state"), dict)
            and isinstance(optim_state_dict.get("param_groups"), list)):
        raise TypeError("optim_state_dict must be what dmuon.get_optimizer_state_dict returns, a dict with 'state' "
                        f"and 'param_groups', got {describe(optim_state_dict)}")
    names = _names(model)
    saved = optim_state_dict["state"]
    expected = [names[p] for group in optimizer.param_groups for p in group["params"]]
    missing = [n for n in expected if n not in saved]
    if missing and options.strict:
        raise RuntimeError(f"optimizer state dict lacks the state of {missing}")
    for name, p in state.params.items():  # full tensors, the same on every rank: every rank refuses alike, before any copy
        buffer = saved.get(name, {}).get("momentum_buffer")
        if isinstance(buffer, torch.Tensor) and not bool(buffer.isfinite().all()):
            raise ValueError(
                f"the momentum buffer of {name} in this optimizer state dict holds NaN or Inf, so every later update "
                "of it would be NaN. Load a checkpoint from before the divergence, or leave the optimizer state out "
                "(momentum restarts from zero)"
            )
        if name in saved:
            _require_tensor_like(buffer, p._dmuon_shape, f"the momentum buffer of {name}")
    for p in optimizer.adamw_group["params"]:
        for key, target in optimizer._adamw.state[p].items():
            if names[p] in saved:
                _require_tensor_like(saved[names[p]].get(key), target.shape, f"the {key} of {names[p]}")
    for name, p in state.params.items():
        if name in saved and state.runs_muon(p):
            _copy_into(optimizer._muon.state[p]["momentum_buffer"], saved[name]["momentum_buffer"])
    for p in optimizer.adamw_group["params"]:
        for key, target in optimizer._adamw.state[p].items():
            if names[p] in saved:
                _copy_into(target, saved[names[p]][key])
    for group, saved_group in zip(optimizer.param_groups, optim_state_dict["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def _require_tensor_like(value, shape: torch.Size, where: str) -> None:
    """Refuse, before anything is loaded, a state dict entry that is no tensor or has another shape."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} in the state dict is {describe(value)}, not a tensor; nothing was loaded")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where} in the state dict has shape {tuple(value.shape)}, but the model's has shape "
                         f"{tuple(shape)}: the state dict is another model's, and nothing was loaded. Load it into "
                         "a model built as the saved one was")


def _check_optimizer(optimizer, state: DMuonState) -> None:
    if not isinstance(optimizer, Muon) or optimizer._dmuon is not state:
        raise TypeError("pass the dmuon.Muon optimizer that was built for this model")


def clip_grad_norm_(model_or_optimizer: nn.Module | Muon, max_norm: float) -> torch.Tensor:
    r"""Scale gradients so that their global 2-norm is at most ``max_norm``; a collective.

    .. math::

        \lVert g \rVert = \Bigl(\sum_{\text{ranks}} \sum_{g \text{ held}} \lVert g \rVert_2^2\Bigr)^{1/2},
        \qquad g \leftarrow g \cdot \min\Bigl(1, \frac{\text{max\_norm}}{\lVert g \rVert + 10^{-6}}\Bigr)

    Two forms:

    - ``clip_grad_norm_(model, max_norm)``: every gradient, the owners' reduced dedicated
      gradients and every FSDP2 gradient shard (a plain replicated gradient counts once):
      the same norm and scaling as torch.nn.utils.clip_grad_norm_ in one process with
      the full gradients.
    - ``clip_grad_norm_(optimizer, max_norm)``, the public dmuon project's form: the Muon
      (dedicated) gradients only; clip the others with torch's own clip_grad_norm_.

    Call it after the last backward of the window, outside no_sync.

    Args:
        model_or_optimizer: a model prepared with ``dedicate_params``, or its dmuon.Muon.
        max_norm: the largest allowed global norm, a finite number > 0.

    Returns:
        The global norm before clipping, a scalar float32 tensor (the same on every rank).

    Raises:
        ValueError: ``max_norm`` is not a finite number > 0, or the model has no
            dedicated parameters.
        TypeError: neither a model nor a dmuon.Muon was given.
        RuntimeError: called inside no_sync, or with gradients not reduced yet.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < float("inf"):
        raise ValueError(
            f"max_norm must be a finite number > 0, got {max_norm!r}: 0 would zero every gradient and a negative "
            "one would flip every gradient; 1.0 is the usual value"
        )
    if isinstance(model_or_optimizer, Muon):
        state, model = model_or_optimizer._dmuon, None
    elif isinstance(model_or_optimizer, nn.Module):
        state, model = state_of(model_or_optimizer), model_or_optimizer
    else:
        raise TypeError(f"clip_grad_norm_ takes the model or its dmuon.Muon, got {type(model_or_optimizer).__name__}")
    if state.in_no_sync or any(p._accumulated_grad is not None for p in state.params.values()):
        raise RuntimeError(
            "clip_grad_norm_ needs reduced gradients: call it after the last backward of the window, "
            "which runs outside no_sync"
        )
    dedicated = [p._reduced_grad for p in state.params.values() if p._reduced_grad is not None]  # on owners
    shards, replicated = [], []
    for p in model.parameters() if model is not None else ():
        if not _is_dedicated(state, p) and p.grad is not None:
            (shards if isinstance(p.grad, DTensor) else replicated).append(p.grad)
    # Count each gradient once: a shard is the same in every replica, a plain gradient on every rank.
    counted = dedicated + (shards if state.replica == 0 else []) + (replicated if dist.get_rank() == 0 else [])
    squares = torch.zeros((), dtype=torch.float32, device=state.mesh_device)
    for g in counted:
        squares += (g.to_local() if isinstance(g, DTensor) else g).float().square().sum()
    with state.order.collective("clip_grad_norm_'s all-reduce of squared gradient norms"):
        dist.all_reduce(squares, group=state.everyone)
    total = squares.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in dedicated + shards + replicated:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(scale.to(g.dtype))
    return total
