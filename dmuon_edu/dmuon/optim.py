"""dmuon.Muon: single-device Muon on each owner's matrices, AdamW on everyone's FSDP2 shards.

Two param groups, visible to torch.optim.lr_scheduler like any optimizer's:

- ``param_groups[0]``, Muon: every dedicated parameter (on every rank, so that the
  groups look alike everywhere), with lr, momentum, nesterov, weight_decay,
  adjust_lr_fn, ns_steps, ns_dtype;
- ``param_groups[1]``, AdamW: every other trainable parameter (its FSDP2 shard), with
  lr (= adamw_lr), betas, eps, weight_decay (= adamw_weight_decay).

A scheduler scales each group's own ``lr``: LambdaLR(opt, f) multiplies both lr and
adamw_lr by f(step). The groups are the source of truth; step() hands their values to
two inner optimizers: a dmuon_edu.muon.Muon over the matrices this rank owns (fed with
``p._reduced_grad``; see its docstring for how same-shape matrices are batched) and a
torch.optim.AdamW over the shards.

Non-finite gradients: if any gradient of the step holds NaN or Inf, on any rank (an
owner's reduced matrix gradient or any FSDP2 shard), step() skips the whole step on
every rank: weights, momentum, Adam moments and step counts stay as they were, a
RuntimeWarning says so, and ``skipped_steps`` counts it (GradScaler's policy, applied
to all ranks alike). Deciding it costs one all_reduce of a one-element flag per step.
A learning-rate scheduler that the loop steps after every optimizer step still
advances on a skipped one, as it does after a step that GradScaler skips; a loop that
must not lose schedule on a skip can compare ``skipped_steps`` before and after.

Optimizer state is created at construction (zero momentum, zero Adam moments, step 0:
exactly a fresh optimizer's first step), so that a fresh optimizer's state dict
already holds every entry a checkpoint load fills.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_scalar_dtype

from dmuon_edu import muon as single_device

from .dedicate import state_of

__all__ = ["Muon"]

MUON_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "adjust_lr_fn", "ns_steps", "ns_dtype")
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


class Muon(torch.optim.Optimizer):
    """Distributed Muon for a model prepared with ``dedicate_params`` and ``fully_shard``.

    Call ``step()`` once per optimizer step, outside ``no_sync`` (after the backward
    that reduces), and ``zero_grad()`` after it. After ``step()`` the non-owner copies
    of dedicated parameters are freed: the next forward broadcasts the new values.
    ``state_dict()`` is not per-rank meaningful; use dmuon.get_optimizer_state_dict.

    The defaults, and the order of the positional arguments, are the public dmuon
    project's: its update scale is s(m, n) = 0.2 sqrt(max(m, n)) ("match_rms_adamw",
    an update with AdamW's RMS, so that lr 0.02 sits beside adamw_lr 1e-3).
    ``adjust_lr_fn="original"`` gives Keller Jordan's sqrt(max(1, m / n)), the default
    of dmuon_edu.muon.Muon and torch.optim.Muon: pass it to compare with those.

    Args:
        model: the model, after ``dedicate_params`` and ``fully_shard``.
        lr, momentum, weight_decay, ns_steps, nesterov, adjust_lr_fn, ns_dtype: the Muon
            hyperparameters of the dedicated matrices, as in dmuon_edu.muon.Muon.
        adamw_lr, adamw_betas, adamw_weight_decay, adamw_eps: torch.optim.AdamW's lr,
            betas, weight_decay and eps for every other trainable parameter.
        forward_prefetch_depth: how many layers ahead a layer's forward issues their
            broadcasts (the backward of Z3 likewise, in reverse order), so that they
            travel while this layer computes; 0 issues each at its own layer's forward.
        replicate_async: with a replicate mesh (HSDP), start publishing each owner's
            updated matrices to the other replicas at the end of ``step()`` and wait for
            them at the next forward (True), or within ``step()`` (False). The same
            results either way; nothing to publish on a 1-D mesh.

    Raises:
        TypeError: ``model`` is not an nn.Module, or a hyperparameter has the wrong type.
        ValueError: the model has no dedicated parameters, a trainable parameter is
            neither dedicated nor sharded by FSDP2, a hyperparameter is invalid (also
            checked at every step, after schedulers and state dict loads), or
            ``adamw_eps`` rounds to 0 in the dtype of the AdamW parameters (1e-8 in
            float16: AdamW would write NaN into them; keep float32 parameters and compute
            in float16 through fully_shard's mp_policy).
        RuntimeError: ``step()`` is called inside ``no_sync``.
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
        *,
        nesterov: bool = True,
        adjust_lr_fn: str = "match_rms_adamw",
        ns_dtype: torch.dtype | str = "auto",
        forward_prefetch_depth: int = 1,
        replicate_async: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"dmuon.Muon takes the model (after dedicate_params and fully_shard), got {type(model).__name__}")
        self._dmuon = state_of(model)
        depth = forward_prefetch_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(
                f"forward_prefetch_depth must be an int >= 0 (0: each layer's broadcast waits until its forward), "
                f"got {forward_prefetch_depth!r}; 1 is the default"
            )
        self._dmuon.prefetch_depth = depth
        if not isinstance(replicate_async, bool):
            raise ValueError(f"replicate_async must be True or False, got {replicate_async!r}")
        self.replicate_async = replicate_async
        dedicated = list(self._dmuon.params.values())
        is_dedicated = {id(p) for p in dedicated}
        others = [p for p in model.parameters() if id(p) not in is_dedicated and p.requires_grad]
        self._owned = [p for p in dedicated if self._dmuon.runs_muon(p)]
        unsharded = [n for n, p in model.named_parameters()
                     if id(p) not in is_dedicated and p.requires_grad and not isinstance(p, DTensor)]
        if unsharded and self._dmuon.world_size > 1:
            raise ValueError(
                f"{unsharded[0]} (and {len(unsharded) - 1} more) is neither dedicated nor sharded by FSDP2, so "
                "nothing would average its gradient: fully_shard the layers and the model before building dmuon.Muon"
            )

        muon_hyper = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                          adjust_lr_fn=adjust_lr_fn, ns_steps=ns_steps, ns_dtype=ns_dtype)
        adamw_hyper = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
        _check_adamw_hyperparameters(adamw_hyper)  # torch.optim.AdamW lets inf through
        adamw_hyper["betas"] = tuple(adamw_betas)
        self._adamw_dtypes = {p.dtype for p in others}
        _check_adamw_eps_fits(adamw_eps, self._adamw_dtypes)
        # The inner optimizers check the hyperparameters (and accept an empty list).
        self._muon = single_device.Muon([{"params": self._owned}], **muon_hyper)
        self._adamw = torch.optim.AdamW([{"params": others}], **adamw_hyper)
        super().__init__([{"params": dedicated, **muon_hyper}, {"params": others, **adamw_hyper}], defaults={})

        self.skipped_steps = 0  # steps skipped for non-finite gradients
        self._nonfinite_flag = torch.zeros((), device=self._dmuon.mesh_device)  # reused at every step
        for p in self._owned:
            self._muon.state[p]["momentum_buffer"] = torch.zeros_like(p)
        for p in others:
            self._adamw.state[p].update(
                step=torch.tensor(0.0, dtype=_get_scalar_dtype()),  # as AdamW makes it: on CPU
                exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
            )

    @property
    def muon_group(self) -> dict:
        return self.param_groups[0]

    @property
    def adamw_group(self) -> dict:
        return self.param_groups[1]

    def _push_hyperparameters(self) -> None:
        inner_muon, inner_adamw = self._muon.param_groups[0], self._adamw.param_groups[0]
        muon_values = {k: self.muon_group[k] for k in MUON_KEYS}
        adamw_values = {k: self.adamw_group[k] for k in ADAMW_KEYS}
        single_device.check_hyperparameters(muon_values)
        _check_adamw_hyperparameters(adamw_values)
        _check_adamw_eps_fits(adamw_values["eps"], self._adamw_dtypes)
        inner_muon.update(muon_values)
        inner_adamw.update(adamw_values)

    @torch.no_grad()
    def step(self, closure=None):
        if self._dmuon.in_no_sync:
            raise RuntimeError(
                "optimizer.step() inside dmuon.no_sync(model): the gradients are not reduced yet. "
                "Run the last micro-batch's forward and backward outside no_sync, then step"
            )
        pending = next((name for name, p in self._dmuon.params.items() if p._accumulated_grad is not None), None)
        if pending is not None:
            raise RuntimeError(
                f"optimizer.step() after a window whose every backward ran inside dmuon.no_sync(model): {pending} "
                "(and every other gradient) was accumulated but never reduced, and FSDP2 has not reduce-scattered "
                "its own. Run the window's last forward and backward outside no_sync, then step"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._push_hyperparameters()
        self._dmuon.microbatch = 0  # the next forward starts the next window
        # Owners step their masters; no copy a layer used is needed after the last backward.
        self._dmuon.wait_published()
        self._dmuon.release_all()
        if not self._gradients_finite():
            self.skipped_steps += 1
            warnings.warn(
                "dmuon.Muon skipped this optimizer step on every rank: a gradient holds NaN or Inf. Weights and "
                "optimizer state are unchanged. Call zero_grad() and go on, and look for the cause (a too-large "
                "learning rate, an fp16 overflow, a bad batch)",
                RuntimeWarning,
            )
            return loss
        for p in self._owned:
            p.grad = p._reduced_grad
        try:
            self._muon.step()
        finally:
            for p in self._owned:
                p.grad = None
        self._dmuon.publish()
        if not self.replicate_async:
            self._dmuon.wait_published()
        self._adamw.step()
        return loss

    def _gradients_finite(self) -> bool:
        """Whether every gradient of this step is finite on every rank (the same answer everywhere)."""
        grads = [p._reduced_grad for p in self._owned if p._reduced_grad is not None]
        grads += [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                  for p in self.adamw_group["params"] if p.grad is not None]
        # min and max are finite exactly when every entry is; one host sync in all.
        extremes = [torch.stack(torch.aminmax(g)).float() for g in grads if g.numel() > 0]
        bad = self._nonfinite_flag
        bad.copy_((~torch.cat(extremes).isfinite()).any() if extremes else False)
        everyone = self._dmuon.everyone
        if dist.get_world_size(everyone) > 1:
            with self._dmuon.order.collective("the optimizer step's all-reduce of its finite-gradients flag"):
                dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=everyone)
        return bad.item() == 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``_reduced_grad`` and ``_accumulated_grad`` of dedicated parameters and the FSDP2 gradients."""
        for p in self._dmuon.params.values():
            p._reduced_grad = None
            p._accumulated_grad = None
            p.grad = None
        for bucket in self._dmuon.buckets:  # what a backward that raised left unreduced
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
