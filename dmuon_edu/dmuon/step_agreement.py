"""The step's agreement: one all-reduce before every optimizer step, so that every rank decides alike.

dmuon.Muon.step() all-reduces (max) six float64 numbers, 48 bytes: whether any gradient on
this rank holds NaN or Inf (then every rank skips the step), whether the FSDP2 gradients
changed after the backward (a clip that saw only them: a warning unless
dmuon.clip_grad_norm_ ran), and the order check's event count and hash, each with its
negation, so that the maximum tells a difference between ranks (order.py).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .order import compare_logs

__all__ = ["StepAgreement"]


class StepAgreement:
    """The all-reduce of one model's state before each step, and the close of its order check after it."""

    def __init__(self, state):
        self.state = state
        self.agreed = torch.zeros(6, dtype=torch.float64, device=state.mesh_device)  # reused at every step

    def agree(self, others: list[nn.Parameter]) -> bool:
        """One all-reduce (max) of [any gradient non-finite, FSDP2 gradients changed since the backward, events,
        -events, CRC, -CRC]: skip on a non-finite gradient (False), refuse on diverged event orders, warn on a
        clip that saw the FSDP2 gradients only. The same answers on every rank. ``others``: the parameters of the
        AdamW groups, whose gradients are in p.grad."""
        state, agreed = self.state, self.agreed
        # The averaged dedicated gradients, on their owners (a TP-sharded matrix's shards, on its DP owners)
        grads = [r.reduced_grad for r in state.records.values() if r.reduced_grad is not None]
        grads += [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                  for p in others if p.grad is not None and p not in state.name_of]
        # min and max are finite exactly when every entry is; one host sync in all.
        extremes = [torch.stack(torch.aminmax(g)).float() for g in grads if g.numel() > 0]
        agreed[0] = (~torch.cat(extremes).isfinite()).any() if extremes else False
        before, now = state.gradients.symmetric_sample, state.gradients.sample_symmetric_gradients()
        agreed[1] = (before is not None and now is not None and before.shape == now.shape
                     and (before != now).any())
        state.gradients.symmetric_sample = None  # the next backward takes its own
        everyone = state.everyone
        if dist.get_world_size(everyone) > 1:
            event = state.order.check("the optimizer step's all-reduce of its finite-gradients flag")
            events, crc = state.order.digest()
            agreed[2:] = torch.tensor([events, -events, crc, -crc], dtype=torch.float64)
            with state.order.waiting(event, "the optimizer step's all-reduce of its finite-gradients flag"):
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=everyone)
            if state.order.mode != "off" and (agreed[2] != -agreed[3] or agreed[4] != -agreed[5]):
                raise RuntimeError(
                    (compare_logs(state.order) or "dmuon: the ranks ran different collectives since the last step")
                    + ". optimizer.step() refused the step on every rank: the gradients mixed layers"
                )
        for order in state.orders:
            order.meetings_passed()
        if bool(agreed[1]) and not state.gradients.clipped and agreed[0] == 0:  # a skipped step needs no word
            warnings.warn(
                "the other parameters' gradients (in p.grad) were scaled after the backward, but not the dedicated "
                "(Muon) ones: torch.nn.utils.clip_grad_norm_(model.parameters(), ...) sees only the gradients in "
                "p.grad, and a dedicated matrix's gradient lives on its owner (in its "
                "dmuon.record_of(p).reduced_grad), so it measured and clipped part of the gradient. Use "
                "dmuon.clip_grad_norm_(model, max_norm) for the global norm",
                RuntimeWarning,
            )
        return agreed[0].item() == 0

    def close(self) -> None:
        """The step's events agreed on every rank (its all-reduce compared them): each order's list, up to and with
        the step's own gathers, scatters and post-step broadcasts, is what the next step is compared with. The
        replicate axis's events (HSDP) and the TP group's follow from the shard axis's: they are checked with them."""
        for order in self.state.orders:
            order.step_checked()
