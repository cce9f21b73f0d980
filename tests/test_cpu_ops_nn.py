"""CPU kernels of the convolution, pooling, normalization, softmax, activation and linalg families against
onnx's reference evaluator.

Each case builds one single-node model with onnx.helper, runs it through
``onnx.reference.ReferenceEvaluator``, and calls the registered kernel directly, both with static
input shapes and with unknown ones. Where the reference implementation is known to be wrong (see
the notes on each case) the oracle is a plain numpy restatement of the spec instead.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.algorithms import conv_blas, window
from onnx_runtime_ep_cpu.ops import conv as conv_ops
from onnx_runtime_ep_cpu.ops import normalization
from onnx_runtime_ep_cpu.registry import lookup
from reference64 import assert_within, gamma, run_float64

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


# -- Conv ----------------------------------------------------------------------------------------

CONV_CASES = [
    # x shape, w shape, attrs
    ((1, 3, 7, 8), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 3, 9, 7), (5, 3, 3, 2), {"strides": [2, 1], "pads": [0, 1, 1, 2]}),
    ((1, 2, 10, 9), (3, 2, 3, 3), {"dilations": [2, 3], "pads": [2, 1, 0, 1]}),
    ((1, 4, 6, 6), (6, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
    ((2, 4, 7, 7), (4, 1, 3, 3), {"group": 4, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 3, 6, 5), (6, 1, 3, 3), {"group": 3}),
    ((1, 3, 7, 9), (2, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 3, 8, 7), (2, 3, 4, 2), {"auto_pad": "SAME_LOWER", "strides": [2, 3]}),
    ((1, 3, 7, 7), (2, 3, 3, 3), {"auto_pad": "VALID", "strides": [2, 2]}),
    ((2, 5, 6, 7), (3, 5, 1, 1), {}),
    ((1, 5, 7, 7), (3, 5, 1, 1), {"strides": [2, 2], "kernel_shape": [1, 1]}),
    ((1, 2, 11), (3, 2, 4), {"strides": [3], "pads": [2, 1]}),
    ((1, 2, 4, 5, 6), (3, 2, 2, 3, 2), {"pads": [1, 0, 1, 0, 1, 1], "strides": [1, 2, 2]}),
    ((1, 7, 4), (2, 7, 1), {"group": 1, "auto_pad": "SAME_UPPER"}),
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", CONV_CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv(x_shape, w_shape, attrs, with_bias):
    x, w = rand(*x_shape), rand(*w_shape)
    b = rand(w_shape[0]) if with_bias else None
    check("Conv", [x, w, b], attrs, 11)


@pytest.mark.parametrize("opset", [1, 22])
@pytest.mark.parametrize("dtype", [F16, F64])
def test_conv_dtypes_and_opsets(opset, dtype):
    x, w, b = rand(1, 4, 6, 6, dtype=dtype), rand(4, 2, 3, 3, dtype=dtype), rand(4, dtype=dtype)
    check("Conv", [x, w, b], {"group": 2, "pads": [1, 0, 1, 2], "strides": [1, 2]}, opset)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [CONV_CASES[1], CONV_CASES[4], CONV_CASES[12]])
def test_conv_in_row_blocks(monkeypatch, x_shape, w_shape, attrs, knobs):
    # Large images build the im2col matrix a block of output rows at a time; force tiny blocks.
    knobs(im2col_block_bytes=64)
    check("Conv", [rand(*x_shape), rand(*w_shape), rand(w_shape[0])], attrs, 11)


@pytest.mark.parametrize("pads,dilations,multiplier", [
    ([1, 1, 1, 1], [1, 1], 1),  # output as wide as the input: rows without pads, straight into y
    ([0, 2, 1, 0], [1, 2], 2),  # reads wrap only on the left, dilated columns
    ([1, 0, 0, 1], [2, 1], 1),  # output narrower than the input: cropped
    ([0, 3, 0, 3], [1, 1], 1),  # output wider than the input: the fully padded rows instead
])
def test_depthwise_stride_one_rows(pads, dilations, multiplier):
    # Taps past a row's edge read the neighbouring row in the unpadded layout and must count as zeros.
    x, w, b = rand(2, 3, 5, 6, low=1, high=2), rand(3 * multiplier, 1, 3, 3), rand(3 * multiplier)
    check("Conv", [x, w, b], {"group": 3, "pads": pads, "dilations": dilations}, 11)


@pytest.mark.parametrize("pads,dilations", [([1, 1, 1, 1], [1, 1]), ([0, 2, 2, 0], [1, 1]), ([2, 1, 2, 3], [2, 2])])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_over_unpadded_rows(monkeypatch, pads, dilations, with_bias, knobs):
    # Outputs as wide as the input: im2col from the unpadded rows, here a few output rows per block.
    knobs(im2col_block_bytes=4 * 28 * 9 * 2)
    x, w = rand(2, 3, 6, 9, low=1, high=2), rand(4, 3, 3, 3)
    geo = window.Window(Node("Conv", [], [], attrs={"pads": pads, "dilations": dilations}), [], needs_kernel=False)
    assert conv_blas.tight_fits(geo.resolve((6, 9), (3, 3)))
    check("Conv", [x, w, rand(4) if with_bias else None], {"pads": pads, "dilations": dilations}, 11)


def test_conv_bfloat16():
    import ml_dtypes

    x, w, b = rand(1, 3, 6, 5), rand(4, 3, 3, 3), rand(4)
    attrs = {"pads": [1, 1, 1, 1], "strides": [2, 1]}
    (expected,) = reference("Conv", [x, w, b], attrs, 22)
    bf16 = [v.astype(ml_dtypes.bfloat16) for v in (x, w, b)]
    (got,) = ours("Conv", bf16, attrs, 22)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(got.astype(F32), expected, rtol=5e-2, atol=5e-2)


def test_conv_rejects_bad_attributes():
    for attrs in ({"auto_pad": "SAME"}, {"pads": [1, 1]}, {"strides": [0, 1]}, {"group": 0}):
        with pytest.raises(InvalidGraphError, match="attribute"):
            ours("Conv", [rand(1, 2, 5, 5), rand(2, 2, 3, 3)], attrs, 11)
    with pytest.raises(InvalidArgumentError, match="channels"):
        ours("Conv", [rand(1, 3, 5, 5), rand(2, 2, 3, 3)], {}, 11)


# -- fused convolutions (conv_fusions.py) --------------------------------------------------------

X_SHAPE, Y_SHAPE = (1, 3, 6, 6), (1, 4, 6, 6)


def _fusion_model(pattern: str, opset: int = 13):
    """A Conv (or BatchNormalization) followed by ``pattern``'s nodes, as an onnx model."""
    inits = {"w": rand(4, 3, 3, 3), "b": rand(4), "lo": np.array(-0.2, F32), "hi": np.array(0.3, F32),
             "scale": rand(3), "shift": rand(3), "mean": rand(3), "var": rand(3, low=0.5, high=1.5)}
    conv = helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1])
    nodes, z_shape = {
        "relu": ([conv, helper.make_node("Relu", ["c"], ["y"])], None),
        "clip": ([conv, helper.make_node("Clip", ["c", "lo", "hi"], ["y"])], None),
        "clip_max_only": ([conv, helper.make_node("Clip", ["c", "", "hi"], ["y"])], None),
        "leaky_relu": ([conv, helper.make_node("LeakyRelu", ["c"], ["y"], alpha=0.2)], None),
        "add_relu": ([conv, helper.make_node("Add", ["c", "z"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
                     Y_SHAPE),
        "sum_first_relu": ([conv, helper.make_node("Sum", ["z", "c"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
                           Y_SHAPE),
        "add_only": ([conv, helper.make_node("Add", ["c", "z"], ["y"])], Y_SHAPE),
        "add_broadcasts_up": ([conv, helper.make_node("Add", ["c", "z"], ["s"]),
                               helper.make_node("Relu", ["s"], ["y"])], (2, 4, 6, 6)),
        "batchnorm_relu": ([helper.make_node("BatchNormalization", ["x", "scale", "shift", "mean", "var"], ["c"]),
                            helper.make_node("Relu", ["c"], ["y"])], None),
    }[pattern]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, X_SHAPE)]
    if z_shape:
        inputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, z_shape))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), z_shape


def _exact(model, feeds) -> np.ndarray:
    """``model``'s first output in float64. onnx's reference evaluator runs an opset 9-13 BatchNormalization
    on the batch's own statistics (it takes the momentum attribute's default as training), so the
    batch-normalization model's exact value is the spec's inference formula instead."""
    if model.graph.node[0].op_type != "BatchNormalization":
        return run_float64(model, feeds)[0]
    inits = {t.name: onnx.numpy_helper.to_array(t).astype(F64).reshape(1, -1, 1, 1) for t in model.graph.initializer}
    normalized = (feeds["x"] - inits["mean"]) / np.sqrt(inits["var"] + 1e-5) * inits["scale"] + inits["shift"]
    assert [node.op_type for node in model.graph.node] == ["BatchNormalization", "Relu"]
    return np.maximum(normalized, 0)


def _error_bound(model, feeds) -> float:
    """A bound on float32's rounding error for the convolutions (or batch normalization) of ``model``
    followed by its additions and activations (Relu, Clip and LeakyRelu do not grow an error): gamma of
    the terms summed, times the largest such sum of magnitudes."""
    inits = {t.name: np.abs(onnx.numpy_helper.to_array(t)) for t in model.graph.initializer}
    x = np.abs(feeds["x"]).max()
    addend = sum(np.abs(value).max() for name, value in feeds.items() if name != "x")
    convs = [node for node in model.graph.node if node.op_type == "Conv"]
    if convs:
        terms = max(inits[node.input[1]][0].size for node in convs)
        weight = max(inits[node.input[1]].max() for node in convs)
        bias = max([inits[node.input[2]].max() for node in convs if len(node.input) > 2] + [0])
        return gamma(terms + 3) * (terms * x * weight + bias + addend)
    spread = (x + inits["mean"].max()) * inits["scale"].max() / np.sqrt(inits["var"].min())
    return gamma(8) * (spread + inits["shift"].max() + addend)


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session, session.run(None, feeds)


def _pin_intermediates(model):
    """The same model with every node output also a graph output, so that nothing can be fused."""
    pinned = onnx.ModelProto()
    pinned.CopyFrom(model)
    for node in pinned.graph.node[:-1]:
        pinned.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in node.output)
    return pinned


