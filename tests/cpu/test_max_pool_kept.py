"""MaxPool's kept call per input shape (algorithms/pooling.KeptPool): once the compiled loops run, a repeated
shape runs its prepared call (the pool job's windows.pool_planes for a float32 3x3 window of stride 1 or 2, pool_2d
otherwise),
with each output the float64 windows' maximum (NaN and -inf included) and onnxruntime's; a change of the kernel
threads takes the general path again."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import pytest
from onnx import TensorProto, helper
from onnx_runtime_ep_cpu.algorithms.pooling import KeptPool
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.tuning import KNOBS

onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")

CASES = [  # (input shape, kernel, strides, pads, dtype, the loop kept)
    ((1, 16, 32, 32), (3, 3), (2, 2), (1, 1, 1, 1), np.float32, "pool"),  # resnet's stem pool
    ((2, 5, 17, 33), (3, 3), (1, 1), (1, 1, 1, 1), np.float32, "pool"),
    ((1, 4, 19, 21), (3, 3), (2, 2), (0, 0, 0, 0), np.float32, "pool"),
    ((1, 16, 48, 48), (2, 2), (2, 2), (0, 0, 0, 0), np.float32, "pool_2d"),
    ((1, 6, 24, 24), (3, 3), (2, 2), (1, 1, 1, 1), np.float64, "pool_2d"),
]


def _model(shape, kernel, strides, pads, dtype) -> bytes:
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=list(kernel), strides=list(strides), pads=list(pads))
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", elem, list(shape))],
                              [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _reference(x, kernel, strides, pads) -> np.ndarray:
    """Each window's maximum over the input values it covers, in float64 (NaN wins, as in both loops)."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (top, left, bottom, right) = kernel, strides, pads
    oh, ow = (h + top + bottom - kh) // sh + 1, (w + left + right - kw) // sw + 1
    y = np.empty((n, c, oh, ow))
    x64 = x.astype(np.float64)
    for i in range(oh):
        for j in range(ow):
            r0, c0 = i * sh - top, j * sw - left
            window = x64[:, :, max(r0, 0):r0 + kh, max(c0, 0):c0 + kw].reshape(n, c, -1)
            y[:, :, i, j] = np.where(np.isnan(window).any(-1), np.nan, window.max(-1))
    return y


def _kept(session) -> list:
    """The KeptPool calls the session's MaxPool kernel holds."""
    found = []
    for step in session._executor_for(None).plan(("y",)).steps:  # noqa: SLF001 (the plan's own kernel)
        for cell in getattr(step.run, "__closure__", None) or ():
            if isinstance(cell.cell_contents, dict):
                found += [v for v in cell.cell_contents.values() if isinstance(v, KeptPool)]
    return found


@pytest.mark.parametrize("shape,kernel,strides,pads,dtype,loop", CASES)
def test_kept_pool_equals_reference_and_onnxruntime(shape, kernel, strides, pads, dtype, loop):
    data = _model(shape, kernel, strides, pads, dtype)
    options = onnx_runtime.SessionOptions()
    options.intra_op_num_threads = 1
    ours = onnx_runtime.InferenceSession(data, options, providers=["cpu"])
    theirs = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(dtype)
    ours.run(None, {"x": x})
    deferred.wait_ready(300)
    for trial in range(4):
        x = rng.standard_normal(shape).astype(dtype)
        if trial == 3:  # NaN and -inf: a window with a NaN gives NaN, -inf loses to any value
            x[0, 0, 1, 1], x[0, -1, -1, -1], x[-1, 1, 0, :3] = np.nan, -np.inf, -np.inf
        (y,) = ours.run(None, {"x": x})
        np.testing.assert_array_equal(y, _reference(x, kernel, strides, pads).astype(dtype))
        if trial < 3:
            np.testing.assert_array_equal(y, theirs.run(None, {"x": x})[0])
    kept = _kept(ours)
    assert len(kept) == 1 and kept[0].loop.__name__ == {"pool": "pool_planes", "pool_2d": "pool_2d"}[loop]


def test_kept_pool_steps_aside_when_the_threads_change(monkeypatch):
    shape, kernel, strides, pads = CASES[0][:4]
    data = _model(shape, kernel, strides, pads, np.float32)
    options = onnx_runtime.SessionOptions()
    options.intra_op_num_threads = 1
    ours = onnx_runtime.InferenceSession(data, options, providers=["cpu"])
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    ours.run(None, {"x": x})
    deferred.wait_ready(300)
    ours.run(None, {"x": x})
    (kept,) = _kept(ours)
    assert kept.threads == 1  # the session's setting, during its runs
    monkeypatch.setattr(KNOBS, "threads", 1)
    np.testing.assert_array_equal(kept(x), _reference(x, kernel, strides, pads).astype(np.float32))
    monkeypatch.setattr(KNOBS, "threads", 2)
    assert kept(x) is None  # the kernel then runs compiled_pool, which may split the planes
    np.testing.assert_array_equal(ours.run(None, {"x": x})[0], _reference(x, kernel, strides, pads).astype(np.float32))
