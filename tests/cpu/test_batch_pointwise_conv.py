"""1x1 convolutions at batch size: the product over every image's pixels (algorithms/conv_pointwise_batch.py)
for one output pixel per image or a large product over a few, and the other paths for the rest, strided
included, each against the float64 result within the rounding bound of its sums."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, record_calls, record_results, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms.conv_pointwise_batch import PointwiseBatch
from onnx_runtime_ep_cpu.compiled import deferred
from reference64 import gamma, run_float64


def _pointwise_reference(x, w, b, strides):
    """The float64 1x1 convolution and the bound on a float32 result's error (any summation order)."""
    picked = x.astype(np.float64)[:, :, ::strides[0], ::strides[1]]
    weights = w.astype(np.float64).reshape(w.shape[0], -1)
    exact = np.einsum("mc,nchw->nmhw", weights, picked)
    magnitude = np.einsum("mc,nchw->nmhw", np.abs(weights), np.abs(picked))
    if b is not None:
        exact += b.astype(np.float64)[None, :, None, None]
        magnitude += np.abs(b.astype(np.float64))[None, :, None, None]
    return exact, gamma(x.shape[1] + 1, x.dtype) * magnitude + 1e-30


# (batch, channels in, outputs, height, width, strides, whether the batch product takes it)
GEOMETRIES = [
    (33, 37, 11, 1, 1, (1, 1), True),  # a squeeze-excite block's pooled pixel
    (17, 29, 5, 5, 7, (5, 7), True),  # strided to one pixel per image
    (9, 211, 163, 2, 2, (1, 1), True),  # a late stage's 2x2 map, a large product
    (11, 203, 167, 3, 4, (2, 3), True),  # strided, odd sizes, 2x2 outputs
    (13, 19, 23, 9, 7, (2, 3), False),  # strided to 5x3: the packed convolution
    (7, 31, 9, 2, 2, (1, 1), False),  # a small product over 2x2: the packed convolution
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g[:5])) + f"s{g[5][0]}{g[5][1]}")
def test_pointwise_conv_against_float64(monkeypatch, geometry, with_bias, dtype):
    n, c, m, h, w_, strides, batched = geometry
    rng = np.random.default_rng(sum(geometry[:5]))
    x = rng.standard_normal((n, c, h, w_)).astype(dtype)
    w = rng.standard_normal((m, c, 1, 1)).astype(dtype)
    b = rng.standard_normal(m).astype(dtype) if with_bias else None
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(b, "b")] if with_bias else [])
    node = helper.make_node("Conv", ["x", "w", "b"] if with_bias else ["x", "w"], ["y"], kernel_shape=[1, 1],
                            strides=list(strides))
    model = make_model([node], [tensor_info("x", elem, ["n", c, h, w_])], [tensor_info("y", elem)], inits)
    calls = record_calls(monkeypatch, PointwiseBatch)
    session = ort.InferenceSession(model.SerializeToString())
    got = session.run(None, {"x": x})[0]
    exact, bound = _pointwise_reference(x, w, b, strides)
    assert got.shape == exact.shape and got.dtype == dtype
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)
    assert bool(calls) == (batched and dtype == np.float32 or batched and dtype == np.float64)


def _block_model(channels: int, hidden: int):
    """Two 1x1 convolutions over a 2x2 map with a Relu between and a residual Add then Relu after (the
    fusions make them FusedConvs in one segment, the second adding the residual in its epilogue)."""
    rng = np.random.default_rng(26)
    w1 = (rng.standard_normal((hidden, channels, 1, 1)) / np.sqrt(channels)).astype(np.float32)
    w2 = (rng.standard_normal((channels, hidden, 1, 1)) / np.sqrt(hidden)).astype(np.float32)
    b1, b2 = (rng.standard_normal(k).astype(np.float32) * 0.1 for k in (hidden, channels))
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], kernel_shape=[1, 1]),
             helper.make_node("Add", ["c2", "x"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    inits = [numpy_helper.from_array(a, name) for a, name in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))]
    return make_model(nodes, [tensor_info("x", shape=["n", channels, 2, 2])], [tensor_info("y")], inits)


def test_pointwise_block_with_residual_in_a_segment(monkeypatch):
    """The plan binds both convolutions (the residual through the epilogue): every run after the first is the
    bound plan's, and each agrees with float64 within the sums' rounding."""
    deferred.wait_ready(240)  # (plans are made once the compiled loops have loaded)
    channels, hidden = 192, 200
    model = _block_model(channels, hidden)
    calls = record_calls(monkeypatch, PointwiseBatch)
    bound = record_results(monkeypatch, PointwiseBatch, "bind")
    session = ort.InferenceSession(model.SerializeToString())
    x = np.random.default_rng(5).standard_normal((24, channels, 2, 2)).astype(np.float32)
    (exact,) = run_float64(model, {"x": x})
    scale = float(np.abs(exact).max())
    for _ in range(3):
        got = session.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, exact, rtol=0, atol=gamma(2 * (channels + hidden)) * 8 * scale)
    assert calls, "the batch product did not run"
    # both convolutions bound, the second's epilogue with the residual (its last step, the finish's rows)
    assert len({len(steps) for steps in bound}) == 1 and len(bound) >= 2
    residuals = [steps[-1][0].__self__.residual.size for steps in bound]
    assert any(size == x.size for size in residuals) and any(size == 0 for size in residuals)
