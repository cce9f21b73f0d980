"""Kernels for the provider's own fused operators (domain ai.onnx_runtime.cpu, see fusions.py and
decoder_fusions.py): RotateHalfEmbedding, SkipRMSNormalization, SwishMul, GeluMul, ReshapeTranspose and
TransposeReshape.

On float32/float64, the rotation, the residual add with RMS normalization and a decode step's SwishMul
run compiled loops (compiled/decoder.py), one pass per row; every other dtype keeps numpy kernels, which
compute what the unfused nodes would.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime.ir import Node

from ..algorithms.activations import gelu_erf, gelu_series, gelu_tanh
from ..algorithms.bound_loop import EntryOnce
from ..compiled import COMPILED_DTYPES
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import graph_error, quiet, stash_dtype
from .transformer_blocks import rms_normalization
from .view import reshape_to


def _compiled_decoder():
    from ..compiled import decoder  # numba loads only for models that need it

    return decoder


_FLOAT32, _FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)
# The last call's kept state of a kernel below before any call bound one (never matches a shape).
_UNBOUND = ((), None, None, None, None)


class _Entries:
    """A compiled row loop's entry points, one per dtype (bound_loop.EntryOnce). A decode step calls the loops below
    with the same shapes and argument types every step, and numba's dispatcher types each argument on every call (a
    third of a one-row call): the kernels keep the entry point with the shapes of their last call (``kept``) and
    call it directly while a call has those shapes, that dtype and C-contiguous arrays as reshaped for the loop (the
    entry point does not check its arguments); any other call goes through the dispatcher."""

    __slots__ = ("float32", "float64")

    def __init__(self, loop):
        self.float32, self.float64 = EntryOnce(loop), EntryOnce(loop)

    def __call__(self, dtype, arguments: tuple):
        """The entry point for ``arguments`` (C-contiguous arrays, each of ``dtype`` or the loop's other fixed
        types), bound now where not yet; None where there is none (numba still loading, or no linked overload)."""
        if dtype is _FLOAT32:
            return self.float32(arguments)
        return self.float64(arguments) if dtype is _FLOAT64 else None


def _keep_pair(kept: list, entries: _Entries, arguments: tuple, shape, dtype, b) -> None:
    """After a dispatcher call of a pair loop on ``arguments`` (a and b flat, then the constant and the output): keep
    its entry point for ``shape`` where b has a's dtype and both are C-contiguous."""
    if b.dtype is dtype and arguments[0].flags.c_contiguous and arguments[1].flags.c_contiguous:
        entry = entries(dtype, arguments)
        if entry is not None:
            kept[0] = (shape, dtype, entry)


def _rotate_half_numpy(q, cos, sin, half, end):
    rotated = np.concatenate((np.negative(q[..., half:end]), q[..., :half]), axis=-1) * sin
    out = q * cos
    if out.shape == rotated.shape:
        out += rotated
        return out
    return out + rotated  # the tables broadcast one product up


class RotationPlan:
    """How the compiled loop sees one pair of (q, cos/sin) shapes: q as (rows, end), the tables as
    (table rows, end), and for each row of q the table row it reads once the tables are broadcast over
    q's leading axes. None where the loop does not apply. The last pair's plan is kept (with its key in
    one tuple: sessions may run from several threads), as shapes rarely change between runs."""

    def __init__(self, half: int, end: int):
        self.half, self.end = half, end
        self.last = (None, None)

    def __call__(self, q_shape, table_shape):
        key = (q_shape, table_shape)
        last = self.last
        if key != last[0]:
            last = self.last = (key, self._plan(q_shape, table_shape))
        return last[1]

    def _plan(self, q_shape, table_shape):
        """None unless the rotation covers q's last axis and the tables broadcast to q's shape without
        enlarging it, with q's last axis as theirs."""
        if not q_shape or q_shape[-1] != self.end or not 0 <= self.half <= self.end or 0 in q_shape\
                or len(table_shape) > len(q_shape) or table_shape[-1:] != q_shape[-1:]:
            return None
        try:
            if np.broadcast_shapes(q_shape, table_shape) != q_shape:
                return None
        except ValueError:
            return None
        index = np.arange(math.prod(table_shape[:-1])).reshape(table_shape[:-1])
        rows = np.ascontiguousarray(np.broadcast_to(index, q_shape[:-1]), dtype=np.int64).reshape(-1)
        return rows, (rows.size, self.end), (index.size, self.end)


