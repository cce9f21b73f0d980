"""QDQ groups on integers (qdq_fusions.fuse_quantized_linear): DequantizeLinear -> MatMul/Gemm/Conv ->
QuantizeLinear as one node, the exact product of the codes requantized once, as onnxruntime's QDQ
transformer runs such groups (QLinearMatMul, QGemm, QLinearConv).

Inputs (a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero[, bias]): ``a`` is the codes the input
DequantizeLinear read or, with attribute ``quantize_a``, the float32 tensor its QuantizeLinear quantized (the
codes are made here, as QuantizeLinear makes them: float32 division, half to even, saturation); ``b`` the
same with ``quantize_b`` (a MatMul of two activations). The output is the QuantizeLinear's codes or, with
``dequantize``, the float32 tensor the DequantizeLinear reading them gives. ``bias`` is the float32 value
added to the product (Gemm's C, Conv's B); Gemm's transB, alpha and beta and Conv's attributes are kept.

Arithmetic: the product of the centred codes is exact (int32, or integers held in float32/float64 for the
convolution); the real result (acc * a_scale * b_scale[n] * alpha + bias[n] * beta) / y_scale is formed in
float64 and rounded once, half to even. The QDQ graph forms it in float32 (each dequantized operand, the
product and the bias rounded to float32) before the same rounding, so the two can differ by one code where
the real value lies within float32 rounding of a half-integer: the bound onnxruntime's integer kernels keep.
"""

from __future__ import annotations

import math
from operator import is_
from types import SimpleNamespace

import numpy as np
from onnx_runtime.errors import OnnxRuntimeError

from ..algorithms.bound_loop import EntryOnce
from ..algorithms.patch_geometry import patch_geometry
from ..algorithms.prepared import Prepared
from ..algorithms.quantize import integer_range
from ..algorithms.repeat_call import RepeatCall
from ..compiled.deferred import numpy_first, tried
from ..fusions import FUSED_DOMAIN
from ..registry import register
from ..threads import helper_count
from ._common import argument_error
from .quantization import integer_conv, qlinear_matmul_general

_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_F32 = np.dtype(np.float32)


class Requantization:
    """The constant side of a group, checked and made once per set of constant inputs: the input's
    (scale, zero point, code range), the weight's, and per output channel the float64 ``multiplier`` and
    ``offset`` with code = rint(acc * multiplier + offset) + y_zero (one of each when they are uniform)."""

    def __init__(self, node, columns: int, a_scale, a_zero, b_scale, b_zero, y_scale, y_zero, bias,
                 alpha: float = 1.0, beta: float = 1.0):
        self.a_scale = _scalar(node, "a_scale", a_scale, _F32)
        self.a_zero = int(_scalar(node, "a_zero_point", a_zero))
        self.a_dtype = _eight_bit(node, "a_zero_point", a_zero)
        self.a_low, self.a_high = integer_range(self.a_dtype)
        self.b_dtype = _eight_bit(node, "b_zero_point", b_zero)
        self.b_low, self.b_high = integer_range(self.b_dtype)
        self.b_zeros = _channels(node, "b_zero_point", b_zero, columns).astype(np.int32)
        b_scales = _channels(node, "b_scale", b_scale, columns, _F32)
        self.b_scale = b_scales[0]
        self.y_scale = _scalar(node, "y_scale", y_scale, _F32)
        self.y_zero = int(_scalar(node, "y_zero_point", y_zero))
        self.y_dtype = _eight_bit(node, "y_zero_point", y_zero)
        self.y_low, self.y_high = integer_range(self.y_dtype)
        y = np.float64(self.y_scale)
        multiplier = np.broadcast_to(alpha * np.float64(self.a_scale) * b_scales.astype(np.float64) / y, (columns,))
        offset = np.zeros(1) if bias is None else _channels(node, "bias", bias, columns, _F32).astype(np.float64)
        offset = np.broadcast_to(beta * offset / y, (columns,))
        self.per_tensor = self.b_zeros.size == 1 and not (columns and (np.ptp(multiplier) or np.ptp(offset)))
        width = 1 if self.per_tensor else columns
        self.multiplier = np.ascontiguousarray(multiplier[:width])
        self.offset = np.ascontiguousarray(offset[:width])
        self.packed = None  # (B, its packed int16 form) for a constant 2-D B
        self.consts: np.ndarray | None = None  # compiled_consts, for the products
        self.out_dtype = self.y_dtype
        self.channel_params: tuple | None = None  # (multiplier, offset) one per output channel, where asked for
        self.finite = bool(np.isfinite(self.multiplier).all() and np.isfinite(self.offset).all())
        self.singles: np.ndarray | None = None  # the grid's float32 requantization parameters (single_params)

    def compiled_consts(self, quantize_a: bool, quantize_b: bool, dequantize: bool) -> np.ndarray:
        """The parameters as compiled/qgemm.py's ``consts`` array."""
        from ..compiled import qgemm

        consts = np.zeros(qgemm.CONSTS)
        consts[[qgemm.A_SCALE, qgemm.A_ZERO, qgemm.A_LOW, qgemm.A_HIGH, qgemm.A_QUANTIZE]] = (
            self.a_scale, self.a_zero, self.a_low, self.a_high, quantize_a)
        consts[[qgemm.B_SCALE, qgemm.B_ZERO, qgemm.B_LOW, qgemm.B_HIGH, qgemm.B_QUANTIZE]] = (
            self.b_scale, self.b_zeros[0], self.b_low, self.b_high, quantize_b)
        consts[[qgemm.Y_ZERO, qgemm.Y_LOW, qgemm.Y_HIGH, qgemm.Y_SCALE, qgemm.DEQUANTIZE]] = (
            self.y_zero, self.y_low, self.y_high, self.y_scale, dequantize)
        return consts


def _eight_bit(node, name: str, zero) -> np.dtype:
    if zero.dtype not in _EIGHT_BIT:
        raise argument_error(node, f"input {name!r} is {zero.dtype}; expected uint8 or int8")
    return zero.dtype


