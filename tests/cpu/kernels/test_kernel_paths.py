"""The CPU kernels' fast paths, each forced by its shapes and checked against a plain numpy restatement.

Conv picks among a 1x1 matmul, per-tap matmuls, a depthwise padded-row path and the general
im2col path; pooling folds windows without padding (a flat pass over whole rows where it can);
BatchNormalization folds its parameters once. Small column budgets force the blocked loops.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import blas, ops  # noqa: F401  (ops fills the registry)
from onnx_runtime_ep_cpu.algorithms import conv_blas, conv_path, window
from onnx_runtime_ep_cpu.registry import lookup

RNG = np.random.default_rng(7)


def rand(*shape, dtype=np.float32):
    return RNG.uniform(-1, 1, shape).astype(dtype)


def constant(array):
    """An array as the executor hands over initializers: read-only."""
    array.flags.writeable = False
    return array


def kernel(op, attrs, shapes, n_outputs=1, opset=17):
    node = Node(op, [f"in{i}" for i in range(len(shapes))], [f"out{i}" for i in range(n_outputs)],
                name="n", attrs=dict(attrs), opset=opset)
    return lookup(op, "", opset)(node, list(shapes), opset)


# -- numpy restatements of the specs -------------------------------------------------------------


def pads_of(attrs, rank):
    return attrs.get("pads", [0] * (2 * rank))


def conv_reference(x, w, b, attrs):
    """Direct convolution: every output pixel as a sum over its receptive field, in float64."""
    rank = x.ndim - 2
    strides = attrs.get("strides", [1] * rank)
    dilations = attrs.get("dilations", [1] * rank)
    pads = pads_of(attrs, rank)
    group = attrs.get("group", 1)
    x = np.pad(x.astype(np.float64), [(0, 0), (0, 0)] + [(pads[i], pads[rank + i]) for i in range(rank)])
    n, c = x.shape[:2]
    m, cg = w.shape[:2]
    kernel_shape = w.shape[2:]
    out = [(x.shape[2 + i] - (kernel_shape[i] - 1) * dilations[i] - 1) // strides[i] + 1 for i in range(rank)]
    y = np.zeros((n, m, *out))
    mg = m // group
    for pos in itertools.product(*(range(o) for o in out)):
        window = tuple(slice(p * s, p * s + (k - 1) * d + 1, d)
                       for p, s, k, d in zip(pos, strides, kernel_shape, dilations))
        patch = x[(slice(None), slice(None), *window)]  # (N, C, *kernel)
        for g in range(group):
            field = patch[:, g * cg:(g + 1) * cg].reshape(n, -1)
            y[(slice(None), slice(g * mg, (g + 1) * mg), *pos)] = field @ w[g * mg:(g + 1) * mg].reshape(mg, -1).T
    if b is not None:
        y += b.reshape(-1, *(1,) * rank)
    return y


def pool_reference(x, attrs, mode, include_pad=False):
    """Max or average over each window, by explicit loops; padding never wins a max, and an average
    counts the input (plus the declared pads with ``include_pad``), never a ceil_mode overhang."""
    rank = x.ndim - 2
    kernel_shape = attrs["kernel_shape"]
    strides = attrs.get("strides", [1] * rank)
    dilations = attrs.get("dilations", [1] * rank)
    pads = pads_of(attrs, rank)
    ceil = attrs.get("ceil_mode", 0)
    out = []
    for i in range(rank):
        room = x.shape[2 + i] + pads[i] + pads[rank + i] - ((kernel_shape[i] - 1) * dilations[i] + 1)
        o = (-(-room // strides[i]) if ceil else room // strides[i]) + 1
        if ceil and (o - 1) * strides[i] >= x.shape[2 + i] + pads[i]:
            o -= 1
        out.append(o)
    y = np.zeros(x.shape[:2] + tuple(out), dtype=np.float64)
    for pos in itertools.product(*(range(o) for o in out)):
        values, counted = [], 0
        for tap in itertools.product(*(range(k) for k in kernel_shape)):
            at = [p * s - pads[i] + t * d for i, (p, s, t, d) in enumerate(zip(pos, strides, tap, dilations))]
            inside = all(0 <= a < x.shape[2 + i] for i, a in enumerate(at))
            declared = all(-pads[i] <= a < x.shape[2 + i] + pads[rank + i] for i, a in enumerate(at))
            if inside:
                values.append(x[(slice(None), slice(None), *at)].astype(np.float64))
            counted += inside or (include_pad and declared)
        index = (slice(None), slice(None), *pos)
        if mode == "max":
            y[index] = np.max(values, axis=0)
        else:
            y[index] = np.sum(values, axis=0) / counted
    return y


def run_conv(x, w, b, attrs):
    inputs = [x, w] + ([] if b is None else [b])
    return kernel("Conv", attrs, [a.shape for a in inputs])(*inputs)[0]


def assert_conv(x, w, b, attrs):
    y = run_conv(x, w, b, attrs)
    expected = conv_reference(x, w, b, attrs)
    assert y.dtype == x.dtype and y.shape == expected.shape
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)


# -- Conv ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("attrs", [
    {"strides": [2, 2], "pads": [1, 0, 2, 1]},
    {"dilations": [2, 1], "pads": [2, 1, 2, 1]},
    {"strides": [2, 3], "group": 2},
    {"strides": [2, 2], "pads": [3, 4, 3, 2], "dilations": [2, 2]},  # whole tap rows and columns in the pads
])
def test_conv_im2col(with_bias, attrs):
    x, w = rand(2, 4, 9, 10), constant(rand(6, 4 // attrs.get("group", 1), 3, 3))
    assert_conv(x, w, constant(rand(6)) if with_bias else None, attrs)


def test_conv_im2col_in_row_blocks(monkeypatch, knobs):
    # A budget of a few output rows splits the column matrix into several blocks, the last one short.
    knobs(im2col_block_bytes=4 * 2 * 2 * (3 * 9 + 1) * 9)
    x, w, b = rand(2, 3, 11, 11), constant(rand(5, 3, 3, 3)), constant(rand(5))
    assert_conv(x, w, b, {"pads": [1, 1, 1, 1]})


@pytest.mark.parametrize("shape,kernel_shape", [((2, 3, 13), (4,)), ((1, 2, 5, 6, 7), (2, 3, 2))])
def test_conv_im2col_other_ranks(shape, kernel_shape):
    x = rand(*shape)
    w, b = constant(rand(4, shape[1], *kernel_shape)), constant(rand(4))
    assert_conv(x, w, b, {"pads": [1] * (2 * len(kernel_shape))})


@pytest.mark.parametrize("kernel_shape,attrs", [
    ((3, 3), {"pads": [1, 1, 1, 1]}),
    ((3, 5), {"pads": [0, 2, 2, 2]}),
    ((3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    ((1, 3), {"pads": [0, 1, 0, 1]}),
    ((3, 3), {"pads": [4, 0, 1, 2]}),  # whole tap rows above the image, a one-sided width pad
    ((2, 4), {"pads": [1, 3, 0, 0], "dilations": [3, 1]}),  # every tap wraps on the left
])
@pytest.mark.parametrize("rows_per_block", [1, 3, 99])
def test_conv_tight_rows_compiled_fill(monkeypatch, kernel_shape, attrs, rows_per_block, knobs):
    # Outputs as wide as the input: the compiled loop fills each column block straight from x;
    # checked exactly against the numpy fill (staged rows, wrapped columns zeroed) and against Conv.
    c, width = 3, 6
    depth = c * math.prod(kernel_shape)
    knobs(im2col_block_bytes=4 * depth * width * rows_per_block)
    geo = geometry(attrs, (7, width), kernel_shape)
    assert conv_blas.tight_fits(geo) and not conv_path.use_taps(geo, 1, c, 5, np.dtype(np.float32))
    x, w = rand(2, c, 7, width), constant(rand(5, c, *kernel_shape))
    assert_conv(x, w, constant(rand(5)), dict(attrs, kernel_shape=list(kernel_shape)))
    compiled, staged = (np.full((depth, 99 * width), np.nan, np.float32) for _ in range(2))
    conv_blas.tight_fill(x, geo, compiled)(1, 1, geo.out[0] - 1)
    monkeypatch.setattr(conv_blas, "takes_compiled", lambda *arrays: False)
    conv_blas.tight_fill(x, geo, staged)(1, 1, geo.out[0] - 1)
    np.testing.assert_array_equal(compiled, staged)


def test_conv_tight_rows_integers_take_the_numpy_fill():
    geo = geometry({"pads": [1, 1, 1, 1]}, (5, 4), (3, 3))
    x = np.arange(2 * 3 * 5 * 4).reshape(2, 3, 5, 4)
    w = np.arange(4 * 27).reshape(1, 4, 27) % 5 - 2
    y = conv_blas.conv_tight_rows(x, w, geo, False)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(y, conv_reference(x, w.reshape(4, 3, 3, 3), None, {"pads": [1, 1, 1, 1]}))


@pytest.mark.parametrize("m,group", [(12, 1), (3, 1), (8, 2), (6, 3)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_pointwise(m, group, with_bias):
    # More outputs than inputs per group puts the bias on a row of ones; fewer adds it afterwards.
    x, w = rand(2, 6, 5, 7), constant(rand(m, 6 // group, 1, 1))
    assert_conv(x, w, constant(rand(m)) if with_bias else None, {"group": group})


@pytest.mark.parametrize("attrs", [
    {"pads": [1, 1, 1, 1]},
    {"pads": [0, 2, 1, 0], "dilations": [2, 2]},
    {"kernel_shape": [2, 3]},
])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_by_taps(attrs, with_bias):
    c, m = 16, 3  # 4 * m <= c: one matmul per kernel tap
    kernel_shape = attrs.get("kernel_shape", [3, 3])
    x, w = rand(2, c, 8, 9), constant(rand(m, c, *kernel_shape))
    assert conv_path.use_taps(geometry(attrs, (8, 9), tuple(kernel_shape)), 1, c, m, np.dtype(np.float32))
    assert_conv(x, w, constant(rand(m)) if with_bias else None, attrs)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_by_taps_accumulating_in_blas(monkeypatch, dtype, with_bias, knobs):
    # A column matrix past the budget (made small here): per-tap products accumulated in place by BLAS.
    knobs(taps_column_bytes=1 << 10)
    c, m, attrs = 8, 24, {"pads": [1, 2, 1, 0], "dilations": [1, 2]}
    x, w = rand(2, c, 16, 18, dtype=dtype), constant(rand(m, c, 3, 3, dtype=dtype))
    assert blas.available(dtype)
    assert conv_path.use_taps(geometry(attrs, (16, 18), (3, 3)), 1, c, m, np.dtype(dtype))
    b = constant(rand(m, dtype=dtype)) if with_bias else None
    y = run_conv(x, w, b, attrs)
    expected = conv_reference(x, w, b, attrs)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(y, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("reachable", [True, False])
def test_gemm_accumulate_on_strided_views(monkeypatch, reachable):
    if not reachable:  # another BLAS: np.matmul and an add give the same sums
        monkeypatch.setattr(blas, "_gemm", lambda dtype: None)
    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 40)).astype(np.float32)
    a = rng.standard_normal((5, 6)).astype(np.float32)
    b = base[:, 3:33]  # a row stride wider than the rows, as a tap's run of padded rows
    c = np.ascontiguousarray(rng.standard_normal((5, 40)).astype(np.float32)[:, :30])
    expected = c + a @ b
    blas.gemm_accumulate(a, b, c)
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-5)
    # Not a BLAS layout (a column stride): still correct, through numpy.
    c2 = np.zeros((30, 5), np.float32).T
    blas.gemm_accumulate(a, b, c2)
    np.testing.assert_allclose(c2, a @ b, rtol=1e-5, atol=1e-5)


def geometry(attrs, in_shape, kernel_shape):
    return window.Window(Node("Conv", [], [], attrs=attrs), [], needs_kernel=False).resolve(in_shape, kernel_shape)


@pytest.mark.parametrize("attrs,size", [
    ({"pads": [1, 1, 1, 1]}, (12, 14)),  # even output: whole 2x2 tiles
    ({"pads": [0, 1, 1, 0]}, (14, 15)),  # odd output height, asymmetric pads: the last tile row is cropped
    ({"auto_pad": "VALID"}, (15, 15)),
])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv_winograd(attrs, size, with_bias, dtype):
    c, m = 192, 192
    assert conv_path.use_winograd(geometry(attrs, size, (3, 3)), 1, c, m)
    x, w = rand(2, c, *size, dtype=dtype), constant(rand(m, c, 3, 3, dtype=dtype))
    b = constant(rand(m, dtype=dtype)) if with_bias else None
    y = run_conv(x, w, b, attrs)
    pads = [0, 0, 0, 0] if "auto_pad" in attrs else attrs["pads"]
    expected = conv_reference(x, w, b, {"pads": pads})
    assert y.dtype == dtype and y.shape == expected.shape
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(y, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("multiplier", [1, 2])
@pytest.mark.parametrize("attrs", [{"pads": [1, 1, 1, 1]}, {"pads": [2, 0, 1, 2], "dilations": [1, 2]}])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_depthwise(monkeypatch, multiplier, attrs, with_bias, knobs):
    # A budget of two channels' columns makes several channel blocks, the last one short.
    knobs(depthwise_block_bytes=2 * 4 * 10 * 7 * 12)
    c = 5
    x, w = rand(2, c, 7, 9), constant(rand(c * multiplier, 1, 3, 3))
    attrs = {**attrs, "group": c}
    assert_conv(x, w, constant(rand(c * multiplier)) if with_bias else None, attrs)


@pytest.mark.parametrize("shape,kernel_shape,attrs", [
    ((2, 6, 9, 10), (3, 3), {"strides": [2, 2], "pads": [1, 0, 1, 1]}),
    ((2, 6, 11), (3,), {"pads": [1, 1]}),  # 1-D
    ((1, 6, 5, 6, 7), (3, 2, 2), {"strides": [1, 2, 1]}),  # 3-D
])
@pytest.mark.parametrize("multiplier", [1, 3])
def test_conv_depthwise_strided_windows(monkeypatch, shape, kernel_shape, attrs, multiplier, knobs):
    knobs(depthwise_block_bytes=2 * 4 * 10 * 30)  # a few channels per block
    c = shape[1]
    x, w, b = rand(*shape), constant(rand(c * multiplier, 1, *kernel_shape)), constant(rand(c * multiplier))
    assert_conv(x, w, b, {**attrs, "group": c})


def test_conv_float16_computes_in_float32():
    x, w, b = rand(1, 4, 6, 6, dtype=np.float16), constant(rand(8, 4, 3, 3, dtype=np.float16)), constant(rand(8))
    y = run_conv(x, w, b.astype(np.float16), {"pads": [1, 1, 1, 1]})
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, conv_reference(x, w, b.astype(np.float16), {"pads": [1, 1, 1, 1]}),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("c,m,group,kernel_shape", [
    (6, 12, 1, (3, 3)),  # im2col, bias folded into the weights
    (6, 12, 1, (1, 1)),  # pointwise
    (16, 2, 1, (3, 3)),  # per-tap weights
    (96, 64, 1, (3, 3)),  # Winograd weights
    (4, 4, 4, (3, 3)),  # depthwise
])
def test_conv_prepared_weights_follow_the_arrays(c, m, group, kernel_shape):
    attrs = {"group": group, "pads": [1, 1, 1, 1] if kernel_shape == (3, 3) else [0, 0, 0, 0]}
    x = rand(1, c, 12, 12)
    w, b = rand(m, c // group, *kernel_shape), rand(m)
    run = kernel("Conv", attrs, [x.shape, w.shape, b.shape])
    # Read-only constants are prepared once and reused while the same arrays come in...
    w_const, b_const = constant(w.copy()), constant(b.copy())
    first = run(x, w_const, b_const)[0]
    np.testing.assert_allclose(run(x, w_const, b_const)[0], first)
    # ...other arrays (new constants, or fed arrays changed in place) are prepared again.
    tol = {"rtol": 1e-5, "atol": 1e-5 * np.abs(first).max()}
    np.testing.assert_allclose(run(x, constant(2 * w), constant(2 * b))[0], 2 * first, **tol)
    fed_w, fed_b = w.copy(), b.copy()
    np.testing.assert_allclose(run(x, fed_w, fed_b)[0], first, **tol)
    fed_w *= 3
    fed_b *= 3
    np.testing.assert_allclose(run(x, fed_w, fed_b)[0], 3 * first, **tol)


# -- pooling -------------------------------------------------------------------------------------


POOL_CASES = [
    {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]},  # flat rows: width == out * stride
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},  # flat rows with stride 2
    {"kernel_shape": [3, 3], "strides": [2, 2]},  # odd width: per-axis views
    {"kernel_shape": [2, 3], "strides": [2, 2], "ceil_mode": 1},  # overhang past the input
    {"kernel_shape": [3, 2], "dilations": [2, 2], "pads": [2, 1, 0, 2]},
    {"kernel_shape": [1, 3], "strides": [2, 1], "pads": [0, 1, 0, 1]},  # a size-1 axis is a strided view
    {"kernel_shape": [4, 4], "pads": [3, 3, 3, 3]},  # border outputs whose windows are mostly padding
    {"kernel_shape": [3, 3], "dilations": [2, 2], "pads": [2, 2, 2, 2]},  # flat passes with dilated taps
    {"kernel_shape": [2, 2], "pads": [1, 1, 0, 0]},  # flat passes, taps on one side only
]


@pytest.mark.parametrize("attrs", POOL_CASES)
@pytest.mark.parametrize("width", [10, 11])
def test_max_pool(attrs, width):
    x = rand(2, 3, 9, width)
    y = kernel("MaxPool", attrs, [x.shape])(x)[0]
    np.testing.assert_array_equal(y, pool_reference(x, attrs, "max").astype(np.float32))


def test_max_pool_integers():
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    x = RNG.integers(-128, 128, (1, 2, 8, 8)).astype(np.int8)
    y = kernel("MaxPool", attrs, [x.shape])(x)[0]
    assert y.dtype == np.int8
    np.testing.assert_array_equal(y, pool_reference(x, attrs, "max").astype(np.int8))


@pytest.mark.parametrize("attrs", POOL_CASES)
@pytest.mark.parametrize("include_pad", [0, 1])
def test_average_pool(attrs, include_pad):
    x = rand(2, 3, 9, 10)
    attrs = {**attrs, "count_include_pad": include_pad}
    y = kernel("AveragePool", attrs, [x.shape])(x)[0]
    np.testing.assert_allclose(y, pool_reference(x, attrs, "average", bool(include_pad)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape,attrs", [
    ((2, 3, 12), {"kernel_shape": [3], "pads": [1, 1]}),
    ((1, 2, 5, 6, 7), {"kernel_shape": [3, 3, 3], "pads": [1, 1, 1, 1, 1, 1]}),  # flat passes on every axis
    ((1, 2, 5, 6, 8), {"kernel_shape": [3, 2, 3], "strides": [1, 2, 2], "pads": [1, 0, 1, 1, 0, 0]}),
])
def test_pooling_other_ranks(shape, attrs):
    x = rand(*shape)
    np.testing.assert_allclose(kernel("AveragePool", attrs, [x.shape])(x)[0], pool_reference(x, attrs, "average"),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(kernel("MaxPool", attrs, [x.shape])(x)[0],
                                  pool_reference(x, attrs, "max").astype(np.float32))


# -- BatchNormalization --------------------------------------------------------------------------


def batch_norm_reference(x, scale, bias, mean, var, epsilon):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    normalized = (x.astype(np.float64) - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + epsilon)
    return normalized * scale.reshape(shape) + bias.reshape(shape)


@pytest.mark.parametrize("shape", [(2, 5, 4, 3), (3, 5), (1, 5, 6)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_batch_norm_per_channel(shape, dtype):
    c = shape[1]
    params = [constant(rand(c, dtype=dtype)) for _ in range(3)] + [constant(RNG.uniform(0.5, 2, c).astype(dtype))]
    scale, bias, mean, var = params
    x = rand(*shape, dtype=dtype)
    run = kernel("BatchNormalization", {"epsilon": 1e-3}, [x.shape] + [p.shape for p in params], opset=15)
    expected = batch_norm_reference(x, scale, bias, mean, var, 1e-3)
    tol = 1e-2 if dtype == np.float16 else 1e-5
    for _ in range(2):  # the second call reuses the folded parameters
        y = run(x, *params)[0]
        assert y.dtype == dtype and y.shape == x.shape
        np.testing.assert_allclose(y, expected, rtol=tol, atol=tol)
    # New parameter arrays are folded again.
    doubled = constant(scale * 2)
    np.testing.assert_allclose(run(x, doubled, bias, mean, var)[0],
                               batch_norm_reference(x, doubled, bias, mean, var, 1e-3), rtol=tol, atol=tol)


def test_reference_helpers_agree_on_a_trivial_case():
    # A 1x1 all-ones convolution and a 1x1 pool are the identity: guards the references themselves.
    x = rand(1, 2, 3, 3)
    w = np.zeros((2, 2, 1, 1), np.float32)
    w[0, 0] = w[1, 1] = 1
    np.testing.assert_allclose(conv_reference(x, w, None, {}), x)
    np.testing.assert_allclose(pool_reference(x, {"kernel_shape": [1, 1]}, "max"), x)
    assert math.isclose(pool_reference(x, {"kernel_shape": [3, 3]}, "average")[0, 0, 0, 0], x[0, 0].mean(),
                        rel_tol=1e-6)



@pytest.mark.parametrize("c,m,group,kernel_shape,size", [
    (6, 12, 1, (3, 3), 8),  # im2col
    (6, 12, 1, (1, 1), 8),  # pointwise, bias on a row of ones
    (12, 6, 3, (1, 1), 8),  # pointwise, bias added
    (16, 2, 1, (3, 3), 8),  # per-tap matmuls
    (96, 64, 1, (3, 3), 12),  # Winograd
    (4, 4, 4, (3, 3), 8),  # depthwise
])
def test_conv_empty_batch(c, m, group, kernel_shape, size):
    attrs = {"group": group, "pads": [1, 1, 1, 1] if kernel_shape == (3, 3) else [0, 0, 0, 0]}
    y = run_conv(rand(0, c, size, size), constant(rand(m, c // group, *kernel_shape)), constant(rand(m)), attrs)
    assert y.shape == (0, m, size, size)


def test_pooling_and_batch_norm_empty_batch():
    x = rand(0, 3, 8, 8)
    assert kernel("MaxPool", POOL_CASES[0], [x.shape])(x)[0].shape == (0, 3, 8, 8)
    assert kernel("AveragePool", POOL_CASES[1], [x.shape])(x)[0].shape == (0, 3, 4, 4)
    params = [constant(rand(3)) for _ in range(3)] + [constant(np.ones(3, np.float32))]
    run = kernel("BatchNormalization", {}, [x.shape] + [p.shape for p in params], opset=15)
    assert run(x, *params)[0].shape == x.shape


# -- erf, Gelu, LayerNormalization, Softmax -------------------------------------------------------


def onnx_reference(op, inputs, attrs, opset, n_outputs=1):
    """One node through onnx's reference evaluator."""
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    names = [f"in{i}" for i in range(len(inputs))]
    outputs = [f"out{i}" for i in range(n_outputs)]
    graph = helper.make_graph(
        [helper.make_node(op, names, outputs, **attrs)], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
         for n, x in zip(names, inputs)],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, dict(zip(names, inputs)))


