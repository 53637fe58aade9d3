"""dmuon.Muon: single-device Muon on each owner's matrices, AdamW on everyone's FSDP2 shards.

Param groups, visible to torch.optim.lr_scheduler like any optimizer's: a Muon group
and an AdamW group for each *semantic* group, the public dmuon project's lowering of
``param_groups=``. Without it there is one semantic group, "default":

- ``param_groups[0]``, Muon: every dedicated parameter routed to Muon (on every rank, so
  that the groups look alike everywhere), with lr, momentum, nesterov, weight_decay,
  adjust_lr_fn, ns_steps, ns_dtype;
- ``param_groups[1]``, AdamW: every other trainable parameter (its FSDP2 shard) and the
  dedicated matrices routed to AdamW (policy.py), with lr (= adamw_lr), betas, eps,
  weight_decay (= adamw_weight_decay).

Each group also has ``group_name`` ("default/muon"), ``semantic_group_name``,
``subgroup_type`` ("muon" or "adamw") and ``use_muon``. With ``param_groups=[{"params":
..., "lr": ...}, ...]`` (a list of dicts, e.g. norms and embeddings without weight
decay), group i becomes ``param_groups[2 i]`` (its dedicated Muon matrices) and
``param_groups[2 i + 1]`` (the rest). A group's keys: ``params``; ``group_name`` or
``name``; ``lr`` (both subgroups), ``muon_lr``, ``adamw_lr``; ``weight_decay`` (both),
``muon_weight_decay``, ``adamw_weight_decay``; ``momentum``, ``adamw_betas``,
``adamw_eps``; ``nesterov``, ``adjust_lr_fn``, ``ns_steps``, ``ns_dtype``;
``dmuon_route`` ("muon" or "adamw": the optimizer of its dedicated matrices). Every
trainable parameter of the model must be in exactly one group; frozen ones are skipped.

A scheduler scales each group's own ``lr``: LambdaLR(opt, f) multiplies both lr and
adamw_lr by f(step). The groups are the source of truth; step() hands their values to
three inner optimizers, one group per semantic group each: a dmuon_edu.muon.Muon over
the Muon matrices this rank owns (fed with their records' ``reduced_grad``: record.py; see
its docstring for how same-shape matrices are batched), a torch.optim.AdamW over the
shards, and one over the AdamW-routed matrices this rank owns.

Non-finite gradients: if any gradient of the step holds NaN or Inf, on any rank (an
owner's reduced matrix gradient or any FSDP2 shard), step() skips the whole step on
every rank: weights, momentum, Adam moments and step counts stay as they were, a
RuntimeWarning says so, and ``skipped_steps`` counts it (GradScaler's policy, applied
to all ranks alike). Deciding it costs one all_reduce of a few numbers per step, which
also carries the order check's digests (order.py) and whether a clip of the FSDP2
gradients alone happened (clip.py). A learning-rate scheduler that the loop steps after
every optimizer step still advances on a skipped one, as it does after a step that
GradScaler skips; a loop that must not lose schedule on a skip can compare
``skipped_steps`` before and after.

Optimizer state is created at construction (zero momentum, zero Adam moments, step 0:
exactly a fresh optimizer's first step), so that a fresh optimizer's state dict
already holds every entry a checkpoint load fills.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from functools import partial

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_scalar_dtype

from dmuon_edu import muon as single_device

from . import tp
from .clip import MuonGradClipStats, clip_grad_norm_
from .ddp import replicated_params
from .dedicate import state_of
from .ns_backend import NewtonSchulz, as_backend
from .order import MODES
from .record import record_of
from .step_agreement import StepAgreement

__all__ = ["Muon"]

MUON_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "adjust_lr_fn", "ns_steps", "ns_dtype")
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
# A semantic group's keys -> (the Muon subgroup's key, the AdamW subgroup's key); the specific key wins.
GROUP_KEYS = {
    "lr": ("lr", "lr"), "muon_lr": ("lr", None), "adamw_lr": (None, "lr"),
    "weight_decay": ("weight_decay", "weight_decay"), "muon_weight_decay": ("weight_decay", None),
    "adamw_weight_decay": (None, "weight_decay"), "momentum": ("momentum", None), "nesterov": ("nesterov", None),
    "adjust_lr_fn": ("adjust_lr_fn", None), "ns_steps": ("ns_steps", None), "ns_dtype": ("ns_dtype", None),
    "adamw_betas": (None, "betas"), "adamw_eps": (None, "eps"),
}
ROUTE_KEYS = ("dmuon_route", "dmuon_optimizer", "matrix_optimizer")  # the public project's three spellings
NAME_KEYS = ("group_name", "name")


class _OwnerMuon(single_device.Muon):
    """dmuon_edu.muon.Muon orthogonalising with dmuon.Muon's ``ns_backend``."""

    _refuses_empty_groups = False  # a rank that owns no matrix steps empty groups

    def __init__(self, params, backend: NewtonSchulz, **hyper):
        self.backend = backend
        super().__init__(params, **hyper)

    def _orthogonaliser(self, group: dict):
        return partial(self.backend.orthogonalise, steps=group["ns_steps"], dtype=group["ns_dtype"])


