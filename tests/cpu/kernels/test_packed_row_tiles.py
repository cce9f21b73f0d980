"""Row tiles of the packed float32 MatMul (compiled/matmul.py): 13 to 16 rows left run as an 8-row tile and
the rest (16 rows: two whole 8-row tiles) instead of 12 rows and a padded 8-row tile. Every output's reduction
runs k = 0 .. K-1 with one fused multiply-add per term in either tile, so each row's bits must not depend on
which tile computed it: the product of all rows equals the products of row blocks that tile differently, and
float64 numpy within float32 accumulation."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms import products
from onnx_runtime_ep_cpu.compiled import gemm

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the packed MatMul needs an AVX-512 host")
RNG = np.random.default_rng(7)


@pytest.fixture(autouse=True)
def packed_at_every_size(knobs):
    knobs(packed_macs=1)


@pytest.mark.parametrize("rows", [13, 14, 16, 17, 28, 40, 50])
@pytest.mark.parametrize("width", [64, 1000])
def test_rows_do_not_depend_on_their_tile(kernel_threads, rows, width):
    depth = 64
    a = RNG.standard_normal((rows, depth), dtype=np.float32)
    b = RNG.standard_normal((depth, width), dtype=np.float32)
    b.flags.writeable = False
    bias = RNG.standard_normal(width, dtype=np.float32)
    bias.flags.writeable = False
    product = products.PackedProduct()
    whole = product(a, b, bias)
    # Blocks of 12 rows and one of the rest: each block tiles as 12 (+ a padded 8), never 8 + 8.
    blocks = np.concatenate([product(a[start:start + 12], b, bias) for start in range(0, rows, 12)])
    np.testing.assert_array_equal(whole, blocks)
    expected = a.astype(np.float64) @ b.astype(np.float64) + bias
    bound = (depth + 4) * np.finfo(np.float32).eps * (np.abs(a).astype(np.float64) @ np.abs(b) + np.abs(bias))
    assert np.all(np.abs(whole - expected) <= bound)


def test_a_fed_bias_or_weight_is_read_afresh_on_every_call(kernel_threads):
    """A call's plan (packed weights, padded bias, task split) is kept for the next call with the same arrays only
    while they are read-only: a fed (writeable) bias or weight changed in place between calls is read again."""
    a = RNG.standard_normal((16, 64), dtype=np.float32)
    b = RNG.standard_normal((64, 100), dtype=np.float32)
    bias = RNG.standard_normal(100, dtype=np.float32)
    product = products.PackedProduct()
    for _ in range(2):
        first = product(a, b, bias)
        np.testing.assert_allclose(first, a @ b + bias, rtol=1e-5, atol=1e-4)
        bias += 1
        b *= 2
        np.testing.assert_allclose(product(a, b, bias), a @ b + bias, rtol=1e-5, atol=1e-4)
    b.flags.writeable = False
    bias.flags.writeable = False
    kept = product(a, b, bias)
    np.testing.assert_array_equal(product(a, b, bias), kept)  # the kept plan: the same bits
    np.testing.assert_allclose(kept, a @ b + bias, rtol=1e-5, atol=1e-4)
