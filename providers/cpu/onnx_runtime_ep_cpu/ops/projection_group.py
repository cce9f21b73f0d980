"""ProjectionGroup (projection_groups.py): products of one input by weights side by side, each output a column
view of the one product (an attention's query, key and value, which its kernel reads in place)."""

from __future__ import annotations

import math
from operator import itemgetter

import numpy as np

from ..algorithms.products import GEMV_ROWS, PackedProduct
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ..threads import kernel_threads
from ..tuning import knobs_epoch
from ._common import argument_error, required_attr
from .norm_in_front import norm_in_front

_F32 = np.dtype(np.float32)


def _widths(node) -> list[int]:
    widths = [int(w) for w in required_attr(node, "widths", "the members' output widths")]
    if len(widths) != len(node.outputs) or any(w <= 0 for w in widths):
        raise argument_error(node, f"attribute 'widths' is {widths} for {len(node.outputs)} outputs; expected one "
                                   f"positive width per output")
    return widths


def _layouts(node, widths: list[int]) -> list[tuple | None]:
    """Per output, the (shape, perm) of the head split folded into the group (projection_groups.fold_head_splits:
    the column reshaped, then transposed, as the ReshapeTranspose it replaces did), or None for the column as is.
    Attribute ``layouts``: per output its rank r, then r target dimensions (no 0; one may be -1), then a
    permutation of range(r); r = 0 for none."""
    flat = [int(v) for v in node.attr("layouts", [])]
    if not flat:
        return [None] * len(widths)
    layouts, at = [], 0
    for _ in widths:
        rank = flat[at] if at < len(flat) else -1
        shape, perm = tuple(flat[at + 1:at + 1 + rank]), tuple(flat[at + 1 + rank:at + 1 + 2 * rank])
        if rank < 0 or len(perm) != rank or 0 in shape or shape.count(-1) > 1 or sorted(perm) != list(range(rank)):
            raise argument_error(node, f"attribute 'layouts' is {flat}; expected per output a rank r, r target "
                                       f"dimensions (none 0, at most one -1) and a permutation of range(r)")
        layouts.append((shape, perm) if rank else None)
        at += 1 + 2 * rank
    if at != len(flat):
        raise argument_error(node, f"attribute 'layouts' is {flat}: {len(flat) - at} values past the "
                                   f"{len(widths)} outputs' layouts")
    return layouts


def column_views(node, widths: list[int], starts: list[int]):
    """The function taking the group's product (..., sum of widths) to its outputs: each member's column view,
    split into heads where the node's layouts say so."""
    spans = [(Ellipsis, slice(starts[i], starts[i + 1])) for i in range(len(widths))]
    layouts = _layouts(node, widths)

    if any(layouts):
        def columns(y: np.ndarray) -> tuple:
            try:
                return tuple([y[span] if layout is None else y[span].reshape(layout[0]).transpose(layout[1])
                              for span, layout in zip(spans, layouts)])
            except ValueError:
                raise argument_error(node, f"A's product {y.shape} does not split into the heads of attribute "
                                           f"'layouts' {layouts}") from None
    else:
        columns = _views(spans)
    return columns, layouts


def _views(spans: list):
    """The function taking a product to its members' views at ``spans`` (index tuples), as one itemgetter call (a
    list of the views costs a decode step's product about twice as much)."""
    if len(spans) > 1:
        return itemgetter(*spans)
    only = spans[0]
    return lambda y: (y[only],)  # (itemgetter of one index gives the item, not a tuple)


def planned_heads(columns, layouts: list, widths: list[int], lead: tuple) -> tuple | None:
    """(the product's shape, the function taking it to the members) where every member is split into heads whose
    transpose moves only axes of length 1 at the planned leading shape (a decode step's one token): the product,
    reshaped once, holds the heads side by side along one axis, and each member is a slice of it, not a reshaped
    and transposed column (two calls a member). None where that does not hold, checked on a product of distinct
    values against ``columns``."""
    if not all(layouts):
        return None
    total = sum(widths)
    probe = np.arange(math.prod(lead) * total, dtype=np.int64).reshape(lead + (total,))
    if probe.size > 1 << 16:  # (bounds the check's cost at planning: the one-token products it serves are small)
        return None
    wanted = columns(probe)
    first = wanted[0].shape
    if any(len(part.shape) != len(first) for part in wanted):
        return None
    for axis in range(len(first)):
        if any(part.shape[:axis] != first[:axis] or part.shape[axis + 1:] != first[axis + 1:] for part in wanted) \
                or math.prod(first[:axis]) != math.prod(lead):
            continue
        ends = np.cumsum([0, *(part.shape[axis] for part in wanted)]).tolist()
        shape = first[:axis] + (ends[-1],) + first[axis + 1:]
        spans = [(slice(None),) * axis + (slice(ends[i], ends[i + 1]),) for i in range(len(wanted))]
        heads = probe.reshape(shape)
        if all(np.array_equal(heads[span], part) for span, part in zip(spans, wanted)):
            return shape, _views(spans)
    return None


