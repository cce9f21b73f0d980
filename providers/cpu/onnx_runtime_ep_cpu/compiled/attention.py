"""Float32 scaled dot-product attention, one tile of query rows at a time, through gemm.py's microkernel.

Through numpy, a prefill's attention is a batched QK^T product, a mask-and-shift pass, exp, a
batched PV product and a division, each a pass over (heads x queries x keys) scores in memory, and
its products OpenBLAS's (whose spinning pool fights the helper threads of workers.py). Here each
(batch, head) unit runs on one thread: K^T is packed once per KV head into rows of keys, then for each
tile of 12 (or 8) query rows the scores tile (rows x visible keys) is computed by the microkernel,
turned into unnormalized softmax weights in place (scale, mask, shift by the row's maximum, exp), and
multiplied by V read in place; each output row is divided by its weights' sum as it is stored. The
scores never leave the core's cache, and keys that the mask hides from every row of a tile (a causal
mask's future) are not computed at all. Results do not depend on how units are split across threads.

Also here: decoder.py's one-call small attention over the (B, S, H, D) layout of a 3-D Attention's inputs
(attention_heads.py folds the exporters' head split and merge into the node), read and written in place.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .decoder import row_dot
from .gemm import IDENTITY, NR
from .matmul import tile
from .transformer import contracting_jit, exp_nonpositive_float32, exp_shifted_sum_, mask_and_shift_, row_max, row_sum


@jit
def padded_keys(total):
    """Keys rounded up to whole NR-lane panels: the width of packed K^T rows and of a scores tile."""
    return -(-total // NR) * NR


def scratch_size(head_size: int, value_size: int, total: int) -> int:
    """Floats of scratch attention_units needs: K^T packed, a scores tile, an output tile, padded queries."""
    return head_size * padded_keys(total) + 12 * padded_keys(total) + 12 * value_size + 12 * head_size


def tiles(rows: int) -> np.ndarray:
    """The query tiles (first row, rows, tile height) of ``rows`` queries: 12-row tiles, then 8."""
    plan, t0 = [], 0
    while t0 < rows:
        mr = 12 if rows - t0 >= 12 else 8
        plan.append((t0, min(mr, rows - t0), mr))
        t0 += min(mr, rows - t0)
    return np.array(plan, dtype=np.int64).reshape(-1, 3)


@jit
def _tile(mr, a, lda, b, rows, c, depth, ldc):
    """matmul.tile without bias, residual or activation."""
    tile(mr, a, lda, b, rows, c, depth, ldc, c, c, 0, 0, IDENTITY)


@jit
def attention_units(q, q_strides, k, k_strides, v, v_strides, y, y_strides, heads, kv_heads, total, head_size,
                    value_size, scale, mask, plan, extents, first, end, scratch, status):
    """Units (batch * heads + head) first .. end of softmax(Q K^T * scale + mask) V into y.

    q, k, v and y are flat views of (B, H, S, D)-strided memory from their first element: element
    (b, h, s, d) at b*strides[0] + h*strides[1] + s*strides[2] + d (q with ``heads``, k and v with
    ``kv_heads``, which a group of consecutive query heads shares). ``mask``: the (queries, total)
    additive mask, or empty. ``plan``: tiles(queries); ``extents[t]``: the keys tile t computes (one
    past the last key a row of it can see). status[0] is set to 1, and the unit abandoned, when a
    row has no finite score (the caller then takes its general path)."""
    padded = padded_keys(total)
    packed = scratch[: head_size * padded]
    scores = scratch[head_size * padded: head_size * padded + 12 * padded]
    out = scratch[head_size * padded + 12 * padded: head_size * padded + 12 * padded + 12 * value_size]
    queries = scratch[head_size * padded + 12 * padded + 12 * value_size:]
    key_rows = np.arange(head_size) * padded  # row d of K^T, in ``packed``
    value_rows = np.arange(total) * v_strides[2]  # row j of V, from the head's first element
    group = heads // kv_heads
    packed_for = -1
    for unit in range(first, end):
        b, h = unit // heads, unit % heads
        kv = b * kv_heads + h // group
        k_at, v_at = b * k_strides[0] + (h // group) * k_strides[1], b * v_strides[0] + (h // group) * v_strides[1]
        if kv != packed_for:  # K^T of this KV head, rows of keys padded with zeros to whole panels
            for j in range(total):  # (key by key: K's rows read in order, their columns scattered in L1)
                key = k[k_at + j * k_strides[2]: k_at + j * k_strides[2] + head_size]
                for d in range(head_size):
                    packed[d * padded + j] = key[d]
            for d in range(head_size):
                packed[d * padded + total: (d + 1) * padded] = 0
            packed_for = kv
        q_at, y_at = b * q_strides[0] + h * q_strides[1], b * y_strides[0] + h * y_strides[1]
        for t in range(plan.shape[0]):
            t0, rows, mr = plan[t, 0], plan[t, 1], plan[t, 2]
            extent = extents[t]
            if rows == mr:
                a, lda = q[q_at + t0 * q_strides[2]:], q_strides[2]
            else:  # the last rows, padded with zero rows to a whole tile
                a, lda = queries, head_size
                queries[: mr * head_size] = 0
                for i in range(rows):
                    for d in range(head_size):
                        queries[i * head_size + d] = q[q_at + (t0 + i) * q_strides[2] + d]
            for p in range(-(-extent // NR)):
                _tile(mr, a, lda, packed[p * NR:], key_rows, scores[p * NR:], head_size, padded)
            for i in range(rows):
                row = scores[i * padded: i * padded + extent]
                # Scale, mask, minus the row's maximum (a NaN score makes its weight, and so its row, NaN, as
                # numpy's softmax); False for a row without a finite score.
                if not mask_and_shift_(row.reshape(1, 1, extent), scale, mask, t0 + i):
                    status[0] = 1
                    return
                for j in range(extent):
                    row[j] = exp_nonpositive_float32(row[j])
            for i in range(rows, mr):  # padded rows: weights of zero
                scores[i * padded: i * padded + extent] = 0
            for p in range(value_size // NR):
                _tile(mr, scores, padded, v[v_at + p * NR:], value_rows, out[p * NR:], extent, value_size)
            for i in range(rows):
                total_weight = row_sum(scores[i * padded: i * padded + extent])
                target = y_at + (t0 + i) * y_strides[2]
                line, source = y[target: target + value_size], out[i * value_size: (i + 1) * value_size]
                for d in range(value_size):
                    line[d] = source[d] / total_weight


@jit
def few_rows_by_position(q, k, v, scale, bias, y):
    """decoder.few_query_attention_float32 over (B, S, H, D) arrays, the (B, S, H * D) layout of a 3-D Attention
    split in place (no transposed copies to (B, H, S, D)): y[b, :, h] = softmax(q[b, :, h] k[b, :, g]^T * scale +
    bias[b, h]) v[b, :, g] with g = h // (query heads / KV heads). Per query row: its dot products with the keys,
    the row's maximum, exp with the sum, the weighted sum of V's rows, the division, in that loop's order (the
    same bits). ``bias`` is (B', H', M', T) as there (each of B', H', M' one or full), or empty. False, with y
    partly written, when a row's largest score is not finite (the caller's general path decides those)."""
    batch, rows, heads = q.shape[0], q.shape[1], q.shape[2]
    keys = k.shape[1]
    group = heads // k.shape[2]
    with_bias = bias.size > 0
    bias_b, bias_h, bias_r = bias.shape[0] > 1, bias.shape[1] > 1, bias.shape[2] > 1
    scores, weights = np.empty(keys, dtype=np.float32), np.empty(keys, dtype=np.float32)
    for b in range(batch):
        for h in range(heads):
            g = h // group
            for r in range(rows):
                query = q[b, r, h]
                if with_bias:
                    row_bias = bias[b if bias_b else 0, h if bias_h else 0, r if bias_r else 0]
                    for t in range(keys):
                        scores[t] = row_dot(query, k[b, t, g]) * scale + row_bias[t]
                else:
                    for t in range(keys):
                        scores[t] = row_dot(query, k[b, t, g]) * scale
                peak = row_max(scores)
                if not abs(peak) < np.float32(np.inf):
                    return False
                total = exp_shifted_sum_(scores, peak, weights)
                out = y[b, r, h]
                _weighted_heads(weights, v, b, g, out)
                for j in range(out.shape[0]):
                    out[j] /= total
    return True


@contracting_jit
def _weighted_heads(weights, v, b, g, out):
    """out = the sum over t of weights[t] * v[b, t, g] (in t order, one fused multiply-add per term), as
    decoder._weighted_rows over V's rows of one head."""
    out[:] = 0
    for t in range(v.shape[1]):
        weight = weights[t]
        row = v[b, t, g]
        for j in range(out.shape[0]):
            out[j] += weight * row[j]
