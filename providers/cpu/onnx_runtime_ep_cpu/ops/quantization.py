"""Quantization kernels: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, MatMulInteger,
QLinearMatMul, QLinearConv, ConvInteger, and BitCast.

Quantizing to an integer type rounds half to even and saturates to the type's range; float8 and
float4 targets round through ml_dtypes' casts (float8 saturating as the ``saturate`` attribute says,
float4 always, having no infinity). float32 data to and from 8- and 16-bit integers, per tensor or per
axis, runs in compiled/quantize.py's one-pass loops. Products of 8-bit matrices by a 2-D weight run in
int32 through compiled/qgemm.py; other integer accumulations run in float64, which holds every sum of
8-bit products exactly and goes through BLAS.
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from ..algorithms.bound_loop import EntryOnce
from ..algorithms.prepared import Prepared
from ..algorithms.quantize import IntegerProduct
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import argument_error, quiet, shape_free
from .elementwise import cast_to
from .linalg import zero_point_rows

_INTEGER_TARGETS = {
    DataType.UINT8, DataType.INT8, DataType.UINT16, DataType.INT16,
    DataType.UINT4, DataType.INT4, DataType.UINT2, DataType.INT2,
}
_FLOAT_TARGETS = {
    DataType.FLOAT8E4M3FN, DataType.FLOAT8E4M3FNUZ, DataType.FLOAT8E5M2, DataType.FLOAT8E5M2FNUZ,
    DataType.FLOAT4E2M1,
}
_DEQUANTIZED = {DataType.FLOAT, DataType.FLOAT16, DataType.BFLOAT16}
_PRECISIONS = _DEQUANTIZED | {DataType.INT32}


def _error(node, attr: str, message: str) -> InvalidGraphError:
    return InvalidGraphError(f"node {node.name!r} ({node.op_type}): attribute {attr!r} {message}")


def _type_attr(node, name: str, allowed: set[DataType]) -> DataType | None:
    """An optional data-type attribute (0 or absent means "not given"), checked against ``allowed``."""
    value = int(node.attr(name, 0))
    if value == 0:
        return None
    try:
        dtype = DataType(value)
    except ValueError:
        dtype = None
    if dtype not in allowed:
        names = ", ".join(sorted(t.name for t in allowed))
        raise _error(node, name, f"is {value}; expected one of {names}")
    return dtype


class _Granularity:
    """How a node's scale and zero point map onto its input: per tensor, per axis, or blocked.

    ``per_axis`` is False for the opset-10 operators, which only quantize per tensor; ``block_size``
    is 0 unless blocked quantization (opset 21+) is asked for.
    """

    def __init__(self, node, *, per_axis: bool, blocked: bool):
        self.node = node
        self.per_axis = per_axis
        self.axis = int(node.attr("axis", 1)) if per_axis else None
        self.block_size = int(node.attr("block_size", 0)) if blocked else 0
        if self.block_size < 0:
            raise _error(node, "block_size", f"is {self.block_size}; expected a non-negative block size")

    def channels(self, param: np.ndarray, x_shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(outer, C, inner): ``x`` viewed so that a per-tensor (C = 1) or per-axis ``param`` has one value per
        channel C; None for blocked parameters (which the compiled loops leave to numpy)."""
        size = math.prod(x_shape)
        if param.size == 1 and param.ndim <= 1:
            return 1, 1, size
        if self.block_size or not self.per_axis or param.ndim != 1 or not x_shape:
            return None
        axis = self._axis(len(x_shape))
        if param.shape[0] != x_shape[axis]:
            return None
        return math.prod(x_shape[:axis]), x_shape[axis], math.prod(x_shape[axis + 1:])

    def _axis(self, rank: int) -> int:
        if not -rank <= self.axis < rank:
            raise argument_error(self.node, f"axis {self.axis} is out of range for a rank-{rank} input")
        return self.axis % rank

    def expand(self, param: np.ndarray, x_shape: tuple[int, ...]) -> np.ndarray:
        """``param`` (a scale or zero point) shaped to broadcast elementwise against ``x``."""
        if param.size == 1 and param.ndim <= 1:  # one block covering everything is per-tensor too
            return param.reshape(())
        if not self.per_axis or not x_shape:
            raise argument_error(self.node, f"a parameter of shape {param.shape} needs per-tensor (scalar) form here")
        axis = self._axis(len(x_shape))
        if not self.block_size:
            if param.ndim != 1 or param.shape[0] != x_shape[axis]:
                raise argument_error(
                    self.node, f"per-axis parameter of shape {param.shape} does not match dimension {axis} "
                    f"({x_shape[axis]}) of the input {x_shape}"
                )
            return param.reshape((-1,) + (1,) * (len(x_shape) - 1 - axis))
        return self._blocked(param, x_shape, axis)

    def _blocked(self, param, x_shape, axis):
        b = self.block_size
        others_match = param.ndim == len(x_shape) and all(
            p == d for i, (p, d) in enumerate(zip(param.shape, x_shape)) if i != axis
        )
        # Every block but the last is full: Si blocks of size B cover Di, and Si - 1 do not.
        if not others_match or not (param.shape[axis] - 1) * b < x_shape[axis] <= param.shape[axis] * b:
            raise argument_error(
                self.node, f"blocked parameter of shape {param.shape} does not fit input {x_shape} with "
                f"axis {axis} and block_size {b}"
            )
        return np.repeat(param, b, axis=axis)[(slice(None),) * axis + (slice(0, x_shape[axis]),)]


