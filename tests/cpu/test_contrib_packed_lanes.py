"""ContribPackedAttention on attention_lanes.py's 16-lane loop (sequences of 8 or more query rows, no causal
frontier): the packed product split into contiguous Q, K, V with the bias added, the contrib mask spellings as
the loop's additive key bias. Checked against a float64 reference and onnxruntime (the oracle) for every mask
spelling, odd sequence lengths and head sizes that are not a multiple of 16."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms.products import gemv_host
from onnx_runtime_ep_cpu.ops import contrib_transformer

RNG = np.random.default_rng(41)
BATCH = 2
TOL = 2e-5


def _model(hidden: int, heads: int, mask_shape, bias: bool = True):
    weight = (RNG.standard_normal((hidden, 3 * hidden)) * 0.3).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w")]
    inputs = ["x", "w", ""]
    if bias:
        inits.append(numpy_helper.from_array(RNG.standard_normal(3 * hidden).astype(np.float32), "b"))
        inputs[2] = "b"
    infos = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "steps", hidden])]
    if mask_shape is not None:
        inputs.append("mask")
        infos.append(helper.make_tensor_value_info("mask", TensorProto.INT32, list(mask_shape)))
    while not inputs[-1]:
        inputs.pop()
    node = helper.make_node("Attention", inputs, ["y"], domain="com.microsoft", num_heads=heads)
    graph = helper.make_graph([node], "attention", infos, [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                        None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    proto.ir_version = 8
    return proto


def _hidden_keys(mask, batch: int, steps: int):
    """(B, S|1, T) True where a key is masked, by the contrib mask conventions."""
    keys = np.arange(steps)
    if mask is None:
        return np.zeros((batch, 1, steps), bool)
    if mask.ndim == 1 and mask.shape[0] == batch:
        return (keys[None, :] >= mask[:, None])[:, None]
    if mask.ndim == 1:
        return ((keys[None, :] >= mask[:batch, None]) | (keys[None, :] < mask[batch:, None]))[:, None]
    if mask.ndim == 2:
        return (mask <= 0)[:, None]
    if mask.ndim == 3:
        return mask <= 0
    return mask[:, 0, :steps, :steps] <= 0


def _reference(proto, x, mask, heads: int, fill: float = -10000.0):
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in proto.graph.initializer}
    qkv = x.astype(np.float64) @ inits["w"] + inits.get("b", 0)
    batch, steps, width = qkv.shape
    size = width // 3 // heads
    q, k, v = (qkv[..., i * heads * size:(i + 1) * heads * size].reshape(batch, steps, heads, size)
               .transpose(0, 2, 1, 3) for i in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(size)
    scores = scores + np.where(_hidden_keys(mask, batch, steps), fill, 0.0)[:, None]
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    y = (weights / weights.sum(axis=-1, keepdims=True)) @ v
    return y.transpose(0, 2, 1, 3).reshape(batch, steps, heads * size)


def _mask(spelling: str, steps: int):
    if spelling == "none":
        return None
    if spelling == "key_lengths":
        return np.array([steps, steps // 2 + 1], np.int32)
    if spelling == "ends_and_starts":
        return np.array([steps, steps - 2, 0, 3], np.int32)
    if spelling == "two_d":
        return (np.arange(steps)[None, :] < np.array([[steps], [steps - 3]])).astype(np.int32)
    if spelling == "three_d":
        mask = (RNG.random((BATCH, steps, steps)) < 0.7).astype(np.int32)
        mask[:, :, 0] = 1  # every query sees a key
        return mask
    mask = (RNG.random((BATCH, 1, steps + 3, steps + 3)) < 0.7).astype(np.int32)  # (B, 1, M, M), M > T
    mask[:, :, :, 0] = 1
    return mask


@pytest.fixture
def lanes_calls(monkeypatch):
    """The compiled path from the first call, with the 16-lane path's calls counted (over the packed product, with
    the product in the same call, or per group of heads on more threads)."""
    if not gemv_host():
        pytest.skip("the 16-lane loop runs on AVX-512 hosts only")
    from onnx_runtime_ep_cpu.compiled import attention_groups, packed_attention

    monkeypatch.setattr(contrib_transformer, "numpy_first", lambda: False)
    calls = []
    for module, name in ((packed_attention, "packed_in_lanes_"), (packed_attention, "product_in_lanes_"),
                         (attention_groups, "split_groups")):
        loop = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _loop=loop: calls.append(1) or _loop(*a))
    return calls


@pytest.mark.parametrize("spelling", ["none", "key_lengths", "ends_and_starts", "two_d", "three_d", "four_d"])
@pytest.mark.parametrize(("steps", "hidden", "heads"), [(9, 32, 4), (17, 24, 1), (13, 60, 3), (33, 40, 5)])
def test_lanes_match_reference_and_onnxruntime(spelling, steps, hidden, heads, lanes_calls):
    import onnxruntime

    mask = _mask(spelling, steps)
    proto = _model(hidden, heads, None if mask is None else mask.shape, bias=spelling != "two_d")
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    assert ("ai.onnx_runtime.cpu", "ContribPackedAttention") in {(r.domain, r.op_type) for r in session.placement()}
    x = RNG.standard_normal((BATCH, steps, hidden)).astype(np.float32)
    feeds = {"x": x} if mask is None else {"x": x, "mask": mask}
    got = session.run(None, feeds)[0]
    assert lanes_calls, "the 16-lane loop did not run"
    np.testing.assert_allclose(got, _reference(proto, x, mask, heads), rtol=TOL, atol=TOL)
    if spelling != "four_d":  # (onnxruntime's CPU kernel refuses the 4-D mask: the reference decides)
        np.testing.assert_allclose(got, oracle.run(None, feeds)[0], rtol=TOL, atol=TOL)


def test_short_sequences_and_new_lengths_through_one_session(lanes_calls):
    """Lengths below the lanes' rows (the scalar packed loop) and above them, one session; a key count of 0
    (every key at the fill) stays within the fill's float32 spacing of the reference."""
    proto = _model(32, 2, [BATCH])
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    for steps, counts in ((3, [3, 2]), (11, [11, 0]), (7, [1, 7]), (25, [20, 25])):
        x = RNG.standard_normal((BATCH, steps, 32)).astype(np.float32)
        mask = np.array(counts, np.int32)
        tol = 4e-3 if 0 in counts else TOL
        np.testing.assert_allclose(session.run(None, {"x": x, "mask": mask})[0], _reference(proto, x, mask, 2),
                                   rtol=tol, atol=tol)
    assert len(lanes_calls) == 2


