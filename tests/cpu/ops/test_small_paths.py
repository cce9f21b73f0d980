"""The small-tensor paths of a streaming model's operators (silero-vad's frames): the direct convolution for
few output positions (compiled/smallconv.py), the compiled LSTM (compiled/lstm.py) and Pad by slice copies.
Each is checked against a float64 reference within a stated bound, and shown to be the path taken."""

from __future__ import annotations

import numpy as np
import pytest
from node_reference import F32, F64, ours, rand, reference
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.algorithms import conv_path
from onnx_runtime_ep_cpu.compiled import deferred, smallconv
from onnx_runtime_ep_cpu.compiled import lstm as compiled_lstm
from onnx_runtime_ep_cpu.ops import pad as pad_ops
from reference64 import assert_within, gamma


def _spy(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


# -- Conv with few output positions -------------------------------------------------------------

DIRECT_CASES = [
    # x shape, w shape, attrs: silero-vad's STFT and encoder convolutions (scaled down), then other windows
    ((1, 1, 96), (18, 1, 32), {"strides": [16]}),
    ((1, 9, 3), (8, 9, 3), {"pads": [1, 1]}),
    ((1, 8, 3), (4, 8, 3), {"pads": [1, 1], "strides": [2]}),
    ((2, 4, 1), (8, 4, 3), {"pads": [1, 1]}),
    ((1, 6, 1), (1, 6, 1), {"pads": [0, 1]}),
    ((2, 4, 5), (6, 2, 3), {"group": 2, "pads": [2, 0], "dilations": [2]}),
    ((1, 3, 4, 3), (5, 3, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 1]}),
    ((1, 2, 2, 2, 3), (3, 2, 2, 2, 2), {"pads": [1, 0, 0, 0, 1, 0]}),
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", DIRECT_CASES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_direct_conv_is_taken_and_within_the_rounding_bound(monkeypatch, x_shape, w_shape, attrs, with_bias, dtype):
    # The register tiles (AVX2) and the packed convolution (AVX-512) take 2-D float32 convolutions first
    # (test_direct_conv.py and test_packed_conv.py cover them).
    monkeypatch.setattr(conv_path, "direct_tiles_apply", lambda geo, group, x, w: False)
    monkeypatch.setattr(conv_path, "packed_conv_applies", lambda geo, group, x: False)
    calls = _spy(monkeypatch, smallconv, "conv_gathered")
    x, w = rand(*x_shape, dtype=dtype), rand(*w_shape, dtype=dtype)
    b = rand(w_shape[0], dtype=dtype) if with_bias else None
    inputs = [x, w] + ([b] if with_bias else [])
    (got,) = ours("Conv", inputs, attrs, 11)
    assert calls, "the direct convolution was not taken"
    exact = reference("Conv", [a.astype(F64) for a in inputs], attrs, 11)[0]
    magnitude = reference("Conv", [np.abs(a).astype(F64) for a in inputs], attrs, 11)[0]
    depth = int(np.prod(w_shape[1:])) + 1
    assert got.dtype == dtype and got.shape == exact.shape
    assert_within(got, exact, gamma(depth, dtype) * magnitude)


def test_direct_conv_leaves_wide_outputs_and_deep_windows_to_the_products(monkeypatch):
    calls = _spy(monkeypatch, smallconv, "conv_gathered")
    ours("Conv", [rand(1, 4, 40), rand(6, 4, 3)], {"pads": [1, 1]}, 11)  # 40 positions
    ours("Conv", [rand(1, 2048, 4), rand(4, 2048, 3)], {"pads": [1, 1]}, 11)  # columns past the cache bound
    ours("Conv", [rand(1, 8, 4, 4), rand(6, 8, 1, 1)], {}, 11)  # pointwise: one product as it is
    assert not calls


# -- LSTM ---------------------------------------------------------------------------------------


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def _lstm_reference(x, w, r, b, h0, c0, direction, layout):
    """LSTM in float64, one step at a time, straight from the operator's definition."""
    x, w, r = (np.asarray(a, F64) for a in (x, w, r))
    if layout:
        x = x.swapaxes(0, 1)
        h0 = None if h0 is None else h0.swapaxes(0, 1)
        c0 = None if c0 is None else c0.swapaxes(0, 1)
    seq, batch = x.shape[:2]
    dirs, hidden = w.shape[0], r.shape[-1]
    y = np.zeros((seq, dirs, batch, hidden))
    finals = []
    for d in range(dirs):
        h = np.zeros((batch, hidden)) if h0 is None else np.asarray(h0[d], F64)
        c = np.zeros((batch, hidden)) if c0 is None else np.asarray(c0[d], F64)
        bias = np.zeros(8 * hidden) if b is None else np.asarray(b[d], F64)
        steps = range(seq - 1, -1, -1) if direction == "reverse" or d == 1 else range(seq)
        for t in steps:
            gates = x[t] @ w[d].T + h @ r[d].T + bias[:4 * hidden] + bias[4 * hidden:]
            i, o, f, g = (gates[:, k * hidden:(k + 1) * hidden] for k in range(4))
            c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
            h = _sigmoid(o) * np.tanh(c)
            y[t, d] = h
        finals.append((h, c))
    yh, yc = np.stack([f[0] for f in finals]), np.stack([f[1] for f in finals])
    if layout:
        return y.transpose(2, 0, 1, 3), yh.swapaxes(0, 1), yc.swapaxes(0, 1)
    return y, yh, yc


LSTM_CASES = [
    # direction, layout, seq, batch, inputs, hidden, with bias and states
    ("forward", 0, 1, 1, 16, 16, True),  # a streaming model's one step
    ("forward", 0, 1, 1, 8, 4, False),
    ("bidirectional", 0, 3, 2, 5, 6, True),
    ("reverse", 1, 4, 3, 6, 5, True),
    ("forward", 0, 12, 2, 7, 8, True),  # past _PROJECT_IN_LOOP: the input projection is one product
    ("bidirectional", 1, 9, 2, 3, 4, False),
]


@pytest.mark.parametrize("direction,layout,seq,batch,inputs,hidden,full", LSTM_CASES)
@pytest.mark.parametrize("dtype", [F32, F64])
def test_compiled_lstm_is_taken_and_matches_float64(monkeypatch, direction, layout, seq, batch, inputs, hidden,
                                                     full, dtype):
    # As after the background loader's switch with no guard: the compiled loop runs (compiled here where numba's
    # cache misses it); while numba loads, or where a miss must not compile on this thread, numpy would serve.
    monkeypatch.setattr(deferred, "numpy_first", lambda *kinds: False)
    monkeypatch.setattr(deferred.state, "guarding", False)  # (set only when a session opens deferral)
    calls = _spy(monkeypatch, compiled_lstm, "lstm_steps")
    dirs = 2 if direction == "bidirectional" else 1
    x = rand(*((batch, seq) if layout else (seq, batch)), inputs, dtype=dtype)
    w, r = rand(dirs, 4 * hidden, inputs, dtype=dtype), rand(dirs, 4 * hidden, hidden, dtype=dtype)
    state_shape = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    b = rand(dirs, 8 * hidden, dtype=dtype) if full else None
    h0 = rand(*state_shape, dtype=dtype) if full else None
    c0 = rand(*state_shape, dtype=dtype) if full else None
    attrs = {"hidden_size": hidden, "direction": direction, "layout": layout}
    got = ours("LSTM", [x, w, r, b, None, h0, c0], attrs, 14, n_outputs=3)
    assert len(calls) == dirs, "the compiled LSTM was not taken"
    # Each step's sums have inputs + hidden + 2 terms of magnitude below inputs + hidden + 2; the state
    # carries a step's rounding into the next, so the bound grows with the sequence.
    tol = gamma(inputs + hidden + 2, dtype) * (inputs + hidden + 2) * 4 * seq
    for g, e in zip(got, _lstm_reference(x, w, r, b, h0, c0, direction, layout)):
        assert g.dtype == dtype and g.shape == e.shape
        assert_within(g, e, np.full(e.shape, tol))


def test_lstm_of_a_large_batch_keeps_the_batched_products(monkeypatch):
    calls = _spy(monkeypatch, compiled_lstm, "lstm_steps")
    x, w, r, b = rand(3, 6, 5, dtype=F64), rand(1, 16, 5, dtype=F64), rand(1, 16, 4, dtype=F64), rand(1, 32, dtype=F64)
    got = ours("LSTM", [x, w, r, b], {"hidden_size": 4}, 14, n_outputs=3)
    assert not calls
    for g, e in zip(got, _lstm_reference(x, w, r, b, None, None, "forward", 0)):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)