class _Tiles:
    """A planned node's few-row tiles: its PackedProduct (made on first use) and, as MatMul keeps one, the bound call
    of its last product (PackedProduct.bound) with what it was bound for: (w, bias, the call, the thread count, the
    knobs' epoch, the normalization's scale), for constant w and bias (or none). A node with a normalization in
    front (norm_in_front.py) binds it with it: its bound call takes the input before the normalization."""

    __slots__ = ("packed", "kept")

    def __init__(self):
        self.packed: PackedProduct | None = None
        self.kept: tuple = (None, None, None, 0, -1, None)

    def __call__(self, rows: np.ndarray, w: np.ndarray, bias, norm: tuple | None = None) -> np.ndarray:
        """rows @ w (+ bias), ``rows`` A as a matrix; the call bound for the next one where it can be (with ``norm``,
        PackedProduct.bound's, where its scale and shift are constants)."""
        if self.packed is None:
            self.packed = PackedProduct()
        y = self.packed(rows, w, bias)
        if not w.flags.writeable and (bias is None or not bias.flags.writeable) and (norm is None or (
                not norm[0].flags.writeable and (norm[1] is None or not norm[1].flags.writeable))):
            bound = self.packed.bound(rows, w, bias, norm=norm)
            if bound is not None:
                self.kept = (w, bias, bound, kernel_threads(), knobs_epoch[0], None if norm is None else norm[0])
        return y

    def bound_for(self, a: np.ndarray, w: np.ndarray, bias, a_shape: tuple, scale=None):
        """The kept bound call where it computes this product (float32 A of the planned shape, the same constant w
        and bias, and normalization ``scale``, the thread count and knobs' epoch it was bound with), else None."""
        weights, kept_bias, run, threads, epoch, kept_scale = self.kept  # one read: another thread may replace it
        if w is weights and bias is kept_bias and scale is kept_scale and a.shape == a_shape and a.dtype is _F32 \
                and a.flags.c_contiguous and kernel_threads() == threads and knobs_epoch[0] == epoch:
            return run
        return None


def _general(node, columns, total: int, norm) -> tuple:
    """(general, product): the kernel for any shapes and dtypes, (a, w, bias=None, scale=None, shift=None), and its
    product of an A already normalized, (a, w, bias)."""

    def general(a, w, bias=None, scale=None, shift=None):
        return product(a if norm is None else norm(a, scale, shift), w, bias)

    def product(a, w, bias):
        if w.ndim != 2 or a.ndim < 1 or a.shape[-1] != w.shape[0] or w.shape[1] != total \
                or (bias is not None and bias.shape != (total,)):
            raise argument_error(node, f"A {a.shape}, W {w.shape}, bias {None if bias is None else bias.shape}; "
                                       f"expected A (..., K), W (K, {total}) and a bias ({total},)")
        y = np.matmul(a, w)
        if bias is not None:
            y += bias
        return columns(y)

    return general, product


@register("ProjectionGroup", domain=FUSED_DOMAIN, since=1)
def projection_group(node, shapes, opset):
    """Inputs: A (..., K), W (K, sum of widths), optional bias (sum of widths,); one output (..., width) per
    member: (A @ W + bias)'s columns of that member (split into heads where attribute ``layouts`` says so). With
    attribute ``normalize`` (norm_in_front.py), inputs 3 and 4 are the normalization's scale and optional shift,
    applied to A first."""
    norm = norm_in_front(node, shapes)
    widths = _widths(node)
    starts = [0, *np.cumsum(widths).tolist()]
    total = starts[-1]

    columns, layouts = column_views(node, widths, starts)
    general, product = _general(node, columns, total, norm)
    a_shape = tuple(shapes[0]) if shapes and shapes[0] is not None else None
    if not a_shape or not all(isinstance(d, int) and d > 0 for d in a_shape):
        return general
    from ..compiled import transformer as compiled  # once here: an import statement costs each call microseconds

    rows, depth = math.prod(a_shape[:-1]), a_shape[-1]
    lead = a_shape[:-1]
    out_shape = lead + (total,)
    out_shape, columns_planned = planned_heads(columns, layouts, widths, lead) or (out_shape, columns)
    no_residual = np.empty((0, 0), _F32)
    add = compiled.add_bias_residual_
    # A decode step's few rows by constant weights of this size: few_rows.py's tiles (BLAS packs the weights per call)
    # (any thread count here: each call's takes_few reads the running one)
    # (and smaller ones with a normalization in front: the two then run as one compiled call)
    few = rows <= GEMV_ROWS and PackedProduct.few_sized(rows, depth * total, False, 2, depth, norm is not None)
    tiles = _Tiles()

    def kernel(a, w, bias=None, scale=None, shift=None):
        run = tiles.bound_for(a, w, bias, a_shape, scale) if few else None
        if run is not None:
            return columns_planned(run(a).reshape(out_shape))
        # The planned shape: one product of A's rows (BLAS's, or the tiles'), the bias added, column views reshaped.
        if a.shape != a_shape or a.dtype is not _F32 or w.dtype is not _F32 or w.shape != (depth, total) \
                or not a.flags.c_contiguous \
                or (bias is not None and (bias.dtype is not _F32 or bias.shape != (total,))):
            return general(a, w, bias, scale, shift)
        spec = None
        if norm is not None:
            a, spec = norm(a, scale, shift), norm.spec(scale, shift)
            if a.dtype is not _F32 or not a.flags.c_contiguous:
                return product(a, w, bias)
        if few and PackedProduct.takes_few(a.reshape(rows, depth), w, norm is not None):
            y = tiles(a.reshape(rows, depth), w, bias, spec).reshape(out_shape)
        else:
            y = np.dot(a.reshape(rows, depth), w)
            if bias is not None:  # (without one the loop adds nothing: its dispatch alone would cost the call)
                add(y, bias, no_residual)
            y = y.reshape(out_shape)
        return columns_planned(y)

    return kernel
