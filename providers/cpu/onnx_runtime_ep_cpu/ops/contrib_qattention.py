"""onnxruntime's quantized BERT operators (domain com.microsoft): QAttention and QEmbedLayerNormalization,
as docs/ContribOperators.md defines them.

QAttention's input projection is an exact integer product (input - zero point) x (weight - zero point),
rescaled by input_scale * weight_scale (per tensor or per column) plus the float bias; the attention
that follows is com.microsoft.Attention's, in float64, rounded once to the output type.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.quantize import dequantize, int_matmul, widen
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error, graph_error, wants_output
from .contrib_quantization import eight_bit, scalar

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_FLOATS = (_F32, np.dtype(np.float16))


# -- QAttention ------------------------------------------------------------------------------------


class _AttentionAttrs:
    def __init__(self, node):
        self.node = node
        heads = node.attr("num_heads")
        if heads is None or int(heads) < 1:
            raise graph_error(node, "num_heads", f"is {heads!r}; expected a positive head count")
        self.heads = int(heads)
        self.causal = bool(node.attr("unidirectional", 0))
        self.scale = node.attr("scale")
        self.filter = float(node.attr("mask_filter_value", -10000.0))
        for name in ("do_rotary", "past_present_share_buffer"):
            if int(node.attr(name, 0)):
                raise graph_error(node, name, "is set; QAttention here supports neither rotary embedding nor "
                                  "a shared past/present buffer (expected 0)")


def _projection(node, heads, x, w, bias, x_scale, w_scale, x_zero_point, w_zero_point):
    """(B, S, 3 * hidden) float64 Q/K/V projections: exact integer product, rescaled, plus bias."""
    eight_bit(node, "input", x)
    eight_bit(node, "weight", w)
    if x.ndim != 3 or w.ndim != 2 or x.shape[2] != w.shape[0] or w.shape[1] % 3 or (w.shape[1] // 3) % heads:
        raise argument_error(node, f"input {x.shape} and weight {w.shape} do not fit: expected (B, S, D) and "
                             f"(D, 3 * hidden) with hidden divisible by num_heads={heads}")
    columns = w.shape[1]
    if bias.shape != (columns,) or bias.dtype not in _FLOATS:
        raise argument_error(node, f"bias is {bias.dtype}{bias.shape}; expected float ({columns},)")
    x_zero = scalar(node, "input_zero_point", x_zero_point, x.dtype)
    w_zero = _per_column(node, "weight_zero_point", w_zero_point, columns, w.dtype)
    scale = scalar(node, "input_scale", x_scale).astype(_F64) * _per_column(
        node, "weight_scale", w_scale, columns).astype(_F64)
    return int_matmul(widen(x, x_zero), widen(w, w_zero)) * scale + bias.astype(_F64)


def _per_column(node, name, value, columns, dtype=None):
    if value is None or value.size == 1:
        return scalar(node, name, value, dtype)
    if value.shape != (columns,) or (dtype is not None and value.dtype != dtype):
        raise argument_error(node, f"input {name!r} is {value.dtype}{value.shape}; expected a scalar or ({columns},)")
    return value


def _heads(t: np.ndarray, heads: int) -> np.ndarray:
    b, s, hidden = t.shape
    return t.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _with_past(node, k, v, past):
    if past is None:
        return k, v
    if past.ndim != 5 or past.shape[0] != 2 or past.shape[1:3] != k.shape[:2] or past.shape[4] != k.shape[3]:
        raise argument_error(node, f"past has shape {past.shape}; expected (2, {k.shape[0]}, {k.shape[1]}, "
                             f"past_sequence_length, {k.shape[3]})")
    return np.concatenate([past[0].astype(_F64), k], axis=2), np.concatenate([past[1].astype(_F64), v], axis=2)


def _index_mask(node, mask, batch, total):
    """Key positions (B, T) kept by a 1-D mask index: valid lengths (B) or end and start positions (2B)."""
    positions = np.arange(total)
    if mask.shape == (batch,):
        return positions[None, :] < mask[:, None]
    if mask.shape == (2 * batch,):
        end, start = mask[:batch, None], mask[batch:, None]
        return (positions[None, :] < end) & (positions[None, :] >= start)
    raise argument_error(node, f"mask_index has shape {mask.shape}; expected ({batch},) or ({2 * batch},)")


def _kept(node, mask, batch, seq, total):
    """(B, S, T) booleans: which key positions each query may attend to, from the mask alone."""
    if mask.dtype != np.int32:
        raise argument_error(node, f"mask_index is {mask.dtype}; expected int32")
    if mask.ndim == 1:
        return np.broadcast_to(_index_mask(node, mask, batch, total)[:, None, :], (batch, seq, total))
    if mask.shape == (batch, total):
        return np.broadcast_to((mask > 0)[:, None, :], (batch, seq, total))
    if mask.shape == (batch, seq, total):
        return mask > 0
    raise argument_error(node, f"mask_index has shape {mask.shape}; expected ({batch},), ({2 * batch},), "
                         f"({batch}, {total}) or ({batch}, {seq}, {total})")


def _additive_mask(node, attrs, mask, batch, seq, total):
    """(B, 1, S, T) float64 added to the scaled scores, or None: mask_filter_value where the mask drops a
    key, plus mask_filter_value again past each query's position when unidirectional."""
    bias = None
    if mask is not None:
        bias = np.where(_kept(node, mask, batch, seq, total), 0.0, attrs.filter)
    if attrs.causal and seq > 1:
        past = total - seq
        future = np.arange(total)[None, :] > (past + np.arange(seq))[:, None]
        causal = np.where(future, attrs.filter, 0.0)
        bias = causal[None] if bias is None else bias + causal
    return None if bias is None else bias[:, None]


