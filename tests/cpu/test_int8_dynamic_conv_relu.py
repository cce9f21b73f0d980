"""A DynamicQuantizeConv's Relu folded in (dynamic_epilogues.fold_dynamic_conv_relu, activation "relu"): the
Relu kernel's np.maximum in place, so the unfused nodes' bits, within onnxruntime's and the float64 reference's;
both exporters' int8_dynamic ResNet take it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime
import pytest
from model_helpers import session_without_passes, zoo_model
from onnx import TensorProto, helper
from onnx_runtime.errors import InvalidGraphError
from onnx_runtime_ep_cpu.compiled import deferred
from test_int8_dynamic_conv import GEOMETRIES, chain_model, reference

onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")


def with_relu(data: bytes, graph_output: bool = False) -> bytes:
    m = onnx.load_from_string(data)
    m.graph.node[-1].output[0] = "pre"
    m.graph.node.append(helper.make_node("Relu", ["pre"], ["y"]))
    if graph_output:
        m.graph.output.append(helper.make_tensor_value_info("pre", TensorProto.FLOAT, None))
    return m.SerializeToString()


def without_fold(data, monkeypatch):
    return session_without_passes(data, monkeypatch, "DYNAMIC_EPILOGUE_PASSES", "fold_dynamic_conv_relu")


def ops(session) -> list[str]:
    return [n.op_type for n in session.placement()]


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_relu_folds_into_the_conv(geometry, monkeypatch):
    base = chain_model(*geometry)
    data = with_relu(base)
    ours = onnx_runtime.InferenceSession(data, providers=["cpu"])
    assert "Relu" not in ops(ours) and ops(ours).count("DynamicQuantizeConv") == 1
    plain = without_fold(data, monkeypatch)
    assert "Relu" in ops(plain)
    theirs = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(len(geometry[0]))
    for trial in range(3):  # numpy first, then the compiled call
        x = rng.standard_normal(geometry[0]).astype(np.float32)
        if trial == 2:
            x.reshape(-1)[3] = np.nan  # a NaN code quantizes to the zero point, as DynamicQuantizeLinear's
        (y,) = ours.run(None, {"x": x})
        np.testing.assert_array_equal(y, plain.run(None, {"x": x})[0])
        assert (y >= 0).all()
        if trial < 2:  # (the float64 reference takes no NaN)
            expected = np.maximum(reference(x, base), 0)
            np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(expected).max())))
            np.testing.assert_allclose(y, theirs.run(None, {"x": x})[0], rtol=1e-5, atol=1e-4)
        deferred.wait_ready(300)


def test_a_read_product_keeps_its_relu():
    data = with_relu(chain_model(*GEOMETRIES[0]), graph_output=True)
    assert "Relu" in ops(onnx_runtime.InferenceSession(data, providers=["cpu"]))


def test_unknown_activation_is_a_graph_error():
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.ops.dynamic_quantize_conv import dynamic_quantize_conv

    with pytest.raises(InvalidGraphError, match="activation"):
        dynamic_quantize_conv(Node("DynamicQuantizeConv", ["x", "w", "s"], ["y"], attrs={"activation": "tanh"}),
                              None, 1)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_zoo_resnet(exporter, monkeypatch):
    entry, path = zoo_model(f"resnet.{exporter}.int8_dynamic")
    import zoo_feeds

    feeds = zoo_feeds.make_feeds(entry["calls"]["default"])
    ours = onnx_runtime.InferenceSession(path, providers=["cpu"])
    plain = without_fold(path, monkeypatch)
    assert ops(plain).count("Relu") - ops(ours).count("Relu") >= 5  # (stem and every block's first two convs)
    theirs = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    for y, y_plain, y_ort in zip(ours.run(None, feeds), plain.run(None, feeds), theirs.run(None, feeds)):
        np.testing.assert_array_equal(y, y_plain)
        np.testing.assert_allclose(y, y_ort, rtol=0, atol=1e-3 * max(1.0, float(np.abs(y_ort).max())))
