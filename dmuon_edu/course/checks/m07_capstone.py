"""Checks for module 7: which parameters Muon steps, in the GPT and in a torch-built model, and the floor of the
capstone's text."""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn

from dmuon_edu.course.capstone_problem import Capstone
from dmuon_edu.course.data import MarkovSource, entropy
from dmuon_edu.course.gpt import GPT, EncoderLM, GPTConfig, is_hidden_matrix


# The feature-to-feature matrices of each model the predicate is tried on, by role: what Muon should step.
_TORCH_NAMED_MATRICES = ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight")


def _hidden_matrices(model) -> set[str]:
    if isinstance(model, GPT):
        return {name for name, p in model.named_parameters() if is_hidden_matrix(name, p)}
    return {name for name, _ in model.named_parameters() if name.endswith(_TORCH_NAMED_MATRICES)}


def _check_hidden_matrix_predicate(candidate: Callable) -> tuple[str, str]:
    if candidate is is_hidden_matrix:
        return "FAIL", "that is the package's own is_hidden_matrix: decide for yourself which parameters Muon steps"
    for model in (GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=2, n_head=2, d_model=8)), EncoderLM()):
        verdict = _predicate_verdict(candidate, model)
        if verdict is not None:
            return "FAIL", f"on {type(model).__name__}: {verdict}"
    return "PASS", ("on both models the attention and MLP matrices go to Muon; embeddings, head, norms and biases "
                    "to AdamW")


def _predicate_verdict(candidate: Callable, model) -> str | None:
    named = list(model.named_parameters())
    expected = _hidden_matrices(model)
    got = {name for name, p in named if candidate(name, p)}
    if got == expected:
        return None
    extra, missing = sorted(got - expected), sorted(expected - got)
    params = dict(named)
    if any(params[name].ndim != 2 for name in extra):
        one_d = next(name for name in extra if params[name].ndim != 2)
        return f"{one_d} is {params[one_d].ndim}-D: Muon orthogonalises matrices only"
    lookup = next((name for name in extra if isinstance(model.get_submodule(name.rpartition(".")[0]), nn.Embedding)),
                  None)
    if lookup is not None:
        return (f"you selected {lookup}, an embedding table: a token picks one of its rows, a lookup, not a "
                "feature-to-feature map; it stays on AdamW")
    head = "lm_head.weight" if isinstance(model, GPT) else "head.weight"
    if head in extra:
        return (f"you selected {head}: it maps features to token scores, and every peer keeps the output head on "
                "AdamW")
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return (f"{missing[0]}{more} is a hidden matrix (it maps features to features) but was not selected: "
                "decide by what a parameter does, not by one model's names")
    return f"{extra[0]} should not be selected"


def _floor_terms(source: MarkovSource, seq_len: int) -> dict:
    """The entropies a floor of an order-k source is built from, nats, for sequences of seq_len predictions."""
    joints = [entropy(joint.flatten()).item() for joint in source.leading_joints()]  # H(X_0 ... X_t), t < k
    row_entropies = entropy(source.rows())
    return {"rate": (source.stationary() @ row_entropies).item(), "uniform_rate": row_entropies.mean().item(),
            "early": [joints[t + 1] - joints[t] for t in range(min(source.order - 1, seq_len))],
            "no_context": joints[0]}


def _mean(early: list[float], rate: float, predictions: int) -> float:
    return (sum(early) + (predictions - len(early)) * rate) / predictions


