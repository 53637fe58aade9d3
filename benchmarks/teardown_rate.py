"""How often does a torchrun job end badly after its work is done? Launch a script many times and count.

    .venv/bin/python benchmarks/teardown_rate.py --runs 50 --nproc 4
    .venv/bin/python benchmarks/teardown_rate.py --runs 50 --code /path/to/an/older/checkout
    .venv/bin/python benchmarks/teardown_rate.py --runs 50 --nproc 4 --ending public

Each launch runs tests/dist/atexit_after_session.py (FSDP2 and dmuon training under
distributed.session(), with an atexit handler per rank; ``--ending public`` ends it as torch's examples do, with
``destroy_process_group()`` after a full state dict) and is counted as clean only
if torchrun returns 0 and every rank's atexit handler ran. ``--code`` puts another
checkout's dmuon_edu first on the ranks' PYTHONPATH, to measure an older ending the
same way. Not part of `make bench`: 50 launches take 5 to 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
from pathlib import Path

from dmuon_edu.launch import RankFailedError, torchrun

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "dist" / "atexit_after_session.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--code", type=Path, help="a checkout whose dmuon_edu the ranks import instead")
    parser.add_argument("--ending", choices=("session", "public"), default="session")
    args = parser.parse_args()
    env = {"PYTHONPATH": str(args.code.resolve())} if args.code else None
    outcomes = collections.Counter()
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as out:
            try:
                torchrun(SCRIPT, nproc=args.nproc, args=[out, args.ending], env=env, echo=False, timeout=300)
            except RankFailedError as failure:
                outcomes[f"rank failed: {failure.exception[:80]}"] += 1
                continue
            handlers = len(os.listdir(out))
            outcomes["clean" if handlers == args.nproc else f"exit 0, atexit ran on {handlers} of {args.nproc}"] += 1
        print(f"run {run + 1}: {dict(outcomes)}", flush=True)
    print(f"{args.runs} launches of {args.nproc} ranks, ending {args.ending}: {dict(outcomes)}")


if __name__ == "__main__":
    main()
