"""An attention's query, key and value products of one input run as one ProjectionGroup (projection_groups.py),
whose column views the attention reads in place, and a ViT patch embedding (a convolution whose stride is its
kernel, then flatten + transpose) as one PatchEmbedding product (patch_embedding.py). Both against float64
references with odd sizes (with and without biases, a member without one, batches above one, grouped-query
heads, the few-row loop and the larger paths), and on the zoo's exports from both torch exporters against the
same models with the two passes off (the unfused graph) and onnxruntime."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime_ep_cpu import attention_heads, patch_embedding, projection_groups, provider
from reference64 import assert_within, gamma

ZOO = Path(__file__).resolve().parents[2] / "benchmarks" / ".models" / "zoo"


def _without(monkeypatch, *passes) -> None:
    kept = [p for p in attention_heads.HEADS_PASSES if p not in passes]
    monkeypatch.setattr(provider, "HEADS_PASSES", kept, raising=False)


# -- query, key and value as one product ---------------------------------------------------------------------


def _attention_model(batch, length, embed, q_heads, kv_heads, size, biases: str, mask: bool):
    """x -> projections (MatMul, + Add of a bias where ``biases`` has a 1 at the member's place, as the
    TorchScript exporter and the dynamo exporter's whisper k_proj write them) -> head split -> Attention-23 ->
    head merge."""
    rng = np.random.default_rng(embed * 31 + size)
    widths = {"q": q_heads * size, "k": kv_heads * size, "v": kv_heads * size}
    weights, initializers, nodes = {}, [], []
    for index, (name, width) in enumerate(widths.items()):
        weights[f"w{name}"] = (rng.standard_normal((embed, width)) / 3).astype(np.float32)
        product = f"{name}_flat"
        nodes.append(helper.make_node("MatMul", ["x", f"w{name}"], [product]))
        if biases[index] == "1":
            weights[f"b{name}"] = rng.standard_normal(width).astype(np.float32)
            nodes.append(helper.make_node("Add", [product, f"b{name}"], [f"{name}_biased"]))
            product = f"{name}_biased"
        weights[f"{name}_shape"] = np.array([batch, length, -1, size], np.int64)
        nodes += [helper.make_node("Reshape", [product, f"{name}_shape"], [f"{name}_split"]),
                  helper.make_node("Transpose", [f"{name}_split"], [f"{name}_heads"], perm=[0, 2, 1, 3])]
    weights["merged_shape"] = np.array([batch, length, -1], np.int64)
    initializers = [numpy_helper.from_array(value, name) for name, value in weights.items()]
    nodes += [helper.make_node("Attention", ["q_heads", "k_heads", "v_heads"] + (["mask"] if mask else []),
                               ["y_heads"]),
              helper.make_node("Transpose", ["y_heads"], ["y_split"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["y_split", "merged_shape"], ["y"])]
    inputs = [tensor_info("x", TensorProto.FLOAT, [batch, length, embed])]
    if mask:
        inputs.append(tensor_info("mask", TensorProto.FLOAT, [batch, 1, length, length]))
    model = make_model(nodes, inputs, [tensor_info("y", TensorProto.FLOAT, None)], initializers, opset=23)
    return model.SerializeToString(), weights


def _attention_reference(feeds, weights, q_heads, kv_heads, size) -> tuple[np.ndarray, np.ndarray]:
    """Y in float64, and a bound on a float32 computation's error: the projections' (gamma of their depth
    times the magnitudes), carried through the softmax-weighted sums, plus the attention's own."""
    x = feeds["x"].astype(np.float64)
    batch, length, embed = x.shape

    def heads(name, count):
        y = x @ weights[f"w{name}"].astype(np.float64)
        if f"b{name}" in weights:
            y = y + weights[f"b{name}"]
        return y.reshape(batch, length, count, size).transpose(0, 2, 1, 3)

    q, k, v = heads("q", q_heads), heads("k", kv_heads), heads("v", kv_heads)
    k, v = np.repeat(k, q_heads // kv_heads, axis=1), np.repeat(v, q_heads // kv_heads, axis=1)
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(size)
    if "mask" in feeds:
        scores = scores + feeds["mask"].astype(np.float64)
    weights_ = np.exp(scores - scores.max(-1, keepdims=True))
    probs = weights_ / weights_.sum(-1, keepdims=True)
    y = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, length, -1)
    scale = max(float(np.abs(q).max()), float(np.abs(k).max()), float(np.abs(v).max()), 1.0)
    bound = (gamma(embed + 1) * 40 + gamma(size + length + 8) * 40) * scale * (1 + scale * np.sqrt(size))
    return y, np.full(y.shape, bound)


def _feeds(batch, length, embed, mask: bool, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((batch, length, embed)).astype(np.float32)}
    if mask:
        hidden = rng.random((batch, 1, length, length)) < 0.3
        hidden[..., 0] = False
        feeds["mask"] = np.where(hidden, -np.inf, rng.standard_normal((batch, 1, length, length))).astype(np.float32)
    return feeds


GROUPS = [
    # batch, length, embed, query heads, KV heads, head size, biases (q k v), mask
    (1, 17, 64, 4, 4, 16, "111", False),  # a ViT's: the few-row loop in lanes over column views
    (2, 9, 13, 3, 3, 5, "101", True),  # odd sizes, a member without a bias (whisper's key), a mask
    (2, 7, 11, 4, 2, 3, "000", False),  # grouped-query heads, no biases (T5's)
    (1, 3, 9, 2, 2, 5, "111", False),  # few query rows: the scalar loop (a contiguous copy of the views)
    (2, 40, 24, 4, 4, 16, "011", True),  # too long for the few-row loop: the products path
]


@pytest.mark.parametrize("case", GROUPS, ids=[f"b{c[0]}s{c[1]}e{c[2]}h{c[3]}-{c[4]}d{c[5]}bias{c[6]}m{int(c[7])}"
                                              for c in GROUPS])
def test_projection_group_matches_the_float64_reference_and_the_unfused_graph(case, made, monkeypatch):
    batch, length, embed, q_heads, kv_heads, size, biases, mask = case
    model, weights = _attention_model(*case)
    session = ort.InferenceSession(model, providers=["cpu"])
    for seed in (0, 1):  # the planned kernels on new values
        feeds = _feeds(batch, length, embed, mask, seed)
        (y,) = session.run(None, feeds)
        exact, bound = _attention_reference(feeds, weights, q_heads, kv_heads, size)
        assert_within(y, exact, bound, f"seed {seed}")
    groups = [shapes for op, shapes in made if op == "ProjectionGroup"]
    assert groups and groups[0][0] == (batch, length, embed), made
    _without(monkeypatch, projection_groups.group_attention_projections, projection_groups.group_sibling_projections)
    made.clear()
    (unfused,) = ort.InferenceSession(model, providers=["cpu"]).run(None, feeds)
    assert not [op for op, _ in made if op == "ProjectionGroup"]
    assert_within(y, unfused.astype(np.float64), 2 * bound, "against the unfused graph")


def test_a_projection_read_elsewhere_stays_its_own_product(made):
    """The key product also a graph output: query and value still merge, the key keeps its node."""
    model, weights = _attention_model(2, 9, 13, 3, 3, 5, "111", False)
    proto = __import__("onnx").load_from_string(model)
    proto.graph.output.append(tensor_info("k_biased", TensorProto.FLOAT, None))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["cpu"])
    feeds = _feeds(2, 9, 13, False, 0)
    y, key = session.run(None, feeds)
    exact, bound = _attention_reference(feeds, weights, 3, 3, 5)
    assert_within(y, exact, bound)
    np.testing.assert_allclose(key, feeds["x"] @ weights["wk"] + weights["bk"], rtol=1e-5, atol=1e-5)
    assert [op for op, _ in made].count("ProjectionGroup") == 1


