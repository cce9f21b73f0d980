"""A FusedConv kernel keeps its direct tiles' bound call (DirectConv.bound_run) from its second call with constant
weights and bias and no residual: later frames of the same shape match the first call bit for bit and a float64
reference, read their own values, and other shapes, a residual or writable weights go through the full path."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms.conv_direct import DirectConv
from onnx_runtime_ep_cpu.ops import conv as conv_ops


def _constant(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False  # an initializer: the same read-only array on every run
    return array


def _reference(x, w, b, activation: str, z=None) -> np.ndarray:
    """A valid (unpadded, stride 1) convolution in float64, + bias (+ residual z), then the activation."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    spatial = x.shape[2:]
    kernel = w.shape[2:]
    out = tuple(s - k + 1 for s, k in zip(spatial, kernel))
    y = np.zeros((x.shape[0], w.shape[0], *out))
    for index in np.ndindex(*out):
        window = x[(slice(None), slice(None), *(slice(i, i + k) for i, k in zip(index, kernel)))]
        y[(slice(None), slice(None), *index)] = np.tensordot(window, w, axes=(list(range(1, x.ndim)),
                                                                              list(range(1, w.ndim))))
    y += b.astype(np.float64).reshape(1, -1, *([1] * len(out)))
    if z is not None:
        y += z
    if activation == "Relu":
        y = np.maximum(y, 0)
    elif activation == "HardSwish":
        y = y * np.clip(y / 6 + 0.5, 0, 1)
    return y


@pytest.mark.parametrize("activation", ["Relu", "HardSwish"])
@pytest.mark.parametrize("x_shape,w_shape", [((1, 40, 3), (64, 40, 3)), ((1, 8, 11), (16, 8, 3)),
                                             ((1, 1, 12, 3), (16, 1, 3, 3)), ((2, 3, 9, 9), (24, 3, 3, 3))])
def test_fused_conv_keeps_the_direct_tiles_call(monkeypatch, activation, x_shape, w_shape):
    rng = np.random.default_rng(len(x_shape) * 10 + w_shape[0])
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = _constant(rng.standard_normal(w_shape, dtype=np.float32) * np.float32(0.3))
    b = _constant(rng.standard_normal(w_shape[0]).astype(np.float32))
    kernel_shape = list(w_shape[2:])
    node = Node("FusedConv", ["x", "w", "b"], ["y"], name="c", opset=1,
                attrs={"kernel_shape": kernel_shape, "activation": activation})
    kernel = conv_ops.fused_conv(node, [None] * 3, 1)
    first = [kernel(x, w, b)[0] for _ in range(2)][-1]
    bound = 1e-5 * np.sqrt(np.prod(w_shape[1:])) * 3 + 1e-5
    assert np.abs(first - _reference(x, w, b, activation)).max() <= bound
    runs = []
    monkeypatch.setattr(DirectConv, "run", lambda self, *args, **kw: runs.append(1) or real_run(self, *args, **kw))
    for scale in (1.0, -2.0):  # a later frame's own values
        frame = x * np.float32(scale)
        (y,) = kernel(frame, w, b)
        assert y.shape == first.shape and y.dtype == np.float32
        assert np.abs(y - _reference(frame, w, b, activation)).max() <= bound * 2
    assert np.array_equal(kernel(x, w, b)[0], first)
    kept = not runs  # through the bound call where the direct tiles took the node
    # A residual, another shape or writable weights take the full path again (and still compute the right values).
    z = rng.standard_normal(first.shape, dtype=np.float32)
    (y,) = kernel(x, w, b, z)
    assert np.abs(y - _reference(x, w, b, activation, z)).max() <= bound * 2
    wider = np.concatenate([x, x[..., :1]], axis=-1)
    (y,) = kernel(wider, w, b)
    assert np.abs(y - _reference(wider, w, b, activation)).max() <= bound
    writable = w.copy()
    (y,) = kernel(x, writable, b)
    writable *= 2
    (y,) = kernel(x, writable, b)
    assert np.abs(y - _reference(x, writable, b, activation)).max() <= bound * 2
    if kept:
        assert runs  # the residual, wider and writable calls ran the full path


real_run = DirectConv.run


def test_the_keyword_spotter_conv_takes_the_bound_call(monkeypatch):
    """The streaming keyword spotter's Conv1d (40 features x 3 frames into 64 channels, one output frame) runs the
    direct tiles, so from its second call it is bound."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 40, 3), dtype=np.float32)
    w = _constant(rng.standard_normal((64, 40, 3), dtype=np.float32))
    b = _constant(rng.standard_normal(64).astype(np.float32))
    node = Node("FusedConv", ["x", "w", "b"], ["y"], name="c", opset=1,
                attrs={"kernel_shape": [3], "activation": "Relu"})
    kernel = conv_ops.fused_conv(node, [None] * 3, 1)
    for _ in range(3):
        kernel(x, w, b)
    runs = []
    monkeypatch.setattr(DirectConv, "run", lambda self, *args, **kw: runs.append(1) or real_run(self, *args, **kw))
    (y,) = kernel(x, w, b)
    assert y.shape == (1, 64, 1)
    assert np.abs(y - _reference(x, w, b, "Relu")).max() <= 1e-4
    from onnx_runtime_ep_cpu.compiled import gemm

    if gemm.AVAILABLE:  # (AVX-512 hosts route this size to the direct tiles: conv_direct.SMALL_MACS)
        assert not runs
