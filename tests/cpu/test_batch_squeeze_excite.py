"""Squeeze-excitation blocks over a batch (issue 26): compiled/segment_loops.squeeze_excite and
blocked_ops.squeeze_excite_blocked run the block's two small products for every image at once
(segment_loops.squeeze_products). Checked against a float64 reference on odd channel, pixel and reduced sizes
(the four-term passes and their remainder), one to 33 images, both gates, SiLU or not after the squeeze, and
through a session (EfficientNet's spelling of the block, both torch exporters' SiLU) at batches 1, 3 and 8."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.session import InferenceSession, SessionOptions
from onnx_runtime_ep_cpu.compiled import blocked_ops, deferred, epilogue, segment_loops
from reference64 import run_float64

RNG = np.random.default_rng(2026)
LANES = 16  # blocked_ops' channels per block


def _reference(x, w1, b1, relu, swish, w2, b2, hard, alpha, beta):
    """float64: x (N, C, P) times the gate of the block's two products of the planes' means."""
    x, w1, b1, w2, b2 = (a.astype(np.float64) for a in (x, w1, b1, w2, b2))
    hidden = x.mean(axis=2) @ w1.T + b1
    if relu:
        hidden = np.maximum(hidden, 0)
    if swish:
        hidden = hidden / (1 + np.exp(-hidden))
    excited = hidden @ w2.T + b2
    gate = np.clip(alpha * excited + beta, 0, 1) if hard else 1 / (1 + np.exp(-excited))
    return x * gate[:, :, None]


def _parameters(channels, reduced):
    w1 = (RNG.standard_normal((reduced, channels)) / np.sqrt(channels)).astype(np.float32)
    w2 = (RNG.standard_normal((channels, reduced)) / np.sqrt(reduced) * 2).astype(np.float32)
    b1 = RNG.standard_normal(reduced).astype(np.float32)
    b2 = RNG.standard_normal(channels).astype(np.float32)
    return w1, b1, w2, b2


def _transposed(weights):
    """The kernels' layout of a 1x1 convolution's (outputs, inputs) weights: (inputs, outputs), C-contiguous."""
    return np.ascontiguousarray(weights.T)


def _bounds(relu):
    return epilogue.activation_bounds(epilogue.RELU if relu else epilogue.NONE, (), np.float32)


def _gate(hard):
    return ((segment_loops.HARD_SIGMOID_GATE, np.float32(0.2), np.float32(0.5)) if hard
            else (segment_loops.SIGMOID_GATE, np.float32(0), np.float32(0)))


CASES = [  # (images, channels, pixels, reduced)
    (1, 7, 1, 2), (2, 33, 4, 5), (3, 20, 9, 6), (5, 40, 4, 10), (8, 17, 1, 3), (32, 96, 4, 4), (33, 48, 2, 12)]


@pytest.mark.parametrize("images, channels, pixels, reduced", CASES)
@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("swish", [False, True])
def test_plain_block_matches_float64(images, channels, pixels, reduced, hard, swish):
    x = RNG.standard_normal((images, channels, pixels)).astype(np.float32) * 3
    w1, b1, w2, b2 = _parameters(channels, reduced)
    relu = not swish
    y = np.full_like(x, np.nan)
    scratch = [np.empty(size, np.float32) for size in (channels, reduced, channels)]
    segment_loops.squeeze_excite(x, _transposed(w1), b1, _bounds(relu), swish, _transposed(w2), b2, _bounds(False),
                                 *_gate(hard), y, *scratch)
    expected = _reference(x, w1, b1, relu, swish, w2, b2, hard, 0.2, 0.5)
    assert np.abs(y - expected).max() <= 2e-6 * (1 + np.abs(expected).max())


def _blocked(x: np.ndarray) -> np.ndarray:
    """(N, C, P) -> blocked_ops' flat (N, blocks, P, 16), channels past C zero."""
    n, c, p = x.shape
    blocks = -(-c // LANES)
    padded = np.zeros((n, blocks * LANES, p), x.dtype)
    padded[:, :c] = x
    return np.ascontiguousarray(padded.reshape(n, blocks, LANES, p).transpose(0, 1, 3, 2)).reshape(-1)


def _unblocked(flat: np.ndarray, n: int, c: int, p: int) -> np.ndarray:
    blocks = -(-c // LANES)
    return flat.reshape(n, blocks, p, LANES).transpose(0, 1, 3, 2).reshape(n, blocks * LANES, p)


@pytest.mark.parametrize("images, channels, pixels, reduced", CASES)
@pytest.mark.parametrize("hard", [False, True])
def test_blocked_block_matches_float64(images, channels, pixels, reduced, hard):
    x = RNG.standard_normal((images, channels, pixels)).astype(np.float32) * 3
    w1, b1, w2, b2 = _parameters(channels, reduced)
    blocks = -(-channels // LANES)
    flat = _blocked(x)
    y = np.full_like(flat, np.nan)
    pooled, hidden, scale = (np.empty(size, np.float32) for size in (blocks * LANES, reduced, blocks * LANES))
    blocked_ops.squeeze_excite_blocked(flat, _transposed(w1), b1, _bounds(True), False, _transposed(w2), b2,
                                       _bounds(False), *_gate(hard), y,
                                       images, channels, pixels, pooled, hidden, scale)
    got = _unblocked(y, images, channels, pixels)
    expected = _reference(x, w1, b1, True, False, w2, b2, hard, 0.2, 0.5)
    assert np.abs(got[:, :channels] - expected).max() <= 2e-6 * (1 + np.abs(expected).max())
    assert not got[:, channels:].any()  # the padding lanes stay zero


def _se_model(spelling: str, channels: int, reduced: int, size: int) -> onnx.ModelProto:
    """Conv -> SiLU -> EfficientNet's squeeze-excitation block (pool, 1x1 conv, SiLU, 1x1 conv, Sigmoid, Mul), the
    SiLU as Sigmoid and Mul (both torch exporters) or as Swish (opset 24); dynamic batch."""
    def silu(name, x):
        if spelling == "swish":
            return [helper.make_node("Swish", [x], [name], alpha=1.0)]
        return [helper.make_node("Sigmoid", [x], [name + "_s"]), helper.make_node("Mul", [x, name + "_s"], [name])]

    w0 = (RNG.standard_normal((channels, 3, 3, 3)) / 3).astype(np.float32)
    w1, b1, w2, b2 = _parameters(channels, reduced)
    weights = [numpy_helper.from_array(a, n) for a, n in ((w0, "w0"), (w1.reshape(reduced, channels, 1, 1), "w1"),
                                                           (b1, "b1"), (w2.reshape(channels, reduced, 1, 1), "w2"),
                                                           (b2, "b2"))]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], kernel_shape=[3, 3], pads=[1] * 4), *silu("h", "c0"),
             helper.make_node("GlobalAveragePool", ["h"], ["p"]),
             helper.make_node("Conv", ["p", "w1", "b1"], ["c1"], kernel_shape=[1, 1]), *silu("q", "c1"),
             helper.make_node("Conv", ["q", "w2", "b2"], ["c2"], kernel_shape=[1, 1]),
             helper.make_node("Sigmoid", ["c2"], ["g"]), helper.make_node("Mul", ["h", "g"], ["y"])]
    graph = helper.make_graph(nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                           ["n", 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24 if spelling == "swish" else 17)])
    model.ir_version = 10 if spelling == "swish" else 8
    return model


