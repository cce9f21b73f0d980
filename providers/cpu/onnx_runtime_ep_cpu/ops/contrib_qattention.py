"""onnxruntime's quantized BERT operators (domain com.microsoft): QAttention and QEmbedLayerNormalization,
as docs/ContribOperators.md defines them.

QAttention's input projection is an exact integer product (input - zero point) x (weight - zero point),
rescaled by input_scale * weight_scale (per tensor or per column) plus the float bias; the attention
that follows is com.microsoft.Attention's (algorithms/contrib_attention.py: its mask conventions, scale and
softmax), in float32 as onnxruntime computes it.
"""

from __future__ import annotations

import math

import numpy as np

from ..algorithms.contrib_attention import attend, causal_hidden, key_mask_bias, merge_heads, split_heads
from ..algorithms.quantize import IntegerProduct, dequantize, int_matmul, widen
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
        self.scale = node.attr("scale")  # None or 0: the default
        self.filter = float(node.attr("mask_filter_value", -10000.0))
        for name in ("do_rotary", "past_present_share_buffer"):
            if int(node.attr(name, 0)):
                raise graph_error(node, name, "is set; QAttention here supports neither rotary embedding nor "
                                  "a shared past/present buffer (expected 0)")


def _projection(node, product, heads, x, w, bias, x_scale, w_scale, x_zero_point, w_zero_point):
    """(B, S, 3 * hidden) float32 Q/K/V projections: an exact integer product, rescaled in float64, plus the
    bias, rounded once."""
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
    acc = product(x, w, x_zero, w_zero)
    if acc is None:
        acc = int_matmul(widen(x, x_zero), widen(w, w_zero))
    return (acc * scale + bias.astype(_F64)).astype(_F32)


def _per_column(node, name, value, columns, dtype=None):
    if value is None or value.size == 1:
        return scalar(node, name, value, dtype)
    if value.shape != (columns,) or (dtype is not None and value.dtype != dtype):
        raise argument_error(node, f"input {name!r} is {value.dtype}{value.shape}; expected a scalar or ({columns},)")
    return value


def _present(node, k, v, past):
    """The stacked (2, B, N, P + S, H) keys and values: past's followed by this step's."""
    new = np.stack((k, v))
    if past is None:
        return new
    if past.ndim != 5 or past.shape[0] != 2 or past.shape[1:3] != k.shape[:2] or past.shape[4] != k.shape[3]:
        raise argument_error(node, f"past has shape {past.shape}; expected (2, {k.shape[0]}, {k.shape[1]}, "
                             f"past_sequence_length, {k.shape[3]})")
    return np.concatenate((past.astype(_F32), new), axis=3)


def _scores_bias(node, attrs, mask, batch, seq, total, past):
    """The additive (B, 1, S|1, T) bias of the attention scores, or None: com.microsoft Attention's key
    padding conventions with mask_filter_value, then the dtype's lowest value after each query's position
    when unidirectional (as onnxruntime's shared attention code fills both)."""
    bias = None
    if mask is not None:
        if mask.dtype != np.int32:
            raise argument_error(node, f"mask_index is {mask.dtype}; expected int32")
        bias = key_mask_bias(mask, batch, seq, total, past, _F32.type(attrs.filter))
        if bias is None:
            raise argument_error(node, f"mask_index has shape {mask.shape}; expected ({batch},), ({2 * batch},), "
                                 f"({batch}, {total}), ({batch}, {seq}, {total}) or ({batch}, 1, M, M)")
    if attrs.causal:
        bias = np.where(causal_hidden(seq, total, past), np.finfo(_F32).min, _F32.type(0) if bias is None else bias)
    return bias


@register("QAttention", domain=CONTRIB_DOMAIN, since=1)
def qattention(node, shapes, opset):
    attrs = _AttentionAttrs(node)
    want_present = wants_output(node, 1)
    product = IntegerProduct()

    def kernel(x, w, bias, x_scale, w_scale, mask_index=None, x_zero_point=None, w_zero_point=None, past=None):
        qkv = _projection(node, product, attrs.heads, x, w, bias, x_scale, w_scale, x_zero_point, w_zero_point)
        hidden = qkv.shape[2] // 3
        q, k, v = (split_heads(qkv[..., i * hidden:(i + 1) * hidden], attrs.heads) for i in range(3))
        present = _present(node, k, v, past)
        keys, values = present[0], present[1]
        batch, seq, total = x.shape[0], x.shape[1], keys.shape[2]
        head_size = hidden // attrs.heads
        # 0 (or absent) means the default, 1 / sqrt(head size), as for com.microsoft Attention.
        scale = 1 / math.sqrt(head_size) if not attrs.scale else float(attrs.scale)
        scores_bias = _scores_bias(node, attrs, mask_index, batch, seq, total, total - seq)
        y, _ = attend(q, keys, values, scale, scores_bias)
        outputs = (merge_heads(y).astype(bias.dtype),)
        if want_present:
            outputs += (present.astype(bias.dtype),)
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
    # The number of words: the positions whose mask is 1 (onnxruntime counts those, as EmbedLayerNormalization
    # does, not every non-zero entry).
    return (mask == 1).sum(axis=1, dtype=np.int32)


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
