"""``python -m dmuon_edu.dmuon``: a training step's predicted seconds, layout by layout (step_time.py).

    python -m dmuon_edu.dmuon --model llama2-7b --world-size 64 --hardware h100-sxm
    python -m dmuon_edu.dmuon --shapes my_model.json --world-size 8 --micro-batches 4 --layouts "dmuon Z3" "FSDP2 + AdamW"
    torchrun --nproc-per-node=2 -m dmuon_edu.dmuon --model gpt2-small --hardware calibrate   # this machine

docs/dmuon.md lists the options and shows the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from .hardware import HARDWARE, calibrate
from .step_time import LAYOUTS, MODELS, Workload, predict_step

DEFAULT_LAYOUTS = ["FSDP2 + AdamW", "dmuon Z2", "dmuon Z3", "DDP + AdamW", "DDP + replicated Muon", "dmuon DDP backend"]
ADAMW_OF = {"fsdp2": "FSDP2 + AdamW", "ddp": "DDP + AdamW"}


def _workload(args) -> Workload:
    if args.shapes is None:
        workload = MODELS[args.model]
    else:
        try:
            spec = json.loads(Path(args.shapes).read_text())
            workload = Workload({name: tuple(shape) for name, shape in spec["shapes"].items()},
                                frozenset(spec["dedicated"]), int(spec["tokens"]),
                                frozenset(spec.get("lookups", ())), float(spec.get("attention_flops_per_token", 0)),
                                float(spec.get("activation_entries_per_token", 0)),
                                float(spec.get("nonlinearity_entries_per_token", 0)), dtype=spec.get("dtype", "bfloat16"),
                                activation_checkpointing=bool(spec.get("activation_checkpointing", False)))
        except (OSError, ValueError, KeyError, TypeError) as error:
            sys.exit(f"--shapes {args.shapes}: {error}. The file is JSON: {{\"shapes\": {{name: [m, n], ...}}, "
                     "\"dedicated\": [names of the Muon matrices], \"tokens\": tokens per micro-batch per rank}, "
                     "optionally \"lookups\", \"attention_flops_per_token\", \"activation_entries_per_token\", "
                     "\"nonlinearity_entries_per_token\", "
                     "\"dtype\", \"activation_checkpointing\"")
    if args.tokens is not None:
        workload = dataclasses.replace(workload, tokens=args.tokens)
    return workload


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dmuon_edu.dmuon", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", choices=sorted(MODELS), default="gpt2-small", help="a model preset (shapes, tokens)")
    which.add_argument("--shapes", help="a JSON file: {shapes: {name: [m, n]}, dedicated: [...], tokens: N}")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: the torchrun job's, else 8)")
    parser.add_argument("--micro-batches", type=int, default=8, help="N, the first N-1 under no_sync (default 8)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch per rank (default: the preset's)")
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, metavar="LAYOUT",
                        help=f"of: {', '.join(LAYOUTS)} (default: the 1-D ones)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="HSDP's replicas (default: one per node on a GPU preset, shards within a node; else 2)")
    parser.add_argument("--hardware", default="h100-sxm", help=f"{', '.join(HARDWARE)}, or calibrate (under torchrun)")
    parser.add_argument("--ns-dtype", default="bfloat16", help="Newton-Schulz's dtype (default bfloat16)")
    parser.add_argument("--ns-backend", choices=("gram", "direct"), default="gram")
    args = parser.parse_args(argv)
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {unknown[0]!r}; the layouts are: {', '.join(LAYOUTS)}")
    workload = _workload(args)
    if args.hardware == "calibrate":
        hardware, printing = _calibrated()
        world = args.world_size or hardware.calibrated_world_size
    elif args.hardware in HARDWARE:
        hardware, printing, world = HARDWARE[args.hardware], True, args.world_size or 8
    else:
        parser.error(f"unknown hardware {args.hardware!r}; use one of {', '.join(HARDWARE)}, or calibrate")
    rows = {}
    for name in args.layouts:
        layout = LAYOUTS[name]
        if layout.replicas > 1:
            per_node = hardware.ranks_per_node
            replicas = args.replicas or (max(1, world // per_node) if per_node else layout.replicas)
            layout = dataclasses.replace(layout, replicas=replicas)
        try:
            rows[name] = predict_step(workload, layout, world_size=world, micro_batches=args.micro_batches,
                                      hardware=hardware, ns_dtype=args.ns_dtype, ns_backend=args.ns_backend)
        except ValueError as error:
            parser.error(f"{name}: {error}")
    if printing:
        print(_report(rows, workload, world, args, hardware))
    return 0


def _calibrated():
    import torch.distributed as dist

    from dmuon_edu import distributed

    if "RANK" not in os.environ:
        return calibrate(), True
    with distributed.session() as ranks:
        hardware = calibrate()
        dist.barrier()
    return hardware, ranks.rank == 0


def _report(rows, workload, world, args, hardware) -> str:
    phases = list(dict.fromkeys(phase for step in rows.values() for phase in step.phases))
    header = ["layout", "step (ms)", "vs its AdamW", "NS balance", *(f"{p} (ms)" for p in phases)]
    lines = [f"{hardware.name}: {world} ranks, {args.micro_batches} micro-batches of {workload.tokens} tokens per rank, "
             f"{sum(map(math.prod, workload.shapes.values())) / 1e6:.0f}M parameters "
             f"({sum(math.prod(workload.shapes[n]) for n in workload.dedicated) / 1e6:.0f}M in Muon's matrices); "
             f"collectives {'beside' if hardware.overlap else 'added to'} compute. Phases at full cost; the step "
             "hides what overlaps.", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, step in rows.items():
        peer = ADAMW_OF[LAYOUTS[name].sharding]
        if LAYOUTS[name].replicas > 1:
            peer = "HSDP + AdamW"
        elif LAYOUTS[name].tp > 1:
            peer = {"fsdp2": "FSDP2 + TP + AdamW", "ddp": "DDP + TP + AdamW"}[LAYOUTS[name].sharding]
        ratio = f"{step.total / rows[peer].total:.3f}" if peer in rows else "-"
        lines.append(f"| {name} | {step.total * 1e3:.1f} | {ratio} | {step.ns_balance:.2f} | "
                     + " | ".join(f"{step.phases.get(p, 0.0) * 1e3:.1f}" for p in phases) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
