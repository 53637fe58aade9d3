"""The bad-input audit: every misuse a learner can make of a public function, and what it gets back.

One table, one row per bad input: the call, the error type, and a fragment of the
message that says what to do (not only what was wrong). The test ids name the bad
inputs. A second table takes refused calls that could have changed something (a
weight, an optimizer state) and checks that they changed nothing. Below them, the bad
inputs whose answer is a correct result rather than an error. dmuon cases run on a
one-rank gloo process group in this process; the dmuon misuse that needs several ranks
(a mesh that does not span the process group, stepping inside no_sync, non-finite
gradients on one rank) is in tests/test_reliability.py (test_distributed_misuse_raises_on_every_rank,
test_non_finite_gradients_skip_the_step_on_every_rank) and tests/test_dmuon.py (windows of
different lengths on two ranks, a rank silent in a reduce), the launcher's faults there and
in tests/test_data_parallel.py.
"""

import json
import math
import os
import warnings

import pytest
from helpers import Tiny
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import dmuon_edu
from dmuon_edu import checkpoint, distributed, dmuon, muon
from dmuon_edu.course import pitfalls, widgets
from dmuon_edu.course.checks import run_check
from dmuon_edu.course.data import MarkovSource, lm_batch
from dmuon_edu.course.dmuon_problem import is_dedicated
from dmuon_edu.course.timeline import Timeline
from dmuon_edu.launch import RankFailedError, torchrun
from dmuon_edu.newton_schulz import newton_schulz


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


def dedicated(mesh, shard=True, model=None):
    model = Tiny() if model is None else model
    dmuon.dedicate_params(model, mesh, is_dedicated)
    if shard:
        fully_shard(model, mesh=mesh)
    return model


def ddp_dedicated(mesh, replicated=True, model=None):
    model = Tiny() if model is None else model
    dmuon.dedicate_params_ddp(model, mesh, is_dedicated)
    if replicated:
        dmuon.replicate(model, mesh)
    return model


def ddp_dedicated_then_sharded(mesh):
    model = ddp_dedicated(mesh, replicated=False)
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


def a_group_of_another_route_loaded(mesh):
    model = dedicated(mesh)
    opt = dmuon.Muon(model)
    saved = dmuon.get_optimizer_state_dict(model, opt, rank0_only=False)
    saved["param_groups"][0]["use_muon"] = False  # it used to be copied in: the optimizer-form clip then saw nothing
    dmuon.set_optimizer_state_dict(model, opt, saved)


def a_non_finite_gradient_clipped_with_error_if_nonfinite(mesh):
    model = dedicated(mesh)
    model(torch.full((2, 4), float("inf"))).sum().backward()
    dmuon.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)


def tensor_parallel_of_degree_one(mesh):
    grid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = Tiny()
    parallelize_module(model.layers[0]["up_proj"], grid["tp"], ColwiseParallel())
    dmuon.dedicate_params(model, grid["dp"], is_dedicated)


