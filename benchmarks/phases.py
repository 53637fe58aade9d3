"""Where a training step's time goes on one rank: the self time of named phases.

bench_step.py wraps the functions that make up a step (dmuon's hooks and collectives,
the optimizers' steps) into phases, and its loop brackets the forward and the backward.
Time is charged to the innermost phase running, so a wait inside a hook counts as the
wait, and the forward's own time is what is left of it after dmuon's hooks. The phases:

- "forward", "backward": the model's compute (and, for FSDP2 and DDP, their own
  collectives, which run inside torch's hooks);
- "reduce waits": waiting for dmuon's reduces to owners and the DDP backend's all-reduces
  of the other gradients;
- "broadcast waits": waiting for dmuon's broadcasts (before a layer runs) and for the
  post-step broadcasts (the DDP backend, HSDP);
- "step all-reduce": the optimizer step's all-reduce of its flag, wait included: a rank
  that finished its Newton-Schulz first waits there for the others;
- "Muon": Muon's local steps on the owned matrices (momentum, Newton-Schulz, the update);
- "TP gather + scatter": the TP owner's gather of the gradient shards and scatter of the
  update (a rank waiting there for its TP owner's Newton-Schulz counts that time too);
- "AdamW": torch.optim.AdamW's steps;
- "order check": dmuon's collective-order check;
- "dmuon's hooks and copies": the rest of dmuon's own work (packing and unpacking the
  buffers, issuing the collectives, residency, the step's bookkeeping).
"""

from __future__ import annotations

import contextlib
import functools
import time

PHASES = ("forward", "backward", "reduce waits", "broadcast waits", "step all-reduce", "Muon", "TP gather + scatter",
          "AdamW", "order check", "dmuon's hooks and copies")


class Phases:
    """Self time per phase since the last :meth:`reset`."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.stack: list[str] = []
        self.since = clock()

    def reset(self) -> None:
        self.spent = dict.fromkeys(PHASES, 0.0)

    def _charge(self) -> None:
        now = self.clock()
        if self.stack:
            self.spent[self.stack[-1]] += now - self.since
        self.since = now

    @contextlib.contextmanager
    def phase(self, name: str):
        if name not in self.spent:
            raise KeyError(f"{name!r} is not a phase; the phases are {PHASES}")
        self._charge()
        self.stack.append(name)
        try:
            yield
        finally:
            self._charge()
            self.stack.pop()

    def wrap(self, owner, attribute: str, name) -> None:
        """Make ``owner.attribute`` (a function) a phase; ``name`` is a phase or a function of the call's arguments."""
        function = getattr(owner, attribute)

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with self.phase(name(*args, **kwargs) if callable(name) else name):
                return function(*args, **kwargs)
        setattr(owner, attribute, wrapper)

    def wrap_context(self, owner, attribute: str, name) -> None:
        """The same for a context manager (``with owner.attribute(...)``)."""
        function = getattr(owner, attribute)

        @contextlib.contextmanager
        def wrapper(*args, **kwargs):
            with self.phase(name(*args, **kwargs) if callable(name) else name), function(*args, **kwargs):
                yield
        setattr(owner, attribute, wrapper)


def _wait_phase(_order, _event, description: str) -> str:
    if "finite-gradients flag" in description:
        return "step all-reduce"
    if "the TP gather" in description or "the TP scatter" in description:  # the TP owner's, as its docstring says
        return "TP gather + scatter"
    return "broadcast waits" if "broadcast" in description or "publish" in description else "reduce waits"


def instrument(phases: Phases) -> None:
    """Wrap dmuon's functions and the optimizers' steps into ``phases``. Call it before any model is prepared: dmuon
    registers bound methods as hooks."""
    import torch

    from dmuon_edu import muon
    from dmuon_edu.dmuon import ddp, gradients, optim, order, publish, residency, tp

    phases.wrap_context(order.CollectiveOrder, "waiting", _wait_phase)
    phases.wrap(order.CollectiveOrder, "_record", "order check")  # check(), check_all() and note() call it
    hooks = "dmuon's hooks and copies"
    for cls, attributes in ((residency.Residency, ("issue_broadcasts", "land", "release")),
                            (ddp.LocalCopies, ("issue_broadcasts",)),
                            (gradients.Gradients, ("on_grad", "issue_reduce", "finish_backward",
                                                   "_sample_after_backward")),
                            (publish.Publisher, ("publish", "wait")), (ddp.OwnersBroadcast, ("publish", "wait")),
                            (ddp.DDPState, ("on_replicated_grad", "issue_all_reduce", "finish_replicated_backward")),
                            (residency, ("before_forward", "after_forward"))):
        for attribute in attributes:
            phases.wrap(cls, attribute, hooks)
    phases.wrap(optim.Muon, "step", hooks)
    phases.wrap(muon.Muon, "_step_same_shape", "Muon")
    phases.wrap(torch.optim.AdamW, "step", "AdamW")
    for attribute in ("gather_gradients", "apply_updates"):
        phases.wrap(tp, attribute, "TP gather + scatter")
