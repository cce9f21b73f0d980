"""The compiled paths onnxruntime's optimizer output runs on: EmbedLayerNormalization's lookups and sum
(compiled/embedding.py), the contrib key-padding mask as an additive bias, and the contrib Attention lowered to
one projection per Q, K and V; checked against a float64 reference and onnxruntime (the oracle)."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime_ep_cpu.algorithms.contrib_attention import key_mask_bias
from onnx_runtime_ep_cpu.compiled.embedding import embedding_sum_

CONTRIB = "com.microsoft"
RNG = np.random.default_rng(11)


def _tables(dtype, vocab=13, positions=10, segments=3, hidden=24):
    return [RNG.standard_normal((rows, hidden)).astype(dtype) for rows in (vocab, positions, segments)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("with_segments", [True, False])
def test_embedding_sum_loop_matches_float64_reference(dtype, with_segments):
    word, position, segment = _tables(dtype)
    ids = RNG.integers(0, 13, (2, 7)).astype(np.int32)
    segment_ids = RNG.integers(0, 3, (2, 7)).astype(np.int64)
    mask = np.array([[1, 1, 1, 0, 0, 2, 1], [1] * 7], np.int32)
    out, counts = np.empty((2, 7, 24), dtype), np.zeros(2, np.int32)
    empty_ids, empty_rows = np.empty((0, 0), np.int32), np.empty((0, 0), dtype)
    found = embedding_sum_(ids, word, position, segment_ids if with_segments else empty_ids,
                           segment if with_segments else empty_rows, mask, out, counts)
    assert found == -1
    expected = word.astype(np.float64)[ids] + position.astype(np.float64)[:7]
    if with_segments:
        expected += segment.astype(np.float64)[segment_ids]
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    assert counts.tolist() == [4, 7]  # ones only, as the contrib kernel counts


def test_embedding_sum_loop_reports_the_first_id_outside_its_table():
    word, position, segment = _tables(np.float32)
    ids = np.zeros((2, 3), np.int32)
    segment_ids = np.zeros((2, 3), np.int32)
    out, counts = np.empty((2, 3, 24), np.float32), np.zeros(2, np.int32)
    no_mask = np.empty((0, 0), np.int32)
    ids[1, 1] = -1
    assert embedding_sum_(ids, word, position, segment_ids, segment, no_mask, out, counts) == 4
    ids[1, 1] = 0
    segment_ids[0, 2] = 3
    assert embedding_sum_(ids, word, position, segment_ids, segment, no_mask, out, counts) == 6 + 2


def _embed_model(hidden=24, heads=4):
    word, position, segment = _tables(np.float32, hidden=hidden)
    inits = [numpy_helper.from_array(array, name) for array, name in
             ((word, "word"), (position, "position"), (segment, "segment"),
              (RNG.standard_normal(hidden).astype(np.float32), "gamma"),
              (RNG.standard_normal(hidden).astype(np.float32), "beta"),
              ((RNG.standard_normal((hidden, 3 * hidden)) * 0.3).astype(np.float32), "qkv"),
              (RNG.standard_normal(3 * hidden).astype(np.float32), "qkv_bias"))]
    nodes = [helper.make_node("EmbedLayerNormalization", ["ids", "segment_ids", "word", "position", "segment", "gamma",
                                                          "beta", "mask"], ["embedded", "mask_index"], domain=CONTRIB,
                              epsilon=1e-5),
             helper.make_node("Attention", ["embedded", "qkv", "qkv_bias", "mask_index"], ["y"], domain=CONTRIB,
                              num_heads=heads)]
    ints = [helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", "steps"])
            for name in ("ids", "segment_ids", "mask")]
    graph = helper.make_graph(nodes, "embed_attention", ints, [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                              None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    proto.ir_version = 8
    return proto


def _feeds(lengths):
    steps = max(lengths)
    mask = np.array([[1] * n + [0] * (steps - n) for n in lengths], np.int32)
    return {"ids": RNG.integers(0, 13, mask.shape).astype(np.int32),
            "segment_ids": RNG.integers(0, 3, mask.shape).astype(np.int32), "mask": mask}


@pytest.mark.parametrize("lengths", [[6, 6], [6, 3], [1]])
def test_embedding_and_padded_attention_match_onnxruntime(lengths):
    import onnxruntime

    proto = _embed_model()
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(3):  # the numpy first calls and the compiled ones after them
        feeds = _feeds(lengths)
        np.testing.assert_allclose(session.run(None, feeds)[0], oracle.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
    ran = {(record.domain, record.op_type) for record in session.placement()}
    assert ("", "Split") not in ran and ("", "Attention") in ran, ran  # Q, K and V each written whole


def test_embedding_id_outside_the_table_is_a_typed_error_on_every_path():
    session = ort.InferenceSession(_embed_model(), providers=["CPUExecutionProvider"])
    feeds = _feeds([4, 4])
    session.run(None, feeds)
    feeds["ids"][1, 2] = 13
    with pytest.raises(OnnxRuntimeError, match=r"input_ids.*expected ids in \[0, 13\)"):
        session.run(None, feeds)
    feeds["ids"][1, 2] = 0
    feeds["segment_ids"][0, 0] = -2
    with pytest.raises(OnnxRuntimeError, match=r"segment_ids.*expected ids in \[0, 3\)"):
        session.run(None, feeds)


@pytest.mark.parametrize("mask", [np.array([3, 5], np.int32), np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], np.int64)])
def test_key_mask_bias_of_counts_and_raw_masks(mask):
    fill = np.float32(-10000.0)
    bias = key_mask_bias(mask, 2, 5, 5, 0, fill)
    hidden = np.arange(5)[None, :] >= mask[:, None] if mask.ndim == 1 else mask <= 0
    assert bias.shape == (2, 1, 1, 5) and bias.dtype == np.float32
    np.testing.assert_array_equal(bias[:, 0, 0], np.where(hidden, fill, 0))
