"""onnxruntime's optimizer output run as standard operators (contrib_lowering.py): encoder blocks of com.microsoft
Attention, SkipLayerNormalization, BiasGelu, FastGelu, SkipSimplifiedLayerNormalization and
SimplifiedLayerNormalization after MatMuls by constant weights, checked against onnxruntime (the oracle) and
against what the provider ran them as; the forms the lowering must leave to the contrib kernels."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.loader import load_model

CONTRIB = "com.microsoft"
HIDDEN, HEADS, BATCH, STEPS = 32, 4, 2, 6
RNG = np.random.default_rng(7)


def _weights(*shape, dtype=np.float32, scale=0.3):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


class _Block:
    """A graph under construction: constant weights as initializers, nodes in order."""

    def __init__(self, dtype=np.float32):
        self.dtype = dtype
        self.nodes: list = []
        self.inits: list = []
        self.count = 0

    def const(self, array) -> str:
        name = f"w{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op, inputs, n_outputs=1, domain="", **attrs) -> list[str]:
        self.count += 1
        outputs = [f"{op.lower()}{self.count}_{i}" for i in range(n_outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{self.count}", domain=domain, **attrs))
        return outputs

    def model(self, inputs, output: str):
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(self.dtype))
        graph = helper.make_graph(self.nodes, "block", inputs, [helper.make_tensor_value_info(output, elem, None)],
                                  self.inits)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
        proto.ir_version = 8
        return proto


def _x_info(dtype=np.float32):
    return helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), ["batch", "steps",
                                                                                               HIDDEN])


def bert_block(mask_shape=None, unidirectional=0, gelu="BiasGelu"):
    """Attention -> output projection -> SkipLayerNormalization -> MatMul -> [Bias|Fast]Gelu -> MatMul ->
    SkipLayerNormalization, the transformer optimizer's BERT layer."""
    b = _Block()
    inputs = ["x", b.const(_weights(HIDDEN, 3 * HIDDEN)), b.const(_weights(3 * HIDDEN))]
    if mask_shape is not None:
        inputs.append("mask")
    attended = b.node("Attention", inputs, domain=CONTRIB, num_heads=HEADS, unidirectional=unidirectional)[0]
    projected = b.node("MatMul", [attended, b.const(_weights(HIDDEN, HIDDEN))])[0]
    norm1 = b.node("SkipLayerNormalization", [projected, "x", b.const(_weights(HIDDEN) + 1), b.const(_weights(HIDDEN)),
                                              b.const(_weights(HIDDEN))], domain=CONTRIB, epsilon=1e-5)[0]
    up = b.node("MatMul", [norm1, b.const(_weights(HIDDEN, 4 * HIDDEN))])[0]
    activated = b.node(gelu, [up, b.const(_weights(4 * HIDDEN))], domain=CONTRIB)[0]
    down = b.node("MatMul", [activated, b.const(_weights(4 * HIDDEN, HIDDEN))])[0]
    out = b.node("SkipLayerNormalization", [down, norm1, b.const(_weights(HIDDEN) + 1), b.const(_weights(HIDDEN)),
                                            b.const(_weights(HIDDEN))], domain=CONTRIB, epsilon=1e-5)[0]
    infos = [_x_info()]
    if mask_shape is not None:
        infos.append(helper.make_tensor_value_info("mask", TensorProto.INT32, mask_shape))
    return b.model(infos, out)


def t5_block():
    """SimplifiedLayerNormalization -> MatMul -> SkipSimplifiedLayerNormalization (with a bias), T5's and
    LLaMA's residual stream."""
    b = _Block()
    normed = b.node("SimplifiedLayerNormalization", ["x", b.const(_weights(HIDDEN) + 1)], epsilon=1e-6)[0]
    projected = b.node("MatMul", [normed, b.const(_weights(HIDDEN, HIDDEN))])[0]
    out = b.node("SkipSimplifiedLayerNormalization", [projected, "x", b.const(_weights(HIDDEN) + 1),
                                                      b.const(_weights(HIDDEN))], n_outputs=4, domain=CONTRIB,
                 epsilon=1e-6)
    relu = b.node("Relu", [out[0]])[0]
    total = b.node("Add", [relu, out[3]])[0]
    return b.model([_x_info()], total)


def _run_both(proto, feeds):
    import onnxruntime

    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, session.run(None, feeds)[0], oracle.run(None, feeds)[0]


def _ran_as(session) -> set[tuple[str, str]]:
    return {(record.domain, record.op_type) for record in session.placement()}


