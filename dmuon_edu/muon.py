r"""Muon: momentum, then Newton-Schulz orthogonalisation, for the hidden matrices of a network.

The update, for one weight matrix W of shape (m, n) with gradient G:

.. math::

    B &\leftarrow \mu B + G                                   &&\text{momentum buffer, starts at 0} \\
    U &= G + \mu B \ \text{(Nesterov)} \quad\text{or}\quad U = B \\
    O &= \mathrm{NS}_5(U)                                     &&\approx \text{the } U_{svd} V_{svd}^T \text{ of } U \\
    W &\leftarrow (1 - \eta\lambda)\, W                       &&\text{decoupled weight decay} \\
    W &\leftarrow W - \eta\, s(m, n)\, O

with :math:`s = \sqrt{\max(1, m/n)}` ("original", Keller Jordan) or
:math:`s = 0.2\sqrt{\max(m, n)}` ("match_rms_adamw", Moonlight: an update with the RMS of
AdamW's, so that AdamW's learning rate and weight decay carry over).

Everything that is not a hidden matrix (biases, norms, embeddings, the output head)
belongs to AdamW: ``muon_param_groups(model)`` splits a model that way.
"""

import math
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from .arguments import describe, require_iterable, require_module
from .newton_schulz import batching_pays, check_ns_dtype, check_ns_steps, newton_schulz, overlaps_itself

__all__ = ["Muon", "muon_param_groups", "check_hyperparameters", "ADJUST_LR_FNS"]

# adjust_lr_fn name -> s(m, n), the factor on the learning rate for an (m, n) matrix.
ADJUST_LR_FNS = {
    "original": lambda m, n: math.sqrt(max(1.0, m / n)),
    "match_rms_adamw": lambda m, n: 0.2 * math.sqrt(max(m, n)),
}


