"""onnxruntime's quantized contrib operators (domain com.microsoft), as docs/ContribOperators.md defines them:
the QLinear elementwise (Add, Mul, Where), activation, softmax, concat and pooling operators, QGemm,
MatMulIntegerToFloat, DynamicQuantizeMatMul, and the contrib QuantizeLinear/DequantizeLinear.

Operators defined as quantize(f(dequantize(x))) compute f on the float32 tensor DequantizeLinear gives and
quantize it as QuantizeLinear does (float32 division, ties to even, saturation). Products of integers
accumulate exactly (algorithms/quantize.py) and wrap as a 32-bit accumulator would; the float rescaling
that follows runs in float64 and rounds once.
"""

from __future__ import annotations

import functools
import math
from operator import is_

import numpy as np
from onnx_runtime.dtypes import DataType

from ..algorithms.activations import sigmoid
from ..algorithms.prepared import Prepared
from ..algorithms.qlinear_layout import binary_layout
from ..algorithms.quantize import (
    IntegerProduct,
    apply_table,
    dequantize,
    dynamic_uint8,
    int_matmul,
    integer_range,
    lookup_table,
    quantize,
    round_saturate,
    widen,
)
from ..algorithms.repeat_call import RepeatCall
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error, graph_error, normalize_axis, required_attr
from .pool import average_pool

_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


# -- input checks ----------------------------------------------------------------------------------


def eight_bit(node, name: str, x: np.ndarray) -> np.dtype:
    if x.dtype not in _EIGHT_BIT:
        raise argument_error(node, f"input {name!r} is {x.dtype}; expected uint8 or int8")
    return x.dtype


def scalar(node, name: str, value: np.ndarray | None, dtype=None):
    """A per-tensor parameter: a scalar or one-element tensor (of ``dtype`` when given), or None."""
    if value is None:
        return None
    if value.size != 1:
        raise argument_error(node, f"input {name!r} has shape {value.shape}; expected a scalar (per-tensor)")
    if dtype is not None and value.dtype != dtype:
        raise argument_error(node, f"input {name!r} is {value.dtype}; expected {np.dtype(dtype)} like the data")
    return value.reshape(())


def float_scale(node, name: str, value: np.ndarray):
    if value.dtype != _F32:
        raise argument_error(node, f"input {name!r} is {value.dtype}; expected float32")
    return scalar(node, name, value)


def same_type(node, names: tuple[str, str], a: np.ndarray, b: np.ndarray) -> None:
    if a.dtype != b.dtype:
        raise argument_error(node, f"inputs {names[0]!r} ({a.dtype}) and {names[1]!r} ({b.dtype}) must have one type")


# -- QLinearAdd, QLinearMul ------------------------------------------------------------------------


def _binary(node, combine):
    """C = combine(A, B) on the real values, requantized: the zero points come off exactly (int64), the scales
    join in float64, and the result rounds once (in one compiled pass for the common broadcasts). The checked
    parameters are kept while the same constant arrays come in, and the layout per pair of input shapes."""
    from ..compiled import quantize as compiled  # once here: an import statement costs each call microseconds

    multiply = combine is _mul
    last: list = [(), None]
    layouts: dict = {}
    # the last compiled call: A's shape and type, the six parameter arrays, and (B's shape, the output shape, the
    # loop's arguments after the operands)
    repeat = RepeatCall()

    def parameters(a, b, params):
        dtype = eight_bit(node, "A", a)
        same_type(node, ("A", "B"), a, b)
        a_scale, a_zero_point, b_scale, b_zero_point, c_scale, c_zero_point = params
        zeros = [scalar(node, n, z, dtype) for n, z in
                 (("A_zero_point", a_zero_point), ("B_zero_point", b_zero_point), ("C_zero_point", c_zero_point))]
        scales = [float_scale(node, n, s) for n, s in
                  (("A_scale", a_scale), ("B_scale", b_scale), ("C_scale", c_scale))]
        compiled = (np.array([0 if z is None else int(z) for z in zeros], np.int64),
                    np.array([float(s) for s in scales], np.float64), *integer_range(dtype))
        found = (dtype, zeros, scales, compiled)
        if all(p is None or not p.flags.writeable for p in params):
            last[:] = [params, found]
        return found

    def kernel(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point=None):
        params = (a_scale, a_zero_point, b_scale, b_zero_point, c_scale, c_zero_point)
        kept = repeat.match(a, params)  # a run repeats its shapes and constant parameters: one comparison each
        if kept is not None and b.shape == kept[0] and b.dtype is a.dtype:
            out = np.empty(kept[1], a.dtype)
            arguments = kept[2]
            compiled.requantize_binary(np.ascontiguousarray(a).reshape(-1), arguments[0],
                                       np.ascontiguousarray(b).reshape(-1), *arguments[1:-1],
                                       out.reshape(arguments[-1]))
            return (out,)
        seen, found = last
        if not (len(seen) == 6 and all(map(is_, seen, params)) and a.dtype is found[0] and b.dtype is found[0]):
            found = parameters(a, b, params)
        dtype, zeros, scales, compiled_params = found
        shape, steps = _layout_of(node, layouts, a.shape, b.shape)
        if steps is not None:
            out = np.empty(shape, dtype)
            arguments = (steps[1], steps[2], *compiled_params, multiply, (-1, steps[0]))
            compiled.requantize_binary(np.ascontiguousarray(a).reshape(-1), arguments[0],
                                       np.ascontiguousarray(b).reshape(-1), *arguments[1:-1],
                                       out.reshape(arguments[-1]))
            if last[1] is found:  # constant parameters: the next call with these arrays and shapes skips the checks
                repeat.keep(a, params, (b.shape, shape, arguments))
            return (out,)
        values = combine(widen(a, zeros[0]), widen(b, zeros[1]), *(s.astype(_F64) for s in scales))
        return (round_saturate(values, zeros[2], dtype),)

    return kernel


