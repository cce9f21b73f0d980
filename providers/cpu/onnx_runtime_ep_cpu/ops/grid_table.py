"""GridTable (qdq_tables.fuse_grid_tables): a float chain of one tensor on a per-tensor 8-bit grid and constant
scalars, as a table of its float32 result for each code of the grid.

Inputs (x, scale, zero, constants...): the grid tensor, its grid's float32 scale and 8-bit zero point, then the
constants the chain's nodes read, in the order of attribute ``names`` after x (attributes ``chain``, ``wiring``
and ``{index}.{name}`` hold the chain's nodes: table_chains.py). The table is made with
the chain's own node kernels, run once on the grid's values (code - zero) * scale in float32 for every code of
the zero point's type, and made again only when other constant arrays come in. Each element's code (compiled
quantize.grid_lookup: QuantizeLinear's rounding) then picks its entry.

ChannelGridTable (qdq_tables.fuse_channel_tables) is the same with constants of one value per channel: its table
holds a row per channel, made by the chain's kernels on a (1, C, ..., codes) tensor of the grid's values in every
channel, and each element's code picks from its channel's row. With attributes codes_scale and codes_zero
(qdq_tables.channel_tables_to_codes: only integer groups read the values, each quantizing them to that grid) the
rows hold those values' codes (uint8, or int8 with codes_signed), quantized once as the groups' own quantization
does, and the node writes the codes.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.bound_loop import EntryOnce
from ..algorithms.quantize import integer_range, quantize
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import argument_error
from .table_chain import TableChain, broadcast_rank

_F32 = np.dtype(np.float32)
_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))


def table_of_grid(chain: TableChain, scale, zero, constants: tuple) -> tuple:
    """(table, scale, zero, low, high, rank): the chain's result per code, from the lowest code up, the grid's
    parameters as the lookup takes them, and the rank the constants broadcast the result to."""
    grid, s, z, low, high = _grid_values(scale, zero)
    table, rank = chain.evaluate(grid, constants, _F32, "grid values")
    return table, s, z, low, high, rank


def _grid_values(scale, zero) -> tuple:
    """(the grid's float32 values from the lowest code up, as its producers make them, (code - zero) * scale; the
    scale, zero point and code range as the lookups take them)."""
    low, high = integer_range(zero.dtype)
    s, z = scale.reshape(-1)[0], zero.reshape(-1)[0]
    grid = (np.arange(low, high + 1, dtype=np.float32) - np.float32(z)) * s
    return grid, float(s), float(z), float(low), float(high)


@register("GridTable", domain=FUSED_DOMAIN, since=1)
def grid_table(node, shapes, opset):
    from ..compiled import quantize as compiled  # once here: an import statement costs each call microseconds

    chain = TableChain(node)
    expected = len(chain.names) + 2
    state: dict = {"key": (), "found": None}  # the grid and constants last seen, and their table
    # the lookup's entry point once it runs compiled: a decode step's few values cost less than the dispatcher's
    # typing of seven arguments
    bind = EntryOnce(compiled.grid_lookup)

    def kernel(x, scale, zero, *constants):
        key = (scale, zero, *constants)
        if len(key) != len(state["key"]) or not all(map(_same, key, state["key"])):
            _check_grid(node, expected, scale, zero, constants)
            state["found"] = table_of_grid(chain, scale, zero, constants)
            state["key"] = key
        if x.dtype is not _F32:
            raise argument_error(node, f"input {chain.names[0]!r} is {x.dtype}; expected float32 values on the grid "
                                 "(a QDQ model's rounded activation)")
        table, s, z, low, high, rank = state["found"]
        out = np.empty(x.shape, _F32)
        if out.size:
            arguments = (np.ascontiguousarray(x).reshape(-1), s, z, low, high, table, out.reshape(-1))
            if table.flags.c_contiguous:  # (the flat float32 arguments keep their types; a strided table's differ)
                bind.run(arguments)
            else:
                compiled.grid_lookup(*arguments)
        return (broadcast_rank(out, rank),)

    return kernel


def _check_grid(node, expected: int, scale, zero, constants: tuple) -> None:
    """A table node's inputs: the count its chain names, a per-tensor 8-bit grid."""
    if len(constants) + 3 != expected:
        raise argument_error(node, f"takes {expected} inputs (x, its grid's scale and zero point, the chain's "
                             f"constants); got {len(constants) + 3}")
    if scale.size != 1 or scale.dtype != _F32 or zero.size != 1 or zero.dtype not in _EIGHT_BIT:
        raise argument_error(node, f"the grid is {scale.dtype}{scale.shape} scale and {zero.dtype}{zero.shape} zero "
                             "point; expected a float32 scalar and a uint8 or int8 scalar")


def _same(a, b) -> bool:
    return a is b


def channel_table_of_grid(chain: TableChain, x_shape: tuple, scale, zero, constants: tuple) -> tuple:
    """(table (C, codes), scale, zero, low, high): the chain's result per channel and code."""
    grid, s, z, low, high = _grid_values(scale, zero)
    channels = x_shape[1]
    values = np.ascontiguousarray(np.broadcast_to(grid, (1, channels) + (1,) * (len(x_shape) - 3) + grid.shape))
    table, _ = chain.evaluate(values, constants, _F32, "grid values in each channel")
    return table.reshape(channels, grid.size), s, z, low, high


def codes_of_table(table: np.ndarray, scale: float, zero: int, signed: bool) -> np.ndarray:
    """The codes a group quantizing to (scale, zero) makes of each float32 entry: QuantizeLinear's, but NaN the
    lowest code (the groups' convention; QuantizeLinear's 0 differs for int8)."""
    dtype = np.dtype(np.int8 if signed else np.uint8)
    codes = quantize(table, np.float32(scale), zero, dtype)
    codes[np.isnan(table)] = integer_range(dtype)[0]
    return codes


@register("ChannelGridTable", domain=FUSED_DOMAIN, since=1)
def channel_grid_table(node, shapes, opset):
    from ..compiled import quantize as compiled

    chain = TableChain(node)
    expected = len(chain.names) + 2
    state: dict = {"key": (), "found": None}
    codes = None if "codes_scale" not in node.attrs else \
        (float(node.attr("codes_scale")), int(node.attr("codes_zero")), bool(node.attr("codes_signed", 0)))

    def kernel(x, scale, zero, *constants):
        if x.dtype is not _F32 or x.ndim < 3:
            raise argument_error(node, f"input {chain.names[0]!r} is {x.dtype}{x.shape}; expected float32 values on "
                                 "the grid with channels on axis 1 (a QDQ model's rounded activation)")
        key = (x.shape[1:2], x.ndim, scale, zero, *constants)
        if len(key) != len(state["key"]) or key[:2] != state["key"][:2] or not all(map(_same, key[2:],
                                                                                      state["key"][2:])):
            _check_grid(node, expected, scale, zero, constants)
            found = channel_table_of_grid(chain, x.shape, scale, zero, constants)
            if codes is not None:
                found = (codes_of_table(found[0], *codes), *found[1:])
            state["found"] = found
            state["key"] = key
        table, s, z, low, high = state["found"]
        out = np.empty(x.shape, table.dtype)
        if out.size:
            n, c = x.shape[:2]
            compiled.channel_grid_lookup(np.ascontiguousarray(x).reshape(n, c, -1), s, z, low, high, table,
                                         out.reshape(n, c, -1))
        return (out,)

    return kernel