class Muon(torch.optim.Optimizer):
    r"""Muon for 2-D parameters (see the module docstring for the update).

    Args:
        params: 2-D parameters, or param groups (dicts) of them.
        lr: learning rate :math:`\eta` (>= 0). Read from ``param_groups`` at every step,
            so torch.optim.lr_scheduler works as with any optimizer.
        momentum: :math:`\mu` in [0, 1).
        nesterov: use :math:`U = G + \mu B` rather than :math:`U = B`.
        weight_decay: :math:`\lambda` (>= 0), decoupled: W shrinks by a factor 1 - lr * wd.
        adjust_lr_fn: "original" or "match_rms_adamw", the shape factor s(m, n); None is
            "original", as in torch.optim.Muon.
        ns_steps: Newton-Schulz steps (1 to newton_schulz.MAX_STEPS), Keller Jordan's coefficients.
        ns_dtype: precision of the Newton-Schulz products. ``"auto"`` takes
            newton_schulz.fast_dtype of each parameter's device: bf16 where the
            hardware multiplies it natively (what every peer uses on GPUs), float32
            elsewhere (a CPU without native bf16 emulates it tens of times slower);
            the environment variable DMUON_EDU_NS_DTYPE overrides that choice. A
            torch.dtype is used as given: torch.float32 makes the step match a float64
            evaluation of the update to float32 accuracy (for reference computations).

    Raises:
        TypeError: ``params`` is a set or a model (pass its matrices), a parameter is not
            real floating point or is a DTensor (use dmuon.Muon for a sharded model), or a
            hyperparameter has the wrong type.
        ValueError: ``params`` is empty, a parameter is not 2-D, is on the meta device,
            appears twice or shares memory with another parameter or with itself (an
            ``expand()``-ed tensor), or a hyperparameter is out of range or not finite.
            ``step()`` checks every group's hyperparameters again (a scheduler or a hand
            edit may have changed them) and refuses a gradient whose dtype, shape or
            layout is not its parameter's, before it changes anything; ``load_state_dict``
            refuses a momentum buffer holding NaN or Inf, or of another shape than its
            parameter.

    Behaviour worth knowing:

    - ``p.grad`` is never modified. (Keller Jordan's Muon writes the Nesterov blend
      into ``p.grad``; a misplaced ``zero_grad`` then starts the next accumulation
      window from the blend instead of from zero.)
    - Same as torch.optim.Muon up to bf16 rounding, with the same hyperparameters and
      ``ns_dtype=torch.bfloat16`` (torch always multiplies in bf16; "auto" may choose
      float32, which then differs from torch's step by torch's own bf16 error).
      torch keeps an exponential moving average, ``buf.lerp_(g, 1 - mu)``, which is
      (1 - mu) times the buffer B above, so its U is (1 - mu) times this U. NS
      divides U by its norm first, so the constant factor drops out (up to eps).
    - Parameters of the same shape are orthogonalised together, in one batched
      newton_schulz call on their updates, on GPUs and for small matrices on CPU.
      Large matrices on CPU go one at a time through one scratch tensor, which is
      faster there (see newton_schulz.batching_pays).
    - A gradient holding NaN or Inf (or so large that its sum overflows) never
      reaches the weights: that parameter's step
      is skipped (weights and momentum buffer unchanged) with a RuntimeWarning that
      names its shape; every other parameter steps normally. Skipping rather than
      raising lets a mixed-precision run ride over a rare overflow, as
      torch.amp.GradScaler does; the warning makes sure it is seen.
    - Any other gradient, however large, gives a finite update of unit scale, the
      update of its direction: newton_schulz normalises without overflow, and B and U
      never hold Inf. With gradient entries at most g in absolute value, B is a
      geometric sum and both stay within g / (1 - mu):

      .. math::

          |B_t| \le \sum_{k \ge 0} \mu^k g = \frac{g}{1 - \mu}, \qquad
          |U_t| \le g + \mu |B_t| \le \frac{g}{1 - \mu} .

      So nothing can overflow until an entry reaches (1 - mu) times the dtype's largest
      value: 1.7e37 in float32 at mu = 0.95 (entries of 1e30 are far from it), but only
      3275 in fp16. Beyond that an entry of B or U that would overflow is held at the
      largest finite value of its sign: those entries lose their relative sizes (the
      direction is approximate), and nothing becomes Inf or NaN. After a huge gradient the buffer is what momentum
      says, :math:`B_{t+k} = \mu^k B_t + \dots`: its direction leads the updates until
      :math:`\mu^k` times its size falls to that of the ordinary gradients, for
      :math:`k \approx \ln(|G_{huge}| / |G|) / \ln(1/\mu)` steps (about 900 for 1e20
      against 1 at mu = 0.95), while every update stays unit-scale and the weights keep
      moving. ``optimizer.state[p]["momentum_buffer"].zero_()`` forgets it at once.
    - Runs on any device torch runs on; with CUDA tensors the products run on the GPU.
    """

    _refuses_empty_groups = True  # dmuon's inner optimizer (dmuon/optim.py) turns it off

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        adjust_lr_fn: str | None = "original",
        ns_steps: int = 5,
        ns_dtype: torch.dtype | str = "auto",
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            adjust_lr_fn=adjust_lr_fn,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
        )
        check_hyperparameters(defaults)
        if isinstance(params, nn.Module):
            raise TypeError(f"Muon takes a list of parameters, not the model ({type(params).__name__}): pass "
                            "its hidden matrices, e.g. muon_param_groups(model)[0]")
        if isinstance(params, set):
            raise TypeError("params must be a list, not a set: state_dict relies on their order")
        if not isinstance(params, torch.Tensor):  # for a tensor, torch.optim.Optimizer says what to pass
            require_iterable("params", params, "pass a list of 2-D parameters, e.g. muon_param_groups(model)[0]")
            params = list(params)  # a generator can be read once only
            if not params:
                raise ValueError("Muon got an empty list of parameters: pass the model's hidden matrices, e.g. "
                                 "muon_param_groups(model)[0] (a model that has none needs no Muon)")
        super().__init__(params, defaults)
        if self._refuses_empty_groups and not any(group["params"] for group in self.param_groups):
            raise ValueError("Muon got parameter groups that are all empty: give at least one group the model's "
                             "hidden matrices, e.g. [{'params': muon_param_groups(model)[0]}]")

    def add_param_group(self, param_group: dict) -> None:
        # Checked before the group is added, so that a rejected group leaves no trace.
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("params must be a list, not a set: state_dict relies on their order")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        first_index = {}
        spans = _MemorySpans(q for group in self.param_groups for q in group["params"])
        for index, p in enumerate(params):
            if isinstance(p, tuple) and len(p) == 2:
                p = p[1]  # torch.optim.Optimizer takes (name, parameter) pairs, as from named_parameters()
            if not isinstance(p, torch.Tensor):
                continue  # torch.optim.Optimizer raises the TypeError
            if id(p) in first_index:
                raise ValueError(
                    f"parameter {index} of the group is parameter {first_index[id(p)]} again; Muon would step "
                    "it twice per step. Pass each parameter once (model.parameters() does)"
                )
            first_index[id(p)] = index
            if not p.is_floating_point():
                raise TypeError(f"Muon takes real floating-point parameters, got dtype {p.dtype}")
            if p.ndim != 2:
                raise ValueError(
                    f"Muon takes 2-D matrices only, got a {p.ndim}-D parameter of shape "
                    f"{tuple(p.shape)}. A {p.ndim}-D parameter belongs to AdamW; use "
                    "muon_param_groups(model) to split a model's parameters."
                )
            if _is_dtensor(p):
                raise TypeError(f"parameter {index} of the group is a DTensor (sharded by fully_shard), and Muon "
                                "orthogonalises whole matrices: for a sharded model use dmuon.Muon (dmuon_edu.dmuon), "
                                "which gives each matrix an owner rank")
            if p.is_meta:
                raise ValueError(f"parameter {index} of the group is on the meta device, which holds no values: "
                                 "materialise the model first (model.to_empty(device=...), then initialise it)")
            if overlaps_itself(p):
                raise ValueError(f"parameter {index} of the group has entries that share memory (an expand()-ed "
                                 "tensor), which Muon cannot update: give it its own, nn.Parameter(t.clone())")
            if spans.overlapping(p):
                raise ValueError(
                    f"parameter {index} of the group shares memory with another parameter (views of one tensor?): "
                    "Muon would update the shared entries twice per step. Give each parameter storage of its "
                    "own, e.g. nn.Parameter(t.detach().clone())"
                )
            spans.add(p)
        check_hyperparameters({**self.defaults, **param_group})
        super().add_param_group({**param_group, "params": params})

    def load_state_dict(self, state_dict: dict) -> None:
        # Checked before loading, so that a refused state leaves the optimizer as it was.
        if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
                and isinstance(state_dict.get("param_groups"), list)):
            raise TypeError(f"state_dict must be what Muon.state_dict() returns, a dict with 'state' and "
                            f"'param_groups', got {describe(state_dict)}")
        shapes = {index: p.shape for group, saved in zip(self.param_groups, state_dict["param_groups"])
                  for p, index in zip(group["params"], saved["params"])}
        names = {
            index: name
            for group in state_dict["param_groups"]
            for index, name in zip(group["params"], group.get("param_names", ()))
        }
        for index, state in state_dict["state"].items():
            buffer = state.get("momentum_buffer")
            if isinstance(buffer, torch.Tensor) and not bool(buffer.isfinite().all()):
                name = f" ({names[index]})" if index in names else ""
                raise ValueError(
                    f"the momentum buffer of parameter {index}{name} in this state_dict holds NaN or Inf, so "
                    "every later update of it would be NaN. Load a checkpoint from before the divergence, or "
                    "leave the optimizer state out (momentum restarts from zero)"
                )
            if isinstance(buffer, torch.Tensor) and index in shapes and buffer.shape != shapes[index]:
                name = f" ({names[index]})" if index in names else ""
                raise ValueError(
                    f"the momentum buffer of parameter {index}{name} in this state_dict has shape "
                    f"{tuple(buffer.shape)}, but the parameter has shape {tuple(shapes[index])}: the state_dict "
                    "is another model's. Build the optimizer on the parameters it was saved from, in that order"
                )
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        for index, group in enumerate(self.param_groups):
            try:  # again at every step: a scheduler or a hand edit may have changed them
                check_hyperparameters(group)
                for position, p in enumerate(group["params"]):
                    _check_gradient(p, position)
            except (TypeError, ValueError) as error:
                raise type(error)(f"param group {index}: {error}") from None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            same_shape = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    same_shape[(p.shape, p.device, p.dtype)].append(p)
            for params in same_shape.values():
                self._step_same_shape(params, group)
        return loss

    def _orthogonaliser(self, group: dict):
        """``f(U, overwrite_input=...)``: the Newton-Schulz call for ``group``'s updates."""
        return partial(newton_schulz, steps=group["ns_steps"], dtype=group["ns_dtype"])

    def _step_same_shape(self, params: list[torch.Tensor], group: dict) -> None:
        orthogonalise = self._orthogonaliser(group)
        if not batching_pays(params[0]):
            # Large matrices on CPU go one at a time, as in torch.optim.Muon, but through
            # one reused scratch tensor: each gradient is checked, turned into an update
            # there, orthogonalised and applied before the next, so memory stays warm.
            # Fresh memory costs page faults: about 0.2 ms per megabyte on the benchmark
            # machine, which made forming all updates first 4% slower (benchmarks/README.md).
            scratch = torch.empty_like(params[0])
            for p in _with_finite_grads(params, one_at_a_time=True):
                self._apply(p, orthogonalise(self._update(p, group, out=scratch), overwrite_input=True), group)
            return
        params = list(_with_finite_grads(params))
        if params:
            # The updates are written straight into one batch, which newton_schulz then
            # normalises in place: no stacked copy of them.
            updates = params[0].new_empty((len(params), *params[0].shape))
            for p, out in zip(params, updates):
                self._update(p, group, out=out)
            for p, o in zip(params, orthogonalise(updates, overwrite_input=True)):
                self._apply(p, o, group)

    def _update(self, p: torch.Tensor, group: dict, out: torch.Tensor) -> torch.Tensor:
        """B <- mu B + G; U = G + mu B (Nesterov) or B into ``out``; both held within the dtype's finite range."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        B, mu = state["momentum_buffer"], group["momentum"]
        largest = torch.finfo(B.dtype).max  # an entry that would overflow stays finite (class docstring)
        torch.add(p.grad, B, alpha=mu, out=B).clamp_(-largest, largest)  # the sum in one pass
        if group["nesterov"]:
            return torch.add(p.grad, B, alpha=mu, out=out).clamp_(-largest, largest)
        return out.copy_(B)

    @staticmethod
    def _apply(p: torch.Tensor, o: torch.Tensor, group: dict) -> None:
        """W <- (1 - lr wd) W - lr s(m, n) O."""
        lr, wd = group["lr"], group["weight_decay"]
        if wd != 0:
            p.mul_(1 - lr * wd)
        p.add_(o, alpha=-lr * ADJUST_LR_FNS[group["adjust_lr_fn"] or "original"](*p.shape))


def _is_dtensor(p: torch.Tensor) -> bool:
    # Read from sys.modules, not imported: importing torch.distributed.tensor costs ~0.8 s, and no DTensor
    # exists before something else imported it.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


class _MemorySpans:
    """The bytes that parameters' entries occupy, per storage, to find two parameters sharing memory."""

    def __init__(self, params):
        self.spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for p in params:
            self.add(p)

    @staticmethod
    def _span(p: torch.Tensor) -> tuple[int, int, int]:
        """(storage address, first byte, one past the last byte) of p's entries."""
        extent = 1 + sum((size - 1) * stride for size, stride in zip(p.shape, p.stride()))
        start = p.storage_offset() * p.element_size()
        return p.untyped_storage().data_ptr(), start, start + extent * p.element_size()

    def overlapping(self, p: torch.Tensor) -> bool:
        if p.numel() == 0:
            return False
        storage, start, end = self._span(p)
        return any(start < other_end and other_start < end for other_start, other_end in self.spans[storage])

    def add(self, p: torch.Tensor) -> None:
        if p.numel() > 0:
            storage, start, end = self._span(p)
            self.spans[storage].append((start, end))