def _scalar(node, name: str, value, dtype=None):
    if value.size != 1 or (dtype is not None and value.dtype != dtype):
        raise argument_error(node, f"input {name!r} is {value.dtype}{value.shape}; expected a per-tensor "
                             f"{'scalar' if dtype is None else np.dtype(dtype).name + ' scalar'}")
    return value.reshape(-1)[0]


def _channels(node, name: str, value, columns: int, dtype=None) -> np.ndarray:
    """A per-tensor or per-output-channel parameter as a flat array of 1 or ``columns`` values."""
    if (dtype is not None and value.dtype != dtype) or value.size not in (1, columns) \
            or (value.ndim > 1 and max(value.shape) != value.size):
        raise argument_error(node, f"input {name!r} is {value.dtype}{value.shape}; expected a scalar or "
                             f"({columns},){'' if dtype is None else ' of ' + np.dtype(dtype).name}")
    return value.reshape(-1)


def _operand(node, name: str, x, quantize: bool, dtype) -> None:
    """``x`` is float32 data to quantize (``quantize``) or codes of the zero point's type."""
    expected = _F32 if quantize else dtype
    if x.dtype != expected:
        raise argument_error(node, f"input {name!r} is {x.dtype}; expected {expected}"
                             + (" (it is quantized here)" if quantize else " like its zero point"))


