"""Module 6d in one process: the ring all-reduce's and the bucket size's checks against every known wrong answer
and two honest ones each; the timing and fit verdicts against each mistake's number; the exposure simulation
against its closed form; the step-time widget's figure.

The timing script's own run (timing gloo, fitting the learner's medians) is tested in tests/test_module6.py, and
its wrong functions go through tests/dist/script_mutations.py.
"""

import math
import re

import pytest
import torch

from dmuon_edu.course.checks import run_check
from dmuon_edu.course.checks.m06_seconds import FIT_SIZES, fit_verdict, timer_verdict
from dmuon_edu.course.comm_figures import timings_figure
from dmuon_edu.course.comm_seconds import Ring, SlowRankCall, bucketed_exposed_seconds, link_timings
from dmuon_edu.course.widgets import step_time_figure, step_time_widget
from helpers import fit_relative, fit_least_absolute


# -- the ring all-reduce -------------------------------------------------------------------------------------------
def _ring_phases(buffers, send, gather_adds=False, gather=True):
    """The ring by chunk views: the reduce-scatter, then (unless not ``gather``) the all-gather, which copies what
    it receives (adds it, where ``gather_adds``: a mistake)."""
    W = len(buffers)
    chunks = [list(b.chunk(W)) for b in buffers]
    for k in range(W - 1):
        received = [send(r, (r + 1) % W, chunks[r][(r - k) % W]) for r in range(W)]
        for r in range(W):
            chunks[(r + 1) % W][(r - k) % W] += received[r]
    for k in range(W - 1 if gather else 0):
        received = [send(r, (r + 1) % W, chunks[r][(r + 1 - k) % W]) for r in range(W)]
        for r in range(W):
            chunk = chunks[(r + 1) % W][(r + 1 - k) % W]
            if gather_adds:
                chunk.add_(received[r])
            else:
                chunk.copy_(received[r])


def ring_by_views(buffers, send):
    _ring_phases(buffers, send)


def ring_backwards_by_offsets(buffers, send):
    """The other way round the ring (r sends to r - 1), with explicit offsets, returning new tensors."""
    W, n = len(buffers), buffers[0].numel() // len(buffers)
    out = [b.clone() for b in buffers]
    part = lambda r, c: out[r][c * n:(c + 1) * n]  # noqa: E731
    for k in range(W - 1):
        messages = [(r, (r + k) % W, send(r, (r - 1) % W, part(r, (r + k) % W))) for r in range(W)]
        for r, c, message in messages:
            part((r - 1) % W, c).add_(message)
    for k in range(W - 1):
        messages = [(r, (r - 1 + k) % W, send(r, (r - 1) % W, part(r, (r - 1 + k) % W))) for r in range(W)]
        for r, c, message in messages:
            part((r - 1) % W, c).copy_(message)
    return out


def ring_reduce_to_root(buffers, send):
    W = len(buffers)
    total = buffers[0].clone()
    for r in range(1, W):
        total += send(r, 0, buffers[r])
    buffers[0].copy_(total)
    for r in range(1, W):
        buffers[r].copy_(send(0, r, total))


def ring_whole_buffers(buffers, send):
    W = len(buffers)
    passing = [b.clone() for b in buffers]
    for _ in range(W - 1):
        passing = [send((r - 1) % W, r, passing[(r - 1) % W]) for r in range(W)]
        for r in range(W):
            buffers[r] += passing[r]


def ring_reduce_scatter_only(buffers, send):
    _ring_phases(buffers, send, gather=False)


def ring_gather_adds(buffers, send):
    _ring_phases(buffers, send, gather_adds=True)


def ring_direct_to_owners(buffers, send):
    """Each chunk straight to its owner rank and back: the bytes of a ring, but every rank talks to every rank."""
    W = len(buffers)
    chunks = [list(b.chunk(W)) for b in buffers]
    for c in range(W):
        for r in range(W):
            if r != c:
                chunks[c][c] += send(r, c, chunks[r][c])
    for c in range(W):
        for r in range(W):
            if r != c:
                chunks[r][c].copy_(send(c, r, chunks[c][c]))