def exact_erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(np.asarray(x, np.float64))


def test_float32_erf_is_within_two_ulps_of_one_everywhere():
    from onnx_runtime_ep_cpu.algorithms.erf import erf_float32

    x = np.concatenate([np.linspace(-9, 9, 900_001), np.geomspace(1.2e-38, 9, 100_000),
                        -np.geomspace(1.2e-38, 9, 1000), np.geomspace(9, 3e38, 1000)]).astype(np.float32)
    want = exact_erf(x)
    got = erf_float32(x)
    assert got.dtype == np.float32
    error = np.abs(got - want)
    assert error.max() <= 2e-7
    small = (np.abs(want) < 0.5) & (x != 0)  # relative accuracy where erf is small, down to the smallest normal
    assert (error[small] / np.abs(want[small])).max() <= 4e-7
    # erf(x / sqrt(2)) for Gelu, folded into the coefficients.
    assert np.abs(erf_float32(x, scale=1 / math.sqrt(2)) - exact_erf(x.astype(np.float64) / math.sqrt(2))).max() <= 2e-7


def test_float32_erf_special_values():
    from onnx_runtime_ep_cpu.algorithms.erf import erf_float32

    subnormal = np.array([1e-45, 3e-45, 1e-40, -1e-39, 1.1e-38], np.float32)
    np.testing.assert_allclose(erf_float32(subnormal), exact_erf(subnormal).astype(np.float32), rtol=0, atol=3e-45)
    special = np.array([np.inf, -np.inf, 3.4e38, -3.4e38, 0.0, -0.0, np.nan], np.float32)
    with np.errstate(all="raise", under="ignore"):  # no warnings escape for infinities or huge values
        got = erf_float32(special)
    np.testing.assert_array_equal(got, [1, -1, 1, -1, 0, 0, np.nan])
    assert np.signbit(got[5]) and not np.signbit(got[4])
    scalar = erf_float32(np.float32(0.5))
    assert isinstance(scalar, np.ndarray) and scalar.shape == () and abs(scalar - math.erf(0.5)) < 1e-7


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_its_formula(dtype, approximate):
    huge = float(np.finfo(dtype).max) / 4
    x = np.concatenate([np.linspace(-10, 10, 20001), [0, -0.0, 1e-30, 60, -60, huge, -huge]]).astype(dtype)
    wide = x.astype(np.float64)
    with np.errstate(over="ignore"):
        if approximate == "none":
            want = 0.5 * wide * (1 + exact_erf(wide / math.sqrt(2)))
        else:
            want = 0.5 * wide * (1 + np.tanh(math.sqrt(2 / math.pi) * (wide + 0.044715 * wide**3)))
    with np.errstate(all="raise", under="ignore"):  # no warnings escape for huge |x|
        got = kernel("Gelu", {"approximate": approximate}, [x.shape], opset=20)(x)[0]
    assert got.dtype == dtype
    tol = {np.float16: 1e-3, np.float32: 4e-7, np.float64: 1e-14}[dtype]
    np.testing.assert_allclose(got, want.astype(dtype), rtol=tol, atol=tol)