# -- QuantizeLinear ---------------------------------------------------------------------------------


@functools.cache
def _integer_range(target: DataType) -> tuple[int, int]:
    info = ml_dtypes.iinfo(target.numpy)
    return int(info.min), int(info.max)


@quiet
def _to_quantized(values: np.ndarray, zero_point, target: DataType, saturate: bool = True) -> np.ndarray:
    """``values`` (already divided by the scale) plus the zero point, rounded and saturated to ``target``.

    Integers round half to even before the zero point is added (an integer, so the order is moot);
    float targets add the zero point in float and round once, in the cast.
    """
    zero = 0 if zero_point is None else zero_point
    if target in _INTEGER_TARGETS:
        low, high = _integer_range(target)
        wide = np.rint(values.astype(np.float64)) + np.asarray(zero).astype(np.float64)
        return np.clip(wide, low, high).astype(target.numpy)
    wide = values.astype(np.float32) + np.asarray(zero).astype(np.float32)
    return cast_to(wide, target, saturate)


@quiet
def _divide(x: np.ndarray, scale: np.ndarray, precision: np.dtype) -> np.ndarray:
    """``x / scale`` at ``precision``: both operands round to it, and their float32 quotient then
    rounds to float16/bfloat16 exactly as a native division would; int32 divides in float64."""
    if precision == np.int32:
        return x.astype(np.float64) / scale.astype(np.float64)
    quotient = x.astype(precision).astype(np.float32) / scale.astype(precision).astype(np.float32)
    return quotient.astype(precision).astype(np.float32, copy=False)


_F32 = np.dtype(np.float32)
_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
# The targets the compiled loops (compiled/quantize.py) take: float32 data to 8- and 16-bit integers.
_COMPILED_TARGETS = {DataType.UINT8, DataType.INT8, DataType.UINT16, DataType.INT16}
_COMPILED_CODES = {t.numpy for t in _COMPILED_TARGETS}


def _layout(granularity: _Granularity, x: np.ndarray, scale: np.ndarray, zero_point) -> tuple | None:
    """(outer, C, inner) for the compiled loops when the parameters are per tensor or per axis, else None."""
    layout = granularity.channels(scale, x.shape)
    if layout is None or (zero_point is not None and zero_point.size != scale.size):
        return None
    if x.size == 0:
        return None
    return layout


def _channel_params(scale: np.ndarray, zero_point) -> tuple[np.ndarray, np.ndarray]:
    """The scale (float32) and zero point (int32) as one value per channel."""
    flat = scale.reshape(-1)
    zero = np.zeros(flat.shape, np.int32) if zero_point is None else zero_point.reshape(-1).astype(np.int32)
    return flat, zero