@pytest.mark.parametrize("candidate, status, hint", [
    (ring_by_views, "PASS", "sends 2(W-1)/W of the buffer"),
    (ring_backwards_by_offsets, "PASS", "sends 2(W-1)/W of the buffer"),
    (ring_reduce_to_root, "FAIL", "on 3 ranks: rank 0 sends 960 bytes and rank 1 480: one rank carries everything"),
    (ring_whole_buffers, "FAIL", "on 3 ranks: rank 0 sends 960 bytes of a 480-byte buffer, where a ring sends "
                                 "2(W-1)/W S = 640: whole buffers"),
    (ring_reduce_scatter_only, "FAIL", "holds the sum of chunk 1 only: that is the reduce-scatter; add the all-gather"),
    (ring_gather_adds, "FAIL", "in the all-gather it copies it"),
    (ring_direct_to_owners, "FAIL", "on 4 ranks: rank 0 sends to ranks [1, 2, 3]: on a ring a rank talks to its "
                                    "neighbours only"),
])
def test_ring_all_reduce_verdicts(candidate, status, hint):
    result = run_check("ring_all_reduce", candidate)
    assert result.status == status and hint in result.message, str(result)


def test_the_ring_counts_bytes_and_refuses_a_send_to_oneself():
    ring = Ring(3)
    ring.send(0, 1, torch.zeros(5, dtype=torch.float64))
    assert ring.sent_bytes == [40, 0, 0] and ring.destinations[0] == {1}
    with pytest.raises(ValueError, match="rank 2 sends to itself"):
        ring.send(2, 2, torch.zeros(1))
    with pytest.raises(ValueError, match="dst must be a rank from 0 to 2, got 3"):
        ring.send(0, 3, torch.zeros(1))


# -- the bucket size -----------------------------------------------------------------------------------------------
def bucket_closed_form(P, alpha, seconds_per_byte, backward_seconds):
    return min(P, P * math.sqrt(alpha / backward_seconds))


def bucket_by_search(P, alpha, seconds_per_byte, backward_seconds):
    """The learner's own formula for the exposed time, minimised by a golden-section search on log b."""
    exposed = lambda log_b: (math.exp(log_b) * backward_seconds / P + P * alpha / math.exp(log_b)  # noqa: E731
                             + seconds_per_byte * P - backward_seconds)
    low, high = math.log(1.0), math.log(P)
    for _ in range(200):
        a, b = high - 0.618 * (high - low), low + 0.618 * (high - low)
        low, high = (low, b) if exposed(a) < exposed(b) else (a, high)
    return math.exp(low)


@pytest.mark.parametrize("candidate, status, hint", [
    (bucket_closed_form, "PASS", "within 5% of the least exposed communication"),
    (bucket_by_search, "PASS", "within 5% of the least exposed communication"),
    (lambda P, a, s, T: P, "FAIL", "one bucket: nothing is sent before the backward ends"),
    (lambda P, a, s, T: P * a / T, "FAIL", "the square root is missing"),
    (lambda P, a, s, T: P * math.sqrt(T / a), "FAIL", "upside down"),
    (lambda P, a, s, T: a / s, "FAIL", "alpha / beta is the size where one call's latency equals its bandwidth time"),
    (lambda P, a, s, T: 25 * 2**20, "FAIL", "DDP's default 25 MB"),
    (lambda P, a, s, T: 4 * P * math.sqrt(a / T), "FAIL", "about 4x too large"),
    (lambda P, a, s, T: P * math.sqrt(a / T) / 4, "FAIL", "about 4x too small"),
    (lambda P, a, s, T: math.sqrt(P * a / T), "FAIL", "minimise it over b"),
    (lambda P, a, s, T: -1.0, "FAIL", "a positive number"),
])
def test_best_bucket_bytes_verdicts(candidate, status, hint):
    result = run_check("best_bucket_bytes", candidate)
    assert result.status == status and hint in result.message, str(result)
    if status == "FAIL" and "positive" not in hint:
        assert re.search(r"leaves \d+\.\d ms exposed, the best bucket \(.* MB\) \d+\.\d ms", result.message)


def exposed_by_events(P, b, alpha, beta, T):
    """The model, event by event: bucket k ready at min(k b, P) / P * T, its call starting when the last one ends."""
    done, k = 0.0, 0
    while k * b < P:
        k += 1
        size = min(k * b, P) - (k - 1) * b
        done = max(done, min(k * b, P) / P * T) + alpha + beta * size
    return done - T


