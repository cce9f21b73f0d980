"""QLinearAdd / QLinearMul repeat calls: a call with the last call's shapes and constant parameter arrays skips the
checks and reuses the prepared loop arguments; anything else (new shapes, other parameter arrays or values, the
other code type) goes through the checks again. Every call's codes equal a float64 reference within one code
(exactly where no value lies near a half-integer) and onnxruntime's within one code."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.ops.contrib_qlinear_binary import qlinear_add, qlinear_mul

_NAMES = ["A", "A_scale", "A_zero_point", "B", "B_scale", "B_zero_point", "C_scale", "C_zero_point"]


def _params(dtype, scales, zeros, constant=True):
    out = []
    for s, z in zip(scales, zeros):
        pair = [np.array(s, np.float32), np.array(z, dtype)]
        for array in pair:
            array.flags.writeable = not constant
        out.append(pair)
    return out


def _reference(op, a, b, dtype, scales, zeros):
    sa, sb, sc = (float(np.float32(s)) for s in scales)
    x, y = a.astype(np.float64) - zeros[0], b.astype(np.float64) - zeros[1]
    real = sa * x + sb * y if op == "QLinearAdd" else sa * x * sb * y
    info = np.iinfo(dtype)
    return np.clip(np.rint(real / sc) + zeros[2], info.min, info.max)


def _oracle(op, a, b, dtype, scales, zeros):
    code = TensorProto.INT8 if dtype == np.int8 else TensorProto.UINT8
    inits = [helper.make_tensor(n, TensorProto.FLOAT if "scale" in n else code, [], [v])
             for n, v in zip(["A_scale", "A_zero_point", "B_scale", "B_zero_point", "C_scale", "C_zero_point"],
                             [scales[0], zeros[0], scales[1], zeros[1], scales[2], zeros[2]])]
    graph = helper.make_graph([helper.make_node(op, _NAMES, ["C"], domain="com.microsoft")], "g",
                              [helper.make_tensor_value_info("A", code, list(a.shape)),
                               helper.make_tensor_value_info("B", code, list(b.shape))],
                              [helper.make_tensor_value_info("C", code, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": a, "B": b})[0]


@pytest.mark.parametrize("op,factory", [("QLinearAdd", qlinear_add), ("QLinearMul", qlinear_mul)])
def test_repeat_calls_follow_their_inputs(op, factory):
    node = Node(op, _NAMES, ["C"], name="binary", domain="com.microsoft", opset=1)
    kernel = factory(node, [(2, 16, 64), (2, 16, 64)], 1)
    rng = np.random.default_rng(11)
    calls = []
    for dtype, zeros, scales in ((np.uint8, (0, 255, 128), (0.02, 0.05, 0.03)),  # zero points at the extremes
                                 (np.int8, (-128, 127, 0), (0.02, 0.05, 0.01)),  # a fine output grid saturates
                                 (np.uint8, (7, 250, 3), (0.5, 0.003, 0.25))):
        info = np.iinfo(dtype)
        params = _params(dtype, scales, zeros)
        for a_shape, b_shape in (((2, 16, 64), (2, 16, 64)), ((2, 16, 64), (64,)), ((1, 1, 64), (2, 16, 64))):
            a = rng.integers(info.min, info.max + 1, a_shape).astype(dtype)
            b = rng.integers(info.min, info.max + 1, b_shape).astype(dtype)
            calls.append((a, b, dtype, params, scales, zeros))
        # the same arrays' values changed (parameters fed at run time: writable) are read again
        moved = _params(dtype, scales, zeros, constant=False)
        calls.append((calls[-1][0], calls[-1][1], dtype, moved, scales, zeros))
        doubled = (scales[0] * 2, scales[1], scales[2])

        def double(array=moved[0][0], value=doubled[0]):
            array[()] = value

        calls.append((calls[-1][0], calls[-1][1], dtype, moved, doubled, zeros, double))
    for call in calls:
        a, b, dtype, params, scales, zeros = call[:6]
        if len(call) > 6:
            call[6]()
        for _ in range(2):  # the second call takes the prepared path where it applies
            got = kernel(a, *params[0], b, *params[1], *params[2])[0]
            assert got.dtype == dtype and got.shape == np.broadcast_shapes(a.shape, b.shape)
            assert np.abs(got.astype(np.int64) - _reference(op, a, b, dtype, scales, zeros)).max() <= 1
            want = _oracle(op, a, b, dtype, scales, zeros)
            assert np.abs(got.astype(np.int64) - want.astype(np.int64)).max() <= 1


def test_repeat_call_with_other_code_type_is_checked():
    node = Node("QLinearAdd", _NAMES, ["C"], name="binary", domain="com.microsoft", opset=1)
    kernel = qlinear_add(node, [(4, 64), (4, 64)], 1)
    params = _params(np.uint8, (0.02, 0.02, 0.02), (128, 128, 128))
    a = np.zeros((4, 64), np.uint8)
    kernel(a, *params[0], a, *params[1], *params[2])
    kernel(a, *params[0], a, *params[1], *params[2])
    with pytest.raises(InvalidArgumentError, match="int8"):
        kernel(a.view(np.int8), *params[0], a.view(np.int8), *params[1], *params[2])
