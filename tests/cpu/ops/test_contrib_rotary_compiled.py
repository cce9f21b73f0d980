"""com.microsoft RotaryEmbedding through compiled/rotary.py (float32): checked against a float64 reference and
onnxruntime (the oracle) over both layouts, interleaved and halves, partial rotary dims, start and per-token
positions; the numpy path keeps float16 and reports what the loop leaves to it."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime_ep_cpu.ops import contrib_transformer

CONTRIB = "com.microsoft"
RNG = np.random.default_rng(41)
B, N, S, D = 2, 3, 5, 8


def _model(four_d: bool, attrs: dict):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    names = ["x", "ids", "cos", "sin"]
    infos = [x, helper.make_tensor_value_info("ids", TensorProto.INT64, None),
             *(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("cos", "sin"))]
    node = helper.make_node("RotaryEmbedding", names, ["y"], domain=CONTRIB, **attrs)
    graph = helper.make_graph([node], "rotary", infos, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    proto.ir_version = 8
    return proto


def _reference(x, ids, cos, sin, interleaved, dim, four_d):
    """float64: x as (B, S, N, D), each token's position row, pairs rotated, the rest passed through."""
    heads = x.astype(np.float64).transpose(0, 2, 1, 3) if four_d else x.astype(np.float64).reshape(B, S, N, -1)
    positions = ids[0] + np.arange(S)[None, :].repeat(B, 0) if ids.ndim == 1 else ids
    c, s = cos.astype(np.float64)[positions][:, :, None], sin.astype(np.float64)[positions][:, :, None]
    out = heads.copy()
    first, second = (heads[..., 0:dim:2], heads[..., 1:dim:2]) if interleaved else \
        (heads[..., :dim // 2], heads[..., dim // 2:dim])
    real, imag = first * c - second * s, first * s + second * c
    if interleaved:
        out[..., 0:dim:2], out[..., 1:dim:2] = real, imag
    else:
        out[..., :dim // 2], out[..., dim // 2:dim] = real, imag
    return out.transpose(0, 2, 1, 3) if four_d else out.reshape(x.shape)


@pytest.fixture
def compiled(monkeypatch):
    """The compiled path from the first call, every call counted."""
    from onnx_runtime_ep_cpu.compiled import rotary

    calls = []
    original = rotary.rotary_embedding_
    monkeypatch.setattr(contrib_transformer, "numpy_first", lambda: False)
    monkeypatch.setattr(rotary, "rotary_embedding_", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("four_d", [False, True])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("dim", [D, 4])
@pytest.mark.parametrize("start", [True, False])
def test_compiled_rotary_matches_reference_and_onnxruntime(four_d, interleaved, dim, start, compiled):
    import onnxruntime

    attrs = {"interleaved": interleaved, "num_heads": N, **({"rotary_embedding_dim": dim} if dim != D else {})}
    proto = _model(four_d, attrs)
    cos, sin = (RNG.standard_normal((16, dim // 2)).astype(np.float32) for _ in range(2))
    x = RNG.standard_normal((B, N, S, D) if four_d else (B, S, N * D)).astype(np.float32)
    ids = np.array([7], np.int64) if start else RNG.integers(0, 16, (B, S)).astype(np.int64)
    feeds = {"x": x, "ids": ids, "cos": cos, "sin": sin}
    got = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert compiled
    np.testing.assert_allclose(got, _reference(x, ids, cos, sin, interleaved, dim, four_d), rtol=1e-6, atol=1e-6)
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got, oracle.run(None, feeds)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("ids", "expect"), [
    (np.array([[0, 1, 2, 3, 4], [6, 7, 19, 2, 0]], np.int64), "positions up to 19"),
    (np.array([12], np.int64), "positions up to 16"),
    (np.array([], np.int64), r"position_ids has shape \(0,\)"),
])
def test_positions_outside_the_caches_are_typed_errors(ids, expect, compiled):
    session = ort.InferenceSession(_model(False, {}), providers=["CPUExecutionProvider"])
    feeds = {"x": np.zeros((B, S, N * D), np.float32), "ids": ids, "cos": np.ones((16, D // 2), np.float32),
             "sin": np.zeros((16, D // 2), np.float32)}
    with pytest.raises(OnnxRuntimeError, match=expect):
        session.run(None, feeds)
