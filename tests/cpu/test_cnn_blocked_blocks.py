"""A light CNN's blocks over channel-blocked values (algorithms/segment_layout.py, compiled/blocked_ops.py):
depthwise convolutions, squeeze-excitation blocks, max and average pools and the closing global average pool read
and write (N, C/16, H, W, 16) so that a block stays blocked end to end. Checked against a float64 reference and
onnxruntime over channel counts that are not multiples of 16, stride 2, padding, dilation, ceil_mode, the
activations a depthwise convolution carries, both gates, and batches of 1 and 3."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_helpers import bound_plan
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import blocked_ops, deferred, host
from reference64 import run_float64
from test_segment_fusion import _segment_and_feeds, segment_matches_references

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the direct tiles need AVX2")

_OUTPUTS = ["pool", "tail"]


def _block_model(gate: str = "HardSigmoid", size: int = 19) -> onnx.ModelProto:
    rng = np.random.default_rng(23)
    inits, nodes = [], []

    def conv(x, y, cin, cout, k, stride=1, pad=None, group=1, dilation=1):
        w = (rng.standard_normal((cout, cin // group, k, k)) / np.sqrt(cin // group * k * k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"{y}_w"))
        inits.append(numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{y}_b"))
        pad = k // 2 * dilation if pad is None else pad
        nodes.append(helper.make_node("Conv", [x, f"{y}_w", f"{y}_b"], [y], kernel_shape=[k, k], strides=[stride] * 2,
                                      pads=[pad] * 4, group=group, dilations=[dilation] * 2))

    conv("x", "c1", 3, 20, 3, stride=2)  # the stem: plain feed -> blocked, 20 channels
    nodes.append(helper.make_node("HardSwish", ["c1"], ["a1"]))
    conv("a1", "d1", 20, 20, 3, stride=2, group=20)  # depthwise, stride 2, padded, then Relu
    nodes.append(helper.make_node("Relu", ["d1"], ["r1"]))
    nodes.append(helper.make_node("GlobalAveragePool", ["r1"], ["s1"]))  # squeeze-excitation
    conv("s1", "s2", 20, 8, 1)
    nodes.append(helper.make_node("Relu", ["s2"], ["s3"]))
    conv("s3", "s4", 8, 20, 1)
    nodes.append(helper.make_node(gate, ["s4"], ["s5"]))
    nodes.append(helper.make_node("Mul", ["r1", "s5"], ["e1"]))
    conv("e1", "p1", 20, 24, 1)  # projection
    conv("p1", "x2", 24, 40, 1)  # expansion
    nodes.append(helper.make_node("HardSwish", ["x2"], ["a2"]))
    conv("a2", "d2", 40, 40, 5, group=40)  # depthwise 5x5, stride 1, HardSwish
    nodes.append(helper.make_node("HardSwish", ["d2"], ["a3"]))
    conv("a3", "p2", 40, 24, 1)
    nodes.append(helper.make_node("Add", ["p2", "p1"], ["res"]))  # the residual, blocked on both sides
    conv("res", "x3", 24, 33, 1)
    nodes.append(helper.make_node("MaxPool", ["x3"], ["m1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                                  ceil_mode=1))
    conv("m1", "d3", 33, 33, 3, group=33, dilation=2)  # dilated depthwise without activation
    conv("d3", "tail", 33, 17, 1)
    nodes.append(helper.make_node("GlobalAveragePool", ["tail"], ["pool"]))
    graph = helper.make_graph(nodes, "blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                              ["batch", 3, size, size])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in _OUTPUTS],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _called(plan) -> list[str]:
    return [getattr(f, "__name__", "") for f, _ in plan._steps]  # noqa: SLF001


@pytest.mark.parametrize("batch, gate", [(1, "HardSigmoid"), (3, "Sigmoid")])
def test_blocked_blocks_match_float64_and_onnxruntime(batch, gate):
    model = _block_model(gate)
    deferred.wait_ready(240)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 19, 19)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    plan = bound_plan(plan)
    called = _called(plan)
    assert called.count("depthwise_blocked") == 3
    assert called.count("squeeze_excite_blocked") == 1 and called.count("max_pool_blocked") == 1
    assert "plane_means_blocked" not in called  # "tail" is an output: plain, and so is its pool's input
    segment_matches_references(model, segment, feeds, x.shape, rng, runs=3)


@pytest.mark.parametrize("op", ["GlobalAveragePool", "ReduceMean"])
def test_closing_pool_reads_blocked(op):
    """A mean over the planes (GlobalAveragePool, or the dynamo exporter's ReduceMean over axes 2 and 3) whose
    input only it reads takes it blocked (plain out), in plane_means's order."""
    model = _block_model()
    graph = model.graph
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("pool", TensorProto.FLOAT, None))
    if op == "ReduceMean":
        (at,) = [i for i, n in enumerate(graph.node) if n.output[0] == "pool"]
        graph.node[at].CopyFrom(helper.make_node("ReduceMean", ["tail"], ["pool"], axes=[2, 3], keepdims=0))
    deferred.wait_ready(240)
    x = np.random.default_rng(7).standard_normal((2, 3, 19, 19)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    plan = bound_plan(plan)
    assert "plane_means_blocked" in _called(plan)
    (got,) = segment(*feeds)
    (wide,) = run_float64(model, {"x": x})
    assert np.abs(got - wide).max() <= 2e-5 * (1 + np.abs(wide).max())


@pytest.mark.parametrize("channels, size, kernel, stride, pad, dilation, ceil",
                         [(5, 9, 3, 2, 1, 1, 0), (16, 7, 3, 1, 1, 1, 0), (21, 10, 2, 2, 0, 1, 1),
                          (33, 3, 3, 1, 1, 2, 0), (18, 2, 3, 2, 1, 1, 1), (24, 12, 2, 2, 0, 1, 0)])
def test_blocked_loops_match_float64(channels, size, kernel, stride, pad, dilation, ceil):
    """The loops alone against float64 sums over the blocked layout (narrow rows under a tile, padding past a
    whole window, ceil_mode's overhang), padded lanes never read; averages with and without count_include_pad
    (an overhang never counted)."""
    deferred.wait_ready(240)
    rng = np.random.default_rng(channels)
    batch = 2
    x = rng.standard_normal((batch, channels, size, size)).astype(np.float32)
    blocks = -(-channels // 16)
    extent = dilation * (kernel - 1) + 1
    out = (size + 2 * pad - extent + (stride - 1 if ceil else 0)) // stride + 1
    flat = np.full(batch * blocks * 16 * size * size, np.nan, np.float32)
    blocked = flat.reshape(batch, blocks, 16, size, size)
    padded_x = np.concatenate([x, np.zeros((batch, blocks * 16 - channels, size, size), np.float32)], axis=1)
    blocked[...] = padded_x.reshape(batch, blocks, 16, size, size)
    flat = np.ascontiguousarray(blocked.transpose(0, 1, 3, 4, 2)).reshape(-1)
    rows, columns, scratch = blocked_ops.padded_size(size, size, out, out, stride, stride, pad, pad, kernel, kernel,
                                                     dilation, dilation)
    taps = blocked_ops.depthwise_taps(kernel, kernel, dilation, dilation, columns)
    w = rng.standard_normal((channels, 1, kernel, kernel)).astype(np.float32)
    b = rng.standard_normal(channels).astype(np.float32)
    weights, bias = blocked_ops.pack_depthwise(w, b, channels)
    for kind in ("depthwise", "max", "mean", "mean_pads"):
        y = np.full(batch * blocks * 16 * out * out, np.nan, np.float32)
        tile = np.zeros(blocked_ops.PIXELS * 16, np.float32)
        if kind == "depthwise":
            blocked_ops.depthwise_blocked(flat, weights, taps, bias, np.array([-np.inf, np.inf, 1], np.float32), 0, y,
                                          batch, blocks, size, size, out, out, stride, stride, pad, pad,
                                          np.zeros(scratch, np.float32), rows, columns, tile)
        elif kind == "max":
            blocked_ops.max_pool_blocked(flat, taps, y, batch, blocks, size, size, out, out, stride, stride, pad, pad,
                                         np.full(scratch, -np.inf, np.float32), rows, columns, tile)
        else:
            counted = (0, 2 * pad + size) if kind == "mean_pads" else (pad, pad + size)
            scale = blocked_ops.mean_scale(out, out, kernel, kernel, stride, stride, dilation, dilation, counted,
                                           counted)
            blocked_ops.average_pool_blocked(flat, taps, scale, y, batch, blocks, size, size, out, out, stride, stride,
                                             pad, pad, np.zeros(scratch, np.float32), rows, columns, tile)
        got = y.reshape(batch, blocks, out, out, 16).transpose(0, 1, 4, 2, 3).reshape(batch, blocks * 16, out, out)
        got = got[:, :channels]
        margin = (pad, pad + 2 * stride + extent)
        wide = np.pad(x.astype(np.float64), ((0, 0), (0, 0), margin, margin),
                      constant_values=-np.inf if kind == "max" else 0)
        expected = np.full((batch, channels, out, out), -np.inf if kind == "max" else 0.0)
        count = np.zeros((out, out))
        for i in range(kernel):
            for j in range(kernel):
                window = wide[:, :, i * dilation:i * dilation + stride * out:stride,
                              j * dilation:j * dilation + stride * out:stride]
                if kind == "depthwise":
                    expected += window * w[:, 0, i, j].astype(np.float64)[None, :, None, None]
                elif kind == "max":
                    expected = np.maximum(expected, window)
                else:
                    expected += window
                    lo, hi = (0, 2 * pad + size) if kind == "mean_pads" else (pad, pad + size)
                    rows_at = np.arange(out) * stride + i * dilation
                    columns_at = np.arange(out) * stride + j * dilation
                    count += np.outer((rows_at >= lo) & (rows_at < hi), (columns_at >= lo) & (columns_at < hi))
        if kind == "depthwise":
            expected += b.astype(np.float64)[None, :, None, None]
        elif kind != "max":
            assert count.min() > 0
            expected /= count
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * (1 + np.abs(expected).max()))


def _silu_model(size: int = 15) -> onnx.ModelProto:
    """EfficientNet's spelling: SiLU as Sigmoid and Mul nodes (fuse_silu's Swish) around a depthwise convolution."""
    rng = np.random.default_rng(31)
    inits, nodes = [], []

    def conv(x, y, cin, cout, k, stride=1, group=1):
        w = (rng.standard_normal((cout, cin // group, k, k)) / np.sqrt(cin // group * k * k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"{y}_w"))
        nodes.append(helper.make_node("Conv", [x, f"{y}_w"], [y], kernel_shape=[k, k], strides=[stride] * 2,
                                      pads=[k // 2] * 4, group=group))

    def silu(x, y):
        nodes.append(helper.make_node("Sigmoid", [x], [f"{y}_gate"]))
        nodes.append(helper.make_node("Mul", [x, f"{y}_gate"], [y]))

    conv("x", "c1", 3, 20, 3, stride=2)
    silu("c1", "a1")
    conv("a1", "d1", 20, 20, 3, group=20)
    silu("d1", "a2")
    conv("a2", "c2", 20, 24, 1)
    conv("c2", "tail", 24, 24, 3)
    nodes.append(helper.make_node("GlobalAveragePool", ["tail"], ["pool"]))
    graph = helper.make_graph(nodes, "silu", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            ["batch", 3, size, size])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in _OUTPUTS],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_activation_nodes_run_over_blocked_buffers():
    model = _silu_model()
    deferred.wait_ready(240)
    x = np.random.default_rng(9).standard_normal((2, 3, 15, 15)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    plan = bound_plan(plan)
    swish = [a for f, a in plan._steps if getattr(f, "__name__", "") == "swish_float32_into"]  # noqa: SLF001
    images = plan.feeds[0][1].shape[0]  # (the batch, or the images of a range where it is split across threads)
    assert len(swish) == 2 and all(a[0].size == images * 32 * 8 * 8 for a in swish)  # 20 channels stored as 32
    assert _called(plan).count("depthwise_blocked") == 1
    got = dict(zip(segment.output_names, segment(*feeds)))
    for name, wide in zip(_OUTPUTS, run_float64(model, {"x": x})):
        assert np.abs(got[name] - wide).max() <= 2e-5 * (1 + np.abs(wide).max()), name


def _average_model(include_pad: int) -> onnx.ModelProto:
    """Convolutions around two average pools (3x3 stride 1 padded, as an Inception branch; 3x3 stride 2 with
    ceil_mode's overhang) over channel counts that are not multiples of 16."""
    rng = np.random.default_rng(31)
    inits, nodes = [], []

    def conv(x, y, cin, cout, k, stride=1):
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"{y}_w"))
        inits.append(numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{y}_b"))
        nodes.append(helper.make_node("Conv", [x, f"{y}_w", f"{y}_b"], [y], kernel_shape=[k, k], strides=[stride] * 2,
                                      pads=[k // 2] * 4))

    conv("x", "c1", 3, 20, 3, stride=2)
    nodes.append(helper.make_node("Relu", ["c1"], ["r1"]))
    nodes.append(helper.make_node("AveragePool", ["r1"], ["a1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                                  count_include_pad=include_pad))
    conv("a1", "c2", 20, 24, 1)
    nodes.append(helper.make_node("AveragePool", ["c2"], ["a2"], kernel_shape=[3, 3], strides=[2, 2],
                                  pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=include_pad))
    conv("a2", "tail", 24, 17, 3)
    nodes.append(helper.make_node("GlobalAveragePool", ["tail"], ["pool"]))
    graph = helper.make_graph(nodes, "averages", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                ["batch", 3, 22, 22])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in _OUTPUTS],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize("batch, include_pad", [(1, 0), (3, 1)])
def test_blocked_average_pools_match_float64_and_onnxruntime(batch, include_pad):
    """Average pools between direct convolutions run blocked (as an Inception block's pool branch), their
    windows' tap counts with and without count_include_pad."""
    model = _average_model(include_pad)
    deferred.wait_ready(240)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 22, 22)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    ((plan,),) = segment.plans.values()
    called = _called(bound_plan(plan))
    assert called.count("average_pool_blocked") == 2 and "pool_2d" not in called
    segment_matches_references(model, segment, feeds, x.shape, rng)
