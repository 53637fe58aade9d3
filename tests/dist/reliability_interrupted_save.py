"""A checkpoint.save that the test kills half-way (tests/test_reliability.py).

    python tests/dist/reliability_interrupted_save.py PATH before_marker|during_write

Saves a model's and an optimizer's state to PATH with dmuon_edu.checkpoint.save, in one
process, and stops at the named point, printing ``STOPPED <point>``, so that the test
can SIGKILL it there: ``before_marker`` after torch.distributed.checkpoint wrote every
file (data and .metadata), just before the completion marker; ``during_write`` after
the first tensor of the data file.
"""

import os
import sys
import time
import warnings

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from dmuon_edu import checkpoint


def stop_here(point):
    print(f"STOPPED {point}", flush=True)
    time.sleep(600)


def main():
    path, point = sys.argv[1], sys.argv[2]
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
    if point == "before_marker":
        os.replace = lambda *args: stop_here(point)
    else:
        write_item = dcp_filesystem._write_item

        def first_item_then_stop(*args, **kwargs):
            result = write_item(*args, **kwargs)
            stop_here(point)
            return result

        dcp_filesystem._write_item = first_item_then_stop
    torch.manual_seed(1)  # other values than the good checkpoint's
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    checkpoint.save({"model": get_model_state_dict(model)}, path)


if __name__ == "__main__":
    main()