LAYER_NORM_CASES = [
    # x shape, axis, scale/bias shape
    ((2, 3, 7), -1, (7,)),
    ((2, 3, 7), 1, (3, 7)),
    ((5, 6), 0, (5, 6)),
    ((3, 4, 5), -2, (1, 5)),  # parameters broadcast over the normalized axes
    ((1, 3, 5), 1, (1, 3, 5)),
]


def layer_norm_reference(x, scale, bias, axis, epsilon):
    """(Y, Mean, InvStdDev) in float64."""
    axes = tuple(range(axis % x.ndim, x.ndim))
    wide = x.astype(np.float64)
    mean = wide.mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(((wide - mean) ** 2).mean(axis=axes, keepdims=True) + epsilon)
    y = (wide - mean) * inv_std * scale
    return (y if bias is None else y + bias), mean, inv_std


@pytest.mark.parametrize("shape,axis,param_shape", LAYER_NORM_CASES)
@pytest.mark.parametrize("dtype,stash", [(np.float32, 1), (np.float16, 1), (np.float64, 11), (np.float32, 11),
                                         (np.float16, 10)])
def test_layer_norm_paths(shape, axis, param_shape, dtype, stash):
    # float32/float64 statistics take the row path (BLAS sums); float16 ones the generic reductions.
    x = (rand(*shape) * 3 + 2).astype(dtype)
    scale, bias = constant(rand(*param_shape, dtype=dtype)), constant(rand(*param_shape, dtype=dtype))
    attrs = {"axis": axis, "epsilon": 1e-3, "stash_type": stash}
    stash_dtype = {1: np.float32, 10: np.float16, 11: np.float64}[stash]
    tol = 1e-2 if np.float16 in (dtype, stash_dtype) else 1e-5
    for inputs in ([x, scale, bias], [x, scale]):
        original = x.copy()
        got = kernel("LayerNormalization", attrs, [i.shape for i in inputs], n_outputs=3)(*inputs)
        np.testing.assert_array_equal(x, original)
        assert [g.dtype for g in got] == [dtype, stash_dtype, stash_dtype]
        want = layer_norm_reference(*inputs, *([None] if len(inputs) == 2 else []), axis, 1e-3)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_allclose(g.astype(np.float64), w, rtol=tol, atol=tol)
        if stash == 1:  # onnx's reference implements only float32 statistics
            y = onnx_reference("LayerNormalization", inputs, attrs, 17)[0]
            np.testing.assert_allclose(got[0].astype(np.float64), y.astype(np.float64), rtol=tol, atol=tol)


