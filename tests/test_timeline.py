"""The course's timeline: layer spans in the order autograd runs them, and collectives sorted by phase.
Its use on real dmuon runs (Z2 against Z3, every rank) is in tests/test_module6.py."""

import torch
from torch import nn

from dmuon_edu.course.timeline import Timeline, collectives_by_phase


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.linear(x)


def test_spans_follow_forward_then_backward_in_reverse_and_never_overlap():
    torch.manual_seed(0)
    embed, layers = nn.Linear(4, 8), nn.ModuleList(Residual() for _ in range(3))
    with Timeline(layers) as timeline:
        for _ in range(2):  # two micro-batches
            h = embed(torch.randn(5, 4))
            for layer in layers:
                h = layer(h)
            h.sum().backward()
    order = [(phase, index) for phase, index, _, _ in timeline.spans]
    one_micro_batch = [("forward", 0), ("forward", 1), ("forward", 2), ("backward", 2), ("backward", 1), ("backward", 0)]
    assert order == one_micro_batch * 2
    ends = [(start, end) for _, _, start, end in timeline.spans]
    assert all(start <= end <= next_start for (start, end), (next_start, _) in zip(ends, ends[1:]))
    assert timeline.events == []  # no process group, no collectives


def test_collectives_are_sorted_into_the_forwards_and_what_follows_them():
    # Two micro-batches of two layers; hand-placed events (seconds, name, bytes).
    spans = [["forward", 0, 0.0, 1.0], ["forward", 1, 1.0, 2.0], ["backward", 1, 2.0, 3.0], ["backward", 0, 3.0, 4.0],
             ["forward", 0, 5.0, 6.0], ["forward", 1, 6.0, 7.0], ["backward", 1, 7.0, 8.0], ["backward", 0, 8.0, 9.0]]
    events = [[-0.1, "broadcast", 4], [1.5, "broadcast", 4], [2.5, "broadcast", 4], [4.5, "reduce", 4],
              [5.5, "broadcast", 4], [8.5, "reduce", 4]]
    assert collectives_by_phase({"spans": spans, "events": events}) == {
        "forward": {"broadcast": 3}, "backward": {"broadcast": 1, "reduce": 2}}
