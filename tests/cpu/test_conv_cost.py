"""On two threads a convolution above conv_choice.SMALL_MACS takes the direct tiles on the calling thread where
they cost less than the packed convolution split across the threads (conv_choice.split_cost_favours_direct): a
stem of 3 channels into 16 or 32 (resnet's 7x7/2, whose packed panels gather every strided window and whose
split ran 1.4-1.7x slower than the direct tiles); wider, deeper layers keep the split packed convolution.
Results against a float64 reference (and the zoo's resnet against onnxruntime) either way."""

from __future__ import annotations

import os

import numpy as np
import onnx_runtime as ort
import pytest
from conftest import ZOO
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms import conv_choice, conv_packed_layout
from onnx_runtime_ep_cpu.algorithms.window import Geometry
from onnx_runtime_ep_cpu.compiled import host

pytestmark = [pytest.mark.skipif(not host.AVX512, reason="the packed convolution needs an AVX-512 host"),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two threads need two usable CPUs")]


@pytest.fixture(autouse=True)
def _small_bound(monkeypatch):
    """The rules beyond conv_choice.SMALL_MACS, at a bound of 2^20 multiply-adds: layers that size run quickly here."""
    monkeypatch.setattr(conv_choice, "SMALL_MACS", 1 << 20)


def _reference(x, w, b, stride, pad):
    """float64 2-D convolution by its definition, then Relu."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    k, out = w.shape[2], (x.shape[2] + 2 * pad - w.shape[2]) // stride + 1
    taps = np.stack([xp[:, :, i: i + (out - 1) * stride + 1: stride, j: j + (out - 1) * stride + 1: stride]
                     for i in range(k) for j in range(k)], axis=2)  # (N, C, K*K, out, out)
    y = np.einsum("ncthw,mct->nmhw", taps, w.astype(np.float64).reshape(*w.shape[:2], -1))
    return np.maximum(y + b.astype(np.float64)[None, :, None, None], 0)


def _session(model, threads):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.compile_in_background", "0")  # (the compiled paths from the first run)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _run(cin, cout, k, stride, size, threads):
    rng = np.random.default_rng(cin + cout + size)
    w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    x = rng.standard_normal((1, cin, size, size)).astype(np.float32)
    pad = k // 2
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[pad] * 4, strides=[stride] * 2,
                              kernel_shape=[k, k]), helper.make_node("Relu", ["c"], ["y"])]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, x.shape)], [tensor_info("y", TensorProto.FLOAT)],
                       [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    y = _session(model.SerializeToString(), threads).run(None, {"x": x})[0]
    expected = _reference(x, w, b, stride, pad)
    assert np.abs(y - expected).max() <= 1e-5 * max(1.0, np.abs(expected).max())


@pytest.fixture
def built(built_convs):
    return built_convs


@pytest.mark.parametrize("cin,cout,k,stride,size,taken", [
    (3, 16, 7, 2, 64, "DirectConv"),  # resnet's stem: 2.4M multiply-adds
    (3, 16, 3, 2, 128, "DirectConv"),  # 1.8M, depth 27
    (3, 32, 7, 2, 64, "DirectConv"),  # 4.8M: the packed convolution's panels gather each strided window
    (32, 64, 3, 1, 32, "PackedConv"),  # 18.9M
    (128, 128, 3, 1, 14, "PackedConv"),  # 28.9M
])
def test_two_threads_weigh_the_split(built, cin, cout, k, stride, size, taken):
    assert cin * k * k * cout * ((size + 2 * (k // 2) - k) // stride + 1) ** 2 > conv_choice.SMALL_MACS
    _run(cin, cout, k, stride, size, threads=2)
    assert [name for name, _ in built] == [taken]


def test_one_thread_keeps_its_rules(built):
    _run(32, 32, 3, 1, 28, threads=1)  # 7.2M, no stem, both fill their lanes: the packed convolution
    _run(16, 32, 3, 1, 32, threads=1)  # 4.7M, shallow: the packed lanes' share 1/1.31 (conv_choice.LANE_MACS)
    assert [name for name, _ in built] == ["PackedConv", "DirectConv"]


def test_more_threads_split_sooner():
    geo = Geometry((64, 64), (7, 7), (2, 2), (1, 1), (3, 3), (3, 3), (32, 32))
    w = np.zeros((32, 3, 7, 7), np.float32)  # 4.8M: close on two threads, split on eight
    assert conv_choice.split_cost_favours_direct(geo, w, 1, 2)
    assert not conv_choice.split_cost_favours_direct(geo, w, 1, 8)


def test_mirrored_tile_shapes_match_the_kernels():
    from onnx_runtime_ep_cpu.compiled import directconv, gemm, lanes

    assert (conv_packed_layout.LANE_CHANNELS, conv_packed_layout.LANE_PIXELS) == (lanes.CHANNELS, lanes.PIXELS)
    assert conv_packed_layout.PANEL_PIXELS == gemm.NR and conv_choice.TILE_PIXELS == directconv.PIXELS
    assert conv_choice.CHANNELS_PER_TILE == directconv.CHANNELS
    assert all(conv_packed_layout.lane_tile(width) == lanes.shape(width) for width in range(1, 64))
    assert all(conv_packed_layout.panel_rows(m) == gemm.tile_rows(m) for m in range(1, 1025))


def test_zoo_resnet_stem_on_the_direct_tiles_at_two_threads(built):
    import onnxruntime

    path = ZOO / "resnet.torchscript.fp32.onnx"
    if not path.exists():
        pytest.skip("the model zoo is not built: run scripts/build_zoo.sh")
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    ours = _session(str(path), 2)
    name = ours.get_inputs()[0].name
    y = ours.run(None, {name: x})[0]
    assert ("DirectConv", (16, 3, 7, 7)) in built  # the stem
    expected = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {name: x})[0]
    assert np.abs(y - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())


def test_a_segments_one_image_weighs_the_direct_tiles_as_on_one_thread():
    """Inside a segment (conv_choice.SEGMENT_NODES, set while its nodes run one by one) one image's direct tiles
    share their rows with the helpers as the packed convolution splits (compiled/conv_chain.run_chain_split), so at
    two threads the one-thread lane rule takes 32 -> 48 on 28x28 (three full 16-channel tiles, one and a half
    32-channel ones) where, outside a segment or for a batch, the split packed convolution wins."""
    from onnx_runtime_ep_cpu.tuning import override

    geo = Geometry((28, 28), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), (28, 28))
    w = np.zeros((48, 32, 3, 3), np.float32)
    with override(threads=2):
        assert conv_choice.packed_threads(w.size * 28 * 28) == 2
        assert not conv_choice.direct_tiles_before_packed(geo, w)
        token = conv_choice.SEGMENT_NODES.set(True)
        try:
            assert conv_choice.direct_tiles_before_packed(geo, w)
            assert not conv_choice.direct_tiles_before_packed(geo, w, images=2)
            wide = np.zeros((64, 32, 3, 3), np.float32)  # two full 32-channel tiles: the packed lanes as full
            assert not conv_choice.direct_tiles_before_packed(geo, wide)
        finally:
            conv_choice.SEGMENT_NODES.reset(token)
