"""Token data the course generates itself: a seeded Markov source, and padded batches.

A first-order Markov chain over a vocabulary of V tokens has a known
entropy rate,

    H = sum_i pi_i * H(P[i, :])       (nats per token; pi is the stationary distribution),

the lowest average next-token loss any model can reach on its text. The
course uses it as the floor a training curve approaches. Nothing is
downloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dmuon_edu.accumulation import IGNORE_INDEX

__all__ = ["MarkovSource", "lm_batch"]


@dataclass(frozen=True)
class MarkovSource:
    """A first-order Markov chain; ``transition[i, j]`` = P(next = j | current = i).

    Raises:
        TypeError: ``transition`` is not a floating-point tensor.
        ValueError: it is not a square V x V matrix with V >= 2, or a row is not a
            probability distribution (an entry NaN, infinite or negative, or a row sum
            other than 1).
    """

    transition: torch.Tensor

    def __post_init__(self) -> None:
        p = self.transition
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            got = p.dtype if isinstance(p, torch.Tensor) else type(p).__name__
            raise TypeError(
                f"transition must be a floating-point tensor, got {got}; "
                "build it with torch.softmax(logits, dim=1), or use MarkovSource.random"
            )
        if p.dim() != 2 or p.shape[0] != p.shape[1] or p.shape[0] < 2:
            raise ValueError(f"transition must be a square V x V matrix with V >= 2, got shape {tuple(p.shape)}")
        bad = ~(p.isfinite() & (p >= 0)).all(dim=1)
        if bad.any():
            row = int(bad.nonzero()[0])
            raise ValueError(
                f"row {row} of transition holds a NaN, infinite or negative entry: {p[row].tolist()}; "
                "every row must be a probability distribution"
            )
        # Each entry and each step of the sum rounds by at most eps / 2, so a row that is
        # a distribution up to rounding sums to 1 within V * eps.
        off = (p.sum(dim=1) - 1).abs()
        if off.max() > p.shape[1] * torch.finfo(p.dtype).eps:
            row = int(off.argmax())
            raise ValueError(
                f"row {row} of transition sums to {float(p[row].sum())}, not 1: every row must be a "
                "probability distribution; divide each row by its sum"
            )

    @classmethod
    def random(cls, vocab_size: int, seed: int = 0, sharpness: float = 2.0) -> MarkovSource:
        """A random chain; larger ``sharpness`` makes next tokens more predictable (lower entropy)."""
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
        if not 0 <= sharpness < math.inf:  # infinite logits would make NaN rows
            raise ValueError(f"sharpness must be >= 0 and finite, got {sharpness}; 2.0 is the default")
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
    counts it. A sequence of length L gives L - 1 predictions. Token ids must be
    >= 0: a negative one (such as IGNORE_INDEX itself) would be taken for padding.
    """
    if not isinstance(sequences, (list, tuple)) or any(
        not isinstance(s, torch.Tensor) or s.is_floating_point() or s.is_complex() for s in sequences
    ):
        raise TypeError("lm_batch needs a list of 1-D integer token tensors, e.g. list(source.sample(...))")
    if not sequences or any(s.dim() != 1 or len(s) < 2 for s in sequences):
        raise ValueError("lm_batch needs a non-empty list of 1-D token tensors, each at least 2 tokens long")
    for index, s in enumerate(sequences):
        if (s < 0).any():
            raise ValueError(
                f"sequence {index} holds the negative token id {int(s.min())}; token ids must be >= 0 "
                f"(as targets, a negative id such as {IGNORE_INDEX} would be dropped from the loss as padding)"
            )
    width = max(len(s) for s in sequences) - 1
    inputs = torch.zeros(len(sequences), width, dtype=torch.long)
    targets = torch.full((len(sequences), width), IGNORE_INDEX, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        inputs[row, : len(sequence) - 1] = sequence[:-1]
        targets[row, : len(sequence) - 1] = sequence[1:]
    return inputs, targets
