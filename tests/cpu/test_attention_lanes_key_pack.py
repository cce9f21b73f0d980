"""compiled/attention_lanes.py's K^T packing (_pack_keys) in 16 x 16 blocks transposed in registers: every packed
row is its component across the keys, the padding keys zeros, nothing written past the packed rows, for key counts
and head sizes that fill whole blocks, part of a last one, or one key, keys read at any row step (rows of one
product, a head of several); and the attention over such shapes against a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms.products import gemv_host
from onnx_runtime_ep_cpu.compiled import attention_lanes

pytestmark = pytest.mark.skipif(not gemv_host(), reason="the 16-lane loop runs on AVX-512 hosts only")


@pytest.mark.parametrize(("keys", "size", "step"), [
    (50, 16, 192), (16, 16, 16), (17, 16, 64), (1, 16, 16), (5, 24, 24), (33, 64, 64), (16, 20, 60), (64, 48, 300),
    (31, 8, 8), (197, 64, 2304),
])
def test_packed_rows_are_the_keys_transposed(keys, size, step):
    rng = np.random.default_rng(keys * 1000 + size)
    first = 3  # (a head's keys past others' components)
    k = rng.standard_normal(first + (keys - 1) * step + size).astype(np.float32)
    padded = -(-keys // attention_lanes.LANES) * attention_lanes.LANES
    packed = np.full(size * padded + 19, np.nan, np.float32)  # NaN: what no store reached
    attention_lanes._pack_keys(k, first, step, keys, size, packed, padded)  # noqa: SLF001
    expected = np.zeros((size, padded), np.float32)
    for t in range(keys):
        expected[:, t] = k[first + t * step:first + t * step + size]
    np.testing.assert_array_equal(packed[:size * padded].reshape(size, padded), expected)
    assert np.isnan(packed[size * padded:]).all()


@pytest.mark.parametrize(("rows", "keys", "heads", "size"), [(50, 50, 4, 16), (9, 17, 2, 24), (20, 33, 3, 40),
                                                             (16, 1, 1, 16), (12, 70, 2, 72)])
def test_attention_over_packed_keys_matches_float64(rows, keys, heads, size):
    rng = np.random.default_rng(rows + keys)
    q = rng.standard_normal((2, rows, heads * size)).astype(np.float32)
    k = rng.standard_normal((2, keys, heads * size)).astype(np.float32)
    v = rng.standard_normal((2, keys, heads * size)).astype(np.float32)
    scale = np.float32(size ** -0.5)
    y = np.empty_like(q)
    assert attention_lanes.few_rows_of_tokens(q, k, v, heads, heads, scale, np.empty((0, 1, 0, 0), np.float32), y)
    split = [a.astype(np.float64).reshape(2, -1, heads, size).transpose(0, 2, 1, 3) for a in (q, k, v)]
    scores = split[0] @ split[1].transpose(0, 1, 3, 2) * float(scale)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = (weights / weights.sum(axis=-1, keepdims=True) @ split[2]).transpose(0, 2, 1, 3).reshape(q.shape)
    np.testing.assert_allclose(y, expected, rtol=2e-5, atol=2e-5)
