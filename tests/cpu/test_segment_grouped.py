"""Grouped convolutions inside a CNN segment (a RegNet block: 1x1, a grouped 3x3, squeeze-excitation, 1x1, the
residual): where each group's input and output channels are whole blocks of 16, each image's groups run as direct
tiles of their own over the blocked values (segment_layout._grouped; tiles across rows where the output rows are
narrower than a tile), so the block stays blocked and chained; narrower groups keep their plain call. Within float32
rounding of a float64 reference and of onnxruntime, at batch 1 and 3, and split into image ranges on two threads."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_helpers import bound_plan
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import deferred, host
from test_segment_fusion import _segment_and_feeds, segment_matches_references
from test_segment_split import split_run_matches_float64

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the chained loops (direct tiles) need AVX2")


def _regnet_model(group_width: int = 16, stride: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(group_width + stride)
    inits, nodes = [], []

    def conv(x, y, cin, cout, k, s=1, group=1, act="Relu"):
        w = (rng.standard_normal((cout, cin // group, k, k)) / np.sqrt(cin // group * k * k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"{y}_w"))
        inits.append(numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{y}_b"))
        out = f"{y}_c" if act else y
        nodes.append(helper.make_node("Conv", [x, f"{y}_w", f"{y}_b"], [out], kernel_shape=[k, k], pads=[k // 2] * 4,
                                      strides=[s, s], group=group))
        if act:
            nodes.append(helper.make_node(act, [out], [y]))

    conv("x", "stem", 3, 32, 3)
    conv("stem", "a", 32, 48, 1)
    conv("a", "b", 48, 48, 3, s=stride, group=48 // group_width)
    nodes.append(helper.make_node("GlobalAveragePool", ["b"], ["pooled"]))
    conv("pooled", "squeezed", 48, 8, 1)
    conv("squeezed", "gate", 8, 48, 1, act="Sigmoid")
    nodes.append(helper.make_node("Mul", ["b", "gate"], ["excited"]))
    conv("excited", "c", 48, 48, 1, act=None)
    conv("stem", "shortcut", 32, 48, 1, s=stride, act=None)
    nodes.append(helper.make_node("Add", ["c", "shortcut"], ["sum"]))
    nodes.append(helper.make_node("Relu", ["sum"], ["block"]))
    conv("block", "tail", 48, 16, 3, act=None)
    nodes.append(helper.make_node("GlobalAveragePool", ["tail"], ["y"]))
    graph = helper.make_graph(nodes, "regnet", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                              ["batch", 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _names(plan) -> list[str]:
    return [getattr(f, "__name__", "") for f, _ in plan._steps]  # noqa: SLF001


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("group_width, stride, blocked", [(16, 1, True), (16, 2, True), (8, 1, False)])
def test_grouped_convolutions_run_blocked_within_rounding(batch, group_width, stride, blocked):
    model = _regnet_model(group_width, stride)
    deferred.wait_ready(240)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 12, 12)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    names = _names(bound_plan(plan))
    if blocked:  # (each image's 3 groups a call of their own, 5 other convolutions; the excitation blocked too)
        assert "conv_direct" not in names and "squeeze_excite_blocked" in names
        assert names.count("conv_blocked") + names.count("conv_gathered") >= 5 + 3
        # the groups' calls (16 channels x 3 x 3 taps deep): tiles across rows where the stride leaves rows of 6
        # pixels, narrower than a tile
        groups = [getattr(f, "__name__", "") for f, a in bound_plan(plan)._steps  # noqa: SLF001
                  if getattr(f, "__name__", "") in ("conv_blocked", "conv_gathered") and a[1].shape[2] == 16 * 9]
        assert len(groups) >= 3 and set(groups) == {"conv_gathered" if stride == 2 else "conv_blocked"}
    else:
        assert "conv_direct" in names
    segment_matches_references(model, segment, feeds, x.shape, rng)


def test_grouped_batch_splits_into_image_ranges_on_two_threads():
    split_run_matches_float64(_regnet_model(), (5, 3, 12, 12), 8, [2, 3])