def test_lstm_with_peepholes_keeps_the_numpy_path(monkeypatch):
    calls = _spy(monkeypatch, compiled_lstm, "lstm_steps")
    x, w, r, b = rand(2, 1, 3), rand(1, 8, 3), rand(1, 8, 2), rand(1, 16)
    p = rand(1, 6)
    got = ours("LSTM", [x, w, r, b, None, None, None, p], {"hidden_size": 2}, 14, n_outputs=3)
    expected = reference("LSTM", [x, w, r, b, None, None, None, p], {"hidden_size": 2}, 14, n_outputs=3)
    assert not calls
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


# -- Pad by slices --------------------------------------------------------------------------------

PAD_CASES = [
    ((1, 512), [0, 64, 0, 64]),  # silero-vad's reflection of a frame
    ((3, 4), [1, 2, 2, 1]),
    ((2, 3, 4), [1, 0, 2, 1, 2, 3]),
    ((5,), [4, 4]),
    ((3, 4), [-1, 1, 1, -2]),
]


@pytest.mark.parametrize("shape,pads", PAD_CASES)
@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_by_slices_equals_numpy_pad(monkeypatch, shape, pads, mode):
    rank = len(shape)
    begin, end = pads[:rank], pads[rank:]
    width = [(max(b, 0), max(e, 0)) for b, e in zip(begin, end)]
    kept = tuple(slice(max(-b, 0), d - max(-e, 0)) for d, b, e in zip(shape, begin, end))
    x = rand(*shape)
    limit = {"reflect": 1, "wrap": 0}.get(mode)
    if limit is not None and any(max(b, e) > d - limit for d, (b, e) in zip(x[kept].shape, width)):
        pytest.skip("a reflection or wrap wider than the axis: numpy.pad's own case")
    calls = _spy(monkeypatch, pad_ops, "_pad_by_slices")
    extra = {"constant_values": F32(1.5)} if mode == "constant" else {}
    expected = np.pad(x[kept], width, mode=mode, **extra)
    value = [np.array(1.5, F32)] if mode == "constant" else []
    (got,) = ours("Pad", [x, np.array(pads, np.int64), *value], {"mode": mode}, 19)
    assert calls
    np.testing.assert_array_equal(got, expected)


