"""split_dynamic_quantize_outputs: a DynamicQuantizeMatMul of projections already merged (Phi-3's int8_dynamic qkv_proj
and gate_up_proj), cut along its last axis by Slices or a Split into head splits or SwishMul, is one
DynamicQuantizeMatMulColumns whose outputs are the product's column views: the same bits as the unfused graph (the
product is the node's own), onnxruntime as the oracle at int8's tolerance. Cuts that overlap, leave a gap or feed
another reader keep their nodes."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from model_helpers import holdout_planned_ops, make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN

RNG = np.random.default_rng(5)
HIDDEN, HEAD = 64, 16
INT64_MAX = np.iinfo(np.int64).max
PASS = "split_dynamic_quantize_outputs"


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(cuts: list[tuple[int, int]], readers: str = "heads", split: bool = False):
    """x (batch, seq, HIDDEN) -> DynamicQuantizeMatMul by int8 (HIDDEN, total) -> the columns ``cuts`` [start, end)
    by Slices (or one Split) -> per part a head split (``readers`` "heads"), or SwishMul's spelling of the first
    two parts (Sigmoid, Mul, Mul: "gate"), or a Relu (not a view reader: "relu")."""
    total = max(end for _, end in cuts)
    weight = RNG.integers(-127, 128, (HIDDEN, total)).astype(np.int8)
    initializers = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array(0.02, np.float32), "scale"),
                    _ints("axis", [2]), _ints("heads", [0, 0, -1, HEAD])]
    nodes = [helper.make_node("DynamicQuantizeMatMul", ["x", "w", "scale"], ["product"], domain="com.microsoft")]
    parts = [f"part{index}" for index in range(len(cuts))]
    if split:
        initializers.append(_ints("sizes", [end - start for start, end in cuts]))
        nodes.append(helper.make_node("Split", ["product", "sizes"], parts, axis=-1))
    for index, (start, end) in enumerate(cuts):
        if split:
            break
        initializers += [_ints(f"s{index}", [start]), _ints(f"e{index}", [INT64_MAX if end == total else end])]
        nodes.append(helper.make_node("Slice", ["product", f"s{index}", f"e{index}", "axis"], [parts[index]]))
    outputs = []
    if readers == "gate":
        nodes += [helper.make_node("Sigmoid", [parts[0]], ["sig"]),
                  helper.make_node("Mul", [parts[0], "sig"], ["swish"]),
                  helper.make_node("Mul", ["swish", parts[1]], ["y0"])]
        outputs = ["y0"]
    for index, part in enumerate(parts if readers != "gate" else []):
        if readers == "relu" and index == 0:
            nodes.append(helper.make_node("Relu", [part], [f"y{index}"]))
        else:
            nodes += [helper.make_node("Reshape", [part, "heads"], [f"r{index}"]),
                      helper.make_node("Transpose", [f"r{index}"], [f"y{index}"], perm=[0, 2, 1, 3])]
        outputs.append(f"y{index}")
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])],
                       [tensor_info(name) for name in outputs], initializers)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model.SerializeToString()


def _ours(model, x, monkeypatch=None, left_out=PASS):
    """A session and its outputs; with ``monkeypatch``, the control: the pass ``left_out`` left out while the session
    specializes (at its first run) too."""
    if monkeypatch is None:
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        return session, session.run(None, {"x": x})
    from onnx_runtime_ep_cpu import provider

    with monkeypatch.context() as patch:
        kept = [p for p in provider.HEADS_PASSES if p.__name__ != left_out]
        patch.setattr(provider, "HEADS_PASSES", kept, raising=False)
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        return session, session.run(None, {"x": x})


def _ops(session, x):
    return [(node.op_type, node.domain) for node in session.graph_for({"x": x}).nodes]


PHI3_QKV = [(0, 64), (64, 96), (96, 128)]
GATE_UP = [(0, 128), (128, 256)]


@pytest.mark.parametrize("seq", [16, 5, 1])
@pytest.mark.parametrize("cuts, readers, split", [
    (PHI3_QKV, "heads", False),   # Phi-3's q, k and v by Slices into their head splits
    (PHI3_QKV[::-1], "heads", False),  # the Slices written in another order
    (GATE_UP, "gate", False),     # gate and up into SwiGLU's gate (SwishMul)
    (PHI3_QKV, "heads", True),    # one Split of unequal parts
])
def test_a_cut_product_is_one_node_with_the_unfused_bits(cuts, readers, split, seq, monkeypatch):
    model = _model(cuts, readers, split)
    x = RNG.standard_normal((1, seq, HIDDEN)).astype(np.float32)
    session, got = _ours(model, x)
    control, want = _ours(model, x, monkeypatch)
    for ours, unfused in zip(got, want):
        np.testing.assert_array_equal(ours, unfused)
    oracle = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for ours, theirs in zip(got, oracle):  # int8's tolerance: A's quantization may round a code differently
        assert np.max(np.abs(ours - theirs)) <= 0.02 * np.max(np.abs(theirs)) + 1e-3
    ops = _ops(session, x)
    assert ("DynamicQuantizeMatMulColumns", FUSED_DOMAIN) in ops, ops
    assert not any(op in ("Slice", "Split", "DynamicQuantizeMatMul") for op, _ in ops), ops
    assert ("DynamicQuantizeMatMul", "com.microsoft") in _ops(control, x)


@pytest.mark.parametrize("cuts, readers", [
    ([(0, 64), (48, 96), (96, 128)], "heads"),  # overlapping parts
    ([(0, 64), (80, 96), (96, 128)], "heads"),  # a gap
    (PHI3_QKV, "relu"),                         # a part read by a Relu (no column-view reader)
])
def test_other_cuts_keep_their_nodes(cuts, readers):
    model = _model(cuts, readers)
    x = RNG.standard_normal((1, 4, HIDDEN)).astype(np.float32)
    session, got = _ours(model, x)
    oracle = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for ours, theirs in zip(got, oracle):
        assert np.max(np.abs(ours - theirs)) <= 0.02 * np.max(np.abs(theirs)) + 1e-3
    ops = [op for op, _ in _ops(session, x)]
    assert "DynamicQuantizeMatMulColumns" not in ops and "DynamicQuantizeMatMul" in ops, ops


def test_widths_that_do_not_fit_the_outputs_are_refused_naming_the_attribute():
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.registry import lookup

    node = Node("DynamicQuantizeMatMulColumns", ["a", "b", "s"], ["p", "q"], name="columns", domain=FUSED_DOMAIN,
                attrs={"widths": [64]}, opset=1)
    with pytest.raises(Exception, match="widths"):
        lookup("DynamicQuantizeMatMulColumns", FUSED_DOMAIN, 1)(node, [None, None, None], 1)




@pytest.mark.parametrize("seq", [1, 5])
@pytest.mark.parametrize("split", [False, True])
def test_head_splits_fold_into_the_columns_node_with_the_unfolded_bits(seq, split, monkeypatch):
    """fold_head_splits: each part's head split (ReshapeTranspose) is the columns node's own layout (no step of its
    own), the same bits as the graph that keeps the splits; at one token the parts are slices of the product
    reshaped once (planned_heads), at five the general reshape and transpose."""
    model = _model(PHI3_QKV, "heads", split)
    x = RNG.standard_normal((1, seq, HIDDEN)).astype(np.float32)
    session, got = _ours(model, x)
    control, want = _ours(model, x, monkeypatch, left_out="fold_head_splits")
    for ours, unfolded in zip(got, want):
        assert ours.shape == unfolded.shape == (1, ours.shape[1], seq, HEAD)
        np.testing.assert_array_equal(ours, unfolded)
    ops = _ops(session, x)
    assert ops == [("DynamicQuantizeMatMulColumns", FUSED_DOMAIN)], ops
    assert ("ReshapeTranspose", FUSED_DOMAIN) in _ops(control, x)
    oracle = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for ours, theirs in zip(got, oracle):
        assert np.max(np.abs(ours - theirs)) <= 0.02 * np.max(np.abs(theirs)) + 1e-3


def _columns_kernel(layouts, a_shape):
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.registry import lookup

    node = Node("DynamicQuantizeMatMulColumns", ["a", "b", "s"], ["q", "k", "v"], name="columns", domain=FUSED_DOMAIN,
                attrs={"widths": [64, 32, 32], "layouts": layouts}, opset=1)
    return lookup("DynamicQuantizeMatMulColumns", FUSED_DOMAIN, 1)(node, [a_shape, (HIDDEN, 128), ()], 1)


def test_a_columns_kernel_with_layouts_serves_other_shapes_than_its_planned_one():
    """A kernel planned for one token splits another shape's product by the general reshape and transpose, each part
    as the unfused DynamicQuantizeMatMul's columns split into heads; a product of other columns is an error."""
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.ops.contrib_integer_matmul import dynamic_quantize_matmul

    layouts = [4, 1, -1, 4, HEAD, 0, 2, 1, 3, 4, 1, -1, 2, HEAD, 0, 2, 1, 3, 4, 1, -1, 2, HEAD, 0, 2, 1, 3]
    kernel = _columns_kernel(layouts, (1, 1, HIDDEN))
    w = RNG.integers(-127, 128, (HIDDEN, 128)).astype(np.int8)
    scale = np.array(0.02, np.float32)
    w.setflags(write=False)
    for rows in (1, 3, 1):
        a = RNG.standard_normal((1, rows, HIDDEN)).astype(np.float32)
        single = dynamic_quantize_matmul(Node("DynamicQuantizeMatMul", ["a", "b", "s"], ["y"], name="single",
                                              domain="com.microsoft", opset=1), [a.shape, w.shape, ()], 1)
        product = single(a, w, scale)[0]
        parts = kernel(a, w, scale)
        for part, (start, end) in zip(parts, PHI3_QKV):
            want = product[..., start:end].reshape(1, rows, -1, HEAD).transpose(0, 2, 1, 3)
            assert part.shape == want.shape
            np.testing.assert_array_equal(part, want)
    with pytest.raises(Exception, match="expected 128"):
        kernel(RNG.standard_normal((1, 2, HIDDEN)).astype(np.float32), w[:, :100].copy(), scale)


def test_layouts_that_do_not_fit_the_outputs_are_refused_naming_the_attribute():
    with pytest.raises(Exception, match="layouts"):
        _columns_kernel([4, 1, -1, 4, HEAD, 0, 2, 1], (1, 1, HIDDEN))


@pytest.mark.parametrize("name", ["phi3.torchscript.int8_dynamic", "phi3.dynamo.int8_dynamic"])
def test_holdout_phi3_int8_dynamic_cuts_no_product(name):
    """Both exporters' prefill and decode graphs: each layer's qkv and gate/up products one columns node, no Slice."""
    for call, ops in holdout_planned_ops(name).items():
        assert ops.count("DynamicQuantizeMatMulColumns") == 4 and "Slice" not in ops, (call, ops)
