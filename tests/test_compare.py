"""max_parameter_difference, the measure of every equivalence: exact on known differences, and never fooled by NaN."""

import math

import pytest
import torch

from dmuon_edu.compare import max_parameter_difference


def test_the_largest_difference_over_every_tensor():
    a = [torch.zeros(2, 2), torch.ones(3)]
    b = [torch.tensor([[0.0, 0.25], [0.0, 0.0]]), torch.tensor([1.0, 1.5, 1.0])]
    assert max_parameter_difference(a, b) == 0.5
    assert max_parameter_difference(a, a) == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("first", [True, False], ids=["in the first tensor", "in a later one"])
def test_a_diverged_run_is_infinitely_far_whichever_side_and_tensor(bad, first):
    good = [torch.zeros(3), torch.zeros(3)]
    diverged = [t.clone() for t in good]
    diverged[0 if first else 1][1] = bad
    # Python's max(0.0, nan) is 0.0: a NaN must not drop out, on either side.
    assert max_parameter_difference(good, diverged) == math.inf
    assert max_parameter_difference(diverged, good) == math.inf
    assert max_parameter_difference(diverged, diverged) == math.inf  # NaN equals nothing; inf - inf is NaN
