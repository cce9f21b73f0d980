"""torch's "-1 -> 1" Where over an Expand target (session/shape_wheres.py): inference sees through it when the shape
vector's pieces are non-negative dimensions or constants, so a specialized graph knows the Expand's shape; forms it
cannot prove keep the Where. Results checked against onnxruntime (the oracle) over a growing length."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.loader import infer_graph
from onnx_runtime.session.shape_wheres import see_through_shape_wheres


def _model(first_piece: str = "dim"):
    """y = Expand(v, Where(Equal(c, -1), 1, c)) + x, c = [x.shape[0], -1, x.shape[1]] (the first piece an input's
    value instead with ``first_piece="value"``)."""
    inits = [numpy_helper.from_array(np.array(value, np.int64), name) for value, name in
             ((0, "i0"), (1, "i1"), ([0], "axes"), ([-1], "minus"), ([-1, -1, -1], "k"), ([1, 1, 1], "ones"))]
    inits.append(numpy_helper.from_array(np.ones((1, 1, 1), np.float32), "v"))
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "i1"], ["d1"]),
             helper.make_node("Unsqueeze", ["d1", "axes"], ["u1"])]
    source = "s" if first_piece == "dim" else "n"
    nodes += [helper.make_node("Gather", [source, "i0"], ["d0"]), helper.make_node("Unsqueeze", ["d0", "axes"], ["u0"])]
    nodes += [helper.make_node("Concat", ["u0", "minus", "u1"], ["c"], axis=0),
              helper.make_node("Equal", ["c", "k"], ["e"]),
              helper.make_node("Where", ["e", "ones", "c"], ["target"]),
              helper.make_node("Expand", ["v", "target"], ["expanded"]),
              helper.make_node("Unsqueeze", ["x", "axes1"], ["x3"]),
              helper.make_node("Add", ["expanded", "x3"], ["y"])]
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axes1"))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "length"]),
              helper.make_tensor_value_info("n", TensorProto.INT64, [1])]
    graph = helper.make_graph(nodes, "shape_where", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                           None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    return proto


def _shape(graph: onnx.GraphProto, name: str):
    for vi in (*graph.value_info, *graph.output):
        if vi.name == name:
            dims = vi.type.tensor_type.shape.dim
            return [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in dims]
    return None


def test_inference_sees_through_the_where_of_non_negative_dimensions():
    proto = _model()
    before = _shape(infer_graph(proto), "expanded")
    assert before is None or all(isinstance(d, str) and d.startswith("unk") for d in before)  # onnx alone: unknown
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    inferred = infer_graph(see_through_shape_wheres(copy))
    assert _shape(inferred, "expanded") == ["batch", 1, "length"]
    assert [node.op_type for node in copy.graph.node].count("Where") == 0


def test_a_piece_that_is_an_input_value_keeps_the_where():
    copy = _model("value")
    see_through_shape_wheres(copy)
    assert [node.op_type for node in copy.graph.node].count("Where") == 1


def test_specialized_runs_over_a_growing_length_match_onnxruntime():
    import onnxruntime

    proto = _model()
    options = ort.SessionOptions()
    options.add_session_config_entry("session.plan_cache", "0")
    session = ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    for length in (3, 4, 5, 9, 2):
        feeds = {"x": rng.standard_normal((2, length)).astype(np.float32), "n": np.array([7], np.int64)}
        got, expected = session.run(None, feeds)[0], oracle.run(None, feeds)[0]
        assert got.shape == expected.shape == (2, 1, length)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
