"""Blocked convolutions whose output rows are narrower than a tile (compiled/directconv_gathered.py): a ResNet's
last stages, where a tile of pixels spans rows and images. Checked against a float64 reference and onnxruntime
with stride 2 (padded 3x3 and pointwise shortcut), a residual with its activation, channel counts that are not
multiples of 16, and pixel counts that leave the last tile partly empty (batches of 1, 3 and 5)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from model_helpers import bound_plan
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import deferred, host
from reference64 import run_float64
from test_segment_fusion import _segment_and_feeds

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the direct tiles need AVX2")


def _stage_model(size: int) -> onnx.ModelProto:
    """A stem, then a bottleneck stage at stride 2 whose outputs are 3 pixels wide: 1x1 reduce, 3x3 stride 2 padded,
    1x1 expand plus a strided 1x1 shortcut, Relu after the sum, then a pool."""
    rng = np.random.default_rng(5)
    inits, nodes = [], []

    def conv(x, y, cin, cout, k, stride=1):
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"{y}_w"))
        inits.append(numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{y}_b"))
        nodes.append(helper.make_node("Conv", [x, f"{y}_w", f"{y}_b"], [y], kernel_shape=[k, k],
                                      strides=[stride] * 2, pads=[k // 2] * 4))

    conv("x", "c1", 3, 20, 3)
    nodes.append(helper.make_node("Relu", ["c1"], ["a1"]))
    conv("a1", "r1", 20, 12, 1)
    nodes.append(helper.make_node("Relu", ["r1"], ["a2"]))
    conv("a2", "r2", 12, 12, 3, stride=2)
    nodes.append(helper.make_node("Relu", ["r2"], ["a3"]))
    conv("a3", "r3", 12, 36, 1)
    conv("a1", "short", 20, 36, 1, stride=2)
    nodes.append(helper.make_node("Add", ["r3", "short"], ["sum"]))
    nodes.append(helper.make_node("Relu", ["sum"], ["a4"]))
    conv("a4", "tail", 36, 24, 1)
    nodes.append(helper.make_node("GlobalAveragePool", ["tail"], ["pool"]))
    graph = helper.make_graph(nodes, "stage", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             ["batch", 3, size, size])],
                              [helper.make_tensor_value_info("pool", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_narrow_rows_gathered_match_float64_and_onnxruntime(batch):
    model = _stage_model(6)
    deferred.wait_ready(240)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 6, 6)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    plan = bound_plan(plan)
    called = [getattr(f, "__name__", "") for f, _ in plan._steps]  # noqa: SLF001
    assert called.count("conv_gathered") == 2, called  # the strided 3x3 and shortcut (pointwise: one row)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    oracle = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for run in range(3):
        x = rng.standard_normal(x.shape).astype(np.float32) * (run + 1)
        feeds = [x if f.shape == x.shape and f.flags.writeable else f for f in feeds]
        (got,) = segment(*feeds)
        (exact,) = run_float64(model, {"x": x})
        (theirs,) = oracle.run(None, {"x": x})
        bound = 2e-5 * (1 + np.abs(exact).max())
        assert got.shape == exact.shape and got.dtype == np.float32
        assert np.abs(got - exact).max() <= bound, run
        assert np.abs(got - theirs).max() <= bound, run
