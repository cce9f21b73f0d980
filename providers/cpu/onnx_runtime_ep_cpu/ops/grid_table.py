"""GridTable (qdq_tables.fuse_grid_tables): a float chain of one tensor on a per-tensor 8-bit grid and constant
scalars, as a table of its float32 result for each code of the grid.

Inputs (x, scale, zero, constants...): the grid tensor, its grid's float32 scale and 8-bit zero point, then the
constants the chain's nodes read, in the order of attribute ``names`` after x (attributes ``chain``, ``wiring``
and ``{index}.{name}`` hold the chain's nodes). The table is made with
the chain's own node kernels, run once on the grid's values (code - zero) * scale in float32 for every code of
the zero point's type, and made again only when other constant arrays come in. Each element's code (compiled
quantize.grid_lookup: QuantizeLinear's rounding) then picks its entry.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.ir import Node

from ..algorithms.quantize import integer_range
from ..fusions import FUSED_DOMAIN
from ..registry import NEEDS, lookup, register
from ._common import argument_error

_F32 = np.dtype(np.float32)
_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))


class _Chain:
    """The chain's nodes with their kernels, and the table of the constants last seen."""

    def __init__(self, node):
        self.node = node
        self.names = [str(name) for name in node.attr("names", [])]
        self.result = str(node.attr("result", ""))
        self.nodes = []
        for inner in chain_nodes(node):
            factory = lookup(inner.op_type, inner.domain, inner.opset)
            if factory is None or NEEDS.get(factory):
                raise OnnxRuntimeError(f"node {node.name!r} (GridTable): its node {inner.name!r} ({inner.op_type}) "
                                       f"has no CPU kernel that runs on its inputs alone")
            self.nodes.append((inner, factory))
        self.key: tuple = ()
        self.found: tuple | None = None

    def build(self, scale, zero, constants: tuple) -> tuple:
        """(table, scale, zero, low, high, rank): the chain's result per code, from the lowest code up, the grid's
        parameters as the lookup takes them, and the rank the constants broadcast the result to."""
        low, high = integer_range(zero.dtype)
        s, z = scale.reshape(-1)[0], zero.reshape(-1)[0]
        grid = (np.arange(low, high + 1, dtype=np.float32) - np.float32(z)) * s  # the producers' float32 values
        values = dict(zip(self.names, (grid, *constants)))
        for inner, factory in self.nodes:
            inputs = [values[name] if name else None for name in inner.inputs]
            shapes = [None if v is None else tuple(v.shape) for v in inputs]
            outputs = factory(inner, shapes, inner.opset)(*inputs)
            values.update(zip(inner.outputs, outputs))
        result = np.asarray(values[self.result])
        if result.size != grid.size or result.dtype != _F32:
            raise OnnxRuntimeError(f"node {self.node.name!r} (GridTable): its chain gave {result.dtype}{result.shape} "
                                   f"for the {grid.size} grid values; expected one float32 value each")
        rank = max([np.ndim(c) for c in constants] + [0])
        return np.ascontiguousarray(result.reshape(-1)), float(s), float(z), float(low), float(high), rank


def chain_nodes(node) -> list[Node]:
    """The chain's nodes from the GridTable's attributes (qdq_tables._table_node writes them)."""
    chain, wiring = list(node.attr("chain", [])), list(node.attr("wiring", []))
    if not chain or len(chain) != len(wiring):
        raise OnnxRuntimeError(f"node {node.name!r} (GridTable): attributes 'chain' and 'wiring' must name the same "
                               f"nodes (got {len(chain)} and {len(wiring)})")
    nodes = []
    for index, (kind, io) in enumerate(zip(chain, wiring)):
        domain, op_type, opset = str(kind).rsplit(":", 2)
        inputs, output = str(io).split("|")
        prefix = f"{index}."
        attrs = {key[len(prefix):]: value for key, value in node.attrs.items() if key.startswith(prefix)}
        nodes.append(Node(op_type, inputs.split(","), [output], name=f"{node.name}/{index}", domain=domain,
                          attrs=attrs, opset=int(opset)))
    return nodes


@register("GridTable", domain=FUSED_DOMAIN, since=1)
def grid_table(node, shapes, opset):
    from ..compiled import quantize as compiled  # once here: an import statement costs each call microseconds

    chain = _Chain(node)
    expected = len(chain.names) + 2

    def kernel(x, scale, zero, *constants):
        key = (scale, zero, *constants)
        if len(key) != len(chain.key) or not all(map(_same, key, chain.key)):
            if len(constants) + 3 != expected:
                raise argument_error(node, f"takes {expected} inputs (x, its grid's scale and zero point, the "
                                     f"chain's constants); got {len(constants) + 3}")
            if scale.size != 1 or scale.dtype != _F32 or zero.size != 1 or zero.dtype not in _EIGHT_BIT:
                raise argument_error(node, f"the grid is {scale.dtype}{scale.shape} scale and {zero.dtype}{zero.shape} "
                                     "zero point; expected a float32 scalar and a uint8 or int8 scalar")
            chain.found = chain.build(scale, zero, constants)
            chain.key = key
        if x.dtype is not _F32:
            raise argument_error(node, f"input {chain.names[0]!r} is {x.dtype}; expected float32 values on the grid "
                                 "(a QDQ model's rounded activation)")
        table, s, z, low, high, rank = chain.found
        out = np.empty(x.shape, _F32)
        if out.size:
            compiled.grid_lookup(np.ascontiguousarray(x).reshape(-1), s, z, low, high, table, out.reshape(-1))
        if rank > out.ndim:
            out = out.reshape((1,) * (rank - out.ndim) + out.shape)
        return (out,)

    return kernel


def _same(a, b) -> bool:
    return a is b