@pytest.mark.parametrize("pattern", ["relu", "clip", "clip_max_only", "leaky_relu", "add_relu", "sum_first_relu",
                                     "add_only", "add_broadcasts_up", "batchnorm_relu"])
def test_fused_conv_equals_the_unfused_nodes(pattern):
    model, z_shape = _fusion_model(pattern)
    feeds = {"x": rand(*X_SHAPE)}
    if z_shape:
        feeds["z"] = rand(*z_shape)
    originals = {k: v.copy() for k, v in feeds.items()}
    session, (fused,) = _run(model, feeds)
    op_types = [node.op_type for node in session.model.graph.nodes]
    assert op_types == ["FusedBatchNormalization" if pattern == "batchnorm_relu" else "FusedConv"], op_types
    unfused_session, unfused = _run(_pin_intermediates(model), feeds)
    assert not any(n.op_type.startswith("Fused") for n in unfused_session.model.graph.nodes)
    exact, bound = _exact(model, feeds), _error_bound(model, feeds)
    assert_within(fused, exact, bound, "fused")
    assert_within(unfused[0], exact, bound, "unfused")
    for name, value in feeds.items():  # the residual is read, never written
        np.testing.assert_array_equal(value, originals[name])


def test_fusion_leaves_shared_values_and_computed_bounds_alone():
    conv = helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1])
    nodes = [conv, helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Neg", ["c"], ["n"]),
             helper.make_node("ReduceMax", ["n"], ["top"], keepdims=0),
             helper.make_node("Conv", ["r", "w2"], ["c2"]), helper.make_node("Clip", ["c2", "", "top"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, X_SHAPE)],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "n")],
        initializer=[onnx.numpy_helper.from_array(rand(3, 3, 3, 3), "w"),
                     onnx.numpy_helper.from_array(rand(2, 3, 1, 1), "w2")])
    session, _ = _run(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), {"x": rand(*X_SHAPE)})
    # The first Conv's output is also read by Neg, and the Clip's bound is computed: neither fuses.
    assert "FusedConv" not in [node.op_type for node in session.model.graph.nodes]


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("activation,params", [("Relu", []), ("LeakyRelu", [0.3]), ("Clip", [-0.5, 0.25])])
def test_fused_batchnorm_equals_batchnorm_then_activation(dtype, activation, params):
    x = rand(2, 5, 4, 3, dtype=dtype)
    stats = [rand(5, dtype=dtype), rand(5, dtype=dtype), rand(5, dtype=dtype), rand(5, dtype=dtype, low=0.5, high=2)]
    node = Node("FusedBatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="f",
                attrs={"epsilon": 1e-3, "activation": activation, "activation_params": params}, opset=1)
    (fused,) = normalization.fused_batch_normalization(node, [None] * 5, 1)(x, *stats)
    (normalized,) = ours("BatchNormalization", [x, *stats], {"epsilon": 1e-3}, 15)
    act_inputs = [normalized] + ([np.array(p, dtype) for p in params] if activation == "Clip" else [])
    act_attrs = {"alpha": params[0]} if activation == "LeakyRelu" else {}
    (expected,) = ours(activation, act_inputs, act_attrs, 13)
    np.testing.assert_array_equal(fused, expected)


