"""Table chains: what code_tables.py (QOperator codes) and qdq_tables.py (QDQ grids) share.

Both find, in graph order, elementwise nodes whose every non-constant input is a function of one root tensor that
holds one of 256 values per element, and replace each chain result that nodes outside the chain read by one node
whose kernel runs the chain's own nodes once on those values and then looks every element up (ops/table_chain.py).
The caller says which nodes are elementwise, which tensors are roots and which outside readers a table serves.

The chain is spelled in plain attributes, not a graph attribute: a node with a graph attribute is control flow to
the session's shape analysis, which would leave every shape after it unknown. Per chain node ``chain`` holds
"domain:op_type:opset", ``wiring`` its input names then its output after "|", and its attributes are
``{index}.{name}``; ``names`` are the table's inputs after the grid parameters (the root, then the constants in
input order), ``result`` the value made.
"""

from __future__ import annotations

from collections.abc import Callable

from onnx_runtime.ir import Graph, Node

from .fusions import GraphView, owned
from .registry import NEEDS, lookup

MIN_NODES = 2  # one node already makes one pass over its values


class ElementwiseChains:
    """The chains of one graph (seen through ``view``), by root.

    ``elementwise(node)``: whether every output element of the node depends only on the same element of each
    input; ``root(name)``: whether the tensor holds one of 256 values per element, so a chain may start at it;
    ``serves(value, outside)``: whether a table may make the value for the nodes outside the chain that read it.
    A constant of more than ``max_constant_rank`` dimensions is not taken (None: any); ``constant(name)``, where
    given, says instead which inputs are constant operands (one per channel, say: ``elementwise`` then checks how
    its node reads them)."""

    def __init__(self, view: GraphView, owns, *, elementwise: Callable[[Node], bool], root: Callable[[str], bool],
                 serves: Callable[[str, list[Node]], bool], max_constant_rank: int | None = None,
                 constant: Callable[[str], bool] | None = None):
        self.view, self.graph, self.owns = view, view.graph, owns
        self.elementwise, self.root, self.serves = elementwise, root, serves
        self.max_constant_rank = max_constant_rank
        self.constant = constant or self.scalar
        self.source: dict[str, str] = {}  # value -> the root it is a function of
        self.members: dict[str, list[Node]] = {}  # root -> its chain's nodes, in graph order

    def scalar(self, name: str) -> bool:
        value = self.view.const(name)
        return value is not None and value.size == 1 \
            and (self.max_constant_rank is None or value.ndim <= self.max_constant_rank)

    def take(self, node: Node) -> None:
        """Adds ``node`` to the chain of the one root its non-constant inputs are functions of."""
        if not self.elementwise(node) or node.subgraphs() or len(node.outputs) != 1 \
                or not owned(self.owns, [node]) or node.outputs[0] in self.view.outputs \
                or node.outputs[0] in self.view.inner_reads:
            return  # (a value the graph returns or a subgraph reads stays as its node makes it)
        factory = lookup(node.op_type, node.domain, node.opset)
        if factory is None or NEEDS.get(factory) or any("," in n or "|" in n for n in [*node.inputs, *node.outputs]):
            return  # (the table's attributes spell a node's values with those separators)
        roots = set()
        for name in node.inputs:
            if not name or self.constant(name):
                continue
            if name in self.source:
                roots.add(self.source[name])
            elif self.root(name):
                roots.add(name)
            else:
                return
        if len(roots) != 1:
            return
        root = roots.pop()
        self.source[node.outputs[0]] = root
        self.members.setdefault(root, []).append(node)

    def ends(self, root: str) -> list[tuple[str, list[Node]]]:
        """The chain's results that nodes outside it read and ``serves`` accepts, each with the chain nodes it
        depends on, where that is at least MIN_NODES of them (the other results stay as their nodes make them)."""
        nodes = self.members[root]
        inside = {id(n) for n in nodes}
        made = {n.outputs[0]: n for n in nodes}
        order = {id(n): i for i, n in enumerate(nodes)}
        found = []
        for node in nodes:
            value = node.outputs[0]
            outside = [r for r in self.view.consumers.get(value, []) if id(r) not in inside]
            if not outside or not self.serves(value, outside):
                continue
            cone, stack, seen = [], [node], set()
            while stack:
                current = stack.pop()
                if id(current) in seen:
                    continue
                seen.add(id(current))
                cone.append(current)
                stack.extend(made[i] for i in current.inputs if i in made)
            if len(cone) >= MIN_NODES:
                found.append((value, sorted(cone, key=lambda n: order[id(n)])))
        return found

    def replace(self, table: Callable[[str, str, list[Node]], Node]) -> bool:
        """Each chain result of ``ends`` becomes ``table(root, value, cone)`` where its last node was; chain nodes
        nothing reads any more go (the tables read their roots themselves)."""
        for node in self.graph.nodes:
            self.take(node)
        replaced: dict[int, Node] = {}  # id of a chain's last node -> the table that takes its place
        for root in self.members:
            for value, cone in self.ends(root):
                replaced[id(self.view.producer[value])] = table(root, value, cone)
        if not replaced:
            return False
        nodes = [replaced.get(id(n), n) for n in self.graph.nodes]
        chained = {id(n) for members in self.members.values() for n in members}
        while True:
            read = {name for n in nodes for name in n.inputs} | self.view.outputs | self.view.inner_reads
            kept = [n for n in nodes if id(n) not in chained or any(o in read for o in n.outputs)]
            if len(kept) == len(nodes):
                break
            nodes = kept
        self.graph.nodes = nodes
        return True


def chain_attributes(graph: Graph, root: str, value: str, cone: list[Node]) -> tuple[list[str], dict]:
    """(constants, attributes): the initializers the chain reads besides its root, in input order, and the chain
    in the module doc's plain attributes."""
    constants: list[str] = []
    for node in cone:
        for name in node.inputs:
            if name and name != root and name not in constants and name in graph.initializers:
                constants.append(name)
    attrs: dict = {"chain": [f"{n.domain}:{n.op_type}:{n.opset}" for n in cone],
                   "wiring": [",".join(n.inputs) + "|" + n.outputs[0] for n in cone],
                   "names": [root, *constants], "result": value}
    for index, node in enumerate(cone):
        attrs.update({f"{index}.{key}": v for key, v in (node.attrs or {}).items()})
    return constants, attrs
