"""com.microsoft Attention over its packed Q/K/V product in one compiled pass: the projection's bias added in
place, then per (batch, head, query row) the scores against the keys, the key-padding mask, the softmax and the
weighted sum of the values, each read where the packed product holds it (B, S, 3, N, D). Run as separate
projections, a mask step and an attention step, a BERT-sized layer spent most of its time between kernels.
Where attention_lanes.py's 16-lane loop takes the sequence, packed_in_lanes_ instead writes the contiguous
Q, K, V and key bias that loop reads, in the one pass the bias add would take, and calls it; product_in_lanes_
takes the node's input itself, computes the packed product with matmul.py's tiles and runs that loop over its
parts in place, so a short sequence's node is one compiled call."""

from __future__ import annotations

import numpy as np

from . import jit
from .attention_lanes import few_rows_in_lanes
from .attention_lanes import scratch_size as lanes_scratch_size
from .decoder import row_dot
from .few_rows import PANEL_ROWS, few_row_panels
from .matmul import matmul_panels
from .matmul import scratch_size as product_scratch_size
from .transformer import contracting_jit, exp_shifted_sum_, row_max


@jit
def packed_self_attention_(qkv, bias, counts, mask, scale, fill, causal, y):
    """y[b, r, h] = softmax(q . k * scale + mask) v over qkv (B, S, 3, N, D) float32, C-contiguous, after
    qkv += bias (3, N, D) where ``bias`` has elements. The mask is ``fill`` added to keys at or after counts[b]
    where ``counts`` (B,) has elements, plus mask[b', 0, r', t] (B' and M' one or full) where ``mask`` has
    elements; ``causal`` leaves out keys after the query. False, with y partly written, when a row's largest
    score is not finite (the general path decides those)."""
    batch, steps, heads = qkv.shape[0], qkv.shape[1], qkv.shape[3]
    if bias.size:
        _add_bias_(qkv, bias)
    with_counts, with_mask = counts.size > 0, mask.size > 0
    mask_b, mask_r = mask.shape[0] > 1, mask.shape[2] > 1
    scores, weights = np.empty(steps, np.float32), np.empty(steps, np.float32)
    for b in range(batch):
        valid = counts[b] if with_counts else steps
        for h in range(heads):
            for r in range(steps):
                visible = r + 1 if causal else steps
                _scores(qkv, b, h, r, visible, scale, valid, fill, scores)
                if with_mask:
                    row_mask = mask[b if mask_b else 0, 0, r if mask_r else 0]
                    for t in range(visible):
                        scores[t] += row_mask[t]
                peak = row_max(scores[:visible])
                if not abs(peak) < np.float32(np.inf):
                    return False
                total = exp_shifted_sum_(scores[:visible], peak, weights[:visible])
                out = y[b, r, h]
                _weighted_values(weights, qkv, b, h, visible, out)
                for j in range(out.shape[0]):
                    out[j] /= total
    return True


@jit
def _scores(qkv, b, h, r, visible, scale, valid, fill, scores):
    """scores[t] = q[b, r, h] . k[b, t, h] * scale for the visible keys, ``fill`` added from key ``valid`` on."""
    query = qkv[b, r, 0, h]
    for t in range(visible):
        scores[t] = row_dot(query, qkv[b, t, 1, h]) * scale
    for t in range(valid, visible):
        scores[t] += fill


@jit
def _add_bias_(qkv, bias):
    """qkv[b, s] += bias (3, N, D) for every packed row."""
    add = bias.reshape(-1)
    for b in range(qkv.shape[0]):
        for s in range(qkv.shape[1]):
            flat = qkv[b, s].reshape(-1)
            for j in range(flat.shape[0]):
                flat[j] += add[j]


@contracting_jit
def _weighted_values(weights, qkv, b, h, visible, out):
    """out = the sum over t < visible of weights[t] * v[b, t, h] (in t order, one fused multiply-add per term)."""
    out[:] = 0
    for t in range(visible):
        weight = weights[t]
        row = qkv[b, t, 2, h]
        for j in range(out.shape[0]):
            out[j] += weight * row[j]