class _FastPath:
    """A Q/DQ kernel's compiled-loop arguments, worked out once per input shape and type while the same
    constant scale and zero point come in (fed parameters are worked out on every call)."""

    __slots__ = ("_entry",)

    def __init__(self):
        self._entry = None

    def get(self, x, scale, zero_point, build):
        entry = self._entry  # one read: another thread may swap in a new entry meanwhile
        if entry is not None and entry[0] == x.shape and entry[1] is x.dtype and entry[2] is scale \
                and entry[3] is zero_point:
            return entry[4]
        value = build(x, scale, zero_point)
        if not scale.flags.writeable and (zero_point is None or not zero_point.flags.writeable):
            self._entry = (x.shape, x.dtype, scale, zero_point, value)
        return value


def _quantize_target(node, zero_point, output_dtype: DataType | None) -> DataType:
    if zero_point is None:
        return output_dtype or DataType.UINT8
    target = DataType.from_numpy(zero_point.dtype)
    if output_dtype is not None and output_dtype is not target:
        raise argument_error(
            node, f"y_zero_point is {target.name} but attribute 'output_dtype' asks for {output_dtype.name}; "
            "they must agree"
        )
    if target not in _INTEGER_TARGETS | _FLOAT_TARGETS:
        raise argument_error(node, f"y_zero_point has type {target.name}, which is not a quantized type")
    return target


def _quantize_factory(node, *, per_axis=True, blocked=False, saturating=False, typed=False, precise=False):
    granularity = _Granularity(node, per_axis=per_axis, blocked=blocked)
    saturate = bool(node.attr("saturate", 1)) if saturating else True
    output_dtype = _type_attr(node, "output_dtype", _INTEGER_TARGETS | _FLOAT_TARGETS) if typed else None
    precision = _type_attr(node, "precision", _PRECISIONS) if precise else None

    fast = _FastPath()

    def compiled_call(x, y_scale, y_zero_point):
        """(layout, codes' type, low, high, scales, zero points) of the compiled loop, or None."""
        target = _quantize_target(node, y_zero_point, output_dtype)
        if (target in _COMPILED_TARGETS and x.dtype == _F32 and y_scale.dtype == _F32
                and (precision is None or precision is DataType.FLOAT)):
            layout = _layout(granularity, x, y_scale, y_zero_point)
            if layout is not None:
                return (layout, target.numpy, *_integer_range(target), *_channel_params(y_scale, y_zero_point))
        return None

    from ..compiled import quantize as compiled  # once here: an import statement costs a call microseconds

    def kernel(x, y_scale, y_zero_point=None):
        call = fast.get(x, y_scale, y_zero_point, compiled_call)
        if call is not None:
            layout, dtype, low, high, scales, zeros = call
            out = np.empty(x.shape, dtype)
            compiled.quantize(np.ascontiguousarray(x).reshape(layout), scales, zeros, low, high, out.reshape(layout))
            return (out,)
        target = _quantize_target(node, y_zero_point, output_dtype)
        scale = granularity.expand(y_scale, x.shape)
        zero = None if y_zero_point is None else granularity.expand(y_zero_point, x.shape)
        # The division runs at the precision attribute's type, else the scale's (float32 for float8e8m0).
        dtype = precision.numpy if precision is not None else y_scale.dtype
        if DataType.from_numpy(dtype) not in _PRECISIONS:
            dtype = np.dtype(np.float32)
        return (_to_quantized(_divide(x, scale, np.dtype(dtype)), zero, target, saturate),)

    return kernel


@register("QuantizeLinear", since=10)
def quantize_linear_10(node, shapes, opset):
    return _quantize_factory(node, per_axis=False)


@register("QuantizeLinear", since=13)
def quantize_linear_13(node, shapes, opset):
    return _quantize_factory(node)


@register("QuantizeLinear", since=19)
def quantize_linear_19(node, shapes, opset):
    return _quantize_factory(node, saturating=True)


@register("QuantizeLinear", since=21)
def quantize_linear_21(node, shapes, opset):
    return _quantize_factory(node, blocked=True, saturating=True, typed=True)


# 23 adds 'precision' and float4e2m1; 24, 25 and 28 only add types (float8e8m0 scales, 2-bit integers).
@register("QuantizeLinear", since=23)
def quantize_linear_23(node, shapes, opset):
    return _quantize_factory(node, blocked=True, saturating=True, typed=True, precise=True)


# -- DequantizeLinear -------------------------------------------------------------------------------


