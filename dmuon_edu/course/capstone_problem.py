"""The capstone's problem: its text, the floor of its loss, its GPT, and the n-gram tables it is measured against.

The text is a copy task with noise. Each token repeats the token three before it with
probability ``copy``; otherwise it follows a first-order Markov chain from the previous
token. So the next token depends on the last three, a Markov source of order 3::

    P(next = j | a, b, c) = copy * [j == a] + (1 - copy) * Q[c, j]

where (a, b, c) are the last three tokens, oldest first, and Q is a random V x V chain.
An n-gram table sees the last n - 1 tokens: a trigram sees (b, c) and never the token
that is copied, so every table up to the trigram stays far above the floor, and only
a model that looks three tokens back reaches it. A GPT has to learn where to look.

Both the course's checks and the capstone's runs (``capstone.py``, ``capstone_sweep.py``)
import this module; it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmuon_edu.arguments import require_int
from dmuon_edu.course.data import MarkovSource, context_numbers
from dmuon_edu.course.gpt import GPT, GPTConfig

__all__ = ["Capstone", "NGRAMS", "ngram_loss"]

# The n-gram ladder the capstone's losses stand beside: n - 1 tokens of context each.
NGRAMS = {1: "unigram", 2: "bigram", 3: "trigram", 4: "4-gram"}


@dataclass(frozen=True)
class Capstone:
    """Every setting of the capstone run; the defaults fit about a minute of a 2-core CPU in all."""

    vocab_size: int = 4
    order: int = 3  # the copied token is three back: no table up to the trigram sees it
    copy: float = 0.7  # how often the next token repeats the one `order` back
    sharpness: float = 2.5  # of the random chain Q followed otherwise
    source_seed: int = 0  # the chain and the held-out text: the same for every run
    seq_len: int = 32
    d_model: int = 32
    n_layer: int = 2
    n_head: int = 2
    steps: int = 120
    # Two micro-batches per step: under torchrun on CPU each micro-batch costs tens of
    # milliseconds of FSDP2 and gloo overhead, far more than its arithmetic.
    accum_steps: int = 2
    global_microbatch: int = 16  # sequences, split over the ranks
    eval_sequences: int = 1024
    muon_lr: float = 0.02
    # Muon's update scale, given to Muon and dmuon alike (their defaults differ): Keller Jordan's sqrt(max(1, m/n)).
    muon_scale: str = "original"
    adamw_lr: float = 1e-2  # AdamW alone, and AdamW's share of Muon and dmuon (embeddings, norms, biases, head)
    seed: int = 0  # the model's initialisation and the training text

    def source(self) -> MarkovSource:
        """The text's source: ``transition[a, ..., c, j] = copy * [j == a] + (1 - copy) * Q[c, j]``."""
        vocab, k = self.vocab_size, self.order
        chain = MarkovSource.random(vocab, seed=self.source_seed, sharpness=self.sharpness).transition
        copied = torch.eye(vocab, dtype=torch.float64).reshape(vocab, *(1,) * (k - 1), vocab)  # j == a, the oldest
        followed = chain.reshape(*(1,) * (k - 1), vocab, vocab)  # Q[c, j], c the newest
        return MarkovSource((self.copy * copied + (1 - self.copy) * followed).expand((vocab,) * (k + 1)).contiguous())

    def floor(self) -> float:
        """The lowest mean loss any model can reach on sequences of seq_len predictions, nats per token.

        The mean of :meth:`MarkovSource.position_floors`: the entropy rate, except for the
        first ``order - 1`` predictions, which have not yet seen a whole context.
        """
        return float(self.source().position_floors(self.seq_len).mean())

    def model(self) -> GPT:
        """The same freshly initialised GPT on every call and every rank."""
        torch.manual_seed(self.seed)
        return GPT(GPTConfig(vocab_size=self.vocab_size, block_size=self.seq_len, n_layer=self.n_layer,
                             n_head=self.n_head, d_model=self.d_model))

    def microbatches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every global micro-batch of the run, in order: ``steps * accum_steps`` (inputs, targets) pairs.

        Each optimizer step's text has its own generator, so a shorter run trains on the
        first micro-batches of a longer one (the sweep's test re-runs a prefix of a stored run).
        """
        source = self.source()
        steps = [source.sample(self.accum_steps * self.global_microbatch, self.seq_len + 1,
                               torch.Generator().manual_seed(_STEP_SEEDS * self.seed + step))
                 for step in range(self.steps)]
        return [(chunk[:, :-1], chunk[:, 1:]) for chunk in torch.cat(steps).split(self.global_microbatch)]

    def held_out(self) -> torch.Tensor:
        """(eval_sequences, seq_len + 1) tokens no run trains on, the same for every seed."""
        return self.source().sample(self.eval_sequences, self.seq_len + 1,
                                    torch.Generator().manual_seed(_HELD_OUT_SEED + self.source_seed))


# Optimizer step i of seed s draws its text with generator seed s * _STEP_SEEDS + i, and the held-out
# text with _HELD_OUT_SEED + source_seed: far enough apart that no two runs share a generator.
_STEP_SEEDS = 1_000_000
_HELD_OUT_SEED = 999_999_000


def ngram_loss(n: int, microbatches, tokens: torch.Tensor, vocab_size: int) -> float:
    """Held-out loss on ``tokens`` of the n-gram table counted on the training text, nats per prediction.

    Prediction t of a sequence (of token t + 1) looks up the last min(t + 1, n - 1)
    tokens: the first predictions of a sequence have seen fewer, and each context length
    has its own table, counted over the training positions that use it. Add-one
    smoothing keeps every probability above zero; with hundreds of counts per context it
    moves the loss by a few thousandths of a nat at most.

    Args:
        n: 1 for a unigram (token frequencies), 2 for a bigram, 3 for a trigram, ...
        microbatches: the training text, (inputs, targets) pairs of (B, seq_len) as
            :meth:`Capstone.microbatches` gives them.
        tokens: (sequences, seq_len + 1) held-out text.
        vocab_size: V; token ids are 0 ... V - 1.
    """
    require_int("n", n, minimum=1, hint="1 for a unigram, 2 for a bigram, 3 for a trigram")
    training = torch.cat([torch.cat([inputs[:, :1], targets], dim=1) for inputs, targets in microbatches])
    predictions = tokens.shape[1] - 1
    total, count = 0.0, 0
    for length in range(n):
        positions = torch.tensor([t for t in range(predictions) if min(t + 1, n - 1) == length], dtype=torch.long)
        if positions.numel() == 0:
            continue
        table = torch.ones(vocab_size**length, vocab_size, dtype=torch.float64)
        contexts, following = _contexts_and_next(training, positions, length, vocab_size)
        table.index_put_((contexts, following), torch.ones(contexts.numel(), dtype=torch.float64), accumulate=True)
        table /= table.sum(dim=1, keepdim=True)
        contexts, following = _contexts_and_next(tokens, positions, length, vocab_size)
        total -= table[contexts, following].log().sum().item()
        count += contexts.numel()
    return total / count


def _contexts_and_next(sequences: torch.Tensor, positions: torch.Tensor, length: int, vocab: int):
    """For every sequence and prediction in ``positions``: the number of its last ``length`` tokens, and the next token."""
    window = positions.unsqueeze(1) + torch.arange(1 - length, 1)  # (P, length): the tokens each prediction has seen
    return context_numbers(sequences[:, window], vocab).flatten(), sequences[:, positions + 1].flatten()
