"""MatMulIntegerToFloat and DynamicQuantizeMatMul (domain com.microsoft, docs/ContribOperators.md): an exact
integer product of 8-bit A and B (A quantized as DynamicQuantizeLinear does for DynamicQuantizeMatMul),
rescaled in float64 and rounded once to float32, plus the float32 bias. A constant B is packed once
(WeightSide) and the common case runs in one compiled call (compiled/qgemm.py)."""

from __future__ import annotations

import numpy as np

from ..algorithms.bound_loop import EntryOnce
from ..algorithms.prepared import Prepared
from ..algorithms.quantize import IntegerProduct, dynamic_uint8, int_matmul, widen
from ..algorithms.repeat_call import RepeatCall
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error
from .contrib_quantization import eight_bit, scalar

_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)

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
    repeat = RepeatCall()  # the last compiled call: A's shape, the constant inputs and the loop's kept arguments
    bind = EntryOnce(qgemm.dynamic_scaled_product)

    def kernel(a, b, b_scale, b_zero_point=None, bias=None):
        out = repeated(repeat, a, (b, b_scale, b_zero_point, bias))
        if out is not None:
            return (out,)
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
                arguments = (np.ascontiguousarray(a).reshape(-1, side.depth), side.packed, side.pairs, side.scales,
                             side.bias, out.reshape(-1, side.columns))
                run_and_keep(bind, repeat, a, (b, b_scale, b_zero_point, bias), side, arguments, out.shape)
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


def run_and_keep(bind: EntryOnce, repeat: RepeatCall, a, constants: tuple, side, arguments: tuple,
                 out_shape: tuple) -> None:
    """Runs the loop ``bind`` is for on ``arguments`` (A's rows, ``side``'s arrays, the output's rows) and keeps the
    call for its repeats once the loop runs compiled (until then numpy's twin serves): its entry point, A's rows'
    shape, the side and the output's shape and rows."""
    bind.run(arguments)
    entry = bind(arguments)
    if entry is not None:
        repeat.keep(a, constants, (entry, arguments[0].shape, side, out_shape, arguments[-1].shape))


def repeated(repeat: RepeatCall, a, constants: tuple) -> np.ndarray | None:
    """The output of a call repeating ``repeat``'s kept one (A's shape and type, the same constant arrays): the
    kept entry point on A's rows, without the checks, shapes worked out or the dispatcher's typing of six arrays;
    None for any other call."""
    kept = repeat.match(a, constants)
    if kept is None:
        return None
    entry, rows, side, out_shape, out_rows = kept
    out = np.empty(out_shape, _F32)
    entry(np.ascontiguousarray(a).reshape(rows), side.packed, side.pairs, side.scales, side.bias, out.reshape(out_rows))
    return out


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
        from ..compiled import qgemm

        side.pairs = qgemm.pairs_for(packed)
        side.bias = cls._NO_BIAS if bias is None else bias
        side.columns, side.depth = packed.shape[0], b.shape[0]  # (packed may be compact's (N, 0) stand-in)
        return side
