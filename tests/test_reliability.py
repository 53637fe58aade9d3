"""Reliability: resume without loss, faults without hangs, deterministic notebooks, short errors.

Resume (dmuon, torchrun on gloo CPU ranks, float32 Newton-Schulz; tests/dist/reliability_resume.py):
three launches and one in-process run. An uninterrupted 5-step run on 2 and on 4 ranks
saves a checkpoint after step 2 (dmuon state dicts through torch.distributed.checkpoint,
with dmuon_edu.checkpoint's completion marker) and its full state; resumes then load
into freshly built models (another seed) and continue:

- 2 -> 2 and 4 -> 4: the continuation is bit-identical to the uninterrupted run.
- 2 -> 4, 4 -> 2 and 2 -> 1 (the last in this process, on a one-rank gloo group):
  owners are re-planned, the loaded model and optimizer state (momentum of every
  matrix, Adam moments, steps, lr schedule) equal the saved state bit for bit, and
  the continued run stays within 1e-6 of the uninterrupted run on the saving ranks.
  Measured here: 7.5e-8 (2 -> 4), 6.0e-8 (4 -> 2); the uninterrupted runs on 2 and on 4
  ranks differ by about as much (reduction order alone).

Faults injected (tests/dist/reliability_faults.py, 2 ranks, in dmuon training):

- rank_raises_mid_step: rank 1 raises inside a layer's forward in step 2 while rank 0
  waits in that layer's collectives; the job ends within 60 s of the fault (4.6 s measured
  under load), non-zero, and RankFailedError (one line) names rank 1 and its exception; no
  process is left.
- rank_stops_answering: rank 1 sleeps instead of joining a layer's collectives, and (silent_in_reduce)
  in the backward that reduces; rank 0's collective times out after session(timeout_s=5) and
  RankFailedError says "a collective timed out" and names rank 1 as the silent one; no process
  is left.
- (tests/test_data_parallel.py: a rank raising before any step, a job hanging past the
  launcher's own timeout, torchrun itself killed, Ctrl-C, a script that does not compile,
  a collective mismatch that gloo aborts: every process of the job is gone afterwards.)
- interrupted save (no torchrun): a process (a fork of the test's) killed (SIGKILL) just
  before the completion marker, and one killed while overwriting a good checkpoint, leave
  directories that checkpoint.load refuses and checkpoint.latest skips.

Checkpoints all or nothing (in this process, and on 2 ranks in the resume launches): a
byte flipped in tensor data (which torch.distributed.checkpoint alone loads without a
word) is refused by its checksum, on every rank, also when the checkpoint was saved on
another world size; a load that fails part-way (a read error after 3 of 4 tensors, a
shape that differs, a value where the state holds a tensor) raises an Exception and leaves
every parameter bit for bit as it was; latest() takes the highest step among checkpoints
that verify, whatever their markers' times; a save that fails leaves no marker.

dmuon misuse that needs several ranks (the rest of the bad-input table is tests/test_bad_input.py):
a mesh that does not span the process group, stepping inside no_sync, and non-finite
gradients on one rank only (an inf input; a NaN in one FSDP2 shard after clipping):
every rank skips the step, with a RuntimeWarning, and no weight becomes NaN.

Also: a single-device loop (Muon, LR schedule, GradScaler through
train_step_with_accumulation) resumes bit-identically; a solution notebook executed
again reproduces its stored text outputs exactly; a stub's check cell prints one line.
"""

import errno
import importlib.util
import io
import os
import re
import select
import signal
import sys
import time
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import nbformat
import pytest
from helpers import processes_running
import dist.check_channel as check_channel
import nbval_record
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from nbclient import NotebookClient
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from dmuon_edu import checkpoint, muon, train_step_with_accumulation
from dmuon_edu.course import notebooks
from dmuon_edu.course.checks import check
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.launch import RankFailedError, torchrun

DIST = Path(__file__).parent / "dist"
RESUME_TOLERANCE = 1e-6  # the bound; reduction order alone gives ~1e-7 here


def _load_script(name):
    sys.path.insert(0, str(DIST))
    try:
        spec = importlib.util.spec_from_file_location(name, DIST / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(DIST))




