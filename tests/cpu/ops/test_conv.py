"""Conv, the fused convolutions of conv_fusions.py (bias, residual, activation, into a Concat, through a
channel shuffle, appending to a DenseNet block) and ConvTranspose."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from node_reference import F16, F32, F64, check, ours, rand, reference
from onnx import TensorProto, helper
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.algorithms import conv_blas, window
from onnx_runtime_ep_cpu.ops import conv as conv_ops
from onnx_runtime_ep_cpu.ops import normalization
from reference64 import assert_within, gamma, run_float64

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
    elem = model.graph.input[0].type.tensor_type.elem_type  # the model's one element type (float or double)
    for node in pinned.graph.node[:-1]:
        pinned.graph.output.extend(helper.make_tensor_value_info(name, elem, None) for name in node.output)
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
    nodes = _nodes(session.model.graph)  # (a segment's, where the convolutions run in one)
    op_types = [node.op_type for node in nodes]
    assert "Concat" not in op_types and op_types.count("FusedConv") == 3, op_types
    assert [n.attrs.get("concat_offset") for n in nodes if n.op_type == "FusedConv"] == [0, 4, 9]
    _, unfused = _run(_pin_intermediates(model), {"x": x})
    assert fused.shape == (batch, 11, 7, 7)
    if dtype == TensorProto.FLOAT:
        exact, bound = _exact(model, {"x": x}), _error_bound(model, {"x": x})
        assert_within(fused, exact, bound, "fused")
        assert_within(unfused[0], exact, bound, "unfused")
    else:
        np.testing.assert_allclose(fused, unfused[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], fused)  # again: a fresh tensor, same values


def _nodes(graph):
    """The graph's nodes, a FusedSegment (segment_fusions.py) as the nodes of its body."""
    return [n for node in graph.nodes for n in (node.attr("body").nodes if node.op_type == "FusedSegment" else [node])]


def test_a_concat_input_read_elsewhere_keeps_the_concat():
    session, (y, r3) = _run(_concat_model(1, extra_reader=True), {"x": rand(1, 3, 7, 7)})
    assert "Concat" in [node.op_type for node in _nodes(session.model.graph)]
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
    knobs(split_depthwise_macs=1)
    monkeypatch.setenv("ONNX_RUNTIME_SEGMENTS", "0")  # (a segment would take both convolutions and the shuffle)
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
    assert not any(node.attrs.get("shuffle_shape") for node in _nodes(session.model.graph))
    assert "Reshape" in [node.op_type for node in _nodes(session.model.graph)]  # the shuffle is still computed
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
def test_dense_concats_append_into_one_tensor(batch, branch, monkeypatch):
    """Each layer's convolution writes behind the features so far, which later layers read as views:
    the same bits as the Concats, the earlier concatenations (graph outputs) unchanged by later
    appends; a concatenation appended to twice keeps its own copies. (Segments off: one takes concatenations
    this small, test_segment_concat_parts.py.)"""
    monkeypatch.setenv("ONNX_RUNTIME_SEGMENTS", "0")
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
