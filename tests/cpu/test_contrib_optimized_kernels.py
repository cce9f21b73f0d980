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
    assert ("", "Split") not in ran and ("ai.onnx_runtime.cpu", "ContribPackedAttention") in ran, ran


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


# -- contrib attention on the compiled few-row loop -----------------------------------------------------------


def _reference(q, k, v, scale, bias):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.swapaxes(-1, -2) * scale + (0 if bias is None else bias.astype(np.float64))
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("bias_shape", [None, (2, 1, 1, 9), (1, 1, "rows", 9), (9,)])
def test_few_rows_matches_float64_reference_with_grouped_heads(rows, bias_shape, monkeypatch):
    from onnx_runtime_ep_cpu.algorithms import contrib_attention

    monkeypatch.setattr(contrib_attention, "numpy_first", lambda: False)  # numba may be loading in this process
    q = RNG.standard_normal((2, 8, rows, 16)).astype(np.float32)
    k, v = (RNG.standard_normal((2, 2, 9, 16)).astype(np.float32) for _ in range(2))
    bias = None
    if bias_shape is not None:
        bias = np.where(RNG.random(tuple(rows if d == "rows" else d for d in bias_shape)) < 0.3, np.float32(-1e4),
                        np.float32(0)).astype(np.float32)
        bias[..., 0] = 0  # every row sees a key
    y = contrib_attention.few_rows(q, k, v, 0.25, bias)
    assert y is not None
    np.testing.assert_allclose(y, _reference(q, k, v, 0.25, bias), rtol=1e-5, atol=1e-5)
    y2, _ = contrib_attention.attend(q, k, v, 0.25, bias)
    np.testing.assert_allclose(y2, y, rtol=0, atol=0)


def test_few_rows_leaves_rows_without_a_visible_key_to_the_numpy_path(monkeypatch):
    from onnx_runtime_ep_cpu.algorithms import contrib_attention

    monkeypatch.setattr(contrib_attention, "numpy_first", lambda: False)
    q = RNG.standard_normal((1, 2, 3, 8)).astype(np.float32)
    k, v = (RNG.standard_normal((1, 2, 4, 8)).astype(np.float32) for _ in range(2))
    bias = np.zeros((1, 1, 3, 4), np.float32)
    bias[0, 0, 1] = -np.inf
    assert contrib_attention.few_rows(q, k, v, 0.3, bias) is None
    y, _ = contrib_attention.attend(q, k, v, 0.3, bias)
    assert np.all(y[:, :, 1] == 0) and np.all(np.isfinite(y))
    assert contrib_attention.few_rows(q.astype(np.float64), k, v, 0.3, None) is None  # float32 only


def _attention_with_past_model(dtype, heads=4, hidden=32):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array((RNG.standard_normal((hidden, 3 * hidden)) * 0.3).astype(dtype), "w"),
             numpy_helper.from_array(RNG.standard_normal(3 * hidden).astype(dtype), "b")]
    node = helper.make_node("Attention", ["x", "w", "b", "mask", "past"], ["y", "present"], domain=CONTRIB,
                            num_heads=heads, unidirectional=1)
    inputs = [helper.make_tensor_value_info("x", elem, [1, "steps", hidden]),
              helper.make_tensor_value_info("mask", TensorProto.INT32, [1, "total"]),
              helper.make_tensor_value_info("past", elem, [2, 1, heads, "past", hidden // heads])]
    outputs = [helper.make_tensor_value_info(name, elem, None) for name in ("y", "present")]
    proto = helper.make_model(helper.make_graph([node], "attention_past", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    proto.ir_version = 8
    return proto


def _gqa_model(dtype, heads=8, kv_heads=2, head_size=8):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens_k",
                                                    "total_length"], ["y", "present_key", "present_value"],
                            domain=CONTRIB, num_heads=heads, kv_num_heads=kv_heads)
    inputs = [helper.make_tensor_value_info("q", elem, [1, "steps", heads * head_size]),
              helper.make_tensor_value_info("k", elem, [1, "steps", kv_heads * head_size]),
              helper.make_tensor_value_info("v", elem, [1, "steps", kv_heads * head_size]),
              helper.make_tensor_value_info("past_key", elem, [1, kv_heads, "past", head_size]),
              helper.make_tensor_value_info("past_value", elem, [1, kv_heads, "past", head_size]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info(name, elem, None) for name in ("y", "present_key", "present_value")]
    proto = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    proto.ir_version = 8
    return proto


def _counting_few_rows(monkeypatch):
    from onnx_runtime_ep_cpu.algorithms import contrib_attention

    calls = []
    original = contrib_attention.few_rows
    monkeypatch.setattr(contrib_attention, "numpy_first", lambda: False)
    monkeypatch.setattr(contrib_attention, "few_rows", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize(("dtype", "tol"), [(np.float32, 2e-5), (np.float16, 4e-3)])
def test_contrib_attention_with_past_runs_compiled_and_matches_onnxruntime(dtype, tol, monkeypatch):
    import onnxruntime

    calls = _counting_few_rows(monkeypatch)
    proto = _attention_with_past_model(dtype)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for past, steps in ((0, 5), (5, 1), (6, 1), (7, 3)):
        mask = np.ones((1, past + steps), np.int32)
        mask[0, 0] = 0  # a padded first key
        feeds = {"x": RNG.standard_normal((1, steps, 32)).astype(dtype), "mask": mask,
                 "past": (RNG.standard_normal((2, 1, 4, past, 8)) * 0.5).astype(dtype)}
        for got, want in zip(session.run(None, feeds), oracle.run(None, feeds)):
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    assert calls


@pytest.mark.parametrize(("dtype", "tol"), [(np.float32, 2e-5), (np.float16, 4e-3)])
def test_group_query_attention_decode_runs_compiled_and_matches_onnxruntime(dtype, tol, monkeypatch):
    import onnxruntime

    calls = _counting_few_rows(monkeypatch)
    proto = _gqa_model(dtype)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for past, steps in ((0, 4), (4, 1), (5, 1), (9, 1)):
        feeds = {"q": RNG.standard_normal((1, steps, 64)).astype(dtype),
                 "k": RNG.standard_normal((1, steps, 16)).astype(dtype),
                 "v": RNG.standard_normal((1, steps, 16)).astype(dtype),
                 "past_key": RNG.standard_normal((1, 2, past, 8)).astype(dtype),
                 "past_value": RNG.standard_normal((1, 2, past, 8)).astype(dtype),
                 "seqlens_k": np.array([past + steps - 1], np.int32),
                 "total_length": np.array(past + steps, np.int32)}
        for got, want in zip(session.run(None, feeds), oracle.run(None, feeds)):
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    assert calls
