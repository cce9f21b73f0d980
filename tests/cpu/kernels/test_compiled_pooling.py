"""The compiled (numba) pooling and LRN loops against the numpy kernels they replace.

MaxPool and AveragePool run the compiled loops for float32/float64 inputs with 1-D or 2-D windows;
the numpy fold (``_Geometry.reduce_windows``) stays for other dtypes, ranks and the Indices output.
Random geometries cover pads, ceil_mode (windows that start in the padding), dilations, strides
(1, 2 and the generic phase split) and count_include_pad. LRN's compiled base must give the same
bits as the numpy formula.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.algorithms import pooling, window
from onnx_runtime_ep_cpu.registry import lookup

RNG = np.random.default_rng(11)


def kernel(op, attrs, shape, n_outputs=1, opset=19):
    node = Node(op, ["x"], [f"y{i}" for i in range(n_outputs)], name="n", attrs=dict(attrs), opset=opset)
    return lookup(op, "", opset)(node, [shape], opset)


def numpy_pool(x, attrs, include_pad=None):
    """The numpy fold over the same geometry: max (``include_pad`` None) or average."""
    node = Node("MaxPool", ["x"], ["y"], name="ref", attrs=dict(attrs), opset=19)
    geo = window.Window(node, [x.shape], needs_kernel=True).resolve(x.shape[2:])
    if include_pad is None:
        return geo.reduce_windows(x, np.maximum, -np.inf)
    total = geo.reduce_windows(x, np.add, 0)
    with np.errstate(invalid="ignore"):  # 0/0 for a window wholly in the padding
        return total / geo.divisor(include_pad, x.dtype)


def random_case(rank, seed, dtype=np.float32):
    """Random window attributes (each a fresh draw from ``seed``) and an input for them."""
    rng = np.random.default_rng(seed)
    kernel_shape = [int(k) for k in rng.integers(1, 5, rank)]
    dilations = [int(d) for d in rng.integers(1, 3, rank)]
    attrs = {
        "kernel_shape": kernel_shape,
        "strides": [int(s) for s in rng.integers(1, 4, rank)],
        "dilations": dilations,
        "ceil_mode": int(rng.integers(0, 2)),
    }
    if rng.random() < 0.2:
        attrs["auto_pad"] = str(rng.choice(["SAME_UPPER", "SAME_LOWER", "VALID"]))
    else:
        # Pads smaller than the dilated kernel, as ONNX requires.
        attrs["pads"] = [int(rng.integers(0, (k - 1) * d + 1)) for k, d in zip(kernel_shape * 2, dilations * 2)]
    return attrs, rng.standard_normal((2, 3, *rng.integers(5, 14, rank))).astype(dtype)


CASES = [(rank, seed) for rank in (1, 2) for seed in range(40)]


@pytest.mark.parametrize("rank,seed", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_pool_matches_numpy(rank, seed, dtype):
    attrs, x = random_case(rank, seed, dtype)
    y = kernel("MaxPool", attrs, x.shape)(x)[0]
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, numpy_pool(x, attrs))


@pytest.mark.parametrize("rank,seed", CASES)
@pytest.mark.parametrize("include_pad", [0, 1])
def test_average_pool_matches_numpy(rank, seed, include_pad):
    attrs, x = random_case(rank, seed)
    attrs["count_include_pad"] = include_pad
    y = kernel("AveragePool", attrs, x.shape)(x)[0]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, numpy_pool(x, attrs, bool(include_pad)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_common_geometries(stride):
    """The shapes CNNs use: 3x3 windows over wide planes, padded on both sides or only at the end."""
    x = RNG.standard_normal((1, 4, 37, 40)).astype(np.float32)
    for pads in ([1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]):
        attrs = {"kernel_shape": [3, 3], "strides": [stride, stride], "pads": pads}
        np.testing.assert_array_equal(kernel("MaxPool", attrs, x.shape)(x)[0], numpy_pool(x, attrs))
        for include_pad in (0, 1):
            y = kernel("AveragePool", {**attrs, "count_include_pad": include_pad}, x.shape)(x)[0]
            np.testing.assert_allclose(y, numpy_pool(x, attrs, bool(include_pad)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel_shape,dilations", [
    ([3, 3], [1, 1]), ([2, 4], [1, 1]), ([3, 2], [2, 3]), ([1, 1], [1, 1]),
])
@pytest.mark.parametrize("split", [0, 1, 2])
def test_same_width_stride_one(kernel_shape, dilations, split):
    """Stride 1 with pads across that sum to the kernel's reach, so the output is as wide as the
    input: the whole-plane passes, with the pads split before/after in several ways."""
    reach = [(k - 1) * d for k, d in zip(kernel_shape, dilations)]
    before = [min(split, r) for r in reach]
    after = [r - b for r, b in zip(reach, before)]
    attrs = {"kernel_shape": kernel_shape, "dilations": dilations, "pads": before + after}
    for shape in ((2, 3, 9, 11), (1, 2, 1, 5), (1, 1, 12, 2)):
        x = RNG.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(kernel("MaxPool", attrs, x.shape)(x)[0], numpy_pool(x, attrs))
        for include_pad in (0, 1):
            y = kernel("AveragePool", {**attrs, "count_include_pad": include_pad}, x.shape)(x)[0]
            np.testing.assert_allclose(y, numpy_pool(x, attrs, bool(include_pad)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pads", [[0, 0, 0, 0], [0, 0, 1, 1], [1, 2, 0, 0]])
@pytest.mark.parametrize("include_pad", [0, 1])
def test_window_over_whole_plane(pads, include_pad):
    """A single window that covers each whole plane (CNN heads) takes the plane means."""
    x = RNG.standard_normal((2, 5, 6, 7)).astype(np.float32)
    attrs = {"kernel_shape": [6 + pads[0] + pads[2], 7 + pads[1] + pads[3]], "pads": pads,
             "count_include_pad": include_pad}
    y = kernel("AveragePool", attrs, x.shape)(x)[0]
    assert y.shape == (2, 5, 1, 1)
    np.testing.assert_allclose(y, numpy_pool(x, attrs, bool(include_pad)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(2, 5, 7, 7), (1, 3, 13), (1, 2, 3, 4, 5), (1, 2, 70, 70), (1, 0, 4, 4)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_global_average_pool(shape, dtype):
    """Plane means by the compiled loop (planes up to PLANE_SUM_LIMIT), numpy beyond."""
    x = RNG.standard_normal(shape).astype(dtype)
    y = kernel("GlobalAveragePool", {}, x.shape)(x)[0]
    assert y.dtype == dtype and y.shape == shape[:2] + (1,) * (len(shape) - 2)
    np.testing.assert_allclose(y, x.mean(axis=tuple(range(2, x.ndim)), keepdims=True), rtol=1e-5, atol=1e-7)


def sprinkle_specials(x, rng, count):
    """NaN and infinities at random places, half of them on the planes' first and last rows and
    columns, where a loop that pools several planes (or rows) at once would let them leak into
    the neighbouring plane's (or row's) windows."""
    planes = x.reshape(-1, *x.shape[-2:])
    for value in rng.choice([np.nan, np.inf, -np.inf], count):
        p = rng.integers(0, planes.shape[0])
        i, j = rng.integers(0, planes.shape[1]), rng.integers(0, planes.shape[2])
        if rng.random() < 0.5:
            i = rng.choice([0, planes.shape[1] - 1])
            j = rng.choice([0, planes.shape[2] - 1]) if rng.random() < 0.5 else j
        planes[p, i, j] = value


def check_pools(x, attrs):
    """MaxPool (exactly) and AveragePool (both count_include_pad) against the numpy fold."""
    np.testing.assert_array_equal(kernel("MaxPool", attrs, x.shape)(x)[0], numpy_pool(x, attrs))
    for include_pad in (0, 1):
        y = kernel("AveragePool", {**attrs, "count_include_pad": include_pad}, x.shape)(x)[0]
        with np.errstate(invalid="ignore"):  # inf - inf in a window sum
            expected = numpy_pool(x, attrs, bool(include_pad))
        np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(40))
def test_same_width_plane_groups(seed):
    """Stride 1 with pads across that sum to the kernel's reach: whole planes per pass, and groups
    of consecutive planes when the output is as tall as the input, with the taps outside a plane
    or row masked; many small planes, so groups end anywhere (a partial last group too)."""
    rng = np.random.default_rng(seed)
    kernel_shape = [int(k) for k in rng.integers(1, 6, 2)]
    dilations = [int(d) for d in rng.integers(1, 3, 2)]
    reach = [(k - 1) * d for k, d in zip(kernel_shape, dilations)]
    before = [int(rng.integers(0, r + 1)) for r in reach]
    after = [r - b for r, b in zip(reach, before)]
    if rng.random() < 0.3:  # a shorter or taller output: planes one at a time
        after[0] = int(rng.integers(0, reach[0] + 1))
    attrs = {"kernel_shape": kernel_shape, "dilations": dilations, "pads": before + after}
    height = int(rng.integers(max(1, reach[0] - before[0] - after[0] + 1), 12))
    x = rng.standard_normal((2, int(rng.integers(10, 70)), height, int(rng.integers(1, 12))))
    x = x.astype(np.float32 if seed % 2 else np.float64)
    sprinkle_specials(x, rng, 6)
    check_pools(x, attrs)


@pytest.mark.parametrize("seed", range(40))
def test_narrow_rows_across_planes(seed):
    """Outputs up to NARROW_ROWS wide: the rows of many planes laid end to end in one buffer, with
    strides 1 to 4 (the generic phase split too), pads, dilations and ceil_mode windows."""
    rng = np.random.default_rng(100 + seed)
    attrs, _ = random_case(2, 100 + seed)
    attrs["strides"] = [int(s) for s in rng.integers(1, 5, 2)]
    shape = (1, int(rng.integers(10, 60)), int(rng.integers(5, 20)), int(rng.integers(5, 40)))
    x = rng.standard_normal(shape).astype(np.float32)
    sprinkle_specials(x, rng, 6)
    check_pools(x, attrs)


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_wide_rows(stride):
    """Outputs wider than NARROW_ROWS pool row by row."""
    x = RNG.standard_normal((1, 3, 9, 2 * pooling.pool_loops().NARROW_ROWS * stride + 5)).astype(np.float32)
    sprinkle_specials(x, RNG, 4)
    for pads in ([0, 0, 0, 0], [1, 2, 1, 0]):
        check_pools(x, {"kernel_shape": [3, 3], "strides": [stride, stride], "pads": pads})


def test_max_pool_nan_wins():
    x = RNG.standard_normal((1, 2, 8, 9)).astype(np.float32)
    x[0, 0, 3, 4] = np.nan
    x[0, 1, 0, 0] = np.nan
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    y = kernel("MaxPool", attrs, x.shape)(x)[0]
    np.testing.assert_array_equal(y, numpy_pool(x, attrs))  # equal NaNs in the same places
    assert np.isnan(y).sum() == 2 + 1  # two windows hold the first NaN, one the corner one


def test_window_wholly_in_padding():
    """ceil_mode with large pads: a last window that holds only padding gives -inf (max) and
    0/0 (average without the pads counted), as the numpy fold does."""
    x = RNG.standard_normal((1, 1, 3, 3)).astype(np.float32)
    attrs = {"kernel_shape": [2, 2], "strides": [3, 3], "pads": [1, 1, 1, 1], "ceil_mode": 1}
    np.testing.assert_array_equal(kernel("MaxPool", attrs, x.shape)(x)[0], numpy_pool(x, attrs))
    np.testing.assert_allclose(kernel("AveragePool", attrs, x.shape)(x)[0], numpy_pool(x, attrs, False))


def test_non_contiguous_input():
    x = RNG.standard_normal((2, 3, 12, 10)).astype(np.float32)[:, :, ::2, :]
    attrs = {"kernel_shape": [3, 2], "strides": [1, 2], "pads": [1, 0, 1, 1]}
    np.testing.assert_array_equal(kernel("MaxPool", attrs, x.shape)(x)[0], numpy_pool(x, attrs))


def test_float_inputs_take_compiled_loops(monkeypatch):
    loops = pooling.pool_loops()
    calls = []
    loop = loops.pool_2d
    monkeypatch.setattr(loops, "pool_2d", lambda *args: calls.append(args[10]) or loop(*args))  # is_max
    monkeypatch.setattr(pooling, "TINY_MAX_READS", 0)  # (a map this small is pooled over its taps by numpy)
    monkeypatch.setattr(pooling, "SMALL_MAX_READS", 0)
    x = RNG.standard_normal((1, 2, 6, 6))
    kernel("MaxPool", {"kernel_shape": [2, 2]}, x.shape)(x)
    kernel("AveragePool", {"kernel_shape": [3]}, x.shape[:3])(x[:, :, 0])
    assert calls == [True, False]


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.float16])
def test_other_dtypes_take_numpy(monkeypatch, dtype):
    """Integer and half-precision inputs never reach the compiled loops."""
    monkeypatch.setattr(pooling.pool_loops(), "pool_2d", None)
    x = RNG.integers(-100, 100, (1, 2, 7, 8)).astype(dtype)
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    y = kernel("MaxPool", attrs, x.shape)(x)[0]
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, numpy_pool(x.astype(np.float64), attrs).astype(dtype))
    if dtype == np.float16:
        y = kernel("AveragePool", attrs, x.shape)(x)[0]
        assert y.dtype == dtype
        np.testing.assert_allclose(y, numpy_pool(x.astype(np.float32), attrs, False), rtol=1e-3)


def test_three_d_and_indices_take_numpy(monkeypatch):
    monkeypatch.setattr(pooling.pool_loops(), "pool_2d", None)
    x = RNG.standard_normal((1, 2, 4, 5, 6)).astype(np.float32)
    attrs = {"kernel_shape": [2, 2, 2]}
    np.testing.assert_array_equal(kernel("MaxPool", attrs, x.shape)(x)[0], numpy_pool(x, attrs))
    x = x[:, :, 0]
    y, indices = kernel("MaxPool", {"kernel_shape": [2, 2]}, x.shape, n_outputs=2)(x)
    np.testing.assert_array_equal(y, numpy_pool(x, {"kernel_shape": [2, 2]}))
    assert indices.shape == y.shape


def numpy_lrn(x, size, alpha, beta, bias):
    """The numpy formula of the LRN kernel: zero-padded channel sums of squares, in channel order."""
    before = (size - 1) // 2
    squares = np.zeros((x.shape[0], x.shape[1] + size - 1, *x.shape[2:]), dtype=x.dtype)
    np.square(x, out=squares[:, before:before + x.shape[1]])
    total = squares[:, : x.shape[1]].copy()
    for offset in range(1, size):
        total += squares[:, offset:offset + x.shape[1]]
    return x / np.power(bias + (alpha / size) * total, beta)


@pytest.mark.parametrize("size", [1, 2, 5, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(2, 7, 5, 6), (1, 3, 4), (1, 12, 2, 3, 2)])
def test_lrn_matches_numpy_exactly(size, dtype, shape):
    attrs = {"size": size, "alpha": 3e-3, "beta": 0.8, "bias": 1.5}
    x = (RNG.standard_normal(shape) * 4).astype(dtype)
    y = kernel("LRN", attrs, x.shape, opset=13)(x)[0]
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, numpy_lrn(x, size, 3e-3, 0.8, 1.5))


def test_lrn_half_precision_takes_numpy():
    x = RNG.standard_normal((1, 6, 3, 3)).astype(np.float16)
    y = kernel("LRN", {"size": 3}, x.shape, opset=13)(x)[0]
    assert y.dtype == np.float16
    expected = numpy_lrn(x.astype(np.float32), 3, 1e-4, 0.75, 1.0).astype(np.float16)
    np.testing.assert_array_equal(y, expected)


@pytest.mark.skipif(not __import__("onnx_runtime_ep_cpu.compiled.gemm", fromlist=["AVAILABLE"]).AVAILABLE,
                    reason="compiled/windows.py's kernel needs an AVX-512 host")
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("pads,ceil_mode", [([0, 0, 0, 0], 0), ([1, 1, 1, 1], 0), ([0, 1, 1, 0], 1), ([0, 0, 0, 0], 1)])
@pytest.mark.parametrize("height,width", [(1, 5), (7, 7), (9, 16), (22, 17), (15, 40), (30, 3)])
def test_three_by_three_max_pools_read_the_planes_in_place(monkeypatch, stride, pads, ceil_mode, height, width):
    # float32 3x3 max pools of stride 1 or 2 run compiled/windows.py's kernel (7 output rows x 16 columns
    # per call, masked loads at the plane's edges): exactly numpy's maxima, NaN winning, infinities kept.
    from onnx_runtime_ep_cpu.compiled import jobs, windows, workers

    if height + pads[0] + pads[2] < 3 or width + pads[1] + pads[3] < 3:
        pytest.skip("no window fits")
    posted = []  # the windows kernel's routes: the pool job posted, or its loop called here (pooling.KeptPool)
    real, loop = workers.run, windows.pool_planes
    monkeypatch.setattr(workers, "run", lambda job, parts, *a: posted.append(job) or real(job, parts, *a))
    monkeypatch.setattr(windows, "pool_planes", lambda *a: posted.append(jobs.POOL) or loop(*a))
    monkeypatch.setattr(pooling, "TINY_MAX_READS", 0)  # (a map this small is pooled over its taps by numpy)
    monkeypatch.setattr(pooling, "SMALL_MAX_READS", 0)
    attrs = {"kernel_shape": [3, 3], "strides": [stride, stride], "pads": pads, "ceil_mode": ceil_mode}
    assert windows.takes_pool(3, 3, stride, stride, 1, 1)
    x = RNG.standard_normal((2, 3, height, width)).astype(np.float32)
    x[0, 0, 0, :2] = np.nan
    x[1, 2, -1, -1] = np.inf
    x[1, 1, height // 2, width // 2] = -np.inf
    (y,) = kernel("MaxPool", attrs, x.shape)(x)
    np.testing.assert_array_equal(y, numpy_pool(x, attrs).astype(np.float32))
    assert posted == [jobs.POOL]


@pytest.mark.skipif(not __import__("onnx_runtime_ep_cpu.compiled.gemm", fromlist=["AVAILABLE"]).AVAILABLE,
                    reason="compiled/windows.py's kernel needs an AVX-512 host")
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("pads,ceil_mode", [([0, 0, 0, 0], 0), ([1, 1, 1, 1], 0), ([0, 1, 1, 0], 1), ([0, 0, 0, 0], 1)])
@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("height,width", [(1, 5), (7, 7), (9, 16), (22, 17), (15, 40), (30, 3)])
def test_three_by_three_average_pools_read_the_planes_in_place(stride, pads, ceil_mode, include_pad, height, width):
    # float32 3x3 average pools of stride 1 or 2 run compiled/windows.py's kernel too: row-major sums of the
    # taps on the plane times the reciprocal tap counts (those of pooling.py, pads counted or not, a
    # ceil_mode overhang never), within rounding of numpy's quotients; the kernel called directly gives
    # the operator's result.
    from onnx_runtime_ep_cpu.compiled import windows

    if height + pads[0] + pads[2] < 3 or width + pads[1] + pads[3] < 3:
        pytest.skip("no window fits")
    attrs = {"kernel_shape": [3, 3], "strides": [stride, stride], "pads": pads, "ceil_mode": ceil_mode,
             "count_include_pad": include_pad}
    x = (RNG.standard_normal((2, 3, height, width)) * 3).astype(np.float32)
    (y,) = kernel("AveragePool", attrs, x.shape)(x)
    np.testing.assert_allclose(y, numpy_pool(x, attrs, bool(include_pad)), rtol=1e-6, atol=1e-6)
    direct = np.full(y.shape, np.nan, dtype=np.float32)
    oh, ow = y.shape[2:]
    # Counted rows and columns, in padded coordinates: the input alone, or with its declared pads.
    lo_h, hi_h = (0, height + pads[0] + pads[2]) if include_pad else (pads[0], pads[0] + height)
    lo_w, hi_w = (0, width + pads[1] + pads[3]) if include_pad else (pads[1], pads[1] + width)
    windows.pool(x.reshape(-1, height, width), direct.reshape(-1, oh, ow), stride, pads[0], pads[1], False,
                 lo_h, hi_h, lo_w, hi_w)
    np.testing.assert_array_equal(direct, y)


@pytest.mark.skipif(not __import__("onnx_runtime_ep_cpu.compiled.gemm", fromlist=["AVAILABLE"]).AVAILABLE,
                    reason="compiled/windows.py's kernel needs an AVX-512 host")
@pytest.mark.parametrize("include_pad", [None, False, True], ids=["max", "average", "average with pads"])
def test_a_plans_one_thread_pool_binds_the_windows_kernel(knobs, include_pad):
    """A bound plan's pool on one thread (pooling.bound_pool, one span) takes the pool job's 3x3 kernel
    (windows.pool_planes) where it takes the window, as the node's kernel does through the job, and pool_2d for
    other windows: the node's values, bit for bit."""
    from onnx_runtime_ep_cpu.compiled import windows

    knobs(threads=1)
    x = (RNG.standard_normal((1, 5, 23, 30)) * 3).astype(np.float32)
    for kernel_shape, stride, pads in (((3, 3), 2, (1, 1)), ((3, 3), 1, (0, 0)), ((2, 2), 2, (0, 0))):
        op = "MaxPool" if include_pad is None else "AveragePool"
        attrs = {"kernel_shape": list(kernel_shape), "strides": [stride] * 2, "pads": [*pads, *pads]}
        if include_pad is not None:
            attrs["count_include_pad"] = int(include_pad)
        (want,) = kernel(op, attrs, x.shape)(x)
        out = tuple((n + 2 * p - k) // stride + 1 for n, p, k in zip(x.shape[2:], pads, kernel_shape))
        geo = window.Geometry(x.shape[2:], kernel_shape, (stride, stride), (1, 1), pads, pads, out)
        y = np.full(want.shape, np.nan, np.float32)
        ((loop, arguments),) = pooling.bound_pool(pooling.pool_loops(), x, geo, include_pad, y)
        assert (loop is windows.pool_planes) == (kernel_shape == (3, 3))
        loop(*arguments)
        np.testing.assert_array_equal(y, want)