def test_projection_group_kernel_shapes_and_errors():
    """The kernel for other shapes than planned (the general path), and a weight of another width: typed."""
    from onnx_runtime_ep_cpu.ops.projection_group import projection_group

    node = type("N", (), {"name": "g", "op_type": "ProjectionGroup", "outputs": ["a", "b"],
                          "attr": lambda self, k, d=None: {"widths": [3, 5]}.get(k, d)})()
    kernel = projection_group(node, [(2, 4, 7), (7, 8), (8,)], 1)
    rng = np.random.default_rng(3)
    w, b = rng.standard_normal((7, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    for shape in ((2, 4, 7), (3, 7), (1, 2, 5, 7)):
        a = rng.standard_normal(shape).astype(np.float32)
        first, second = kernel(a, w, b)
        exact = a.astype(np.float64) @ w + b
        bound = gamma(8) * (np.abs(a.astype(np.float64)) @ np.abs(w) + np.abs(b))
        assert_within(first, exact[..., :3], bound[..., :3], f"{shape}")
        assert_within(second, exact[..., 3:], bound[..., 3:], f"{shape}")
    with pytest.raises(OnnxRuntimeError, match="expected A"):
        kernel(rng.standard_normal((2, 4, 7)).astype(np.float32), w[:, :6], b)


def test_merged_weights_are_shared_by_specializations_and_released_with_the_session():
    """Each signature's specialized graph merges the same constants: one merged array for all, dropped once the
    session (which holds the members' weights) is gone."""
    import gc

    model, weights = _attention_model(1, 5, 8, 2, 2, 3, "101", False)
    proto = __import__("onnx").load_from_string(model)
    proto.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "s"  # the length free: one plan per length
    for name in ("q_shape", "k_shape", "v_shape", "merged_shape"):
        init = next(i for i in proto.graph.initializer if i.name == name)
        value = numpy_helper.to_array(init).copy()
        value[1] = 0  # (Reshape copies the length)
        init.CopyFrom(numpy_helper.from_array(value, name))
    gc.collect()
    before = projection_groups.kept_merges()
    session = ort.InferenceSession(proto.SerializeToString(), providers=["cpu"])
    for length in (5, 7, 5, 9):
        feeds = _feeds(1, length, 8, False, length)
        (y,) = session.run(None, feeds)
        exact, bound = _attention_reference(feeds, weights, 2, 2, 3)
        assert_within(y, exact, bound, f"length {length}")
    assert projection_groups.kept_merges() == before + 1
    del session
    gc.collect()
    assert projection_groups.kept_merges() == before


# -- the patch embedding ---------------------------------------------------------------------------------------


def _patch_model(batch, channels, height, width, patch, out_channels, bias: bool, dynamo: bool):
    """Conv(kernel = stride = patch) -> flatten(2) -> transpose(1, 2): the dynamo exporter's constant Reshape, or
    the TorchScript exporter's shape read back (Shape, Gather, Unsqueeze, Concat) for the flattened size."""
    rng = np.random.default_rng(channels * 7 + height)
    weight = (rng.standard_normal((out_channels, channels, *patch)) / 4).astype(np.float32)
    values = {"w": weight}
    if bias:
        values["b"] = rng.standard_normal(out_channels).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["conv"], kernel_shape=list(patch),
                              strides=list(patch), pads=[0, 0, 0, 0], dilations=[1, 1], group=1)]
    if dynamo:
        values["flat"] = np.array([batch, out_channels, -1], np.int64)
        nodes.append(helper.make_node("Reshape", ["conv", "flat"], ["flattened"]))
    else:
        values.update({"i0": np.array(0, np.int64), "i1": np.array(1, np.int64), "minus": np.array([-1], np.int64),
                       "axes": np.array([0], np.int64)})
        nodes += [helper.make_node("Shape", ["conv"], ["shape"]),
                  helper.make_node("Gather", ["shape", "i0"], ["n"], axis=0),
                  helper.make_node("Gather", ["shape", "i1"], ["c"], axis=0),
                  helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
                  helper.make_node("Unsqueeze", ["c", "axes"], ["c1"]),
                  helper.make_node("Concat", ["n1", "c1", "minus"], ["flat"], axis=0),
                  helper.make_node("Reshape", ["conv", "flat"], ["flattened"])]
    nodes.append(helper.make_node("Transpose", ["flattened"], ["tokens"], perm=[0, 2, 1]))
    initializers = [numpy_helper.from_array(value, name) for name, value in values.items()]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, ["n" if not dynamo else batch, channels,
                                                                     height, width])],
                       [tensor_info("tokens", TensorProto.FLOAT, None)], initializers, opset=17)
    return model.SerializeToString(), values