def _centered(x: np.ndarray, zero_point) -> np.ndarray:
    """``x - zero_point``, exactly: in int64 for integer types, in float32 for float8/float4."""
    if DataType.from_numpy(x.dtype).is_float:
        wide = x.astype(np.float32)
        return wide if zero_point is None else wide - np.asarray(zero_point).astype(np.float32)
    wide = x.astype(np.int64)
    return wide if zero_point is None else wide - np.asarray(zero_point).astype(np.int64)


def _dequantize_factory(node, *, per_axis=True, blocked=False, typed=False):
    granularity = _Granularity(node, per_axis=per_axis, blocked=blocked)
    output_dtype = _type_attr(node, "output_dtype", _DEQUANTIZED) if typed else None

    fast = _FastPath()

    def compiled_call(x, x_scale, x_zero_point):
        """(layout, scales, zero points) of the compiled loop, or None."""
        out = output_dtype or DataType.from_numpy(x_scale.dtype)
        if x.dtype in _COMPILED_CODES and x_scale.dtype == _F32 and out is DataType.FLOAT:
            layout = _layout(granularity, x, x_scale, x_zero_point)
            if layout is not None:
                return (layout, *_channel_params(x_scale, x_zero_point))
        return None

    from ..compiled import quantize as compiled

    def kernel(x, x_scale, x_zero_point=None):
        call = fast.get(x, x_scale, x_zero_point, compiled_call)
        if call is not None:
            layout, scales, zeros = call
            y = np.empty(x.shape, _F32)
            compiled.dequantize(np.ascontiguousarray(x).reshape(layout), scales, zeros, y.reshape(layout))
            return (y,)
        out = output_dtype or DataType.from_numpy(x_scale.dtype)
        if out not in _DEQUANTIZED:
            raise argument_error(
                node, f"x_scale is {out.name}, which is no output type; set attribute 'output_dtype'"
            )
        scale = granularity.expand(x_scale, x.shape)
        zero = None if x_zero_point is None else granularity.expand(x_zero_point, x.shape)
        # Multiply in float32 and round once to the output type: a half-precision output gets the
        # nearest value to the exact product.
        y = _centered(x, zero).astype(np.float32, copy=False) * scale.astype(np.float32)
        return (np.asarray(y).astype(out.numpy, copy=False),)

    return kernel


@register("DequantizeLinear", since=10)
def dequantize_linear_10(node, shapes, opset):
    return _dequantize_factory(node, per_axis=False)


@register("DequantizeLinear", since=13)
def dequantize_linear_13(node, shapes, opset):
    return _dequantize_factory(node)


# 19 adds float8 inputs and half-precision scales, which the opset-13 kernel already handles; 21 adds
# blocks; 23 adds 'output_dtype'; 24, 25 and 28 only add types.
@register("DequantizeLinear", since=21)
def dequantize_linear_21(node, shapes, opset):
    return _dequantize_factory(node, blocked=True)


@register("DequantizeLinear", since=23)
def dequantize_linear_23(node, shapes, opset):
    return _dequantize_factory(node, blocked=True, typed=True)


# -- QuantizeDequantize (qdq_fusions.py): a QuantizeLinear read only by equal DequantizeLinears -----