def hidden_states(dtype=np.float32):
    return RNG.standard_normal((BATCH, STEPS, HIDDEN)).astype(dtype)


@pytest.mark.parametrize("mask", [None, "lengths", "raw"])
@pytest.mark.parametrize("gelu", ["BiasGelu", "FastGelu"])
def test_bert_block_runs_as_standard_fused_operators(mask, gelu):
    mask_value = {None: None, "lengths": np.array([STEPS, STEPS - 2], np.int32),
                  "raw": np.array([[1] * STEPS, [1] * (STEPS - 3) + [0] * 3], np.int32)}[mask]
    proto = bert_block(None if mask is None else list(mask_value.shape), gelu=gelu)
    feeds = {"x": hidden_states()} if mask is None else {"x": hidden_states(), "mask": mask_value}
    session, got, expected = _run_both(proto, feeds)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    ran = _ran_as(session)
    assert not any(domain == CONTRIB for domain, _ in ran), ran
    assert ("ai.onnx_runtime.cpu", "FusedMatMul") in ran and ("ai.onnx_runtime.cpu", "ContribPackedAttention") in ran
    assert ("ai.onnx_runtime.cpu", "ContribAttentionMask") not in ran  # the mask index is read in place


def test_unidirectional_attention_with_padding_matches_onnxruntime():
    lengths = np.array([STEPS - 1, 3], np.int32)
    session, got, expected = _run_both(bert_block([BATCH], unidirectional=1), {"x": hidden_states(), "mask": lengths})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert ("ai.onnx_runtime.cpu", "ContribPackedAttention") in _ran_as(session)


def test_attention_mask_of_no_convention_is_a_typed_error():
    session = ort.InferenceSession(bert_block([BATCH, 3]), providers=["CPUExecutionProvider"])
    with pytest.raises(InvalidArgumentError, match=r"mask of shape \(2, 3\) fits no mask convention"):
        session.run(None, {"x": hidden_states(), "mask": np.ones((BATCH, 3), np.int32)})


def test_simplified_norms_run_as_rms_normalization():
    session, got, expected = _run_both(t5_block(), {"x": hidden_states()})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    ran = _ran_as(session)
    assert not any(domain == CONTRIB or op == "SimplifiedLayerNormalization" for domain, op in ran), ran


def test_simplified_norm_output_shapes_are_inferred():
    """onnx does not know SimplifiedLayerNormalization (onnxruntime's, in the ONNX domain): its output and what
    follows are typed by the loader's stand-in, so the shape chains after it fold."""
    graph = load_model(t5_block()).graph
    first = next(node for node in graph.nodes if node.op_type == "SimplifiedLayerNormalization")
    info = graph.type_of(first.outputs[0])
    assert info is not None and info.shape == ("batch", "steps", HIDDEN)


def test_half_precision_block_is_lowered_after_its_float32_conversion():
    """float16 weights: precision_fusions.py computes the block in float32, then the lowering applies."""
    b = _Block(np.float16)
    projected = b.node("MatMul", ["x", b.const(_weights(HIDDEN, HIDDEN, dtype=np.float16))])[0]
    out = b.node("SkipLayerNormalization", [projected, "x", b.const(np.ones(HIDDEN, np.float16)),
                                            b.const(_weights(HIDDEN, dtype=np.float16))], domain=CONTRIB)[0]
    session, got, expected = _run_both(b.model([_x_info(np.float16)], out), {"x": hidden_states(np.float16)})
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=2e-3, atol=4e-3)
    assert ("", "LayerNormalization") in _ran_as(session)


def test_half_precision_node_without_half_weights_keeps_the_contrib_kernel():
    """No half-precision weights to widen: a float16 node is not split into per-op float16 roundings; the contrib
    kernel computes it in float32 and rounds once."""
    b = _Block(np.float16)
    out = b.node("SkipLayerNormalization", ["x", "skip", b.const(np.ones(HIDDEN, np.float16))], domain=CONTRIB)[0]
    infos = [_x_info(np.float16), helper.make_tensor_value_info("skip", TensorProto.FLOAT16, None)]
    feeds = {"x": hidden_states(np.float16), "skip": hidden_states(np.float16)}
    session, got, expected = _run_both(b.model(infos, out), feeds)
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=2e-3, atol=4e-3)
    assert (CONTRIB, "SkipLayerNormalization") in _ran_as(session)


