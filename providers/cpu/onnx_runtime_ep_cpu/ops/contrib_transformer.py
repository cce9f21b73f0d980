"""onnxruntime's contrib attention operators (domain com.microsoft), as docs/ContribOperators.md defines them:
Attention (packed Q/K/V projection), MultiHeadAttention, GroupQueryAttention and RotaryEmbedding.

Half-precision inputs compute in float32 and are rounded once, at the outputs. Key-padding masks follow the
contrib conventions: a masked key's score gets ``mask_filter_value`` added (it stays finite), a unidirectional
frontier hides later keys outright. GroupQueryAttention keeps one present buffer per batch entry, its new
keys written at that entry's past length (seqlens_k + 1 - sequence_length, or 0 for the first prompt).
"""

from __future__ import annotations

import math
import types

import numpy as np

from ..algorithms import tiled_attention
from ..algorithms.contrib_attention import (
    attend,
    causal_hidden,
    hide,
    key_mask_bias,
    merge_heads,
    positions_from,
    rotate_,
    split_heads,
)
from ..algorithms.kept_call import KeptCall
from ..algorithms.precision import compute_dtype
from ..algorithms.product_attention import ProductAttention
from ..compiled.deferred import numpy_first, tried
from ..contrib_lowering import PACKED_LOOP_MACS, packed_macs_factor
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ..tuning import KNOBS
from ._common import CONTRIB_DOMAIN, argument_error, graph_error, has_input, wants_output

_MASK_SHAPES = "(B), (2 * B), (B, T), (B, S, T) or (B, 1, M, M) with M >= T"


# -- shared --------------------------------------------------------------------------------------


def _positive(node, attr: str) -> int:
    value = node.attr(attr)
    if value is None or int(value) < 1:
        raise graph_error(node, attr, f"is {value!r}; it is required and must be positive")
    return int(value)


def _scale(node, head_size: int) -> float:
    scale = node.attr("scale")
    return 1 / math.sqrt(head_size) if scale is None or float(scale) == 0 else float(scale)


def _declared(graph, node, index: int, default: np.dtype) -> np.dtype:
    """The dtype the graph declares for output ``index`` (the QK outputs' type is the model's choice)."""
    info = graph.type_of(node.outputs[index]) if graph is not None and node.outputs[index] else None
    return np.dtype(info.dtype.numpy) if info is not None and info.dtype is not None else np.dtype(default)


def _scalar_int(node, name: str, value) -> int:
    if value is None or np.size(value) != 1:
        raise argument_error(node, f"{name} must be one integer, got shape {np.shape(value)}")
    return int(np.asarray(value).reshape(-1)[0])


def _padding_bias(node, mask, batch: int, q_len: int, total: int, past: int, dtype):
    """The additive bias of a key padding mask (None without one), mask_filter_value where masked."""
    if mask is None:
        return None
    fill = dtype.type(node.attr("mask_filter_value", -10000.0))
    bias = key_mask_bias(np.asarray(mask), batch, q_len, total, past, fill)
    if bias is None:
        raise argument_error(node, f"mask of shape {mask.shape} fits no mask convention for batch {batch}, "
                             f"sequence {q_len} and total sequence {total}; expected {_MASK_SHAPES}")
    return bias


def _with_attention_bias(node, bias, attention_bias, shape: tuple, dtype):
    """``bias`` plus attention_bias, which must broadcast to (B, N, S, T) ``shape``."""
    if attention_bias is None:
        return bias
    if attention_bias.ndim != 4 or any(d not in (1, full) for d, full in zip(attention_bias.shape, shape)):
        raise argument_error(node, f"attention_bias has shape {attention_bias.shape}; expected one broadcasting "
                             f"to (batch, heads, sequence, total sequence) {shape}")
    extra = attention_bias.astype(dtype, copy=False)
    return extra if bias is None else bias + extra


def _unidirectional(node, bias, q_len: int, total: int, past: int, dtype):
    """Keys after each query replaced by the dtype's lowest value (the contrib kernels' causal fill)."""
    if not node.attr("unidirectional", 0):
        return bias
    hidden = causal_hidden(q_len, total, past)
    return np.where(hidden, np.finfo(dtype).min.astype(dtype), dtype.type(0) if bias is None else bias)


# -- Attention -----------------------------------------------------------------------------------


