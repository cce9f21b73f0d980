"""The decoder-step kernels and fusions: compiled RMS normalization and rotate-half rotary embedding
against the numpy paths, and the decoder fusions (residual add + RMS norm, Swish * gate, Reshape/Transpose
pairs) with the unfused results. Other dtypes keep the numpy kernels."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, record_results, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms.products import gemv_host
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import fused, transformer, transformer_blocks
from reference64 import assert_within, gamma

RNG = np.random.default_rng(0)


def _ops(sess):
    return [n.op_type for n in sess.placement()]


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["cpu"])


def _rms_reference(x, w, eps):
    """RMS normalization over the last axis in float64."""
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w.astype(np.float64)


def _rms_kernel(**attrs):
    return transformer_blocks.rms_normalization(Node("RMSNormalization", ["x", "w"], ["y"], attrs=attrs), [None, None],
                                                23)


# -- RMSNormalization ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 7), (2, 3, 8), (4, 9), (1, 1000), (5, 1)])
def test_rms_norm_loop_matches_the_numpy_formula(dtype, shape):
    x = (RNG.standard_normal(shape) * 3).astype(dtype)
    w = RNG.standard_normal(shape[-1:]).astype(dtype)
    kernel = _rms_kernel(epsilon=1e-5, stash_type=1 if dtype == np.float32 else 11)
    got = kernel(x, w)[0]
    assert got.dtype == dtype and got.shape == shape
    rtol = 2e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(got, _rms_reference(x, w, 1e-5), rtol=rtol, atol=rtol)
    # A transposed (non-contiguous) input, and rows strided in memory, give the same rows.
    xt = np.ascontiguousarray(np.swapaxes(x, 0, -2)) if x.ndim >= 2 else x
    np.testing.assert_array_equal(kernel(np.swapaxes(xt, 0, -2), w)[0], got)
    spaced = np.repeat(x, 2, axis=0)[::2]
    np.testing.assert_array_equal(kernel(spaced, w)[0], got)


@pytest.mark.parametrize("dtype,stash,axis", [(np.float16, 1, -1), (np.float64, 1, -1), (np.float32, 1, 1)])
def test_rms_norm_other_dtypes_and_axes_keep_the_numpy_path(dtype, stash, axis):
    x = RNG.standard_normal((2, 3, 4)).astype(dtype)
    w = RNG.standard_normal((3, 4) if axis == 1 else (4,)).astype(dtype)
    got = _rms_kernel(epsilon=1e-5, stash_type=stash, axis=axis)(x, w)[0]
    x64 = x.astype(np.float64)
    axes = (1, 2) if axis == 1 else (2,)
    want = x64 / np.sqrt((x64 * x64).mean(axes, keepdims=True) + 1e-5) * w
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3 if dtype == np.float16 else 1e-5, atol=1e-3)


# -- SkipRMSNormalization: Add then RMSNormalization -----------------------------------------------


def _skip_rms_model(shape_a, shape_b, elem=TensorProto.FLOAT, eps=1e-6):
    w = numpy_helper.from_array(np.linspace(0.5, 1.5, shape_a[-1]).astype(helper.tensor_dtype_to_np_dtype(elem)), "w")
    nodes = [
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("RMSNormalization", ["s", "w"], ["y"], axis=-1, epsilon=eps),
        helper.make_node("Neg", ["s"], ["residual"]),  # the sum has a reader of its own
    ]
    inputs = [tensor_info("a", elem, list(shape_a)), tensor_info("b", elem, list(shape_b))]
    return make_model(nodes, inputs, [tensor_info("y", elem), tensor_info("residual", elem)], [w], opset=23)


@pytest.mark.parametrize("shape", [(1, 1, 256), (2, 5, 24), (3, 13)])
def test_residual_add_and_rms_norm_become_one_node(shape):
    sess = _session(_skip_rms_model(shape, shape))
    assert _ops(sess) == ["SkipRMSNormalization", "Neg"]
    a, b = (RNG.standard_normal(shape).astype(np.float32) for _ in range(2))
    y, residual = sess.run(None, {"a": a, "b": b})
    np.testing.assert_array_equal(residual, -(a + b))
    w = np.linspace(0.5, 1.5, shape[-1]).astype(np.float32)
    np.testing.assert_allclose(y, _rms_reference(a + b, w, 1e-6), rtol=2e-6, atol=2e-6)
    # The same norm as the RMSNormalization kernel's compiled pass over the sum.
    np.testing.assert_array_equal(y, _rms_kernel(epsilon=1e-6)(a + b, w)[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_skip_rms_norm_kernel_on_strided_inputs(dtype):
    node = Node("SkipRMSNormalization", ["a", "b", "w"], ["y", "s"], domain=FUSED_DOMAIN,
                attrs={"epsilon": 1e-5, "stash_type": 1 if dtype == np.float32 else 11})
    kernel = fused.skip_rms_normalization(node, [None] * 3, 1)
    a, b = (RNG.standard_normal((3, 5, 16)).astype(dtype) for _ in range(2))
    w = RNG.standard_normal(16).astype(dtype)
    y, total = kernel(a, b, w)
    np.testing.assert_array_equal(total, a + b)
    np.testing.assert_array_equal(y, _rms_kernel(epsilon=1e-5, stash_type=node.attrs["stash_type"])(a + b, w)[0])
    strided = kernel(np.repeat(a, 2, axis=1)[:, ::2], b.transpose(1, 0, 2).copy().transpose(1, 0, 2), w)
    np.testing.assert_array_equal(strided[0], y)
    np.testing.assert_array_equal(strided[1], total)


def test_skip_rms_norm_in_half_precision_takes_the_numpy_path():
    shape = (2, 3, 8)
    sess = _session(_skip_rms_model(shape, shape, TensorProto.FLOAT16))
    assert _ops(sess) == ["SkipRMSNormalization", "Neg"]
    a, b = (RNG.standard_normal(shape).astype(np.float16) for _ in range(2))
    y, residual = sess.run(None, {"a": a, "b": b})
    assert y.dtype == np.float16
    np.testing.assert_array_equal(residual, -(a + b))
    w = np.linspace(0.5, 1.5, 8).astype(np.float16)
    np.testing.assert_array_equal(y, _rms_kernel(epsilon=1e-6)(a + b, w)[0])


def test_broadcasting_add_takes_the_numpy_path():
    sess = _session(_skip_rms_model((2, 3, 8), (1, 1, 8)))
    assert _ops(sess) == ["SkipRMSNormalization", "Neg"]
    a, b = RNG.standard_normal((2, 3, 8)).astype(np.float32), RNG.standard_normal((1, 1, 8)).astype(np.float32)
    y, residual = sess.run(None, {"a": a, "b": b})
    np.testing.assert_array_equal(residual, -(a + b))
    w = np.linspace(0.5, 1.5, 8).astype(np.float32)
    np.testing.assert_array_equal(y, _rms_kernel(epsilon=1e-6)(a + b, w)[0])


def test_rms_norm_over_more_than_the_last_axis_stays_unfused():
    model = _skip_rms_model((2, 3, 8), (2, 3, 8))
    model.graph.node[1].attribute[0].i = 1  # axis=1: normalize over the last two axes
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ones((3, 8), np.float32), "w"))
    sess = _session(model)
    assert _ops(sess) == ["Add", "RMSNormalization", "Neg"]


# -- SwishMul: Swish(a) * b ------------------------------------------------------------------------


def _swish_mul_model(shape, extra_outputs=(), elem=TensorProto.FLOAT):
    nodes = [
        helper.make_node("Sigmoid", ["g"], ["sg"]),
        helper.make_node("Mul", ["g", "sg"], ["silu"]),  # fusions.py makes this Swish
        helper.make_node("Mul", ["silu", "u"], ["y"]),
    ]
    inputs = [tensor_info("g", elem, list(shape)), tensor_info("u", elem, list(shape))]
    return make_model(nodes, inputs, [tensor_info(n, elem) for n in ("y", *extra_outputs)], opset=17)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("size", [40, fused._SWISH_MUL_COMPILED_SIZE, fused._SWISH_MUL_COMPILED_SIZE + 1])
def test_swish_times_gate_becomes_one_node_with_the_unfused_results(dtype, size):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    shape = (1, 1, size)
    sess = _session(_swish_mul_model(shape, elem=elem))
    assert _ops(sess) == ["SwishMul"]
    unfused = _session(_swish_mul_model(shape, ("silu",), elem=elem))  # reading silu blocks the fusion
    assert _ops(unfused) == ["Swish", "Mul"]
    g = (RNG.standard_normal(shape) * 40).astype(dtype)  # exp overflows for the most negative
    u = RNG.standard_normal(shape).astype(dtype)
    got = sess.run(None, {"g": g, "u": u})[0]
    want = unfused.run(None, {"g": g, "u": u})[0]
    assert got.dtype == dtype
    if dtype == np.float16 or (size > fused._SWISH_MUL_COMPILED_SIZE and dtype == np.float64):
        np.testing.assert_array_equal(got, want)  # numpy: Swish's and Mul's operations, in their order
    elif dtype == np.float32:  # a compiled pass on one side at least (a float32 Swish is compiled/silu.py's at
        # every size): the vectorized sigmoid, whose exp is 0 below -87 (where Swish(g) = g * e^g is under 1e-35)
        np.testing.assert_allclose(got, want, rtol=4 * np.finfo(dtype).eps, atol=1e-35)
    else:  # the compiled pass: libm's exp instead of numpy's
        np.testing.assert_allclose(got, want, rtol=4 * np.finfo(dtype).eps, atol=np.finfo(dtype).tiny)
    assert np.isfinite(got).all()


def test_swish_mul_broadcasts_the_gate():
    kernel = fused.swish_mul(Node("SwishMul", ["a", "b"], ["y"], domain=FUSED_DOMAIN, attrs={"alpha": 0.5}),
                             [None, None], 1)
    a = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    b = RNG.standard_normal((1, 3, 1)).astype(np.float32)
    want = a / (1 + np.exp(-np.float32(0.5) * a)) * b
    np.testing.assert_array_equal(kernel(a, b)[0], want)
    big = RNG.standard_normal((5, 2, 3, 4)).astype(np.float32)  # b larger than a: the output grows
    np.testing.assert_array_equal(kernel(a, big)[0], a / (1 + np.exp(-np.float32(0.5) * a)) * big)


# -- ReshapeTranspose / TransposeReshape -----------------------------------------------------------


def _heads_model(shape_value, perm, x_shape, first="Reshape"):
    shape = numpy_helper.from_array(np.asarray(shape_value, np.int64), "shape")
    perm_attrs = {} if perm is None else {"perm": perm}
    if first == "Reshape":
        nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Transpose", ["r"], ["y"],
                                                                                       **perm_attrs)]
    else:
        nodes = [helper.make_node("Transpose", ["x"], ["t"], **perm_attrs),
                 helper.make_node("Reshape", ["t", "shape"], ["y"])]
    return make_model(nodes, [tensor_info("x", shape=list(x_shape))], [tensor_info("y")], [shape], opset=17)


@pytest.mark.parametrize("shape_value,perm,x_shape", [
    ([1, 3, 4, 8], [0, 2, 1, 3], (1, 3, 32)),  # split heads: (B, S, H*D) -> (B, H, S, D)
    ([0, 0, 4, -1], [0, 2, 1, 3], (2, 3, 32)),  # 0 copies a dimension, -1 infers one
    ([6, 16], None, (3, 32)),  # no perm: reverse the axes
])
def test_reshape_then_transpose_becomes_one_node(shape_value, perm, x_shape):
    sess = _session(_heads_model(shape_value, perm, x_shape))
    assert _ops(sess) == ["ReshapeTranspose"]
    x = RNG.standard_normal(x_shape).astype(np.float32)
    target = [x.shape[i] if d == 0 else d for i, d in enumerate(shape_value)]
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.transpose(x.reshape(target), perm))


@pytest.mark.parametrize("shape_value,perm,x_shape", [
    ([1, 3, 32], [0, 2, 1, 3], (1, 4, 3, 8)),  # merge heads: (B, H, S, D) -> (B, S, H*D)
    ([0, 0, -1], [0, 2, 1, 3], (2, 4, 3, 8)),
    ([-1], None, (3, 4)),
])
def test_transpose_then_reshape_becomes_one_node(shape_value, perm, x_shape):
    sess = _session(_heads_model(shape_value, perm, x_shape, first="Transpose"))
    assert _ops(sess) == ["TransposeReshape"]
    x = RNG.standard_normal(x_shape).astype(np.float32)
    t = np.transpose(x, perm)
    target = [t.shape[i] if d == 0 else d for i, d in enumerate(shape_value)]
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], t.reshape(target))


def test_reshape_with_a_computed_shape_stays_unfused():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0])]
    sess = _session(make_model(nodes, [tensor_info("x", shape=["n", 4])], [tensor_info("y")]))  # no folding
    assert "ReshapeTranspose" not in _ops(sess)
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x.T)


# -- RotateHalfEmbedding ---------------------------------------------------------------------------


def _rotate_kernel(half, end):
    node = Node("RotateHalfEmbedding", ["q", "cos", "sin"], ["y"], domain=FUSED_DOMAIN,
                attrs={"half": half, "end": end})
    return fused.rotate_half_embedding(node, [None] * 3, 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("half,end", [(4, 8), (3, 8), (5, 8), (0, 8)])
@pytest.mark.parametrize("table_shape", [(5, 8), (1, 1, 5, 8), (2, 1, 5, 8), (2, 3, 5, 8), (1, 3, 1, 8)])
def test_rotate_half_loop_matches_the_numpy_path(dtype, half, end, table_shape):
    q = RNG.standard_normal((2, 3, 5, 8)).astype(dtype)
    cos, sin = (RNG.standard_normal(table_shape).astype(dtype) for _ in range(2))
    got = _rotate_kernel(half, end)(q, cos, sin)[0]
    want = fused._rotate_half_numpy(q, cos, sin, half, end)
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-14, atol=1e-6)
    # As the kernel sees a transposed q (heads split from a projection), or strided rows: the same values.
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(_rotate_kernel(half, end)(qt, cos, sin)[0], got)
    np.testing.assert_array_equal(_rotate_kernel(half, end)(np.repeat(q, 2, axis=0)[::2], cos, sin)[0], got)


@pytest.mark.parametrize("q_shape,table_shape,end,dtype", [
    ((2, 5, 10), (5, 8), 8, np.float32),  # the rotation covers part of the last axis only... (numpy path)
    ((5, 8), (2, 5, 8), 8, np.float32),  # tables broadcast q up
    ((2, 5, 8), (5, 1), 8, np.float32),  # a table broadcast along the last axis
    ((2, 5, 8), (5, 8), 8, np.float16),  # half precision
])
def test_rotate_half_other_cases_keep_the_numpy_path(q_shape, table_shape, end, dtype):
    q = RNG.standard_normal(q_shape).astype(dtype)
    cos, sin = (RNG.standard_normal(table_shape).astype(dtype) for _ in range(2))
    kernel = _rotate_kernel(4, end)
    if q_shape[-1] != end:
        with pytest.raises(ValueError):  # q * cos does not broadcast, as in the unfused graph
            kernel(q, cos, sin)
        return
    got = kernel(q, cos, sin)[0]
    np.testing.assert_array_equal(got, fused._rotate_half_numpy(q, cos, sin, 4, end))
    assert got.dtype == dtype


# -- a decoder step's attention block: every fused output typed, results as the unfused math ---------------


def _rotate_half_nodes(x, out):
    """The rotation with the half size computed from x's shape, as torch exports it: shape inference
    then cannot tell the slices' shapes (constant folding later can)."""
    return [
        helper.make_node("Mul", [x, "cos"], [f"{out}_c"]),
        helper.make_node("Shape", [x], [f"{out}_size"], start=-1),
        helper.make_node("Div", [f"{out}_size", "two"], [f"{out}_half"]),
        helper.make_node("Slice", [x, "zero", f"{out}_half", "last"], [f"{out}_lo"]),
        helper.make_node("Slice", [x, f"{out}_half", "full", "last"], [f"{out}_hi"]),
        helper.make_node("Neg", [f"{out}_hi"], [f"{out}_nhi"]),
        helper.make_node("Concat", [f"{out}_nhi", f"{out}_lo"], [f"{out}_rot"], axis=-1),
        helper.make_node("Mul", [f"{out}_rot", "sin"], [f"{out}_s"]),
        helper.make_node("Add", [f"{out}_c", f"{out}_s"], [out]),
    ]


