"""The subgraphs of an onnx ``GraphProto`` (If branches, Loop and Scan bodies, any graph-valued attribute):
the one place that knows which attributes hold graphs, for the modules that read protobuf graphs before the
session's IR exists (checks, shape inference, specialization), and the field copy that leaves one field behind."""

from __future__ import annotations

from collections.abc import Iterator

import onnx

from .errors import InvalidGraphError


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


def copy_fields_except(source, target, skip: str) -> None:
    """Every set field of protobuf message ``source`` into ``target`` except ``skip`` (e.g. a graph without its
    initializers, which can be most of a model's bytes)."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):
            getattr(target, field.name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(target, field.name).CopyFrom(value)
        else:
            try:
                setattr(target, field.name, value)
            except UnicodeDecodeError:  # a string field read back as bytes: protobuf kept what is not UTF-8
                raise InvalidGraphError(
                    f"field {field.name!r} of the model's {source.DESCRIPTOR.name} is not UTF-8 text "
                    f"({value[:32]!r}); ONNX strings must be UTF-8: re-export or fix the file") from None