def _patch_reference(x, values, patch) -> tuple[np.ndarray, np.ndarray]:
    """The tokens in float64 (each output position's own patch times the kernel), and gamma of the patch size
    times the magnitudes."""
    weight = values["w"].astype(np.float64)
    kh, kw = patch
    batch, channels, height, width = x.shape
    rows, columns = height // kh, width // kw
    patches = x[:, :, :rows * kh, :columns * kw].astype(np.float64).reshape(batch, channels, rows, kh, columns, kw)
    patches = patches.transpose(0, 2, 4, 1, 3, 5).reshape(batch, rows * columns, -1)
    matrix = weight.reshape(weight.shape[0], -1).T
    bias = values.get("b", np.zeros(weight.shape[0])).astype(np.float64)
    exact = patches @ matrix + bias
    bound = gamma(matrix.shape[0] + 1) * (np.abs(patches) @ np.abs(matrix) + np.abs(bias))
    return exact, bound


PATCHES = [
    # batch, channels, height, width, patch, out channels, bias
    (1, 3, 32, 32, (8, 8), 64, True),  # the zoo's ViT
    (2, 5, 15, 21, (5, 7), 11, True),  # odd sizes, a patch that is not square, a batch of two
    (1, 3, 17, 13, (4, 3), 7, False),  # rows and columns past the last whole patch (read by no output), no bias
]


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("case", PATCHES, ids=[f"b{c[0]}c{c[1]}{c[2]}x{c[3]}p{c[4][0]}x{c[4][1]}m{c[5]}"
                                               f"bias{int(c[6])}" for c in PATCHES])
