"""Conv, MaxPool, AveragePool and GlobalAveragePool on the CUDA provider (kernels/conv.cu) against the CPU
provider, plus two small networks run end to end through CUDA+CPU."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from cuda_op_harness import (
    CONV_OPS,
    CUDA,
    CUDA_FIRST,
    HALVES,
    check_node,
    compare,
    decline_reason,
    family_cases,
    node_model,
    random,
    run_backend_case,
    tolerance,
)
from onnx import helper, numpy_helper

pytestmark = pytest.mark.usefixtures("cuda_driver_mode")



@pytest.mark.parametrize("name", family_cases(CONV_OPS))
def test_backend_case(name):
    # 3-D windows and double precision are declined by design and run on the CPU.
    run_backend_case(name, declined_ok=lambda case: "_3d" in case or "double" in case)


# -- Conv --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((2, 3, 9, 10), (8, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((1, 20, 11, 9), (70, 20, 3, 2), {"strides": [2, 1], "pads": [0, 1, 2, 0]}),   # tiles past 64 rows, K > 16
    ((2, 4, 9, 10), (6, 2, 3, 2), {"group": 2, "dilations": [1, 2]}),             # grouped
    ((1, 6, 8, 8), (12, 1, 3, 3), {"group": 6, "auto_pad": "SAME_UPPER", "strides": [2, 2]}),  # depthwise x2
    ((3, 1, 7, 7), (5, 1, 2, 2), {"auto_pad": "SAME_LOWER"}),                     # one input channel
    ((1, 70, 5, 5), (65, 70, 1, 1), {}),                                          # pointwise
    ((2, 5, 17), (7, 5, 4), {"auto_pad": "VALID", "strides": [3]}),               # 1-D
    ((2, 4, 13), (4, 1, 3), {"group": 4, "pads": [2, 1], "dilations": [2]}),      # 1-D depthwise
])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_conv(x_shape, w_shape, attrs, with_bias):
    feeds = {"x": random(x_shape, seed=1), "w": random(w_shape, seed=2),
             "b": random((w_shape[0],), seed=3) if with_bias else None}
    check_node("Conv", feeds, attrs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: np.dtype(d).name)
def test_conv_half_types(dtype):
    feeds = {"x": random((2, 8, 7, 6), dtype, 1), "w": random((10, 4, 3, 3), dtype, 2), "b": random((10,), dtype, 3)}
    check_node("Conv", feeds, {"group": 2, "pads": [1, 1, 1, 1]}, **tolerance(dtype))
    depthwise = {"x": random((1, 4, 6, 6), dtype, 4), "w": random((4, 1, 3, 3), dtype, 5)}
    check_node("Conv", depthwise, {"group": 4}, **tolerance(dtype))


def test_conv_on_an_empty_batch():
    feeds = {"x": random((0, 3, 5, 5)), "w": random((4, 3, 3, 3))}
    session = ort.InferenceSession(node_model("Conv", feeds), providers=CUDA_FIRST)
    (y,) = session.run(None, feeds)
    assert y.shape == (0, 4, 3, 3) and y.dtype == np.float32


def test_3d_conv_is_declined_with_a_reason():
    reason = decline_reason("Conv", {"x": random((1, 2, 3, 3, 3)), "w": random((2, 2, 2, 2, 2))})
    assert "1-D and 2-D windows" in reason and "3 spatial dimensions" in reason


# -- pooling -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1, "pads": [1, 0, 1, 0]},
    {"kernel_shape": [2, 3], "dilations": [2, 1], "storage_order": 1},
    {"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER", "strides": [2, 3]},
    {"kernel_shape": [4, 4], "auto_pad": "SAME_LOWER"},
])
def test_max_pool_with_indices(attrs):
    check_node("MaxPool", {"x": random((2, 3, 9, 10))}, attrs, outputs=2)


def test_max_pool_propagates_nan_and_takes_8_bit_integers():
    x = random((1, 2, 4, 4))
    x[0, 0, 1, 1] = np.nan
    (y,) = check_node("MaxPool", {"x": x}, {"kernel_shape": [2, 2]})
    assert np.isnan(y[0, 0, 0, 0])
    ints = np.random.default_rng(0).integers(-128, 128, (2, 3, 7, 7)).astype(np.int8)
    check_node("MaxPool", {"x": ints}, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, outputs=2)


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: np.dtype(d).name)
def test_pools_on_half_types(dtype):
    x = random((2, 3, 8, 9), dtype)
    check_node("MaxPool", {"x": x}, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, outputs=2)
    check_node("AveragePool", {"x": x}, {"kernel_shape": [2, 3], "strides": [2, 2], "ceil_mode": 1},
               **tolerance(dtype))
    check_node("GlobalAveragePool", {"x": x}, **tolerance(dtype))


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1, "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 2], "pads": [2, 0, 1, 1], "dilations": [2, 2]},
    {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER", "strides": [3, 3]},
    {"kernel_shape": [5], "strides": [2], "pads": [2, 2], "ceil_mode": 1},  # 1-D
])
def test_average_pool(attrs, include_pad):
    x = random((2, 3, 9, 10) if len(attrs["kernel_shape"]) == 2 else (2, 3, 11))
    check_node("AveragePool", {"x": x}, {**attrs, "count_include_pad": include_pad}, opset=19)


@pytest.mark.filterwarnings("ignore:Mean of empty slice", "ignore:invalid value encountered")
@pytest.mark.parametrize("shape", [(2, 3, 1, 1), (1, 2, 40, 33), (2, 2, 3, 4, 5), (3, 4, 0, 2)])
def test_global_average_pool(shape):
    check_node("GlobalAveragePool", {"x": random(shape)}, rtol=1e-5, atol=1e-6)


# -- networks ----------------------------------------------------------------------------------------


def _small_cnn() -> onnx.ModelProto:
    """Conv -> MaxPool -> grouped Conv -> AveragePool -> depthwise Conv -> GlobalAveragePool -> Flatten -> Gemm,
    with random weights so every layer's arithmetic shows in the result."""
    weights = {"w1": random((16, 3, 3, 3), seed=1), "b1": random((16,), seed=2),
               "w2": random((24, 4, 3, 3), seed=3), "w3": random((24, 1, 3, 3), seed=4), "b3": random((24,), seed=5),
               "fc": random((10, 24), seed=6), "fb": random((10,), seed=7)}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("MaxPool", ["c1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], group=4, strides=[1, 1]),
        helper.make_node("AveragePool", ["c2"], ["p2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Conv", ["p2", "w3", "b3"], ["c3"], group=24, auto_pad="SAME_UPPER"),
        helper.make_node("GlobalAveragePool", ["c3"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fb"], ["y"], transB=1),
    ]
    graph = helper.make_graph(nodes, "small_cnn", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                                   [2, 3, 20, 18])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_small_cnn_runs_entirely_on_cuda():
    compare(_small_cnn().SerializeToString(), {"x": random((2, 3, 20, 18), seed=8)}, rtol=1e-4, atol=1e-5)


def test_squeezenet_through_cuda_and_cpu():
    from model_helpers import light_model, with_softmax_logits

    # Its closing softmax is of logits equal in exact arithmetic (test_light_models.py says why): the two
    # providers' logits are compared, where float32 rounding stays small.
    model, data, shape = light_model("light_squeezenet")
    model, _ = with_softmax_logits(model)
    feeds = {data: random(shape, seed=9)}
    session = ort.InferenceSession(model.SerializeToString(), providers=CUDA_FIRST)
    on_cuda = {n.op_type for n in session.placement() if n.provider == CUDA}
    assert {"Conv", "MaxPool", "Concat", "GlobalAveragePool"} <= on_cuda
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(session.run(None, feeds)[1], expected[1], rtol=1e-4)
