"""The learning-rate scaling widget: its controls drive the plotted data."""

import math

import pytest

from dmuon_edu.course.pitfalls import DEFAULT_LR
from dmuon_edu.course.widgets import CORRECT_LABEL, MULTIPLIER_LABEL, UNSCALED_LABEL, lr_scaling_figure, lr_scaling_widget


def lines(figure, panel):
    return {line.get_label().removesuffix(" (diverged)"): line for line in figure.axes[panel].lines}


def multiplier_at(widget, n):
    curve = lines(widget.figure, 0)[MULTIPLIER_LABEL]
    return dict(zip(curve.get_xdata(), curve.get_ydata()))[n]


@pytest.fixture(scope="module")
def widget():
    return lr_scaling_widget()


def test_moving_the_controls_redraws_the_multiplier(widget):
    widget.optimizer.value = "sgd"
    widget.scale_loss.value = False
    widget.accum_steps.value = 24
    # Same tolerance as test_pitfalls: SGD's unscaled multiplier is N up to float32 summation order.
    assert multiplier_at(widget, 24) == pytest.approx(24, rel=1e-5)
    assert multiplier_at(widget, 64) == pytest.approx(64, rel=1e-5)

    widget.scale_loss.value = True
    assert multiplier_at(widget, 24) == pytest.approx(1, rel=1e-5)

    widget.scale_loss.value = False
    widget.optimizer.value = "adamw"
    assert widget.lr.value == pytest.approx(DEFAULT_LR["adamw"])
    assert multiplier_at(widget, 24) == pytest.approx(1, abs=1e-3)  # eps's effect, as in test_pitfalls


def test_the_training_panel_follows_the_learning_rate_and_n():
    widget = lr_scaling_widget("sgd", accum_steps=32, scale_loss=False)
    widget.lr.value = 0.5
    curves = lines(widget.figure, 1)
    correct, unscaled = curves[CORRECT_LABEL].get_ydata(), curves[UNSCALED_LABEL].get_ydata()
    assert correct[-1] < correct[0]
    assert math.isnan(unscaled[-1]), "an unscaled loss at N = 32 is a learning rate of 16 for SGD: it must diverge"
    assert "diverged" in curves[UNSCALED_LABEL].get_label()

    widget.accum_steps.value = 2
    curves = lines(widget.figure, 1)
    assert list(curves[CORRECT_LABEL].get_ydata()) == pytest.approx(list(correct), rel=1e-4)  # does not depend on N (up to float32 reordering)
    assert math.isfinite(curves[UNSCALED_LABEL].get_ydata()[-1])


def test_the_plot_is_a_png_of_the_latest_figure(widget):
    before = widget.plot.value
    widget.accum_steps.value = 5
    assert bytes(widget.plot.value).startswith(b"\x89PNG") and widget.plot.value != before


def test_an_out_of_range_n_is_refused():
    with pytest.raises(ValueError, match="accum_steps must be between 1 and 64"):
        lr_scaling_figure("sgd", 65, lr=0.1, scale_loss=False)
