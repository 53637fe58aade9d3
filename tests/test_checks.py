"""The self-check recognises a correct answer and names each common mistake.

The wrong answers here are written the way a learner writes them, not taken
from dmuon_edu.course.pitfalls, so that the checker is tested against code it has
never seen.
"""

import itertools
import re

import pytest
import torch

from dmuon_edu import accumulation
from dmuon_edu.course import gpt
from dmuon_edu.course.checks import RESULT_LINE, check, run_check


def learner_correct(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    n_total = sum(t.shape[0] for _, t in microbatches)
    total = 0.0
    for x, t in microbatches:
        loss = loss_fn(model(x), t) * (t.shape[0] / n_total)
        loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def learner_no_scaling(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    total = 0.0
    for x, t in microbatches:
        loss = loss_fn(model(x), t)
        loss.backward()
        total += loss.item() * t.shape[0]
    optimizer.step()
    return total / sum(t.shape[0] for _, t in microbatches)


def learner_zero_grad_in_loop(model, optimizer, microbatches, loss_fn):
    n_total = sum(t.shape[0] for _, t in microbatches)
    total = 0.0
    for x, t in microbatches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), t) * t.shape[0] / n_total
        loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def learner_one_over_n(model, optimizer, microbatches, loss_fn):
    """The exercise's own instructions: every loss divided by N (its micro-batches are of equal size)."""
    optimizer.zero_grad()
    n = len(microbatches)
    total_loss = 0.0
    for inputs, targets in microbatches:
        loss = loss_fn(model(inputs), targets) / n
        loss.backward()
        total_loss += loss.item() * n
    optimizer.step()
    return total_loss / n


