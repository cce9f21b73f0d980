"""Stale declarations: a model's value_info, output shapes and initializer inputs that disagree with what its nodes
compute. onnxruntime merges such claims leniently (or refuses a wrong element type); the session must never trust
them over what it computes (declared_shapes.py, model_checks.py). onnxruntime is the oracle."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime import InferenceSession, declared_shapes
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

X = np.random.default_rng(7).standard_normal((2, 3, 4)).astype(np.float32)


def vi(name, shape=None, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, value_info=(), outputs=None, initializers=(), inputs=None):
    graph = helper.make_graph(nodes, "g", inputs or [vi("x", [2, 3, 4])], outputs or [vi("y")],
                              initializer=list(initializers), value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 21)]).SerializeToString()


def _both(data, feeds):
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # its "falling back to lenient merge" warnings
    expected = onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


RELU = helper.make_node("Relu", ["x"], ["r"])
SHAPE_AS_FLOAT = [helper.make_node("Shape", ["r"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT)]


@pytest.mark.parametrize("declared", [[2, 3, 5], [7, 7, 7], [24], [2, 3, 4, 1]], ids=str)
def test_shape_of_a_value_with_a_stale_declaration_is_the_computed_one(declared):
    # Shape folded from the declaration: [2, 3, 5] for an actual (2, 3, 4)
    _both(_model([RELU, *SHAPE_AS_FLOAT], [vi("r", declared)]), {"x": X})


def test_size_of_a_value_with_a_stale_declaration_is_the_computed_one():
    nodes = [RELU, helper.make_node("Size", ["r"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT)]
    _both(_model(nodes, [vi("r", [3, 3])]), {"x": X})


def test_a_reshape_to_the_declared_shape_is_not_taken_for_a_no_op():
    target = numpy_helper.from_array(np.array([2, 12], np.int64), "target")
    nodes = [RELU, helper.make_node("Reshape", ["r", "target"], ["y"])]
    _both(_model(nodes, [vi("r", [2, 12])], initializers=[target]), {"x": X})


def test_an_output_declared_with_a_stale_shape_and_read_inside_is_computed():
    outputs = [vi("y"), vi("r", [2, 3, 9])]
    _both(_model([RELU, *SHAPE_AS_FLOAT], outputs=outputs), {"x": X})


def test_a_stale_declaration_inside_a_branch_is_not_trusted():
    then = helper.make_graph([RELU, *SHAPE_AS_FLOAT], "then", [], [vi("y")], value_info=[vi("r", [7, 7, 7])])
    other = helper.make_graph([helper.make_node("Constant", [], ["e"], value=numpy_helper.from_array(
        np.zeros(3, np.float32)))], "else", [], [vi("e")])
    node = helper.make_node("If", ["c"], ["out"], then_branch=then, else_branch=other)
    data = _model([node], outputs=[vi("out")], inputs=[vi("x", [2, 3, 4]), vi("c", [], TensorProto.BOOL)])
    _both(data, {"x": X, "c": np.array(True)})


def test_consistent_declarations_are_kept_and_inferred_once():
    calls = []

    def infer(model, strict):
        calls.append(strict)
        return onnx.shape_inference.infer_shapes(model, strict_mode=strict).graph

    model = onnx.ModelProto.FromString(_model([RELU, *SHAPE_AS_FLOAT], [vi("r", [2, 3, "n"])]))
    graph = declared_shapes.infer_reconciled(model, infer)
    assert calls == [True]
    declared = {v.name: v for v in graph.value_info}["r"].type.tensor_type.shape.dim
    assert [d.dim_value or d.dim_param for d in declared] == [2, 3, 4]


def test_a_stale_declaration_is_merged_as_onnxruntime_merges_it():
    calls = []

    def infer(model, strict):
        calls.append(strict)
        try:
            return onnx.shape_inference.infer_shapes(model, strict_mode=strict).graph
        except Exception:  # noqa: BLE001 (strict inference refuses the stale claim)
            return None

    model = onnx.ModelProto.FromString(_model([RELU, *SHAPE_AS_FLOAT], [vi("r", [2, 3, 5]), vi("unused", [4])]))
    graph = declared_shapes.infer_reconciled(model, infer)
    assert calls == [True, False]
    found = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.value_info}
    assert found["r"] == [2, 3, 4]  # computed wins
    assert found["unused"] == [4]  # nothing computed it: kept, unchecked
    assert len(model.graph.value_info) == 2  # the caller's model is not changed


def test_a_declared_element_type_that_differs_from_the_computed_one_is_refused():
    # onnxruntime: "Type Error: Type (tensor(int64)) of output arg (r) of node () does not match expected type"
    data = _model([RELU, *SHAPE_AS_FLOAT], [vi("r", [2, 3, 4], TensorProto.INT64)])
    with pytest.raises(InvalidGraphError, match=r"value 'r' is declared int64 but node '' \(Relu\) computes float"):
        InferenceSession(data, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("declared", [[4], [3, 1], []], ids=str)
def test_an_initializer_of_another_shape_than_its_declared_input_is_refused(declared):
    # onnxruntime: "Type Error: Shape of initializer w does not match. {4} != {3}"
    w = numpy_helper.from_array(np.ones(3, np.float32), "w")
    nodes = [helper.make_node("Shape", ["w"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [vi("w", declared)], [vi("y")], initializer=[w])
    data = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 21)], ir_version=8)
    with pytest.raises(InvalidGraphError, match=r"initializer 'w' .* has shape \[3\] but the graph input of that name "
                                                r"declares"):
        InferenceSession(data.SerializeToString(), providers=["CPUExecutionProvider"])


def test_an_initializer_matching_a_symbolic_declared_shape_is_accepted():
    w = numpy_helper.from_array(np.ones(3, np.float32), "w")
    nodes = [helper.make_node("Shape", ["w"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [vi("w", ["n"])], [vi("y")], initializer=[w])
    data = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 21)], ir_version=8)
    _both(data.SerializeToString(), {})


def test_a_convolution_stepping_past_the_whole_image_runs_as_onnxruntime_does():
    # Fuzz seed 46: strides [1, 2**40] made the direct tiles' margin 2**44 floats (a MemoryError in the kernel).
    from onnx_runtime_ep_cpu.algorithms.conv_choice import direct_tiles_apply
    from onnx_runtime_ep_cpu.algorithms.window import Window

    w = np.random.default_rng(1).standard_normal((16, 8, 1, 1)).astype(np.float32)
    x = np.random.default_rng(2).standard_normal((1, 8, 12, 12)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=[1, 2**40])
    graph = helper.make_graph([node], "g", [vi("x", [1, 8, 12, 12])], [vi("y")],
                              initializer=[numpy_helper.from_array(w, "w")])
    _both(helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 21)]).SerializeToString(), {"x": x})

    from onnx_runtime.ir import Node

    window = Window(Node("Conv", ["x", "w"], ["y"], attrs={"strides": [1, 2**40]}), [x.shape, w.shape],
                    needs_kernel=False)
    assert not direct_tiles_apply(window.resolve(x.shape[2:], w.shape[2:]), 1, x, w)


def test_rotary_embedding_caches_of_two_shapes_are_refused():
    # Fuzz seed 46: a sin_cache of fewer rows than cos_cache was indexed past its end (an IndexError).
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], name="rope")
    inputs = [vi("x", [1, 2, 3, 8]), vi("cos"), vi("sin"), vi("pos", None, TensorProto.INT64)]
    graph = helper.make_graph([node], "g", inputs, [vi("y")])
    data = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 23)]).SerializeToString()
    session = InferenceSession(data, providers=["CPUExecutionProvider"])
    feeds = {"x": np.ones((1, 2, 3, 8), np.float32), "cos": np.ones((10, 4), np.float32),
             "sin": np.ones((2, 4), np.float32), "pos": np.array([[0, 5, 9]], np.int64)}
    with pytest.raises(InvalidArgumentError, match=r"'rope' \(RotaryEmbedding\).*cos_cache \[10, 4\] and sin_cache "
                                                   r"\[2, 4\] must have one shape") as info:
        session.run(None, feeds)
    cause = info.value
    while cause is not None:
        assert not isinstance(cause, (IndexError, TypeError)), repr(cause)
        cause = cause.__cause__


@pytest.fixture
def plan_cache_on(tmp_path, monkeypatch):
    """The persistent plan cache on, in a folder of the test's own (the suite turns it off)."""
    monkeypatch.setenv("ONNX_RUNTIME_PLAN_CACHE", "1")
    monkeypatch.setenv("ONNX_RUNTIME_PLAN_CACHE_DIR", str(tmp_path / "plans"))