def _heads_nodes(name):
    return [
        helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}_proj"]),
        helper.make_node("Reshape", [f"{name}_proj", "split"], [f"{name}_split"]),
        helper.make_node("Transpose", [f"{name}_split"], [f"{name}_heads"], perm=[0, 2, 1, 3]),
    ]


def _attention_block_model(weights, extra_outputs=()):
    nodes = [*_heads_nodes("q"), *_heads_nodes("k"), *_heads_nodes("v"),
             *_rotate_half_nodes("q_heads", "q_rot"), *_rotate_half_nodes("k_heads", "k_rot"),
             helper.make_node("Concat", ["past_k", "k_rot"], ["present_k"], axis=2),
             helper.make_node("Concat", ["past_v", "v_heads"], ["present_v"], axis=2),
             helper.make_node("Attention", ["q_rot", "present_k", "present_v"], ["att"]),
             helper.make_node("Transpose", ["att"], ["att_t"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["att_t", "merge"], ["y"])]
    inits = [numpy_helper.from_array(w, f"w{n}") for n, w in weights.items()]
    inits += [numpy_helper.from_array(np.asarray(v, np.int64), n) for n, v in (
        ("split", [1, 1, 2, 8]), ("merge", [1, 1, 16]), ("zero", [0]), ("two", [2]), ("full", [8]), ("last", [-1]))]
    inputs = [tensor_info("x", shape=[1, 1, 16]), tensor_info("cos", shape=[1, 1, 1, 8]),
              tensor_info("sin", shape=[1, 1, 1, 8]), tensor_info("past_k", shape=[1, 2, 3, 8]),
              tensor_info("past_v", shape=[1, 2, 3, 8])]
    outputs = [tensor_info("y"), *(tensor_info(n, shape=[1, 2, 4, 8]) for n in ("present_k", "present_v"))]
    outputs += [tensor_info(n) for n in extra_outputs]
    return make_model(nodes, inputs, outputs, inits, opset=23)


def test_attention_block_fuses_types_its_outputs_and_keeps_the_results():
    weights = {n: RNG.standard_normal((16, 16)).astype(np.float32) for n in "qkv"}
    sess = _session(_attention_block_model(weights))
    # (q, k and v of one input as one ProjectionGroup that splits their heads itself: projection_groups.py; the
    # cache appends, attention and head merge as one PastAttention: past_attention.py)
    assert sorted(_ops(sess)) == ["PastAttention", "ProjectionGroup", "RotateHalfEmbedding", "RotateHalfEmbedding"]
    assert "CPUExecutionProvider:infer_fused_types" in sess.applied_passes()
    graph = sess.model.graph
    for name, shape in (("q_rot", (1, 2, 1, 8)), ("k_rot", (1, 2, 1, 8)), ("y", (1, 1, 16))):
        assert graph.type_of(name).static_shape == shape, name

    feeds = {"x": RNG.standard_normal((1, 1, 16)), "cos": RNG.standard_normal((1, 1, 1, 8)),
             "sin": RNG.standard_normal((1, 1, 1, 8)), "past_k": RNG.standard_normal((1, 2, 3, 8)),
             "past_v": RNG.standard_normal((1, 2, 3, 8))}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    y, present_k, present_v = sess.run(None, feeds)

    # The exact (float64) values, and float32's error bounds for the projections and the rotation.
    exact = {k: v.astype(np.float64) for k, v in feeds.items()}

    def heads(x, w):
        return (x @ w.astype(np.float64)).reshape(1, 1, 2, 8).transpose(0, 2, 1, 3)

    def rotate(t, cos, sin, sign=-1):
        return t * cos + np.concatenate((sign * t[..., 4:], t[..., :4]), -1) * sin

    def projection_bound(name):
        return gamma(16) * heads(np.abs(exact["x"]), np.abs(weights[name]))

    def rotated_bound(name):  # the projection's error carried through the rotation, plus its own roundings
        cos, sin = np.abs(exact["cos"]), np.abs(exact["sin"])
        return rotate(projection_bound(name), cos, sin, 1) + gamma(3) * rotate(
            np.abs(heads(exact["x"], weights[name])), cos, sin, 1)

    k = np.concatenate((exact["past_k"], rotate(heads(exact["x"], weights["k"]), exact["cos"], exact["sin"])), axis=2)
    v = np.concatenate((exact["past_v"], heads(exact["x"], weights["v"])), axis=2)
    scores = rotate(heads(exact["x"], weights["q"]), exact["cos"], exact["sin"]) @ k.swapaxes(-1, -2) / np.sqrt(8)
    weights_ = np.exp(scores - scores.max(-1, keepdims=True))
    att = (weights_ / weights_.sum(-1, keepdims=True)) @ v
    assert_within(present_k[:, :, :3], k[:, :, :3], 0, "present_k, past")
    assert_within(present_k[:, :, 3:], k[:, :, 3:], rotated_bound("k"), "present_k, new")
    assert_within(present_v[:, :, :3], v[:, :, :3], 0, "present_v, past")
    assert_within(present_v[:, :, 3:], v[:, :, 3:], projection_bound("v"), "present_v, new")
    np.testing.assert_allclose(y, att.transpose(0, 2, 1, 3).reshape(1, 1, 16), rtol=1e-5, atol=1e-5)


# -- Unsqueeze and Concat: per-call work done once -----------------------------------------------------


def test_unsqueeze_follows_changing_axes_and_shapes():
    from onnx_runtime_ep_cpu.ops import view

    kernel = view.unsqueeze(Node("Unsqueeze", ["x", "axes"], ["y"]), [None, None], 13)
    x = np.zeros((2, 3), np.float32)
    cases = [(x, [1], (2, 1, 3)), (x, [1], (2, 1, 3)), (x, [-1, 0], (1, 2, 3, 1)), (x[:1], [-1, 0], (1, 1, 3, 1)),
             (x, np.array([1], np.int32), (2, 1, 3))]
    for value, axes, want in cases:
        axes = axes if isinstance(axes, np.ndarray) else np.array(axes, np.int64)
        assert kernel(value, axes)[0].shape == want
    with pytest.raises(Exception, match="duplicate"):
        kernel(x, np.array([1, 1], np.int64))


@pytest.mark.parametrize("shapes", [[(2, 3, 4), (2, 1, 4)], [None, None]])
def test_concat_with_a_negative_axis_and_known_or_unknown_rank(shapes):
    from onnx_runtime_ep_cpu.ops import shape as shape_ops

    kernel = shape_ops._concat_factory(None)(Node("Concat", ["a", "b"], ["y"], attrs={"axis": -2}), shapes, 13)
    a, b = np.ones((2, 3, 4), np.float32), np.zeros((2, 1, 4), np.float32)
    np.testing.assert_array_equal(kernel(a, b)[0], np.concatenate((a, b), axis=1))


def test_attention_block_with_the_new_key_and_value_read_elsewhere():
    weights = {n: RNG.standard_normal((16, 16)).astype(np.float32) for n in "qkv"}
    sess = _session(_attention_block_model(weights, extra_outputs=["k_rot", "v_heads"]))
    # (the head splits inside the ProjectionGroup, v's heads a graph output too)
    assert _ops(sess).count("RotateHalfEmbedding") == 2 and _ops(sess).count("ReshapeTranspose") == 0
    feeds = {"x": RNG.standard_normal((1, 1, 16)), "cos": RNG.standard_normal((1, 1, 1, 8)),
             "sin": RNG.standard_normal((1, 1, 1, 8)), "past_k": RNG.standard_normal((1, 2, 3, 8)),
             "past_v": RNG.standard_normal((1, 2, 3, 8))}
    _, present_k, present_v, k_rot, v_heads = sess.run(None, {k: v.astype(np.float32) for k, v in feeds.items()})
    np.testing.assert_array_equal(present_k[:, :, 3:], k_rot)
    np.testing.assert_array_equal(present_v[:, :, 3:], v_heads)


# -- Attention of a few queries (a decode step's) --------------------------------------------------


@pytest.fixture
def few_calls(monkeypatch):
    """The results of _Attention.few_query_attention in this test (None where it handed over)."""
    return record_results(monkeypatch, transformer._Attention, "few_query_attention")


# (batch, query heads, KV heads, queries, keys, head size, rank): a decode step's one query over its cache,
# grouped-query heads, up to four queries, head sizes off the 16-lane vectors, 3-D and 4-D layouts.
FEW_GEOMETRIES = [(1, 4, 2, 1, 129, 64, 4), (1, 4, 2, 1, 129, 64, 3), (2, 6, 3, 3, 37, 20, 4), (1, 8, 8, 4, 5, 16, 3),
                  (3, 2, 1, 2, 1, 7, 4)]


@pytest.mark.parametrize("geometry", FEW_GEOMETRIES, ids=lambda g: "-".join(map(str, g)))
@pytest.mark.parametrize("causal", [0, 1])
def test_few_query_attention_matches_the_numpy_path(few_calls, geometry, causal):
    """One compiled call per node (the query heads sharing a KV head read its rows), against the numpy
    path; a causal frontier (top-left: query i sees keys 0 .. i) is the call's bias."""
    from test_compiled_transformer import _attention, _no_compiled, _qkv

    batch, q_heads, kv_heads, q_len, kv_len, size, rank = geometry
    q, k, v = _qkv(batch, q_heads, kv_heads, q_len, kv_len, size, rank)
    attrs = {"q_num_heads": q_heads, "kv_num_heads": kv_heads} if rank == 3 else {}
    shapes = [q.shape, k.shape, v.shape]
    got = _attention(shapes, scale=0.3, is_causal=causal, **attrs)(q, k, v)
    want = _no_compiled(_attention(shapes, scale=0.3, is_causal=causal, **attrs))(q, k, v)
    assert len(few_calls) == 1 and few_calls[0][0] is got[0]
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


# (mask shape, batch, query heads, KV heads, queries, keys): a padding mask, a per-head position bias (T5's),
# a per-batch mask over several queries, a 2-D mask.
MASKS = [((1, 1, 1, 40), 1, 4, 2, 1, 40), ((1, 4, 3, 40), 1, 4, 2, 3, 40), ((2, 1, 16, 9), 2, 4, 4, 16, 9),
         ((5, 12), 1, 2, 1, 5, 12), ((1, 2, 1, 7), 1, 2, 2, 1, 7)]


@pytest.mark.parametrize("case", MASKS, ids=lambda c: "x".join(map(str, c[0])))
def test_few_query_attention_adds_a_float_mask(few_calls, case):
    """A float32 mask covering every key, each leading dimension one or the scores' own, is the compiled
    call's bias (broadcast over what it lacks), as the numpy path adds it; -inf hides a key."""
    from test_compiled_transformer import _attention, _no_compiled, _qkv

    shape, batch, q_heads, kv_heads, q_len, kv_len = case
    q, k, v = _qkv(batch, q_heads, kv_heads, q_len, kv_len, 16, 4)
    mask = RNG.standard_normal(shape).astype(np.float32)
    mask[..., 0] = -np.inf
    shapes = [q.shape, k.shape, v.shape, mask.shape]
    got = _attention(shapes)(q, k, v, mask)
    want = _no_compiled(_attention(shapes))(q, k, v, mask)
    assert len(few_calls) == 1 and few_calls[0] is not None and few_calls[0][0] is got[0]
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


def test_few_query_attention_leaves_other_masks_and_large_products_to_the_other_paths(few_calls, knobs):
    from test_compiled_transformer import _attention, _no_compiled, _qkv

    q, k, v = _qkv(1, 4, 2, 1, 40, 16, 4)
    for mask in (RNG.standard_normal((1, 30)).astype(np.float32),  # short: the trailing keys are masked
                 RNG.standard_normal((1, 40)) > 0,  # boolean
                 RNG.standard_normal((1, 40)).astype(np.float64)):
        shapes = [q.shape, k.shape, v.shape, mask.shape]
        got = _attention(shapes)(q, k, v, mask)
        np.testing.assert_allclose(got[0], _no_compiled(_attention(shapes))(q, k, v, mask)[0], rtol=2e-5, atol=2e-6)
        assert few_calls[-1] is None
    few_calls.clear()
    mask = np.full((1, 40), -np.inf, np.float32)  # every key hidden: the general path's zeros
    assert not _attention([q.shape, k.shape, v.shape, mask.shape])(q, k, v, mask)[0].any()
    assert few_calls == [None]
    few_calls.clear()
    plain = _attention([q.shape, k.shape, v.shape])
    assert plain(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))[0].dtype == np.float64
    assert not few_calls  # float64 keeps the numpy path
    plain(q, k, v)
    assert len(few_calls) == 1
    knobs(few_query_macs=4 * 40 * 16 - 1)  # one multiply-add too many
    assert _attention([q.shape, k.shape, v.shape])(q, k, v)[0].shape == (1, 4, 1, 16)
    assert len(few_calls) == 1
    # The scalar loop (one query head per KV head: fewer rows per KV head than the 16-lane loop takes): more
    # than four queries take up to half the knob
    knobs(few_query_macs=4 * 4 * 40 * 16)
    q, k, v = _qkv(1, 4, 4, 5, 40, 16, 4)
    _attention([q.shape, k.shape, v.shape])(q, k, v)
    assert len(few_calls) == 1
    q, k, v = _qkv(1, 4, 4, 4, 40, 16, 4)
    _attention([q.shape, k.shape, v.shape])(q, k, v)
    assert len(few_calls) == 2
    # Two query heads per KV head make 10 rows per KV head: on AVX-512 hosts the 16-lane loop over the heads
    # takes BY_HEAD_MACS times the knob, so the same five queries run there
    q, k, v = _qkv(1, 4, 2, 5, 40, 16, 4)
    _attention([q.shape, k.shape, v.shape])(q, k, v)
    assert len(few_calls) == (3 if gemv_host() else 2)


def test_few_query_attention_non_finite_values_as_the_numpy_path(few_calls):
    """A NaN key makes its heads' rows NaN as numpy's softmax does, an infinite value spreads through the
    weighted sum; a NaN query leaves its row without a finite score: the other paths decide it."""
    from test_compiled_transformer import _qkv, non_finite_values_spread_as_in_the_numpy_path

    got = non_finite_values_spread_as_in_the_numpy_path(*_qkv(1, 4, 2, 1, 24, 16, 4), few_calls, (0, 0, 0, 3))
    assert np.isnan(got[0, 2:]).all() and np.isinf(got[0, :2, 0, 0]).all()  # KV head 1's query heads; head 0's


def test_a_decode_step_attention_matches_onnx_reference(few_calls):
    """Through a session, as a user runs it: one new token's 3-D query over a cache of 77 keys, grouped heads."""
    from test_compiled_transformer import _qkv, session_attention_matches_reference

    session_attention_matches_reference(*_qkv(1, 8, 2, 1, 77, 32, 3), q_num_heads=8, kv_num_heads=2, is_causal=1)
    assert few_calls and few_calls[0] is not None
