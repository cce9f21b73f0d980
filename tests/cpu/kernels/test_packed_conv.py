"""The packed float32 convolution (compiled/gemm.py) and its helper threads (compiled/workers.py), with
the kernels that share them (pooling, batch normalization, depthwise convolution), against onnx's
reference evaluator (the few-row products: test_few_row_products.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import threads
from onnx_runtime_ep_cpu.algorithms import conv_choice, conv_packed, split, window
from onnx_runtime_ep_cpu.compiled import gemm
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import conv as conv_ops
from onnx_runtime_ep_cpu.ops import linalg, normalization, pool
from onnx_runtime_ep_cpu.tuning import KNOBS
from test_compiled_epilogue import ACTIVATIONS, fused_and_unfused

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the packed convolution needs an AVX-512 host")


@pytest.fixture(autouse=True)
def packed_at_every_size(monkeypatch):
    """The packed convolution for the small test convolutions too (the direct tiles take the smallest on
    AVX-512 hosts: conv_choice.direct_tiles_before_packed)."""
    monkeypatch.setattr(conv_choice, "SMALL_MACS", 0)
    monkeypatch.setattr(conv_choice, "STEM_CHANNELS", 0)  # (and the one-thread stems)
    monkeypatch.setattr(conv_choice, "ROW_MACS", 0)  # (and the one-thread single rows)
    monkeypatch.setattr(conv_choice, "LANE_MACS", 0)  # (and the one-thread layers whose lanes the tiles fill better)
    monkeypatch.setattr(conv_choice, "split_cost_favours_direct", lambda *_: False)  # (and on more threads)


@pytest.fixture(params=[1, 2], ids=["one thread", "two threads"])
def kernel_threads(request, monkeypatch, knobs):
    """Run with one thread, and with two (a helper thread, even on a one-CPU machine)."""
    knobs(threads=request.param)
    knobs(split_macs=1)  # split even the small test convolutions
    return request.param


@pytest.fixture(params=["lanes", "panels"])
def conv_layout(request, monkeypatch):
    """The packed convolution with output channels across the lanes (compiled/lanes.py) wherever its
    column stride allows (even for few channels), or with pixel panels (gemm.py) everywhere."""
    _force_lanes(monkeypatch, request.param == "lanes")
    return request.param


def _force_lanes(monkeypatch, on: bool) -> None:
    """Channel lanes wherever the column stride allows them (1 or 2), or nowhere."""
    monkeypatch.setattr(conv_packed, "lanes_apply", lambda geo, outputs, depth: on and geo.strides[1] <= 2)


def _taken(monkeypatch) -> list:
    """Records each call of the packed path (``run``: conv_path's compute calls it, and FusedConv and Conv
    call it straight)."""
    calls = []
    real = conv_packed.PackedConv.run
    monkeypatch.setattr(conv_packed.PackedConv, "run", lambda self, *args: calls.append(self) or real(self, *args))
    return calls


def _inputs(geometry: str, seed: int, with_bias: bool):
    """(rng, x, w read-only as an initializer, b or None, the Conv attributes) for a GEOMETRIES entry."""
    x_shape, w_shape, attrs = GEOMETRIES[geometry]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = rng.standard_normal(w_shape, dtype=np.float32)
    w.flags.writeable = False
    b = rng.standard_normal(w_shape[0], dtype=np.float32) if with_bias else None
    return rng, x, w, b, dict(kernel_shape=list(w_shape[2:]), **attrs)


def _split_spy(monkeypatch, kind: str) -> list:
    """Records the number of parts of each job of ``kind`` (a jobs.py name) run through workers.run."""
    from onnx_runtime_ep_cpu.compiled import jobs, workers

    splits = []
    real = workers.run
    wanted = getattr(jobs, kind)

    def spy(job, parts, count):
        if job is wanted:
            splits.append(len(parts))
        return real(job, parts, count)

    monkeypatch.setattr(workers, "run", spy)
    return splits


def _reference(x, w, b, attrs):
    inputs = ["x", "w"] + (["b"] if b is not None else [])
    node = helper.make_node("Conv", inputs, ["y"], **attrs)
    feeds = {"x": x, "w": w, **({"b": b} if b is not None else {})}
    return ReferenceEvaluator(node).run(None, feeds)[0]


# (x shape, w shape, Conv attributes): both lane layouts (the padded grid of stride-1 windows and
# packed panels), edge tiles in both directions, groups, batches, dilations, asymmetric and auto pads.
GEOMETRIES = {
    "3x3 same": ((1, 5, 9, 11), (13, 5, 3, 3), dict(pads=[1, 1, 1, 1])),
    "3x3 same, wide": ((2, 16, 30, 40), (40, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
    "1x1": ((2, 24, 7, 9), (30, 24, 1, 1), {}),
    "1x1 stride 2": ((1, 8, 13, 11), (12, 8, 1, 1), dict(strides=[2, 2])),
    "3x3 stride 2": ((1, 6, 17, 15), (25, 6, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    "7x7 stride 2 stem": ((1, 3, 40, 36), (16, 3, 7, 7), dict(pads=[3, 3, 3, 3], strides=[2, 2])),
    "5x5 dilated": ((1, 4, 21, 23), (7, 4, 5, 5), dict(pads=[4, 4, 4, 4], dilations=[2, 2])),
    "asymmetric pads": ((1, 3, 10, 12), (11, 3, 3, 2), dict(pads=[0, 2, 1, 0])),
    "same_lower": ((1, 4, 9, 8), (6, 4, 4, 3), dict(auto_pad="SAME_LOWER")),
    "valid, strides 3x2": ((1, 5, 16, 17), (9, 5, 3, 3), dict(auto_pad="VALID", strides=[3, 2])),
    "3x3 stride 2, dilated": ((1, 5, 19, 21), (10, 5, 3, 3), dict(pads=[2, 2, 2, 2], strides=[2, 2], dilations=[2, 2])),
    "7x7 stride 2, even size": ((2, 3, 32, 30), (9, 3, 7, 7), dict(pads=[3, 3, 3, 3], strides=[2, 2])),
    "stride 3": ((1, 4, 20, 23), (6, 4, 3, 3), dict(pads=[1, 1, 1, 1], strides=[3, 3])),
    "groups": ((2, 6, 10, 10), (9, 2, 3, 3), dict(pads=[1, 1, 1, 1], group=3)),
    "one output channel": ((1, 7, 6, 6), (1, 7, 3, 3), {}),
    "tiny image, many channels": ((1, 200, 3, 3), (50, 200, 3, 3), dict(pads=[1, 1, 1, 1])),
    "one pixel": ((9, 64, 1, 1), (20, 64, 1, 1), {}),  # (8 images or fewer: a few-row product)
    # Channel-lane tiles: two rows of 7 (an odd height: the last tile shifted up a row), one output row
    # (the second row read past the image), row chunks of 14 with the last shifted back, 40 channels.
    "7 wide, odd height": ((2, 8, 9, 7), (40, 8, 3, 3), dict(pads=[1, 1, 1, 1])),
    "one output row": ((1, 6, 3, 6), (33, 6, 3, 3), dict(pads=[0, 1, 0, 1])),
    "row chunks": ((1, 4, 5, 31), (35, 4, 3, 3), dict(pads=[1, 1, 1, 1])),
    "row chunks, stride 2": ((1, 4, 9, 61), (18, 4, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    # An input past lanes._INPUT_BYTES: the pixel blocks run outermost, the tiles inside.
    "large input": ((1, 96, 56, 52), (40, 96, 1, 1), {}),
    # Pointwise windows run as one row of pixels: 169 in chunks of 14 (the last shifted back), and a
    # plane of 9, narrower than a tile, which reads past it (a margin) even as one row.
    "1x1 on 13x13": ((1, 40, 13, 13), (64, 40, 1, 1), {}),
    "1x1 on 3x3": ((2, 20, 3, 3), (40, 20, 1, 1), dict(dilations=[2, 2])),
}


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_packed_conv_matches_the_reference(monkeypatch, kernel_threads, conv_layout, geometry, with_bias):
    rng, x, w, b, attrs = _inputs(geometry, 7, with_bias)
    w_shape = w.shape
    taken = _taken(monkeypatch)
    node = Node("Conv", ["x", "w"] + (["b"] if with_bias else []), ["y"], attrs=attrs, opset=13)
    conv = conv_ops.conv(node, None, 13)
    (y,) = conv(x, w, b)
    (again,) = conv(x, w, b)  # weights packed once, reused
    expected = _reference(x, w, b, attrs)
    assert taken and y.dtype == np.float32 and y.shape == expected.shape
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4 * np.sqrt(np.prod(w_shape[1:])))
    np.testing.assert_array_equal(again, y)


@pytest.mark.parametrize("kind,params", ACTIVATIONS)
@pytest.mark.parametrize("with_bias,with_residual", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("geometry", ["3x3 same", "3x3 stride 2", "groups", "1x1", "7 wide, odd height"])
def test_fused_conv_is_conv_then_epilogue_exactly(monkeypatch, kernel_threads, conv_layout, geometry, kind, params,
                                                   with_bias, with_residual):
    """The microkernel adds the bias, the residual and applies the activation as it stores each tile,
    in the order of the unfused nodes: bit for bit what Conv (no bias) then those passes give."""
    rng, x, w, b, attrs = _inputs(geometry, 8, with_bias)
    taken = _taken(monkeypatch)
    (conv_out,) = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=attrs, opset=13), None, 13)(x, w)
    z = rng.standard_normal(conv_out.shape, dtype=np.float32) if with_residual else None
    if z is not None:
        z[0, 0, 0, :2] = [np.nan, -np.inf]  # NaN and infinities pass through every activation as in numpy
    got, expected = fused_and_unfused(x, w, b, z, attrs, kind, params, conv_out)
    plain = kind is None and z is None and b is not None  # the expected output is then the Conv's own, one more run
    assert len(taken) == (3 if plain else 2)
    np.testing.assert_array_equal(got, expected)


def test_results_do_not_depend_on_the_thread_count(monkeypatch, conv_layout, knobs):
    """Each output is reduced over k in the same order whichever thread computes it."""
    knobs(split_macs=1)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 32, 20, 20), dtype=np.float32)
    w = rng.standard_normal((36, 32, 3, 3), dtype=np.float32)
    attrs = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    results = []
    for count in (1, 2):
        knobs(threads=count)
        conv = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=attrs, opset=13), None, 13)
        results.append(conv(x, w)[0])
    np.testing.assert_array_equal(results[0], results[1])


def test_a_sleeping_helper_leaves_the_job_to_the_caller_and_wakes_up(monkeypatch):
    """A helper idle past its spin time blocks; the next job runs on the caller alone (correctly) and
    wakes the helper, which takes its share of the jobs after that; a long job waits for it."""
    from onnx_runtime_ep_cpu.compiled import jobs, workers

    monkeypatch.setattr(workers, "_SPIN_SECONDS", 0.02)
    pool = workers.Helpers(1)
    helper_thread = pool._helpers[0]
    rng = np.random.default_rng(10)
    a = rng.standard_normal((2, 300), dtype=np.float32)
    w = rng.standard_normal((64, 300), dtype=np.float32)
    expected = a @ w.T

    def run(long: bool = False) -> bool:
        """One job in two parts; whether the helper ran one."""
        helper_thread.mailbox[workers.CPU] = -1
        sums = np.zeros((1, 2, 64), np.float32)
        pool.run(jobs.PRODUCT, [(True, a, w, sums, 2, 0, 1), (True, a, w, sums, 2, 1, 2)], long)
        np.testing.assert_allclose(sums[0], expected, rtol=1e-5, atol=1e-4)
        return helper_thread.mailbox[workers.CPU] >= 0

    for _ in range(2):
        threading.Event().wait(0.1)  # past the spin time: the helper blocks
        assert not run()  # the caller ran both parts (and woke the helper)
    deadline = time.monotonic() + 30  # awake within milliseconds, it spins for 20 ms between jobs (a
    while time.monotonic() < deadline:  # loaded machine may keep it waiting for a CPU)
        if run():
            break
        threading.Event().wait(0.005)
    else:
        pytest.fail("the helper never took a part")
    threading.Event().wait(0.1)
    assert run(long=True)  # a long job waits for the sleeping helper to wake and take its part


def test_hosts_without_avx512_keep_the_blas_paths(monkeypatch):
    from onnx_runtime_ep_cpu.compiled import host

    monkeypatch.setattr(gemm, "AVAILABLE", False)
    monkeypatch.setattr(host, "AVX512", False)  # what packed_conv_applies asks
    taken = _taken(monkeypatch)
    x = np.ones((1, 3, 5, 5), np.float32)
    w = np.ones((4, 3, 3, 3), np.float32)
    conv = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=dict(kernel_shape=[3, 3]), opset=13), None, 13)
    (y,) = conv(x, w)
    assert not taken
    np.testing.assert_array_equal(y, np.full((1, 4, 3, 3), 27, np.float32))
    (product,) = linalg.gemm_7(Node("Gemm", ["a", "b"], ["y"], attrs={}, opset=13), None, 13)(
        np.ones((1, 4), np.float32), np.ones((4, 2), np.float32))
    np.testing.assert_array_equal(product, np.full((1, 2), 4, np.float32))


def test_tile_heights_follow_the_channel_count():
    # 8-high tiles where 12-high ones would leave more rows empty: 64 = 8 x 8 rather than 72 = 6 x 12.
    counts = (1, 12, 16, 24, 32, 64, 96, 128, 160, 256)
    assert [gemm.tile_rows(m) for m in counts] == [8, 12, 8, 12, 8, 8, 12, 12, 12, 12]
    w = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    packed = gemm.pack_weights(w, 8)
    assert packed.shape == (1, 3 * 8)
    np.testing.assert_array_equal(packed.reshape(3, 8)[:, :5], w.T)  # interleaved by k, zero rows past M
    np.testing.assert_array_equal(packed.reshape(3, 8)[:, 5:], 0)


@pytest.mark.parametrize("op,attrs", [
    ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2])),
    ("AveragePool", dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)),
    ("AveragePool", dict(kernel_shape=[2, 3], strides=[2, 1], ceil_mode=1)),
])
def test_pooling_split_across_threads_matches_the_reference(monkeypatch, kernel_threads, op, attrs, knobs):

    knobs(split_elements=1)
    splits = _split_spy(monkeypatch, "POOL")
    x = np.random.default_rng(13).standard_normal((2, 5, 11, 9), dtype=np.float32)
    node = Node(op, ["x"], ["y"], attrs=attrs, opset=19)
    (y,) = (pool.max_pool if op == "MaxPool" else pool.average_pool)(node, None, 19)(x)
    expected = ReferenceEvaluator(helper.make_node(op, ["x"], ["y"], **attrs)).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
    # one part runs on this thread without a job: MaxPool's kept call (pooling.KeptPool) calls its loop here, and
    # compiled_pool one part of a window other than the 3x3 kernel's (b825f5c)
    direct = kernel_threads == 1 and (op == "MaxPool" or attrs["kernel_shape"] != [3, 3])
    assert splits == ([] if direct else [kernel_threads])


@pytest.mark.parametrize("activation", [None, "Relu"])
def test_batch_normalization_split_across_threads(monkeypatch, kernel_threads, activation, knobs):
    from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN as domain

    knobs(split_elements=1)
    splits = _split_spy(monkeypatch, "AFFINE")
    rng = np.random.default_rng(14)
    x = rng.standard_normal((1, 7, 6, 5), dtype=np.float32)
    scale, bias, mean = (rng.standard_normal(7, dtype=np.float32) for _ in range(3))
    var = rng.random(7, dtype=np.float32) + 0.5
    attrs = {} if activation is None else dict(activation=activation, activation_params=[])
    node = Node("FusedBatchNormalization", ["x", "s", "b", "m", "v"], ["y"], domain=domain, attrs=attrs, opset=1)
    (y,) = normalization.fused_batch_normalization(node, None, 1)(x, scale, bias, mean, var)
    expected = ReferenceEvaluator(helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])).run(
        None, dict(x=x, s=scale, b=bias, m=mean, v=var))[0]
    if activation == "Relu":
        expected = np.maximum(expected, 0)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert splits == [kernel_threads]


@pytest.mark.parametrize("attrs", [dict(pads=[1, 1, 1, 1]), dict(pads=[1, 1, 1, 1], strides=[2, 2]),
                                   dict(pads=[0, 1, 2, 0], dilations=[2, 1])])
@pytest.mark.parametrize("multiplier", [1, 2])
def test_depthwise_split_across_threads_matches_the_reference(monkeypatch, kernel_threads, attrs, multiplier, knobs):

    from onnx_runtime_ep_cpu.compiled import jobs

    knobs(split_depthwise_macs=1)
    splits = []  # the parts of each depthwise convolution, posted from compiled code (jobs.split_depthwise)
    real = jobs.split_depthwise
    monkeypatch.setattr(jobs, "split_depthwise", lambda *a: splits.append(len(a[19]) - 1) or real(*a))
    rng = np.random.default_rng(15)
    # (planes of more than 64 outputs: the plane loops', not conv_depthwise_blocks')
    x = rng.standard_normal((1, 6, 18, 20), dtype=np.float32)
    w = rng.standard_normal((6 * multiplier, 1, 3, 3), dtype=np.float32)
    b = rng.standard_normal(6 * multiplier, dtype=np.float32)
    attrs = dict(kernel_shape=[3, 3], group=6, **attrs)
    (y,) = conv_ops.conv(Node("Conv", ["x", "w", "b"], ["y"], attrs=attrs, opset=13), None, 13)(x, w, b)
    np.testing.assert_allclose(y, _reference(x, w, b, attrs), rtol=1e-5, atol=1e-5)
    assert splits == ([kernel_threads] if kernel_threads > 1 else [])  # one thread: the loop itself, no job


def test_a_split_convolution_posts_a_part_to_the_helper(monkeypatch, knobs):
    """Posted from compiled code (jobs.split_conv): once the helper is awake it runs the second part,
    with its own scratch for packed panels (a strided convolution packs them), same result throughout."""
    from onnx_runtime_ep_cpu.compiled import workers

    knobs(split_macs=1)
    knobs(threads=2)
    _force_lanes(monkeypatch, False)  # (the pixel panels, whose parts need the scratch: not a test before's)
    rng, x, w, b, attrs = _inputs("3x3 stride 2", 18, True)
    conv = conv_ops.conv(Node("Conv", ["x", "w", "b"], ["y"], attrs=attrs, opset=13), None, 13)
    (first,) = conv(x, w, b)
    np.testing.assert_allclose(first, _reference(x, w, b, attrs), rtol=1e-4, atol=1e-4)
    pool = workers.helpers(threads.helper_count())
    deadline = time.monotonic() + 30  # a loaded machine may keep the helper waiting for a CPU
    while time.monotonic() < deadline:
        pool.mailboxes[0, workers.CPU] = -1
        (again,) = conv(x, w, b)
        np.testing.assert_array_equal(again, first)
        if pool.mailboxes[0, workers.CPU] >= 0:
            break
        threading.Event().wait(0.005)
    else:
        pytest.fail("the helper never took a part")
    assert pool.mailboxes[0, workers.BUFFER_SIZE] >= gemm.scratch_size(w[0].size)


@pytest.mark.skipif(not hasattr(__import__("os"), "register_at_fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_helpers(monkeypatch, knobs):
    """The parent's helper threads do not exist in a forked child: it must not post jobs to their
    mailboxes (it would wait forever), but start helpers of its own."""
    import os

    from onnx_runtime_ep_cpu.compiled import workers

    knobs(split_macs=1)
    knobs(threads=2)
    rng = np.random.default_rng(16)
    x = rng.standard_normal((1, 8, 12, 12), dtype=np.float32)
    w = rng.standard_normal((16, 8, 3, 3), dtype=np.float32)
    conv = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=dict(kernel_shape=[3, 3]), opset=13), None, 13)
    (expected,) = conv(x, w)
    assert workers._helpers is not None
    child = os.fork()
    if child == 0:  # the child: the verdict as its exit status, without cleanup
        status = 1
        try:
            if workers._helpers is None:
                status = 2
                (got,) = conv(x, w)  # starts the child's own helpers
                status = 0 if workers._helpers is not None and np.array_equal(got, expected) else 3
        finally:
            os._exit(status)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("split_bytes", [1, 1 << 40], ids=["padded by the helpers too", "padded by the caller"])
@pytest.mark.parametrize("geometry", ["asymmetric pads", "1x1", "7 wide, odd height"])
def test_padded_inputs_in_the_scratch_give_the_reference(monkeypatch, kernel_threads, conv_layout, split_bytes,
                                                         geometry, knobs):
    """Padded inputs (for channel-lane tiles with a margin past the image, also without pads; per image of
    a batch) are written whole into the calling thread's scratch, by the caller or split with the helpers.
    Two different inputs in a row must each give their own reference result."""
    knobs(split_pad_bytes=split_bytes)
    rng, x, w, b, attrs = _inputs(geometry, 17, True)
    conv = conv_ops.conv(Node("Conv", ["x", "w", "b"], ["y"], attrs=attrs, opset=13), None, 13)
    for _ in range(2):
        (y,) = conv(x, w, b)
        np.testing.assert_allclose(y, _reference(x, w, b, attrs), rtol=1e-4, atol=1e-4)
        x = rng.standard_normal(x.shape, dtype=np.float32) * 3


STRIDED = ["3x3 stride 2", "7x7 stride 2 stem", "valid, strides 3x2", "7x7 stride 2, even size", "stride 3",
           "stride 2, asymmetric pads", "groups, stride 2"]
GEOMETRIES["stride 2, asymmetric pads"] = ((1, 4, 12, 13), (5, 4, 3, 3), dict(pads=[0, 1, 2, 1], strides=[2, 2]))
GEOMETRIES["groups, stride 2"] = ((2, 6, 11, 11), (9, 2, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2], group=3))


@pytest.mark.parametrize("kept_bytes", [1, 1 << 20], ids=["fresh phases", "kept phase buffer"])
@pytest.mark.parametrize("geometry", STRIDED)
def test_strided_windows_over_the_phase_split_image_give_the_packed_panels_bits(monkeypatch, kernel_threads,
                                                                                 geometry, kept_bytes, knobs):
    """A strided window read in place from the image split into its stride's phases gives exactly the
    packed panels' result (the same reduction order), and the reference's; a kept buffer's zeros stay."""
    knobs(kept_padded_bytes=kept_bytes)
    monkeypatch.setattr(conv_packed, "lanes_apply", lambda geo, outputs, depth: False)  # (phases: the panels' layout)
    rng, x, w, b, attrs = _inputs(geometry, 21, True)
    taken = _taken(monkeypatch)
    node = Node("Conv", ["x", "w", "b"], ["y"], attrs=attrs, opset=13)
    knobs(phase_macs=1)  # (the smallest the knobs take: every strided window splits)
    phased = conv_ops.conv(node, None, 13)
    phased(x, w, b)  # (the path is chosen on the first call)
    knobs(phase_macs=10**9)
    packed = conv_ops.conv(node, None, 13)
    packed(x, w, b)
    for _ in range(2):  # a second input: the kept buffer holds the first one's cells, rewritten
        (y,) = phased(x, w, b)
        np.testing.assert_array_equal(y, packed(x, w, b)[0])
        tolerance = 1e-4 * np.sqrt(np.prod(w.shape[1:]))
        np.testing.assert_allclose(y, _reference(x, w, b, attrs), rtol=1e-4, atol=tolerance)
        x = rng.standard_normal(x.shape, dtype=np.float32) * 3
    assert taken[0]._phases is not None and taken[1]._phases is None