@register("QuantizedMatMul", domain=FUSED_DOMAIN, since=1)
def quantized_matmul(node, shapes, opset):
    """A QDQ MatMul or Gemm (transA = 0), in one compiled pass (quantize A, integer product against B packed
    once when constant, requantize, dequantize); stacked operands (attention's products) the same per matrix."""
    from ..compiled import qgemm

    trans_b = bool(node.attr("transB", 0))
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    quantize_a, quantize_b = bool(node.attr("quantize_a", 0)), bool(node.attr("quantize_b", 0))
    dequantize = bool(node.attr("dequantize", 0))
    last: list = [(), None]  # the constant inputs last seen, and what was made of them

    def prepare(columns: int, constants: tuple) -> Requantization:
        p = Requantization(node, columns, *constants, alpha, beta)
        p.consts = p.compiled_consts(quantize_a, quantize_b, dequantize)
        p.out_dtype = _F32 if dequantize else p.y_dtype
        if all(c is None or not c.flags.writeable for c in constants):
            last[:] = [(columns, *constants), p]
        return p

    rounded = Prepared()  # the rounded add's parameters per set of constant inputs
    repeat = RepeatCall()  # the last call with a 2-D B and no rounded add: its A, constants and loop arguments
    repeat_rounded = RepeatCall()  # the same for a call with a rounded add (an encoder's projections)
    stacked = RepeatCall()  # the last stacked call (attention's: B fed): A, the parameters, B's shape and type
    repeats = (repeat, repeat_rounded, stacked)
    binds: dict = {}  # the loops' entry points (EntryOnce) by loop and argument kinds, for the kept calls

    def kernel(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero, bias=None, row=None, after_scale=None,
               after_zero=None):
        out = _repeated(repeats, qgemm, a, b, (a_scale, a_zero, b_scale, b_zero, y_scale, y_zero, bias), row,
                        after_scale, after_zero)
        if out is not None:
            return (out,)
        columns = _columns(b, trans_b)
        key = (columns, a_scale, a_zero, b_scale, b_zero, y_scale, y_zero, bias)
        seen = last[0]
        p = last[1] if len(seen) == 8 and all(map(is_, seen, key)) else prepare(columns, key[1:])
        if a.dtype is not (_F32 if quantize_a else p.a_dtype) or b.dtype is not (_F32 if quantize_b else p.b_dtype):
            _operand(node, "A", a, quantize_a, p.a_dtype)
            _operand(node, "B", b, quantize_b, p.b_dtype)
        after = None if row is None else rounded.get(columns, (row, after_scale, after_zero), lambda: _rounded_add(
            node, qgemm, columns, row, after_scale, after_zero, dequantize))
        if b.ndim != 2 or a.ndim < 1:
            y = _stacked(node, qgemm, a, b, p)
            _keep_stacked(stacked, binds, qgemm, a, b, y, key[1:], p, after)
            return (y if after is None else _round_after(y, row, after),)
        depth = b.shape[1] if trans_b else b.shape[0]
        if a.shape[-1] != depth:
            raise argument_error(node, f"A {a.shape} and B {b.shape} (transB={int(trans_b)}) have different inner "
                                 "dimensions")
        packed = p.packed[1] if p.packed is not None and p.packed[0] is b else _pack(qgemm, b, p, trans_b, quantize_b)
        out = np.empty(a.shape[:-1] + (columns,), p.out_dtype)
        if out.size:
            flat = np.ascontiguousarray(a).reshape(out.size // columns, depth)
            pairs = qgemm.pairs_for(packed)
            if after is None:
                arguments = (flat, packed, pairs, p.multiplier, p.offset, p.consts, out.reshape(-1, columns))
                qgemm.requantized_product(*arguments)
                # constants (B among them, so packed once and kept): later calls with this A shape skip the checks
                # and, once the loop runs compiled, the dispatcher's typing of seven arrays (its entry point)
                entry = (not b.flags.writeable and _entry(binds, qgemm.requantized_product, arguments)) \
                    or qgemm.requantized_product
                repeat.keep(a, (b, *key[1:]), (entry, flat.shape, packed, pairs, p.multiplier, p.offset, p.consts,
                                               out.shape, p.out_dtype, (-1, columns)))
            else:
                line = row.reshape(-1)
                qgemm.requantized_product_rounded(flat, packed, pairs, p.multiplier, p.offset, p.consts, line, after,
                                                  out.reshape(-1, columns))
                repeat_rounded.keep(a, (b, *key[1:], row, after_scale, after_zero), (
                    flat.shape, packed, pairs, p.multiplier, p.offset, p.consts, line, after, out.shape, (-1, columns)))
        return (out,)

    kernel.repeat = repeat  # type: ignore[attr-defined]
    kernel.repeat_rounded = repeat_rounded  # type: ignore[attr-defined]
    kernel.stacked = stacked  # type: ignore[attr-defined]
    return kernel


def repeated_product(repeat: RepeatCall, a, constants: tuple, row=None):
    """The product of a call repeating ``repeat``'s kept call (A's shape and type, the same constant arrays, no
    rounded add) through the loop's kept arguments, or None for any other call."""
    arguments = None if row is not None else repeat.match(a, constants)
    if arguments is None:
        return None
    product, flat_shape, packed, pairs, multiplier, offset, consts, out_shape, out_dtype, rows = arguments
    out = np.empty(out_shape, out_dtype)
    product(np.ascontiguousarray(a).reshape(flat_shape), packed, pairs, multiplier, offset, consts, out.reshape(rows))
    return out


def _repeated(repeats: tuple, qgemm, a, b, params: tuple, row, after_scale, after_zero):
    """The product of a call repeating one of QuantizedMatMul's kept calls (a plain product, one with a rounded
    add, stacked operands), or None."""
    repeat, rounded, stacked = repeats
    if row is not None:
        return repeated_rounded(rounded, qgemm, a, (b, *params, row, after_scale, after_zero))
    if b.ndim == 2:
        return repeated_product(repeat, a, (b, *params))
    return repeated_stacked(stacked, qgemm, a, b, params)


def repeated_rounded(repeat: RepeatCall, qgemm, a, constants: tuple):
    """The product and rounded add of a call repeating ``repeat``'s kept call (A's shape and type, the same
    constant arrays, the row and the rounding's among them), or None for any other call."""
    arguments = repeat.match(a, constants)
    if arguments is None:
        return None
    flat_shape, packed, pairs, multiplier, offset, consts, line, after, out_shape, rows = arguments
    out = np.empty(out_shape, _F32)
    qgemm.requantized_product_rounded(np.ascontiguousarray(a).reshape(flat_shape), packed, pairs, multiplier, offset,
                                      consts, line, after, out.reshape(rows))
    return out


def _entry(binds: dict, loop, arguments: tuple):
    """``loop``'s entry point for ``arguments``' types, bound once per kernel, loop and array kinds (EntryOnce:
    the kept calls differ from the bound one in shapes only), or None."""
    key = (loop, *((x.dtype, x.ndim) if isinstance(x, np.ndarray) else type(x) for x in arguments))
    bind = binds.get(key)
    if bind is None:
        bind = binds[key] = EntryOnce(loop)
    return bind(arguments)


def _keep_stacked(stacked: RepeatCall, binds: dict, qgemm, a, b, y, constants: tuple, p, after) -> None:
    """Keeps a stacked call without a rounded add whose operands have the same batch dimensions (no broadcast)
    for its repeats, with the loop's entry point once it runs compiled (the dispatcher types six arrays)."""
    if after is None and a.ndim >= 2 and a.shape[:-2] == b.shape[:-2] and y.size \
            and all(c is None or not c.flags.writeable for c in constants):
        a_layout, b_layout = (-1,) + a.shape[-2:], (-1,) + b.shape[-2:]
        loop = qgemm.requantized_batched_product
        entry = _entry(binds, loop, (np.ascontiguousarray(a).reshape(a_layout), np.ascontiguousarray(b).reshape(
            b_layout), p.multiplier, p.offset, p.consts, y.reshape(-1, a.shape[-2], b.shape[-1]))) or loop
        stacked.keep(a, constants, (b.shape, b.dtype, a_layout, b_layout, y.shape, y.dtype, entry,
                                    p.multiplier, p.offset, p.consts))


def repeated_stacked(stacked: RepeatCall, qgemm, a, b, constants: tuple, row=None):
    """The product of stacked operands repeating ``stacked``'s kept call (A's and B's shapes and types, the same
    constant parameters, no rounded add; B is read as fed), or None for any other call."""
    kept = None if row is not None else stacked.match(a, constants)
    if kept is None or b.shape != kept[0] or b.dtype is not kept[1]:
        return None
    a_layout, b_layout = kept[2], kept[3]
    out = np.empty(kept[4], kept[5])
    kept[6](np.ascontiguousarray(a).reshape(a_layout), np.ascontiguousarray(b).reshape(b_layout), *kept[7:],
            out.reshape(-1, a_layout[1], b_layout[2]))
    return out


def _rounded_add(node, qgemm, columns: int, row, scale, zero, dequantize: bool) -> np.ndarray:
    """The rounded add's parameters (qdq_fusions.absorb_rounded_add: a float32 row of 1 or N values added to the
    group's float32 output, then rounded to a per-tensor 8-bit grid) as requantized_product_rounded's ``after``."""
    if not dequantize:
        raise argument_error(node, "a rounded add needs attribute 'dequantize' (it adds to float32 values)")
    if row.dtype != _F32 or row.size not in (1, columns) or row.ndim > 1:
        raise argument_error(node, f"input 'row' is {row.dtype}{row.shape}; expected float32 (1,) or ({columns},)")
    after_scale = _scalar(node, "after_scale", scale, _F32)
    after = np.zeros(4)
    after[[qgemm.AFTER_SCALE, qgemm.AFTER_ZERO]] = after_scale, int(_scalar(node, "after_zero", zero))
    after[[qgemm.AFTER_LOW, qgemm.AFTER_HIGH]] = integer_range(_eight_bit(node, "after_zero", zero))
    return after


def _round_after(y: np.ndarray, row: np.ndarray, after: np.ndarray) -> np.ndarray:
    """The rounded add on a float32 result computed elsewhere (stacked operands): add in float32, then the
    compiled QuantizeLinear -> DequantizeLinear rounding."""
    from ..compiled import qgemm, quantize

    total = np.ascontiguousarray(y + row.reshape(-1), _F32)
    out = np.empty_like(total)
    quantize.fake_quantize(total.reshape(1, 1, -1), np.full(1, after[qgemm.AFTER_SCALE], _F32),
                           np.full(1, after[qgemm.AFTER_ZERO], _F32), after[qgemm.AFTER_LOW], after[qgemm.AFTER_HIGH],
                           out.reshape(1, 1, -1))
    return out


@register("QLinearMatMul", since=10)
def qlinear_matmul(node, shapes, opset):
    """QLinearMatMul: 8-bit codes with per-tensor A and output parameters and a per-tensor or per-column B
    (a matrix, or stacked per tensor) through the QDQ group's compiled kernel (the same integer sum and float64
    requantization), everything else (per-row A, float8, half-precision scales) through the general kernel."""
    fast, general = quantized_matmul(node, shapes, opset), qlinear_matmul_general(node, shapes, opset)
    repeat = fast.repeat  # a repeat of the fast kernel's last call: its loop straight away
    takes_fast = Prepared()  # whether the fast kernel takes these parameters and operand kinds (kept while they come)

    def applies(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero) -> bool:
        return (a.dtype in _EIGHT_BIT and b.dtype in _EIGHT_BIT and a_zero.dtype == a.dtype and b_zero.dtype == b.dtype
                and y_zero.dtype in _EIGHT_BIT and a_scale.dtype == _F32 and b_scale.dtype == _F32
                and y_scale.dtype == _F32 and a_scale.size == a_zero.size == y_scale.size == y_zero.size == 1
                and b.ndim >= 2 and a.ndim >= 1 and _column_params(b, b_scale, b_zero))

    def kernel(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero):
        out = repeated_product(repeat, a, (b, a_scale, a_zero, b_scale, b_zero, y_scale, y_zero, None))
        if out is not None:
            return (out,)
        inputs = (a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero)
        # B by what applies() reads of it: attention's B is a fed activation, a new array each call
        kind = (a.dtype, a.ndim >= 1, b.dtype, b.ndim, b.shape[-1] if b.ndim else 0)
        if takes_fast.get(kind, (a_scale, a_zero, b_scale, b_zero, y_scale, y_zero), lambda: applies(*inputs)):
            return fast(*inputs)
        return general(*inputs)

    return kernel


def _column_params(b, b_scale, b_zero) -> bool:
    """B's scale and zero point per tensor, or for a matrix B one per column as a vector."""
    if b_scale.size == 1 and b_zero.size == 1:
        return True
    columns = b.shape[-1]
    return b.ndim == 2 and all(p.size in (1, columns) and (p.ndim <= 1 or max(p.shape) == p.size)
                               for p in (b_scale, b_zero))


def _pack(qgemm, b, p, trans_b: bool, quantize_b: bool) -> np.ndarray:
    """B (K, N), or (N, K) with transB, as int16 (N, K) with its zero points subtracted (quantized first when
    it is float32 data); kept on ``p`` when B is a constant."""
    matrix = b.T if trans_b else b
    packed = np.empty(matrix.shape[::-1], np.int16)
    if quantize_b:
        qgemm.centred_columns(matrix, p.b_scale, int(p.b_zeros[0]), p.b_low, p.b_high, True, packed)
    else:
        qgemm.pack_columns(matrix, p.b_zeros, packed)
    packed = qgemm.compact(packed)  # (only the pairs, where the tiles run)
    if not b.flags.writeable:
        p.packed = (b, packed)
    return packed


def _columns(b, trans_b: bool) -> int:
    return b.shape[0] if trans_b and b.ndim == 2 else b.shape[-1] if b.ndim else 0


def _stacked(node, qgemm, a, b, p) -> np.ndarray:
    """A @ B for stacked matrices (..., M, K) @ (..., K, N), broadcast over the leading dims; per-tensor B."""
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2] or p.b_zeros.size != 1:
        raise argument_error(node, f"A {a.shape} and B {b.shape} do not multiply as stacked matrices with a "
                             "per-tensor B")
    if a.shape[:-2] == b.shape[:-2]:
        batch = a.shape[:-2]
    else:
        try:
            batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ValueError:
            raise argument_error(node, f"the batch dimensions of A {a.shape} and B {b.shape} do not broadcast") \
                from None
        a = np.broadcast_to(a, batch + a.shape[-2:])
        b = np.broadcast_to(b, batch + b.shape[-2:])
    rows, depth, columns = a.shape[-2], a.shape[-1], b.shape[-1]
    out = np.empty(batch + (rows, columns), p.out_dtype)
    if out.size:
        qgemm.requantized_batched_product(np.ascontiguousarray(a).reshape(-1, rows, depth),
                                          np.ascontiguousarray(b).reshape(-1, depth, columns), p.multiplier,
                                          p.offset, p.consts, out.reshape(-1, rows, columns))
    return out


