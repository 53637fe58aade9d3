"""Where a benchmark ran: the facts every benchmark prints beside its numbers.

A CPU's speed in bf16 depends on whether it multiplies bf16 natively: on a 2-core AVX2
CPU a 512 x 512 bf16 product ran 50x slower than in float32, on one with AVX512-BF16
twice as fast. So every table says which CPU kernels torch ran (its CPU capability),
which bf16 flags the CPU has, the bf16 and float32 matmul rates measured now, and the
Newton-Schulz dtype that ``dtype="auto"`` chose. Under the environment variables that
make torch run other kernels (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS) or that override the Newton-Schulz dtype, the line says
"emulated": those are this machine's speeds with fewer instructions, not another
machine's.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch

from dmuon_edu.newton_schulz import NS_DTYPE_ENV, cpu_bf16_flags, fast_dtype

EMULATION_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", NS_DTYPE_ENV)
# A CPU without native bf16 (AVX2 only), as `make test`'s emulated stage runs it: torch's AVX2 kernels, and the
# Newton-Schulz dtype such a CPU's dtype="auto" takes.
EMULATED_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", NS_DTYPE_ENV: "float32"}
MATMUL_SIZE = 512


def matmul_gflops(dtype: torch.dtype, size: int = MATMUL_SIZE) -> float:
    """One thread's rate for a size x size product in ``dtype``, the median of 5 timings of at least 0.2 s."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a @ b
        rates = []
        for _ in range(5):
            start, count = time.perf_counter(), 0
            while time.perf_counter() - start < 0.2:
                a @ b
                count += 1
            rates.append(2 * size**3 * count / (time.perf_counter() - start) / 1e9)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(rates)


def emulation() -> str:
    """The kernel- or dtype-changing environment variables that are set, or "" for none."""
    return ", ".join(f"{name}={os.environ[name]}" for name in EMULATION_VARIABLES if name in os.environ)


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def describe() -> str:
    """One sentence: the machine, its kernels and bf16 support, the matmul rates now, and the NS dtype chosen."""
    gpu = f", GPU: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    flags = ", ".join(sorted(cpu_bf16_flags())) or "none"
    emulated = emulation()
    return (f"{os.cpu_count()}-core {platform.machine()} CPU ({cpu_model()}){gpu}, torch {torch.__version__}, "
            f"Python {platform.python_version()}; CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"bf16 flags: {flags}; {MATMUL_SIZE}x{MATMUL_SIZE} matmul on 1 thread: "
            f"float32 {matmul_gflops(torch.float32):.1f}, bf16 {matmul_gflops(torch.bfloat16):.1f} GFLOP/s; "
            f'Newton-Schulz dtype="auto" chose {str(fast_dtype("cpu"))[6:]} on the CPU'
            + (f"; EMULATED ({emulated}): this machine's speed with other kernels, not another machine's"
               if emulated else ""))
