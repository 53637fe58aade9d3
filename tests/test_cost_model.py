"""The cost model's arithmetic on hand-worked numbers, and its bad input. Its predictions
against what runs count and hold are in tests/test_module6.py (dmuon, ZeRO-1) and
tests/test_data_parallel.py (DDP, FSDP2)."""

import pytest

from dmuon_edu.course import cost_model


def test_a_hand_worked_ddp_row():
    # 4 ranks, 1000 bytes of parameters, 4 micro-batches, AdamW (s = 2).
    with_no_sync = cost_model.cost("DDP", P=1000, W=4, N=4, L=2)
    assert with_no_sync.counted == {"all_reduce": 1000}
    assert with_no_sync.wire == 1500  # a ring all-reduce sends 2 (W-1)/W = 1.5 of its tensor per rank
    assert with_no_sync.memory == 1000 + 1000 + 2000
    assert cost_model.cost("DDP", P=1000, W=4, N=4, L=2, no_sync=False).counted == {"all_reduce": 4000}


def test_a_hand_worked_dmuon_z2_row():
    # The same P_M, ranks and layers in Z2: every matrix held, one broadcast per window; at the window's first
    # forward, one layer before the last, its own 100 bytes of the last layer are in flight on top.
    z2 = cost_model.cost("dmuon Z2", P=1200, W=4, N=2, L=3, s=1)
    assert z2.counted == {"broadcast": 1200, "reduce": 1200}
    assert (z2.parameters, z2.in_flight) == (1200, 100)
    assert cost_model.cost("dmuon Z2", P=1200, W=4, N=2, L=1, s=1).in_flight == 0  # one layer: nothing to prefetch


def test_a_hand_worked_dmuon_z3_row():
    # P_M = 1200 bytes over 3 layers and 4 ranks, 2 micro-batches, Muon (s = 1), no_sync.
    z3 = cost_model.cost("dmuon Z3", P=1200, W=4, N=2, L=3, s=1)
    assert z3.counted == {"broadcast": 4 * 1200, "reduce": 1200}
    assert z3.parameters == 300 + 300  # its quarter, and the other owners' 3/4 of the running 400-byte layer
    # The prefetched layer's packed broadcasts: the other owners' 300 bytes received, this rank's 100 copied to send.
    assert z3.in_flight == 400
    assert z3.gradients == 1200 + 300  # every matrix's accumulated gradient, and its own reduced quarter
    assert z3.wire == 0.75 * (4800 + 1200)


def test_a_hand_worked_dmuon_ddp_backend_row():
    # P_M = 1200 bytes, 4 ranks, 2 micro-batches, no_sync: every rank keeps every matrix and its own accumulated
    # gradient, the owner its reduced quarter and the momentum of it; one reduce per window, one broadcast after.
    ddp = cost_model.cost("dmuon DDP backend", P=1200, W=4, N=2, L=3, s=1)
    assert ddp.counted == {"reduce": 1200, "broadcast": 1200}
    assert (ddp.parameters, ddp.gradients, ddp.optimizer_state) == (1200, 1200 + 300, 300)


def test_a_hand_worked_tensor_parallel_row():
    # T = 2: each rank's shards are half of every matrix; of each matrix's gather, the TP owner counts it all
    # (1200) and the other DP owner its half (600): 1800 over the W T = 4 ranks, 450 each on average.
    tp = cost_model.cost("dmuon Z2", P=1200, W=2, N=2, L=3, s=1, T=2)
    assert tp.counted == {"broadcast": 600, "reduce": 600, "gather": 450, "scatter": 450}
    assert tp.parameters == 600 + 1200 / 4  # its shards, and on average a quarter of the TP owners' proxies
    with pytest.raises(ValueError, match="dmuon's rows only"):
        cost_model.cost("FSDP2", P=1200, W=2, N=2, L=3, T=2)


@pytest.mark.parametrize("bad, match", [
    (dict(scheme="ZeRO-4"), "scheme must be one of"),
    (dict(W=0), "W must be an int >= 1"),
    (dict(N=2.5), "N must be an int >= 1"),
    (dict(L=True), "L must be an int >= 1"),
    (dict(P=0), "P must be a positive number of bytes"),
])
def test_bad_input_is_refused_by_name(bad, match):
    arguments = dict(scheme="DDP", P=1000, W=2, N=4, L=3) | bad
    with pytest.raises(ValueError, match=match):
        cost_model.cost(arguments.pop("scheme"), **arguments)


def test_the_cost_widget_draws_each_schemes_hand_worked_numbers_and_redraws_on_a_change():
    from dmuon_edu.course.widgets import cost_widget

    widget = cost_widget(W=4, N=2, L=3, no_sync=True)
    memory, wire = widget.figure.axes
    tops = {}
    for bar in memory.patches:  # stacked: parameters, gradients, optimizer state, scheme by scheme
        x = round(bar.get_x(), 3)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    # DDP (first bar): 1 + 1 + 2 (AdamW) P; dmuon Z3 (fifth), in P_M: the hand-worked row above over 1200
    # bytes, (600 + 400) + 1500 + 300 (Muon's momentum, a quarter).
    assert list(tops.values())[0] == pytest.approx(4.0)
    assert list(tops.values())[4] == pytest.approx((600 + 400 + 1500 + 300) / 1200)
    assert [bar.get_height() for bar in wire.patches][0] == pytest.approx(1.5)  # 2 (W-1)/W of one all-reduce
    before = widget.plot.value
    widget.N.value = 8
    assert widget.plot.value != before
    assert "N = 8 micro-batches" in widget.figure.texts[0].get_text()
