"""Hook boundaries: the module whose forward brackets the use of a dedicated parameter.

dmuon broadcasts a dedicated matrix to the non-owners in a forward pre-hook and frees it
after the forward (Z3), so the module that carries these hooks must be *called*, and
every read of the matrix must happen inside its forward. Three ways to choose it, as in
the public dmuon project:

- by default, the parameter's layer: its name up to the first numeric component
  (``layers.3`` for ``layers.3.mlp.up_proj.weight``, plan.layer_of), or the parameter's
  own module when the name has no such component or that layer is a container that is
  never called (a ModuleDict);
- ``hook_boundary_predicate(module) -> bool``: the lowest module, from the parameter's
  own up to the root, for which it is True. Needed where a module reads a child's
  weight without calling the child: ``nn.MultiheadAttention`` reads
  ``out_proj.weight`` itself, so ``lambda m: isinstance(m, nn.MultiheadAttention)``;
- ``hook_boundary_resolver(name, param) -> module``: any module of the model, for
  boundaries that are not ancestors; it takes precedence over the predicate.

``hook_boundary_strict`` (default True) raises when the predicate matches no ancestor or
the resolver returns None; False falls back to the parameter's own module.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dmuon_edu.arguments import require_called_as

from .plan import layer_of

__all__ = ["hook_boundaries", "check_hook_boundary_arguments"]

HookBoundaryPredicate = Callable[[nn.Module], bool]
HookBoundaryResolver = Callable[[str, nn.Parameter], "nn.Module | None"]


def check_hook_boundary_arguments(predicate, strict, resolver) -> None:
    """Raise TypeError unless the three hook_boundary_* arguments have the types dedicate_params takes."""
    for name, value, call, arguments, hint in (
            ("hook_boundary_predicate", predicate, "hook_boundary_predicate(module)", (None,),
             "it takes the module, e.g. lambda m: isinstance(m, nn.MultiheadAttention)"),
            ("hook_boundary_resolver", resolver, "hook_boundary_resolver(name, param)", ("name", None),
             "it takes a parameter's name and the parameter, and returns its module or None")):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be a callable or None, got {type(value).__name__}")
        if value is not None:
            require_called_as(name, value, call, arguments, hint)
    if not isinstance(strict, bool):
        raise TypeError(f"hook_boundary_strict must be True or False, got {strict!r}")


def hook_boundaries(model: nn.Module, aliases: list[tuple[str, nn.Parameter]],
                    predicate: HookBoundaryPredicate | None = None, strict: bool = True,
                    resolver: HookBoundaryResolver | None = None) -> dict[str, str]:
    """The boundary module's path for each ``(name, parameter)`` of ``aliases`` (see the module docstring).

    Args:
        model: the model the names are relative to.
        aliases: ``(name, parameter)`` pairs, as ``model.named_parameters(remove_duplicate=False)``.
        predicate, strict, resolver: the ``hook_boundary_*`` arguments of dedicate_params.

    Returns:
        ``{name: path}``, ``""`` for the root module.

    Raises:
        ValueError: with ``strict``, the predicate matches no module above a parameter or
            the resolver returns None for one; or the resolver returns a module that is
            not in ``model``.
        TypeError: the resolver returns something other than a module or None.
    """
    path_of = {id(module): path for path, module in model.named_modules(remove_duplicate=False)}
    return {name: _boundary(model, name, p, predicate, strict, resolver, path_of) for name, p in aliases}


def _boundary(model, name, p, predicate, strict, resolver, path_of) -> str:
    own = name.rpartition(".")[0]
    if resolver is not None:
        module = resolver(name, p)
        if module is None:
            if strict:
                raise ValueError(
                    f"hook_boundary_resolver returned None for {name}: return the module whose forward reads it, "
                    "leave it out of the dedicate_params predicate, or pass hook_boundary_strict=False to hook it "
                    "on its own module"
                )
            return own
        if not isinstance(module, nn.Module):
            raise TypeError(f"hook_boundary_resolver must return an nn.Module or None, got {type(module).__name__} "
                            f"for {name}")
        if id(module) not in path_of:
            raise ValueError(f"hook_boundary_resolver returned a {type(module).__name__} for {name} that is not a "
                             "module of this model: return one of model.modules()")
        return path_of[id(module)]
    if predicate is not None:
        parts = own.split(".") if own else []
        for depth in range(len(parts), -1, -1):  # from the parameter's own module up to the root
            path = ".".join(parts[:depth])
            if predicate(model.get_submodule(path)):
                return path
        if strict:
            raise ValueError(
                f"hook_boundary_predicate matched no module from {own or 'the root'} up to the root, for {name}: "
                "extend the predicate to cover a module whose forward reads it, leave it out of the dedicate_params "
                "predicate, or pass hook_boundary_strict=False to hook it on its own module"
            )
        return own
    path = layer_of(name)
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        layer = None
    # A container that is never called (a ModuleDict) has nn.Module's forward; torch.compile's OptimizedModule has
    # it too on its class, but is called: its forward is set on the instance.
    if layer is None or getattr(layer.forward, "__func__", None) is nn.Module.forward:
        return own
    return path
