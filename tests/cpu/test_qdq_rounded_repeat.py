"""QuantizedMatMul with a rounded add (an encoder's Linear layers in QDQ form, qdq_fusions.absorb_rounded_add): a
call with the last call's A shape and type and the same constant arrays (weight, parameters, bias row, rounding)
runs the compiled loop from the kept arguments, reading the new A; any other call goes through the checks. Each
result is checked against a float64 evaluation of the quantized math (within one output code), bit for bit
against the kernel's checked path, and, on a whole model run several times, against onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops.qdq_linear import quantized_matmul

F32 = np.float32
X, Y, S = 0.03, 0.05, 0.07  # the scales of the input, the product and the rounded sum


def _constant(value, dtype):
    array = np.array(value, dtype)
    array.flags.writeable = False  # as initializers are
    return array


def _constants(rng, depth: int, columns: int, act=np.uint8, row_width=None):
    z = 0 if act == np.int8 else 128
    w = _constant(rng.integers(-127, 128, (depth, columns)), np.int8)
    row = _constant(rng.standard_normal(row_width or columns) * 0.5, F32)
    return (_constant(X, F32), _constant(z + 1, act), w, _constant(0.004, F32), _constant(0, np.int8),
            _constant(Y, F32), _constant(z - 3, act), None, row, _constant(S, F32), _constant(z + 5, act))


def _kernel():
    node = Node("QuantizedMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz", "", "row", "rs", "rz"], ["y"],
                name="linear", domain=FUSED_DOMAIN, attrs={"quantize_a": 1, "dequantize": 1}, opset=1)
    return quantized_matmul(node, [None] * 12, 1)


def _call(kernel, a, c):
    return kernel(a, *c)[0]


def _want(a, c):
    """float64 of the quantized math: A's codes, the exact product, rounded to the product's grid, the row added,
    rounded to the sum's grid."""
    a_scale, a_zero, w, w_scale, w_zero, y_scale, y_zero, _, row, s_scale, s_zero = c
    low, high = (0, 255) if a_zero.dtype == np.uint8 else (-128, 127)

    def grid(v, scale, zero):
        return (np.clip(np.rint(v / np.float64(scale)) + int(zero), low, high) - int(zero)) * np.float64(scale)

    codes = np.clip(np.rint(a / a_scale) + int(a_zero), low, high) - int(a_zero)  # float32 division
    real = codes.astype(np.float64) @ (w.astype(np.float64) - int(w_zero)) * (np.float64(a_scale) *
                                                                              np.float64(w_scale))
    return grid(grid(real, y_scale, y_zero) + row.astype(np.float64), s_scale, s_zero)


@pytest.mark.parametrize("act", [np.uint8, np.int8])
@pytest.mark.parametrize("depth,columns,row_width", [(64, 64, None), (17, 33, None), (9, 7, 1), (128, 64, None)])
def test_repeated_rounded_calls_read_new_a_and_stay_exact(act, depth, columns, row_width):
    kernel, rng = _kernel(), np.random.default_rng(depth * columns)
    c = _constants(rng, depth, columns, act, row_width)
    for shape in [(1, 17, depth)] * 3 + [(5, depth), (1, 17, depth), (2, 3, depth)]:
        a = (rng.standard_normal(shape) * 2).astype(F32)
        a.reshape(-1)[:2] = [1e4, -1e4]  # saturation
        first = _call(kernel, a, c)
        assert kernel.repeat_rounded.match(a, (c[2], *c[:2], *c[3:])) is not None
        again = _call(kernel, a, c)  # the kept call
        np.testing.assert_array_equal(again, first)
        assert np.abs(again - _want(a, c)).max() <= np.float32(S) * 1.001
        assert np.mean(again == _want(a, c).astype(F32)) >= 0.9


