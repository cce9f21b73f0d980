"""Single-node com.microsoft models run through this runtime and through onnxruntime's CPU provider (the oracle),
and the comparisons the quantized contrib operators' tests make."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import onnxruntime
from onnx import helper, numpy_helper

MS = "com.microsoft"
RNG = np.random.default_rng(20)


def node_model(op, inputs, attrs=None, n_outputs=1, constants=(), after=None, opset=21):
    """A model of one ``op`` node (domain com.microsoft) over ``inputs`` (None: an omitted optional input); the
    inputs at ``constants`` are initializers, the others graph inputs. ``after`` (op_type, attrs) appends a
    standard node applied to each output (e.g. a Cast, to read int4 results). Returns (model, feeds)."""
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    graph_inputs, initializers, feeds = [], [], {}
    for i, (name, x) in enumerate(zip(names, inputs)):
        if x is None:
            continue
        x = np.asarray(x)
        if i in constants:
            initializers.append(numpy_helper.from_array(x, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape))
            feeds[name] = x
    outs = [f"out{i}" for i in range(n_outputs)]
    nodes = [helper.make_node(op, names, outs, name="n", domain=MS, **(attrs or {}))]
    if after is not None:
        op_after, attrs_after = after
        nodes += [helper.make_node(op_after, [o], [f"{o}_"], **attrs_after) for o in outs]
        outs = [f"{o}_" for o in outs]
    graph = helper.make_graph(nodes, "g", graph_inputs, [helper.make_empty_tensor_value_info(o) for o in outs],
                              initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return model, feeds


def run_both(op, inputs, attrs=None, n_outputs=1, constants=(), after=None):
    """(ours, onnxruntime's) outputs of the single-node model."""
    model, feeds = node_model(op, inputs, attrs, n_outputs, constants, after)
    data = model.SerializeToString()
    theirs = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    ours = onnx_runtime.InferenceSession(data, providers=["cpu"]).run(None, feeds)
    return ours, theirs


def run_ours(op, inputs, attrs=None, n_outputs=1, constants=()):
    model, feeds = node_model(op, inputs, attrs, n_outputs, constants)
    return onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, feeds)


def assert_integers(ours, theirs, off_by_one=False):
    """Equal integer tensors; with ``off_by_one``, differences of 1 are allowed (and must stay rare): the spec
    leaves the float rounding of a requantization to the implementation, so a value within a float rounding of
    a tie may round either way."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (ours.dtype, ours.shape, theirs.dtype,
                                                                        theirs.shape)
    diff = np.abs(ours.astype(np.int64) - theirs.astype(np.int64))
    if not off_by_one:
        np.testing.assert_array_equal(ours, theirs)
        return
    assert diff.max(initial=0) <= 1, f"differences up to {diff.max()}"
    assert np.count_nonzero(diff) <= max(2, diff.size // 50), f"{np.count_nonzero(diff)} of {diff.size} differ by 1"


def assert_floats(ours, theirs, atol, rtol=1e-5):
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (ours.dtype, ours.shape, theirs.dtype,
                                                                        theirs.shape)
    np.testing.assert_allclose(ours.astype(np.float64), theirs.astype(np.float64), rtol=rtol, atol=atol)


def quantized(shape, dtype, rng=RNG, high=None):
    info = np.iinfo(dtype)
    return rng.integers(info.min, int(info.max if high is None else high) + 1, size=shape).astype(dtype)


def operand_a(shape, a_type, b_type):
    """A quantized left operand. Against int8 weights a uint8 operand stays within 7 bits (onnxruntime's
    reduce_range): onnxruntime's AVX2 u8 x s8 kernels add product pairs in saturating int16, so full-range
    operands give it wrong sums. This runtime sums exactly either way (see the full-range tests)."""
    return quantized(shape, a_type, high=127 if (a_type, b_type) == (np.uint8, np.int8) else None)


def zero_point(dtype, value=None):
    if value is not None:
        return np.array(value, dtype)
    return np.array(128 if dtype == np.uint8 else 0, dtype)