@register("QuantizedConv", domain=FUSED_DOMAIN, since=1)
def quantized_conv(node, shapes, opset):
    """A QDQ Conv: for group 1 (1-D and 2-D, explicit pads) its patch rows through the integer product of
    QuantizedMatMul in one compiled call (compiled/dynamic_conv.quantized_conv: x quantized, gathered, the int32
    product against the weight packed once, requantized per output channel); otherwise the exact float
    convolution of the centred codes (ops/quantization.integer_conv, quantizing x in the same pass with
    ``quantize_a``), then one requantizing pass per output channel. Both give the same codes (exact sums, the
    same float64 rounding)."""
    from ..compiled import quantize as compiled

    run = integer_conv(node, shapes, opset)
    quantize_a, dequantize = bool(node.attr("quantize_a", 0)), bool(node.attr("dequantize", 0))
    params = Prepared()
    repeat = RepeatCall()  # the last call of the byte products: X's shape and type, the constants, the loop's call
    rows = _conv_rows(node, quantize_a, dequantize, repeat)

    def kernel(x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero, bias=None):
        kept = repeat.match(x, (x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero, bias))
        if kept is not None:
            loop, shape4, arguments, out_shape, out_dtype, layout = kept
            out = np.empty(out_shape, out_dtype)
            loop(np.ascontiguousarray(x).reshape(shape4), *arguments, out.reshape(layout))
            return (out,)
        if w.ndim < 3 or x.ndim != w.ndim:
            raise argument_error(node, f"X {x.shape} and W {w.shape} must be (N, C, ...) and (M, C/group, k...)")
        channels = w.shape[0]
        p = params.get(channels, (x_scale, x_zero, w_scale, w_zero, y_scale, y_zero, bias), lambda: Requantization(
            node, channels, x_scale, x_zero, w_scale, w_zero, y_scale, y_zero, bias))
        _operand(node, "W", w, False, p.b_dtype)
        _operand(node, "X", x, quantize_a, p.a_dtype)
        out = rows(x, w, w_zero, p, lambda kept: repeat.keep(x, (x_scale, x_zero, w, w_scale, w_zero, y_scale,
                                                                   y_zero, bias), kept))
        if out is not None:
            return (out,)
        acc = run(x, w, x_zero, w_zero, (p.a_scale, p.a_low, p.a_high) if quantize_a else None)
        out = np.empty(acc.shape, _F32 if dequantize else p.y_dtype)
        if out.size:
            layout = (1, 1, -1) if p.per_tensor else (acc.shape[0], channels, -1)
            compiled.requantize_affine(acc.reshape(layout), p.multiplier, p.offset, p.y_zero, p.y_low, p.y_high,
                                       p.y_scale, dequantize, out.reshape(layout))
        return (out,)

    return kernel


