"""Segments over large maps (segment_fusions.large_runs): an expanded layer over MAX_VALUE_ELEMENTS becomes a
segment of its own where its work pays for what the segment copies in and out, cut where the values crossing its
edges are small; a batch too large to plan runs node by node without a planning run (ops/segment.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.loader import load_model
from onnx_runtime_ep_cpu import segment_fusions
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.conv_fusions import CONV_PASSES
from onnx_runtime_ep_cpu.fusions import PASSES
from onnx_runtime_ep_cpu.ops import segment as segment_op
from reference64 import run_float64


def _mbconv_model(expand_kernel: int = 3) -> onnx.ModelProto:
    """An EfficientNetV2-style start: stem 3->16 (16x32x32), a 16->96 expansion at 32x32 (98,304 elements: over
    MAX_VALUE_ELEMENTS) with SiLU, a 3x3/2 depthwise convolution back to 16x16, squeeze-excitation, projection,
    two pointwise layers and the classifier: the expansion up to the projection (its narrow output the seam) one
    large segment, what follows a small one."""
    rng = np.random.default_rng(21)
    inits, nodes = [], []

    def weight(name, *shape):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), name))
        return name

    def conv(x, y, cin, cout, k, stride=1, group=1):
        nodes.append(helper.make_node("Conv", [x, weight(f"{y}_w", cout, cin // group, k, k), weight(f"{y}_b", cout)],
                                      [y], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4,
                                      group=group))

    def silu(x, y):
        nodes.append(helper.make_node("Sigmoid", [x], [f"{y}_sigmoid"]))
        nodes.append(helper.make_node("Mul", [x, f"{y}_sigmoid"], [y]))

    conv("x", "stem", 3, 16, 3, stride=2)
    silu("stem", "a0")
    conv("a0", "expand", 16, 96, expand_kernel)
    silu("expand", "a1")
    conv("a1", "depthwise", 96, 96, 3, stride=2, group=96)
    silu("depthwise", "a2")
    nodes.append(helper.make_node("GlobalAveragePool", ["a2"], ["pooled"]))
    conv("pooled", "squeeze", 96, 8, 1)
    silu("squeeze", "a3")
    conv("a3", "excite", 8, 96, 1)
    nodes.append(helper.make_node("Sigmoid", ["excite"], ["gate"]))
    nodes.append(helper.make_node("Mul", ["a2", "gate"], ["scaled"]))
    conv("scaled", "project", 96, 24, 1)
    conv("project", "head", 24, 64, 1)
    silu("head", "a4")
    conv("a4", "head2", 64, 64, 1)
    nodes.append(helper.make_node("Relu", ["head2"], ["a5"]))
    nodes.append(helper.make_node("GlobalAveragePool", ["a5"], ["features"]))
    nodes.append(helper.make_node("Flatten", ["features"], ["flat"]))
    nodes.append(helper.make_node("Gemm", ["flat", weight("fc_w", 10, 64), weight("fc_b", 10)], ["logits"], transB=1))
    graph = helper.make_graph(nodes, "mbconv", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                              ["batch", 3, 64, 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def _fused(model):
    graph = load_model(model).graph
    for graph_pass in [*PASSES, *CONV_PASSES]:  # the CPU provider's order
        graph_pass(graph, None)
    return graph


def _elements(graph, name):
    return int(np.prod([d for d in graph.type_of(name).shape if isinstance(d, int)]))


def test_the_expanded_layer_is_a_segment_of_its_own_cut_where_values_are_small():
    graph = _fused(_mbconv_model())
    segments = [n for n in graph.nodes if n.op_type == "FusedSegment"]
    assert len(segments) == 2
    large, small = segments
    body = large.attr("body")
    made = [name for n in body.nodes for name in n.outputs]
    assert max(_elements(graph, name) for name in made) > segment_fusions.MAX_VALUE_ELEMENTS
    # its edges: the stem's SiLU in, the projection's output out (16x32x32 and 24x16x16)
    assert all(_elements(graph, name) <= segment_fusions.MAX_VALUE_ELEMENTS
               for name in [*large.inputs, *large.outputs] if name not in graph.initializers)
    assert list(large.outputs) == [n for n in small.inputs if n not in graph.initializers][:1]
    assert max(_elements(graph, name) for n in small.attr("body").nodes for name in n.outputs) \
        <= segment_fusions.MAX_VALUE_ELEMENTS
    # (the stem alone, one convolution, stays a node of its own)
    assert [n.op_type for n in graph.nodes if n.op_type != "FusedSegment"] == ["Conv", "Swish"]


def _grouped_pair_model() -> onnx.ModelProto:
    """ShuffleNet's stretch between two channel shuffles: two grouped 1x1 convolutions (4 groups of 32 channels) on
    a 128x32x32 map, between nodes no segment takes (Softplus)."""
    rng = np.random.default_rng(22)
    inits = [numpy_helper.from_array((rng.standard_normal((128, 32, 1, 1)) / 6).astype(np.float32), name)
             for name in ("w1", "w2")]
    nodes = [helper.make_node("Softplus", ["x"], ["s"]),
             helper.make_node("Conv", ["s", "w1"], ["c1"], kernel_shape=[1, 1], group=4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], kernel_shape=[1, 1], group=4),
             helper.make_node("Softplus", ["c2"], ["y"])]
    graph = helper.make_graph(nodes, "pair", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_a_large_run_whose_work_does_not_pay_for_its_seam_stays_node_by_node(monkeypatch):
    # 32 multiply-adds per output element of each convolution: 8.4M for the 131,072 elements copied in and as many out
    assert "FusedSegment" not in [n.op_type for n in _fused(_grouped_pair_model()).nodes]
    monkeypatch.setattr(segment_fusions, "WORK_PER_SEAM_ELEMENT", 16)
    assert "FusedSegment" in [n.op_type for n in _fused(_grouped_pair_model()).nodes]


def _session(model, threads):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("batch, threads", [(1, 1), (2, 2)])
def test_large_segments_match_onnxruntime_and_float64_through_their_plans(batch, threads):
    model = _mbconv_model()
    sess = _session(model, threads)
    oracle = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(batch)
    for run in range(4):  # the first node by node, the second plans, then the plans
        x = rng.standard_normal((batch, 3, 64, 64)).astype(np.float32)
        (got,) = sess.run(None, {"x": x})
        (exact,) = run_float64(model, {"x": x})
        (theirs,) = oracle.run(None, {"x": x})
        bound = 1e-5 * (1 + np.abs(exact).max())
        assert got.shape == exact.shape and np.abs(got - exact).max() <= bound, run
        assert np.abs(got - theirs).max() <= bound, run
        if run == 0:
            deferred.wait_ready(240)
    placed = [p.op_type for p in sess.placement()]
    assert placed.count("FusedSegment") == 2


def test_value_bytes_count_every_value_at_the_batch_of_the_inputs():
    graph = _fused(_mbconv_model())
    large = next(n for n in graph.nodes if n.op_type == "FusedSegment")
    counted = segment_op.Segment(large).value_bytes
    per_image = sum(4 * _elements(graph, name) for n in large.attr("body").nodes for name in n.outputs)
    feeds = [np.zeros((3, 16, 32, 32), np.float32) if name not in graph.initializers else graph.initializers[name]
             for name in large.inputs]
    assert counted(feeds) == 3 * per_image


def _large_segment_and_feeds(batch, rng):
    graph = _fused(_mbconv_model())
    large = next(n for n in graph.nodes if n.op_type == "FusedSegment")
    feeds = [rng.standard_normal((batch, 16, 32, 32)).astype(np.float32) if name not in graph.initializers
             else graph.initializers[name] for name in large.inputs]
    return segment_op.Segment(large), feeds


def _first_image(feeds):
    return [f[:1] if f.flags.writeable else f for f in feeds]  # (the feed; the weights are read-only)


def test_a_batch_whose_plan_would_pass_the_pool_limit_runs_in_planned_chunks(monkeypatch):
    deferred.wait_ready(240)
    rng = np.random.default_rng(5)
    segment, feeds = _large_segment_and_feeds(5, rng)
    want = segment._node_by_node(feeds, keep_all=False)[1]  # noqa: SLF001
    one_image = segment.value_bytes(_first_image(feeds))
    monkeypatch.setattr(segment_op, "POOL_LIMIT_BYTES", 2 * one_image)  # two images' values fit, five do not
    for _ in range(3):  # plans the whole batch (over the limit: none), then chunks of two, planned
        got = segment(*feeds)
        for a, b in zip(got, want):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    ((key, chunks),) = segment.chunks.items()
    assert chunks.images == 2 and segment.plans[key] is None
    planned = [k for k, plans in segment.plans.items() if plans]
    assert sorted(k[chunks.feeds[0]][0][0] for k in planned) == [1, 2]  # (2 + 2 + 1 images)


def test_a_batch_too_large_to_plan_runs_node_by_node_without_planning(monkeypatch):
    deferred.wait_ready(240)
    rng = np.random.default_rng(6)
    segment, two = _large_segment_and_feeds(2, rng)
    planned = []
    monkeypatch.setattr(segment_op.Segment, "_plan_and_run",
                        lambda self, key, inputs: planned.append(key) or self._node_by_node(inputs, False)[1])
    one = _first_image(two)
    limit = segment.value_bytes(one) + 1  # one image's values pass, two images' do not
    monkeypatch.setattr(segment_op, "PLANNING_LIMIT_BYTES", limit)
    monkeypatch.setattr(segment_op, "POOL_LIMIT_BYTES", limit)
    from onnx_runtime_ep_cpu.algorithms import segment_split

    monkeypatch.setattr(segment_split, "per_image", lambda *args: False)  # (no chunks: not proved per image)
    for _ in range(2):
        got = segment(*two)
    assert planned == [] and list(segment.plans.values()) == [None]
    want = segment._node_by_node(two, keep_all=False)[1]  # noqa: SLF001
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    segment(*one)
    assert len(planned) == 1  # (the batch of one is planned)


def test_long_ranges_wait_for_sleeping_helpers(monkeypatch):
    """A batch's ranges whose chained calls took LONG_STAGE_SECONDS are posted to the helpers as long parts the next
    time (woken if asleep), shorter ones as before; the values are the same either way."""
    from onnx_runtime_ep_cpu.algorithms import segment_split

    model = _mbconv_model()
    sess = _session(model, 2)
    x = np.random.default_rng(7).standard_normal((4, 3, 64, 64)).astype(np.float32)
    sess.run(None, {"x": x})
    deferred.wait_ready(240)
    (want,) = sess.run(None, {"x": x})
    seen = []
    original = segment_split.SplitPlan.run

    def spy(plan, inputs):
        real = plan._run  # noqa: SLF001
        plan._run = lambda kind, parts, count, long=False: seen.append(long) or real(kind, parts, count, long)  # noqa: SLF001
        try:
            return original(plan, inputs)
        finally:
            plan._run = real  # noqa: SLF001

    monkeypatch.setattr(segment_split.SplitPlan, "run", spy)
    monkeypatch.setattr(segment_split, "LONG_STAGE_SECONDS", 0.0)
    for _ in range(3):
        (got,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(got, want)
    assert seen and seen[-1] is True  # (after a stage longer than 0 s)
    monkeypatch.setattr(segment_split, "LONG_STAGE_SECONDS", float("inf"))
    seen.clear()
    for _ in range(3):
        (got,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(got, want)
    assert seen and seen[-1] is False
