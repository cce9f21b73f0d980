"""A QDQ decoder's attention between its two products (qdq_attention.fuse_rounded_attention) in one call: the
scores' integer product requantized to its grid, the rounded elementwise steps on the scores (a GridTable's
lookup, an AddRounded of a mask or position bias), the Softmax, and the context's integer product.

Each step is its node's arithmetic: the operands quantized as QuantizeLinear does (qgemm.float_code), the exact
integer sums (in float64, or int32 on qgemm_tiles' register tiles for larger heads) requantized in float64
(quantize.requantized_code), a table entry picked by the value's code as grid_lookup picks it, an add in float32
then the rounding (quantize.on_grid), and the Softmax node's own loop (transformer.softmax_rows_float32_), so the
values are the unfused nodes' bit for bit.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .qgemm import float_code
from .qgemm_tiles import pack_pairs, tile_product
from .quantize import on_grid, requantized_code
from .transformer import softmax_rows_float32_

# The layout of ``params`` (float64): per quantized operand (q, keys, softmax, values) its scale, zero point and
# code range; per product (scores, context) its multiplier, output zero point, code range and output scale.
Q, K, P, V = 0, 4, 8, 12
SCORES, CONTEXT = 16, 21
PARAMS = 26
# The layout of a row of ``steps`` (float32): its kind, the table or addend it reads, its grid (scale, zero
# point, code range).
TABLE, ADD = 0, 1
STEP_COLUMNS = 6


@jit
def _centred(x, scale, zero, low, high, out):
    """out[i] = code(x[i]) - zero for flat float32 ``x``, as out's type (float64 or int16; one plain loop: LLVM
    vectorizes it)."""
    s, z, lo, hi = np.float32(scale), np.float32(zero), np.float32(low), np.float32(high)
    for i in range(x.shape[0]):
        out[i] = float_code(x[i], s, z, lo, hi) - z  # (an integer in float32: exact in either type)


@jit
def _requantized(acc, params, at, out):
    """out[i] = the float32 value of the product's code for the integer sum acc[i] (float64 or int32; parameters
    at ``params[at:]``), flat."""
    m, z, lo, hi, s = params[at], params[at + 1], params[at + 2], params[at + 3], params[at + 4]
    for i in range(acc.shape[0]):
        out[i] = np.float32((requantized_code(np.float64(acc[i]), m, 0.0, z, lo, hi) - z) * s)


@jit
def _product(a, b, out):
    """out = a @ b for (R, K) and (K, N) float64 codes (exact: sums of code products stay far below 2**53), one
    row of b at a time over each row of out."""
    out[:] = 0
    for r in range(a.shape[0]):
        line = out[r]
        for k in range(a.shape[1]):
            c = a[r, k]
            row = b[k]
            for j in range(row.shape[0]):
                line[j] += c * row[j]


@jit
def _stepped(line, b, h, r, add0, add1, tables, steps):
    """The steps on one row of scores, in place."""
    for t in range(steps.shape[0]):
        s, z, lo, hi = steps[t, 2], steps[t, 3], steps[t, 4], steps[t, 5]
        if steps[t, 0] == TABLE:
            table = tables[int(steps[t, 1])]
            for j in range(line.shape[0]):
                c = np.rint(line[j] / s) + z
                c = lo if c < lo else c
                c = hi if c > hi else c
                line[j] = table[np.int64(c - lo)] if c == c else table[np.int64(z - lo)]
            continue
        addend = add0 if steps[t, 1] == 0 else add1
        other = addend[b if addend.shape[0] > 1 else 0, h if addend.shape[1] > 1 else 0,
                       r if addend.shape[2] > 1 else 0]
        if other.shape[0] == 1:
            for j in range(line.shape[0]):
                line[j] = on_grid(line[j] + other[0], s, z, lo, hi)
        else:
            for j in range(line.shape[0]):
                line[j] = on_grid(line[j] + other[j], s, z, lo, hi)


@jit
def _codes(x, params, at, dtype):
    """code(x) - zero as ``dtype`` (float64 or int16), in x's shape (operand parameters at ``params[at:]``)."""
    flat = np.empty(x.size, dtype)
    _centred(x.reshape(-1), params[at], params[at + 1], params[at + 2], params[at + 3], flat)
    return flat.reshape(x.shape)


# Scores per head (query rows x keys) from which the products run on qgemm_tiles' register tiles (packing each kv
# head's pairs and the tiles' own setup cost more than they gain below: a ViT's 17 x 17 attention, decode steps).
TILED_SCORES = 1024