def test_pad_wider_than_the_axis_reflects_repeatedly():
    x = rand(3)
    (got,) = ours("Pad", [x, np.array([5, 4], np.int64)], {"mode": "reflect"}, 19)
    np.testing.assert_array_equal(got, np.pad(x, (5, 4), mode="reflect"))


# -- Slice, Squeeze and Gather: what a call keeps from the last ------------------------------------


def _frozen(*values):
    for value in values:
        value.flags.writeable = False
    return values


def _kernel(op, n_inputs, opset=13, **attrs):
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.registry import lookup

    node = Node(op, [f"in{i}" for i in range(n_inputs)], ["out"], name="n", attrs=attrs, opset=opset)
    return lookup(op, "", opset)(node, [None] * n_inputs, opset)


def test_slice_keeps_the_index_of_constant_bounds_per_input_shape():
    kernel = _kernel("Slice", 5)
    starts, ends, axes, steps = _frozen(np.array([1, -1]), np.array([-1, 0]), np.array([1, 2]), np.array([1, -1]))
    for shape in [(2, 5, 4), (2, 5, 4), (3, 7, 6)]:
        x = rand(*shape)
        (got,) = kernel(x, starts, ends, axes, steps)
        np.testing.assert_array_equal(got, x[:, 1:-1, :0:-1])


def test_slice_rereads_bounds_that_may_change():
    kernel = _kernel("Slice", 3)
    x, starts, ends = rand(6), np.array([1]), np.array([4])
    np.testing.assert_array_equal(kernel(x, starts, ends)[0], x[1:4])
    starts[0] = 2  # the same (writeable) array with other contents
    np.testing.assert_array_equal(kernel(x, starts, ends)[0], x[2:4])


