"""The time model (dmuon_edu/dmuon/step_time.py, hardware.py) in one process: its flops, its rules, its errors.

Its collectives are checked against count_comm and summarize_comm_plan in the shared torchrun launches
(tests/test_dmuon.py, test_time_model_plans_the_collectives_that_run); its seconds against every bench row in
make bench (docs/benchmarks.md). calibrate() runs in the 2-rank launch (tests/test_dmuon.py,
test_calibrate_measures_this_machine_in_30_seconds).
"""

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dmuon_edu import dmuon
from dmuon_edu.dmuon.__main__ import main as predict_command
from dmuon_edu.dmuon.hardware import LinkCost, wire_factor
from dmuon_edu.newton_schulz import newton_schulz, ns_flops

PRODUCTS = {"mm": lambda a, b: (a, b), "addmm": lambda c, a, b: (a, b), "bmm": lambda a, b: (a, b),
            "baddbmm": lambda c, a, b: (a, b)}


class CountProducts(TorchDispatchMode):
    """The flops of every matrix product dispatched: 2 m k n per product (per batch entry)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in PRODUCTS:
            a, b = PRODUCTS[name](*args[:3])
            self.flops += 2 * math.prod(a.shape) * b.shape[-1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", [(64, 48), (48, 64), (512, 512), (256, 1024), (1024, 256), (300, 2000)])
@pytest.mark.parametrize("steps", [1, 3, 4, 5, 6])
@pytest.mark.parametrize("gram_space", [True, False])
def test_ns_flops_are_the_products_newton_schulz_runs(shape, steps, gram_space):
    # on the meta device: the products are dispatched with their shapes, and nothing is computed
    with CountProducts() as counted:
        newton_schulz(torch.empty(shape, device="meta"), steps, dtype=torch.float32, gram_space=gram_space)
    assert ns_flops(shape, steps, gram_space) == counted.flops


def test_plan_balances_newton_schulz_time_not_its_old_proxy():
    # max(m, n) min(m, n)^2 gives all three the same cost; their Newton-Schulz flops (Gram-space pairs for the
    # wide ones, the m^3 terms for the square one) make the square one 2.4x each wide one: alone on its rank
    shapes = {"square.weight": (4096, 4096), "wide_a.weight": (65536, 1024), "wide_b.weight": (1024, 65536)}
    owners = dmuon.plan_owners(shapes, 2)
    assert owners["wide_a.weight"] == owners["wide_b.weight"] != owners["square.weight"], owners
    assert ns_flops((4096, 4096)) / ns_flops((65536, 1024)) == pytest.approx(2.43, abs=0.01)


def test_wire_factors_are_the_stated_algorithms():
    assert wire_factor("all_reduce", 4) == 1.5  # ring: 2 (W - 1) / W
    assert wire_factor("all_gather", 4) == wire_factor("reduce_scatter", 4) == 0.75
    assert wire_factor("broadcast", 4) == wire_factor("reduce", 4) == 1.0  # a pipelined chain: the whole message
    assert wire_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="one of"):
        wire_factor("all_to_all_v", 4)


CPU = dmuon.Hardware("two cores", {"float32": 1e11, "bfloat16": 2e11}, memory_bandwidth=6e9, cores=2,
                     collectives={c: LinkCost(alpha=3e-4, beta=1e-9) for c in dmuon.hardware.COLLECTIVES},
                     elementwise_seconds=1e-9, nonlinearity_seconds=4e-9)
SMALL = dmuon.transformer(vocab=256, d_model=256, n_layer=4, ffn=1024, sequence=64, tokens=512, fused_qkv=True,
                          biases=True, positions=True)


@pytest.mark.parametrize("layout", list(dmuon.LAYOUTS))
def test_without_overlap_every_part_adds_up(layout):
    step = dmuon.predict_step(SMALL, dmuon.LAYOUTS[layout], world_size=4, micro_batches=4, hardware=CPU)
    assert step.total == pytest.approx(sum(step.phases.values()), rel=1e-12)
    assert all(seconds >= 0 for seconds in step.phases.values())


@pytest.mark.parametrize("layout", list(dmuon.LAYOUTS))
def test_with_overlap_the_step_hides_communication_only(layout):
    h100 = dmuon.HARDWARE["h100-sxm"]
    step = dmuon.predict_step(dmuon.MODELS["gpt2-small"], dmuon.LAYOUTS[layout], world_size=16, micro_batches=8,
                              hardware=h100)
    compute = sum(step.phases[p] for p in ("forward", "backward", "Newton-Schulz", "optimizer", "buffer copies"))
    assert compute <= step.total <= sum(step.phases.values()) * (1 + 1e-12)


def test_ranks_share_the_cores_they_outnumber():
    # 4 ranks on 2 cores: each computes at half its rate; 2 ranks on 2 cores at its full rate
    two, four = (dmuon.predict_step(SMALL, dmuon.LAYOUTS["DDP + AdamW"], world_size=w, micro_batches=4, hardware=CPU)
                 for w in (2, 4))
    assert four.phases["forward"] == pytest.approx(2 * two.phases["forward"])
    assert four.phases["backward"] == pytest.approx(2 * two.phases["backward"])


def test_ranks_calibrated_together_compute_at_the_share_they_kept():
    # calibrate() on 4 ranks kept 0.4 of the alone rate with all of them multiplying (less than the 0.5 of 2 cores
    # over 4 ranks): the model uses it for 4 ranks on the node, and the cores rule for other counts
    measured = dataclasses.replace(CPU, concurrent_share=0.4, calibrated_world_size=4)
    two, four = (dmuon.predict_step(SMALL, dmuon.LAYOUTS["DDP + AdamW"], world_size=w, micro_batches=4,
                                    hardware=measured) for w in (2, 4))
    assert four.phases["forward"] == pytest.approx(two.phases["forward"] / 0.4)
    assert measured.share(2) == 1.0 and measured.share(8) == 0.25


def test_owners_share_newton_schulz_and_the_replicated_peer_does_not():
    replicated, owned = (dmuon.predict_step(SMALL, dmuon.LAYOUTS[name], world_size=2, micro_batches=4, hardware=CPU)
                         for name in ("DDP + replicated Muon", "dmuon DDP backend"))
    # 16 matrices of four layers, whole layers per owner over 2 ranks: each owner runs half
    assert owned.phases["Newton-Schulz"] == pytest.approx(replicated.phases["Newton-Schulz"] / 2)
    assert owned.ns_balance == pytest.approx(1.0)


def test_fsdp2_gathers_pad_each_parameter_to_the_shards():
    # a (3, 16) head over 4 shards is gathered as 4 rows of 16 (FSDP2 pads dim 0), and a (16,) bias as 16
    workload = dmuon.Workload({"head.weight": (3, 16), "head.bias": (16,)}, frozenset(), tokens=1)
    gathers = [c for c in dmuon.planned_collectives(workload, dmuon.LAYOUTS["FSDP2 + AdamW"], world_size=4,
                                                    micro_batches=1) if c.collective == "all_gather"]
    assert [(c.calls, c.bytes) for c in gathers] == [(1, (4 * 16 + 16) * 4)]  # one forward, the root's one unit


def test_a_calibration_prices_only_the_groups_it_measured():
    calibrated = dataclasses.replace(CPU, calibrated={2: CPU.collectives}, calibrated_world_size=2)
    dmuon.predict_step(SMALL, dmuon.LAYOUTS["dmuon Z3"], world_size=2, micro_batches=4, hardware=calibrated)
    with pytest.raises(ValueError, match="calibrate\\(\\) at the world size"):
        dmuon.predict_step(SMALL, dmuon.LAYOUTS["dmuon Z3"], world_size=4, micro_batches=4, hardware=calibrated)


@pytest.mark.parametrize("call, error, words", [
    (lambda: dmuon.predict_step(SMALL, dmuon.LAYOUTS["dmuon Z3 + TP"], world_size=3, micro_batches=4, hardware=CPU),
     ValueError, "multiple of tp"),
    (lambda: dmuon.predict_step(SMALL, dmuon.LAYOUTS["dmuon Z3"], world_size=2, micro_batches=0, hardware=CPU),
     ValueError, "micro_batches"),
    (lambda: dmuon.predict_step(SMALL, dmuon.LAYOUTS["dmuon Z3"], world_size=2, micro_batches=4, hardware=CPU,
                                ns_dtype="float16"), ValueError, "no matmul rate for float16"),
    (lambda: dmuon.Workload({"w": (2, 2)}, frozenset({"v"}), tokens=1), ValueError, "not a 2-D entry"),
    (lambda: dmuon.Workload({"w": (2, 2)}, frozenset(), tokens=0), ValueError, "tokens"),
    (lambda: dmuon.Layout("ddp", "dmuon", replicas=2), ValueError, "HSDP"),
    (lambda: dmuon.Layout("zero", "adamw"), ValueError, "sharding"),
    (lambda: dmuon.Layout("fsdp2", "dmuon", tp=0), ValueError, "tp must be an int >= 1"),
    (lambda: ns_flops((2, 2, 2)), ValueError, "shape"),
])
def test_bad_input_is_named(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_the_command_prints_every_layout(capsys):
    assert predict_command(["--model", "llama2-7b", "--world-size", "16", "--hardware", "h200"]) == 0
    out = capsys.readouterr().out
    for layout in ("FSDP2 + AdamW", "dmuon Z2", "dmuon Z3", "DDP + AdamW", "DDP + replicated Muon",
                   "dmuon DDP backend"):
        assert f"| {layout} |" in out
    assert out.startswith("H200, 8 per node: 16 ranks, 8 micro-batches of 4096 tokens per rank, 6738M parameters")
    with pytest.raises(SystemExit):
        predict_command(["--layouts", "dmuon Z4"])
    assert "unknown layout 'dmuon Z4'" in capsys.readouterr().err
