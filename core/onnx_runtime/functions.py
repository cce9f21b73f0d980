"""Function expansion: a node no provider implements is replaced by its function body.

ONNX defines many operators as functions of simpler ones (in the operator schema, possibly
depending on the node's attributes and input types), and models may carry their own local
functions. When placement finds no provider for such a node, the node is expanded in place: the
body's nodes are renamed into the graph (formal inputs and outputs become the node's actual values,
internal values get unique names, attribute references are resolved) and placed in turn, so
nested function operators expand too. Types of the new values come from onnx shape inference over
the body, which context-dependent bodies and later expansions need.
"""

from __future__ import annotations

import itertools

import onnx
import onnx.defs

from .dtypes import DataType
from .errors import InvalidGraphError
from .ir import Dim, Graph, Node, ValueInfo
from .loader import convert_attribute, convert_type


class FunctionExpander:
    """Expands nodes into their function bodies (model-local functions first, then schemas)."""

    def __init__(self, model_functions: dict | None = None):
        self.model_functions = dict(model_functions or {})
        self._ids = itertools.count()

    def can_expand(self, node: Node) -> bool:
        return node.proto is not None and (
            (node.domain, node.op_type) in self.model_functions or _schema_with_function(node) is not None
        )

    def expand(self, node: Node, graph: Graph) -> list[Node] | None:
        """The nodes replacing ``node``, or None when it has no usable function body."""
        if node.proto is None:
            return None
        body = self._body(node, graph)
        if body is None:
            return None
        return self._instantiate(node, body, graph)

    # -- finding the body -----------------------------------------------------------------------
    def _body(self, node: Node, graph: Graph) -> onnx.FunctionProto | None:
        local = self.model_functions.get((node.domain, node.op_type))
        if local is not None:
            return local
        schema = _schema_with_function(node)
        if schema is None:
            return None
        plain = [v for v in schema.function_opset_versions if v <= node.opset]
        dependent = [v for v in schema.context_dependent_function_opset_versions if v <= node.opset]
        version = max(plain + dependent, default=None)
        if version is None:
            return None
        if version in dependent:
            input_types = []
            for name in node.proto.input:
                if not name:
                    input_types.append(b"")
                    continue
                info = graph.type_of(name)
                if info is None or info.dtype is None:
                    return None  # the body depends on input types we do not know
                input_types.append(_type_proto(info.dtype).SerializeToString())
            data = schema.get_context_dependent_function_with_opset_version(
                version, node.proto.SerializeToString(), input_types
            )
        else:
            data = schema.get_function_with_opset_version(version)
        body = onnx.FunctionProto()
        body.ParseFromString(data)
        return body

    # -- instantiating it in the graph ----------------------------------------------------------------
    def _instantiate(self, node: Node, body: onnx.FunctionProto, graph: Graph) -> list[Node]:
        prefix = f"{node.name}/{body.name or node.op_type}#{next(self._ids)}/"
        rename: dict[str, str] = {}
        for index, formal in enumerate(body.input):
            rename[formal] = node.inputs[index] if index < len(node.inputs) else ""
        for index, formal in enumerate(body.output):
            actual = node.outputs[index] if index < len(node.outputs) else ""
            rename[formal] = actual or prefix + formal
        opsets = dict(graph.opsets)
        opsets.update({("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in body.opset_import})
        defaults = {a.name: a for a in body.attribute_proto}
        actual_attrs = {a.name: a for a in node.proto.attribute}

        def mapped(name: str) -> str:
            if not name:
                return ""
            if name not in rename:
                rename[name] = prefix + name
            return rename[name]

        new_nodes: list[Node] = []
        for index, inner in enumerate(body.node):
            proto = onnx.NodeProto()
            proto.CopyFrom(inner)
            del proto.input[:]
            del proto.output[:]
            proto.input.extend(mapped(n) for n in inner.input)
            proto.output.extend(mapped(n) for n in inner.output)
            proto.name = f"{prefix}{inner.name or inner.op_type + '_' + str(index)}"
            del proto.attribute[:]
            for attr in inner.attribute:
                if attr.ref_attr_name:
                    source = actual_attrs.get(attr.ref_attr_name) or defaults.get(attr.ref_attr_name)
                    if source is None:
                        continue  # an unset optional attribute stays unset
                    resolved = onnx.AttributeProto()
                    resolved.CopyFrom(source)
                    resolved.name = attr.name
                    proto.attribute.append(resolved)
                else:
                    copied = onnx.AttributeProto()
                    copied.CopyFrom(attr)
                    if copied.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                        for sub in ([copied.g] if copied.type == onnx.AttributeProto.GRAPH else list(copied.graphs)):
                            _rename_outer_reads(sub, rename)
                    proto.attribute.append(copied)
            domain = "" if proto.domain == "ai.onnx" else proto.domain
            if domain not in opsets:
                raise InvalidGraphError(
                    f"node {node.name!r} ({node.op_type}): its function body uses domain {domain!r} without an opset"
                )
            scope = tuple(graph.value_info) + tuple(rename.values())
            new_nodes.append(Node(
                op_type=proto.op_type, inputs=list(proto.input), outputs=list(proto.output), name=proto.name,
                domain=domain, opset=opsets[domain], proto=proto,
                attrs={a.name: convert_attribute(a, opsets, scope) for a in proto.attribute},
            ))
        self._infer_types(node, new_nodes, graph, opsets)
        return new_nodes

    @staticmethod
    def _infer_types(node: Node, new_nodes: list[Node], graph: Graph, opsets: dict[str, int]) -> None:
        """Record types of the new values by inferring shapes over the body as a small model."""
        inputs = []
        for name in dict.fromkeys(n for nd in new_nodes for n in nd.inputs if n):
            produced = any(name in nd.outputs for nd in new_nodes)
            info = graph.type_of(name)
            if not produced and info is not None and info.is_tensor and info.dtype is not None:
                inputs.append(onnx.helper.make_value_info(name, _type_proto(info.dtype, info.shape)))
        outputs = [onnx.helper.make_value_info(n, onnx.TypeProto()) for nd in new_nodes for n in nd.outputs if n]
        probe = onnx.helper.make_model(
            onnx.helper.make_graph([nd.proto for nd in new_nodes], "body", inputs, outputs),
            opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
        )
        try:
            inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False)
        except Exception:
            return  # types stay unknown; kernels resolve shapes at run time
        for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
            if vi.name not in graph.value_info and vi.type.WhichOneof("value") is not None:
                graph.value_info[vi.name] = ValueInfo(vi.name, convert_type(vi.type))


def _schema_with_function(node: Node):
    try:
        schema = onnx.defs.get_schema(node.op_type, node.opset, node.domain)
    except Exception:
        return None
    if schema.has_function or schema.has_context_dependent_function:  # type: ignore[attr-defined]  # stubs lack it
        return schema
    return None


def _type_proto(dtype: DataType, shape: tuple[Dim, ...] | None = None) -> onnx.TypeProto:
    """A tensor type; ``shape`` (None: no shape) keeps its known and symbolic dims."""
    dims = None if shape is None else [d if isinstance(d, (int, str)) else None for d in shape]
    return onnx.helper.make_tensor_type_proto(int(dtype), dims)


def _rename_outer_reads(graph: onnx.GraphProto, rename: dict[str, str]) -> None:
    """Point a body subgraph's reads of function-scope values at their renamed instances."""
    local = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for node in graph.node:
        for position, name in enumerate(node.input):
            if name and name not in local and name in rename:
                node.input[position] = rename[name]
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                _rename_outer_reads(sub, {k: v for k, v in rename.items() if k not in local})
        local.update(node.output)
    for output in graph.output:
        if output.name not in local and output.name in rename:
            output.name = rename[output.name]
