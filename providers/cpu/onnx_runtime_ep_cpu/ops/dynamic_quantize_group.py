"""DynamicQuantizeMatMul nodes that read one A, run as one (qdq_fusions.group_dynamic_quantize_matmul): a
layer's query, key and value projections each quantized the same activation again and paid a node's fixed cost
for a small product. Here A is quantized once and multiplied by the members' weights side by side, each output
the bits its own node gives.

One DynamicQuantizeMatMul of projections already merged (Phi-3's qkv_proj and gate_up_proj) that Slices or a Split
cut into parts (projection_groups.split_dynamic_quantize_outputs) runs as DynamicQuantizeMatMulColumns: its
outputs are the product's column views, without the cutting nodes' steps and copies."""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from ..algorithms.bound_loop import EntryOnce
from ..algorithms.prepared import Prepared
from ..algorithms.quantize import IntegerProduct
from ..algorithms.repeat_call import RepeatCall
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import argument_error, graph_error
from .contrib_integer_matmul import WeightSide, dynamic_quantize_matmul, repeated, run_and_keep

_F32 = np.dtype(np.float32)
SLOTS = 4  # each member's inputs after A: B, b_scale, b_zero_point, bias ("" where absent)


def _columns(value: np.ndarray | None, width: int, dtype) -> np.ndarray | None:
    """A per-tensor or per-column parameter as one value per column of its member's weight."""
    if value is None:
        return None
    return np.broadcast_to(value.reshape(-1), (width,)).astype(dtype)


def joined_side(product: IntegerProduct, a, members: list) -> WeightSide | None:
    """One WeightSide for the members' (B, b_scale, b_zero_point, bias) side by side: B (K, W) each of one
    type, parameters made per column (the same float32 and zero-point values), the biases joined. None where a
    member's weight does not fit the compiled product, or the members differ in width, type or bias."""
    weights = [m[0] for m in members]
    if any(w.ndim != 2 for w in weights) or len({(w.shape, w.dtype) for w in weights}) != 1 \
            or len({m[3] is None for m in members}) != 1 or len({m[2] is None for m in members}) != 1:
        return None
    width, dtype = weights[0].shape[1], weights[0].dtype
    for w, scale, zero, bias in members:
        if WeightSide.of(product, a, w, scale, zero, bias) is None:  # each member's own check of its inputs
            return None
    scales = np.concatenate([_columns(m[1], width, _F32) for m in members])
    zeros = None if members[0][2] is None else np.concatenate([_columns(m[2], width, dtype) for m in members])
    bias = None if members[0][3] is None else np.concatenate([m[3] for m in members])
    return WeightSide.of(product, a, np.concatenate(weights, axis=1), scales, zeros, bias)


@register("DynamicQuantizeMatMulGroup", domain=FUSED_DOMAIN, since=1)
def dynamic_quantize_matmul_group(node, shapes, opset):
    """Inputs: A, then per member B, b_scale, b_zero_point, bias (DynamicQuantizeMatMul's, "" where absent);
    one output per member. Where the joined product does not apply, each member runs its own kernel (which
    also gives the errors)."""
    from ..compiled import qgemm  # once here: an import statement costs each call microseconds

    count = len(node.outputs)  # (the graph drops absent inputs at the end)
    if count < 1 or not 1 + SLOTS * (count - 1) < len(node.inputs) <= 1 + SLOTS * count:
        raise argument_error(node, f"{len(node.inputs)} inputs and {len(node.outputs)} outputs; expected A then "
                                   f"{SLOTS} per member and one output per member")
    single = dynamic_quantize_matmul(node, shapes, opset)
    product = IntegerProduct()
    sides = Prepared()
    last: list = [(), None]  # the constant inputs of the last call, then their joined side
    repeat = RepeatCall()  # the last compiled call: A's shape, the constant inputs and the loop's kept arguments
    bind = EntryOnce(qgemm.dynamic_scaled_group)

    def apart(a, rest):
        return tuple(single(a, *rest[i:i + SLOTS])[0] for i in range(0, len(rest), SLOTS))

    def kernel(a, *rest):
        out = repeated(repeat, a, rest)
        if out is not None:
            return tuple(out)
        given = rest
        if len(rest) < SLOTS * count:  # absent trailing inputs
            rest = rest + (None,) * (SLOTS * count - len(rest))
        if a.dtype is not _F32 or not a.ndim or not a.size:
            return apart(a, rest)
        seen, side = last
        if len(seen) != len(rest) or not all(map(_is, seen, rest)):
            members = [rest[i:i + SLOTS] for i in range(0, len(rest), SLOTS)]
            side = sides.get(None, rest, lambda: joined_side(product, a, members))
            if all(x is None or not x.flags.writeable for x in rest):
                last[:] = [rest, side]
        if side is None or a.shape[-1] != side.depth:
            return apart(a, rest)
        width = side.columns // count
        out = np.empty((count, *a.shape[:-1], width), _F32)
        arguments = (np.ascontiguousarray(a).reshape(-1, side.depth), side.packed, side.pairs, side.scales, side.bias,
                     out.reshape(count, -1, width))
        run_and_keep(bind, repeat, a, given, side, arguments, out.shape)
        return tuple(out)

    return kernel