@pytest.mark.parametrize("P, alpha, beta, T", [
    (64e6, 1e-3, 1e-9, 0.02),  # network-bound: the calls queue
    (64e6, 1e-6, 1e-12, 1.0),  # hidden: only the last call is left
    (5e6, 3e-4, 1e-9, 0.004),  # in between
])
def test_the_exposed_time_is_the_models_event_by_event(P, alpha, beta, T):
    for b in (P / 1000, 3e5, 1e6, 1.7e6, 4e6, P, 2 * P):
        assert bucketed_exposed_seconds(P, b, alpha, beta, T) == pytest.approx(exposed_by_events(P, b, alpha, beta, T),
                                                                              rel=1e-9, abs=1e-15)
    # Network-bound, P / b whole: b T / P + (P / b)(alpha + beta b) - T, the exercise's formula.
    if beta * P > T:
        b = P / 16
        assert bucketed_exposed_seconds(P, b, alpha, beta, T) == pytest.approx(
            b * T / P + P / b * (alpha + beta * b) - T, rel=1e-12)


# -- the timing function and the fit (their numbers; the script's runs are in test_module6.py) ----------------------
# SlowRankCall's defaults: 4 ms on rank 0, 12 on rank 1, 300 ms the first call, one 80 ms hiccup; 7 repeats, the
# function calling it 8 times (one untimed), the slowest rank's median call measured at 12.1 ms unless given.
@pytest.mark.parametrize("results, status, hint, calls, truth", [
    ([0.0121, 0.0121], "PASS", "the slowest rank's median call", 8, 0.0121),
    ([0.0145, 0.0145], "PASS", "the slowest rank's median call", 8, 0.0125),  # a busy machine's overshoot
    ([0.0121, 0.0121], "PASS", "the slowest rank's median call", 9, 0.0121),  # two untimed calls
    ([0.004, 0.012], "FAIL", "each rank returned its own time (4.0 ms, 12.0 ms)", 8, 0.0121),
    ([0.004, 0.004], "FAIL", "the fastest rank's time", 8, 0.0121),
    ([0.08, 0.08], "FAIL", "the worst repeat, a hiccup of 80 ms", 8, 0.0121),
    ([0.3, 0.3], "FAIL", "the first call, 300 ms of set-up", 8, 0.0121),
    ([0.152, 0.152], "FAIL", "the total of 7 repeats", 8, 0.0121),
    ([(6 * 0.012 + 0.08) / 7] * 2, "FAIL", "the mean of the repeats, moved by a hiccup of 80 ms", 8, 0.0121),
    ([0.0121, 0.0121], "FAIL", "the call ran 7 times, all timed", 7, 0.0121),
    ([0.0121, 0.0121], "FAIL", "the call ran 1 times for 7 repeats", 1, 0.0121),
    ([0.035, 0.035], "FAIL", "where the slowest rank's median call took 12.1 ms", 8, 0.0121),
    ([float("nan")] * 2, "FAIL", "a finite float", 8, 0.0121),
])
def test_timer_verdicts(results, status, hint, calls, truth):
    got_status, message = timer_verdict(results, truth, calls, SlowRankCall(0, 2), repeats=7)
    assert got_status == status and hint in message, message


def test_the_slow_rank_call_times_itself():
    call = SlowRankCall(1, 2, first=0.002, slow=0.003, hiccup=0.004)
    for _ in range(5):
        call()
    planned = [0.002, 0.003, 0.003, 0.004, 0.003]  # the first call, slow calls, the hiccup at the fourth
    assert call.calls == 5 and all(took >= seconds for took, seconds in zip(call.took, planned))
    middle = sorted(call.took[1:])[1:3]  # the first call (set-up) left out; the median of four is the middle two's mean
    assert call.typical() == pytest.approx(sum(middle) / 2, rel=1e-12)


def fit_through_origin(sizes, seconds):
    return 0.0, sum(s * t for s, t in zip(sizes, seconds)) / sum(s * s for s in sizes)


def fit_log_log(sizes, seconds):
    xs, ys = [math.log(s) for s in sizes], [math.log(t) for t in seconds]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    p = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return math.exp(my - p * mx), p


