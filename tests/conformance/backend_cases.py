"""The onnx package's backend test cases, run through onnx_runtime and compared as onnx's own
backend runner compares them (each case's rtol/atol for floats; exact for integers, bools and
strings; sequences element by element; None for empty optionals)."""

from __future__ import annotations

import functools
import glob
import os

import numpy as np
import onnx
import onnx_runtime as ort
from onnx import numpy_helper

EXCLUSIONS_FILE = os.path.join(os.path.dirname(__file__), "exclusions.txt")
# Cases not passing yet: tracked as strict xfails, so a fixed case fails the suite until it is removed
# from the list. The goal is an empty file.
KNOWN_FAILURES_FILE = os.path.join(os.path.dirname(__file__), "known_failures.txt")


@functools.cache
def node_cases() -> dict:
    from onnx.backend.test.case.node import collect_testcases

    return {case.name: case for case in collect_testcases()}


def exclusions() -> dict[str, str]:
    """Cases that are themselves wrong: name -> reason (from exclusions.txt)."""
    return _read_listing(EXCLUSIONS_FILE)


def known_failures() -> dict[str, str]:
    """Cases that do not pass yet: name -> what is missing (from known_failures.txt)."""
    return _read_listing(KNOWN_FAILURES_FILE) if os.path.exists(KNOWN_FAILURES_FILE) else {}


def _read_listing(path: str) -> dict[str, str]:
    found = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, reason = line.partition(" ")
                found[name] = reason.strip()
    return found


def model_set_dirs() -> list[str]:
    root = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
    dirs = []
    for kind in ("simple", "pytorch-converted", "pytorch-operator"):
        dirs += sorted(d for d in glob.glob(os.path.join(root, kind, "*")) if os.path.isdir(d))
    return dirs


def _read_pb(path: str):
    """A test-data .pb file: a TensorProto, a SequenceProto, or an OptionalProto."""
    with open(path, "rb") as handle:
        data = handle.read()
    for proto_type, convert in (
        (onnx.TensorProto, numpy_helper.to_array),
        (onnx.SequenceProto, numpy_helper.to_list),
        (onnx.OptionalProto, numpy_helper.to_optional),
    ):
        proto = proto_type()
        try:
            proto.ParseFromString(data)
        except Exception:
            continue
        if proto_type is onnx.TensorProto and not proto.HasField("data_type") and proto.data_type == 0:
            continue
        return proto.name, convert(proto)
    raise ValueError(f"{path} is not a tensor, sequence or optional")


def load_model_set(model_dir: str):
    """(model path, [(inputs, outputs)]) for one folder of the model-level sets."""
    model = os.path.join(model_dir, "model.onnx")
    sets = []
    for data_dir in sorted(glob.glob(os.path.join(model_dir, "test_data_set_*"))):
        inputs = [_read_pb(p)[1] for p in sorted(glob.glob(os.path.join(data_dir, "input_*.pb")),
                                                  key=lambda p: int(p.rsplit("_", 1)[1][:-3]))]
        outputs = [_read_pb(p)[1] for p in sorted(glob.glob(os.path.join(data_dir, "output_*.pb")),
                                                   key=lambda p: int(p.rsplit("_", 1)[1][:-3]))]
        sets.append((inputs, outputs))
    return model, sets


def run_case(model, data_sets, rtol: float, atol: float) -> None:
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model)
    sess = ort.InferenceSession(proto.SerializeToString() if isinstance(model, onnx.ModelProto) else model,
                                providers=["CPUExecutionProvider"])
    input_names = [vi.name for vi in proto.graph.input if vi.name not in {i.name for i in proto.graph.initializer}]
    for inputs, expected in data_sets:
        # As onnx's runner does: cases may hold TensorProto objects for exotic element types.
        inputs = [_normalize(v) for v in inputs]
        expected = [_normalize(v) for v in expected]
        feeds = dict(zip(input_names, inputs))
        outputs = sess.run(None, feeds)
        assert_similar(expected, outputs, rtol, atol)


def _normalize(value):
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else value


def assert_similar(expected, outputs, rtol: float, atol: float, where: str = "output") -> None:
    assert len(outputs) == len(expected), f"{where}: {len(outputs)} values, expected {len(expected)}"
    for index, (want, got) in enumerate(zip(expected, outputs)):
        label = f"{where}[{index}]"
        if want is None:
            assert got is None, f"{label}: expected an empty optional, got {type(got).__name__}"
            continue
        if isinstance(want, (list, tuple)):
            assert isinstance(got, (list, tuple)), f"{label}: expected a sequence, got {type(got).__name__}"
            assert_similar(list(want), list(got), rtol, atol, label)
            continue
        want = np.asarray(want)
        assert isinstance(got, np.ndarray), f"{label}: expected an array, got {type(got).__name__}"
        assert got.shape == want.shape, f"{label}: shape {got.shape}, expected {want.shape}"
        if want.dtype == object:
            np.testing.assert_array_equal(got, want, err_msg=label)
            continue
        assert got.dtype == want.dtype, f"{label}: dtype {got.dtype}, expected {want.dtype}"
        if want.dtype.kind in "biu":
            np.testing.assert_array_equal(got, want, err_msg=label)
        elif want.dtype.kind in "fc":
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=label)
        else:  # ml_dtypes (bfloat16, float8, int4, float4...): compare through float32 / int, at the case's tolerance
            wide = np.float32 if "float" in want.dtype.name else np.int64
            g, w = got.astype(wide), want.astype(wide)
            if wide is np.int64:
                np.testing.assert_array_equal(g, w, err_msg=label)
            else:
                np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=label)


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