@jit
def packed_in_lanes_(qkv, bias, counts, mask, fill, scale, y, work):
    """packed_self_attention_'s y (without a causal frontier) through attention_lanes.few_rows_in_lanes: Q, K, V
    and the key bias (counts' as ``fill`` past each count, else ``mask``) written into ``work``, which holds
    3 * B * S * N * D + B * S floats and the lanes' scratch after them. False as few_rows_in_lanes."""
    batch, steps, heads, size = qkv.shape[0], qkv.shape[1], qkv.shape[3], qkv.shape[4]
    part = batch * steps * heads * size
    q = work[:part].reshape(batch, steps, heads, size)
    k = work[part:2 * part].reshape(batch, steps, heads, size)
    v = work[2 * part:3 * part].reshape(batch, steps, heads, size)
    key_bias = work[3 * part:3 * part + batch * steps].reshape(batch, 1, 1, steps) if counts.size else mask
    lanes_operands_(qkv, bias, counts, fill, q, k, v, key_bias)
    return few_rows_in_lanes(q, k, v, scale, key_bias, y, work[3 * part + batch * steps:])


@jit
def lanes_operands_(qkv, bias, counts, fill, q, k, v, key_bias):
    """q, k, v (B, S, N, D) = the packed product's parts (B, S, 3, N, D) plus bias (3, N, D) where ``bias`` has
    elements; key_bias[b, 0, 0, t] = ``fill`` for keys t at or after counts[b], else 0, where ``counts`` has
    elements (attention_lanes.few_rows_in_lanes's additive bias form of the contrib key count)."""
    batch, steps = qkv.shape[0], qkv.shape[1]
    width = qkv.shape[3] * qkv.shape[4]
    rows = batch * steps
    source, add = qkv.reshape(rows, 3, width), bias.reshape(-1, width)
    parts = (q.reshape(rows, width), k.reshape(rows, width), v.reshape(rows, width))
    if add.shape[0]:
        for i in range(3):
            _biased_rows(source, i, add[i], parts[i])
    else:
        for i in range(3):
            parts[i][:] = source[:, i]
    if counts.size:
        for b in range(batch):
            for t in range(steps):
                key_bias[b, 0, 0, t] = fill if t >= counts[b] else np.float32(0)


@jit
def _biased_rows(source, part, add, target):
    """target[r] = source[r, part] + add for every row r."""
    for r in range(target.shape[0]):
        row, out = source[r, part], target[r]
        for j in range(out.shape[0]):
            out[j] = row[j] + add[j]



def product_work(batch: int, steps: int, depth: int, hidden: int, size: int) -> int:
    """Floats product_in_lanes_'s ``work`` holds: the packed product (B * S, 3 * hidden), the key bias, then the
    scratch of the product's tiles or of the 16-lane loop (used one after the other)."""
    return (3 * hidden + 1) * batch * steps + max(product_scratch_size(depth), lanes_scratch_size(size, steps))


@jit
def product_in_lanes_(x, heads, packed, offsets, padded_bias, flags, counts, mask, fill, scale, y, work):
    """packed_in_lanes_'s y (B, S, hidden) from the node's input x (B, S, K) itself, both C-contiguous: the packed
    product x @ W (+ b) by matmul.py's tiles (few_rows.py's up to PANEL_ROWS rows: the same bits) over W packed by
    matmul.pack_columns (``flags``: gemm.BIAS to add ``padded_bias``, matmul.pad_bias's, else 0; ``offsets``:
    gemm.packed_offsets(K)) into ``work`` (product_work's floats), then few_rows_in_lanes reading Q, K and V there
    as views, with the key bias of ``counts`` or ``mask`` as packed_in_lanes_. One call instead of BLAS's product,
    a copy of the three parts and the loop's call. False as few_rows_in_lanes."""
    batch, steps, depth = x.shape
    hidden = y.shape[2]
    size = hidden // heads
    rows = batch * steps
    part = rows * hidden
    scratch = work[3 * part + rows:]
    none = np.empty(0, np.float32)
    product = work[:3 * part]
    if rows <= PANEL_ROWS:
        few_row_panels(x.reshape(-1), depth, rows, depth, packed, offsets, padded_bias, product, 3 * hidden, none,
                       flags, none, 0, packed.shape[0], scratch)
    else:
        matmul_panels(x.reshape(-1), depth, rows, depth, packed, offsets, padded_bias, product, 3 * hidden, none,
                      flags, none, 0, packed.shape[0], scratch)
    qkv = product.reshape(batch, steps, 3, heads, size)
    key_bias = mask
    if counts.size:
        key_bias = work[3 * part:3 * part + rows].reshape(batch, 1, 1, steps)
        for b in range(batch):
            for t in range(steps):
                key_bias[b, 0, 0, t] = fill if t >= counts[b] else np.float32(0)
    return few_rows_in_lanes(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], scale, key_bias,
                             y.reshape(batch, steps, heads, size), scratch)
