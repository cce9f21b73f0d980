"""The chain a CodeTable or GridTable node holds (table_chains.py spells it in plain attributes): its nodes with
their kernels, run once on the table's root values to make the table."""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.ir import Node

from ..registry import NEEDS, lookup


def chain_nodes(node) -> list[Node]:
    """The chain's nodes from the table node's attributes ``chain``, ``wiring`` and ``{index}.{name}``."""
    chain, wiring = list(node.attr("chain", [])), list(node.attr("wiring", []))
    if not chain or len(chain) != len(wiring):
        raise OnnxRuntimeError(f"node {node.name!r} ({node.op_type}): attributes 'chain' and 'wiring' must name the "
                               f"same nodes (got {len(chain)} and {len(wiring)})")
    nodes = []
    for index, (kind, io) in enumerate(zip(chain, wiring)):
        domain, op_type, opset = str(kind).rsplit(":", 2)
        inputs, output = str(io).split("|")
        prefix = f"{index}."
        attrs = {key[len(prefix):]: value for key, value in node.attrs.items() if key.startswith(prefix)}
        nodes.append(Node(op_type, inputs.split(","), [output], name=f"{node.name}/{index}", domain=domain,
                          attrs=attrs, opset=int(opset)))
    return nodes


class TableChain:
    """The chain's nodes with their kernels; ``names`` are its inputs (the root, then the constants)."""

    def __init__(self, node):
        self.node = node
        self.names = [str(name) for name in node.attr("names", [])]
        self.result = str(node.attr("result", ""))
        self.nodes = []
        for inner in chain_nodes(node):
            factory = lookup(inner.op_type, inner.domain, inner.opset)
            if factory is None or NEEDS.get(factory):
                raise OnnxRuntimeError(f"node {node.name!r} ({node.op_type}): its node {inner.name!r} "
                                       f"({inner.op_type}) has no CPU kernel that runs on its inputs alone")
            self.nodes.append((inner, factory))

    def evaluate(self, values: np.ndarray, constants: tuple, dtype: np.dtype | None,
                 what: str) -> tuple[np.ndarray, int]:
        """(table, rank): the chain's result for each of ``values`` (one flat array; a result of another type
        than ``dtype``, where given, is refused, ``what`` naming the values in the error) and the rank its
        constants broadcast the result to (a result may have more dimensions than the root)."""
        known = dict(zip(self.names, (values, *constants)))
        for inner, factory in self.nodes:
            inputs = [known[name] if name else None for name in inner.inputs]
            shapes = [None if v is None else tuple(v.shape) for v in inputs]
            outputs = factory(inner, shapes, inner.opset)(*inputs)
            known.update(zip(inner.outputs, outputs))
        result = np.asarray(known[self.result])
        if result.size != values.size or (dtype is not None and result.dtype != dtype):
            raise OnnxRuntimeError(f"node {self.node.name!r} ({self.node.op_type}): its chain gave "
                                   f"{result.dtype}{result.shape} for the {values.size} {what}; expected one "
                                   f"{dtype or 'value'} each (elementwise nodes only)")
        rank = max([np.ndim(c) for c in constants] + [0])
        return np.ascontiguousarray(result.reshape(-1)), rank


def broadcast_rank(out: np.ndarray, rank: int) -> np.ndarray:
    """``out`` with leading ones up to ``rank`` dimensions, where the chain's constants had more than the root."""
    return out.reshape((1,) * (rank - out.ndim) + out.shape) if rank > out.ndim else out