def session_with_rank_but_no_world_size(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with distributed.session():
        pass


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


def saved_checkpoint(tmp_path):
    """A checkpoint of a small model at tmp_path/ckpt, and a file outside it."""
    checkpoint.save({"model": nn.Linear(2, 2).state_dict()}, tmp_path / "ckpt", step=1)
    (tmp_path / "outside.txt").write_text("not the checkpoint's")
    return tmp_path / "ckpt"


def marker_listing(tmp_path, name, make=None):
    """Load a checkpoint whose marker lists ``name`` (made inside it by ``make(path)``) among its files."""
    path = saved_checkpoint(tmp_path)
    if make:
        make(path / name)
    marker = json.loads((path / checkpoint.MARKER).read_text())
    marker["sha256"][name] = "0" * 64
    (path / checkpoint.MARKER).write_text(json.dumps(marker))
    checkpoint.load({"model": nn.Linear(2, 2).state_dict()}, path)


def step_of(model, optimizer, microbatches=None, loss_fn=F.mse_loss, **kwargs):
    return dmuon_edu.train_step_with_accumulation(model, optimizer, [(X, X)] if microbatches is None else microbatches,
                                                 loss_fn, **kwargs)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def own_step(model, microbatches=None, **kwargs):
    """A step of ``model`` with an optimizer of its own."""
    return step_of(model, sgd(model), microbatches, **kwargs)


def own_train(loader, **kwargs):
    model = nn.Linear(2, 2)
    return dmuon_edu.train(model, sgd(model), loader, F.mse_loss, 1, **kwargs)


def frozen_step():
    model = nn.Linear(2, 2)
    optimizer = sgd(model)
    model.requires_grad_(False)
    step_of(model, optimizer)


def step_under_no_grad():
    model = nn.Linear(2, 2)
    with torch.no_grad():
        step_of(model, sgd(model))


def with_matrix(weight):
    """A Tiny whose first up_proj weight is ``weight`` (not dedicated yet)."""
    model = Tiny()
    model.layers[0]["up_proj"].weight = nn.Parameter(weight)
    return model


def muon_step_with_gradient(gradient):
    p = nn.Parameter(torch.zeros(3, 3))
    optimizer = muon.Muon([p], lr=0.02)
    if gradient.dtype == p.dtype:
        p.grad = gradient
    else:  # assigning p.grad checks the dtype; replacing p.grad.data, as hand-made gradient code may, does not
        p.grad = torch.zeros(3, 3)
        p.grad.data = gradient
    optimizer.step()


def muon_loading_a_buffer_of_shape(shape):
    p = nn.Parameter(torch.zeros(3, 3))
    optimizer = muon.Muon([p], lr=0.02)
    p.grad = torch.ones(3, 3)
    optimizer.step()
    saved = optimizer.state_dict()
    saved["state"][0]["momentum_buffer"] = torch.zeros(shape)
    optimizer.load_state_dict(saved)


def dmuon_model_state_dict_with(mesh, name, value):
    model = dedicated(mesh)
    saved = dmuon.get_model_state_dict(model)
    saved[name] = value
    dmuon.set_model_state_dict(model, saved)


def dmuon_momentum_of_shape(mesh, shape):
    model = dedicated(mesh)
    optimizer = dmuon.Muon(model)
    saved = dmuon.get_optimizer_state_dict(model, optimizer)
    saved["state"]["layers.0.up_proj.weight"]["momentum_buffer"] = torch.zeros(shape)
    dmuon.set_optimizer_state_dict(model, optimizer, saved)


def dmuon_optimizer_given_the_models_state_dict(mesh):
    model = dedicated(mesh)
    dmuon.set_optimizer_state_dict(model, dmuon.Muon(model), dmuon.get_model_state_dict(model))


X = torch.randn(3, 2)
DUPLICATED = nn.Parameter(torch.zeros(3, 3))
SHARED = torch.zeros(5, 3)  # two parameters over rows 0-3 and 1-4 of it

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
    ("train_step/optimizer_none", lambda: step_of(nn.Linear(2, 2), None), TypeError,
     "optimizer must be a torch.optim.Optimizer, got None; build one on the model's parameters"),
    ("train_step/model_not_callable", lambda: step_of("model", sgd(nn.Linear(2, 2))), TypeError,
     "model must be callable, got the string 'model'; pass the model (an nn.Module)"),
    ("train_step/loss_without_grad", lambda: lm_step(lambda p, t: F.mse_loss(p.detach(), t)), ValueError,
     "the loss of microbatch 0 does not require grad, so backward cannot reach the parameters; does loss_fn"),
    ("train_step/under_no_grad", step_under_no_grad, ValueError, "runs under torch.no_grad(): call it outside"),
    ("train_step/all_parameters_frozen", frozen_step, ValueError,
     "every parameter of the optimizer is frozen (requires_grad=False)"),
    ("train_step/optimizer_of_another_model", lambda: step_of(nn.Linear(2, 2), sgd(nn.Linear(2, 2))), ValueError,
     "build the optimizer on model.parameters()"),
    ("train_step/fp16_model_fp32_inputs", lambda: own_step(nn.Linear(2, 2).half()), TypeError,
     "are torch.float32 but the model's parameters are torch.float16: convert them"),
    ("train_step/scaler_not_a_grad_scaler", lambda: own_step(nn.Linear(2, 2), scaler="yes"),
     TypeError, "scaler must be a torch.amp.GradScaler, got the string 'yes'"),
    ("train_step/meta_inputs", lambda: linear_step([(X.to("meta"), X)]), ValueError,
     "the inputs of microbatch 0 are on the meta device"),
    ("train_step/meta_model", lambda: own_step(nn.Linear(2, 2).to("meta")), ValueError,
     "the model's parameters are on the meta device, which holds no values: materialise it first"),
    ("train_step/targets_a_list", lambda: linear_step([(X, X.tolist())]), TypeError,
     "the targets of microbatch 0 are a list of length 3 of numbers, not a tensor: pass torch.tensor(targets)"),
    ("train_step/inputs_a_list", lambda: linear_step([(X.tolist(), X)]), TypeError, "pass torch.tensor(inputs)"),
    ("train_step/targets_a_numpy_array", lambda: linear_step([(X, X.numpy())]), TypeError,
     "the targets of microbatch 0 are a numpy.ndarray of shape (3, 2), not a tensor: pass torch.as_tensor(targets)"),
    ("train_step/targets_a_number", lambda: linear_step([(X, 3)]), TypeError,
     "the targets of microbatch 0 are the number 3, not a tensor: pass torch.tensor(targets)"),
    ("accumulation_windows/batches_none", lambda: dmuon_edu.accumulation_windows(None, 2), TypeError,
     "batches must be an iterable, got None; pass a list of micro-batches or a DataLoader"),
    ("train/loader_none", lambda: own_train(None), TypeError, "loader must be an iterable, got None"),
    ("train/progress_a_string", lambda: own_train([(X, X)], progress="no"), TypeError, "progress must be True or False, got 'no'"),
    ("summed_token_loss/float_targets", lambda: dmuon_edu.summed_token_loss(torch.randn(3, 5), torch.randn(3)), TypeError,
     "convert with targets.long()"),
    ("summed_token_loss/targets_of_another_shape",
     lambda: dmuon_edu.summed_token_loss(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long)), ValueError,
     "targets need one token id per row of logits"),
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
    ("newton_schulz/nan_coefficient", lambda: newton_schulz(torch.randn(4, 4), coefficients=(float("nan"), 0, 0)),
     ValueError, "coefficients must be finite numbers, got (nan, 0, 0); 'jordan' is the usual set"),
    ("newton_schulz/infinite_eps", lambda: newton_schulz(torch.randn(4, 4), eps=float("inf")), ValueError,
     "eps must be >= 0 and finite, got inf; 1e-7 is the usual value"),
    ("newton_schulz/eps_a_string", lambda: newton_schulz(torch.randn(4, 4), eps="1e-7"), TypeError,
     "eps must be a number, got the string '1e-7'; 1e-7 is the usual value"),
    ("newton_schulz/ten_million_steps", lambda: newton_schulz(torch.randn(4, 4), steps=10**7), ValueError,
     "steps must be at most 100, got 10000000: more steps do not converge further"),
    ("newton_schulz/overwrite_an_expanded_input",
     lambda: newton_schulz(torch.randn(1, 4).expand(4, 4), overwrite_input=True), ValueError,
     "G's entries share memory (an expand()-ed or as_strided view), so Newton-Schulz cannot write into it: pass "
     "overwrite_input=False, or G.clone()"),
    ("muon/ns_steps_ten_million", lambda: muon.Muon([nn.Parameter(torch.zeros(3, 3))], lr=0.02, ns_steps=10**7),
     ValueError, "ns_steps must be at most 100"),
    ("muon/a_model_instead_of_its_parameters", lambda: muon.Muon(nn.Linear(3, 3), lr=0.02), TypeError,
     "Muon takes a list of parameters, not the model (Linear): pass its hidden matrices, e.g. muon_param_groups(model)[0]"),
    ("muon/empty_parameter_list", lambda: muon.Muon([], lr=0.02), ValueError,
     "Muon got an empty list of parameters: pass the model's hidden matrices"),
    ("muon/lr_none", lambda: muon.Muon([torch.nn.Parameter(torch.randn(4, 4))], lr=None), TypeError,
     "lr must be a number, got None; pass e.g. lr=0.02"),
    ("muon/empty_parameter_groups", lambda: muon.Muon([{"params": []}, {"params": []}], lr=0.02), ValueError,
     "Muon got parameter groups that are all empty: give at least one group the model's hidden matrices"),
    ("muon/expanded_parameter", lambda: muon.Muon([nn.Parameter(torch.zeros(1, 3).expand(3, 3))], lr=0.02), ValueError,
     "has entries that share memory (an expand()-ed tensor), which Muon cannot update: give it its own"),
    ("muon/parameters_sharing_memory", lambda: muon.Muon([nn.Parameter(SHARED[:4]), nn.Parameter(SHARED[1:])], lr=0.02),
     ValueError, "Muon would update the shared entries twice per step. Give each parameter storage of its own"),
    ("muon/meta_parameter", lambda: muon.Muon([nn.Parameter(torch.zeros(3, 3, device="meta"))], lr=0.02), ValueError,
     "is on the meta device, which holds no values: materialise the model first"),
    ("muon/float64_gradient_on_float32_parameter", lambda: muon_step_with_gradient(torch.ones(3, 3, dtype=torch.float64)),
     ValueError, "is torch.float64 of shape (3, 3), but the parameter is torch.float32 of shape (3, 3): Muon steps a "
     "parameter with a gradient like it. Set p.grad from backward, or convert it: p.grad = p.grad.to(p.dtype)"),
    ("muon/sparse_gradient", lambda: muon_step_with_gradient(torch.eye(3).to_sparse()), TypeError,
     "Muon takes dense gradients"),
    ("muon/load_a_momentum_buffer_of_another_shape", lambda: muon_loading_a_buffer_of_shape((2, 2)), ValueError,
     "has shape (2, 2), but the parameter has shape (3, 3): the state_dict is another model's"),
    ("muon/load_state_dict_none", lambda: muon.Muon([nn.Parameter(torch.zeros(3, 3))], lr=0.02).load_state_dict(None),
     TypeError, "state_dict must be what Muon.state_dict() returns, a dict with 'state' and 'param_groups', got None"),
    ("muon_param_groups/a_list", lambda: muon.muon_param_groups([nn.Linear(2, 2)]), TypeError,
     "muon_param_groups takes the model (an nn.Module), got a list of length 1"),
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
    ("MarkovSource.random/seed_a_string", lambda: MarkovSource.random(4, seed="0"), TypeError,
     "seed must be an int, got the string '0'"),
    # pitfalls, widgets, timeline
    ("effective_lr_multiplier/infinite_lr", lambda: pitfalls.effective_lr_multiplier("sgd", 4, lr=float("inf")),
     ValueError, "lr must be > 0 and finite, got inf"),
    ("effective_lr_multiplier/lr_a_string", lambda: pitfalls.effective_lr_multiplier("sgd", 4, lr="0.1"), TypeError,
     "lr must be a number, got the string '0.1'; pass a positive number such as 0.1"),
    ("relative_decay_strength/weight_decay_a_string", lambda: pitfalls.relative_decay_strength("sgd", 4, "0.1"),
     TypeError, "weight_decay must be a number, got the string '0.1'"),
    ("training_curve/negative_steps", lambda: pitfalls.training_curve("sgd", 4, scale_loss=True, steps=-1), ValueError,
     "steps must be an int >= 1, got -1"),
    ("widgets/unknown_optimizer_of_the_widget", lambda: widgets.lr_scaling_widget("adam"), ValueError,
     "unknown optimizer 'adam'; use one of sgd, momentum, adamw, muon"),
    ("widgets/cost_widget_with_no_rank", lambda: widgets.cost_widget(W=0), ValueError, "W must be between 1 and 64"),
    ("widgets/cost_figure_no_sync_a_string", lambda: widgets.cost_figure(8, 4, 12, "no"), TypeError,
     "no_sync must be True or False, got 'no'"),
    ("Timeline/a_number_for_the_layers", lambda: Timeline(3), TypeError,
     "layers must be an iterable, got an int; pass the modules to time, e.g. model.layers"),
    # launcher, distributed, checks, widgets, checkpoint
    ("torchrun/missing_script", not_a_script, FileNotFoundError, "pass the path of a .py file"),
    ("torchrun/nproc_zero", lambda: torchrun(__file__, nproc=0), ValueError, "nproc must be an int >= 1"),
    ("torchrun/timeout_zero", lambda: torchrun(__file__, timeout=0), ValueError, "a positive number of seconds"),
    ("torchrun/args_one_string", lambda: torchrun(__file__, args="--steps 3"), TypeError, "['--steps', '3']"),
    ("torchrun/two_nodes_without_an_endpoint", lambda: torchrun(__file__, nnodes=2), ValueError,
     "nnodes=2 needs rdzv_endpoint='host:port', an address every machine can reach"),
    ("torchrun/endpoint_without_a_port", lambda: torchrun(__file__, nnodes=2, rdzv_endpoint="10.0.0.1"), ValueError,
     "rdzv_endpoint must be 'host:port', e.g. '10.0.0.1:29400'"),
    ("torchrun/script_none", lambda: torchrun(None), TypeError, "script must be the path of a .py file (a str or a Path)"),
    ("session/infinite_timeout", lambda: distributed.session(timeout_s=float("inf")).__enter__(), ValueError,
     "timeout_s must be a positive number of seconds, finite, got inf"),
    ("checkpoint.latest/root_none", lambda: checkpoint.latest(None), TypeError,
     "root must be a directory's path (a str or a Path), got None"),
    ("checkpoint.save/path_none", lambda: checkpoint.save({}, None), TypeError, "path must be a directory's path"),
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
    ("dmuon.clip_grad_norm_/max_norm_a_string", lambda mesh: dmuon.clip_grad_norm_(dedicated(mesh), "1.0"), TypeError,
     "max_norm must be a number or None (measure only), got the string '1.0'; 1.0 is the usual value"),
    ("dmuon.dedicate_params/mesh_none", lambda mesh: dmuon.dedicate_params(torch.nn.Linear(4, 4), None, lambda n, p: True),
     TypeError, "dedicate_params needs a 1-D DeviceMesh as mesh, got NoneType: use init_device_mesh"),
    ("dmuon.clip_grad_norm_/zero_max_norm", lambda mesh: dmuon.clip_grad_norm_(dedicated(mesh), 0.0), ValueError,
     "0 would zero every gradient"),
    ("dmuon.set_optimizer_state_dict/a_group_of_another_route", a_group_of_another_route_loaded, ValueError,
     "param group 0 of the optimizer state dict has use_muon=False, this optimizer's group 0 has use_muon=True: "
     "the state dict's groups are not this optimizer's, and nothing was loaded"),
    ("dmuon/param_policy_override_matches_nothing", lambda mesh: dmuon.dedicate_params(
        Tiny(), mesh, is_dedicated, param_policy={"overrides": [{"name": "up_porj", "set": {"route": "adamw"}}]}),
     ValueError, "param_policy['overrides'][0] (name ['up_porj']) matches none of the parameters the predicate "
                 "selected, so it would change nothing: is a name misspelt?"),
    ("dmuon.NewtonSchulz/nan_coefficient", lambda: dmuon.NewtonSchulz(coefficients=[(float("nan"), 0, 0)]),
     ValueError, "coefficients must be finite numbers"),
    ("dmuon.NewtonSchulz/diverging_coefficients", lambda: dmuon.NewtonSchulz(coefficients=[(1e30, 0, 0)]),
     ValueError, "take a normalised matrix's singular values (in [0, 1]) to 1e+30, beyond 100: such a set diverges"),
    ("newton_schulz/diverging_coefficients", lambda: newton_schulz(torch.eye(3), coefficients=(1e30, 0, 0)),
     ValueError, "such a set diverges and would make the update, then the weights, non-finite"),
    ("dmuon.summarize_param_groups/optimizer_of_another_model", lambda mesh: dmuon.summarize_param_groups(
        dedicated(mesh), dmuon.Muon(dedicated(mesh))), TypeError,
     "the optimizer is the dmuon.Muon of another model: pass the dmuon.Muon optimizer that was built for this model"),
    ("dmuon.summarize_param_groups/a_torch_adamw", lambda mesh: dmuon.summarize_param_groups(
        dedicated(mesh), torch.optim.AdamW(Tiny().parameters())), TypeError,
     "the optimizer is a AdamW: pass the dmuon.Muon optimizer that was built for this model"),
    ("dmuon/compute_dtype_int8", lambda mesh: dmuon.dedicate_params(Tiny(), mesh, is_dedicated, compute_dtype=torch.int8),
     ValueError, "compute_dtype: torch.int8 is not a floating-point dtype"),
    ("dmuon/tensor_parallel_of_degree_one", tensor_parallel_of_degree_one, ValueError,
     "on a tensor-parallel mesh of 1 rank (('tp',)), which shards nothing, and dedicate_params takes plain matrices "
     "then: skip parallelize_module when the TP degree is 1"),
    ("dmuon/hook_boundary_predicate_of_name_and_param", lambda mesh: dmuon.dedicate_params(
        Tiny(), mesh, is_dedicated, hook_boundary_predicate=lambda name, p: "layers" in name), TypeError,
     "hook_boundary_predicate is called as hook_boundary_predicate(module), but it takes (name, p); it takes the module"),
    ("dmuon.clip_grad_norm_/non_finite_norm", a_non_finite_gradient_clipped_with_error_if_nonfinite, RuntimeError,
     "the global gradient norm of order 2.0 is non-finite (nan), so it cannot be clipped"),
    ("session/rank_without_world_size", session_with_rank_but_no_world_size, RuntimeError,
     "RANK is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not"),
    ("MarkovSource.random/a_hundred_thousand_tokens", lambda: MarkovSource.random(100_000), ValueError,
     "has vocab_size ** (order + 1) = 10,000,000,000 transition probabilities (80.0 GB in float64)"),
    ("dmuon.set_optimizer_state_dict/nan_momentum", nan_momentum_loaded_into_dmuon, ValueError,
     "the momentum buffer of layers.0.up_proj.weight in this optimizer state dict holds NaN or Inf"),
    ("checkpoint.load/missing_directory", lambda tmp_path: checkpoint.load({}, tmp_path / "nope"), FileNotFoundError,
     "pass the directory that checkpoint.save wrote"),
    ("checkpoint.load/half_written", half_written_checkpoint, checkpoint.IncompleteCheckpointError,
     "Resume from an earlier checkpoint"),
    ("checkpoint.save/state_not_a_dict", lambda tmp_path: checkpoint.save([1], tmp_path / "c"), TypeError,
     "{'model': ..., 'optim': ...}"),
    ("checkpoint.save/path_under_a_file", lambda tmp_path: checkpoint.save(
        {}, saved_checkpoint(tmp_path) / checkpoint.MARKER / "step-2"), checkpoint.CheckpointError,
     "which is a file, and a checkpoint is a directory; choose a path whose existing parts are directories"),
    # The marker never makes the loader read a file but the checkpoint's own (it used to hang on /dev/zero).
    ("checkpoint.load/marker_lists_dev_zero", lambda tmp_path: marker_listing(tmp_path, "/dev/zero"),
     checkpoint.CorruptCheckpointError, "lists '/dev/zero', which is not a plain name inside the checkpoint directory"),
    ("checkpoint.load/marker_lists_a_file_above", lambda tmp_path: marker_listing(tmp_path, "../outside.txt"),
     checkpoint.CorruptCheckpointError, "lists '../outside.txt', which is not a plain name inside the checkpoint"),
    ("checkpoint.load/marker_lists_a_symlink_out", lambda tmp_path: marker_listing(
        tmp_path, "link", lambda link: link.symlink_to(link.parent.parent / "outside.txt")),
     checkpoint.CorruptCheckpointError, "lists 'link', which leads outside the checkpoint directory"),
    ("checkpoint.load/marker_lists_a_fifo", lambda tmp_path: marker_listing(tmp_path, "pipe", os.mkfifo),
     checkpoint.CorruptCheckpointError, "lists 'pipe', which is not a regular file (a directory, a device or a FIFO)"),
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
    ("dmuon/non_contiguous_matrix", lambda mesh: dmuon.dedicate_params(with_matrix(torch.randn(4, 4).T), mesh, is_dedicated),
     ValueError, "layers.0.up_proj.weight is not contiguous (a transposed or expand()-ed view), and a dedicated matrix "
     "travels as one block of memory of its own: replace it with nn.Parameter(weight.detach().contiguous())"),
    ("dmuon/expanded_matrix",
     lambda mesh: dmuon.dedicate_params(with_matrix(torch.randn(1, 4).expand(4, 4)), mesh, is_dedicated), ValueError,
     "is not contiguous (a transposed or expand()-ed view)"),
    ("dmuon/view_into_a_larger_tensor",
     lambda mesh: dmuon.dedicate_params(with_matrix(torch.randn(8, 4)[4:]), mesh, is_dedicated), ValueError,
     "(it is a view into a larger one); dedicated parameters need their own: replace it with "
     "nn.Parameter(weight.detach().clone())"),
    ("dmuon/dedicate_a_list", lambda mesh: dmuon.dedicate_params([Tiny()], mesh, is_dedicated), TypeError,
     "dedicate_params takes the model (an nn.Module), got a list of length 1; pass the model itself"),
    ("dmuon/predicate_a_string", lambda mesh: dmuon.dedicate_params(Tiny(), mesh, "proj"), TypeError,
     "predicate must be callable, got the string 'proj'; pass a function of (name, param)"),
    ("dmuon/predicate_of_one_argument", lambda mesh: dmuon.dedicate_params(Tiny(), mesh, lambda name: "proj" in name),
     TypeError, "predicate is called as predicate(name, param), but it takes (name)"),
    ("dmuon/no_sync_of_a_list", lambda mesh: dmuon.no_sync([dedicated(mesh)]).__enter__(), TypeError,
     "dmuon takes the model (an nn.Module), got a list of length 1; pass the model that dmuon.dedicate_params"),
    ("dmuon/held_bytes_of_a_string", lambda mesh: dmuon.held_bytes("model"), TypeError,
     "dmuon takes the model (an nn.Module), got the string 'model'"),
    # dmuon's DDP backend (dedicate_params_ddp, replicate)
    ("dmuon.replicate/before_dedicate_params_ddp", lambda mesh: dmuon.replicate(Tiny(), mesh), ValueError,
     "call dmuon.dedicate_params_ddp(model, mesh, predicate) first"),
    ("dmuon.replicate/after_dedicate_params", lambda mesh: dmuon.replicate(dedicated(mesh, shard=False), mesh),
     ValueError, "(this model was prepared by dedicate_params, whose other parameters fully_shard shards)"),
    ("dmuon.replicate/twice", lambda mesh: dmuon.replicate(ddp_dedicated(mesh), mesh), RuntimeError, "call it once"),
    ("dmuon.dedicate_params_ddp/2d_mesh",
     lambda mesh: dmuon.dedicate_params_ddp(Tiny(), init_device_mesh("cpu", (1, 1)), is_dedicated), ValueError,
     "For HSDP use dedicate_params(model, mesh2d['shard'], predicate, replicate_mesh=mesh2d['replicate'])"),
    ("dmuon.dedicate_params_ddp/after_fully_shard", lambda mesh: dmuon.dedicate_params_ddp(
        dedicated(mesh), mesh, is_dedicated), RuntimeError, "they replace fully_shard, not join it"),
    ("dmuon.dedicate_params_ddp/sharded_adamw_route", lambda mesh: dmuon.dedicate_params_ddp(
        Tiny(), mesh, is_dedicated, param_policy={"defaults": {"route": "sharded_adamw"}}), ValueError,
     "shards nothing: route it to 'adamw' (its owner steps it with AdamW), or leave it out of the predicate"),
    ("dmuon.Muon/ddp_without_replicate", lambda mesh: dmuon.Muon(ddp_dedicated(mesh, replicated=False)), ValueError,
     "is neither dedicated nor replicated, so nothing would average its gradient: call dmuon.replicate(model, mesh)"),
    ("dmuon.Muon/ddp_with_fully_shard", lambda mesh: dmuon.Muon(ddp_dedicated_then_sharded(mesh)), ValueError,
     "the DDP backend replaces fully_shard. Call dmuon.replicate(model, mesh) instead of fully_shard"),
    ("dmuon.Muon/adamw_betas_a_float", lambda mesh: dmuon.Muon(dedicated(mesh), adamw_betas=0.9), TypeError,
     "adamw_betas must be a pair of numbers, got 0.9; (0.9, 0.999) is the default"),
    ("dmuon.Muon/adamw_lr_a_string", lambda mesh: dmuon.Muon(dedicated(mesh), adamw_lr="1e-3"), TypeError,
     "adamw_lr must be a number, got '1e-3'"),
    ("dmuon.Muon/float16_adamw_eps_rounds_to_zero", lambda mesh: dmuon.Muon(dedicated(mesh, model=Tiny().half())),
     ValueError, "adamw_eps=1e-08 rounds to 0 in torch.float16, the dtype of AdamW parameters of this model, so AdamW "
     "would write NaN into them. Keep the parameters in float32"),
    ("dmuon.set_model_state_dict/none", lambda mesh: dmuon.set_model_state_dict(dedicated(mesh), None), TypeError,
     "state_dict must be a dict {name: tensor}, as dmuon.get_model_state_dict returns, got None"),
    ("dmuon.set_model_state_dict/entry_of_another_shape",
     lambda mesh: dmuon_model_state_dict_with(mesh, "layers.1.up_proj.weight", torch.zeros(3, 3)), ValueError,
     "layers.1.up_proj.weight in the state dict has shape (3, 3), but the model's has shape (4, 4): the state dict is "
     "another model's, and nothing was loaded"),
    ("dmuon.set_model_state_dict/entry_a_list",
     lambda mesh: dmuon_model_state_dict_with(mesh, "layers.0.norm.bias", [0.0] * 4), TypeError,
     "layers.0.norm.bias in the state dict is a list of length 4, not a tensor; nothing was loaded"),
    ("dmuon.set_optimizer_state_dict/the_models_state_dict", dmuon_optimizer_given_the_models_state_dict, TypeError,
     "state_dict must be what dmuon.get_optimizer_state_dict returns, a dict with 'state' and 'param_groups'"),
    ("dmuon.set_optimizer_state_dict/momentum_of_another_shape", lambda mesh: dmuon_momentum_of_shape(mesh, (3, 3)),
     ValueError, "the momentum buffer of layers.0.up_proj.weight in the state dict has shape (3, 3), but the model's "
     "has shape (4, 4)"),
    ("dmuon.plan_owners/negative_shape", lambda: dmuon.plan_owners({"w": (-3, 4)}, 2), ValueError,
     "w has shape (-3, 4): a shape is two ints >= 0, such as tuple(p.shape)"),
    ("dmuon.plan_owners/a_list_of_shapes", lambda: dmuon.plan_owners([(4, 4)], 2), TypeError,
     "shapes must be a dict {name: (m, n)}"),
    ("dmuon.imbalance/an_owner_without_a_shape", lambda: dmuon.imbalance({"a": 0}, {}, 2), ValueError,
     "a has an owner but no shape: pass the shapes the plan was made from"),
    ("muon/a_dtensor_parameter", lambda mesh: muon.Muon(
        [nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)]))], lr=0.02), TypeError,
     "is a DTensor (sharded by fully_shard), and Muon orthogonalises whole matrices: for a sharded model use dmuon.Muon"),
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