@jit
def rounded_attention(q, k, v, add0, add1, group, tables, steps, params, out):
    """out[b, h] = context of softmax(steps(scores)) for (B, H, R, D) float32 ``q``, (B, H / group, L, D) keys
    ``k`` and (B, H / group, L, E) values ``v`` (head h reads kv head h // group), ``out`` (B, H, R, E). The
    steps run on each row of scores in order: TABLE picks ``tables[index]`` by the value's code on the step's
    grid; ADD adds the row of ``add0`` or ``add1`` (4-D, each axis 1 or the scores', broadcast) and rounds to
    the step's grid. The integer sums are exact either way: int32 on the register tiles from TILED_SCORES
    scores per head, else float64 row loops (LLVM vectorizes them where int32 products widen to int64 first)."""
    if q.shape[2] * k.shape[2] >= TILED_SCORES:
        _tiled_heads(q, k, v, add0, add1, group, tables, steps, params, out)
    else:
        _row_heads(q, k, v, add0, add1, group, tables, steps, params, out)


@jit
def _rest_of_head(scores, weights, b, h, add0, add1, tables, steps, params, probs):
    """The steps on each row of the requantized scores, the Softmax, and the probabilities' centred codes."""
    if steps.shape[0]:  # (a call per row costs more than the row's work where there is no step)
        for r in range(scores.shape[0]):
            _stepped(scores[r], b, h, r, add0, add1, tables, steps)
    softmax_rows_float32_(scores, weights)
    _centred(weights.reshape(-1), params[P], params[P + 1], params[P + 2], params[P + 3], probs.reshape(-1))


@jit
def _row_heads(q, k, v, add0, add1, group, tables, steps, params, out):
    """rounded_attention's heads with float64 codes and row loops."""
    batch, heads, rows, depth = q.shape
    length, width = k.shape[2], v.shape[3]
    codes_q, codes_k = _codes(q, params, Q, np.float64), _codes(k, params, K, np.float64)
    codes_v = _codes(v, params, V, np.float64)
    keys = np.empty((depth, length), np.float64)  # one kv head's keys, transposed: the scores' rows run over j
    sums = np.empty((rows, length), np.float64)
    scores = np.empty((rows, length), np.float32)
    weights = np.empty((rows, length), np.float32)
    probs = np.empty((rows, length), np.float64)
    context = np.empty((rows, width), np.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // group
            if h % group == 0:
                keys[:] = codes_k[b, g].T
            _product(codes_q[b, h], keys, sums)
            _requantized(sums.reshape(-1), params, SCORES, scores.reshape(-1))
            _rest_of_head(scores, weights, b, h, add0, add1, tables, steps, params, probs)
            _product(probs, codes_v[b, g], context)
            _requantized(context.reshape(-1), params, CONTEXT, out[b, h].reshape(-1))


@jit
def _tiled_heads(q, k, v, add0, add1, group, tables, steps, params, out):
    """rounded_attention's heads with int16 codes on the register tiles: each kv head's keys and values packed in
    pairs once, int32 sums."""
    batch, heads, rows, depth = q.shape
    length, width = k.shape[2], v.shape[3]
    codes_q, codes_k = _codes(q, params, Q, np.int16), _codes(k, params, K, np.int16)
    codes_v = _codes(v, params, V, np.int16)
    lanes = 16  # (qgemm_tiles.LANES: the pairs' columns rounded up to whole vectors)
    keys = np.empty(((depth + 1) // 2, (length + lanes - 1) // lanes * lanes, 2), np.int16)
    values = np.empty(((length + 1) // 2, (width + lanes - 1) // lanes * lanes, 2), np.int16)
    sums = np.empty((rows, length), np.int32)
    scores = np.empty((rows, length), np.float32)
    weights = np.empty((rows, length), np.float32)
    probs = np.empty((rows, length), np.int16)
    context = np.empty((rows, width), np.int32)
    for b in range(batch):
        for h in range(heads):
            g = h // group
            if h % group == 0:
                pack_pairs(codes_k[b, g], keys)  # scores = q @ keys.T: the keys' rows are B's columns
                pack_pairs(np.ascontiguousarray(codes_v[b, g].T), values)
            tile_product(codes_q[b, h], keys, sums)
            _requantized(sums.reshape(-1), params, SCORES, scores.reshape(-1))
            _rest_of_head(scores, weights, b, h, add0, add1, tables, steps, params, probs)
            tile_product(probs, values, context)
            _requantized(context.reshape(-1), params, CONTEXT, out[b, h].reshape(-1))
