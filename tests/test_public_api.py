"""dmuon_edu.dmuon's signatures against the public dmuon's, read from its source (tests/public_signatures.json,
written by tools/public_signatures.py with the commit it read).

For each public name we have: the public parameters we lack are exactly those docs/dmuon.md lists as absent; the
ones we share come in the public order, each public positional one at its public place while every one before it
is shared (so a positional call of the public project means the same here); their defaults are the public ones,
but for the differences listed here, each with where docs/dmuon.md says why. Our own parameters may follow.
"""

import ast
import inspect
import json
from pathlib import Path

import pytest

from dmuon_edu import dmuon

TABLE = json.loads((Path(__file__).parent / "public_signatures.json").read_text())
SIGNATURES = TABLE["signatures"]

# Public parameters dmuon_edu does not take (docs/dmuon.md, "other arguments of ..." rows: CUDA tuning and
# ablation knobs of the public implementation).
_OWNER_KNOBS = {"assignment_group_key_fn", "max_owners_per_group", "owner_strategy", "owner_cost_model",
                "pack_small_params", "process_group_policy"}
ABSENT = {
    "dedicate_params": _OWNER_KNOBS | {"route_hint_fn", "hsdp_column_balance", "tp_buffer_reuse",
                                       "replicate_broadcast_bucket_mb", "muon_forward_unshard",
                                       "delay_stage2_to_optimizer"},
    "dedicate_params_ddp": _OWNER_KNOBS,
    "dedicate_params_ddp_tp": _OWNER_KNOBS | {"tp_buffer_reuse"},
    "Muon": {"record_step_profile", "group_prepare_ahead", "tp_distributed_gram", "tp_distributed_gram_policy",
             "tp_distributed_gram_max_factor_to_scatter_ratio", "post_step_prefetch_groups",
             "post_step_prefetch_sharded_adamw", "sharded_adamw_unshard_separate_stream", "first_step_progress_log",
             "first_step_progress_log_limit"},
}
# Public defaults that differ here, and why. The state dicts' cpu_offload and rank0_only are None, which means the
# public True for a full state dict: None leaves the choice to the StateDictOptions argument of torch's checkpoint
# flow when it is given (docs/dmuon.md, "Checkpoints and faults").
DIFFERENT_DEFAULTS = {name: {"cpu_offload", "rank0_only"} for name in ("get_model_state_dict", "get_optimizer_state_dict")}


def ours(name):
    target = getattr(dmuon, name)
    return inspect.signature(target.__init__ if inspect.isclass(target) else target).parameters


def default_of(text):
    try:
        return ast.literal_eval(text)
    except ValueError:
        return text


def test_the_table_is_the_public_projects_at_a_commit():
    assert TABLE["repository"] == "X-Square-Robot/dmuon" and len(TABLE["commit"]) == 40, TABLE["commit"]
    assert len(SIGNATURES) >= 20 and all(hasattr(dmuon, name) for name in SIGNATURES), sorted(SIGNATURES)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_the_signature_is_the_public_ones_but_for_what_the_docs_list(name):
    public = SIGNATURES[name]
    mine = {n: p for n, p in ours(name).items() if n != "self"}
    public_names = [n for n, _, _ in public]
    assert set(public_names) - set(mine) == ABSENT.get(name, set()), (name, sorted(set(public_names) - set(mine)))
    shared = [n for n in public_names if n in mine]
    assert [n for n in mine if n in shared] == shared, (name, list(mine))
    positional = [n for n, p in mine.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for index, (n, kind, _) in enumerate(public):
        if kind == "positional" and all(m in mine for m in public_names[:index + 1]):
            assert positional[index:index + 1] == [n], (name, n, positional)
        if kind == "keyword" and n in mine:
            assert mine[n].kind is not inspect.Parameter.POSITIONAL_ONLY, (name, n)
    for n, _, default in public:
        if n in mine and n not in DIFFERENT_DEFAULTS.get(name, {}):
            expected = inspect.Parameter.empty if default is None else default_of(default)
            assert mine[n].default == expected, (name, n, mine[n].default, default)
