"""Runs of a bound plan's blocked-layout steps as one compiled call (algorithms/segment_chain.py,
compiled/conv_chain.run_chain): a chained plan gives the unchained plan's values bit for bit (the same loops on
the same buffers in the same order) and a float64 reference's to float32 rounding, over every chained loop
(direct convolutions plain and gathered, depthwise, squeeze-excitation, max pool, plane means), batches 1 and 3,
and the zoo's ResNet and MobileNetV3 from both torch exporters; steps of other types are left unchained. A
closing classifier Gemm binds compiled/small_gemm.py's loop (one call for product and bias)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from model_helpers import bound_plan
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms import segment_chain
from onnx_runtime_ep_cpu.compiled import deferred, host
from onnx_runtime_ep_cpu.tuning import override
from reference64 import run_float64
from test_cnn_blocked_blocks import _block_model as _light_block
from test_cnn_blocked_layout import _chain_model
from test_segment_fusion import _segment_and_feeds

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the direct tiles (the chained loops' steps) need AVX2")

_ZOO = Path(__file__).resolve().parents[2] / "benchmarks" / ".models" / "zoo"


def _plan_outputs(model, x, chain: bool, monkeypatch):
    monkeypatch.setattr(segment_chain, "CHAIN", chain)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    plan = bound_plan(plan)
    return plan, segment.output_names, segment(*feeds)


def _kinds(plan) -> list[int]:
    return [int(k) for f, a in plan._calls if getattr(f, "__name__", "") == "run_chain"  # noqa: SLF001
            for k in a[0][:, 0]]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("which, size, kinds", [
    ("convs", 13, {"conv_blocked", "conv_gathered", "plane_means_blocked"}),
    ("HardSigmoid", 19, {"conv_blocked", "depthwise_blocked", "squeeze_excite_blocked", "max_pool_blocked"}),
    ("Sigmoid", 19, {"conv_blocked", "depthwise_blocked", "squeeze_excite_blocked", "max_pool_blocked"}),
])
def test_chained_plan_gives_the_unchained_values(which, size, kinds, batch, monkeypatch):
    with override(threads=1):  # (bit for bit: both plans of one thread; a batch split across threads plans its
        _chained_and_unchained(which, size, kinds, batch, monkeypatch)  # ranges as one thread does)


def _chained_and_unchained(which, size, kinds, batch, monkeypatch):
    model = _chain_model() if which == "convs" else _light_block(gate=which)
    deferred.wait_ready(240)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, size, size)).astype(np.float32)
    plain, names, expected = _plan_outputs(model, x, False, monkeypatch)
    chained, _, got = _plan_outputs(model, x, True, monkeypatch)
    assert not _kinds(plain) and plain.describe()["calls"] == plain.describe()["steps"]
    numbers = {name: number for number, name in enumerate(segment_chain.PATTERNS)}
    assert {numbers[k] for k in kinds} <= set(_kinds(chained))
    assert chained.describe()["calls"] < chained.describe()["steps"]
    graph_outputs = [o.name for o in model.graph.output]
    exact = dict(zip(graph_outputs, run_float64(model, {"x": x})))
    for name, a, b in zip(names, got, expected):
        wide = exact[name]
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.float32 and a.shape == wide.shape
        assert np.abs(a - wide).max() <= 1e-4 * (1 + np.abs(wide).max()), name
    x2 = (rng.standard_normal(x.shape) * 3).astype(np.float32)  # another feed through the same tables
    segment, feeds = _segment_and_feeds(model, x)
    monkeypatch.setattr(segment_chain, "CHAIN", True)
    segment(*feeds)
    again = dict(zip(segment.output_names, segment(*[x2 if f is x else f for f in feeds])))
    for name, wide in zip(graph_outputs, run_float64(model, {"x": x2})):
        assert np.abs(again[name] - wide).max() <= 1e-4 * (1 + np.abs(wide).max()), name


def test_steps_of_other_types_stay_unchained():
    """A step whose argument is not its pattern's type (float64, not contiguous, a flag for an integer, one
    argument short) is no row; a lone chainable step is left as it is."""
    from onnx_runtime_ep_cpu.compiled.directconv_blocked import conv_blocked

    deferred.wait_ready(240)
    pattern = segment_chain.PATTERNS["plane_means_blocked"].split()
    assert pattern == ["f1", "f1", "i", "i", "i", "f1"]
    from onnx_runtime_ep_cpu.compiled.blocked_ops import plane_means_blocked

    x, y, sums = np.zeros(32, np.float32), np.zeros(2, np.float32), np.zeros(128, np.float32)
    good = (x, y, 1, 2, 1, sums)
    row = segment_chain._row(plane_means_blocked, good, [])  # noqa: SLF001
    assert row is not None and len(row) == segment_chain._WIDTH and row[0] == 5  # noqa: SLF001
    for bad in [(x.astype(np.float64), y, 1, 2, 1, sums), (np.zeros(64, np.float32)[::2], y, 1, 2, 1, sums),
                (x, y, True, 2, 1, sums), (x, y, 1, 2, 1), (x, y, 1.0, 2, 1, sums)]:
        assert segment_chain._row(plane_means_blocked, bad, []) is None  # noqa: SLF001
    assert segment_chain._row(conv_blocked, good, []) is None  # noqa: SLF001  (another loop's pattern)
    assert segment_chain._row(np.add, (x, x, x), []) is None  # noqa: SLF001
    steps = [(plane_means_blocked, good), (np.add, (x, x, x))]
    assert segment_chain.chained(steps, lambda f, a: True) is steps


def _zoo_models() -> list[str]:
    manifest = _ZOO / "manifest.json"
    if not manifest.exists():
        return []
    names = [m["name"] for m in json.loads(manifest.read_text())["models"]]
    return [n for n in names if n.split(".")[0] in ("resnet", "mobilenetv3") and n.endswith(".fp32")]


@pytest.mark.parametrize("name", _zoo_models() or [pytest.param("none", marks=pytest.mark.skip("no zoo"))])
def test_zoo_cnns_chained_as_unchained(name, monkeypatch):
    """Both exporters' ResNet and MobileNetV3: the whole model's outputs with the chains equal those without, and
    onnxruntime's to float32 rounding."""
    import onnx_runtime as ours

    model = next(m for m in json.loads((_ZOO / "manifest.json").read_text())["models"] if m["name"] == name)
    feed = {f["name"]: np.random.default_rng(5).standard_normal(f["shape"]).astype(np.float32)
            for f in model["calls"]["default"]["feeds"]}
    path = str(_ZOO / model["file"])
    deferred.wait_ready(240)
    outputs = {}
    for chain in (False, True):
        monkeypatch.setattr(segment_chain, "CHAIN", chain)
        session = ours.InferenceSession(path, providers=["CPUExecutionProvider"])
        for _ in range(3):
            outputs[chain] = session.run(None, feed)
    theirs = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feed)
    for a, b, c in zip(outputs[True], outputs[False], theirs):
        np.testing.assert_array_equal(a, b)
        assert np.abs(a - c).max() <= 1e-4 * (1 + np.abs(c).max())


