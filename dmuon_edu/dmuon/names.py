"""Parameter names as checkpoints know them: fully qualified names without wrapper prefixes.

Wrapping a module inserts a segment into the names of its parameters:
``checkpoint_wrapper`` (activation checkpointing) adds ``_checkpoint_wrapped_module``,
``torch.compile`` of a submodule ``_orig_mod``:

    layers.0._checkpoint_wrapped_module.attn.q_proj.weight  ->  layers.0.attn.q_proj.weight
    layers.0._orig_mod.attn.q_proj.weight                    ->  layers.0.attn.q_proj.weight

A checkpoint keyed by raw names could only be loaded into a model wrapped the same
way. torch.distributed.checkpoint's state dicts drop both segments; dmuon's do too, in
the model's state dict and in the optimizer's, so a checkpoint saved with the wrappers
resumes into the model without them, and the reverse.
"""

from __future__ import annotations

__all__ = ["fqn", "WRAPPER_SEGMENTS"]

WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


def fqn(name: str) -> str:
    """``name`` without the segments that wrappers insert (see the module docstring)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)
