"""dmuon's time model on GPU clusters: GPT-2 small and Llama-2-7B from 8 to 1024 H100s, every layout.

    .venv/bin/python benchmarks/gpu_predictions.py          # markdown, a second (run_all.py includes it)

Predictions, not measurements: the H100 SXM preset of dmuon_edu/dmuon/hardware.py (its
sources there), 8 GPUs per node on NVLink, one 400 Gb/s InfiniBand NIC per GPU; each model
as dmuon.MODELS gives it (sequence 4096, one sequence per GPU per micro-batch, bf16,
activation checkpointing), N = 8 micro-batches per step. HSDP shards within a node (8)
and replicates across nodes (W / 8). Each cell: the step in seconds, and its ratio to the
AdamW step of the same layout.
"""

from __future__ import annotations

import dataclasses

from dmuon_edu import dmuon

WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
MICRO_BATCHES = 8
HARDWARE = "h100-sxm"
# Each layout beside the AdamW step of its own layout.
COLUMNS = {"FSDP2 + AdamW": None, "dmuon Z2": "FSDP2 + AdamW", "dmuon Z3": "FSDP2 + AdamW",
           "HSDP + AdamW": None, "dmuon HSDP Z2": "HSDP + AdamW", "dmuon HSDP Z3": "HSDP + AdamW",
           "DDP + AdamW": None, "DDP + replicated Muon": "DDP + AdamW", "dmuon DDP backend": "DDP + AdamW"}


def layout_at(name: str, world_size: int) -> dmuon.Layout:
    layout = dmuon.LAYOUTS[name]
    if layout.replicas > 1:  # shards within a node, replicas across nodes
        layout = dataclasses.replace(layout, replicas=max(1, world_size // 8))
    return layout


def predictions(model: str) -> dict[int, dict[str, float]]:
    """{world size: {layout: step seconds}}."""
    workload, hardware = dmuon.MODELS[model], dmuon.HARDWARE[HARDWARE]
    return {w: {name: dmuon.predict_step(workload, layout_at(name, w), world_size=w, micro_batches=MICRO_BATCHES,
                                         hardware=hardware).total for name in COLUMNS} for w in WORLD_SIZES}


def table(model: str) -> str:
    steps = predictions(model)
    lines = [f"**{model}**, predicted on {dmuon.HARDWARE[HARDWARE].name}: step seconds (x its layout's AdamW step)", "",
             "| W GPUs | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for w, row in steps.items():
        cells = [f"{row[name]:.2f}" + (f" ({row[name] / row[peer]:.3f}x)" if peer else "") for name, peer in
                 COLUMNS.items()]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def section() -> str:
    return "\n\n".join(["## The time model on GPU clusters (predicted)", __doc__.split("\n\n", 2)[2].strip(),
                        *(table(model) for model in ("gpt2-small", "llama2-7b"))]) + "\n"


if __name__ == "__main__":
    print(section())
