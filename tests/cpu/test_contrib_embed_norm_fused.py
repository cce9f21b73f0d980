"""EmbedLayerNormalization in one compiled call (compiled/embedding.embed_layer_norm_: the lookups, the sum and
the normalization), checked against a float64 reference and onnxruntime (the oracle), with the general path's
errors for what the loop does not take."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime_ep_cpu.compiled.embedding import embed_layer_norm_
from onnx_runtime_ep_cpu.ops import contrib_normalization

CONTRIB = "com.microsoft"
RNG = np.random.default_rng(31)
HIDDEN = 24


def _tables(dtype, vocab=13, positions=10, segments=3):
    return [RNG.standard_normal((rows, HIDDEN)).astype(dtype) for rows in (vocab, positions, segments)]


def _reference(ids, segment_ids, word, position, segment, gamma, beta, epsilon):
    total = word.astype(np.float64)[ids] + position.astype(np.float64)[:ids.shape[1]]
    if segment_ids is not None:
        total += segment.astype(np.float64)[segment_ids]
    mean = total.mean(axis=-1, keepdims=True)
    var = ((total - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (total - mean) / np.sqrt(var + epsilon) * gamma.astype(np.float64)
    return (y if beta is None else y + beta.astype(np.float64)), total


@pytest.mark.parametrize(("dtype", "tol"), [(np.float32, 2e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("with_segments", [True, False])
@pytest.mark.parametrize("with_beta", [True, False])
def test_fused_loop_matches_float64_reference(dtype, tol, with_segments, with_beta):
    word, position, segment = _tables(dtype)
    gamma, beta = (RNG.standard_normal(HIDDEN).astype(dtype) for _ in range(2))
    ids = RNG.integers(0, 13, (2, 7)).astype(np.int32)
    segment_ids = RNG.integers(0, 3, (2, 7)).astype(np.int64)
    mask = np.array([[1, 1, 1, 0, 0, 2, 1], [1] * 7], np.int32)
    total, out, counts = np.empty((2, 7, HIDDEN), dtype), np.empty((2, 7, HIDDEN), dtype), np.zeros(2, np.int32)
    found = embed_layer_norm_(ids, word, position, np.empty((0, 0), np.int32),
                              segment_ids if with_segments else np.empty((0, 0), np.int32),
                              segment if with_segments else np.empty((0, 0), dtype), mask, gamma,
                              beta if with_beta else np.empty(0, dtype), 1e-5, total, out, counts,
                              np.empty(14, dtype), np.empty(14, dtype))
    assert found == -1
    y, summed = _reference(ids, segment_ids if with_segments else None, word, position, segment, gamma,
                           beta if with_beta else None, 1e-5)
    np.testing.assert_allclose(out, y, rtol=tol, atol=tol)
    np.testing.assert_allclose(total, summed, rtol=tol, atol=tol)
    assert counts.tolist() == [4, 7]  # ones only, as the contrib kernel counts


def test_fused_loop_reports_the_first_id_outside_its_table():
    word, position, segment = _tables(np.float32)
    ids = np.zeros((2, 3), np.int32)
    ids[1, 2] = 13
    scratch = [np.empty((2, 3, HIDDEN), np.float32), np.empty((2, 3, HIDDEN), np.float32), np.zeros(2, np.int32),
               np.empty(6, np.float32), np.empty(6, np.float32)]
    no_ids, no_rows = np.empty((0, 0), np.int32), np.empty((0, 0), np.float32)
    gamma, beta = np.ones(HIDDEN, np.float32), np.zeros(HIDDEN, np.float32)
    assert embed_layer_norm_(ids, word, position, no_ids, no_ids, no_rows, no_ids, gamma, beta, 1e-5, *scratch) == 5
    ids[1, 2] = 0
    positions = np.array([[0, 1, 10]], np.int64)  # the table has 10 rows
    assert embed_layer_norm_(ids, word, position, positions, no_ids, no_rows, no_ids, gamma, beta, 1e-5,
                             *scratch) >= 2 * 6


def _model(outputs: int, positions=None):
    word, position, segment = _tables(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((word, "word"), (position, "position"), (segment, "segment"),
                                                          (RNG.standard_normal(HIDDEN).astype(np.float32), "gamma"),
                                                          (RNG.standard_normal(HIDDEN).astype(np.float32), "beta"))]
    names = ["embedded", "mask_index", "embedding_sum"][:outputs]
    node = helper.make_node("EmbedLayerNormalization", ["ids", "segment_ids", "word", "position", "segment", "gamma",
                                                        "beta", "mask", *(["positions"] if positions else [])],
                            names, domain=CONTRIB,
                            epsilon=1e-5)
    ints = [helper.make_tensor_value_info(n, TensorProto.INT32, None) for n in ("ids", "segment_ids", "mask")]
    if positions:
        ints.append(helper.make_tensor_value_info("positions", TensorProto.INT32, None))
    outs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "mask_index" else TensorProto.FLOAT, None)
            for n in names]
    proto = helper.make_model(helper.make_graph([node], "embed", ints, outs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    proto.ir_version = 8
    return proto


@pytest.mark.parametrize(("outputs", "positions"), [(2, None), (3, None), (2, (1, 6)), (3, (2, 6))])
def test_session_matches_onnxruntime_through_the_fused_loop(outputs, positions, monkeypatch):
    import onnxruntime

    calls = []
    original = contrib_normalization.fused_embed_norm
    monkeypatch.setattr(contrib_normalization, "numpy_first", lambda: False)  # numba may be loading here
    monkeypatch.setattr(contrib_normalization, "fused_embed_norm", lambda *a: calls.append(1) or original(*a))
    proto = _model(outputs, positions)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    mask = np.array([[1] * 6, [1] * 3 + [0] * 3], np.int32)
    feeds = {"ids": RNG.integers(0, 13, (2, 6)).astype(np.int32),
             "segment_ids": RNG.integers(0, 3, (2, 6)).astype(np.int32), "mask": mask}
    if positions:
        feeds["positions"] = RNG.integers(0, 10, positions).astype(np.int32)
    for got, want in zip(session.run(None, feeds), oracle.run(None, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert calls


def test_id_outside_the_table_is_a_typed_error_naming_it(monkeypatch):
    monkeypatch.setattr(contrib_normalization, "numpy_first", lambda: False)
    session = ort.InferenceSession(_model(2), providers=["CPUExecutionProvider"])
    feeds = {"ids": np.array([[1, 13]], np.int32), "segment_ids": np.zeros((1, 2), np.int32),
             "mask": np.ones((1, 2), np.int32)}
    with pytest.raises(OnnxRuntimeError, match=r"input_ids hold values up to 13.*expected ids in \[0, 13\)"):
        session.run(None, feeds)