def _concat_model(batch: int, dtype=TensorProto.FLOAT, extra_reader: bool = False):
    """A SqueezeNet fire module's tail: a 1x1 and a 3x3 convolution (each with a Relu) of one input,
    an Inception-style third branch (a strided 3x3 of a pooled input), concatenated on channels."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    inits = {"w1": rand(4, 3, 1, 1), "b1": rand(4), "w3": rand(5, 3, 3, 3), "b3": rand(5), "w5": rand(2, 3, 3, 3)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["x", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c3"], ["r3"]),
             helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["p", "w5"], ["c5"], pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["r1", "r3", "c5"], ["y"], axis=1)]
    outputs = [helper.make_tensor_value_info("y", dtype, None)]
    if extra_reader:  # r3 is also a graph output: the Concat may not take it over
        outputs.append(helper.make_tensor_value_info("r3", dtype, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, [batch, 3, 7, 7])], outputs,
                              initializer=[onnx.numpy_helper.from_array(v.astype(np_dtype), k)
                                           for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.DOUBLE])
def test_convolutions_write_straight_into_their_concat(batch, dtype):
    """The Concat goes: each convolution fills its channels of one tensor (in place for one image),
    with the unfused graph's results (float32: both within rounding error of the exact values; float64:
    equal to 1e-12, the fused activation's epilogue adding the bias after the product rather than in
    it) and several images."""
    model = _concat_model(batch, dtype)
    x = rand(batch, 3, 7, 7).astype(helper.tensor_dtype_to_np_dtype(dtype))
    session, (fused,) = _run(model, {"x": x})
    op_types = [node.op_type for node in session.model.graph.nodes]
    assert "Concat" not in op_types and op_types.count("FusedConv") == 3, op_types
    assert [n.attrs.get("concat_offset") for n in session.model.graph.nodes if n.op_type == "FusedConv"] == [0, 4, 9]
    _, unfused = _run(_pin_intermediates(model), {"x": x})
    assert fused.shape == (batch, 11, 7, 7)
    if dtype == TensorProto.FLOAT:
        exact, bound = _exact(model, {"x": x}), _error_bound(model, {"x": x})
        assert_within(fused, exact, bound, "fused")
        assert_within(unfused[0], exact, bound, "unfused")
    else:
        np.testing.assert_allclose(fused, unfused[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], fused)  # again: a fresh tensor, same values


def test_a_concat_input_read_elsewhere_keeps_the_concat():
    session, (y, r3) = _run(_concat_model(1, extra_reader=True), {"x": rand(1, 3, 7, 7)})
    assert "Concat" in [node.op_type for node in session.model.graph.nodes]
    np.testing.assert_array_equal(y[:, 4:9], r3)


def test_into_concat_rejects_a_mismatched_buffer():
    node = Node("FusedConv", ["x", "w", "", "", "into"], ["y"], name="part",
                attrs={"kernel_shape": [1, 1], "concat_channels": 6, "concat_offset": 2}, opset=1)
    kernel = conv_ops.fused_conv(node, [None] * 5, 1)
    x, w = rand(1, 3, 4, 4), rand(4, 3, 1, 1)
    (y,) = kernel(x, w, None, None, np.zeros((1, 6, 4, 4), F32))
    np.testing.assert_array_equal(y[:, :2], 0)
    with pytest.raises(InvalidArgumentError, match="concatenation so far"):
        kernel(x, w, None, None, np.zeros((1, 6, 5, 4), F32))
    with pytest.raises(InvalidArgumentError, match="do not fit"):
        kernel(x, rand(5, 3, 1, 1), None, None, np.zeros((1, 6, 4, 4), F32))


def _shuffle_model(groups: int, per_group: int, depthwise: bool = True, activation: bool = False):
    """ShuffleNet's channel shuffle (Reshape -> Transpose -> Reshape) of a convolution's output, read by
    a 3x3 depthwise convolution (or by a plain one)."""
    c = groups * per_group
    shape = (1, c, 9, 9)
    inits = {"w0": rand(c, 3, 1, 1), "split": np.array([1, groups, per_group, 9, 9], np.int64),
             "merge": np.array(shape, np.int64), "wd": rand(c, 1 if depthwise else c, 3, 3), "bd": rand(c)}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"]),
             helper.make_node("Reshape", ["c0", "split"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3, 4]),
             helper.make_node("Reshape", ["t", "merge"], ["s"]),
             helper.make_node("Conv", ["s", "wd", "bd"], ["d"], pads=[1, 1, 1, 1], strides=[2, 2],
                              group=c if depthwise else 1)]
    if activation:
        nodes.append(helper.make_node("Relu", ["d"], ["y"]))
    else:
        nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 9, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("activation", [False, True])
def test_a_depthwise_convolution_reads_through_a_channel_shuffle(monkeypatch, threads, activation, knobs):
    """The shuffle's copy goes: the depthwise loop reads each channel from where the shuffle would take
    it, also when its channels are split across threads: the same bits as the fused convolution of the
    shuffled tensor, and the unfused nodes' values (a FusedConv adds its bias after the convolution)."""

    knobs(threads=threads)
    knobs(split_elements=1)
    model = _shuffle_model(3, 4, activation=activation)
    x = rand(1, 3, 9, 9)
    session, (fused,) = _run(model, {"x": x})
    nodes = [(node.op_type, node.attrs.get("shuffle_shape")) for node in session.model.graph.nodes]
    assert nodes == [("Conv", None), ("FusedConv", [1, 3, 4, 9, 9])], nodes
    _, unfused = _run(_pin_intermediates(model), {"x": x})
    if activation:  # a FusedConv with an activation adds its bias after the convolution
        np.testing.assert_allclose(fused, unfused[0], rtol=1e-5, atol=1e-6)
    else:  # without, it is the Conv itself
        np.testing.assert_array_equal(fused, unfused[0])
    node = session.model.graph.nodes[1]
    plain = Node("FusedConv", node.inputs, node.outputs, name="plain", opset=1,
                 attrs={k: v for k, v in node.attrs.items() if k != "shuffle_shape"})
    (c0,) = _run_first_conv(model, x)
    shuffled = c0.reshape(1, 3, 4, 9, 9).transpose(0, 2, 1, 3, 4).reshape(1, 12, 9, 9)
    weights = [session.model.graph.initializers[name] for name in node.inputs[1:3]]
    (expected,) = conv_ops.fused_conv(plain, [None] * 3, 1)(shuffled, *weights)
    (through,) = conv_ops.fused_conv(node, [None] * 3, 1)(c0, *weights)
    np.testing.assert_array_equal(through, expected)
    np.testing.assert_array_equal(fused, expected)


