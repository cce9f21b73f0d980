"""The attention fusion (optimizer pass ``fuse_attention``) and the CPU Attention kernel's in-place path.

Each fused graph must compute what the unfused graph computes (the same session with the pass
disabled), and each near-miss pattern must stay as written.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.ops.transformer import _Attention

RNG = np.random.default_rng(0)
MODELS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", ".models")
B, HEADS, KV_HEADS, SEQ, SIZE = 2, 4, 2, 5, 8
ELEM = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _attention_graph(layout="gpt", scale="Div", mask="const", dtype=np.float32, softmax_axis=-1, opset=17,
                     extra_nodes=(), extra_outputs=(), guard=False):
    """MatMul(Q, K^T) -> scale -> [+ mask] -> Softmax -> MatMul(., V), with K^T and V made as
    ``layout`` says: "gpt" (K^T = Transpose(k, [0, 2, 3, 1]) of a (B, S, H, D) k), "repeat" (repeat_kv
    of (B, KV_HEADS, S, D) k and v, then K^T = Transpose(., [0, 1, 3, 2])), "repeat_k" (only K
    repeated; v has all heads) or "plain" (K^T is a graph input)."""
    elem = ELEM[dtype]
    inits, nodes = [], []
    inputs = [tensor_info("q", elem, [B, HEADS, SEQ, SIZE])]
    if layout == "gpt":
        inputs += [tensor_info("k", elem, [B, SEQ, HEADS, SIZE]), tensor_info("v", elem, [B, HEADS, SEQ, SIZE])]
        nodes.append(helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1]))
    elif layout == "plain":
        inputs += [tensor_info("kt", elem, [B, HEADS, SIZE, SEQ]), tensor_info("v", elem, [B, HEADS, SEQ, SIZE])]
    else:
        group = HEADS // KV_HEADS
        inits += [_init("axis2", np.array([2])), _init("reps", np.array([1, 1, group, 1, 1])),
                  _init("merged", np.array([B, HEADS, SEQ, SIZE]))]
        repeated = ["k"] if layout == "repeat_k" else ["k", "v"]
        inputs.append(tensor_info("k", elem, [B, KV_HEADS, SEQ, SIZE]))
        inputs.append(tensor_info("v", elem, [B, HEADS if layout == "repeat_k" else KV_HEADS, SEQ, SIZE]))
        for name in repeated:
            nodes += [helper.make_node("Unsqueeze", [name, "axis2"], [f"{name}_u"]),
                      helper.make_node("Tile", [f"{name}_u", "reps"], [f"{name}_t"]),
                      helper.make_node("Reshape", [f"{name}_t", "merged"], [f"{name}_rep"])]
        nodes.append(helper.make_node("Transpose", ["k_rep"], ["kt"], perm=[0, 1, 3, 2]))
    v_name = "v_rep" if layout == "repeat" else "v"
    q_name, kt_name = "q", "kt"
    if scale == "inputs":  # PyTorch's scaled_dot_product_attention: Q and K^T times sqrt(scale) each
        inits.append(_init("root", np.array(0.2 ** 0.5, dtype)))
        nodes += [helper.make_node("Mul", ["q", "root"], ["q_scaled"]),
                  helper.make_node("Mul", ["kt", "root"], ["kt_scaled"])]
        q_name, kt_name = "q_scaled", "kt_scaled"
    nodes.append(helper.make_node("MatMul", [q_name, kt_name], ["scores"]))
    scaled = "scores"
    if scale in ("Div", "Mul"):
        inits.append(_init("c", np.array(8.0 if scale == "Div" else 0.2, dtype)))
        nodes.append(helper.make_node(scale, ["scores", "c"], ["scaled"]))
        scaled = "scaled"
    elif scale == "input":
        inputs.append(tensor_info("c", elem, []))
        nodes.append(helper.make_node("Div", ["scores", "c"], ["scaled"]))
        scaled = "scaled"
    logits = _masked(scaled, mask, dtype, inits, inputs, nodes)
    nodes.append(helper.make_node("Softmax", [logits], ["probs"], axis=softmax_axis))
    probs = "probs"
    if guard:  # rows the mask hides entirely: NaN from Softmax, zeroed
        inits.append(_init("zero", np.array([0.0], dtype)))
        nodes += [helper.make_node("IsNaN", ["probs"], ["nan"]),
                  helper.make_node("Where", ["nan", "zero", "probs"], ["guarded"])]
        probs = "guarded"
    nodes += [helper.make_node("MatMul", [probs, v_name], ["y"]), *extra_nodes]
    outputs = [tensor_info("y", elem, None)] + [tensor_info(name, elem, None) for name in extra_outputs]
    return make_model(nodes, inputs, outputs, inits, opset=opset)


def _masked(scores: str, mask, dtype, inits: list, inputs: list, nodes: list) -> str:
    """The scores with ``mask`` added (a constant array, "const" for a causal one, a shape for a graph input,
    or None), appending what that takes to ``inits``, ``inputs`` and ``nodes``."""
    if mask is None:
        return scores
    if isinstance(mask, np.ndarray):
        inits.append(_init("mask", mask.astype(dtype)))
    elif mask == "const":
        inits.append(_init("mask", np.triu(np.full((SEQ, SEQ), -np.inf), 1).astype(dtype)))
    else:
        inputs.append(tensor_info("mask", ELEM[dtype], list(mask)))
    nodes.append(helper.make_node("Add", ["mask", scores], ["masked"]))  # mask first: either order fuses
    return "masked"


def _session(model, **kwargs):
    data = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(data, providers=["cpu"], **kwargs)


def _feeds(sess, dtype=np.float32):
    feeds = {}
    for arg in sess.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in arg.shape]
        value = RNG.standard_normal(shape) if shape else np.array(2.5)
        feeds[arg.name] = value.astype(dtype)
    return feeds


def _fused(model, dtype=np.float32, expect=True):
    """The optimized session, after checking that it has an Attention node iff ``expect`` and that
    it computes what the same model without the fusion computes."""
    sess = _session(model)
    plain = _session(model, disabled_optimizers=["fuse_attention"])
    ops = _ops(sess)
    assert ("Attention" in ops) == expect, ops
    assert "Attention" not in _ops(plain)
    if expect:
        assert "optimizer:fuse_attention" in sess.applied_passes()
        assert "Softmax" not in ops and "MatMul" not in ops
    feeds = _feeds(plain, dtype)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 3e-3, "atol": 3e-3}
    for got, want in zip(sess.run(None, feeds), plain.run(None, feeds)):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), **tolerance)
    return sess


def _ops(sess):
    return [node.op_type for node in sess.model.graph.nodes]


def _attention_node(sess):
    (node,) = [node for node in sess.model.graph.nodes if node.op_type == "Attention"]
    return node


# -- the patterns that fuse -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("mask", ["const", None])
@pytest.mark.parametrize("scale", ["Div", "Mul", None])
def test_gpt_style_attention_fuses_with_its_scale_and_mask(scale, mask, dtype):
    sess = _fused(_attention_graph("gpt", scale, mask, dtype), dtype)
    node = _attention_node(sess)
    assert node.opset == 23 and node.domain == ""
    assert node.attrs["scale"] == pytest.approx({"Div": 1 / 8, "Mul": 0.2, None: 1.0}[scale], rel=1e-3)
    assert node.inputs[3:] == (["mask"] if mask else [])
    # The K^T Transpose now yields K: re-permuted in place, not a second Transpose.
    (transpose,) = [n for n in sess.model.graph.nodes if n.op_type == "Transpose"]
    assert transpose.attrs["perm"] == [0, 2, 1, 3] and node.inputs[1] == transpose.outputs[0]
    assert sess.placement().provider_of(node.name) == "CPUExecutionProvider"


@pytest.mark.parametrize("layout", ["gpt", "plain"])
@pytest.mark.parametrize("shape", [(1, 1, SEQ, SEQ), (SEQ, SEQ)])
def test_a_constant_zero_mask_is_dropped(layout, shape):
    """The dynamo exporter's ViT/DeiT attention adds a constant all-zero (1, 1, S, S) bias: the Attention takes none."""
    sess = _fused(_attention_graph(layout, "Mul", np.zeros(shape)))
    assert len(_attention_node(sess).inputs) == 3


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("mask", ["const", None])
def test_repeat_kv_becomes_grouped_query_attention(mask, dtype):
    sess = _fused(_attention_graph("repeat", "Div", mask, dtype), dtype)
    node = _attention_node(sess)
    assert node.inputs[:3] == ["q", "k", "v"]  # the un-repeated KV heads, shared by Attention itself
    assert _ops(sess) == ["Attention"]


