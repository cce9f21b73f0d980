"""onnxruntime's blockwise-quantized weight operators (domain com.microsoft): MatMulNBits and
GatherBlockQuantized, as docs/ContribOperators.md defines them.

MatMulNBits multiplies on the packed weight (compiled/nbits.py), repacked once along K at the same bits per
value: each packed row's weight rows are dequantized into a small float32 buffer, (q - zero point) * scale
exactly, rounded once to float32, and added into every row of the output in float32; for many rows of A,
tiles of weight columns are dequantized and go through BLAS. No float32 copy of the whole weight is kept (8
times the 4-bit one). Act-order weights (g_idx) and small weights (a float32 copy of at most
SMALL_WEIGHT_BYTES) are dequantized once per set of constant inputs instead. That
is at least the accuracy every ``accuracy_level`` asks for, the level being a floor ("A can be quantized"),
not an instruction. GatherBlockQuantized gathers the packed rows first and dequantizes only what it gathered.
"""

from __future__ import annotations

from operator import is_

import ml_dtypes
import numpy as np
from onnx_runtime.dtypes import DataType

from ..algorithms.nbits import block_weights, unpack
from ..algorithms.prepared import Prepared
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error, graph_error, normalize_axis, required_attr

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_FLOATS = (_F32, np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _int_attr(node, name: str, default=None) -> int:
    return int(node.attr(name, default) if default is not None else required_attr(node, name, "an integer"))


def _block_size(node, value: int, allow_zero: bool = False) -> int:
    if (value == 0 and allow_zero) or (value >= 16 and value & (value - 1) == 0):
        return value
    zero = " (or 0 for float8/float4 data)" if allow_zero else ""
    raise graph_error(node, "block_size", f"is {value}; expected a power of 2 not below 16{zero}")


# -- MatMulNBits -----------------------------------------------------------------------------------


class _NBitsShape:
    """MatMulNBits' attributes, and its inputs checked against them."""

    def __init__(self, node):
        self.node = node
        self.k, self.n = _int_attr(node, "K"), _int_attr(node, "N")
        self.bits = _int_attr(node, "bits", 4)
        if self.bits not in (2, 4, 8):
            raise graph_error(node, "bits", f"is {self.bits}; expected 2, 4 or 8")
        self.block = _block_size(node, _int_attr(node, "block_size"))
        level = _int_attr(node, "accuracy_level", 0)
        if not 0 <= level <= 4:
            raise graph_error(node, "accuracy_level", f"is {level}; expected 0 to 4")
        if _int_attr(node, "weight_prepacked", 0):
            raise graph_error(node, "weight_prepacked", "is set; expected 0 (a CUDA layout, not the portable one)")
        if self.k < 1 or self.n < 1:
            raise graph_error(node, "K", f"and N are {self.k} and {self.n}; expected positive sizes")
        self.blocks = -(-self.k // self.block)
        self.blob = self.block * self.bits // 8

    def _shape(self, name, value, *shapes):
        if value.shape not in shapes:
            expected = " or ".join(str(s) for s in shapes)
            raise argument_error(self.node, f"input {name!r} has shape {value.shape}; expected {expected}")

    def _check_packed(self, b, scales):
        n, blocks = self.n, self.blocks
        if b.dtype != np.uint8:
            raise argument_error(self.node, f"input 'B' is {b.dtype}; expected uint8")
        self._shape("B", b, (n, blocks, self.blob))
        self._shape("scales", scales, (n, blocks), (n * blocks,))

    def packed(self, b, scales, zero_points) -> tuple:
        """The weight as compiled/nbits.py takes it, 8 // bits values of a byte along K: (ceil(K / per_byte), N)
        uint8, and the scales and zero points (blocks, N), in float32 for integer zero points (exact for every
        scale type), else in float64."""
        self._check_packed(b, scales)
        n, blocks, per_byte = self.n, self.blocks, 8 // self.bits
        zeros = self._zero_points(zero_points, scales.dtype)
        values = unpack(b.reshape(n, -1), self.bits)[:, :self.k].T  # (K, N), one byte a value for a moment
        rows = -(-self.k // per_byte)
        padded = np.zeros((rows * per_byte, n), np.uint8)
        padded[:self.k] = values
        along_k = np.zeros((rows, n), np.uint8)
        for t in range(per_byte):
            along_k |= padded[t::per_byte] << np.uint8(t * self.bits)
        wide = _F32 if zeros.dtype == np.uint8 else _F64
        return along_k, np.ascontiguousarray(scales.reshape(n, blocks).T, wide), np.ascontiguousarray(zeros.T, wide)

    def weights(self, b, scales, zero_points, g_idx) -> np.ndarray:
        """The dequantized (N, K) float64 weight."""
        self._check_packed(b, scales)
        n, blocks = self.n, self.blocks
        quantized = unpack(b.reshape(n, -1), self.bits)[:, :self.k]
        return block_weights(quantized, scales.reshape(n, blocks), self._zero_points(zero_points, scales.dtype),
                             self._groups(g_idx))

    def _zero_points(self, zero_points, scale_dtype):
        n, blocks = self.n, self.blocks
        if zero_points is None:
            return np.full((n, blocks), 1 << (self.bits - 1), np.uint8)  # the midpoint, 2^(bits - 1)
        if zero_points.dtype == np.uint8:
            packed = -(-blocks * self.bits // 8)
            self._shape("zero_points", zero_points, (n, packed), (n * packed,))
            return unpack(zero_points.reshape(n, packed), self.bits)[:, :blocks]
        if zero_points.dtype != scale_dtype:
            raise argument_error(self.node, f"input 'zero_points' is {zero_points.dtype}; expected uint8 (packed) "
                                 f"or {scale_dtype} like the scales")
        self._shape("zero_points", zero_points, (n, blocks), (n * blocks,))
        return zero_points.reshape(n, blocks)

    def _groups(self, g_idx):
        if g_idx is None:
            return np.arange(self.k) // self.block
        if g_idx.dtype != np.int32:
            raise argument_error(self.node, f"input 'g_idx' is {g_idx.dtype}; expected int32")
        self._shape("g_idx", g_idx, (self.k,), (self.blocks * self.block,))
        if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= self.blocks):
            raise argument_error(self.node, f"input 'g_idx' holds block indices outside [0, {self.blocks})")
        return g_idx[:self.k].astype(np.int64)

    def check(self, a, scales, bias):
        if a.dtype not in _FLOATS or scales.dtype != a.dtype:
            raise argument_error(self.node, f"A ({a.dtype}) and scales ({scales.dtype}) must share a float type "
                                 "(float32, float16 or bfloat16)")
        if a.ndim < 1 or a.shape[-1] != self.k:
            raise argument_error(self.node, f"input 'A' has shape {a.shape}; expected a last dimension of K={self.k}")
        if bias is not None:
            if bias.dtype != a.dtype:
                raise argument_error(self.node, f"input 'bias' is {bias.dtype}; expected {a.dtype} like A")
            self._shape("bias", bias, (self.n,))


@register("MatMulNBits", domain=CONTRIB_DOMAIN, since=1)
def matmul_nbits(node, shapes, opset):
    spec = _NBitsShape(node)
    prepared = Prepared()
    small: list = [(), None, None]  # a dequantized small weight: its constant inputs, A's type then, the weight

    def kernel(a, b, scales, zero_points=None, g_idx=None, bias=None):
        key = (b, scales, zero_points, g_idx, bias)
        seen = small[0]
        if len(seen) == 5 and a.dtype is small[1] and a.ndim >= 1 and a.shape[-1] == spec.k \
                and all(map(is_, seen, key)):
            # The same constants as the last call, checked then: the product at once (a contiguous float32 A is
            # not copied; a strided one is, as BLAS needs rows of unit stride)
            y = np.asarray(np.matmul(np.ascontiguousarray(a, _F32), small[2]))
            if bias is not None:
                y = y + bias.astype(_F32)
            return (y.astype(a.dtype, copy=False),)
        spec.check(a, scales, bias)
        if g_idx is not None or spec.n * spec.k * 4 <= SMALL_WEIGHT_BYTES:
            weight_t = prepared.get("weights", (b, scales, zero_points, g_idx),
                                    lambda: np.ascontiguousarray(spec.weights(b, scales, zero_points, g_idx).T, _F32))
            if not any(v is not None and v.flags.writeable for v in key):
                small[:] = [key, a.dtype, weight_t]
            y = np.asarray(np.matmul(np.ascontiguousarray(a, _F32), weight_t))
        else:
            y = _packed_product(spec, a, prepared.get("packed", (b, scales, zero_points),
                                                      lambda: spec.packed(b, scales, zero_points)))
        if bias is not None:
            y = y + bias.astype(_F32)
        return (y.astype(a.dtype, copy=False),)

    return kernel


# A weight whose float32 copy is at most this size is dequantized once and multiplied by BLAS: at these sizes
# the call's fixed costs dominate and BLAS is about twice as fast as the packed loop, for little memory.
SMALL_WEIGHT_BYTES = 256 << 10

# Rows of A from which the weight is dequantized a tile of columns at a time for BLAS: below, the compiled
# product (each packed row unpacked once for all rows of A) is as fast and reads only the packed weight.
_TILED_ROWS = 64
_TILE = 256  # weight columns per dequantized tile: K x 256 float32


def _packed_product(spec, a, packed) -> np.ndarray:
    from ..compiled import nbits

    along_k, scales, zeros = packed
    wide = zeros.dtype == _F64
    flat = np.ascontiguousarray(a.reshape(-1, spec.k), _F32)
    out = np.empty((flat.shape[0], spec.n), _F32)
    if flat.shape[0] < _TILED_ROWS:
        if out.size:
            nbits.product(flat, along_k, scales, zeros, wide, spec.bits, spec.block, out)
    else:
        tile = np.empty((spec.k, min(_TILE, spec.n)), _F32)
        for first in range(0, spec.n, _TILE):
            columns = tile[:, :min(_TILE, spec.n - first)]
            nbits.dequantize_columns(along_k, scales, zeros, wide, spec.bits, spec.block, first, columns)
            np.matmul(flat, columns, out=out[:, first:first + columns.shape[1]])
    return out.reshape(a.shape[:-1] + (spec.n,))


# -- GatherBlockQuantized --------------------------------------------------------------------------

_FP_DATA = {DataType.FLOAT8E4M3FN, DataType.FLOAT8E4M3FNUZ, DataType.FLOAT8E5M2, DataType.FLOAT8E5M2FNUZ,
            DataType.FLOAT4E2M1}
_INT4 = {DataType.INT4, DataType.UINT4}


class _GatherSpec:
    """GatherBlockQuantized's attributes and one call's data layout: the logical (unpacked) data shape,
    how many values each stored element holds along the last axis, and the default zero point."""

    def __init__(self, node):
        self.node = node
        self.gather_axis = _int_attr(node, "gather_axis", 0)
        self.quantize_axis = _int_attr(node, "quantize_axis", 1)
        self.block_attr = _int_attr(node, "block_size", 128)
        self.bits = _int_attr(node, "bits", 4)

    def layout(self, data):
        """(gather axis, quantize axis, values per stored element, default zero point, is float data)."""
        kind = DataType.from_numpy(data.dtype)
        rank = data.ndim
        if rank < 1:
            raise argument_error(self.node, "input 'data' is a scalar; expected rank >= 1")
        g = normalize_axis(self.node, self.gather_axis, rank)
        q = normalize_axis(self.node, self.quantize_axis, rank)
        if kind in _FP_DATA:
            _block_size(self.node, self.block_attr, allow_zero=True)
            return g, q, 1, None, True
        _block_size(self.node, self.block_attr)
        if kind in _INT4:
            if self.bits != 4:
                raise graph_error(self.node, "bits", f"is {self.bits}; expected 4 for {kind.name} data")
            return g, q, 1, 0, False
        if kind is not DataType.UINT8:
            raise argument_error(self.node, f"input 'data' is {data.dtype}; expected int4, uint4, uint8, float8 or "
                                 "float4e2m1")
        if self.bits not in (2, 4, 8):
            raise graph_error(self.node, "bits", f"is {self.bits}; expected 2, 4 or 8 for uint8 data")
        if g != 0 or q != rank - 1:
            raise argument_error(self.node, f"uint8 data gathers on axis 0 and is quantized along its last axis; "
                                 f"got gather_axis={g}, quantize_axis={q}")
        return g, q, 8 // self.bits, 1 << (self.bits - 1), False


def _values(data, per_element, bits):
    """Stored data as the values it holds: unpacked uint8, int4/uint4 widened, float8/float4 as float32."""
    if per_element > 1:
        return unpack(data, bits).astype(np.int64)
    if DataType.from_numpy(data.dtype) in _FP_DATA:
        return data.astype(_F32)
    return data.astype(np.int64)


def _expected_scales(data, q, per_element, block):
    """The shape ``scales`` must have: one scale per block of the quantize axis' logical (unpacked) length."""
    logical = data.shape[q] * per_element
    return tuple(-(-logical // block) if i == q else d for i, d in enumerate(data.shape))


def _check_scales(spec, scales, expected, q, floating):
    ok = scales.ndim == len(expected) and all(
        s == e or (floating and i != q and s == 1) for i, (s, e) in enumerate(zip(scales.shape, expected)))
    if not ok:
        raise argument_error(spec.node, f"input 'scales' has shape {scales.shape}; expected {expected} (one scale "
                             "per block along the quantize axis)")
    if scales.dtype not in _FLOATS:
        raise argument_error(spec.node, f"input 'scales' is {scales.dtype}; expected float32, float16 or bfloat16")


def _zero_points(spec, zero_points, data, scales, per_element, default):
    """Zero points shaped like ``scales`` (unpacked along the last axis for packed uint8), or the default."""
    if zero_points is None:
        return default
    if default is None:
        raise argument_error(spec.node, "input 'zero_points' is given for float8/float4 data, which is symmetric")
    if zero_points.dtype != data.dtype:
        raise argument_error(spec.node, f"input 'zero_points' is {zero_points.dtype}; expected {data.dtype} like data")
    expected = scales.shape[:-1] + (-(-scales.shape[-1] // per_element),) if per_element > 1 else scales.shape
    if zero_points.shape != expected:
        raise argument_error(spec.node, f"input 'zero_points' has shape {zero_points.shape}; expected {expected}")
    values = _values(zero_points, per_element, spec.bits)
    return values[..., :scales.shape[-1]] if per_element > 1 else values


def _blocks_along(param, axis, block, length):
    """A per-block parameter repeated over each block's elements along ``axis``, cut to ``length``."""
    if np.ndim(param) == 0 or param.shape[axis] == 1:
        return param
    return np.repeat(param, block, axis=axis).take(np.arange(length), axis=axis)


def _gather_param(param, indices, g, q, block, axis_size):
    """A scale or zero point (shaped like scales) for the gathered elements: taken along the gather axis
    (by block when it is the quantize axis; broadcast dimensions of 1 stay)."""
    if np.ndim(param) == 0:
        return param
    if param.shape[g] == 1 and axis_size != 1:
        return np.take(param, np.zeros_like(indices), axis=g)
    return np.take(param, indices // block if g == q else indices, axis=g)


def _dequantize_gathered(spec, data, safe, g, q, scales, zero):
    """(values - zero point) * scale for the data gathered at ``safe`` (in-range) indices, float32."""
    per_element = 8 // spec.bits if data.dtype == np.uint8 else 1
    block = spec.block_attr or data.shape[q] * per_element  # 0 (float data): one block over the axis
    values = _values(np.take(data, safe, axis=g), per_element, spec.bits)
    # Axes after the gather axis move by the indices' rank minus the one axis they replace.
    out_q = q if q < g else q + safe.ndim - 1
    params = [_gather_param(p, safe, g, q, block, data.shape[g]) for p in (scales, zero)]
    if g != q:
        params = [_blocks_along(p, out_q, block, data.shape[q] * per_element) for p in params]
    scale, zero = params
    centered = values if zero is None or (np.ndim(zero) == 0 and zero == 0) else values - zero
    return centered.astype(_F32) * np.asarray(scale).astype(_F32)


@register("GatherBlockQuantized", domain=CONTRIB_DOMAIN, since=1)
def gather_block_quantized(node, shapes, opset):
    spec = _GatherSpec(node)

    def kernel(data, indices, scales, zero_points=None):
        g, q, per_element, default_zero, floating = spec.layout(data)
        if indices.dtype not in (np.int32, np.int64):
            raise argument_error(node, f"input 'indices' is {indices.dtype}; expected int32 or int64")
        block = spec.block_attr or data.shape[q] * per_element
        _check_scales(spec, scales, _expected_scales(data, q, per_element, block), q, floating)
        zero = _zero_points(spec, zero_points, data, scales, per_element, default_zero)
        size = data.shape[g]
        valid = (indices >= -size) & (indices < size)
        safe = np.where(valid, np.where(indices < 0, indices + size, indices), 0).astype(np.int64)
        out = _dequantize_gathered(spec, data, safe, g, q, scales, zero)
        # An index outside [-s, s) gives zeros for its slice.
        keep = valid.reshape((1,) * g + indices.shape + (1,) * (data.ndim - g - 1))
        return (np.where(keep, out, 0).astype(scales.dtype),)

    return kernel
