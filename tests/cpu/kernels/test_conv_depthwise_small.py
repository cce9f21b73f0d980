"""The small-plane depthwise loops (compiled/depthwise_small.py, algorithms/conv_depthwise_small.py): the
channels-last pair sums (5x5-and-larger windows, or 3x3 ones over planes of up to 16 pixels, onto few outputs)
and the flat planes (stride-1 windows keeping
a small plane's size): against a float64 reference (onnx's evaluator
on the inputs in float64) and onnxruntime, through sessions (the Conv alone, fused with an activation, and
with a residual sum), for strides, dilations, uneven pads and batches. No ISA-specific code: the loop is plain
numba, so these run on every host."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms.conv_depthwise_small import flat_depthwise_apply, pairs_depthwise_apply
from onnx_runtime_ep_cpu.algorithms.window import Geometry
from onnx_runtime_ep_cpu.compiled import deferred
from reference64 import run_float64

# (x shape, kernel, attributes): each taken by the pair sums (checked below)
CASES = {
    "5x5 on 4x4": ((1, 120, 4, 4), (5, 5), dict(pads=[2, 2, 2, 2])),
    "5x5/2 on 8x8": ((1, 96, 8, 8), (5, 5), dict(pads=[2, 2, 2, 2], strides=[2, 2])),
    "7x7, uneven pads, 2 images": ((2, 16, 4, 4), (7, 7), dict(pads=[3, 1, 2, 4])),
    "5x5/2 dilated 2": ((1, 24, 6, 6), (5, 5), dict(pads=[4, 4, 4, 4], strides=[2, 2], dilations=[2, 2])),
    "5x5/(1,2), no pads": ((1, 33, 6, 8), (5, 5), dict(strides=[1, 2])),
    "3x3 on 4x4, 2 images": ((2, 96, 4, 4), (3, 3), dict(pads=[1, 1, 1, 1])),  # (small planes: PAIRS_SMALL_INPUTS)
    "3x3 on 2x2, 3 images": ((3, 40, 2, 2), (3, 3), dict(pads=[1, 1, 1, 1])),
    "3x3/2 on 4x4": ((1, 32, 4, 4), (3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2])),
}
# (x shape, kernel, attributes): each taken by the flat planes
FLAT_CASES = {
    "3x3 on 8x8": ((1, 72, 8, 8), (3, 3), dict(pads=[1, 1, 1, 1])),
    "3x3 on 4x4, 8 channels": ((2, 8, 4, 4), (3, 3), dict(pads=[1, 1, 1, 1])),  # (too few for the pair sums)
    "5x5 on 8x8": ((1, 40, 8, 8), (5, 5), dict(pads=[2, 2, 2, 2])),
    "3x3 dilated 2 on 6x7": ((1, 8, 6, 7), (3, 3), dict(pads=[2, 2, 2, 2], dilations=[2, 2])),
    "2x2, uneven pads": ((1, 5, 8, 8), (2, 2), dict(pads=[1, 0, 0, 1])),
}
ALL_CASES = {**{("pairs", k): v for k, v in CASES.items()}, **{("flat", k): v for k, v in FLAT_CASES.items()}}


def _model(x_shape, kernel, attrs, tail):
    c = x_shape[1]
    rng = np.random.default_rng(sum(x_shape) + kernel[0])
    w = (rng.standard_normal((c, 1, *kernel)) * 0.3).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv"], kernel_shape=list(kernel), group=c, **attrs)]
    out = "conv"
    if tail == "relu":
        nodes.append(helper.make_node("Relu", ["conv"], ["y"]))
        out = "y"
    elif tail == "residual":
        nodes.append(helper.make_node("Add", ["conv", "r"], ["y"]))
        out = "y"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    if tail == "residual":
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "depthwise", inputs, [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _geometry(x_shape, kernel, attrs) -> Geometry:
    rank = 2
    strides = tuple(attrs.get("strides", [1, 1]))
    dilations = tuple(attrs.get("dilations", [1, 1]))
    pads = attrs.get("pads", [0] * 4)
    out = tuple((n + pads[i] + pads[i + rank] - (k - 1) * d - 1) // s + 1
                for i, (n, k, s, d) in enumerate(zip(x_shape[2:], kernel, strides, dilations)))
    return Geometry(tuple(x_shape[2:]), kernel, strides, dilations, tuple(pads[:rank]), tuple(pads[rank:]), out)


@pytest.mark.parametrize("case", sorted(ALL_CASES), ids=lambda case: f"{case[0]}: {case[1]}")
@pytest.mark.parametrize("tail", ["none", "relu", "residual"])
def test_small_plane_loops_match_float64_and_onnxruntime(case, tail):
    x_shape, kernel, attrs = ALL_CASES[case]
    x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)
    geo = _geometry(x_shape, kernel, attrs)
    if case[0] == "pairs":
        assert pairs_depthwise_apply(geo, x, x_shape[1])
    else:
        assert flat_depthwise_apply(geo, x, x_shape[1]) and not pairs_depthwise_apply(geo, x, x_shape[1])
    model = _model(x_shape, kernel, attrs, tail)
    feeds = {"x": x}
    if tail == "residual":
        probe = onnxruntime.InferenceSession(_model(x_shape, kernel, attrs, "none").SerializeToString())
        feeds["r"] = np.random.default_rng(2).standard_normal(probe.run(None, {"x": x})[0].shape).astype(np.float32)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    exact = run_float64(model, feeds)[0]
    theirs = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    taps = kernel[0] * kernel[1]
    for run in range(3):  # the first run and the later ones (compiled kernels, a fusion's prepared calls)
        ours = sess.run(None, feeds)[0]
        if run == 0:
            deferred.wait_ready(240)
        assert ours.shape == exact.shape and ours.dtype == np.float32
        # float32 sums of ``taps`` terms: a few ulps of the largest partial sum each
        bound = (taps + 2) * np.finfo(np.float32).eps * (1 + np.abs(exact).max() + np.abs(x).max() * taps)
        assert np.abs(ours - exact).max() <= bound
        assert np.abs(ours - theirs).max() <= 2 * bound


def test_three_by_three_windows_and_large_planes_keep_the_plane_loops():
    x = np.zeros((1, 64, 16, 16), np.float32)
    assert not pairs_depthwise_apply(_geometry(x.shape, (3, 3), dict(pads=[1] * 4)), x, 64)
    assert not pairs_depthwise_apply(_geometry(x.shape, (5, 5), dict(pads=[2] * 4)), x, 64)  # 256 pixels out
    y = x[:, :, :8, :8]
    assert not pairs_depthwise_apply(_geometry(y.shape, (5, 5), dict(pads=[2] * 4)), y, 64)  # 8x8/1: 64 out
    assert not pairs_depthwise_apply(_geometry((1, 8, 4, 4), (5, 5), dict(pads=[2] * 4)), x[:, :8, :4, :4], 8)
    assert not pairs_depthwise_apply(_geometry((1, 16, 4, 4), (5, 5), dict(pads=[2] * 4)),
                                     x[:, :16, :4, :4].astype(np.int32), 16)


def test_strided_or_shrinking_windows_and_large_planes_keep_off_the_flat_planes():
    x = np.zeros((1, 32, 16, 16), np.float32)
    assert not flat_depthwise_apply(_geometry(x.shape, (3, 3), dict(pads=[1] * 4)), x, 32)  # 256 pixels
    y = x[:, :, :8, :8]
    assert not flat_depthwise_apply(_geometry(y.shape, (3, 3), dict(pads=[1] * 4, strides=[2, 2])), y, 32)
    assert not flat_depthwise_apply(_geometry(y.shape, (3, 3), {}), y, 32)  # no pads: 6x6 out of 8x8
    assert not flat_depthwise_apply(_geometry(y.shape, (3, 3), dict(pads=[1] * 4)), y, 64)  # two outputs each


@pytest.mark.parametrize("case", ["5x5 on 4x4", "3x3 on 2x2, 3 images"])
def test_a_plain_depthwise_call_keeps_its_loops_entry_point(case):
    # A Conv node without an epilogue repeats its loop's argument types every run (ConvNeXt's standalone depthwise
    # nodes): after the first call the loop's entry point is bound once and called without numba's dispatcher.
    from onnx_runtime_ep_cpu.algorithms.conv_depthwise_small import PairsDepthwise
    from onnx_runtime_ep_cpu.algorithms.prepared import Prepared

    x_shape, kernel, attrs = CASES[case]
    geo = _geometry(x_shape, kernel, attrs)
    model = _model(x_shape, kernel, attrs, "none")
    w, b = (numpy_helper.to_array(t) for t in model.graph.initializer)
    w.setflags(write=False)
    b.setflags(write=False)
    compute = PairsDepthwise(geo, Prepared(), np.float32)
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal(x_shape).astype(np.float32)
        ours = compute(x, w, b, None)
        exact = run_float64(model, {"x": x})[0]
        taps = kernel[0] * kernel[1]
        bound = (taps + 2) * np.finfo(np.float32).eps * (1 + np.abs(exact).max() + np.abs(x).max() * taps)
        assert ours.shape == exact.shape and np.abs(ours - exact).max() <= bound
    assert compute._plain is not None and compute._plain.entry is not None  # noqa: SLF001