def test_only_k_repeated_feeds_the_repeated_k():
    """V already has every head, so K cannot be shared either: the repeat stays and feeds K."""
    sess = _fused(_attention_graph("repeat_k", "Div", None))
    assert _attention_node(sess).inputs[:3] == ["q", "k_rep", "v"]
    assert "Tile" in _ops(sess) and "Transpose" not in _ops(sess)


def test_k_transposed_some_other_way_gets_a_transpose():
    sess = _fused(_attention_graph("plain", "Mul", "const"))
    (transpose,) = [n for n in sess.model.graph.nodes if n.op_type == "Transpose"]
    assert transpose.inputs == ["kt"] and transpose.attrs["perm"] == [0, 1, 3, 2]
    assert _attention_node(sess).inputs[1] == transpose.outputs[0]


def test_a_shared_k_transpose_stays_and_k_gets_its_own():
    reader = helper.make_node("Neg", ["kt"], ["kt_neg"])
    sess = _fused(_attention_graph("gpt", extra_nodes=[reader], extra_outputs=["kt_neg"]))
    transposes = [n for n in sess.model.graph.nodes if n.op_type == "Transpose"]
    assert sorted(tuple(n.attrs["perm"]) for n in transposes) == [(0, 2, 1, 3), (0, 2, 3, 1)]