@register("QuantizeDequantize", domain=FUSED_DOMAIN, since=1)
def quantize_dequantize(node, shapes, opset):
    """DequantizeLinear(QuantizeLinear(x, scale, zero), scale, zero) of the QuantizeLinear opset ``opset``
    (an attribute), in one compiled pass for float32 data, else through the two kernels."""
    version = int(node.attr("opset", 13))
    per_axis = version >= 13
    quantize = _quantize_factory(node, per_axis=per_axis)
    dequantize = _dequantize_factory(node, per_axis=per_axis)
    granularity = _Granularity(node, per_axis=per_axis, blocked=False)
    prepared = Prepared()
    from ..compiled import quantize as compiled

    def compiled_params(scale, zero_point):
        """(scale, zero point, low, high) for the compiled loop, or None (other types): built once per
        constant scale and zero point, as the pass only fuses constant ones."""
        target = DataType.from_numpy(zero_point.dtype)
        if target not in _COMPILED_TARGETS or scale.dtype != _F32 or zero_point.size != scale.size:
            return None
        return (*_channel_params(scale, zero_point), *_integer_range(target))

    last: list = [None, None, None]  # the constant scale and zero point of the last call, and their params
    # The last compiled call's (x's shape, scale, zero point, the loop's bound entry point, its parameters, the
    # layout): a decode step rounds the same shapes every run, where the dispatcher's typing of six arguments
    # costs more than a few hundred values' rounding.
    kept = (None,) * 6
    bind = EntryOnce(compiled.fake_quantize)

    def kernel(x, scale, zero_point):
        nonlocal kept
        shape, kept_scale, kept_zero, entry, kept_params, kept_layout = kept  # (one read: threads)
        if x.shape == shape and scale is kept_scale and zero_point is kept_zero and x.dtype is _F32 \
                and x.flags.c_contiguous:
            y = np.empty(shape, _F32)
            entry(x.reshape(kept_layout), *kept_params, y.reshape(kept_layout))
            return (y,)
        if last[0] is scale and last[1] is zero_point:
            params = last[2]  # the usual call: the same constant arrays, no key to build
        else:
            params = prepared.get("params", (scale, zero_point), lambda: compiled_params(scale, zero_point))
            if not scale.flags.writeable and not zero_point.flags.writeable:
                last[:] = [scale, zero_point, params]
        if params is not None and x.dtype is _F32 and (x.size or scale.size == 1):
            if not x.size:  # nothing to round (a prefill's empty past): the two kernels' checks cost ~15 us
                return (np.empty(x.shape, _F32),)
            layout = (1, 1, x.size) if scale.size == 1 else granularity.channels(scale, x.shape)
            if layout is not None:
                y = np.empty(x.shape, _F32)
                arguments = (np.ascontiguousarray(x).reshape(layout), *params, y.reshape(layout))
                compiled.fake_quantize(*arguments)
                kept = _kept_rounding(bind, x, scale, zero_point, last, arguments) or kept
                return (y,)
        return dequantize(quantize(x, scale, zero_point)[0], scale, zero_point)

    kernel.bind = _rounding_binder(granularity, lambda scale, zero_point: prepared.get(
        "params", (scale, zero_point), lambda: compiled_params(scale, zero_point)))
    return shape_free(kernel)  # (its layout is taken per call)


def _kept_rounding(bind, x, scale, zero_point, last: list, arguments: tuple) -> tuple | None:
    """quantize_dequantize's kept call for a contiguous ``x`` and constant parameters (those ``last`` holds): (x's
    shape, scale, zero point, fake_quantize's entry point (``bind``, an EntryOnce), its parameters, the layout),
    or None."""
    if last[0] is not scale or last[1] is not zero_point or not x.flags.c_contiguous:
        return None
    bound = bind(arguments)
    return None if bound is None else (x.shape, scale, zero_point, bound, arguments[1:-1], arguments[0].shape)


def _rounding_binder(granularity, params_of):
    """QuantizeDequantize's ``bind``: the compiled rounding as one prepared call over a segment's buffers
    (algorithms/segment_steps.py), for float32 data and constant parameters the compiled loop takes
    (``params_of(scale, zero_point)``: its (scales, zero points, low, high), or None); None otherwise (the
    kernel runs)."""
    from ..compiled import quantize as compiled

    def bind(inputs, outputs, constant):
        x, scale, zero_point = (list(inputs) + [None])[:3]
        y = outputs[0]
        if len(constant) < 3 or not (constant[1] and constant[2]) or x is None or x.dtype != _F32 \
                or y.dtype != _F32 or x.shape != y.shape or not x.size:
            return None
        params = params_of(scale, zero_point)
        layout = None if params is None else (1, 1, x.size) if scale.size == 1 else granularity.channels(scale,
                                                                                                         x.shape)
        if layout is None:
            return None
        return [(compiled.fake_quantize, (x.reshape(layout), *params, y.reshape(layout)))]

    return bind


# -- DynamicQuantizeLinear --------------------------------------------------------------------------


