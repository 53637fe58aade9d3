"""The one place where dmuon patches torch: fully_shard skips dedicated parameters.

(dmuon also calls private torch functions and attributes without patching them; each is
named, with a probe of what dmuon relies on, in tests/test_torch_internals.py.)

The dmuon API, as the dmuon project's gradient-accumulation guide uses it, calls a plain
``fully_shard(layer, mesh=mesh)`` after ``dedicate_params``, without ``ignored_params``,
yet FSDP2 must leave the dedicated parameters alone (their owner keeps them whole). ``fully_shard`` finds the parameters it will manage with one
internal function (since torch 2.11; earlier releases collect them in two steps),

    torch.distributed.fsdp._fully_shard._fully_shard._get_modules_and_states(module, device, ignored_params)

and everything it then does (sharding, all-gather, reduce-scatter, state dicts) follows
from that list. :func:`install` wraps that name, once, so that the dedicated parameters
found under ``module`` are added to ``ignored_params``. The effect is exactly that of
calling ``fully_shard(..., ignored_params=<the dedicated parameters>)``, which torch
supports; modules whose parameters are all dedicated are then not managed by FSDP2 at
all, as with ignored_params. Modules without dedicated parameters are unaffected, so
the wrapper is harmless to code that does not use dmuon.

Why not something without a patch? FSDP2 offers no per-parameter opt-out other than
``ignored_params``; its other skip rules (a module with another composable API, an
already-sharded submodule) skip whole subtrees, biases included.

:func:`check_compatible` says, loudly, when a torch upgrade has moved or changed that
function (tests/test_dmuon.py calls it); ``install`` calls it before patching.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
from torch import nn

from .record import is_dedicated

__all__ = ["install", "check_compatible"]

FULLY_SHARD_MODULE = "torch.distributed.fsdp._fully_shard._fully_shard"
COLLECTOR = "_get_modules_and_states"
COLLECTOR_PARAMETERS = ("module", "device", "ignored_params")


def check_compatible():
    """The module holding fully_shard, after checking that it still collects parameters as expected.

    Raises:
        RuntimeError: this torch's fully_shard no longer collects its parameters through
            ``_get_modules_and_states(module, device, ignored_params)``.
    """
    module = importlib.import_module(FULLY_SHARD_MODULE)
    collector = getattr(module, COLLECTOR, None)
    problem = None
    if collector is None:
        problem = f"{FULLY_SHARD_MODULE} has no function {COLLECTOR}"
    else:
        names = tuple(inspect.signature(collector).parameters)[: len(COLLECTOR_PARAMETERS)]
        if names != COLLECTOR_PARAMETERS:
            problem = f"{COLLECTOR} now takes {names}, not {COLLECTOR_PARAMETERS}"
        elif COLLECTOR not in _names_used_by(module.fully_shard):
            problem = f"fully_shard no longer calls {COLLECTOR}"
    if problem:
        raise RuntimeError(
            f"dmuon cannot make fully_shard skip dedicated parameters with torch {torch.__version__}: "
            f"{problem}. dmuon needs torch 2.11 or later (tested on 2.13); update dmuon_edu/dmuon/fsdp_exclusion.py "
            "for this torch, or install a torch it supports."
        )
    return module


def install() -> None:
    """Make every later ``fully_shard`` call ignore the dedicated parameters under its module(s). Idempotent."""
    module = check_compatible()
    collector = getattr(module, COLLECTOR)
    if getattr(collector, "_dmuon_wrapped", False):
        return

    @functools.wraps(collector)
    def collect_without_dedicated(module_or_modules, device, ignored_params, *args, **kwargs):
        roots = [module_or_modules] if isinstance(module_or_modules, nn.Module) else list(module_or_modules)
        dedicated = {p for root in roots for p in root.parameters() if is_dedicated(p)}
        if dedicated:
            ignored_params = set(ignored_params or ()) | dedicated
        return collector(module_or_modules, device, ignored_params, *args, **kwargs)

    collect_without_dedicated._dmuon_wrapped = True
    setattr(module, COLLECTOR, collect_without_dedicated)


def _names_used_by(function) -> set[str]:
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    code = getattr(function, "__code__", None)
    return set(code.co_names) if code is not None else set()
