"""ProjectionGroup (projection_groups.py): products of one input by weights side by side, each output a column
view of the one product (an attention's query, key and value, which its kernel reads in place)."""

from __future__ import annotations

import math

import numpy as np

from ..algorithms.products import GEMV_ROWS, PackedProduct
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ..threads import kernel_threads
from ..tuning import knobs_epoch
from ._common import argument_error, required_attr

_F32 = np.dtype(np.float32)


def _widths(node) -> list[int]:
    widths = [int(w) for w in required_attr(node, "widths", "the members' output widths")]
    if len(widths) != len(node.outputs) or any(w <= 0 for w in widths):
        raise argument_error(node, f"attribute 'widths' is {widths} for {len(node.outputs)} outputs; expected one "
                                   f"positive width per output")
    return widths


class _Tiles:
    """A planned node's few-row tiles: its PackedProduct (made on first use) and, as MatMul keeps one, the bound call
    of its last product (PackedProduct.bound) with what it was bound for: (w, bias, the call, the thread count, the
    knobs' epoch), for constant w and bias (or none)."""

    __slots__ = ("packed", "kept")

    def __init__(self):
        self.packed: PackedProduct | None = None
        self.kept: tuple = (None, None, None, 0, -1)

    def __call__(self, rows: np.ndarray, w: np.ndarray, bias) -> np.ndarray:
        """rows @ w (+ bias), ``rows`` A as a matrix; the call bound for the next one where it can be."""
        if self.packed is None:
            self.packed = PackedProduct()
        y = self.packed(rows, w, bias)
        if not w.flags.writeable and (bias is None or not bias.flags.writeable):
            bound = self.packed.bound(rows, w, bias)
            if bound is not None:
                self.kept = (w, bias, bound, kernel_threads(), knobs_epoch[0])
        return y

    def bound_for(self, a: np.ndarray, w: np.ndarray, bias, a_shape: tuple):
        """The kept bound call where it computes this product (float32 A of the planned shape, the same constant w
        and bias, the thread count and knobs' epoch it was bound with), else None."""
        weights, kept_bias, run, threads, epoch = self.kept  # one read: another thread may replace it
        if w is weights and bias is kept_bias and a.shape == a_shape and a.dtype is _F32 and a.flags.c_contiguous \
                and kernel_threads() == threads and knobs_epoch[0] == epoch:
            return run
        return None


@register("ProjectionGroup", domain=FUSED_DOMAIN, since=1)
def projection_group(node, shapes, opset):
    """Inputs: A (..., K), W (K, sum of widths), optional bias (sum of widths,); one output (..., width) per
    member: (A @ W + bias)'s columns of that member."""
    widths = _widths(node)
    starts = [0, *np.cumsum(widths).tolist()]
    total = starts[-1]

    spans = [(Ellipsis, slice(starts[i], starts[i + 1])) for i in range(len(widths))]

    def columns(y: np.ndarray) -> tuple:
        return tuple([y[span] for span in spans])

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
    no_bias = np.empty(0, _F32)
    no_residual = np.empty((0, 0), _F32)
    add = compiled.add_bias_residual_
    # A decode step's few rows by constant weights of this size: few_rows.py's tiles (BLAS packs the weights per call)
    # (any thread count here: each call's takes_few reads the running one)
    few = rows <= GEMV_ROWS and PackedProduct.few_sized(rows, depth * total, False, 2, depth)
    tiles = _Tiles()

    def kernel(a, w, bias=None):
        run = tiles.bound_for(a, w, bias, a_shape) if few else None
        if run is not None:
            return columns(run(a).reshape(out_shape))
        # The planned shape: one product of A's rows (BLAS's, or the tiles'), the bias added, column views reshaped.
        if a.shape != a_shape or a.dtype is not _F32 or w.dtype is not _F32 or w.shape != (depth, total) \
                or not a.flags.c_contiguous \
                or (bias is not None and (bias.dtype is not _F32 or bias.shape != (total,))):
            return general(a, w, bias)
        if few and PackedProduct.takes_few(a.reshape(rows, depth), w):
            y = tiles(a.reshape(rows, depth), w, bias).reshape(out_shape)
        else:
            y = np.dot(a.reshape(rows, depth), w)
            add(y, no_bias if bias is None else bias, no_residual)
            y = y.reshape(out_shape)
        return columns(y)

    return kernel
