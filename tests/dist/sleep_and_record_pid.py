"""Every rank writes "<its pid> <its parent's pid>" to DIR/rank-<RANK>, then sleeps.

    torchrun --nproc-per-node=2 tests/dist/sleep_and_record_pid.py DIR

Its parent is torchrun: tests/test_data_parallel.py kills torchrun, or interrupts the
launch, and checks that no rank is left. No process group: the ranks start quickly.
"""

import os
import sys
import time
from pathlib import Path

directory, rank = Path(sys.argv[1]), os.environ["RANK"]
partial = directory / f".rank-{rank}"
partial.write_text(f"{os.getpid()} {os.getppid()}")
os.replace(partial, directory / f"rank-{rank}")  # the test polls for it: whole, or not there
time.sleep(600)
