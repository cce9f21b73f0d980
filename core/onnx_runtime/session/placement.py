"""Placement: which provider runs each node, and why the others declined.

Order of decision, per node: a provider that *claims* the node (``claim_nodes``) gets it first;
otherwise the node goes to the first provider, in the session's priority order, whose
``supports_op`` accepts it. Every rejection keeps its reason, so nothing falls back silently:
``InferenceSession.placement()`` and ``onnx-runtime info`` show it all.
"""

from __future__ import annotations

from collections import Counter, deque

from ..contract.kernels import input_facts
from ..errors import ProviderError, UnsupportedOperatorError
from ..ir import Graph, Node
from ..provider_handle import ProviderHandle
from ..records import Record


class NodePlacement(Record):
    __match_args__ = ("node", "op_type", "domain", "provider", "claimed", "cost", "rejected")
    node: str
    op_type: str
    domain: str
    provider: str
    claimed: bool
    cost: float
    rejected: dict[str, str]  # provider name -> reason

    def __init__(self,
                 node: str, op_type: str, domain: str, provider: str, claimed: bool = False, cost: float = 1.0,
                 rejected: dict[str, str] | None = None) -> None:
        self.node = node
        self.op_type = op_type
        self.domain = domain
        self.provider = provider
        self.claimed = claimed
        self.cost = cost
        self.rejected = {} if rejected is None else rejected


class Copy(Record):
    """A transfer the executor inserted at a device boundary."""

    __match_args__ = ("value", "source", "target")
    value: str
    source: str  # "host" or a provider name
    target: str

    def __init__(self, value: str, source: str, target: str) -> None:
        self.value = value
        self.source = source
        self.target = target


class Placement:
    """Node -> provider decisions (and rejections) for a session's graph, plus inserted copies."""

    def __init__(self, nodes: list[NodePlacement]):
        self.nodes = nodes
        self._by_name = {n.node: n for n in nodes}
        self.copies: list[Copy] = []
        self.expanded: dict[str, list[str]] = {}  # function node -> the body nodes that replaced it

    def __getitem__(self, node_name: str) -> NodePlacement:
        return self._by_name[node_name]

    def __iter__(self):
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def provider_of(self, node_name: str) -> str:
        return self._by_name[node_name].provider

    def as_dict(self) -> dict[str, str]:
        return {n.node: n.provider for n in self.nodes}

    def summary(self) -> dict[str, int]:
        """Node count per provider."""
        return dict(Counter(n.provider for n in self.nodes))

    def __str__(self) -> str:
        lines = [f"{len(self.nodes)} nodes: " + ", ".join(f"{p} {c}" for p, c in self.summary().items())]
        for n in self.nodes:
            how = "claimed by" if n.claimed else "on"
            lines.append(f"  {n.node} ({n.op_type}) {how} {n.provider}")
            for provider, reason in n.rejected.items():
                lines.append(f"      {provider} declined: {reason}")
        for name, body in self.expanded.items():
            lines.append(f"  {name} expanded into its function body: {', '.join(body)}")
        if self.copies:
            lines.append(f"{len(self.copies)} copies at device boundaries:")
            lines.extend(f"  {c.value}: {c.source} -> {c.target}" for c in self.copies)
        return "\n".join(lines)


def place(graph: Graph, handles: list[ProviderHandle], expander=None) -> tuple[Placement, dict[str, ProviderHandle]]:
    """Assign every node of ``graph`` to one of ``handles`` (priority order).

    A node no provider accepts is replaced by its function body when ``expander`` (a
    :class:`onnx_runtime.functions.FunctionExpander`) finds one; the body's nodes are placed in turn.
    """
    claims: dict[str, ProviderHandle] = {}
    for handle in handles:
        claimed = handle.hook.claim_nodes(graph=graph) or []
        for name in claimed:
            claims.setdefault(name, handle)

    records: list[NodePlacement] = []
    assignment: dict[str, ProviderHandle] = {}
    expanded: dict[str, list[str]] = {}
    origin: dict[str, str] = {}  # expanded node -> the original node it came from
    pending = deque(graph.nodes)
    placed: list[Node] = []
    while pending:
        node = pending.popleft()
        record = NodePlacement(node.name, node.op_type, node.domain, provider="")
        if node.name in claims:
            record.provider, record.claimed = claims[node.name].name, True
            assignment[node.name] = claims[node.name]
            records.append(record)
            placed.append(node)
            continue
        shapes, dtypes, layouts = input_facts(graph, node)
        for handle in handles:
            try:
                match = handle.supports_op(node, node.opset, shapes, dtypes, layouts)
            except ProviderError:
                raise
            except Exception as exc:
                raise ProviderError(f"{handle.name}: supports_op failed on node {node.name!r}: {exc}") from exc
            if match.is_supported:
                record.provider, record.cost = handle.name, match.cost
                assignment[node.name] = handle
                break
            record.rejected[handle.name] = match.reason
        if not record.provider:
            body = expander.expand(node, graph) if expander is not None else None
            if body is not None:
                expanded[node.name] = [n.name for n in body]
                for inner in body:
                    origin[inner.name] = origin.get(node.name, f"{node.name!r} ({node.op_type})")
                pending.extendleft(reversed(body))
                continue
            domain = node.domain or "ai.onnx"
            reasons = "; ".join(f"{p}: {r}" for p, r in record.rejected.items()) or "no providers"
            where = f", in the function body of node {origin[node.name]}" if node.name in origin else ""
            raise UnsupportedOperatorError(
                f"node {node.name!r}: operator {node.op_type} (domain {domain}, opset {node.opset}) is not "
                f"implemented by any selected provider{where} ({reasons})"
            )
        records.append(record)
        placed.append(node)
    graph.nodes = placed
    placement = Placement(records)
    placement.expanded = expanded
    return placement, assignment
