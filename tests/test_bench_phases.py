"""benchmarks/phases.py, the self-time accounting behind bench_step's table of where a step's time goes and its
floors: time goes to the innermost phase running, never to two phases at once. A clock that the test moves by
hand makes it exact, with no timing of this machine."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from phases import PHASES, Phases  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_nested_phase_takes_its_own_time_out_of_the_phase_around_it():
    clock = Clock()
    phases = Phases(clock)
    with phases.phase("backward"):
        clock.now += 3.0
        with phases.phase("reduce waits"):
            clock.now += 2.0
            with phases.phase("order check"):
                clock.now += 0.5
            clock.now += 1.0
        clock.now += 4.0
    clock.now += 10.0  # outside every phase: nobody's
    assert phases.spent["backward"] == 7.0 and phases.spent["reduce waits"] == 3.0, phases.spent
    assert phases.spent["order check"] == 0.5 and sum(phases.spent.values()) == 10.5, phases.spent


def test_wrapped_functions_and_context_managers_are_phases_and_reset_clears_every_phase():
    import contextlib

    clock = Clock()
    phases = Phases(clock)

    class Work:
        @staticmethod
        def hook(seconds):
            clock.now += seconds
            return "done"

        @staticmethod
        @contextlib.contextmanager
        def waiting(seconds):
            clock.now += seconds
            yield

    phases.wrap(Work, "hook", "dmuon's hooks and copies")
    phases.wrap_context(Work, "waiting", lambda seconds: "broadcast waits" if seconds > 1 else "reduce waits")
    with phases.phase("forward"):
        assert Work.hook(0.25) == "done"
        with Work.waiting(2.0):
            pass
        with Work.waiting(0.5):
            clock.now += 0.25  # the body of the with-block is the wait's too
    assert phases.spent["dmuon's hooks and copies"] == 0.25 and phases.spent["forward"] == 0.0, phases.spent
    assert phases.spent["broadcast waits"] == 2.0 and phases.spent["reduce waits"] == 0.75, phases.spent
    phases.reset()
    assert phases.spent == dict.fromkeys(PHASES, 0.0)


def test_an_unknown_phase_is_refused():
    with pytest.raises(KeyError):
        with Phases(Clock()).phase("lunch"):
            pass


@pytest.mark.parametrize("description, phase", [
    ("the optimizer step's all-reduce of its finite-gradients flag", "step all-reduce"),
    ("the TP gather of layers.0.attn.qkv_proj.weight's gradient to TP rank 0 (98304 values each)", "TP gather + scatter"),
    ("the TP scatter of layers.0.attn.qkv_proj.weight's update from TP rank 0 (98304 values each)",
     "TP gather + scatter"),
    ("the post-step broadcast of 8 matrices from rank 0 (786432 values)", "broadcast waits"),
    ("the broadcast of layers.1's matrices from rank 1 (65536 values of torch.float32)", "broadcast waits"),
    ("the reduce of layers.3's gradients to rank 1 (4 matrices, 393216 values of torch.float32)", "reduce waits"),
])
def test_each_wait_counts_in_the_phase_of_its_collective(description, phase):
    # a TP owner's gathers and scatters are the floor's TP term: their waits must not count as reduce waits
    from phases import _wait_phase
    assert _wait_phase(None, 0, description) == phase
