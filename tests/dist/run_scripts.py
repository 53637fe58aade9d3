"""Several exercise scripts in one launch: each one's ``main(ranks)``, writing its results file.

    torchrun --nproc-per-node=2 tests/dist/run_scripts.py RESULTS_DIR SCRIPT.py [SCRIPT.py ...]
    torchrun --nproc-per-node=1 tests/dist/run_scripts.py --stubs SCRIPT.py [SCRIPT.py ...]

A launch costs seconds; the scripts' checks cost less. Each script writes
RESULTS_DIR/<script stem>.json, as it would when run alone with that path.
With ``--stubs`` (learner copies, their exercises not done) rank 0 prints
``RAISED <script stem> <exception type>`` for each: what the grader reads to
report "not attempted" is a NotImplementedError.
"""

import importlib.util
import sys
from pathlib import Path

from dmuon_edu import distributed


def load(path: Path):
    """The script at ``path`` as a fresh module: its functions defined, its ``main`` not run."""
    spec = importlib.util.spec_from_file_location(f"exercise_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_stubs(scripts: list[Path]) -> None:
    with distributed.session() as ranks:
        for script in scripts:
            sys.argv = [str(script)]
            try:
                load(script).main(ranks)
                raised = "nothing"
            except Exception as error:  # the grader's test is the type; anything else is reported as such
                raised = type(error).__name__
            distributed.print0(f"RAISED {script.stem} {raised}")


def main():
    if sys.argv[1] == "--stubs":
        return run_stubs([Path(arg) for arg in sys.argv[2:]])
    results, scripts = Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]]
    with distributed.session() as ranks:
        for script in scripts:
            sys.argv = [str(script), str(results / f"{script.stem}.json")]  # where report() writes
            load(script).main(ranks)
            distributed.barrier()


if __name__ == "__main__":
    main()
