"""QLinearConcat's kept plan (ops/contrib_qlinear_concat.py): a call whose parameters are the last checked
call's read-only arrays and whose tensors have its shapes and dtypes repeats that call's plan (a constant part's
codes, a table or nothing per part) without the checks. Over repeated calls with new values each time: equal
to the first-call path of a fresh kernel bit for bit and within one code of onnxruntime, for a ViT's layout (the
class token fed, as dynamo's export computes it with Expand; or an initializer) and for parts on the output's
grid; shape changes, fed parameters and a part of the wrong dtype after a kept call take the checked path."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.ops.contrib_qlinear_concat import qlinear_concat

PARAMS = {"ys": 0.021, "yz": 3, "cs": 0.013, "cz": -7, "ps": 0.021, "pz": 3}  # patches on Y's grid


def _ro(value, dtype=None):
    a = np.array(value, dtype)
    a.flags.writeable = False
    return a


def _model(dtype, token: str) -> bytes:
    """Y = QLinearConcat(class token (1, 1, 8), patches (1, T, 8)) on axis 1; the token fed or an initializer."""
    code = TensorProto.INT8 if dtype == np.int8 else TensorProto.UINT8
    shift = 0 if dtype == np.int8 else 128
    inits = [numpy_helper.from_array(np.float32(PARAMS[n]), n) for n in ("ys", "cs", "ps")]
    inits += [numpy_helper.from_array(np.array(PARAMS[n] + shift, dtype), n) for n in ("yz", "cz", "pz")]
    inputs = [helper.make_tensor_value_info("p", code, [1, None, 8])]
    if token == "initializer":
        inits.append(numpy_helper.from_array(np.arange(-4, 4).astype(dtype).reshape(1, 1, 8) + shift, "c"))
    else:
        inputs.append(helper.make_tensor_value_info("c", code, [1, 1, 8]))
    node = helper.make_node("QLinearConcat", ["ys", "yz", "c", "cs", "cz", "p", "ps", "pz"], ["y"], axis=1,
                            domain="com.microsoft")
    graph = helper.make_graph([node], "concat", inputs, [helper.make_tensor_value_info("y", code, None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    return m.SerializeToString()


def _codes(rng, dtype, shape):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.parametrize("token", ["fed", "initializer"])
def test_repeated_runs_match_onnxruntime(dtype, token):
    model = _model(dtype, token)
    sess = ort.InferenceSession(model, providers=["cpu"])
    oracle = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(11)
    for tokens in (16, 16, 16, 5, 5, 16):  # kept, repeated, a new length (checked again), kept again
        feeds = {"p": _codes(rng, dtype, (1, tokens, 8))}
        if token == "fed":
            feeds["c"] = _codes(rng, dtype, (1, 1, 8))
        got = sess.run(None, feeds)[0]
        want = oracle.run(None, feeds)[0]
        assert got.dtype == dtype and got.shape == (1, tokens + 1, 8)
        assert np.abs(got.astype(np.int64) - want.astype(np.int64)).max() <= 1
        np.testing.assert_array_equal(got[:, 1:], feeds["p"])  # the patches' grid is Y's: codes pass through


def _kernel():
    node = Node("QLinearConcat", ["ys", "yz", "c", "cs", "cz", "p", "ps", "pz"], ["y"], name="cat",
                attrs={"axis": 1}, domain="com.microsoft", opset=1)
    return qlinear_concat(node, None, 1)


def _params(dtype):
    shift = 0 if dtype == np.int8 else 128
    return {n: _ro(PARAMS[n], np.float32) if n.endswith("s") else _ro(PARAMS[n] + shift, dtype) for n in PARAMS}


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_kept_plan_equals_a_fresh_kernels_first_call(dtype):
    params = _params(dtype)
    token = _ro(_codes(np.random.default_rng(1), dtype, (1, 1, 8)))  # an initializer's class token
    kernel = _kernel()
    rng = np.random.default_rng(2)
    for _ in range(4):
        c, p = _codes(rng, dtype, (1, 1, 8)), _codes(rng, dtype, (1, 9, 8))
        for first in (c, token):
            args = (params["ys"], params["yz"], first, params["cs"], params["cz"], p, params["ps"], params["pz"])
            got = kernel(*args)[0]
            np.testing.assert_array_equal(got, _kernel()(*args)[0])
    p = _codes(rng, dtype, (1, 8, 9)).transpose(0, 2, 1)  # a transposed view (a ViT's patch tokens)
    for first in (token, _codes(rng, dtype, (1, 1, 8))):
        args = (params["ys"], params["yz"], first, params["cs"], params["cz"], p, params["ps"], params["pz"])
        kernel(*args)
        assert kernel.kept is not None  # kept for the calls that repeat it
        np.testing.assert_array_equal(kernel(*args)[0], _kernel()(*args)[0])


def test_fewer_inputs_than_the_kept_call_are_refused():
    """A call of other arity (a zero point left off) never repeats the kept plan."""
    dtype = np.int8
    params = _params(dtype)
    kernel = _kernel()
    rng = np.random.default_rng(6)
    c, p = _codes(rng, dtype, (1, 1, 8)), _codes(rng, dtype, (1, 4, 8))
    kernel(params["ys"], params["yz"], c, params["cs"], params["cz"], p, params["ps"], params["pz"])
    with pytest.raises(OnnxRuntimeError, match="triples"):
        kernel(params["ys"], params["yz"], c, params["cs"], params["cz"], p, params["ps"])


def test_fed_parameters_are_never_kept():
    """A scale fed per call (writeable) may change: every call takes the checked path with its own value."""
    dtype = np.int8
    params = _params(dtype)
    kernel = _kernel()
    rng = np.random.default_rng(3)
    c, p = _codes(rng, dtype, (1, 1, 8)), _codes(rng, dtype, (1, 4, 8))
    outputs = []
    for scale in (0.013, 0.05, 0.013):
        fed_scale = np.array(scale, np.float32)
        args = (params["ys"], params["yz"], c, fed_scale, params["cz"], p, params["ps"], params["pz"])
        outputs.append(kernel(*args)[0])
        assert kernel.kept is None
    assert not np.array_equal(outputs[0][:, :1], outputs[1][:, :1])
    np.testing.assert_array_equal(outputs[0], outputs[2])


def test_wrong_dtype_after_a_kept_call_is_a_typed_error():
    dtype = np.int8
    params = _params(dtype)
    kernel = _kernel()
    rng = np.random.default_rng(5)
    p = _codes(rng, dtype, (1, 4, 8))
    kernel(params["ys"], params["yz"], _codes(rng, dtype, (1, 1, 8)), params["cs"], params["cz"], p, params["ps"],
           params["pz"])
    with pytest.raises(OnnxRuntimeError, match="tensor 0 is uint8; expected int8"):
        kernel(params["ys"], params["yz"], _codes(rng, np.uint8, (1, 1, 8)), params["cs"], params["cz"], p,
               params["ps"], params["pz"])
    with pytest.raises(OnnxRuntimeError, match=r"tensor 1 has shape \(1, 4, 7\)"):
        kernel(params["ys"], params["yz"], _codes(rng, dtype, (1, 1, 8)), params["cs"], params["cz"],
               _codes(rng, dtype, (1, 4, 7)), params["ps"], params["pz"])
