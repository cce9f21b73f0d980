"""Hostile-model defects fixed at their root rather than where the fuzz first saw them: a value declared with an
undefined element type or as a sparse tensor (a raw TensorProto fed to such an input reached Cast), and a
convolution weight with an empty axis (a ValueError from reshaping it inside the kernel). onnxruntime is the oracle
where it gives an answer."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime import InferenceSession
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError, OnnxRuntimeError


def _model(nodes, inputs, outputs, value_info=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", opset)]).SerializeToString()


def _ours(data):
    return InferenceSession(data, providers=["CPUExecutionProvider"])


def _theirs_refuses(data):
    with pytest.raises(Exception):  # noqa: B017 (its own exception types)
        onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])


CAST = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)
Y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])


@pytest.mark.parametrize("where", ["input", "value_info", "output", "sequence element"])
def test_a_declared_undefined_element_type_is_refused_naming_the_value(where):
    undefined = helper.make_tensor_value_info("t", TensorProto.UNDEFINED, [2])
    x = helper.make_tensor_value_info("x", TensorProto.INT64, [2])
    if where == "input":
        data = _model([helper.make_node("Cast", ["t"], ["y"], to=TensorProto.FLOAT)], [undefined], [Y])
    elif where == "value_info":
        data = _model([helper.make_node("Neg", ["x"], ["t"]), helper.make_node("Cast", ["t"], ["y"], to=1)], [x], [Y],
                      [undefined])
    elif where == "output":
        data = _model([helper.make_node("Neg", ["x"], ["t"])], [x], [undefined])
    else:
        seq = helper.make_tensor_sequence_value_info("t", TensorProto.UNDEFINED, None)
        data = _model([helper.make_node("SequenceConstruct", ["x"], ["t"])], [x], [seq])
    _theirs_refuses(data)
    with pytest.raises(InvalidGraphError, match=r"value 't' .*element type 0.*declare its type"):
        _ours(data)


def test_a_sparse_input_read_by_a_dense_operator_is_refused_at_creation():
    # The fuzz case: a raw TensorProto fed to a sparse input reached Cast's kernel (fuzz50_cast_of_unconverted_...)
    sparse = helper.make_sparse_tensor_value_info("x", TensorProto.INT64, [7, 1])
    data = _model([CAST], [sparse], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [7, 1])])
    _theirs_refuses(data)
    with pytest.raises(InvalidGraphError, match=r"Cast .*input 0 \('x'\) is sparse_tensor\(int64\)"):
        _ours(data)


@pytest.mark.parametrize("feed", [np.zeros(2, np.float32), numpy_helper.from_array(np.zeros(2, np.float32), "x")],
                         ids=["array", "tensor_proto"])
def test_a_feed_for_a_sparse_input_is_refused_naming_the_input(feed):
    sparse = helper.make_sparse_tensor_value_info("x", TensorProto.FLOAT, [2])
    session = _ours(_model([], [sparse], [sparse]))
    with pytest.raises(InvalidArgumentError, match=r"input 'x' is declared as a sparse tensor.*dense tensor"):
        session.run(None, {"x": feed})


def test_a_dense_feed_of_a_protobuf_is_refused_naming_the_input():
    session = _ours(_model([CAST], [helper.make_tensor_value_info("x", TensorProto.INT64, [2])], [Y]))
    with pytest.raises(InvalidArgumentError, match=r"input 'x' must be a numpy array, got TensorProto"):
        session.run(None, {"x": numpy_helper.from_array(np.zeros(2, np.int64), "x")})
    np.testing.assert_array_equal(session.run(None, {"x": np.array([3, -1])})[0], [3.0, -1.0])


def _conv(group=1):
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, None)]
    return _model([helper.make_node("Conv", ["x", "w"], ["y"], group=group)], inputs,
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])


@pytest.mark.parametrize(("x_shape", "w_shape", "group", "axis"), [
    ((1, 4, 5, 5), (0, 1, 1, 1), 4, 0),  # the fuzz case: no output channels, grouped (fuzz50_conv_empty_weight_lanes)
    ((1, 4, 5, 5), (0, 4, 1, 1), 1, 0),
    ((1, 4, 5, 5), (4, 4, 0, 1), 1, 2),  # a kernel without taps (onnxruntime does not return on it)
    ((1, 4, 9), (2, 4, 0), 1, 2),
])
def test_a_convolution_weight_with_an_empty_axis_is_refused_by_name(x_shape, w_shape, group, axis):
    session = _ours(_conv(group))
    x, w = np.ones(x_shape, np.float32), np.ones(w_shape, np.float32)
    with pytest.raises(OnnxRuntimeError, match=rf"weight 'w' has shape .*empty in axis {axis}.*fix the weight") as info:
        session.run(None, {"x": x, "w": w})
    assert isinstance(info.value.__cause__, OnnxRuntimeError)  # raised as such, not a numpy error wrapped


def test_a_convolution_over_zero_input_channels_still_matches_onnxruntime():
    x, w = np.ones((1, 0, 5, 5), np.float32), np.ones((3, 0, 1, 1), np.float32)
    expected = onnxruntime.InferenceSession(_conv(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "w": w})[0]
    got = _ours(_conv()).run(None, {"x": x, "w": w})[0]
    assert got.shape == expected.shape == (1, 3, 5, 5)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def _bias_split_gelu(consumer, declared):
    """x (1, 4, 6) -> com.microsoft BiasSplitGelu (no onnx schema, no stand-in: inference cannot check its output)
    -> ``consumer``, with ``declared`` as g's value_info."""
    bias = numpy_helper.from_array(np.linspace(-1, 1, 6, dtype=np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("BiasSplitGelu", ["x", "b"], ["g"], domain="com.microsoft"), consumer], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[bias],
        value_info=[helper.make_tensor_value_info("g", TensorProto.FLOAT, declared)])
    opsets = [helper.make_operatorsetid("", 17), helper.make_operatorsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _reference_bias_split_gelu(x):
    import math

    h = x.astype(np.float64) + np.linspace(-1, 1, 6)
    left, right = h[..., :3], h[..., 3:]
    return left * 0.5 * right * (1 + np.vectorize(math.erf)(right / math.sqrt(2)))


X3 = np.random.default_rng(3).standard_normal((1, 4, 6)).astype(np.float32)


@pytest.mark.parametrize("declared", [[1, 4, 3, 1], [4, 3], [1, 4, 7]], ids=str)
def test_a_declaration_inference_cannot_check_is_not_trusted(declared):
    # The stale rank 4 made Concat's axis -1 mean axis 3 for a rank-3 value, through numpy's AxisError.
    session = _ours(_bias_split_gelu(helper.make_node("Concat", ["g", "g"], ["y"], axis=-1), declared))
    g = _reference_bias_split_gelu(X3)
    np.testing.assert_allclose(session.run(None, {"x": X3})[0], np.concatenate([g, g], -1), rtol=1e-5, atol=1e-5)


def test_an_axis_valid_only_for_an_unchecked_declared_rank_is_a_typed_error():
    session = _ours(_bias_split_gelu(helper.make_node("Concat", ["g", "g"], ["y"], axis=3), [1, 4, 3, 1]))
    with pytest.raises(OnnxRuntimeError, match=r"axis 3 is out of range for a rank-3 tensor") as info:
        session.run(None, {"x": X3})
    assert isinstance(info.value.__cause__, OnnxRuntimeError)  # not numpy's AxisError (an IndexError) wrapped


def test_declarations_inference_can_check_are_left_to_it():
    from onnx_runtime import declared_shapes

    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]))
    assert declared_shapes.without_unverifiable_shapes(model) is model  # no copy on the common path


