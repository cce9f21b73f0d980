"""A static-QDQ ViT's patch embedding (patch_embedding.fuse_patch_embedding): the convolution's per-tensor
output rounding moves past the token layout, so Conv -> QuantizeDequantize -> ReshapeTranspose is one
PatchEmbedding and the rounding on its tokens; bit-equal to the graph where the rounding stays (the same float32
products, the same rounding of each value), within one code of onnxruntime; a per-channel output rounding keeps
the convolution; both exporters' zoo ViTs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import patch_embedding

ZOO = Path(__file__).resolve().parents[2] / "benchmarks" / ".models" / "zoo"
Y_SCALE = 0.05


def _model(batch: int, act, per_channel_output: bool = False) -> bytes:
    """x (batch, 3, 16, 12) -> Q -> DQ -> Conv(DQ(int8 W, per channel), bias; 4x4 patches, 8 channels) -> Q -> DQ
    -> Reshape (batch, 8, -1) -> Transpose (0, 2, 1) -> y, as the quantization tools write a ViT's stem."""
    rng = np.random.default_rng(batch)
    zero = np.array(128 if act == np.uint8 else 0, act)
    y_scale = np.full(8, Y_SCALE, np.float32) if per_channel_output else np.array(Y_SCALE, np.float32)
    y_zero = np.full(8, zero, act) if per_channel_output else zero
    values = {"xs": np.array(0.02, np.float32), "xz": zero,
              "w": rng.integers(-127, 128, (8, 3, 4, 4)).astype(np.int8),
              "ws": (rng.random(8) * 0.002 + 0.001).astype(np.float32), "wz": np.zeros(8, np.int8),
              "b": (rng.standard_normal(8) * 0.2).astype(np.float32), "ys": y_scale, "yz": y_zero,
              "flat": np.array([batch, 8, -1], np.int64)}
    axis = {"axis": 1} if per_channel_output else {}
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd", "b"], ["conv"], kernel_shape=[4, 4], strides=[4, 4]),
             helper.make_node("QuantizeLinear", ["conv", "ys", "yz"], ["cq"], **axis),
             helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["cd"], **axis),
             helper.make_node("Reshape", ["cd", "flat"], ["flattened"]),
             helper.make_node("Transpose", ["flattened"], ["y"], perm=[0, 2, 1])]
    return make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [batch, 3, 16, 12])],
                      [tensor_info("y", TensorProto.FLOAT, [batch, 12, 8])],
                      [numpy_helper.from_array(v, k) for k, v in values.items()], opset=19).SerializeToString()


def _runs(model: bytes, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model, providers=["cpu"])
    for _ in range(2):  # (the specialized plan, where the passes fire, is made at a first run)
        (y,) = session.run(None, feeds)[:1]
    return y


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("act", [np.uint8, np.int8])
def test_rounded_patch_embedding_is_one_product(batch, act, made, monkeypatch):
    model = _model(batch, act)
    x = (np.random.default_rng(7).standard_normal((batch, 3, 16, 12)) * 1.5).astype(np.float32)
    y = _runs(model, {"x": x})
    ops = [op for op, _ in made]
    assert "PatchEmbedding" in ops and "Conv" not in ops, ops
    made.clear()
    monkeypatch.setattr(patch_embedding, "_per_tensor_rounding", lambda *a: False)
    kept = _runs(model, {"x": x})
    assert "Conv" in [op for op, _ in made] and "PatchEmbedding" not in [op for op, _ in made], made
    np.testing.assert_array_equal(y, kept)
    (oracle,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    codes, want = np.rint(y.astype(np.float64) / Y_SCALE), np.rint(oracle.astype(np.float64) / Y_SCALE)
    assert np.abs(codes - want).max() <= 1 and np.mean(codes == want) >= 0.99


def test_a_per_channel_output_rounding_keeps_the_convolution(made):
    model = _model(1, np.uint8, per_channel_output=True)
    x = np.random.default_rng(8).standard_normal((1, 3, 16, 12)).astype(np.float32)
    y = _runs(model, {"x": x})
    assert "Conv" in [op for op, _ in made], made
    options = onnxruntime.SessionOptions()  # (its QLinearConv takes one output zero point: the nodes as written)
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    (oracle,) = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.abs(np.rint(y.astype(np.float64) / Y_SCALE) - np.rint(oracle.astype(np.float64) / Y_SCALE)).max() <= 1


@pytest.mark.parametrize("name", ["vit.torchscript.int8_qdq", "vit.dynamo.int8_qdq"])
def test_zoo_qdq_vit_embeds_its_patches_in_one_product(name, made, monkeypatch):
    if not (ZOO / f"{name}.onnx").is_file():
        pytest.skip("the model zoo is not built: run scripts/build_zoo.sh")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from zoo_feeds import make_feeds

    entry = next(m for m in json.loads((ZOO / "manifest.json").read_text())["models"] if m["name"] == name)
    feeds = make_feeds(entry["calls"]["default"])
    model = (ZOO / f"{name}.onnx").read_bytes()
    y = _runs(model, feeds)
    ops = [op for op, _ in made]
    assert "PatchEmbedding" in ops and "Conv" not in ops, ops
    monkeypatch.setattr(patch_embedding, "_per_tensor_rounding", lambda *a: False)
    np.testing.assert_array_equal(y, _runs(model, feeds))
    (oracle,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[:1]
    assert np.abs(y - oracle).max() <= 0.05 * float(np.abs(oracle).max())
