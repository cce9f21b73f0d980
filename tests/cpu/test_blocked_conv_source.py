"""The padded copy a blocked direct convolution reads (compiled/directconv_blocked.conv_blocked's ``source``) is the
plan's own buffer, allocated once: calls copy each image into its interior and leave the pads and the margin past
the last plane zero. Checked over runs whose inputs change scale and sign (a pad or margin left with an earlier
run's values would change the next run's border outputs) against a float64 reference, with the buffer's size
and its zero cells checked after every run."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import bound_plan
from onnx_runtime_ep_cpu.compiled import deferred, host
from onnx_runtime_ep_cpu.compiled import directconv_blocked as blocked
from onnx_runtime_ep_cpu.compiled.directconv import CHANNELS, PIXELS
from reference64 import run_float64
from test_cnn_blocked_layout import _chain_model
from test_segment_fusion import _segment_and_feeds

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the direct tiles need AVX2")


def _padded_steps(plan) -> list[tuple]:
    """The arguments of the plan's conv_blocked steps that copy their input into a padded source."""
    return [a for f, a in plan._steps if getattr(f, "__name__", "") == "conv_blocked" and not a[15]]  # noqa: SLF001


def _interior(arguments) -> np.ndarray:
    """A mask over ``source``: True where a call copies the image (every plane's rows and columns of x)."""
    source, top, left, padded_height, padded_width = arguments[8], *arguments[11:15]
    channels, height, width, x_blocked = arguments[17:21]
    lanes = CHANNELS if x_blocked else 1
    planes = -(-channels // CHANNELS) if x_blocked else channels
    mask = np.zeros(source.size, bool)
    grid = mask[:planes * padded_height * padded_width * lanes].reshape(planes, padded_height, padded_width, lanes)
    grid[:, top:top + min(height, padded_height - top), left:left + min(width, padded_width - left)] = True
    return mask


@pytest.mark.parametrize("batch", [1, 2])
def test_padded_sources_stay_zero_outside_the_image(batch):
    model = _chain_model()
    deferred.wait_ready(240)
    rng = np.random.default_rng(40 + batch)
    x = rng.standard_normal((batch, 3, 13, 13)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    plan = bound_plan(plan)
    padded = _padded_steps(plan)
    assert {bool(a[20]) for a in padded} == {False, True}  # a plain input (the feed) and a blocked one
    for a in padded:
        sw, padded_height, padded_width, channels, x_blocked = a[10], a[13], a[14], a[17], a[20]
        lanes = CHANNELS if x_blocked else 1
        stored = -(-channels // CHANNELS) * CHANNELS if x_blocked else channels
        assert a[8].dtype == np.float32 and a[8].size == stored * padded_height * padded_width + PIXELS * sw * lanes
    for run, scale in enumerate((1e4, 1.0, -3e2, 1e-3)):
        x = (rng.standard_normal(x.shape) * scale).astype(np.float32)
        x[..., 0, :] = x[..., -1, :] = x[..., :, 0] = x[..., :, -1] = 50 * scale  # borders that the pads sit beside
        feeds = [x if f.shape == x.shape and f.flags.writeable else f for f in feeds]
        got = dict(zip(segment.output_names, segment(*feeds)))
        exact = dict(zip(["pool", "c5"], run_float64(model, {"x": x})))
        for name, wide in exact.items():
            assert np.abs(got[name] - wide).max() <= 1e-5 * (1 + np.abs(wide).max()), (name, run)
        for a in padded:
            assert not np.any(a[8][~_interior(a)]), run  # pads and margin still zero
            assert np.any(a[8][_interior(a)]), run  # (the image itself was copied in)


def test_source_size_rule():
    assert blocked.source_size(3, 70, 70, 2, False, False) == 3 * 4900 + PIXELS * 2
    assert blocked.source_size(20, 15, 15, 1, True, False) == 32 * 225 + PIXELS * CHANNELS
    assert blocked.source_size(20, 15, 15, 1, True, True) == 0
