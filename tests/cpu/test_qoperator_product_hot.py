"""QGemm and QLinearMatMul repeat calls: a call with the last call's A shape and constant parameter arrays runs
the compiled pass with the prepared arguments (weights packed once); anything else (new shapes, fed parameters
changed in place, the other code type) goes through the checks again. Codes equal a float64 reference and
onnxruntime's within one code; the unquantized QGemm output is the exact integer product."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.ops.contrib_qlinear_gemm import qgemm
from onnx_runtime_ep_cpu.ops.qdq_linear import qlinear_matmul

_GEMM = ["A", "a_scale", "a_zero_point", "B", "b_scale", "b_zero_point", "C", "y_scale", "y_zero_point"]
_MATMUL = ["a", "a_scale", "a_zero_point", "b", "b_scale", "b_zero_point", "y_scale", "y_zero_point"]
# (code type, A/B/Y zero points, A/B/Y scales): the extremes, a fine output grid that saturates, an odd set
_SETS = ((np.uint8, (0, 255, 128), (0.02, 0.005, 0.03)),
         (np.int8, (-128, 127, 0), (0.02, 0.05, 0.001)),
         (np.uint8, (7, 250, 3), (0.5, 0.003, 0.25)))


def _constant(value, dtype):
    array = np.array(value, dtype)
    array.flags.writeable = False  # as initializers reach kernels
    return array


def _codes(rng, dtype, shape):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


def _requantized(acc, real_scale, y_scale, y_zero, dtype):
    info = np.iinfo(dtype)
    return np.clip(np.rint(acc * real_scale / y_scale) + y_zero, info.min, info.max)


def _oracle(node, inputs: dict, names: list, feeds: tuple, out_type):
    inits = [numpy_helper.from_array(np.asarray(v), n) for n, v in inputs.items() if n not in feeds]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(
        inputs[n].dtype), list(inputs[n].shape)) for n in feeds], [helper.make_tensor_value_info("Y", out_type, None)],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft",
                                                                                                    1)])
    model.ir_version = 8
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {n: inputs[n] for n in feeds})[0]


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("rows,depth,columns", [(17, 48, 48), (4, 33, 7), (1, 64, 96)])
def test_qgemm_repeat_calls(trans_b, rows, depth, columns):
    node = Node("QGemm", _GEMM, ["Y"], name="qgemm", domain="com.microsoft", opset=1, attrs={"transB": trans_b})
    kernel = qgemm(node, [], 1)
    rng = np.random.default_rng(rows * 100 + depth + trans_b)
    for dtype, zeros, scales in _SETS:
        b = _constant(_codes(rng, dtype, (columns, depth) if trans_b else (depth, columns)), dtype)
        right = (b.T if trans_b else b).astype(np.int64) - zeros[1]
        c = _constant(rng.integers(-5000, 5000, columns), np.int32)
        params = [_constant(scales[0], np.float32), _constant(zeros[0], dtype), b, _constant(scales[1], np.float32),
                  _constant(zeros[1], dtype), c, _constant(scales[2], np.float32), _constant(zeros[2], dtype)]
        for shape in ((rows, depth), (rows + 1, depth), (rows, depth)):
            a = _codes(rng, dtype, shape)
            acc = (a.astype(np.int64) - zeros[0]) @ right + c
            real = float(np.float32(scales[0])) * float(np.float32(scales[1]))
            want = _requantized(acc, real, float(np.float32(scales[2])), zeros[2], dtype)
            inputs = dict(zip(_GEMM, [a, *params]))
            oracle = _oracle(helper.make_node("QGemm", _GEMM, ["Y"], domain="com.microsoft", transB=trans_b), inputs,
                             _GEMM, ("A",), helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
            for _ in range(2):  # the second call takes the prepared path
                (got,) = kernel(a, *params)
                assert got.dtype == dtype and got.shape == (shape[0], columns)
                assert np.abs(got.astype(np.int64) - want).max() <= 1
                assert np.abs(got.astype(np.int64) - oracle.astype(np.int64)).max() <= 1
        # float output with unit scales: the exact integer product (it stays below 2**24)
        ones = [_constant(1.0, np.float32), params[1], b, _constant(1.0, np.float32), params[4], None]
        a = _codes(rng, dtype, (rows, depth))
        exact = (a.astype(np.int64) - zeros[0]) @ right
        for _ in range(2):
            (got,) = kernel(a, *ones)
            assert got.dtype == np.float32 and np.array_equal(got.astype(np.int64), exact)


def test_qgemm_fed_parameters_changed_in_place_are_read():
    node = Node("QGemm", _GEMM, ["Y"], name="qgemm", domain="com.microsoft", opset=1)
    kernel = qgemm(node, [], 1)
    rng = np.random.default_rng(5)
    a, b = _codes(rng, np.uint8, (8, 32)), _constant(_codes(rng, np.int8, (32, 16)), np.int8)
    a_scale, y_scale = np.array(0.02, np.float32), np.array(0.05, np.float32)  # fed: writable
    a_zero, b_scale, b_zero, y_zero = (_constant(128, np.uint8), _constant(0.01, np.float32), _constant(0, np.int8),
                                       _constant(128, np.uint8))
    acc = (a.astype(np.int64) - 128) @ b.astype(np.int64)
    for scale in (0.02, 0.02, 0.04, 0.04):
        a_scale[()] = scale
        (got,) = kernel(a, a_scale, a_zero, b, b_scale, b_zero, None, y_scale, y_zero)
        want = _requantized(acc, float(np.float32(scale)) * float(np.float32(0.01)), float(np.float32(0.05)), 128,
                            np.uint8)
        assert np.abs(got.astype(np.int64) - want).max() <= 1


def test_qgemm_other_code_type_after_repeats_is_typed():
    node = Node("QGemm", _GEMM, ["Y"], name="qgemm", domain="com.microsoft", opset=1)
    kernel = qgemm(node, [], 1)
    b = _constant(np.ones((16, 8), np.int8), np.int8)
    params = [_constant(0.1, np.float32), _constant(3, np.uint8), b, _constant(0.1, np.float32), _constant(0, np.int8),
              None, _constant(0.1, np.float32), _constant(0, np.uint8)]
    a = np.full((4, 16), 9, np.uint8)
    for _ in range(2):
        kernel(a, *params)
    with pytest.raises(InvalidArgumentError, match="a_zero_point"):
        kernel(a.view(np.int8), *params)
    with pytest.raises(InvalidArgumentError, match="inner dimensions"):
        kernel(np.zeros((4, 15), np.uint8), *params)


@pytest.mark.parametrize("a_shape,columns", [((17, 48), 48), ((2, 5, 33), 7), ((1, 64), 96)])
def test_qlinear_matmul_repeat_calls(a_shape, columns):
    node = Node("QLinearMatMul", _MATMUL, ["Y"], name="qmm", opset=10)
    kernel = qlinear_matmul(node, [], 10)
    rng = np.random.default_rng(sum(a_shape) + columns)
    depth = a_shape[-1]
    for dtype, zeros, scales in _SETS:
        b = _constant(_codes(rng, dtype, (depth, columns)), dtype)
        per_column = _constant(np.linspace(0.5, 2.0, columns) * scales[1], np.float32)
        for b_scale in (_constant(scales[1], np.float32), per_column):
            params = [_constant(scales[0], np.float32), _constant(zeros[0], dtype), b, b_scale,
                      _constant(zeros[1], dtype), _constant(scales[2], np.float32), _constant(zeros[2], dtype)]
            for shape in (a_shape, (3,) + a_shape[1:], a_shape):
                a = _codes(rng, dtype, shape)
                acc = (a.astype(np.int64) - zeros[0]) @ (b.astype(np.int64) - zeros[1])
                real = float(np.float32(scales[0])) * b_scale.astype(np.float64)
                want = _requantized(acc, real, float(np.float32(scales[2])), zeros[2], dtype)
                inputs = dict(zip(_MATMUL, [a, *params]))
                oracle = _oracle(helper.make_node("QLinearMatMul", _MATMUL, ["Y"]), inputs, _MATMUL, ("a",),
                                 helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
                for _ in range(2):
                    (got,) = kernel(a, *params)
                    assert got.dtype == dtype and got.shape == shape[:-1] + (columns,)
                    assert np.abs(got.astype(np.int64) - want).max() <= 1
                    assert np.abs(got.astype(np.int64) - oracle.astype(np.int64)).max() <= 1


def test_qlinear_matmul_fed_parameters_and_bad_input():
    node = Node("QLinearMatMul", _MATMUL, ["Y"], name="qmm", opset=10)
    kernel = qlinear_matmul(node, [], 10)
    rng = np.random.default_rng(9)
    a, b = _codes(rng, np.uint8, (6, 24)), _constant(_codes(rng, np.uint8, (24, 10)), np.uint8)
    y_scale = np.array(0.5, np.float32)  # fed: writable
    consts = [_constant(0.03, np.float32), _constant(120, np.uint8), b, _constant(0.02, np.float32),
              _constant(130, np.uint8)]
    acc = (a.astype(np.int64) - 120) @ (b.astype(np.int64) - 130)
    for scale in (0.5, 0.5, 0.125, 0.125):
        y_scale[()] = scale
        (got,) = kernel(a, *consts, y_scale, _constant(10, np.uint8))
        want = _requantized(acc, float(np.float32(0.03)) * float(np.float32(0.02)), scale, 10, np.uint8)
        assert np.abs(got.astype(np.int64) - want).max() <= 1
    # int8 codes after the repeats leave the prepared path, and their uint8 zero point is refused by name
    with pytest.raises(InvalidArgumentError, match="a_zero_point is uint8 but a is int8"):
        kernel(a.view(np.int8), *consts, y_scale, _constant(10, np.uint8))
    with pytest.raises(InvalidArgumentError, match="inner dimensions"):
        kernel(np.zeros((6, 23), np.uint8), *consts, y_scale, _constant(10, np.uint8))


def test_qlinear_matmul_stacked_fed_b_is_read_each_call():
    """Attention's products: B is an activation, a new array on every call, stacked per head."""
    node = Node("QLinearMatMul", _MATMUL, ["Y"], name="qmm", opset=10)
    kernel = qlinear_matmul(node, [], 10)
    rng = np.random.default_rng(21)
    consts = [_constant(0.04, np.float32), _constant(0, np.int8), None, _constant(0.03, np.float32),
              _constant(-128, np.int8), _constant(0.02, np.float32), _constant(127, np.int8)]
    for shape in ((2, 3, 5, 16), (2, 3, 5, 16), (1, 3, 7, 16)):
        a, b = _codes(rng, np.int8, shape), _codes(rng, np.int8, (shape[0], 3, 16, 6))
        params = list(consts)
        params[2] = b
        acc = (a.astype(np.int64)) @ (b.astype(np.int64) + 128)
        want = _requantized(acc, float(np.float32(0.04)) * float(np.float32(0.03)), float(np.float32(0.02)), 127,
                            np.int8)
        (got,) = kernel(a, *params)
        assert got.shape == shape[:-1] + (6,) and np.abs(got.astype(np.int64) - want).max() <= 1
        inputs = dict(zip(_MATMUL, [a, *params]))
        oracle = _oracle(helper.make_node("QLinearMatMul", _MATMUL, ["Y"]), inputs, _MATMUL, ("a", "b"),
                         helper.np_dtype_to_tensor_dtype(np.dtype(np.int8)))
        assert np.abs(got.astype(np.int64) - oracle.astype(np.int64)).max() <= 1