@pytest.mark.parametrize("mask_shape", [(SEQ, SEQ), (1, SEQ), (B, 1, SEQ, SEQ), (HEADS, 1, SEQ)])
def test_a_computed_mask_that_broadcasts_onto_the_scores_fuses(mask_shape):
    _fused(_attention_graph("gpt", mask=mask_shape))


def test_softmax_11_over_the_last_axis_fuses():
    _fused(_attention_graph("gpt", softmax_axis=3, opset=11))


def test_shapes_that_inference_left_unknown_are_re_inferred():
    """Q's shape is unknown to onnx shape inference (a Slice by a computed start), but folding makes
    the start a constant: inferring the Slice again proves Q's batch and heads match K's."""
    model = _attention_graph("repeat", "Div", None)
    graph = model.graph
    graph.input[0].name = "q_in"
    graph.initializer.extend([_init("zero", np.array([0])), _init("end", np.array([SIZE])),
                              _init("last", np.array([3]))])
    graph.node.insert(0, helper.make_node("Abs", ["zero"], ["start"]))
    graph.node.insert(1, helper.make_node("Slice", ["q_in", "start", "end", "last"], ["q"]))
    sess = _fused(model)
    q_info = sess.model.graph.type_of("q")
    assert q_info.shape is not None and not all(isinstance(d, int) for d in q_info.shape)
    assert _attention_node(sess).inputs[:3] == ["q", "k", "v"]


# -- near misses that stay as written ---------------------------------------------------------------


@pytest.mark.parametrize("read", ["scores", "scaled", "masked", "probs"])
def test_an_intermediate_read_elsewhere_does_not_fuse(read):
    reader = helper.make_node("Neg", [read], ["spy"])
    _fused(_attention_graph("gpt", extra_nodes=[reader], extra_outputs=["spy"]), expect=False)


def test_an_intermediate_graph_output_does_not_fuse():
    _fused(_attention_graph("gpt", extra_outputs=["probs"]), expect=False)


def test_a_repeat_read_elsewhere_keeps_the_repeat():
    reader = helper.make_node("Neg", ["v_t"], ["spy"])
    sess = _fused(_attention_graph("repeat", extra_nodes=[reader], extra_outputs=["spy"]))
    assert _attention_node(sess).inputs[:3] == ["q", "k_rep", "v_rep"]


@pytest.mark.parametrize("axis", [2, -2])
def test_softmax_over_another_axis_does_not_fuse(axis):
    _fused(_attention_graph("gpt", softmax_axis=axis, opset=13), expect=False)


def test_softmax_11_with_axis_1_does_not_fuse():
    """Softmax-11 flattens from axis 1: one softmax over heads, queries and keys together."""
    _fused(_attention_graph("gpt", softmax_axis=1, opset=11), expect=False)


