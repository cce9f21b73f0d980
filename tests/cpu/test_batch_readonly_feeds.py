"""A read-only feed (a column from Arrow, a memory map) is not a weight: a segment bound to it copies it in like any
feed once it has seen it change, instead of running node by node from then on. The outputs stay those of a float64
reference on every run, and after the replan every run goes through the bound plan."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime import session as session_module
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.ops import segment as segment_module
from reference64 import run_float64


def _cnn() -> onnx.ModelProto:
    """A stem (odd channel count, stride 2), a bottleneck with a residual Add, a strided 1x1 projection, a pool
    and a Gemm head: one fused segment on the CPU provider."""
    rng = np.random.default_rng(5)
    inits, nodes = [], []

    def conv(x, y, cin, cout, k, stride=1):
        w = numpy_helper.from_array((rng.standard_normal((cout, cin, k, k)) * 0.3).astype(np.float32), f"{y}_w")
        b = numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{y}_b")
        inits.extend([w, b])
        nodes.append(helper.make_node("Conv", [x, w.name, b.name], [y], kernel_shape=[k, k],
                                      strides=[stride, stride], pads=[k // 2] * 4))

    conv("x", "stem", 3, 12, 3, stride=2)
    nodes.append(helper.make_node("Relu", ["stem"], ["s"]))
    conv("s", "a", 12, 6, 1)
    nodes.append(helper.make_node("Relu", ["a"], ["a_r"]))
    conv("a_r", "b", 6, 12, 3)
    nodes.append(helper.make_node("Add", ["b", "s"], ["r"]))
    nodes.append(helper.make_node("Relu", ["r"], ["r_r"]))
    conv("r_r", "down", 12, 20, 1, stride=2)
    nodes.append(helper.make_node("GlobalAveragePool", ["down"], ["pooled"]))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["flat"]))
    fc = numpy_helper.from_array((rng.standard_normal((20, 7)) * 0.3).astype(np.float32), "fc")
    inits.append(fc)
    nodes.append(helper.make_node("Gemm", ["flat", "fc"], ["logits"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 17, 17])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)
    return helper.make_model(helper.make_graph(nodes, "cnn", [x], [y], inits),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("batch", [5, 8])
def test_read_only_feeds_run_through_the_plan(monkeypatch, batch):
    deferred.wait_ready(240)
    made, by_nodes = [], [0]
    real_init = segment_module.Segment.__init__
    real_nodes = segment_module.Segment._node_by_node  # noqa: SLF001

    def init(self, node):
        real_init(self, node)
        made.append(self)

    def node_by_node(self, inputs, keep_all):
        by_nodes[0] += 1
        return real_nodes(self, inputs, keep_all)

    monkeypatch.setattr(segment_module.Segment, "__init__", init)
    monkeypatch.setattr(segment_module.Segment, "_node_by_node", node_by_node)
    model = _cnn()
    options = session_module.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.compile_in_background", "0")
    sess = session_module.InferenceSession(model.SerializeToString(), sess_options=options)
    rng = np.random.default_rng(batch)
    rows = rng.standard_normal((6 * batch, 3, 17, 17)).astype(np.float32)
    rows.setflags(write=False)  # as pyarrow's zero-copy to_numpy hands a column over
    for run in range(6):
        x = rows[run * batch:(run + 1) * batch]
        if run == 4:
            before = by_nodes[0]
        (got,) = sess.run(None, {"x": x})
        (exact,) = run_float64(model, {"x": x})
        assert np.abs(got - exact).max() <= 1e-4 * (1 + np.abs(exact).max()), run
    assert made, "the model was expected to run as a fused segment"
    assert by_nodes[0] == before, "runs after the replan went node by node"
    planned = [s for s in made if any(p for p in s.plans.values())]
    assert planned and all(0 in s.fed for s in planned)


def test_a_read_only_input_that_stays_is_still_bound_as_a_constant(monkeypatch):
    """The same read-only array fed again (an input used as a weight) is not copied in: the plan keeps it bound."""
    deferred.wait_ready(240)
    made = []
    real_init = segment_module.Segment.__init__

    def init(self, node):
        real_init(self, node)
        made.append(self)

    monkeypatch.setattr(segment_module.Segment, "__init__", init)
    model = _cnn()
    options = session_module.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.compile_in_background", "0")
    sess = session_module.InferenceSession(model.SerializeToString(), sess_options=options)
    x = np.random.default_rng(3).standard_normal((4, 3, 17, 17)).astype(np.float32)
    x.setflags(write=False)
    for _ in range(4):
        (got,) = sess.run(None, {"x": x})
    (exact,) = run_float64(model, {"x": x})
    assert np.abs(got - exact).max() <= 1e-4 * (1 + np.abs(exact).max())
    planned = [s for s in made if any(p for p in s.plans.values())]
    assert planned and not any(s.fed for s in planned)


def watch_segments(monkeypatch) -> tuple[list, list]:
    """(the segments the sessions make, each plan's key's first entry) from now on, the loader's kernels ready."""
    deferred.wait_ready(240)
    made, planned = [], []
    real_init = segment_module.Segment.__init__
    real_plan = segment_module.Segment._plan_and_run  # noqa: SLF001

    def init(self, node):
        real_init(self, node)
        made.append(self)

    def plan_and_run(self, key, inputs):
        planned.append(key[0][0])
        return real_plan(self, key, inputs)

    monkeypatch.setattr(segment_module.Segment, "__init__", init)
    monkeypatch.setattr(segment_module.Segment, "_plan_and_run", plan_and_run)
    return made, planned


def test_a_new_batch_size_copies_a_feed_already_seen_to_change(monkeypatch):
    """A batch job's partial last micro-batch is a new input shape, which the session specializes into a new copy
    of the segment: that copy's first plan copies in the feed its sibling saw change (one plan per shape, not a
    plan bound to the read-only feed and a second at the next batch). Every run within a float64 bound."""
    made, planned = watch_segments(monkeypatch)
    model = _cnn()
    options = session_module.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.compile_in_background", "0")
    sess = session_module.InferenceSession(model.SerializeToString(), sess_options=options)
    rows = np.random.default_rng(11).standard_normal((40, 3, 17, 17)).astype(np.float32)
    rows.setflags(write=False)
    for start, stop in [(0, 8), (8, 16), (16, 21), (21, 29), (29, 34), (34, 40)]:  # batches of 8, tails of 5, one 6
        x = rows[start:stop]
        (got,) = sess.run(None, {"x": x})
        (exact,) = run_float64(model, {"x": x})
        assert np.abs(got - exact).max() <= 1e-4 * (1 + np.abs(exact).max()), (start, stop)
    assert len({id(s) for s in made}) >= 2, "each batch size was expected to get its own copy of the segment"
    # batch 8: bound to the feed, then planned again once it changed; 5 and 6: one plan each, the feed copied in
    assert sorted(planned) == [(5, 3, 17, 17), (6, 3, 17, 17), (8, 3, 17, 17), (8, 3, 17, 17)], planned
    copies = [s for s in made if any(p for p in s.plans.values())]
    assert copies and all(s.fed == {0} for s in copies)