@pytest.mark.parametrize("spelling", ["mul", "swish"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_session_block_over_a_batch(spelling, batch):
    model = _se_model(spelling, channels=40, reduced=10, size=5)
    options = SessionOptions()
    options.intra_op_num_threads = 1
    session = InferenceSession(model.SerializeToString(), options)
    for run in range(4):  # node by node, then the plan made and checked, then the plan
        x = RNG.standard_normal((batch, 3, 5, 5)).astype(np.float32)
        (got,) = session.run(None, {"x": x})
        (expected,) = run_float64(model, {"x": x})
        assert got.shape == expected.shape and got.dtype == np.float32
        assert np.abs(got - expected).max() <= 1e-5 * (1 + np.abs(expected).max()), run
        if run == 0:
            deferred.wait_ready(240)


def test_one_images_sums_run_in_order_as_running_sums():
    """squeeze_scale sums every output at once, one weights' row a pass, yet each output's sum runs over its inputs in
    order from 0 as a float32 running sum does: the same bits (hard gate, no libm)."""
    channels, reduced = 37, 11
    w1, b1, w2, b2 = _parameters(channels, reduced)
    pooled = RNG.standard_normal(channels).astype(np.float32)
    hidden, scale = np.empty(reduced, np.float32), np.empty(channels, np.float32)
    segment_loops.squeeze_scale(pooled, _transposed(w1), b1, _bounds(True), False, _transposed(w2), b2,
                                _bounds(False), *_gate(True), hidden, scale)
    expected_hidden = np.empty(reduced, np.float32)
    for r in range(reduced):
        total = np.float32(0)
        for c in range(channels):
            total = np.float32(total + np.float32(w1[r, c] * pooled[c]))
        expected_hidden[r] = max(np.float32(total + b1[r]), np.float32(0))
    for c in range(channels):
        total = np.float32(0)
        for r in range(reduced):
            total = np.float32(total + np.float32(w2[c, r] * expected_hidden[r]))
        v = np.float32(np.float32(np.float32(0.2) * np.float32(total + b2[c])) + np.float32(0.5))
        assert scale[c] == min(max(v, np.float32(0)), np.float32(1))


@pytest.mark.parametrize("pixels", [0, 1, 7, 49])
def test_blocked_means_and_products_run_pixel_by_pixel_in_vectors(pixels):
    """blocked_ops' plane sums (16 lanes a vector) add the pixels in order from 0 as the plain loop does: the same
    bits as float32 running sums per lane; the gate's product is each value times its channel's factor."""
    images, blocks = 2, 3
    x = RNG.standard_normal(images * blocks * pixels * LANES).astype(np.float32)
    scale = RNG.standard_normal(blocks * LANES).astype(np.float32)
    for n in range(images):
        sums = np.full(blocks * LANES, np.nan, np.float32)
        blocked_ops._lane_sums(x, n, blocks, pixels, sums)  # noqa: SLF001
        planes = x.reshape(images, blocks, pixels, LANES)[n]
        expected = np.zeros((blocks, LANES), np.float32)
        for p in range(pixels):
            expected = expected + planes[:, p]
        assert np.array_equal(sums, expected.reshape(-1))
        y = np.full_like(x, np.nan)
        blocked_ops._scaled(x, n, blocks, pixels, scale, y)  # noqa: SLF001
        image = slice(n * blocks * pixels * LANES, (n + 1) * blocks * pixels * LANES)
        assert np.array_equal(y[image].reshape(blocks, pixels, LANES), planes * scale.reshape(blocks, 1, LANES))
