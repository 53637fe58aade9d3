"""Checks for module 7: which of the GPT's parameters Muon steps, and the floor of the capstone's text."""

from __future__ import annotations

import math
from collections.abc import Callable

from dmuon_edu.course.data import MarkovSource, entropy
from dmuon_edu.course.gpt import GPT, GPTConfig, is_hidden_matrix


def _check_hidden_matrix_predicate(candidate: Callable) -> tuple[str, str]:
    model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=2, n_head=2, d_model=8))
    named = list(model.named_parameters())
    expected = {name for name, p in named if is_hidden_matrix(name, p)}
    got = {name for name, p in named if candidate(name, p)}
    if got == expected:
        return "PASS", f"the {len(expected)} attention and MLP matrices go to Muon; embeddings, head, norms and biases to AdamW"
    extra, missing = sorted(got - expected), sorted(expected - got)
    params = dict(named)
    if any(params[name].ndim != 2 for name in extra):
        one_d = next(name for name in extra if params[name].ndim != 2)
        return "FAIL", f"{one_d} is {params[one_d].ndim}-D: Muon orthogonalises matrices only; add `p.ndim == 2`"
    if any("embedding" in name for name in extra):
        return "FAIL", ("you selected an embedding table: a token picks one of its rows, it is a lookup, not a "
                        "feature-to-feature map; keep tok_embedding and pos_embedding on AdamW")
    if "lm_head.weight" in extra:
        return "FAIL", ("you selected lm_head.weight: it maps features to token scores, and every peer keeps the "
                        "output head on AdamW; select only the *_proj matrices")
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return "FAIL", f"{missing[0]}{more} is a hidden matrix but was not selected: every *_proj weight is one"
    return "FAIL", f"{extra[0]} should not be selected"


def _floor_terms(source: MarkovSource) -> dict[str, float]:
    """The entropies a floor of a second-order source is built from, nats."""
    pi = source.stationary()
    first_token, first_two = (entropy(joint.flatten()).item() for joint in source.leading_joints()[:1] + [pi])
    row_entropies = entropy(source.rows())
    return {"rate": (pi @ row_entropies).item(), "uniform_rate": row_entropies.mean().item(),
            "first": first_two - first_token, "no_context": first_token}


# Each known mistake: what it computes from the terms above for seq_len T, and what it misses.
_MISTAKES: dict[str, tuple[Callable[[dict, int], float], str]] = {
    "rate_only": (lambda h, T: h["rate"],
                  "you returned the entropy rate: the first prediction has seen one token only, so it cannot know "
                  "which row applies; its floor is H(X_1 | X_0), and the floor is the mean over the T predictions"),
    "uniform_contexts": (lambda h, T: (h["first"] + (T - 1) * h["uniform_rate"]) / T,
                         "you weighted every context equally: weight each row's entropy by how often its context "
                         "occurs, source.stationary()"),
    "uniform_rate_only": (lambda h, T: h["uniform_rate"],
                          "you averaged the rows' entropies with equal weights and left out the first prediction: "
                          "weight each row by source.stationary(), and the first prediction has only X_0 to go on"),
    "first_without_context": (lambda h, T: (h["no_context"] + (T - 1) * h["rate"]) / T,
                              "your first prediction has no context at all, H(X_1): it has seen X_0, so its floor "
                              "is H(X_1 | X_0) = H(X_0, X_1) - H(X_0)"),
    "bigram_everywhere": (lambda h, T: h["first"],
                          "you returned H(X_1 | X_0) for every prediction: that is a bigram's floor; from the "
                          "second prediction on the model has seen two tokens, and the floor is the entropy rate"),
    "seq_len_plus_one": (lambda h, T: (h["first"] + T * h["rate"]) / (T + 1),
                         "you averaged over seq_len + 1 predictions: sequences of seq_len + 1 tokens give seq_len "
                         "predictions (inputs tokens[:-1], targets tokens[1:])"),
}


def _check_loss_floor(candidate: Callable) -> tuple[str, str]:
    # Imported here: the capstone imports the course's data-parallel helpers, which import the checks.
    from dmuon_edu.course.capstone import Capstone

    settings = Capstone()
    # The capstone's own source, and a smaller one with other numbers, so that no mistake matches both by chance.
    cases = [(settings.source(), settings.seq_len), (MarkovSource.random(3, seed=7, sharpness=1.0, order=2), 5)]
    right = [float(source.position_floors(T).mean()) for source, T in cases]
    got = [float(candidate(source, T)) for source, T in cases]
    # float64 sums of at most a few hundred terms agree to ~1e-15; any exact formula lands within 1e-9.
    if all(math.isclose(g, r, rel_tol=1e-9) for g, r in zip(got, right)):
        return "PASS", f"the floor of {settings.seq_len} predictions on the capstone's text is {right[0]:.3f} nats"
    terms = [_floor_terms(source) for source, _ in cases]
    wrong = {name: [formula(h, T) for h, (_, T) in zip(terms, cases)] for name, (formula, _) in _MISTAKES.items()}
    wrong["bits"] = [r / math.log(2) for r in right]
    hints = {name: hint for name, (_, hint) in _MISTAKES.items()}
    hints["bits"] = "you computed in bits: the loss is in nats, use the natural log (torch.log)"
    for name, values in wrong.items():
        if all(math.isclose(g, w, rel_tol=1e-9) for g, w in zip(got, values)):
            return "FAIL", f"{hints[name]} (off by {abs(got[0] - right[0]):.3f} nats on the capstone's text)"
    return "FAIL", (f"your floor on the capstone's text is {got[0]:.4f} nats, {got[0] - right[0]:+.4f} from the true "
                    "one: weight each context's row entropy by its stationary frequency, and remember that the "
                    "first prediction has seen one token")


EXERCISES: dict[str, Callable[[Callable], tuple[str, str]]] = {
    "is_hidden_matrix": _check_hidden_matrix_predicate,
    "loss_floor": _check_loss_floor,
}