def _run_first_conv(model, x):
    """The output of the model's first Conv (the shuffle's input)."""
    first = onnx.ModelProto()
    first.CopyFrom(model)
    del first.graph.node[1:]
    del first.graph.output[:]
    first.graph.output.extend([helper.make_tensor_value_info("c0", TensorProto.FLOAT, None)])
    return _run(first, {"x": x})[1]


def test_a_channel_shuffle_before_a_dense_convolution_stays():
    session, (y,) = _run(_shuffle_model(2, 3, depthwise=False), {"x": rand(1, 3, 9, 9)})
    assert not any(node.attrs.get("shuffle_shape") for node in session.model.graph.nodes)
    assert "Reshape" in [node.op_type for node in session.model.graph.nodes]  # the shuffle is still computed
    assert y.shape == (1, 6, 5, 5)


def test_a_shuffled_fused_conv_given_another_shape_shuffles_as_the_nodes_would():
    node = Node("FusedConv", ["x", "w"], ["y"], name="dw", opset=1,
                attrs={"kernel_shape": [1, 1], "group": 6, "shuffle_shape": [1, 2, 3, 4, 4]})
    kernel = conv_ops.fused_conv(node, [None] * 2, 1)
    w = rand(6, 1, 1, 1)
    x = rand(1, 6, 4, 4)
    (y,) = kernel(x, w)
    shuffled = x.reshape(1, 2, 3, 4, 4).transpose(0, 2, 1, 3, 4).reshape(1, 6, 4, 4)
    np.testing.assert_allclose(y, shuffled * w.reshape(1, 6, 1, 1), rtol=1e-6)
    with pytest.raises(ValueError, match="reshape"):  # Reshape's own error for a tensor that does not fit
        kernel(rand(2, 6, 4, 4), w)


def _dense_model(batch: int, layers: int = 3, branch: bool = False):
    """A DenseNet block: each layer's features (Relu -> 3x3 Conv, 2 channels) appended to all before them;
    the first concatenation is also a graph output. With ``branch``, it is appended to twice."""
    nodes, inits, so_far = [helper.make_node("MaxPool", ["x"], ["x0"], kernel_shape=[1, 1])], {}, "x0"
    channels = 3
    for k in range(layers):
        inits[f"w{k}"] = rand(2, channels, 3, 3)
        nodes += [helper.make_node("Relu", [so_far], [f"r{k}"]),
                  helper.make_node("Conv", [f"r{k}", f"w{k}"], [f"n{k}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Concat", [so_far, f"n{k}"], [f"c{k}"], axis=1)]
        so_far, channels = f"c{k}", channels + 2
    outputs = [so_far, "c0"]
    if branch:  # c0 appended to a second time: the chain must stop before c1
        inits["wb"] = rand(2, 5, 3, 3)
        nodes += [helper.make_node("Conv", ["c0", "wb"], ["nb"], pads=[1, 1, 1, 1]),
                  helper.make_node("Concat", ["c0", "nb"], ["cb"], axis=1)]
        outputs.append("cb")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 6, 6])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
                              initializer=[onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("branch", [False, True])
def test_dense_concats_append_into_one_tensor(batch, branch):
    """Each layer's convolution writes behind the features so far, which later layers read as views:
    the same bits as the Concats, the earlier concatenations (graph outputs) unchanged by later
    appends; a concatenation appended to twice keeps its own copies."""
    model = _dense_model(batch, branch=branch)
    x = rand(batch, 3, 6, 6)
    session, fused = _run(model, {"x": x})
    op_types = [node.op_type for node in session.model.graph.nodes]
    # Appended to twice, c0 ends its chain; c1's and cb's chains each copy it into a buffer of their own.
    assert op_types.count("ConcatBuffer") == (3 if branch else 1) and "Concat" not in op_types, op_types
    _, unfused = _run(_pin_intermediates(model), {"x": x})
    assert [y.shape for y in fused] == [(batch, 9, 6, 6), (batch, 5, 6, 6)] + ([(batch, 7, 6, 6)] if branch else [])
    for got, expected in zip(fused, unfused):
        np.testing.assert_array_equal(got, expected)


def test_an_appending_conv_given_a_plain_tensor_concatenates_it():
    node = Node("FusedConv", ["x", "w", "", "", "so_far"], ["y"], name="append", opset=1,
                attrs={"kernel_shape": [1, 1], "append": 1})
    kernel = conv_ops.fused_conv(node, [None] * 5, 1)
    x, w, so_far = rand(1, 3, 4, 4), rand(2, 3, 1, 1), rand(1, 5, 4, 4)
    (y,) = kernel(x, w, None, None, so_far)
    np.testing.assert_array_equal(y[:, :5], so_far)
    np.testing.assert_allclose(y[:, 5:], np.einsum("oc,nchw->nohw", w[:, :, 0, 0], x), rtol=1e-5, atol=1e-6)
    start_buffer = conv_ops.concat_buffer(Node("ConcatBuffer", ["x"], ["y"], attrs={"extra": 2}, opset=1), None, 1)
    (start,) = start_buffer(so_far)
    np.testing.assert_array_equal(start, so_far)
    (appended,) = kernel(x, w, None, None, start)
    assert appended.base is start.base  # written behind, not copied
    np.testing.assert_array_equal(appended, y)
    with pytest.raises(InvalidArgumentError, match="at least two dimensions"):
        start_buffer(rand(3))


def test_fusion_leaves_a_first_listed_providers_nodes_alone():
    # The sample device provider runs Relu and Add: listed first, it keeps them, so nothing is fused.
    model, _ = _fusion_model("add_relu")
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["SampleDeviceExecutionProvider", "CPUExecutionProvider"])
    conv, add, relu = session.model.graph.nodes
    assert (conv.op_type, add.op_type, relu.op_type) == ("Conv", "Add", "Relu")
    assert session.placement().as_dict()[relu.name] == "SampleDeviceExecutionProvider"


