"""Max pools on small maps (a streaming CRNN's pool over one frame's features) run over their taps' strided
views in numpy (algorithms/pooling.py SmallMaxPool), not the compiled loop: the same maxima as onnxruntime
and a float64 reference, for padded, dilated, strided, ceil-mode and 1-D windows."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.algorithms import pooling, window
from onnx_runtime_ep_cpu.ops import pool as pool_ops
from onnx_runtime_ep_cpu.registry import lookup

CASES = [
    ((1, 16, 40, 1), {"kernel_shape": [2, 1], "strides": [2, 1]}),  # the CRNN's
    ((1, 3, 9, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 3, 8, 8), {"kernel_shape": [2, 2], "strides": [1, 1], "dilations": [2, 2]}),
    ((1, 5, 7, 6), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 6, 11), {"kernel_shape": [3], "strides": [2], "pads": [1, 0]}),
    ((1, 8, 10, 10), {"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
]


def _kernel(attrs, shape):
    node = Node("MaxPool", ["x"], ["y"], name="pool", attrs=dict(attrs), opset=12)
    return lookup("MaxPool", "", 12)(node, [shape], 12)


def _reference(x, attrs):
    node = Node("MaxPool", ["x"], ["y"], name="ref", attrs=dict(attrs), opset=12)
    geo = window.Window(node, [x.shape], needs_kernel=True).resolve(x.shape[2:])
    return geo.reduce_windows(x.astype(np.float64), np.maximum, -np.inf)


@pytest.mark.parametrize("shape,attrs", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_max_pools_match_onnxruntime_and_float64(monkeypatch, shape, attrs, dtype):
    monkeypatch.setattr(pool_ops, "compiled_pool", None)  # the compiled loop must not be reached
    rng = np.random.default_rng(len(shape) + sum(shape))
    x = rng.standard_normal(shape).astype(dtype)
    x.flat[3] = np.nan  # a NaN in a window wins, as in numpy's maximum and the compiled loops
    kernel = _kernel(attrs, shape)
    for _ in range(3):  # the first call resolves the shape's taps, the next reuse them
        (y,) = kernel(x)
    assert y.dtype == dtype
    expected = _reference(x, attrs)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(expected))
    np.testing.assert_allclose(y, expected, rtol=0, atol=0)
    model = make_model([helper.make_node("MaxPool", ["x"], ["y"], **attrs)],
                       [tensor_info("x", 11 if dtype == np.float64 else 1, list(shape))],
                       [tensor_info("y", 11 if dtype == np.float64 else 1, None)], opset=12)
    theirs = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (their_y,) = theirs.run(None, {"x": x})
    finite = ~np.isnan(their_y) & ~np.isnan(y)  # (onnxruntime skips a NaN that is not a window's first tap)
    assert their_y.shape == y.shape
    np.testing.assert_array_equal(y[finite], their_y[finite])


def test_large_maps_keep_the_compiled_loop(monkeypatch):
    # the compiled loop through compiled_pool, or through its kept call (pooling.KeptPool) once numba is loaded
    calls = []
    real, real_kept = pool_ops.compiled_pool, pooling.KeptPool.__call__

    def kept(self, x):
        y = real_kept(self, x)
        if y is not None:
            calls.append("kept")
        return y

    monkeypatch.setattr(pool_ops, "compiled_pool", lambda *args: calls.append("compiled_pool") or real(*args))
    monkeypatch.setattr(pooling.KeptPool, "__call__", kept)
    x = np.random.default_rng(1).standard_normal((1, 32, 32, 32)).astype(np.float32)
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    assert x.size * 4 > pooling.SMALL_MAX_READS
    (y,) = _kernel(attrs, x.shape)(x)
    np.testing.assert_array_equal(y, _reference(x, attrs).astype(np.float32))
    assert calls
