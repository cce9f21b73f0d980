"""A small 8-bit embedding table's Gather -> DequantizeLinear as a Gather of its float32 values
(dynamic_epilogues.dequantize_small_tables): each row the float64 reference's (code - zero point) * scale rounded
once, the unfused nodes' bits and onnxruntime's; a table past DEQUANTIZED_TABLE_VALUES, per-axis parameters or a
shared Gather output stay as they are; both exporters' int8_dynamic BERT and LLaMA take it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime
import pytest
from model_helpers import session_without_passes, zoo_model
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import dynamic_epilogues

onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")


def embedding(rows: int, width: int, dtype, axis: int = 0, extra_output: bool = False, seed: int = 2) -> bytes:
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    table = rng.integers(info.min, info.max + 1, (rows, width)).astype(dtype)
    zero = np.array(3 if dtype == np.uint8 else -2, dtype)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["codes"], axis=axis),
             helper.make_node("DequantizeLinear", ["codes", "scale", "zero"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_output:
        outputs.append(helper.make_tensor_value_info("codes", TensorProto.UINT8 if dtype == np.uint8
                                                     else TensorProto.INT8, None))
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
                              outputs, initializer=[numpy_helper.from_array(table, "table"),
                                                    numpy_helper.from_array(np.float32(0.0173), "scale"),
                                                    numpy_helper.from_array(zero, "zero")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString()


def without_pass(data, monkeypatch):
    return session_without_passes(data, monkeypatch, "DYNAMIC_EPILOGUE_PASSES", "dequantize_small_tables")


def ops(session) -> list[str]:
    return [n.op_type for n in session.placement()]


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.parametrize("axis", [0, 1])
def test_small_table_is_gathered_dequantized(dtype, axis, monkeypatch):
    rows, width = 50, 24
    data = embedding(rows, width, dtype, axis)
    ours = onnx_runtime.InferenceSession(data, providers=["cpu"])
    assert "DequantizeLinear" not in ops(ours) and ops(ours).count("Gather") == 1
    plain = without_pass(data, monkeypatch)
    assert "DequantizeLinear" in ops(plain)
    theirs = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(data).graph.initializer}
    values = (inits["table"].astype(np.float64) - float(inits["zero"])) * float(inits["scale"])
    limit = rows if axis == 0 else width
    ids = np.random.default_rng(5).integers(-limit, limit, (2, 7)).astype(np.int64)  # negative ids count back
    (y,) = ours.run(None, {"ids": ids})
    np.testing.assert_array_equal(y, plain.run(None, {"ids": ids})[0])
    np.testing.assert_array_equal(y, theirs.run(None, {"ids": ids})[0])
    np.testing.assert_array_equal(y, np.take(values, ids, axis=axis).astype(np.float32))
    with pytest.raises(Exception, match="ids|indices|index"):  # out of range: the Gather's own typed error
        ours.run(None, {"ids": np.full((1, 1), limit, np.int64)})


def test_what_stays_unfused(monkeypatch):
    monkeypatch.setattr(dynamic_epilogues, "DEQUANTIZED_TABLE_VALUES", 50 * 24 - 1)
    assert "DequantizeLinear" in ops(onnx_runtime.InferenceSession(embedding(50, 24, np.int8), providers=["cpu"]))
    monkeypatch.undo()
    shared = onnx_runtime.InferenceSession(embedding(50, 24, np.int8, extra_output=True), providers=["cpu"])
    assert "DequantizeLinear" in ops(shared)  # the codes are a graph output too
    # The table read by another Gather as well: that one keeps the codes.
    m = onnx.load_from_string(embedding(50, 24, np.int8))
    m.graph.node.append(helper.make_node("Gather", ["table", "ids"], ["raw"]))
    m.graph.output.append(helper.make_tensor_value_info("raw", TensorProto.INT8, None))
    both = onnx_runtime.InferenceSession(m.SerializeToString(), providers=["cpu"])
    assert "DequantizeLinear" not in ops(both)
    ids = np.array([[1, 49, -1]], np.int64)
    y, raw = both.run(None, {"ids": ids})
    table = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "table"))
    np.testing.assert_array_equal(raw, table[ids])
    expected = (table[ids].astype(np.float64) + 2) * float(np.float32(0.0173))  # (zero point -2)
    np.testing.assert_array_equal(y, expected.astype(np.float32))


@pytest.mark.parametrize("name", ["bert.torchscript", "bert.dynamo", "llama.torchscript", "llama.dynamo"])
def test_zoo_embeddings(name, monkeypatch):
    entry, path = zoo_model(f"{name}.int8_dynamic")
    import zoo_feeds

    ours = onnx_runtime.InferenceSession(path, providers=["cpu"])
    assert "DequantizeLinear" not in ops(ours)
    plain = without_pass(path, monkeypatch)
    assert "DequantizeLinear" in ops(plain)
    theirs = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    for call in entry["calls"].values():
        feeds = zoo_feeds.make_feeds(call)
        for y, y_plain, y_ort in zip(ours.run(None, feeds), plain.run(None, feeds), theirs.run(None, feeds)):
            np.testing.assert_array_equal(y, y_plain)
            np.testing.assert_allclose(y, y_ort, rtol=0, atol=1e-3 * max(1.0, float(np.abs(y_ort).max())))
