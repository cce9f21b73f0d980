"""A ViT's class token Concat and position Add folded into its PatchEmbedding (patch_embedding.fuse_patch_tokens),
on both torch exporters' spellings (the dynamo exporter's constant Expand shape, the TorchScript exporter's batch
read back through Shape/Gather/Unsqueeze/Concat), against a float64 reference and the graph without the fold."""

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
from onnx_runtime_ep_cpu import attention_heads, patch_embedding, provider
from reference64 import assert_within, gamma

ZOO = Path(__file__).resolve().parents[2] / "benchmarks" / ".models" / "zoo"


def _without_fold(monkeypatch) -> None:
    kept = [p for p in attention_heads.HEADS_PASSES if p is not patch_embedding.fuse_patch_tokens]
    monkeypatch.setattr(provider, "HEADS_PASSES", kept, raising=False)


def _model(batch, lead, positions, dynamo, swapped=False, cls_from_input=False):
    """x (batch, 3, 16, 12) -> Conv(4x4 patches, 8 channels, bias) -> flatten -> transpose -> Concat(Expand(cls),
    tokens; axis 1) [lead > 0] -> Add(., position table) [``positions``: the table's shape, or None]."""
    rng = np.random.default_rng(batch * 10 + lead)
    channels, count = 8, (16 // 4) * (12 // 4)
    values = {"w": (rng.standard_normal((channels, 3, 4, 4)) / 4).astype(np.float32),
              "b": rng.standard_normal(channels).astype(np.float32),
              "flat": np.array([batch, channels, -1], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv"], kernel_shape=[4, 4], strides=[4, 4]),
             helper.make_node("Reshape", ["conv", "flat"], ["flattened"]),
             helper.make_node("Transpose", ["flattened"], ["tokens"], perm=[0, 2, 1])]
    inputs = [tensor_info("x", TensorProto.FLOAT, [batch, 3, 16, 12])]
    out = "tokens"
    if lead:
        if cls_from_input:
            inputs.append(tensor_info("cls", TensorProto.FLOAT, [1, lead, channels]))
        else:
            values["cls"] = rng.standard_normal((1, lead, channels)).astype(np.float32)
        if dynamo:
            values["expand_to"] = np.array([batch, 1, 1], np.int64)
        else:  # the batch read back from x
            values.update({"i0": np.array(0, np.int64), "axes": np.array([0], np.int64),
                           "ones": np.array([1, 1], np.int64)})
            nodes += [helper.make_node("Shape", ["x"], ["x_shape"]),
                      helper.make_node("Gather", ["x_shape", "i0"], ["n"], axis=0),
                      helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
                      helper.make_node("Concat", ["n1", "ones"], ["expand_to"], axis=0)]
        nodes += [helper.make_node("Expand", ["cls", "expand_to"], ["cls_rows"]),
                  helper.make_node("Concat", ["cls_rows", out], ["with_cls"], axis=1)]
        out = "with_cls"
    if positions is not None:
        values["pos"] = rng.standard_normal(positions).astype(np.float32)
        nodes.append(helper.make_node("Add", ["pos", out] if swapped else [out, "pos"], ["embedded"]))
        out = "embedded"
    nodes.append(helper.make_node("Identity", [out], ["y"]))
    initializers = [numpy_helper.from_array(value, name) for name, value in values.items()]
    model = make_model(nodes, inputs, [tensor_info("y", TensorProto.FLOAT, [batch, lead + count, channels])],
                       initializers, opset=17)
    return model.SerializeToString(), values


def _reference(x, values, lead, cls=None):
    """The embedded tokens in float64, and a bound on float32's error."""
    batch = x.shape[0]
    patches = x.astype(np.float64).reshape(batch, 3, 4, 4, 3, 4).transpose(0, 2, 4, 1, 3, 5).reshape(batch, 12, -1)
    matrix = values["w"].astype(np.float64).reshape(8, -1).T
    bias = values["b"].astype(np.float64)
    tokens = patches @ matrix + bias
    bound = gamma(matrix.shape[0] + 2) * (np.abs(patches) @ np.abs(matrix) + np.abs(bias))
    if lead:
        head = (values["cls"] if cls is None else cls).astype(np.float64)
        tokens = np.concatenate([np.broadcast_to(head, (batch, *head.shape[1:])), tokens], axis=1)
        bound = np.concatenate([np.zeros((batch, lead, 8)), bound], axis=1)
    if "pos" in values:
        position = values["pos"].astype(np.float64)
        tokens = tokens + position
        bound = bound + gamma(1) * np.abs(tokens)
    return tokens, bound


CASES = [
    # batch, leading tokens, position table shape (None: no Add), Add(pos, tokens)
    (1, 1, (1, 13, 8), False),  # a ViT's class token and positions
    (2, 1, (1, 13, 8), True),  # a batch of two, the table as the Add's first operand
    (2, 2, (14, 8), False),  # two leading tokens (DeiT's class and distillation), a 2-D table
    (1, 0, (1, 12, 8), False),  # positions without a class token
    (3, 1, None, False),  # a class token without positions
    (2, 1, (1, 1, 8), False),  # one row broadcast over every token
]


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}lead{c[1]}pos{'x'.join(map(str, c[2] or ()))}{'swap' * c[3]}"
                                             for c in CASES])
