"""Channel Concats whose inputs are not convolutions writing in place (a GhostNet module: a 1x1 convolution's
output beside a depthwise convolution of it) and residual Adds after them run blocked inside a CNN segment
(algorithms/segment_layout.py): each Concat input copied into its channels of the blocked output, aligned to a
block of 16 channels or not, the Add one flat sum. The whole network stays one chained segment within float32
rounding of a float64 reference and of onnxruntime, also split into image ranges on two threads."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_helpers import bound_plan
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import blocked_ops, deferred, host
from test_segment_fusion import _segment_and_feeds, segment_matches_references
from test_segment_split import split_run_matches_float64

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the chained loops (direct tiles) need AVX2")


def _ghost_model(half: int = 12) -> onnx.ModelProto:
    """stem conv -> two ghost modules (1x1 to ``half`` channels + SiLU, its depthwise 3x3 + SiLU, Concat) with a
    residual Add around the second -> conv -> global average pool."""
    rng = np.random.default_rng(11)
    inits, nodes = [], []

    def conv(x, y, cin, cout, k, group=1, activation=True):
        w = (rng.standard_normal((cout, cin // group, k, k)) / np.sqrt(cin // group * k * k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"{y}_w"))
        inits.append(numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{y}_b"))
        out = f"{y}_c" if activation else y
        nodes.append(helper.make_node("Conv", [x, f"{y}_w", f"{y}_b"], [out], kernel_shape=[k, k], pads=[k // 2] * 4,
                                      group=group))
        if activation:
            nodes.append(helper.make_node("Sigmoid", [out], [f"{y}_s"]))
            nodes.append(helper.make_node("Mul", [out, f"{y}_s"], [y]))

    def ghost(x, y, cin):
        conv(x, f"{y}_p", cin, half, 1)
        conv(f"{y}_p", f"{y}_d", half, half, 3, group=half)
        nodes.append(helper.make_node("Concat", [f"{y}_p", f"{y}_d"], [y], axis=1))

    conv("x", "stem", 3, 2 * half, 3)
    ghost("stem", "g1", 2 * half)
    ghost("g1", "g2", 2 * half)
    nodes.append(helper.make_node("Add", ["g2", "g1"], ["res"]))
    conv("res", "tail", 2 * half, 20, 3, activation=False)
    nodes.append(helper.make_node("GlobalAveragePool", ["tail"], ["y"]))
    graph = helper.make_graph(nodes, "ghost", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             ["batch", 3, 14, 14])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _names(plan) -> list[str]:
    return [getattr(f, "__name__", "") for f, _ in plan._steps]  # noqa: SLF001


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("half", [12, 16])
def test_ghost_modules_concatenate_and_add_blocked_within_rounding(batch, half):
    """Halves of 12 channels (the second input lane-shifted into a block) and of 16 (whole blocks)."""
    model = _ghost_model(half)
    deferred.wait_ready(240)
    rng = np.random.default_rng(batch + half)
    x = rng.standard_normal((batch, 3, 14, 14)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    names = _names(bound_plan(plan))
    assert names.count("copy_channels_blocked") == 4 and names.count("add_float32_into") == 1
    assert names.count("depthwise_blocked") == 2 and "conv_direct" not in names
    segment_matches_references(model, segment, feeds, x.shape, rng)


def test_ghost_batch_splits_into_image_ranges_on_two_threads():
    split_run_matches_float64(_ghost_model(), (5, 3, 14, 14), 6, [2, 3])


@pytest.mark.parametrize("channels, offset, total, pixels", [(16, 0, 32, 9), (20, 0, 44, 7), (20, 20, 44, 7),
                                                             (4, 40, 44, 7), (33, 3, 36, 5)])
def test_channel_copies_place_each_channel_and_nothing_else(channels, offset, total, pixels):
    """One input's channels land at its offset in each image of the blocked output; the channels of the other
    inputs before it and after its last block are left as they were."""
    deferred.wait_ready(240)
    images = 2
    blocks, out_blocks = -(-channels // 16), -(-total // 16)
    values = np.random.default_rng(channels).standard_normal((images, channels, pixels)).astype(np.float32)
    padded = np.zeros((images, blocks * 16, pixels), np.float32)
    padded[:, :channels] = values
    x = np.ascontiguousarray(padded.reshape(images, blocks, 16, pixels).transpose(0, 1, 3, 2)).reshape(-1)
    y = np.full(images * out_blocks * 16 * pixels, -7.0, np.float32)
    blocked_ops.copy_channels_blocked(x, y, images, channels, offset, total, pixels)
    plain = y.reshape(images, out_blocks, pixels, 16).transpose(0, 1, 3, 2).reshape(images, out_blocks * 16, pixels)
    assert np.array_equal(plain[:, offset:offset + channels], values)
    assert (plain[:, :offset] == -7).all()
    written_to = offset + channels if offset % 16 else offset + blocks * 16  # (whole blocks where aligned)
    assert (plain[:, written_to:] == -7).all()
