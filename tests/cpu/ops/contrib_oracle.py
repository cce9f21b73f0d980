"""Single-node com.microsoft models run through onnx_runtime and through onnxruntime (the oracle), for the
contrib operator tests: random inputs, per-dtype tolerances, the placement of the node."""

from __future__ import annotations

import numpy as np
import onnx_runtime
from onnx import helper

CONTRIB = "com.microsoft"
RNG = np.random.default_rng(20)
F32, F16 = np.float32, np.float16
# (rtol, atol) per dtype; float32's atol is scaled by callers whose outputs sum long rows.
TOL = {np.dtype(F32): (1e-5, 1e-5), np.dtype(F16): (1e-3, 2e-3), np.dtype(np.float64): (1e-7, 1e-9)}


def rand(*shape, dtype=F32, low=-1.0, high=1.0):
    return RNG.uniform(low, high, shape).astype(dtype)


def model(op, inputs, attrs=None, n_outputs=1, domain=CONTRIB, opset=17, outputs=None, types=None):
    """A one-node model: ``inputs`` are arrays (None for an omitted optional input), fed as graph inputs
    named in0, in1, ...; ``outputs`` names the node's outputs ("" for an omitted one), out0.. by default;
    ``types`` maps an output's index to its declared dtype (where the oracle cannot infer it)."""
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    outputs = outputs if outputs is not None else [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op, names, outputs, name=f"{op.lower()}_node", domain=domain, **(attrs or {}))
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
         for n, x in zip(names, inputs) if x is not None],
        [helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(np.dtype(types[i])), None)
         if types and i in types else helper.make_empty_tensor_value_info(o) for i, o in enumerate(outputs) if o],
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(CONTRIB, 1)]
    proto = helper.make_model(graph, opset_imports=opsets)
    proto.ir_version = 8
    return proto


def feeds(inputs) -> dict:
    return {f"in{i}": x for i, x in enumerate(inputs) if x is not None}


def ours(proto, inputs) -> list:
    session = onnx_runtime.InferenceSession(proto, providers=["CPUExecutionProvider"])
    return [np.asarray(y) for y in session.run(None, feeds(inputs))]


def oracle(proto, inputs) -> list:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds(inputs))


def close(got, expected, dtype=None, scale: float = 1.0, what: str = "") -> None:
    """Bounded error: the dtype's (rtol, atol), atol times ``scale`` (long sums)."""
    expected = np.asarray(expected)
    got = np.asarray(got)
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    assert got.dtype == expected.dtype, (what, got.dtype, expected.dtype)
    rtol, atol = TOL.get(np.dtype(dtype or expected.dtype), (0, 0))
    if got.dtype.kind in "iub":
        np.testing.assert_array_equal(got, expected, err_msg=what)
        return
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol * scale,
                               err_msg=what)


def compare(op, inputs, attrs=None, n_outputs=1, scale: float = 1.0, outputs=None, domain=CONTRIB, opset=17,
            dtype=None, only=None, types=None):
    """Run the node through both runtimes and compare every output (or those indexed by ``only``)."""
    proto = model(op, inputs, attrs, n_outputs, domain=domain, opset=opset, outputs=outputs, types=types)
    got, expected = ours(proto, inputs), oracle(proto, inputs)
    assert len(got) == len(expected)
    for index, (g, e) in enumerate(zip(got, expected)):
        if only is None or index in only:
            close(g, e, dtype, scale, what=f"{op} output {index}")
    return got, expected


def placed_on_cpu(op, inputs, attrs=None, n_outputs=1, domain=CONTRIB, opset=17) -> None:
    proto = model(op, inputs, attrs, n_outputs, domain=domain, opset=opset)
    session = onnx_runtime.InferenceSession(proto, providers=["CPUExecutionProvider"])
    record = session.placement()[f"{op.lower()}_node"]
    assert record.provider == "CPUExecutionProvider"
    assert (record.op_type, record.domain) == (op, domain)
