"""Channel-blocked values in a segment's bound plan (algorithms/segment_layout.py, compiled/directconv_blocked.py):
runs of direct convolutions keep their values as (N, C/16, H, W, 16) between them. Checked against a float64
reference and onnxruntime over channel counts that are not multiples of 16, stride 2, padding, dilation, a
grouped convolution (left plain), residuals in both layouts, and batches of 1 and 3."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_helpers import bound_plan
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms import segment_steps
from onnx_runtime_ep_cpu.compiled import deferred, host
from onnx_runtime_ep_cpu.compiled import directconv_blocked as blocked
from test_segment_fusion import _segment_and_feeds, segment_matches_references

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the direct tiles need AVX2")


def _chain_model(size: int = 13) -> onnx.ModelProto:
    rng = np.random.default_rng(11)
    inits, nodes = [], []

    def conv(x, y, cin, cout, k, stride=1, pad=None, group=1, dilation=1):
        w = (rng.standard_normal((cout, cin // group, k, k)) / np.sqrt(cin // group * k * k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"{y}_w"))
        inits.append(numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{y}_b"))
        pad = k // 2 * dilation if pad is None else pad
        nodes.append(helper.make_node("Conv", [x, f"{y}_w", f"{y}_b"], [y], kernel_shape=[k, k], strides=[stride] * 2,
                                      pads=[pad] * 4, group=group, dilations=[dilation] * 2))

    conv("x", "c1", 3, 20, 3)  # plain input (the segment's feed) -> blocked output, 20 channels
    nodes.append(helper.make_node("Relu", ["c1"], ["r1"]))
    conv("r1", "c2", 20, 24, 3, stride=2)  # blocked -> blocked, stride 2, padded
    nodes.append(helper.make_node("Relu", ["c2"], ["r2"]))
    conv("r2", "c3", 24, 24, 1)  # pointwise, then a residual in the blocked layout
    nodes.append(helper.make_node("Add", ["c3", "r2"], ["s3"]))
    nodes.append(helper.make_node("Relu", ["s3"], ["r3"]))
    conv("r3", "c4", 24, 17, 3, dilation=2)  # dilated, 17 outputs
    nodes.append(helper.make_node("Clip", ["c4", "lo", "hi"], ["r4"]))
    inits += [numpy_helper.from_array(np.float32(0), "lo"), numpy_helper.from_array(np.float32(6), "hi")]
    conv("r4", "c5", 17, 32, 3, group=1, stride=2, pad=0)  # unpadded, stride 2
    conv("c5", "c6", 32, 32, 3, group=2)  # grouped: reads and writes the plain layout
    nodes.append(helper.make_node("HardSwish", ["c6"], ["a6"]))
    conv("a6", "c7", 32, 19, 1)
    nodes.append(helper.make_node("GlobalAveragePool", ["c7"], ["pool"]))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             ["batch", 3, size, size])],
                              [helper.make_tensor_value_info("pool", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("c5", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _modes(plan) -> list[tuple[bool, bool]]:
    return [(a[-6], a[-2]) for f, a in plan._steps if getattr(f, "__name__", "") == "conv_blocked"]  # noqa: SLF001


@pytest.mark.parametrize("batch", [1, 3])
def test_blocked_runs_match_float64_and_onnxruntime(batch):
    model = _chain_model()
    deferred.wait_ready(240)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 13, 13)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    plan = bound_plan(plan)
    modes = _modes(plan)
    assert (False, True) in modes and (True, True) in modes and (True, False) in modes
    segment_matches_references(model, segment, feeds, x.shape, rng, runs=3, tolerance=1e-5)


def test_plain_and_blocked_plans_agree(monkeypatch):
    model = _chain_model()
    deferred.wait_ready(240)
    x = np.random.default_rng(5).standard_normal((2, 3, 13, 13)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    with_blocks = segment(*feeds)
    monkeypatch.setattr(segment_steps, "block_direct_runs", lambda segment, steps, spans, *_: (steps, 0))
    plain_segment, feeds = _segment_and_feeds(model, x)
    plain = plain_segment(*feeds)
    ((plan,),) = plain_segment.plans.values()
    plan = bound_plan(plan)
    assert not _modes(plan)
    for a, b in zip(with_blocks, plain):
        np.testing.assert_array_equal(a, b)  # the same sums in the same order, stored elsewhere


@pytest.mark.parametrize("channels", [1, 16, 21])
def test_layout_conversions_and_taps(channels):
    deferred.wait_ready(240)
    rng = np.random.default_rng(channels)
    x = rng.standard_normal((2, channels, 5, 7)).astype(np.float32)
    stored = -(-channels // 16) * 16
    y = np.full(2 * stored * 35, np.nan, np.float32)
    blocked.to_blocked(x.reshape(-1), y, 2, channels, 35)
    expected = np.zeros((2, stored, 35), np.float32)
    expected[:, :channels] = x.reshape(2, channels, 35)
    np.testing.assert_array_equal(y.reshape(2, stored // 16, 35, 16),
                                  expected.reshape(2, stored // 16, 16, 35).transpose(0, 1, 3, 2))
    back = np.empty(x.size, np.float32)
    blocked.from_blocked(y, back, 2, channels, 35)
    np.testing.assert_array_equal(back.reshape(x.shape), x)
    plane = 35
    offsets = np.array([c * plane + r for c in range(channels) for r in (0, 8, 34)], np.int64)
    taps = blocked.blocked_taps(offsets, plane)
    image = y[:stored * 35]
    np.testing.assert_array_equal(image[taps], x[0].reshape(-1)[offsets])
