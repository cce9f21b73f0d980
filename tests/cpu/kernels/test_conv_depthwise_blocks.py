"""The channel blocks (compiled/depthwise_blocks.py, algorithms/conv_depthwise_blocks.py): depthwise convolutions of
the plain layout computed 16 channels across the lanes, each block transposed into a padded blocked plane and back.
The loop against a float64 reference for channel counts off a block of 16, strides, dilations, uneven pads, planes
narrower than a tile, batches, activation bounds and spans of blocks (nothing outside its span and its output is
written); through sessions (the Conv alone, with a Relu, with a residual sum; one and two threads; inside a
segment's bound plan) where the host takes it (AVX-512: 5x5 windows and larger, 3x3 ones on planes of up to 64
outputs), EfficientNet-B0's layers included; and which layers keep their own loops."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms.conv_depthwise_blocks import blocks_depthwise_apply
from onnx_runtime_ep_cpu.algorithms.conv_depthwise_small import pairs_depthwise_apply, rows_depthwise_apply
from onnx_runtime_ep_cpu.compiled import deferred, host
from reference64 import run_float64
from test_batch_readonly_feeds import watch_segments
from test_conv_depthwise_rows import _geometry, _model, _reference  # (the same Conv models and float64 windows)

# (x shape, kernel, strides, dilations, pads (begin h, w, end h, w))
LOOP_CASES = {
    "5x5 on 14x14, 40 channels": ((1, 40, 14, 14), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2)),
    "5x5/2 on 15x13, 2 images, 20 channels": ((2, 20, 15, 13), (5, 5), (2, 2), (1, 1), (2, 2, 2, 2)),
    "3x3 on 7x7, 33 channels": ((1, 33, 7, 7), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    "7x7 on 3x5, uneven pads": ((1, 17, 3, 5), (7, 7), (1, 1), (1, 1), (3, 1, 2, 4)),
    "5x5/(1,2) dilated 2": ((1, 16, 13, 19), (5, 5), (1, 2), (2, 2), (3, 1, 2, 4)),
    "3x7/(2,1) dilated (1,2), no top pad": ((1, 5, 9, 20), (3, 7), (2, 1), (1, 2), (0, 5, 1, 0)),
    "5x5 on 2x2, 3 images": ((3, 48, 2, 2), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2)),
    "5x5/2 on 28x28, no pads": ((1, 16, 28, 28), (5, 5), (2, 2), (1, 1), (0, 0, 0, 0)),
}
BOUNDS = {"none": (-np.inf, np.inf, 1.0), "relu": (0.0, np.inf, 0.0), "leaky clip": (-1.0, 1.5, 0.1)}


def _out(shape, kernel, strides, dilations, pads):
    return tuple((size + pads[a] + pads[a + 2] - d * (k - 1) - 1) // s + 1
                 for a, (size, k, s, d) in enumerate(zip(shape[2:], kernel, strides, dilations)))


def _loop_arguments(x, w, b, bounds, strides, dilations, pads, out, y, first, end):
    from onnx_runtime_ep_cpu.compiled import blocked_ops, depthwise_blocks

    n, c, h, width = x.shape
    (kh, kw), (sh, sw), (dh, dw) = w.shape[2:], strides, dilations
    rows, columns, _ = blocked_ops.padded_size(h, width, *out, sh, sw, pads[0], pads[1], kh, kw, dh, dw)
    weights, bias = blocked_ops.pack_depthwise(w, b, c)
    source = np.zeros(depthwise_blocks.source_floats(rows, columns, sw) + 32, np.float32)  # (a guard past each)
    tiles = np.zeros(depthwise_blocks.out_floats(*out) + 32, np.float32)
    return (x.reshape(-1), weights, blocked_ops.depthwise_taps(kh, kw, dh, dw, columns), bias, bounds, y, n, c, h,
            width, *out, sh, sw, columns, depthwise_blocks.source_places(h, width, pads[0], pads[1], columns),
            depthwise_blocks.lane_starts(out[0] * out[1]), source[:-32], tiles[:-32], first, end), source, tiles


@pytest.mark.parametrize("case", sorted(LOOP_CASES))
@pytest.mark.parametrize("activation", sorted(BOUNDS))
def test_loop_matches_float64(case, activation):
    from onnx_runtime_ep_cpu.compiled import depthwise_blocks

    shape, kernel, strides, dilations, pads = LOOP_CASES[case]
    rng = np.random.default_rng(sum(shape))
    n, c = shape[:2]
    out = _out(shape, kernel, strides, dilations, pads)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((c, 1, *kernel)) * 0.3).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    bounds = np.array(BOUNDS[activation], np.float32)
    exact = _reference(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), strides, dilations, pads,
                       out, BOUNDS[activation])
    y = np.full(n * c * out[0] * out[1] + 32, 7.0, np.float32)  # a guard past the output: never written
    arguments, source, tiles = _loop_arguments(x, w, b, bounds, strides, dilations, pads, out, y, 0, -(-c // 16))
    depthwise_blocks.depthwise_channel_blocks(*arguments)
    taps = kernel[0] * kernel[1]
    bound = (taps + 2) * np.finfo(np.float32).eps * (1 + np.abs(x).max() * np.abs(w).max() * taps)
    assert np.abs(y[:-32].reshape(exact.shape) - exact).max() <= bound
    assert (y[-32:] == 7.0).all() and (source[-32:] == 0).all() and (tiles[-32:] == 0).all()


def test_a_span_of_blocks_writes_its_channels_alone():
    from onnx_runtime_ep_cpu.compiled import depthwise_blocks

    shape, kernel, strides, dilations, pads = (2, 40, 9, 9), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((40, 1, 5, 5)) * 0.3).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    out = _out(shape, kernel, strides, dilations, pads)
    bounds = np.array(BOUNDS["none"], np.float32)
    exact = _reference(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), strides, dilations, pads,
                       out, BOUNDS["none"])
    y = np.full((2, 40, *out), 7.0, np.float32)
    arguments, _, _ = _loop_arguments(x, w, b, bounds, strides, dilations, pads, out, y.reshape(-1), 1, 2)
    depthwise_blocks.depthwise_channel_blocks(*arguments)  # channels 16 .. 31 of each image
    assert (y[:, :16] == 7.0).all() and (y[:, 32:] == 7.0).all()
    assert np.abs(y[:, 16:32] - exact[:, 16:32]).max() <= 30 * np.finfo(np.float32).eps * (1 + np.abs(exact).max())


def _session(model, threads: int):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


# EfficientNet-B0's 5x5 layers at 224x224 (the 7x7 map's at 1152 channels, the 14x14 one's at 672), a 3x3 one on its
# 7x7 map, and channel counts off a block
SESSION_CASES = {
    "1152 channels 5x5 on 7x7": ((1, 1152, 7, 7), (5, 5), (2, 2, 2, 2), (1, 1)),
    "672 channels 5x5/2 on 14x14": ((1, 672, 14, 14), (5, 5), (1, 1, 2, 2), (2, 2)),
    "240 channels 5x5 on 28x28": ((1, 240, 28, 28), (5, 5), (2, 2, 2, 2), (1, 1)),
    "1152 channels 3x3 on 7x7": ((1, 1152, 7, 7), (3, 3), (1, 1, 1, 1), (1, 1)),
    "72 channels 5x5/2 on 9x11, 2 images": ((2, 72, 9, 11), (5, 5), (2, 2, 2, 2), (2, 2)),
}


@pytest.mark.parametrize("case", sorted(SESSION_CASES))
@pytest.mark.parametrize("tail", ["none", "relu", "residual"])
@pytest.mark.parametrize("threads", [1, 2])
def test_sessions_take_the_blocks_on_avx512_and_match_float64(case, tail, threads, knobs):
    x_shape, kernel, pads, strides = SESSION_CASES[case]
    x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)
    geo = _geometry(x_shape, kernel, pads, strides)
    assert not pairs_depthwise_apply(geo, x, x_shape[1]) and not rows_depthwise_apply(geo, x, x_shape[1])
    assert blocks_depthwise_apply(geo, x, x_shape[1]) == host.AVX512
    if threads > 1:
        knobs(split_depthwise_macs=1)  # (every image's blocks split between the threads)
    model = _model(x_shape, kernel, pads, strides, tail)
    feeds = {"x": x}
    if tail == "residual":
        shape = run_float64(_model(x_shape, kernel, pads, strides, "none"), feeds)[0].shape
        feeds["r"] = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    exact = run_float64(model, feeds)[0]
    sess = _session(model, threads)
    taps = kernel[0] * kernel[1]
    for run in range(3):  # the first run and the later ones (compiled kernels, a fusion's prepared calls)
        ours = sess.run(None, feeds)[0]
        if run == 0:
            deferred.wait_ready(240)
        assert ours.shape == exact.shape and ours.dtype == np.float32
        bound = (taps + 2) * np.finfo(np.float32).eps * (1 + np.abs(exact).max() + np.abs(x).max() * taps)
        assert np.abs(ours - exact).max() <= bound


def _pair(c: int, size: int):
    """Two 5x5 depthwise convolutions of one input (one with a bias and a Relu), both graph outputs: a segment whose
    values stay in the plain layout, so that its plan binds the blocks' loop (segment_layout.py keeps a depthwise
    convolution between blocked convolutions blocked)."""
    rng = np.random.default_rng(c)
    inits = [numpy_helper.from_array((rng.standard_normal((c, 1, 5, 5)) * 0.3).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((c, 1, 5, 5)) * 0.3).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[5, 5], pads=[2, 2, 2, 2], group=c),
             helper.make_node("Relu", ["c1"], ["y1"]),
             helper.make_node("Conv", ["x", "w2"], ["y2"], kernel_shape=[5, 5], strides=[2, 2], pads=[1, 2, 2, 1],
                              group=c)]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y1", "y2")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, size, size])]
    graph = helper.make_graph(nodes, "pair", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_segment_plan_binds_the_blocks(monkeypatch, knobs, threads):
    model = _pair(40, 13)
    x = np.random.default_rng(3).standard_normal((2, 40, 13, 13)).astype(np.float32)
    made, _ = watch_segments(monkeypatch)
    knobs(split_depthwise_macs=1)  # (not the rows' work: the blocks take both; two threads split each)
    sess = _session(model, threads)
    for _ in range(3):
        got = sess.run(None, {"x": x})
    for ours, exact in zip(got, run_float64(model, {"x": x})):
        assert np.abs(ours - exact).max() <= 1e-5 * (1 + np.abs(exact).max())
    plans = [plan for segment in made for plans in segment.plans.values() for plan in (plans or ())]
    assert len(plans) == 1 and plans[0].describe()["kernels"] == 0
    loops = [getattr(function, "__name__", "") for function, _ in plans[0]._steps]  # noqa: SLF001
    parts = [len(arguments[0]) for function, arguments in plans[0]._steps  # noqa: SLF001
             if getattr(function, "__name__", "") == "_claimed"]
    if host.AVX512:
        assert loops.count("depthwise_channel_blocks") == 2 if threads == 1 else parts == [2, 2]


def test_other_layers_keep_their_loops():
    three = np.zeros((1, 144, 56, 56), np.float32)  # 3x3 windows on large planes: the tuned plane loops
    assert not blocks_depthwise_apply(_geometry(three.shape, (3, 3), (1, 1, 1, 1), (1, 1)), three, 144)
    wider = np.zeros((1, 480, 14, 14), np.float32)
    assert not blocks_depthwise_apply(_geometry(wider.shape, (3, 3), (1, 1, 1, 1), (1, 1)), wider, 480)
    convnext = np.zeros((1, 16, 16, 16), np.float32)  # ConvNeXt's 7x7: the rows come first (conv_path)
    assert rows_depthwise_apply(_geometry(convnext.shape, (7, 7), (3, 3, 3, 3), (1, 1)), convnext, 16) == host.AVX512
    doubles = np.zeros((1, 32, 14, 14), np.float64)
    assert not blocks_depthwise_apply(_geometry(doubles.shape, (5, 5), (2, 2, 2, 2), (1, 1)), doubles, 32)
    multiplier = np.zeros((1, 32, 14, 14), np.float32)  # two outputs per channel
    assert not blocks_depthwise_apply(_geometry(multiplier.shape, (5, 5), (2, 2, 2, 2), (1, 1)), multiplier, 64)
