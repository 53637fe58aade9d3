"""Checks for module 7: which of the GPT's parameters Muon steps."""

from __future__ import annotations

from collections.abc import Callable

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


EXERCISES: dict[str, Callable[[Callable], tuple[str, str]]] = {
    "is_hidden_matrix": _check_hidden_matrix_predicate,
}
