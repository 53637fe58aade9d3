"""Several exercise scripts in one launch: each one's ``main(ranks)``, writing its results file.

    torchrun --nproc-per-node=2 tests/dist/run_scripts.py RESULTS_DIR SCRIPT.py [SCRIPT.py ...]

A launch costs seconds; the scripts' checks cost less. Each script writes
RESULTS_DIR/<script stem>.json, as it would when run alone with that path.
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


def main():
    results, scripts = Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]]
    with distributed.session() as ranks:
        for script in scripts:
            sys.argv = [str(script), str(results / f"{script.stem}.json")]  # where report() writes
            load(script).main(ranks)
            distributed.barrier()


if __name__ == "__main__":
    main()
