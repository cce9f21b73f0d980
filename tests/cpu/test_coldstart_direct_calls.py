"""A fused convolution's direct calls (ops/conv.py: the packed convolution, direct tiles or depthwise lanes called
with the node's own bias, residual and bounds) are tried inside a deferred.Trial until one has run whole: their
argument types need not be the ones the path's own tried call used, and while the background loader guards, a
loop that misses numba's cache must not compile on the run's thread. Such a call is served by numpy's algorithm
(conv_path's ``path.numpy``) while the loader's child compiles the loop. The miss is simulated in process; the
outputs are checked against a float64 reference."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms.conv_depthwise import LanesDepthwise
from onnx_runtime_ep_cpu.algorithms.conv_direct import DirectConv
from onnx_runtime_ep_cpu.algorithms.conv_packed import PackedConv
from onnx_runtime_ep_cpu.compiled import deferred
from reference64 import run_float64

CPU = ["CPUExecutionProvider"]


def _residual_model(rng):
    """Conv + Relu, then Conv + the first's output + Relu: two FusedConvs, the second with a residual."""
    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1] * 4),
             helper.make_node("Add", ["c2", "r1"], ["a2"]),
             helper.make_node("Relu", ["a2"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 24, 24])
    graph = helper.make_graph(nodes, "residual", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [weight("w1", 16, 8, 3, 3), weight("b1", 16), weight("w2", 16, 16, 3, 3),
                               weight("b2", 16)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _counting_bound(original, state: dict):
    """DirectConv.bound_run whose bound calls (a FusedConv without a residual keeps its direct tiles' entry point,
    ops/conv.py) count as straight calls once a miss was served by numpy, outside a Trial."""
    def bind(self, *arguments, **keywords):
        run = original(self, *arguments, **keywords)
        if run is None:
            return None

        def counted(x):
            if state["served_by_numpy"] and not getattr(deferred._trial, "depth", 0):  # noqa: SLF001
                state["straight"] += 1
            return run(x)
        return counted
    return bind


def test_a_direct_call_that_would_compile_is_served_by_numpy(monkeypatch):
    monkeypatch.setenv("ONNX_RUNTIME_SEGMENTS", "0")  # node by node: the FusedConvs' own kernels run
    rng = np.random.default_rng(3)
    model = _residual_model(rng)
    state = {"armed": False, "served_by_numpy": 0, "compiled_here": 0, "straight": 0}

    def guarded(original):
        def run(self, *arguments, **keywords):
            direct = not state["through_path"]  # (the path's own tried call goes through __call__)
            if state["armed"] and direct:
                if getattr(deferred._trial, "depth", 0):  # noqa: SLF001  (a miss inside a Trial, as _guard raises)
                    state["served_by_numpy"] += 1
                    raise deferred.WouldCompile("simulated cache miss")
                state["compiled_here"] += 1  # outside a Trial the miss would compile on this thread
            elif direct and state["served_by_numpy"] and not getattr(deferred._trial, "depth", 0):  # noqa: SLF001
                state["straight"] += 1
            return original(self, *arguments, **keywords)
        return run

    def through_path(original):
        def call(self, *arguments, **keywords):
            state["through_path"] = True
            try:
                return original(self, *arguments, **keywords)
            finally:
                state["through_path"] = False
        return call

    state["through_path"] = False
    for cls in (PackedConv, DirectConv, LanesDepthwise):
        monkeypatch.setattr(cls, "run", guarded(cls.run))
        monkeypatch.setattr(cls, "__call__", through_path(cls.__call__))
    monkeypatch.setattr(DirectConv, "bound_run", _counting_bound(DirectConv.bound_run, state))
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    feeds = [{"x": rng.standard_normal((1, 8, 24, 24)).astype(np.float32)} for _ in range(6)]
    state["armed"] = True  # every direct call misses the cache until disarmed
    outputs = [session.run(None, feeds[0])[0]]
    assert deferred.wait_ready(600)  # numba loaded (a warm cache): the compiled paths are taken from here
    outputs += [session.run(None, feed)[0] for feed in feeds[1:4]]
    state["armed"] = False  # linked: tried once more, then called straight
    outputs += [session.run(None, feed)[0] for feed in feeds[4:]]
    assert state["compiled_here"] == 0, state
    assert state["served_by_numpy"] >= 2, state  # both FusedConvs met the miss
    assert state["straight"] >= 2, state
    for got, feed in zip(outputs, feeds):
        exact = run_float64(model, feed)[0]
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(exact))))
