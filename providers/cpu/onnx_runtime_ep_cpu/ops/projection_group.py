"""ProjectionGroup (projection_groups.py): products of one input by weights side by side, each output a column
view of the one product (an attention's query, key and value, which its kernel reads in place)."""

from __future__ import annotations

import math

import numpy as np

from ..algorithms.products import GEMV_ROWS, PackedProduct
from ..fusions import FUSED_DOMAIN
from ..registry import register
from ._common import argument_error, required_attr

_F32 = np.dtype(np.float32)


def _widths(node) -> list[int]:
    widths = [int(w) for w in required_attr(node, "widths", "the members' output widths")]
    if len(widths) != len(node.outputs) or any(w <= 0 for w in widths):
        raise argument_error(node, f"attribute 'widths' is {widths} for {len(node.outputs)} outputs; expected one "
                                   f"positive width per output")
    return widths


@register("ProjectionGroup", domain=FUSED_DOMAIN, since=1)
def projection_group(node, shapes, opset):
    """Inputs: A (..., K), W (K, sum of widths), optional bias (sum of widths,); one output (..., width) per
    member: (A @ W + bias)'s columns of that member."""
    widths = _widths(node)
    starts = [0, *np.cumsum(widths).tolist()]
    total = starts[-1]

    def columns(y: np.ndarray) -> tuple:
        return tuple(y[..., starts[i]:starts[i + 1]] for i in range(len(widths)))

    def general(a, w, bias=None):
        if w.ndim != 2 or a.ndim < 1 or a.shape[-1] != w.shape[0] or w.shape[1] != total \
                or (bias is not None and bias.shape != (total,)):
            raise argument_error(node, f"A {a.shape}, W {w.shape}, bias {None if bias is None else bias.shape}; "
                                       f"expected A (..., K), W (K, {total}) and a bias ({total},)")
        y = np.matmul(a, w)
        if bias is not None:
            y += bias
        return columns(y)

    a_shape = tuple(shapes[0]) if shapes and shapes[0] is not None else None
    if not a_shape or not all(isinstance(d, int) and d > 0 for d in a_shape):
        return general
    from ..compiled import transformer as compiled  # once here: an import statement costs each call microseconds

    rows, depth = math.prod(a_shape[:-1]), a_shape[-1]
    lead = a_shape[:-1]
    out_shape = lead + (total,)
    members = [(slice(None),) * len(lead) + (slice(starts[i], starts[i + 1]),) for i in range(len(widths))]
    no_bias = np.empty(0, _F32)
    no_residual = np.empty((0, 0), _F32)
    add = compiled.add_bias_residual_
    # A decode step's few rows by constant weights of this size: few_rows.py's tiles (BLAS packs the weights per call)
    # (any thread count here: each call's takes_few reads the running one)
    few = rows <= GEMV_ROWS and PackedProduct.few_sized(rows, depth * total, False, 2, depth)
    packed = None  # the node's PackedProduct, made on first use

    def kernel(a, w, bias=None):
        nonlocal packed
        # The planned shape: one product of A's rows (BLAS's, or the tiles'), the bias added, column views reshaped.
        if a.shape != a_shape or a.dtype is not _F32 or w.dtype is not _F32 or w.shape != (depth, total) \
                or not a.flags.c_contiguous \
                or (bias is not None and (bias.dtype is not _F32 or bias.shape != (total,))):
            return general(a, w, bias)
        if few and PackedProduct.takes_few(a.reshape(rows, depth), w):
            if packed is None:
                packed = PackedProduct()
            y = packed(a.reshape(rows, depth), w, bias).reshape(out_shape)
        else:
            y = np.dot(a.reshape(rows, depth), w)
            add(y, no_bias if bias is None else bias, no_residual)
            y = y.reshape(out_shape)
        return tuple([y[member] for member in members])

    return kernel
