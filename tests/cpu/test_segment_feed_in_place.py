"""A segment plan's feed whose only reader is its chained first convolution (which copies each image into its
own padded source anyway) is read from the caller's array instead of being copied into the plan's buffer first
(algorithms/segment_chain.read_in_place), as onnxruntime's first convolution reads its input. A feed that is not
C-contiguous is copied in as before, a feed another node reads keeps its copy, and every run's outputs stay
within a float64 reference's bound whichever way the last run went."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime import session as session_module
from onnx_runtime_ep_cpu.compiled import deferred
from reference64 import run_float64
from test_batch_readonly_feeds import _cnn


def _session(model: onnx.ModelProto):
    deferred.wait_ready(240)
    options = session_module.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.compile_in_background", "0")
    return session_module.InferenceSession(model.SerializeToString(), sess_options=options)


def _feed_copies(monkeypatch) -> list:
    """The ids of np.copyto's sources (a test clears it before a run and looks right after: its feed is alive
    in between, so no other object has its id)."""
    copied: list = []
    real = np.copyto

    def copyto(dst, src, *args, **kwargs):
        copied.append(id(src))
        return real(dst, src, *args, **kwargs)

    monkeypatch.setattr(np, "copyto", copyto)
    return copied


def _close(model, x, got) -> bool:
    (exact,) = run_float64(model, {"x": x})
    return np.abs(got - exact).max() <= 1e-4 * (1 + np.abs(exact).max())


def _two_readers() -> onnx.ModelProto:
    """The stem reads x, and so does a second convolution whose output is added to the stem's."""
    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in (("w1", (8, 3, 3, 3)), ("w2", (8, 3, 3, 3)), ("w3", (8, 8, 3, 3)))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4),
             helper.make_node("Conv", ["x", "w2"], ["b"], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4),
             helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("Relu", ["c"], ["d"]),
             helper.make_node("Conv", ["d", "w3"], ["y"], kernel_shape=[3, 3], pads=[1] * 4)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 16, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return helper.make_model(helper.make_graph(nodes, "two", [x], [y], inits),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("read_only", [False, True])
def test_first_convolution_reads_the_feed_in_place(monkeypatch, read_only):
    model = _cnn()
    sess = _session(model)
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((40, 3, 17, 17)).astype(np.float32)
    rows.setflags(write=not read_only)  # (read-only: a column from Arrow, fed as slices)
    for run in range(4):  # planned, and for read-only slices planned again once seen to change
        sess.run(None, {"x": rows[run * 8:(run + 1) * 8]})
    copied = _feed_copies(monkeypatch)
    for run in range(4, 8):
        x = rows[(run % 5) * 8:(run % 5 + 1) * 8]
        copied.clear()
        (got,) = sess.run(None, {"x": x})
        assert id(x) not in copied, f"run {run}: the feed was copied into the plan's buffer"
        assert _close(model, x, got), run


def test_a_feed_that_is_not_contiguous_is_copied_in_and_the_next_read_in_place(monkeypatch):
    model = _cnn()
    sess = _session(model)
    rng = np.random.default_rng(4)
    wide = rng.standard_normal((8, 3, 17, 34)).astype(np.float32)
    for _ in range(3):
        sess.run(None, {"x": np.ascontiguousarray(wide[..., :17])})
    copied = _feed_copies(monkeypatch)
    for run in range(6):  # alternating: a strided view (copied in), a contiguous array (read where it is)
        x = wide[..., run % 2::2] if run % 2 == 0 else np.ascontiguousarray(wide[..., 17:]) * (run + 1)
        copied.clear()
        (got,) = sess.run(None, {"x": x})
        assert (id(x) in copied) == (not x.flags.c_contiguous), run
        assert _close(model, x, got), run


def test_a_feed_two_nodes_read_keeps_its_copy(monkeypatch):
    model = _two_readers()
    sess = _session(model)
    rng = np.random.default_rng(6)
    for _ in range(3):
        sess.run(None, {"x": rng.standard_normal((4, 3, 16, 16)).astype(np.float32)})
    copied = _feed_copies(monkeypatch)
    x = rng.standard_normal((4, 3, 16, 16)).astype(np.float32)
    copied.clear()
    (got,) = sess.run(None, {"x": x})
    assert id(x) in copied
    assert _close(model, x, got)
