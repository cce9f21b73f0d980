"""Transformer kernels: Attention (FlexAttention: flex_attention.py; LinearAttention and CausalConvWithState:
linear_attention.py; RMSNormalization, RotaryEmbedding and SwiGLU: transformer_blocks.py).

The spec defines these as functions; here they are direct numpy kernels. Half-precision inputs
(float16, bfloat16) compute in float32; Attention rounds to the input type where its function body's
ops do (the scaled Q and K, the scores, the biased scores, the probabilities), the others once, at
the end. Grouped-query attention never materializes repeated key/value heads: the
``q_num_heads / kv_num_heads`` query heads that share one KV head are folded into the rows of a
single batched matmul against that head.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime import budget, kv_append
from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidGraphError

from ..algorithms.attention_keys import length_free_key as _length_free_key
from ..algorithms.bound_loop import EntryOnce
from ..algorithms.precision import FLOAT32, compute_dtype
from ..algorithms.products import gemv_host
from ..algorithms.tiled_attention import TiledLayout, few_by_head, few_in_place, few_macs, lanes_take, rows_readable
from ..compiled import deferred
from ..compiled.deferred import numpy_first  # (the tiles import numba: not while it loads)
from ..registry import register
from ..threads import helper_count, kernel_threads
from ..tuning import KNOBS
from ._common import argument_error, graph_error, has_input

_SOFTMAX_PRECISIONS = (DataType.FLOAT, DataType.FLOAT16, DataType.DOUBLE, DataType.BFLOAT16)


# -- shared helpers ------------------------------------------------------------------------------


def _has_output(node, index: int) -> bool:
    return len(node.outputs) > index and bool(node.outputs[index])


def softmax_dtype_of(node, default: np.dtype) -> np.dtype:
    """The dtype softmax runs in: ``softmax_precision`` when set, else ``default``."""
    precision = node.attr("softmax_precision")
    if precision is None:
        return np.dtype(default)
    if int(precision) not in _SOFTMAX_PRECISIONS:
        raise graph_error(node, "softmax_precision", f"is {precision}; expected 1, 10, 11 or 16")
    return np.dtype(DataType(int(precision)).numpy)


def _rounding_to(narrow: np.dtype, wide: np.dtype):
    """For a half-precision input computed in float32, the function rounding a float32 result to the input
    type and back (None otherwise): a kernel that stands for a function body rounds where its ops do."""
    if narrow == wide:
        return None
    return lambda x: x.astype(narrow).astype(wide)



def gqa_heads(node, q_heads: int, kv_heads: int) -> None:
    if kv_heads <= 0 or q_heads % kv_heads:
        raise argument_error(
            node, f"{q_heads} query heads do not split evenly over {kv_heads} key/value heads; "
            f"q_num_heads must be a positive multiple of kv_num_heads"
        )


# -- Attention -----------------------------------------------------------------------------------


class _AttentionGeometry:
    """Head layout and sequence lengths of one Attention node for one set of input shapes."""

    def __init__(self, node, shapes):
        q, k, v = shapes[0], shapes[1], shapes[2]
        self.rank = len(q)
        past = shapes[4] if len(shapes) > 4 else None
        if len(k) != self.rank or len(v) != self.rank or (past is not None and len(past) != 4):
            raise argument_error(node, f"Q, K and V have ranks {len(q)}, {len(k)} and {len(v)}"
                                 f"{f' and past_key {len(past)}' if past is not None else ''}; expected Q, K and V of "
                                 "one rank (3 or 4) and a 4-D past_key")
        if self.rank == 3:
            q_heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
            if q_heads is None or kv_heads is None:
                raise InvalidGraphError(
                    f"node {node.name!r} (Attention): 3-D Q/K/V need the attributes 'q_num_heads' and "
                    f"'kv_num_heads' to split the hidden dimension into heads"
                )
            self.q_heads, self.kv_heads = int(q_heads), int(kv_heads)
            for name, hidden, heads in (("Q", q[2], self.q_heads), ("K", k[2], self.kv_heads),
                                        ("V", v[2], self.kv_heads)):
                if heads <= 0 or hidden % heads:
                    raise argument_error(node, f"{name} hidden size {hidden} does not split into {heads} heads")
            self.q_len, self.kv_len = q[1], k[1]
            self.head_size, self.v_head_size = q[2] // self.q_heads, v[2] // self.kv_heads
        elif self.rank == 4:
            _, self.q_heads, self.q_len, self.head_size = q
            self.kv_heads, self.kv_len, self.v_head_size = k[1], k[2], v[3]
        else:
            raise argument_error(node, f"Q has rank {self.rank}; expected 3 or 4")
        gqa_heads(node, self.q_heads, self.kv_heads)
        self.past_len = past[2] if past is not None else 0
        self.total_len = self.past_len + self.kv_len

    def to_heads(self, x: np.ndarray, heads: int) -> np.ndarray:
        """(B, S, heads * D) -> (B, heads, S, D); 4-D inputs are already laid out so."""
        if self.rank == 4:
            return x
        return x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(0, 2, 1, 3)

    def from_heads(self, y: np.ndarray) -> np.ndarray:
        if self.rank == 4:
            return y
        return y.transpose(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], -1)


def _visible_keys(q_len: int, total_len: int, offset, causal: bool, left: int, right: int,
                  nonpad: np.ndarray | None) -> np.ndarray | None:
    """Which keys each query may attend, from the causal frontier, the sliding window and the padding.

    Query ``i`` sits at absolute position ``p = i + offset``. ``offset`` is an int, or per batch an array
    (B,), which makes the result (B, 1, q_len, total_len) instead of (q_len, total_len). None when
    every key is visible.
    """
    if not causal and left < 0 and right < 0 and nonpad is None:
        return None
    # The lengths may come from declared shapes (the kernel is built before the run): within the budget first.
    budget.check(max(q_len, 1) * total_len * max(np.size(offset), 1), 8, "the attention's key visibility")
    keys = np.arange(total_len)
    position = np.arange(q_len)[:, None] + np.reshape(offset, (-1, 1, 1) if np.ndim(offset) else ())
    distance = position - keys  # how far key j lies behind the query
    visible = np.ones(distance.shape, dtype=bool)
    if causal:
        visible &= distance >= 0
    if left >= 0:
        visible &= distance <= left
    if right >= 0:
        visible &= distance >= -right
    if nonpad is not None:
        visible &= keys < np.reshape(nonpad, (-1, 1, 1))
    return visible[:, None] if visible.ndim == 3 else visible


# Query rows per block of the compiled attention when a mask hides trailing keys from some rows
# (32 beat 16 and 64 on a causal prefill; afcca01).
_ROW_BLOCK = 32


class _Attention:
    """Attention for one node and one set of input shapes; the attention bias is rebuilt per call only
    when it depends on input values (attn_mask, nonpad_kv_seqlen). Without a causal or window frontier
    nothing built here depends on the keys' length, which is read per call: the kernel then gives the
    session ``shape_key`` and serves every step of a decode loop."""

    def __init__(self, node, shapes, opset):
        self.node = node
        self.geo = geo = _AttentionGeometry(node, shapes)
        if has_input(node, 4) != has_input(node, 5):
            raise InvalidGraphError(
                f"node {node.name!r} (Attention): 'past_key' and 'past_value' must be given together"
            )
        self.has_nonpad = has_input(node, 6)
        if self.has_nonpad and has_input(node, 4):
            raise InvalidGraphError(
                f"node {node.name!r} (Attention): 'nonpad_kv_seqlen' marks an external KV cache and cannot be "
                f"combined with 'past_key'/'past_value'"
            )
        scale = node.attr("scale")
        if scale is None and geo.head_size == 0:
            raise argument_error(node, "Q has a head size of 0, so the default scale 1/sqrt(head_size) is undefined; "
                                       "give Q a non-empty head dimension or the node a 'scale' attribute")
        self.scale = 1 / math.sqrt(geo.head_size) if scale is None else float(scale)
        self.softcap = float(node.attr("softcap", 0.0))
        self.mode = int(node.attr("qk_matmul_output_mode", 0))
        if self.mode not in (0, 1, 2, 3):
            raise graph_error(node, "qk_matmul_output_mode", f"is {self.mode}; expected 0, 1, 2 or 3")
        self.wants_qk = _has_output(node, 3)
        self.causal = bool(node.attr("is_causal", 0))
        # Sliding windows arrived in opset 25; earlier opsets have no such attributes.
        self.left = int(node.attr("left_window_size", -1)) if opset >= 25 else -1
        self.right = int(node.attr("right_window_size", -1)) if opset >= 25 else -1
        for attr, value in (("left_window_size", self.left), ("right_window_size", self.right)):
            if value < -1:
                raise graph_error(node, attr, f"is {value}; expected -1 (unbounded) or a size >= 0")
        softmax_dtype_of(node, np.float32)  # validates the attribute
        # Without nonpad_kv_seqlen the causal/window frontier depends on shapes only: build it once.
        self.static_visible = None if self.has_nonpad else _visible_keys(
            geo.q_len, geo.total_len, geo.past_len, self.causal, self.left, self.right, None)
        self.shape_key = _length_free_key if self.static_visible is None and not self.has_nonpad else None
        # Plain scaled-dot-product attention (what the optimizer's attention fusion produces) runs
        # in place; float32 inputs and a float32 or no mask are checked per call.
        self.plain = (self.softcap <= 0 and not self.wants_qk and not self.has_nonpad and not has_input(node, 4)
                      and self.static_visible is None and softmax_dtype_of(node, np.float32) == np.float32)
        # The compiled path takes plain attention and also a causal/window frontier without a mask
        # (as a precomputed additive bias); float32 operands are checked per call.
        frontier_only = self.static_visible is not None and self.static_visible.ndim == 2 and not has_input(node, 3)
        self.compiled = None
        self.frontier = None
        self._tiles: dict[tuple, TiledLayout] = {}  # per input shapes, for _tiled_attention
        if self.softcap <= 0 and not self.wants_qk and not self.has_nonpad and not has_input(node, 4)\
                and softmax_dtype_of(node, np.float32) == np.float32 and (self.static_visible is None or frontier_only):
            from ..compiled import transformer as compiled

            self.compiled = compiled
            if frontier_only:
                self.frontier = np.where(self.static_visible, np.float32(0), np.float32(-np.inf))
        # Small attention (a decode step's few queries over the cache, a short sequence's): one compiled call
        # (compiled/decoder.py), a causal frontier or a float32 mask that covers every key as its bias.
        self.few = None
        self._few_tried = not deferred.guarding()  # else tried until a call ran whole (deferred.tried)
        per_key = geo.q_heads * geo.q_len * geo.head_size  # multiply-adds per key
        limit = few_macs(geo, KNOBS.few_query_macs if geo.q_len <= _FEW_QUERIES else KNOBS.few_query_macs // 2)
        self._few_keys = limit // per_key if per_key else math.inf  # the most keys it takes (checked per call)
        if self.compiled is not None and (self.shape_key is not None or geo.total_len <= self._few_keys):
            self.few = _compiled_decoder().few_query_attention_prefix_float32
            # (its entry point bound at the first call: a decode step's call keeps its argument types, see
            # append_over_rows, and numba's typing of its nine arguments cost a fifth of the call)
            self._append = EntryOnce(_compiled_decoder().append_attention_float32)
            self._outputs, self._few_scale = len(node.outputs), np.float32(self.scale)
            self._few_bias = np.empty((0, 0, 0, 0), np.float32) if self.frontier is None else self.frontier[None, None]
            self._few_masks: dict[tuple, tuple | None] = {}  # per mask shape: its (B', H', M', T) view, or None
            self._by_head = geo.rank == 4 and lanes_take(geo)  # (B, H, S, D) heads of a prefill: the 16-lane loop

    def bias(self, mask: np.ndarray | None, nonpad: np.ndarray | None, dtype, total: int) -> np.ndarray | None:
        """The additive attention bias over ``total`` keys (0 or -inf for masked ones, plus a float mask's values)."""
        geo = self.geo
        bias = None
        if mask is not None:
            if mask.dtype == bool:
                bias = np.where(mask, dtype.type(0), dtype.type(-np.inf))
            else:
                bias = mask.astype(dtype)
            short = total - bias.shape[-1] if bias.ndim else 0  # a scalar mask broadcasts
            if short > 0:  # a short mask leaves the trailing keys masked
                pad = [(0, 0)] * (bias.ndim - 1) + [(0, short)]
                bias = np.pad(bias, pad, constant_values=-np.inf)
        if self.has_nonpad:
            nonpad = np.asarray(nonpad).reshape(-1).astype(np.int64)
            visible = _visible_keys(geo.q_len, total, nonpad - geo.q_len, self.causal, self.left,
                                    self.right, nonpad)
        else:
            visible = self.static_visible
        if visible is not None:
            bias = np.where(visible, dtype.type(0) if bias is None else bias, dtype.type(-np.inf))
        return bias

    def __call__(self, q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None):
        if self.few is not None and k.shape[-2] <= self._few_keys and q.dtype is k.dtype is v.dtype is FLOAT32:
            outputs = self.few_query_attention(q, k, v, attn_mask) if self._few_tried else \
                deferred.tried(self, "_few_tried", self.few_query_attention, q, k, v, attn_mask)
            if outputs is not None:
                return outputs
        if self.compiled is not None and q.dtype == k.dtype == v.dtype == np.float32:
            outputs = self.compiled_attention(q, k, v, attn_mask)
            if outputs is not None:
                return outputs[: len(self.node.outputs)]
        if self.plain and q.dtype == np.float32 and (attn_mask is None or attn_mask.dtype == np.float32):
            outputs = self.plain_attention(q, k, v, attn_mask)
            if outputs is not None:
                return outputs[: len(self.node.outputs)]
        from ..algorithms.contrib_attention import grouped_matmul, softmax_  # (the general path alone)

        geo = self.geo
        k = geo.to_heads(k, geo.kv_heads)
        v = geo.to_heads(v, geo.kv_heads)
        present_key = k if past_key is None else np.concatenate((past_key, k), axis=2)
        present_value = v if past_value is None else np.concatenate((past_value, v), axis=2)
        dtype = compute_dtype(q.dtype)
        softmax_dtype = compute_dtype(softmax_dtype_of(self.node, dtype))
        rounded = _rounding_to(q.dtype, dtype)

        queries = geo.to_heads(q, geo.q_heads).astype(dtype)
        keys = present_key.astype(dtype, copy=False).swapaxes(-1, -2)
        if rounded is None:
            queries = queries * dtype.type(self.scale)
        else:  # as the function body: both sides times sqrt(scale) in the input type
            root = dtype.type(q.dtype.type(math.sqrt(self.scale)))
            queries, keys = rounded(queries * root), rounded(keys * root)
        scores = grouped_matmul(queries, keys)
        rounded = rounded or (lambda x: x)
        scores = rounded(scores)
        qk = scores.copy() if self.wants_qk and self.mode == 0 else None
        if self.softcap > 0:
            cap = dtype.type(self.softcap)
            scores = rounded(np.tanh(rounded(scores / cap)))
            scores = rounded(scores * cap)
        if self.wants_qk and self.mode == 1:
            qk = scores.copy()
        bias = self.bias(attn_mask, nonpad_kv_seqlen, dtype, present_key.shape[2])
        if bias is not None:
            scores = rounded(scores + bias)
        if self.wants_qk and self.mode == 2:
            qk = scores.copy()

        probs = softmax_(scores.astype(softmax_dtype, copy=False))
        if bias is not None and bias.size:
            # A query that may attend no key at all outputs zeros (decided on the bias, not the scores).
            dead = np.isneginf(bias.max(axis=-1, keepdims=True))
            if dead.any():
                probs = np.where(dead, softmax_dtype.type(0), probs)
        if self.wants_qk and self.mode == 3:
            qk = probs
        values = present_value.astype(dtype, copy=False)
        y = grouped_matmul(rounded(probs.astype(dtype, copy=False)), values)
        y = geo.from_heads(y).astype(q.dtype, copy=False)
        if qk is not None:
            qk = qk.astype(q.dtype, copy=False)
        return (y, present_key, present_value, qk)[: len(self.node.outputs)]

    def few_over_rows(self, q, k, v, mask, key_rows, value_rows):
        """few_query_attention's result for a decode step's (B, H, S, D) Q, K and V whose K and V are the first rows
        of ``key_rows``/``value_rows`` (C-contiguous buffers at their capacity: kv_append's), read there; None
        where the call's own paths decide (see __call__)."""
        if self.few is None or not self._few_tried or self._by_head or self.geo.rank != 4 \
                or k.shape[-2] > self._few_keys or q.dtype is not FLOAT32 or key_rows.dtype is not FLOAT32 \
                or value_rows.dtype is not FLOAT32 \
                or not (key_rows.flags.c_contiguous and value_rows.flags.c_contiguous):
            return None
        return self.few_query_attention(q, k, v, mask, (key_rows, value_rows))

    def append_over_rows(self, q, k, v, mask, key_rows, value_rows, length: int):
        """few_over_rows for a decode step that has not appended yet: K and V written at row ``length`` of
        ``key_rows``/``value_rows`` (kv_append's buffers) and the attention over the grown rows, in one compiled
        call. Y (B, H, S, D); None where few_over_rows would decline (nothing is written); False where the rows
        were written but a row had no finite score (the caller's general path decides)."""
        keys = length + k.shape[-2]
        if self.few is None or not self._few_tried or self._by_head or self.geo.rank != 4 or keys > self._few_keys \
                or q.dtype is not FLOAT32 or k.dtype is not FLOAT32 or v.dtype is not FLOAT32 \
                or not (key_rows.flags.c_contiguous and value_rows.flags.c_contiguous):
            return None
        bias = self._few_bias if mask is None else self.few_mask(mask, q.shape[0], keys)
        if bias is None:
            return None
        return self._append_rows(q, k, v, key_rows, value_rows, length, bias)

    def append_over_windows(self, q, k, v, mask, mask_lead, key_window, value_window, length: int):
        """append_over_rows into two kv_append windows' buffers, for a caller that has checked the mask's shape but
        its keys' length already and found its (B', H', M') ``mask_lead`` (few_mask_lead of that shape; None: it
        broadcasts otherwise): the windows' contiguity is read as they kept it, the lead is not looked up again."""
        keys = length + k.shape[-2]
        if self.few is None or not self._few_tried or self._by_head or self.geo.rank != 4 or keys > self._few_keys \
                or q.dtype is not FLOAT32 or k.dtype is not FLOAT32 or v.dtype is not FLOAT32 \
                or not (key_window.contiguous and value_window.contiguous):
            return None
        if mask is None:
            bias = self._few_bias
        elif mask_lead is None or mask.dtype is not FLOAT32 or mask.shape[-1] != keys:
            return None
        else:
            bias = mask if mask.ndim == 4 and mask.flags.c_contiguous else \
                np.ascontiguousarray(mask).reshape(mask_lead + (keys,))
        return self._append_rows(q, k, v, key_window.physical, value_window.physical, length, bias)

    def few_mask_lead(self, shape: tuple, batch: int) -> tuple | None:
        """The (B', H', M') a mask of ``shape`` is read with by append_over_windows, or None: it broadcasts otherwise,
        or this kernel has no small-attention call."""
        return None if self.few is None else self._few_mask_view(shape, batch)

    def _append_rows(self, q, k, v, key_rows, value_rows, length: int, bias):
        geo = self.geo
        y = np.empty((q.shape[0], geo.q_heads, geo.q_len, geo.v_head_size), np.float32)
        # (Q, K and V as C-contiguous arrays, the buffers checked so, the bias few_mask's: every call passes the
        # argument types the entry point was bound for)
        if not self._append.run((np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), key_rows,
                                 value_rows, length, self._few_scale, bias, y)):
            return False
        return y

    def few_query_attention(self, q, k, v, mask=None, rows=None):
        """(Y, present_key, present_value) as compiled_attention's for small attention, in one compiled call. None
        where the general path decides: a row with no finite score, a mask not float32, short or broadcasting.
        ``rows``: the buffers K and V are the first rows of, where the caller has them (few_over_rows)."""
        geo, bias = self.geo, self._few_bias
        if mask is not None:
            bias = self.few_mask(mask, q.shape[0], k.shape[-2])
            if bias is None:
                return None
        if self._by_head and not numpy_first():  # (its loop has no numpy version to serve while numba loads)
            return few_by_head(geo, q, k, v, self._few_scale, bias, self._outputs)
        if geo.rank == 3 and rows_readable(q, k, v) and not numpy_first():
            return few_in_place(geo, q, k, v, self._few_scale, bias, self._outputs)  # (Y in place: no copies)
        queries, keys, values = (q, k, v) if geo.rank == 4 else (  # (a decode step's (B, H, S, D): no head moves)
            geo.to_heads(q, geo.q_heads), geo.to_heads(k, geo.kv_heads), geo.to_heads(v, geo.kv_heads))
        y = np.empty((queries.shape[0], geo.q_heads, geo.q_len, geo.v_head_size), np.float32)
        # (caches appended in place: where they lie)
        key_rows, value_rows = kv_append.contiguous_rows(keys, values) if rows is None else rows
        if not self.few(np.ascontiguousarray(queries), key_rows, value_rows, keys.shape[2], self._few_scale, bias, y):
            return None
        return (geo.from_heads(y), keys, values)[:self._outputs]

    def few_mask(self, mask: np.ndarray, batch: int, keys: int) -> np.ndarray | None:
        """The float32 ``mask`` over ``keys`` keys as the (B', H', M', T) bias the compiled call reads, or None where
        it broadcasts otherwise or is not float32 (the general path takes it)."""
        lead = self._few_masks.get(mask.shape[:-1], False)  # (the keys' length is checked per call)
        if lead is False:
            lead = self._few_masks[mask.shape[:-1]] = self._few_mask_view(mask.shape, batch)
        if lead is None or mask.dtype is not FLOAT32 or mask.shape[-1] != keys:
            return None
        return mask if mask.ndim == 4 and mask.flags.c_contiguous else \
            np.ascontiguousarray(mask).reshape(lead + mask.shape[-1:])  # (a 4-D one is read as it lies)

    def _few_mask_view(self, shape: tuple, batch: int) -> tuple | None:
        """The (B', H', M') leading the keys' axis in the (B', H', M', T) shape the compiled call reads a mask of
        ``shape`` as (each of B', H', M' one or the scores' own size), or None: it broadcasts otherwise, or a
        frontier is also in force (the general path combines them)."""
        geo = self.geo
        if self.frontier is not None or not 2 <= len(shape) <= 4:
            return None
        lead = (1,) * (4 - len(shape)) + tuple(shape[:-1])
        if all(d in (1, full) for d, full in zip(lead, (batch, geo.q_heads, geo.q_len))):
            return lead
        return None

    def _compiled_bias(self, mask, total: int) -> np.ndarray | None:
        """The (q_len, total_len) float32 bias the compiled softmax adds (empty for none), or (q_heads, q_len,
        total_len): one per query head (T5's relative positions); None for other shapes or types."""
        geo = self.geo
        if mask is None:
            return np.empty((0, 0), np.float32) if self.frontier is None else self.frontier
        lead = mask.shape[:-2]
        if self.frontier is not None or mask.dtype != np.float32 or mask.ndim < 2 \
                or mask.shape[-2:] != (geo.q_len, total):
            return None
        if all(d == 1 for d in lead):
            return np.ascontiguousarray(mask.reshape(mask.shape[-2:]))
        if lead[-1] == geo.q_heads and all(d == 1 for d in lead[:-1]):
            return np.ascontiguousarray(mask.reshape(mask.shape[-3:]))
        return None

    def compiled_attention(self, q, k, v, mask):
        """(Y, present_key, present_value) as in plain_attention, with one compiled pass per scores row for
        the scale, the mask and the shift by the row's maximum, numpy's exp, and one compiled pass dividing
        Y's rows by the weights' sums. None where another path must decide (see _compiled_bias; a row
        without a finite score)."""
        geo = self.geo
        total = k.shape[-2]
        bias = self._compiled_bias(mask, total)
        if bias is None or q.size == 0 or k.size == 0:
            return None
        per_head = bias.ndim == 3
        if geo.q_len >= _TILED_ROWS and geo.v_head_size % 32 == 0 and gemv_host() and not per_head \
                and not numpy_first("jobs.ATTENTION"):  # AVX-512
            return self._tiled_attention(q, k, v, bias)
        queries = geo.to_heads(q, geo.q_heads)
        keys, values = geo.to_heads(k, geo.kv_heads), geo.to_heads(v, geo.kv_heads)
        keys_t = keys.swapaxes(-1, -2)
        if bias.size and geo.q_len > _ROW_BLOCK and not per_head:
            # Contiguous operands (Q, K^T, V are often strided views of one QKV product): BLAS multiplies
            # the blocks' small matrices up to twice as fast as through the views.
            queries, keys_t = np.ascontiguousarray(queries), np.ascontiguousarray(keys_t)
            extents = self.compiled.key_extents(bias, _ROW_BLOCK, self._hiding_gap(queries, keys_t))
            if extents.min() < total:
                y = self._blocked_attention(queries, keys_t, np.ascontiguousarray(values), bias, extents)
                return None if y is None else (y, keys, values)
        batch, heads, rows, size = queries.shape
        # Grouped-query attention: the query heads sharing one KV head are rows of one matmul.
        scores = np.matmul(queries.reshape(batch, geo.kv_heads, heads // geo.kv_heads * rows, size), keys_t)
        per_row = scores.reshape(-1, rows, scores.shape[-1])  # (batch x query heads, in head order)
        if per_head:  # one call per head and its bias
            for index in range(per_row.shape[0]):
                if not self.compiled.mask_and_shift_(per_row[index:index + 1], np.float32(self.scale),
                                                     bias[index % heads], 0):
                    return None
        elif not self.compiled.mask_and_shift_(per_row, np.float32(self.scale), bias, 0):
            return None
        np.exp(scores, out=scores)
        y = np.matmul(scores, values)
        self.compiled.divide_by_row_sums_(scores.reshape(-1, scores.shape[-1]), y.reshape(-1, y.shape[-1]))
        return geo.from_heads(y.reshape(batch, heads, rows, values.shape[-1])), keys, values

    def _tiled_attention(self, q, k, v, bias):
        """compiled_attention's result through compiled/attention.py: one (batch, head) unit per thread at a
        time, tiles of query rows over the keys the mask leaves visible to them, the scores kept in
        cache. None where a row has no finite score (as compiled_attention)."""
        from ..compiled import jobs, workers

        geo = self.geo
        q, k, v = np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)
        key = (q.shape, k.shape, v.shape, kernel_threads())
        layout = self._tiles.get(key)
        if layout is None:
            if len(self._tiles) > 64:  # shapes vary without bound (a growing sequence): start over
                self._tiles.clear()
            layout = self._tiles[key] = TiledLayout(geo, q, k, v, self.scale, k.shape[-2])
        size = geo.head_size
        if bias.size:
            gap = 128.0 + 2.0 * abs(self.scale) * 1.001 * self.compiled.largest_row_norm(q.reshape(-1, size)) *\
                self.compiled.largest_row_norm(k.reshape(-1, size))  # as _hiding_gap, over every head's rows
            extents = np.maximum.reduceat(self.compiled.key_extents(bias, 1, gap), layout.starts)
        else:
            extents = layout.every_key
        y = np.empty(layout.y_shape, np.float32)
        status = np.zeros(1, np.int64)
        arguments = (q.reshape(-1), layout.q_strides, k.reshape(-1), layout.k_strides, v.reshape(-1),
                     layout.v_strides, y.reshape(-1), layout.y_strides, *layout.sizes, layout.scale, bias, layout.plan,
                     extents, layout.bounds, status, workers.local_mailbox(layout.scratch))
        workers.call(jobs.split_attention, arguments, jobs.ATTENTION.address(), layout.scratch,
                     helper_count() if len(layout.bounds) > 2 else 0)
        if status[0]:
            return None
        return y, geo.to_heads(k, geo.kv_heads), geo.to_heads(v, geo.kv_heads)

    def _hiding_gap(self, queries, keys_t) -> float:
        """How far below a row's largest bias a key's bias must lie for its weight to be exactly zero, for
        C-contiguous queries (..., M, D) and transposed keys (..., D, T).

        A scaled score lies within scale * |q| * |k| of zero, so a hidden key's shifted score is at most
        mask - peak + 2 * scale * max|q| * max|k| (the row's maximum is at least the peak key's score),
        and float32 exp of anything below -104 is 0. A finite mask such as -1e9 on future keys then skips
        their products like -inf does; non-finite queries or keys skip nothing (inf)."""
        size = queries.shape[-1]
        reach = self.compiled.largest_row_norm(queries.reshape(-1, size)) *\
            self.compiled.largest_column_norm(keys_t.reshape(-1, size, keys_t.shape[-1]))
        return 128.0 + 2.0 * abs(self.scale) * reach * 1.001  # margins: float32 scores, the norms' rounding

    def _blocked_attention(self, queries, keys_t, values, bias, extents):
        """Y of compiled_attention per block of _ROW_BLOCK query rows over the keys the bias leaves visible
        to the block (``extents``): a causal mask needs about half the products. Query heads sharing a KV
        head broadcast against it (an axis of their own) instead of folding into its rows."""
        geo = self.geo
        batch, heads, rows, size = queries.shape
        group = heads // geo.kv_heads
        grouped = queries.reshape(batch, geo.kv_heads, group, rows, size)
        keys_t, shared_values = keys_t[:, :, None], values[:, :, None]
        y = np.empty((batch, heads, rows, values.shape[-1]), np.float32)
        y_grouped = y.reshape(batch, geo.kv_heads, group, rows, -1)
        scale = np.float32(self.scale)
        for index, extent in enumerate(extents.tolist()):
            start, stop = index * _ROW_BLOCK, min(rows, (index + 1) * _ROW_BLOCK)
            scores = np.matmul(grouped[..., start:stop, :], keys_t[..., :extent])
            if not self.compiled.mask_and_shift_(scores.reshape(-1, stop - start, extent), scale, bias, start):
                return None
            np.exp(scores, out=scores)
            part = np.matmul(scores, shared_values[..., :extent, :])
            self.compiled.divide_by_row_sums_(scores.reshape(-1, extent), part.reshape(-1, part.shape[-1]))
            y_grouped[..., start:stop, :] = part
        return geo.from_heads(y)

    def plain_attention(self, q, k, v, mask):
        """(Y, present_key, present_value) for softmax(Q K^T * scale + mask) V with one buffer for the
        scores, updated in place, and the softmax's division applied to Y (fewer elements than the
        scores). None when the general path must decide: a mask that does not cover every key or
        would broadcast the scores, or a row with no finite score (fully masked rows become zeros)."""
        geo = self.geo
        if q.size == 0 or k.size == 0 or (mask is not None and (mask.ndim == 0 or mask.shape[-1] != k.shape[-2])):
            return None
        queries = geo.to_heads(q, geo.q_heads) * np.float32(self.scale)
        keys, values = geo.to_heads(k, geo.kv_heads), geo.to_heads(v, geo.kv_heads)
        batch, heads, rows, size = queries.shape
        # Grouped-query attention: the query heads sharing one KV head are rows of one matmul.
        scores = np.matmul(queries.reshape(batch, geo.kv_heads, heads // geo.kv_heads * rows, size),
                           keys.swapaxes(-1, -2))
        grid = scores.reshape(batch, heads, rows, scores.shape[-1])
        if mask is not None:
            try:
                grid += mask
            except ValueError:  # the mask has dimensions the scores lack
                return None
        peak = np.fmax.reduce(grid, axis=-1, keepdims=True)  # fmax: numpy's fast maximum (NaN fails below)
        if not np.isfinite(peak).all():
            return None
        grid -= peak
        np.exp(grid, out=grid)
        weights = grid.reshape(scores.shape)
        y = np.matmul(weights, values)
        # Row sums as a BLAS matrix-vector product: several times faster than numpy's reduction.
        totals = weights.reshape(-1, weights.shape[-1]) @ np.ones((weights.shape[-1], 1), np.float32)
        y /= totals.reshape(y.shape[:-1] + (1,))
        return geo.from_heads(y.reshape(batch, heads, rows, values.shape[-1])), keys, values


# Queries from which attention runs compiled/attention.py's tiles (a decode step's few rows keep the products).
_TILED_ROWS = 16
# Attention of at most this many queries up to the few_query_macs knob's multiply-adds, and of more queries up
# to half of it, runs one compiled call: on the AVX2 host numpy's per-call overhead outweighed BLAS up to there.
_FEW_QUERIES = 4


@register("Attention", since=23)
def attention_23(node, shapes, opset):
    return _Attention(node, shapes, opset)


@register("Attention", since=24)  # adds the nonpad_kv_seqlen input (external KV cache)
def attention_24(node, shapes, opset):
    return _Attention(node, shapes, opset)


@register("Attention", since=25)  # adds left_window_size / right_window_size
def attention_25(node, shapes, opset):
    return _Attention(node, shapes, opset)


def _compiled_decoder():
    from ..compiled import decoder  # numba loads only for models that need it

    return decoder
