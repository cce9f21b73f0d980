"""The onnx package's backend test cases on the CPU provider, through onnx_runtime.testing's runner
(onnx_runtime/testing/cases.py: loading, comparison as onnx's own backend runner compares, declined nodes and
silent fallback), with this project's exclusions and the proof behind the half-precision ones."""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import numpy_helper
from onnx_runtime.testing.cases import (  # noqa: F401  (the conformance tests import these from here)
    MODEL_SET_ATOL,
    MODEL_SET_RTOL,
    assert_similar,
    load_model_set,
    model_set_dirs,
    node_cases,
    read_listing,
)
from onnx_runtime.testing.cases import normalize as _normalize  # noqa: F401
from onnx_runtime.testing.cases import run_case as run_on

EXCLUSIONS_FILE = os.path.join(os.path.dirname(__file__), "exclusions.txt")
# Cases not passing yet: tracked as strict xfails, so a fixed case fails the suite until it is removed
# from the list. The goal is an empty file.
KNOWN_FAILURES_FILE = os.path.join(os.path.dirname(__file__), "known_failures.txt")


def exclusions() -> dict[str, str]:
    """Cases that are themselves wrong: name -> reason (from exclusions.txt)."""
    return read_listing(EXCLUSIONS_FILE)


def known_failures() -> dict[str, str]:
    """Cases that do not pass yet: name -> what is missing (from known_failures.txt)."""
    return read_listing(KNOWN_FAILURES_FILE) if os.path.exists(KNOWN_FAILURES_FILE) else {}


def run_case(model, data_sets, rtol: float, atol: float) -> None:
    """One case on the CPU provider alone, through onnx_runtime.testing's runner (as
    ``pytest -p onnx_runtime.testing --provider cpu`` runs it)."""
    run_on(model, data_sets, rtol, atol, provider="CPUExecutionProvider")


_HALF_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def exact_function_body(expanded: onnx.ModelProto):
    """``run(feeds) -> outputs``: an ``_expanded`` case's graph (an operator's function body) evaluated
    exactly as the body defines it: each node computed in float64 by onnx's reference evaluator, and its
    half-precision results rounded to their type once, after the node, as a kernel for that node would.

    This is the oracle for half-precision cases whose expected values round inside a node (the case
    generators compute in ml_dtypes' bfloat16 ufuncs, which round every exp and every partial sum of a
    softmax): where the expected values and this evaluation disagree beyond the case's tolerance, the
    expected values are not the operator's."""
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    graph = onnx.shape_inference.infer_shapes(expanded).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.input, *graph.output)}
    half_inputs = {v.name for v in graph.input if types[v.name] in _HALF_TYPES}
    nodes = [helper.make_node("Cast", [f"{name}.half"], [name], to=TensorProto.DOUBLE) for name in half_inputs]
    for original in graph.node:
        node = onnx.NodeProto()
        node.CopyFrom(original)
        for attr in node.attribute:
            if node.op_type in ("Cast", "CastLike") and attr.name == "to" and attr.i in _HALF_TYPES:
                attr.i = TensorProto.DOUBLE
            elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in _HALF_TYPES:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float64), attr.t.name))
        rounding = []
        for index, name in enumerate(node.output):
            if types.get(name) in _HALF_TYPES:
                node.output[index] = f"{name}.exact"
                rounding += [helper.make_node("Cast", [f"{name}.exact"], [f"{name}.rounded"], to=types[name]),
                             helper.make_node("Cast", [f"{name}.rounded"], [name], to=TensorProto.DOUBLE)]
        nodes += [node, *rounding]
    inputs = [helper.make_tensor_value_info(f"{v.name}.half" if v.name in half_inputs else v.name,
                                            v.type.tensor_type.elem_type, None) for v in graph.input]
    outputs = [helper.make_tensor_value_info(v.name, TensorProto.DOUBLE if types[v.name] in _HALF_TYPES
                                             else v.type.tensor_type.elem_type, None) for v in graph.output]
    model = helper.make_model(helper.make_graph(nodes, "exact_body", inputs, outputs),
                              opset_imports=expanded.opset_import, ir_version=expanded.ir_version)
    evaluator = ReferenceEvaluator(model)

    def run(feeds: dict) -> list:
        return evaluator.run(None, {f"{k}.half" if k in half_inputs else k: v for k, v in feeds.items()})

    return run
