"""Compiled loops for the small per-token kernels of a decoder step: RMS normalization (alone or after
the residual add), the rotate-half rotary embedding, and attention of a few queries over the cache.

At decode sizes (one row of a few hundred values) numpy's cost is its per-call overhead: RMS
normalization is six ufunc calls and temporaries for 256 values, where one compiled pass over the row
takes a fraction of a microsecond besides numba's dispatch (measured in afcca01).
Row sums keep eight partial sums: float sums cannot vectorize without reassociation (no fastmath),
and eight chains are faster and more accurate than one.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .exp_float32 import contracting_jit, sigmoid_float32
from .transformer import exp_shifted_sum_, row_max, summing_jit


@jit
def _square_sum(row):
    """Sum of row^2 through eight interleaved partial sums."""
    n = row.shape[0]
    body = n - n % 8
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = row.dtype.type(0)
    for j in range(0, body, 8):
        s0 += row[j] * row[j]
        s1 += row[j + 1] * row[j + 1]
        s2 += row[j + 2] * row[j + 2]
        s3 += row[j + 3] * row[j + 3]
        s4 += row[j + 4] * row[j + 4]
        s5 += row[j + 5] * row[j + 5]
        s6 += row[j + 6] * row[j + 6]
        s7 += row[j + 7] * row[j + 7]
    total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for j in range(body, n):
        total += row[j] * row[j]
    return total


@jit
def _normalize_row(row, weight, epsilon, out):
    """out = row / sqrt(mean(row^2) + epsilon) * weight, in the numpy kernel's order of operations."""
    n = row.shape[0]
    mean_square = _square_sum(row) * row.dtype.type(1.0 / max(n, 1)) + epsilon
    denominator = np.sqrt(mean_square)
    for j in range(n):
        out[j] = row[j] / denominator * weight[j]


@jit
def rms_norm(x, weight, epsilon, out):
    """RMS normalization of each row of ``x`` (rows, n) into ``out``; ``weight`` (n,) scales the columns."""
    eps = x.dtype.type(epsilon)
    for r in range(x.shape[0]):
        _normalize_row(x[r], weight, eps, out[r])


@jit
def skip_rms_norm(a, b, weight, epsilon, out, total):
    """``total`` = a + b, and ``out`` its RMS normalization, row by row (the residual add before a norm)."""
    eps = a.dtype.type(epsilon)
    n = a.shape[1]
    for r in range(a.shape[0]):
        row = total[r]
        for j in range(n):
            row[j] = a[r, j] + b[r, j]
        _normalize_row(row, weight, eps, out[r])


@jit
def append_attention_float32(q, k, v, key_rows, value_rows, length, scale, bias, y):
    """A decode step's cache appends and attention in one call: K and V (B, G, S, D) written at rows
    ``length:length + S`` of ``key_rows`` and ``value_rows`` (the (B, G, capacity, D) caches kv_append grows in
    place), then few_query_attention_prefix_float32 over their first ``length + S`` rows into ``y``. False as
    that function's (the rows are written either way)."""
    for b in range(k.shape[0]):
        for g in range(k.shape[1]):
            for r in range(k.shape[2]):
                key_row, value_row = key_rows[b, g, length + r], value_rows[b, g, length + r]
                for j in range(key_row.shape[0]):
                    key_row[j] = k[b, g, r, j]
                for j in range(value_row.shape[0]):
                    value_row[j] = v[b, g, r, j]
    return few_query_attention_prefix_float32(q, key_rows, value_rows, length + k.shape[2], scale, bias, y)


@jit
def rotate_half(q, cos, sin, table_row, half, out):
    """q * cos + concat(-q[:, half:], q[:, :half]) * sin for each row of ``q`` (rows, d); row ``r`` of q
    uses row ``table_row[r]`` of ``cos`` and ``sin`` (the broadcast of the tables over batch and heads)."""
    d = q.shape[1]
    rest = d - half
    for r in range(q.shape[0]):
        c = table_row[r]
        for j in range(rest):
            out[r, j] = q[r, j] * cos[c, j] + (-q[r, half + j]) * sin[c, j]
        for j in range(rest, d):
            out[r, j] = q[r, j] * cos[c, j] + q[r, j - rest] * sin[c, j]


@jit
def swish_mul_float32(a, b, alpha, out):
    """swish_mul for float32 as a * sigmoid(alpha * a) * b, through transformer.py's vectorized sigmoid
    (libm's scalar exp does not vectorize; measured in 999109f)."""
    scale = np.float32(alpha)
    for j in range(a.shape[0]):
        out[j] = a[j] * sigmoid_float32(scale * a[j]) * b[j]


