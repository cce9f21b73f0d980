"""A ProjectionGroup's head splits folded into it (projection_groups.fold_head_splits): the ReshapeTranspose that
alone reads a member's column becomes the group's ``layouts``, one step instead of four for a decoder's q, k and
v. The kernel against a float64 reference at a decode step's one row (the planned slices of one reshaped
product), a prefill's rows (a real transpose) and an unplanned shape; bad layouts a typed error. A decode-style
layer (the cache's Concat after the split) against float64; the zoo's decoders from both torch exporters keep no
ReshapeTranspose and match the float64 reference."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info, zoo_model
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import attention_heads, projection_groups, provider
from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN
from onnx_runtime_ep_cpu.registry import lookup
from reference64 import assert_within, gamma, run_float64


def _group_node(widths, layouts) -> Node:
    return Node("ProjectionGroup", ["a", "w", "b"], [f"y{i}" for i in range(len(widths))], name="group",
                domain=FUSED_DOMAIN, attrs={"widths": list(widths), "layouts": list(layouts)}, opset=1)


KERNEL_CASES = [
    # A's shape, widths, head size, split members (None: the column as is)
    ((1, 1, 24), (12, 6, 6), 3, (True, True, True)),  # a decode step: the planned slices
    ((2, 1, 10), (8, 4, 4), 4, (True, True, True)),  # two sequences' one token each
    ((1, 5, 24), (12, 6, 6), 3, (True, True, True)),  # a prefill's rows: transposed for real
    ((1, 1, 24), (12, 6, 6), 3, (True, False, True)),  # a member left as a column
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in KERNEL_CASES])
def test_the_kernel_splits_heads_within_the_float64_bound(case):
    a_shape, widths, size, split = case
    batch, length, depth = a_shape
    layouts = [v for s in split for v in ([4, batch, length, -1, size, 0, 2, 1, 3] if s else [0])]
    node = _group_node(widths, layouts)
    rng = np.random.default_rng(sum(a_shape))
    w = rng.standard_normal((depth, sum(widths))).astype(np.float32)
    bias = rng.standard_normal(sum(widths)).astype(np.float32)
    factory = lookup("ProjectionGroup", FUSED_DOMAIN, 1)
    for shapes in ([a_shape, w.shape, bias.shape], None):  # planned, then unplanned
        kernel = factory(node, shapes, 1)
        for seed in (0, 1):
            a = np.random.default_rng(seed).standard_normal(a_shape).astype(np.float32)
            got = kernel(a, w, bias)
            exact = a.astype(np.float64) @ w.astype(np.float64) + bias
            bound = gamma(depth + 1) * (np.abs(a.astype(np.float64)) @ np.abs(w) + np.abs(bias))
            start = 0
            for part, width, s in zip(got, widths, split):
                cut = (Ellipsis, slice(start, start + width))
                want, tol = exact[cut], bound[cut]
                if s:
                    want = want.reshape(batch, length, -1, size).transpose(0, 2, 1, 3)
                    tol = tol.reshape(batch, length, -1, size).transpose(0, 2, 1, 3)
                assert part.shape == want.shape, (part.shape, want.shape)
                assert_within(part, want, tol, f"member at {start}, {'planned' if shapes else 'unplanned'}")
                start += width


@pytest.mark.parametrize("layouts", [[4, 1, 1, -1, 3, 0, 2, 1, 3], [2, 0, -1, 1, 0, 0, 0],
                                     [4, 1, 1, -1, 3, 0, 2, 1, 1, 0, 0], [4, 1, 1, -1, 5, 0, 2, 1, 3] * 3 + [0]])
def test_bad_layouts_are_a_typed_error(layouts):
    node = _group_node((12, 6, 6), layouts)
    with pytest.raises(InvalidArgumentError, match="layouts"):
        lookup("ProjectionGroup", FUSED_DOMAIN, 1)(node, None, 1)


def test_heads_that_do_not_divide_the_product_are_a_typed_error():
    node = _group_node((12, 6, 6), [4, 1, 1, -1, 5, 0, 2, 1, 3] + [0, 0])
    kernel = lookup("ProjectionGroup", FUSED_DOMAIN, 1)(node, None, 1)
    with pytest.raises(InvalidArgumentError, match="layouts"):
        kernel(np.ones((1, 1, 4), np.float32), np.ones((4, 24), np.float32), np.zeros(24, np.float32))


def _cached_layer(batch, length, past, embed, heads, size):
    """x -> q, k, v products -> head splits (Reshape + Transpose) -> k, v after the cache's past (Concat) ->
    Attention -> head merge -> y; present_k, present_v graph outputs (a decoder's decode step)."""
    rng = np.random.default_rng(embed + length)
    weights, nodes = {}, []
    for name in "qkv":
        weights[f"w{name}"] = (rng.standard_normal((embed, heads * size)) / 3).astype(np.float32)
        weights[f"{name}_shape"] = np.array([batch, length, -1, size], np.int64)
        nodes += [helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}_flat"]),
                  helper.make_node("Reshape", [f"{name}_flat", f"{name}_shape"], [f"{name}_split"]),
                  helper.make_node("Transpose", [f"{name}_split"], [f"{name}_heads"], perm=[0, 2, 1, 3])]
    weights["merged_shape"] = np.array([batch, length, -1], np.int64)
    nodes += [helper.make_node("Concat", ["past_k", "k_heads"], ["present_k"], axis=2),
              helper.make_node("Concat", ["past_v", "v_heads"], ["present_v"], axis=2),
              helper.make_node("Attention", ["q_heads", "present_k", "present_v"], ["y_heads"]),
              helper.make_node("Transpose", ["y_heads"], ["y_split"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["y_split", "merged_shape"], ["y"])]
    cache = [batch, heads, past, size]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [batch, length, embed]),
                               tensor_info("past_k", TensorProto.FLOAT, cache),
                               tensor_info("past_v", TensorProto.FLOAT, cache)],
                       [tensor_info(n, TensorProto.FLOAT, None) for n in ("y", "present_k", "present_v")],
                       [numpy_helper.from_array(v, n) for n, v in weights.items()], opset=23)
    return model, weights