def test_fused_activation_rejects_an_unknown_kind():
    node = Node("FusedConv", ["x", "w"], ["y"], name="f", attrs={"activation": "Tanh"}, opset=1)
    with pytest.raises(InvalidGraphError, match="activation"):
        conv_ops.fused_conv(node, [None, None], 1)


# -- ConvTranspose -------------------------------------------------------------------------------

CONV_TRANSPOSE_CASES = [
    ((1, 3, 4, 5), (3, 2, 3, 3), {}),
    ((2, 2, 4, 3), (2, 3, 3, 2), {"strides": [2, 3], "pads": [1, 0, 0, 1]}),
    ((1, 2, 3, 3), (2, 2, 3, 3), {"strides": [2, 2], "output_padding": [1, 0]}),
    ((1, 2, 4, 4), (2, 1, 2, 3), {"dilations": [2, 1], "strides": [1, 2], "pads": [1, 1, 0, 0]}),
    ((1, 2, 3, 4), (2, 2, 3, 3), {"strides": [2, 2], "output_shape": [8, 9]}),
    ((1, 2, 3, 4), (2, 2, 3, 3), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 3, 4), (2, 2, 4, 3), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ((1, 3, 5), (3, 2, 4), {"strides": [2], "pads": [1, 2]}),
    ((1, 2, 2, 3, 2), (2, 2, 2, 2, 3), {"strides": [2, 1, 2]}),
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", CONV_TRANSPOSE_CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_transpose(x_shape, w_shape, attrs, with_bias):
    x, w = rand(*x_shape), rand(*w_shape)
    b = rand(w_shape[1]) if with_bias else None
    check("ConvTranspose", [x, w, b], attrs, 11)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_conv_transpose_groups(dtype):
    # The reference mishandles group > 1, so the oracle is one group=1 reference run per group.
    x, w, b = rand(2, 4, 3, 4, dtype=dtype), rand(4, 3, 3, 2, dtype=dtype), rand(6, dtype=dtype)
    attrs = {"strides": [2, 1], "pads": [1, 0, 0, 1]}
    parts = [
        reference("ConvTranspose", [x[:, 2 * g:2 * g + 2], w[2 * g:2 * g + 2], b[3 * g:3 * g + 3]], attrs, 22)[0]
        for g in range(2)
    ]
    check("ConvTranspose", [x, w, b], {**attrs, "group": 2}, 22, expected=[np.concatenate(parts, axis=1)])


# -- pooling -------------------------------------------------------------------------------------

POOL_CASES = [
    ((1, 2, 7, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 3, 8, 7), {"kernel_shape": [2, 3], "strides": [2, 1], "pads": [0, 1, 1, 0]}),
    ((1, 2, 8, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 2, 7, 8), {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1], "ceil_mode": 1}),
    ((1, 2, 7, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 6, 7), {"kernel_shape": [2, 3], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 7, 7), {"kernel_shape": [3, 2], "strides": [2, 1], "auto_pad": "VALID"}),
    ((1, 3, 10), {"kernel_shape": [3], "strides": [2], "pads": [1, 2]}),
    ((1, 2, 4, 5, 6), {"kernel_shape": [2, 2, 3], "strides": [2, 1, 2], "pads": [0, 1, 1, 1, 0, 1]}),
    ((1, 2, 5, 6), {"kernel_shape": [1, 1], "strides": [2, 2]}),
    ((1, 2, 5, 6), {"kernel_shape": [1, 1]}),
    # Stride-1 windows wider than the pads reach: border outputs of the flat folds with 3 and 1 taps inside.
    ((2, 3, 5, 6), {"kernel_shape": [5, 4], "pads": [2, 2, 2, 1]}),
    ((1, 2, 3, 1), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
]


@pytest.mark.parametrize("x_shape,attrs", POOL_CASES)
def test_max_pool(x_shape, attrs):
    check("MaxPool", [rand(*x_shape)], attrs, 12)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("x_shape,attrs", [
    ((2, 2, 7, 6), {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 1, 1, 0]}),
    ((1, 2, 9, 9), {"kernel_shape": [2, 2], "dilations": [2, 3], "strides": [1, 2]}),
    ((1, 2, 5, 4, 6), {"kernel_shape": [2, 2, 3], "strides": [2, 1, 2], "pads": [1, 0, 0, 0, 1, 1]}),
    ((1, 3, 9), {"kernel_shape": [3], "strides": [2], "ceil_mode": 1}),
])
def test_max_pool_indices(x_shape, attrs, storage_order):
    check("MaxPool", [rand(*x_shape)], {**attrs, "storage_order": storage_order}, 12, n_outputs=2)


def test_max_pool_dilated_borders():
    check("MaxPool", [rand(1, 2, 7, 8)], {"kernel_shape": [3, 3], "pads": [2, 2, 2, 2], "dilations": [2, 2]}, 12)


def test_max_pool_old_opset_dilations_and_int8():
    check("MaxPool", [rand(1, 2, 6, 6)], {"kernel_shape": [2, 2], "strides": [2, 2]}, 1)
    check("MaxPool", [rand(1, 2, 9, 8, dtype=F16)], {"kernel_shape": [2, 2], "dilations": [2, 2]}, 10)
    x = RNG.integers(-128, 127, (1, 2, 6, 7)).astype(np.int8)
    check("MaxPool", [x], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}, 12)


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("x_shape,attrs", POOL_CASES)
def test_average_pool(x_shape, attrs, count_include_pad):
    check("AveragePool", [rand(*x_shape)], {**attrs, "count_include_pad": count_include_pad}, 11)


def test_average_pool_dilations_and_dtypes():
    attrs = {"kernel_shape": [2, 3], "dilations": [2, 1], "pads": [1, 1, 0, 1], "count_include_pad": 1}
    check("AveragePool", [rand(1, 2, 7, 7)], attrs, 19)
    check("AveragePool", [rand(1, 2, 6, 6, dtype=F16)], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, 7)
    check("AveragePool", [rand(1, 2, 6, 5, dtype=F64)], {"kernel_shape": [2, 2], "strides": [2, 2]}, 1)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("x_shape,attrs", [POOL_CASES[0], POOL_CASES[1], POOL_CASES[4], POOL_CASES[7]])