def _head_model(trans_b: int, bias: str) -> onnx.ModelProto:
    rng = np.random.default_rng(31)
    w = (rng.standard_normal((16, 3, 3, 3)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((16, 16, 1, 1)) * 0.3).astype(np.float32)
    head = (rng.standard_normal((10, 16) if trans_b else (16, 10)) * 0.3).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(head, "head")]
    gemm_inputs = ["flat", "head"]
    if bias != "none":
        shape = (10,) if bias == "row" else (1, 10)
        inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), "bias"))
        gemm_inputs.append("bias")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c"], ["r0"]),
             helper.make_node("Conv", ["r0", "w2"], ["c2"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c2"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["flat"]),
             helper.make_node("Gemm", gemm_inputs, ["logits"], transB=trans_b)]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 9, 9])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias", ["none", "row", "matrix"])
def test_classifier_gemm_binds_the_small_loop(trans_b, bias):
    """A segment's closing float32 Gemm (1 x 16 by 16 x 10, both layouts of B, C none, (N,) or (1, N)) binds
    compiled/small_gemm.py's loop, product and bias in one call: within float32 rounding of float64 and of
    onnxruntime."""
    model = _head_model(trans_b, bias)
    deferred.wait_ready(240)
    x = np.random.default_rng(trans_b).standard_normal((1, 3, 9, 9)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    plan = bound_plan(plan)
    called = [getattr(f, "__name__", "") for f, _ in plan._steps]  # noqa: SLF001
    assert ("rows_by_transposed_bias_" if trans_b else "rows_by_weights_bias_") in called
    assert "matmul" not in called
    got = segment(*feeds)[0]
    (wide,) = run_float64(model, {"x": x})
    (theirs,) = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})
    assert got.shape == wide.shape == (1, 10) and got.dtype == np.float32
    assert np.abs(got - wide).max() <= 1e-5 * (1 + np.abs(wide).max())
    assert np.abs(got - theirs).max() <= 1e-5 * (1 + np.abs(theirs).max())