# --- a refused call changes nothing -------------------------------------------------------------------

def trained_linear():
    """A model and an SGD with momentum after one step: the optimizer holds state a refused call could touch."""
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    optimizer = sgd(model)
    step_of(model, optimizer)
    return model, optimizer


def refused_step(**step):
    model, optimizer = trained_linear()
    return lambda: step_of(model, optimizer, **step), lambda: (model.state_dict(), optimizer.state_dict())


def refused_step_of_another_model():
    model, optimizer = trained_linear()
    other = nn.Linear(2, 2)
    return lambda: step_of(other, optimizer), lambda: (model.state_dict(), optimizer.state_dict(), other.state_dict())


def refused_fp16_forward():
    torch.manual_seed(0)
    model = nn.Linear(2, 2).half()
    optimizer = sgd(model)
    return lambda: step_of(model, optimizer), lambda: (model.state_dict(), optimizer.state_dict())


def refused_muon_step():
    """Two parameters, the second with a float64 gradient: the first must not step either."""
    good, bad = nn.Parameter(torch.ones(3, 3)), nn.Parameter(torch.ones(3, 3))
    optimizer = muon.Muon([good, bad], lr=0.02)
    good.grad, bad.grad = torch.ones(3, 3), torch.zeros(3, 3)
    bad.grad.data = torch.ones(3, 3, dtype=torch.float64)
    return optimizer.step, lambda: (good.detach().clone(), bad.detach().clone(), optimizer.state_dict())


