"""The arithmetic of onnxruntime's contrib attention operators (com.microsoft Attention, MultiHeadAttention,
GroupQueryAttention, RotaryEmbedding), whose grouped products and in-place softmax the ONNX Attention kernel
(ops/transformer.py) uses too: heads, rotary embedding, the additive masks of their key-padding
conventions, and scaled dot-product attention with grouped key/value heads, a soft cap and a softmax sink.

Everything here runs in the caller's compute dtype (float32 for half-precision inputs); masks are additive
biases in which -inf hides a key outright and a finite ``fill`` (mask_filter_value) only pushes it down, as
the contrib kernels do.
"""

from __future__ import annotations

import numpy as np

from ..compiled.deferred import numpy_first
from ..tuning import KNOBS

_F32 = np.dtype(np.float32)
_NO_BIAS = np.empty((0, 0, 0, 0), np.float32)
# Query rows up to which a few-row call gets the whole multiply-add budget (ops/transformer.py's rule).
_FEW_ROWS = 4


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(B, S, heads * D) -> (B, heads, S, D), a view."""
    return x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(0, 2, 1, 3)


def merge_heads(y: np.ndarray) -> np.ndarray:
    """(B, heads, S, D) -> (B, S, heads * D)."""
    return y.transpose(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], -1)


def rotate_(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotary embedding in place on the first ``2 * cos.shape[-1]`` features of ``x``'s last axis (the rest
    pass through): pairs (2i, 2i + 1) when ``interleaved``, else (i, i + half). ``cos``/``sin`` broadcast
    against ``x[..., :half]``."""
    half = cos.shape[-1]
    if interleaved:
        first, second = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    else:
        first, second = x[..., :half], x[..., half:2 * half]
    real = first * cos - second * sin
    imag = first * sin + second * cos
    first[...] = real
    second[...] = imag
    return x


def positions_from(position_ids: np.ndarray, batch: int, steps: int, start: bool) -> np.ndarray:
    """(batch, steps) positions: ``position_ids``' first element plus 0, 1, ... when ``start`` (a start
    offset, as a (1,)-shaped position_ids means), else position_ids itself broadcast to (batch, steps)."""
    ids = np.asarray(position_ids).astype(np.int64, copy=False)
    if start:
        return np.broadcast_to(ids.reshape(-1)[0] + np.arange(steps, dtype=np.int64), (batch, steps))
    return np.broadcast_to(ids, (batch, steps))


def key_mask_bias(mask: np.ndarray, batch: int, q_len: int, total: int, past: int, fill) -> np.ndarray | None:
    """The additive bias (B, 1, S|1, T) of a contrib key-padding mask, ``fill`` where a key is masked and 0
    elsewhere, or None when the mask's shape is none of the conventions:

    (B): each batch's valid key count (right padding); (2B): exclusive ends, then inclusive starts (left
    padding); (B, T): raw 0/1 per key; (B, S, T): raw 0/1 per query and key; (B, 1, M, M): a raw mask over a
    maximum length M, of which rows past .. past + S and columns 0 .. T apply.
    """
    keys = np.arange(total)
    if mask.ndim == 1 and mask.shape[0] == batch:  # (one where over (B, T): this runs per layer and call)
        return np.where(keys >= mask[:, None], fill, fill.dtype.type(0)).reshape(batch, 1, 1, total)
    if mask.ndim == 2 and mask.shape == (batch, total):
        return np.where(mask <= 0, fill, fill.dtype.type(0)).reshape(batch, 1, 1, total)
    if mask.ndim == 1 and mask.shape[0] == 2 * batch:
        ends, starts = mask[:batch].reshape(batch, 1), mask[batch:].reshape(batch, 1)
        hidden = ((keys >= ends) | (keys < starts))[:, None, None, :]
    elif mask.ndim == 3 and mask.shape == (batch, q_len, total):
        hidden = (mask <= 0)[:, None]
    elif mask.ndim == 4 and mask.shape[:2] == (batch, 1) and mask.shape[2] >= past + q_len and mask.shape[3] >= total:
        hidden = mask[:, :, past:past + q_len, :total] <= 0
    else:
        return None
    return np.where(hidden, fill, fill.dtype.type(0))


def causal_hidden(q_len: int, total: int, offset) -> np.ndarray:
    """Which keys lie after each query, query i sitting at absolute position i + ``offset``: (S, T) for an
    int offset, (B, 1, S, T) for one per batch."""
    per_batch = np.ndim(offset) > 0
    position = np.arange(q_len)[:, None] + (np.reshape(offset, (-1, 1, 1, 1)) if per_batch else offset)
    return np.arange(total) > position


