"""com.microsoft Attention without a past as ContribPackedAttention (contrib_lowering.py): one product by the
packed Q/K/V weight and compiled/packed_attention.py over it in place, the mask index read there. Checked against
a float64 reference, onnxruntime (the oracle) and the contrib kernel's own arithmetic; the forms left to the
contrib kernel and its typed errors."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime_ep_cpu.ops import contrib_transformer

CONTRIB = "com.microsoft"
PACKED = ("ai.onnx_runtime.cpu", "ContribPackedAttention")
RNG = np.random.default_rng(23)
BATCH, STEPS, HIDDEN, HEADS = 2, 7, 32, 4


def _model(mask_shape=None, bias=True, dtype=np.float32, heads=HEADS, hidden=HIDDEN, declared=True, steps="steps",
           **attrs):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    weight = (RNG.standard_normal((hidden, 3 * hidden)) * 0.3).astype(dtype)
    inits = [numpy_helper.from_array(weight, "w")]
    inputs = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(RNG.standard_normal(3 * hidden).astype(dtype), "b"))
    inputs.append("b" if bias else "")
    infos = [helper.make_tensor_value_info("x", elem, ["batch", steps, hidden] if declared else None)]
    if mask_shape is not None:
        inputs.append("mask")
        infos.append(helper.make_tensor_value_info("mask", TensorProto.INT32, mask_shape if declared else None))
    while not inputs[-1]:
        inputs.pop()
    node = helper.make_node("Attention", inputs, ["y"], domain=CONTRIB, num_heads=heads, **attrs)
    graph = helper.make_graph([node], "attention", infos, [helper.make_tensor_value_info("y", elem, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    proto.ir_version = 8
    return proto


def _reference(proto, x, mask, heads=HEADS, fill=-10000.0, causal=False, scale=None):
    """The contrib Attention in float64: packed projection, split heads, masked softmax, merged heads."""
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in proto.graph.initializer}
    qkv = x.astype(np.float64) @ inits["w"] + inits.get("b", 0)
    batch, steps, width = qkv.shape
    size = width // 3 // heads
    q, k, v = (qkv[..., i * heads * size:(i + 1) * heads * size].reshape(batch, steps, heads, size)
               .transpose(0, 2, 1, 3) for i in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) * (scale or 1 / np.sqrt(size))
    keys = np.arange(steps)
    if mask is not None:
        if mask.ndim == 1 and mask.shape[0] == batch:
            hidden = keys[None, :] >= mask[:, None]
        elif mask.ndim == 1:
            hidden = (keys[None, :] >= mask[:batch, None]) | (keys[None, :] < mask[batch:, None])
        else:
            hidden = mask <= 0
        scores = scores + np.where(hidden, fill, 0.0).reshape(batch, 1, -1, steps)
    if causal:
        scores = np.where(keys[None, :] > keys[:, None], -np.inf, scores)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    y = (weights / weights.sum(axis=-1, keepdims=True)) @ v
    return y.transpose(0, 2, 1, 3).reshape(batch, steps, heads * size)


def _sessions(proto):
    import onnxruntime

    return (ort.InferenceSession(proto, providers=["CPUExecutionProvider"]),
            onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]))


@pytest.fixture
def compiled(monkeypatch):
    """The compiled path taken from the first call (numba may be loading in this process)."""
    monkeypatch.setattr(contrib_transformer, "numpy_first", lambda: False)


MASKS = {
    None: None,
    "lengths": np.array([STEPS, 3], np.int32),
    "ends_and_starts": np.array([STEPS, 5, 0, 2], np.int32),
    "raw": np.array([[1] * STEPS, [1] * 4 + [0] * 3], np.int32),
    "raw_per_query": (RNG.random((BATCH, STEPS, STEPS)) < 0.7).astype(np.int32),
    "no_key_visible": np.array([0, STEPS], np.int32),
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("causal", [0, 1])
def test_packed_attention_matches_reference_and_onnxruntime(mask, causal, compiled):
    value = MASKS[mask]
    proto = _model(None if value is None else list(value.shape), unidirectional=causal)
    session, oracle = _sessions(proto)
    assert PACKED in {(r.domain, r.op_type) for r in session.placement()}
    x = RNG.standard_normal((BATCH, STEPS, HIDDEN)).astype(np.float32)
    feeds = {"x": x} if value is None else {"x": x, "mask": value}
    got = session.run(None, feeds)[0]
    # Every key masked: scores near the fill keep float32's spacing there (about 1e-3) of their differences.
    tol = 4e-3 if mask == "no_key_visible" or (causal and mask == "ends_and_starts") else 2e-5
    np.testing.assert_allclose(got, _reference(proto, x, value, causal=bool(causal)), rtol=tol, atol=tol)
    np.testing.assert_allclose(got, oracle.run(None, feeds)[0], rtol=tol, atol=tol)


@pytest.mark.parametrize(("bias", "scale", "heads"), [(False, None, 4), (True, 0.5, 2), (True, None, 1)])
def test_packed_attention_without_bias_with_scale_and_head_counts(bias, scale, heads, compiled):
    attrs = {} if scale is None else {"scale": scale}
    proto = _model([BATCH], bias=bias, heads=heads, **attrs)
    session, oracle = _sessions(proto)
    for steps in (1, STEPS, 20, 200):  # one input shape after another through one session (200: the long path)
        x = RNG.standard_normal((BATCH, steps, HIDDEN)).astype(np.float32)
        feeds = {"x": x, "mask": np.array([steps, max(1, steps - 2)], np.int32)}
        got = session.run(None, feeds)[0]
        np.testing.assert_allclose(got, _reference(proto, x, feeds["mask"], heads=heads, scale=scale),
                                   rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got, oracle.run(None, feeds)[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mask", ["lengths", "raw"])
@pytest.mark.parametrize("causal", [0, 1])
def test_long_sequences_match_reference_and_onnxruntime(mask, causal, compiled):
    """More keys than the compiled loops take: the ONNX Attention kernel over the packed product's parts."""
    steps = 200
    value = np.array([steps, 40], np.int32) if mask == "lengths" else \
        (np.arange(steps)[None, :] < np.array([[steps], [33]])).astype(np.int32)
    proto = _model(list(value.shape), unidirectional=causal)
    session, oracle = _sessions(proto)
    x = RNG.standard_normal((BATCH, steps, HIDDEN)).astype(np.float32)
    got = session.run(None, {"x": x, "mask": value})[0]
    np.testing.assert_allclose(got, _reference(proto, x, value, causal=bool(causal)), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, oracle.run(None, {"x": x, "mask": value})[0], rtol=2e-5, atol=2e-5)