def _check_gradient(p: torch.Tensor, position: int) -> None:
    """Raise unless p.grad (if any) is a dense gradient of p's dtype and shape (checked before any update)."""
    g = p.grad
    if g is None:
        return
    if g.layout != torch.strided:
        raise TypeError(f"the gradient of parameter {position} (shape {tuple(p.shape)}) is {g.layout}: Muon "
                        "takes dense gradients; give sparse ones (nn.Embedding(sparse=True)) to AdamW")
    if g.dtype != p.dtype or g.shape != p.shape:
        raise ValueError(
            f"the gradient of parameter {position} is {g.dtype} of shape {tuple(g.shape)}, but the parameter is "
            f"{p.dtype} of shape {tuple(p.shape)}: Muon steps a parameter with a gradient like it. Set p.grad "
            "from backward, or convert it: p.grad = p.grad.to(p.dtype)"
        )


def _with_finite_grads(params: list[torch.Tensor], one_at_a_time: bool = False) -> Iterator[torch.Tensor]:
    """The parameters whose gradient is finite; a warning for each of the others.

    NaN and Inf propagate through a sum, which costs a thirtieth of isfinite(g).all()
    on CPU. The sum accumulates in float32 (an fp16 gradient of 300 x 300 ones is finite
    though its sum is not in fp16); a gradient whose float32 sum overflows is skipped
    too, since telling it from one holding Inf would take a second pass. ``one_at_a_time``
    checks each gradient just before it is used, while it is in cache; otherwise one
    host sync for the list.
    """
    def total(p):
        return p.grad.sum(dtype=torch.promote_types(p.grad.dtype, torch.float32))

    if one_at_a_time:
        finite = (bool(total(p).isfinite()) for p in params)  # lazily: each just before its use
    else:
        finite = torch.stack([total(p) for p in params]).isfinite().tolist()
    for p, ok in zip(params, finite):
        if ok:
            yield p
        else:
            warnings.warn(
                f"Muon skipped the step of a parameter of shape {tuple(p.shape)}: its gradient "
                "holds NaN or Inf (or overflows when summed). Its weights and momentum are "
                "unchanged. Look for the cause "
                "(a too-large learning rate, an fp16 overflow, a bad batch).",
                RuntimeWarning,
            )


