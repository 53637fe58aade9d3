"""The torchrun script exercises grade by effect: every known wrong answer FAILs, naming its mistake.

One launch (tests/dist/script_mutations.py) feeds every wrong variant, and every honest
alternative, to its script's check on 2 ranks, then runs the learner copy of every script
(its exercises not done). The right answers PASS in tests/test_data_parallel.py and
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
    "all_reduce_per_parameter": ["all_reduce made 6 calls", "6x the calls", "each call has a fixed cost",
                                 "one flat buffer"],
    "sum_not_divided": ["the averaged gradient is 2x the full-batch gradient", "divide by the world size once"],
    "not_averaged": ["all_reduce moved 0 bytes", "not the average of the ranks' gradients"],
    "sum_left_in_a_copy": ["left p.grad as it was", "torch.cat copies"],
    "no_sync_read_in_backward": ["backward_inside: all_reduce calls per optimizer step 4, not 1",
                                 "forward_inside: all_reduce calls per optimizer step 1, not 4",
                                 "DDP decides in the forward"],
    "unsynced_ranks_agree": ["every_micro_batch_inside: equal to one process False, not True",
                             "each rank stepped with its own gradient"],
    "extra_all_reduces_change_the_numbers": ["backward_inside: equal to one process True, not False",
                                             "averaging commutes with adding"],
    "fsdp2_syncs_every_micro_batch": ["budget 1.25 P: 3416256 bytes sent per optimizer step where 2562192 fit",
                                      "1.3x the traffic", "the whole gradient fits"],
    "fsdp2_syncs_the_last_whatever_the_budget": [
        "budget 0.75 P: a rank kept 284688 bytes between micro-batches where the budget is 213516",
        "the whole unsharded gradient", "budget 2.5 P: 2562192 bytes sent", "the gathered parameters fit too"],
    "fsdp2_keeps_gathered_whatever_the_budget": ["budget 1.25 P: a rank kept 569376 bytes",
                                                 "the gathered parameters too (P bytes more)"],
    "fsdp2_never_syncs": ["parameters left the baseline", "the window's last backward at least must reduce-scatter"],
    "wait_right_away": ["waited before the backward produced another gradient", "nothing overlaps"],
    "all_reduce_every_parameter": ["all_reduce made 6 calls", "in 3 calls would do", "2x the calls"],
    "not_waited_before_step": ["only 0 of the 3 all_reduces issued were waited before step()"],
    "bucket_sum_not_divided": ["the averaged gradient is 2x the full-batch gradient", "divide by the world size once"],
    "sends_every_micro_batch": ["moved 1138752 bytes in 9 calls", "4x the traffic", "only in the window's last backward"],
    "full_state_on_every_rank": ["rank 0 holds 569400 bytes of optimizer state where 284692 would do", "2x the memory"],
    "no_all_gather": ["all_gather moved 0 bytes", "the ranks hold different parameters"],
    "shard_gradient_summed": ["the averaged gradient is 2x the full-batch gradient", "divide by the world size once"],
    "overlapping_shards": ["1 parameter element(s) stepped by two ranks or more", "element 35585", "stepped by no rank"],
    "all_reduce_instead_of_reduce": ["reduce moved 0 bytes", "not all_reduce"],
    "summed_not_averaged": ["the owners stepped with the ranks' sum, 2x their average", "op=dist.ReduceOp.AVG"],
    "broadcast_before_step": ["a rank holds stale values", "after its owner's step"],
    "accumulated_not_merged": ["never left their rank", "merge them into this backward's gradient"],
    "stored_not_added": ["the owner kept only the last", "add each arrival into p._reduced_grad"],
    "grad_left_set": ["left a gradient in p.grad", "sent again"],
    "residency_replicated_at_rest": ["between steps: bytes per rank / P_M 0.5, not 1:",
                                     "a rank holds only the matrices it owns"],
    "residency_whole_model_while_computing": ["while a layer computes: bytes per rank / P_M 0.667, not 1:",
                                              "no other layer's"],
    "residency_without_prefetch": ["in flight while a layer computes: bytes per rank / P_M 0.333, not 0:",
                                   "forward_prefetch_depth=1"],
    "residency_receive_buffers_only": ["in flight while a layer computes: bytes per rank / P_M 0.333, not 0.167",
                                       "the rank's own part copied to send"],
    "z3_broadcasts_once_per_micro_batch": ["Z3, no_sync: broadcast / P_M 8, not 4", "twice per micro-batch"],
    "z2_broadcasts_every_micro_batch": ["Z2, no_sync: broadcast / P_M 1, not 4", "once per window"],
    "no_sync_reduces_every_micro_batch": ["Z3, no_sync: reduce / P_M 1, not 4", "reduces the sum once"],
    "wire_bytes_predicted": ["every prediction is 0.5x the count", "whole tensor once on every rank"],
    "resume_model_only": ["the momentum (off by up to", "and the AdamW state (off by up to", "did not come back",
                          "dmuon.set_optimizer_state_dict hands it to the run", "its next steps are up to"],
    "resume_optimizer_only": ["the weights (off by up to", "did not come back", "dmuon.set_model_state_dict",
                              "its next steps are up to"],
    "loaded_but_not_handed_back": ["the weights (off by up to", "the momentum (off by up to",
                                   "checkpoint.load only fills the dictionary"],
    "resume_newest_folder": ["resume read step-4, whose save was cut short", "the newest checkpoint that verifies"],
    "resume_first_checkpoint": ["an older checkpoint (step 1)", "checkpoint.latest(root)"],
    "resume_unmarked_folder": ["resume read step-4, whose save was cut short (it has no COMPLETE marker",
                               "checkpoint.latest(root) and checkpoint.load do"],
    "resume_newest_marked_folder": ["resume read step-3, whose files differ from their checksums",
                                    "checkpoint.latest(root)"],
    "resume_damaged_unverified": ["resume read step-3 with torch.distributed.checkpoint",
                                  "checkpoint.latest(root) passes over it", "its next steps are up to"],
    "resume_counting_the_saves": ["resume restored step 2's state but returned 3", "window 3 is due",
                                  "its next steps are up to"],
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
    "no_sync_left_out": ["DDP's all-reduces of the gradients moved", "dmuon's reduces of the matrices moved",
                         "3.7x the traffic", "inside no_sync: one gradient sync per window"],
    "zero_grad_every_micro_batch": ["only each window's last micro-batch reached the step",
                                    "zero_grad() inside the micro-batch loop"],
    "timer_own_rank": ["slowest_median_seconds: each rank returned its own time", "ReduceOp.MAX"],
    "timer_fastest_rank": ["the fastest rank's time (4 ms a call)", "its slowest rank is done (12 ms)"],
    "timer_mean": ["the mean of the repeats, moved by a hiccup of 80 ms"],
    "timer_mean_without_warm_up": ["the call ran 7 times, all timed", "make one untimed call first"],
    "timer_worst_repeat": ["the worst repeat, a hiccup of 80 ms"],
    "timer_total": ["the total of 7 repeats"],
    "capstone_without_no_sync": ["the reduce to the owners ran every micro-batch", "2 x P_M = 196608 bytes",
                                 "inside dmuon.no_sync(model)"],
    "capstone_loss_not_divided": ["not divided by the window's length", "2x the window's mean", "from the reference"],
    "capstone_torch_clip": ["torch.nn.utils.clip_grad_norm_ saw only the gradients in p.grad", "from the reference",
                            "dmuon.clip_grad_norm_(model, MAX_NORM)"],
    "capstone_no_clip": ["no clipping", "from the reference", "dmuon.clip_grad_norm_(model, MAX_NORM)"],
    "capstone_scheduler_per_micro_batch": ["the scheduler stepped once per micro-batch", "2 times too early"],
    "capstone_scheduler_before_step": ["the scheduler moved before optimizer.step()", "from the reference",
                                       "after optimizer.step()"],
    "capstone_scheduler_never_stepped": ["the learning rate never changed"],
    "capstone_summed_loss_returned": ["train_step returned 2x the window's loss", "the check averages the ranks"],
    "capstone_resume_without_scheduler": ["the schedule started over", "rate was 0.004 where the run's was 0.02",
                                          "scheduler.state_dict()"],
    "capstone_save_without_step": ["checkpoint.latest(root) finds no checkpoint of step 8",
                                   "checkpoint.save(state, path, step=step)"],
    "capstone_resume_weights_only": ["the resumed run is not the uninterrupted one", "the optimizer's state"],
    "capstone_resume_counting_saves": ["resume returned 1, where the checkpoint holds step 8"],
}

# Honest alternatives to a script's answer, which its check must PASS.
HONEST = {"packed_per_owner",  # 06_reduce_broadcast: one reduce and one broadcast per owner, as dmuon packs them
          "resume_step_from_adamw_state",  # 06_save_and_resume: the step AdamW's restored state counts
          "timer_best_repeat",  # 06_time_collectives: the fastest repeat of the slowest rank
          # 07_train_capstone: Z2, the gradients zeroed first; the DDP backend, the step from the folder's name;
          # one no_sync block and the losses as a tensor, the step saved in the checkpoint's own state
          "capstone_z2", "capstone_resume_step_from_folder", "capstone_resume_step_in_the_state"}


SCRIPTS = sorted(notebooks.SOLUTION_SCRIPTS.glob("*.py"))


@pytest.fixture(scope="module")
def learner_copies(tmp_path_factory):
    """Fresh learner copies of every exercise script (not notebooks/scripts/, where a learner works)."""
    folder = tmp_path_factory.mktemp("learner")
    for script in SCRIPTS:
        (folder / script.name).write_text(notebooks.learner_script(script.read_text(), script.name))
    return [folder / script.name for script in SCRIPTS]


@pytest.fixture(scope="module")
def launch(learner_copies):
    """Rank 0's output lines: the verdict on every variant, then what every learner copy raised."""
    result = torchrun(DIST / "script_mutations.py", nproc=2, args=learner_copies, echo=False, timeout=300)
    return result.stdout(0).splitlines()