class _Attention:
    """com.microsoft Attention: one input projected to Q, K and V by merged weights, a past state stacked
    (2, B, N, P, H), optionally in a buffer shared with the present state."""

    def __init__(self, node):
        self.node = node
        self.heads = _positive(node, "num_heads")
        self.share = bool(node.attr("past_present_share_buffer", 0))
        if int(node.attr("do_rotary", 0)):
            raise graph_error(node, "do_rotary", "is 1; Attention has no cos/sin cache input to rotate with: "
                              "fuse the model as MultiHeadAttention + RotaryEmbedding (expected 0)")

    def sizes(self, columns: int) -> tuple[int, int, int]:
        node = self.node
        sizes = node.attr("qkv_hidden_sizes")
        sizes = (columns // 3,) * 3 if sizes is None else tuple(int(s) for s in sizes)
        if len(sizes) != 3 or sum(sizes) != columns or sizes[0] != sizes[1] or any(
                s <= 0 or s % self.heads for s in sizes):
            raise argument_error(node, f"weights have {columns} columns; expected Q, K, V hidden sizes {sizes} "
                                 f"summing to them, Q and K equal, each divisible by num_heads={self.heads}")
        return sizes

    def project(self, x, weights, bias, dtype):
        node = self.node
        if x.ndim != 3 or weights.ndim != 2 or weights.shape[0] != x.shape[2]:
            raise argument_error(node, f"input {x.shape} and weights {weights.shape} do not fit; expected "
                                 f"(batch, sequence, input hidden) and (input hidden, Q + K + V hidden)")
        sizes = self.sizes(weights.shape[1])
        qkv = np.matmul(x.astype(dtype, copy=False), weights.astype(dtype, copy=False))
        if bias is not None:
            if bias.shape != (weights.shape[1],):
                raise argument_error(node, f"bias has shape {bias.shape}; expected ({weights.shape[1]},)")
            qkv += bias.astype(dtype, copy=False)
        ends = np.cumsum(sizes)
        return [split_heads(qkv[..., end - size:end], self.heads) for size, end in zip(sizes, ends)]

    def cached(self, k, v, past, past_length, dtype):
        """(keys, values, present, past length): the keys and values attended and the present state."""
        node = self.node
        if past is None:
            return k, v, (np.stack((k, v)) if wants_output(node, 1) else None), 0
        if past.ndim != 5 or past.shape[0] != 2 or past.shape[1:3] != k.shape[:2] or past.shape[4] != k.shape[3] \
                or k.shape[3] != v.shape[3]:
            raise argument_error(node, f"past has shape {past.shape}; expected (2, {k.shape[0]}, {k.shape[1]}, "
                                 f"past sequence, {k.shape[3]}) with Q, K and V of one hidden size")
        new = np.stack((k, v))
        if not self.share:
            present = np.concatenate((past.astype(dtype, copy=False), new), axis=3)
            return present[0], present[1], present, past.shape[3]
        start = _scalar_int(node, "past_sequence_length (needed with past_present_share_buffer)", past_length)
        end = start + k.shape[2]
        if start < 0 or end > past.shape[3]:
            raise argument_error(node, f"past_sequence_length {start} plus {k.shape[2]} new tokens exceeds the "
                                 f"shared buffer's {past.shape[3]} positions")
        present = past.astype(dtype)  # the buffer, with this step's keys and values written at its end
        present[:, :, :, start:end] = new
        return present[0, :, :, :end], present[1, :, :, :end], present, start

    def __call__(self, x, weights, bias=None, mask_index=None, past=None, attention_bias=None,
                 past_sequence_length=None):
        node, dtype = self.node, compute_dtype(x.dtype)
        q, k, v = self.project(x, weights, bias, dtype)
        keys, values, present, past_len = self.cached(k, v, past, past_sequence_length, dtype)
        batch, heads, q_len, total = q.shape[0], self.heads, q.shape[2], keys.shape[2]
        scores_bias = _padding_bias(node, mask_index, batch, q_len, total, past_len, dtype)
        scores_bias = _unidirectional(node, scores_bias, q_len, total, past_len, dtype)
        scores_bias = _with_attention_bias(node, scores_bias, attention_bias, (batch, heads, q_len, total), dtype)
        y, _ = attend(q, keys, values, _scale(node, q.shape[3]), scores_bias)
        outputs = [merge_heads(y).astype(x.dtype, copy=False)]
        if wants_output(node, 1):
            outputs.append(present.astype(x.dtype, copy=False))
        return tuple(outputs)


@register("Attention", domain=CONTRIB_DOMAIN, since=1)
def attention(node, shapes, opset):
    return _Attention(node)


@register("ContribAttentionMask", domain=FUSED_DOMAIN, since=1)
def contrib_attention_mask(node, shapes, opset):
    """The additive float32 bias (B, 1, S|1, T) of a contrib attention's key-padding mask for the queries of its
    input (B, S, hidden) and the keys of ``keys`` (B, T, hidden; the input itself when omitted): what
    contrib_lowering.py feeds the ONNX Attention it runs the node as."""
    fill = np.float32(node.attr("mask_filter_value", -10000.0))

    def kernel(mask, x, keys=None):
        keys = x if keys is None else keys
        if x.ndim != 3 or keys.ndim != 3:
            raise argument_error(node, f"queries {x.shape} and keys {keys.shape}: expected (batch, sequence, "
                                 f"hidden) each")
        bias = key_mask_bias(mask, x.shape[0], x.shape[1], keys.shape[1], 0, fill)
        if bias is None:  # (the general path words the error)
            return (_padding_bias(node, mask, x.shape[0], x.shape[1], keys.shape[1], 0, np.dtype(np.float32)),)
        return (bias,)

    return kernel


_F32 = np.dtype(np.float32)
_NO_COUNTS, _NO_MASK, _NO_BIAS = np.empty(0, np.int32), np.empty((0, 1, 0, 0), np.float32), \
    np.empty((0, 0, 0), np.float32)


def _packed_weights(weights, bias, heads: int) -> tuple | None:
    """(the bias as a (3, N, D) view or _NO_BIAS, head size D) where ContribPackedAttention's compiled path takes
    this float32 packed weight and bias; None where it does not."""
    if weights.dtype != _F32 or weights.ndim != 2 or weights.shape[1] % (3 * heads) or not weights.shape[1] \
            or (bias is not None and (bias.dtype != _F32 or bias.shape != weights.shape[1:]
                                      or not bias.flags.c_contiguous)):
        return None
    size = weights.shape[1] // (3 * heads)
    return (_NO_BIAS if bias is None else bias.reshape(3, heads, size)), size


def _packed_masks(mask_index, batch: int, steps: int, fill) -> tuple | None:
    """(counts, mask) as compiled/packed_attention.py reads a contrib mask index: a (B,) int32 count of valid
    keys as is, any other convention as its additive bias; None for a shape of no convention."""
    if mask_index is None:
        return _NO_COUNTS, _NO_MASK
    if mask_index.shape == (batch,) and mask_index.dtype == np.int32:
        return mask_index, _NO_MASK
    mask = key_mask_bias(np.asarray(mask_index), batch, steps, steps, 0, fill)
    return None if mask is None else (_NO_COUNTS, np.ascontiguousarray(mask, np.float32))


class _PackedAttention:
    """com.microsoft Attention without a past (contrib_lowering.py's rewrite of one whose Q, K and V sizes are
    equal): one product by the packed weight, then compiled/packed_attention.py over it in place, the mask
    index read there; longer sequences through the ONNX Attention kernel. Other dtypes, layouts and masks, and
    every error, go through the contrib kernel."""

    def __init__(self, node):
        self.node, self.general = node, _Attention(node)
        self.heads = self.general.heads
        self.fill = np.float32(node.attr("mask_filter_value", -10000.0))
        self.causal = bool(node.attr("unidirectional", 0))
        self.macs_factor = packed_macs_factor(self.causal)  # (times the few_query_macs knob: longer goes long)
        # compiled loops, imported at the first compiled call
        self.loop = self.lanes = self.product = None
        self.work: dict[tuple, int] = {}  # per (B, S, head size): the floats the 16-lane path's scratch holds
        self.tried = False  # a compiled call after deferral ran whole (deferred.tried)
        self.longer: dict[tuple, object] = {}  # per (B, S, hidden): the ONNX Attention kernel of longer sequences
        self.scales: dict[int, np.float32] = {}  # per head size (the attributes read once)
        self.seen: tuple = (None, None, None)  # (weights, bias, _packed_weights' answer) of the last call
        self.kept = KeptCall()  # run(x, mask_index): the last compiled call with a count or no mask, once one ran
        # after deferral

    def __call__(self, x, weights, bias=None, mask_index=None):
        kept = self.kept.match((weights, bias), (x, mask_index))
        if kept is not None:  # a repeat of the last call: its compiled call straight away
            y = kept(x, mask_index)
            if y is not None:
                return (y,)
        seen = self.seen  # the weights and bias of the last call (initializers: the same arrays every run)
        prepared = seen[2] if seen[0] is weights and seen[1] is bias else self.prepare(weights, bias)
        if prepared is None or x.dtype != _F32 or x.ndim != 3 or not x.size or x.shape[2] != weights.shape[0] \
                or (mask_index is not None and not mask_index.ndim) or numpy_first():
            return self.general(x, weights, bias, mask_index)
        add, size = prepared
        batch, steps, depth = x.shape
        masks = _packed_masks(mask_index, batch, steps, self.fill)
        if masks is None:  # (the contrib kernel words the error)
            return self.general(x, weights, bias, mask_index)
        counts, mask = masks
        factor = self.macs_factor if steps >= tiled_attention.LANES_ROWS else PACKED_LOOP_MACS
        short = self.heads * steps * steps * size <= factor * KNOBS.few_query_macs
        if short and self.takes_product(x, weights, bias, steps):  # (the product and the 16-lane loop in one call)
            keep = (self.kept, mask_index) if self.tried and mask is _NO_MASK else None
            y = self.product(x, weights, bias, counts, mask, self.scale(size), keep) if self.tried else \
                tried(self, "tried", self.product, x, weights, bias, counts, mask, self.scale(size))
            return self.general(x, weights, bias, mask_index) if y is None else (y,)
        qkv = np.matmul(np.ascontiguousarray(x).reshape(batch * steps, depth), weights)
        if not short:
            if bias is not None:
                qkv += bias
            if counts.size:
                mask = key_mask_bias(counts, batch, steps, steps, 0, self.fill)
            return (self.long_attention(qkv.reshape(batch, steps, -1), mask, size),)
        if self.tried and mask is _NO_MASK:  # (a count or no mask: the same arrays' kinds repeat it)
            y = self.attend(qkv, add, counts, mask, batch, steps, size, (x, weights, bias, mask_index))
        else:
            y = self.attend(qkv, add, counts, mask, batch, steps, size) if self.tried else \
                tried(self, "tried", self.attend, qkv, add, counts, mask, batch, steps, size)
        return self.general(x, weights, bias, mask_index) if y is None else (y,)

    def takes_product(self, x, weights, bias, steps: int) -> bool:
        """Whether a short sequence's call runs algorithms/product_attention.py's one call: the 16-lane loop taking
        the sequence (AVX-512, no causal frontier) and ProductAttention.takes."""
        if self.loop is None:
            self.import_loops()
        return self.product is not None and steps >= tiled_attention.LANES_ROWS and self.product.takes(x, weights,
                                                                                                      bias)

    def import_loops(self) -> None:
        from ..compiled import packed_attention

        self.loop = packed_attention.packed_self_attention_
        loops = tiled_attention.FEW_ROWS if tiled_attention.FEW_ROWS[1] is not None else \
            tiled_attention.few_rows_loops()
        if loops[0] is not None and not self.causal:  # (None off AVX-512)
            self.lanes = packed_attention.packed_in_lanes_
            self.product = ProductAttention(self.heads, self.fill)

    def prepare(self, weights, bias) -> tuple | None:
        """_packed_weights' answer, remembered for these arrays."""
        prepared = _packed_weights(weights, bias, self.heads)
        self.seen = (weights, bias, prepared)
        return prepared

    def attend(self, qkv, add, counts, mask, batch: int, steps: int, size: int, inputs: tuple = ()):
        """Y from the compiled loops over the packed product (B * S, 3 * N * D) and its bias ``add`` (3, N, D):
        attention_lanes.py's 16-lane loop over contiguous Q, K, V (the bias added as they are written) where it
        takes the sequence, else packed_attention.py's loop in place; None where a row has no finite score. With
        the node's ``inputs``, a call that ran whole is kept for ``repeat``."""
        heads = self.heads
        if self.loop is None:
            self.import_loops()
        packed = qkv.reshape(batch, steps, 3, heads, size)
        y = np.empty((batch, steps, heads * size), np.float32)
        if self.lanes is not None and steps >= tiled_attention.LANES_ROWS:
            work = self.work.get((batch, steps, size))
            if work is None:
                from ..compiled.attention_lanes import scratch_size

                work = self.work[(batch, steps, size)] = \
                    (3 * heads * size + 1) * batch * steps + scratch_size(size, steps)
            loop, arguments = self.lanes, (packed, add, counts, mask, self.fill, self.scale(size),
                                           y.reshape(batch, steps, heads, size), np.empty(work, np.float32))
        else:
            work, loop, arguments = 0, self.loop, (packed, add, counts, mask, self.scale(size), self.fill,
                                                   self.causal, y.reshape(batch, steps, heads, size))
        if not loop(*arguments):
            return None
        if inputs:
            x, weights, bias, mask_index = inputs
            repeat = (loop, work, (batch * steps, x.shape[2]), packed.shape, add, arguments[4:6], y.shape,
                      (batch, steps, heads, size))
            self.kept.keep((weights, bias), (x, mask_index),
                           lambda x, mask_index: self.repeat(x, weights, mask_index, *repeat))
        return y

    def repeat(self, x, weights, mask_index, loop, work: int, rows: tuple, packed: tuple, add, between: tuple,
               shape: tuple, heads_shape: tuple):
        """Y for a call repeating the kept one (KeptCall: the same weight and bias, x and the mask index of the
        same kinds) through the kept arguments; None where a row has no finite score."""
        qkv = np.matmul(x.reshape(rows), weights).reshape(packed)
        y = np.empty(shape, np.float32)
        counts = _NO_COUNTS if mask_index is None else mask_index
        if work:
            done = loop(qkv, add, counts, _NO_MASK, *between, y.reshape(heads_shape), np.empty(work, np.float32))
        else:
            done = loop(qkv, add, counts, _NO_MASK, *between, self.causal, y.reshape(heads_shape))
        return y if done else None

    def scale(self, size: int) -> np.float32:
        scale = self.scales.get(size)
        if scale is None:
            scale = self.scales[size] = np.float32(_scale(self.node, size))
        return scale

    def long_attention(self, qkv, mask, size: int):
        """Attention over more keys than the few-row loop takes: the ONNX Attention kernel's tiled and blocked
        paths over contiguous Q, K and V."""
        from onnx_runtime.ir import Node

        from .transformer import attention_23

        hidden = self.heads * size
        parts = [np.ascontiguousarray(qkv[:, :, i * hidden:(i + 1) * hidden]) for i in range(3)]
        key = parts[0].shape
        kernel = self.longer.get(key)
        if kernel is None:
            if len(self.longer) > 64:  # lengths vary without bound: start over
                self.longer.clear()
            attrs = {"q_num_heads": self.heads, "kv_num_heads": self.heads, "is_causal": int(self.causal),
                     "scale": float(_scale(self.node, size))}
            node = Node("Attention", ["q", "k", "v", "mask"], [self.node.outputs[0]], name=self.node.name,
                        attrs=attrs, opset=23)
            kernel = self.longer[key] = attention_23(node, [part.shape for part in parts], 23)
        return kernel(*parts, mask if mask.size else None)[0]


@register("ContribPackedAttention", domain=FUSED_DOMAIN, since=1)
def contrib_packed_attention(node, shapes, opset):
    return _PackedAttention(node)


# -- MultiHeadAttention --------------------------------------------------------------------------


def _unpack(node, heads: int, query, key, value):
    """(q (B, S, Hq), k, v): k/v (B, L, H) hidden layouts, or (B, N, L, D) head layouts (a cross-attention
    cache, which takes no bias). Packed QKV (B, S, N, 3, D) and KV (B, L, N, 2, D) are split here."""
    if query.ndim == 5:
        if key is not None or query.shape[2:4] != (heads, 3):
            raise argument_error(node, f"query {query.shape} is packed Q/K/V only as (B, S, {heads}, 3, head "
                                 f"size), and then key and value must be omitted")
        parts = [query[:, :, :, i].reshape(query.shape[0], query.shape[1], -1) for i in range(3)]
        return parts[0], parts[1], parts[2]
    if query.ndim != 3 or key is None:
        raise argument_error(node, f"query has shape {query.shape}; expected (B, S, hidden) with key and value, "
                             f"or packed (B, S, N, 3, head size)")
    if key.ndim == 5:
        if value is not None or key.shape[2:4] != (heads, 2):
            raise argument_error(node, f"key {key.shape} is packed K/V only as (B, L, {heads}, 2, head size), "
                                 f"and then value must be omitted")
        return query, key[:, :, :, 0].reshape(key.shape[0], key.shape[1], -1), \
            key[:, :, :, 1].reshape(key.shape[0], key.shape[1], -1)
    if value is None or key.ndim not in (3, 4) or value.ndim != key.ndim:
        raise argument_error(node, f"key {key.shape} and value {None if value is None else value.shape} must be "
                             f"both (B, L, hidden) or both (B, N, L, head size)")
    return query, key, value


def _add_bias(node, q, k, v, bias) -> None:
    """The input projection's bias (Q + K + V hidden,) added in place; keys and values given in the head
    layout (a cross-attention cache) take none of it."""
    hidden = q.shape[-1]
    expected = hidden + k.shape[-1] + v.shape[-1] if k.ndim == 3 else None
    if bias.ndim != 1 or bias.shape[0] < hidden or expected not in (None, bias.shape[0]):
        raise argument_error(node, f"bias has shape {bias.shape}; expected (Q + K + V hidden,) = ({expected},)")
    q += bias[:hidden]
    if k.ndim == 3:
        k += bias[hidden:hidden + k.shape[-1]]
        v += bias[hidden + k.shape[-1]:]


class _MultiHeadAttention:
    def __init__(self, node, graph):
        self.node, self.graph = node, graph
        self.heads = _positive(node, "num_heads")

    def project(self, query, key, value, bias, dtype):
        """q, k, v as (B, N, S|L, D) arrays of ``dtype``, the bias added."""
        node, heads = self.node, self.heads
        q, k, v = (np.array(t, dtype=dtype) for t in _unpack(node, heads, query, key, value))
        if bias is not None:
            _add_bias(node, q, k, v, bias.astype(dtype, copy=False))
        for name, t in (("query", q), ("key", k), ("value", v)):
            if t.ndim == 3 and t.shape[-1] % heads:
                raise argument_error(node, f"{name} hidden size {t.shape[-1]} does not split into {heads} heads")
        k, v = (split_heads(t, heads) if t.ndim == 3 else t for t in (k, v))
        return split_heads(q, heads), k, v

    def cached(self, k, v, past_key, past_value, past_length, beams, dtype):
        """(keys, values, present key, present value, past length)."""
        node = self.node
        if past_key is None and past_value is None:
            return k, v, k, v, 0
        if past_key is None or past_value is None or past_key.shape[:2] != k.shape[:2] or \
                past_key.shape[3] != k.shape[3] or past_value.shape[:3] != past_key.shape[:3]:
            raise argument_error(node, f"past_key/past_value must be given together as (B, N, P, head size) "
                                 f"matching the keys {k.shape}")
        if past_length is None:
            present_k = np.concatenate((past_key.astype(dtype, copy=False), k), axis=2)
            present_v = np.concatenate((past_value.astype(dtype, copy=False), v), axis=2)
            return present_k, present_v, present_k, present_v, past_key.shape[2]
        start = _scalar_int(node, "past_sequence_length", past_length)
        end = start + k.shape[2]
        if start < 0 or end > past_key.shape[2]:
            raise argument_error(node, f"past_sequence_length {start} plus {k.shape[2]} new tokens exceeds the "
                                 f"shared buffer's {past_key.shape[2]} positions")
        present_k, present_v = past_key.astype(dtype), past_value.astype(dtype)
        present_k[:, :, start:end], present_v[:, :, start:end] = k, v
        keys, values = present_k[:, :, :end], present_v[:, :, :end]
        if beams is not None:
            keys, values = self.indirect(keys, values, beams, start)
        return keys, values, present_k, present_v, start

    def indirect(self, keys, values, beams, past: int):
        """Beam search's cache: past position t of batch entry b*W + w reads beam beams[b, w, t]'s entry."""
        batch = keys.shape[0]
        if beams.ndim != 3 or beams.shape[0] * beams.shape[1] != batch or beams.shape[2] < past:
            raise argument_error(self.node, f"cache_indirection has shape {beams.shape}; expected (batch, beam "
                                 f"width, max sequence) with batch * beam width = {batch}")
        width = beams.shape[1]
        source = (np.arange(batch) // width * width)[:, None] + beams.reshape(batch, -1)[:, :past].astype(np.int64)
        if past and (source.min() < 0 or source.max() >= batch):
            raise argument_error(self.node, f"cache_indirection holds beam indices outside [0, {width})")
        steps = np.arange(past)
        keys, values = keys.copy(), values.copy()
        keys[:, :, :past] = keys[source, :, steps].transpose(0, 2, 1, 3)
        values[:, :, :past] = values[source, :, steps].transpose(0, 2, 1, 3)
        return keys, values

    def __call__(self, query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
                 past_key=None, past_value=None, past_sequence_length=None, cache_indirection=None):
        node, dtype = self.node, compute_dtype(query.dtype)
        q, k, v = self.project(query, key, value, bias, dtype)
        if cache_indirection is not None and past_sequence_length is None:
            raise argument_error(node, "cache_indirection needs past_sequence_length (a shared past/present buffer)")
        keys, values, present_k, present_v, past = self.cached(k, v, past_key, past_value, past_sequence_length,
                                                               cache_indirection, dtype)
        shape = (q.shape[0], self.heads, q.shape[2], keys.shape[2])
        scores_bias = _padding_bias(node, key_padding_mask, shape[0], shape[2], shape[3], past, dtype)
        scores_bias = _unidirectional(node, scores_bias, shape[2], shape[3], past, dtype)
        scores_bias = _with_attention_bias(node, scores_bias, attention_bias, shape, dtype)
        y, scores = attend(q, keys, values, _scale(node, q.shape[3]), scores_bias, keep=wants_output(node, 3))
        outputs = [merge_heads(y).astype(query.dtype, copy=False), present_k, present_v]
        outputs[1:] = [t.astype(query.dtype, copy=False) for t in outputs[1:]]
        if wants_output(node, 3):
            logits = np.broadcast_to(scores.logits, shape)
            outputs.append(logits.astype(_declared(self.graph, node, 3, query.dtype)))
        return tuple(outputs[:len(node.outputs)])


@register("MultiHeadAttention", domain=CONTRIB_DOMAIN, since=1, needs=("graph",))
def multi_head_attention(node, shapes, opset, graph):
    return _MultiHeadAttention(node, graph)


# -- GroupQueryAttention -------------------------------------------------------------------------

# The inputs past head_sink (by index): a quantized cache's scales and per-head Q/K norms (CUDA/WebGPU only).
_GQA_UNSUPPORTED_INPUTS = {12: "k_scale", 13: "v_scale", 14: "q_norm_weight", 15: "k_norm_weight"}


class _GroupQueryAttention:
    """Grouped-query attention over a per-batch-entry KV cache (seqlens_k), with rotary embedding, a local
    window, a soft cap, a softmax sink (head_sink or smooth_softmax) and the pre/post-softmax QK output."""

    def __init__(self, node, graph):
        self.node, self.graph = node, graph
        self.heads, self.kv_heads = _positive(node, "num_heads"), _positive(node, "kv_num_heads")
        if self.heads % self.kv_heads:
            raise graph_error(node, "num_heads", f"({self.heads}) must be a multiple of kv_num_heads "
                              f"({self.kv_heads})")
        self.window = int(node.attr("local_window_size", -1))
        self.causal = bool(node.attr("causal", 1))
        self.softcap = float(node.attr("softcap", 0.0))
        self.rotary = bool(node.attr("do_rotary", 0))
        self.interleaved = bool(node.attr("rotary_interleaved", 0))
        self.smooth = bool(node.attr("smooth_softmax", 0))
        self.qk_mode = int(node.attr("qk_output", 0))
        self.check_attributes()

    def check_attributes(self):
        node = self.node
        if self.qk_mode not in (0, 1, 2):
            raise graph_error(node, "qk_output", f"is {self.qk_mode}; expected 0 (none), 1 (before softmax) or 2")
        if self.window > 0 and not self.causal:
            raise graph_error(node, "local_window_size", f"is {self.window} with causal=0; expected -1")
        if int(node.attr("sliding_window_cache", 0)):
            raise graph_error(node, "sliding_window_cache", "is 1; only full-length caches are supported here")
        for attr in ("k_quant_type", "v_quant_type"):
            if node.attr(attr, "NONE") not in ("NONE", b"NONE"):
                raise graph_error(node, attr, f"is {node.attr(attr)!r}; a quantized KV cache is not supported "
                                  f"here (expected 'NONE')")
        for index, name in _GQA_UNSUPPORTED_INPUTS.items():
            if has_input(node, index):
                raise argument_error(node, f"input {name!r} is not supported on the CPU provider; omit it")

    def split(self, query, key, value, dtype):
        """q (B, Nq, S, D), k and v (B, Nkv, S, D): fresh arrays of ``dtype``."""
        node, heads, kv_heads = self.node, self.heads, self.kv_heads
        if query.ndim != 3:
            raise argument_error(node, f"query has shape {query.shape}; expected (batch, sequence, hidden)")
        if key is None:  # packed (B, S, (Nq + 2 * Nkv) * D)
            head_size, rest = divmod(query.shape[2], heads + 2 * kv_heads)
            if rest:
                raise argument_error(node, f"packed query hidden size {query.shape[2]} does not split into "
                                     f"{heads} + 2 * {kv_heads} heads")
            ends = (heads * head_size, (heads + kv_heads) * head_size)
            query, key, value = query[..., :ends[0]], query[..., ends[0]:ends[1]], query[..., ends[1]:]
        head_size = query.shape[2] // heads
        if value is None or query.shape[2] % heads or key.shape != value.shape or key.shape[:2] != query.shape[:2] \
                or key.shape[2] != kv_heads * head_size:
            raise argument_error(node, f"query {query.shape}, key and value do not fit {heads} query and {kv_heads} "
                                 f"key/value heads of one head size (or a packed (B, S, (N + 2 * Nkv) * D) query)")
        return [split_heads(np.array(t, dtype=dtype), n) for t, n in ((query, heads), (key, kv_heads),
                                                                      (value, kv_heads))]

    def lengths(self, seqlens_k, total_sequence_length, batch: int, steps: int):
        """(each entry's past length, each entry's total length, total_sequence_length)."""
        node = self.node
        total = _scalar_int(node, "total_sequence_length", total_sequence_length)
        lengths = np.asarray(seqlens_k).reshape(-1).astype(np.int64) + 1
        if lengths.shape != (batch,) or lengths.min(initial=1) < 1 or lengths.max(initial=0) > total:
            raise argument_error(node, f"seqlens_k must hold {batch} lengths minus one, each below "
                                 f"total_sequence_length {total}; got {np.asarray(seqlens_k).tolist()}")
        first = steps == total  # the first prompt: every entry's keys start at 0
        past = np.zeros(batch, np.int64) if first else lengths - steps
        if past.min(initial=0) < 0:
            raise argument_error(node, f"seqlens_k + 1 ({lengths.tolist()}) is shorter than the {steps} new tokens")
        return past, lengths, total

    def rotate(self, q, k, cos_cache, sin_cache, position_ids, past, first: bool, dtype):
        node = self.node
        if cos_cache is None or sin_cache is None:
            raise argument_error(node, "do_rotary=1 needs the cos_cache and sin_cache inputs")
        batch, steps, half = q.shape[0], q.shape[2], cos_cache.shape[-1]
        if cos_cache.ndim != 2 or sin_cache.shape != cos_cache.shape or 2 * half > q.shape[3]:
            raise argument_error(node, f"cos/sin caches of shape {cos_cache.shape} must be (max sequence, rotary "
                                 f"dim / 2) with the rotary dim at most the head size {q.shape[3]}")
        if position_ids is not None:
            positions = positions_from(position_ids, batch, steps, start=first)
        else:
            positions = past[:, None] + np.arange(steps)
        if positions.size and (positions.min() < 0 or positions.max() >= cos_cache.shape[0]):
            raise argument_error(node, f"positions up to {positions.max()} exceed the cos/sin caches' "
                                 f"{cos_cache.shape[0]} rows")
        cos = cos_cache.astype(dtype, copy=False)[positions][:, None]
        sin = sin_cache.astype(dtype, copy=False)[positions][:, None]
        rotate_(q, cos, sin, self.interleaved)
        rotate_(k, cos, sin, self.interleaved)

    def present(self, k, past_cache, past, length: int, dtype):
        """The present buffer (B, Nkv, length, D): the past buffer, with each entry's new keys at its past
        length."""
        node = self.node
        present = np.zeros(k.shape[:2] + (length, k.shape[3]), dtype)
        if past_cache is not None:
            if past_cache.ndim != 4 or past_cache.shape[:2] != k.shape[:2] or past_cache.shape[3] != k.shape[3]:
                raise argument_error(node, f"past key/value has shape {past_cache.shape}; expected "
                                     f"({k.shape[0]}, {k.shape[1]}, past sequence, {k.shape[3]})")
            present[:, :, :past_cache.shape[2]] = past_cache
        steps = k.shape[2]
        if (past + steps).max(initial=0) > length:
            raise argument_error(node, f"past lengths {past.tolist()} plus {steps} new tokens exceed the present "
                                 f"buffer's {length} positions")
        for b, start in enumerate(past.tolist()):
            present[b, :, start:start + steps] = k[b]
        return present

    def hidden(self, past, lengths, steps: int, keys: int) -> np.ndarray:
        """(B, 1, S, T): which keys each query may not see."""
        position = past[:, None, None, None] + np.arange(steps)[:, None]
        key = np.arange(keys)
        if not self.causal:
            return np.broadcast_to(key >= lengths[:, None, None, None], (past.shape[0], 1, steps, keys))
        hidden = key > position
        if self.window > 0:
            hidden |= key <= position - self.window
        return hidden

    def bias(self, attention_bias, shape: tuple, total: int, dtype):
        if attention_bias is None:
            return None
        width = attention_bias.shape[-1] if attention_bias.ndim == 4 else -1
        if width != total or any(d not in (1, full) for d, full in zip(attention_bias.shape, shape[:3])):
            raise argument_error(self.node, f"attention_bias has shape {attention_bias.shape}; expected one "
                                 f"broadcasting to (batch, heads, sequence, total_sequence_length {total})")
        bias = attention_bias.astype(dtype, copy=False)
        if shape[3] > total:  # keys past total_sequence_length (a longer shared buffer) are hidden anyway
            bias = np.pad(bias, [(0, 0)] * 3 + [(0, shape[3] - total)])
        return bias[..., :shape[3]]

    def sink(self, head_sink, dtype):
        if head_sink is not None:
            if head_sink.shape != (self.heads,):
                raise argument_error(self.node, f"head_sink has shape {head_sink.shape}; expected ({self.heads},)")
            return head_sink.astype(dtype)
        return np.zeros(self.heads, dtype) if self.smooth else None

    def __call__(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
                 total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None, attention_bias=None,
                 head_sink=None, *_):
        node, dtype = self.node, compute_dtype(query.dtype)
        q, k, v = self.split(query, key, value, dtype)
        batch, steps = q.shape[0], q.shape[2]
        past, lengths, total = self.lengths(seqlens_k, total_sequence_length, batch, steps)
        if self.rotary:
            self.rotate(q, k, cos_cache, sin_cache, position_ids, past, steps == total, dtype)
        length = max(total, 0 if past_key is None else past_key.shape[2])
        keys = self.present(k, past_key, past, length, dtype)
        values = self.present(v, past_value, past, length, dtype)
        shape = (batch, self.heads, steps, length)
        hidden = self.hidden(past, lengths, steps, length)
        bias = hide(self.bias(attention_bias, shape, total, dtype), hidden, dtype)
        y, scores = attend(q, keys, values, _scale(node, q.shape[3]), bias, self.softcap,
                           self.sink(head_sink, dtype), keep=self.qk_mode > 0 and wants_output(node, 3))
        cache_dtype = query.dtype if past_key is None else past_key.dtype
        outputs = [merge_heads(y).astype(query.dtype, copy=False), keys.astype(cache_dtype, copy=False),
                   values.astype(cache_dtype, copy=False)]
        if wants_output(node, 3):
            outputs.append(self.qk(scores, hidden, shape, query.dtype))
        return tuple(outputs[:len(node.outputs)])

    def qk(self, scores, hidden, shape, default):
        """output_qk: the scores as the softmax saw them (0 where hidden), or its probabilities."""
        dtype = _declared(self.graph, self.node, 3, default)
        if scores is None:
            return np.zeros(shape, dtype)
        chosen = np.where(hidden, 0, scores.logits) if self.qk_mode == 1 else scores.probs
        return np.broadcast_to(chosen, shape).astype(dtype)


@register("GroupQueryAttention", domain=CONTRIB_DOMAIN, since=1, needs=("graph",))
def group_query_attention(node, shapes, opset, graph):
    return _GroupQueryAttention(node, graph)


# -- RotaryEmbedding -----------------------------------------------------------------------------


def _rotary_layout(node, x, heads: int, half: int, rotary_dim: int):
    """x as (B, S, N, D) or (B, N, S, D), the index expanding (B, S, half) cos/sin over its heads, and the
    head size."""
    if x.ndim == 4:
        return x, (slice(None), None), x.shape[3]
    if x.ndim != 3:
        raise argument_error(node, f"input has rank {x.ndim}; expected 3 (B, S, hidden) or 4 (B, N, S, head size)")
    if rotary_dim and not heads:
        raise graph_error(node, "num_heads", "is required with rotary_embedding_dim for a 3-D input")
    head_size = x.shape[2] // heads if heads else 2 * half
    if not head_size or x.shape[2] % head_size:
        raise argument_error(node, f"hidden size {x.shape[2]} does not split into heads of size {head_size}")
    return x.reshape(x.shape[0], x.shape[1], -1, head_size), (slice(None), slice(None), None), head_size


_NO_POSITIONS = np.empty((0, 0), np.int64)


def _compiled_rotary(x, view, position_ids, cos_cache, sin_cache, interleaved: bool) -> np.ndarray | None:
    """RotaryEmbedding's output from compiled/rotary.py for float32 inputs and caches (x's (B, S, N, D) or
    (B, N, S, D) ``view``), or None where the numpy path decides: other dtypes, numba loading, or a position
    outside the caches (which it reports)."""
    if x.dtype != _F32 or cos_cache.dtype != _F32 or sin_cache.dtype != _F32 or position_ids.dtype.kind not in "iu" \
            or not x.size or numpy_first():
        return None
    from ..compiled.rotary import rotary_embedding_

    out = np.empty(view.shape, np.float32)
    transposed = x.ndim == 4  # (B, N, S, D): the loop walks (B, S, N, D)
    source, target = (view.transpose(0, 2, 1, 3), out.transpose(0, 2, 1, 3)) if transposed else (view, out)
    ids = np.asarray(position_ids)
    start = int(ids.reshape(-1)[0]) if ids.ndim <= 1 else 0
    positions = _NO_POSITIONS if ids.ndim <= 1 else ids
    if rotary_embedding_(source, positions, start, np.ascontiguousarray(cos_cache), np.ascontiguousarray(sin_cache),
                         interleaved, target) >= 0:
        return None
    return out.reshape(x.shape)


@register("RotaryEmbedding", domain=CONTRIB_DOMAIN, since=1)
def rotary_embedding(node, shapes, opset):
    """com.microsoft RotaryEmbedding(input, position_ids, cos_cache, sin_cache): position_ids (1) is a start
    position for every batch entry, (B, S) one position per token. ``scale`` is not applied (onnxruntime's
    kernels ignore it as well)."""
    interleaved = bool(node.attr("interleaved", 0))
    heads = int(node.attr("num_heads", 0))
    rotary_dim = int(node.attr("rotary_embedding_dim", 0))
    if int(node.attr("is_packed_batching", 0)):
        raise graph_error(node, "is_packed_batching", "is 1; ragged (packed) batches are not supported here")
    ran = types.SimpleNamespace(compiled=False)  # (the compiled call in a Trial until one ran whole: tried)

    def kernel(x, position_ids, cos_cache, sin_cache):
        half = cos_cache.shape[-1] if cos_cache.ndim == 2 else 0
        view, expand, head_size = _rotary_layout(node, x, heads, half, rotary_dim)
        dim = rotary_dim or head_size
        if cos_cache.ndim != 2 or sin_cache.shape != cos_cache.shape or dim % 2 or 2 * half != dim \
                or dim > head_size:
            raise argument_error(node, f"cos/sin caches of shape {cos_cache.shape} must be (max sequence, "
                                 f"{dim // 2}): half the rotary dim {dim}, at most the head size {head_size}")
        batch, steps = x.shape[0], x.shape[1] if x.ndim == 3 else x.shape[2]
        if position_ids.ndim > 1 and position_ids.shape != (batch, steps):
            raise argument_error(node, f"position_ids has shape {position_ids.shape}; expected (1) or "
                                 f"({batch}, {steps})")
        if position_ids.ndim <= 1 and position_ids.size != 1:
            raise argument_error(node, f"position_ids has shape {position_ids.shape}; expected (1) (a start "
                                 f"position) or ({batch}, {steps})")
        arguments = (x, view, position_ids, cos_cache, sin_cache, interleaved)
        rotated = _compiled_rotary(*arguments) if ran.compiled else tried(ran, "compiled", _compiled_rotary, *arguments)
        if rotated is not None:
            return (rotated,)
        positions = positions_from(position_ids, batch, steps, start=position_ids.ndim <= 1)
        if positions.size and (positions.min() < 0 or positions.max() >= cos_cache.shape[0]):
            raise argument_error(node, f"positions up to {positions.max()} are outside the cos/sin caches' "
                                 f"{cos_cache.shape[0]} rows")
        dtype = compute_dtype(x.dtype)
        out = np.array(view, dtype=dtype)  # a copy: the features past the rotary dim pass through
        cos = cos_cache.astype(dtype, copy=False)[positions][expand]
        sin = sin_cache.astype(dtype, copy=False)[positions][expand]
        rotate_(out, cos, sin, interleaved)
        return (out.reshape(x.shape).astype(x.dtype, copy=False),)

    return kernel
