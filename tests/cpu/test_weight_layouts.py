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


@pytest.mark.parametrize("rows", [8, 12])
@pytest.mark.parametrize("shape", [(1, 5), (8, 9), (12, 3), (29, 40), (64, 147)])
def test_weight_panels_interleave_each_tiles_rows_by_k(rows, shape):
    from onnx_runtime_ep_cpu.compiled.gemm import pack_weights

    w = RNG.standard_normal(shape)  # float64: packed as float32
    m, depth = shape
    packed = pack_weights(w, rows)
    tiles = -(-m // rows)
    assert packed.shape == (tiles, depth * rows) and packed.dtype == np.float32 and packed.flags.c_contiguous
    cells = packed.reshape(tiles, depth, rows)
    for i in range(tiles * rows):
        want = w[i].astype(np.float32) if i < m else np.zeros(depth, np.float32)  # zero rows past M
        np.testing.assert_array_equal(cells[i // rows, :, i % rows], want)


@pytest.mark.parametrize("shape", [(1, 1), (32, 4), (29, 45), (64, 147), (70, 258)])
def test_lane_tiles_hold_each_k_in_the_run_of_its_remainder(shape):
    """compiled/lanes.py's tiles: k's 32 weights at row k // STREAMS of run k % STREAMS, every other cell (rows
    past M, run rows past K) zero, on a cache line."""
    from onnx_runtime_ep_cpu.compiled import lanes
    from onnx_runtime_ep_cpu.compiled.aligned import LINE

    w = RNG.standard_normal(shape)  # float64: packed as float32
    m, depth = shape
    packed = lanes.pack_weights(w)
    tiles, rows = -(-m // lanes.CHANNELS), -(-depth // lanes.STREAMS)  # (rows per run)
    assert packed.shape == (tiles, lanes.packed_depth(depth) * lanes.CHANNELS) == (tiles, lanes.STREAMS * rows * 32)
    assert packed.dtype == np.float32
    assert packed.flags.c_contiguous and packed.ctypes.data % LINE == 0
    cells = packed.reshape(tiles, lanes.STREAMS, rows, lanes.CHANNELS)
    want = np.zeros_like(cells)
    for i in range(m):
        for k in range(depth):
            want[i // lanes.CHANNELS, k % lanes.STREAMS, k // lanes.STREAMS, i % lanes.CHANNELS] = w[i, k]
    np.testing.assert_array_equal(cells, want)
    into = np.zeros_like(packed)
    assert lanes.pack_weights(w, into) is not None
    np.testing.assert_array_equal(into, packed)


@pytest.mark.parametrize("shape", [(1,), (3, 5), (17, 33, 2), (0, 4)])
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.int16, np.float64])
def test_aligned_arrays_start_on_a_cache_line_and_hold_what_they_are_given(shape, dtype):
    from onnx_runtime_ep_cpu.compiled.aligned import LINE, aligned_copy, aligned_empty, aligned_zeros

    for _ in range(8):  # (numpy's own allocations land on 16-byte boundaries: several tries see other offsets)
        empty, zeros = aligned_empty(shape, dtype), aligned_zeros(shape, dtype)
        for a in (empty, zeros):
            assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
            assert a.ctypes.data % LINE == 0 or a.size == 0
        assert not zeros.any()
        source = (RNG.standard_normal(shape[::-1]) * 50).astype(dtype).T  # a transposed view: not contiguous
        copy = aligned_copy(source)
        assert copy.flags.c_contiguous and (copy == source).all() and not np.shares_memory(copy, source)
        assert copy.ctypes.data % LINE == 0 or copy.size == 0


def test_packed_weights_start_on_a_cache_line():
    from onnx_runtime_ep_cpu.compiled import blocked_ops, depthwise_lanes, directconv, lanes, qgemm_quads, qgemm_tiles
    from onnx_runtime_ep_cpu.compiled.aligned import LINE
    from onnx_runtime_ep_cpu.compiled.gemm import pack_weights
    from onnx_runtime_ep_cpu.compiled.matmul import pack_columns

    for m, depth in [(5, 3), (64, 147), (1000, 512)]:
        w = RNG.standard_normal((m, depth)).astype(np.float32)
        codes = (w * 20).astype(np.int8)
        packs = [pack_weights(w, 32), pack_weights(w, 12), pack_columns(w.T), qgemm_quads.quads_of(codes),
                 lanes.pack_weights(w),
                 directconv.pack_weights(w.reshape(m, depth, 1, 1), 1),
                 depthwise_lanes.pack_weights(w[:, :9].reshape(m, 1, 3, -1)),
                 blocked_ops.pack_depthwise(w[:, :9].reshape(m, 1, 3, -1), None, m)[0]]
        if qgemm_tiles.AVAILABLE:
            packs.append(qgemm_tiles.pairs_of(codes.astype(np.int16)))
        for packed in packs:
            assert packed.ctypes.data % LINE == 0


@pytest.mark.parametrize("outputs", [12, 64])  # (pixel panels; channel-lane tiles)
@pytest.mark.parametrize("group", [1, 3])
def test_a_grouped_convolutions_panels_are_each_groups_panels_on_a_cache_line(group, outputs):
    from onnx_runtime_ep_cpu.algorithms.conv_packed import PackedConv
    from onnx_runtime_ep_cpu.algorithms.prepared import Prepared
    from onnx_runtime_ep_cpu.algorithms.window import Geometry
    from onnx_runtime_ep_cpu.compiled import gemm, lanes
    from onnx_runtime_ep_cpu.compiled.aligned import LINE

    if not gemm.AVAILABLE:
        pytest.skip("the packed convolution runs on AVX-512 hosts only")
    w = RNG.standard_normal((outputs * group, 5, 3, 3)).astype(np.float32)
    w.flags.writeable = False  # (a constant: its panels are kept)
    geometry = Geometry((9, 9), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), (9, 9))
    for _ in range(4):  # (numpy's own allocations land on 16-byte boundaries: several tries see other offsets)
        conv = PackedConv(geometry, group, (1, 5 * group, 9, 9), w.shape, Prepared())
        packed = conv.packed_weights(w)
        assert packed.ctypes.data % LINE == 0 and packed.shape[0] == group
        for g in range(group):
            weights = w[outputs * g:outputs * (g + 1)].reshape(outputs, -1)
            lane_tiles = outputs == 64  # (the layout these outputs take: conv_packed.lanes_apply)
            want = lanes.pack_weights(weights) if lane_tiles else gemm.pack_weights(weights, gemm.tile_rows(outputs))
            np.testing.assert_array_equal(packed[g], want)
