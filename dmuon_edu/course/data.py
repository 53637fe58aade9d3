"""Token data the course generates itself: a seeded Markov source, and padded batches.

A Markov chain of order k over a vocabulary of V tokens draws each token from a
distribution that depends on the k tokens before it, its *context*. Its entropy rate,

    H = sum_c pi_c * H(P[c, :])       (nats per token; pi: how often each context occurs),

is the lowest average next-token loss any model can reach once it has seen k tokens.
Order 1 (module 3) needs only the previous token; the capstone's source has order 3, so no
table of fewer than three tokens of context reaches its floor. Everything here is computed
from the transition table by linear algebra, never by sampling. Nothing is downloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dmuon_edu.accumulation import IGNORE_INDEX
from dmuon_edu.arguments import require_int

__all__ = ["MarkovSource", "entropy", "context_numbers", "lm_batch"]

# MarkovSource.random's largest table: 2**27 float64 probabilities, 1 GiB (100,000 tokens of order 1 asked for 80 GB).
_MAX_TRANSITION_ENTRIES = 2 ** 27


def entropy(distributions: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each distribution along the last dimension (0 log 0 = 0)."""
    return -(distributions * torch.log(distributions.clamp_min(1e-300))).sum(dim=-1)


@dataclass(frozen=True)
class MarkovSource:
    """A Markov chain of order k: ``transition[a_1, ..., a_k, j]`` = P(next = j | the last k tokens a_1 ... a_k).

    ``transition`` has k + 1 dimensions of size V: a V x V matrix is a first-order chain.
    A context (a_1, ..., a_k) is numbered in base V, a_1 most significant, so that
    ``rows()[c]`` is its next-token distribution.

    Raises:
        TypeError: ``transition`` is not a floating-point tensor.
        ValueError: it is not a square V x V matrix (or V x ... x V), V >= 2, or a row is
            not a probability distribution (an entry NaN, infinite or negative, or a row
            sum other than 1).
    """

    transition: torch.Tensor

    def __post_init__(self) -> None:
        p = self.transition
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            got = p.dtype if isinstance(p, torch.Tensor) else type(p).__name__
            raise TypeError(
                f"transition must be a floating-point tensor, got {got}; "
                "build it with torch.softmax(logits, dim=-1), or use MarkovSource.random"
            )
        if p.dim() < 2 or p.shape[0] < 2 or any(size != p.shape[0] for size in p.shape):
            raise ValueError(f"transition must be a square V x V matrix with V >= 2 (or V x ... x V for a "
                             f"higher order), got shape {tuple(p.shape)}")
        rows = self.rows()
        bad = ~(rows.isfinite() & (rows >= 0)).all(dim=1)
        if bad.any():
            row = int(bad.nonzero()[0])
            raise ValueError(
                f"row {row} of transition holds a NaN, infinite or negative entry: {rows[row].tolist()}; "
                "every row must be a probability distribution"
            )
        # Each entry and each step of the sum rounds by at most eps / 2, so a row that is
        # a distribution up to rounding sums to 1 within V * eps.
        off = (rows.sum(dim=1) - 1).abs()
        if off.max() > rows.shape[1] * torch.finfo(p.dtype).eps:
            row = int(off.argmax())
            raise ValueError(
                f"row {row} of transition sums to {float(rows[row].sum())}, not 1: every row must be a "
                "probability distribution; divide each row by its sum"
            )

    @classmethod
    def random(cls, vocab_size: int, seed: int = 0, sharpness: float = 2.0, order: int = 1) -> MarkovSource:
        """A random chain; larger ``sharpness`` makes next tokens more predictable (lower entropy)."""
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
        if not isinstance(order, int) or order < 1:
            raise ValueError(f"order must be an int >= 1, got {order!r}")
        if not 0 <= sharpness < math.inf:  # infinite logits would make NaN rows
            raise ValueError(f"sharpness must be >= 0 and finite, got {sharpness}; 2.0 is the default")
        require_int("seed", seed, hint="the random number generator's seed, e.g. 0")
        entries = vocab_size ** (order + 1)
        if entries > _MAX_TRANSITION_ENTRIES:
            raise ValueError(
                f"a chain of order {order} over {vocab_size} tokens has vocab_size ** (order + 1) = {entries:,} "
                f"transition probabilities ({entries * 8 / 1e9:,.1f} GB in float64), beyond the "
                f"{_MAX_TRANSITION_ENTRIES:,} this course's sources hold: lower vocab_size or order (the course's "
                "chains have at most a few hundred tokens)")
        generator = torch.Generator().manual_seed(seed)
        logits = sharpness * torch.randn((vocab_size,) * (order + 1), generator=generator, dtype=torch.float64)
        return cls(torch.softmax(logits, dim=-1))

    @property
    def vocab_size(self) -> int:
        return self.transition.shape[0]

    @property
    def order(self) -> int:
        return self.transition.dim() - 1

    def rows(self) -> torch.Tensor:
        """(V^k, V): the next-token distribution of each context."""
        return self.transition.reshape(-1, self.vocab_size)

    def context_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """The number of the context ending at each position of ``tokens`` (..., T): (..., T - k + 1)."""
        return context_numbers(tokens.unfold(-1, self.order, 1), self.vocab_size)

    def stationary(self) -> torch.Tensor:
        """(V^k,): the long-run frequency pi of each context (for order 1, of each token): pi M = pi.

        M is the chain on contexts: (a_1, ..., a_k) moves to (a_2, ..., a_k, j) with
        probability P(j | a_1 ... a_k); pi is its left eigenvector for eigenvalue 1.
        """
        vocab, contexts = self.vocab_size, self.vocab_size**self.order
        following = (torch.arange(contexts) % (contexts // vocab)) * vocab  # drop a_1, shift left, append j
        moves = torch.zeros(contexts, contexts, dtype=self.transition.dtype)
        moves[torch.arange(contexts).unsqueeze(1), following.unsqueeze(1) + torch.arange(vocab)] = self.rows()
        eigenvalues, eigenvectors = torch.linalg.eig(moves.T)
        pi = eigenvectors[:, torch.argmin((eigenvalues - 1).abs())].real
        return pi / pi.sum()

    def entropy_rate(self) -> float:
        """Nats per token: the loss floor of a next-token model that has seen at least k tokens."""
        return float(self.stationary() @ entropy(self.rows()))

    def leading_joints(self) -> list[torch.Tensor]:
        """The stationary joint distribution of a sequence's first t + 1 tokens, for t = 0 ... k - 1.

        A sequence starts with a context drawn from pi, so its first t + 1 tokens follow
        pi's marginal over the first t + 1 coordinates: a (V^t, V) table, row = the first t
        tokens (in base V), column = token t.
        """
        k, vocab = self.order, self.vocab_size
        pi = self.stationary().reshape((vocab,) * k)
        # (sum over an empty tuple of dimensions would sum them all)
        return [(pi.sum(dim=tuple(range(t + 1, k))) if t + 1 < k else pi).reshape(-1, vocab) for t in range(k)]

    def position_floors(self, seq_len: int) -> torch.Tensor:
        """(seq_len,): the lowest expected loss of each prediction in a sequence of seq_len + 1 tokens, nats.

        Prediction t (of token t + 1, having seen t + 1 tokens) can use the whole row only
        once it has seen k tokens; before that it can do no better than the conditional
        entropy H(X_{t+1} | X_0 ... X_t) = H(X_0 ... X_{t+1}) - H(X_0 ... X_t).
        """
        joints = [entropy(joint.flatten()) for joint in self.leading_joints()]
        early = [joints[t + 1] - joints[t] for t in range(min(self.order - 1, seq_len))]
        return torch.tensor(early + [self.entropy_rate()] * (seq_len - len(early)), dtype=torch.float64)

    def next_token_distributions(self, inputs: torch.Tensor) -> torch.Tensor:
        """(B, T, V): the true distribution of each next token given every input token up to it."""
        k = self.order
        out = torch.empty(*inputs.shape, self.vocab_size, dtype=self.transition.dtype)
        out[:, k - 1:] = self.rows()[self.context_index(inputs)]
        joints = self.leading_joints()
        for t in range(min(k - 1, inputs.shape[1])):  # fewer than k tokens seen: the conditional of pi's leading tokens
            joint = joints[t + 1][context_numbers(inputs[:, : t + 1], self.vocab_size)]
            out[:, t] = joint / joint.sum(dim=-1, keepdim=True)
        return out

    def sample(self, num_sequences: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """(num_sequences, length) token ids, each sequence's first k tokens drawn from the stationary distribution."""
        for name, value in (("num_sequences", num_sequences), ("length", length)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        k, vocab = self.order, self.vocab_size
        tokens = torch.empty(num_sequences, max(length, k), dtype=torch.long)
        start = self.stationary().clamp_min(0).expand(num_sequences, -1)
        context = torch.multinomial(start, 1, generator=generator).squeeze(1)
        for i in range(k):
            tokens[:, i] = context // vocab ** (k - 1 - i) % vocab
        rows = self.rows()
        for t in range(k, length):
            tokens[:, t] = torch.multinomial(rows[context], 1, generator=generator).squeeze(1)
            context = context % vocab ** (k - 1) * vocab + tokens[:, t]  # drop the oldest token, append the new one
        return tokens[:, :length]


def context_numbers(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The tokens along the last dimension read as one number in base ``vocab``, the first most significant.

    A context (a_1, ..., a_k) is numbered as :meth:`MarkovSource.rows` numbers it; an
    empty last dimension is the one empty context, 0.
    """
    powers = vocab ** torch.arange(tokens.shape[-1] - 1, -1, -1, device=tokens.device)
    return (tokens * powers).sum(dim=-1)


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
