"""The torchrun script exercises grade by effect: every known wrong answer FAILs, naming its mistake.

One launch (tests/dist/script_mutations.py) feeds every wrong variant to its script's
check on 2 ranks. The right answers PASS in tests/test_data_parallel.py and
tests/test_module6.py, which run the solution scripts.
"""

import json
from pathlib import Path

import pytest

from dmuon_edu.course import grading, notebooks
from dmuon_edu.launch import torchrun

pytestmark = pytest.mark.torchrun

DIST = Path(__file__).parent / "dist"

# variant -> the words its hint must contain (the mistake, and its measured cost)
EXPECTED = {
    "all_reduce_per_parameter": ["all_reduce made 6 calls", "6x the messages", "one flat buffer"],
    "sum_not_divided": ["the averaged gradient is 2x the full-batch gradient", "divide by the world size once"],
    "not_averaged": ["all_reduce moved 0 bytes", "not the average of the ranks' gradients"],
    "forward_outside_no_sync": ["4x the traffic", "decides in the forward"],
    "no_no_sync": ["moved 1138752 bytes in 4 calls", "4x the traffic"],
    "step_inside_no_sync": ["parameters left the baseline", "moved 0 bytes"],
    "fsdp2_syncs_every_micro_batch": ["12 calls", "4x the traffic", "set_requires_gradient_sync(is_last)"],
    "fsdp2_never_syncs": ["parameters left the baseline", "moved 0 bytes"],
    "wait_right_away": ["waited before the backward produced another gradient", "nothing overlaps"],
    "all_reduce_every_parameter": ["all_reduce made 6 calls", "in 3 calls would do", "2x the messages"],
    "not_waited_before_step": ["only 0 of the 3 all_reduces issued were waited before step()"],
    "bucket_sum_not_divided": ["the averaged gradient is 2x the full-batch gradient", "divide by the world size once"],
    "sends_every_micro_batch": ["moved 1138752 bytes in 9 calls", "4x the traffic", "only in the window's last backward"],
    "full_state_on_every_rank": ["rank 0 holds 569400 bytes of optimizer state where 284692 would do", "2x the memory"],
    "no_all_gather": ["all_gather moved 0 bytes", "the ranks hold different parameters"],
    "shard_gradient_summed": ["the averaged gradient is 2x the full-batch gradient", "divide by the world size once"],
    "overlapping_shards": ["1 parameter element(s) stepped by two ranks or more", "element 35585", "stepped by no rank"],
    "all_reduce_instead_of_reduce": ["reduce moved 0 bytes", "12x the traffic", "not all_reduce"],
    "summed_not_averaged": ["an owner stepped with the wrong gradient", "op=dist.ReduceOp.AVG"],
    "broadcast_before_step": ["a rank holds stale values", "after muon.step()"],
    "accumulated_not_merged": ["an owner stepped with the wrong gradient", "add p._accumulated_grad"],
    "stored_not_added": ["an owner stepped with the wrong gradient", "add the result into the owner's p._reduced_grad"],
    "prepare_z2": ["broadcast moved 49152 bytes", "0.12x the traffic", "reshard_after_forward=True"],
    "prepare_fully_shard_first": ["already sharded by fully_shard", "call dmuon.dedicate_params(model, mesh, predicate) first"],
    "train_without_no_sync": ["reduce, Z3, no_sync moved 196608 bytes", "4x the traffic", "inside the no_sync(model)"],
    "train_steps_inside_no_sync": ["optimizer.step() inside dmuon.no_sync(model)"],
    "train_steps_every_micro_batch": ["broadcast, Z2, no_sync moved 196608 bytes", "4x the traffic",
                                      "call optimizer.step() and zero_grad() once per window"],
    "resume_model_only": ["the momentum did not come back", "the AdamW state did not come back",
                          "dmuon.set_optimizer_state_dict", "step 3 is"],
    "resume_optimizer_only": ["the weights did not come back", "dmuon.set_model_state_dict", "step 3 is"],
    "loaded_but_not_handed_back": ["the weights did not come back", "the momentum did not come back",
                                   "checkpoint.load only fills the dictionary"],
    "token_mean_per_micro_batch": ["of its norm away", "the 2024 transformers bug", "all_reduce ran 1 time"],
    "token_local_count": ["each rank divided by its own token count", "all_reduce the count"],
    "token_average_not_undone": ["0.50x its norm", "multiply each loss by dist.get_world_size()"],
    "token_padding_counted": ["0.38x its norm", "the count includes padding"],
    "guide_loop_drops_leftover": ["samples 64-87 (24 of 88) were never trained on", "(i + 1) % accum_steps",
                                  "every micro-batch weighted equally"],
    "equal_weights": ["(DDP)", "(dmuon)", "every micro-batch weighted equally"],
    "short_window_over_accum_steps": ["step 3's gradient", "0.75x its norm", "as if it held accum_steps = 4"],
    "local_sample_count": ["each rank divided by its own sample count", "(dmuon)"],
    "sample_average_not_undone": ["0.50x its norm", "multiply each loss by dist.get_world_size()", "(dmuon)"],
}


@pytest.fixture(scope="module")
def verdicts():
    result = torchrun(DIST / "script_mutations.py", nproc=2, echo=False, timeout=300)
    lines = [json.loads(line[len("MUTATION "):]) for line in result.stdout(0).splitlines()
             if line.startswith("MUTATION ")]
    return {line["variant"]: line for line in lines}


def test_every_known_mistake_was_fed_to_its_check(verdicts):
    assert sorted(verdicts) == sorted(EXPECTED)


@pytest.mark.parametrize("variant", sorted(EXPECTED))
def test_a_wrong_answer_fails_with_the_hint_that_names_it(verdicts, variant):
    verdict = verdicts[variant]
    # step() inside dmuon.no_sync and dedicate_params after fully_shard never get to the check: dmuon
    # itself refuses them, by name.
    raised = variant in ("train_steps_inside_no_sync", "prepare_fully_shard_first")
    assert verdict["status"] == ("RAISED" if raised else "FAIL"), verdict
    for words in EXPECTED[variant]:
        assert words in verdict["message"], (words, verdict)


SCRIPTS = sorted(notebooks.SOLUTION_SCRIPTS.glob("*.py"))


@pytest.fixture(scope="module")
def learner_copies(tmp_path_factory):
    """Fresh learner copies of every exercise script (not notebooks/scripts/, where a learner works)."""
    folder = tmp_path_factory.mktemp("learner")
    for script in SCRIPTS:
        (folder / script.name).write_text(notebooks.learner_script(script.read_text(), script.name))
    return [folder / script.name for script in SCRIPTS]


def test_every_learner_script_is_a_real_exercise(learner_copies):
    # One launch for all of them; one rank suffices to reach a stub, and starts faster than two.
    result = torchrun(DIST / "run_scripts.py", nproc=1, args=["--stubs", *learner_copies], echo=False, timeout=300)
    raised = dict(line.split()[1:] for line in result.stdout(0).splitlines() if line.startswith("RAISED "))
    assert raised == {script.stem: "NotImplementedError" for script in SCRIPTS}


def test_the_grader_reports_a_learner_stub_as_not_attempted(learner_copies):
    status = grading.grade_script(learner_copies[0], nproc=1)
    assert status.status == "not attempted", status