def _layout_of(node, layouts: dict, a_shape, b_shape) -> tuple:
    """(output shape, binary_layout's answer) for a pair of input shapes, remembered for up to 64 pairs."""
    key = (a_shape, b_shape)
    layout = layouts.get(key)
    if layout is None:
        try:
            shape = np.broadcast_shapes(a_shape, b_shape)
        except ValueError:
            raise argument_error(node, f"A {a_shape} and B {b_shape} do not broadcast") from None
        layout = (shape, binary_layout(a_shape, b_shape, shape))
        if len(layouts) < 64:
            layouts[key] = layout
    return layout


def _add(a, b, a_scale, b_scale, c_scale):
    return (a_scale * a + b_scale * b) / c_scale


def _mul(a, b, a_scale, b_scale, c_scale):
    return (a * b) * (a_scale * b_scale / c_scale)


@register("QLinearAdd", domain=CONTRIB_DOMAIN, since=1)
def qlinear_add(node, shapes, opset):
    return _binary(node, _add)


@register("QLinearMul", domain=CONTRIB_DOMAIN, since=1)
def qlinear_mul(node, shapes, opset):
    return _binary(node, _mul)


# -- QLinearSigmoid, QLinearLeakyRelu: one 256-entry table per set of quantization parameters ------


def _table_op(node, fn):
    last = (None, None)  # (parameters, table): constant parameters build the table once

    def kernel(x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        dtype = eight_bit(node, "X", x)
        if y_scale is None:
            raise argument_error(node, "input 'Y_scale' is missing; expected a float32 scalar")
        params = (float_scale(node, "X_scale", x_scale), scalar(node, "X_zero_point", x_zero_point, dtype),
                  float_scale(node, "Y_scale", y_scale), scalar(node, "Y_zero_point", y_zero_point, dtype))
        nonlocal last
        key = (dtype.str,) + tuple(None if p is None else p.item() for p in params)
        table = last[1] if last[0] == key else None
        if table is None:
            table = lookup_table(dtype, params[0], params[1], fn, params[2], params[3])
            last = (key, table)
        return (apply_table(table, x),)

    return kernel


def _sigmoid_f32(x):
    # In float64, rounded once to float32: the exact sigmoid of each float32 input.
    return sigmoid(x.astype(_F64)).astype(_F32)


@register("QLinearSigmoid", domain=CONTRIB_DOMAIN, since=1)
def qlinear_sigmoid(node, shapes, opset):
    return _table_op(node, _sigmoid_f32)


@register("QLinearLeakyRelu", domain=CONTRIB_DOMAIN, since=1)
def qlinear_leaky_relu(node, shapes, opset):
    alpha = _F32.type(node.attr("alpha", 0.01))
    return _table_op(node, lambda x: np.where(x >= 0, x, alpha * x))


# -- QLinearSoftmax --------------------------------------------------------------------------------


@register("QLinearSoftmax", domain=CONTRIB_DOMAIN, since=1)
def qlinear_softmax(node, shapes, opset):
    version = int(required_attr(node, "opset", "the opset of the Softmax it replaces (e.g. 13)"))
    axis = int(node.attr("axis", 1 if version < 13 else -1))

    def kernel(x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        dtype = eight_bit(node, "X", x)
        if y_scale is None:
            raise argument_error(node, "input 'y_scale' is missing; expected a float32 scalar")
        scale = float_scale(node, "X_scale", x_scale).astype(_F64)
        scalar(node, "x_zero_point", x_zero_point, dtype)  # softmax is shift-invariant: checked, then unused
        y_zero = scalar(node, "y_zero_point", y_zero_point, dtype)
        if x.size == 0:
            return (x.copy(),)
        a = normalize_axis(node, axis, x.ndim)
        y_scale_value = float_scale(node, "y_scale", y_scale)
        if a == x.ndim - 1 and y_zero is not None:  # rows along the last axis (either opset): one compiled pass
            return (_softmax_rows(x, float(scale), y_scale_value, y_zero, dtype),)
        # Before opset 13 softmax runs over the input flattened to 2-D at the axis.
        rows = x.reshape(math.prod(x.shape[:a]), -1) if version < 13 else x
        along = 1 if version < 13 else a
        centered = widen(rows) - widen(rows).max(axis=along, keepdims=True)
        e = np.exp(centered * scale)
        p = (e / e.sum(axis=along, keepdims=True)).astype(_F32)
        return (quantize(p, y_scale_value, y_zero, dtype).reshape(x.shape),)

    return kernel


@functools.lru_cache(maxsize=64)
def _exp_table(x_scale: float) -> np.ndarray:
    """exp(-d * x_scale) for every difference d = max - x of 8-bit codes (0..255), in float64: the values
    exp((x - max) * x_scale) takes."""
    table = np.exp(np.arange(0, -256, -1, dtype=np.int64) * x_scale)
    table.flags.writeable = False
    return table


def _softmax_rows(x, x_scale: float, y_scale, y_zero, dtype) -> np.ndarray:
    from ..compiled import quantize as compiled

    out = np.empty(x.shape, dtype)
    compiled.softmax_codes(np.ascontiguousarray(x).reshape(-1, x.shape[-1]), _exp_table(x_scale), y_scale,
                           int(y_zero), *integer_range(dtype), out.reshape(-1, x.shape[-1]))
    return out


# -- QLinearConcat ---------------------------------------------------------------------------------


@register("QLinearConcat", domain=CONTRIB_DOMAIN, since=1)
def qlinear_concat(node, shapes, opset):
    axis = int(required_attr(node, "axis", "the axis to concatenate on"))
    constant_parts: dict[int, tuple] = {}  # a constant part (a class token) requantized once: (inputs, codes)
    tables: dict[int, tuple] = {}  # per part, its constant parameters and their 256-code table (or None: same grid)

    def part(i, triple, dtype, scale, zero, y_params):
        seen = constant_parts.get(i)
        if seen is not None and all(map(is_, seen[0], triple + y_params)):
            return seen[1]
        params = triple[1:] + y_params
        known = tables.get(i)
        if known is not None and all(map(is_, known[0], params)) and triple[0].dtype == dtype:
            codes = triple[0] if known[1] is None else apply_table(known[1], triple[0])
        else:
            codes = _requantized(node, i // 3, triple, dtype, scale, zero)
            if not any(v is not None and v.flags.writeable for v in params):
                # a code's requantized value depends on the code only: one table for every later call
                same = codes is triple[0]
                tables[i] = (params, None if same else _requantize_table(triple, dtype, scale, zero))
        if not any(v is not None and v.flags.writeable for v in triple + y_params):
            constant_parts[i] = (triple + y_params, codes)
        return codes

    def kernel(y_scale, y_zero_point, *triples):
        dtype = eight_bit(node, "Y_zero_point", y_zero_point)
        scale, zero = float_scale(node, "Y_scale", y_scale), scalar(node, "Y_zero_point", y_zero_point)
        if not triples or len(triples) % 3:
            raise argument_error(node, f"has {len(triples)} inputs after Y_scale and Y_zero_point; expected "
                                 "(tensor, scale, zero point) triples")
        parts = [part(i, triples[i:i + 3], dtype, scale, zero, (y_scale, y_zero_point))
                 for i in range(0, len(triples), 3)]
        a = normalize_axis(node, axis, parts[0].ndim)
        _check_concat_shapes(node, parts, a)
        return (np.concatenate(parts, axis=a),)

    return kernel


def _requantize_table(triple, dtype, y_scale, y_zero) -> np.ndarray:
    """_requantized's codes for every 8-bit code: the same dequantize and quantize, element by element."""
    x_zero = np.zeros((), dtype) if triple[2] is None else triple[2].reshape(())
    return lookup_table(dtype, triple[1].reshape(()), x_zero, lambda values: values, y_scale, y_zero)


def _requantized(node, index, triple, dtype, y_scale, y_zero):
    x, x_scale, x_zero_point = triple
    if x.dtype != dtype:
        raise argument_error(node, f"tensor {index} is {x.dtype}; expected {dtype} like Y_zero_point")
    x_scale = float_scale(node, f"scale {index}", x_scale)
    x_zero = scalar(node, f"zero point {index}", x_zero_point, dtype)
    x_zero = np.zeros((), dtype) if x_zero is None else x_zero
    if x_scale == y_scale and x_zero == y_zero:
        return x
    return quantize(dequantize(x, x_scale, x_zero), y_scale, y_zero, dtype)


@register("QLinearWhere", domain=CONTRIB_DOMAIN, since=1)
def qlinear_where(node, shapes, opset):
    """Z = Where(condition, X, Y) on the real values: X and Y requantized to Z's parameters, as in QLinearConcat."""

    def kernel(condition, x, x_scale, x_zero_point, y, y_scale, y_zero_point, z_scale, z_zero_point):
        if condition.dtype != np.bool_:
            raise argument_error(node, f"input 'condition' is {condition.dtype}; expected bool")
        dtype = eight_bit(node, "z_zero_point", z_zero_point)
        scale, zero = float_scale(node, "z_scale", z_scale), scalar(node, "z_zero_point", z_zero_point)
        a = _requantized(node, 0, (x, x_scale, x_zero_point), dtype, scale, zero)
        b = _requantized(node, 1, (y, y_scale, y_zero_point), dtype, scale, zero)
        try:
            return (np.where(condition, a, b),)
        except ValueError:
            raise argument_error(node, f"condition {condition.shape}, X {x.shape} and Y {y.shape} do not "
                                 "broadcast") from None

    return kernel


def _check_concat_shapes(node, parts, axis):
    first = parts[0].shape
    for i, p in enumerate(parts[1:], 1):
        if p.ndim != len(first) or any(d != e for j, (d, e) in enumerate(zip(p.shape, first)) if j != axis):
            raise argument_error(node, f"tensor {i} has shape {p.shape}; expected {first} outside axis {axis}")


# -- QLinearGlobalAveragePool, QLinearAveragePool --------------------------------------------------


def _channels_last(node) -> bool:
    value = int(node.attr("channels_last", 0))
    if value not in (0, 1):
        raise graph_error(node, "channels_last", f"is {value}; expected 0 (NCHW) or 1 (NHWC)")
    return bool(value)


def _pool_params(node, x, x_scale, x_zero_point, y_scale, y_zero_point):
    dtype = eight_bit(node, "X", x)
    if x.ndim < 3:
        raise argument_error(node, f"input 'X' has shape {x.shape}; expected (N, C, D1, ...) with a spatial dim")
    return (dtype, float_scale(node, "x_scale", x_scale), scalar(node, "x_zero_point", x_zero_point, dtype),
            float_scale(node, "y_scale", y_scale), scalar(node, "y_zero_point", y_zero_point, dtype))


@register("QLinearGlobalAveragePool", domain=CONTRIB_DOMAIN, since=1)
def qlinear_global_average_pool(node, shapes, opset):
    last = _channels_last(node)

    def kernel(x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        dtype, xs, xz, ys, yz = _pool_params(node, x, x_scale, x_zero_point, y_scale, y_zero_point)
        axes = tuple(range(1, x.ndim - 1)) if last else tuple(range(2, x.ndim))
        count = math.prod(x.shape[a] for a in axes)
        # The sum of (x - zero point) is exact; mean and rescale meet in one float64 factor.
        total = widen(x, xz).sum(axis=axes, keepdims=True)
        values = total * (xs.astype(_F64) / (ys.astype(_F64) * count)) if count else total * 0.0
        return (round_saturate(values, yz, dtype),)

    return kernel


@register("QLinearAveragePool", domain=CONTRIB_DOMAIN, since=1)
def qlinear_average_pool(node, shapes, opset):
    last = _channels_last(node)
    pool = average_pool(node, [None], opset)

    def kernel(x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        dtype, xs, xz, ys, yz = _pool_params(node, x, x_scale, x_zero_point, y_scale, y_zero_point)
        real = dequantize(x, xs, xz)
        if last:  # NHWC -> NCHW for the float pool, and back
            real = np.ascontiguousarray(np.moveaxis(real, -1, 1))
        pooled = pool(real)[0]
        if last:
            pooled = np.moveaxis(pooled, 1, -1)
        return (quantize(pooled, ys, yz, dtype),)

    return kernel


# -- QGemm -----------------------------------------------------------------------------------------


def _column_param(node, name: str, value, columns: int, dtype=None):
    """A per-tensor or per-column (N,) parameter of B, shaped to broadcast along the output's columns."""
    if value is None or value.size == 1:
        return scalar(node, name, value, dtype)
    if dtype is not None and value.dtype != dtype:
        raise argument_error(node, f"input {name!r} is {value.dtype}; expected {np.dtype(dtype)} like B")
    if value.ndim != 1 or value.shape[0] != columns:
        raise argument_error(node, f"input {name!r} has shape {value.shape}; expected a scalar or ({columns},)")
    return value


def _qgemm_product(node, product, trans_a, trans_b, a, a_zero_point, b, b_zero_point):
    """The int32 accumulator of QGemm: compiled for a non-transposed A, else exact through int_matmul."""
    (left, a_zero), (right, b_zero) = _qgemm_operands(node, trans_a, trans_b, a, a_zero_point, b, b_zero_point)
    if not trans_a:
        acc = product(a, b, a_zero, b_zero, trans_b=trans_b)
        if acc is not None:
            return acc, right.shape[1]
    return int_matmul(widen(left, a_zero), widen(right, b_zero)), right.shape[1]


def _qgemm_operands(node, trans_a, trans_b, a, a_zero_point, b, b_zero_point):
    eight_bit(node, "A", a)
    eight_bit(node, "B", b)
    if a.ndim != 2 or b.ndim != 2:
        raise argument_error(node, f"A {a.shape} and B {b.shape} must be matrices")
    left, right = (a.T if trans_a else a), (b.T if trans_b else b)
    if left.shape[1] != right.shape[0]:
        raise argument_error(node, f"A {a.shape} and B {b.shape} (transA={int(trans_a)}, transB={int(trans_b)}) "
                             "have different inner dimensions")
    a_zero = scalar(node, "a_zero_point", a_zero_point, a.dtype)
    b_zero = _column_param(node, "b_zero_point", b_zero_point, right.shape[1], b.dtype)
    return (left, a_zero), (right, b_zero)


def _add_c(node, acc, c):
    if c is None:
        return acc
    if c.dtype != np.int32:
        raise argument_error(node, f"input 'C' is {c.dtype}; expected int32")
    try:
        if np.broadcast_shapes(c.shape, acc.shape) != acc.shape:
            raise ValueError
    except ValueError:
        raise argument_error(node, f"C {c.shape} does not broadcast to the output {acc.shape}") from None
    # C joins the 32-bit accumulator, wrapping as it would.
    return (acc.astype(np.int64) + c).astype(np.int32)


@register("QGemm", domain=CONTRIB_DOMAIN, since=1)
def qgemm(node, shapes, opset):
    alpha = float(node.attr("alpha", 1.0))
    trans_a, trans_b = bool(node.attr("transA", 0)), bool(node.attr("transB", 0))
    product = IntegerProduct()
    multipliers = Prepared()
    kernels = _qgemm_kernels()  # once here: an import statement costs each call microseconds
    repeat = RepeatCall()  # the last compiled call: its A shape and type, constants and the loop's arguments

    def multiplier(a_scale, b_scale, y_scale) -> np.ndarray:
        """alpha * a_scale * b_scale[n] (/ y_scale) in float64, in the general path's order."""
        m = (alpha * a_scale.astype(_F64).reshape(())) * b_scale.astype(_F64).reshape(-1)
        return m if y_scale is None else m / y_scale.astype(_F64).reshape(())

    def compiled(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c, y_scale, y_zero_point):
        """The common case in one compiled pass (compiled/qgemm.qgemm): A (M, K) not transposed, per-tensor A
        and Y parameters, per-tensor or per-column B, C per tensor or per column; None for anything else."""
        if trans_a or not _qgemm_compiles(trans_b, a, a_scale, a_zero_point, b, b_scale, b_zero_point, c, y_scale,
                                          y_zero_point):
            return None
        columns = b.shape[0] if trans_b else b.shape[1]
        quantized = y_scale is not None
        packed = product.packed(b, b_zero_point, trans_b)
        if packed is None:
            return None
        m = multipliers.get(quantized, (a_scale, b_scale, y_scale), lambda: multiplier(a_scale, b_scale, y_scale))
        low, high = integer_range(y_zero_point.dtype) if quantized else (0, 0)
        out = np.empty((a.shape[0], columns), y_zero_point.dtype if quantized else _F32)
        if out.size:
            arguments = (int(a_zero_point.reshape(-1)[0]), packed, kernels.pairs_for(packed),
                         _NO_C if c is None else c.reshape(-1), m,
                         int(y_zero_point.reshape(-1)[0]) if quantized else 0, low, high, quantized, out.dtype,
                         columns)
            kernels.qgemm(np.ascontiguousarray(a), *arguments[:-2], out)
            repeat.keep(a, (b, a_scale, a_zero_point, b_scale, b_zero_point, c, y_scale, y_zero_point), arguments)
        return out

    def kernel(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c=None, y_scale=None, y_zero_point=None):
        out = _repeated_qgemm(repeat, kernels, a, (b, a_scale, a_zero_point, b_scale, b_zero_point, c, y_scale,
                                                   y_zero_point))
        if out is None:
            out = compiled(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c, y_scale, y_zero_point)
        if out is None:
            out = _qgemm_general(node, product, alpha, trans_a, trans_b, a, a_scale, a_zero_point, b, b_scale,
                                 b_zero_point, c, y_scale, y_zero_point)
        return (out,)

    return kernel


def _qgemm_general(node, product, alpha, trans_a, trans_b, a, a_scale, a_zero_point, b, b_scale, b_zero_point, c,
                   y_scale, y_zero_point) -> np.ndarray:
    """QGemm for every input the compiled pass does not take, checking each (the typed errors come from here)."""
    acc, columns = _qgemm_product(node, product, trans_a, trans_b, a, a_zero_point, b, b_zero_point)
    acc = _add_c(node, acc, c)
    scale = alpha * float_scale(node, "a_scale", a_scale).astype(_F64) * _column_param(
        node, "b_scale", b_scale, columns).astype(_F64)
    if y_zero_point is None and y_scale is None:
        return (acc * scale).astype(_F32)
    if y_zero_point is None or y_scale is None:
        raise argument_error(node, "y_scale and y_zero_point come together (quantized output) or not at all")
    dtype = eight_bit(node, "y_zero_point", y_zero_point)
    values = acc * (scale / float_scale(node, "y_scale", y_scale).astype(_F64))
    return round_saturate(values, scalar(node, "y_zero_point", y_zero_point), dtype)


_NO_C = np.zeros(0, np.int32)


def _repeated_qgemm(repeat: RepeatCall, kernels, a, constants: tuple):
    """The output of a call repeating ``repeat``'s kept call (A's shape and type, the same constant arrays) through
    the loop's kept arguments, or None for any other call."""
    arguments = repeat.match(a, constants)
    if arguments is None:
        return None
    out = np.empty((a.shape[0], arguments[-1]), arguments[-2])
    kernels.qgemm(np.ascontiguousarray(a), *arguments[:-2], out)
    return out


def _qgemm_compiles(trans_b, a, a_scale, a_zero, b, b_scale, b_zero, c, y_scale, y_zero) -> bool:
    """Whether QGemm's compiled pass takes these inputs: 8-bit matrices that multiply, per-tensor A and Y
    parameters of the types the spec gives them, B's scale per tensor or per column, an int32 C per tensor or
    per column; everything else (and every error) goes through the general path."""
    if a_zero is None or b_zero is None or a.ndim != 2 or b.ndim != 2 or a.dtype not in _EIGHT_BIT \
            or b.dtype not in _EIGHT_BIT:
        return False
    columns, depth = b.shape if trans_b else b.shape[::-1]
    if a.shape[1] != depth or a_zero.dtype != a.dtype or a_zero.size != 1 or b_zero.dtype != b.dtype \
            or a_scale.dtype != _F32 or a_scale.size != 1 or b_scale.dtype != _F32 \
            or not (b_scale.size == 1 or b_scale.shape == (columns,)):
        return False
    if c is not None and (c.dtype != np.int32 or not (c.size == 1 or c.shape in ((columns,), (1, columns)))):
        return False
    if y_scale is None or y_zero is None:
        return y_scale is None and y_zero is None
    return y_scale.dtype == _F32 and y_scale.size == 1 and y_zero.size == 1 and y_zero.dtype in _EIGHT_BIT


def _qgemm_kernels():
    from ..compiled import qgemm

    return qgemm


# -- MatMulIntegerToFloat, DynamicQuantizeMatMul ---------------------------------------------------


def _matmul_shapes(node, a, b):
    if a.ndim < 1 or b.ndim < 1:
        raise argument_error(node, "A and B must have at least one dimension")
    inner_b = b.shape[-2] if b.ndim > 1 else b.shape[0]
    if a.shape[-1] != inner_b:
        raise argument_error(node, f"A {a.shape} and B {b.shape} have different inner dimensions")
    if b.ndim <= 2:  # no batch dims on B: A's broadcast over it
        return
    try:
        np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise argument_error(node, f"the batch dimensions of A {a.shape} and B {b.shape} do not broadcast") from None


def _b_param(node, name: str, value, b: np.ndarray, dtype=None):
    """B's scale or zero point: per tensor, per column (N,), or per column of each batched matrix
    (..., 1, N); shaped to broadcast against B."""
    if value is None or value.size == 1:
        return scalar(node, name, value, dtype)
    if dtype is not None and value.dtype != dtype:
        raise argument_error(node, f"input {name!r} is {value.dtype}; expected {np.dtype(dtype)} like B")
    columns = b.shape[-1]
    fits = value.shape == (columns,) or (
        value.ndim == b.ndim and value.shape[-2:] == (1, columns) and all(
            v in (1, d) for v, d in zip(value.shape[:-2], b.shape[:-2])))
    if not fits:
        raise argument_error(node, f"input {name!r} has shape {value.shape}; expected a scalar, ({columns},) or "
                             f"(..., 1, {columns}) for B {b.shape}")
    return value


def _a_param(node, name: str, value, a: np.ndarray, dtype=None):
    """A's scale or zero point: per tensor, or (as the spec allows) one per column of A, i.e. along K."""
    if value is None or value.size == 1:
        return scalar(node, name, value, dtype)
    if value.shape != (a.shape[-1],) or (dtype is not None and value.dtype != dtype):
        raise argument_error(node, f"input {name!r} has shape {value.shape} ({value.dtype}); expected a scalar or "
                             f"({a.shape[-1]},) of {np.dtype(dtype) if dtype is not None else 'float'}")
    return value


def _bias(node, bias, columns: int, dtype):
    if bias is None:
        return None
    if bias.shape != (columns,) or bias.dtype != dtype:
        raise argument_error(node, f"input 'bias' is {bias.dtype}{bias.shape}; expected {np.dtype(dtype)} ({columns},)")
    return bias


def _integer_to_float(product, a, a_scale, a_zero, b, b_scale, b_zero):
    """(A - a_zero) * a_scale @ (B - b_zero) * b_scale in float64: an exact integer product rescaled when
    A's scale is per tensor; per-K scales of A (which no integer product can factor out) scale A first."""
    if a_scale.ndim == 0 and (a_zero is None or a_zero.ndim == 0):
        acc = product(a, b, a_zero, b_zero)
        if acc is not None:
            return acc * (a_scale.astype(_F64) * b_scale.astype(_F64))
    bc = widen(b, b_zero)
    if a_scale.ndim == 0:
        return int_matmul(widen(a, a_zero), bc) * (a_scale.astype(_F64) * b_scale.astype(_F64))
    scaled = widen(a, a_zero) * a_scale.astype(_F64)
    return np.asarray(np.matmul(scaled, bc.astype(_F64))) * b_scale.astype(_F64)


def _finish(y, bias, dtype):
    """Rounded to float32 (the accumulator's rescaled type), the bias added there, then the output type."""
    y = y.astype(_F32)
    if bias is not None:
        y = y + bias.astype(_F32)
    return y.astype(dtype, copy=False)


def _fast_weight(a, b, b_scale, b_zero_point, bias) -> bool:
    """B's side of compiled/qgemm's scaled products: a 2-D 8-bit B that A (..., K) multiplies, per-tensor or
    per-column float32 scales and zero points of B's type, a float32 (N,) bias or none."""
    columns = b.shape[-1] if b.ndim else 0
    return (b.dtype in _EIGHT_BIT and b.ndim == 2 and a.ndim >= 1 and a.shape[-1] == b.shape[0]
            and b_scale.dtype == _F32
            and all(p is None or (p.size in (1, columns) and p.ndim <= 1) for p in (b_scale, b_zero_point))
            and (b_zero_point is None or b_zero_point.dtype == b.dtype)
            and (bias is None or (bias.dtype == _F32 and bias.shape == (columns,))))


@register("MatMulIntegerToFloat", domain=CONTRIB_DOMAIN, since=1)
def matmul_integer_to_float(node, shapes, opset):
    from ..compiled import qgemm

    product = IntegerProduct()
    sides = Prepared()  # WeightSide per set of constant inputs (None: not compiled)

    def fast(a, b, a_scale, b_scale, a_zero_point, b_zero_point, bias):
        """compiled/qgemm.scaled_product for 8-bit A with per-tensor float32 parameters and a B WeightSide
        takes; None for anything else."""
        if a.dtype not in _EIGHT_BIT or not a.ndim or not a.size or a_scale.dtype is not _F32 or a_scale.size != 1 \
                or (a_zero_point is not None and (a_zero_point.size != 1 or a_zero_point.dtype is not a.dtype)):
            return None
        side = sides.get(None, (b, b_scale, b_zero_point, bias),
                         lambda: WeightSide.of(product, a, b, b_scale, b_zero_point, bias))
        if side is None or a.shape[-1] != side.depth:
            return None
        out = np.empty(a.shape[:-1] + (side.columns,), _F32)
        qgemm.scaled_product(np.ascontiguousarray(a).reshape(-1, side.depth),
                             0 if a_zero_point is None else int(a_zero_point.reshape(-1)[0]), side.packed, side.pairs,
                             float(a_scale.reshape(-1)[0]), side.scales, side.bias, out.reshape(-1, side.columns))
        return out

    def kernel(a, b, a_scale, b_scale, a_zero_point=None, b_zero_point=None, bias=None):
        out = fast(a, b, a_scale, b_scale, a_zero_point, b_zero_point, bias)
        if out is not None:
            return (out,)
        eight_bit(node, "A", a)
        eight_bit(node, "B", b)
        _matmul_shapes(node, a, b)
        dtype = a_scale.dtype
        if dtype not in (_F32, np.dtype(np.float16)) or b_scale.dtype != dtype:
            raise argument_error(node, f"a_scale ({a_scale.dtype}) and b_scale ({b_scale.dtype}) must both be "
                                 "float32 or both float16")
        y = _integer_to_float(product, a, _a_param(node, "a_scale", a_scale, a),
                              _a_param(node, "a_zero_point", a_zero_point, a, a.dtype),
                              b, _b_param(node, "b_scale", b_scale, b),
                              _b_param(node, "b_zero_point", b_zero_point, b, b.dtype))
        return (_finish(y, _bias(node, bias, b.shape[-1], dtype), dtype),)

    return kernel


@register("DynamicQuantizeMatMul", domain=CONTRIB_DOMAIN, since=1)
def dynamic_quantize_matmul(node, shapes, opset):
    from ..compiled import qgemm  # once here: an import statement costs each call microseconds

    product = IntegerProduct()
    sides = Prepared()  # WeightSide per set of constant inputs (None: not compiled)
    last: list = [None] * 5  # the constant inputs of the last call, then their WeightSide

    def kernel(a, b, b_scale, b_zero_point=None, bias=None):
        if a.dtype is _F32 and a.ndim and a.size:
            if last[0] is b and last[1] is b_scale and last[2] is b_zero_point and last[3] is bias:
                side = last[4]  # the same constant arrays as before (the usual call): no key to build
            else:
                side = sides.get(None, (b, b_scale, b_zero_point, bias),
                                 lambda: WeightSide.of(product, a, b, b_scale, b_zero_point, bias))
                if all(x is None or not x.flags.writeable for x in (b, b_scale, b_zero_point, bias)):
                    last[:] = [b, b_scale, b_zero_point, bias, side]
            if side is not None and a.shape[-1] == side.depth:
                # DynamicQuantizeLinear's codes of A then MatMulIntegerToFloat's product, in one compiled call
                out = np.empty(a.shape[:-1] + (side.columns,), _F32)
                qgemm.dynamic_scaled_product(np.ascontiguousarray(a).reshape(-1, side.depth), side.packed,
                                             side.pairs, side.scales, side.bias, out.reshape(-1, side.columns))
                return (out,)
        if a.dtype != _F32 or b_scale.dtype != _F32:
            raise argument_error(node, f"A ({a.dtype}) and b_scale ({b_scale.dtype}) must be float32")
        eight_bit(node, "B", b)
        _matmul_shapes(node, a, b)
        # A is quantized to uint8 over its whole range, as DynamicQuantizeLinear does.
        a_scale, a_zero, aq = dynamic_uint8(a)
        b_scale = _b_param(node, "b_scale", b_scale, b)
        b_zero = _b_param(node, "b_zero_point", b_zero_point, b, b.dtype)
        y = _integer_to_float(product, aq, np.asarray(a_scale), np.asarray(a_zero), b, b_scale, b_zero)
        return (_finish(y, _bias(node, bias, b.shape[-1], _F32), _F32),)

    return kernel


class WeightSide:
    """B's side of compiled/qgemm's scaled products, made once per set of constant inputs: B packed as int16
    (N, K) with its zero points subtracted, its scales as float64 (1,) or (N,), the float32 bias or an empty one."""

    __slots__ = ("packed", "pairs", "scales", "bias", "depth", "columns")
    _NO_BIAS = np.zeros(0, _F32)

    @classmethod
    def of(cls, product: IntegerProduct, a, b, b_scale, b_zero_point, bias) -> WeightSide | None:
        """None where the compiled products do not apply (_fast_weight)."""
        if not _fast_weight(a, b, b_scale, b_zero_point, bias):
            return None
        packed = product.packed(b, b_zero_point)
        if packed is None:
            return None
        side = cls()
        side.packed, side.scales = packed, b_scale.reshape(-1).astype(_F64)
        side.pairs = _qgemm_kernels().pairs_for(packed)
        side.bias = cls._NO_BIAS if bias is None else bias
        side.columns, side.depth = packed.shape[0], b.shape[0]  # (packed may be compact's (N, 0) stand-in)
        return side


# -- QuantizeLinear, DequantizeLinear (com.microsoft) ----------------------------------------------

_QUANTIZED = {DataType.INT8, DataType.UINT8, DataType.INT16, DataType.UINT16, DataType.INT4, DataType.UINT4}
_HALF_OR_FLOAT = (_F32, np.dtype(np.float16))


def _axis_param(node, name: str, value, shape, axis, dtype=None):
    """A scale or zero point: per tensor (a single value), else 1-D along ``axis``."""
    if value is None or value.size == 1:
        return scalar(node, name, value, dtype)
    a = normalize_axis(node, axis, len(shape))
    if value.shape != (shape[a],):
        raise argument_error(node, f"input {name!r} has shape {value.shape}; expected ({shape[a]},) for axis {a} "
                             f"of the input {tuple(shape)}")
    if dtype is not None and value.dtype != dtype:
        raise argument_error(node, f"input {name!r} is {value.dtype}; expected {np.dtype(dtype)}")
    return value.reshape((-1,) + (1,) * (len(shape) - 1 - a))


def _axis(node) -> int:
    # The spec asks for scalars when 'axis' is absent; onnxruntime then takes 1-D parameters along axis 1,
    # as ONNX's QuantizeLinear does, and so does this runtime.
    return int(node.attr("axis", 1))


@register("QuantizeLinear", domain=CONTRIB_DOMAIN, since=1)
def contrib_quantize_linear(node, shapes, opset):
    axis = _axis(node)

    def kernel(x, y_scale, y_zero_point=None):
        if x.dtype not in _HALF_OR_FLOAT or y_scale.dtype != x.dtype:
            raise argument_error(node, f"x ({x.dtype}) and y_scale ({y_scale.dtype}) must both be float32 or float16")
        target = np.dtype(np.uint8) if y_zero_point is None else y_zero_point.dtype
        if DataType.from_numpy(target) not in _QUANTIZED:
            raise argument_error(node, f"y_zero_point is {target}; expected int8, uint8, int16, uint16, int4 or uint4")
        scale = _axis_param(node, "y_scale", y_scale, x.shape, axis)
        zero = _axis_param(node, "y_zero_point", y_zero_point, x.shape, axis, target)
        return (quantize(x, scale, zero, target),)

    return kernel


@register("DequantizeLinear", domain=CONTRIB_DOMAIN, since=1)
def contrib_dequantize_linear(node, shapes, opset):
    axis = _axis(node)

    def kernel(x, x_scale, x_zero_point=None):
        if DataType.from_numpy(x.dtype) not in _QUANTIZED | {DataType.INT32}:
            raise argument_error(node, f"x is {x.dtype}; expected int8, uint8, int16, uint16, int32, int4 or uint4")
        if x_scale.dtype not in _HALF_OR_FLOAT:
            raise argument_error(node, f"x_scale is {x_scale.dtype}; expected float32 or float16")
        scale = _axis_param(node, "x_scale", x_scale, x.shape, axis)
        zero = _axis_param(node, "x_zero_point", x_zero_point, x.shape, axis, x.dtype)
        # Exact difference, one float32 product, rounded once to the scale's type.
        return (dequantize(x, scale, zero).astype(x_scale.dtype, copy=False),)

    return kernel