@register("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(node, shapes, opset):
    """An all-zero (or empty) input has range [0, 0], where the spec's scale formula divides by zero. This
    follows onnx's reference implementation, the spec's executable form: a unit range, scale 1/255.
    onnxruntime returns scale 1 there instead; the codes and the zero point (all 0) agree, and so does every
    value they dequantize to."""
    low, high = _integer_range(DataType.UINT8)

    from ..compiled import quantize as compiled

    @quiet
    def kernel(x):
        x = x.astype(np.float32, copy=False)
        if x.size:
            y = np.empty(x.shape, np.uint8)
            scale, zero_point = compiled.dynamic_quantize(np.ascontiguousarray(x).reshape(-1), y.reshape(-1))
            # The compiled loop's float32 results come back as Python floats, exactly.
            return y, np.asarray(scale, np.float32), np.asarray(zero_point, np.uint8)
        # Empty: the range is [0, 0], which takes a unit scale.
        return x.astype(np.uint8), np.asarray(np.float32(1) / np.float32(high - low)), np.asarray(0, np.uint8)

    return kernel


# -- QLinearMatMul, QLinearConv, ConvInteger --------------------------------------------------------


def _rows(param: np.ndarray, operand: np.ndarray) -> np.ndarray:
    """A 1-D per-row parameter of a matrix operand (length M) broadcast along its rows."""
    return zero_point_rows(param, operand) if param.ndim == 1 else param


@register("MatMulInteger", since=10)
def matmul_integer(node, shapes, opset):
    product = IntegerProduct()

    def kernel(a, b, a_zero_point=None, b_zero_point=None):
        y = product(a, b, a_zero_point, b_zero_point)
        if y is not None:
            return (y,)
        # Batched B, or zero points of other shapes: float64 holds every partial sum of 8-bit products
        # exactly (K up to ~1e11) and uses BLAS.
        af = a.astype(np.float64)
        if a_zero_point is not None:
            af -= zero_point_rows(a_zero_point, a)
        bf = b.astype(np.float64)
        if b_zero_point is not None:
            bf -= b_zero_point
        # Through int64 so that sums past int32 wrap like the integer accumulation they stand for.
        return (np.matmul(af, bf).astype(np.int64).astype(np.int32),)

    return kernel


def qlinear_matmul_general(node, shapes, opset):
    """QLinearMatMul for every type and parameter shape (registered through ops/qdq_linear.py, which runs the
    8-bit per-tensor and per-column cases in one compiled pass)."""
    integer_product = IntegerProduct()

    # 21 adds float8 operands and half-precision scales; the same arithmetic covers them.
    def kernel(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
        for name, codes, zero in (("a", a, a_zero_point), ("b", b, b_zero_point)):
            if zero.dtype != codes.dtype:  # (what the codes mean depends on it: never read one type as the other)
                raise InvalidArgumentError(
                    f"node {node.name!r} (QLinearMatMul): {name}_zero_point is {zero.dtype} but {name} is "
                    f"{codes.dtype}; ONNX requires the same type: feed the zero point in {codes.dtype}")
        if a_scale.size == 1 and y_scale.size == 1 and y_zero_point.size == 1:
            acc = integer_product(a, b, a_zero_point, b_zero_point)
            if acc is not None:
                # The exact integer sum, rescaled once in float64.
                multiplier = a_scale.astype(np.float64).reshape(()) * b_scale.astype(np.float64).reshape(-1)
                multiplier = multiplier / float(y_scale.reshape(()))
                if y_zero_point.dtype in _EIGHT_BIT and acc.size and multiplier.size in (1, acc.shape[-1]):
                    return (_requantized(acc, (-1, acc.shape[-1], 1), None, multiplier, y_zero_point),)
                target = DataType.from_numpy(y_zero_point.dtype)
                return (_to_quantized(acc * multiplier, y_zero_point.reshape(()), target),)
        a_real = _centered(a, _rows(a_zero_point, a)) * _rows(a_scale, a).astype(np.float64)
        b_real = _centered(b, b_zero_point) * b_scale.astype(np.float64)
        product = np.asarray(np.matmul(a_real, b_real))
        values = product / _rows(y_scale, product).astype(np.float64)
        target = DataType.from_numpy(y_zero_point.dtype)
        return (_to_quantized(values, _rows(y_zero_point, product), target),)

    return kernel


def _output_channels(param: np.ndarray, ndim: int) -> np.ndarray:
    """A per-tensor or per-output-channel (M,) parameter shaped to broadcast over (N, M, ...)."""
    return param.reshape(()) if param.size == 1 else param.reshape((-1,) + (1,) * (ndim - 2))


# Every integer of magnitude up to 2**24 is a float32, and so is every partial sum of such a convolution
# that stays below it: then float32 arithmetic (any order, fused multiply-adds or not) is exact.
_FLOAT32_EXACT = float(1 << 24)


def integer_conv(node, shapes, opset):
    """conv(x - x_zero_point, w - w_zero_point), exactly, through the float Conv kernel: in float32 when the
    weights bound every partial sum below 2**24 (255 times the largest sum of |w - w_zero| over one output
    channel's taps), else in float64. Returns float32 or float64 integers.

    Padding the centred input with zeros pads the raw input with its zero point, as ONNX requires.
    ``quantize`` (scale, low, high), when given, makes x's codes from float32 ``x`` here, as QuantizeLinear
    with that scale and x_zero_point does, centred in the same pass (the fused QDQ convolution).
    """
    from .conv import conv  # (the float Conv kernel and its algorithms: imported by convolutions only)

    float_conv = conv(node, shapes[:1] if shapes else shapes, opset)
    prepared = Prepared()
    last: list = [None, None, None]  # the constant weight and its zero point of the last call, then the centred weight
    from ..compiled import quantize as compiled

    def centred_weight(w, w_zero):
        wc = _centered(w, w_zero)
        bound = float(np.abs(wc).reshape(wc.shape[0], -1).sum(axis=1).max()) if wc.size else 0.0
        narrow = w.dtype in _EIGHT_BIT and bound * 255 < _FLOAT32_EXACT
        wc = wc.astype(np.float32 if narrow else np.float64)
        wc.flags.writeable = False  # a constant for the conv kernel's own prepared transforms
        return wc

    def run(x, w, x_zero_point, w_zero_point, quantize=None):
        if w.ndim < 3 or x.ndim != w.ndim:
            raise argument_error(node, f"input {x.shape} and weight {w.shape} must have one rank of at least 3 "
                                       f"(batch or output channels, channels, spatial axes)")
        if x_zero_point is not None and x_zero_point.size != 1:
            raise argument_error(node, f"x_zero_point has shape {x_zero_point.shape}; expected a scalar")
        x_zero = None if x_zero_point is None else x_zero_point.reshape(())
        if last[0] is w and last[1] is w_zero_point:
            wc = last[2]  # the usual call: the same constant weight, no key to build
        else:
            # The weight's leading dim is its output channel: (M,) zero points broadcast as (M, 1, ...).
            w_zero = None if w_zero_point is None else _output_channels(w_zero_point, w.ndim + 1)
            wc = prepared.get("weight", (w, w_zero_point), lambda: centred_weight(w, w_zero))
            if not w.flags.writeable and (w_zero_point is None or not w_zero_point.flags.writeable):
                last[:] = [w, w_zero_point, wc]
        if quantize is not None:
            xc = np.empty(x.shape, wc.dtype)
            compiled.quantize_centred(np.ascontiguousarray(x).reshape(-1), quantize[0], 0 if x_zero is None else
                                      int(x_zero), quantize[1], quantize[2], xc.reshape(-1))
            return float_conv(xc, wc)[0]
        dtype = wc.dtype if x.dtype in _EIGHT_BIT else np.dtype(np.float64)
        # x - x_zero in one pass (the difference of two integers is exact in either float type)
        xc = x.astype(dtype) if x_zero is None else np.subtract(x, x_zero.astype(dtype), dtype=dtype)
        return float_conv(xc, wc.astype(dtype, copy=False))[0]

    return run


@register("ConvInteger", since=10)
def conv_integer(node, shapes, opset):
    run = integer_conv(node, shapes, opset)

    def kernel(x, w, x_zero_point=None, w_zero_point=None):
        # Through int64 so that sums past int32 wrap like the 32-bit accumulation they stand for.
        return (run(x, w, x_zero_point, w_zero_point).astype(np.int64).astype(np.int32),)

    return kernel


def _requantized(acc, layout, bias, multiplier, zero_point) -> np.ndarray:
    """compiled/quantize.requantize of an integer accumulator viewed as (outer, C, inner): + bias[c], times
    multiplier[c] (float64), rounded, + the zero point, saturated to its 8-bit type."""
    from ..compiled import quantize as compiled

    dtype = zero_point.dtype
    low, high = _integer_range(DataType.from_numpy(dtype))
    bias64 = np.zeros(1) if bias is None else bias.astype(np.float64).reshape(-1)
    out = np.empty(acc.shape, dtype)
    compiled.requantize(np.ascontiguousarray(acc).reshape(layout), bias64, multiplier, int(zero_point.reshape(())),
                        low, high, out.reshape(layout))
    return out


@register("QLinearConv", since=10)
def qlinear_conv(node, shapes, opset):
    run = integer_conv(node, shapes, opset)
    last: list = [None] * 6  # the constant parameters of the last call (5), then what requantizing takes of them
    from ..compiled import quantize as compiled

    def requantization(x_scale, w_scale, y_scale, y_zero_point, bias) -> tuple:
        """compiled/quantize.requantize's bias, multiplier (the float64 values the numpy path forms), zero point
        and code range."""
        multiplier = x_scale.astype(np.float64).reshape(()) * w_scale.astype(np.float64).reshape(-1)
        low, high = _integer_range(DataType.from_numpy(y_zero_point.dtype))
        bias64 = np.zeros(1) if bias is None else bias.astype(np.float64).reshape(-1)
        return bias64, multiplier / float(y_scale.reshape(())), int(y_zero_point.reshape(())), low, high

    from .qlinear_conv_rows import patch_rows_conv

    fast = patch_rows_conv(node)  # group 1: patch rows times the packed weight in one compiled call

    def kernel(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, bias=None):
        out = fast(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, bias)
        if out is not None:
            return (out,)
        acc = run(x, w, x_zero_point, w_zero_point)
        if y_zero_point.dtype in _EIGHT_BIT and acc.ndim >= 2 and acc.size and y_zero_point.size == 1 \
                and (bias is None or bias.size == acc.shape[1]) and w_scale.size in (1, acc.shape[1]):
            # The same float64 arithmetic in one compiled pass.
            if last[0] is x_scale and last[1] is w_scale and last[2] is y_scale and last[3] is y_zero_point \
                    and last[4] is bias:
                params = last[5]
            else:
                params = requantization(x_scale, w_scale, y_scale, y_zero_point, bias)
                if not any(p is not None and p.flags.writeable for p in (x_scale, w_scale, y_scale, y_zero_point,
                                                                         bias)):
                    last[:] = [x_scale, w_scale, y_scale, y_zero_point, bias, params]
            out = np.empty(acc.shape, y_zero_point.dtype)
            layout = (acc.shape[0], acc.shape[1], -1)
            compiled.requantize(np.ascontiguousarray(acc).reshape(layout), *params, out.reshape(layout))
            return (out,)
        acc = acc.astype(np.float64, copy=False)
        if bias is not None:
            acc += _output_channels(bias, acc.ndim)
        # The bias is quantized with scale x_scale * w_scale, so it joins the sum before rescaling.
        multiplier = x_scale.astype(np.float64).reshape(()) * _output_channels(w_scale, acc.ndim).astype(np.float64)
        values = acc * (multiplier / y_scale.astype(np.float64).reshape(()))
        target = DataType.from_numpy(y_zero_point.dtype)
        return (_to_quantized(values, y_zero_point.reshape(()), target),)

    return kernel


# -- BitCast ----------------------------------------------------------------------------------------


@register("BitCast", since=26)
def bit_cast(node, shapes, opset):
    to = node.attr("to")
    try:
        target = DataType(int(to))
    except (TypeError, ValueError):
        target = None
    if target in (None, DataType.UNDEFINED, DataType.STRING):
        raise _error(node, "to", f"is {to!r}; expected a non-string ONNX tensor data type")

    def kernel(x):
        source = DataType.from_numpy(x.dtype)
        if source is DataType.STRING or source.bits != target.bits:
            raise argument_error(
                node, f"cannot bit-cast {source.name} to {target.name}: the bit widths differ"
            )
        if target.is_packed:
            # ml_dtypes keeps a sub-byte value in the low bits of its byte; keep only those bits.
            bits = x.view(np.uint8) & np.uint8((1 << target.bits) - 1)
            return (bits.view(target.numpy),)
        return (x.view(target.numpy),)

    return kernel
