"""Windows that are not uniform: token-weighted DDP (module 5) and uneven, short windows under DDP and dmuon (module 6).

The checks of solutions/scripts/05_token_weighted_ddp.py and 06_uneven_windows.py name a
run's mistake by the gradient it stepped with: each known mistake is a weighting of the
micro-batches' gradients. The unit tests below prove the right weighting against one
backward of the whole window, and that the known mistakes sit far enough from it, and
from each other, for GRADIENT_RATIO_TOLERANCE to tell them apart. No test here launches
torchrun: the solutions PASS, every step within ADAMW_TOLERANCE, in the one-launch fixtures
of tests/test_data_parallel.py (every 05_ script) and tests/test_module6.py (every 06_
script), and their wrong answers FAIL in tests/dist/script_mutations.py.
"""

import itertools

import pytest
import torch

from dmuon_edu.accumulation import IGNORE_INDEX, summed_token_loss
from dmuon_edu.course.data_parallel import (
    GRADIENT_RATIO_TOLERANCE,
    TokenProblem,
    flat_gradient,
    microbatch_gradients,
    relative_distance,
    weighted,
)
from dmuon_edu.course.dmuon_problem import UnevenProblem, dedicated_parameters

WORLD_SIZE = 2
# float32 sums of the same terms in another order: ~1e-7 relative, measured below 1e-6 here.
SUM_ORDER_TOLERANCE = 1e-6


def test_one_over_the_global_token_count_is_the_full_batch_gradient():
    problem = TokenProblem()
    model = problem.model()
    params = list(model.parameters())
    window = problem.windows(WORLD_SIZE)[0]
    by_rank = list(zip(*window))
    gradients = microbatch_gradients(params, [[summed_token_loss(model(x), y)[0] for x, y in rank] for rank in by_rank])
    count = sum(int((y != IGNORE_INDEX).sum()) for rank in by_rank for _, y in rank)
    tokens, targets = (torch.cat(parts) for parts in zip(*itertools.chain(*window)))
    loss_sum, total = summed_token_loss(model(tokens), targets)
    (loss_sum / total).backward()
    right = weighted(gradients, [[1 / count] * len(rank) for rank in by_rank])
    assert relative_distance(right, flat_gradient(params)) < SUM_ORDER_TOLERANCE


@pytest.mark.parametrize("with_muon", [False, True], ids=["DDP", "dmuon"])
def test_each_samples_share_of_the_window_is_the_full_batch_gradient_short_window_too(with_muon):
    problem = UnevenProblem()
    model = problem.model()
    graded = list(dedicated_parameters(model).values()) if with_muon else list(model.parameters())
    window, by_batch, splits = problem.windows()[-1], problem.rank_windows(WORLD_SIZE)[-1], problem.splits(WORLD_SIZE)[-1]
    by_rank = list(zip(*by_batch))
    gradients = microbatch_gradients(graded, [[model(batch).loss for batch in rank] for rank in by_rank])
    samples = sum(map(sum, splits))
    model(tuple(torch.cat(parts) for parts in zip(*window))).loss.backward()
    right = weighted(gradients, [[n / samples for n in rank] for rank in zip(*splits)])
    assert len(window) == problem.leftover < problem.accum_steps
    assert relative_distance(right, flat_gradient(graded)) < SUM_ORDER_TOLERANCE


def test_every_rank_runs_the_same_number_of_micro_batches_of_different_sizes():
    problem = UnevenProblem()
    streams = [problem.stream(rank, WORLD_SIZE) for rank in range(WORLD_SIZE)]
    assert len({len(stream) for stream in streams}) == 1  # a different number: another lesson (06_uneven_windows)
    sizes = [[len(x) for x, _ in stream] for stream in streams]
    assert all(n >= 1 for rank in sizes for n in rank)
    assert sizes[0] != sizes[1] and [a + b for a, b in zip(*sizes)] == [problem.global_microbatch] * len(sizes[0])


@pytest.fixture(scope="module")
def references():
    return {"tokens": TokenProblem().reference_steps(WORLD_SIZE),
            "uneven, DDP": UnevenProblem().reference_steps(WORLD_SIZE, with_muon=False),
            "uneven, dmuon": UnevenProblem().reference_steps(WORLD_SIZE, with_muon=True)}


def test_the_known_mistakes_are_far_from_the_right_gradient_and_from_each_other(references):
    # The checks tell a gradient right, or a given mistake, within GRADIENT_RATIO_TOLERANCE of its norm:
    # every mistake must sit at least 100 times as far away, or the diagnosis could confuse two of them.
    for name, steps in references.items():
        for step, reference in enumerate(steps, start=1):
            short = step == len(steps) and name.startswith("uneven")
            candidates = {"right": reference.gradient}
            for mistake, gradient in reference.mistakes.items():
                if mistake.startswith("the short window") and not short:
                    assert relative_distance(gradient, reference.gradient) < SUM_ORDER_TOLERANCE  # a full window
                    continue
                candidates[mistake] = gradient
            for (a, ga), (b, gb) in itertools.combinations(candidates.items(), 2):
                assert relative_distance(ga, gb) > 100 * GRADIENT_RATIO_TOLERANCE, (name, step, a, b)


def _ratio(reference, starts):
    gradient = next(g for mistake, g in reference.mistakes.items() if mistake.startswith(starts))
    return (gradient.norm() / reference.gradient.norm()).item()


def test_the_mistakes_that_scale_the_gradient_scale_it_by_what_their_hints_say(references):
    tokens, uneven = references["tokens"], references["uneven, dmuon"]
    assert _ratio(tokens[0], "DDP averaged") == pytest.approx(1 / WORLD_SIZE, rel=1e-5)
    assert _ratio(uneven[0], "the ranks' gradients were averaged") == pytest.approx(1 / WORLD_SIZE, rel=1e-5)
    problem = UnevenProblem()
    assert _ratio(uneven[-1], "the short window") == pytest.approx(problem.leftover / problem.accum_steps, rel=1e-5)
    targets = [y for batch in TokenProblem().windows(WORLD_SIZE)[0] for _, y in batch]
    real = sum(int((y != IGNORE_INDEX).sum()) for y in targets) / sum(y.numel() for y in targets)
    assert _ratio(tokens[0], "the count includes padding") == pytest.approx(real, rel=1e-5)


def test_a_dropped_leftover_window_is_named_by_its_samples():
    problem = UnevenProblem()
    assert problem.never_trained(problem.n_windows) is None
    message = problem.never_trained(problem.n_windows - 1)
    assert "samples 64-87 (24 of 88) were never trained on" in message and "(i + 1) % accum_steps" in message

