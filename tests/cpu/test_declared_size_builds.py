"""What a kernel build or a fusion works out from declared shapes must not allocate by them: a declared dimension
can be far larger than any feed, and the memory budget sees feeds and outputs, not a build. A model declaring
2^39 rows is created, and its run names the input whose shape disagrees (fuzz seed 64 found the LayerNorm case).
The shape arithmetic the int8 fusions and the QOperator layout use works on sizes without arrays."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.optimizer.elimination import reshaped
from onnx_runtime_ep_cpu.algorithms.qlinear_layout import binary_layout

HUGE = 2**39


def _session_of(nodes, x_shape, inits, domain_opsets=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17), *(helper.make_opsetid(d, 1) for d in domain_opsets)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"])


def test_layer_norm_declared_huge_is_created_and_its_run_names_the_input():
    rng = np.random.default_rng(3)
    inits = {"scale": rng.standard_normal(8).astype(np.float32), "bias": rng.standard_normal(8).astype(np.float32)}
    session = _session_of([helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=-1)],
                          [HUGE, 3, 8], inits)
    with pytest.raises(InvalidArgumentError, match="'x'"):
        session.run(None, {"x": np.zeros((2, 3, 8), np.float32)})


def test_int8_product_under_huge_declared_heads_is_created_and_its_run_names_the_input():
    """The int8 passes (grouping, unflattening) and the product's build all see the declared 2^39 rows."""
    rng = np.random.default_rng(4)
    k, n = 32, 24
    inits = {"w": rng.integers(-64, 64, (k, n)).astype(np.int8), "w_scale": np.full(n, 0.02, np.float32),
             "w_zero": np.zeros(n, np.int8), "bias": rng.standard_normal(n).astype(np.float32),
             "flat": np.array([-1, k], np.int64), "back": np.array([1, -1, n], np.int64)}
    nodes = [helper.make_node("Transpose", ["x"], ["heads"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["heads", "flat"], ["a"]),
             helper.make_node("DynamicQuantizeMatMul", ["a", "w", "w_scale", "w_zero", "bias"], ["p"],
                              domain="com.microsoft"),
             helper.make_node("Reshape", ["p", "back"], ["y"])]
    session = _session_of(nodes, [1, 4, HUGE, k // 4], inits, ("com.microsoft",))
    with pytest.raises(InvalidArgumentError, match="'x'"):
        session.run(None, {"x": np.zeros((1, 4, 5, k // 4), np.float32)})


def test_shape_arithmetic_takes_huge_sizes_without_memory():
    assert reshaped((1, HUGE, 4, 8), [0, -1, 32], False) == (1, HUGE, 32)
    assert reshaped((1, HUGE, 4, 8), [-1, -1], False) is None
    assert reshaped((1, HUGE, 4, 8), [HUGE, 33], False) is None
    cols, a_steps, b_steps = binary_layout((HUGE, 64), (64,), (HUGE, 64))
    assert cols == 64 and a_steps.dtype == np.int64 and b_steps.dtype == np.int64
