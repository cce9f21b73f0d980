"""A segment plan's values in one arena shared by liveness (algorithms/segment_arena.py): values live at the same
time never share memory, the arena holds about the widest live set (not every value), and the plan's outputs
stay those of a float64 reference over runs on new inputs (no value read after another took its memory)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_helpers import bound_plan
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.loader import load_model
from onnx_runtime_ep_cpu.algorithms import segment_arena, segment_steps
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.conv_fusions import CONV_PASSES
from onnx_runtime_ep_cpu.fusions import PASSES
from onnx_runtime_ep_cpu.ops import segment as segment_module
from onnx_runtime_ep_cpu.ops.segment import Segment
from reference64 import run_float64


def _branchy_model(channels: int = 24) -> onnx.ModelProto:
    """Stem, an expansion block with SiLU (Sigmoid * x), a depthwise convolution, a sigmoid-gated
    squeeze-excitation and a residual; two branches joined by an Add, and a residual Add
    that reads the stem's output long after it was written; a global pool and a Gemm head."""
    rng = np.random.default_rng(17)
    inits, nodes = [], []

    def weight(name, *shape, scale=0.25):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def conv(x, y, cin, cout, k, stride=1, group=1):
        nodes.append(helper.make_node("Conv", [x, weight(f"{y}_w", cout, cin // group, k, k),
                                               weight(f"{y}_b", cout)], [y], kernel_shape=[k, k],
                                      strides=[stride, stride], pads=[k // 2] * 4, group=group))

    def silu(x, y):
        nodes.append(helper.make_node("Sigmoid", [x], [f"{y}_s"]))
        nodes.append(helper.make_node("Mul", [x, f"{y}_s"], [y]))

    c, wide = channels, channels * 3
    conv("x", "stem", 3, c, 3, stride=2)
    silu("stem", "s0")
    conv("s0", "e1", c, wide, 1)
    silu("e1", "e1a")
    conv("e1a", "d1", wide, wide, 3, group=wide)
    silu("d1", "d1a")
    nodes.append(helper.make_node("GlobalAveragePool", ["d1a"], ["sq"]))
    conv("sq", "sq1", wide, 6, 1)
    silu("sq1", "sq1a")
    conv("sq1a", "sq2", 6, wide, 1)
    nodes.append(helper.make_node("Sigmoid", ["sq2"], ["gate"]))
    nodes.append(helper.make_node("Mul", ["d1a", "gate"], ["se"]))
    conv("se", "p1", wide, c, 1)
    nodes.append(helper.make_node("Add", ["p1", "s0"], ["r1"]))
    conv("r1", "left", c, c, 3)  # two branches of r1, joined
    nodes.append(helper.make_node("Relu", ["left"], ["left_a"]))
    conv("r1", "right", c, c, 1)
    nodes.append(helper.make_node("Add", ["left_a", "right"], ["both"]))
    conv("both", "merge", c, c, 1)
    nodes.append(helper.make_node("Add", ["merge", "s0"], ["r2"]))  # the stem's value, read again
    conv("r2", "head", c, 2 * c, 1)
    silu("head", "head_a")
    nodes.append(helper.make_node("GlobalAveragePool", ["head_a"], ["pooled"]))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["flat"]))
    nodes.append(helper.make_node("Gemm", ["flat", weight("fc", 2 * c, 10)], ["logits"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 24, 24])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "branchy", [x], [logits], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _segment(model):
    graph = load_model(model).graph
    for graph_pass in [*PASSES, *CONV_PASSES]:
        graph_pass(graph, None)
    (node,) = [n for n in graph.nodes if n.op_type == "FusedSegment"]
    weights = {}
    for name in node.inputs:
        if name != "x":
            weights[name] = np.array(graph.initializers[name])
            weights[name].setflags(write=False)
    return Segment(node), [None if name == "x" else weights[name] for name in node.inputs]


def _feeds(template, x):
    return [x if value is None else value for value in template]


def _live_sets(arena) -> list[int]:
    """Bytes of the arena's values live at each node index."""
    ends = [last for _, last in arena.intervals.values() if last < 1 << 62]
    width = max(ends + [first for first, _ in arena.intervals.values()]) + 1
    live = [0] * width
    for key, (first, last) in arena.intervals.items():
        for index in range(first, min(last, width - 1) + 1):
            live[index] += arena.views[key].nbytes
    return live


@pytest.mark.parametrize("batch", [1, 3])
def test_shared_buffers_never_alias_live_values(batch):
    deferred.wait_ready(240)
    model = _branchy_model()
    segment, template = _segment(model)
    rng = np.random.default_rng(batch)
    for run in range(4):  # node by node + plan (checked), then the plan on new values each run
        x = rng.standard_normal((batch, 3, 24, 24)).astype(np.float32)
        (got,) = segment(*_feeds(template, x))
        (exact,) = run_float64(model, {"x": x})
        assert np.abs(got - exact).max() <= 1e-4 * (1 + np.abs(exact).max()), run
        if run == 0:
            deferred.wait_ready(240)
    ((plan,),) = segment.plans.values()
    arena = bound_plan(plan).arena
    assert arena is not None and len(arena.views) >= 10
    keys = list(arena.views)
    for i, a in enumerate(keys):  # values live at once: apart in memory
        for b in keys[i + 1:]:
            (fa, la), (fb, lb) = arena.intervals[a], arena.intervals[b]
            if fa <= lb and fb <= la:
                assert not np.shares_memory(arena.views[a], arena.views[b]), (a, b)
    shared = sum(1 for i, a in enumerate(keys) for b in keys[i + 1:]
                 if np.shares_memory(arena.views[a], arena.views[b]))
    assert shared > 0  # (some memory is reused: the test checks the sharing, not a buffer per value)
    live = sorted(_live_sets(arena), reverse=True)
    assert arena.nbytes <= live[0] + live[1]
    assert arena.nbytes < sum(view.nbytes for view in arena.views.values())


def test_a_plan_over_the_limit_fits_once_shared(monkeypatch):
    """Every value together passes the limit, the widest live set does not: the plan is made (a buffer per
    value, as before the arena, would have left the segment node by node)."""
    deferred.wait_ready(240)
    model = _branchy_model(channels=32)
    segment, template = _segment(model)
    x = np.random.default_rng(4).standard_normal((4, 3, 24, 24)).astype(np.float32)
    env, _ = segment._node_by_node(_feeds(template, x), keep_all=True)  # noqa: SLF001
    values = sum(v.nbytes for v in env[segment.feeds:] if isinstance(v, np.ndarray))
    plan = segment_steps.build_plan(segment, env, 1 << 40)
    assert plan is not None and plan.nbytes < values
    monkeypatch.setattr(segment_module, "POOL_LIMIT_BYTES", plan.nbytes + 1024)
    assert plan.nbytes + 1024 < values + x.nbytes
    (got,) = segment(*_feeds(template, x))
    (exact,) = run_float64(model, {"x": x})
    assert np.abs(got - exact).max() <= 1e-4 * (1 + np.abs(exact).max())
    assert segment.plans and all(p is not None for p in segment.plans.values())


def test_place_keeps_overlapping_intervals_apart():
    rng = np.random.default_rng(0)
    items = {}
    for key in range(60):
        first = int(rng.integers(0, 40))
        items[key] = (first, first + int(rng.integers(0, 8)), int(rng.integers(1, 5000)))
    offsets, total = segment_arena.place(items)
    for a in items:
        for b in items:
            (fa, la, sa), (fb, lb, sb) = items[a], items[b]
            if a < b and fa <= lb and fb <= la:
                assert offsets[a] + sa <= offsets[b] or offsets[b] + sb <= offsets[a], (a, b)
    assert all(offset % 64 == 0 for offset in offsets.values())
    live = [sum(s for f, last, s in items.values() if f <= i <= last) for i in range(48)]
    assert max(live) <= total <= sum(sorted(live)[-2:]) + 64 * len(items)
