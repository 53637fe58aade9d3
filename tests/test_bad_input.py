"""The bad-input audit: every misuse a learner can make of a public function, and what it gets back.

One table, one row per bad input: the call, the error type, and a fragment of the
message that says what to do (not only what was wrong). The test ids name the bad
inputs. dmuon cases run on a one-rank gloo process group in this process; the dmuon
misuse that needs several ranks (a mesh that does not span the process group,
stepping inside no_sync, non-finite gradients on one rank) is in tests/test_reliability.py
(test_distributed_misuse_raises_on_every_rank, test_non_finite_gradients_skip_the_step_on_every_rank),
the launcher's faults there and in tests/test_data_parallel.py.
"""

import pytest
from helpers import Tiny
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_edu
from dmuon_edu import checkpoint, distributed, dmuon, muon
from dmuon_edu.course import widgets
from dmuon_edu.course.checks import run_check
from dmuon_edu.course.data import MarkovSource, lm_batch
from dmuon_edu.course.dmuon_problem import is_dedicated
from dmuon_edu.launch import torchrun
from dmuon_edu.newton_schulz import newton_schulz


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


def dedicated(mesh, shard=True):
    model = Tiny()
    dmuon.dedicate_params(model, mesh, is_dedicated)
    if shard:
        fully_shard(model, mesh=mesh)
    return model


def nan_momentum_loaded_into_dmuon(mesh):
    model = dedicated(mesh)
    opt = dmuon.Muon(model)
    saved = dmuon.get_optimizer_state_dict(model, opt, rank0_only=False)
    saved["state"]["layers.0.up_proj.weight"]["momentum_buffer"][0, 0] = float("nan")
    dmuon.set_optimizer_state_dict(model, opt, saved)


def sharded_then_dedicated(mesh):
    model = Tiny()
    fully_shard(model, mesh=mesh)
    dmuon.dedicate_params(model, mesh, is_dedicated)


def negative_adamw_lr_set_after_construction(mesh):
    optimizer = dmuon.Muon(dedicated(mesh))
    optimizer.adamw_group["lr"] = -5.0
    optimizer.step()


def nan_muon_lr_set_after_construction(mesh):
    optimizer = dmuon.Muon(dedicated(mesh))
    optimizer.muon_group["lr"] = float("nan")
    optimizer.step()


def optimizer_of_another_model(mesh):
    model, other = dedicated(mesh), dedicated(mesh)
    dmuon.get_optimizer_state_dict(model, dmuon.Muon(other))


def accumulated_and_clipped_with_dmuon(mesh):
    model = dedicated(mesh)
    batch = (torch.randn(3, 4), torch.randn(3, 4))
    dmuon_edu.train_step_with_accumulation(model, dmuon.Muon(model), [batch], F.mse_loss, max_grad_norm=1.0)


def torch_dcp_state_dict_of_dmuon(mesh):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = dedicated(mesh)
    get_state_dict(model, dmuon.Muon(model))


def lm_step(loss_fn):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dmuon_edu.train_step_with_accumulation(model, opt, [(torch.randn(3, 2), torch.randn(3, 2))], loss_fn)


def linear_step(microbatches, **kwargs):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dmuon_edu.train_step_with_accumulation(model, opt, microbatches, nn.functional.mse_loss, **kwargs)


def not_a_script(tmp_path):
    torchrun(tmp_path / "missing.py")


def half_written_checkpoint(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"")  # what a killed save can leave
    checkpoint.load({"model": {}}, tmp_path / "ckpt")


X = torch.randn(3, 2)
DUPLICATED = nn.Parameter(torch.zeros(3, 3))