def test_a_computed_scale_does_not_fuse():
    _fused(_attention_graph("gpt", scale="input"), expect=False)


@pytest.mark.parametrize("mask_shape", [(SEQ, 1), (3, B, HEADS, SEQ, SEQ), (B, HEADS, SEQ, "keys")])
def test_a_mask_attention_would_read_differently_does_not_fuse(mask_shape):
    """A mask with one key column (Attention pads it with -inf rather than broadcasting it), one that
    adds a dimension, and one whose key count is not provably the scores'."""
    model = _attention_graph("gpt", mask=mask_shape)
    sess = _session(model)
    assert "Attention" not in _ops(sess)


@pytest.mark.parametrize("mask", ["const", None])
def test_q_and_k_each_scaled_fuse_with_the_product_of_the_scales(mask):
    sess = _fused(_attention_graph("gpt", "inputs", mask))
    assert _attention_node(sess).attrs["scale"] == pytest.approx(float(np.float32(0.2 ** 0.5)) ** 2)
    assert "Mul" not in _ops(sess)


def test_a_nan_guard_after_softmax_fuses_even_where_the_mask_hides_a_whole_row():
    """Where(IsNaN(p), 0, p) zeroes the rows Softmax made NaN: Attention gives those rows zeros itself."""
    mask = np.zeros((SEQ, SEQ))
    mask[1] = -np.inf
    sess = _fused(_attention_graph("gpt", "Div", mask, guard=True))
    assert "IsNaN" not in _ops(sess) and "Where" not in _ops(sess)
    y = sess.run(None, _feeds(sess))[0]
    np.testing.assert_array_equal(y[:, :, 1], 0)
    assert np.isfinite(y).all()


def test_a_constant_mask_that_masks_a_whole_row_does_not_fuse():
    """Softmax makes NaN of that row, Attention zeros."""
    mask = np.zeros((SEQ, SEQ))
    mask[1] = -np.inf
    sess = _session(_attention_graph("gpt", mask=mask))
    assert "Attention" not in _ops(sess)


@pytest.mark.parametrize("scale, mask", [("Mul", None), (None, "const")])
def test_no_fusion_moves_work_between_providers(scale, mask):
    """The sample device runs Mul and Add but not Attention: fusing would move the scale or the mask
    to the CPU. Without either, every matched node is the CPU's and the fusion happens."""
    model = _attention_graph("gpt", scale, mask).SerializeToString()
    sess = ort.InferenceSession(model, providers=["SampleDeviceExecutionProvider", "cpu"])
    assert "Attention" not in _ops(sess)
    sess = ort.InferenceSession(_attention_graph("gpt", None, None).SerializeToString(),
                                providers=["SampleDeviceExecutionProvider", "cpu"])
    assert "Attention" in _ops(sess)


def test_the_pass_can_be_disabled_by_name():
    sess = _session(_attention_graph("gpt"), disabled_optimizers=["optimizer:fuse_attention"])
    assert "Attention" not in _ops(sess)


# -- the exported transformers ----------------------------------------------------------------------


EXPORTED = sorted(
    path for pattern in ("gpt_*.onnx", "llama_*.onnx") for path in glob.glob(os.path.join(MODELS_DIR, pattern))
)