def test_class_token_and_positions_fold_into_the_patch_embedding(case, dynamo, made, monkeypatch):
    batch, lead, positions, swapped = case
    model, values = _model(batch, lead, positions, dynamo, swapped)
    session = ort.InferenceSession(model, providers=["cpu"])
    rng = np.random.default_rng(3)
    for _ in range(2):  # (the specialized plan, where the passes fire, is made at a first run)
        x = rng.standard_normal((batch, 3, 16, 12)).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        exact, bound = _reference(x, values, lead)
        assert_within(y, exact, bound)
    ops = [op for op, _ in made]
    assert "PatchEmbedding" in ops and "Conv" not in ops, ops
    kernels = [(op, shapes) for op, shapes in made if op == "PatchEmbedding"]
    assert len(kernels[-1][1]) == 3 + (1 if lead else 0) + (1 if positions is not None else 0) + \
        (1 if positions is not None and not lead else 0), kernels  # (an absent head input is "")
    assert not any(op == "Concat" and shapes and len(shapes[0]) == 3 for op, shapes in made[-3:]), made
    assert "Add" not in ops[-3:], made
    _without_fold(monkeypatch)
    made.clear()
    (unfused,) = ort.InferenceSession(model, providers=["cpu"]).run(None, {"x": x})
    assert ("Add" if positions is not None else "Concat") in [op for op, _ in made], made
    np.testing.assert_array_equal(y, unfused)  # the same float32 operations in the same order


def test_a_class_token_fed_at_run_time_is_not_folded(made):
    model, values = _model(1, 1, (1, 13, 8), dynamo=True, cls_from_input=True)
    session = ort.InferenceSession(model, providers=["cpu"])
    rng = np.random.default_rng(4)
    for _ in range(2):
        x = rng.standard_normal((1, 3, 16, 12)).astype(np.float32)
        cls = rng.standard_normal((1, 1, 8)).astype(np.float32)
        (y,) = session.run(None, {"x": x, "cls": cls})
        exact, bound = _reference(x, values, 1, cls)
        assert_within(y, exact, bound)
    assert "Concat" in [op for op, _ in made], made


def test_patch_embedding_kernel_refuses_positions_of_another_token_count():
    from onnx_runtime_ep_cpu.ops.patch_embedding import patch_embedding as factory

    node = type("N", (), {"name": "p", "op_type": "PatchEmbedding", "outputs": ["t"],
                          "attr": lambda self, k, d=None: {"kernel_shape": [2, 2]}.get(k, d)})()
    kernel = factory(node, [(1, 3, 4, 4), (12, 5), (5,), (1, 5), (4, 5)], 1)
    ones = np.ones
    with pytest.raises(OnnxRuntimeError, match="positions"):
        kernel(ones((1, 3, 4, 4), np.float32), ones((12, 5), np.float32), ones(5, np.float32),
               ones((1, 5), np.float32), ones((3, 5), np.float32))
    (y,) = kernel(ones((1, 3, 4, 4), np.float32), ones((12, 5), np.float32), ones(5, np.float32),
                  np.full((1, 5), 7, np.float32), ones((4, 5), np.float32))
    assert y.shape == (1, 5, 5) and (y[0, 0] == 7).all() and (y[0, 1:] == 14).all()


@pytest.mark.parametrize("name", ["vit.torchscript.fp32", "vit.dynamo.fp32"])
def test_zoo_vit_folds_its_class_token_and_positions(name, made):
    if not (ZOO / f"{name}.onnx").is_file():
        pytest.skip("the model zoo is not built: run scripts/build_zoo.sh")
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from zoo_feeds import make_feeds

    entry = next(m for m in json.loads((ZOO / "manifest.json").read_text())["models"] if m["name"] == name)
    feeds = make_feeds(entry["calls"]["default"])
    path = str(ZOO / f"{name}.onnx")
    session = ort.InferenceSession(path, providers=["cpu"])
    for _ in range(2):
        ours = session.run(None, feeds)
    planned = [(op, shapes) for op, shapes in made]
    patches = [shapes for op, shapes in planned if op == "PatchEmbedding"]
    assert patches and len(patches[-1]) == 5, planned  # x, weight, bias, class row, positions
    assert not any(op == "Concat" and shapes and len(shapes[0]) == 3 for op, shapes in planned), planned
    theirs = oracle.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, reference in zip(ours, theirs):
        scale = float(np.abs(reference).max()) + 1e-6
        np.testing.assert_allclose(got, reference, rtol=0, atol=1e-4 * scale)