def test_which_strided_windows_run_over_phases():
    def phases(kernel, strides, out_channels, in_shape=(28, 28), pads=(1, 1), dilations=(1, 1)):
        out = tuple((n + 2 * p - d * (k - 1) - 1) // s + 1
                    for n, p, k, s, d in zip(in_shape, pads, kernel, strides, dilations))
        geo = window.Geometry(in_shape, kernel, strides, dilations, pads, pads, out)
        return conv_packed.phase_split(geo, geo.padded_shape(in_shape), out_channels)

    assert phases((3, 3), (2, 2), 256) == (15, 15)  # 256 * 9 / 4 multiply-adds per input value
    assert phases((3, 3), (2, 2), 64) is None  # too few for the split's copy to pay
    assert phases((1, 1), (2, 2), 1024, pads=(0, 0)) is None  # one phase of four read
    assert phases((3, 3), (2, 2), 256, dilations=(2, 2), pads=(2, 2)) is None  # dilated: one phase read too
    assert phases((3, 3), (1, 1), 1024) is None  # stride 1 reads the image itself


@pytest.mark.parametrize("geometry", sorted(g for g in GEOMETRIES if GEOMETRIES[g][2].get("strides", [1, 1])[1] <= 2))
def test_channel_lanes_give_the_pixel_panels_bits(monkeypatch, kernel_threads, geometry):
    """Both kernels reduce k = 0 .. K-1 for every output, then add the bias and residual and apply the
    activation: the same bits, whichever layout (tile edges, margins, shifted tiles, groups, batches)."""
    rng, x, w, b, attrs = _inputs(geometry, 23, True)
    taken = _taken(monkeypatch)
    node = Node("FusedConv", ["x", "w", "b", "z"], ["y"], domain=FUSED_DOMAIN, opset=1,
                attrs=dict(attrs, activation="LeakyRelu", activation_params=[0.125]))
    (conv_out,) = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=attrs, opset=13), None, 13)(x, w)
    z = rng.standard_normal(conv_out.shape, dtype=np.float32)
    results = []
    for lanes in (True, False):
        _force_lanes(monkeypatch, lanes)
        for residual in (z, None):
            results.append(conv_ops.fused_conv(node, None, 1)(x, w, b, residual)[0])
    np.testing.assert_array_equal(results[0], results[2])
    np.testing.assert_array_equal(results[1], results[3])
    lanes = [conv for conv in taken if conv._by_lanes]
    assert lanes and len(lanes) < len(taken)