@register("RotateHalfEmbedding", domain=FUSED_DOMAIN, since=1)
def rotate_half_embedding(node, shapes, opset):
    """q * cos + concat(-q[..., half:end], q[..., :half]) * sin: one compiled pass over q when the rotation
    covers q's last axis (end = its size) and cos/sin broadcast onto q; otherwise three numpy passes."""
    half, end = int(node.attr("half")), int(node.attr("end"))
    compiled = _compiled_decoder()
    plans = RotationPlan(half, end)
    entries = _Entries(compiled.rotate_half)
    # ((q's shape, the tables'), dtype, the plan's rows, q's and the tables' 2-D shapes) and the entry point of the
    # last call that had one (see _Entries), read as one tuple (threads may run this node at once)
    kept = [_UNBOUND + (None,)]

    def kernel(q, cos, sin):
        shapes, dtype, rows, q_2d, table_2d, entry = kept[0]
        if (q.shape, cos.shape) == shapes and sin.shape == shapes[1] and q.dtype is dtype and cos.dtype is dtype \
                and sin.dtype is dtype:
            q_rows, cos_rows, sin_rows = q.reshape(q_2d), cos.reshape(table_2d), sin.reshape(table_2d)
            if q_rows.flags.c_contiguous and cos_rows.flags.c_contiguous and sin_rows.flags.c_contiguous:
                out = np.empty(q_2d, dtype)
                entry(q_rows, cos_rows, sin_rows, rows, half, out)
                return (out.reshape(shapes[0]),)
        dtype = q.dtype
        if dtype in COMPILED_DTYPES and dtype == cos.dtype == sin.dtype and cos.shape == sin.shape:
            plan = plans(q.shape, cos.shape)
            if plan is not None:
                rows, q_2d, table_2d = plan
                out = np.empty(q_2d, dtype)
                arguments = (q.reshape(q_2d), cos.reshape(table_2d), sin.reshape(table_2d), rows, half, out)
                compiled.rotate_half(*arguments)
                if all(array.flags.c_contiguous for array in arguments[:3]) and dtype is cos.dtype is sin.dtype:
                    entry = entries(dtype, arguments)
                    if entry is not None:
                        kept[0] = ((q.shape, cos.shape), dtype, rows, q_2d, table_2d, entry)
                return (out.reshape(q.shape),)
        return (_rotate_half_numpy(q, cos, sin, half, end),)

    return kernel


