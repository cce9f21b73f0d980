"""The IR written back as a standard ONNX model: what ``SessionOptions.optimized_model_filepath`` saves.

The graph is written as the session runs it, after the optimizer and the providers' passes: fused operators keep the
domain their provider registers them under (the CPU provider's ``ai.onnx_runtime.cpu``, onnxruntime's
``com.microsoft``), so this runtime loads the file back and runs it without optimizing again. A standard operator a
fusion made at a later opset than the model imports (RMSNormalization is opset 23) is written in the domain
``ai.onnx_runtime.opset<N>``, imported at N, which the loader reads back as that standard operator.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import InvalidArgumentError
from .ir import Graph, Model, TypeInfo, ValueInfo
from .loader import LATER_OPSET_DOMAIN

# Past this many initializer bytes, weights go to a data file beside the model: protobuf refuses messages over 2 GiB.
EXTERNAL_DATA_BYTES = 1 << 30


def model_to_proto(model: Model, graph: Graph | None = None) -> onnx.ModelProto:
    """``graph`` (the model's graph by default) as an ``onnx.ModelProto`` with the model's metadata."""
    graph = model.graph if graph is None else graph
    opsets = dict(model.opsets)
    base = opsets.get("", 1)
    for node in graph.walk():
        if not node.domain and node.opset > base:
            opsets[f"{LATER_OPSET_DOMAIN}{node.opset}"] = node.opset
        opsets.setdefault(node.domain, 1)
    proto = helper.make_model(
        graph_to_proto(graph, base),
        opset_imports=[helper.make_opsetid(domain, version) for domain, version in sorted(opsets.items())],
        producer_name=model.producer_name, producer_version=model.producer_version, domain=model.domain,
        model_version=model.model_version, doc_string=model.doc_string,
    )
    proto.ir_version = max(int(model.ir_version), 3)
    for key, value in model.metadata.items():
        proto.metadata_props.add(key=key, value=value)
    proto.functions.extend(model.functions.values())
    return proto


def save_model(model: Model, path: str, graph: Graph | None = None) -> None:
    """Write ``graph`` to ``path``; weights over ``EXTERNAL_DATA_BYTES`` in all go to ``<file>.data`` beside it."""
    proto = model_to_proto(model, graph)
    weights = sum(t.ByteSize() for t in proto.graph.initializer)
    if weights > EXTERNAL_DATA_BYTES:
        onnx.save_model(proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=os.path.basename(path) + ".data")
    else:
        onnx.save_model(proto, path)


def graph_to_proto(graph: Graph, opset: int) -> onnx.GraphProto:
    """``graph`` as a GraphProto for a model importing the default domain at ``opset``."""
    nodes = []
    for node in graph.nodes:
        op_type, domain, attrs = node.op_type, node.domain, node.attrs
        if not domain and node.opset > opset:  # a fusion's operator of a later opset than the model's
            domain = f"{LATER_OPSET_DOMAIN}{node.opset}"
        written = helper.make_node(op_type, node.inputs, node.outputs, name=node.name or None,
                                   domain=domain or None, doc_string=node.doc or None)
        written.attribute.extend(_attribute(node.name, key, value, opset) for key, value in attrs.items())
        nodes.append(written)
    initializers = [_tensor(name, value) for name, value in graph.initializers.items()]
    declared = {vi.name for vi in graph.inputs} | {vi.name for vi in graph.outputs}
    value_info = [_value_info(vi) for name, vi in graph.value_info.items()
                  if name not in declared and vi.type.is_tensor and vi.type.dtype is not None]
    return helper.make_graph(nodes, graph.name or "graph", [_value_info(vi) for vi in graph.inputs],
                             [_value_info(vi) for vi in graph.outputs], initializers, doc_string=graph.doc or None,
                             value_info=value_info)


def _attribute(node: str, key: str, value, opset: int) -> onnx.AttributeProto:
    """The attribute ``key`` of ``node``; subgraphs are written recursively."""
    if isinstance(value, (list, tuple)) and not value:
        return helper.make_attribute(key, [], attr_type=onnx.AttributeProto.INTS)
    return helper.make_attribute(key, _attribute_value(node, key, value, opset))


def _attribute_value(node: str, key: str, value, opset: int):
    if isinstance(value, Graph):
        return graph_to_proto(value, opset)
    if isinstance(value, np.ndarray):
        return _tensor("", value)
    if isinstance(value, (list, tuple)):
        return [_attribute_value(node, key, item, opset) for item in value]
    if isinstance(value, (bool, int, float, str, bytes, np.integer, np.floating)):
        return value.item() if isinstance(value, np.generic) else value
    raise InvalidArgumentError(
        f"node {node!r} attribute {key!r} holds a {type(value).__name__}, which has no ONNX attribute type; the "
        f"optimized graph cannot be written (leave optimized_model_filepath empty)"
    )


def _tensor(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _value_info(vi: ValueInfo) -> onnx.ValueInfoProto:
    return helper.make_value_info(vi.name, _type_proto(vi.type))


def _type_proto(info: TypeInfo) -> onnx.TypeProto:
    if info.kind in ("tensor", "sparse_tensor"):
        elem = int(info.dtype) if info.dtype is not None else 0
        shape = None if info.shape is None else [d if isinstance(d, (int, str)) else None for d in info.shape]
        if info.kind == "sparse_tensor":
            return helper.make_sparse_tensor_type_proto(elem, shape)
        return helper.make_tensor_type_proto(elem, shape)
    if info.kind == "sequence" and info.elem is not None:
        return helper.make_sequence_type_proto(_type_proto(info.elem))
    if info.kind == "optional" and info.elem is not None:
        return helper.make_optional_type_proto(_type_proto(info.elem))
    return onnx.TypeProto()
