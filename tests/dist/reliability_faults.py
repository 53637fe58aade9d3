"""A fault injected into rank 1 in the middle of dmuon training (tests/test_reliability.py).

    torchrun --nproc-per-node=2 tests/dist/reliability_faults.py raise|silent|silent_in_reduce|silent_ddp STAMP_FILE

- ``raise``: in the second optimizer step, rank 1 raises inside a layer's forward while
  rank 0 goes on into that layer's collectives (FSDP2's all-gather, dmuon's broadcast).
  The job must end quickly, non-zero, and the launcher must name rank 1 and its exception.
- ``silent``: in the second step rank 1 stops answering (it sleeps instead of joining
  that layer's collectives). Rank 0's collective times out after TIMEOUT_S (session(timeout_s=...))
  and the launcher says so, naming the silent rank.
- ``silent_in_reduce``: the same in the second step's backward, after the reduces of the
  later layers are issued: rank 0 waits in a reduce (gloo often reports another of its
  waits, "Application timeout caused pair closure"), and the launcher names rank 1.
- ``silent_ddp``: ``silent`` on the DDP backend (dedicate_params_ddp and replicate), where
  no broadcast precedes a forward: rank 0 runs on into the backward's reduces and
  all-reduces, and waits there.

Just before the fault rank 1 writes time.time() to STAMP_FILE, so that the test can
measure how long the job takes to end after the fault (not counting start-up).
"""

import sys
import time
from pathlib import Path

from torch.distributed.device_mesh import init_device_mesh

from dmuon_edu import distributed
from dmuon_edu.dmuon import order
from reliability_resume import MICRO, build, train_step

# session()'s collective timeout, waited out once by each silent fault (tests/test_reliability.py asserts that it
# ended the job). Its honest waits come before any rank is warm: init_process_group's connection (each rank waits for
# the other to finish importing torch: up to 0.9 s apart with the load average at 5 on 2 cores) and step 0's first
# collectives (after each rank's first-time work, FSDP2's lazy init among it). 3 s was tried: one launch in four failed
# before its fault (rank 1 never got to it) with the load average at 7, so 5 s stays.
TIMEOUT_S = 5
FAULT_STEP = 1


def main():
    fault, stamp = sys.argv[1], Path(sys.argv[2])
    # A rank whose wait in one of dmuon's own collectives times out (silent_ddp: rank 0 in the backward's all-reduce)
    # then waits up to order.LOG_WAIT_S (15 s) for the other ranks' logs of their recent collectives, to name where
    # they diverged. A rank that stopped answering never sends its log, so that wait only adds to the job's time: the
    # same path runs with a short one. (Set here, not on import: the test imports this module for TIMEOUT_S.)
    order.LOG_WAIT_S = 1
    with distributed.session(timeout_s=TIMEOUT_S) as ranks:
        mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
        model, opt, sched = build(mesh, ddp=fault == "silent_ddp")
        state = {"step": 0}

        def inject(module, args):
            if ranks.rank == 1 and state["step"] == FAULT_STEP:
                stamp.write_text(repr(time.time()))
                if fault == "raise":
                    raise ValueError("injected failure on rank 1 in the middle of step 1")
                time.sleep(600)  # stops answering: never reaches the collectives rank 0 waits in

        if fault == "silent_in_reduce":
            backwards = []

            def in_the_reducing_backward(_):  # the step's last micro-batch, outside no_sync
                backwards.append(state["step"])
                if backwards.count(state["step"]) == MICRO:
                    inject(None, None)

            # The first layer's matrix: its gradient is among the backward's last, after the later layers' reduces.
            model.layers[0].down_proj.weight.register_post_accumulate_grad_hook(in_the_reducing_backward)
        else:
            model.layers[1].register_forward_pre_hook(inject, prepend=True)  # before FSDP2's and dmuon's hooks
        for step in range(3):
            state["step"] = step
            train_step(model, opt, sched, step)
            distributed.print0(f"step {step} done")


if __name__ == "__main__":
    main()