def learner_logs_scaled_loss(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    n_total = sum(t.shape[0] for _, t in microbatches)
    total = 0.0
    for x, t in microbatches:
        loss = loss_fn(model(x), t) * t.shape[0] / n_total
        loss.backward()
        total += loss.item()
    optimizer.step()
    return total / len(microbatches)


def learner_hard_wired_n(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    total = 0.0
    for x, t in microbatches:
        loss = loss_fn(model(x), t)
        (loss / 4).backward()
        total += loss.item() / 4
    optimizer.step()
    return total


def learner_keeps_loss_tensors(model, optimizer, microbatches, loss_fn):
    """Honest: keeps each loss tensor for logging; its graph was freed by its backward all the same."""
    optimizer.zero_grad()
    losses = []
    for x, t in microbatches:
        loss = loss_fn(model(x), t)
        (loss / len(microbatches)).backward()
        losses.append(loss)
    optimizer.step()
    return sum(loss.item() for loss in losses) / len(losses)


def learner_one_summed_backward(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    total = sum(loss_fn(model(x), t) for x, t in microbatches) / len(microbatches)
    total.backward()
    optimizer.step()
    return total.item()


def learner_retains_graphs(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    losses = []
    for x, t in microbatches:
        loss = loss_fn(model(x), t)
        (loss / len(microbatches)).backward(retain_graph=True)
        losses.append(loss)
    optimizer.step()
    return sum(loss.item() for loss in losses) / len(losses)


def learner_one_big_batch(model, optimizer, microbatches, loss_fn):
    optimizer.zero_grad()
    loss = loss_fn(model(torch.cat([x for x, _ in microbatches])), torch.cat([t for _, t in microbatches]))
    loss.backward()
    optimizer.step()
    return loss.item()


def learner_stub(model, optimizer, microbatches, loss_fn):
    raise NotImplementedError("Exercise: replace this line with your code")


def learner_crashes(model, optimizer, microbatches, loss_fn):
    return model(microbatches)


@pytest.mark.parametrize(
    "candidate, status, hint",
    [
        (learner_correct, "PASS", "equals one full-batch step"),
        (learner_no_scaling, "FAIL", "N times too large"),
        (learner_zero_grad_in_loop, "FAIL", "zero_grad\\(\\) is inside the micro-batch loop"),
        (learner_one_over_n, "PASS", "equals one full-batch step"),
        (learner_logs_scaled_loss, "FAIL", "returned loss is N times too small"),
        (learner_hard_wired_n, "FAIL", "differ from one full-batch step"),
        (learner_keeps_loss_tensors, "PASS", "peaks at one micro-batch's memory"),
        # The same update as one full-batch step, at several times the memory: the lesson, graded.
        (learner_one_summed_backward, "FAIL", r"added the losses and called backward once.*\d\.\dx the peak memory"),
        (learner_retains_graphs, "FAIL", r"outlived its backward \(retain_graph=True\?\).*\d\.\dx the peak memory"),
        (learner_one_big_batch, "FAIL", r"window as one batch.*\d\.\dx the peak memory"),
        (learner_stub, "TODO", "not attempted"),
        (learner_crashes, "FAIL", "raised TypeError"),
    ],
)
def test_verdicts_name_the_mistake(candidate, status, hint):
    result = run_check("train_step_with_accumulation", candidate)
    assert result.status == status, str(result)
    assert re.search(hint, result.message), str(result)


def test_check_prints_one_parseable_line(capsys):
    check("train_step_with_accumulation", learner_no_scaling)
    line = capsys.readouterr().out.strip()
    assert RESULT_LINE.match(line).groups()[:2] == ("FAIL", "train_step_with_accumulation")


def test_a_multi_line_exception_still_makes_one_verdict_line(capsys):
    def learner_raises_shape_error(model, optimizer, microbatches, loss_fn):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied\n(4x8 and 16x4)\nsee above")

    check("train_step_with_accumulation", learner_raises_shape_error)
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    assert line == "FAIL train_step_with_accumulation: your function raised RuntimeError: mat1 and mat2 shapes cannot be multiplied"


def test_unknown_exercise_and_non_callable_are_refused():
    with pytest.raises(ValueError, match="known exercises"):
        run_check("no_such_exercise", learner_correct)
    with pytest.raises(TypeError, match="pass your function itself"):
        run_check("train_step_with_accumulation", 1.0)


# module 1, microbatch_weights: the weights learners derive, right and wrong.


def weights_share(sizes):
    return [n / sum(sizes) for n in sizes]


def weights_share_as_a_tensor(sizes):
    counts = torch.tensor(sizes, dtype=torch.float32)
    return counts / counts.sum()


def weights_one_over_n(sizes):
    return [1 / len(sizes) for _ in sizes]


def weights_counts(sizes):
    return [float(n) for n in sizes]


def weights_counts_over_n(sizes):
    return [n / len(sizes) for n in sizes]


def weights_inverse(sizes):
    return [1 / n for n in sizes]


def weights_written_out_for_the_example(sizes):
    return [3 / 16, 5 / 16, 8 / 16]


def weights_share_of_the_largest(sizes):
    return [n / max(sizes) for n in sizes]


def weights_one_number(sizes):
    return 1 / sum(sizes)


@pytest.mark.parametrize(
    "candidate, status, hint",
    [
        (weights_share, "PASS", "full batch's mean gradient"),
        (weights_share_as_a_tensor, "PASS", "full batch's mean gradient"),
        (weights_one_over_n, "FAIL", r"\d+% off the full batch's: every micro-batch has weight 1/N"),
        (weights_counts, "FAIL", r"\d+% off the full batch's: the weights are the sample counts"),
        (weights_counts_over_n, "FAIL", r"\d+% off the full batch's: the weights are n_i / N"),
        (weights_inverse, "FAIL", r"\d+% off the full batch's: the weights are 1 / n_i"),
        (weights_written_out_for_the_example, "FAIL", r"for sizes \[1, 2, 7, 6\], a list of 4 numbers"),
        (weights_share_of_the_largest, "FAIL", r"\d+% off the full batch's; write the full-batch mean loss"),
        (weights_one_number, "FAIL", "return one weight per micro-batch"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_microbatch_weights_verdicts(candidate, status, hint):
    result = run_check("microbatch_weights", candidate)
    assert result.status == status and re.search(hint, result.message), str(result)


def test_microbatch_weights_hint_states_the_measured_cost():
    # 1/N on sizes 3, 5, 8 is not a rounding error: the hint's percentage is the measured distance
    # of the accumulated gradient from the full batch's (25% on the check's seeded problem).
    message = run_check("microbatch_weights", weights_one_over_n).message
    assert int(re.search(r"(\d+)% off", message).group(1)) >= 10, message


# --- module 3 ---------------------------------------------------------------------------------


def windows_correct(batches, accum_steps):
    window = []
    for batch in batches:
        window.append(batch)
        if len(window) == accum_steps:
            yield window
            window = []
    if window:
        yield window


def windows_by_islice(batches, accum_steps):  # honest too: itertools reads exactly one window at a time
    batches = iter(batches)
    while window := list(itertools.islice(batches, accum_steps)):
        yield window


def windows_reading_the_epoch_first(batches, accum_steps):
    batches = list(batches)
    return [batches[i : i + accum_steps] for i in range(0, len(batches), accum_steps)]


def windows_by_slicing(batches, accum_steps):
    return [batches[i : i + accum_steps] for i in range(0, len(batches), accum_steps)]


def windows_dropping_leftover(batches, accum_steps):
    window = []
    for batch in batches:
        window.append(batch)
        if len(window) == accum_steps:
            yield window
            window = []


def windows_merging_leftover(batches, accum_steps):
    windows = list(windows_correct(batches, accum_steps))
    if len(windows) > 1 and len(windows[-1]) < accum_steps:
        leftover = windows.pop()
        windows[-1] += leftover
    return windows


@pytest.mark.parametrize(
    "candidate, status, hint",
    [
        (windows_correct, "PASS", "from a list, a generator and a DataLoader"),
        (windows_by_islice, "PASS", "from a list, a generator and a DataLoader"),
        (windows_reading_the_epoch_first, "FAIL", "read 10 batches before yielding the first window of 4"),
        (windows_by_slicing, "FAIL", "needs len() or slicing"),
        (windows_dropping_leftover, "FAIL", "last, shorter window is missing"),
        (windows_merging_leftover, "FAIL", "expected windows"),
    ],
)
def test_accumulation_windows_verdicts(candidate, status, hint):
    result = run_check("accumulation_windows", candidate)
    assert result.status == status and hint in result.message, str(result)


def z_loss_by_cross_entropy(logits, targets, z_weight):
    real = targets != -100
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return loss + z_weight * (logits.logsumexp(-1)[real] ** 2).sum(), int(real.sum())


def z_loss_by_log_softmax(logits, targets, z_weight):
    # the other honest answer: per position, masked by multiplying
    real = (targets != -100).float()
    log_z = torch.logsumexp(logits, dim=-1)
    picked = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return ((-picked + z_weight * log_z.pow(2)) * real).sum(), int(real.sum().item())


def z_loss_unmasked(logits, targets, z_weight):
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return loss + z_weight * (logits.logsumexp(-1) ** 2).sum(), int((targets >= 0).sum())


def z_loss_averaged(logits, targets, z_weight):
    real = targets != -100
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return loss + z_weight * (logits.logsumexp(-1)[real] ** 2).mean(), int(real.sum())


def z_loss_forgotten(logits, targets, z_weight):
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return loss, int((targets >= 0).sum())


def z_loss_not_squared(logits, targets, z_weight):
    real = targets != -100
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return loss + z_weight * logits.logsumexp(-1)[real].sum(), int(real.sum())


def z_loss_mean(logits, targets, z_weight):
    total, count = z_loss_by_cross_entropy(logits, targets, z_weight)
    return total / count, count


def z_loss_counting_padding(logits, targets, z_weight):
    return z_loss_by_cross_entropy(logits, targets, z_weight)[0], targets.numel()


def z_loss_detached(logits, targets, z_weight):
    total, count = z_loss_by_cross_entropy(logits, targets, z_weight)
    return torch.tensor(total.item()), count


def z_loss_not_a_pair(logits, targets, z_weight):
    return z_loss_by_cross_entropy(logits, targets, z_weight)[0]


def z_loss_for_one_weight(logits, targets, z_weight):
    return z_loss_by_cross_entropy(logits, targets, 0.1)  # right only at the first weight


@pytest.mark.parametrize(
    "candidate, status, hint",
    [
        (z_loss_by_cross_entropy, "PASS", "z-loss included"),
        (z_loss_by_log_softmax, "PASS", "z-loss included"),
        (z_loss_unmasked, "FAIL", "ignore_index masks only F.cross_entropy's own term"),
        (z_loss_averaged, "FAIL", "averaged within the micro-batch"),
        (z_loss_forgotten, "FAIL", "z-loss term is missing"),
        (z_loss_not_squared, "FAIL", "not w log Z"),
        (z_loss_mean, "FAIL", "that is the mean over tokens"),
        (z_loss_counting_padding, "FAIL", "count includes padding"),
        (z_loss_detached, "FAIL", "left the graph"),
        (z_loss_not_a_pair, "FAIL", "return a pair"),
        (z_loss_for_one_weight, "FAIL", "with z_weight 0.0001"),
    ],
)
def test_summed_token_loss_with_z_verdicts(candidate, status, hint):
    result = run_check("summed_token_loss_with_z", candidate)
    assert result.status == status and hint in result.message, str(result)


def weights_by_tokens(microbatches):
    counts = [(targets != -100).sum().item() for _, targets in microbatches]
    return [count / sum(counts) for count in counts]


def weights_by_tokens_as_a_tensor(microbatches):
    counts = torch.stack([(targets != -100).sum() for _, targets in microbatches]).float()
    return counts / counts.sum()


def weights_equal(microbatches):
    return [1 / len(microbatches) for _ in microbatches]


def weights_by_sequences(microbatches):
    sizes = [len(targets) for _, targets in microbatches]
    return [size / sum(sizes) for size in sizes]


def weights_by_positions(microbatches):
    sizes = [targets.numel() for _, targets in microbatches]
    return [size / sum(sizes) for size in sizes]


def weights_token_counts(microbatches):
    return [int((targets != -100).sum()) for _, targets in microbatches]


def weights_inverse_token_counts(microbatches):
    inverse = [1 / int((targets != -100).sum()) for _, targets in microbatches]
    return [w / sum(inverse) for w in inverse]


def weights_one_short(microbatches):
    return weights_by_tokens(microbatches[:-1])


def weights_stub(microbatches):
    raise NotImplementedError("Exercise: replace this line with your code")


@pytest.mark.parametrize(
    "candidate, status, hint",
    [
        (weights_by_tokens, "PASS", "full batch's token-mean gradient"),
        (weights_by_tokens_as_a_tensor, "PASS", "full batch's token-mean gradient"),
        (weights_equal, "FAIL", r"mean of micro-batch means, the 2024 transformers bug.* \d+% off"),
        (weights_by_sequences, "FAIL", r"you weight by sequences .* \d+% off"),
        (weights_by_positions, "FAIL", r"you count padded positions too.* \d+% off"),
        (weights_token_counts, "FAIL", "the right proportions, but your weights add up to 129"),
        (weights_inverse_token_counts, "FAIL", r"\d+% off the full batch's token mean: how many tokens"),
        (weights_one_short, "FAIL", "3 micro-batches, got 2 weights"),
        (weights_stub, "TODO", "not attempted"),
    ],
)
def test_mean_loss_weights_verdicts(candidate, status, hint):
    result = run_check("mean_loss_weights", candidate)
    assert result.status == status and re.search(hint, result.message), str(result)


def test_each_named_weighting_mistake_moves_the_gradient_far_beyond_the_tolerance():
    # The check tells a right answer from a wrong one at GRADIENT_RTOL = 1e-5: every named mistake must be
    # far outside it (measured 21%, 44% and 42%), and the right weights inside (measured 1.6e-7).
    for candidate in (weights_equal, weights_by_sequences, weights_by_positions):
        cost = int(re.search(r"(\d+)% off", run_check("mean_loss_weights", candidate).message).group(1))
        assert cost >= 10, candidate.__name__


# --- module 4 ---------------------------------------------------------------------------------


def ns_step_correct(X, a, b, c):
    gram = X @ X.mT
    return a * X + b * gram @ X + c * gram @ gram @ X


def ns_step_without_linear_term(X, a, b, c):
    gram = X @ X.mT
    return b * gram @ X + c * gram @ gram @ X


def ns_step_elementwise_square(X, a, b, c):
    gram = X @ X.mT
    return a * X + (b * gram + c * gram * gram) @ X


def ns_step_quintic_without_square(X, a, b, c):
    gram = X @ X.mT
    return a * X + (b * gram + c * gram) @ X


def ns_step_swapped_coefficients(X, a, b, c):
    gram = X @ X.mT
    return a * X + (c * gram + b * gram @ gram) @ X


def ns_step_right_to_left(X, a, b, c):  # honest: A X twice, and A (A X) instead of (A A) X: 1.8x the flops
    gram = X @ X.mT
    return a * X + b * gram @ X + c * gram @ (gram @ X)


def ns_step_through_the_wide_gram(X, a, b, c):  # the right values through the n x n X^T X: 10x the flops
    wide = X.mT @ X
    return a * X + X @ (b * wide + c * wide @ wide)


def ns_step_wrong_gram(X, a, b, c):
    gram = X.mT @ X  # n x n: the shapes no longer fit a wide X
    return a * X + (b * gram + c * gram @ gram) @ X.mT


@pytest.mark.parametrize(
    "candidate, status, hint",
    [
        (ns_step_correct, "PASS", "one quintic Newton-Schulz step"),
        (ns_step_without_linear_term, "FAIL", "the a * X term is missing"),
        (ns_step_elementwise_square, "FAIL", "A * A squares each entry of A"),
        (ns_step_quintic_without_square, "FAIL", "the quintic term needs A @ A, i.e. (X X^T)^2, not A"),
        (ns_step_swapped_coefficients, "FAIL", "the coefficients are swapped"),
        (ns_step_right_to_left, "PASS", "one quintic Newton-Schulz step"),
        (ns_step_through_the_wide_gram, "FAIL", "the right values at 10.7x the flops of the cheapest grouping"),
        (ns_step_wrong_gram, "FAIL", "shape"),
    ],
)
def test_ns_step_verdicts(candidate, status, hint):
    result = run_check("ns_step", candidate)
    assert result.status == status and hint in result.message, str(result)


def _orthogonalise(U):
    from dmuon_edu.newton_schulz import newton_schulz

    return newton_schulz(U, dtype=torch.float32)


def muon_conv_step_flatten(W, G, B, lr, momentum=0.95, nesterov=True):
    B = B.mul(momentum).add(G)
    update = (G.add(B, alpha=momentum) if nesterov else B).flatten(1)
    m, n = update.shape
    return W - lr * (max(m, n) / n) ** 0.5 * _orthogonalise(update).view_as(W), B


def muon_conv_step_ema_reshape(W, G, B, lr, momentum=0.95, nesterov=True):
    """torch.optim.Muon's convention (an EMA buffer, the same update after normalisation), with reshape."""
    B = B.lerp(G, 1 - momentum)
    update = (G.lerp(B, momentum) if nesterov else B).reshape(len(W), -1)
    m, n = update.shape
    return W - lr * max(1, m / n) ** 0.5 * _orthogonalise(update).reshape(W.shape), B


def _conv_step(W, G, B, lr, momentum, matrix_of, factor, look_ahead=lambda G, B, mu: G + mu * B,
               orthogonalise=True):
    B = momentum * B + G
    update = matrix_of(look_ahead(G, B, momentum))
    return W - lr * factor * (_orthogonalise(update) if orthogonalise else update).reshape(W.shape), B


def muon_conv_step_per_kernel(W, G, B, lr, momentum=0.95, nesterov=True):
    return _conv_step(W, G, B, lr, momentum, lambda U: U.reshape(-1, *W.shape[2:]), 1.0)


def muon_conv_step_factor_of_the_4d_shape(W, G, B, lr, momentum=0.95, nesterov=True):
    return _conv_step(W, G, B, lr, momentum, lambda U: U.flatten(1), max(1, W.shape[0] / W.shape[1]) ** 0.5)


def muon_conv_step_no_shape_factor(W, G, B, lr, momentum=0.95, nesterov=True):
    return _conv_step(W, G, B, lr, momentum, lambda U: U.flatten(1), 1.0)


def muon_conv_step_no_nesterov(W, G, B, lr, momentum=0.95, nesterov=True):
    return _conv_step(W, G, B, lr, momentum, lambda U: U.flatten(1), 2**0.5, look_ahead=lambda G, B, mu: B)


def muon_conv_step_swapped_look_ahead(W, G, B, lr, momentum=0.95, nesterov=True):
    return _conv_step(W, G, B, lr, momentum, lambda U: U.flatten(1), 2**0.5,
                      look_ahead=lambda G, B, mu: B + mu * G if nesterov else B)


def muon_conv_step_not_orthogonalised(W, G, B, lr, momentum=0.95, nesterov=True):
    return _conv_step(W, G, B, lr, momentum, lambda U: U.flatten(1), 2**0.5, orthogonalise=False)


def muon_conv_step_on_the_4d_tensor(W, G, B, lr, momentum=0.95, nesterov=True):
    B = momentum * B + G
    return W - lr * _orthogonalise(G + momentum * B), B


def muon_conv_step_left_flat(W, G, B, lr, momentum=0.95, nesterov=True):
    B = momentum * B + G
    return W.flatten(1) - lr * 2**0.5 * _orthogonalise((G + momentum * B).flatten(1)), B


@pytest.mark.parametrize(
    "candidate, status, hint",
    [
        (muon_conv_step_flatten, "PASS", "one row of a (16, 8) matrix"),
        (muon_conv_step_ema_reshape, "PASS", "one row of a (16, 8) matrix"),
        (muon_conv_step_per_kernel, "FAIL", "kh x kw kernel as a matrix of its own"),
        (muon_conv_step_factor_of_the_4d_shape, "FAIL", "out / in of the 4-D shape, 16 / 2, gives sqrt(8)"),
        (muon_conv_step_no_shape_factor, "FAIL", "sqrt(2), is missing"),
        (muon_conv_step_no_nesterov, "FAIL", "without Nesterov"),
        (muon_conv_step_swapped_look_ahead, "FAIL", "the look-ahead is swapped"),
        (muon_conv_step_not_orthogonalised, "FAIL", "the update is not orthogonalised"),
        (muon_conv_step_on_the_4d_tensor, "FAIL", "reshape to 2-D first"),
        (muon_conv_step_left_flat, "FAIL", "reshape the update back"),
    ],
)
def test_muon_conv_step_verdicts(candidate, status, hint):
    result = run_check("muon_conv_step", candidate)
    assert result.status == status and hint in result.message, str(result)


# Each answer of the coefficient-design exercise: a tuple and the band it promises.
# (3.7, -5.25, 2.2) reaches [0.61, 1.27]; (3.5, -7.0, 4.2) reaches [0.50, 1.02] (a narrower band
# for a lower floor); Keller Jordan's tuple reaches only 0.47 at 0.001; the classic cubic 0.008;
# (3.6, -4.7, 2.1) has p(1) = 1 and p'(1) = 0 but peaks at 1.31, past its escape point 1.11.
@pytest.mark.parametrize(
    "answer, status, hint",
    [
        (((3.7, -5.25, 2.2), (0.6, 1.3)), "PASS", "into [0.61, 1.27], inside your band [0.60, 1.30]"),
        (((3.5, -7.0, 4.2), (0.5, 1.05)), "PASS", "into [0.50, 1.02]"),
        (((3.4445, -4.775, 2.0315), (0.5, 1.3)), "FAIL", "slope at zero is too small: near 0, p(x) = a x, so 5 steps"),
        (((3.4445, -4.775, 2.0315), (0.5, 1.3)), "FAIL", "0.001 ends at 0.47"),
        (((1.5, -0.5, 0.0), (0.5, 1.0)), "FAIL", "a^5 = 8 and 0.001 ends at 0.01"),
        (((3.6, -4.7, 2.1), (0.55, 1.3)), "FAIL", "the iteration diverges"),
        (((3.6, -4.7, 2.1), (0.55, 1.3)), "FAIL", "above 1.11 further up (p(x) > x there), and p's peak on [0, 1] is 1.31"),
        (((3.7, -5.25, 2.2), (0.6, 0.95)), "FAIL", "excludes 1"),
        (((3.7, -5.25, 2.2), (1.05, 1.3)), "FAIL", "excludes 1"),
        (((3.7, -5.25, 2.2), (0.3, 1.3)), "FAIL", "too wide: promise at least 0.5 and at most 1.5 (Keller Jordan's tuple already reaches [0.47, 1.20])"),
        (((3.7, -5.25, 2.2), (0.6, 1.6)), "FAIL", "too wide"),
        (((3.7, -5.25, 2.2), (0.62, 1.2)), "FAIL", "into [0.61, 1.27], outside the band [0.62, 1.20] you promised"),
        (((3.7, -5.25), (0.6, 1.3)), "FAIL", "return ((a, b, c), (lo, hi))"),
        ((3.7, -5.25, 2.2), "FAIL", "return ((a, b, c), (lo, hi))"),
    ],
)
def test_ns_coefficients_verdicts(answer, status, hint):
    result = run_check("ns_coefficients", lambda: answer)
    assert result.status == status and hint in result.message, str(result)


def test_ns_coefficients_band_is_measured_on_the_grid():
    """The reported band is the composition's range on [0.001, 1], compared with an independent evaluation."""
    from dmuon_edu.course.ns_design import band_reached

    a, b, c = 3.7, -5.25, 2.2
    x = torch.logspace(-3, 0, 100_001, dtype=torch.float64)
    for _ in range(5):
        x = x * (a + x * x * (b + c * x * x))  # Horner form: rounds differently from the package's
    # The 10,001-point grid misses the extremes between its points by less than 1e-3 here.
    assert band_reached((a, b, c)) == pytest.approx((x.min().item(), x.max().item()), abs=1e-3)


def test_missing_script_results_give_one_friendly_line(tmp_path):
    from dmuon_edu.course.checks import ExerciseNotDone, load_script_results

    with pytest.raises(ExerciseNotDone) as missing:
        load_script_results(tmp_path / "fsdp2.json")
    rendered = missing.value._render_traceback_()  # what IPython shows instead of a traceback
    assert len(rendered) == 1 and "finish the exercise script" in rendered[0]
    (tmp_path / "fsdp2.json").write_text('{"status": "PASS"}')
    assert load_script_results(tmp_path / "fsdp2.json") == {"status": "PASS"}


# --- module 7 ---------------------------------------------------------------------------------


def _entropy(p):
    return -(p * p.clamp_min(1e-300).log()).sum(dim=-1)


def _first_tokens(source, t):
    """H(X_0, ..., X_t): the stationary joint of a sequence's first t + 1 tokens, from pi over contexts."""
    pi, vocab = source.stationary(), source.vocab_size
    return _entropy(pi.reshape(vocab ** (t + 1), -1).sum(dim=1))


def _early(source, seq_len):
    """H(X_t+1 | X_0 ... X_t) of the predictions that have seen fewer than k tokens."""
    return [_first_tokens(source, t + 1) - _first_tokens(source, t) for t in range(min(source.order - 1, seq_len))]


def _rate(source):
    return source.stationary() @ _entropy(source.rows())


def floor_correct(source, seq_len):
    early = _early(source, seq_len)
    return float((sum(early) + (seq_len - len(early)) * _rate(source)) / seq_len)


def floor_by_weighted_conditionals(source, seq_len):  # another route: sum over contexts u of P(u) H(next | u)
    vocab, floors = source.vocab_size, []
    pi = source.stationary()
    for t in range(min(source.order - 1, seq_len)):
        joint = pi.reshape(vocab ** (t + 2), -1).sum(dim=1).reshape(vocab ** (t + 1), vocab)  # (X_0..X_t, X_t+1)
        context = joint.sum(dim=1)
        floors.append(context @ _entropy(joint / context[:, None]))
    return float((sum(floors) + (seq_len - len(floors)) * source.entropy_rate()) / seq_len)


def floor_entropy_rate(source, seq_len):
    return source.entropy_rate()


def floor_uniform_contexts(source, seq_len):
    early = _early(source, seq_len)
    return float((sum(early) + (seq_len - len(early)) * _entropy(source.rows()).mean()) / seq_len)


def floor_uniform_rows_only(source, seq_len):
    return float(_entropy(source.rows()).mean())


def floor_early_without_context(source, seq_len):
    early = [_first_tokens(source, 0)] * (source.order - 1)
    return float((sum(early) + (seq_len - len(early)) * _rate(source)) / seq_len)


def floor_of_an_order_2_source(source, seq_len):  # the old capstone's formula: only the first prediction early
    return float((_early(source, seq_len)[0] + (seq_len - 1) * _rate(source)) / seq_len)


def floor_bigram(source, seq_len):
    return float(_early(source, seq_len)[0])


def floor_seq_len_plus_one(source, seq_len):
    early = _early(source, seq_len)
    return float((sum(early) + (seq_len + 1 - len(early)) * _rate(source)) / (seq_len + 1))


def floor_in_bits(source, seq_len):
    return floor_correct(source, seq_len) / 0.6931471805599453


def floor_stub(source, seq_len):
    raise NotImplementedError("derive the floor")


@pytest.mark.parametrize(
    "candidate, status, hint",
    [
        (floor_correct, "PASS", "the floor of 32 predictions"),
        (floor_by_weighted_conditionals, "PASS", "the floor of 32 predictions"),
        (floor_entropy_rate, "FAIL", "you returned the entropy rate for every prediction"),
        (floor_uniform_contexts, "FAIL", "weighted every context's row equally"),
        (floor_uniform_rows_only, "FAIL", "equal weights, for every prediction"),
        (floor_early_without_context, "FAIL", "use no context at all"),
        (floor_of_an_order_2_source, "FAIL", "as in an order-2 source"),
        (floor_bigram, "FAIL", "a bigram's floor"),
        (floor_seq_len_plus_one, "FAIL", "seq_len + 1 predictions"),
        (floor_in_bits, "FAIL", "in bits"),
        (lambda source, seq_len: 1.0, "FAIL", "from the true one"),
        (lambda source, seq_len: float(source.position_floors(seq_len).mean()), "FAIL",
         "you called source.position_floors, which is the answer"),
        (lambda source, seq_len: float(sum(_entropy(j.flatten()) for j in source.leading_joints())), "FAIL",
         "you called source.leading_joints"),
        (floor_stub, "TODO", "not attempted"),
    ],
)
def test_loss_floor_verdicts(candidate, status, hint):
    result = run_check("loss_floor", candidate)
    assert result.status == status and hint in result.message, str(result)
    if status == "FAIL" and hint not in ("from the true one",) and "you called" not in hint:
        assert re.search(r"off by \d\.\d{3} nats", result.message), str(result)  # every named mistake says what it costs


def test_every_named_floor_mistake_has_its_own_hint():
    hints = [run_check("loss_floor", c).message.split(" (off by")[0] for c in (
        floor_entropy_rate, floor_uniform_contexts, floor_uniform_rows_only, floor_early_without_context,
        floor_of_an_order_2_source, floor_bigram, floor_seq_len_plus_one, floor_in_bits)]
    assert len(set(hints)) == len(hints), hints


@pytest.mark.parametrize("exercise, function, hint", [
    ("train_step_with_accumulation", accumulation.train_step_with_accumulation, "the package's own"),
    ("accumulation_windows", accumulation.accumulation_windows, "the package's own"),
    ("train_epoch", accumulation.train, "the package's own"),
    ("is_hidden_matrix", gpt.is_hidden_matrix, "the package's own is_hidden_matrix"),
])
def test_the_packages_own_function_does_not_pass_its_exercise(exercise, function, hint):
    result = run_check(exercise, function)
    assert result.status == "FAIL" and hint in result.message, str(result)
