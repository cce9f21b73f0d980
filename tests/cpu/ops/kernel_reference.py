"""Single-node checks of CPU kernels against onnx's reference evaluator, for the ops without window or
product arithmetic: random inputs, the registered kernel, exact comparison where the op is exact."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.registry import lookup

rng = np.random.default_rng(0)


def f32(*shape, low=-3.0, high=3.0):
    return rng.uniform(low, high, shape).astype(np.float32)


def i32(*shape, low=-10, high=10):
    return rng.integers(low, high, shape).astype(np.int32)


def i64(values):
    return np.array(values, dtype=np.int64)


def make_kernel(op, inputs, attrs=None, opset=18, n_outputs=1):
    """The registered kernel for one node; ``inputs`` are arrays, or None for an omitted input."""
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    node = Node(op, names, [f"out{i}" for i in range(n_outputs)], name="n", attrs=dict(attrs or {}), opset=opset)
    factory = lookup(op, "", opset)
    assert factory is not None, f"no kernel for {op} at opset {opset}"
    return factory(node, [None if x is None else x.shape for x in inputs], opset)


def run_kernel(op, inputs, attrs=None, opset=18, n_outputs=1):
    outputs = make_kernel(op, inputs, attrs, opset, n_outputs)(*inputs)
    assert isinstance(outputs, tuple) and len(outputs) == n_outputs
    return outputs


def _elem_type(x):
    return TensorProto.STRING if x.dtype == object else helper.np_dtype_to_tensor_dtype(x.dtype)


def run_reference(op, inputs, attrs=None, opset=18, n_outputs=1):
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    outputs = [f"out{i}" for i in range(n_outputs)]
    proto_attrs = {k: numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v for k, v in (attrs or {}).items()}
    graph = helper.make_graph(
        [helper.make_node(op, names, outputs, **proto_attrs)],
        "single_node",
        [helper.make_tensor_value_info(n, _elem_type(x), x.shape) for n, x in zip(names, inputs) if n],
        [helper.make_value_info(name, onnx.TypeProto()) for name in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {n: x for n, x in zip(names, inputs) if n}
    return ReferenceEvaluator(model).run(None, feeds)


def assert_same(actual, expected):
    expected = np.asarray(expected)
    if expected.dtype.kind in "US" or actual.dtype == object:
        assert actual.dtype == object
        np.testing.assert_array_equal(actual.astype(str), expected.astype(str))
        return
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if actual.dtype.kind in "biu":
        np.testing.assert_array_equal(actual, expected)
    elif actual.dtype in (np.float32, np.float64):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    else:  # float16, bfloat16, float8: compare in float32 with the narrow type's precision
        np.testing.assert_allclose(actual.astype(np.float32), expected.astype(np.float32), rtol=1e-2, atol=1e-3)


def check(op, inputs, attrs=None, opset=18, n_outputs=1):
    """Run the kernel and the reference evaluator on the same node and compare every output."""
    actual = run_kernel(op, inputs, attrs, opset, n_outputs)
    expected = run_reference(op, inputs, attrs, opset, n_outputs)
    for a, e in zip(actual, expected):
        assert_same(a, e)
    return actual