def test_lp_pool(x_shape, attrs, p):
    check("LpPool", [rand(*x_shape)], {**attrs, "p": p}, 11)


def test_lp_pool_dilations_opset_18():
    attrs = {"kernel_shape": [2, 2], "dilations": [2, 2], "strides": [1, 2], "p": 1}
    check("LpPool", [rand(1, 2, 7, 8)], attrs, 18)


@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 2, 7), (1, 2, 3, 2, 4)])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_global_pools(shape, dtype):
    x = rand(*shape, dtype=dtype)
    axes = tuple(range(2, len(shape)))
    check("GlobalAveragePool", [x], {}, 1)
    # The reference GlobalMaxPool drops a dim of 1-D inputs; numpy states it directly.
    check("GlobalMaxPool", [x], {}, 22, expected=[x.max(axis=axes, keepdims=True)])
    for p, opset in ((2, 2), (3, 2), (1.0, 1)):  # GlobalLpPool-1 takes a float p
        expected = (np.abs(x.astype(F64)) ** p).sum(axis=axes, keepdims=True) ** (1 / p)
        check("GlobalLpPool", [x], {"p": p}, opset, expected=[expected.astype(dtype)])


def test_pool_rejects_bad_attributes():
    with pytest.raises(InvalidGraphError, match="kernel_shape"):
        ours("MaxPool", [rand(1, 1, 4, 4)], {}, 12)
    with pytest.raises(InvalidGraphError, match="storage_order"):
        ours("MaxPool", [rand(1, 1, 4, 4)], {"kernel_shape": [2, 2], "storage_order": 2}, 12, n_outputs=2)
    with pytest.raises(InvalidGraphError, match="dilations"):
        ours("AveragePool", [rand(1, 1, 4, 4)], {"kernel_shape": [2, 2], "dilations": [1]}, 19)
    with pytest.raises(InvalidArgumentError, match="smaller than"):
        ours("MaxPool", [rand(1, 1, 2, 2)], {"kernel_shape": [3, 3]}, 12)


# -- normalization -------------------------------------------------------------------------------


def _bn_inputs(shape, dtype=F32):
    c = shape[1]
    return [rand(*shape, dtype=dtype), rand(c, dtype=dtype), rand(c, dtype=dtype),
            rand(c, dtype=dtype), rand(c, dtype=dtype, low=0.1, high=2.0)]


@pytest.mark.parametrize("opset,attrs", [
    (1, {"is_test": 1, "consumed_inputs": [0, 0, 0, 1, 1]}),
    (6, {"is_test": 1, "epsilon": 1e-3}),
    (7, {"spatial": 1}),
    (9, {"momentum": 0.8}),
    (14, {"training_mode": 0}),
    (15, {"epsilon": 1e-2}),
])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 4), (1, 2, 3, 2, 2)])
def test_batch_normalization_inference(opset, attrs, shape):
    # The reference runs opset 6-13 in training mode whenever momentum is set; inference semantics
    # are the same in every version, so opset 15's reference (training_mode=0) is the oracle.
    inputs = _bn_inputs(shape)
    expected = reference("BatchNormalization", inputs, {"epsilon": attrs.get("epsilon", 1e-5)}, 15)
    check("BatchNormalization", inputs, attrs, opset, expected=expected)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 2, 40, 33), (3, 4)])
def test_fused_batchnorm_relu_special_values(shape):
    # The same values as BatchNormalization then Relu, NaN and infinities included.
    x, *stats = _bn_inputs(shape)
    x.flat[:4] = [np.nan, np.inf, -np.inf, 0.0]
    node = Node("FusedBatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="f",
                attrs={"activation": "Relu"}, opset=1)
    (fused,) = normalization.fused_batch_normalization(node, [None] * 5, 1)(x, *stats)
    (normalized,) = ours("BatchNormalization", [x, *stats], {}, 15)
    np.testing.assert_array_equal(fused, np.maximum(normalized, 0))
    assert np.isnan(fused.flat[0]) and (fused >= 0).sum() == fused.size - 1


def test_batch_normalization_half_and_training():
    check("BatchNormalization", _bn_inputs((2, 3, 4, 4), F16), {}, 15)
    attrs = {"training_mode": 1, "momentum": 0.7}
    check("BatchNormalization", _bn_inputs((3, 2, 4, 3)), attrs, 15, n_outputs=3)


def test_batch_normalization_training_outputs_before_14():
    # Opset 9 names its training outputs (mean, var, saved_mean, saved_var); the reference has no
    # such kernel, so the running stats come from opset 15's and the batch stats from numpy.
    inputs = _bn_inputs((3, 2, 4, 3))
    y, run_mean, run_var = reference("BatchNormalization", inputs, {"training_mode": 1}, 15, 3)
    x = inputs[0]
    expected = [y, run_mean, run_var, x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))]
    check("BatchNormalization", inputs, {}, 9, n_outputs=5, expected=expected)


def test_batch_normalization_inference_passes_running_stats_through():
    inputs = _bn_inputs((2, 3, 4))
    (y,) = reference("BatchNormalization", inputs, {}, 15)
    check("BatchNormalization", inputs, {}, 15, n_outputs=3, expected=[y, inputs[3], inputs[4]])
    check("BatchNormalization", inputs, {"is_test": 1}, 6, n_outputs=3, expected=[y, inputs[3], inputs[4]])


def test_batch_normalization_per_activation_before_9():
    # spatial=0 (opset 7): statistics and parameters per (C, D1, ...) activation.
    x, (s, b, m) = rand(2, 3, 4), (rand(3, 4) for _ in range(3))
    v = rand(3, 4, low=0.1, high=2.0)
    expected = (s * (x - m) / np.sqrt(v + 1e-5) + b).astype(F32)
    check("BatchNormalization", [x, s, b, m, v], {"spatial": 0}, 7, expected=[expected])


@pytest.mark.parametrize("opset", [1, 6, 22])
@pytest.mark.parametrize("shape,dtype", [((2, 3, 5, 4), F32), ((1, 2, 7), F16), ((1, 2, 3, 2, 4), F64)])
def test_instance_normalization(opset, shape, dtype):
    x, s, b = rand(*shape, dtype=dtype), rand(shape[1], dtype=dtype), rand(shape[1], dtype=dtype)
    check("InstanceNormalization", [x, s, b], {"epsilon": 1e-3}, opset, ref_opset=max(opset, 6))