def require_built_for(optimizer: object, state) -> None:
    """Refuse an optimizer that is not the dmuon.Muon built for the model whose dmuon state is ``state``."""
    if not isinstance(optimizer, Muon) or optimizer._dmuon is not state:
        what = (f"a {type(optimizer).__name__}" if not isinstance(optimizer, Muon) else
                "the dmuon.Muon of another model")
        raise TypeError(f"the optimizer is {what}: pass the dmuon.Muon optimizer that was built for this model")


class Muon(torch.optim.Optimizer):
    """Distributed Muon for a model prepared with ``dedicate_params`` and ``fully_shard``.

    Call ``step()`` once per optimizer step, outside ``no_sync`` (after the backward
    that reduces), and ``zero_grad()`` after it. After ``step()`` the non-owner copies
    of dedicated parameters are freed: the next forward broadcasts the new values.
    ``state_dict()`` is not per-rank meaningful; use dmuon.get_optimizer_state_dict.

    The defaults, and the order of the positional arguments (up to ``replicate_async``),
    are the public dmuon project's: its update scale is s(m, n) = 0.2 sqrt(max(m, n))
    ("match_rms_adamw", an update with AdamW's RMS, so that lr 0.02 sits beside adamw_lr
    1e-3). ``adjust_lr_fn="original"`` gives Keller Jordan's sqrt(max(1, m / n)), the
    default of dmuon_edu.muon.Muon and torch.optim.Muon: pass it to compare with those.

    Args:
        model: the model, after ``dedicate_params`` and ``fully_shard``.
        lr, momentum, weight_decay, ns_steps, nesterov, adjust_lr_fn, ns_dtype: the Muon
            hyperparameters of the dedicated matrices, as in dmuon_edu.muon.Muon
            (``ns_dtype="auto"``: bf16 where the hardware multiplies it natively).
        adamw_lr, adamw_betas, adamw_weight_decay, adamw_eps: torch.optim.AdamW's lr,
            betas, weight_decay and eps for every other trainable parameter.
        param_groups: a list of dicts, each lowered into a Muon and an AdamW group (the
            module docstring lists their keys); None: one group of everything.
        ns_backend: "gram" (the default), "direct", or a dmuon.NewtonSchulz with its own
            coefficients (ns_backend.py).
        replicate_async: with a replicate mesh (HSDP), start publishing each owner's
            updated matrices to the other replicas at the end of ``step()`` and wait for
            them at the next forward (True), or within ``step()`` (False). The same
            results either way; nothing to publish on a 1-D mesh, except with the DDP
            backend (ddp.py), whose owners publish their matrices to every rank so.
        forward_prefetch_depth: how many layers ahead a layer's forward issues their
            broadcasts (the backward of Z3 likewise, in reverse order), so that they
            travel while this layer computes; 0 issues each at its own layer's forward.
        order_check: how the ranks check that they run dmuon's collectives in the same
            order (order.py): "per_step" (the default: strictly until the first step,
            then a running hash compared at every step, and on gloo, which aborts
            natively on a mismatched collective, each event compared with the last
            step's, the ranks meeting in the store where it differs), "strict" (a
            store round trip before every event) or "off".

    Raises:
        TypeError: ``model`` is not an nn.Module, ``param_groups`` or ``ns_backend`` has
            the wrong type, or a hyperparameter has the wrong type.
        ValueError: the model has no dedicated parameters, a trainable parameter is
            neither dedicated nor sharded by FSDP2, ``param_groups`` leaves out or repeats
            a trainable parameter or has an unknown key, a hyperparameter is invalid (also
            checked at every step, after schedulers and state dict loads), an AdamW group's
            ``eps`` rounds to 0 in the dtype of its parameters (1e-8 in float16: AdamW would
            write NaN into them; keep float32 parameters and compute in float16 through
            fully_shard's mp_policy), or a dedicated matrix's compute_dtype disagrees with
            fully_shard's mixed-precision policy.
        RuntimeError: ``step()`` is called inside ``no_sync``, or the ranks ran dmuon's
            collectives in different orders (the step is refused on every rank).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_weight_decay: float = 0.01,
        adamw_eps: float = 1e-8,
        param_groups: list[dict] | None = None,
        ns_backend: str | NewtonSchulz = "gram",
        nesterov: bool = True,
        replicate_async: bool = True,
        *,
        adjust_lr_fn: str = "match_rms_adamw",
        ns_dtype: torch.dtype | str = "auto",
        forward_prefetch_depth: int = 1,
        order_check: str = "per_step",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"dmuon.Muon takes the model (after dedicate_params and fully_shard), got {type(model).__name__}")
        self._dmuon = state_of(model)
        _check_step_options(forward_prefetch_depth, replicate_async, order_check)
        backend = as_backend(ns_backend)
        for unit in self._dmuon.units:  # a compute_dtype that disagrees with fully_shard's policy: refused now
            self._dmuon.precision(unit)
        _require_every_gradient_averaged(model, self._dmuon)
        muon_hyper = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                          adjust_lr_fn=adjust_lr_fn, ns_steps=ns_steps, ns_dtype=ns_dtype)
        adamw_hyper = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
        _check_adamw_hyperparameters(adamw_hyper)  # their types before tuple(); torch.optim.AdamW lets inf through
        adamw_hyper["betas"] = tuple(adamw_betas)
        groups = _lower(model, self._dmuon, param_groups, muon_hyper, adamw_hyper)
        for group in groups:  # a user group's own values too; the inner Muon checks its own
            _check_group(group)

        self._dmuon.schedule = dataclasses.replace(self._dmuon.schedule, prefetch_depth=forward_prefetch_depth)
        self.replicate_async = replicate_async
        for order in self._dmuon.orders:
            order.mode = order_check
        self._muon, self._adamw, self._owner_adamw = _inner_optimizers(self._dmuon, groups, backend, muon_hyper,
                                                                        adamw_hyper)
        self._inner = (self._muon, self._adamw, self._owner_adamw)
        # The record of each tensor this rank steps (a TP-sharded matrix's owner steps its proxy: tp.py)
        state = self._dmuon
        self._record_stepped_as = {id(state.stepped(p)): record_of(p) for p in state.params.values() if state.steps(p)}
        super().__init__(groups, defaults={})
        self.last_muon_grad_clip_stats: MuonGradClipStats | None = None
        self.skipped_steps = 0  # steps skipped for non-finite gradients
        self._agreement = StepAgreement(self._dmuon)

    @property
    def muon_group(self) -> dict:
        """``param_groups[0]``: the first (without ``param_groups``, the one) Muon group."""
        return self.param_groups[0]

    @property
    def adamw_group(self) -> dict:
        """``param_groups[1]``: the first (without ``param_groups``, the one) AdamW group."""
        return self.param_groups[1]

    @property
    def _owned_muon(self) -> list[nn.Parameter]:
        return [p for group in self._muon.param_groups for p in group["params"]]

    @property
    def _owned(self) -> list[nn.Parameter]:
        """The dedicated matrices this rank steps, Muon's and AdamW's."""
        return self._owned_muon + [p for group in self._owner_adamw.param_groups for p in group["params"]]

    def inner_optimizer_of(self, p: nn.Parameter) -> torch.optim.Optimizer:
        """The inner optimizer that steps ``p`` on this rank, whose ``state[p]`` holds its state."""
        p = self._dmuon.stepped(p) if p in self._dmuon.name_of else p
        return next(o for o in self._inner if any(q is p for group in o.param_groups for q in group["params"]))

    def clip_grad_norm_(self, max_norm: float | None, *, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None, strategy: str = "global_norm") -> MuonGradClipStats:
        """``dmuon.clip_grad_norm_(self, ...)``: the Muon gradients only (the public project's method)."""
        return clip_grad_norm_(self, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                               foreach=foreach, strategy=strategy)

    @torch.no_grad()
    def step(self, closure=None):
        self._dmuon.gradients.require_reduced()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _push_hyperparameters(self.param_groups, self._muon, (self._adamw, self._owner_adamw))
        self._dmuon.microbatch = 0  # the next forward starts the next window
        # Owners step their masters; no copy a layer used is needed after the last backward.
        self._dmuon.publisher.wait()
        self._dmuon.run("step")
        if not self._agreement.agree([p for group in self.param_groups[1::2] for p in group["params"]]):
            self._agreement.close()
            self.skipped_steps += 1
            warnings.warn(
                "dmuon.Muon skipped this optimizer step on every rank: a gradient holds NaN or Inf. Weights and "
                "optimizer state are unchanged. Call zero_grad() and go on, and look for the cause (a too-large "
                "learning rate, an fp16 overflow, a bad batch)",
                RuntimeWarning,
            )
            return loss
        tp.gather_gradients(self._dmuon)
        owned = self._owned
        for p in owned:
            p.grad = self._record_stepped_as[id(p)].step_gradient
        try:
            self._muon.step()
            self._owner_adamw.step()
        finally:
            for p in owned:
                p.grad = None
        tp.apply_updates(self._dmuon, self._lr_and_weight_decay)
        self._dmuon.publisher.publish()
        self._agreement.close()
        if not self.replicate_async:
            self._dmuon.publisher.wait()
        self._adamw.step()
        return loss

    def _lr_and_weight_decay(self, p: nn.Parameter) -> tuple[float, float]:
        group = next(g for g in self.param_groups[0::2] if any(q is p for q in g["params"]))
        return group["lr"], group["weight_decay"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the dedicated matrices' gradients (their records' and ``p.grad``) and the FSDP2 gradients."""
        for name, p in self._dmuon.params.items():
            record = self._dmuon.records[name]
            record.reduced_grad = record.accumulated_grad = None
            p.grad = None
        for bucket in self._dmuon.gradients.buckets:  # what a backward that raised left unreduced
            bucket.ready.clear()
        self._adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        raise RuntimeError(
            "dmuon.Muon's state is spread over ranks: use dmuon.get_optimizer_state_dict(model, optimizer)"
        )

    def load_state_dict(self, state_dict):
        raise RuntimeError(
            "dmuon.Muon's state is spread over ranks: use dmuon.set_optimizer_state_dict(model, optimizer, state_dict)"
        )


def _push_hyperparameters(groups: list[dict], muon: torch.optim.Optimizer,
                          adamws: tuple[torch.optim.Optimizer, ...]) -> None:
    """Check the public groups again (a scheduler or a hand edit may have changed them) and hand their values to
    the inner optimizers, whose i-th groups are the i-th semantic group's."""
    for index, group in enumerate(groups):
        try:
            _check_group(group)
        except (TypeError, ValueError) as error:
            raise type(error)(f"param group {index} ({group['group_name']}): {error}") from None
    for i, (muon_group, adamw_group) in enumerate(zip(groups[0::2], groups[1::2])):
        muon.param_groups[i].update({k: muon_group[k] for k in MUON_KEYS})
        for optimizer in adamws:
            optimizer.param_groups[i].update({k: adamw_group[k] for k in ADAMW_KEYS})


def _check_step_options(forward_prefetch_depth, replicate_async, order_check) -> None:
    if isinstance(forward_prefetch_depth, bool) or not isinstance(forward_prefetch_depth, int) or \
            forward_prefetch_depth < 0:
        raise ValueError(
            f"forward_prefetch_depth must be an int >= 0 (0: each layer's broadcast waits until its forward), "
            f"got {forward_prefetch_depth!r}; 1 is the default"
        )
    if not isinstance(replicate_async, bool):
        raise ValueError(f"replicate_async must be True or False, got {replicate_async!r}")
    if order_check not in MODES:
        raise ValueError(f"order_check must be one of {', '.join(map(repr, MODES))}, got {order_check!r}")


def _require_every_gradient_averaged(model: nn.Module, state) -> None:
    """Refuse a model whose trainable parameters are not each dedicated, sharded by FSDP2 or replicated by the DDP
    backend (nothing would average their gradients), or a DDP-backend model that fully_shard also sharded."""
    averaged = {id(p) for p in state.params.values()} | {id(p) for p in replicated_params(model)}
    unsharded = [n for n, p in model.named_parameters() if id(p) not in averaged
                 and p.requires_grad and not isinstance(p, DTensor)]
    # One rank needs no average, but the DDP backend's call order is refused anywhere (as the public one does).
    if unsharded and (state.world_size > 1 or state.holds_every_matrix):
        fix = (f"call dmuon.{'replicate_tp' if state.tp_name else 'replicate'}(model, mesh) before "
               "building dmuon.Muon" if state.holds_every_matrix else
               "fully_shard the layers and the model before building dmuon.Muon")
        raise ValueError(
            f"{unsharded[0]} (and {len(unsharded) - 1} more) is neither dedicated nor "
            f"{'replicated' if state.holds_every_matrix else 'sharded by FSDP2'}, so nothing would average "
            f"its gradient: {fix}"
        )
    if state.holds_every_matrix and any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(
            "the model was prepared by dmuon.dedicate_params_ddp and then sharded by fully_shard: the DDP backend "
            "replaces fully_shard. Call dmuon.replicate(model, mesh) instead of fully_shard, or use "
            "dmuon.dedicate_params with fully_shard"
        )


def _inner_optimizers(state, groups: list[dict], backend: NewtonSchulz, muon_hyper: dict, adamw_hyper: dict):
    """The three inner optimizers, one group per semantic group each, with their state made (as a first step would
    make it, so that a state dict of a fresh optimizer is complete): Muon on the matrices this rank steps (a
    TP-sharded matrix's owner steps its full-shape proxy: tp.py), AdamW on the other parameters, AdamW on the
    matrices routed to it that this rank steps."""
    dedicated = {id(p) for p in state.params.values()}
    muon_groups, adamw_groups = groups[0::2], groups[1::2]
    muon = _OwnerMuon([{"params": [state.stepped(p) for p in g["params"] if state.steps(p)]} for g in muon_groups],
                      backend, **muon_hyper)
    adamw = torch.optim.AdamW([{"params": [p for p in g["params"] if id(p) not in dedicated]}
                               for g in adamw_groups], **adamw_hyper)
    owner_adamw = torch.optim.AdamW([{"params": [p for p in g["params"] if id(p) in dedicated and state.steps(p)]}
                                     for g in adamw_groups], **adamw_hyper)
    for p in (p for group in muon.param_groups for p in group["params"]):
        muon.state[p]["momentum_buffer"] = torch.zeros_like(p)
    for optimizer in (adamw, owner_adamw):
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            optimizer.state[p].update(
                step=torch.tensor(0.0, dtype=_get_scalar_dtype()),  # as AdamW makes it: on CPU
                exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
            )
    return muon, adamw, owner_adamw


def _lower(model: nn.Module, state, param_groups, muon_hyper: dict, adamw_hyper: dict) -> list[dict]:
    """The public project's lowering: each semantic group -> [its Muon group, its AdamW group] (module docstring)."""
    if param_groups is None:
        param_groups = [{"params": list(model.parameters()), "group_name": "default"}]
        trainable_only = False  # frozen dedicated matrices stay in it (they get no gradient, so no step)
    else:
        trainable_only = True
        if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)):
            raise TypeError(f"param_groups must be a list of dicts, got {type(param_groups).__name__}")
        if not param_groups:
            raise ValueError("param_groups is empty: pass None for one group of every parameter")
    names = {id(p): name for name, p in model.named_parameters()}
    symmetric = {id(p) for p in model.parameters() if p.requires_grad and p not in state.name_of}
    seen: dict[int, str] = {}
    lowered = []
    for index, user in enumerate(param_groups):
        group_name, route = _name_and_route(index, user)
        params = [user["params"]] if isinstance(user["params"], torch.Tensor) else list(user["params"])
        muon_params, adamw_params = [], []
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param_groups[{index}]['params'] holds a {type(p).__name__}, not a tensor")
            if trainable_only and not p.requires_grad:
                continue
            if id(p) not in symmetric and p not in state.name_of:
                if id(p) in names:  # a frozen symmetric parameter: AdamW has nothing to step
                    continue
                raise ValueError(
                    f"param_groups[{index}] holds a parameter that is not one of this model's: build the groups "
                    "from model.named_parameters() after dedicate_params and fully_shard"
                )
            if id(p) in seen:
                raise ValueError(f"{names[id(p)]} is in param_groups {seen[id(p)]} and {group_name}: put it in one")
            seen[id(p)] = group_name
            if p in state.name_of and (route or record_of(p).policy.optimizer) == "muon":
                muon_params.append(p)
            else:
                adamw_params.append(p)
        # GROUP_KEYS lists each shared key before its specific ones, which therefore win.
        muon = {**muon_hyper, **{GROUP_KEYS[k][0]: user[k] for k in GROUP_KEYS if k in user and GROUP_KEYS[k][0]}}
        adamw = {**adamw_hyper, **{GROUP_KEYS[k][1]: user[k] for k in GROUP_KEYS if k in user and GROUP_KEYS[k][1]}}
        adamw["betas"] = tuple(adamw["betas"])
        common = dict(semantic_group_name=group_name)
        lowered.append({"params": muon_params, **muon, **common, "group_name": f"{group_name}/muon",
                        "subgroup_type": "muon", "use_muon": True})
        lowered.append({"params": adamw_params, **adamw, **common, "group_name": f"{group_name}/adamw",
                        "subgroup_type": "adamw", "use_muon": False})
    missing = [names[id(p)] for p in model.parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(
            f"param_groups leaves out {missing[:8]}{' and more' if len(missing) > 8 else ''}: every trainable "
            "parameter must be in one group (add a group of the rest)"
        )
    return lowered


def _name_and_route(index: int, user: object) -> tuple[str, str | None]:
    """A user's group's name and route ("muon", "adamw" or None: each matrix's policy), its keys checked."""
    if not isinstance(user, dict) or "params" not in user:
        raise TypeError(f"param_groups[{index}] must be a dict with 'params', got {user!r:.80}")
    unknown = set(user) - {"params", *NAME_KEYS, *GROUP_KEYS, *ROUTE_KEYS}
    if unknown:
        raise ValueError(
            f"param_groups[{index}] has unknown key(s) {sorted(unknown)}; a group takes params, group_name, "
            f"{', '.join(GROUP_KEYS)} and dmuon_route (AdamW's betas are 'adamw_betas')"
        )
    route = next((str(user[k]).strip().lower() for k in ROUTE_KEYS if k in user), None)
    if route not in (None, "muon", "adamw"):
        raise ValueError(
            f"param_groups[{index}] routes its dedicated matrices to {route!r}: a group chooses 'muon' or "
            "'adamw'; 'sharded_adamw' is a dedicate_params param_policy route"
        )
    return str(next((user[k] for k in NAME_KEYS if k in user), f"group_{index}")), route


def _check_group(group: dict) -> None:
    """A lowered group's hyperparameters: Muon's, or AdamW's with an eps its parameters' dtype can hold."""
    if group["use_muon"]:
        single_device.check_hyperparameters(group)
    else:
        _check_adamw_hyperparameters(group)
        _check_adamw_eps_fits(group["eps"], {p.dtype for p in group["params"]})


def _check_adamw_hyperparameters(h: dict) -> None:
    """What torch.optim.AdamW checks at construction, checked again at every step (a scheduler or a
    state dict may have changed the group since)."""
    for key in ("lr", "eps", "weight_decay"):
        if isinstance(h[key], bool) or not isinstance(h[key], numbers.Real):
            raise TypeError(f"adamw_{key} must be a number, got {h[key]!r}")
    betas = h["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, numbers.Real) and not isinstance(b, bool) for b in betas)):
        raise TypeError(f"adamw_betas must be a pair of numbers, got {betas!r}; (0.9, 0.999) is the default")
    if not 0 <= h["lr"] < math.inf:
        raise ValueError(f"adamw_lr must be >= 0 and finite, got {h['lr']}; 1e-3 is the usual value")
    if not 0 <= h["eps"] < math.inf:
        raise ValueError(f"adamw_eps must be >= 0 and finite, got {h['eps']}; 1e-8 is the usual value")
    if not 0 <= h["weight_decay"] < math.inf:
        raise ValueError(f"adamw_weight_decay must be >= 0 and finite, got {h['weight_decay']}; use 0 for none")
    if not all(0 <= beta < 1 for beta in h["betas"]):
        raise ValueError(f"adamw_betas must both lie in [0, 1), got {h['betas']}; (0.9, 0.999) is the default")


def _check_adamw_eps_fits(eps: float, dtypes: set[torch.dtype]) -> None:
    """AdamW divides by sqrt(v) + eps in its parameters' dtype: an eps that rounds to 0 there (1e-8 in
    float16) gives 0 / 0 = NaN wherever a gradient's square underflows, and NaN weights after one step."""
    for dtype in sorted(dtypes, key=str):
        if eps > 0 and torch.tensor(eps, dtype=dtype).item() == 0:
            raise ValueError(
                f"adamw_eps={eps} rounds to 0 in {dtype}, the dtype of AdamW parameters of this model, so AdamW "
                "would write NaN into them. Keep the parameters in float32 and compute in lower precision with "
                "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=...)), or pass an adamw_eps that "
                f"{dtype} can hold (at least {torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps:.1e})"
            )