# Each known mistake: what it computes from the terms above for seq_len T, and what it misses.
_MISTAKES: dict[str, tuple[Callable[[dict, int], float], str]] = {
    "rate_only": (lambda h, T: h["rate"],
                  "you returned the entropy rate for every prediction: the first k - 1 (k = source.order) have not "
                  "seen a whole context, so each can do no better than H(X_t+1 | X_0 ... X_t)"),
    "uniform_contexts": (lambda h, T: _mean(h["early"], h["uniform_rate"], T),
                         "you weighted every context's row equally: weight each row's entropy by how often its "
                         "context occurs, source.stationary()"),
    "uniform_rate_only": (lambda h, T: h["uniform_rate"],
                          "you averaged the rows' entropies with equal weights, for every prediction: weight them by "
                          "source.stationary(), and give the first k - 1 predictions only what they have seen"),
    "early_without_context": (lambda h, T: _mean([h["no_context"]] * len(h["early"]), h["rate"], T),
                              "your first k - 1 predictions use no context at all, H(X_1): prediction t has seen "
                              "X_0 ... X_t, so its floor is H(X_0 ... X_t+1) - H(X_0 ... X_t)"),
    "only_the_first_early": (lambda h, T: _mean(h["early"][:1], h["rate"], T),
                             "only your first prediction lacks a whole context, as in an order-2 source: with k = 3 "
                             "the second has seen two tokens of three, and its floor is H(X_2 | X_0, X_1)"),
    "bigram_everywhere": (lambda h, T: h["early"][0],
                          "you returned H(X_1 | X_0), a bigram's floor, for every prediction: from prediction k - 1 "
                          "on the model has seen k tokens, and the floor is the entropy rate"),
    "seq_len_plus_one": (lambda h, T: _mean(h["early"], h["rate"], T + 1),
                         "you averaged over seq_len + 1 predictions: a sequence of seq_len + 1 tokens gives seq_len "
                         "of them (inputs tokens[:-1], targets tokens[1:])"),
    "bits": (lambda h, T: _mean(h["early"], h["rate"], T) / math.log(2),
             "you computed in bits: the loss is in nats, so use the natural log (torch.log)"),
}


class _ShortcutTaken(RuntimeError):
    """A learner's loss_floor called what the exercise asks it to derive."""


class _SourceWithoutShortcuts(MarkovSource):
    """The source the check hands to loss_floor: the floor and the leading joints are the exercise, not a call."""

    def position_floors(self, seq_len: int):
        raise _ShortcutTaken("you called source.position_floors, which is the answer: derive the floor from "
                             "source.stationary() and source.rows()")

    def leading_joints(self):
        raise _ShortcutTaken("you called source.leading_joints, half of the derivation: marginalise "
                             "source.stationary() over the later tokens yourself")


def _check_loss_floor(candidate: Callable) -> tuple[str, str]:
    settings = Capstone()
    # The capstone's own source, and a smaller one with other numbers, so that no mistake matches both by chance.
    cases = [(settings.source(), settings.seq_len), (MarkovSource.random(3, seed=7, sharpness=1.0, order=3), 5)]
    right = [float(source.position_floors(T).mean()) for source, T in cases]
    try:
        got = [float(candidate(_SourceWithoutShortcuts(source.transition), T)) for source, T in cases]
    except _ShortcutTaken as shortcut:
        return "FAIL", str(shortcut)
    # float64 sums of at most a few hundred terms agree to ~1e-15; any exact formula lands within 1e-9.
    if all(math.isclose(g, r, rel_tol=1e-9) for g, r in zip(got, right)):
        return "PASS", f"the floor of {settings.seq_len} predictions on the capstone's text is {right[0]:.3f} nats"
    terms = [_floor_terms(source, T) for source, T in cases]
    for formula, hint in _MISTAKES.values():
        if all(math.isclose(g, formula(h, T), rel_tol=1e-9) for g, h, (_, T) in zip(got, terms, cases)):
            return "FAIL", f"{hint} (off by {abs(got[0] - right[0]):.3f} nats on the capstone's text)"
    return "FAIL", (f"your floor on the capstone's text is {got[0]:.4f} nats, {got[0] - right[0]:+.4f} from the true "
                    "one: weight each row's entropy by source.stationary(), and work out what each of the first "
                    "k - 1 predictions has seen")


EXERCISES: dict[str, Callable[[Callable], tuple[str, str]]] = {
    "is_hidden_matrix": _check_hidden_matrix_predicate,
    "loss_floor": _check_loss_floor,
}
