"""When a depthwise convolution of one image splits its channels across the helper threads: from the
split_depthwise_macs knob's multiply-adds (tuning.py), not from split_elements's 64K, which sent a
mobilenet's 16x32x32 and 64x16x16 3x3 layers (147K multiply-adds, ~19 us on one thread) to the helper, where
the hand-off cost more than it saved on default threads (issue 20). Results on one, two and three threads
against a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.compiled import host
from onnx_runtime_ep_cpu.ops import conv as conv_ops


def _reference(x, w, b, stride):
    """float64 depthwise convolution, 3x3 windows, one pixel of zero padding on every side."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    _, c, h, width = x.shape
    padded = np.pad(x64, ((0, 0), (0, 0), (1, 1), (1, 1)))
    oh, ow = (h - 1) // stride + 1, (width - 1) // stride + 1
    y = np.zeros((1, c, oh, ow)) + b.astype(np.float64)[None, :, None, None]
    for i in range(3):
        for j in range(3):
            window = padded[:, :, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride]
            y += window * w64[None, :, 0, i, j, None, None]
    return y


@pytest.mark.parametrize("channels,size,stride,splits", [
    (16, 32, 1, False),  # mobilenetv3's first depthwise layer at the zoo's input size: 147K multiply-adds
    (64, 16, 1, False),  # its 64-channel layer: 147K
    (64, 64, 1, True),  # 2.4M: worth a helper
    (128, 64, 2, True),  # strided: counted by the input read, 4.7M
])
def test_depthwise_splits_from_the_knobs_size(monkeypatch, kernel_threads, channels, size, stride, splits):
    from onnx_runtime_ep_cpu.compiled import jobs

    posted = []  # the parts of each split depthwise convolution (jobs.split_depthwise, posted from compiled code)
    real = jobs.split_depthwise
    monkeypatch.setattr(jobs, "split_depthwise", lambda *a: posted.append(len(a[19]) - 1) or real(*a))
    rng = np.random.default_rng(channels + size)
    x = rng.standard_normal((1, channels, size, size), dtype=np.float32)
    w = rng.standard_normal((channels, 1, 3, 3), dtype=np.float32)
    b = rng.standard_normal(channels, dtype=np.float32)
    attrs = dict(kernel_shape=[3, 3], group=channels, pads=[1, 1, 1, 1], strides=[stride, stride])
    conv = conv_ops.conv(Node("Conv", ["x", "w", "b"], ["y"], attrs=attrs, opset=13), None, 13)
    for _ in range(2):  # the second call: the kept plan
        (y,) = conv(x, w, b)
        np.testing.assert_allclose(y, _reference(x, w, b, stride), rtol=1e-5, atol=1e-5)
    # (thread spans are AVX-512 hosts' only; elsewhere the loop runs whole on the caller)
    split = splits and kernel_threads > 1 and host.AVX512
    assert posted == ([kernel_threads] * 2 if split else []), posted


def test_the_knob_still_forces_a_small_split(monkeypatch, knobs):
    """split_depthwise_macs=1 splits the small layer again (the knob decides, nothing else): same values."""
    from onnx_runtime_ep_cpu.compiled import jobs

    if not host.AVX512:
        pytest.skip("thread spans split on AVX-512 hosts only")
    knobs(threads=2, split_depthwise_macs=1)
    posted = []
    real = jobs.split_depthwise
    monkeypatch.setattr(jobs, "split_depthwise", lambda *a: posted.append(len(a[19]) - 1) or real(*a))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 16, 32, 32), dtype=np.float32)
    w = rng.standard_normal((16, 1, 3, 3), dtype=np.float32)
    b = rng.standard_normal(16, dtype=np.float32)
    attrs = dict(kernel_shape=[3, 3], group=16, pads=[1, 1, 1, 1])
    (y,) = conv_ops.conv(Node("Conv", ["x", "w", "b"], ["y"], attrs=attrs, opset=13), None, 13)(x, w, b)
    np.testing.assert_allclose(y, _reference(x, w, b, 1), rtol=1e-5, atol=1e-5)
    assert posted == [2]