def hide(bias: np.ndarray | None, hidden: np.ndarray | None, dtype) -> np.ndarray | None:
    """``bias`` with -inf where ``hidden`` (either may be None)."""
    if hidden is None:
        return bias
    base = dtype.type(0) if bias is None else bias
    return np.where(hidden, dtype.type(-np.inf), base)


def grouped_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` per head, ``a`` (B, Hq, M, K) having Hq / Hkv consecutive heads per head of ``b``
    (B, Hkv, K, N): a group's rows go through one matmul. Returns (B, Hq, M, N)."""
    batch, heads, rows, depth = a.shape
    kv_heads = b.shape[1]
    folded = a.reshape(batch, kv_heads, (heads // kv_heads) * rows, depth)
    return np.matmul(folded, b).reshape(batch, heads, rows, b.shape[-1])


def softmax_(scores: np.ndarray, sink: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis, in place. A row of only -inf becomes zeros. ``sink`` (per head, (H,)) adds
    exp(sink) to each row's denominator (a smooth softmax, whose rows may sum to less than one)."""
    if scores.shape[-1] == 0:
        return scores
    peak = scores.max(axis=-1, keepdims=True)
    if sink is not None:
        sink = sink.reshape(1, -1, 1, 1).astype(scores.dtype, copy=False)
        peak = np.maximum(peak, sink)
    peak[np.isneginf(peak)] = 0
    scores -= peak
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    if sink is not None:
        total += np.exp(sink - peak)
    total[total == 0] = 1
    scores /= total
    return scores


class Scores:
    """What one attention step computed besides its output: the scores as the softmax saw them and the
    probabilities (for the operators' optional QK outputs)."""

    __slots__ = ("logits", "probs")

    def __init__(self, logits, probs):
        self.logits, self.probs = logits, probs


def few_rows(q, k, v, scale: float, bias=None) -> np.ndarray | None:
    """attend's y from compiled/decoder.py's few-row loop (the ONNX Attention's small-attention path: one
    compiled call for what numpy runs as eight) for float32 operands within its multiply-add budget and a bias
    that is (B', H', M', T) with each lead 1 or full after padding its rank; None where attend's numpy path
    decides (other cases, a row without a finite score, numba still loading)."""
    if q.dtype != _F32 or k.dtype != _F32 or v.dtype != _F32 or q.ndim != 4:
        return None
    batch, heads, rows, depth = q.shape
    keys = k.shape[2]
    budget = KNOBS.few_query_macs if rows <= _FEW_ROWS else KNOBS.few_query_macs // 2
    if not keys or heads * rows * depth * keys > budget or heads % k.shape[1]:
        return None
    if bias is None:
        bias = _NO_BIAS
    else:
        if bias.dtype != _F32 or not 1 <= bias.ndim <= 4 or bias.shape[-1] != keys:
            return None
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        if any(d not in (1, full) for d, full in zip(bias.shape[:3], (batch, heads, rows))):
            return None
        bias = np.ascontiguousarray(bias)
    if numpy_first():
        return None
    from ..compiled import decoder  # numba loads only for models that need it

    y = np.empty((batch, heads, rows, v.shape[3]), np.float32)
    if not decoder.few_query_attention_float32(np.ascontiguousarray(q), np.ascontiguousarray(k),
                                               np.ascontiguousarray(v), np.float32(scale), bias, y):
        return None
    return y


def attend(q, k, v, scale: float, bias=None, softcap: float = 0.0, sink=None, keep: bool = False):
    """Scaled dot-product attention: q (B, Hq, S, D), k (B, Hkv, T, D), v (B, Hkv, T, Dv), Hq a multiple of
    Hkv, all of one float dtype; ``bias`` an additive term broadcasting to (B, Hq, S, T), -inf hiding a key;
    ``softcap`` > 0 bounds the scaled scores to (-softcap, softcap) by tanh before the bias. Returns
    (y (B, Hq, S, Dv), Scores or None): the Scores when ``keep``."""
    if softcap <= 0 and sink is None and not keep:
        y = few_rows(q, k, v, scale, bias)
        if y is not None:
            return y, None
    dtype = q.dtype.type
    scores = grouped_matmul(q * dtype(scale), k.swapaxes(-1, -2))
    if softcap > 0:
        scores = dtype(softcap) * np.tanh(scores / dtype(softcap))
    if bias is not None:
        scores += bias
    logits = scores.copy() if keep else None
    probs = softmax_(scores, sink)
    y = grouped_matmul(probs, v)
    return y, (Scores(logits, probs) if keep else None)