@contracting_jit
def gelu_mul_float32(x, gate, coefficients, out):
    """out = Gelu(x) * gate over float32 1-D arrays of one length, in one pass (a GeGLU block's gated unit, Gemma's
    Mul(Gelu(A Wg), A Wu)): each Gelu value as transformer.gelu_float32_ computes it, u * sigmoid(2 s) with s the
    odd series of the coefficients (lowest first: degree 6 for the erf form, 1 for the tanh form), times its gate."""
    top = coefficients.shape[0] - 1
    if top != 6 and top != 1:
        raise ValueError("gelu_mul_float32 takes a series of degree 6 (erf form) or 1 (tanh form)")
    two = np.float32(2)
    c0, c1 = coefficients[0], coefficients[1]
    if top == 6:
        c2, c3, c4, c5, c6 = coefficients[2], coefficients[3], coefficients[4], coefficients[5], coefficients[6]
        for j in range(x.shape[0]):
            v = x[j]
            q = v * v
            series = ((((((q * c6 + c5) * q + c4) * q + c3) * q + c2) * q + c1) * q + c0) * v
            out[j] = v * sigmoid_float32(two * series) * gate[j]
    else:
        for j in range(x.shape[0]):
            v = x[j]
            out[j] = v * sigmoid_float32(two * ((v * v * c1 + c0) * v)) * gate[j]


@jit
def swish_mul(a, b, alpha, out):
    """out = a / (1 + exp(-alpha * a)) * b over 1-D arrays of one length."""
    one = a.dtype.type(1)
    minus_alpha = a.dtype.type(-alpha)
    for j in range(a.shape[0]):
        out[j] = a[j] / (one + np.exp(minus_alpha * a[j])) * b[j]


@summing_jit
def row_dot(a, b):
    """The dot product of two 1-D arrays (reassociated: it vectorizes)."""
    total = a.dtype.type(0)
    for j in range(a.shape[0]):
        total += a[j] * b[j]
    return total


@contracting_jit
def _weighted_rows(weights, rows, out):
    """out = the sum over t of weights[t] * rows[t] (in t order, one fused multiply-add per term); ``rows`` may
    hold more rows than ``weights`` weighs (a cache at its capacity): those are not read."""
    out[:] = 0
    for t in range(weights.shape[0]):
        weight = weights[t]
        row = rows[t]
        for j in range(out.shape[0]):
            out[j] += weight * row[j]


@jit
def few_query_attention_float32(q, k, v, scale, bias, y):
    """y[b, h] = softmax(q[b, h] k[b, g]^T * scale + bias[b, h]) v[b, g] for the query heads h of each KV head g
    (grouped-query attention: g = h // (query heads / KV heads)), float32 (B, H, M, D) arrays with
    contiguous rows. ``bias`` is (B', H', M', T) with each of B', H', M' either 1 (broadcast) or the full
    size (an attention mask, a per-head position bias, a causal frontier), or empty for none. One pass per
    query row: its scores, their largest value, exp by transformer.py's polynomial with the sum, the
    weighted sum of V's rows, then the division. Small attention (a decode step's few rows over the cache, a
    short encoder's) is a handful of such rows, where numpy's eight calls cost several times the
    arithmetic. False, with ``y`` partly written, when a row's largest score is not finite (a fully masked
    row, inf or NaN): the caller's general path decides those."""
    return few_query_attention_prefix_float32(q, k, v, k.shape[2], scale, bias, y)


@jit
def few_query_attention_prefix_float32(q, k, v, keys, scale, bias, y):
    """few_query_attention_float32 over the first ``keys`` rows of each head of K and V: a KV cache kept at its
    capacity (kv_append.py), read where it lies instead of copied out of it at the valid length every step."""
    batch, heads, rows = q.shape[0], q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    with_bias = bias.size > 0
    bias_b, bias_h, bias_r = bias.shape[0] > 1, bias.shape[1] > 1, bias.shape[2] > 1
    scores, weights = np.empty(keys, dtype=np.float32), np.empty(keys, dtype=np.float32)
    for b in range(batch):
        for h in range(heads):
            kh, vh = k[b, h // group], v[b, h // group]
            for r in range(rows):
                query = q[b, h, r]
                if with_bias:
                    row_bias = bias[b if bias_b else 0, h if bias_h else 0, r if bias_r else 0]
                    for t in range(keys):
                        scores[t] = row_dot(query, kh[t]) * scale + row_bias[t]
                else:
                    for t in range(keys):
                        scores[t] = row_dot(query, kh[t]) * scale
                peak = row_max(scores)
                if not abs(peak) < np.float32(np.inf):
                    return False
                total = exp_shifted_sum_(scores, peak, weights)
                out = y[b, h, r]
                _weighted_rows(weights, vh, out)
                for j in range(out.shape[0]):
                    out[j] /= total
    return True
