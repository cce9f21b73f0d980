"""BatchNormalization (inference) and LRN on the CUDA provider (kernels/channel_norm.cu) against the CPU
provider, and the light CNNs that need them placed entirely on CUDA."""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from cuda_op_harness import (
    CUDA,
    CUDA_FIRST,
    HALVES,
    check_node,
    decline_reason,
    node_cases,
    random,
    run_backend_case,
    tolerance,
)
from onnx import helper

pytestmark = pytest.mark.usefixtures("cuda_driver_mode")

OPS = frozenset({"BatchNormalization", "LRN"})


def _cases() -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node_cases()
    return sorted(name for name, case in cases.items() if {n.op_type for n in case.model.graph.node} <= OPS)


@pytest.mark.parametrize("name", _cases())
def test_backend_case(name):
    # Training-mode BatchNormalization (running statistics as outputs) is declined by design.
    run_backend_case(name, declined_ok=lambda case: "training" in case)


def _bn_inputs(shape, dtype, seed):
    channels = shape[1]
    rng = np.random.default_rng(seed)
    return {"x": random(shape, dtype, seed), "scale": rng.uniform(0.5, 2, channels).astype(dtype),
            "bias": rng.uniform(-1, 1, channels).astype(dtype), "mean": rng.uniform(-1, 1, channels).astype(dtype),
            "var": rng.uniform(0.1, 3, channels).astype(dtype)}


# Odd element counts (not a multiple of the block), rank 2 (no spatial dims), rank 3 and 5.
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 9), (1, 6, 33), (2, 2, 3, 2, 5)])
def test_batch_norm_shapes(shape):
    check_node("BatchNormalization", _bn_inputs(shape, np.float32, 1), {"epsilon": 1e-3}, opset=15,
               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALVES, ids=["f16", "bf16"])
def test_batch_norm_half_precision(dtype):
    check_node("BatchNormalization", _bn_inputs((2, 5, 6, 7), dtype, 2), opset=15, **tolerance(dtype))


def test_batch_norm_declines_training_mode_and_mixed_types():
    inputs = _bn_inputs((2, 3, 4), np.float32, 3)
    assert "training_mode" in decline_reason("BatchNormalization", inputs, {"training_mode": 1}, opset=15,
                                             outputs=3)
    mixed = dict(inputs, mean=inputs["mean"].astype(np.float16), var=inputs["var"].astype(np.float16))
    assert "one type" in decline_reason("BatchNormalization", mixed, opset=15)


# size odd and even (the window is asymmetric for even sizes), wider than the channel count, rank 3.
@pytest.mark.parametrize("shape,size", [((2, 7, 5, 6), 5), ((1, 6, 4, 3), 4), ((2, 3, 5, 5), 9), ((2, 8, 11), 3)])
def test_lrn(shape, size):
    attrs = {"size": size, "alpha": 2e-3, "beta": 0.6, "bias": 1.5}
    check_node("LRN", {"x": random(shape, np.float32, 4) * 3}, attrs, opset=13, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", HALVES, ids=["f16", "bf16"])
def test_lrn_half_precision(dtype):
    check_node("LRN", {"x": random((2, 6, 4, 5), dtype, 5)}, {"size": 3}, opset=13, **tolerance(dtype))


def _light(name: str) -> str:
    from model_helpers import LIGHT_DIR

    return os.path.join(LIGHT_DIR, f"light_{name}.onnx")


@pytest.mark.parametrize("name", ["bvlc_alexnet", "densenet121", "inception_v1", "zfnet512"])
def test_light_models_needing_them_place_entirely_on_cuda(name):
    session = ort.InferenceSession(_light(name), providers=CUDA_FIRST)
    off = {(n.op_type, n.rejected.get(CUDA)) for n in session.placement() if n.provider != CUDA}
    assert not off


def test_a_bn_lrn_network_matches_the_cpu_provider():
    """Conv -> LRN -> MaxPool -> Concat -> BatchNormalization -> Relu, as in GoogLeNet/DenseNet, end to end."""
    rng = np.random.default_rng(6)
    weights = {"w": rng.uniform(-0.5, 0.5, (6, 3, 3, 3)).astype(np.float32)}
    weights.update({k: v for k, v in _bn_inputs((1, 9), np.float32, 7).items() if k != "x"})
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("LRN", ["c"], ["l"], size=5, alpha=1e-3),
        helper.make_node("MaxPool", ["l"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("MaxPool", ["x"], ["q"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Concat", ["p", "q"], ["cat"], axis=1),
        helper.make_node("BatchNormalization", ["cat", "scale", "bias", "mean", "var"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "bn_lrn", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                               [2, 3, 10, 12])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [onnx.numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]).SerializeToString()
    # Without the optimizer, so the BatchNormalization is not folded away and runs as a kernel.
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model, options, providers=CUDA_FIRST)
    assert {n.provider for n in session.placement()} == {CUDA}
    feeds = {"x": random((2, 3, 10, 12), np.float32, 8)}
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(session.run(None, feeds)[0], expected[0], rtol=1e-4, atol=1e-5)
