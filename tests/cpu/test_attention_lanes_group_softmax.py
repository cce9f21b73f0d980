"""compiled/attention_lanes.py's softmax of a whole group of ROWS scores rows in one pass (_group_softmax, the rows
interleaved, lanes combined by shuffles): the same weights and reciprocals as the row-by-row _softmax_rows, bit for
bit; the bias rows of a group read at their own stride (a bias per query row, per head, per batch, none) against a
float64 reference, with a last partial group; a row whose keys are all masked still refuses the call."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import attention_lanes
from onnx_runtime_ep_cpu.compiled.attention_lanes import LANES, ROWS

numba = pytest.importorskip("numba")
# (a deferred loop: numba's own dispatcher inside njit)
_softmax_rows = attention_lanes._softmax_rows.dispatcher()  # noqa: SLF001


@numba.njit
def _both(scores, keys, bias, rows_bias):
    """(group weights, group reciprocals, group ok, rows weights, rows reciprocals, rows ok) for one group of
    ROWS scores rows: _group_softmax (biased when ``rows_bias``) and _softmax_rows on copies."""
    padded = scores.shape[1]
    grouped, by_rows = scores.copy().reshape(-1), scores.copy().reshape(-1)
    zeros = np.zeros(keys, np.float32)
    group_reciprocals, rows_reciprocals = np.zeros(ROWS, np.float32), np.zeros(ROWS, np.float32)
    if rows_bias:
        ok = attention_lanes._group_softmax(grouped, padded, keys, bias[0, 0],  # noqa: SLF001
                                            bias.strides[2] // 4, group_reciprocals)
    else:
        ok = attention_lanes._group_softmax_unbiased(grouped, padded, keys, group_reciprocals)  # noqa: SLF001
    rows_ok = _softmax_rows(by_rows, padded, ROWS, bias, 0, 0, 0, zeros, rows_reciprocals)
    return grouped, group_reciprocals, ok, by_rows, rows_reciprocals, rows_ok


def _group(keys, biased, seed):
    rng = np.random.default_rng(seed)
    padded = -(-keys // LANES) * LANES
    scores = np.full((ROWS, padded), np.nan, np.float32)  # the padding keys' scores are garbage
    scores[:, :keys] = rng.standard_normal((ROWS, keys)).astype(np.float32) * 4
    bias = rng.standard_normal((1, 1, ROWS, keys)).astype(np.float32) if biased else \
        np.empty((0, 0, 0, 0), np.float32)
    return scores, bias


@pytest.mark.parametrize("keys", [1, 5, 16, 17, 50, 80])
@pytest.mark.parametrize("biased", [False, True])
def test_group_softmax_is_the_rows_softmax(keys, biased):
    scores, bias = _group(keys, biased, keys)
    grouped, group_reciprocals, ok, by_rows, rows_reciprocals, rows_ok = _both(scores, keys, bias, biased)
    assert ok and rows_ok
    assert np.array_equal(grouped, by_rows)  # the padding keys weigh 0 in both
    assert np.array_equal(group_reciprocals, rows_reciprocals)
    weights = grouped.reshape(ROWS, -1)[:, :keys] * group_reciprocals[:, None]
    expected = scores[:, :keys].astype(np.float64) + (bias[0, 0] if biased else 0)
    expected = np.exp(expected - expected.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    assert np.abs(weights - expected).max() <= 1e-6


@pytest.mark.parametrize("masked_row", [0, ROWS - 1])
def test_group_softmax_refuses_a_row_without_visible_keys(masked_row):
    scores, bias = _group(20, True, 3)
    bias[0, 0, masked_row] = -np.inf
    assert not _both(scores, 20, bias, True)[2]


def _reference(q, k, v, heads, scale, bias):
    """softmax(q k^T * scale + bias) v in float64 over 3-D (B, S, H * D) operands, bias (B', H', M', T)."""
    batch, rows = q.shape[0], q.shape[1]
    split = [x.astype(np.float64).reshape(batch, x.shape[1], heads, -1).transpose(0, 2, 1, 3) for x in (q, k, v)]
    scores = split[0] @ split[1].transpose(0, 1, 3, 2) * scale + bias.astype(np.float64)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights @ split[2]).transpose(0, 2, 1, 3).reshape(batch, rows, -1)


@pytest.mark.parametrize("bias_shape", ["none", "rows", "heads", "batch", "heads_rows"])
@pytest.mark.parametrize("rows,keys", [(13, 13), (50, 50), (8, 33)])
def test_tokens_with_each_bias_layout_match_float64(bias_shape, rows, keys):
    batch, heads, size = 2, 3, 16
    rng = np.random.default_rng(rows * keys)
    q = rng.standard_normal((batch, rows, heads * size)).astype(np.float32)
    k, v = (rng.standard_normal((batch, keys, heads * size)).astype(np.float32) for _ in range(2))
    shape = {"none": (1, 1, 1, keys), "rows": (1, 1, rows, keys), "heads": (1, heads, 1, keys),
             "batch": (batch, 1, 1, keys), "heads_rows": (batch, heads, rows, keys)}[bias_shape]
    bias = (rng.standard_normal(shape) * 3).astype(np.float32)
    if bias_shape == "none":
        bias[...] = 0
    scale = np.float32(size ** -0.5)
    y = np.full(q.shape, np.nan, np.float32)
    passed = np.empty((0, 0, 0, 0), np.float32) if bias_shape == "none" else bias
    assert attention_lanes.few_rows_of_tokens(q, k, v, heads, heads, scale, passed, y)
    expected = _reference(q, k, v, heads, scale, bias)
    assert np.abs(y - expected).max() <= 2e-6 * max(1.0, np.abs(expected).max())
