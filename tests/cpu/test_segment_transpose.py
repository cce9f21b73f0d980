"""A Transpose inside a segment (ConvNeXt's layout changes around its downsampling convolutions) is bound as one copy
through the permuted view of its input's buffer (segment_steps' Transpose binder), not its kernel's call and a copy
of its result: no step of the plan runs a node's kernel, and every run stays within a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime import session as session_module
from reference64 import run_float64
from test_batch_readonly_feeds import watch_segments


def _channels_last_block(x_shape, perm_out):
    """x (N, H, W, C) -> Transpose to NCHW -> 3x3 Conv -> Relu -> 3x3 depthwise Conv -> Transpose(perm_out)."""
    n, h, w, c = x_shape
    rng = np.random.default_rng(c)
    inits = [numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.2).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((c, 1, 3, 3)) * 0.3).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b2")]
    nodes = [helper.make_node("Transpose", ["x"], ["planes"], perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["planes", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=c),
             helper.make_node("Transpose", ["c2"], ["y"], **({} if perm_out is None else {"perm": perm_out}))]
    graph = helper.make_graph(nodes, "channels_last", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                     list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("x_shape", [(1, 8, 8, 16), (2, 5, 7, 8)])
def test_a_segments_layout_changes_are_bound_copies(monkeypatch, x_shape):
    made, _ = watch_segments(monkeypatch)
    model = _channels_last_block(x_shape, [0, 2, 3, 1])
    options = session_module.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.compile_in_background", "0")
    options.add_session_config_entry("session.plan_cache", "0")
    sess = session_module.InferenceSession(model.SerializeToString(), sess_options=options)
    for seed in range(4):
        x = np.random.default_rng(seed).standard_normal(x_shape).astype(np.float32)
        (got,) = sess.run(None, {"x": x})
        (exact,) = run_float64(model, {"x": x})
        assert got.shape == exact.shape
        assert np.abs(got - exact).max() <= 1e-5 * (1 + np.abs(exact).max()) * (1 + np.abs(x).max())
    plans = [plan for segment in made for plans in segment.plans.values() for plan in (plans or ())]
    assert plans, "the block ran as a segment's plan"
    assert all(plan.describe()["kernels"] == 0 for plan in plans), [plan.describe() for plan in plans]


def test_other_transposes_keep_their_kernel(monkeypatch):
    # a reversing Transpose (no perm) after the block: not a layout change between NCHW and NHWC
    made, _ = watch_segments(monkeypatch)
    model = _channels_last_block((1, 6, 6, 8), None)
    options = session_module.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.compile_in_background", "0")
    options.add_session_config_entry("session.plan_cache", "0")
    sess = session_module.InferenceSession(model.SerializeToString(), sess_options=options)
    x = np.random.default_rng(9).standard_normal((1, 6, 6, 8)).astype(np.float32)
    for _ in range(3):
        (got,) = sess.run(None, {"x": x})
    (exact,) = run_float64(model, {"x": x})
    assert np.abs(got - exact).max() <= 1e-5 * (1 + np.abs(exact).max()) * (1 + np.abs(x).max())
    plans = [plan for segment in made for plans in segment.plans.values() for plan in (plans or ())]
    assert [plan.describe()["kernels"] for plan in plans] == [1]


def _shuffle_block(groups: int = 3, per_group: int = 8, size: int = 10):
    """ShuffleNet's unit middle: a grouped 1x1 convolution, the channel shuffle (Reshape -> 5-D Transpose ->
    Reshape), a 3x3 depthwise convolution and a grouped 1x1 one with its Relu."""
    c = groups * per_group
    rng = np.random.default_rng(c)
    inits = [numpy_helper.from_array((rng.standard_normal((c, per_group, 1, 1)) * 0.3).astype(np.float32), "w1"),
             numpy_helper.from_array(np.array([0, groups, per_group, size, size], np.int64), "split"),
             numpy_helper.from_array(np.array([0, c, size, size], np.int64), "merge"),
             numpy_helper.from_array((rng.standard_normal((c, 1, 3, 3)) * 0.3).astype(np.float32), "w2"),
             numpy_helper.from_array((rng.standard_normal((c, per_group, 1, 1)) * 0.3).astype(np.float32), "w3")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], group=groups),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Reshape", ["r1", "split"], ["grouped"]),
             helper.make_node("Transpose", ["grouped"], ["swapped"], perm=[0, 2, 1, 3, 4]),
             helper.make_node("Reshape", ["swapped", "merge"], ["shuffled"]),
             helper.make_node("Conv", ["shuffled", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=c),
             helper.make_node("Conv", ["c2", "w3"], ["c3"], group=groups),
             helper.make_node("Relu", ["c3"], ["y"])]
    graph = helper.make_graph(nodes, "shuffle", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                               ["batch", c, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("batch, threads", [(1, 1), (2, 2)])
def test_a_channel_shuffle_inside_a_segment_is_one_bound_copy(monkeypatch, batch, threads):
    """The segment takes the shuffle (conv_fusions runs the shuffle-reading convolution's fusion only on shuffles no
    segment took): its 5-D Transpose a copy through the permuted view, no step a node's kernel, the values within a
    float64 reference, one image or two on two threads."""
    made, _ = watch_segments(monkeypatch)
    model = _shuffle_block()
    options = session_module.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.compile_in_background", "0")
    options.add_session_config_entry("session.plan_cache", "0")
    sess = session_module.InferenceSession(model.SerializeToString(), sess_options=options)
    assert [p.op_type for p in sess.placement()] == ["FusedSegment"]
    for seed in range(4):
        x = np.random.default_rng(seed).standard_normal((batch, 24, 10, 10)).astype(np.float32)
        (got,) = sess.run(None, {"x": x})
        (exact,) = run_float64(model, {"x": x})
        assert got.shape == exact.shape
        assert np.abs(got - exact).max() <= 1e-5 * (1 + np.abs(exact).max()) * (1 + np.abs(x).max())
    plans = [plan for segment in made for plans in segment.plans.values() for plan in (plans or ())]
    assert plans and all(plan.describe()["kernels"] == 0 for plan in plans), [p.describe() for p in plans]
