r"""The machine, as the time model (step_time.py) sees it: collective costs, matmul rates, and what overlaps.

    hardware = dmuon.calibrate()                 # inside torchrun: this machine, at this world size
    hardware = dmuon.HARDWARE["h100-sxm"]        # or a GPU preset, with its sources

A collective of ``S`` counted bytes (count_comm's unit: the whole tensor, on every rank
taking part) over a group of ``g`` ranks takes

.. math::

    t = \alpha + \beta\, f(g)\, S,

:math:`\alpha` its fixed cost per call, :math:`\beta` the seconds per byte one rank
sends, :math:`f(g)` the bytes one rank sends per counted byte (:func:`wire_factor`):

- ring all-reduce, 2(g-1)/g (a reduce-scatter, then an all-gather);
- all-gather and reduce-scatter, (g-1)/g of the whole (ring);
- broadcast and reduce, 1: NCCL runs both as a pipelined chain, where every rank but the
  last forwards the whole message once (nccl-tests' PERFORMANCE.md: t = S / B);
- gather and scatter, (g-1)/g: the root receives, or sends, every part but its own.

Each collective has its own :math:`\alpha` and :math:`\beta`: :func:`calibrate` measures
them one collective at a time, so whatever gloo (or NCCL) does beyond the wire factor is
in its :math:`\beta`. The GPU presets give :math:`\alpha` as NCCL's own latency model
does (its ``src/graph/tuning.cc``): a base cost plus a cost per hop of the algorithm
(ring: 2(g-1) hops for an all-reduce, g-1 for the others; across nodes the all-reduce
takes NCCL's tree, whose latency grows with log2 of the nodes).

Compute: ``matmul_flops`` is one rank's rate for large products in each dtype, with a
device (or ``cores`` CPU cores shared by the node's ranks, one thread each) to itself.
``compute_efficiency`` is the fraction of that rate a training step's forward and
backward reach (the rest: normalisations, activations, softmax, the framework's own
overhead); ``memory_bandwidth`` prices the optimizers' elementwise passes. ``overlap``
states whether collectives run beside compute (a GPU: NCCL's kernels beside the compute
stream) or take the same cores (a CPU whose ranks fill its cores: gloo's threads
compete with compute, measured on 2 cores with no gain from ``async_op``).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = ["COLLECTIVES", "LinkCost", "Hardware", "HARDWARE", "wire_factor", "calibrate"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter")


def wire_factor(collective: str, group_size: int) -> float:
    """Bytes one rank sends per counted byte of ``collective`` over ``group_size`` ranks (the module docstring)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}, got {collective!r}")
    g = group_size
    if g <= 1:
        return 0.0
    return {"all_reduce": 2 * (g - 1) / g, "broadcast": 1.0, "reduce": 1.0}.get(collective, (g - 1) / g)


def _hops(collective: str, group_size: int) -> int:
    """Ring steps of ``collective`` over ``group_size`` ranks (NCCL's tuning model: nsteps)."""
    g = group_size
    return 2 * (g - 1) if collective == "all_reduce" else g - 1 if g > 1 else 0


@dataclass(frozen=True)
class LinkCost:
    """One collective's cost on one kind of link: ``alpha + alpha_per_hop * hops + beta * wire bytes``.

    ``alpha``: seconds per call (a calibration measures it at its own world size, where
    ``alpha_per_hop`` is 0); ``alpha_per_hop``: seconds per ring step (the GPU presets);
    ``beta``: seconds per byte one rank sends.
    """

    alpha: float
    beta: float
    alpha_per_hop: float = 0.0


