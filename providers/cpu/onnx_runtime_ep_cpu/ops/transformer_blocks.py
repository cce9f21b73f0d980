"""Per-token transformer blocks around attention: RMSNormalization, RotaryEmbedding and SwiGLU.

Direct numpy kernels for the spec's function-defined operators (ops/transformer.py has the attention family);
half-precision inputs compute in float32 and round once, at the end. RMSNormalization over the last axis in
float32/float64 runs one compiled pass per row (compiled/decoder.py).
"""

from __future__ import annotations

import numpy as np

from ..algorithms.activations import sigmoid
from ..algorithms.precision import compute_dtype, upcast
from ..compiled import COMPILED_DTYPES
from ..registry import register
from ._common import argument_error, graph_error, normalize_axis, stash_dtype


def _compiled_decoder():
    from ..compiled import decoder  # numba loads only for models that need it

    return decoder


@register("RMSNormalization", since=23)
def rms_normalization(node, shapes, opset):
    epsilon = float(node.attr("epsilon", 1e-5))
    axis = int(node.attr("axis", -1))
    stash = stash_dtype(node)
    # One compiled pass per row when the statistics stay in the input's float32/float64 (see compiled/decoder.py).
    compiled = _compiled_decoder() if stash in COMPILED_DTYPES else None

    def kernel(x, scale):
        if x.dtype == stash and scale.dtype == stash and (axis == -1 or axis == x.ndim - 1):
            if compiled is not None and x.size and scale.shape == x.shape[-1:]:
                out = np.empty(x.shape, x.dtype)
                compiled.rms_norm(x.reshape(-1, x.shape[-1]), scale, epsilon, out.reshape(-1, x.shape[-1]))
                return (out,)
            # The common case (float32 over the last axis) in four passes, without the generic
            # multi-axis mean's Python-level overhead: it runs once per layer per decode step.
            mean_square = np.add.reduce(x * x, axis=-1, keepdims=True)
            mean_square *= stash.type(1.0 / max(x.shape[-1], 1))
            mean_square += stash.type(epsilon)
            y = x / np.sqrt(mean_square, out=mean_square)
            y *= scale
            return (y,)
        axes = tuple(range(normalize_axis(node, axis, x.ndim), x.ndim))
        xs = x.astype(stash)
        mean_square = np.mean(np.square(xs), axis=axes, keepdims=True)
        xs /= np.sqrt(mean_square + stash.type(epsilon))
        dtype = compute_dtype(np.result_type(compute_dtype(x.dtype), compute_dtype(scale.dtype)))
        y = xs.astype(dtype, copy=False) * scale.astype(dtype, copy=False)
        return (y.astype(scale.dtype, copy=False),)

    return kernel


def _rotary_rows(node, cos_cache, sin_cache, position_ids, half: int):
    """The cos/sin rows of the positions (the caches themselves without position_ids), checked."""
    if cos_cache.shape != sin_cache.shape:  # (a shorter sin_cache was indexed past its rows)
        raise argument_error(node, f"cos_cache {list(cos_cache.shape)} and sin_cache {list(sin_cache.shape)} "
                                   f"must have one shape")
    if position_ids is not None:
        if position_ids.size and (position_ids.min() < 0 or position_ids.max() >= cos_cache.shape[0]):
            # numpy would wrap a negative position to the cache's last rows
            raise argument_error(node, f"position_ids span {position_ids.min()}..{position_ids.max()}; they "
                                       f"must lie in [0, {cos_cache.shape[0]}), the cos/sin caches' rows")
        cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]
    if cos_cache.shape[-1] != half or sin_cache.shape[-1] != half:
        raise argument_error(node, f"cos/sin caches must have last dim {half} (rotary dim / 2)")
    return cos_cache, sin_cache


@register("RotaryEmbedding", since=23)
def rotary_embedding(node, shapes, opset):
    interleaved = bool(node.attr("interleaved", 0))
    rotary_dim = int(node.attr("rotary_embedding_dim", 0))
    num_heads = int(node.attr("num_heads", 0))

    def kernel(x, cos_cache, sin_cache, position_ids=None):
        if x.ndim == 4:  # (B, H, S, D): one cos/sin row per (batch, position), shared by the heads
            heads_view, expand = x, (slice(None), None)
        elif x.ndim == 3:  # (B, S, H * D)
            if num_heads <= 0:
                raise graph_error(node, "num_heads", "is required (and positive) for a 3-D input")
            heads_view, expand = x.reshape(x.shape[0], x.shape[1], num_heads, -1), (slice(None), slice(None), None)
        else:
            raise argument_error(node, f"input has rank {x.ndim}; expected 3 or 4")
        head_size = heads_view.shape[-1]
        dim = rotary_dim or head_size
        if dim % 2 or dim > head_size:
            raise argument_error(node, f"rotary_embedding_dim {dim} must be even and at most head size {head_size}")
        half = dim // 2
        cos_cache, sin_cache = _rotary_rows(node, cos_cache, sin_cache, position_ids, half)
        dtype = compute_dtype(x.dtype)
        cos = cos_cache.astype(dtype, copy=False)[expand]
        sin = sin_cache.astype(dtype, copy=False)[expand]
        out = heads_view.astype(dtype)  # a copy; dims past the rotary dim pass through
        if interleaved:
            x1, x2 = out[..., 0:dim:2], out[..., 1:dim:2]
        else:
            x1, x2 = out[..., :half], out[..., half:dim]
        real = cos * x1 - sin * x2
        imag = sin * x1 + cos * x2
        x1[...] = real
        x2[...] = imag
        return (out.reshape(x.shape).astype(x.dtype, copy=False),)

    return kernel


@register("SwiGLU", since=28)
def swiglu(node, shapes, opset):
    alpha = float(node.attr("alpha", 1.0))

    def kernel(a, b):
        if a.shape != b.shape:
            raise argument_error(node, f"A {a.shape} and B {b.shape} must have the same shape (no broadcasting)")
        gate = upcast(a)
        with np.errstate(over="ignore"):  # exp overflow for very negative gates: sigmoid is 0 there
            y = gate * sigmoid(gate * gate.dtype.type(alpha)) * upcast(b)
        return (y.astype(a.dtype, copy=False),)

    return kernel
