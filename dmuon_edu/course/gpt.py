"""A small GPT, after nanoGPT: token and position embeddings, pre-norm blocks, a linear head.

    model = GPT(GPTConfig(vocab_size=16, block_size=32))
    out = model(inputs, targets)        # out.logits (B, T, V), out.loss (mean over tokens)

The names follow the accumulation guide's conventions, so that its predicate selects exactly the
hidden matrices: every feature-to-feature matrix is a ``*_proj`` (``attn.qkv_proj``,
``attn.out_proj``, ``mlp.up_proj``, ``mlp.down_proj``), the blocks sit in
``model.layers``, and the embeddings and ``lm_head`` (tokens to and from features)
have other names and stay with AdamW. The head is not tied to the token embedding:
a tied weight would be both a Muon matrix's neighbour and an AdamW parameter, and
FSDP2 and dmuon would each need to be told about the sharing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dmuon_edu.accumulation import IGNORE_INDEX

__all__ = ["GPTConfig", "GPT", "LMOutput", "is_hidden_matrix", "EncoderLM"]


def is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    """The accumulation guide's predicate: the GPT's feature-to-feature matrices, the ones Muon (and dmuon) step."""
    return "proj" in name and p.ndim == 2


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 16
    block_size: int = 32  # the longest context; position embeddings exist up to here
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")


class LMOutput(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor | None  # mean cross-entropy over non-padding targets; None without targets


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv_proj = nn.Linear(config.d_model, 3 * config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv_proj(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # position t sees 0..t only
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.d_model, 4 * config.d_model)
        self.down_proj = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_embedding = nn.Embedding(config.block_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> LMOutput:
        """``idx``: (B, T) token ids, T <= block_size; ``targets``: the next tokens, IGNORE_INDEX for padding."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"a sequence of {T} tokens is longer than block_size={self.config.block_size}; "
                             "cut it, or build the GPT with a larger block_size")
        x = self.tok_embedding(idx) + self.pos_embedding(torch.arange(T, device=idx.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)
        return LMOutput(logits, loss)


def _init_weights(module: nn.Module) -> None:
    # nanoGPT's initialisation: small normal weights, zero biases.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class EncoderLM(nn.Module):
    """A language model built from torch's ``nn.TransformerEncoderLayer``: its names follow torch's conventions
    (``self_attn.in_proj_weight``, ``linear1``, ``norm1``, ``embed``, ``head``), not the accumulation guide's, so a
    predicate that picks Muon's matrices by the ``*_proj`` naming fails on it (module 7's exercise)."""

    def __init__(self, vocab_size: int = 8, d_model: int = 8, n_layer: int = 2, n_head: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_head, dim_feedforward=4 * d_model, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        return self.head(self.encoder(self.embed(idx), mask=mask, is_causal=True))