def refused_muon_load():
    p = nn.Parameter(torch.zeros(3, 3))
    optimizer = muon.Muon([p], lr=0.02)
    p.grad = torch.ones(3, 3)
    optimizer.step()
    saved = optimizer.state_dict()
    saved = {**saved, "state": {0: {"momentum_buffer": torch.zeros(2, 2)}}}
    return lambda: optimizer.load_state_dict(saved), optimizer.state_dict


def refused_overwrite():
    G = torch.randn(1, 4).expand(4, 4)
    return lambda: newton_schulz(G, overwrite_input=True), lambda: G.clone()


def dmuon_state(model, optimizer):
    return lambda: (dmuon.get_model_state_dict(model), dmuon.get_optimizer_state_dict(model, optimizer))


def refused_dmuon_model_load(mesh):
    model = dedicated(mesh)
    optimizer = dmuon.Muon(model)
    saved = {name: value + 1 for name, value in dmuon.get_model_state_dict(model).items()}
    saved["layers.1.up_proj.weight"] = torch.zeros(3, 3)  # every entry before it would load
    return lambda: dmuon.set_model_state_dict(model, saved), dmuon_state(model, optimizer)


def refused_dmuon_optimizer_load(mesh):
    model = dedicated(mesh)
    optimizer = dmuon.Muon(model)
    saved = dmuon.get_optimizer_state_dict(model, optimizer)
    for state in saved["state"].values():
        for value in state.values():
            value.add_(1)
    saved["state"]["layers.1.up_proj.weight"]["momentum_buffer"] = torch.zeros(3, 3)
    return lambda: dmuon.set_optimizer_state_dict(model, optimizer, saved), dmuon_state(model, optimizer)