@pytest.mark.parametrize("case", [(1, 1, 6, 16, 4, 4), (2, 1, 3, 10, 2, 3), (1, 4, 5, 12, 3, 4)],
                         ids=["decode", "decode-b2", "prefill-rows"])
def test_a_cached_layer_folds_its_splits_and_matches_float64(case, made):
    batch, length, past, embed, heads, size = case
    model, weights = _cached_layer(*case)
    session = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    rng = np.random.default_rng(3)
    for _ in range(3):  # (the specialized plan, where the passes fire, is made at a first run)
        feeds = {"x": rng.standard_normal((batch, length, embed)).astype(np.float32),
                 "past_k": rng.standard_normal((batch, heads, past, size)).astype(np.float32),
                 "past_v": rng.standard_normal((batch, heads, past, size)).astype(np.float32)}
        got = session.run(None, feeds)
        exact = run_float64(model, feeds)
        x64 = np.abs(feeds["x"].astype(np.float64))
        product = max(float((x64 @ np.abs(weights[f"w{n}"])).max()) for n in "qkv")
        bound = gamma(embed + 1) * product * 8 * (1 + product * np.sqrt(size)) + gamma(size + past + length + 8) * 40
        for name, value, reference in zip(("y", "present_k", "present_v"), got, exact):
            assert_within(value, reference, bound, name)
    ops = [op for op, _ in made]
    assert "ProjectionGroup" in ops and "ReshapeTranspose" not in ops, ops


ZOO_DECODERS = ["gpt2.torchscript.fp32", "gpt2.dynamo.fp32", "llama.torchscript.fp32", "llama.dynamo.fp32"]


@pytest.mark.parametrize("name", ZOO_DECODERS)
def test_zoo_decoders_keep_no_head_split_step(name, made):
    entry, path = zoo_model(name)
    from zoo_feeds import make_feeds

    session = ort.InferenceSession(path, providers=["cpu"])
    feeds = make_feeds(entry["calls"]["decode"])
    for _ in range(2):
        got = session.run(None, feeds)
    ops = [op for op, _ in made]
    # (q, k and v split inside their group; the head merge after the attention stays)
    assert "ProjectionGroup" in ops and "ReshapeTranspose" not in ops, ops
    for value, exact in zip(got, run_float64(onnx.load(path), feeds)):
        scale = float(np.abs(exact).max()) + 1e-6
        np.testing.assert_allclose(value, exact, rtol=0, atol=1e-4 * scale)


def test_without_the_fold_the_splits_stay(made, monkeypatch):
    """The pass is what removes them: the cached layer keeps its three head splits without it."""
    monkeypatch.setattr(provider, "HEADS_PASSES",
                        [p for p in attention_heads.HEADS_PASSES if p is not projection_groups.fold_head_splits],
                        raising=False)
    model, _ = _cached_layer(1, 1, 4, 8, 2, 4)
    session = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    feeds = {"x": np.ones((1, 1, 8), np.float32), "past_k": np.ones((1, 2, 4, 4), np.float32),
             "past_v": np.ones((1, 2, 4, 4), np.float32)}
    for _ in range(2):
        session.run(None, feeds)
    assert [op for op, _ in made].count("ReshapeTranspose") >= 3
