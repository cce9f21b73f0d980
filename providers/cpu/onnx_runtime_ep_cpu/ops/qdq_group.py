"""QDQ products of one input run as one (qdq_groups.group_quantized_products): a layer's query, key and value
projections, or its gate and up projections, each quantized the same activation again and paid a node's fixed
cost for a small integer product. Here A is quantized once and multiplied by the members' weights side by side;
each member's columns are requantized with its own output scale and zero point (compiled/qgemm.requantized_group),
the bits its own QuantizedMatMul gives.

Inputs: A, a_scale, a_zero_point, then per member B, b_scale, b_zero_point, y_scale, y_zero_point, bias ("" where
absent), and with attribute ``rounded`` three more, its rounded add's row, after_scale, after_zero (QuantizedMatMul's
last three, qdq_fusions.absorb_rounded_add: an encoder's Linear bias added after the product's rounding, then
rounded again; "" for a member without one); one output per member, each a contiguous block of one buffer.
Attributes: ``quantize_a`` and ``dequantize`` as QuantizedMatMul's (shared), ``trans_b`` one flag per member
(Gemm's transB), ``rounded``.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.ir import Node

from ..algorithms.prepared import Prepared
from ..algorithms.quantize import integer_range
from ..algorithms.repeat_call import RepeatCall
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import argument_error
from .qdq_linear import Requantization, quantized_matmul

_F32 = np.dtype(np.float32)
SLOTS = 6  # each member's inputs after A's three: B, b_scale, b_zero_point, y_scale, y_zero_point, bias
ROUNDED_SLOTS = 9  # the same, then its rounded add's row, after_scale, after_zero (attribute ``rounded``)
_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))


class _Joined:
    """The members' constant side as one product: the weights side by side packed once, per joined column the
    multiplier and offset, per member its block and output parameters (qgemm.requantized_group's layout)."""

    def __init__(self, qgemm, parts: list, trans: list[bool], quantize_a: bool, dequantize: bool, adds=None):
        matrices = [b.T if t else b for (b, *_), t in zip(parts, trans)]
        self.depth = matrices[0].shape[0]
        self.widths = [m.shape[1] for m in matrices]
        self.columns = sum(self.widths)
        ps = [p for *_, p in parts]
        zeros = np.concatenate([np.broadcast_to(p.b_zeros, (w,)) for p, w in zip(ps, self.widths)]).astype(np.int32)
        packed = np.empty((self.columns, self.depth), np.int16)
        qgemm.pack_columns(np.concatenate(matrices, axis=1), zeros, packed)
        self.packed = qgemm.compact(packed)
        self.pairs = qgemm.pairs_for(self.packed)
        self.multiplier = np.concatenate([np.broadcast_to(p.multiplier, (w,)) for p, w in zip(ps, self.widths)])
        self.offset = np.concatenate([np.broadcast_to(p.offset, (w,)) for p, w in zip(ps, self.widths)])
        self.consts = ps[0].compiled_consts(quantize_a, False, dequantize)
        self.a_dtype = _F32 if quantize_a else ps[0].a_dtype
        self.out_dtype = _F32 if dequantize else ps[0].y_dtype
        starts = np.cumsum([0, *self.widths])
        self.members = np.zeros((len(ps), qgemm.GROUP_COLUMNS))
        for g, p in enumerate(ps):
            row = self.members[g]
            row[[qgemm.G_FIRST, qgemm.G_WIDTH]] = starts[g], self.widths[g]
            row[[qgemm.G_ZERO, qgemm.G_LOW, qgemm.G_HIGH, qgemm.G_SCALE]] = p.y_zero, p.y_low, p.y_high, p.y_scale
        self.row = self.afters = None
        if adds is not None:  # per member (its row, its ``after``) or None: the joined row and afters
            self.row = np.zeros(self.columns, _F32)
            self.afters = np.zeros((len(ps), qgemm.AFTER_COLUMNS))
            for g, add in enumerate(adds):
                if add is not None:
                    self.row[starts[g]:starts[g + 1]] = add[0].reshape(-1)  # (a row of one value: repeated)
                    self.afters[g, :4], self.afters[g, qgemm.AFTER_ON] = add[1], 1


def joined(qgemm, nodes: list[Node], a_scale, a_zero, members: list, trans: list[bool], quantize_a: bool,
            dequantize: bool, rounded: bool = False) -> _Joined | None:
    """The joined side, or None where a member's inputs do not fit the one product (each member's own kernel
    then runs, and gives the error if any): a 2-D B of its zero point's type and one depth for all, per-member
    parameters its own node takes, and one output type; a rounded add as _rounded_add takes it."""
    parts, adds = [], []
    for node, (b, b_scale, b_zero, y_scale, y_zero, bias, *add), t in zip(nodes, members, trans):
        if b is None or b.ndim != 2:
            return None
        try:
            p = Requantization(node, b.shape[0] if t else b.shape[1], a_scale, a_zero, b_scale, b_zero, y_scale,
                                y_zero, bias)
        except OnnxRuntimeError:
            return None
        if b.dtype != p.b_dtype:
            return None
        parts.append((b, p))
        if rounded:
            adds.append(_rounded_add(qgemm, b.shape[0] if t else b.shape[1], *add) if add[0] is not None else None)
            if adds[-1] is False:
                return None
    depths = {b.shape[1] if t else b.shape[0] for (b, _), t in zip(parts, trans)}
    if len(depths) != 1 or (not dequantize and len({p.y_dtype for _, p in parts}) != 1) \
            or (rounded and not dequantize):
        return None
    return _Joined(qgemm, parts, trans, quantize_a, dequantize, adds if rounded else None)


def _rounded_add(qgemm, columns: int, row, scale, zero):
    """(row, after) of a member's rounded add as requantized_product_rounded takes them (a float32 row of 1 or
    ``columns`` values, a per-tensor float32 scale and 8-bit zero point), or False."""
    if row.dtype != _F32 or row.ndim > 1 or row.size not in (1, columns) or scale is None or zero is None \
            or scale.dtype != _F32 or scale.size != 1 or zero.dtype not in _EIGHT_BIT or zero.size != 1:
        return False
    after = np.zeros(4)
    after[[qgemm.AFTER_SCALE, qgemm.AFTER_ZERO]] = scale.reshape(-1)[0], int(zero.reshape(-1)[0])
    after[[qgemm.AFTER_LOW, qgemm.AFTER_HIGH]] = integer_range(zero.dtype)
    return np.broadcast_to(row.reshape(-1), (columns,)), after


def member_nodes(node) -> list[Node]:
    """Each member as the QuantizedMatMul it was (its kernel serves the calls the joined product does not take)."""
    count = len(node.outputs)
    trans = _trans(node, count)
    shared = {"quantize_a": int(node.attr("quantize_a", 0)), "dequantize": int(node.attr("dequantize", 0))}
    width = ROUNDED_SLOTS if node.attr("rounded", 0) else SLOTS
    inputs = list(node.inputs) + [""] * (3 + width * count - len(node.inputs))
    nodes = []
    for g in range(count):
        slots = inputs[3 + width * g:3 + width * (g + 1)]
        names = [*inputs[:3], *slots[:5]] + ([slots[5]] if slots[5] or slots[SLOTS:] and slots[SLOTS] else [])
        if slots[SLOTS:] and slots[SLOTS]:
            names += slots[SLOTS:]
        nodes.append(Node("QuantizedMatMul", names, [node.outputs[g]], name=f"{node.name}/{g}", domain=FUSED_DOMAIN,
                          attrs={**shared, "transB": int(trans[g])}, opset=1))
    return nodes


def _trans(node, count: int) -> list[bool]:
    trans = [bool(t) for t in node.attr("trans_b", [0] * count)]
    if len(trans) != count:
        raise argument_error(node, f"attribute 'trans_b' has {len(trans)} flags for {count} outputs; expected one "
                                   "per member")
    return trans


@register("QuantizedMatMulGroup", domain=FUSED_DOMAIN, since=1)
def quantized_matmul_group(node, shapes, opset):
    """One integer product for the members (see the module docstring); any call the joined product does not take
    (another A type or depth, a member's inputs out of its form) runs each member's own kernel."""
    from ..compiled import qgemm  # once here: an import statement costs each call microseconds

    count = len(node.outputs)
    rounded = bool(node.attr("rounded", 0))
    width = ROUNDED_SLOTS if rounded else SLOTS
    if count < 1 or not 3 + width * (count - 1) + 5 <= len(node.inputs) <= 3 + width * count:
        raise argument_error(node, f"{len(node.inputs)} inputs and {count} outputs; expected A, its scale and zero "
                                   f"point, then {width} per member (the last member's optional ones may be absent) "
                                   "and one output per member")
    trans = _trans(node, count)
    quantize_a, dequantize = bool(node.attr("quantize_a", 0)), bool(node.attr("dequantize", 0))
    nodes = member_nodes(node)
    singles = [quantized_matmul(n, None, opset) for n in nodes]
    sides = Prepared()
    repeat = RepeatCall()  # the last joined call: A's shape and type, the constants and the call's arguments

    def apart(a, a_scale, a_zero, rest) -> tuple:
        outs = []
        for g in range(count):
            inputs = rest[width * g:width * (g + 1)]
            if rounded and inputs[SLOTS] is None:  # (a member without a rounded add)
                inputs = inputs[:SLOTS]
            outs.append(singles[g](a, a_scale, a_zero, *inputs)[0])
        return tuple(outs)

    def kernel(a, a_scale, a_zero, *rest):
        if len(rest) < width * count:  # the last member's absent optional inputs
            rest = rest + (None,) * (width * count - len(rest))
        constants = (a_scale, a_zero, *rest)
        arguments = repeat.match(a, constants)
        if arguments is not None:
            return _run(qgemm, a, arguments)
        members = [rest[width * g:width * (g + 1)] for g in range(count)]
        side = sides.get(None, constants, lambda: joined(qgemm, nodes, a_scale, a_zero, members, trans, quantize_a,
                                                          dequantize, rounded))
        if side is None or a.ndim < 1 or a.shape[-1] != side.depth or a.dtype is not side.a_dtype:
            return apart(a, a_scale, a_zero, rest)
        rows = a.size // side.depth if side.depth else int(np.prod(a.shape[:-1]))
        lead = a.shape[:-1]
        starts = np.cumsum([0, *side.widths]).tolist()
        blocks = [(rows * starts[g], rows * starts[g + 1], lead + (side.widths[g],)) for g in range(count)]
        arguments = ((rows, side.depth), side, rows * side.columns, blocks)
        repeat.keep(a, constants, arguments)
        return _run(qgemm, a, arguments)

    return kernel


def _run(qgemm, a, arguments) -> tuple:
    """The joined product of a kept or checked call: (A's rows, the joined side, the buffer's size, each output's
    block)."""
    flat_shape, side, size, blocks = arguments
    out = np.empty(size, side.out_dtype)
    if size:
        flat = np.ascontiguousarray(a).reshape(flat_shape)
        if side.row is None:
            qgemm.requantized_group(flat, side.packed, side.pairs, side.multiplier, side.offset, side.consts,
                                    side.members, out)
        else:
            qgemm.requantized_group_rounded(flat, side.packed, side.pairs, side.multiplier, side.offset, side.consts,
                                            side.members, side.row, side.afters, out)
    return tuple(out[start:end].reshape(shape) for start, end, shape in blocks)
