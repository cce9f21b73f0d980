"""A QDQ decoder's RMS normalization as one node (ops/qdq_norm.py, compiled/rounded_norm.py).

LLaMA-style decoders normalize with Pow(x, 2) -> ReduceMean(last axis) -> Add(eps) -> Sqrt -> Reciprocal (or Div)
-> Mul(x) -> Mul(weight); quantize_static rounds the activations between them. After the earlier QDQ passes the
chain reads, in both torch exporters' forms:

    Pow(x, 2) -> ReduceMeanRounded -> GridTable (eps, square root, reciprocal and their roundings) -> MulRounded(x)
      [-> Mul(weight)]
      ->  RoundedRMSNorm(x, weight, mean grid, product grid, table grid, table constants)

five steps of a few dozen values each in a decode call, as one pass that gives the same float32 values bit for bit.
Applied where x is float32 with a static last dimension, the exponent a float32 scalar 2, the mean over x's last
axis with keepdims, every rounding's parameters and the table's constants constant scalars, the weight (if any) a
constant float32 vector of x's last dimension, and each intermediate value read by the next node alone (no graph
output, no subgraph). Runs after qdq_epilogues.fold_rounding_epilogues, which makes the Rounded nodes.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, GraphView, fuse_chains

_F32 = np.dtype(np.float32)
SQUARES = "squares_"  # the prefix of a squares' GridTable's attributes on RoundedRMSNorm (ops/qdq_norm.py)


def _sole(view: GraphView, name: str, op_type: str, domain: str) -> Node | None:
    """The one node reading ``name``, when it is ``op_type`` of ``domain`` and reads it once; nothing else sees it."""
    readers = view.consumers.get(name, [])
    if len(readers) != 1 or name in view.outputs or name in view.inner_reads:
        return None
    node = readers[0]
    return node if node.op_type == op_type and node.domain == domain and node.inputs.count(name) == 1 else None


def _scalars(view: GraphView, names) -> bool:
    return all(name and (value := view.const(name)) is not None and value.size == 1 for name in names)


def _last_dim(graph: Graph, name: str) -> tuple[int, int] | None:
    """(rank, last dimension) of a float32 tensor whose rank and last dimension are known, else None."""
    info = graph.type_of(name)
    shape = info.shape if info is not None and info.is_tensor else None
    if shape is None or not shape or not isinstance(shape[-1], int) or info.dtype is None \
            or info.dtype.numpy != _F32:
        return None
    return len(shape), shape[-1]


def _mean_of_last_axis(view: GraphView, mean: Node, rank: int) -> bool:
    """Whether a ReduceMeanRounded averages its input's last axis, keeping it, with a constant rounding."""
    count = len(mean.inputs) - 2
    if count == 1:
        axes = mean.attr("axes")
    elif count == 2 and mean.inputs[1]:
        axes = view.const(mean.inputs[1])
    else:
        return False
    if axes is None or not int(mean.attr("keepdims", 1)) or not _scalars(view, mean.inputs[count:]):
        return False
    axes = [int(a) for a in np.asarray(axes).reshape(-1)]
    return len(axes) == 1 and axes[0] in (-1, rank - 1)


def _squares_table(graph: Graph, view: GraphView, squares: Node) -> tuple | None:
    """(x, rank, depth) where ``squares`` is a GridTable of y whose sole reader's chain multiplies x, and x is y or a
    QuantizeDequantize of y (so of y's shape, element for element); else None."""
    if squares.op_type != "GridTable" or squares.domain != FUSED_DOMAIN or not _scalars(view, squares.inputs[1:]):
        return None
    y = squares.inputs[0]
    mean = _sole(view, squares.outputs[0], "ReduceMeanRounded", FUSED_DOMAIN)
    table = None if mean is None else _sole(view, mean.outputs[0], "GridTable", FUSED_DOMAIN)
    product = None if table is None else _sole(view, table.outputs[0], "MulRounded", FUSED_DOMAIN)
    if product is None or len(product.inputs) != 4 or table.outputs[0] not in product.inputs[:2]:
        return None
    x = product.inputs[1] if product.inputs[0] == table.outputs[0] else product.inputs[0]
    if x != y:
        source = view.producer.get(x)
        if source is None or source.op_type != "QuantizeDequantize" or source.domain != FUSED_DOMAIN \
                or source.inputs[0] != y or not _scalars(view, source.inputs[1:]):
            return None
    found = _last_dim(graph, x)
    return None if found is None or _last_dim(graph, y) is None or view.const(y) is not None else (x, *found)


