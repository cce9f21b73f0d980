"""The numpy im2col that serves a convolution's first runs (compiled/generic.py's fill_columns) against a direct
reference: every column entry is the input at its tap's position, zero in the padding, over strides, dilations,
padding wider than the window, row blocks that start or end in the padding and columns past the block left as
they were. A copy, so the values must be equal; no numba involved."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import generic


def _reference(x, kh, kw, sh, sw, dh, dw, top, left, row_start, row_count, ow_count):
    channels, height, width = x.shape
    out = np.zeros((channels * kh * kw, row_count * ow_count), np.float64)
    for c, i, j, r, o in itertools.product(range(channels), range(kh), range(kw), range(row_count), range(ow_count)):
        y, z = (row_start + r) * sh - top + i * dh, o * sw - left + j * dw
        if 0 <= y < height and 0 <= z < width:
            out[(c * kh + i) * kw + j, r * ow_count + o] = x[c, y, z]
    return out


GEOMETRIES = [  # kh, kw, sh, sw, dh, dw, top, left, bottom, right, h, w
    (7, 7, 2, 2, 1, 1, 3, 3, 3, 3, 16, 16),  # a stem
    (3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 5, 6),
    (3, 3, 2, 2, 1, 1, 1, 1, 1, 1, 9, 11),
    (2, 3, 1, 1, 2, 2, 0, 2, 0, 2, 8, 7),
    (3, 2, 3, 2, 2, 1, 4, 3, 4, 3, 6, 5),  # padding wider than the window
    (1, 1, 2, 2, 1, 1, 0, 0, 0, 0, 7, 7),
    (5, 1, 1, 3, 1, 1, 2, 0, 2, 0, 4, 10),
]


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_fill_columns_matches_the_reference(geometry):
    kh, kw, sh, sw, dh, dw, top, left, bottom, right, h, w = geometry
    rng = np.random.default_rng(sum(geometry))
    x = rng.standard_normal((3, h, w)).astype(np.float32)
    oh = (h + top + bottom - ((kh - 1) * dh + 1)) // sh + 1
    ow = (w + left + right - ((kw - 1) * dw + 1)) // sw + 1
    for row_start, row_count in ((0, oh), (1, oh - 1), (oh - 1, 1), (0, 1)):
        if row_count <= 0:
            continue
        cols = np.full((3 * kh * kw, oh * ow + 5), 7.0, np.float32)
        generic.fill_columns(x, cols, kh, kw, sh, sw, dh, dw, top, left, row_start, row_count, ow)
        used = row_count * ow
        expected = _reference(x, kh, kw, sh, sw, dh, dw, top, left, row_start, row_count, ow)
        np.testing.assert_array_equal(cols[:, :used], expected.astype(np.float32))
        assert (cols[:, used:] == 7.0).all(), "columns past the block must stay as they were"


def test_fill_columns_reads_a_strided_view_and_an_empty_block():
    base = np.arange(2 * 3 * 8 * 9, dtype=np.float32).reshape(2, 3, 8, 9)
    x = base[1, :, :, ::1][:, 1:, :]  # a view with the strides of a larger tensor, as conv_blas passes
    cols = np.full((3 * 9, 7 * 9), -1.0, np.float32)
    generic.fill_columns(x, cols, 3, 3, 1, 1, 1, 1, 1, 1, 0, 7, 9)
    np.testing.assert_array_equal(cols, _reference(x, 3, 3, 1, 1, 1, 1, 1, 1, 0, 7, 9).astype(np.float32))
    untouched = cols.copy()
    generic.fill_columns(x, cols, 3, 3, 1, 1, 1, 1, 1, 1, 0, 0, 9)  # no rows: nothing written
    np.testing.assert_array_equal(cols, untouched)


def test_fill_tight_columns_is_fill_columns_at_stride_one():
    x = np.random.default_rng(3).standard_normal((2, 6, 9)).astype(np.float32)
    for kw, left in ((3, 1), (5, 2)):
        cols = np.full((2 * 3 * kw, 4 * 9 + 3), 7.0, np.float32)
        generic.fill_tight_columns(x, cols, 3, kw, 1, 1, 1, left, 1, 4)
        expected = _reference(x, 3, kw, 1, 1, 1, 1, 1, left, 1, 4, 9).astype(np.float32)
        np.testing.assert_array_equal(cols[:, :36], expected)
        assert (cols[:, 36:] == 7.0).all()