_ADD = _MATMUL + ["bias", "bias_scale", "bias_zero", "x_scale", "x_zero", "c_scale", "c_zero"]


def test_qlinear_matmul_add_repeat_calls_equal_the_two_kernels():
    """The fused product + bias row repeated (the kept arguments) gives the two nodes' codes each call, and a fed
    bias changed in place between calls is read."""
    from onnx_runtime_ep_cpu.ops.contrib_qlinear_binary import qlinear_add
    from onnx_runtime_ep_cpu.ops.qdq_linear import qlinear_matmul_add

    fused = qlinear_matmul_add(Node("QLinearMatMulAdd", _ADD, ["Y"], name="mma", domain="ai.onnx_runtime.cpu",
                                    opset=1), [], 1)
    matmul = qlinear_matmul(Node("QLinearMatMul", _MATMUL, ["P"], name="mm", opset=10), [], 10)
    add = qlinear_add(Node("QLinearAdd", ["P", "x_scale", "x_zero", "bias", "bias_scale", "bias_zero", "c_scale",
                                          "c_zero"], ["Y"], name="add", domain="com.microsoft", opset=1), [], 1)
    rng = np.random.default_rng(3)
    for dtype, zeros, scales in _SETS:
        b = _constant(_codes(rng, dtype, (33, 10)), dtype)
        mm = [_constant(scales[0], np.float32), _constant(zeros[0], dtype), b, _constant(scales[1], np.float32),
              _constant(zeros[1], dtype), _constant(scales[2], np.float32), _constant(zeros[2], dtype)]
        # the bias's scale and zero point, then the output's
        rest = [_constant(0.013, np.float32), _constant(zeros[0], dtype), _constant(0.29, np.float32),
                _constant(zeros[2], dtype)]
        fed_bias = _codes(rng, dtype, (10,))
        for bias in (_constant(_codes(rng, dtype, (10,)), dtype), fed_bias):
            for shape in ((2, 5, 33), (2, 5, 33), (7, 33), (2, 5, 33)):
                if bias is fed_bias:
                    bias[:] = _codes(rng, dtype, (10,))  # changed in place between calls
                a = _codes(rng, dtype, shape)
                (product,) = matmul(a, *mm)
                (want,) = add(product, mm[5], mm[6], bias, *rest)
                (got,) = fused(a, *mm, bias, *rest[:2], mm[5], mm[6], *rest[2:])
                assert got.dtype == dtype and got.shape == shape[:-1] + (10,)
                np.testing.assert_array_equal(got, want)