def _attend(q, k, v, bias, scale):
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    scores -= scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    return np.matmul(e / e.sum(axis=-1, keepdims=True), v)


@register("QAttention", domain=CONTRIB_DOMAIN, since=1)
def qattention(node, shapes, opset):
    attrs = _AttentionAttrs(node)
    want_present = wants_output(node, 1)

    def kernel(x, w, bias, x_scale, w_scale, mask_index=None, x_zero_point=None, w_zero_point=None, past=None):
        qkv = _projection(node, attrs.heads, x, w, bias, x_scale, w_scale, x_zero_point, w_zero_point)
        hidden = qkv.shape[2] // 3
        q, k, v = (_heads(qkv[..., i * hidden:(i + 1) * hidden], attrs.heads) for i in range(3))
        k, v = _with_past(node, k, v, past)
        batch, seq, total = x.shape[0], x.shape[1], k.shape[2]
        scale = attrs.scale if attrs.scale is not None else 1.0 / np.sqrt(hidden // attrs.heads)
        bias_mask = None if mask_index is None and not attrs.causal else _additive_mask(
            node, attrs, mask_index, batch, seq, total)
        out = _attend(q, k, v, bias_mask, float(scale)).transpose(0, 2, 1, 3).reshape(batch, seq, hidden)
        dtype = bias.dtype
        outputs = (out.astype(dtype),)
        if want_present:
            outputs += (np.stack([k, v]).astype(dtype),)
        return outputs

    return kernel


# -- QEmbedLayerNormalization ----------------------------------------------------------------------


def _ids(node, name, ids, rows, shape):
    if ids.dtype != np.int32 or ids.shape != shape:
        raise argument_error(node, f"input {name!r} is {ids.dtype}{ids.shape}; expected int32 {shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise argument_error(node, f"input {name!r} has ids outside [0, {rows}) of its embedding table")
    return ids


def _table(node, name, q, scale, zero_point, hidden=None):
    """A dequantized (float32) embedding table or LayerNorm parameter."""
    eight_bit(node, name, q)
    zero = scalar(node, f"{name} zero point", zero_point, q.dtype)
    values = dequantize(q, scalar(node, f"{name} scale", scale), zero)
    if hidden is not None and values.shape[-1] != hidden:
        raise argument_error(node, f"{name} has shape {q.shape}; expected a last dimension of {hidden}")
    return values.astype(_F64)


def _layer_norm(x, gamma, beta, epsilon):
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    var = np.mean(centered * centered, axis=-1, keepdims=True)
    return centered / np.sqrt(var + epsilon) * gamma + beta


def _segments(node, segment, batch_shape, hidden):
    """The (B, S, hidden) segment embeddings, or 0 when the all-or-none segment group is omitted."""
    ids, table, scale, zero = segment
    given = [v is not None for v in segment]
    if not any(given):
        return 0.0
    if not all(given):
        raise argument_error(node, "segment_ids, segment_embedding, its scale and its zero point must all be "
                             "given or all be omitted")
    values = _table(node, "segment_embedding", table, scale, zero, hidden)
    return values[_ids(node, "segment_ids", ids, values.shape[0], batch_shape)]


def _mask_index(node, mask, batch_shape):
    if mask is None:
        return np.zeros(batch_shape[0], np.int32)
    if mask.dtype != np.int32 or mask.shape != batch_shape:
        raise argument_error(node, f"mask is {mask.dtype}{mask.shape}; expected int32 {batch_shape}")
    # The number of words: the positions the mask keeps.
    return np.count_nonzero(mask, axis=1).astype(np.int32)


@register("QEmbedLayerNormalization", domain=CONTRIB_DOMAIN, since=1)
def qembed_layer_normalization(node, shapes, opset):
    epsilon = float(node.attr("epsilon", 1e-12))
    if not epsilon >= 0:
        raise graph_error(node, "epsilon", f"is {epsilon}; expected a non-negative value")

    def kernel(input_ids, segment_ids, word_q, position_q, segment_q, gamma_q, beta_q, mask,
               word_scale, position_scale, segment_scale, gamma_scale, beta_scale,
               word_zero, position_zero, segment_zero, gamma_zero, beta_zero):
        if input_ids.ndim != 2:
            raise argument_error(node, f"input_ids has shape {input_ids.shape}; expected (batch_size, sequence_length)")
        batch_shape = input_ids.shape
        words = _table(node, "word_embedding", word_q, word_scale, word_zero)
        hidden = words.shape[-1]
        positions = _table(node, "position_embedding", position_q, position_scale, position_zero, hidden)
        if positions.shape[0] < batch_shape[1]:
            raise argument_error(node, f"position_embedding has {positions.shape[0]} rows; the sequence needs "
                                 f"{batch_shape[1]}")
        ids = _ids(node, "input_ids", input_ids, words.shape[0], batch_shape)
        total = words[ids] + positions[None, :batch_shape[1]]
        total = total + _segments(node, (segment_ids, segment_q, segment_scale, segment_zero), batch_shape, hidden)
        gamma = _table(node, "gamma", gamma_q, gamma_scale, gamma_zero, hidden)
        beta = _table(node, "beta", beta_q, beta_scale, beta_zero, hidden)
        out = _layer_norm(total, gamma, beta, epsilon).astype(_F32)
        return out, _mask_index(node, mask, batch_shape)

    return kernel
