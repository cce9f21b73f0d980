"""The output rows across the lanes (compiled/depthwise_rows.py, algorithms/conv_depthwise_small.RowsDepthwise): 5x5
and 7x7 depthwise windows over small planes. The loop against a float64 reference for odd sizes, uneven pads,
strides 1 and 2, dilations, batches and activation bounds (its vectors are plain LLVM ones: it runs on every x86
host); and through sessions (the Conv alone, with a Relu, with a residual sum) where the host takes it (AVX-512,
stride 1), ConvNeXt's shapes included."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms.conv_depthwise_small import (
    flat_depthwise_apply,
    pairs_depthwise_apply,
    rows_depthwise_apply,
)
from onnx_runtime_ep_cpu.algorithms.window import Geometry
from onnx_runtime_ep_cpu.compiled import deferred, host
from reference64 import run_float64

# (x shape, kernel, strides, dilations, pads (begin h, w, end h, w))
LOOP_CASES = {
    "7x7 on 16x16": ((1, 16, 16, 16), (7, 7), (1, 1), (1, 1), (3, 3, 3, 3)),
    "7x7 on 8x8": ((1, 32, 8, 8), (7, 7), (1, 1), (1, 1), (3, 3, 3, 3)),
    "7x7 on 13x11, 2 images": ((2, 5, 13, 11), (7, 7), (1, 1), (1, 1), (3, 3, 3, 3)),
    "7x7 on 9x21, uneven pads": ((1, 3, 9, 21), (7, 7), (1, 1), (1, 1), (3, 1, 2, 4)),
    "7x7/2 on 13x19": ((1, 5, 13, 19), (7, 7), (2, 2), (1, 1), (3, 3, 3, 3)),
    "5x5/(1,2) dilated 2": ((1, 5, 13, 19), (5, 5), (1, 2), (2, 2), (3, 1, 2, 4)),
    "3x7/(2,1) dilated (1,2), no top pad": ((1, 3, 9, 20), (3, 7), (2, 1), (1, 2), (0, 5, 1, 0)),
    "7x7/2 on 7x7, no pads": ((3, 4, 7, 7), (7, 7), (2, 2), (1, 1), (0, 0, 0, 0)),
    "5x5 on 12x10, columns dilated 2": ((1, 6, 12, 10), (5, 5), (1, 1), (1, 2), (2, 4, 2, 4)),
    "7x7 on 17x17, columns stride 2": ((1, 3, 17, 17), (7, 7), (1, 2), (1, 1), (3, 3, 3, 3)),
}
BOUNDS = {"none": (-np.inf, np.inf, 1.0), "relu": (0.0, np.inf, 0.0), "leaky clip": (-1.0, 1.5, 0.1)}


def _reference(x, w, b, strides, dilations, pads, out, bounds):
    n, c, h, width = x.shape
    kh, kw = w.shape[2:]
    padded = np.zeros((n, c, h + pads[0] + pads[2] + 64, width + pads[1] + pads[3] + 64))
    padded[:, :, pads[0]:pads[0] + h, pads[1]:pads[1] + width] = x
    y = np.zeros((n, c, *out)) + b[None, :, None, None]
    (sh, sw), (dh, dw) = strides, dilations
    for i in range(kh):
        for j in range(kw):
            window = padded[:, :, i * dh:i * dh + out[0] * sh:sh, j * dw:j * dw + out[1] * sw:sw]
            y += w[None, :, 0, i, j, None, None] * window
    low, high, slope = bounds
    y = np.where(y < 0, y * slope, y)
    return np.minimum(np.maximum(y, low), high)


@pytest.mark.parametrize("case", sorted(LOOP_CASES))
@pytest.mark.parametrize("activation", sorted(BOUNDS))
def test_loop_matches_float64(case, activation):
    from onnx_runtime_ep_cpu.compiled import depthwise_rows

    shape, kernel, strides, dilations, pads = LOOP_CASES[case]
    rng = np.random.default_rng(sum(shape))
    n, c, h, width = shape
    out = tuple((size + pads[a] + pads[a + 2] - d * (k - 1) - 1) // s + 1
                for a, (size, k, s, d) in enumerate(zip((h, width), kernel, strides, dilations)))
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((c, 1, *kernel)) * 0.3).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    bounds = np.array(BOUNDS[activation], np.float32)
    exact = _reference(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), strides, dilations, pads,
                       out, BOUNDS[activation])
    height = depthwise_rows.shared_height(kernel, strides, dilations)  # (0 or the tiles sharing their row loads)
    for lanes, shared in ((8, height), (16, height), (8, 0), (16, 0)):
        taps, phase_width, size = depthwise_rows.plane_layout((h, width), kernel, strides, dilations, pads[:2], out,
                                                              lanes)
        # a guard past the planes and the output: nothing may be written there
        planes = np.zeros(strides[1] * size + 32, np.float32)
        y = np.full(n * c * out[0] * out[1] + 32, 7.0, np.float32)
        depthwise_rows.depthwise_rows(x.reshape(-1), w.reshape(-1).copy(), b, bounds, y, planes, taps, h, width,
                                      pads[0], pads[1], strides[1], phase_width, size, out[0], out[1], strides[0],
                                      lanes, shared)
        taps_count = kernel[0] * kernel[1]
        bound = (taps_count + 2) * np.finfo(np.float32).eps * (1 + np.abs(x).max() * np.abs(w).max() * taps_count)
        assert np.abs(y[:-32].reshape(exact.shape) - exact).max() <= bound
        assert (y[-32:] == 7.0).all() and (planes[-32:] == 0).all()


def _model(x_shape, kernel, pads, strides, tail):
    c = x_shape[1]
    rng = np.random.default_rng(sum(x_shape))
    w = (rng.standard_normal((c, 1, *kernel)) * 0.3).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv"], kernel_shape=list(kernel), group=c, pads=list(pads),
                              strides=list(strides))]
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


def _geometry(x_shape, kernel, pads, strides) -> Geometry:
    out = tuple((n + pads[i] + pads[i + 2] - k) // s + 1
                for i, (n, k, s) in enumerate(zip(x_shape[2:], kernel, strides)))
    return Geometry(tuple(x_shape[2:]), kernel, strides, (1, 1), tuple(pads[:2]), tuple(pads[2:]), out)


SESSION_CASES = {
    "ConvNeXt stage 0": ((1, 16, 16, 16), (7, 7), (3, 3, 3, 3), (1, 1)),
    "ConvNeXt stage 1": ((1, 32, 8, 8), (7, 7), (3, 3, 3, 3), (1, 1)),
    "14x14, 2 images": ((2, 24, 14, 14), (7, 7), (3, 3, 3, 3), (1, 1)),
    "7x7/2 on 15x13, uneven pads": ((1, 8, 15, 13), (7, 7), (3, 2, 1, 3), (2, 2)),
    "5x5 on 16x16": ((1, 32, 16, 16), (5, 5), (2, 2, 2, 2), (1, 1)),
    "5x5 on 8x8": ((1, 64, 8, 8), (5, 5), (2, 2, 2, 2), (1, 1)),
}


@pytest.mark.parametrize("case", sorted(SESSION_CASES))
@pytest.mark.parametrize("tail", ["none", "relu", "residual"])
def test_sessions_take_the_rows_on_avx512_and_match_float64(case, tail):
    x_shape, kernel, pads, strides = SESSION_CASES[case]
    x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)
    geo = _geometry(x_shape, kernel, pads, strides)
    assert not pairs_depthwise_apply(geo, x, x_shape[1])
    assert rows_depthwise_apply(geo, x, x_shape[1]) == (host.AVX512 and strides == (1, 1))  # (strided: plane loops)
    model = _model(x_shape, kernel, pads, strides, tail)
    feeds = {"x": x}
    exact = run_float64(_model(x_shape, kernel, pads, strides, "none"), feeds)[0]
    if tail == "residual":
        feeds["r"] = np.random.default_rng(2).standard_normal(exact.shape).astype(np.float32)
    exact = run_float64(model, feeds)[0]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    taps = kernel[0] * kernel[1]
    for run in range(3):  # the first run and the later ones (compiled kernels, a fusion's prepared calls)
        ours = sess.run(None, feeds)[0]
        if run == 0:
            deferred.wait_ready(240)
        assert ours.shape == exact.shape and ours.dtype == np.float32
        bound = (taps + 2) * np.finfo(np.float32).eps * (1 + np.abs(exact).max() + np.abs(x).max() * taps)
        assert np.abs(ours - exact).max() <= bound


def test_small_windows_and_large_planes_keep_their_loops():
    x = np.zeros((1, 32, 16, 16), np.float32)
    three = _geometry(x.shape, (3, 3), (1, 1, 1, 1), (1, 1))
    assert not rows_depthwise_apply(three, x, 32)  # the tuned 3x3 choices
    large = np.zeros((1, 16, 48, 48), np.float32)
    assert not rows_depthwise_apply(_geometry(large.shape, (7, 7), (3, 3, 3, 3), (1, 1)), large, 16)  # 2304 outputs
    wide = np.zeros((1, 64, 32, 32), np.float32)  # work the plane loops split across threads
    assert not rows_depthwise_apply(_geometry(wide.shape, (5, 5), (2, 2, 2, 2), (1, 1)), wide, 64)
    assert not rows_depthwise_apply(_geometry(x.shape, (7, 7), (3, 3, 3, 3), (1, 1)), x.astype(np.float64), 32)
    small = np.zeros((1, 64, 4, 4), np.float32)  # the pair sums come first there
    assert pairs_depthwise_apply(_geometry(small.shape, (7, 7), (3, 3, 3, 3), (1, 1)), small, 64)
    eight = np.zeros((1, 32, 8, 8), np.float32)
    assert flat_depthwise_apply(_geometry(eight.shape, (7, 7), (3, 3, 3, 3), (1, 1)), eight, 32)  # (without AVX-512)
