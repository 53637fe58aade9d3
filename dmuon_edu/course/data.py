"""Token data the course generates itself: a seeded Markov source, and padded batches.

A first-order Markov chain over a vocabulary of V tokens has a known
entropy rate,

    H = sum_i pi_i * H(P[i, :])       (nats per token; pi is the stationary distribution),

the lowest average next-token loss any model can reach on its text. The
course uses it as the floor a training curve approaches. Nothing is
downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmuon_edu.accumulation import IGNORE_INDEX

__all__ = ["MarkovSource", "lm_batch"]


@dataclass(frozen=True)
class MarkovSource:
    """A first-order Markov chain; ``transition[i, j]`` = P(next = j | current = i)."""

    transition: torch.Tensor

    @classmethod
    def random(cls, vocab_size: int, seed: int = 0, sharpness: float = 2.0) -> MarkovSource:
        """A random chain; larger ``sharpness`` makes next tokens more predictable (lower entropy)."""
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
        if not sharpness >= 0:
            raise ValueError(f"sharpness must be >= 0, got {sharpness}")
        generator = torch.Generator().manual_seed(seed)
        logits = sharpness * torch.randn(vocab_size, vocab_size, generator=generator, dtype=torch.float64)
        return cls(torch.softmax(logits, dim=1))

    @property
    def vocab_size(self) -> int:
        return self.transition.shape[0]

    def stationary(self) -> torch.Tensor:
        """The distribution pi with pi P = pi (the left eigenvector for eigenvalue 1)."""
        eigenvalues, eigenvectors = torch.linalg.eig(self.transition.T)
        pi = eigenvectors[:, torch.argmin((eigenvalues - 1).abs())].real
        return pi / pi.sum()

    def entropy_rate(self) -> float:
        """Nats per token: the loss floor of a next-token model on this source."""
        p = self.transition
        row_entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(dim=1)
        return float(self.stationary() @ row_entropy)

    def sample(self, num_sequences: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """(num_sequences, length) token ids, each sequence started from the stationary distribution."""
        for name, value in (("num_sequences", num_sequences), ("length", length)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        tokens = torch.empty(num_sequences, length, dtype=torch.long)
        start = self.stationary().clamp_min(0).expand(num_sequences, -1)
        tokens[:, 0] = torch.multinomial(start, 1, generator=generator).squeeze(1)
        for t in range(1, length):
            tokens[:, t] = torch.multinomial(self.transition[tokens[:, t - 1]], 1, generator=generator).squeeze(1)
        return tokens


def lm_batch(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token ``(inputs, targets)`` for sequences of different lengths, right-padded.

    ``inputs`` is (B, T) with padding token 0; ``targets`` is the input shifted
    by one, with every padded position set to ``IGNORE_INDEX`` so that no loss
    counts it. A sequence of length L gives L - 1 predictions.
    """
    if not isinstance(sequences, (list, tuple)) or any(
        not isinstance(s, torch.Tensor) or s.is_floating_point() or s.is_complex() for s in sequences
    ):
        raise TypeError("lm_batch needs a list of 1-D integer token tensors, e.g. list(source.sample(...))")
    if not sequences or any(s.dim() != 1 or len(s) < 2 for s in sequences):
        raise ValueError("lm_batch needs a non-empty list of 1-D token tensors, each at least 2 tokens long")
    width = max(len(s) for s in sequences) - 1
    inputs = torch.zeros(len(sequences), width, dtype=torch.long)
    targets = torch.full((len(sequences), width), IGNORE_INDEX, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        inputs[row, : len(sequence) - 1] = sequence[:-1]
        targets[row, : len(sequence) - 1] = sequence[1:]
    return inputs, targets