def _chain(graph: Graph, view: GraphView, pow_: Node) -> tuple | None:
    """(nodes, fused inputs, GridTable, squares' GridTable or None) of an RMS normalization starting at ``pow_`` (a
    Pow, or a GridTable making the squares: a Cast's rounding before the Pow makes the Pow a table of the cast's
    input), else None."""
    squares = None
    if pow_.op_type == "GridTable":
        found = _squares_table(graph, view, pow_)
        if found is None:
            return None
        squares, (x, rank, depth) = pow_, found
    else:
        if pow_.op_type != "Pow" or pow_.domain or len(pow_.inputs) != 2 or len(pow_.outputs) != 1:
            return None
        x = pow_.inputs[0]
        exponent = view.const(pow_.inputs[1])
        found = _last_dim(graph, x)
        if exponent is None or exponent.dtype != _F32 or exponent.size != 1 or exponent.reshape(-1)[0] != 2 \
                or found is None or view.const(x) is not None:
            return None
        rank, depth = found
    mean = _sole(view, pow_.outputs[0], "ReduceMeanRounded", FUSED_DOMAIN)
    if mean is None or mean.inputs[0] != pow_.outputs[0] or not _mean_of_last_axis(view, mean, rank):
        return None
    table = _sole(view, mean.outputs[0], "GridTable", FUSED_DOMAIN)
    if table is None or table.inputs[0] != mean.outputs[0] or not _scalars(view, table.inputs[1:]):
        return None
    product = _sole(view, table.outputs[0], "MulRounded", FUSED_DOMAIN)
    if product is None or len(product.inputs) != 4 or {*product.inputs[:2]} != {x, table.outputs[0]} \
            or not _scalars(view, product.inputs[2:]):
        return None
    nodes, weight, output = [pow_, mean, table, product], "", product.outputs[0]
    scale = _sole(view, output, "Mul", "")
    if scale is not None and len(scale.inputs) == 2:
        other = scale.inputs[1] if scale.inputs[0] == output else scale.inputs[0]
        value = view.const(other)
        if value is not None and value.dtype == _F32 and value.shape == (depth,):
            nodes.append(scale)
            weight, output = other, scale.outputs[0]
    inputs = [x, weight, *mean.inputs[-2:], *product.inputs[2:],
              *([] if squares is None else squares.inputs), *table.inputs[1:]]
    return nodes, inputs, output, table, squares


def fuse_rounded_rms_norm(graph: Graph, owns=None) -> bool:
    """Every RMS normalization the module doc names becomes one RoundedRMSNorm where its last node was."""
    if not any(n.op_type == "GridTable" and n.domain == FUSED_DOMAIN for n in graph.nodes):
        return False
    return fuse_chains(graph, owns, _chain, _rms_norm)


def _rms_norm(found) -> Node:
    nodes, inputs, output, table, squares = found
    attrs = dict(table.attrs or {})
    if squares is not None:  # its inputs (y, grid, constants) come before the table's, its attributes prefixed
        attrs.update({SQUARES + key: value for key, value in (squares.attrs or {}).items()})
        attrs[SQUARES + "inputs"] = len(squares.inputs)
    return Node("RoundedRMSNorm", inputs, [output], name=f"{nodes[-1].name}/rms_norm", domain=FUSED_DOMAIN,
                attrs=attrs, opset=1)