def test_a_graph_name_that_is_not_utf8_does_not_stop_the_plan_cache(plan_cache_on):
    # Fuzz seed 47: a byte-flipped graph name reached the plan cache's writer as bytes (a UnicodeDecodeError).
    graph = helper.make_graph([RELU, helper.make_node("Identity", ["r"], ["y"])], "graphXname", [vi("x", [2, 3, 4])],
                              [vi("y")])
    data = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 21)]).SerializeToString()
    data = data.replace(b"graphXname", b"graph\xeename")
    for _ in range(2):  # written, then read back
        got = InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]
        np.testing.assert_array_equal(got, np.maximum(X, 0))


def test_a_string_attribute_that_is_not_utf8_is_refused_typed_with_the_plan_cache(plan_cache_on):
    # Fuzz seed 47: Pad's mode b"\xff\xfe" reached the plan cache's writer (a UnicodeEncodeError) before the kernel.
    pads = numpy_helper.from_array(np.zeros(6, np.int64), "pads")
    node = helper.make_node("Pad", ["x", "pads"], ["y"], name="pad", mode=b"\xff\xfe")
    with pytest.raises(InvalidGraphError, match=r"'pad' \(Pad\): attribute 'mode'"):
        InferenceSession(_model([node], initializers=[pads]), providers=["CPUExecutionProvider"])


def test_a_padded_convolution_stepping_past_the_image_height_runs_as_onnxruntime_does():
    # Fuzz seed 49: strides [2**31 - 1, 2] made the packed convolution (AVX-512 hosts) pad its input for the whole
    # step (40 GiB, a MemoryError).
    w = np.random.default_rng(3).standard_normal((1, 1, 3, 3)).astype(np.float32)
    x = np.random.default_rng(4).standard_normal((1, 1, 7, 5)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 0, 1, 0], strides=[2**31 - 1, 2])
    graph = helper.make_graph([node], "g", [vi("x", [1, 1, 7, 5])], [vi("y")],
                              initializer=[numpy_helper.from_array(w, "w")])
    _both(helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 21)]).SerializeToString(), {"x": x})
