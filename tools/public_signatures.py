"""Write tests/public_signatures.json: the public dmuon's signatures, read from its source.

    python tools/public_signatures.py /path/to/a/checkout/of/X-Square-Robot/dmuon

For each public name that dmuon_edu.dmuon also has, the parameters of the function (or of
the class's ``__init__``) in order, each with its kind ("positional" or "keyword") and its
default as source text (None when it has none), read with ``ast`` from the checkout's
HEAD, whose commit the file records. tests/test_public_api.py compares dmuon_edu's
signatures with this table; run this script again to move to a newer public commit.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

# public name -> (file in the public repository, function, or "Class.__init__")
PUBLIC = {
    "dedicate_params": ("dmuon/api.py", "dedicate_params"),
    "dedicate_params_ddp": ("dmuon/api.py", "dedicate_params_ddp"),
    "dedicate_params_ddp_tp": ("dmuon/api.py", "dedicate_params_ddp_tp"),
    "replicate": ("dmuon/_backends/ddp/replicate.py", "replicate"),
    "replicate_tp": ("dmuon/_backends/ddp/replicate.py", "replicate_tp"),
    "Muon": ("dmuon/optim/muon.py", "Muon.__init__"),
    "NewtonSchulz": ("dmuon/optim/newton_schulz.py", "NewtonSchulz.__init__"),
    "newton_schulz": ("dmuon/optim/newton_schulz.py", "newton_schulz"),
    "gram_newton_schulz": ("dmuon/optim/newton_schulz.py", "gram_newton_schulz"),
    "get_ns_backend": ("dmuon/optim/syrk_dispatch.py", "get_ns_backend"),
    "get_backend_status": ("dmuon/optim/syrk_dispatch.py", "get_backend_status"),
    "clip_grad_norm_": ("dmuon/grad_clip.py", "clip_grad_norm_"),
    "get_model_state_dict": ("dmuon/checkpoint.py", "get_model_state_dict"),
    "set_model_state_dict": ("dmuon/checkpoint.py", "set_model_state_dict"),
    "get_optimizer_state_dict": ("dmuon/checkpoint.py", "get_optimizer_state_dict"),
    "set_optimizer_state_dict": ("dmuon/checkpoint.py", "set_optimizer_state_dict"),
    "no_sync": ("dmuon/utils.py", "no_sync"),
    "get_dedicated_params": ("dmuon/utils.py", "get_dedicated_params"),
    "get_owned_params": ("dmuon/utils.py", "get_owned_params"),
    "summarize_comm_plan": ("dmuon/diagnostics.py", "summarize_comm_plan"),
    "summarize_param_groups": ("dmuon/diagnostics.py", "summarize_param_groups"),
}
OUT = Path(__file__).resolve().parent.parent / "tests" / "public_signatures.json"


def signature(source: str, qualified: str) -> list[list]:
    """[[name, kind, default source or None], ...] of ``qualified`` ("f" or "Class.__init__") in ``source``."""
    node = ast.parse(source)
    for part in qualified.split("."):
        node = next(child for child in node.body
                    if isinstance(child, (ast.FunctionDef, ast.ClassDef)) and child.name == part)
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    rows = [[a.arg, "positional", d] for a, d in zip(positional, defaults) if a.arg != "self"]
    rows += [[a.arg, "keyword", None if d is None else ast.unparse(d)] for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return rows


def main(checkout: Path) -> None:
    git = lambda *command: subprocess.run(["git", "-C", str(checkout), *command], check=True, capture_output=True,
                                          text=True).stdout
    commit = git("rev-parse", "HEAD").strip()
    table = {name: signature(git("show", f"HEAD:{path}"), function) for name, (path, function) in PUBLIC.items()}
    OUT.write_text(json.dumps({"repository": "X-Square-Robot/dmuon", "commit": commit,
                               "read_by": "tools/public_signatures.py", "signatures": table}, indent=1) + "\n")
    print(f"wrote {OUT} from {commit}: {len(table)} signatures")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