def test_layer_norm_on_a_strided_input_and_a_growing_scale():
    x = rand(4, 6, 5).transpose(1, 0, 2)  # not contiguous
    scale, bias = constant(rand(2, 1, 1, 5)), constant(rand(5))  # scale broadcasts x up a rank
    got = kernel("LayerNormalization", {}, [x.shape, scale.shape, bias.shape])(x, scale, bias)[0]
    want = onnx_reference("LayerNormalization", [x, scale, bias], {}, 17)[0]
    assert got.shape == want.shape == (2, 6, 4, 5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,stash", [(np.float32, 1), (np.float64, 11)])
def test_a_planned_layer_norm_takes_its_loop_on_a_channels_last_view(monkeypatch, dtype, stash):
    # ConvNeXt's LayerNormalization reads Transpose(NCHW map, (0, 2, 3, 1)), a view: the planned loop runs on one
    # copy of it instead of the general path (compiled.layer_norm with its statistics' allocations).
    from onnx_runtime_ep_cpu.compiled import transformer

    planes = (rand(2, 16, 5, 3) * 3 + 1).astype(dtype)
    x = planes.transpose(0, 2, 3, 1)
    assert not x.flags.c_contiguous
    scale, bias = constant(rand(16, dtype=dtype)), constant(rand(16, dtype=dtype))
    run = kernel("LayerNormalization", {"epsilon": 1e-5, "stash_type": stash}, [x.shape, scale.shape, bias.shape])

    def general_path(*args):
        raise AssertionError("the general LayerNormalization path ran")

    monkeypatch.setattr(transformer, "layer_norm", general_path)
    got = run(x, scale, bias)[0]
    want = layer_norm_reference(x, scale, bias, -1, 1e-5)[0]
    assert got.shape == x.shape and got.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(x, planes.transpose(0, 2, 3, 1))  # the input is left as it was


@pytest.mark.parametrize("dtype,stash", [(np.float32, 1), (np.float64, 11)])
def test_a_planned_layer_norm_binds_its_loop_for_constant_parameters_only(dtype, stash):
    # A decode step's LayerNormalization (gpt2's last, one row) calls its loop through the entry point bound for
    # its constant scale and bias; another scale or bias (a writable array changed between calls, none), a
    # strided input and new inputs each call still give the float64 reference's values.
    from onnx_runtime_ep_cpu.algorithms.bound_loop import EntryOnce
    from onnx_runtime_ep_cpu.compiled import deferred, transformer

    scale, bias = constant(rand(64, dtype=dtype)), constant(rand(64, dtype=dtype))
    run = kernel("LayerNormalization", {"epsilon": 1e-5, "stash_type": stash}, [(1, 1, 64), scale.shape, bias.shape])
    writable = rand(64, dtype=dtype)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for call in range(7):
        x = (rand(1, 1, 64) * 3 + 1).astype(dtype)
        if call == 3:
            x = (rand(1, 64, 1) * 3 + 1).astype(dtype).transpose(0, 2, 1)[:, :, ::-1]
        params = (writable, None) if call in (4, 5) else (scale, bias)
        got = run(x, *params)[0]
        want = layer_norm_reference(x, params[0], params[1], -1, 1e-5)[0]
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
        writable *= -1.5  # (changed in place: a writable scale is never taken as the bound one)
    loop = transformer.layer_norm_rows
    if isinstance(loop, deferred.Loop) and loop.switched:
        bound = [cell.cell_contents for cell in run.__closure__ or () if isinstance(cell.cell_contents, EntryOnce)]
        assert bound and bound[0].entry is not None


@pytest.mark.parametrize("shape,axis", [((2, 3, 7), -1), ((2, 3, 7), 1), ((4, 5), 0), ((3, 1), -1), ((6,), 0),
                                        ((2, 3, 2, 9), 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_softmax_against_the_reference(shape, axis, dtype):
    x = (rand(*shape) * 20).astype(dtype)
    got = kernel("Softmax", {"axis": axis}, [x.shape], opset=13)(x)[0]
    want = onnx_reference("Softmax", [x], {"axis": axis}, 13)[0]
    assert got.dtype == dtype
    tol = 1e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_softmax_rows_with_nan_infinities_and_a_strided_input():
    x = np.array([[1, np.nan, 2], [-np.inf, 0, 1], [np.inf, 0, 1], [-1e30, 1e30, 0], [-np.inf] * 3], np.float32)
    with np.errstate(all="raise", under="ignore"):  # no warnings escape
        got = kernel("Softmax", {"axis": -1}, [x.shape], opset=13)(x)[0]
    # NaN, +inf and a fully masked row give NaN rows, as the spec's formula does.
    assert np.isnan(got[0]).all() and np.isnan(got[2]).all() and np.isnan(got[4]).all()
    np.testing.assert_allclose(got[1], [0, 1 / (1 + math.e), math.e / (1 + math.e)], rtol=1e-6)
    np.testing.assert_array_equal(got[3], [0, 1, 0])
    strided = rand(5, 8)[:, ::2]
    np.testing.assert_allclose(kernel("Softmax", {}, [strided.shape], opset=13)(strided)[0],
                               onnx_reference("Softmax", [strided], {}, 13)[0], rtol=1e-6)


@pytest.mark.parametrize("a_shape,b_shape", [((1, 1, 6), (6, 5)), ((3, 6), (6, 5)), ((6,), (6, 5)),
                                             ((2, 3, 6), (2, 6, 4)), ((6,), (6,)), ((3, 6), (6,))])
@pytest.mark.parametrize("dtypes", [(np.float32, np.float32), (np.float64, np.float64), (np.float16, np.float16),
                                    (np.float32, np.float64), (np.int32, np.int32)])
def test_matmul_fast_and_general_paths(a_shape, b_shape, dtypes):
    a, b = (rand(*a_shape) * 4).astype(dtypes[0]), constant((rand(*b_shape) * 4).astype(dtypes[1]))
    got = kernel("MatMul", {}, [a.shape, b.shape], opset=13)(a, b)[0]
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert isinstance(got, np.ndarray) and got.dtype == a.dtype and got.shape == want.shape
    tol = 1e-2 if np.float16 in dtypes else 1e-5
    np.testing.assert_allclose(got.astype(np.float64), want if a.dtype.kind == "f" else want.astype(a.dtype), rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("shape,axis,sizes", [((2, 10), -1, [3, 7]), ((4, 3, 5), 0, [1, 0, 3]),
                                              ((1, 1, 12), 2, [4, 4, 4])])
def test_split_returns_views_cut_at_the_sizes(shape, axis, sizes):
    x = constant(rand(*shape))
    parts = kernel("Split", {"axis": axis}, [x.shape, (len(sizes),)], n_outputs=len(sizes), opset=13)(
        x, np.array(sizes, np.int64))
    for got, want in zip(parts, np.split(x, np.cumsum(sizes)[:-1], axis=axis), strict=True):
        assert got.shape == want.shape and np.shares_memory(got, x) == (got.size > 0)
        np.testing.assert_array_equal(got, want)


def test_taps_path_takes_over_from_large_column_matrices():
    same = {"pads": [1, 1, 1, 1]}
    f32 = np.dtype(np.float32)
    assert conv_path.use_taps(geometry(same, (112, 112), (3, 3)), 1, 32, 32, f32)  # 14 MiB of columns
    assert not conv_path.use_taps(geometry(same, (56, 56), (3, 3)), 1, 64, 64, f32)  # 7 MiB: im2col
    assert not conv_path.use_taps(geometry(same, (112, 112), (3, 3)), 2, 32, 32, f32)  # grouped
    assert not conv_path.use_taps(geometry({"strides": [2, 2]}, (112, 112), (3, 3)), 1, 64, 64, f32)
