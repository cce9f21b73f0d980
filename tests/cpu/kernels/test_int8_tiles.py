"""compiled/qgemm_tiles.py: the register-tiled int16 pair products (AVX-512BW / VNNI hosts) and their portable
stand-in, exactly against int64 numpy, over shapes with partial row tiles, odd K and partial column vectors; and
compiled/qgemm.py's products the same with and without the pairs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import qgemm, qgemm_tiles

RNG = np.random.default_rng(11)
SHAPES = [(2, 1, 1), (2, 2, 16), (3, 7, 17), (4, 64, 64), (5, 63, 200), (9, 129, 33), (16, 64, 256), (17, 256, 48),
          (8, 30, 15)]


def _operands(m, k, n):
    # the full centred range of 8-bit codes, ends included
    centred = RNG.integers(-255, 256, (m, k)).astype(np.int16)
    packed = RNG.integers(-255, 256, (n, k)).astype(np.int16)
    centred[0, 0], packed[0, 0] = -255, -255
    return centred, packed, (centred.astype(np.int64) @ packed.T.astype(np.int64)).astype(np.int32)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_portable_pair_product_exact(shape):
    centred, packed, expected = _operands(*shape)
    pairs = np.zeros(((shape[1] + 1) // 2, (shape[2] + 15) // 16 * 16, 2), np.int16)
    qgemm_tiles.pack_pairs(packed, pairs)
    out = np.full(expected.shape, 7, np.int32)
    qgemm_tiles.portable_product(centred, pairs, out)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.skipif(not qgemm_tiles.AVAILABLE, reason="the host has no AVX-512BW: no register tiles")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tiled_product_exact(shape):
    centred, packed, expected = _operands(*shape)
    pairs = qgemm_tiles.pairs_of(packed)
    assert pairs.shape == ((shape[1] + 1) // 2, (shape[2] + 15) // 16 * 16, 2)
    out = np.full(expected.shape, 7, np.int32)
    qgemm_tiles.tile_product(centred, pairs, out)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("shape", [(1, 64, 64), (6, 33, 40), (16, 64, 256)], ids=str)
def test_products_agree_with_and_without_pairs(shape):
    """qgemm's products through the tiles (where the host has them) and through the portable loop: the same
    integers, and the same requantized codes."""
    m, k, n = shape
    a = RNG.integers(0, 256, (m, k)).astype(np.uint8)
    b = RNG.integers(-128, 128, (k, n)).astype(np.int8)
    packed = np.empty((n, k), np.int16)
    qgemm.pack_columns(b, np.zeros(1, np.int32), packed)
    pairs = qgemm.pairs_for(packed)
    assert qgemm.pairs_for(packed) is pairs  # made once per packed weight
    expected = ((a.astype(np.int64) - 3) @ b.astype(np.int64)).astype(np.int32)
    for with_pairs in (pairs, np.zeros((0, 0, 2), np.int16)):
        out = np.empty((m, n), np.int32)
        qgemm.product(a, np.full(1, 3, np.int32), packed, with_pairs, out)
        np.testing.assert_array_equal(out, expected)
    scales, bias = RNG.uniform(1e-3, 1e-2, n), RNG.standard_normal(n).astype(np.float32)
    results = []
    for with_pairs in (pairs, np.zeros((0, 0, 2), np.int16)):
        out = np.empty((m, n), np.float32)
        qgemm.scaled_product(a, 3, packed, with_pairs, 0.02, scales, bias, out)
        results.append(out)
    np.testing.assert_array_equal(results[0], results[1])
    want = (expected * (0.02 * scales)).astype(np.float32) + bias
    np.testing.assert_array_equal(results[0], want)


def test_importing_the_tiles_loads_neither_numba_nor_llvmlite():
    code = ("import sys; from onnx_runtime_ep_cpu.compiled import qgemm, qgemm_tiles; "
            "print('numba' in sys.modules, 'llvmlite' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == ["False", "False"]
