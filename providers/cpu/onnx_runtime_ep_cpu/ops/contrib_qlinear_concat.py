"""QLinearConcat and QLinearWhere (domain com.microsoft, docs/ContribOperators.md): each input requantized to
the output's scale and zero point (dequantized, then quantized as QuantizeLinear does), then joined."""

from __future__ import annotations

import math
from operator import is_

import numpy as np

from ..algorithms.quantize import apply_table, dequantize, lookup_codes_into, lookup_table, quantize
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error, normalize_axis, required_attr
from .contrib_quantization import eight_bit, float_scale, scalar

# -- QLinearConcat ---------------------------------------------------------------------------------


class _QLinearConcat:
    """Each part requantized to Y's grid (a constant part once, a part of constant parameters by a 256-code
    table), then joined. A call whose parameters and constant parts are the kept call's read-only arrays and
    whose other parts have its shapes and dtypes repeats its plan without the checks: a constant part's codes,
    a table or nothing per part, each written in its place of the output (_joined; a part of other strides, a
    transposed view, is made contiguous first)."""

    def __init__(self, node):
        self.node = node
        self.axis = int(required_attr(node, "axis", "the axis to concatenate on"))
        self.constant_parts: dict[int, tuple] = {}  # a constant part (a class token) requantized once
        self.tables: dict[int, tuple] = {}  # per part, its constant parameters and 256-code table (None: same grid)
        # the last checked call's (constants, the other parts' (shape, dtype), axis, a step per part), or None
        self.kept: tuple | None = None

    def __call__(self, y_scale, y_zero_point, *triples):
        kept = self.kept  # (one read: another thread may keep another call meanwhile)
        if kept is not None:
            constants, kinds, a, steps = kept
            tensors = triples[0::3]
            if len(triples) == 3 * len(steps) and all(map(is_, constants, (y_scale, y_zero_point, *triples[1::3],
                                                                        *triples[2::3]))) \
                    and all(_repeats(x, step, kind) for x, step, kind in zip(tensors, steps, kinds)):
                return (_joined(tensors, steps, a),)
        y = self.checked(y_scale, y_zero_point, triples)
        self.keep(y_scale, y_zero_point, triples)
        return y

    def part(self, i, triple, dtype, scale, zero, y_params):
        seen = self.constant_parts.get(i)
        if seen is not None and all(map(is_, seen[0], triple + y_params)):
            return seen[1]
        params = triple[1:] + y_params
        known = self.tables.get(i)
        if known is not None and all(map(is_, known[0], params)) and triple[0].dtype == dtype:
            codes = triple[0] if known[1] is None else apply_table(known[1], triple[0])
        else:
            codes = _requantized(self.node, i // 3, triple, dtype, scale, zero)
            if not any(v is not None and v.flags.writeable for v in params):
                # a code's requantized value depends on the code only: one table for every later call
                same = codes is triple[0]
                self.tables[i] = (params, None if same else _requantize_table(triple, dtype, scale, zero))
        if not any(v is not None and v.flags.writeable for v in triple + y_params):
            self.constant_parts[i] = (triple + y_params, codes)
        return codes

    def checked(self, y_scale, y_zero_point, triples):
        node = self.node
        dtype = eight_bit(node, "Y_zero_point", y_zero_point)
        scale, zero = float_scale(node, "Y_scale", y_scale), scalar(node, "Y_zero_point", y_zero_point)
        if not triples or len(triples) % 3:
            raise argument_error(node, f"has {len(triples)} inputs after Y_scale and Y_zero_point; expected "
                                 "(tensor, scale, zero point) triples")
        parts = [self.part(i, triples[i:i + 3], dtype, scale, zero, (y_scale, y_zero_point))
                 for i in range(0, len(triples), 3)]
        a = normalize_axis(node, self.axis, parts[0].ndim)
        _check_concat_shapes(node, parts, a)
        return (np.concatenate(parts, axis=a),)

    def keep(self, y_scale, y_zero_point, triples) -> None:
        """Keeps the plan of a call that just passed the checks, where every part's work is fixed by read-only
        arrays: a constant part's codes, another part's table (None: on Y's grid already, taken as it is)."""
        y_params = (y_scale, y_zero_point)
        steps, kinds = [], []
        for i in range(0, len(triples), 3):
            seen = self.constant_parts.get(i)
            if seen is not None and all(map(is_, seen[0], triples[i:i + 3] + y_params)):
                steps.append(_Codes(seen[1], triples[i]))
                kinds.append(None)
                continue
            known = self.tables.get(i)
            if known is None or not all(map(is_, known[0], triples[i + 1:i + 3] + y_params)):
                self.kept = None
                return
            steps.append(known[1])
            kinds.append((triples[i].shape, triples[i].dtype))
        a = normalize_axis(self.node, self.axis, triples[0].ndim)
        self.kept = ((*y_params, *triples[1::3], *triples[2::3]), kinds, a, steps)


def _joined(tensors, steps, axis: int) -> np.ndarray:
    """A kept plan's output: each part written in its place, a table's codes looked up there (lookup_codes_into;
    numpy's indexing then a concatenation made two passes and an index array), the others copied."""
    sources = [step.codes if type(step) is _Codes else x for x, step in zip(tensors, steps)]
    shape = list(sources[0].shape)
    shape[axis] = sum(x.shape[axis] for x in sources)
    out = np.empty(shape, sources[0].dtype)
    outer = math.prod(shape[:axis])
    if not out.size:
        return out
    rows = out.reshape(outer, -1).view(np.uint8)
    at = 0
    for x, step in zip(sources, steps):
        width = x.size // outer
        part = x.reshape(outer, width).view(np.uint8) if x.flags.c_contiguous else \
            np.ascontiguousarray(x).reshape(outer, width).view(np.uint8)
        if step is None or type(step) is _Codes:
            rows[:, at:at + width] = part
        else:
            lookup_codes_into(step, part, rows, at)
        at += width
    return out


def _repeats(x, step, kind) -> bool:
    """Whether part ``x`` is the kept call's: the same constant array, or the same shape and dtype."""
    if kind is None:
        return x is step.source
    return x.shape == kind[0] and x.dtype is kind[1]


@register("QLinearConcat", domain=CONTRIB_DOMAIN, since=1)
def qlinear_concat(node, shapes, opset):
    return _QLinearConcat(node)


class _Codes:
    """A constant part's requantized codes in a kept QLinearConcat plan (beside tables and None), and the
    read-only array they were made from."""

    __slots__ = ("codes", "source")

    def __init__(self, codes: np.ndarray, source: np.ndarray):
        self.codes, self.source = codes, source


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