# ------------------------------------------------------------------ resume across world sizes
@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Three launches (2 ranks: save + misuse; 4 ranks: resume 2->4 + save; 2 ranks: resume 4->2 + a corrupt
    checkpoint), then 2->1 here."""
    directory = tmp_path_factory.mktemp("reliability")
    checks = {}
    for nproc, actions in [(2, ["save", "misuse"]), (4, ["resume:2", "save"]), (2, ["resume:4", "corrupt:4"])]:
        records = directory / f"checks-{nproc}-{actions[0].replace(':', '')}.jsonl"
        torchrun(DIST / "reliability_resume.py", nproc=nproc, args=[directory, *actions], timeout=240, echo=False,
                 env={check_channel.ENV: str(records)})
        checks.update(check_channel.read(records))
    if dist.is_initialized():
        pytest.fail("a process group already exists in this test process; the 2 -> 1 resume needs its own")
    script = _load_script("reliability_resume")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        checks["resume_w2_to_w1"] = script.resume(init_device_mesh("cpu", (1,)), directory, 2)
    finally:
        dist.destroy_process_group()
    checks["directory"] = directory
    return checks


@pytest.mark.torchrun
@pytest.mark.parametrize("world", [2, 4], ids=["2to2", "4to4"])
def test_resume_at_the_same_world_size_is_bit_identical(resumed, world):
    assert resumed[f"saved_w{world}"]["complete"] and resumed[f"saved_w{world}"]["step"] == 2
    c = resumed[f"resume_w{world}_to_w{world}"]
    assert c["loaded_not_identical"] == [] and c["loaded_other_differences"] == [], c
    assert c["final_max_diff"] == 0.0 and c["final_not_identical"] == 0 and c["final_optim_max_diff"] == 0.0, c
    assert c["final_other_differences"] == [] and c["lr"] == c["lr_expected"], c


@pytest.mark.torchrun
@pytest.mark.parametrize("saved,resumed_on", [(2, 4), (4, 2), (2, 1)], ids=["2to4", "4to2", "2to1"])
def test_resume_at_another_world_size(resumed, saved, resumed_on):
    c = resumed[f"resume_w{saved}_to_w{resumed_on}"]
    # Owners are re-planned for the new world size, and momentum moved with its matrix:
    # the loaded state (every momentum buffer, Adam moment, step and the schedule) is the saved one, bit for bit.
    planned = resumed[f"saved_w{resumed_on}"]["owners"] if resumed_on > 1 else dict.fromkeys(c["owners"], 0)
    assert c["owners"] == planned != resumed[f"saved_w{saved}"]["owners"], c
    assert c["loaded_not_identical"] == [] and c["loaded_other_differences"] == [] and c["loaded_max_diff"] == 0.0, c
    assert c["final_max_diff"] < RESUME_TOLERANCE and c["final_optim_max_diff"] < RESUME_TOLERANCE, c
    assert c["finite"] and c["lr"] == c["lr_expected"], c


@pytest.mark.torchrun
def test_reduction_order_alone_is_below_the_resume_tolerance(resumed):
    """The uninterrupted runs on 2 and on 4 ranks: what a different world size costs without any checkpoint."""
    a = torch.load(resumed["directory"] / "final-w2.pt", weights_only=False)["model"]
    b = torch.load(resumed["directory"] / "final-w4.pt", weights_only=False)["model"]
    difference = max_parameter_difference(a, b)
    assert 0 < difference < RESUME_TOLERANCE


@pytest.mark.torchrun
def test_a_corrupt_checkpoint_is_refused_by_every_rank_and_changes_nothing(resumed):
    """Saved on 4 ranks, loaded on 2: the checksums are of files, so they verify on any world size."""
    c = resumed["corrupt_w4_on_w2"]
    assert len(c["errors"]) == 2 and all(
        e["type"] == "CorruptCheckpointError" and f"{c['flipped']} differs from its checksum" in e["message"]
        for e in c["errors"]), c
    assert c["unchanged"], c


# ------------------------------------------------------------- dmuon misuse on several ranks
@pytest.mark.torchrun
@pytest.mark.parametrize("case,error,fragment", [
    ("mesh_not_matching_process_group", "ValueError", "init_device_mesh('cpu', (dist.get_world_size(),))"),
    ("step_inside_no_sync", "RuntimeError", "outside no_sync, then step"),
])
def test_distributed_misuse_raises_on_every_rank(resumed, case, error, fragment):
    errors = resumed[f"misuse_{case}"]["errors"]
    assert len(errors) == 2 and all(e is not None and e["type"] == error and fragment in e["message"] for e in errors), errors


@pytest.mark.torchrun
@pytest.mark.parametrize("poison", ["inf_input", "nan_in_one_shard", "inf_input_ddp"])
def test_non_finite_gradients_skip_the_step_on_every_rank(resumed, poison):
    """The policy (dmuon.Muon's docstring): any NaN/Inf gradient on any rank -> every rank skips the step."""
    c = resumed[f"misuse_non_finite_gradients_{poison}"]
    assert c["skipped_steps"] == [1, 1], c
    assert all(len(w) == 1 and "skipped this optimizer step on every rank" in w[0] and "zero_grad()" in w[0]
               for w in c["warned_every_rank"]), c
    assert c["weights_unchanged"] and c["optimizer_state_unchanged"], c
    assert c["finite_after_next_step"] and c["next_step_moved"] > 0, c


# -------------------------------------------------------------------------------- faults
def _inject(fault, tmp_path):
    """Run the fault script; return the launcher's error and the seconds from the fault to the job's end."""
    stamp = tmp_path / "fault-time"
    with pytest.raises(RankFailedError) as failure:
        torchrun(DIST / "reliability_faults.py", nproc=2, args=[fault, stamp], echo=False, timeout=120)
    return failure.value, time.time() - float(stamp.read_text())


@pytest.mark.torchrun
def test_fault_rank_raises_mid_step(tmp_path):
    error, seconds = _inject("raise", tmp_path)
    # A hang guard, well inside the launcher's 120 s: ~2 s from the raise to the error on an idle 2-core machine.
    assert seconds < 60
    assert error.rank == 1 and error.exception == "ValueError: injected failure on rank 1 in the middle of step 1"
    assert str(error) == "rank 1 failed: ValueError: injected failure on rank 1 in the middle of step 1"
    assert processes_running("reliability_faults.py") == []


@pytest.mark.torchrun
@pytest.mark.parametrize("fault", ["silent", "silent_in_reduce", "silent_ddp"])
def test_fault_rank_stops_answering_is_cut_off_by_the_collective_timeout(tmp_path, fault):
    error, seconds = _inject(fault, tmp_path)
    # The script's collective timeout ended it, not the launcher's 120 s (a hang guard with room for load), and not
    # earlier: rank 0 may already wait in the collective when rank 1 stamps the fault, hence a fifth less.
    assert 0.8 * _load_script("reliability_faults").TIMEOUT_S < seconds < 60
    message = str(error)
    assert "\n" not in message
    # In the forward's collectives gloo says "Timed out waiting 5000ms"; in a reduce often "Application timeout caused
    # pair closure", from another wait of rank 0's: either way the waiting rank's error names rank 1 as the silent one.
    assert error.rank == 0 and message.startswith("rank 0 failed: a collective timed out ("), message
    assert "rank 1 raised nothing" in message and "session(timeout_s=...)" in message, message
    assert processes_running("reliability_faults.py") == []


# -------------------------------------------------------------------- interrupted saves
def _small_state(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    return model, {"model": get_model_state_dict(model)}


def _save_and_stop_at(path, point, stopped):
    """In the forked child: save another model's state to ``path`` with checkpoint.save, write to the pipe
    ``stopped`` when the save reaches ``point``, and wait there to be killed. ``before_marker``: after
    torch.distributed.checkpoint wrote every file (data and .metadata), just before the completion marker;
    ``during_write``: after the first tensor of the data file."""
    def stop_here(*args, **kwargs):
        os.write(stopped, b"STOPPED")
        time.sleep(600)

    if point == "before_marker":
        os.replace = stop_here
    else:
        write_item = dcp_filesystem._write_item

        def first_item_then_stop(*args, **kwargs):
            write_item(*args, **kwargs)
            stop_here()

        dcp_filesystem._write_item = first_item_then_stop
    warnings.simplefilter("ignore")  # e.g. dcp's that there is no process group: the child writes nothing
    checkpoint.save(_small_state(1)[1], path)  # other values than the good checkpoint's


def _kill_during_save(path, point):
    """Save in a child process and SIGKILL it at ``point``. The child is a fork of this process: torch is
    imported already, where a fresh interpreter would take seconds to import it."""
    stopped, stopped_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(stopped)
            torch.set_num_threads(1)  # the parent's OpenMP threads are not in the fork (as in a DataLoader worker)
            _save_and_stop_at(path, point, stopped_w)
        finally:
            os._exit(1)  # reached only if the save never got to ``point``: the parent then reads end of file
    os.close(stopped_w)
    try:
        ready, _, _ = select.select([stopped], [], [], 60)  # never wait on a stuck child
        assert ready and os.read(stopped, 16) == b"STOPPED", f"the save did not get to {point}"
    finally:
        os.close(stopped)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_interrupted_saves_are_never_mistaken_for_good_checkpoints(tmp_path):
    good_model, good = _small_state(0)
    checkpoint.save(good, tmp_path / "step-1", step=1)
    assert checkpoint.is_complete(tmp_path / "step-1")

    # Killed after torch.distributed.checkpoint wrote everything, just before the marker:
    # dcp alone would load it; checkpoint.load refuses it.
    _kill_during_save(tmp_path / "step-2", "before_marker")
    assert (tmp_path / "step-2" / ".metadata").is_file() and not checkpoint.is_complete(tmp_path / "step-2")
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="save was interrupted.*checkpoint.latest"):
        checkpoint.load(_small_state(5)[1], tmp_path / "step-2")
    assert checkpoint.latest(tmp_path) == tmp_path / "step-1"

    # Killed while overwriting the good checkpoint: its old .metadata is still there, but so is no marker.
    _kill_during_save(tmp_path / "step-1", "during_write")
    assert (tmp_path / "step-1" / ".metadata").is_file() and not checkpoint.is_complete(tmp_path / "step-1")
    with pytest.raises(checkpoint.IncompleteCheckpointError):
        checkpoint.load(_small_state(5)[1], tmp_path / "step-1")
    assert checkpoint.latest(tmp_path) is None

    # A finished save is loaded, bit for bit.
    checkpoint.save(good, tmp_path / "step-3", step=3)
    fresh_model, fresh = _small_state(7)
    checkpoint.load(fresh, tmp_path / "step-3")
    set_model_state_dict(fresh_model, fresh["model"])
    assert all(torch.equal(a, b) for a, b in zip(good_model.state_dict().values(), fresh_model.state_dict().values()))
    assert checkpoint.latest(tmp_path) == tmp_path / "step-3"


# ------------------------------------------------------------------- all-or-nothing loads
def _bits(model):
    """Every parameter's bytes: equal lists mean bit for bit (torch.equal calls 0.0 and -0.0 equal)."""
    return [p.detach().flatten().view(torch.uint8).clone() for p in model.parameters()]


def _same_bits(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _flip_a_byte_of(path, key):
    """Flip one byte in the middle of tensor ``key``'s data, where dcp's metadata says it lies; return its file."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == key)
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))
    return info.relative_path


def test_a_flipped_byte_is_refused_and_the_model_is_left_as_it_was(tmp_path):
    good_model, good = _small_state(0)
    checkpoint.save(good, tmp_path / "step-1", step=1)
    checkpoint.save(good, tmp_path / "step-2", step=2)
    data_file = _flip_a_byte_of(tmp_path / "step-2", "model.1.weight")

    # torch.distributed.checkpoint alone loads it without a word, one weight different.
    plain_model, plain = _small_state(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp's warning that there is no process group
        dcp.load(plain, checkpoint_id=tmp_path / "step-2")
    assert torch.equal(plain_model[0].weight, good_model[0].weight)
    assert not torch.equal(plain_model[1].weight, good_model[1].weight)

    model, state = _small_state(7)
    before = _bits(model)
    with pytest.raises(checkpoint.CorruptCheckpointError,
                       match=f"step-2 is corrupt: {data_file} differs from its checksum.*checkpoint.latest"):
        checkpoint.load(state, tmp_path / "step-2")
    assert _same_bits(_bits(model), before)
    with pytest.warns(RuntimeWarning, match=f"passed over .*step-2: {data_file} differs from its checksum"):
        assert checkpoint.latest(tmp_path) == tmp_path / "step-1"


def _two_layers(seed, out=8):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, out))  # 4 parameters
    return model, {"model": get_model_state_dict(model)}


@pytest.mark.parametrize("failure,fragment", [
    ("read_error_at_the_third_of_4_tensors", r"OSError: injected read error\. Nothing in state was changed"),
    ("shape_differs", r"Size mismatch .* for model\.1\.weight\. Nothing in state was changed"),
    ("value_where_state_holds_a_tensor", r"not a tensor where state holds a tensor, at state\['scaler'\]\['scale'\]"),
])
def test_a_load_that_fails_part_way_raises_an_exception_and_changes_nothing(tmp_path, monkeypatch, failure, fragment):
    _, saved = _two_layers(0)
    checkpoint.save({**saved, "scaler": {"scale": 2.0}}, tmp_path / "ckpt", step=1)
    model, state = _two_layers(7, out=4 if failure == "shape_differs" else 8)
    state["scaler"] = {"scale": torch.tensor(1.0) if failure == "value_where_state_holds_a_tensor" else 1.0}
    committed = []
    if failure.startswith("read_error"):
        commit = DefaultLoadPlanner.commit_tensor

        def fail_at_the_third(self, read_item, tensor):
            committed.append(read_item.dest_index.fqn)
            if len(committed) == 3:  # dcp has copied this tensor's data already, and the two before it
                raise OSError("injected read error")
            commit(self, read_item, tensor)

        monkeypatch.setattr(DefaultLoadPlanner, "commit_tensor", fail_at_the_third)
    before, scale_before = _bits(model), state["scaler"]["scale"]
    with pytest.raises(checkpoint.CheckpointError, match=fragment) as refused:
        checkpoint.load(state, tmp_path / "ckpt")
    # torch.distributed.checkpoint's own CheckpointException is a BaseException, which `except Exception` misses.
    assert isinstance(refused.value, Exception)
    assert len(committed) == (3 if failure.startswith("read_error") else 0)
    assert _same_bits(_bits(model), before) and state["scaler"]["scale"] is scale_before


def test_latest_takes_the_highest_step_among_the_checkpoints_that_verify(tmp_path):
    _, state = _small_state(0)
    checkpoint.save(state, tmp_path / "b", step=5)
    checkpoint.save(state, tmp_path / "a", step=2)  # saved later: a newer marker, an earlier step
    checkpoint.save(state, tmp_path / "c", step=9)
    (tmp_path / "c" / "__0_0.distcp").unlink()
    checkpoint.save(state, tmp_path / "d", step=8)
    (tmp_path / "d" / checkpoint.MARKER).write_text("{}")  # a marker with no checksums
    checkpoint.save(state, tmp_path / "e")  # no step
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / ".metadata").write_bytes(b"")  # no marker: passed over in silence
    with pytest.warns(RuntimeWarning) as warned:
        assert checkpoint.latest(tmp_path) == tmp_path / "b"
    reasons = sorted(str(w.message) for w in warned)
    assert len(reasons) == 3, reasons
    for reason, (name, why) in zip(reasons, [("c", "__0_0.distcp is missing or unreadable"),
                                             ("d", "COMPLETE lists no file checksums"),
                                             ("e", "it was saved without a step (checkpoint.save(state, path, step=N))")]):
        assert reason.startswith(f"checkpoint.latest passed over {tmp_path / name}: {why}"), reason
    with pytest.raises(checkpoint.CorruptCheckpointError, match="__0_0.distcp is missing or unreadable"):
        checkpoint.load(_small_state(1)[1], tmp_path / "c")
    model, fresh = _small_state(1)
    checkpoint.load(fresh, tmp_path / "e")  # a checkpoint without a step still loads
    assert torch.equal(model[0].weight, state["model"]["0.weight"])


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")  # dcp's note that it saves over one: the intent
def test_a_save_that_fails_raises_an_exception_and_leaves_no_marker(tmp_path, monkeypatch):
    _, state = _small_state(0)
    checkpoint.save(state, tmp_path / "ckpt", step=1)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_filesystem, "_write_item", disk_full)
    with pytest.raises(checkpoint.CheckpointError, match="could not save .*No space left on device.*save again"):
        checkpoint.save(state, tmp_path / "ckpt", step=2)
    assert not checkpoint.is_complete(tmp_path / "ckpt") and checkpoint.latest(tmp_path) is None


@pytest.mark.parametrize("call,error,fragment", [
    (lambda path: checkpoint.save({}, path, step=-1), ValueError, "step must be >= 0"),
    (lambda path: checkpoint.save({}, path, step="3"), TypeError, "step must be an int"),
    (lambda path: checkpoint.save({}, path, step=True), TypeError, "step must be an int"),
    (lambda path: checkpoint.load({"model": nn.Linear(2, 2)}, path), TypeError, "pass its state dict instead"),
    (lambda path: checkpoint.load({}, checkpoint.latest(path)), FileNotFoundError,
     "path is None, which checkpoint.latest(root) returns when root holds no checkpoint that verifies"),
], ids=["negative_step", "step_a_string", "step_a_bool", "a_module_instead_of_its_state_dict", "latest_found_none"])
def test_bad_checkpoint_input_is_refused_before_anything_is_written(tmp_path, call, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        call(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


# --------------------------------------------------------------- single-device loop resume
def _single_device_run(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12, bias=False), nn.Tanh(), nn.Linear(12, 3, bias=False))
    opt = muon.Muon(model.parameters(), lr=0.05, weight_decay=0.1, ns_dtype=torch.float32)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    return model, opt, sched, scaler


def _window(step):
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)) for n in (3, 5, 2)]


def _train(run, steps):
    model, opt, sched, scaler = run
    for step in steps:
        train_step_with_accumulation(model, opt, _window(step), nn.functional.mse_loss, max_grad_norm=1.0,
                                     scheduler=sched, scaler=scaler)


def _single_device_state(run):
    model, opt, sched, scaler = run
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
            "scheduler": sched.state_dict(), "scaler": scaler.state_dict()}


def test_single_device_resume_with_scheduler_and_grad_scaler_is_bit_identical(tmp_path):
    uninterrupted = _single_device_run()
    _train(uninterrupted, range(3))
    checkpoint.save(_single_device_state(uninterrupted), tmp_path / "step-3", step=3)
    _train(uninterrupted, range(3, 6))

    resumed = _single_device_run(seed=99)  # fresh: other weights, no optimizer state yet
    state = _single_device_state(resumed)  # get_optimizer_state_dict initialises a fresh optimizer's state
    checkpoint.load(state, checkpoint.latest(tmp_path))
    model, opt, sched, scaler = resumed
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    sched.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    assert scaler.get_scale() == 2.0**13  # the scale grew every step: it came from the checkpoint
    _train(resumed, range(3, 6))

    a, b = uninterrupted[0].state_dict(), model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    expected = [uninterrupted[1].state[p]["momentum_buffer"] for p in uninterrupted[0].parameters()]
    assert all(torch.equal(x, y) for x, y in zip(momentum, expected))
    assert scaler.get_scale() == uninterrupted[3].get_scale() and sched.get_last_lr() == uninterrupted[2].get_last_lr()


# ------------------------------------------------------------------------------ determinism
def _text_outputs(notebook):
    texts = []
    for index, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "stream":  # a stream may arrive in any number of pieces: join them
                if texts and texts[-1][:2] == (index, output.name):
                    texts[-1] = (index, output.name, texts[-1][2] + output.text)
                else:
                    texts.append((index, output.name, output.text))
            elif output.output_type in ("execute_result", "display_data"):
                texts.append((index, "text/plain", output.get("data", {}).get("text/plain", "")))
            elif output.output_type == "error":
                texts.append((index, output.ename, output.evalue))
    return texts


@pytest.mark.after_nbval
def test_a_solution_notebook_executed_again_reproduces_its_stored_text_outputs():
    """Executed twice, identical text: the stored outputs are the first execution (`make solutions`), this is
    the second, compared exactly (no sanitising, NBVAL_IGNORE_OUTPUT cells included). Module 1 is the cheap
    one; nbval in `make test` executes every other solution notebook again against its stored outputs.

    The second execution is nbval's own in `make test`, when tests/nbval_record.py recorded it (its raw
    outputs, unsanitised) into DMUON_EDU_NBVAL_OUTPUTS; otherwise this test executes the notebook."""
    path = notebooks.SOLUTIONS / "01_loss_scaled_accumulation.ipynb"
    stored = nbformat.read(path, as_version=4)
    fresh = nbval_record.recorded_execution(path)
    if fresh is None:
        fresh = nbformat.read(path, as_version=4)
        NotebookClient(fresh, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    notebooks.clean_outputs(fresh)
    assert _text_outputs(fresh) == _text_outputs(stored)


# -------------------------------------------------------------------- learner-facing errors
def test_a_stub_check_cell_prints_one_todo_line_and_a_failing_one_one_fail_line():
    def stub(*args, **kwargs):  # what `make notebooks` leaves in the exercise cell
        raise NotImplementedError(notebooks.STUB_MESSAGE)

    def broken(model, optimizer, microbatches, loss_fn):
        raise KeyError("oops")

    for candidate, word in [(stub, "TODO"), (broken, "FAIL")]:
        out = io.StringIO()
        with redirect_stdout(out):
            check("train_step_with_accumulation", candidate)
        lines = out.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{word} train_step_with_accumulation: "), lines
        assert "Traceback" not in out.getvalue()