def test_a_pointwise_window_reads_its_input_in_place_as_one_row(monkeypatch, kernel_threads):
    """A 13x13 plane is narrower than a channel-lane tile's 14 pixels: by rows, each tile would read past
    its row and the input would be copied into a buffer with a margin; as one row of 169 pixels it is
    read where it is."""
    rng, x, w, b, attrs = _inputs("1x1 on 13x13", 29, True)
    taken = _taken(monkeypatch)
    (y,) = conv_ops.conv(Node("Conv", ["x", "w", "b"], ["y"], attrs=attrs, opset=13), None, 13)(x, w, b)
    (conv,) = taken
    assert conv._by_lanes and conv._geo.out == (1, 169) and not conv._margin
    assert np.shares_memory(conv._padded_input(x.reshape(conv._flat)), x)
    assert y.shape == (1, 64, 13, 13)
    np.testing.assert_allclose(y, _reference(x, w, b, attrs), rtol=1e-4, atol=1e-3)


def test_which_windows_put_channels_across_the_lanes():
    def by_lanes(strides, out_channels, kernel=(3, 3), in_shape=(28, 28), pads=(1, 1), channels=64):
        out = tuple((n + 2 * p - (k - 1) - 1) // s + 1 for n, p, k, s in zip(in_shape, pads, kernel, strides))
        geo = window.Geometry(in_shape, kernel, strides, (1, 1), pads, pads, out)
        return conv_packed.lanes_apply(geo, out_channels, channels * kernel[0] * kernel[1])

    assert by_lanes((1, 1), 64) and by_lanes((2, 2), 128) and by_lanes((3, 2), 256)  # any row stride
    assert by_lanes((1, 1), 256, in_shape=(13, 13)) and by_lanes((1, 1), 512, in_shape=(7, 7))
    assert not by_lanes((1, 1), 16)  # half a tile of 32 channels: the pixel panels
    assert not by_lanes((1, 1), 34, kernel=(1, 1), pads=(0, 0))  # 34 of 64 lanes, where panels fill 98%
    assert by_lanes((2, 2), 24, in_shape=(224, 224), channels=3)  # a shallow stem: 1.8x faster
    assert not by_lanes((4, 4), 96, kernel=(11, 11))  # column strides beyond 2: the panels


@pytest.fixture
def two_thread_packed_convs(monkeypatch, knobs) -> list:
    """Two kernel threads splitting even small convolutions; the packed convolutions made, in order."""
    knobs(split_macs=1)
    knobs(threads=2)
    return _taken(monkeypatch)


def _checked_conv(seed: int, x_shape, w_shape, pads) -> np.ndarray:
    """A Conv of random x and w (a 3x3 window with ``pads``) through the CPU kernel, checked against onnx's
    reference; returns x."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = rng.standard_normal(w_shape, dtype=np.float32)
    attrs = dict(kernel_shape=[3, 3], pads=pads)
    (y,) = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=attrs, opset=13), None, 13)(x, w)
    np.testing.assert_allclose(y, _reference(x, w, None, attrs), rtol=1e-4, atol=1e-3)
    return x


def _shares(parts) -> list:
    """Each thread's share of a one-image packed convolution's plan as (its pixel blocks, its channel tiles),
    checking that its tasks cut the share in order into at most conv_tasks_per_thread pieces along one of the two."""
    shares = []
    for part in parts:
        assert 1 <= len(part) <= KNOBS.conv_tasks_per_thread and (part[:, :2] == 0).all()
        blocks, tiles = (part[0, 2], part[-1, 3]), (part[0, 4], part[-1, 5])
        cut_blocks = (part[1:, 2] == part[:-1, 3]).all() and (part[:, 4:6] == tiles).all()
        cut_tiles = (part[1:, 4] == part[:-1, 5]).all() and (part[:, 2:4] == blocks).all()
        assert cut_blocks or cut_tiles
        shares.append((tuple(map(int, blocks)), tuple(map(int, tiles))))
    return shares


def test_channel_lane_tasks_split_by_tiles_where_the_blocks_go_round_unevenly(two_thread_packed_convs):
    # 13 rows of 13 pixels: 13 pixel blocks split 7/6 between two threads, 8 channel tiles 4/4.
    taken = two_thread_packed_convs
    rng = np.random.default_rng(24)
    x = rng.standard_normal((1, 64, 13, 13), dtype=np.float32)
    attrs = dict(kernel_shape=[1, 1])
    for outputs, by_tiles in ((256, True), (200, False)):  # 7 tiles split 4/3: no better than the blocks
        w = rng.standard_normal((outputs, 64, 1, 1), dtype=np.float32)
        (y,) = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=attrs, opset=13), None, 13)(x, w)
        np.testing.assert_allclose(y, _reference(x, w, None, attrs), rtol=1e-4, atol=1e-3)
        conv = taken[-1]
        assert conv._by_lanes
        shares = _shares(conv._plan(2)[0])
        assert shares == ([((0, 13), (0, 4)), ((0, 13), (4, 8))] if by_tiles else [((0, 6), (0, 7)), ((6, 13), (0, 7))])


def test_channel_lane_tasks_split_by_tiles_where_the_weights_outweigh_the_input(two_thread_packed_convs):
    # 7x7 pixels in 4 blocks of two rows (an even split), but 3x3 weights for 224 channels: 7 tiles, 3/4.
    _checked_conv(25, (1, 48, 7, 7), (224, 48, 3, 3), [1, 1, 1, 1])
    assert _shares(two_thread_packed_convs[-1]._plan(2)[0]) == [((0, 4), (0, 3)), ((0, 4), (3, 7))]


def test_threads_claim_each_task_once_through_the_claims(monkeypatch, two_thread_packed_convs):
    """A share's tasks go out one at a time through its claims counter: with no helper to post to, the
    caller runs its share and then claims the other's (the result is whole); a share whose tasks were
    all given out before is not run again (its outputs are left as they were)."""
    from onnx_runtime_ep_cpu.compiled import jobs, workers

    monkeypatch.setattr(workers, "helpers", lambda count: pytest.fail("no helper is used"))
    monkeypatch.setattr(conv_packed, "helper_count", lambda: 0)  # workers.call runs every share on the caller
    calls = []
    real = jobs.split_conv
    monkeypatch.setattr(jobs, "split_conv", lambda *args: calls.append(args) or real(*args))
    rng = np.random.default_rng(26)
    x = rng.standard_normal((1, 32, 20, 20), dtype=np.float32)
    w = rng.standard_normal((64, 32, 3, 3), dtype=np.float32)
    attrs = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    kernel = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=attrs, opset=13), None, 13)
    want = _reference(x, w, None, attrs)
    np.testing.assert_allclose(kernel(x, w)[0], want, rtol=1e-4, atol=1e-3)
    tasks, ranges, claims = calls[-1][10:13]
    counts = np.diff(ranges)
    assert len(counts) == 2 and (counts > 1).all() and (claims >= counts).all()  # every task of both shares claimed
    shares = two_thread_packed_convs[-1]._plan(2)[0]
    (blocks_1, tiles_1), = _shares(shares[1:])
    assert tiles_1 == (0, 2) and blocks_1[0] > 0  # the second share: the later pixel blocks, every tile

    def given_out(*args):  # the second share's tasks all claimed already (by a thread that ran them)
        args[12][1] = counts[1]
        return real(*args)

    monkeypatch.setattr(jobs, "split_conv", given_out)
    out = np.full(want.shape, np.nan, dtype=np.float32)
    two_thread_packed_convs[-1](x, w, None, None, out)
    ran = ~np.isnan(out)
    np.testing.assert_allclose(out[ran], want[ran], rtol=1e-4, atol=1e-3)
    assert ran.any() and not ran.all()


def test_a_fused_convolutions_constant_bias_is_padded_once(monkeypatch):
    """A FusedConv hands the packed convolution its bias initializer itself (not a fresh view per run), so the
    bias padded to whole tiles is made on the first run and reused."""
    rng, x, w, b, attrs = _inputs("1x1 on 13x13", 31, True)
    b.flags.writeable = False  # an initializer
    taken = _taken(monkeypatch)
    node = Node("FusedConv", ["x", "w", "b"], ["y"], domain=FUSED_DOMAIN, opset=1, attrs=dict(attrs, activation="Relu"))
    kernel = conv_ops.fused_conv(node, None, 1)
    first = kernel(x, w, b)[0]
    conv = taken[-1]
    padded = conv._bias_cache[1]
    assert conv._bias_cache[0] is b
    second = kernel(x, w, b)[0]
    assert conv._bias_cache[1] is padded and taken[-1] is conv
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, np.maximum(_reference(x, w, b, attrs), 0), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("top,left,height,width", [(1, 1, 9, 9), (0, 2, 7, 12), (3, 0, 7, 5), (2, 3, 8, 10)])
def test_pad_planes_writes_every_cell_of_the_buffer(top, left, height, width):
    """gemm.pad_planes over a buffer full of garbage: the planes at (top, left), every other cell zero (pads
    after each plane's rows and columns, and the margin past the last plane)."""
    from onnx_runtime_ep_cpu.compiled import gemm

    x = np.random.default_rng(32).standard_normal((3, 4, 5), dtype=np.float32)
    out = np.full(3 * height * width + 7, np.nan, dtype=np.float32)
    gemm.pad_planes(x, out, top, left, height, width)
    want = np.zeros(out.shape, dtype=np.float32)
    want[:3 * height * width].reshape(3, height, width)[:, top:top + 4, left:left + 5] = x
    np.testing.assert_array_equal(out, want)


def test_padded_inputs_share_the_threads_scratch(monkeypatch, kernel_threads):
    """A padded input is written into the calling thread's scratch (no buffer per node or call), which the
    next convolution overwrites whole: results stay those of each convolution alone."""
    taken = _taken(monkeypatch)
    rng = np.random.default_rng(33)
    attrs = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    big = rng.standard_normal((1, 8, 20, 20), dtype=np.float32)
    small = rng.standard_normal((1, 4, 6, 6), dtype=np.float32)
    kernels = [conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=attrs, opset=13), None, 13) for _ in range(2)]
    weights = [rng.standard_normal((16, x.shape[1], 3, 3), dtype=np.float32) for x in (big, small)]
    for _ in range(2):
        for kernel, x, w in zip(kernels, (big, small), weights):
            np.testing.assert_allclose(kernel(x, w)[0], _reference(x, w, None, attrs), rtol=1e-4, atol=1e-3)
    xp = taken[-1]._padded_input(small)
    assert np.shares_memory(xp, split.scratch(1)) and len(taken) == 4


def test_a_padded_input_split_across_the_helpers_is_the_same_buffer(monkeypatch, kernel_threads, knobs):
    """From _SPLIT_PAD_BYTES on, the helpers pad their share of the channels (jobs.split_pad; a part no helper
    takes runs on the caller): the same cells as one thread's gemm.pad_planes, margin included."""
    from onnx_runtime_ep_cpu.compiled import gemm, jobs

    knobs(split_pad_bytes=1)
    splits = []
    real = jobs.split_pad
    monkeypatch.setattr(jobs, "split_pad", lambda *args: splits.append(args[0].shape) or real(*args))
    taken = _taken(monkeypatch)
    x = _checked_conv(34, (2, 7, 11, 13), (40, 7, 3, 3), [2, 1, 0, 1])
    assert splits == ([(7, 11, 13)] * 2 if kernel_threads > 1 else [])
    conv = taken[-1]
    got = conv._padded_input(x).copy()
    want = np.full(got.shape, np.nan, dtype=np.float32)
    for image in range(2):
        gemm.pad_planes(x[image], want[image], 2, 1, 13, 15)
    np.testing.assert_array_equal(got, want)
