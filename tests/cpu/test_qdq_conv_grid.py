"""A QDQ Conv group's 2-D convolution read in place from a grid of channel quads (ops/qdq_linear.quantized_conv
through compiled/quantized_conv_grid: no patches, the lanes past a row's end dropped by compress stores): the same
codes, bit for bit, as the exact float convolution of the centred codes it replaces (strides and their phase planes,
dilations, uneven pads, channel counts off whole quads, positions past one block, output channels past a tile, two
images, both 8-bit types, per-tensor and per-channel weights, float32 data quantized in the call or codes in, codes
or dequantized values out, with and without a bias), the same bits across threads; taken where every weight zero
point is 0 and the requantization is finite, quantized_conv_blocks' patches elsewhere (a NaN bias's code 0) and, where
the host has AMX, for the deep and wide convolutions its tile groups run faster."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu import tuning
from onnx_runtime_ep_cpu.compiled import deferred, qgemm_quads, quantized_conv_blocks, quantized_conv_grid
from onnx_runtime_ep_cpu.ops import qdq_linear
from test_qdq_conv_blocks import _float_path, _node, split_runs_match
from test_qdq_conv_rows import _inputs

pytestmark = pytest.mark.skipif(not qgemm_quads.AVAILABLE, reason="the grid runs on AVX-512 VNNI")

CASES = [  # (x shape, w shape, attributes)
    ((2, 5, 11, 13), (7, 5, 3, 3), {"pads": [1, 1, 1, 1]}),  # a partial quad, two images, rows past one block
    ((1, 8, 9, 9), (20, 8, 3, 3), {"pads": [1, 0, 1, 2], "strides": [2, 1]}),  # row phases, a channel tail
    ((1, 12, 10, 10), (9, 12, 1, 1), {}),  # 1x1 without pads: a plane's rows as one run
    ((1, 4, 12, 12), (6, 4, 3, 2), {"pads": [2, 1, 0, 1], "dilations": [2, 3]}),
    ((1, 3, 20, 20), (17, 3, 7, 7), {"pads": [3, 3, 3, 3], "strides": [2, 2]}),  # a stem: four phase planes
    ((1, 16, 15, 14), (33, 16, 3, 3), {"pads": [0, 2, 1, 0], "strides": [3, 2], "dilations": [2, 1]}),
    ((1, 64, 7, 7), (36, 64, 1, 1), {"strides": [2, 2]}),  # a downsampling shortcut
]


@pytest.fixture(autouse=True)
def _compiled_now(monkeypatch):
    monkeypatch.setattr(deferred.state, "disabled", True)
    monkeypatch.setattr(deferred.state, "deferring", False)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("act", [np.uint8, np.int8])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("quantize_a", [False, True])
@pytest.mark.parametrize("dequantize", [False, True])
def test_the_grid_gives_the_float_paths_codes(monkeypatch, case, act, per_channel, quantize_a, dequantize):
    x_shape, w_shape, attrs = CASES[case]
    rng = np.random.default_rng(case)
    inputs = _inputs(rng, x_shape, w_shape, act, per_channel, quantize_a, case % 2 == 0, zero_points=False)
    for v in inputs[1:]:
        v.flags.writeable = False  # constants, as a session's initializers are
    node = _node(attrs, len(inputs), quantize_a, dequantize)
    calls = []
    compiled = quantized_conv_grid.quantized_conv_grid
    monkeypatch.setattr(quantized_conv_grid, "quantized_conv_grid", lambda *a: calls.append(1) or compiled(*a))
    grid = qdq_linear.quantized_conv(node, [], 1)
    with tuning.override(threads=1):
        got = [grid(*inputs)[0] for _ in range(2)]  # the second call reuses the weight's rows
    assert len(calls) == 2
    want = _float_path(monkeypatch, node, inputs)
    assert got[0].dtype == want.dtype == (np.float32 if dequantize else act) and got[0].shape == want.shape
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(got[1], want)


@pytest.mark.parametrize("act", [np.uint8, np.int8])
@pytest.mark.parametrize("quantize_a", [False, True])
@pytest.mark.parametrize("dequantize", [False, True])
def test_a_kept_call_reads_each_calls_own_input(monkeypatch, act, quantize_a, dequantize):
    # A call on the calling thread is kept for its repeats (the same X shape and type, the same constant arrays):
    # a repeat with new data, another shape and then the first again each give their own float path's codes, and
    # every repeat runs the grid (nothing left over from the call kept before).
    _, w_shape, attrs = CASES[0]
    rng = np.random.default_rng(17)
    inputs = _inputs(rng, (1, 5, 11, 13), w_shape, act, True, quantize_a, True, zero_points=False)
    for v in inputs[1:]:
        v.flags.writeable = False
    node = _node(attrs, len(inputs), quantize_a, dequantize)
    calls = []
    compiled = quantized_conv_grid.quantized_conv_grid
    monkeypatch.setattr(quantized_conv_grid, "quantized_conv_grid", lambda *a: calls.append(1) or compiled(*a))
    prepared = []  # the calls that prepared their arguments (not a kept call's repeat)
    conv_grid = qdq_linear._conv_grid  # noqa: SLF001  (the real call, wrapped to count the prepared ones)
    monkeypatch.setattr(qdq_linear, "_conv_grid", lambda *a: prepared.append(1) or conv_grid(*a))
    grid = qdq_linear.quantized_conv(node, [], 1)
    feeds = [_inputs(np.random.default_rng(seed), shape, w_shape, act, True, quantize_a, True)[0]
             for seed, shape in ((1, (1, 5, 11, 13)), (2, (1, 5, 11, 13)), (3, (2, 5, 9, 16)), (4, (1, 5, 11, 13)))]
    with tuning.override(threads=1):
        for k, x in enumerate(feeds):
            got = grid(x, *inputs[1:])[0]
            want = _float_path(monkeypatch, node, [x, *inputs[1:]])
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
            assert len(calls) == k + 1
    assert len(prepared) == 3  # the second call repeats the first's; the fourth follows another shape


@pytest.mark.parametrize("quantize_a", [False, True])
def test_a_kept_split_call_splits_each_repeat(monkeypatch, quantize_a):
    # A call split across the helpers is kept for its repeats too: each repeat posts its split again with its own
    # input (the float path's codes), and looks the thread count up, so a repeat on one thread runs the loop alone.
    from onnx_runtime_ep_cpu.compiled import dynamic_conv_jobs

    _, w_shape, attrs = CASES[0]
    inputs = _inputs(np.random.default_rng(19), (1, 5, 11, 13), w_shape, np.uint8, True, quantize_a, True,
                     zero_points=False)
    for v in inputs[1:]:
        v.flags.writeable = False
    node = _node(attrs, len(inputs), quantize_a, False)
    splits, alone, prepared = [], [], []
    real_split, real_loop = dynamic_conv_jobs.split_quantized_grid, quantized_conv_grid.quantized_conv_grid
    monkeypatch.setattr(dynamic_conv_jobs, "split_quantized_grid", lambda *a: splits.append(1) or real_split(*a))
    monkeypatch.setattr(quantized_conv_grid, "quantized_conv_grid", lambda *a: alone.append(1) or real_loop(*a))
    conv_grid = qdq_linear._conv_grid  # noqa: SLF001  (the real call, wrapped to count the prepared ones)
    monkeypatch.setattr(qdq_linear, "_conv_grid", lambda *a: prepared.append(1) or conv_grid(*a))
    grid = qdq_linear.quantized_conv(node, [], 1)
    for k, (seed, threads) in enumerate(((1, 2), (2, 2), (3, 2), (4, 1))):
        x = _inputs(np.random.default_rng(seed), (1, 5, 11, 13), w_shape, np.uint8, True, quantize_a, True)[0]
        with tuning.override(threads=threads, split_macs=1):
            got = grid(x, *inputs[1:])[0]
        np.testing.assert_array_equal(got, _float_path(monkeypatch, node, [x, *inputs[1:]]))
        assert (len(splits), len(alone)) == ((k + 1, 0) if threads == 2 else (3, 1))
    assert len(prepared) == 1  # every repeat the first call's, split or not


@pytest.mark.parametrize("nan_bias", [False, True])
def test_a_weight_zero_point_or_a_nan_bias_takes_the_patches(monkeypatch, nan_bias):
    # (a NaN bias's code 0 is the patches' epilogue's; the grid's rounds without a NaN check)
    x_shape, w_shape, attrs = CASES[0]
    inputs = _inputs(np.random.default_rng(5), x_shape, w_shape, np.uint8, True, False, True,
                     zero_points=not nan_bias)
    if nan_bias:
        inputs[-1][2] = np.nan
    else:
        assert np.any(inputs[5] != 0)
    calls = []
    compiled = quantized_conv_blocks.quantized_conv_blocks
    monkeypatch.setattr(quantized_conv_blocks, "quantized_conv_blocks", lambda *a: calls.append(1) or compiled(*a))
    monkeypatch.setattr(quantized_conv_grid, "quantized_conv_grid", lambda *a: pytest.fail("the grid ran"))
    for dequantize in (False, True):
        node = _node(attrs, len(inputs), False, dequantize)
        with tuning.override(threads=1):
            got = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
        assert calls == [1] * (1 + dequantize)
        np.testing.assert_array_equal(got, _float_path(monkeypatch, node, inputs))
        if nan_bias:
            assert (got[:, 2] == (np.float32(-130 * 0.05) if dequantize else 0)).all()


@pytest.mark.parametrize("case", [0, 1, 4, 5])
@pytest.mark.parametrize("quantize_a", [False, True])
def test_threads_share_the_call_with_the_same_bits(monkeypatch, case, quantize_a):
    # The phases (the grid's codes, the products) as tasks the calling thread and the helpers claim, split even
    # where small (split_macs 1), over more parts than threads: the one-thread call's bits.
    x_shape, w_shape, attrs = CASES[case]
    inputs = _inputs(np.random.default_rng(11), x_shape, w_shape, np.uint8, True, quantize_a, True,
                     zero_points=False)
    split_runs_match(monkeypatch, _node(attrs, len(inputs), quantize_a, False), inputs, "split_quantized_grid")


def test_grid_tables_place_each_position_once():
    # Every output position of the phase grid is stored exactly once, at its place in the plane, whatever the
    # geometry: the vectors' starts and lane masks against a direct enumeration.
    x = np.zeros((0, 0, 0, 0), np.float32)
    for shape, (kh, kw, sh, sw, dh, dw, top, bottom, left, right) in [
            ((1, 5, 11, 13), (3, 3, 1, 1, 1, 1, 1, 1, 1, 1)), ((1, 3, 20, 19), (7, 7, 2, 2, 1, 1, 3, 3, 3, 3)),
            ((1, 8, 7, 7), (1, 1, 2, 2, 1, 1, 0, 0, 0, 0)), ((1, 4, 12, 12), (3, 2, 3, 2, 2, 3, 2, 0, 1, 1))]:
        codes = np.zeros(shape, np.uint8)
        oh = (shape[2] + top + bottom - dh * (kh - 1) - 1) // sh + 1
        ow = (shape[3] + left + right - dw * (kw - 1) - 1) // sw + 1
        weight = np.zeros((4, 4 * ((shape[1] + 3) // 4) * kh * kw), np.int8)
        _, geometry = quantized_conv_grid.grid_plan(x, codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh,
                                                    ow, weight, 1)
        _, starts, lanes = quantized_conv_grid.grid_tables(*shape[1:], kh, kw, sh, sw, dh, dw, top, bottom, left,
                                                           right, oh, ow)
        assert len(starts) == geometry[quantized_conv_grid.VECTORS]
        wide = geometry[quantized_conv_grid.WIDE]
        placed = []
        for v, (start, mask) in enumerate(zip(starts, lanes)):
            kept = [16 * v + lane for lane in range(16) if mask >> lane & 1]
            placed += [(q // wide, q % wide) for q in kept]
            assert [r * ow + c for r, c in placed[len(placed) - len(kept):]] == list(range(start, start + len(kept)))
        assert placed == [(r, c) for r in range(oh) for c in range(ow)]


@pytest.mark.parametrize("dequantize", [False, True])
def test_ties_take_the_float64_rounding(monkeypatch, dequantize):
    # A factor of exactly 1/2 and no bias: half of the values are ties, which the tiles' float32 try hands to the
    # float64 rounding (half to even); a shift past float32's bound sends every tile there. The float path's bits.
    x_shape, w_shape, attrs = CASES[0]
    inputs = _inputs(np.random.default_rng(13), x_shape, w_shape, np.uint8, False, False, False, zero_points=False)
    inputs[1], inputs[4], inputs[6] = (np.array(v, np.float32) for v in (0.25, 0.5, 0.25))
    node = _node(attrs, len(inputs), False, dequantize)
    with tuning.override(threads=1):
        got = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
    np.testing.assert_array_equal(got, _float_path(monkeypatch, node, inputs))
    singles = quantized_conv_grid.single_params(np.array([0.5, 0.5, 1e-3]), np.array([0.0, 3e6, -2.0]), 0, 255, 130)
    assert singles[5] == -1  # (the second channel's shift is past float32's bound)
    assert singles[3] == 0.5 and singles[4] == 0 and 0.49 < singles[2] < 0.5 and 0.49 < singles[8] < 0.5


def test_amx_tile_groups_take_only_deep_wide_convolutions(monkeypatch):
    # Where AMX runs, its tile groups read patches and round 32 x 32 sums a group: they take a 1x1 convolution with
    # many output channels and a deep k, or a wider kernel over short rows; the grid keeps the rest (a squeeze
    # convolution 3.4x slower on the tiles, a 3x3 expansion at 55 x 55 2.3x).
    monkeypatch.setattr(qgemm_quads, "AMX", True)
    for channels, depth, taps, row in [(1000, 512, 1, 13), (256, 1024, 1, 14), (512, 4608, 9, 7), (2048, 512, 1, 7)]:
        assert qgemm_quads.amx_beats_grid(channels, depth, taps, row)
    for channels, depth, taps, row in [(16, 64, 1, 55), (64, 144, 9, 55), (256, 2304, 9, 14), (64, 256, 1, 56),
                                       (128, 832, 1, 7), (64, 27, 9, 111)]:
        assert not qgemm_quads.amx_beats_grid(channels, depth, taps, row)
    monkeypatch.setattr(qgemm_quads, "AMX", False)
    assert not qgemm_quads.amx_beats_grid(1000, 512, 1, 13)