@pytest.mark.parametrize("axis", [-1, 1, 0, -2])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_normalization(axis, with_bias):
    x = rand(2, 3, 4, 5)
    norm_shape = x.shape[axis % 4:]
    scale, bias = rand(*norm_shape), rand(*norm_shape) if with_bias else None
    check("LayerNormalization", [x, scale, bias], {"axis": axis, "epsilon": 1e-3}, 17, n_outputs=3)


def test_layer_normalization_half_and_broadcast_scale():
    x, scale, bias = rand(3, 4, 6, dtype=F16), rand(6, dtype=F16), rand(6, dtype=F16)
    check("LayerNormalization", [x, scale, bias], {}, 17)
    # Mean and InvStdDev are float32 (the stash type) whatever the input precision.
    _, mean, inv_std = ours("LayerNormalization", [x, scale, bias], {}, 17, n_outputs=3)
    assert mean.dtype == inv_std.dtype == np.float32 and mean.shape == (3, 4, 1)
    x, scale = rand(2, 3, 4), rand(1, 4)  # scale broadcasts over the normalized [3, 4]
    check("LayerNormalization", [x, scale], {"axis": 1}, 17)


@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize("shape,groups", [((2, 6, 4, 3), 3), ((1, 4, 5), 1), ((2, 4, 2, 2, 3), 4)])
def test_group_normalization(opset, shape, groups):
    params = groups if opset == 18 else shape[1]
    inputs = [rand(*shape), rand(params), rand(params)]
    check("GroupNormalization", inputs, {"num_groups": groups, "epsilon": 1e-3}, opset)


def test_group_normalization_rejects_uneven_groups():
    with pytest.raises(InvalidArgumentError, match="groups"):
        ours("GroupNormalization", [rand(1, 5, 3), rand(5), rand(5)], {"num_groups": 2}, 21)
    with pytest.raises(InvalidGraphError, match="num_groups"):
        ours("GroupNormalization", [rand(1, 4, 3), rand(4), rand(4)], {}, 21)


@pytest.mark.parametrize("opset", [1, 13])
@pytest.mark.parametrize("attrs", [
    {"size": 3}, {"size": 2, "alpha": 0.01, "beta": 0.5, "bias": 2.0}, {"size": 5, "alpha": 0.1},
])
def test_lrn(opset, attrs):
    # The reference loops over the batch dim where it means channels; with N == C it is right.
    check("LRN", [rand(5, 5, 3, 4)], attrs, opset, ref_opset=13)


def test_lrn_half_precision():
    check("LRN", [rand(4, 4, 3, 3, dtype=F16)], {"size": 3}, 13)


# -- Dropout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [7, 10, 12, 13, 22])
def test_dropout_inference(opset):
    x = rand(3, 4)
    check("Dropout", [x], {}, opset, n_outputs=2, expected=None if opset >= 10 else [x, np.ones_like(x)])
    check("Dropout", [x], {}, opset)


def test_dropout_old_opsets_and_training_mode():
    x = rand(2, 5)
    check("Dropout", [x], {"is_test": 1, "ratio": 0.3}, 1, expected=[x])
    check("Dropout", [x], {"ratio": 0.2}, 6, n_outputs=2, expected=[x, np.ones_like(x)])
    check("Dropout", [x, np.array(0.4, F32), np.array(False)], {}, 13, n_outputs=2)
    y, mask = ours("Dropout", [rand(50, 40), np.array(0.5, F32), np.array(True)], {"seed": 3}, 13, 2)
    assert mask.dtype == np.bool_ and 0.3 < mask.mean() < 0.7
    assert np.all(y[~mask] == 0)


# -- Flatten and the softmax family --------------------------------------------------------------


@pytest.mark.parametrize("opset,axis", [(1, 0), (1, 1), (9, 2), (11, -1), (13, 4), (21, -3)])
def test_flatten(opset, axis):
    check("Flatten", [rand(2, 3, 4, 5)], {"axis": axis}, opset)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("opset,attrs", [(1, {}), (11, {"axis": 2}), (11, {"axis": -1}), (13, {}),
                                         (13, {"axis": 0}), (13, {"axis": 1})])
def test_softmax_family(op, opset, attrs):
    x = rand(2, 3, 4, low=-5, high=5)
    expected = None
    if opset < 13:
        # Before opset 13 the input is coerced to 2-D at axis; the reference ignores that, so the
        # oracle is opset 13's reference over the coerced matrix.
        axis = attrs.get("axis", 1) % x.ndim
        flat = x.reshape(math.prod(x.shape[:axis]), -1)
        expected = [reference(op, [flat], {"axis": 1}, 13)[0].reshape(x.shape)]
    check(op, [x], attrs, opset, expected=expected)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
def test_softmax_family_half_and_ties(op):
    check(op, [rand(3, 5, dtype=F16, low=-3, high=3)], {}, 13)
    x = np.array([[1, 3, 3, 0], [2, 2, 2, 2]], F32)  # Hardmax marks the first maximum
    check(op, [x], {"axis": 1}, 11)


@pytest.mark.parametrize("opset,shape", [(13, (2, 1000)), (13, (3, 4, 7)), (11, (1, 1000, 1, 1)), (13, (5, 1))])
def test_small_float32_softmax_runs_one_compiled_call(monkeypatch, opset, shape):
    """A CNN's closing Softmax: one compiled pass per row (the largest non-NaN value, the vectorized exp and
    the sum, the scaling) within float32 rounding of the exact formula; NaN and infinities as numpy's."""
    from onnx_runtime_ep_cpu.compiled import transformer

    calls = []
    real = transformer.softmax_rows_float32_
    monkeypatch.setattr(transformer, "softmax_rows_float32_", lambda x, y: calls.append(x.shape) or real(x, y))
    x = (RNG.standard_normal(shape) * 6).astype(F32)
    flat = x.reshape(-1, x.shape[-1]) if opset >= 13 else x.reshape(x.shape[0], -1)
    flat[0, :3] = [np.nan, 1.0, 2.0][: flat.shape[1]]
    if flat.shape[0] > 2:
        flat[1] = -np.inf
        flat[2, 0] = np.inf
    node = Node("Softmax", ["x"], ["y"], attrs={}, opset=opset)
    (y,) = lookup("Softmax", "", opset)(node, [x.shape], opset)(x)
    with np.errstate(invalid="ignore"):  # (inf - inf: NaN rows, as the formula gives)
        exact = np.exp(flat.astype(np.float64) - np.fmax.reduce(flat, axis=1, keepdims=True))
        exact /= exact.sum(axis=1, keepdims=True)
    assert calls and y.dtype == F32 and y.shape == x.shape
    np.testing.assert_allclose(y.reshape(flat.shape), exact, rtol=3e-6, atol=1e-12)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [F32, F16, F64])