# id (a row of CASES where there is one), setup returning (the refused call, what must not change)
UNCHANGED = [
    ("train_step/loss_without_grad", lambda: refused_step(loss_fn=lambda p, t: F.mse_loss(p.detach(), t))),
    ("train_step/targets_a_list", lambda: refused_step(microbatches=[(X, X.tolist())])),
    ("train_step/targets_a_numpy_array", lambda: refused_step(microbatches=[(X, X.numpy())])),
    ("train_step/scaler_not_a_grad_scaler", lambda: refused_step(scaler="yes")),
    ("train_step/meta_inputs", lambda: refused_step(microbatches=[(X.to("meta"), X)])),
    ("train_step/optimizer_of_another_model", refused_step_of_another_model),
    ("train_step/fp16_model_fp32_inputs", refused_fp16_forward),
    # found at micro-batch 1's forward, after micro-batch 0's backward: the gradients hold some of the
    # window, the weights and the optimizer state nothing of it
    ("train_step/inputs_of_another_dtype_in_a_later_microbatch",
     lambda: refused_step(microbatches=[(X, X), (X.double(), X)])),
    ("muon/float64_gradient_on_float32_parameter", refused_muon_step),
    ("muon/load_a_momentum_buffer_of_another_shape", refused_muon_load),
    ("newton_schulz/overwrite_an_expanded_input", refused_overwrite),
    ("dmuon.set_model_state_dict/entry_of_another_shape", refused_dmuon_model_load),
    ("dmuon.set_optimizer_state_dict/momentum_of_another_shape", refused_dmuon_optimizer_load),
]