def _is(x, y) -> bool:
    return x is y


@register("DynamicQuantizeMatMulColumns", domain=FUSED_DOMAIN, since=1)
def dynamic_quantize_matmul_columns(node, shapes, opset):
    """DynamicQuantizeMatMul's inputs (A, B, b_scale, b_zero_point, bias); one output per entry of ``widths``: the
    product's adjacent column views of those widths, in order (the product is the node's own, bit for bit), each
    split into heads where attribute ``layouts`` says so (ProjectionGroup's, projection_groups.fold_head_splits)."""
    widths = [int(w) for w in node.attr("widths", [])]
    if len(widths) != len(node.outputs) or min(widths, default=0) <= 0:
        raise graph_error(node, "widths", f"is {widths} for {len(node.outputs)} outputs; expected one positive "
                                          f"width per output")
    single = dynamic_quantize_matmul(node, shapes, opset)
    ends = np.cumsum(widths).tolist()
    total = ends[-1]
    if node.attr("layouts") is not None:
        return _split_columns(node, single, widths, shapes)
    # The views' indices made once, taken by one itemgetter call (C's loop: a list of views costs twice as much).
    views = itemgetter(*[(Ellipsis, slice(end - width, end)) for width, end in zip(widths, ends)])
    if len(widths) == 1:
        whole = views
        views = lambda product: (whole(product),)  # noqa: E731  (itemgetter of one index returns no tuple)

    def kernel(a, *rest):
        product = single(a, *rest)[0]
        if product.shape[-1] != total:
            raise argument_error(node, f"B has {product.shape[-1]} columns; expected {total}, the sum of the widths")
        return views(product)

    return kernel


def _split_columns(node, single, widths: list[int], shapes):
    """dynamic_quantize_matmul_columns' kernel for a node with ``layouts``: the column views split into heads as
    ProjectionGroup's are, and at the planned leading shape of a decode step's one token, slices of the product
    reshaped once (projection_group.planned_heads)."""
    from .projection_group import column_views, planned_heads  # (only decoders with folded head splits need it)

    starts = [0, *np.cumsum(widths).tolist()]
    total = starts[-1]
    columns, layouts = column_views(node, widths, starts)
    a_shape = tuple(shapes[0]) if shapes and shapes[0] is not None else None
    planned = None
    if a_shape and all(isinstance(d, int) and d > 0 for d in a_shape):
        lead = a_shape[:-1]
        found = planned_heads(columns, layouts, widths, lead)
        if found is not None:
            planned = (lead + (total,), found[0], found[1])

    def kernel(a, *rest):
        product = single(a, *rest)[0]
        if planned is not None and product.shape == planned[0]:
            return planned[2](product.reshape(planned[1]))
        if product.shape[-1] != total:
            raise argument_error(node, f"B has {product.shape[-1]} columns; expected {total}, the sum of the widths")
        return columns(product)

    return kernel
