"""RoundedRMSNorm (qdq_norms.fuse_rounded_rms_norm): a QDQ decoder's RMS normalization with its roundings, in one
compiled pass per row (compiled/rounded_norm.py).

Inputs (x, weight, mean_scale, mean_zero, product_scale, product_zero, table_scale, table_zero, constants...):
Pow(x, 2) -> ReduceMean over the last axis (keepdims) -> rounded to the mean's grid -> GridTable -> Mul(x) ->
rounded to the product's grid -> Mul(weight). ``weight`` is a float32 vector of x's last dimension, or absent
(""): the chain ends at the rounded product. The GridTable's inputs after x (its grid, then its chain's scalar
constants) and its attributes (chain, wiring, names, ...) come with the node, which makes its table with the
GridTable kernel itself. Where the squares come from a GridTable of y (a Cast's rounding before the Pow: x is y
rounded), its inputs (y, its grid, constants) come between the product's grid and the table's grid, their count
and its attributes as ``squares_``-prefixed attributes; the node makes them with the GridTable kernel too.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Node

from ..algorithms.bound_loop import EntryOnce
from ..algorithms.pooling import pool_loops
from ..algorithms.prepared import Prepared
from ..algorithms.quantize import integer_range
from ..fused_domain import FUSED_DOMAIN
from ..qdq_norms import SQUARES
from ..registry import register
from ._common import argument_error
from .grid_table import grid_table

_F32 = np.dtype(np.float32)
_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_OWN = 6  # inputs before the table's grid: x, weight and the two roundings' parameters


def _grid(node, name: str, scale, zero) -> tuple:
    if scale.size != 1 or scale.dtype != _F32 or zero.size != 1 or zero.dtype not in _EIGHT_BIT:
        raise argument_error(node, f"the {name} grid is {scale.dtype}{scale.shape} scale and {zero.dtype}{zero.shape} "
                             "zero point; expected a float32 scalar and a uint8 or int8 scalar")
    return (scale.reshape(-1)[0], zero.reshape(-1)[0], *integer_range(zero.dtype))


def _checked(node, x, scale) -> tuple:
    """(x as (rows, depth), the output) after checking x and the weight against it."""
    if x.dtype is not _F32 or x.ndim < 1:
        raise argument_error(node, f"input 'x' is {x.dtype}{x.shape}; expected float32 of at least one dimension")
    depth = x.shape[-1]
    if scale.size and scale.shape[0] != depth:
        raise argument_error(node, f"input 'weight' has {scale.shape[0]} values for x {x.shape}; expected "
                             f"{depth}, one per value of x's last axis")
    return (np.ascontiguousarray(x).reshape(-1, depth) if x.size else x), np.empty(x.shape, _F32)


def _means(pool, squares):
    """Each row's mean of (rows, depth) float32 ``squares`` as the ReduceMean kernel takes it: the plane loop for
    rows up to its limit, else numpy's pairwise sum divided in place."""
    if squares.shape[1] <= pool.PLANE_SUM_LIMIT:
        means = np.empty(squares.shape[0], _F32)
        pool.plane_means(squares, means, squares.shape[1])
        return means
    means = np.add.reduce(squares, axis=1)
    means /= squares.shape[1]
    return means


def _split(node) -> tuple:
    """(the table's attributes, the count of the squares' table's inputs or 0, that table's kernel or None)."""
    attrs = dict(node.attrs or {})
    count = int(attrs.pop(SQUARES + "inputs", 0))
    squared = {key[len(SQUARES):]: attrs.pop(key) for key in [k for k in attrs if k.startswith(SQUARES)]}
    if not count:
        return attrs, 0, None
    inputs = node.inputs[_OWN:_OWN + count]
    table = Node("GridTable", inputs, [f"{node.name}/squares"], name=f"{node.name}/squares", domain=FUSED_DOMAIN,
                 attrs=squared, opset=1)
    return attrs, count, grid_table(table, [None] * count, 1)


