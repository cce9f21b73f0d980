"""A single-row (1-D) float32 convolution above conv_choice.SMALL_MACS takes the direct tiles on one thread, up to
conv_choice.ROW_MACS multiply-adds (Whisper's first front-end layer, 80 -> 64 channels over 100 frames), where the
packed convolution's pixel tiles span one short row, and on two threads too while the packed convolution would not
split it (under two threads' KNOBS.split_macs); beyond that size the packed convolution keeps it. Results against a
float64 reference either way."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms import conv_choice
from onnx_runtime_ep_cpu.algorithms.window import Geometry
from onnx_runtime_ep_cpu.compiled import host

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the direct tiles need an AVX2 host")


@pytest.fixture(autouse=True)
def _small_bound(monkeypatch):
    """The rules beyond conv_choice.SMALL_MACS, at a bound of 2^20 multiply-adds: layers that size run quickly here."""
    monkeypatch.setattr(conv_choice, "SMALL_MACS", 1 << 20)


def _reference(x, w, b, stride):
    """float64 1-D convolution with one pad each side, by its definition."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1)))
    k = w.shape[2]
    out = (x.shape[2] + 2 - k) // stride + 1
    taps = np.stack([xp[:, :, t: t + (out - 1) * stride + 1: stride] for t in range(k)], axis=2)  # (N, C, K, L)
    return np.einsum("nckl,mck->nml", taps, w.astype(np.float64)) + b.astype(np.float64)[None, :, None]


def _run(cin, cout, length, stride, threads):
    rng = np.random.default_rng(cin + cout + length)
    w = (rng.standard_normal((cout, cin, 3)) / np.sqrt(3 * cin)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    x = rng.standard_normal((1, cin, length)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1], strides=[stride], kernel_shape=[3])
    model = make_model([node], [tensor_info("x", TensorProto.FLOAT, x.shape)], [tensor_info("y", TensorProto.FLOAT)],
                       [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.compile_in_background", "0")  # (the compiled paths from the first run)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    y = session.run(None, {"x": x})[0]
    expected = _reference(x, w, b, stride)
    assert np.abs(y - expected).max() <= 1e-5 * max(1.0, np.abs(expected).max())


@pytest.fixture
def built(built_convs):
    """The convolution classes conv_path builds, by name."""
    return built_convs


@pytest.mark.parametrize("cin,cout,length,stride,taken", [
    (80, 64, 100, 1, "DirectConv"),  # Whisper's first layer: 1.5M multiply-adds
    (80, 128, 100, 1, "DirectConv"),  # 3.1M
    (128, 128, 200, 2, "PackedConv"),  # strided, 4.9M: past ROW_MACS
])
def test_one_thread_single_row_takes_the_direct_tiles(built, cin, cout, length, stride, taken):
    assert cin * 3 * cout * ((length - 1) // stride + 1) > conv_choice.SMALL_MACS
    _run(cin, cout, length, stride, threads=1)
    assert [name for name, _ in built] == [taken]


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="two threads need two usable CPUs")
def test_two_threads_keep_the_one_thread_rule_where_the_packed_convolution_would_not_split(built):
    """Whisper's first layer (1.5M) is under two threads' worth of KNOBS.split_macs: the packed convolution would run
    it on the calling thread alone (conv_choice.packed_threads), so the one-thread rule holds at two threads too."""
    _run(80, 64, 100, 1, threads=2)
    assert [name for name, _ in built] == ["DirectConv"]


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="two threads need two usable CPUs")
def test_two_threads_weigh_the_split_where_the_packed_convolution_would_split(built, knobs):
    knobs(split_macs=1 << 18)  # (the same layer now splits: the cost of that split decides)
    geo = Geometry((1, 100), (1, 3), (1, 1), (1, 1), (0, 1), (0, 1), (1, 100))
    w = np.zeros((64, 80, 1, 3), np.float32)
    expected = "DirectConv" if conv_choice.split_cost_favours_direct(geo, w, 1, 2) else "PackedConv"
    _run(80, 64, 100, 1, threads=2)
    assert [name for name, _ in built] == [expected]


def test_the_packed_convolution_splits_from_split_macs_per_thread(knobs):
    from onnx_runtime_ep_cpu.algorithms.conv_choice import packed_threads

    knobs(threads=2, split_macs=1 << 20)
    assert [packed_threads(m) for m in (1 << 20, (1 << 21) - 1, 1 << 21, 1 << 24)] == [1, 1, 2, 2]
    knobs(threads=1)
    assert packed_threads(1 << 24) == 1


def test_a_two_dimensional_convolution_of_that_size_keeps_the_packed_one(knobs):
    knobs(threads=1)
    square = Geometry((10, 10), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), (10, 10))
    assert not conv_choice.direct_tiles_before_packed(square, np.zeros((64, 24, 3, 3), np.float32))  # 1.4M
    row = Geometry((1, 100), (1, 3), (1, 1), (1, 1), (0, 1), (0, 1), (1, 100))
    assert conv_choice.direct_tiles_before_packed(row, np.zeros((64, 80, 1, 3), np.float32))  # 1.5M


def test_one_thread_gives_the_direct_tiles_the_layers_whose_lanes_they_fill_better(knobs):
    """48 outputs fill three 16-channel direct tiles and one and a half 32-channel packed ones: up to
    LANE_MACS such a layer takes the direct tiles on one thread; 64 outputs, or a map beyond it, the packed one."""
    knobs(threads=1)

    def square(size):
        return Geometry((size, size), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1), (size, size))

    w48, w64 = np.zeros((48, 32, 3, 3), np.float32), np.zeros((64, 32, 3, 3), np.float32)
    assert 32 * 9 * 48 * 28 * 28 > conv_choice.SMALL_MACS  # (10.8M)
    assert conv_choice.direct_tiles_before_packed(square(28), w48)
    assert not conv_choice.direct_tiles_before_packed(square(28), w64)
    assert 32 * 9 * 48 * 112 * 112 > conv_choice.LANE_MACS
    assert not conv_choice.direct_tiles_before_packed(square(112), w48)
