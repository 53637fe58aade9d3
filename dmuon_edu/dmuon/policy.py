"""Per-parameter policies: how each dedicated parameter is stepped, moved and computed.

The public dmuon project's ``param_policy`` of ``dedicate_params``: ``defaults``, then
ordered ``overrides`` whose ``name`` tokens (or ``contains``, the older spelling) are
substrings of the parameter's name; each override sets only the fields it names. Or
``param_policy_fn(name, param)``, returning a mapping of fields to set, a whole
:class:`DMuonParamPolicy`, or None. ``compute_dtype`` of ``dedicate_params`` is the
default ``param_dtype``. Names are matched without wrapper segments (names.fqn).

Fields, and what dmuon_edu does with each:

- ``route``: ``"muon"`` (the default): the owner runs Muon; ``"adamw"``: the owner runs
  AdamW on the whole matrix, with the AdamW group's hyperparameters (same broadcasts
  and reduces); ``"sharded_adamw"``: AdamW on shards, which is what ``fully_shard``
  does with a parameter dmuon leaves alone, so the parameter is not dedicated:
  FSDP2 shards it, all-gathers it and reduce-scatters its gradient.
- ``param_dtype``: the dtype the matrix is broadcast and computed in. Under a
  ``fully_shard(..., mp_policy=...)`` with a ``param_dtype`` it must be that one (the
  layer's other parameters and inputs are cast to it); without one it is the only
  cast, so run the forward under ``torch.autocast`` with that dtype.
- ``grad_dtype``: the dtype of the gradient's reduce to the owner (by default the
  policy's ``reduce_dtype``, else the master's dtype).
- ``master_dtype``, ``optim_dtype``: the owner's copy and its optimizer state keep the
  parameter's own dtype. None, or that dtype, is accepted; any other is refused.
- ``output_dtype``, ``cast_forward_inputs``: refused when set: fully_shard's
  ``MixedPrecisionPolicy(output_dtype=..., cast_forward_inputs=...)`` on the module does it.
- ``muon_forward_unshard``: ``"broadcast"`` (what dmuon does) or None; the public
  project's experimental ``"all_gather"`` is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from .names import fqn

__all__ = ["DMuonParamPolicy", "resolve_param_policies", "ROUTES"]

ROUTES = ("muon", "adamw", "sharded_adamw")
_ROUTE_ALIASES = {  # the public project's other spellings
    "matrix": "muon", "matrix_optimizer": "muon",
    "base": "adamw", "base_adamw": "adamw", "dedicated_adamw": "adamw",
    "sharded": "sharded_adamw", "base_sharded": "sharded_adamw", "sharded_collective": "sharded_adamw",
    "base_sharded_adamw": "sharded_adamw",
}
_DTYPE_NAMES = {
    "fp32": torch.float32, "float32": torch.float32, "torch.float32": torch.float32, "f32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "torch.float16": torch.float16, "half": torch.float16,
}
_DTYPE_FIELDS = ("param_dtype", "grad_dtype", "output_dtype", "master_dtype", "optim_dtype")


@dataclass(frozen=True)
class DMuonParamPolicy:
    """The resolved policy of one dedicated parameter (fields: see the module docstring).

    ``matched_overrides`` lists the indices of the ``param_policy["overrides"]`` that
    applied, for diagnostics.
    """

    route: str | None = None
    param_dtype: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = False
    master_dtype: torch.dtype | None = None
    optim_dtype: torch.dtype | None = None
    muon_forward_unshard: str | None = None
    matched_overrides: tuple[int, ...] = ()

    @property
    def optimizer(self) -> str:
        """"muon" or "adamw": what the owner runs (a None route is "muon")."""
        return "adamw" if self.route == "adamw" else "muon"


PolicyFn = Callable[[str, nn.Parameter], "Mapping[str, Any] | DMuonParamPolicy | None"]


def resolve_param_policies(params: Mapping[str, nn.Parameter], compute_dtype: torch.dtype | str | None = None,
                           param_policy: Mapping[str, Any] | None = None,
                           param_policy_fn: PolicyFn | None = None) -> dict[str, DMuonParamPolicy]:
    """The policy of each parameter of ``params``, checked (see the module docstring).

    Args:
        params: ``{name: parameter}``, the parameters the predicate selected.
        compute_dtype: the default ``param_dtype`` (a torch.dtype, a name such as
            "bf16", or None).
        param_policy: ``{"defaults": {...}, "overrides": [{"name": tokens, "set": {...}}, ...]}``.
        param_policy_fn: ``(name, param) -> mapping, DMuonParamPolicy or None``.

    Returns:
        ``{name: DMuonParamPolicy}`` in the order of ``params``.

    Raises:
        ValueError: both ``param_policy`` and ``param_policy_fn`` were given, a field,
            route or dtype name is unknown, or a field asks for what dmuon does not do
            (named in the message, with what to do instead).
        TypeError: a policy part has the wrong type.
    """
    if param_policy is not None and param_policy_fn is not None:
        raise ValueError("pass param_policy or param_policy_fn, not both")
    if param_policy_fn is not None and not callable(param_policy_fn):
        raise TypeError(f"param_policy_fn must be a callable (name, param) -> policy, got {type(param_policy_fn).__name__}")
    base = DMuonParamPolicy(param_dtype=_dtype(compute_dtype, "compute_dtype"))
    overrides = []
    if param_policy is not None:
        if not isinstance(param_policy, Mapping):
            raise TypeError(f"param_policy must be a mapping {{'defaults': ..., 'overrides': [...]}}, got "
                            f"{type(param_policy).__name__}")
        unknown = set(param_policy) - {"defaults", "overrides"}
        if unknown:
            raise ValueError(f"param_policy has unknown key(s) {sorted(unknown)}: it takes 'defaults' and 'overrides'")
        base = _apply(base, param_policy.get("defaults") or {}, "param_policy['defaults']")
        overrides = _overrides(param_policy.get("overrides") or ())
    resolved = {}
    for name, p in params.items():
        clean = fqn(name)
        policy, matched = base, []
        for index, (tokens, values) in enumerate(overrides):
            if not tokens or any(token in clean for token in tokens):
                policy = _apply(policy, values, f"param_policy['overrides'][{index}]['set']")
                matched.append(index)
        if param_policy_fn is not None:
            answer = param_policy_fn(name, p)
            if isinstance(answer, DMuonParamPolicy):
                policy = _apply(DMuonParamPolicy(), {f.name: getattr(answer, f.name) for f in fields(answer)
                                                     if f.name != "matched_overrides"}, f"param_policy_fn({clean!r})")
            elif answer is not None:
                policy = _apply(policy, answer, f"param_policy_fn({clean!r})")
        policy = replace(policy, matched_overrides=tuple(matched))
        _check_supported(clean, p, policy)
        resolved[name] = policy
    used = {index for policy in resolved.values() for index in policy.matched_overrides}
    for index, (tokens, _) in enumerate(overrides):
        if index not in used:
            raise ValueError(
                f"param_policy['overrides'][{index}] (name {list(tokens)}) matches none of the parameters the "
                f"predicate selected, so it would change nothing: is a name misspelt? A token matches a parameter "
                f"whose name contains it, e.g. {sorted(map(fqn, params))[:3]}")
    return resolved


def _overrides(raw) -> list[tuple[tuple[str, ...], Mapping]]:
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Iterable):
        raise TypeError("param_policy['overrides'] must be a sequence of {'name': ..., 'set': {...}} mappings")
    result = []
    for index, override in enumerate(raw):
        where = f"param_policy['overrides'][{index}]"
        if not isinstance(override, Mapping):
            raise TypeError(f"{where} must be a mapping {{'name': ..., 'set': {{...}}}}, got {type(override).__name__}")
        unknown = set(override) - {"name", "contains", "set"}
        if unknown:
            raise ValueError(f"{where} has unknown key(s) {sorted(unknown)}: it takes 'name' (or 'contains') and 'set'")
        if "name" in override and "contains" in override:
            raise ValueError(f"{where} has both 'name' and 'contains': they are one selector, pass one")
        if not isinstance(override.get("set"), Mapping):
            raise TypeError(f"{where}['set'] must be a mapping of policy fields")
        tokens = override.get("name", override.get("contains"))
        tokens = () if tokens is None else (tokens,) if isinstance(tokens, str) else tuple(tokens)
        if not all(isinstance(t, str) for t in tokens):
            raise TypeError(f"{where}['name'] must be a string or a sequence of strings, got {tokens!r}")
        result.append((tokens, override["set"]))
    return result


def _apply(policy: DMuonParamPolicy, values: Mapping[str, Any], where: str) -> DMuonParamPolicy:
    if not isinstance(values, Mapping):
        raise TypeError(f"{where} must be a mapping of policy fields, got {type(values).__name__}")
    known = {f.name for f in fields(DMuonParamPolicy)} - {"matched_overrides"}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{where}: unknown policy field(s) {sorted(unknown)}; the fields are {sorted(known)}")
    normalised = {}
    for key, value in values.items():
        if key == "route":
            normalised[key] = _route(value, where)
        elif key in _DTYPE_FIELDS:
            normalised[key] = _dtype(value, f"{where}['{key}']")
        elif key == "cast_forward_inputs":
            if not isinstance(value, bool):
                raise TypeError(f"{where}['cast_forward_inputs'] must be True or False, got {value!r}")
            normalised[key] = value
        else:  # muon_forward_unshard
            normalised[key] = None if value is None else str(value).strip().lower()
    return replace(policy, **normalised)


def _route(value, where: str) -> str | None:
    if value is None:
        return None
    route = str(value).strip().lower()
    route = _ROUTE_ALIASES.get(route, route)
    if route not in ROUTES:
        raise ValueError(f"{where}: route must be one of {', '.join(map(repr, ROUTES))}, got {value!r}")
    return route


def _dtype(value, where: str) -> torch.dtype | None:
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ValueError(f"{where}: {value} is not a floating-point dtype, and matrices are computed, reduced "
                             "and kept in one: pass torch.bfloat16, torch.float16 or torch.float32")
        return value
    if value is None:
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        if key in ("", "none", "null"):
            return None
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    raise ValueError(f"{where}: {value!r} names no dtype; pass a torch.dtype or one of {sorted(_DTYPE_NAMES)}")


def _check_supported(name: str, p: nn.Parameter, policy: DMuonParamPolicy) -> None:
    """Refuse, naming the field and the parameter, what dmuon_edu does not do."""
    if policy.output_dtype is not None or policy.cast_forward_inputs:
        field = "output_dtype" if policy.output_dtype is not None else "cast_forward_inputs"
        raise ValueError(
            f"{field} of {name}'s param_policy is not supported by dmuon: activation casts belong to the module; use "
            "fully_shard(module, mp_policy=MixedPrecisionPolicy(output_dtype=..., cast_forward_inputs=...)) on it"
        )
    if policy.muon_forward_unshard not in (None, "broadcast"):
        raise ValueError(
            f"muon_forward_unshard={policy.muon_forward_unshard!r} of {name}'s param_policy is not supported: dmuon "
            "broadcasts each matrix from its owner ('broadcast', the public default); drop the field"
        )
    if policy.route == "sharded_adamw":
        return  # not dedicated: fully_shard takes it as it is
    for field in ("master_dtype", "optim_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and dtype != p.dtype:
            raise ValueError(
                f"{field}={dtype} of {name}'s param_policy is not supported for a {p.dtype} parameter: the owner "
                f"keeps the parameter and its optimizer state in the parameter's own dtype. Keep the model in "
                f"{dtype} and compute in a lower precision with param_dtype (or fully_shard's MixedPrecisionPolicy)"
            )