@pytest.fixture(scope="module")
def verdicts(launch):
    lines = [json.loads(line[len("MUTATION "):]) for line in launch if line.startswith("MUTATION ")]
    return {line["variant"]: line for line in lines}


def test_every_known_mistake_and_honest_alternative_was_fed_to_its_check(verdicts):
    assert sorted(verdicts) == sorted([*EXPECTED, *HONEST])


@pytest.mark.parametrize("variant", sorted(EXPECTED))
def test_a_wrong_answer_fails_with_the_hint_that_names_it(verdicts, variant):
    verdict = verdicts[variant]
    assert verdict["status"] == "FAIL", verdict
    for words in EXPECTED[variant]:
        assert words in verdict["message"], (words, verdict)
    # a verdict a learner reads at once: two problems at most (the rest print above it)
    assert verdict["message"].count("; and ") <= 1, verdict


@pytest.mark.parametrize("variant", sorted(HONEST))
def test_an_honest_alternative_passes(verdicts, variant):
    assert verdicts[variant]["status"] == "PASS", verdicts[variant]


def test_every_learner_script_is_a_real_exercise(launch):
    raised = {stem: ranks for _, stem, *ranks in (line.split() for line in launch if line.startswith("RAISED "))}
    assert raised == {script.stem: ["NotImplementedError"] * 2 for script in SCRIPTS}


def test_the_grader_reports_a_learner_stub_as_not_attempted(learner_copies):
    # Its own launch, through grade_script, on one rank: the script that reaches its stub soonest (05_zero1_adamw's
    # shard_bounds, called before any training), so that the launch is most of the cost.
    [script] = [path for path in learner_copies if path.stem == "05_zero1_adamw"]
    status = grading.grade_script(script, nproc=1)
    assert status.status == "not attempted", status