# id, call (taking the fixtures it names), error type, a fragment of the message that says what to do
CASES = [
    # dmuon_edu: accumulation
    ("train_step/loss_fn_not_callable", lambda: lm_step("mse"), TypeError, "pass a function such as"),
    ("train_step/microbatches_a_tensor", lambda: linear_step(torch.randn(3, 2)), TypeError, "list of (inputs, targets) pairs"),
    ("train_step/microbatches_empty", lambda: linear_step([]), ValueError, "pass at least one (inputs, targets) pair"),
    ("train_step/microbatch_not_a_pair", lambda: linear_step([(X,)]), TypeError, "build the list as [(x0, y0), (x1, y1), ...]"),
    ("train_step/empty_microbatch", lambda: linear_step([(X[:0], X[:0])]), ValueError, "drop it, or give it at least one sample"),
    ("train_step/max_grad_norm_zero", lambda: linear_step([(X, X)], max_grad_norm=0), ValueError, "or None for no clipping"),
    ("train_step/scheduler_of_another_optimizer", lambda: linear_step([(X, X)], scheduler=torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), lambda step: 1.0)), ValueError,
     "build the scheduler on the optimizer you pass"),
    ("train_step/fractional_item_count", lambda: lm_step(lambda p, t: ((p - t).square().sum(), 2.5)), ValueError,
     "num_items must be a whole number >= 0, got 2.5"),
    ("train_step/loss_fn_returns_per_sample_losses", lambda: lm_step(lambda p, t: (p - t).square()), ValueError,
     "use reduction='mean'"),
    ("train_step/loss_fn_returns_a_triple", lambda: lm_step(lambda p, t: ((p - t).square().sum(), 3, 0)), ValueError,
     "return (sum_loss, num_items)"),
    ("accumulation_windows/accum_steps_zero", lambda: dmuon_edu.accumulation_windows([1, 2], 0), ValueError,
     "micro-batches per optimizer step"),
    ("accumulation_windows/accum_steps_float", lambda: dmuon_edu.accumulation_windows([1, 2], 2.0), ValueError, "an int >= 1"),
    # compare, memory
    ("max_parameter_difference/different_models", lambda: dmuon_edu.max_parameter_difference(nn.Linear(2, 2), nn.Linear(2, 3)),
     ValueError, "in one model and"),
    ("max_parameter_difference/a_single_tensor", lambda: dmuon_edu.max_parameter_difference(X, X), TypeError,
     "pass a model or a list of tensors"),
    ("max_parameter_difference/state_dicts_with_other_keys",
     lambda: dmuon_edu.max_parameter_difference(nn.Linear(2, 2).state_dict(), nn.Linear(2, 2, bias=False).state_dict()),
     ValueError, "differ in their keys"),
    ("max_parameter_difference/list_of_floats", lambda: dmuon_edu.max_parameter_difference([1.0], [1.0]), TypeError,
     "a model, a state_dict or a list of tensors"),
    ("peak_memory_bytes/result_not_function", lambda: dmuon_edu.peak_memory_bytes(3), TypeError, "a callable taking no arguments"),
    ("peak_memory_bytes/meta_device", lambda: dmuon_edu.peak_memory_bytes(lambda: None, "meta"), ValueError, "'cpu' or 'cuda'"),
    # single-device Muon and Newton-Schulz
    ("muon/1d_parameter", lambda: muon.Muon([nn.Parameter(torch.zeros(3))], lr=0.02), ValueError,
     "use muon_param_groups(model)"),
    ("muon/negative_lr", lambda: muon.Muon([nn.Parameter(torch.zeros(3, 3))], lr=-1), ValueError, "pass a positive learning rate"),
    ("muon/lr_nan", lambda: muon.Muon([nn.Parameter(torch.zeros(3, 3))], lr=float("nan")), ValueError,
     "lr must be >= 0 and finite, got nan; pass a positive learning rate, e.g. 0.02"),
    ("muon/weight_decay_nan", lambda: muon.Muon([nn.Parameter(torch.zeros(3, 3))], lr=0.02, weight_decay=float("nan")),
     ValueError, "use 0 for none, 0.1 is a usual value"),
    ("muon/momentum_one", lambda: muon.Muon([nn.Parameter(torch.zeros(3, 3))], lr=0.02, momentum=1.0), ValueError,
     "0.95 is the usual value"),
    ("muon/unknown_adjust_lr_fn", lambda: muon.Muon([nn.Parameter(torch.zeros(3, 3))], lr=0.02, adjust_lr_fn="moon"),
     ValueError, "use one of"),
    ("muon/duplicated_parameter", lambda: muon.Muon([DUPLICATED, DUPLICATED], lr=0.02), ValueError,
     "Pass each parameter once"),
    ("muon/params_a_set", lambda: muon.Muon({nn.Parameter(torch.zeros(3, 3))}, lr=0.02), TypeError,
     "must be a list, not a set"),
    ("muon/param_group_params_a_set", lambda: muon.Muon([{"params": {nn.Parameter(torch.zeros(3, 3))}}], lr=0.02),
     TypeError, "must be a list, not a set"),
    ("newton_schulz/3_steps_float", lambda: newton_schulz(torch.randn(3, 3), steps=2.5), TypeError, "steps must be an int"),
    ("newton_schulz/vector", lambda: newton_schulz(torch.randn(3)), ValueError, "reshape to 2-D first"),
    ("newton_schulz/empty_batch", lambda: newton_schulz([]), ValueError, "pass at least one matrix"),
    ("newton_schulz/overwrite_input_not_bool", lambda: newton_schulz(torch.randn(3, 3), overwrite_input="yes"),
     TypeError, "overwrite_input must be True or False"),
    ("newton_schulz/dtype_a_string", lambda: newton_schulz(torch.randn(3, 3), dtype="bfloat16"), TypeError,
     "a floating torch.dtype such as torch.bfloat16"),
    ("newton_schulz/negative_eps", lambda: newton_schulz(torch.randn(3, 3), eps=-1.0), ValueError, "1e-7 is the usual value"),
    ("newton_schulz/integer_matrix", lambda: newton_schulz(torch.ones(3, 3, dtype=torch.long)), TypeError,
     "floating-point torch.Tensors"),
    # data
    ("MarkovSource.random/vocab_size_one", lambda: MarkovSource.random(1), ValueError, "an int >= 2"),
    ("MarkovSource/negative_entry", lambda: MarkovSource(torch.tensor([[0.5, 0.5], [1.5, -0.5]])), ValueError,
     "row 1 of transition holds a NaN, infinite or negative entry"),
    ("MarkovSource/nan_row", lambda: MarkovSource(torch.tensor([[0.5, 0.5], [float("nan"), 1.0]])), ValueError,
     "every row must be a probability distribution"),
    ("MarkovSource/row_sum_not_one", lambda: MarkovSource(torch.tensor([[0.5, 0.6], [0.5, 0.5]])), ValueError,
     "divide each row by its sum"),
    ("MarkovSource/integer_matrix", lambda: MarkovSource(torch.eye(2, dtype=torch.long)), TypeError,
     "transition must be a floating-point tensor"),
    ("MarkovSource/not_square", lambda: MarkovSource(torch.full((2, 3), 1 / 3)), ValueError, "a square V x V matrix"),
    ("MarkovSource.random/infinite_sharpness", lambda: MarkovSource.random(4, sharpness=float("inf")), ValueError,
     "sharpness must be >= 0 and finite"),
    ("MarkovSource.sample/length_zero", lambda: MarkovSource.random(4).sample(2, 0, torch.Generator()), ValueError, "an int >= 1"),
    ("lm_batch/one_token_sequence", lambda: lm_batch([torch.tensor([3])]), ValueError, "each at least 2 tokens long"),
    ("lm_batch/lists_not_tensors", lambda: lm_batch([[1, 2, 3]]), TypeError, "1-D integer token tensors"),
    ("lm_batch/negative_token", lambda: lm_batch([torch.tensor([1, 2, 3]), torch.tensor([4, -100, 5])]), ValueError,
     "sequence 1 holds the negative token id -100; token ids must be >= 0"),
    ("lm_batch/float_tokens", lambda: lm_batch([torch.tensor([1.5, 2.0])]), TypeError, "integer token tensors"),
    # launcher, distributed, checks, widgets, checkpoint
    ("torchrun/missing_script", not_a_script, FileNotFoundError, "pass the path of a .py file"),
    ("torchrun/nproc_zero", lambda: torchrun(__file__, nproc=0), ValueError, "nproc must be an int >= 1"),
    ("torchrun/timeout_zero", lambda: torchrun(__file__, timeout=0), ValueError, "a positive number of seconds"),
    ("torchrun/args_one_string", lambda: torchrun(__file__, args="--steps 3"), TypeError, "['--steps', '3']"),
    ("session/not_started_by_torchrun", lambda: distributed.session().__enter__(), RuntimeError,
     "dmuon_edu.launch.torchrun(path, nproc=2)"),
    ("session/timeout_zero", lambda: distributed.session(timeout_s=0).__enter__(), ValueError,
     "timeout_s must be a positive number of seconds"),
    ("barrier/without_a_process_group", lambda: distributed.barrier(), RuntimeError,
     "inside distributed.session()"),
    ("run_check/unknown_exercise", lambda: run_check("train_stepp", print), ValueError, "known exercises: "),
    ("run_check/result_instead_of_function", lambda: run_check("train_step_with_accumulation", 0.5), TypeError,
     "pass your function itself"),
    ("widgets/accum_steps_zero", lambda: widgets.lr_scaling_figure("sgd", 0, lr=0.1, scale_loss=False), ValueError,
     "between 1 and"),
    ("widgets/widget_accum_steps_too_large", lambda: widgets.LrScalingWidget(accum_steps=100), ValueError, "between 1 and"),
    ("widgets/scale_loss_a_string", lambda: widgets.lr_scaling_figure("sgd", 4, lr=0.1, scale_loss="no"), TypeError,
     "scale_loss must be True or False, got 'no'"),
    ("widgets/unknown_optimizer", lambda: widgets.lr_scaling_figure("adam", 4, lr=0.1, scale_loss=False), ValueError,
     "use one of sgd, momentum, adamw, muon"),
    ("dmuon.Muon/adamw_lr_negative_at_step", negative_adamw_lr_set_after_construction, ValueError, "1e-3 is the usual value"),
    ("dmuon.Muon/muon_lr_nan_at_step", nan_muon_lr_set_after_construction, ValueError,
     "lr must be >= 0 and finite, got nan; pass a positive learning rate, e.g. 0.02"),
    ("dmuon.imbalance/owner_outside_the_world", lambda: dmuon.imbalance({"a": 2}, {"a": (4, 4)}, 2), ValueError,
     "pass the world size the plan was made for"),
    ("dmuon.clip_grad_norm_/negative_max_norm", lambda mesh: dmuon.clip_grad_norm_(dedicated(mesh), -1.0), ValueError,
     "a negative one would flip every gradient"),
    ("dmuon.Muon/lr_nan", lambda mesh: dmuon.Muon(dedicated(mesh), lr=float("nan")), ValueError,
     "lr must be >= 0 and finite, got nan"),
    ("dmuon.Muon/adamw_lr_inf", lambda mesh: dmuon.Muon(dedicated(mesh), adamw_lr=float("inf")), ValueError,
     "adamw_lr must be >= 0 and finite, got inf"),
    ("dmuon.clip_grad_norm_/zero_max_norm", lambda mesh: dmuon.clip_grad_norm_(dedicated(mesh), 0.0), ValueError,
     "0 would zero every gradient"),
    ("dmuon.set_optimizer_state_dict/nan_momentum", nan_momentum_loaded_into_dmuon, ValueError,
     "the momentum buffer of layers.0.up_proj.weight in this optimizer state dict holds NaN or Inf"),
    ("checkpoint.load/missing_directory", lambda tmp_path: checkpoint.load({}, tmp_path / "nope"), FileNotFoundError,
     "pass the directory that checkpoint.save wrote"),
    ("checkpoint.load/half_written", half_written_checkpoint, checkpoint.IncompleteCheckpointError,
     "Resume from an earlier checkpoint"),
    ("checkpoint.save/state_not_a_dict", lambda tmp_path: checkpoint.save([1], tmp_path / "c"), TypeError,
     "{'model': ..., 'optim': ...}"),
    # dmuon (one-rank gloo group)
    ("dmuon/dedicate_after_fully_shard", sharded_then_dedicated, RuntimeError,
     "call dmuon.dedicate_params(model, mesh, predicate) first, then fully_shard"),
    ("dmuon/predicate_selects_1d_parameter", lambda mesh: dmuon.dedicate_params(Tiny(), mesh, lambda n, p: "proj" in n),
     ValueError, "add `and p.ndim == 2` to the predicate"),
    ("dmuon/predicate_selects_nothing", lambda mesh: dmuon.dedicate_params(Tiny(), mesh, lambda n, p: False), ValueError,
     "e.g. lambda n, p: 'proj' in n and p.ndim == 2"),
    ("dmuon/dedicate_twice", lambda mesh: dmuon.dedicate_params(dedicated(mesh, shard=False), mesh, is_dedicated), RuntimeError,
     "call it once"),
    ("dmuon/2d_mesh", lambda mesh: dmuon.dedicate_params(Tiny(), init_device_mesh("cpu", (1, 1)), is_dedicated), ValueError,
     "init_device_mesh(device_type, (world_size,))"),
    ("dmuon/z2_z3_not_bool", lambda mesh: dmuon.dedicate_params(Tiny(), mesh, is_dedicated, reshard_after_forward="z2"),
     TypeError, "True (Z3) or False (Z2)"),
    ("dmuon/muon_without_dedicate", lambda mesh: dmuon.Muon(Tiny()), ValueError, "call dmuon.dedicate_params"),
    ("dmuon/muon_given_parameters", lambda mesh: dmuon.Muon(list(Tiny().parameters())), TypeError,
     "takes the model (after dedicate_params and fully_shard)"),
    ("dmuon/muon_state_dict", lambda mesh: dmuon.Muon(dedicated(mesh)).state_dict(), RuntimeError,
     "use dmuon.get_optimizer_state_dict(model, optimizer)"),
    ("dmuon/optimizer_of_another_model", optimizer_of_another_model, TypeError, "pass the dmuon.Muon optimizer that was built"),
    ("dmuon/unsupported_state_dict_option", lambda mesh: dmuon.get_model_state_dict(
        dedicated(mesh), dmuon.StateDictOptions(broadcast_from_rank0=True)), ValueError, "use full_state_dict, cpu_offload"),
    ("dmuon/plan_owners_world_size_zero", lambda mesh: dmuon.plan_owners({"w": (2, 2)}, 0), ValueError, "an int >= 1"),
    ("dmuon/train_step_with_accumulation_clipping", accumulated_and_clipped_with_dmuon, TypeError,
     "clip with dmuon.clip_grad_norm_(model, max_norm)"),
    ("dmuon/torch_dcp_get_state_dict", torch_dcp_state_dict_of_dmuon, RuntimeError, "dmuon.get_optimizer_state_dict"),
    ("dmuon/state_dict_options_and_flags", lambda mesh: dmuon.get_model_state_dict(
        dedicated(mesh), dmuon.StateDictOptions(), rank0_only=False), TypeError, "not both"),
    ("dmuon/clip_grad_norm_of_a_list", lambda mesh: dmuon.clip_grad_norm_([], 1.0), TypeError,
     "takes the model or its dmuon.Muon"),
]


@pytest.mark.parametrize("call,error,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_an_error_that_says_what_to_do(request, call, error, fragment):
    names = call.__code__.co_varnames[: call.__code__.co_argcount]
    kwargs = {name: request.getfixturevalue(name) for name in names}
    with pytest.raises(error) as raised:
        call(**kwargs)
    assert fragment in str(raised.value), str(raised.value)


def test_the_table_is_large_enough_and_every_id_is_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) >= 25 and len(set(ids)) == len(ids)