@dataclass(frozen=True)
class Hardware:
    """What the time model needs of a machine (the module docstring); build one with :func:`calibrate`, or
    take a preset from :data:`HARDWARE`."""

    name: str
    matmul_flops: Mapping[str, float]  # dtype name ("float32", "bfloat16") -> FLOP/s of one rank
    memory_bandwidth: float  # bytes/s one rank streams through elementwise passes
    collectives: Mapping[str, LinkCost] = field(default_factory=dict)  # within a node (the presets: per hop)
    across_nodes: Mapping[str, LinkCost] = field(default_factory=dict)  # a group spanning nodes; empty: one node
    # calibrate()'s costs by group size: groups of that many ranks, every such group busy at once
    calibrated: Mapping[int, Mapping[str, LinkCost]] = field(default_factory=dict)
    # calibrate()'s measure of the frameworks' own work around their collectives, by group size: "fsdp2 unit"
    # (seconds per unit and micro-batch, seconds per parameter) and each TP style (seconds per module and
    # micro-batch, 0). Absent: a collective's alpha is all its fixed cost (the GPU presets: the host runs ahead).
    host_work: Mapping[int, Mapping[str, tuple[float, float]]] = field(default_factory=dict)
    ranks_per_node: int | None = None  # GPUs per node; None: every rank on one node
    cores: int | None = None  # CPU cores the node's ranks share, one thread each; None: a device per rank
    overlap: bool = False  # collectives run beside compute
    compute_efficiency: float = 1.0
    elementwise_seconds: float = 0.0  # one activation entry through a norm or an add, forward and backward
    nonlinearity_seconds: float = 0.0  # one entry through the MLP's activation function (GELU), fwd and bwd
    calibrated_world_size: int | None = None  # the world size calibrate() ran on
    # calibrate() on a CPU: the part of its alone rate a rank kept, on average, while every rank multiplied at once
    concurrent_share: float | None = None
    source: str = ""

    def rate(self, dtype: str | torch.dtype) -> float:
        """FLOP/s of one rank's large products in ``dtype``, with its device (or a core) to itself."""
        name = str(dtype).removeprefix("torch.")
        if name not in self.matmul_flops:
            raise ValueError(f"{self.name} has no matmul rate for {name}; it has {', '.join(self.matmul_flops)}: "
                             "calibrate() with that dtype, or pass matmul_flops for it")
        return self.matmul_flops[name]

    def share(self, ranks_on_node: int) -> float:
        """The part of its rate a rank gets while ``ranks_on_node`` ranks compute on its node: on a CPU, what
        calibrate() measured for that many ranks, else cores / ranks with more ranks than cores; else 1."""
        if self.cores is None:
            return 1.0
        if self.concurrent_share is not None and ranks_on_node == self.calibrated_world_size:
            return self.concurrent_share
        return min(1.0, self.cores / max(ranks_on_node, 1))

    def collective_seconds(self, collective: str, calls: int, nbytes: float, group_size: int,
                           nodes: int = 1, fixed: float | None = None) -> float:
        """Seconds of ``calls`` calls of ``collective`` moving ``nbytes`` counted bytes in all, each over
        ``group_size`` ranks that span ``nodes`` nodes; ``fixed``: the calls' fixed cost in all, in place of
        ``calls`` alphas (the frameworks' host work, :meth:`framework_seconds`)."""
        if calls == 0 or group_size <= 1:
            return 0.0
        if self.calibrated:
            measured = self.calibrated.get(group_size)
            if measured is None:
                raise ValueError(f"{self.name} was calibrated for groups of {sorted(self.calibrated)} ranks and cannot "
                                 f"price a collective over {group_size}: calibrate() at the world size you predict for")
            cost = measured[collective]
            return (calls * cost.alpha if fixed is None else fixed) + cost.beta * wire_factor(
                collective, group_size) * nbytes
        within = self.collectives.get(collective)
        if within is None:
            raise ValueError(f"{self.name} has no cost for {collective}; it has {', '.join(self.collectives)}")
        if nodes <= 1:
            hops = _hops(collective, group_size)
            return calls * (within.alpha + within.alpha_per_hop * hops) + within.beta * wire_factor(
                collective, group_size) * nbytes
        across = self.across_nodes.get(collective)
        if across is None:
            raise ValueError(f"{self.name} is one node: it has no cost for a collective across {nodes} nodes")
        if collective == "all_reduce":  # NCCL's tree across nodes: 2 log2(nodes) network hops
            inter = 2 * math.ceil(math.log2(nodes))
            intra = 2 * (group_size // nodes - 1)
        else:
            inter = _hops(collective, nodes)
            intra = _hops(collective, group_size) - inter
        latency = across.alpha + within.alpha_per_hop * intra + across.alpha_per_hop * inter
        # The ring's bytes cross the slowest link on their way: the network's.
        return calls * latency + across.beta * wire_factor(collective, group_size) * nbytes


    def framework_seconds(self, work: str, group_size: int, units: float, parameters: float = 0) -> float | None:
        """The host work of ``units`` FSDP2 units carrying ``parameters`` parameters ("fsdp2 unit"), or of
        ``units`` TP-split modules of a style, per micro-batch, collectives' fixed costs included; None where
        calibrate() did not measure it."""
        measured = self.host_work.get(group_size, {}).get(work)
        if measured is None:
            return None
        per_unit, per_parameter = measured
        return units * per_unit + parameters * per_parameter


# -- GPU presets ------------------------------------------------------------------------------------------------
# Compute: 989 TFLOP/s dense bf16 (NVIDIA's H100 SXM and H200 datasheets; float32 matmuls as TF32, 494). Large
# bf16 GEMMs reach about 75% of it (matmul_flops); a training step's forward and backward reach about 55% of that
# (compute_efficiency), i.e. 41% of peak, the model FLOPs utilisation Meta reports for Llama 3's BF16 pre-training
# on H100s (38-43%, "The Llama 3 Herd of Models", 2024, table 4) with its communication included: an assumption,
# stated, that a GPU run should replace with calibrate()'s rates.
# Links: NVLink 4, 900 GB/s per GPU (450 each way); NCCL reaches about 370 GB/s bus bandwidth on a ring (NVIDIA's
# answer in nccl-tests issue #212, and #1455). NDR InfiniBand, 400 Gb/s per GPU: 46-48 GB/s per NIC in nccl-tests
# (NVIDIA's answers in nccl-tests issues #267 and #290); 46 here.
# Latency: NCCL's own model (src/graph/tuning.cc, Simple protocol, which large messages take): base 8.4 us per
# call, 3.4 us per NVLink hop, 14 us per network hop; NCCL's tree all-reduce across nodes. Its LL protocol for
# small messages is faster (base 6.6, 0.6 per NVLink hop); the model keeps the Simple figures throughout.
_NVLINK = LinkCost(alpha=8.4e-6, beta=1 / 370e9, alpha_per_hop=3.4e-6)
_INFINIBAND = LinkCost(alpha=8.4e-6, beta=1 / 46e9, alpha_per_hop=14e-6)
_GPU_SOURCES = ("989 TFLOP/s dense bf16 (NVIDIA datasheets) at 75% for large GEMMs, 55% of that in a step "
                "(Llama 3's 38-43% MFU on H100); NVLink 370 GB/s NCCL bus bandwidth (nccl-tests #212), NDR IB "
                "46 GB/s per GPU (nccl-tests #267, #290); latency from NCCL's tuning.cc (Simple: 8.4 us + 3.4 us "
                "per NVLink hop, 14 us per network hop)")


def _gpu(name: str, memory_bandwidth: float) -> Hardware:
    return Hardware(
        name=name, matmul_flops={"bfloat16": 0.75 * 989e12, "float32": 0.75 * 494e12},
        memory_bandwidth=memory_bandwidth,
        collectives={c: _NVLINK for c in COLLECTIVES}, across_nodes={c: _INFINIBAND for c in COLLECTIVES},
        ranks_per_node=8, overlap=True, compute_efficiency=0.55, source=_GPU_SOURCES,
        # An activation entry through a norm, an activation and an add, forward and backward: about 12 reads and
        # writes of 2 bytes (bf16), memory-bound.
        elementwise_seconds=24 / memory_bandwidth, nonlinearity_seconds=24 / memory_bandwidth,
    )


HARDWARE: dict[str, Hardware] = {
    # HBM3 3.35 TB/s (H100 SXM) and HBM3e 4.8 TB/s (H200), NVIDIA's datasheets; elementwise passes reach ~90%.
    "h100-sxm": _gpu("H100 SXM, 8 per node", 0.9 * 3.35e12),
    "h200": _gpu("H200, 8 per node", 0.9 * 4.8e12),
}


# -- calibrate --------------------------------------------------------------------------------------------------
CALIBRATION_SIZES = (64, 2**20, 2**22)  # counted bytes per call: one latency-bound, then bandwidth-bound
_REPEATS = 7
_CALLS_PER_TIMING = 3
_MATMUL_SIZE = 512  # rates are flat from 256 up on CPUs (measured: 100-103 GFLOP/s float32 from 256^3 to 1024^3)


def calibrate(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), *,
              device: torch.device | str | None = None) -> Hardware:
    """Measure this machine for the time model: each collective alone over message sizes, matmuls alone.

    Call it on every rank of a torchrun job (it is a collective, with the process group's
    timeout), or in one process without a process group (then it has no collective costs
    and predicts one rank). It never runs a training step: each collective is timed
    alone, every rank starting together, the slowest rank's time, the median of a few;
    :math:`\\alpha` and :math:`\\beta` are the least-squares line through the sizes (with the
    wire factor of :func:`wire_factor`). The matmul rates are timed on rank 0 alone while
    the others wait, so that they are one rank's with the cores to itself; on a CPU the
    first dtype's is timed again on every rank at once, and the ranks' average part of it
    is ``concurrent_share``, which the model uses for that many ranks on one node
    (``cores`` / ranks for other counts). Under 30 s on 2 CPU cores and 4 ranks.

    Args:
        dtypes: the dtypes whose matmul rate to measure.
        device: where to measure: the process group's device (CUDA under NCCL), else the CPU.

    Returns:
        A :class:`Hardware` named "calibrated", with ``calibrated_world_size`` the world size.
    """
    grouped = dist.is_available() and dist.is_initialized()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if (
            grouped and dist.get_backend() == "nccl") else torch.device("cpu")
    device = torch.device(device)
    world = dist.get_world_size() if grouped else 1
    rank = dist.get_rank() if grouped else 0
    calibrated, host_work = {}, {}
    for size in (g for g in range(2, world + 1) if world % g == 0) if grouped else ():
        # groups of consecutive ranks (as a TP group, or a shard group of HSDP), all of them busy at once
        mesh = (init_device_mesh(device.type, (world,)) if size == world else
                init_device_mesh(device.type, (world // size, size), mesh_dim_names=("outer", "inner"))["inner"])
        calibrated[size] = {c: _fit(c, device, mesh.get_group()) for c in COLLECTIVES}
        host_work[size] = {"fsdp2 unit": _fsdp2_unit_work(mesh, device), **_tp_module_work(mesh, device)}
    measured = torch.zeros(len(dtypes) + 3, dtype=torch.float64)
    if rank == 0:
        for i, dtype in enumerate(dtypes):
            measured[i] = _matmul_flops(dtype, device)
        measured[-3] = _memory_bandwidth(device)
        measured[-2], measured[-1] = _elementwise_seconds(device)
    if grouped:
        dist.broadcast(measured, src=0)  # the others waited here, idle
    # The cores this process may run on (a container's share), else every core the machine reports.
    cores = None if device.type == "cuda" else (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    concurrent_share = None
    if grouped and cores is not None:
        # Every rank's rate with all of them multiplying at once, averaged over the ranks: ranks that outnumber the
        # cores lose more than cores / ranks to switching between them (and ranks that fill them lose some)
        dist.barrier()
        together = torch.tensor([_matmul_flops(dtypes[0], device)], dtype=torch.float64)
        dist.all_reduce(together)
        concurrent_share = min(1.0, float(together) / world / float(measured[0]))
    return Hardware(
        name="calibrated", matmul_flops={str(d).removeprefix("torch."): float(measured[i]) for i, d in enumerate(dtypes)},
        memory_bandwidth=float(measured[-3]), elementwise_seconds=float(measured[-2]),
        nonlinearity_seconds=float(measured[-1]), calibrated=calibrated, host_work=host_work, cores=cores,
        overlap=device.type == "cuda", calibrated_world_size=world, concurrent_share=concurrent_share,
        source=f"calibrate() on {world} rank(s), {device.type}",
    )


def _fsdp2_unit_work(mesh, device: torch.device) -> tuple[float, float]:
    """(seconds per unit, per parameter) that FSDP2 adds to a micro-batch's forward and backward of one unit under
    no_sync (its gathers for both passes, its hooks, its copies), beyond the same tiny layers unsharded: units of 2
    and 16 parameters of 8 x 8, timed alone."""
    added = {}
    for layers in (1, 8):
        unit, plain = (nn.Sequential(*[nn.Linear(8, 8, device=device) for _ in range(layers)]) for _ in range(2))
        root = nn.Sequential(unit)  # the unit inside a root without parameters of its own, as a model's layers
        fully_shard(unit, mesh=mesh)
        fully_shard(root, mesh=mesh)
        root.set_requires_gradient_sync(False)
        x = torch.randn(4, 8, device=device)
        added[2 * layers] = (_slowest_median(lambda: root(x).sum().backward())
                             - _slowest_median(lambda: plain(x).sum().backward()))
    per_parameter = max((added[16] - added[2]) / 14, 0.0)
    return max(added[2] - 2 * per_parameter, 0.0), per_parameter


def _tp_module_work(mesh, device: torch.device) -> dict[str, tuple[float, float]]:
    """Per TP style, (seconds per module, 0) that DTensor adds to a micro-batch's forward and backward of one
    TP-split 8 x 8 linear (its redistributions and collectives, its dispatch), beyond the same linear plain."""
    size = mesh.size()
    styles = {"colwise": (ColwiseParallel, 8), "colwise, gathered": (lambda: ColwiseParallel(output_layouts=Replicate()), 8),
              "rowwise": (RowwiseParallel, 8 // size), "rowwise, from replicated": (
                  lambda: RowwiseParallel(input_layouts=Replicate()), 8)}
    work = {}
    if 8 % size:
        return work
    plain = nn.Linear(8, 8, device=device)
    x_plain = torch.randn(4, 8, device=device, requires_grad=True)
    alone = _slowest_median(lambda: plain(x_plain).sum().backward())
    for style, (make, width) in styles.items():
        module = nn.Sequential(nn.Linear(8, 8, device=device))
        parallelize_module(module, mesh, {"0": make()})
        x = torch.randn(4, width, device=device, requires_grad=True)
        work[style] = (max(_slowest_median(lambda: module(x).sum().backward()) - alone, 0.0), 0.0)
    return work


def _fit(collective: str, device: torch.device, group) -> LinkCost:
    """alpha and beta of one collective: alpha is the time of the smallest message, beta the least-squares slope
    of the rest of the time against wire bytes over the megabyte messages. (A line fitted through every size
    misses both ends: gloo changes algorithm between them.)"""
    ranks = dist.get_world_size(group)
    times = {size: _slowest_median(_one_call(collective, size, device, group)) for size in CALIBRATION_SIZES}
    smallest, *large = CALIBRATION_SIZES
    alpha = times[smallest]
    xs = [wire_factor(collective, ranks) * size for size in large]
    beta = sum(x * (times[size] - alpha) for x, size in zip(xs, large)) / sum(x * x for x in xs)
    return LinkCost(alpha=alpha, beta=max(beta, 0.0))


def _one_call(collective: str, size: int, device: torch.device, group):
    """A function issuing one ``collective`` of ``size`` counted bytes (float32) over ``group``, as count_comm
    counts it; its root is the group's first rank."""
    ranks = dist.get_world_size(group)
    n = max(ranks, size // 4 // ranks * ranks)  # divisible into the ranks' parts
    whole = torch.zeros(n, device=device)
    part = torch.zeros(n // ranks, device=device)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(whole, group=group)
    if collective == "all_gather":
        return lambda: dist.all_gather_single(whole, part, group=group)
    if collective == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, whole, group=group)
    if collective == "broadcast":
        return lambda: dist.broadcast(whole, group=group, group_src=0)
    if collective == "reduce":
        return lambda: dist.reduce(whole, group=group, group_dst=0)
    parts = [torch.zeros(n // ranks, device=device) for _ in range(ranks)]
    mine = dist.get_group_rank(group, dist.get_rank()) == 0
    if collective == "gather":
        return lambda: dist.gather(part, parts if mine else None, group=group, group_dst=0)
    return lambda: dist.scatter(part, parts if mine else None, group=group, group_src=0)


def _slowest_median(call) -> float:
    """The median over repeats of the slowest rank's time per call, every rank starting together (the groups
    of one size run at once; the slowest rank of the world decides)."""
    call()  # warm-up: buffers, connections
    times = []
    for _ in range(_REPEATS):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(_CALLS_PER_TIMING):
            call()
        elapsed = torch.tensor([(time.perf_counter() - start) / _CALLS_PER_TIMING], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def _matmul_flops(dtype: torch.dtype, device: torch.device) -> float:
    """One rank's rate of a large product in ``dtype``, one thread on a CPU: the median of 5 timings."""
    size = 8192 if device.type == "cuda" else _MATMUL_SIZE
    a = torch.randn(size, size, device=device).to(dtype)
    with _one_thread(device):
        return 2 * size**3 / _median_seconds(lambda: a @ a, device)


def _memory_bandwidth(device: torch.device) -> float:
    """Bytes/s of an out-of-place add over tensors too large for a cache (read two, write one)."""
    a = torch.ones(2**23, device=device)
    with _one_thread(device):
        return 3 * a.numel() * a.element_size() / _median_seconds(lambda: a + a, device)


def _elementwise_seconds(device: torch.device) -> tuple[float, float]:
    """Seconds per entry of a transformer's elementwise ops on an activation (512 tokens x 1024), forward and
    backward through autograd: (a layer norm and a residual add, each entry counted once per op; a GELU)."""
    x = torch.randn(512, 1024, device=device, requires_grad=True)
    gradient = torch.ones_like(x)

    def norm_and_add():  # the output and the input's gradient, both fresh memory, as in a step
        y = torch.nn.functional.layer_norm(x, x.shape[-1:]) + x
        return (y.detach(), *torch.autograd.grad(y, x, gradient))

    def nonlinearity():
        y = torch.nn.functional.gelu(x)
        return (y.detach(), *torch.autograd.grad(y, x, gradient))
    with _one_thread(device):
        return (_median_seconds(norm_and_add, device) / (2 * x.numel()),
                _median_seconds(nonlinearity, device) / x.numel())


@contextlib.contextmanager
def _one_thread(device: torch.device):
    """One thread on a CPU, as each rank runs under torchrun."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _median_seconds(fn, device: torch.device, seconds: float = 0.15) -> float:
    """The median of 5 timings of ``fn`` repeated for ``seconds``. Its results are kept (up to 64 MiB) as a
    training step keeps its activations for the backward: each call writes fresh memory, whose first touch (page
    faults on a CPU) is part of the cost; an allocator reusing one block would hide it (4x for a GELU here)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    kept, held = [], 0
    fn()
    sync()
    samples = []
    for _ in range(5):
        start, count = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            out = fn()
            outs = out if isinstance(out, tuple) else (out,)
            kept.extend(outs)
            held += sum(t.numel() * t.element_size() for t in outs)
            if held > 64 * 2**20:
                kept, held = [], 0
            count += 1
        sync()
        samples.append((time.perf_counter() - start) / count)
    return statistics.median(samples)
