"""Repeats of a contrib kernel's last compiled call (algorithms/kept_call.py): EmbedLayerNormalization and
ContribPackedAttention skip their input checks when the constants are the same arrays and the fed arrays have
the kept shapes and dtypes. Checked against onnxruntime (the oracle) and a float64 reference over calls whose
values, mask counts, shapes and layouts change, with the repeat path's use counted; an id outside its table on
a repeat is still the typed error."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime_ep_cpu import tuning
from onnx_runtime_ep_cpu.algorithms.kept_call import KeptCall
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.ops import contrib_normalization, contrib_transformer
from reference64 import contrib_attention

RNG = np.random.default_rng(83)
CONTRIB = "com.microsoft"
TOL = 2e-5


@pytest.fixture
def compiled(monkeypatch):
    """The compiled paths from the first call: numba imported (no session opens deferral then), no numpy-first."""
    pytest.importorskip("numba")
    monkeypatch.setattr(deferred.state, "deferring", False)
    monkeypatch.setattr(contrib_normalization, "numpy_first", lambda: False)
    monkeypatch.setattr(contrib_transformer, "numpy_first", lambda: False)


def _counted(monkeypatch, owner, name: str) -> list:
    """Calls of ``owner.name`` that returned a result."""
    original, calls = getattr(owner, name), []

    def counting(*args):
        result = original(*args)
        if result is not None:
            calls.append(1)
        return result

    monkeypatch.setattr(owner, name, counting)
    return calls


def _embed_model(hidden: int = 20):
    tables = [RNG.standard_normal((rows, hidden)).astype(np.float32) for rows in (11, 9, 2)]
    names = ["word", "position", "segment", "gamma", "beta"]
    arrays = [*tables, RNG.standard_normal(hidden).astype(np.float32), RNG.standard_normal(hidden).astype(np.float32)]
    node = helper.make_node("EmbedLayerNormalization", ["ids", "segment_ids", *names, "mask"], ["y", "mask_index"],
                            domain=CONTRIB, epsilon=1e-5)
    ints = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", "steps"]) for n in ("ids", "segment_ids",
                                                                                              "mask")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("mask_index", TensorProto.INT32, None)]
    graph = helper.make_graph([node], "embed", ints, outs, [numpy_helper.from_array(a, n) for a, n in zip(arrays,
                                                                                                           names)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    proto.ir_version = 8
    return proto


def _embed_feeds(batch: int, steps: int) -> dict:
    mask = (RNG.random((batch, steps)) < 0.8).astype(np.int32)
    return {"ids": RNG.integers(0, 11, (batch, steps)).astype(np.int32),
            "segment_ids": RNG.integers(0, 2, (batch, steps)).astype(np.int32), "mask": mask}


def test_embed_norm_repeats_match_onnxruntime(compiled, monkeypatch):
    import onnxruntime

    repeats = _counted(monkeypatch, contrib_normalization, "_embed_repeat")
    proto = _embed_model()
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, steps in ((2, 5), (2, 5), (2, 5), (1, 7), (1, 7), (2, 5)):
        feeds = _embed_feeds(batch, steps)
        for got, want in zip(session.run(None, feeds), oracle.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    # the first call is tried, the second kept (compiled/deferred.tried): the third (2, 5) call repeats it, the
    # second (1, 7) call the first (1, 7) one, the last (2, 5) call none (the kept call was (1, 7)'s)
    assert len(repeats) == 2
    # a repeat whose ids leave the table: the general path's typed error, naming the input
    feeds = _embed_feeds(2, 5)
    feeds["ids"][1, 3] = 11
    with pytest.raises(OnnxRuntimeError, match=r"input_ids hold values up to 11.*expected ids in \[0, 11\)"):
        session.run(None, feeds)


def test_embed_norm_kernel_takes_views_and_other_types_apart(compiled, monkeypatch):
    """Fed arrays that are views, read-only or of another dtype never take the kept call; results stay right."""
    import onnxruntime

    repeats = _counted(monkeypatch, contrib_normalization, "_embed_repeat")
    proto = _embed_model()
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = _embed_feeds(2, 6)
    session.run(None, feeds)
    wide = _embed_feeds(2, 12)
    views = {name: value[:, ::2] for name, value in wide.items()}  # (2, 6), not contiguous
    frozen = {name: value.copy() for name, value in _embed_feeds(2, 6).items()}
    for value in frozen.values():
        value.setflags(write=False)
    for case in (views, frozen):
        for got, want in zip(session.run(None, case), oracle.run(None, {n: np.ascontiguousarray(v) for n, v in
                                                                        case.items()}), strict=True):
            np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    assert not repeats


def _attention_model(hidden: int, heads: int, masked: bool):
    weight = (RNG.standard_normal((hidden, 3 * hidden)) * 0.3).astype(np.float32)
    bias = RNG.standard_normal(3 * hidden).astype(np.float32)
    inputs = ["x", "w", "b"] + (["mask"] if masked else [])
    infos = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "steps", hidden])]
    if masked:
        infos.append(helper.make_tensor_value_info("mask", TensorProto.INT32, ["batch"]))
    node = helper.make_node("Attention", inputs, ["y"], domain=CONTRIB, num_heads=heads)
    graph = helper.make_graph([node], "attention", infos, [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                        None)],
                              [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    proto.ir_version = 8
    return proto, weight.astype(np.float64), bias.astype(np.float64)


def _attention_reference(x, weight, bias, counts, heads: int):
    return contrib_attention(x.astype(np.float64) @ weight + bias, heads, counts)[0]


@pytest.mark.parametrize(("hidden", "heads", "masked"), [(32, 2, True), (24, 3, False), (64, 4, True)])
def test_packed_attention_repeats_match_reference_and_onnxruntime(hidden, heads, masked, compiled, monkeypatch):
    import onnxruntime

    repeats = _counted(monkeypatch, KeptCall, "match")  # (the model's one kernel keeping calls)
    proto, weight, bias = _attention_model(hidden, heads, masked)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    assert ("ai.onnx_runtime.cpu", "ContribPackedAttention") in {(r.domain, r.op_type) for r in session.placement()}
    calls = 0
    for batch, steps in ((2, 16), (2, 16), (2, 16), (1, 5), (1, 5), (2, 16)):
        x = RNG.standard_normal((batch, steps, hidden)).astype(np.float32)
        feeds = {"x": x}
        counts = None
        if masked:  # key counts that change from call to call, the kind kept
            counts = feeds["mask"] = RNG.integers(1, steps + 1, batch).astype(np.int32)
        got = session.run(None, feeds)[0]
        calls += 1
        np.testing.assert_allclose(got, _attention_reference(x, weight, bias, counts, heads), rtol=TOL, atol=TOL)
        np.testing.assert_allclose(got, oracle.run(None, feeds)[0], rtol=TOL, atol=TOL)
    assert len(repeats) == 2  # (as for the embedding: the third (2, 16) call and the second (1, 5) call)
    x = RNG.standard_normal((2, 16, 2 * hidden)).astype(np.float32)[:, :, ::2]  # a strided view of the kept kind
    feeds = {"x": x, **({"mask": np.array([16, 3], np.int32)} if masked else {})}
    np.testing.assert_allclose(session.run(None, feeds)[0], oracle.run(None, {**feeds, "x": x.copy()})[0],
                               rtol=TOL, atol=TOL)
    assert len(repeats) == 2


def test_kept_call_matches_only_its_kinds_and_drops_on_a_knob_change():
    weight = np.ones((3, 3), np.float32)
    weight.setflags(write=False)
    kept = KeptCall()
    fed = np.zeros((2, 3), np.float32)
    assert kept.keep((weight, None), (fed, None), "arguments")
    assert kept.match((weight, None), (np.ones((2, 3), np.float32), None)) == "arguments"
    assert kept.match((weight.copy(), None), (fed, None)) is None  # another constant array
    assert kept.match((weight, None), (np.zeros((2, 4), np.float32), None)) is None  # another shape
    assert kept.match((weight, None), (np.zeros((2, 3), np.float64), None)) is None  # another dtype
    assert kept.match((weight, None), (np.zeros((3, 2), np.float32).T, None)) is None  # not C-contiguous
    assert kept.match((weight, None), (fed, np.zeros(2, np.int32))) is None  # an input given that was omitted
    frozen = np.zeros((2, 3), np.float32)
    frozen.setflags(write=False)
    assert kept.match((weight, None), (frozen, None)) is None
    assert not kept.keep((np.ones((3, 3), np.float32), None), (fed, None), "writable constant")
    assert not kept.keep((weight, None), (fed[:, :2], None), "view")
    with tuning.override(few_query_macs=tuning.KNOBS.few_query_macs + 1):
        assert kept.match((weight, None), (fed, None)) is None
    assert kept.match((weight, None), (fed, None)) is None  # kept before the change: dropped for good