@pytest.mark.parametrize("path", EXPORTED or [None], ids=lambda path: path and os.path.basename(path))
def test_exported_transformers_fuse_and_agree(path):
    if path is None:
        pytest.skip("no exported transformer in benchmarks/.models (benchmarks/torch_models.py makes them)")
    sess = _session(path)
    plain = _session(path, disabled_optimizers=["fuse_attention"])
    assert _ops(sess).count("Attention") >= 1
    feeds = {}
    for arg in plain.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in arg.shape]
        feeds[arg.name] = (RNG.integers(0, 100, shape) if arg.type == "tensor(int64)"
                           else RNG.standard_normal(shape).astype(np.float32))
    for got, want in zip(sess.run(None, feeds), plain.run(None, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# -- the CPU kernel's in-place path -----------------------------------------------------------------


def _kernels(rank, with_mask, **attrs):
    """The CPU Attention kernel twice for one node: as built, and forced onto the general path."""
    inputs = ["q", "k", "v"] + (["mask"] if with_mask else [])
    if rank == 3:
        attrs.update(q_num_heads=HEADS, kv_num_heads=KV_HEADS)
    proto = helper.make_node("Attention", inputs, ["y", "present_key", "present_value"], **attrs)
    node = Node("Attention", inputs, list(proto.output), name="attention", attrs=attrs, opset=23, proto=proto)
    if rank == 4:
        shapes = [(B, HEADS, SEQ, SIZE), (B, KV_HEADS, SEQ + 1, SIZE), (B, KV_HEADS, SEQ + 1, SIZE)]
    else:
        shapes = [(B, SEQ, HEADS * SIZE), (B, SEQ + 1, KV_HEADS * SIZE), (B, SEQ + 1, KV_HEADS * SIZE)]
    fast, general = _Attention(node, shapes, 23), _Attention(node, shapes, 23)
    general.plain = False
    return fast, general, [RNG.standard_normal(shape).astype(np.float32) for shape in shapes]


@pytest.mark.parametrize("rank", [4, 3])
@pytest.mark.parametrize("mask_shape", [None, (SEQ, SEQ + 1), (B, 1, SEQ, SEQ + 1), (SEQ, SEQ)])
def test_the_in_place_path_computes_what_the_general_path_does(rank, mask_shape):
    """Masks of every key, and (left to the general path) a short one."""
    fast, general, args = _kernels(rank, mask_shape is not None, scale=0.3)
    assert fast.plain
    if mask_shape is not None:
        mask = RNG.standard_normal(mask_shape).astype(np.float32)
        mask[..., 1] = -np.inf
        args.append(mask)
    for got, want in zip(fast(*args), general(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_fully_masked_rows_leave_the_in_place_path_and_become_zeros():
    fast, general, args = _kernels(4, True)
    mask = np.zeros((SEQ, SEQ + 1), np.float32)
    mask[2] = -np.inf
    y, _, _ = fast(*args, mask)
    np.testing.assert_array_equal(y, general(*args, mask)[0])
    assert not np.isnan(y).any() and (y[:, :, 2] == 0).all()


@pytest.mark.parametrize("attrs", [{"is_causal": 1}, {"softcap": 2.0}, {"softmax_precision": 11}])
def test_other_attention_features_keep_the_general_path(attrs):
    fast, _, _ = _kernels(4, False, **attrs)
    assert not fast.plain


def _one_node_attention(kv_len: int, mask_shape):
    names = ["Q", "K", "V"] + (["M"] if mask_shape is not None else [])
    infos = [tensor_info("Q", TensorProto.FLOAT, [1, 2, 3, 4]), tensor_info("K", TensorProto.FLOAT, [1, 2, kv_len, 4]),
             tensor_info("V", TensorProto.FLOAT, [1, 2, kv_len, 4])]
    if mask_shape is not None:
        infos.append(tensor_info("M", TensorProto.FLOAT, list(mask_shape)))
    model = make_model([helper.make_node("Attention", names, ["Y"])], infos, [tensor_info("Y")], opset=23)
    feeds = {"Q": RNG.standard_normal((1, 2, 3, 4)).astype(np.float32),
             "K": RNG.standard_normal((1, 2, kv_len, 4)).astype(np.float32),
             "V": RNG.standard_normal((1, 2, kv_len, 4)).astype(np.float32)}
    if mask_shape is not None:
        feeds["M"] = RNG.standard_normal(mask_shape).astype(np.float32)
    return _session(model), feeds


def test_a_scalar_mask_broadcasts_to_every_key():
    """Adding one value to every score leaves the softmax as it was (onnx's reference evaluator fails here)."""
    masked, feeds = _one_node_attention(5, ())
    unmasked, _ = _one_node_attention(5, None)
    want = unmasked.run(None, {k: v for k, v in feeds.items() if k != "M"})[0]
    np.testing.assert_allclose(masked.run(None, feeds)[0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask_shape", [None, (3, 0)])
def test_no_keys_at_all_give_zeros(mask_shape):
    sess, feeds = _one_node_attention(0, mask_shape)
    (y,) = sess.run(None, feeds)
    assert y.shape == (1, 2, 3, 4) and not y.any()
