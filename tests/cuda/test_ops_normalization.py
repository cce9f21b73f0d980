"""CUDA Softmax/LogSoftmax, LayerNormalization and RMSNormalization (kernels/softmax.cu,
ops/normalization.py) against the CPU provider, on the simulator by default (``ONNX_RUNTIME_CUDA_TESTS=real``
runs them on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
from test_ops_elementwise import (  # noqa: E402, F401  (device_mode is an autouse fixture)
    BF16,
    ONNX_TYPE,
    backend_cases_for,
    compare_with_cpu,
    cuda_reason,
    device_mode,
    on_cuda,
    random,
    run_backend_case,
    single_node_model,
)

NORM_OPS = {"Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization"}
HALF_TOLERANCE = {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("name", backend_cases_for(NORM_OPS))
def test_backend_case(name):
    run_backend_case(name)


# -- Softmax --------------------------------------------------------------------------------------------------


def softmax_model(op, dtype, axis, opset=13):
    t = ONNX_TYPE[np.dtype(dtype)]
    return single_node_model(op, [("x", t, None)], [("y", t, None)], {"axis": axis}, opset=opset)


# Rows up to 8,192 are held in registers, longer ones streamed; an inner axis uses column tiles.
@pytest.mark.parametrize("shape,axis", [((3, 1000), -1), ((2, 3, 45), 1), ((5, 7, 3), 0), ((4, 6, 40, 3), 2),
                                        ((1, 1), 0), ((17,), 0), ((2, 33, 65), -1), ((2, 9000), -1)])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_axes(op, shape, axis):
    x = random(shape, np.float32, np.random.default_rng(0), low=-5, high=5)
    compare_with_cpu(softmax_model(op, np.float32, axis), {"x": x}, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_before_opset_13_coerces_to_2d(op, axis):
    x = random((3, 4, 5), np.float32, np.random.default_rng(1))
    compare_with_cpu(softmax_model(op, np.float32, axis, opset=11), {"x": x}, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_half_precision(op, dtype):
    x = random((6, 300), dtype, np.random.default_rng(2))
    compare_with_cpu(softmax_model(op, dtype, -1), {"x": x}, **HALF_TOLERANCE)
    compare_with_cpu(softmax_model(op, dtype, 0), {"x": x}, **HALF_TOLERANCE)


def test_softmax_large_values_and_empty():
    x = np.array([[1000.0, 1001.0, 1002.0], [-1e30, 0.0, 1e30]], np.float32)
    compare_with_cpu(softmax_model("Softmax", np.float32, -1), {"x": x})
    compare_with_cpu(softmax_model("LogSoftmax", np.float32, -1), {"x": x}, atol=1e-4)
    got, = on_cuda(softmax_model("Softmax", np.float32, -1)).run(None, {"x": np.zeros((0, 4), np.float32)})
    assert got.shape == (0, 4)


# -- LayerNormalization / RMSNormalization --------------------------------------------------------------------


def norm_model(op, dtype, axis, epsilon=1e-5, bias=True, stats=(True, True), opset=None, stash_type=None):
    t = ONNX_TYPE[np.dtype(dtype)]
    inputs = [("x", t, None), ("scale", t, None)]
    outputs = [("y", t, None)]
    if op == "LayerNormalization":
        if bias:
            inputs.append(("bias", t, None))
        names = [("mean", TensorProto.FLOAT, None) if stats[0] else ("", TensorProto.FLOAT, None),
                 ("inv_std", TensorProto.FLOAT, None) if stats[1] else None]
        outputs += [o for o in names if o is not None] if any(stats) else []
    attrs = {"axis": axis, "epsilon": epsilon}
    if stash_type is not None:
        attrs["stash_type"] = stash_type
    node = helper.make_node(op, [i[0] for i in inputs], [o[0] for o in outputs], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs if o[0]])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset or (17 if "Layer" in op else 23))])
    model.ir_version = 10
    return model.SerializeToString()


@pytest.mark.parametrize("shape,axis", [((4, 1000), -1), ((2, 3, 40), 1), ((3, 5, 7), 0), ((6, 1), -1),
                                        ((2, 4, 3, 5), 2), ((2, 3, 3000), 1)])
@pytest.mark.parametrize("op", ["LayerNormalization", "RMSNormalization"])
def test_normalization(op, shape, axis):
    rng = np.random.default_rng(3)
    x = random(shape, np.float32, rng, low=-2, high=5)
    normalized = shape[axis % len(shape):]
    feeds = {"x": x, "scale": random(normalized, np.float32, rng)}
    if op == "LayerNormalization":
        feeds["bias"] = random(normalized, np.float32, rng)
    compare_with_cpu(norm_model(op, np.float32, axis, epsilon=1e-3), feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("op", ["LayerNormalization", "RMSNormalization"])
def test_normalization_half_precision(op, dtype):
    rng = np.random.default_rng(4)
    feeds = {"x": random((8, 256), dtype, rng), "scale": random((256,), dtype, rng)}
    if op == "LayerNormalization":
        feeds["bias"] = random((256,), dtype, rng)
    compare_with_cpu(norm_model(op, dtype, -1), feeds, **HALF_TOLERANCE)


def test_layer_norm_optional_inputs_and_outputs():
    rng = np.random.default_rng(5)
    x, scale = random((3, 4, 6), np.float32, rng), random((4, 6), np.float32, rng)
    compare_with_cpu(norm_model("LayerNormalization", np.float32, 1, bias=False, stats=(False, False)),
                     {"x": x, "scale": scale}, rtol=1e-4, atol=1e-5)
    compare_with_cpu(norm_model("LayerNormalization", np.float32, 1, bias=False, stats=(False, True)),
                     {"x": x, "scale": scale}, rtol=1e-4, atol=1e-5)
    # A single-value scale broadcasts over the normalized elements.
    compare_with_cpu(norm_model("LayerNormalization", np.float32, 1), {"x": x, "scale": np.full((1,), 2, np.float32),
                                                                        "bias": np.full((1, 1), 0.5, np.float32)},
                     rtol=1e-4, atol=1e-5)


def test_normalization_declines_what_it_does_not_implement():
    assert "stash_type" in cuda_reason(norm_model("LayerNormalization", np.float32, -1, stash_type=11))
    t = TensorProto.FLOAT
    mixed = single_node_model("RMSNormalization", [("x", t, None), ("scale", TensorProto.FLOAT16, None)],
                              [("y", TensorProto.FLOAT16, None)], opset=23)
    assert "of one type" in cuda_reason(mixed)
    partial_scale = single_node_model("LayerNormalization", [("x", t, [2, 3, 4]), ("scale", t, [3, 1])],
                                      [("y", t, None)], {"axis": 1}, opset=17)
    assert "does not match the normalized shape" in cuda_reason(partial_scale)
