"""Convolutions that write their channels of a Concat (conv_fusions.fuse_concat_convs: a SqueezeNet fire module's
expansions) run inside a CNN segment: its plan writes each part's channels into the concatenation's buffer
through conv_blocked's image stride, no copy: into the blocked concatenation where every part starts at a block
of 16 channels (and all but the last fill whole blocks), else into the plain one. The whole network is one
segment whose outputs stay within float32 rounding of a float64 reference, also split into image ranges on two
threads."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_helpers import bound_plan
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import host
from onnx_runtime_ep_cpu.tuning import override
from reference64 import run_float64
from test_segment_fusion import _segment_and_feeds
from test_segment_split import _close, _fed, _planned, split_run_matches_float64

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the chained loops (direct tiles) need AVX2")


def _fire_model(first: int = 16, second: int = 24) -> onnx.ModelProto:
    """stem conv -> squeeze 1x1 -> [expand 1x1 (``first`` channels), expand 3x3 (``second``)] -> Concat -> conv ->
    pool."""
    rng = np.random.default_rng(5)

    def weights(name, shape, scale):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [weights("w0", (12, 3, 3, 3), 0.3), weights("b0", (12,), 0.1),
             weights("ws", (8, 12, 1, 1), 0.3), weights("bs", (8,), 0.1),
             weights("we1", (first, 8, 1, 1), 0.4), weights("be1", (first,), 0.1),
             weights("we3", (second, 8, 3, 3), 0.15), weights("be3", (second,), 0.1),
             weights("w5", (20, 40, 3, 3), 0.06), weights("b5", (20,), 0.1)]
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], kernel_shape=[3, 3], pads=[1] * 4, strides=[2, 2]),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Conv", ["r0", "ws", "bs"], ["cs"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["cs"], ["rs"]),
             helper.make_node("Conv", ["rs", "we1", "be1"], ["ce1"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["ce1"], ["re1"]),
             helper.make_node("Conv", ["rs", "we3", "be3"], ["ce3"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["ce3"], ["re3"]),
             helper.make_node("Concat", ["re1", "re3"], ["cat"], axis=1),
             helper.make_node("Conv", ["cat", "w5", "b5"], ["c5"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c5"], ["r5"]),
             helper.make_node("GlobalAveragePool", ["r5"], ["y"])]
    graph = helper.make_graph(nodes, "fire", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            ["batch", 3, 20, 20])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _names(plan) -> list[str]:
    return [getattr(f, "__name__", "") for f, _ in plan._steps]  # noqa: SLF001


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("first", "second", "blocked"), [(16, 24, True), (24, 16, False)])
def test_fire_module_parts_write_the_concatenation_within_rounding_of_float64(batch, first, second, blocked):
    """16 + 24 channels: the parts write the blocked concatenation (48 stored channels a pixel); 24 + 16: the
    second part would start inside a block, so the plain one (40 channels)."""
    model = _fire_model(first, second)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 20, 20)).astype(np.float32)
    with override(threads=1):
        segment, feeds = _segment_and_feeds(model, x)  # (the whole graph: one segment)
        parts = [inner.node for inner in segment.inner if inner.node.attr("concat_channels") is not None]
        assert [(n.attr("concat_channels"), n.attr("concat_offset")) for n in parts] == [(40, 0), (40, first)]
        plan = bound_plan(_planned(segment, feeds))
        names = _names(plan)
        assert "copyto" not in names and "concatenate" not in names
        assert plan.describe()["kernels"] == 0
        rows = [a for f, a in plan._steps if getattr(f, "__name__", "") == "conv_blocked"]  # noqa: SLF001
        # the parts' (y_blocked, y_image), by their output channels (no other convolution has 16 or 24): the
        # concatenation's image stride over 10 x 10 pixels, or 0 for one image's plain channels (contiguous)
        writes = [(bool(a[-2]), int(a[-1])) for a in rows if a[-5] in (first, second)]
        if blocked:
            assert writes == [(True, 48 * 100)] * 2
        else:
            assert writes == [(False, 40 * 100 if batch > 1 else 0)] * 2
        for scale in (1.0, 3.0):
            x = (rng.standard_normal(x.shape) * scale).astype(np.float32)
            (got,) = segment(*_fed(feeds, x))
            (exact,) = run_float64(model, {"x": x})
            _close(got, exact)


def test_fire_module_batch_splits_into_image_ranges_on_two_threads():
    split_run_matches_float64(_fire_model(), (5, 3, 20, 20), 4, [2, 3])


def _dense_model() -> onnx.ModelProto:
    """stem conv, then three pre-activation dense layers (BatchNormalization -> Relu -> 3x3 conv, 4 channels
    concatenated behind the features so far), then a pool: DenseNet's block at a size a segment takes."""
    rng = np.random.default_rng(6)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w0")]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["f0"], kernel_shape=[3, 3], pads=[1] * 4)]
    channels = 8
    for k in range(3):
        for name, value in (("scale", rng.uniform(0.5, 1.5, channels)), ("shift", rng.standard_normal(channels) * 0.1),
                            ("mean", rng.standard_normal(channels) * 0.1), ("var", rng.uniform(0.5, 1.5, channels))):
            inits.append(numpy_helper.from_array(value.astype(np.float32), f"{name}{k}"))
        inits.append(numpy_helper.from_array((rng.standard_normal((4, channels, 3, 3)) * 0.2).astype(np.float32),
                                             f"w{k + 1}"))
        nodes += [helper.make_node("BatchNormalization", [f"f{k}", f"scale{k}", f"shift{k}", f"mean{k}", f"var{k}"],
                                   [f"n{k}"]),
                  helper.make_node("Relu", [f"n{k}"], [f"r{k}"]),
                  helper.make_node("Conv", [f"r{k}", f"w{k + 1}"], [f"g{k}"], kernel_shape=[3, 3], pads=[1] * 4),
                  helper.make_node("Concat", [f"f{k}", f"g{k}"], [f"f{k + 1}"], axis=1)]
        channels += 4
    nodes.append(helper.make_node("GlobalAveragePool", ["f3"], ["y"]))
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             ["batch", 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("batch", [1, 3])
def test_dense_layers_concatenate_and_normalize_as_bound_steps(batch):
    """A segment takes DenseNet's growing concatenations at this size (conv_fusions leaves them to it): each Concat
    one call into its buffer, each batch normalization (with its Relu) one compiled pass, no node's kernel."""
    model = _dense_model()
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 12, 12)).astype(np.float32)
    with override(threads=1):
        segment, feeds = _segment_and_feeds(model, x)
        plan = bound_plan(_planned(segment, feeds))
        names = _names(plan)
        assert names.count("channel_affine") == 3 and plan.describe()["kernels"] == 0
        for scale in (1.0, 3.0):
            x = (rng.standard_normal(x.shape) * scale).astype(np.float32)
            (got,) = segment(*_fed(feeds, x))
            (exact,) = run_float64(model, {"x": x})
            _close(got, exact)