@register("SkipRMSNormalization", domain=FUSED_DOMAIN, since=1)
def skip_rms_normalization(node, shapes, opset):
    """(RMSNormalization(a + b, weight), a + b): the residual add and the norm after it, over the last
    axis. When a, b and the weight share a float32/float64 dtype that is also the statistics' (the norm's
    stash_type), one compiled pass per row; otherwise Add then the RMSNormalization kernel."""
    epsilon = float(node.attr("epsilon", 1e-5))
    stash = stash_dtype(node)
    stash = stash if stash in COMPILED_DTYPES else None  # the compiled pass keeps the statistics in the input's dtype
    norm = rms_normalization(Node("RMSNormalization", ["x", "scale"], ["y"], name=node.name, attrs={
        "axis": -1, "epsilon": epsilon, "stash_type": int(node.attr("stash_type", 1))}, opset=23),
        [shapes[0], shapes[2]], 23)
    compiled = _compiled_decoder()
    entries = _Entries(compiled.skip_rms_norm)
    # (a's shape, dtype, the weight, the rows' 2-D shape, the entry point): the last call that had one (see
    # _Entries), for a constant (read-only, C-contiguous) weight, the same array every run
    kept = [_UNBOUND]

    def kernel(a, b, weight):
        shape, dtype, kept_weight, rows_2d, entry = kept[0]
        if weight is kept_weight and a.shape == shape and b.shape == shape and a.dtype is dtype and b.dtype is dtype:
            a_rows, b_rows = a.reshape(rows_2d), b.reshape(rows_2d)
            if a_rows.flags.c_contiguous and b_rows.flags.c_contiguous:
                out, total = np.empty(shape, dtype), np.empty(shape, dtype)
                entry(a_rows, b_rows, weight, epsilon, out.reshape(rows_2d), total.reshape(rows_2d))
                return out, total
        if a.dtype == stash and a.dtype == b.dtype == weight.dtype and a.shape == b.shape and a.size\
                and weight.shape == a.shape[-1:]:
            n = a.shape[-1]
            dtype = a.dtype
            out, total = np.empty(a.shape, dtype), np.empty(a.shape, dtype)
            arguments = (a.reshape(-1, n), b.reshape(-1, n), weight, epsilon, out.reshape(-1, n), total.reshape(-1, n))
            compiled.skip_rms_norm(*arguments)
            if all(array.flags.c_contiguous for array in arguments[:3]) and not weight.flags.writeable \
                    and dtype is b.dtype is weight.dtype:
                entry = entries(dtype, arguments)
                if entry is not None:
                    kept[0] = (a.shape, dtype, weight, (a.size // n, n), entry)
            return out, total
        total = a + b
        return norm(total, weight)[0], total

    return kernel


# Up to this many elements SwishMul runs one compiled pass; above, numpy. The pass saves numpy's five
# ufunc calls and its errstate (more so in a model run, where the weights evict the interpreter's data
# from cache; afcca01); float32 runs the vectorized sigmoid of compiled/transformer.py (faster than
# libm's scalar exp; 999109f), float64 libm's exp.
_SWISH_MUL_COMPILED_SIZE = 2048


@register("SwishMul", domain=FUSED_DOMAIN, since=1)
def swish_mul(node, shapes, opset):
    """Swish(a, alpha) * b, the gated unit of a SwiGLU feed-forward block. A decode step's row (a and b
    of one float32/float64 shape, at most _SWISH_MUL_COMPILED_SIZE values) is one compiled pass, equal to
    Swish then Mul within exp's rounding; otherwise numpy in place in one temporary, equal to them."""
    alpha = float(node.attr("alpha", 1.0))
    compiled = _compiled_decoder()
    entries = {_FLOAT32: _Entries(compiled.swish_mul_float32), _FLOAT64: _Entries(compiled.swish_mul)}
    kept = [_UNBOUND[:3]]  # (shape, dtype, entry point) of the last call that had one (see _Entries)

    @quiet  # exp overflows to inf for large negative inputs, giving the correct limit 0
    def numpy_kernel(a, b):
        if a.dtype not in COMPILED_DTYPES:  # half precision: Swish computes in float32 and casts back
            x = a.astype(np.float32)
            y = x / (1 + np.exp(-x.dtype.type(alpha) * x))
            return (y.astype(a.dtype) * b,)
        t = np.multiply(a, a.dtype.type(-alpha))
        np.exp(t, out=t)
        t += a.dtype.type(1)
        np.divide(a, t, out=t)
        if b.shape == t.shape:
            t *= b
            return (t,)
        return (t * b,)  # b broadcasts

    def kernel(a, b):
        shape, dtype, entry = kept[0]  # the kept entry point (see _Entries): inline, a call's frame costs here
        if a.shape == shape and b.shape == shape and a.dtype is dtype and b.dtype is dtype:
            a_flat, b_flat = a.reshape(-1), b.reshape(-1)
            if a_flat.flags.c_contiguous and b_flat.flags.c_contiguous:
                out = np.empty(shape, dtype)
                entry(a_flat, b_flat, alpha, out.reshape(-1))
                return (out,)
        small = a.shape == b.shape and a.size <= _SWISH_MUL_COMPILED_SIZE
        if small and a.dtype in COMPILED_DTYPES and a.dtype == b.dtype:
            dtype = a.dtype
            out = np.empty(a.shape, dtype)
            arguments = (a.reshape(-1), b.reshape(-1), alpha, out.reshape(-1))
            (compiled.swish_mul_float32 if dtype == np.float32 else compiled.swish_mul)(*arguments)
            found = entries.get(dtype)
            if found is not None:
                _keep_pair(kept, found, arguments, a.shape, dtype, b)
            return (out,)
        return numpy_kernel(a, b)

    return kernel


@register("GeluMul", domain=FUSED_DOMAIN, since=1)
def gelu_mul(node, shapes, opset):
    """Gelu(a, approximate) * b, the gated unit of a GeGLU feed-forward block (Gemma's Mul(Gelu(A Wg), A Wu)).
    float32 a and b of one shape are one compiled pass (the Gelu kernel's values, each times its gate); otherwise
    numpy computes what Gelu then Mul would (b broadcasting)."""
    approximate = node.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise graph_error(node, "approximate", f"is {approximate!r}; expected 'none' or 'tanh'")
    fn = gelu_erf if approximate == "none" else gelu_tanh
    coefficients = np.ascontiguousarray(gelu_series(approximate, np.float32))
    compiled = _compiled_decoder()
    entries = _Entries(compiled.gelu_mul_float32)
    kept = [_UNBOUND[:3]]  # (shape, dtype, entry point) of the last call that had one (see _Entries)

    def kernel(a, b):
        shape, dtype, entry = kept[0]  # the kept entry point (see _Entries): inline, a call's frame costs here
        if a.shape == shape and b.shape == shape and a.dtype is dtype and b.dtype is dtype:
            a_flat, b_flat = a.reshape(-1), b.reshape(-1)
            if a_flat.flags.c_contiguous and b_flat.flags.c_contiguous:
                out = np.empty(shape, dtype)
                entry(a_flat, b_flat, coefficients, out.reshape(-1))
                return (out,)
        if a.dtype == np.float32 and b.dtype == a.dtype and a.shape == b.shape and a.size:
            dtype = a.dtype
            out = np.empty(a.shape, dtype)
            arguments = (a.reshape(-1), b.reshape(-1), coefficients, out.reshape(-1))
            compiled.gelu_mul_float32(*arguments)
            if dtype is _FLOAT32:
                _keep_pair(kept, entries, arguments, a.shape, dtype, b)
            return (out,)
        with np.errstate(over="ignore", invalid="ignore"):  # huge |a| overflows; -inf * 0 is NaN as specified
            return (fn(a).astype(a.dtype, copy=False) * b,)

    return kernel


def _static_reshape(node, x_shape=None):
    """x -> x reshaped to the constant target shape that the decoder fusion moved into the ``shape``
    attribute (a 0 copies x's dimension unless ``allowzero``: resolved here when x's shape is planned)."""
    shape = [int(d) for d in np.asarray(node.attr("shape")).reshape(-1)]
    if 0 in shape and not node.attr("allowzero", 0):
        if x_shape is None or 0 in shape[len(x_shape):] or not all(isinstance(d, (int, np.integer)) for d in x_shape):
            return lambda x: reshape_to(x, shape)
        planned = tuple(int(d) for d in x_shape)
        resolved = tuple(planned[i] if dim == 0 else dim for i, dim in enumerate(shape))
        return lambda x: x.reshape(resolved) if x.shape == planned else reshape_to(x, shape)
    shape = tuple(shape)
    return lambda x: x.reshape(shape)


@register("ReshapeTranspose", domain=FUSED_DOMAIN, since=1)
def reshape_transpose(node, shapes, opset):
    """Transpose(Reshape(x, shape), perm): splitting a hidden axis into heads and moving them forward."""
    reshape, perm = _static_reshape(node, shapes[0] if shapes else None), tuple(node.attr("perm"))
    return lambda x: (reshape(x).transpose(perm),)


@register("TransposeReshape", domain=FUSED_DOMAIN, since=1)
def transpose_reshape(node, shapes, opset):
    """Reshape(Transpose(x, perm), shape): moving heads back and merging them into one hidden axis."""
    perm = tuple(node.attr("perm"))
    x_shape = shapes[0] if shapes and shapes[0] is not None and len(shapes[0]) == len(perm) else None
    reshape = _static_reshape(node, None if x_shape is None else [x_shape[p] for p in perm])
    return lambda x: (reshape(x.transpose(perm)),)