def _conv_rows(node, quantize_a: bool, dequantize: bool, repeat: RepeatCall):
    """quantized_conv's compiled call: a function of (x, w, w_zero, the group's Requantization, a function that
    keeps a call's loop and arguments on ``repeat``) giving the output, or None where the call does not take
    them (another group count or auto_pad, a geometry patch_geometry declines). While numba loads in the
    background its numpy twin (generic_int8) serves. A 1-D convolution without dilation over an even channel
    count, where the register tiles run, reads its windows in place from channel-last codes
    (dynamic_conv.quantized_conv_lines) instead of gathering patch rows; over whole quads of channels, on VNNI,
    as bytes (dynamic_conv.quantized_conv_quads), whose calls are kept for their repeats. On VNNI a 2-D one runs
    channel-major (_conv_blocks)."""
    auto_pad = node.attr("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if int(node.attr("group", 1)) != 1 or auto_pad != "NOTSET":
        return lambda *inputs: None
    geometries: dict = {}  # per (X's shape, W's shape): patch_geometry's answer
    side: list = [None, None, {}]  # the weight, its zero point, then its (packed, pairs) per layout
    ran = SimpleNamespace(compiled=False)  # (the lines' call in a Trial until one ran whole: deferred.tried)
    binds: dict = {}  # the byte products' entry point (EntryOnce), for the kept calls

    def call(x, w, w_zero, p, keep):
        from ..compiled import dynamic_conv, qgemm  # (found in sys.modules after the first call)

        key = (x.shape, w.shape)
        geometry = geometries.get(key)
        if geometry is None:
            geometry = patch_geometry(node, x.shape, w.shape)
            if geometry is None:
                return None
            if len(geometries) < 16:
                geometries[key] = geometry
        if p.consts is None:
            p.consts = p.compiled_consts(quantize_a, False, dequantize)
        shape4, steps, out_shape, (oh, ow) = geometry
        out = _channel_major(side, binds, keep, x, w, w_zero, p, geometry, dequantize)
        if out is not None:
            return out
        if _takes_lines(qgemm, shape4, steps) and not numpy_first():
            out = _lines_call(ran, binds, keep, side, x, w, w_zero, p, geometry, dequantize)
            if out is not None:
                return out
        packed, pairs = _conv_weight(side, qgemm, w, w_zero, p, False)
        out = np.empty(out_shape, _F32 if dequantize else p.y_dtype)
        pad = np.float32(0) if quantize_a else x.dtype.type(p.a_zero)
        dynamic_conv.quantized_conv(np.ascontiguousarray(x).reshape(shape4), pad, *steps, oh, ow, packed, pairs,
                                    p.multiplier, p.offset, p.consts, out.reshape(out_shape[0], out_shape[1], oh * ow))
        return out

    return call


def _lines_call(ran, binds: dict, keep, side: list, x, w, w_zero, p, geometry: tuple, dequantize: bool):
    """_conv_rows' call of the windows read in place, as bytes on VNNI (kept for its repeats) or as int16 pairs;
    None where the compiled loop could not run it (deferred.tried, until one ran whole)."""
    from ..compiled import dynamic_conv, qgemm, qgemm_quads

    arguments = (side, dynamic_conv, qgemm, x, w, w_zero, p, geometry, dequantize)
    quads = _takes_quads(qgemm_quads, geometry[0])
    lines = _conv_quads if quads else _conv_lines
    out = lines(*arguments) if ran.compiled else tried(ran, "compiled", lines, *arguments)
    if out is not None and quads and ran.compiled:
        _keep_quads(binds, keep, side, dynamic_conv, x, w, w_zero, p, geometry, out)
    return out


def _takes_blocks(qgemm_quads, shape4: tuple, steps: tuple) -> bool:
    """Whether the convolution runs channel-major on the byte products (compiled/quantized_conv_blocks): VNNI and
    a 2-D convolution (1-D ones read their windows in place: _takes_lines)."""
    return qgemm_quads.AVAILABLE and not (shape4[2] == steps[0] == 1)


def _conv_blocks(side: list, binds: dict, x, w, w_zero, p, geometry: tuple, dequantize: bool) -> np.ndarray:
    """_conv_rows' call through compiled/quantized_conv_blocks (patches as quads by output position, the weight's
    signed rows broadcast, requantized along each output channel's plane), from KNOBS.split_macs of multiply-adds a
    thread across the helper threads (dynamic_conv_jobs.split_quantized_conv). A call on the calling thread alone
    goes through the loop's entry point once bound (``binds``, by the input's type: numba's dispatcher types its
    22 arguments every call, a small convolution's cost)."""
    from ..compiled import quantized_conv_blocks

    shape4, steps, out_shape, (oh, ow) = geometry
    weight, terms, zeros = _block_weight(side, w, w_zero, p)
    factors, shifts = _channel_params(p, w.shape[0])
    out = np.empty(out_shape, _F32 if dequantize else p.y_dtype)
    out3 = out.reshape(out_shape[0], out_shape[1], oh * ow)
    x4 = np.ascontiguousarray(x).reshape(shape4)
    (xa, xb), (oa, ob) = _pairs(x4, out3, dequantize)
    arguments = (xa, xb, *steps, oh, ow, weight, terms, zeros, factors, shifts, p.consts, oa, ob)
    _channel_call(binds, ("blocks", x4.dtype), quantized_conv_blocks.quantized_conv_blocks, "QUANTIZED_CONV",
                  out_shape[0] * oh * ow * weight.size)(arguments)
    return out


def _channel_call(binds: dict, key: tuple, loop, kind: str, macs: int):
    """``run(arguments)`` of a channel-major call, kept for repeats: split across the helpers from KNOBS.split_macs
    a thread (dynamic_conv_jobs' job ``kind``, its split_ function; the count looked up per call), else on this thread;
    either through its entry point once bound (``binds``, EntryOnce: the dispatcher types 25-31 arguments, ~10 us)."""
    from ..compiled import dynamic_conv_jobs, workers  # (numba runs these loops: its import is paid)
    from .dynamic_quantize_conv import split_threads, task_ranges  # (a transformer's QDQ model needs neither)

    single = binds.get(key) or binds.setdefault(key, EntryOnce(loop))
    split = binds.get(("split", *key)) or binds.setdefault(
        ("split", *key), EntryOnce(getattr(dynamic_conv_jobs, "split_" + kind.lower())))
    address = getattr(dynamic_conv_jobs, kind).address()

    def run(arguments: tuple) -> None:
        threads = split_threads(macs)
        if threads < 2:
            single.run(arguments)
            return
        workers.call(lambda *every: split.run(every), (*arguments, task_ranges(threads), np.zeros(threads, np.int64),
                     workers.local_mailbox(0)), address, 0, helper_count())

    return run


def _channel_major(side: list, binds: dict, keep, x, w, w_zero, p, geometry: tuple, dequantize: bool):
    """_conv_rows' channel-major call of a 2-D convolution on VNNI: read in place from the grid of channel quads
    (_conv_grid, its calls on the calling thread kept by ``keep`` for their repeats) or through patches
    (_conv_blocks); None for other geometries and while numba loads (the patch rows' numpy twin serves)."""
    from ..compiled import qgemm_quads

    if not _takes_blocks(qgemm_quads, geometry[0], geometry[1]):
        return None
    if _takes_grid(qgemm_quads, p, w.shape, geometry[3][1]):
        if numpy_first("dynamic_conv_jobs.QUANTIZED_GRID"):
            return None
        return _conv_grid(side, binds, keep, x, w, w_zero, p, geometry, dequantize)
    if numpy_first("dynamic_conv_jobs.QUANTIZED_CONV"):
        return None
    return _conv_blocks(side, binds, x, w, w_zero, p, geometry, dequantize)


def _takes_grid(qgemm_quads, p, w_shape: tuple, row: int) -> bool:
    """Whether a 2-D convolution that runs channel-major reads the input in place (compiled/quantized_conv_grid)
    rather than through patches: every weight zero point 0 (signed; uint8 weights' 128) and finite requantization
    parameters (a NaN bias's code 0 is the patches' epilogue's), unless AMX's tile groups run it faster."""
    shift = 128 if p.b_dtype == np.uint8 else 0
    return p.finite and not np.any(p.b_zeros != shift) \
        and not qgemm_quads.amx_beats_grid(w_shape[0], math.prod(w_shape[1:]), w_shape[2] * w_shape[3], row)


def _conv_grid(side: list, binds: dict, keep, x, w, w_zero, p, geometry: tuple, dequantize: bool) -> np.ndarray:
    """_conv_rows' call through compiled/quantized_conv_grid (the input's codes as a grid of channel quads read in
    place by the tiles), split across the helpers as _conv_blocks' (dynamic_conv_jobs.split_quantized_grid), kept
    (``keep``) for its repeats: the same shape and constants call the loop, or post its split, straight away."""
    from ..compiled import quantized_conv_grid

    shape4, steps, out_shape, (oh, ow) = geometry
    weight, terms = _kept_form(side, w, w_zero, ("grid", p.a_zero - p.a_low),
                               lambda: quantized_conv_grid.grid_weight(w, p.a_zero - p.a_low))
    factors, shifts = _channel_params(p, w.shape[0])
    if p.singles is None:
        p.singles = quantized_conv_grid.single_params(factors, shifts, p.y_low, p.y_high, p.y_zero)
    out = np.empty(out_shape, _F32 if dequantize else p.y_dtype)
    out3 = out.reshape(out_shape[0], out_shape[1], oh * ow)
    x4 = np.ascontiguousarray(x).reshape(shape4)
    tables = side[2].get(("grid tables", shape4))  # kept with the weight's forms, for up to 16 input shapes
    if tables is None:
        tables = quantized_conv_grid.grid_tables(*shape4[1:], *steps, oh, ow)
        if sum(isinstance(key, tuple) and key[0] == "grid tables" for key in side[2]) < 16:
            side[2][("grid tables", shape4)] = tables
    (xa, xb), (oa, ob) = _pairs(x4, out3, dequantize)
    arguments = (xa, xb, *steps, oh, ow, weight, terms, factors, shifts, p.singles, p.consts, *tables, oa, ob)
    loop = quantized_conv_grid.quantized_conv_grid
    run = _channel_call(binds, ("grid", x4.dtype), loop, "QUANTIZED_GRID", out_shape[0] * oh * ow * weight.size)
    run(arguments)
    keep((_grid_repeat(run, arguments[2:-2], dequantize), shape4, (), out_shape, out.dtype,
          (out_shape[0], out_shape[1], oh * ow)))
    return out


def _grid_repeat(run, middle: tuple, dequantize: bool):
    """A kept grid call as the repeat's ``loop(x4, out3)``, ``middle`` its arguments between X's and the output's."""
    return lambda x4, out3: run((*(pairs := _pairs(x4, out3, dequantize))[0], *middle, *pairs[1]))


def _pairs(x4, out3, dequantize: bool) -> tuple:
    """X and the output in the channel-major loops' two-array convention: (float32, bytes), the other one empty."""
    floats = x4.dtype == _F32
    return ((x4, _NO_BYTES4) if floats else (_NO_FLOATS4, x4.view(np.uint8)),
            (out3, _NO_BYTES3) if dequantize else (_NO_FLOATS3, out3.view(np.uint8)))


_NO_FLOATS4, _NO_BYTES4 = np.zeros((0, 0, 0, 0), _F32), np.zeros((0, 0, 0, 0), np.uint8)
_NO_FLOATS3, _NO_BYTES3 = np.zeros((0, 0, 0), _F32), np.zeros((0, 0, 0), np.uint8)


def _block_weight(side: list, w, w_zero, p) -> tuple:
    """quantized_conv_blocks' weight for the input's zero point (kept as _kept_form keeps): the signed codes as rows
    of whole quads (qgemm_quads.weight_rows, k = (c*KH + i)*KW + j; padded for AMX's tiles where those run), the
    zero points' constant term per output channel (int32, wrapped) and the signed zero points."""
    from ..compiled import qgemm_quads

    unsigned_zero = p.a_zero - p.a_low  # the input's zero point among its codes shifted to unsigned

    def make():
        columns = w.reshape(w.shape[0], -1).T
        quads, sums, zeros = qgemm_quads.signed_quads(columns, p.b_zeros)
        terms = unsigned_zero * (columns.shape[0] * zeros - sums)  # exact in int64; the kernel's sums wrap at int32
        rows = qgemm_quads.weight_rows(quads, w.shape[0])
        return (qgemm_quads.amx_rows(rows) if qgemm_quads.AMX else rows, terms.astype(np.uint32).view(np.int32),
                zeros.astype(np.int32))

    return _kept_form(side, w, w_zero, ("blocks", unsigned_zero), make)


def _channel_params(p, columns: int) -> tuple:
    """The group's requantize_affine multiplier and offset, one each per output channel (float64), kept on ``p``."""
    found = p.channel_params
    if found is None or found[0].shape[0] != columns:
        found = p.channel_params = tuple(np.ascontiguousarray(np.broadcast_to(v, (columns,)), dtype=np.float64)
                                         for v in (p.multiplier, p.offset))
    return found


def _conv_lines(side: list, dynamic_conv, qgemm, x, w, w_zero, p, geometry: tuple, dequantize: bool):
    """_conv_rows' call through dynamic_conv.quantized_conv_lines (the windows read in place)."""
    shape4, steps, out_shape, (_, ow) = geometry
    _, pairs = _conv_weight(side, qgemm, w, w_zero, p, True)
    out = np.empty(out_shape, _F32 if dequantize else p.y_dtype)
    dynamic_conv.quantized_conv_lines(np.ascontiguousarray(x).reshape(shape4), steps[1], steps[3], steps[8],
                                      steps[9], ow, pairs, p.multiplier, p.offset, p.consts,
                                      out.reshape(out_shape[0], out_shape[1], ow))
    return out


def _conv_quads(side: list, dynamic_conv, qgemm, x, w, w_zero, p, geometry: tuple, dequantize: bool):
    """_conv_rows' call through dynamic_conv.quantized_conv_quads (the windows read in place as bytes, VNNI's
    byte products)."""
    shape4, steps, out_shape, (_, ow) = geometry
    quads, fix, zeros = _quad_weight(side, w, w_zero, p)
    out = np.empty(out_shape, _F32 if dequantize else p.y_dtype)
    dynamic_conv.quantized_conv_quads(np.ascontiguousarray(x).reshape(shape4), steps[1], steps[3], steps[8],
                                      steps[9], ow, quads, fix, zeros, p.multiplier, p.offset, p.consts,
                                      out.reshape(out_shape[0], out_shape[1], ow))
    return out


def _keep_quads(binds: dict, keep, side: list, dynamic_conv, x, w, w_zero, p, geometry: tuple, out) -> None:
    """Keeps a call of the byte products for its repeats (``keep``): the loop's entry point once it runs compiled
    (its dispatcher types thirteen arguments a call) and its arguments but X and the output."""
    shape4, steps, out_shape, (_, ow) = geometry
    layout = (out_shape[0], out_shape[1], ow)
    arguments = (steps[1], steps[3], steps[8], steps[9], ow, *_quad_weight(side, w, w_zero, p), p.multiplier,
                 p.offset, p.consts)
    loop = dynamic_conv.quantized_conv_quads
    entry = _entry(binds, loop, (np.ascontiguousarray(x).reshape(shape4), *arguments, out.reshape(layout)))
    keep((entry or loop, shape4, arguments, out_shape, out.dtype, layout))


def _takes_quads(qgemm_quads, shape4: tuple) -> bool:
    """Whether the lines run on the byte products: VNNI, and a channel count of whole quads (every window and
    every stride starts on one)."""
    return qgemm_quads.AVAILABLE and shape4[1] % 4 == 0


def _quad_weight(side: list, w, w_zero, p) -> tuple:
    """quantized_conv_quads' weight for the input's zero point (kept as _kept_form keeps): the codes as signed bytes
    (uint8 codes less 128) in quads of (tap, channel) order, the zero points' term per channel and zero points."""
    from ..compiled import qgemm_quads

    unsigned_zero = p.a_zero - p.a_low  # the input's zero point among its codes shifted to unsigned

    def make():
        columns = w.reshape(w.shape[0], w.shape[1], -1).transpose(2, 1, 0).reshape(-1, w.shape[0])
        quads, sums, zeros = qgemm_quads.signed_quads(columns, p.b_zeros)
        return quads, unsigned_zero * (columns.shape[0] * zeros - sums), zeros

    return _kept_form(side, w, w_zero, ("quads", unsigned_zero), make)


def _kept_form(side: list, w, w_zero, key, make):
    """A form of the weight the products take (``make()``), kept in ``side`` per ``key`` while the same constant
    weight and zero point come in (side: [the weight, its zero point, forms by key])."""
    if side[0] is not w or side[1] is not w_zero:
        side[:] = [w, w_zero, {}]
    found = side[2].get(key)
    if found is None:
        found = make()
        if not w.flags.writeable and not w_zero.flags.writeable:
            side[2][key] = found
    return found


def _takes_lines(qgemm, shape4: tuple, steps: tuple) -> bool:
    """Whether dynamic_conv.quantized_conv_lines takes this geometry: height 1 with a one-row kernel and no
    vertical pads, no dilation, an even channel count (windows start on whole pairs), register tiles. (The loop
    has no numpy twin: while numba loads, the patch rows' twin serves.)"""
    kh, dw, top, bottom = steps[0], steps[5], steps[6], steps[7]
    return shape4[2] == kh == 1 and dw == 1 and top == bottom == 0 and shape4[1] % 2 == 0 \
        and qgemm.qgemm_tiles.AVAILABLE


def _conv_weight(side: list, qgemm, w, w_zero, p, lines: bool):
    """The packed weight and its pairs: columns (channel, tap) for patch rows, (tap, channel) for lines."""

    def make():
        # (K, M): k = j * C + c (a copy) for lines, c * taps + j (a view) for patch rows
        columns = w.reshape(w.shape[0], w.shape[1], -1).transpose(2, 1, 0).reshape(-1, w.shape[0]) if lines \
            else w.reshape(w.shape[0], -1).T
        packed = np.empty((w.shape[0], w[0].size), np.int16)
        qgemm.pack_columns(columns, p.b_zeros, packed)
        packed = qgemm.compact(packed)
        return packed, qgemm.pairs_for(packed)

    return _kept_form(side, w, w_zero, lines, make)


@register("QLinearMatMulAdd", domain=FUSED_DOMAIN, since=1)
def qlinear_matmul_add(node, shapes, opset):
    """QLinearMatMul whose codes only a QLinearAdd of a constant row reads (the bias of onnxruntime's QOperator
    format; qdq_fusions.fuse_qlinear_matmul_bias), in one compiled pass that rounds twice, as the two nodes do.

    Inputs: QLinearMatMul's eight, then the Add's constant operand (bias, bias_scale, bias_zero), the product's
    parameters as the Add reads them (x_scale, x_zero) and the output's (c_scale, c_zero); ``bias_first``: the
    bias was the Add's A. Anything the pass does not take (other types, a stacked B, a bias that is not a row)
    runs the two kernels in turn, which also give the errors."""
    from ..compiled import qgemm
    from .contrib_qlinear_binary import qlinear_add

    matmul, add = qlinear_matmul(node, shapes, opset), qlinear_add(node, shapes, opset)
    bias_first = bool(node.attr("bias_first", 0))
    prepared = Prepared()

    def prepare(columns, a_scale, a_zero, b_scale, b_zero, y_scale, y_zero, bias_scale, bias_zero, x_scale, x_zero,
                c_scale, c_zero):
        add_params = (bias_scale, bias_zero, x_scale, x_zero, c_scale, c_zero)
        if any(v is None or v.size != 1 for v in add_params) or any(s.dtype != _F32 for s in add_params[::2]) \
                or not (bias_zero.dtype == x_zero.dtype == c_zero.dtype == y_zero.dtype):
            return None
        try:
            p = Requantization(node, columns, a_scale, a_zero, b_scale, b_zero, y_scale, y_zero, None)
        except OnnxRuntimeError:
            return None
        p.consts = p.compiled_consts(False, False, False)
        low, high = integer_range(c_zero.dtype)
        p.add = np.array([x_zero.reshape(-1)[0], x_scale.reshape(-1)[0], bias_zero.reshape(-1)[0],
                          bias_scale.reshape(-1)[0], c_zero.reshape(-1)[0], c_scale.reshape(-1)[0], low, high],
                         np.float64)
        return p

    repeat = RepeatCall()  # the last compiled call: A's shape and type, the constants and the loop's arguments

    def compiled(a, b, bias, p, columns: int, key: tuple):
        out = np.empty(a.shape[:-1] + (columns,), p.y_dtype)
        if out.size:
            packed = p.packed[1] if p.packed is not None and p.packed[0] is b else _pack(qgemm, b, p, False, False)
            arguments = ((-1, b.shape[0]), packed, qgemm.pairs_for(packed), p.multiplier, p.offset, p.consts,
                         bias.reshape(-1), p.add, (-1, columns), out.shape, p.y_dtype)
            qgemm.requantized_product_add(np.ascontiguousarray(a).reshape(arguments[0]), *arguments[1:-3],
                                          out.reshape(arguments[-3]))
            repeat.keep(a, key, arguments)  # constants (B, packed once, among them): later calls skip the checks
        return (out,)

    def kernel(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero, bias, bias_scale, bias_zero, x_scale,
               x_zero, c_scale, c_zero):
        key = (a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero, bias, bias_scale, bias_zero, x_scale, x_zero,
               c_scale, c_zero)
        arguments = repeat.match(a, key)
        if arguments is not None:
            out = np.empty(arguments[-2], arguments[-1])
            qgemm.requantized_product_add(np.ascontiguousarray(a).reshape(arguments[0]), *arguments[1:-3],
                                          out.reshape(arguments[-3]))
            return (out,)
        params = (a_scale, a_zero, b_scale, b_zero, y_scale, y_zero, bias_scale, bias_zero, x_scale, x_zero,
                  c_scale, c_zero)
        columns = b.shape[-1] if b.ndim else 0
        p = prepared.get(columns, params, lambda: prepare(columns, *params))
        if p is not None and b.ndim == 2 and 1 <= a.ndim and a.shape[-1] == b.shape[0] and a.dtype is p.a_dtype \
                and b.dtype is p.b_dtype and bias.dtype is p.y_dtype and bias.ndim <= a.ndim \
                and (bias.size == 1 or bias.shape[-1] == bias.size == columns) and _column_params(b, b_scale, b_zero):
            return compiled(a, b, bias, p, columns, key)
        (y,) = matmul(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero)
        first, second = ((bias, bias_scale, bias_zero), (y, x_scale, x_zero))[::1 if bias_first else -1]
        return add(*first, *second, c_scale, c_zero)

    return kernel
