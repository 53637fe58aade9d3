"""Every private torch API the library uses, by name, with a probe of the behaviour it relies on.

dmuon_edu is tested on one torch (constraints.txt, pyproject.toml's bounds). A torch upgrade that moves or changes
one of these fails its row here, naming it and the place that uses it, instead of failing somewhere inside a
training step. fully_shard's collector, the one private function dmuon wraps, has its own runtime guard
(fsdp_exclusion.check_compatible, which dedicate_params calls before patching, and
tests/test_dmuon.py::test_fsdp_internal_that_dmuon_patches_is_still_there).
"""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, distribute_tensor



def dispatch_mode_sees_aten_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2) + 1
    return "add" in Seen.ops


def foreach_support_is_a_bool():
    from torch.utils._foreach_utils import _has_foreach_support
    return _has_foreach_support([torch.ones(2)], torch.device("cpu")) in (True, False)


def queued_callback_runs_after_the_backward():
    order = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: (torch.autograd.Variable._execution_engine.queue_callback(
        lambda: order.append("callback")), order.append("hook"))[1])
    x.register_hook(lambda g: order.append("leaf"))
    y.sum().backward()
    return order == ["hook", "leaf", "callback"]


def tree_leaves_flattens_containers():
    from torch.utils._pytree import tree_leaves
    return tree_leaves([1, (2, {"a": 3})]) == [1, 2, 3]


def graph_task_id_tells_backward_from_forward():
    inside = []
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: inside.append(torch._C._current_graph_task_id()))
    (x * 2).sum().backward()
    return torch._C._current_graph_task_id() == -1 and inside and inside[0] != -1


def scalar_dtype_is_adamws_step_dtype():
    from torch.optim.optimizer import _get_scalar_dtype
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    adamw = torch.optim.AdamW([p])
    adamw.step()
    return _get_scalar_dtype() == adamw.state[p]["step"].dtype


def cpu_bf16_flags_are_bools():
    return all(isinstance(f(), bool) for f in (torch.cpu._is_avx512_bf16_supported, torch.cpu._is_amx_tile_supported))


def disabling_torch_function_skips_a_subclass():
    class Loud(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            raise AssertionError("called")

    t = torch.ones(2).as_subclass(Loud)
    with torch._C.DisableTorchFunctionSubclass():
        return torch.equal(torch.add(t, 1), torch.full((2,), 2.0))


def use_count_counts_autograds_references():
    x = torch.ones(2, requires_grad=True)
    before = x._use_count()
    y = (x * x).sum()  # the product saves x for the backward
    return isinstance(before, int) and x._use_count() > before and y is not None


# name: (where the library uses it, a probe that is True when the behaviour it relies on holds)
INTERNALS = {
    "torch.utils._python_dispatch.TorchDispatchMode": ("distributed.py: count_collectives", dispatch_mode_sees_aten_ops),
    "torch.utils._foreach_utils._has_foreach_support": ("dmuon/clip.py: foreach norms", foreach_support_is_a_bool),
    "torch.autograd.Variable._execution_engine.queue_callback": (
        "dmuon/gradients.py, dmuon/ddp.py: work at the end of the backward", queued_callback_runs_after_the_backward),
    "torch.utils._pytree.tree_leaves": ("dmuon/residency.py: a unit's tensor inputs and outputs", tree_leaves_flattens_containers),
    "torch._C._current_graph_task_id": ("dmuon/residency.py: forward or backward", graph_task_id_tells_backward_from_forward),
    "torch.optim.optimizer._get_scalar_dtype": ("dmuon/optim.py, dmuon/state.py: AdamW's step tensor",
                                                scalar_dtype_is_adamws_step_dtype),
    "torch.cpu._is_avx512_bf16_supported, torch.cpu._is_amx_tile_supported": (
        "newton_schulz.py: cpu_bf16_flags", cpu_bf16_flags_are_bools),
    "torch._C.DisableTorchFunctionSubclass": ("dmuon/placeholder.py, dmuon/residency.py: swapping a placeholder's data",
                                              disabling_torch_function_skips_a_subclass),
    "torch.Tensor._use_count": ("distributed.py: barrier's wait for gloo's workers", use_count_counts_autograds_references),
}


@pytest.mark.parametrize("name", sorted(INTERNALS))
def test_each_private_torch_api_the_library_uses_still_behaves_as_it_relies_on(name):
    where, probe = INTERNALS[name]
    assert probe(), f"{name}, used by {where}, no longer behaves as relied on: adapt that place to this torch"


def test_a_dtensors_local_tensor_can_be_swapped(one_rank_mesh):
    # DTensor._local_tensor: dmuon/placeholder.py and dmuon/residency.py fill and empty a TP shard through it
    d = distribute_tensor(torch.zeros(2, 2), one_rank_mesh, [Replicate()])
    d._local_tensor = torch.ones(2, 2)
    assert torch.equal(d.to_local(), torch.ones(2, 2))


def test_the_default_store_and_a_groups_timeout_are_where_dmuon_reads_them(one_rank_mesh):
    # torch.distributed.distributed_c10d._get_default_store: dmuon/order.py and dmuon/dedicate.py meet in it;
    # ProcessGroup._get_backend(device).options._timeout: dmuon/order.py's group_timeout, the wait dedicate_params
    # gives a rank that never calls it
    import datetime

    import torch.distributed as dist

    from dmuon_edu.dmuon.order import group_timeout
    store = dist.distributed_c10d._get_default_store()
    store.set("internals/probe", "x")
    assert store.check(["internals/probe"]) and store.compare_set("internals/probe", "x", "y") == b"y"
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=7))
    assert group_timeout(group) == datetime.timedelta(seconds=7)
