"""qgemm_tiles.compact: where the register tiles run, a constant int8 weight is kept only as its int16 pairs, an
(N, 0) stub standing in for the (N, K) packed form (which held the same integers a second time). The products
over the stub and its pairs, compiled and numpy-first (generic_int8), equal the exact int64 product, and so do
the session kernels that keep weights this way (MatMulInteger, QLinearMatMul, MatMulIntegerToFloat)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms.quantize import IntegerProduct
from onnx_runtime_ep_cpu.compiled import generic_int8, qgemm, qgemm_tiles

RNG = np.random.default_rng(23)
TILES = pytest.mark.skipif(not qgemm_tiles.AVAILABLE, reason="the host has no AVX-512BW: weights stay packed")


def _weight(k, n):
    b = RNG.integers(-128, 128, (k, n)).astype(np.int8)
    zeros = RNG.integers(-5, 6, n).astype(np.int32)  # per column, asymmetric
    packed = np.empty((n, k), np.int16)
    qgemm.pack_columns(b, zeros, packed)
    return b, zeros, packed


@TILES
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 17), (5, 63, 200), (16, 64, 256), (4, 30, 15)], ids=str)
def test_the_stub_and_its_pairs_give_the_exact_product(shape):
    m, k, n = shape
    b, zeros, packed = _weight(k, n)
    a = RNG.integers(0, 256, (m, k)).astype(np.uint8)
    expected = ((a.astype(np.int64) - 9) @ (b.astype(np.int64) - zeros)).astype(np.int32)
    stub = qgemm.compact(packed)
    assert stub.shape == (n, 0) and stub.nbytes == 0
    pairs = qgemm.pairs_for(stub)
    np.testing.assert_array_equal(pairs, qgemm_tiles.pairs_of(packed))
    a_zero = np.full(1, 9, np.int32)
    for product in (qgemm.product.dispatcher(), generic_int8.product):
        out = np.full((m, n), 7, np.int32)
        product(a, a_zero, stub, pairs, out)
        np.testing.assert_array_equal(out, expected)
    scales, bias = RNG.uniform(1e-3, 1e-2, n), RNG.standard_normal(n).astype(np.float32)
    results = []
    for scaled, weight, with_pairs in ((qgemm.scaled_product.dispatcher(), stub, pairs),
                                       (generic_int8.scaled_product, stub, pairs),
                                       (qgemm.scaled_product.dispatcher(), packed, np.zeros((0, 0, 2), np.int16))):
        out = np.empty((m, n), np.float32)
        scaled(a, 9, weight, with_pairs, 0.02, scales, bias, out)
        results.append(out)
    np.testing.assert_array_equal(results[0], results[2])
    np.testing.assert_array_equal(results[1], results[2])


@TILES
def test_a_constant_weight_is_held_once():
    """IntegerProduct keeps a constant B as the stub: its pairs are the only int16 copy (they live with it)."""
    k, n = 96, 40
    b = RNG.integers(-128, 128, (k, n)).astype(np.int8)
    b.setflags(write=False)
    a = RNG.integers(0, 256, (5, k)).astype(np.uint8)
    product = IntegerProduct()
    out = product(a, b, np.array(3, np.uint8), np.array(-2, np.int8))
    np.testing.assert_array_equal(out, ((a.astype(np.int64) - 3) @ (b.astype(np.int64) + 2)).astype(np.int32))
    held = product.packed(b, np.array(-2, np.int8))
    assert held.shape == (n, 0)
    pairs = qgemm.pairs_for(held)
    assert pairs.nbytes == (k + 1) // 2 * 2 * ((n + 15) // 16 * 16) * 2  # K x N rounded to pairs and lanes, int16
    np.testing.assert_array_equal(product(a, b, np.array(3, np.uint8), np.array(-2, np.int8)), out)