def _flat(value, path=""):
    """(path, value) for every leaf of nested dicts, lists and tuples; tensors as copies."""
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _flat(value[key], f"{path}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _flat(item, f"{path}/{index}")
    else:
        yield path, value.detach().clone() if isinstance(value, torch.Tensor) else value


def _snapshot(value):
    return list(_flat(value))


def _same(a, b):
    """Whether two snapshots hold the same paths and, bit for bit, the same values."""
    return [p for p, _ in a] == [p for p, _ in b] and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for (_, x), (_, y) in zip(a, b))


@pytest.mark.parametrize("setup", [u[1] for u in UNCHANGED], ids=[u[0] for u in UNCHANGED])
def test_a_refused_call_changes_nothing(request, setup):
    names = setup.__code__.co_varnames[: setup.__code__.co_argcount]
    call, state = setup(**{name: request.getfixturevalue(name) for name in names})
    before = _snapshot(state())
    with pytest.raises((TypeError, ValueError)):
        call()
    assert _same(before, _snapshot(state()))


# --- bad inputs whose answer is a correct result ------------------------------------------------------

def test_newton_schulz_of_a_parameter_that_requires_grad_is_that_of_its_values():
    p = nn.Parameter(torch.randn(4, 6))
    result = newton_schulz(p, dtype=torch.float32)
    assert not result.requires_grad and torch.equal(result, newton_schulz(p.detach(), dtype=torch.float32))