def test_parameters_fed_at_run_time_keep_the_contrib_kernel_and_its_errors():
    """gamma as a graph input: the contrib kernel checks it per call and names it in the error."""
    b = _Block()
    out = b.node("SkipLayerNormalization", ["x", "skip", "gamma"], domain=CONTRIB)[0]
    infos = [_x_info(), helper.make_tensor_value_info("skip", TensorProto.FLOAT, None),
             helper.make_tensor_value_info("gamma", TensorProto.FLOAT, None)]
    session = ort.InferenceSession(b.model(infos, out), providers=["CPUExecutionProvider"])
    assert (CONTRIB, "SkipLayerNormalization") in _ran_as(session)
    with pytest.raises(InvalidArgumentError, match=r"gamma has shape \(7,\); expected \(32,\)"):
        session.run(None, {"x": hidden_states(), "skip": hidden_states(), "gamma": np.ones(7, np.float32)})


@pytest.mark.parametrize("op", ["ReshapeTranspose", "TransposeReshape"])
def test_fused_reshape_resolves_copied_dimensions_for_its_planned_shape(op):
    """onnxruntime's optimizer writes Reshape targets with 0s (copy the input's dimension): the fused kernel
    built for a planned input shape resolves them once, and still serves another shape as Reshape would."""
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.ops.fused import reshape_transpose, transpose_reshape

    if op == "ReshapeTranspose":
        node = Node(op, ["x"], ["y"], name="rt", attrs={"shape": [0, 0, -1, 8], "perm": [0, 2, 1, 3]})
        kernel = reshape_transpose(node, [(2, 3, 32)], 1)
        planned, other = RNG.standard_normal((2, 3, 32)), RNG.standard_normal((1, 5, 16))
    else:
        node = Node(op, ["x"], ["y"], name="tr", attrs={"shape": [0, 0, -1], "perm": [0, 2, 1, 3]})
        kernel = transpose_reshape(node, [(2, 4, 3, 8)], 1)
        planned, other = RNG.standard_normal((2, 4, 3, 8)), RNG.standard_normal((1, 2, 5, 8))
    for x in (planned, other):
        (got,) = kernel(x)
        if op == "ReshapeTranspose":
            expected = x.reshape(x.shape[0], x.shape[1], -1, 8).transpose(0, 2, 1, 3)
        else:
            expected = x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)
        np.testing.assert_array_equal(got, expected)


def _mha_block(cross: bool, mask_shape=None, unidirectional=0):
    """Q, K and V projections (MatMul) -> com.microsoft MultiHeadAttention with the packed bias, the optimizer's
    self-attention (or cross-attention over ``memory``) form."""
    b = _Block()
    source = "memory" if cross else "x"
    q, k, v = (b.node("MatMul", [name, b.const(_weights(HIDDEN, HIDDEN))])[0] for name in ("x", source, source))
    inputs = [q, k, v, b.const(_weights(3 * HIDDEN))]
    if mask_shape is not None:
        inputs.append("mask")
    out = b.node("MultiHeadAttention", inputs, domain=CONTRIB, num_heads=HEADS, unidirectional=unidirectional)[0]
    infos = [_x_info()]
    if cross:
        infos.append(helper.make_tensor_value_info("memory", TensorProto.FLOAT, ["batch", "memory", HIDDEN]))
    if mask_shape is not None:
        infos.append(helper.make_tensor_value_info("mask", TensorProto.INT32, mask_shape))
    return b.model(infos, out)


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("mask", [None, "raw", "lengths"])
def test_multi_head_attention_runs_as_onnx_attention(cross, mask):
    keys = 9 if cross else STEPS
    mask_value = {None: None, "lengths": np.array([keys, keys - 2], np.int32),
                  "raw": np.array([[1] * keys, [1] * (keys - 3) + [0] * 3], np.int32)}[mask]
    proto = _mha_block(cross, None if mask is None else list(mask_value.shape))
    feeds = {"x": hidden_states()}
    if cross:
        feeds["memory"] = RNG.standard_normal((BATCH, keys, HIDDEN)).astype(np.float32)
    if mask is not None:
        feeds["mask"] = mask_value
    session, got, expected = _run_both(proto, feeds)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    ran = _ran_as(session)
    assert not any(domain == CONTRIB for domain, _ in ran), ran
    # the bias folded into the projections: FusedMatMul each, or one ProjectionGroup where the three read one input
    projections = {("ai.onnx_runtime.cpu", "FusedMatMul"), ("ai.onnx_runtime.cpu", "ProjectionGroup")}
    assert projections & ran and ("", "Attention") in ran, ran


def test_causal_multi_head_attention_matches_onnxruntime():
    session, got, expected = _run_both(_mha_block(False, unidirectional=1), {"x": hidden_states()})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert ("", "Attention") in _ran_as(session)
