"""compiled/attention_lanes.py's key blocks and value column blocks taken in pairs (and an odd last block alone):
shapes whose keys or value heads fill an odd number of 16-lane blocks, an even one, and a pair whose second block
is partly padding, over (B, S, H, D) and (B, H, S, D) operands, against a float64 reference. A bias that hides
every key but those of one block checks that each block's scores land in their own place. few_rows_of_tokens
reads 3-D column views of one product in place."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import attention_lanes


def _reference(q, k, v, scale, bias):
    """softmax(q k^T * scale + bias) v in float64; q (B, S, H, D), k and v (B, T, G, D), bias (B', H', M', T)."""
    group = q.shape[2] // k.shape[2]
    queries = q.astype(np.float64).transpose(0, 2, 1, 3)
    keys = np.repeat(k.astype(np.float64).transpose(0, 2, 1, 3), group, axis=1)
    values = np.repeat(v.astype(np.float64).transpose(0, 2, 1, 3), group, axis=1)
    scores = queries @ keys.transpose(0, 1, 3, 2) * scale + bias.astype(np.float64)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights @ values).transpose(0, 2, 1, 3)


def _operands(rows, keys, heads, size, value_size, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, rows, heads, size)).astype(np.float32)
    k = rng.standard_normal((1, keys, heads, size)).astype(np.float32)
    v = rng.standard_normal((1, keys, heads, value_size)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("rows,keys,heads,size,value_size", [
    (13, 80, 2, 16, 48),  # five key blocks (two pairs and one), three column blocks (a pair and one)
    (7, 64, 3, 16, 64),  # whole pairs only
    (21, 40, 2, 32, 20),  # a pair whose second key block is half padding, a pair of columns whose second is short
    (4, 145, 1, 8, 80),  # ten key blocks: the last pair mostly padding; five column blocks
])
@pytest.mark.parametrize("by_head", [False, True])
def test_pairs_match_float64(rows, keys, heads, size, value_size, by_head):
    q, k, v = _operands(rows, keys, heads, size, value_size, rows * keys + value_size)
    scale = np.float32(size ** -0.5)
    bias = np.empty((0, 0, 0, 0), np.float32)
    scratch = np.full(attention_lanes.scratch_size(size, keys), np.nan, np.float32)  # garbage must not leak in
    if by_head:
        y = np.full((1, heads, rows, value_size), np.nan, np.float32)
        assert attention_lanes.few_rows_by_head(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                                v.transpose(0, 2, 1, 3), scale, bias, y, scratch)
        y = y.transpose(0, 2, 1, 3)
    else:
        y = np.full((1, rows, heads, value_size), np.nan, np.float32)
        assert attention_lanes.few_rows_in_lanes(q, k, v, scale, bias, y, scratch)
    expected = _reference(q, k, v, scale, np.zeros((1, 1, 1, keys), np.float32))
    assert np.abs(y - expected).max() <= 2e-6 * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("block", [0, 1, 2, 3, 4])
def test_each_key_block_in_its_place(block):
    rows, keys, heads, size = 6, 80, 2, 16
    q, k, v = _operands(rows, keys, heads, size, 16, block)
    visible = np.full((1, 1, 1, keys), -np.inf, np.float32)
    visible[..., block * 16:(block + 1) * 16] = 0  # only this block's keys count
    y = np.full((1, rows, heads, 16), np.nan, np.float32)
    scratch = np.empty(attention_lanes.scratch_size(size, keys), np.float32)
    assert attention_lanes.few_rows_in_lanes(q, k, v, np.float32(0.25), visible, y, scratch)
    expected = _reference(q[:, :, :, :], k[:, block * 16:(block + 1) * 16], v[:, block * 16:(block + 1) * 16],
                          0.25, np.zeros((1, 1, 1, 16), np.float32))
    assert np.abs(y - expected).max() <= 2e-6 * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("rows,keys,heads,kv_heads,size", [(17, 17, 4, 4, 16), (50, 50, 4, 2, 16), (9, 40, 3, 1, 24)])
def test_tokens_loop_reads_column_views(rows, keys, heads, kv_heads, size):
    """few_rows_of_tokens over 3-D (B, S, H * D) operands: Q, K and V column views of one (B, S, 3 parts) product
    (an encoder's ProjectionGroup output), read in place, heads found from their counts; y against float64."""
    rng = np.random.default_rng(rows + keys)
    width, kv_width = heads * size, kv_heads * size
    product = rng.standard_normal((2, max(rows, keys), width + 2 * kv_width + 3)).astype(np.float32)
    q = product[:, :rows, :width]
    k = product[:, :keys, width:width + kv_width]
    v = product[:, :keys, width + kv_width:width + 2 * kv_width]
    y = np.full((2, rows, width), np.nan, np.float32)
    scale = np.float32(size ** -0.5)
    assert attention_lanes.few_rows_of_tokens(q, k, v, heads, kv_heads, scale, np.empty((0, 0, 0, 0), np.float32), y)
    split = (q.reshape(2, rows, heads, size), k.reshape(2, keys, kv_heads, size), v.reshape(2, keys, kv_heads, size))
    expected = _reference(*split, scale, np.zeros((1, 1, 1, keys), np.float32)).reshape(2, rows, width)
    assert np.abs(y - expected).max() <= 2e-6 * max(1.0, np.abs(expected).max())