def test_gelu(approximate, dtype):
    x = np.concatenate([rand(40, dtype=dtype, low=-6, high=6), np.array([0, -0.0, 1e-30, 7, -9], dtype)])
    expected = None
    if dtype == F64 and approximate == "none":
        # The reference's Erf rounds through float32; float64 Gelu must be exact to double precision.
        expected = [np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])]
    check("Gelu", [x], {"approximate": approximate}, 20, expected=expected)


def test_erf_is_accurate_in_float64_and_float32():
    from onnx_runtime_ep_cpu.algorithms.erf import erf_float32, erf_float64

    x = np.concatenate([np.linspace(-7, 7, 20001), [0.0, 1e-300, -1e-10, np.inf, -np.inf]])
    expected = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(erf_float64(x), expected, rtol=1e-14, atol=1e-15)
    assert np.isnan(erf_float64(np.array([np.nan])))[0]
    # The Erf operator's float64 path is this one; its float32 path stays within float32 precision.
    erf = lookup("Erf", "", 13)(Node("Erf", ["x"], ["y"], name="erf", opset=13), [x.shape], 13)
    np.testing.assert_array_equal(erf(x)[0], erf_float64(x))
    np.testing.assert_allclose(erf_float32(x.astype(np.float32)), expected, atol=4e-7)


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(InvalidGraphError, match="approximate"):
        ours("Gelu", [rand(3)], {"approximate": "fast"}, 20)


# -- linalg --------------------------------------------------------------------------------------


@pytest.mark.parametrize("a_shape,b_shape", [
    ((3, 4), (4, 5)), ((4,), (4, 2)), ((3, 4), (4,)), ((4,), (4,)),
    ((2, 1, 3, 4), (5, 4, 6)), ((2, 3, 4), (4, 2)),
])
@pytest.mark.parametrize("opset", [1, 13])
def test_matmul(a_shape, b_shape, opset):
    check("MatMul", [rand(*a_shape), rand(*b_shape)], {}, opset)


def test_matmul_dtypes():
    check("MatMul", [rand(2, 3, 8, dtype=F16), rand(8, 4, dtype=F16)], {}, 13)
    a, b = RNG.integers(-9, 9, (3, 4)).astype(np.int64), RNG.integers(-9, 9, (4, 2)).astype(np.int64)
    check("MatMul", [a, b], {}, 13)


@pytest.mark.parametrize("c_shape", [None, (3, 5), (5,), (1, 5), (3, 1), ()])
@pytest.mark.parametrize("attrs", [{}, {"transA": 1}, {"transB": 1, "alpha": 0.5},
                                   {"transA": 1, "transB": 1, "alpha": 2.0, "beta": -1.5}])
def test_gemm(c_shape, attrs):
    a = rand(4, 3) if attrs.get("transA") else rand(3, 4)
    b = rand(5, 4) if attrs.get("transB") else rand(4, 5)
    c = None if c_shape is None else rand(*c_shape)
    check("Gemm", [a, b, c], attrs, 13)


def test_gemm_old_opsets():
    a, b, c = rand(3, 4), rand(4, 5), rand(5)
    check("Gemm", [a, b, c], {"broadcast": 1, "beta": 2.0}, 6)
    check("Gemm", [a, b, rand(3, 5)], {"alpha": 0.5}, 1, ref_opset=6)  # no reference Gemm-1
    check("Gemm", [a, b, c], {"transA": 0}, 7)
    check("Gemm", [a.astype(F16), b.astype(F16), c.astype(F16)], {}, 11)
    with pytest.raises(InvalidArgumentError, match="broadcast"):
        ours("Gemm", [a, b, c], {}, 6)


@pytest.mark.parametrize("a_dtype,b_dtype", [(np.uint8, np.uint8), (np.int8, np.int8), (np.uint8, np.int8)])
@pytest.mark.parametrize("zero_points", ["none", "scalar", "vector"])
def test_matmul_integer(a_dtype, b_dtype, zero_points):
    def ints(dtype, *shape):
        info = np.iinfo(dtype)
        return RNG.integers(info.min, info.max, shape, endpoint=True).astype(dtype)

    a, b = ints(a_dtype, 2, 3, 6), ints(b_dtype, 6, 4)
    azp = bzp = None
    if zero_points == "scalar":
        azp, bzp = ints(a_dtype), ints(b_dtype)
    elif zero_points == "vector":
        azp, bzp = ints(a_dtype, 3), ints(b_dtype, 4)
        # The reference subtracts a vector zero point of A along K; A's zero point is per row.
        a32, b32 = a.astype(np.int32) - azp.astype(np.int32)[:, None], b.astype(np.int32) - bzp
        check("MatMulInteger", [a, b, azp, bzp], {}, 10, expected=[a32 @ b32])
        return
    check("MatMulInteger", [a, b, azp, bzp], {}, 10)


@pytest.mark.parametrize("equation,shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij, bjk -> bik", [(2, 3, 4), (2, 4, 5)]),
    ("ii->i", [(4, 4)]),
    ("i,i", [(5,), (5,)]),
    ("...ij->...ji", [(2, 3, 4, 5)]),
    ("ij,jk", [(3, 4), (4, 2)]),
    ("bhid,bhjd->bhij", [(1, 2, 3, 4), (1, 2, 5, 4)]),
    ("Ab,bc->cA", [(2, 3), (3, 4)]),
])
@pytest.mark.parametrize("opset", [12, 28])
def test_einsum(equation, shapes, opset):
    check("Einsum", [rand(*s) for s in shapes], {"equation": equation}, opset, ref_opset=12)


def test_einsum_dtypes_and_errors():
    check("Einsum", [rand(3, 4, dtype=F16), rand(4, 2, dtype=F16)], {"equation": "ij,jk->ik"}, 12)
    a, b = RNG.integers(-5, 5, (3, 4)).astype(np.int32), RNG.integers(-5, 5, (4,)).astype(np.int32)
    check("Einsum", [a, b], {"equation": "ij,j->i"}, 12)
    with pytest.raises(InvalidGraphError, match="equation"):
        ours("Einsum", [rand(2)], {}, 12)