def test_declared_long_sequence_keeps_the_split_projections():
    """A sequence the graph declares longer than the packed loop takes: the ONNX Attention over contiguous
    projections (its blocked products), as the packed kernel's own long path would run it per call."""
    proto = _model([BATCH], steps=200)
    session, oracle = _sessions(proto)
    ran = {(r.domain, r.op_type) for r in session.placement()}
    assert PACKED not in ran and ("", "Attention") in ran, ran
    feeds = {"x": RNG.standard_normal((BATCH, 200, HIDDEN)).astype(np.float32), "mask": np.array([200, 50], np.int32)}
    np.testing.assert_allclose(session.run(None, feeds)[0], oracle.run(None, feeds)[0], rtol=2e-5, atol=2e-5)
    assert PACKED in {(r.domain, r.op_type) for r in _sessions(_model([BATCH], steps=20))[0].placement()}


def test_packed_attention_takes_the_compiled_loop(monkeypatch, compiled):
    from onnx_runtime_ep_cpu.compiled import packed_attention

    calls = []
    original = packed_attention.packed_self_attention_
    monkeypatch.setattr(packed_attention, "packed_self_attention_", lambda *a: calls.append(1) or original(*a))
    session, _ = _sessions(_model([BATCH]))
    session.run(None, {"x": RNG.standard_normal((BATCH, 3, HIDDEN)).astype(np.float32),
                       "mask": np.array([3, 2], np.int32)})
    assert calls


def test_nan_input_goes_through_the_contrib_kernel(compiled):
    """A row whose scores are not finite leaves the loop; the contrib kernel's numpy arithmetic answers."""
    session, oracle = _sessions(_model())
    x = RNG.standard_normal((1, 3, HIDDEN)).astype(np.float32)
    x[0, 1, 0] = np.nan
    np.testing.assert_array_equal(np.isnan(session.run(None, {"x": x})[0]), np.isnan(oracle.run(None, {"x": x})[0]))


def test_float64_keeps_the_split_projections():
    """onnxruntime has no float64 Attention: the float64 reference is the oracle."""
    proto = _model([BATCH], dtype=np.float64)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    assert PACKED not in {(r.domain, r.op_type) for r in session.placement()}
    x = RNG.standard_normal((BATCH, 4, HIDDEN))
    mask = np.array([4, 2], np.int32)
    np.testing.assert_allclose(session.run(None, {"x": x, "mask": mask})[0], _reference(proto, x, mask),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("feeds", "message"), [
    ({"x": np.zeros((BATCH, 4, HIDDEN + 1), np.float32), "mask": np.array([4, 4], np.int32)},
     r"input \(2, 4, 33\) and weights \(32, 96\) do not fit"),
    ({"x": np.zeros((BATCH, 4, HIDDEN), np.float32), "mask": np.ones((BATCH, 3), np.int32)},
     r"mask of shape \(2, 3\) fits no mask convention"),
    ({"x": np.zeros((4, HIDDEN), np.float32), "mask": np.array([4, 4], np.int32)},
     r"input \(4, 32\) and weights \(32, 96\) do not fit"),
])
def test_bad_inputs_are_typed_errors_naming_them(feeds, message, compiled):
    session, _ = _sessions(_model([BATCH], declared=False))
    with pytest.raises(InvalidArgumentError, match=message):
        session.run(None, feeds)
