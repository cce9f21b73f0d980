"""The subgraphs of an onnx ``GraphProto`` (If branches, Loop and Scan bodies, any graph-valued attribute):
the one place that knows which attributes hold graphs, for the modules that read protobuf graphs before the
session's IR exists (checks, shape inference, specialization)."""

from __future__ import annotations

from collections.abc import Iterator

import onnx


def node_subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs ``node``'s attributes hold, in attribute order."""
    found: list[onnx.GraphProto] = []
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            found.append(attribute.g)
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            found.extend(attribute.graphs)
    return found


def graph_subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graphs held by ``graph``'s nodes (one level down)."""
    for node in graph.node:
        yield from node_subgraphs(node)


def all_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """``graph`` and every subgraph in it, depth first."""
    found = [graph]
    for sub in graph_subgraphs(graph):
        found.extend(all_graphs(sub))
    return found


__all__ = ["all_graphs", "graph_subgraphs", "node_subgraphs"]