@register("RoundedRMSNorm", domain=FUSED_DOMAIN, since=1)
def rounded_rms_norm(node, shapes, opset):
    from ..compiled import rounded_norm as loop  # once here: an import statement costs each call microseconds

    attrs, count, squares_of = _split(node)
    own = _OWN + count
    table_node = Node("GridTable", ["", *node.inputs[own:]], [f"{node.name}/table"], name=f"{node.name}/table",
                      domain=FUSED_DOMAIN, attrs=attrs, opset=1)
    table_of = grid_table(table_node, [None] * (len(node.inputs) - own + 1), 1)
    pool = pool_loops()
    prepared = Prepared()  # (params, table) per set of constant inputs
    # the loop's entry point once it runs compiled: a decode step's row costs less than the dispatcher's typing
    bind = EntryOnce(loop.rounded_rms_norm)

    def prepare(weight, mean_scale, mean_zero, product_scale, product_zero, table_scale, table_zero, constants):
        params = np.zeros(loop.PARAMS, _F32)
        params[loop.MEAN:loop.MEAN + 4] = _grid(node, "mean", mean_scale, mean_zero)
        params[loop.PRODUCT:loop.PRODUCT + 4] = _grid(node, "product", product_scale, product_zero)
        grid = _grid(node, "table", table_scale, table_zero)
        params[loop.TABLE:loop.TABLE + 4] = grid
        low, high = int(grid[2]), int(grid[3])
        values = (np.arange(low, high + 1, dtype=np.float32) - np.float32(grid[1])) * np.float32(grid[0])
        table = np.ascontiguousarray(table_of(values, table_scale, table_zero, *constants)[0], _F32).reshape(-1)
        if table.size != values.size:
            raise argument_error(node, f"the table's constants make {table.size} values of {values.size} codes; "
                                 "expected scalar constants")
        if weight is not None and (weight.dtype != _F32 or weight.ndim != 1):
            raise argument_error(node, f"input 'weight' is {weight.dtype}{weight.shape}; expected a float32 vector "
                                 "of x's last dimension")
        return params, table, np.zeros(0, _F32) if weight is None else weight

    def squared_kernel(x, weight, mean_scale, mean_zero, product_scale, product_zero, *rest):
        """The squares are a GridTable of y (x is y rounded): its values, summed as the ReduceMean kernel sums
        them, then the steps after the mean as the Pow form's."""
        y, squares = rest[0], squares_of(*rest[:count])[0]
        if squares.shape != x.shape or y.shape != x.shape:
            raise argument_error(node, f"input 'y' {y.shape} makes squares {squares.shape} for x {x.shape}; expected "
                                 "x's shape, x being y rounded to its grid")
        arrays = (weight, mean_scale, mean_zero, product_scale, product_zero, *rest[count:])
        params, table, scale = prepared.get(None, arrays, lambda: prepare(*arrays[:7], arrays[7:]))
        rows, out = _checked(node, x, scale)
        if out.size:
            means = _means(pool, np.ascontiguousarray(squares).reshape(rows.shape))
            loop.rounded_rms_rows(rows, means, scale, params, table, out.reshape(rows.shape))
        return (out,)

    def kernel(x, weight, mean_scale, mean_zero, product_scale, product_zero, table_scale, table_zero, *constants):
        arrays = (weight, mean_scale, mean_zero, product_scale, product_zero, table_scale, table_zero, *constants)
        params, table, scale = prepared.get(None, arrays, lambda: prepare(*arrays[:7], constants))
        rows, out = _checked(node, x, scale)
        if out.size:
            depth = rows.shape[1]
            if depth <= loop.LIMIT:
                # (the entry point's arguments keep their types: rows and table contiguous float32)
                bind.run((rows, scale, params, table, out.reshape(-1, depth)))
            else:  # the ReduceMean kernel's sum beyond its loop's rows: numpy's pairwise sum, divided in place
                means = np.add.reduce(rows * rows, axis=1)
                means /= depth
                loop.rounded_rms_rows(rows, means, scale, params, table, out.reshape(-1, depth))
        return (out,)

    return kernel if squares_of is None else squared_kernel
