"""Code tables: an elementwise chain of a QOperator graph that reads one 8-bit tensor and constant scalars, as one
256-entry table (ops/code_table.py).

onnxruntime's QOperator format keeps what it has no integer operator for as float islands between 8-bit codes:
the erf GELU of a TorchScript export is DequantizeLinear -> Div -> Erf -> QuantizeLinear -> QLinearAdd(one) ->
QLinearMul(x) -> QLinearMul(half), dynamo's DequantizeLinear -> Gelu -> QuantizeLinear, a Softmax's output
DequantizeLinear -> Cast -> QuantizeLinear. Each node there is elementwise, and every operand but the one code
tensor is a constant scalar, so each output code is a function of one input code: there are 256 of them. The
chain becomes one CodeTable node whose kernel computes that function once, with the chain's own node kernels on
the 256 codes, and then looks every code up (one pass, instead of a kernel per node with float tensors
between).

The values are the nodes' own (the same kernels on the same codes), elementwise: an entry equals the chain's
result for that code wherever the kernels compute an element independently of the others.

A chain is taken where its code tensor comes from a QOperator node and its result is read only by QOperator
nodes (never a graph output), at least two nodes long: the QDQ format's chains are left to its own passes
(qdq_fusions.py), which read the QuantizeLinear/DequantizeLinear pairs.
"""

from __future__ import annotations

from onnx_runtime.dtypes import DataType
from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, GraphView
from .table_chains import ElementwiseChains, chain_attributes

_CONTRIB = "com.microsoft"
_CODES = frozenset({DataType.UINT8, DataType.INT8})

# Operators whose every output element depends on the same element of each input (broadcast scalars aside).
_ELEMENTWISE = {
    "": frozenset({
        "Abs", "Add", "Cast", "Ceil", "Celu", "Clip", "Cos", "DequantizeLinear", "Div", "Elu", "Erf", "Exp",
        "Floor", "Gelu", "HardSigmoid", "HardSwish", "Identity", "LeakyRelu", "Log", "Max", "Min", "Mish", "Mul",
        "Neg", "Pow", "QuantizeLinear", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sin", "Softplus",
        "Softsign", "Sqrt", "Sub", "Tanh", "ThresholdedRelu",
    }),
    _CONTRIB: frozenset({
        "DequantizeLinear", "Gelu", "QLinearAdd", "QLinearLeakyRelu", "QLinearMul", "QLinearSigmoid",
        "QuantizeLinear", "QuickGelu",
    }),
}
# Nodes that read and write 8-bit codes themselves: a chain starts at one's output and ends at their inputs.
_QOPERATOR = {
    "": frozenset({"QLinearConv", "QLinearMatMul"}),
    _CONTRIB: frozenset({
        "QAttention", "QGemm", "QLinearAdd", "QLinearAveragePool", "QLinearConcat", "QLinearGlobalAveragePool",
        "QLinearLeakyRelu", "QLinearMul", "QLinearSigmoid", "QLinearSoftmax", "QLinearWhere",
    }),
    FUSED_DOMAIN: frozenset({"QLinearMatMulAdd"}),
}


def _in(table: dict, node: Node) -> bool:
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    return node.op_type in table.get(domain, ())


def _serves(value: str, outside: list[Node]) -> bool:
    return all(_in(_QOPERATOR, r) for r in outside)


def _table_node(graph: Graph, root: str, value: str, cone: list[Node]) -> Node:
    constants, attrs = chain_attributes(graph, root, value, cone)
    return Node("CodeTable", [root, *constants], [value], name=f"{cone[-1].name or cone[-1].op_type}/code_table",
                domain=FUSED_DOMAIN, attrs=attrs, opset=1)


def fuse_code_tables(graph: Graph, owns=None) -> bool:
    """Replace each chain of the module doc by a CodeTable node; chain nodes nothing reads any more go."""
    if not any(_in(_QOPERATOR, node) for node in graph.nodes):
        return False
    view = GraphView(graph)

    def codes(name: str) -> bool:
        """An 8-bit tensor a QOperator node writes."""
        info = graph.type_of(name)
        producer = view.producer.get(name)
        return info is not None and info.is_tensor and info.dtype in _CODES and producer is not None \
            and _in(_QOPERATOR, producer) and view.const(name) is None

    chains = ElementwiseChains(view, owns, elementwise=lambda node: _in(_ELEMENTWISE, node), root=codes,
                               serves=_serves)
    return chains.replace(lambda root, value, cone: _table_node(graph, root, value, cone))