@pytest.mark.parametrize("axis", [3, -1])
def test_declarations_are_not_trusted_when_inference_fails(axis):
    # LayerNormalization's Mean output over an input of unknown rank: onnx inference is not run (it would size the
    # output by an unchecked axis), so nothing checks r's declared rank 4 against its actual rank 3.
    scale = numpy_helper.from_array(np.ones(4, np.float32), "s")
    nodes = [helper.make_node("LayerNormalization", ["x", "s"], ["ln", "mean"], axis=-1),
             helper.make_node("Relu", ["ln"], ["r"]), helper.make_node("Concat", ["r", "r"], ["y"], axis=axis)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("mean", TensorProto.FLOAT, None)], initializer=[scale],
                              value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 3, 4, 1])])
    data = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)]).SerializeToString()
    session = _ours(data)
    x = np.random.default_rng(5).standard_normal((2, 3, 4)).astype(np.float32)
    if axis == 3:
        with pytest.raises(OnnxRuntimeError, match=r"axis 3 is out of range for a rank-3 tensor") as info:
            session.run(None, {"x": x})
        assert isinstance(info.value.__cause__, OnnxRuntimeError)
        return
    x64 = x.astype(np.float64)
    r = np.maximum((x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5), 0)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], np.concatenate([r, r], -1), rtol=1e-4, atol=1e-4)
