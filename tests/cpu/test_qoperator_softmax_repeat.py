"""QLinearSoftmax over the last axis (a QOperator attention's probabilities) keeps its last call: a call with the
same X shape and type and the same constant parameters runs the compiled rows from the kept arguments, reading the
new codes; any other call goes through the checks. Checked against a float64 evaluation of the quantized math
(within one code), the checked call bit for bit, and onnxruntime over repeated runs of a model."""
from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.ops.contrib_qlinear_activation import qlinear_softmax

F32 = np.float32


def _constant(value, dtype):
    array = np.array(value, dtype)
    array.flags.writeable = False  # as initializers are
    return array


def _params(dtype, x_scale=0.05):
    y_zero = -128 if dtype == np.int8 else 0
    return (_constant(x_scale, F32), _constant(3, dtype), _constant(1 / 256, F32), _constant(y_zero, dtype))


def _kernel(axis=-1):
    node = Node("QLinearSoftmax", ["x", "xs", "xz", "ys", "yz"], ["y"], name="probs", domain="com.microsoft",
                attrs={"opset": 13, "axis": axis}, opset=1)
    return qlinear_softmax(node, [None] * 5, 1)


def _want(x, params, axis=-1):
    x_scale, _, y_scale, y_zero = params
    wide = x.astype(np.int64)
    e = np.exp((wide - wide.max(axis=axis, keepdims=True)) * np.float64(x_scale))
    p = (e / e.sum(axis=axis, keepdims=True)).astype(F32)
    info = np.iinfo(x.dtype)
    return np.clip(np.rint(p / y_scale).astype(np.float64) + int(y_zero), info.min, info.max)


def _codes(rng, shape, dtype):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_repeated_calls_read_new_codes_and_stay_within_a_code(dtype):
    kernel, rng, params = _kernel(), np.random.default_rng(5), _params(dtype)
    for shape in [(1, 3, 18, 18)] * 3 + [(1, 3, 7, 7), (2, 5, 33), (1, 3, 18, 18)]:
        x = _codes(rng, shape, dtype)
        first = kernel(x, *params)[0]
        again = kernel(x, *params)[0]  # the kept call
        np.testing.assert_array_equal(again, first)
        assert np.abs(again.astype(np.float64) - _want(x, params)).max() <= 1
        assert np.mean(again == _want(x, params)) >= 0.9


def test_other_parameters_or_axes_after_a_kept_call_are_checked():
    rng = np.random.default_rng(6)
    kernel, params = _kernel(), _params(np.uint8)
    x = _codes(rng, (4, 9), np.uint8)
    kernel(x, *params)
    other = _params(np.uint8, x_scale=0.2)
    assert np.abs(kernel(x, *other)[0].astype(np.float64) - _want(x, other)).max() <= 1
    fed = (np.array(params[0]), *params[1:])  # a writable scale may change in place: never kept
    kernel(x, *fed)
    fed[0][...] = 0.5
    assert np.abs(kernel(x, *fed)[0].astype(np.float64) - _want(x, fed)).max() <= 1
    with pytest.raises(OnnxRuntimeError, match="uint8 or int8|8-bit"):
        kernel(x.astype(np.int16), *params)
    first_axis = _kernel(axis=0)
    for _ in range(2):
        assert np.abs(first_axis(x, *params)[0].astype(np.float64) - _want(x, params, axis=0)).max() <= 1


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_attention_probabilities_agree_with_onnxruntime_over_repeated_runs(dtype):
    elem = TensorProto.UINT8 if dtype == np.uint8 else TensorProto.INT8
    inits = [numpy_helper.from_array(v, n) for n, v in zip(["xs", "xz", "ys", "yz"], map(np.array, _params(dtype)))]
    node = helper.make_node("QLinearSoftmax", ["x", "xs", "xz", "ys", "yz"], ["y"], domain="com.microsoft", opset=13,
                            axis=-1)
    model = make_model([node], [tensor_info("x", elem, [1, 3, "q", "k"])], [tensor_info("y", elem, [1, 3, "q", "k"])],
                       inits, opset=13)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    ours = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    oracle = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    for shape in [(1, 3, 18, 18)] * 3 + [(1, 3, 5, 11), (1, 3, 18, 18)]:
        x = _codes(rng, shape, dtype)
        y, want = ours.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0]
        assert np.abs(y.astype(np.int64) - want).max() <= 1 and np.mean(y == want) >= 0.9
