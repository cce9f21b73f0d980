"""Rearranged copies of constant weights: the block-by-block transpose creation makes for the Gemm epilogues, and
the column panels of compiled/matmul.py, each against its defining indexing."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms.prepared import TRANSPOSE_BLOCK, transposed

RNG = np.random.default_rng(7)


@pytest.mark.parametrize("shape", [(5, 7), (1, 300), (TRANSPOSE_BLOCK * 3, TRANSPOSE_BLOCK * 2),
                                   (TRANSPOSE_BLOCK * 2 + 37, TRANSPOSE_BLOCK * 5 + 1), (70_000, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8])
def test_transposed_copies_every_element_to_its_mirrored_place(shape, dtype):
    matrix = (RNG.standard_normal(shape) * 50).astype(dtype)
    out = transposed(matrix)
    assert out.shape == shape[::-1] and out.dtype == matrix.dtype and out.flags.c_contiguous
    assert not np.shares_memory(out, matrix)
    rows, columns = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    assert (out[columns, rows] == matrix).all()


@pytest.mark.parametrize("shape", [(3, 1), (9, 31), (64, 32), (17, 100), (256, 65)])
def test_column_panels_hold_each_weight_at_its_panel_row_and_lane(shape):
    from onnx_runtime_ep_cpu.compiled.matmul import NR, pack_columns

    w = RNG.standard_normal(shape).astype(np.float32)
    depth, n = shape
    packed = pack_columns(w)
    panels = -(-n // NR)
    assert packed.shape == (panels, depth * NR) and packed.flags.c_contiguous
    lanes = packed.reshape(panels, depth, NR)
    for j in range(panels * NR):
        want = w[:, j] if j < n else np.zeros(depth, np.float32)  # zero columns past N
        np.testing.assert_array_equal(lanes[j // NR, :, j % NR], want)
