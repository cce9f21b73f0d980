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
from onnx_runtime.ir import Graph, Node, ValueInfo

from .fusions import FUSED_DOMAIN, GraphView, owned
from .registry import NEEDS, lookup

_CONTRIB = "com.microsoft"
_CODES = frozenset({DataType.UINT8, DataType.INT8})
MIN_NODES = 2  # one node already makes one pass over its codes

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


class _Chains:
    def __init__(self, graph: Graph, owns):
        self.graph, self.owns = graph, owns
        self.view = GraphView(graph)
        self.source: dict[str, str] = {}  # value -> the code tensor it is a function of
        self.members: dict[str, list[Node]] = {}  # code tensor -> its chain's nodes, in graph order

    def codes(self, name: str) -> bool:
        """An 8-bit tensor a QOperator node writes."""
        info = self.graph.type_of(name)
        producer = self.view.producer.get(name)
        return info is not None and info.is_tensor and info.dtype in _CODES and producer is not None \
            and _in(_QOPERATOR, producer) and self.view.const(name) is None

    def scalar(self, name: str) -> bool:
        value = self.view.const(name)
        return value is not None and value.size == 1

    def take(self, node: Node) -> None:
        """Adds ``node`` to the chain of the one code tensor its non-constant inputs are functions of."""
        if not _in(_ELEMENTWISE, node) or node.subgraphs() or len(node.outputs) != 1 or not owned(self.owns, [node]) \
                or node.outputs[0] in self.view.outputs or node.outputs[0] in self.view.inner_reads:
            return  # (a value the graph returns or a subgraph reads stays as its node makes it)
        factory = lookup(node.op_type, node.domain, node.opset)
        if factory is None or NEEDS.get(factory):
            return
        roots = set()
        for name in node.inputs:
            if not name or self.scalar(name):
                continue
            if name in self.source:
                roots.add(self.source[name])
            elif self.codes(name):
                roots.add(name)
            else:
                return
        if len(roots) != 1:
            return
        root = roots.pop()
        self.source[node.outputs[0]] = root
        self.members.setdefault(root, []).append(node)

    def ends(self, root: str) -> list[tuple[str, list[Node]]]:
        """The chain's results that nodes outside it read, each with the chain nodes it depends on, where every
        such reader is a QOperator node and the result depends on at least MIN_NODES nodes (the other results stay
        as their nodes make them)."""
        nodes = self.members[root]
        inside = {id(n) for n in nodes}
        made = {n.outputs[0]: n for n in nodes}
        found = []
        for node in nodes:
            value = node.outputs[0]
            readers = self.view.consumers.get(value, [])
            outside = [r for r in readers if id(r) not in inside]
            if not outside:
                continue
            if not all(_in(_QOPERATOR, r) for r in outside):
                continue
            cone, stack = [], [node]
            while stack:
                current = stack.pop()
                if any(current is c for c in cone):
                    continue
                cone.append(current)
                stack.extend(made[i] for i in current.inputs if i in made)
            if len(cone) >= MIN_NODES:
                order = {id(n): i for i, n in enumerate(nodes)}
                found.append((value, sorted(cone, key=lambda n: order[id(n)])))
        return found


def _table_node(graph: Graph, root: str, value: str, cone: list[Node], index: int) -> Node:
    constants = []
    for node in cone:
        for name in node.inputs:
            if name and name != root and name not in constants and name in graph.initializers:
                constants.append(name)
    made = {o for n in cone for o in n.outputs}
    body = Graph(
        name=f"code_table_{index}", nodes=list(cone),
        inputs=[ValueInfo(name, graph.type_of(name) or ValueInfo(name).type) for name in [root, *constants]],
        outputs=[ValueInfo(value, graph.type_of(value) or ValueInfo(value).type)],
        initializers={}, value_info={name: graph.value_info[name] for name in made if name in graph.value_info},
        opsets=dict(graph.opsets),
    )
    return Node("CodeTable", [root, *constants], [value], name=f"{cone[-1].name or cone[-1].op_type}/code_table",
                domain=FUSED_DOMAIN, attrs={"body": body}, opset=1)


def fuse_code_tables(graph: Graph, owns=None) -> bool:
    """Replace each chain of the module doc by a CodeTable node; chain nodes nothing reads any more go."""
    if not any(_in(_QOPERATOR, node) for node in graph.nodes):
        return False
    chains = _Chains(graph, owns)
    for node in graph.nodes:
        chains.take(node)
    replaced: dict[int, Node] = {}  # id of a chain's last node -> the table that takes its place
    for root in chains.members:
        for value, cone in chains.ends(root):
            replaced[id(chains.view.producer[value])] = _table_node(graph, root, value, cone, len(replaced))
    if not replaced:
        return False
    nodes = [replaced.get(id(n), n) for n in graph.nodes]
    # chain nodes whose values no one reads now (the tables read the code tensors themselves)
    chained = {id(n) for nodes_ in chains.members.values() for n in nodes_}
    while True:
        read = {name for n in nodes for name in n.inputs} | chains.view.outputs | chains.view.inner_reads
        kept = [n for n in nodes if id(n) not in chained or any(o in read for o in n.outputs)]
        if len(kept) == len(nodes):
            break
        nodes = kept
    graph.nodes = nodes
    return True
