"""Module 6d: a collective's seconds, as the slowest rank sees them, over message sizes; and module 5b's
bucket size, swept.

A collective is done when its slowest rank is done: a rank that arrives late makes every
other rank wait. So a timing that means something starts every rank together, times the
call on each, and keeps the slowest rank's time. One timing is noisy (another process
takes the core, a page is touched for the first time), so it is repeated and the median
kept. The very first call also sets up buffers and connections: it is not timed.

The script grades your `slowest_median_seconds` on a call of known seconds first. Then it
uses it to time all_reduce, broadcast and reduce from 1 KiB to 4 MiB, and grades your
`fit_alpha_beta` on the all_reduce's sizes it did not see. Last, it times one backward with
your module 5b `BucketedAllReduce` at five bucket sizes (`05_bucketed_ddp.py`, beside this
file).

Usage: torchrun --nproc-per-node=2 06_time_collectives.py [results.json]
"""

import importlib.util
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dmuon_edu import distributed
from dmuon_edu.course.checks.m06_seconds import fit_verdict, timer_verdict
from dmuon_edu.course.comm_seconds import SlowRankCall
from dmuon_edu.course.data_parallel import report

SIZES = [2**k for k in range(10, 23)]  # bytes of float32: 1 KiB to 4 MiB, each size twice the last
REPEATS = 7  # the check's call; the collectives take more (COLLECTIVE_REPEATS)
COLLECTIVE_REPEATS = 21  # a median holds while fewer than half the calls stall
SWEEP_BUCKETS = [2**14, 2**16, 2**18, 2**20]  # bytes; and one bucket holding every gradient


def slowest_median_seconds(call, repeats):
    """The seconds one ``call()`` takes as the slowest rank sees it: the median of ``repeats`` timed calls, past
    the set-up of the first, the same float on every rank. Every rank calls this function together."""
    ### BEGIN SOLUTION
    call()  # the first call sets up buffers and connections
    times = []
    for _ in range(repeats):
        dist.barrier()  # every rank starts together
        start = time.perf_counter()
        call()
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the call is done when its slowest rank is
        times.append(elapsed.item())
    return statistics.median(times)
    ### END SOLUTION


def fit_alpha_beta(sizes, seconds):
    """``(alpha, seconds_per_byte)`` such that ``alpha + seconds_per_byte * size`` predicts the seconds of a call
    of ``size`` bytes, fitted to the medians ``seconds`` measured at ``sizes``.

    The sizes run from a kilobyte, where a call costs its latency, to megabytes, where it costs
    its bytes; a prediction must hold at both ends.
    """
    ### BEGIN SOLUTION
    # Least squares on the relative error: each size counts alike, however small its time.
    # Minimise sum ((alpha + b s) / t - 1)^2, linear in (alpha, b): the normal equations of a 2 x 2 system.
    rows = [(1 / t, s / t) for s, t in zip(sizes, seconds)]
    aa = sum(u * u for u, _ in rows)
    ab = sum(u * v for u, v in rows)
    bb = sum(v * v for _, v in rows)
    ya, yb = sum(u for u, _ in rows), sum(v for _, v in rows)
    determinant = aa * bb - ab * ab
    return (ya * bb - yb * ab) / determinant, (aa * yb - ab * ya) / determinant
    ### END SOLUTION


def collective_calls(nbytes):
    """One call of each collective on ``nbytes`` of float32 (given)."""
    x = torch.zeros(nbytes // 4)
    return {"all_reduce": lambda: dist.all_reduce(x),
            "broadcast": lambda: dist.broadcast(x, src=0),
            "reduce": lambda: dist.reduce(x, dst=0)}


def bucket_sweep():
    """Seconds of one backward with your BucketedAllReduce at each bucket size, and its all_reduce calls (given).

    The model: 8 layers of 256 x 256, about 2 MiB of gradients. On gloo with 2 ranks on 2
    cores nothing overlaps: each call's time adds to the backward's.
    """
    path = Path(__file__).with_name("05_bucketed_ddp.py")  # your module 5b script, beside this one
    spec = importlib.util.spec_from_file_location("bucketed_ddp", path)
    bucketed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bucketed)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    rows = {}
    for bucket_bytes in [*SWEEP_BUCKETS, None]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        buckets = bucketed.BucketedAllReduce(model, bucket_bytes or gradient_bytes)

        def backward(sync=True):
            buckets.require_sync = sync
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            if sync:
                buckets.finish()

        seconds = slowest_median_seconds(backward, REPEATS)
        with distributed.count_collectives() as counts:
            backward()
        rows[bucket_bytes or gradient_bytes] = {"seconds": seconds, "calls": counts.calls["all_reduce"]}
    rows["no communication"] = {"seconds": slowest_median_seconds(lambda: backward(sync=False), REPEATS), "calls": 0}
    return {"gradient bytes": gradient_bytes, "rows": rows}


def main(ranks):
    known = SlowRankCall(ranks.rank, ranks.world_size)
    got = slowest_median_seconds(known, REPEATS)
    results, typical = [None] * ranks.world_size, [None] * ranks.world_size
    dist.all_gather_object(results, got)
    dist.all_gather_object(typical, known.typical() if known.calls > 1 else 0.0)
    status, timer = timer_verdict(results, max(typical), known.calls, known, REPEATS)
    if status == "FAIL":
        return report("06_time_collectives", [], {}, hint="", findings=(f"slowest_median_seconds: {timer}",))
    timings = {name: {} for name in collective_calls(4)}
    for nbytes in SIZES:
        for name, call in collective_calls(nbytes).items():
            timings[name][nbytes] = slowest_median_seconds(call, COLLECTIVE_REPEATS)
    sizes = list(timings["all_reduce"])
    status, message = fit_verdict(fit_alpha_beta, sizes, [timings["all_reduce"][n] for n in sizes])
    if status == "FAIL":
        return report("06_time_collectives", [], {}, hint="", findings=(f"fit_alpha_beta: {message}",))
    fits = {name: fit_alpha_beta(list(row), list(row.values())) for name, row in timings.items()}
    try:
        sweep = bucket_sweep()
    except NotImplementedError:
        distributed.print0("the bucket sweep needs your BucketedAllReduce: finish scripts/05_bucketed_ddp.py (05b)")
        sweep = None
    return report("06_time_collectives", [], {}, hint="",
                  passed=f"slowest_median_seconds: {timer}; fit_alpha_beta: {message}",
                  measurements={"timings": timings, "fits": fits, "sweep": sweep, "world size": ranks.world_size})


if __name__ == "__main__":
    with distributed.session() as ranks:
        main(ranks)
