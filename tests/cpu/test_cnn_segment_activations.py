"""A segment plan's float32 SiLU and Sigmoid as one vectorized pass (compiled/segment_loops.py), and the packed
convolution bound into the plan's buffers (conv_packed.PackedConv.bind) instead of its kernel's output copied
in. Checked against float64 and onnxruntime, batch 1 and 2."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from model_helpers import bound_plan
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms import conv_choice, segment_steps
from onnx_runtime_ep_cpu.compiled import deferred, host
from onnx_runtime_ep_cpu.compiled.segment_loops import sigmoid_float32_into, swish_float32_into
from reference64 import run_float64
from test_segment_fusion import _segment_and_feeds


def test_swish_and_sigmoid_loops_against_float64():
    deferred.wait_ready(240)
    x = np.linspace(-80, 80, 40001).astype(np.float32)
    wide = x.astype(np.float64)
    y = np.empty_like(x)
    for alpha in (1.0, 0.5, 1.702):
        swish_float32_into(x, y, np.float32(alpha))
        # (from the float32 product alpha * x, as any float32 evaluation rounds it: the exp amplifies that
        # rounding by |alpha * x|)
        exact = wide / (1 + np.exp(-(np.float32(alpha) * x).astype(np.float64)))
        # (where alpha * x < -87 the exp flushes to zero: outputs below 1e-34 in magnitude become -0)
        assert np.all(np.abs(y - exact) <= 4e-7 * np.abs(exact) + 1e-34), alpha
    sigmoid_float32_into(x, y)
    exact = 1 / (1 + np.exp(-wide))
    assert np.all(np.abs(y - exact) <= 4e-7 * exact + 1e-37)
    edges = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 100.0, -100.0], np.float32)
    out = np.empty_like(edges)
    sigmoid_float32_into(edges, out)
    np.testing.assert_array_equal(out, [1, 0, np.nan, 0.5, 0.5, 1, 0])
    swish_float32_into(edges, out, np.float32(1))
    np.testing.assert_array_equal(out[[0, 2, 3, 5, 6]], [np.inf, np.nan, 0, 100, 0])


def _silu_model(channels: int = 32, size: int = 32) -> onnx.ModelProto:
    rng = np.random.default_rng(21)
    inits, nodes = [], []

    def conv(x, y, cin, cout, k):
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"{y}_w"))
        inits.append(numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{y}_b"))
        nodes.append(helper.make_node("Conv", [x, f"{y}_w", f"{y}_b"], [y], kernel_shape=[k, k], pads=[k // 2] * 4))

    conv("x", "c1", 3, channels, 3)
    nodes.append(helper.make_node("Sigmoid", ["c1"], ["g1"]))
    nodes.append(helper.make_node("Mul", ["c1", "g1"], ["a1"]))  # SiLU, as exporters write it
    conv("a1", "c2", channels, channels, 3)  # 9.4M multiply-adds: the packed convolution on AVX-512 hosts
    nodes.append(helper.make_node("Sigmoid", ["c2"], ["a2"]))
    conv("a2", "c3", channels, 7, 1)
    graph = helper.make_graph(nodes, "silu", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            ["batch", 3, size, size])],
                              [helper.make_tensor_value_info("c3", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _loops(plan) -> list[str]:
    """The names of the plan's steps' loops, a split elementwise step's (segment_elementwise.py, at two threads and
    more) by its loop."""
    from onnx_runtime_ep_cpu.algorithms import segment_elementwise
    from onnx_runtime_ep_cpu.compiled import jobs

    split = {jobs.SWISH: "swish_float32_into", jobs.SIGMOID: "sigmoid_float32_into"}
    return [split.get(arguments[0][0][0], "?") if function is segment_elementwise._claimed_ranges  # noqa: SLF001
            else getattr(function, "__name__", "") for function, arguments in plan._steps]  # noqa: SLF001


@pytest.mark.parametrize("batch", [1, 2])
def test_silu_sigmoid_and_packed_steps_match_float64(batch, monkeypatch):
    monkeypatch.setattr(conv_choice, "LANE_MACS", 0)  # (c2 on the packed convolution, whose lanes it fills less)
    model = _silu_model()
    deferred.wait_ready(240)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    plan = bound_plan(plan)
    called = _loops(plan)
    assert "swish_float32_into" in called and "sigmoid_float32_into" in called
    if host.AVX512:
        assert segment_steps._run_kernel not in [f for f, _ in plan._steps]  # noqa: SLF001
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    oracle = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for run in range(2):
        x = (rng.standard_normal(x.shape) * (1 + 4 * run)).astype(np.float32)
        feeds = [x if f.shape == x.shape and f.flags.writeable else f for f in feeds]
        (got,) = segment(*feeds)
        (exact,) = run_float64(model, {"x": x})
        (theirs,) = oracle.run(None, {"x": x})
        bound = 1e-5 * (1 + np.abs(exact).max())
        assert got.shape == exact.shape and got.dtype == np.float32
        assert np.abs(got - exact).max() <= bound and np.abs(got - theirs).max() <= bound, run