def test_squeeze_follows_the_input_shape_and_axes():
    kernel = _kernel("Squeeze", 2)
    (axes,) = _frozen(np.array([0, -1]))
    for shape in [(1, 3, 1), (1, 5, 1), (1, 1, 1)]:
        assert kernel(np.zeros(shape), axes)[0].shape == np.squeeze(np.zeros(shape), axis=(0, 2)).shape
    assert kernel(np.zeros((2, 1, 1)), np.array([1, 2]))[0].shape == (2,)


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("index", [np.array(1), np.array(-1), np.array([0]), np.array(1, np.int32)])
def test_gather_of_one_index_equals_take(axis, index):
    x = rand(3, 2, 4)
    (got,) = _kernel("Gather", 2, axis=axis)(x, index)
    expected = np.take(x, index, axis=axis)
    assert isinstance(got, np.ndarray) and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_gather_of_one_index_of_a_vector_is_an_array_and_out_of_range_raises():
    (got,) = _kernel("Gather", 2)(np.array([4, 5, 6]), np.array(2))
    assert isinstance(got, np.ndarray) and got.shape == () and got == 6
    with pytest.raises(InvalidArgumentError, match="an index is out of range"):
        _kernel("Gather", 2)(np.array([4, 5, 6]), np.array(3))


def test_unsqueeze_follows_the_input_shape_and_axes_that_change():
    kernel = _kernel("Unsqueeze", 2)
    (axes,) = _frozen(np.array([0, -1]))
    for shape in [(3,), (3,), (2, 5)]:
        assert kernel(np.zeros(shape), axes)[0].shape == (1, *shape, 1)
    changing = np.array([0])
    assert kernel(np.zeros((2,)), changing)[0].shape == (1, 2)
    changing[0] = 1  # the same writeable array with other contents
    assert kernel(np.zeros((2,)), changing)[0].shape == (2, 1)


# -- Sigmoid and Pow(x, 2): the same values with fewer temporaries ---------------------------------


@pytest.mark.parametrize("dtype", [np.float16, F32, F64])
def test_sigmoid_and_square_give_the_formulas_values(dtype):
    x = (np.random.default_rng(1).standard_normal(4096) * 40).astype(dtype)
    x[:5] = [np.inf, -np.inf, np.nan, 0, -0.0]
    (got,) = _kernel("Sigmoid", 1)(x)
    with np.errstate(all="ignore"):
        formula = 1 / (1 + np.exp(-x))  # in x's dtype: what the kernel computed before, operation by operation
        exact = 1 / (1 + np.exp(-x.astype(F64)))
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, formula)
    if dtype != np.float16:  # (float16's exp underflows: the formula's own error)
        np.testing.assert_allclose(got.astype(F64), exact, rtol=4 * np.finfo(dtype).eps, atol=np.finfo(dtype).tiny,
                                   equal_nan=True)
    for exponent in (np.array(2, np.int64), np.array([2.0], dtype)):
        (square,) = _kernel("Pow", 2)(x, exponent)
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal(square, np.power(x, exponent).astype(dtype))
        assert square.dtype == dtype


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("shape", [(), (1, 1, 1), (1, 128), (4, 256)])
def test_small_sigmoid_runs_the_compiled_loop_within_a_few_ulps(monkeypatch, dtype, shape):
    from onnx_runtime_ep_cpu.compiled import sigmoid as compiled_sigmoid
    from onnx_runtime_ep_cpu.ops import elementwise

    monkeypatch.setattr(elementwise, "_sigmoid_loop", [None])
    calls = _spy(monkeypatch, compiled_sigmoid, "sigmoid_into")
    x = np.asarray(np.random.default_rng(2).standard_normal(shape) * 40, dtype)
    if x.size >= 3:
        x.reshape(-1)[:3] = [np.inf, -np.inf, np.nan]
    (got,) = _kernel("Sigmoid", 1)(x)
    assert calls and got.dtype == dtype and got.shape == x.shape
    with np.errstate(all="ignore"):
        exact = 1 / (1 + np.exp(-x.astype(F64)))
    np.testing.assert_allclose(got.astype(F64), exact, rtol=4 * np.finfo(dtype).eps, atol=np.finfo(dtype).tiny,
                               equal_nan=True)
