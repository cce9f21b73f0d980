"""A segment plans a signature from a node-by-node run whose values only check the bound plan's
(ops/segment.py). That run is a ReferenceRun (compiled/reference_run.py): loops with a numpy equivalent and
kernels that ask ``numpy_first`` take numpy's paths on that thread only, record nothing and start no loader,
and the plan still binds the compiled calls (a convolution numpy served is built compiled when bound)."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx_runtime import session as session_module
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.compiled.reference_run import ReferenceRun, active
from onnx_runtime_ep_cpu.ops import segment as segment_module
from reference64 import run_float64
from test_batch_readonly_feeds import _cnn


def _built(function):
    raise AssertionError("the loop's dispatcher was built: a compiled call outside the ReferenceRun")


def test_reference_run_serves_numpy_on_its_thread_only(monkeypatch):
    monkeypatch.setattr(deferred.state, "deferring", False)
    loader = deferred.state.thread

    def doubled(x):
        return x * 2

    loop = deferred.Loop(doubled, _built)
    try:
        loop._generic = lambda x: x * 2.0  # noqa: SLF001  (the numpy equivalent, as generic.py's table gives it)
        x = np.arange(5, dtype=np.float32)
        assert not deferred.numpy_first() and not active()
        with ReferenceRun():
            assert active() and deferred.numpy_first("jobs.MATMUL")
            with ReferenceRun():  # (nested: still on after the inner one ends)
                pass
            np.testing.assert_array_equal(loop(x), x * 2)
            assert not loop.switched and not loop.recorded() and not loop.pending()
            seen = []
            other = threading.Thread(target=lambda: seen.append((active(), deferred.numpy_first())))
            other.start()
            other.join()
            assert seen == [(False, False)]
        assert not active() and not deferred.numpy_first()
        with pytest.raises(AssertionError, match="dispatcher was built"):
            loop(x)
        assert deferred.state.thread is loader  # no loader started by the reference run
    finally:
        with deferred._lock:  # noqa: SLF001
            deferred._loops.remove(loop)  # noqa: SLF001


def _planned_session(monkeypatch, reference):
    deferred.wait_ready(240)
    made, reference_numpy = [], []
    real_init = segment_module.Segment.__init__
    real_nodes = segment_module.Segment._node_by_node  # noqa: SLF001

    def init(self, node):
        real_init(self, node)
        made.append(self)

    def node_by_node(self, inputs, keep_all):
        if keep_all:  # (the reference run of _plan_and_run)
            reference_numpy.append(deferred.numpy_first())
        return real_nodes(self, inputs, keep_all)

    monkeypatch.setattr(segment_module.Segment, "__init__", init)
    monkeypatch.setattr(segment_module.Segment, "_node_by_node", node_by_node)
    if not reference:
        monkeypatch.setattr(segment_module, "ReferenceRun", contextlib.nullcontext)
    options = session_module.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.compile_in_background", "0")
    model = _cnn()
    sess = session_module.InferenceSession(model.SerializeToString(), sess_options=options)
    return model, sess, made, reference_numpy


@pytest.mark.parametrize("batch", [1, 6])
def test_plan_after_a_numpy_reference_run_binds_what_a_compiled_one_does(monkeypatch, batch):
    x = np.random.default_rng(batch).standard_normal((batch, 3, 17, 17)).astype(np.float32)
    described = {}
    for reference in (False, True):
        with monkeypatch.context() as patch:
            model, sess, made, reference_numpy = _planned_session(patch, reference)
            for _ in range(3):
                (got,) = sess.run(None, {"x": x})
                (exact,) = run_float64(model, {"x": x})
                assert np.abs(got - exact).max() <= 1e-4 * (1 + np.abs(exact).max())
            assert reference_numpy == [reference], "one reference run, numpy-served only inside a ReferenceRun"
            plans = [p[0] for s in made for p in s.plans.values() if p]
            assert plans, "the model was expected to run as a planned segment"
            described[reference] = [p.describe() for p in plans]
    assert described[True] == described[False]  # (the convolutions bound compiled, none left to its kernel)
    assert all(d["kernels"] == 0 for d in described[True])


def _pool_model(op: str) -> onnx.ModelProto:
    extra = {"count_include_pad": 1} if op == "AveragePool" else {}
    node = helper.make_node(op, ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], **extra)
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 9, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_pool_in_a_reference_run_posts_no_job(monkeypatch, op):
    """A 3x3 pool in a reference run takes its loop's numpy equivalent, not the helper-job entry points (linked for
    that run alone, ~50 ms in a new worker); outside one the job runs as before. Both within a float64 bound."""
    from onnx_runtime_ep_cpu.compiled import workers

    deferred.wait_ready(240)
    posted = []
    real_run = workers.run

    def run(kind, parts, *rest):
        posted.append(kind)
        return real_run(kind, parts, *rest)

    monkeypatch.setattr(workers, "run", run)
    model = _pool_model(op)
    options = session_module.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.compile_in_background", "0")
    sess = session_module.InferenceSession(model.SerializeToString(), sess_options=options)
    x = np.random.default_rng(7).standard_normal((2, 5, 9, 9)).astype(np.float32)
    (exact,) = run_float64(model, {"x": x})
    with ReferenceRun():
        (got,) = sess.run(None, {"x": x})
    assert posted == [], "a reference run posted a pool job"
    assert np.abs(got - exact).max() <= 1e-5 * (1 + np.abs(exact).max())
    (got,) = sess.run(None, {"x": x})
    assert posted, "outside a reference run the 3x3 pool was expected to run as a job"
    assert np.abs(got - exact).max() <= 1e-5 * (1 + np.abs(exact).max())
