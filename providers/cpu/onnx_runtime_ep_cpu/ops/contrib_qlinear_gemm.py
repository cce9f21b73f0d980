"""QGemm (domain com.microsoft, docs/ContribOperators.md): alpha * (A - a_zero) @ (B - b_zero) + C on an int32
accumulator, wrapping as one would, rescaled in float64 and rounded once to the output's codes, or float32
without an output scale. The common case runs in one compiled pass (compiled/qgemm.qgemm) and a repeated call
with the same constant arrays skips its checks."""

from __future__ import annotations

import numpy as np

from ..algorithms.prepared import Prepared
from ..algorithms.quantize import IntegerProduct, int_matmul, integer_range, round_saturate, widen
from ..algorithms.repeat_call import RepeatCall
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error
from .contrib_quantization import eight_bit, float_scale, scalar

_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)

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