def test_other_constants_after_a_kept_call_are_checked():
    kernel, rng = _kernel(), np.random.default_rng(3)
    c = _constants(rng, 16, 8)
    a = rng.standard_normal((4, 16)).astype(F32)
    _call(kernel, a, c)
    _call(kernel, a, c)
    other_row = (*c[:8], _constant(np.arange(8) * 0.25, F32), *c[9:])  # another row array: not the kept call
    assert np.abs(_call(kernel, a, other_row) - _want(a, other_row)).max() <= np.float32(S) * 1.001
    fed = (*c[:8], np.array(c[8]), *c[9:])  # a writable row may change in place: never kept
    _call(kernel, a, fed)
    fed[8][:] = 3.0
    assert np.abs(_call(kernel, a, fed) - _want(a, fed)).max() <= np.float32(S) * 1.001
    with pytest.raises(OnnxRuntimeError, match="float32"):
        _call(kernel, a.astype(np.float64), c)
    with pytest.raises(OnnxRuntimeError, match="inner"):
        _call(kernel, rng.standard_normal((4, 15)).astype(F32), c)


def _linear_model(rng, depth: int, columns: int):
    """x -> Q/DQ -> MatMul(DQ(W)) -> Q/DQ -> Add(bias) -> Q/DQ, twice in a row (two Linear layers), as
    onnxruntime's quantization tools write them."""
    inits, nodes, name = [numpy_helper.from_array(v, n) for n, v in (
        ("xs", np.array(X, F32)), ("ms", np.array(Y, F32)), ("ys", np.array(S, F32)), ("z", np.array(128, np.uint8)),
        ("wz", np.array(0, np.int8)), ("wsc", np.array(0.004, F32)))], [], "x"
    nodes += [helper.make_node("QuantizeLinear", ["x", "xs", "z"], ["xq"]),
              helper.make_node("DequantizeLinear", ["xq", "xs", "z"], ["x0"])]
    for i, (k, n) in enumerate([(depth, columns), (columns, depth)]):
        inits += [numpy_helper.from_array(rng.integers(-127, 128, (k, n)).astype(np.int8), f"w{i}"),
                  numpy_helper.from_array((rng.standard_normal(n) * 0.5).astype(F32), f"b{i}")]
        nodes += [helper.make_node("DequantizeLinear", [f"w{i}", "wsc", "wz"], [f"wd{i}"]),
                  helper.make_node("MatMul", [f"x{i}", f"wd{i}"], [f"m{i}"]),
                  helper.make_node("QuantizeLinear", [f"m{i}", "ms", "z"], [f"mq{i}"]),
                  helper.make_node("DequantizeLinear", [f"mq{i}", "ms", "z"], [f"md{i}"]),
                  helper.make_node("Add", [f"md{i}", f"b{i}"], [f"s{i}"]),
                  helper.make_node("QuantizeLinear", [f"s{i}", "ys" if i else "xs", "z"], [f"sq{i}"]),
                  helper.make_node("DequantizeLinear", [f"sq{i}", "ys" if i else "xs", "z"], [f"x{i + 1}"])]
    name = "x2"
    return make_model(nodes, [tensor_info("x", shape=[1, "tokens", depth])],
                      [tensor_info(name, shape=[1, "tokens", depth])], inits, opset=19)


@pytest.mark.parametrize("depth,columns", [(64, 128), (19, 37)])
def test_encoder_linears_agree_with_onnxruntime_over_repeated_runs(depth, columns):
    rng = np.random.default_rng(depth)
    model = _linear_model(rng, depth, columns)
    ours = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert [n.op_type for n in ours.placement()].count("QuantizedMatMul") == 2
    oracle = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for tokens in (17, 17, 17, 50, 17):  # repeats of one shape, then another, then back
        x = (rng.standard_normal((1, tokens, depth)) * 2).astype(F32)
        y, want = ours.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0]
        assert np.abs(y - want).max() <= np.float32(S) * 1.001 and np.mean(y == want) >= 0.9
