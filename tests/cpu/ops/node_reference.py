"""Single-node checks of CPU kernels against onnx's reference evaluator: random inputs, the registered kernel
called directly (static and unknown input shapes), the tolerance per dtype."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.registry import lookup

RNG = np.random.default_rng(0)
F32, F16, F64 = np.float32, np.float16, np.float64
TOL = {np.dtype(F16): (1e-2, 1e-2), np.dtype(F32): (1e-4, 1e-5), np.dtype(F64): (1e-7, 1e-9)}


def rand(*shape, dtype=F32, low=-1.0, high=1.0):
    return RNG.uniform(low, high, shape).astype(dtype)


def reference(op, inputs, attrs, opset, n_outputs=1):
    """Run a single-node model through the onnx reference evaluator."""
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    outputs = [f"out{i}" for i in range(n_outputs)]
    graph = helper.make_graph(
        [helper.make_node(op, names, outputs, **attrs)],
        "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
         for n, x in zip(names, inputs) if x is not None],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {n: x for n, x in zip(names, inputs) if x is not None}
    return ReferenceEvaluator(model).run(None, feeds)


def ours(op, inputs, attrs, opset, n_outputs=1, static=True):
    """Build the kernel the registry picks for ``opset`` and call it."""
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    node = Node(op, names, [f"out{i}" for i in range(n_outputs)], name="n", attrs=dict(attrs), opset=opset)
    shapes = [None if x is None or not static else x.shape for x in inputs]
    factory = lookup(op, "", opset)
    assert factory is not None, f"no kernel for {op} at opset {opset}"
    outs = factory(node, shapes, opset)(*inputs)
    assert isinstance(outs, tuple) and len(outs) == n_outputs
    return outs


def check(op, inputs, attrs, opset, n_outputs=1, expected=None, ref_opset=None, tol=None):
    """Compare our kernel (static and unknown shapes) with the reference (or ``expected``)."""
    originals = [None if x is None else x.copy() for x in inputs]
    if expected is None:
        expected = reference(op, inputs, attrs, ref_opset or opset, n_outputs)
    for static in (True, False):
        got = ours(op, inputs, attrs, opset, n_outputs, static)
        for g, e in zip(got, expected):
            e = np.asarray(e)
            rtol, atol = tol or TOL.get(np.dtype(e.dtype), (0, 0))
            assert g.shape == e.shape, (g.shape, e.shape)
            assert g.dtype == e.dtype, (g.dtype, e.dtype)
            np.testing.assert_allclose(g.astype(F64), e.astype(F64), rtol=rtol, atol=atol)
    for x, original in zip(inputs, originals):  # kernels must not write to their inputs
        if x is not None:
            np.testing.assert_array_equal(x, original)
