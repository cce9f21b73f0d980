"""CodeTable (code_tables.fuse_code_tables): an elementwise chain of one 8-bit tensor and constant scalars, as a
table of its result for each of the 256 codes.

Inputs (codes, constants...): the chain's code tensor, then the constants its nodes read, in the order of the
``body`` graph's inputs. The table is made with the chain's own node kernels, run once on the 256 codes, when
the node first runs with a code type, and again only when other constant arrays come in.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import OnnxRuntimeError

from ..fusions import FUSED_DOMAIN
from ..registry import NEEDS, lookup, register
from ._common import argument_error

_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_CODE_COUNT = 256


class _Table:
    """The chain's nodes with their kernels, and its tables per code type."""

    def __init__(self, node):
        body = node.attr("body")
        self.node = node
        self.names = [vi.name for vi in body.inputs]
        self.result = body.outputs[0].name
        self.nodes = []
        for inner in body.nodes:
            factory = lookup(inner.op_type, inner.domain, inner.opset)
            if factory is None or NEEDS.get(factory):
                raise OnnxRuntimeError(f"node {node.name!r} (CodeTable): its node {inner.name!r} ({inner.op_type}) "
                                       f"has no CPU kernel that runs on its inputs alone")
            self.nodes.append((inner, factory))
        self.constants: tuple = ()
        self.tables: dict[np.dtype, tuple[np.ndarray, int]] = {}

    def build(self, dtype: np.dtype, constants: tuple) -> tuple[np.ndarray, int]:
        """(table, rank): the chain's result for each code, indexed by the code's byte, and the rank its constants
        broadcast to (a result may have more dimensions than the codes)."""
        values = dict(zip(self.names, (np.arange(_CODE_COUNT, dtype=np.uint8).view(dtype), *constants)))
        for inner, factory in self.nodes:
            inputs = [values[name] if name else None for name in inner.inputs]
            shapes = [None if v is None else tuple(v.shape) for v in inputs]
            outputs = factory(inner, shapes, inner.opset)(*inputs)
            values.update(zip(inner.outputs, outputs))
        result = np.asarray(values[self.result])
        if result.size != _CODE_COUNT:
            raise OnnxRuntimeError(f"node {self.node.name!r} (CodeTable): its chain gave {result.shape} values for "
                                   f"the {_CODE_COUNT} codes; expected one value per code (elementwise nodes only)")
        rank = max([np.ndim(c) for c in constants] + [0])
        return np.ascontiguousarray(result.reshape(-1)), rank


@register("CodeTable", domain=FUSED_DOMAIN, since=1)
def code_table(node, shapes, opset):
    chain = _Table(node)
    expected = len(chain.names)

    def kernel(x, *constants):
        if len(constants) + 1 != expected:
            raise argument_error(node, f"takes {expected} inputs (the codes and the chain's constants); got "
                                 f"{len(constants) + 1}")
        dtype = x.dtype
        if dtype not in _EIGHT_BIT:
            raise argument_error(node, f"input {chain.names[0]!r} is {dtype}; expected uint8 or int8 codes "
                                 f"(the chain's QOperator input)")
        if len(constants) != len(chain.constants) or not all(map(_same, constants, chain.constants)):
            chain.tables.clear()  # other constants: every table is made again
            chain.constants = constants
        found = chain.tables.get(dtype)
        if found is None:
            found = chain.tables[dtype] = chain.build(dtype, constants)
        table, rank = found
        out = table.take(x.view(np.uint8))
        if rank > out.ndim:
            out = out.reshape((1,) * (rank - out.ndim) + out.shape)
        return (out,)

    return kernel


def _same(a, b) -> bool:
    return a is b
