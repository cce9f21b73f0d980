"""A segment's reference run (compiled/reference_run.py) serves its convolutions by numpy: conv_im2col then
copies each block's taps for every image at once through the window view, where the compiled fill's numpy
equivalent copied one tap of one image at a time (a 7x7 stem at 32 images: about 1,500 copies a block). The
column matrix is the same copy, so the result is the same; outside a reference run the compiled fill serves."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms import conv_blas
from onnx_runtime_ep_cpu.algorithms.conv_blas import conv_im2col, grouped_weights
from onnx_runtime_ep_cpu.algorithms.window import Geometry
from onnx_runtime_ep_cpu.compiled import im2col
from onnx_runtime_ep_cpu.compiled.reference_run import ReferenceRun
from onnx_runtime_ep_cpu.tuning import KNOBS


def _geometry(size, kernel, stride, pad, dilation=1) -> Geometry:
    out = (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
    return Geometry((size, size), (kernel, kernel), (stride, stride), (dilation, dilation), (pad, pad), (pad, pad),
                    (out, out))


def _float64(x, w, b, geo: Geometry, group: int) -> np.ndarray:
    n, c = x.shape[:2]
    m, cg = w.shape[0], c // group
    (kh, kw), (sh, sw), (dh, dw), (top, left), (oh, ow) = geo.kernel, geo.strides, geo.dilations, geo.begin, geo.out
    padded = np.zeros((n, c, geo.in_shape[0] + 2 * top + kh * dh, geo.in_shape[1] + 2 * left + kw * dw))
    padded[:, :, top:top + geo.in_shape[0], left:left + geo.in_shape[1]] = x
    y = np.zeros((n, m, oh, ow))
    for g in range(group):
        for i in range(kh):
            for j in range(kw):
                taps = padded[:, g * cg:(g + 1) * cg, i * dh:i * dh + (oh - 1) * sh + 1:sh,
                              j * dw:j * dw + (ow - 1) * sw + 1:sw]
                part = w[g * (m // group):(g + 1) * (m // group), :, i, j].astype(np.float64)
                y[:, g * (m // group):(g + 1) * (m // group)] += np.einsum("nchw,mc->nmhw", taps, part)
    return y + (0.0 if b is None else b.astype(np.float64)[None, :, None, None])


CASES = [  # (images, channels, size, outputs, kernel, stride, pad, dilation, group, bias)
    (32, 3, 20, 16, 7, 2, 3, 1, 1, True),  # a stem
    (5, 8, 9, 8, 3, 2, 1, 1, 1, False),
    (3, 6, 11, 4, 3, 1, 2, 2, 2, True),  # dilated, grouped
    (1, 4, 6, 5, 5, 3, 0, 1, 1, True),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows_budget", [None, 2])
def test_reference_run_im2col_copies_every_image_at_once(monkeypatch, case, rows_budget):
    n, c, size, m, k, s, pad, d, group, with_bias = case
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, c, size, size)).astype(np.float32)
    w = rng.standard_normal((m, c // group, k, k)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32) if with_bias else None
    geo = _geometry(size, k, s, pad, d)
    if rows_budget is not None:  # several blocks of output rows, the last one short
        monkeypatch.setattr(KNOBS, "im2col_block_bytes", 4 * n * group * (c // group * k * k + 1) * geo.out[1]
                            * rows_budget)
    weights = grouped_weights(w, b, group, np.float32)
    expected = _float64(x, w, b, geo, group)

    calls = []
    real = im2col.fill_columns

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(im2col, "fill_columns", counted)
    compiled = conv_im2col(x, weights, geo, group, with_bias).reshape(expected.shape)
    assert calls, "outside a reference run the compiled fill serves"
    calls.clear()
    with ReferenceRun():
        served = conv_im2col(x, weights, geo, group, with_bias).reshape(expected.shape)
    assert not calls, "the reference run filled the column matrix image by image"
    bound = 1e-5 * np.abs(expected).max() * c * k * k
    assert np.abs(served - expected).max() <= bound
    assert np.abs(compiled - expected).max() <= bound
    np.testing.assert_array_equal(served, compiled)  # the same column matrix, the same product


def test_reference_run_reads_the_flag_per_call(monkeypatch):
    """The choice is made per call (a kernel built in a reference run serves compiled later)."""
    seen = []
    monkeypatch.setattr(conv_blas.reference_run, "active", lambda: seen.append(1) or False)
    x = np.ones((1, 1, 4, 4), np.float32)
    conv_im2col(x, grouped_weights(np.ones((1, 1, 3, 3), np.float32), None, 1, np.float32), _geometry(4, 3, 1, 1), 1,
                False)
    assert seen


@pytest.mark.parametrize("pad,dilation", [(1, 1), (2, 2)])
def test_reference_run_tight_rows_stage_each_block_at_once(monkeypatch, pad, dilation):
    """A stride-1 window as wide as its input (conv_tight_rows): in a reference run the staged rows fill a block,
    not the compiled fill's numpy equivalent; the same columns, the same result."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 4, 12, 12)).astype(np.float32)
    w = rng.standard_normal((5, 4, 3, 3)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    geo = _geometry(12, 3, 1, pad, dilation)
    assert conv_blas.tight_fits(geo)
    weights = grouped_weights(w, b, 1, np.float32)
    expected = _float64(x, w, b, geo, 1)
    calls = []
    real = im2col.fill_tight_columns
    monkeypatch.setattr(im2col, "fill_tight_columns", lambda *args: calls.append(1) or real(*args))
    compiled = conv_blas.conv_tight_rows(x, weights, geo, True)
    assert calls
    calls.clear()
    with ReferenceRun():
        served = conv_blas.conv_tight_rows(x, weights, geo, True)
    assert not calls
    assert np.abs(served - expected).max() <= 1e-5 * np.abs(expected).max() * 36
    np.testing.assert_array_equal(served, compiled)