def fit_least_squares_on_seconds(sizes, seconds):
    n = len(sizes)
    ms, mt = sum(sizes) / n, sum(seconds) / n
    slope = sum((s - ms) * (t - mt) for s, t in zip(sizes, seconds)) / sum((s - ms) ** 2 for s in sizes)
    return mt - slope * ms, slope


FIT_MISTAKES = [
    (fit_least_squares_on_seconds, "least squares on seconds lets the largest messages set the line"),
    (fit_through_origin, "the fit has no latency"),
    (lambda s, t: (sum(t) / len(t), 0.0), "the fit has no bandwidth term"),
    (lambda s, t: tuple(1e3 * v for v in fit_relative(s, t)), "return seconds, not milliseconds"),
    (lambda s, t: tuple(1e6 * v for v in fit_relative(s, t)), "return seconds, not milliseconds or microseconds"),
    (lambda s, t: (fit_relative(s, t)[0], 1 / fit_relative(s, t)[1]), "that is a bandwidth (bytes per second)"),
    (fit_log_log, "a straight line on the log-log plot"),
    (lambda s, t: fit_relative(s, t)[0], "return (alpha, seconds_per_byte), two numbers"),
]
# A gloo-like link that is not the check's own: 250 us, 0.8 GB/s, 10% scatter.
OTHER_LINK = link_timings(FIT_SIZES, 250e-6, 1 / 0.8e9, noise=0.1, seed=7)


@pytest.mark.parametrize("candidate, hint", FIT_MISTAKES)
def test_each_fit_mistake_fails_with_its_own_hint(candidate, hint):
    status, message = fit_verdict(candidate, FIT_SIZES, OTHER_LINK)
    assert status == "FAIL" and hint in message, message


@pytest.mark.parametrize("candidate", [fit_relative, fit_least_absolute,
                                       lambda s, t: torch.tensor(fit_relative(s, t)),  # an array or a list will do
                                       lambda s, t: list(fit_least_absolute(s, t))])
def test_honest_fits_pass(candidate):
    status, message = fit_verdict(candidate, FIT_SIZES, OTHER_LINK)
    assert status == "PASS", message


# -- the prediction widget -----------------------------------------------------------------------------------------
def test_step_time_figure_draws_each_layout_beside_its_adamw_step_and_refuses_bad_input():
    figure = step_time_figure("llama2-7b", 16, 8)
    seconds, overhead = figure.axes
    assert len(seconds.patches) == 6 and len(overhead.patches) == 4  # 3 pairs of bars; 3 bars and the band
    assert "128" in figure.get_suptitle()
    with pytest.raises(ValueError, match="model must be one of gpt2-small, llama2-7b"):
        step_time_figure("gpt5", 16, 8)
    with pytest.raises(ValueError, match="nodes must be between 1 and 128"):
        step_time_widget(nodes=0)


def test_the_timings_figure_draws_no_line_for_a_fit_that_is_not_positive():
    # Only the all_reduce's fit is graded; the learner's function also fits broadcast and reduce, ungraded.
    measured = {"timings": {"all_reduce": {"1024": 4e-4, "4096": 5e-4}, "broadcast": {"1024": 2e-4, "4096": 2e-4}},
                "fits": {"all_reduce": [3.9e-4, 2.5e-8], "broadcast": [2e-4, -1e-12]}}
    axes = timings_figure(measured).axes[0]
    assert [text.get_text() for text in axes.get_legend().get_texts()] == [
        "all_reduce: alpha 390 us, 0.04 GB/s", "broadcast: no line: a fit <= 0"]
    assert len(axes.lines) == 3  # two sets of points, one line


@pytest.mark.parametrize("arguments, name", [((0, 1e6, 1e-4, 1e-9, 0.02), "parameter_bytes"),
                                             ((1e6, -1, 1e-4, 1e-9, 0.02), "bucket_bytes"),
                                             ((1e6, 1e5, 1e-4, 1e-9, float("nan")), "backward_seconds")])
def test_the_exposure_model_refuses_what_is_not_a_positive_size_or_time(arguments, name):
    with pytest.raises(ValueError, match=f"{name} must be a positive finite number"):
        bucketed_exposed_seconds(*arguments)