def test_patch_embedding_matches_the_float64_reference_and_the_unfused_graph(case, dynamo, made, monkeypatch):
    batch, channels, height, width, patch, out_channels, bias = case
    model, values = _patch_model(*case, dynamo=dynamo)
    session = ort.InferenceSession(model, providers=["cpu"])
    rng = np.random.default_rng(5)
    for _ in range(2):
        x = rng.standard_normal((batch, channels, height, width)).astype(np.float32)
        (tokens,) = session.run(None, {"x": x})
        exact, bound = _patch_reference(x, values, patch)
        assert_within(tokens, exact, bound)
    assert [op for op, _ in made].count("PatchEmbedding") == 1, made
    assert "Conv" not in [op for op, _ in made]
    _without(monkeypatch, patch_embedding.fuse_patch_embedding)
    made.clear()
    (unfused,) = ort.InferenceSession(model, providers=["cpu"]).run(None, {"x": x})
    assert "Conv" in [op for op, _ in made]
    assert_within(tokens, unfused.astype(np.float64), 2 * bound, "against the unfused graph")


def test_a_padded_or_overlapping_convolution_is_not_a_patch_embedding(made):
    model, _ = _patch_model(1, 3, 16, 16, (4, 4), 8, True, dynamo=True)
    proto = __import__("onnx").load_from_string(model)
    conv = proto.graph.node[0]
    del conv.attribute[:]
    conv.attribute.extend([helper.make_attribute("kernel_shape", [4, 4]), helper.make_attribute("strides", [2, 2]),
                           helper.make_attribute("pads", [1, 1, 1, 1])])
    proto.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array([1, 8, -1], np.int64), "flat"))
    ort.InferenceSession(proto.SerializeToString(), providers=["cpu"]).run(
        None, {"x": np.ones((1, 3, 16, 16), np.float32)})
    assert "PatchEmbedding" not in [op for op, _ in made] and "Conv" in [op for op, _ in made]


def test_patch_embedding_kernel_refuses_a_weight_of_another_depth():
    from onnx_runtime_ep_cpu.ops.patch_embedding import patch_embedding as factory

    node = type("N", (), {"name": "p", "op_type": "PatchEmbedding", "outputs": ["t"],
                          "attr": lambda self, k, d=None: {"kernel_shape": [2, 2]}.get(k, d)})()
    kernel = factory(node, [(1, 3, 4, 4), (12, 5), (5,)], 1)
    with pytest.raises(OnnxRuntimeError, match="expected x"):
        kernel(np.ones((1, 3, 4, 4), np.float32), np.ones((10, 5), np.float32), np.ones(5, np.float32))


# -- the zoo's exports -----------------------------------------------------------------------------------------

ZOO_MODELS = ["vit.torchscript.fp32", "vit.dynamo.fp32", "bert.torchscript.fp32", "bert.dynamo.fp32",
              "whisper_encoder.torchscript.fp32", "whisper_encoder.dynamo.fp32", "t5_encoder.torchscript.fp32",
              "t5_encoder.dynamo.fp32"]


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_encoders_fuse_and_match_the_unfused_graph(name, made, monkeypatch):
    if not (ZOO / f"{name}.onnx").is_file():
        pytest.skip("the model zoo is not built: run scripts/build_zoo.sh")
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from zoo_feeds import make_feeds

    entry = next(m for m in json.loads((ZOO / "manifest.json").read_text())["models"] if m["name"] == name)
    feeds = make_feeds(entry["calls"]["default"])
    path = str(ZOO / f"{name}.onnx")
    session = ort.InferenceSession(path, providers=["cpu"])
    for _ in range(2):  # (the specialized plan, where the passes fire, is made at a first run)
        ours = session.run(None, feeds)
    ops = [op for op, _ in made]
    assert ops.count("ProjectionGroup") == 2, ops  # (each zoo encoder has two layers)
    if name.startswith("vit"):
        assert ops.count("PatchEmbedding") == 1 and "Conv" not in ops, ops
    _without(monkeypatch, projection_groups.group_attention_projections, projection_groups.group_sibling_projections,
             patch_embedding.fuse_patch_embedding)
    unfused = ort.InferenceSession(path, providers=["cpu"]).run(None, feeds)
    theirs = oracle.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, plain, reference in zip(ours, unfused, theirs):
        scale = float(np.abs(reference).max()) + 1e-6
        np.testing.assert_allclose(got, plain, rtol=0, atol=2e-5 * scale)
        np.testing.assert_allclose(got, reference, rtol=0, atol=1e-4 * scale)
