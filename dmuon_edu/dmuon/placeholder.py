"""What a rank holds of a dedicated matrix it does not own: a guarded placeholder.

Between uses a non-owner keeps no values of the matrix. Its Parameter stays the same
object (``model.parameters()`` returns it at every step, so a user's EMA, an optimizer
or a compiled block sees one stable tensor), but its data is a zero-element tensor of
the matrix's dtype and device, and its class is :class:`DedicatedParameter`, an
nn.Parameter whose ``__torch_function__``:

- answers metadata with the matrix's own: ``shape``, ``size()``, ``dim()``, ``numel()``,
  dtype, device, ``requires_grad``, ``grad``;
- raises a RuntimeError for anything that reads values (``p.norm()``, ``p.clone()``,
  ``p.data``, ``p.detach()``, ``torch.save``, ``model.state_dict()``), naming the
  matrix, its owner and what to call instead.

While the matrix is resident, between the broadcast that fills it for a layer's forward
(or backward) and its release, the parameter is of its own class again: a compiled
block then sees the same parameter types in every layer on every rank, owned or not,
and compiles one graph for all of them (a class that differed by owner would be one
more graph per pattern of owners).

dmuon swaps the data with :func:`hold` and :func:`release` (views of the broadcast
buffer, and the placeholder). Replacing ``.data`` keeps the TensorImpl, so autograd's
saved references to the parameter stay valid and see the refilled values in backward.

A tensor-parallel shard (a DTensor, tp.py) keeps its class: DTensor's layout is not a
plain tensor's, so ``__class__`` cannot change. Its local tensor is what comes and goes
(an empty one between uses). Reads between uses meet DTensor's shape checks, except
``state_dict()`` of a module holding one (without ``keep_vars``), which would save the
empty local tensor without a word: :func:`guard_state_dict` refuses it by name, as above.

A rank that holds a matrix whose step result is still on its way to it (the DDP
backend's non-owners, HSDP's holders in the other replicas, after ``step()`` with
``replicate_async=True``) would read the previous step's values. Until the result lands
the parameter's class is :class:`PublishingParameter` (a DTensor's, :class:`PublishingDTensor`:
a DTensor subclass keeps DTensor's layout, so that class can change): its first read of
values waits for the publish (which lands every matrix of it) and then reads. The forward
waits before its first dedicated layer, so the layers compute with plain parameters.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .record import is_dedicated, record_of

__all__ = ["DedicatedParameter", "PublishingParameter", "PublishingDTensor", "make_placeholder", "guard_state_dict",
           "hold", "release", "is_resident", "publishing", "landed"]

# Metadata a placeholder answers for the matrix: these read no values.
_SHAPE_ANSWERS = {
    "shape": lambda p, *a: record_of(p).shape,
    "size": lambda p, dim=None: record_of(p).shape if dim is None else record_of(p).shape[dim],
    "dim": lambda p: len(record_of(p).shape),
    "ndim": lambda p: len(record_of(p).shape),
    "numel": lambda p: record_of(p).shape.numel(),
    "nelement": lambda p: record_of(p).shape.numel(),
}
# Calls the placeholder itself answers correctly (it has the matrix's dtype and device).
_PASS_THROUGH = {
    "dtype", "device", "layout", "is_leaf", "requires_grad", "requires_grad_", "grad", "grad_fn", "_version",
    "itemsize", "element_size", "is_floating_point", "is_complex", "is_cuda", "is_cpu", "is_meta",
    "register_hook", "register_post_accumulate_grad_hook", "_post_accumulate_grad_hooks", "_backward_hooks",
    "__hash__", "__class__", "__dict__", "_is_param",
}


def _tensors_in(values):
    """The arguments, and the items of list and tuple arguments (torch._foreach_* take lists)."""
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _name_of(func) -> str:
    # Attribute access arrives as the descriptor's __get__ / __set__ (a method-wrapper).
    return func.__self__.__name__ if isinstance(func, types.MethodWrapperType) else getattr(func, "__name__", "")


class DedicatedParameter(nn.Parameter):
    """A dedicated matrix on a rank that does not own it (see the module docstring). Its record (record.py) holds
    its name, owner and shape."""

    @classmethod
    def __torch_function__(cls, func, _types=(), args=(), kwargs=None):
        kwargs = kwargs or {}
        absent = [a for a in _tensors_in((*args, *kwargs.values())) if isinstance(a, DedicatedParameter)]
        if absent:
            name = _name_of(func)
            if name in _SHAPE_ANSWERS and args and args[0] is absent[0] and len(absent) == 1:
                return _SHAPE_ANSWERS[name](*args, **kwargs)
            if name == "__repr__":
                return absent[0]._describe()
            if name not in _PASS_THROUGH:
                raise RuntimeError(_refusal(absent[0], name))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _describe(self) -> str:
        record = record_of(self)
        return (f"DedicatedParameter({record.name}: shape {tuple(record.shape)}, {self.dtype}, owned by "
                f"rank {record.owner_rank}; rank {_this_rank()} holds no copy between uses)")


def _refusal(p: torch.Tensor, operation: str) -> str:
    """Why a non-owner cannot read the dedicated matrix ``p`` between uses, and what to call instead."""
    record = record_of(p)
    return (
        f"{record.name} is owned by rank {record.owner_rank}; rank {_this_rank()} holds no copy of it "
        f"between uses (dmuon dedicated it), so `{operation}` has no values to read here. For its values call "
        f"dmuon.get_model_state_dict(model) on every rank (a collective), or read it on rank {record.owner_rank}. "
        "If the read is in the model's forward, a module reads the matrix without calling the module that holds "
        "it (nn.MultiheadAttention reads out_proj.weight so), and dmuon hooks the wrong one: pass dedicate_params "
        "a hook_boundary_predicate that selects the module whose forward reads it, e.g. "
        "lambda m: isinstance(m, nn.MultiheadAttention)"
    )


def _this_rank() -> int | str:
    return dist.get_rank() if dist.is_initialized() else "this rank"


def make_placeholder(p: nn.Parameter) -> None:
    """Turn the dedicated matrix ``p`` (not owned by this rank) into a :class:`DedicatedParameter`, not resident (a
    DTensor: its local tensor emptied; guard the modules holding it with :func:`guard_state_dict`)."""
    release(p)


def guard_state_dict(module: nn.Module) -> None:
    """Make ``module.state_dict()`` refuse, by name, while a tensor-parallel matrix of its own is not resident
    here: it would save the empty local tensor. ``keep_vars=True`` (dmuon's own state dicts) passes."""
    module.register_state_dict_pre_hook(_refuse_absent_shards)


def _refuse_absent_shards(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if keep_vars:
        return
    for p in module._parameters.values():
        if isinstance(p, DTensor) and not is_resident(p):
            raise RuntimeError(_refusal(p, "state_dict()"))


def is_resident(p: torch.Tensor) -> bool:
    """Whether ``p`` holds the matrix's values now (always, on its owner)."""
    if isinstance(p, DTensor):
        return not is_dedicated(p) or record_of(p).resident
    return not isinstance(p, DedicatedParameter)


def hold(p: nn.Parameter, values: torch.Tensor) -> None:
    """Make ``p`` resident with ``values`` (a tensor of the matrix's shape; no copy is made)."""
    if isinstance(p, DTensor):
        # A copy with a storage of its own: torch.compile cannot fake a DTensor whose local tensor starts inside a
        # larger storage (the broadcast buffer), and fails on "a storage on different device meta" (torch 2.13).
        p._local_tensor = values.clone()
        record_of(p).resident = True
        return
    with torch._C.DisableTorchFunctionSubclass():
        p.data = values
    p.__class__ = record_of(p).own_class


def release(p: nn.Parameter) -> None:
    """Drop ``p``'s values: its data becomes a zero-element tensor of its dtype and device."""
    if isinstance(p, DTensor):
        p._local_tensor = torch.empty(0, dtype=p.dtype, device=p.device)
        record_of(p).resident = False
        return
    with torch._C.DisableTorchFunctionSubclass():
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    p.__class__ = DedicatedParameter


class _Publishing:
    """What :class:`PublishingParameter` and :class:`PublishingDTensor` add: a read of values first lands the
    publish in flight (its record's ``land``, its publisher's wait, which calls :func:`landed`)."""

    __slots__ = ()  # no layout of its own: __class__ can switch between it and the plain class

    @classmethod
    def __torch_function__(cls, func, _types=(), args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name_of(func)
        if name not in _PASS_THROUGH and name not in _SHAPE_ANSWERS:  # metadata and zero_grad() do not wait
            for a in _tensors_in((*args, *kwargs.values())):
                if isinstance(a, _Publishing):
                    a._land()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _land(self) -> None:
        """Wait for the step result; after it this parameter is of its own class again (see :func:`landed`)."""
        record_of(self).land()
        if isinstance(self, _Publishing):  # the publish that was to bring it never started: no value to serve
            raise RuntimeError(
                f"a dedicated matrix of shape {tuple(self.shape)} is still waiting for its step result, which no "
                "broadcast in flight carries: the step that was to publish it failed part way. Its values here are "
                "the previous step's; restart from the last checkpoint (dmuon.set_model_state_dict)")

    # Python-level reads that reach the values without a torch function first (after _land, the class is the
    # parameter's own, whose method runs):
    def __reduce_ex__(self, proto):  # torch.save(p) pickles __dict__ before it reads .data
        self._land()
        return self.__reduce_ex__(proto)

    def __deepcopy__(self, memo):  # nn.Parameter's would build type(self) before reading .data
        self._land()
        return self.__deepcopy__(memo)


class PublishingParameter(_Publishing, nn.Parameter):
    """A matrix this rank holds whose step result is on its way (see the module docstring)."""


class PublishingDTensor(_Publishing, DTensor):
    """A TP shard this rank holds whose step result is on its way: DTensor's Python-level reads land it too."""

    def to_local(self, *args, **kwargs):
        self._land()
        return self.to_local(*args, **kwargs)

    def full_tensor(self, *args, **kwargs):
        self._land()
        return self.full_tensor(*args, **kwargs)

    def redistribute(self, *args, **kwargs):
        self._land()
        return self.redistribute(*args, **kwargs)


def publishing(p: nn.Parameter, land) -> None:
    """Mark ``p`` as awaiting its step result: its next read calls ``land()`` first, which must call
    :func:`landed` on it."""
    record_of(p).land = land
    p.__class__ = PublishingDTensor if isinstance(p, DTensor) else PublishingParameter


def landed(p: nn.Parameter) -> None:
    """``p`` holds its step result: of its own class again."""
    if isinstance(p, _Publishing):
        record = record_of(p)
        p.__class__, record.land = record.own_class, None
