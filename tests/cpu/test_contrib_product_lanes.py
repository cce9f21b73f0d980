"""ContribPackedAttention's one-call route (algorithms/product_attention.py, compiled/packed_attention.py's
product_in_lanes_): the packed Q/K/V product by matmul.py's tiles (few_rows.py's up to 16 rows) and the 16-lane
loop over its parts in place. Checked against a float64 reference (within float32's bound) and onnxruntime for
Whisper's and BERT's sizes and odd ones (hidden sizes not a multiple of a panel, a last partial row tile, no
bias, key counts), over repeats (the kept call's linked overload); the route is left to the packed-product path
for strided inputs and a product split across threads."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import tuning
from onnx_runtime_ep_cpu.algorithms.products import gemv_host
from onnx_runtime_ep_cpu.ops import contrib_transformer
from reference64 import contrib_attention

RNG = np.random.default_rng(77)
CONTRIB = "com.microsoft"


def _model(hidden: int, heads: int, bias: bool, masked: bool):
    weight = (RNG.standard_normal((hidden, 3 * hidden)) * 0.3).astype(np.float32)
    add = RNG.standard_normal(3 * hidden).astype(np.float32)
    infos = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "steps", hidden])]
    inits = [numpy_helper.from_array(weight, "w")]
    inputs = ["x", "w", "b" if bias else ""]
    if bias:
        inits.append(numpy_helper.from_array(add, "b"))
    if masked:
        inputs.append("mask")
        infos.append(helper.make_tensor_value_info("mask", TensorProto.INT32, ["batch"]))
    while not inputs[-1]:
        inputs.pop()
    node = helper.make_node("Attention", inputs, ["y"], domain=CONTRIB, num_heads=heads)
    graph = helper.make_graph([node], "attention", infos,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    proto.ir_version = 8
    return proto, weight, (add if bias else None)


def _reference(x, weight, add, heads: int, counts):
    """float64 attention and the bound of its float32 evaluation's error (a few ulps of each product's terms)."""
    qkv = x.astype(np.float64) @ weight.astype(np.float64) + (0 if add is None else add.astype(np.float64))
    y, scores, v = contrib_attention(qkv, heads, counts)
    magnitude = np.abs(x).astype(np.float64) @ np.abs(weight).astype(np.float64)
    bound = 64 * np.finfo(np.float32).eps * (magnitude.max() * (1 + np.abs(scores).max()) + np.abs(v).max())
    return y, bound


@pytest.fixture
def routes(monkeypatch):
    """Calls of the one-call route and of the packed-product 16-lane route, counted, compiled from the first call;
    the node on the calling thread whatever the thread count (test_contrib_head_groups.py splits it)."""
    if not gemv_host():
        pytest.skip("the 16-lane loop runs on AVX-512 hosts only")
    from onnx_runtime_ep_cpu.compiled import packed_attention

    monkeypatch.setattr(contrib_transformer, "numpy_first", lambda: False)
    counted = {"product_in_lanes_": [], "packed_in_lanes_": []}
    for name, calls in counted.items():
        loop = getattr(packed_attention, name)
        monkeypatch.setattr(packed_attention, name, lambda *a, _loop=loop, _calls=calls: _calls.append(1) or _loop(*a))
    with tuning.override(attention_group_macs=1 << 62):
        yield counted


@pytest.mark.parametrize(("batch", "steps", "hidden", "heads", "bias", "masked"), [
    (1, 50, 64, 4, True, False),  # Whisper's encoder
    (2, 16, 64, 4, True, True),  # BERT's, with key counts (16 rows: few_rows.py's tiles)
    (1, 9, 32, 2, False, False),  # few rows, no bias
    (2, 13, 40, 5, True, True),  # hidden not a multiple of a panel (a partial last panel); 26 rows: a padded tile
    (1, 33, 60, 3, False, True),  # head size 20, a partial last row tile
    (3, 21, 48, 1, True, False),  # one head of 48
])
def test_one_call_matches_reference_and_onnxruntime(batch, steps, hidden, heads, bias, masked, routes):
    import onnxruntime

    proto, weight, add = _model(hidden, heads, bias, masked)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for call in range(4):  # the first tried, the second kept, the rest repeats of the kept call
        x = RNG.standard_normal((batch, steps, hidden)).astype(np.float32)
        counts = RNG.integers(1, steps + 1, batch).astype(np.int32) if masked else None
        counts = None if counts is None else np.where(np.arange(batch) == 0, steps, counts).astype(np.int32)
        feeds = {"x": x} if counts is None else {"x": x, "mask": counts}
        got = session.run(None, feeds)[0]
        expected, bound = _reference(x, weight, add, heads, counts)
        assert np.abs(got - expected).max() <= bound, (call, np.abs(got - expected).max(), bound)
        np.testing.assert_allclose(got, oracle.run(None, feeds)[0], rtol=3e-5, atol=3e-5)
    assert len(routes["product_in_lanes_"]) >= 2 and not routes["packed_in_lanes_"]  # (repeats: the linked overload)


def test_repeats_follow_new_values_and_shapes(routes):
    """A kept call's repeats read each call's x and counts; a new length makes a new call, kept in turn."""
    proto, weight, add = _model(64, 4, True, True)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    for steps in (20, 20, 20, 31, 31, 20):
        x = RNG.standard_normal((2, steps, 64)).astype(np.float32)
        counts = np.array([steps, steps // 2], np.int32)
        expected, bound = _reference(x, weight, add, 4, counts)
        got = session.run(None, {"x": x, "mask": counts})[0]
        assert np.abs(got - expected).max() <= bound


@pytest.mark.parametrize("case", ["strided_x", "split_product"])
def test_other_calls_keep_the_packed_product_route(case, routes):
    """A strided x (the tiles read rows in place) and a product the packed products would split across threads
    take BLAS's product and the 16-lane loop after it; the same results."""
    proto, weight, add = _model(64, 4, True, False)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((1, 24, 128 if case == "strided_x" else 64)).astype(np.float32)
    x = x[:, :, ::2] if case == "strided_x" else x
    feeds = {"x": x}
    if case == "split_product":
        with tuning.override(split_macs=1, threads=2):
            got = session.run(None, feeds)[0]
    else:
        got = session.run(None, feeds)[0]
    expected, bound = _reference(x, weight, add, 4, None)
    assert np.abs(got - expected).max() <= bound
    assert routes["packed_in_lanes_"] and not routes["product_in_lanes_"]