def test_newton_schulz_of_a_meta_matrix_is_a_meta_matrix_of_its_shape():
    for G in (torch.empty(4, 6, device="meta"), torch.empty(3, 6, 4, device="meta")):
        result = newton_schulz(G, dtype=torch.float32)
        assert result.is_meta and result.shape == G.shape and result.dtype == torch.float32


@pytest.mark.parametrize("optimizer,poison,scaler", [("sgd", "infinite_loss", None), ("adamw", "nan_input", None),
                                                     ("sgd", "infinite_loss", "disabled GradScaler")])
def test_a_gradient_holding_nan_or_inf_skips_the_step_and_says_so(optimizer, poison, scaler):
    model, _ = trained_linear()
    opt = sgd(model) if optimizer == "sgd" else torch.optim.AdamW(model.parameters())
    step_of(model, opt)  # a first step: the optimizer holds state
    before = _snapshot((model.state_dict(), opt.state_dict()))
    x = X.clone()
    if poison == "nan_input":
        x[1, 0] = float("nan")
    loss_fn = (lambda p, t: F.mse_loss(p, t) * math.inf) if poison == "infinite_loss" else F.mse_loss
    with pytest.warns(RuntimeWarning, match="skipped this optimizer step: a gradient holds NaN or Inf.*unchanged"):
        loss = step_of(model, opt, [(x, X)], loss_fn,
                       scaler=torch.amp.GradScaler("cpu", enabled=False) if scaler else None)
    assert not math.isfinite(loss)
    assert _same(before, _snapshot((model.state_dict(), opt.state_dict())))
    step_of(model, opt)  # and the next, finite window steps as usual
    assert not _same(before, _snapshot((model.state_dict(), opt.state_dict())))


