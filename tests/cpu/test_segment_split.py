"""A CNN segment's batch split into image ranges run in parallel (algorithms/segment_split.py): at two threads a
batch of two or more images plans one range per thread, each range's chain a job of its own; the outputs stay
within float32 rounding of a float64 reference and of the one-thread plan's, whatever the batch, from several
Python threads at once, and a segment with a node that reads across images (a softmax over the batch) is never
split, whatever its warm-up images."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
from model_helpers import record_calls
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime import session
from onnx_runtime_ep_cpu.algorithms import segment_split
from onnx_runtime_ep_cpu.compiled import deferred, host
from onnx_runtime_ep_cpu.ops import segment as segment_module
from onnx_runtime_ep_cpu.tuning import override
from reference64 import run_float64
from test_cnn_blocked_layout import _chain_model
from test_fp16_cnn_segment import _float32_twin, _half_cnn
from test_segment_fusion import _segment_and_feeds

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the chained loops (direct tiles) need AVX2")


def _close(got, exact) -> None:
    assert got.shape == exact.shape and got.dtype == np.float32
    assert np.abs(got - exact).max() <= 1e-5 * (1 + np.abs(exact).max())


def _head_model(last: str = "Gemm", size: int = 12) -> onnx.ModelProto:
    """conv -> relu -> max pool -> conv (+ residual) -> relu -> global pool -> flatten -> ``last``: a classifier
    Gemm, or a Softmax over the batch axis (which reads every image)."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 3, 3, 3)) / 5).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal(16) / 10).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) / 12).astype(np.float32), "w2"),
             numpy_helper.from_array((rng.standard_normal(16) / 10).astype(np.float32), "b2"),
             numpy_helper.from_array((rng.standard_normal((16, 7)) / 4).astype(np.float32), "wf"),
             numpy_helper.from_array((rng.standard_normal(7) / 10).astype(np.float32), "bf")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Add", ["c2", "p1"], ["s2"]),
             helper.make_node("Relu", ["s2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"])]
    if last == "Gemm":
        nodes.append(helper.make_node("Gemm", ["f", "wf", "bf"], ["y"]))
    else:
        nodes.append(helper.make_node("Softmax", ["f"], ["y"], axis=0))
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            ["batch", 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _planned(segment, feeds):
    """The segment's plan for ``feeds``, run once (settled: on a cold numba cache its loops are linked first)."""
    segment(*feeds)
    deferred.wait_ready(240)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    return plan


def _fed(feeds, x):
    return [x if f.flags.writeable else f for f in feeds]


@pytest.mark.parametrize("batch", [2, 5])
def test_a_batch_runs_in_image_ranges_within_rounding_of_float64(batch):
    model = _chain_model()
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 13, 13)).astype(np.float32)
    with override(threads=2):
        segment, feeds = _segment_and_feeds(model, x)
        plan = _planned(segment, feeds)
        assert plan.describe()["split"] == [batch // 2, batch - batch // 2]
        for scale in (1.0, 3.0):
            x = (rng.standard_normal(x.shape) * scale).astype(np.float32)
            got = dict(zip(segment.output_names, segment(*_fed(feeds, x))))
            for name, exact in zip(["pool", "c5"], run_float64(model, {"x": x})):
                _close(got[name], exact)
    with override(threads=1):  # the same values as the whole batch's plan on one thread
        alone, feeds = _segment_and_feeds(model, x)
        assert "split" not in _planned(alone, _fed(feeds, x)).describe()
        for a, b in zip(alone(*_fed(feeds, x)), got.values()):
            assert np.abs(a - b).max() <= 1e-6 * (1 + np.abs(a).max())


def split_run_matches_float64(model, shape, seed: int, split: list[int]) -> None:
    """At two threads the model's segment plans a batch of ``shape`` in the image ranges ``split``, and its output
    for other images stays within float32 rounding of a float64 reference."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    with override(threads=2):
        segment, feeds = _segment_and_feeds(model, x)
        plan = _planned(segment, feeds)
        assert plan.describe()["split"] == split
        x = rng.standard_normal(x.shape).astype(np.float32)
        (got,) = segment(*_fed(feeds, x))
    (exact,) = run_float64(model, {"x": x})
    _close(got, exact)


def test_a_classifier_after_the_chain_runs_range_by_range():
    split_run_matches_float64(_head_model("Gemm"), (4, 3, 12, 12), 7, [2, 2])


def test_a_half_precision_cnn_rounds_each_range_then_runs_its_chain(monkeypatch):
    """A float16 model's segment rounds its input as its first step (not chained): range by range on this thread,
    then the ranges' chains as jobs, then each range's classifier."""
    called = record_calls(monkeypatch, segment_module.Segment)
    model = _half_cnn()
    options = session.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.compile_in_background", "0")
    sess = session.InferenceSession(model.SerializeToString(), sess_options=options)
    twin = _float32_twin(model)
    rng = np.random.default_rng(12)
    with override(threads=2):  # (the session's two threads, on any host)
        for scale in (1.0, 4.0):
            x = (rng.standard_normal((5, 3, 16, 16)) * scale).astype(np.float32)
            (got,) = sess.run(None, {"x": x})
            (wide,) = run_float64(twin, {"x": x.astype(np.float16).astype(np.float32)})
            assert np.abs(got - wide).max() <= 1e-4 * (1 + np.abs(wide).max())
    plans = [plan for segment in dict.fromkeys(called) for plans in segment.plans.values() for plan in plans or ()]
    assert [plan.describe().get("split") for plan in plans] == [[2, 3]]
    assert getattr(plans[0].parts[0].calls[0][0], "__name__", "") == "round_to_float16"


def test_one_image_or_one_thread_is_not_split():
    model = _head_model("Gemm")
    x = np.random.default_rng(8).standard_normal((1, 3, 12, 12)).astype(np.float32)
    with override(threads=2):
        segment, feeds = _segment_and_feeds(model, x)
        assert "split" not in _planned(segment, feeds).describe()
    x = np.repeat(x, 4, axis=0)
    with override(threads=1):
        segment, feeds = _segment_and_feeds(model, x)
        assert "split" not in _planned(segment, feeds).describe()


def test_a_node_reading_across_images_keeps_the_batch_whole():
    """A softmax over the batch, planned on identical images and run on distinct ones: never split (a range would
    normalize over its own images), always the whole batch's softmax."""
    model = _head_model("Softmax")
    rng = np.random.default_rng(9)
    same = np.repeat(rng.standard_normal((1, 3, 12, 12)).astype(np.float32), 4, axis=0)
    with override(threads=2):
        segment, feeds = _segment_and_feeds(model, same)
        assert "split" not in _planned(segment, feeds).describe()
        x = rng.standard_normal(same.shape).astype(np.float32)
        (got,) = segment(*_fed(feeds, x))
    (exact,) = run_float64(model, {"x": x})
    _close(got, exact)
    assert np.allclose(got.sum(axis=0), 1.0, atol=1e-5)


def test_per_image_reads_the_graph_not_the_values():
    """The proof's verdicts on the nodes themselves: a softmax over the batch, a Concat along it, a transpose that
    moves it, and a constant with a row per image are refused; the classifier head is not."""
    model = _head_model("Gemm")
    x = np.random.default_rng(10).standard_normal((4, 3, 12, 12)).astype(np.float32)
    with override(threads=2):
        segment, feeds = _segment_and_feeds(model, x)
        env, _ = segment._node_by_node(feeds, keep_all=True)  # noqa: SLF001
    constants = {slot for slot, value in enumerate(feeds) if not value.flags.writeable}
    assert segment_split.batch_of(segment, env, constants) == 4
    assert segment_split.per_image(segment, env, constants)
    last = segment.inner[-1].node
    for op_type, attrs in [("Softmax", {"axis": 0}), ("Concat", {"axis": 0}), ("Transpose", {"perm": [1, 0]})]:
        original = (last.op_type, last.domain, dict(last.attrs))
        last.op_type, last.attrs = op_type, attrs
        try:
            assert not segment_split.per_image(segment, env, constants), op_type
        finally:
            last.op_type, last.domain, last.attrs = original
    bias = segment.inner[-1].inputs[2]  # the Gemm's C: one row per image is a constant along the batch
    saved = env[bias]
    env[bias] = np.ones((4, saved.shape[-1]), np.float32)
    try:
        assert not segment_split.per_image(segment, env, constants)
    finally:
        env[bias] = saved


def two_thread_session(model):
    """A session of ``model`` at two threads whose kernels are compiled in the foreground."""
    options = session.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.compile_in_background", "0")
    return session.InferenceSession(model.SerializeToString(), sess_options=options)


def test_sessions_on_two_threads_from_several_python_threads():
    model = _head_model("Gemm")
    sess = two_thread_session(model)
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((6, 3, 12, 12)).astype(np.float32) for _ in range(4)]
    exact = [run_float64(model, {"x": x})[0] for x in inputs]
    sess.run(None, {"x": inputs[0]})
    deferred.wait_ready(240)
    failures: list = []

    def worker(index: int) -> None:
        try:
            for _ in range(20):
                (got,) = sess.run(None, {"x": inputs[index]})
                _close(got, exact[index])
        except BaseException as exc:  # noqa: BLE001  (reported below)
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]