def check_hyperparameters(h: dict) -> None:
    """Raise TypeError or ValueError, naming the key, unless ``h`` holds valid Muon hyperparameters.

    Args:
        h: maps lr, momentum, nesterov, weight_decay, adjust_lr_fn, ns_steps and ns_dtype
            to values, as a Muon param group does (other keys are ignored).

    Raises:
        TypeError: a value has the wrong type (a number given as a string or a bool, a
            float ``ns_steps``, an ``ns_dtype`` that is neither "auto" nor a floating dtype).
        ValueError: a number is NaN, infinite or out of range, or ``lr * weight_decay``
            is 1 or more (the decay factor 1 - lr * weight_decay would zero or flip the
            weights at every step).
    """
    usual = {"lr": "lr=0.02", "momentum": "momentum=0.95", "weight_decay": "weight_decay=0.1 (0 for none)"}

    def number(name):
        v = h[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be a number, got {describe(v)}; pass e.g. {usual[name]}")
        return v

    # Each range is written "not (in range)": NaN fails every comparison, so it is refused too.
    if not 0 <= number("lr") < math.inf:
        raise ValueError(f"lr must be >= 0 and finite, got {h['lr']}; pass a positive learning rate, e.g. 0.02")
    if not 0 <= number("momentum") < 1:
        raise ValueError(f"momentum must be in [0, 1), got {h['momentum']}; 0.95 is the usual value")
    if not 0 <= number("weight_decay") < math.inf:
        raise ValueError(
            f"weight_decay must be >= 0 and finite, got {h['weight_decay']}; use 0 for none, 0.1 is a usual value"
        )
    if h["lr"] * h["weight_decay"] >= 1:
        raise ValueError(
            f"lr * weight_decay must be < 1, got {h['lr']} * {h['weight_decay']}: each step multiplies the "
            "weights by 1 - lr * weight_decay. Lower one of them (lr 0.02 with weight_decay 0.1 is usual)"
        )
    if not isinstance(h["nesterov"], bool):
        raise TypeError(f"nesterov must be True or False, got {type(h['nesterov']).__name__}")
    if h["adjust_lr_fn"] is not None and not isinstance(h["adjust_lr_fn"], str):
        raise TypeError(f"adjust_lr_fn must be a string or None (torch.optim.Muon's name for 'original'), got "
                        f"{type(h['adjust_lr_fn']).__name__}")
    if h["adjust_lr_fn"] is not None and h["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(
            f"unknown adjust_lr_fn {h['adjust_lr_fn']!r}; use one of {sorted(ADJUST_LR_FNS)}"
        )
    check_ns_steps(h["ns_steps"], "ns_steps")
    check_ns_dtype(h["ns_dtype"], "ns_dtype")


def muon_param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split a model's parameters into (for Muon, for AdamW).

    Muon gets the weights of the hidden nn.Linear layers. AdamW gets everything else:
    biases, norm parameters, nn.Embedding tables, the output head, and every weight
    tied to an embedding. The output head is the last nn.Linear the model registers
    (``model.modules()`` order), as ``lm_head`` in nanoGPT or the last layer of an MLP.
    The head and the embeddings map between tokens/classes and features rather than
    features to features, and every peer keeps them on AdamW.

    2-D weights that are not an nn.Linear's (nn.MultiheadAttention's in_proj_weight, a
    hand-made nn.Parameter) go to AdamW too: hand them to Muon yourself if they are
    hidden matrices.

    Returns:
        ``(muon_params, adamw_params)``: two lists that together hold every parameter
        of ``model`` once, in ``model.parameters()`` order.

    Example::

        hidden, rest = muon_param_groups(model)
        muon = Muon(hidden, lr=0.02)
        adamw = torch.optim.AdamW(rest, lr=3e-4)
        # each step: loss.backward(); muon.step(); adamw.step(); both .zero_grad()
    """
    require_module("muon_param_groups", model, "for several modules, pass the model that holds them "
                   "(or nn.ModuleList(modules))")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    embedding_weights = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    hidden = {id(m.weight) for m in linears[:-1]} - embedding_weights
    muon, adamw = [], []
    for p in model.parameters():
        (muon if id(p) in hidden else adamw).append(p)
    return muon, adamw