def test_a_checkpoint_of_the_older_save_loads_with_a_warning_and_latest_says_why_it_passes_over_it(tmp_path):
    torch.manual_seed(0)
    saved = nn.Linear(3, 3)
    checkpoint.save({"model": saved.state_dict()}, tmp_path / "old", step=1)
    # What the older checkpoint.save wrote as its marker: the world size and the keys, no step, no checksums.
    (tmp_path / "old" / checkpoint.MARKER).write_text(json.dumps({"world_size": 1, "keys": ["model"]}))
    state = {"model": nn.Linear(3, 3).state_dict()}
    with pytest.warns(RuntimeWarning, match="written by an older checkpoint.save.*loaded unverified"):
        checkpoint.load(state, tmp_path / "old")
    assert all(torch.equal(state["model"][k], v) for k, v in saved.state_dict().items())
    with pytest.warns(RuntimeWarning, match=r"passed over .*old: it was written by an older checkpoint.save.*"
                                            r"checkpoint.load\(state, path\)"):
        assert checkpoint.latest(tmp_path) is None


def test_a_rank_that_returned_early_is_named_as_the_cause_not_the_rank_it_left_waiting():
    # gloo's words on rank 1 when rank 0 returned (exit 0) while rank 1 waited in an all_reduce (measured with a
    # two-rank script whose rank 0 leaves after its first collective): rank 1 used to be reported as the failure.
    exception = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                 "[127.0.0.1]:12428. This is typically caused by a remote worker crashing.")
    message = str(RankFailedError(1, exception, "", silent_ranks=(0,)))
    assert message.startswith("rank 1 failed: a peer closed its connection while rank 1 waited in a collective "
                              "(RuntimeError: Connection closed by peer"), message
    assert "rank 0 raised nothing: a rank that ended first, returning early" in message, message
    assert "The failing rank is not the cause" in message, message


def test_adjust_lr_fn_none_is_torchs_original():
    # torch.optim.Muon takes None as "original"; it used to be refused here.
    torch.manual_seed(0)
    start = torch.randn(6, 3)
    weights = [nn.Parameter(start.clone()) for _ in range(2)]
    for w in weights:
        w.grad = torch.ones(6, 3)
    muon.Muon([weights[0]], lr=0.1, adjust_lr_fn=None).step()
    muon.Muon([weights[1]], lr=0.1, adjust_lr_fn="original").step()
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], start)


def test_a_timeout_that_closed_the_connection_names_the_silent_rank():
    # gloo's words on a rank whose other wait timed out first and closed the connection (a rank silent in a
    # reduce; tests/test_dmuon.py makes one happen on two ranks).
    message = str(RankFailedError(0, "RuntimeError: Application timeout caused pair closure", "", silent_ranks=(1,)))
    assert message.startswith("rank 0 failed: a collective timed out (RuntimeError: Application timeout caused "
                              "pair closure). rank 1 raised nothing"), message


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the inputs on another device than the model")
def test_inputs_on_another_device_than_the_model_are_named_with_the_move_to_make():
    model = nn.Linear(2, 2).cuda()
    with pytest.raises(ValueError, match=r"the inputs of microbatch 0 are on cpu but the model's parameters are on "
                                         r"cuda:0: move them first, e.g. inputs.to\('cuda:0'\)"):
        step_of(model, sgd(model), [(X, X.cuda())])


def test_latest_passes_over_a_marker_that_lists_files_outside_and_reads_none_of_them(tmp_path):
    good = saved_checkpoint(tmp_path)
    for step, name in ((2, "/dev/zero"), (3, "../../outside.txt")):
        path = tmp_path / f"step-{step}"
        checkpoint.save({"model": nn.Linear(2, 2).state_dict()}, path, step=step)
        marker = json.loads((path / checkpoint.MARKER).read_text())
        marker["sha256"][name] = "0" * 64
        (path / checkpoint.MARKER).write_text(json.dumps(marker))
    with pytest.warns(RuntimeWarning, match=r"passed over .*step-3: COMPLETE lists '../../outside.txt'") as warned:
        assert checkpoint.latest(tmp_path) == good
    assert any("step-2: COMPLETE lists '/dev/zero'" in str(w.message) for w in warned), [str(w.message) for w in warned]