def test_longer_sequences_run_in_lanes_up_to_the_lanes_limit(lanes_calls):
    """Sequences past the scalar loop's limit (PACKED_LOOP_MACS) and within the lanes' (PACKED_LANES_MACS) stay
    on the packed path, declared or not; against the float64 reference."""
    from onnx_runtime_ep_cpu.contrib_lowering import PACKED_LANES_MACS, PACKED_LOOP_MACS
    from onnx_runtime_ep_cpu.tuning import KNOBS

    hidden, heads, steps = 32, 2, 90
    assert PACKED_LOOP_MACS * KNOBS.few_query_macs < hidden * steps * steps <= PACKED_LANES_MACS * KNOBS.few_query_macs
    proto = _model(hidden, heads, [BATCH])
    proto.graph.input[0].type.tensor_type.shape.dim[1].dim_value = steps  # declared: the lowering decides too
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    assert ("ai.onnx_runtime.cpu", "ContribPackedAttention") in {(r.domain, r.op_type) for r in session.placement()}
    x = RNG.standard_normal((BATCH, steps, hidden)).astype(np.float32)
    mask = np.array([steps, 61], np.int32)
    np.testing.assert_allclose(session.run(None, {"x": x, "mask": mask})[0], _reference(proto, x, mask, heads),
                               rtol=TOL, atol=TOL)
    assert lanes_calls
