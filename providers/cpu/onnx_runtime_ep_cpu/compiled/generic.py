"""numpy equivalents of compiled loops, which serve a session's first calls while numba loads (deferred.py).

Each takes the loop's arguments and has its effects: the same outputs written in place, the same return
value, the same error for what the loop refuses. Results agree with the loop's within float32 rounding (the
loops sum in another order, and some fuse multiply-adds or compute exp by their own polynomial); the test
tests/cpu/kernels/test_generic_loops.py holds each pair to that. Keyed by the loop's module and name.
"""

from __future__ import annotations

import numpy as np

from .epilogue import CLIP, LEAKY_RELU, RELU
from .generic_conv import GENERIC_CONV, activate_in_place
from .generic_rows import softmax_rows_float32_


def _rows_like(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``values`` (M,) shaped to be stored into the first M entries of ``out`` (1-D, or (M, 1))."""
    return values.reshape((values.shape[0],) + (1,) * (out.ndim - 1))


def add_bias_residual_(y, bias, residual):
    if bias.shape[0] > 0:
        y += bias
    if residual.shape[0] > 0:
        y += residual


def _sigmoid_float32(z):
    """exp_float32.sigmoid_float32 over an array: e / (1 + e) with e = exp(-|z|), numerator 1 for z >= 0."""
    e = np.exp(-np.abs(z))
    return np.where(z >= np.float32(0), np.float32(1), e) / (np.float32(1) + e)


def gelu_float32_(x, bias, y, residual, coefficients):
    top = coefficients.shape[0] - 1
    if top not in (6, 1):
        raise ValueError("gelu_float32_ takes a series of degree 6 (erf form) or 1 (tanh form)")
    c = [np.float32(value) for value in coefficients]
    u = x + bias if bias.shape[0] > 0 else x.astype(np.float32, copy=True)
    q = u * u
    if top == 6:
        series = ((((((q * c[6] + c[5]) * q + c[4]) * q + c[3]) * q + c[2]) * q + c[1]) * q + c[0]) * u
    else:
        series = (q * c[1] + c[0]) * u
    result = u * _sigmoid_float32(np.float32(2) * series)
    if residual.shape[0] > 0:
        result += residual
    y[...] = result


def layer_norm_rows(x, scale, bias, epsilon, y, mean_out, inv_std_out):
    rows, cols = x.shape
    dtype = x.dtype.type
    mean = x.sum(axis=1) / dtype(cols)
    centred = x - mean[:, None]
    inv_std = dtype(1) / np.sqrt(np.einsum("ij,ij->i", centred, centred) / dtype(cols) + dtype(epsilon))
    mean_out[:rows] = _rows_like(mean, mean_out)
    inv_std_out[:rows] = _rows_like(inv_std, inv_std_out)
    centred *= inv_std[:, None]
    centred *= scale
    if bias.shape[0] > 0:
        centred += bias
    y[...] = centred


def mask_and_shift_(scores, scale, mask, first_row):
    heads, rows, cols = scores.shape
    shifted = scores * scale
    if mask.shape[0] > 0:
        shifted += mask[first_row:first_row + rows, :cols]
    # transformer.row_max: the largest non-NaN value, -inf if none
    peak = np.fmax.reduce(shifted, axis=2, initial=-np.inf)
    scores[...] = shifted
    if not np.all(np.abs(peak) < np.inf):
        return False
    scores -= peak[:, :, None]
    return True


def log_softmax_rows_float32_(x, y):
    peak = np.fmax.reduce(x, axis=1, initial=-np.inf)[:, None]  # transformer.row_max: the largest non-NaN value
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # NaN and overflow as in the loop
        shifted = x - peak
        np.subtract(shifted, np.log(np.exp(shifted).sum(axis=1, keepdims=True)), out=y)


def divide_by_row_sums_(weights, y):
    y /= weights.sum(axis=1, keepdims=True)


def rms_norm(x, weight, epsilon, out):
    dtype = x.dtype.type
    mean_square = np.einsum("ij,ij->i", x, x) * dtype(1.0 / max(x.shape[1], 1)) + dtype(epsilon)
    out[...] = x / np.sqrt(mean_square)[:, None] * weight


def skip_rms_norm(a, b, weight, epsilon, out, total):
    np.add(a, b, out=total)
    rms_norm(total, weight, epsilon, out)


def few_query_attention_float32(q, k, v, scale, bias, y):
    group = q.shape[1] // k.shape[1]
    if group > 1:  # grouped-query attention: query head h reads KV head h // group
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.matmul(q, k.transpose(0, 1, 3, 2))
    scores *= scale
    if bias.size > 0:
        scores += bias
    peak = np.fmax.reduce(scores, axis=3, initial=-np.inf)
    if not np.all(np.abs(peak) < np.float32(np.inf)):
        return False
    scores -= peak[..., None]
    np.exp(scores, out=scores)
    out = np.matmul(scores, v)
    out /= scores.sum(axis=3)[..., None]
    y[...] = out
    return True


def few_query_attention_prefix_float32(q, k, v, keys, scale, bias, y):
    return few_query_attention_float32(q, k[:, :, :keys], v[:, :, :keys], scale, bias, y)


def append_attention_float32(q, k, v, key_rows, value_rows, length, scale, bias, y):
    rows = k.shape[2]
    key_rows[:, :, length:length + rows] = k
    value_rows[:, :, length:length + rows] = v
    return few_query_attention_prefix_float32(q, key_rows, value_rows, length + rows, scale, bias, y)


def rotate_half(q, cos, sin, table_row, half, out):
    d = q.shape[1]
    rest = d - half
    c, s = cos[table_row, :d], sin[table_row, :d]
    rotated = np.empty_like(q)
    rotated[:, :rest] = -q[:, half:]
    rotated[:, rest:] = q[:, :d - rest]
    out[...] = q * c + rotated * s


def swish_mul_float32(a, b, alpha, out):
    out[...] = a * _sigmoid_float32(np.float32(alpha) * a) * b


def gelu_mul_float32(x, gate, coefficients, out):
    gelu = np.empty((1, x.shape[0]), np.float32)
    gelu_float32_(x.reshape(1, -1), np.empty(0, np.float32), gelu, np.empty(0, np.float32), coefficients)
    np.multiply(gelu[0], gate, out=out)


def conv_gathered(x, w, b, table, y):
    images, groups, size = x.shape
    source = np.zeros((images, groups, size + 1), x.dtype)  # the trailing zero: taps in the padding
    source[:, :, :size] = x
    cols = source[:, :, table]  # (N, G, P, D)
    out = np.matmul(w, cols.transpose(0, 1, 3, 2))  # (G, Mg, D) x (N, G, D, P)
    if b.size > 0:
        out += b[:, :, None]
    y[...] = out


def fill_columns(x, cols, kh, kw, sh, sw, dh, dw, top, left, row_start, row_count, ow_count):
    """One strided copy of every tap at once from a zero-bordered copy of the rows the taps reach: gathering
    every tap through index arrays and masking the padding cost a stem convolution's first run several
    milliseconds, and a copy per tap a Python step per tap."""
    channels, height, width = x.shape
    if row_count <= 0 or ow_count <= 0:
        return
    row_lo, col_lo = row_start * sh - top, -left  # the input position of the first output's first tap
    rows = (row_count - 1) * sh + (kh - 1) * dh + 1
    columns = (ow_count - 1) * sw + (kw - 1) * dw + 1
    source = np.zeros((channels, rows, columns), x.dtype)
    r0, r1 = max(row_lo, 0), min(row_lo + rows, height)
    c0, c1 = max(col_lo, 0), min(col_lo + columns, width)
    if r0 < r1 and c0 < c1:
        source[:, r0 - row_lo:r1 - row_lo, c0 - col_lo:c1 - col_lo] = x[:, r0:r1, c0:c1]
    across, along = cols.strides  # column rows (channel, tap), then output positions (row, column)
    target = np.lib.stride_tricks.as_strided(cols, (channels, kh, kw, row_count, ow_count),
                                             (kh * kw * across, kw * across, across, ow_count * along, along))
    by_channel, by_row, by_column = source.strides  # tap (i, j) of output (r, c) reads source[:, i*dh + r*sh, ...]
    taps = np.lib.stride_tricks.as_strided(source, (channels, kh, kw, row_count, ow_count),
                                           (by_channel, dh * by_row, dw * by_column, sh * by_row, sw * by_column),
                                           writeable=False)
    np.copyto(target, taps)


def fill_patches(x, cols, kh, kw):
    channels, _, width = x.shape
    ow = width // kw
    oh = cols.shape[1] // ow
    patches = x[:, :oh * kh, :ow * kw].reshape(channels, oh, kh, ow, kw).transpose(0, 2, 4, 1, 3)
    cols[:channels * kh * kw] = patches.reshape(channels * kh * kw, oh * ow)


def fill_tight_columns(x, cols, kh, kw, dh, dw, top, left, row_start, row_count):
    fill_columns(x, cols, kh, kw, 1, 1, dh, dw, top, left, row_start, row_count, x.shape[2])


def bias_residual_activation(y, bias, residual, bounds, first, end):
    part = y[:, :, first:end]  # a view: every step below writes y in place
    if bias.shape[0] > 0:  # without a bias nothing is added (adding zero would turn -0.0 into +0.0)
        np.add(part, bias[None, :, None], out=part)
    if residual.shape[0] > 0:
        np.add(part, residual[:, :, first:end], out=part)
    activate_in_place(part, bounds)


def channel_affine(x, factor, shift, out, kind, params):
    values = x * factor[None, :, None] + shift[None, :, None]
    # compiled/epilogue._activate_row: comparisons with NaN are false, so NaN passes through
    if kind == RELU:
        values = np.where(values < 0, values.dtype.type(0), values)
    elif kind == CLIP:  # max then min, so the upper bound wins where low > high
        values = np.where(values < params[0], params[0], values)
        values = np.where(values > params[1], params[1], values)
    elif kind == LEAKY_RELU:
        values = np.where(values < 0, values * params[0], values)
    out[...] = values


def lrn_base(x, base, size, before, scale, bias):
    channels = x.shape[1]
    squares = x * x
    total = np.zeros(x.shape, x.dtype)
    for c in range(channels):  # the window's channels summed in order, as the loop does
        lo, hi = max(0, c - before), min(channels, c - before + size)
        total[:, c] = squares[:, lo]
        for k in range(lo + 1, hi):
            total[:, c] += squares[:, k]
    base[...] = bias + scale * total


def plane_means(x, y, divisor):
    y[...] = x.sum(axis=1) / divisor


def _tap_counts(outs, k, s, d, lo, hi, dtype):
    """compiled/pooling.tap_counts: how many taps of each output land on padded positions [lo, hi)."""
    positions = np.arange(outs)[:, None] * s + np.arange(k)[None, :] * d
    return ((positions >= lo) & (positions < hi)).sum(axis=1).astype(dtype)


def pool_2d(x, y, kh, kw, sh, sw, dh, dw, ph, pw, is_max, lo_h, hi_h, lo_w, hi_w):
    planes, height, width = x.shape
    out_h, out_w = y.shape[1], y.shape[2]
    span_h, span_w = (out_h - 1) * sh + (kh - 1) * dh + 1, (out_w - 1) * sw + (kw - 1) * dw + 1
    identity = -np.inf if is_max else 0
    padded = np.full((planes, max(span_h, ph + height), max(span_w, pw + width)), identity, x.dtype)
    padded[:, ph:ph + height, pw:pw + width] = x
    total = None
    for t in range(kh):
        for u in range(kw):
            tap = padded[:, t * dh:t * dh + (out_h - 1) * sh + 1:sh, u * dw:u * dw + (out_w - 1) * sw + 1:sw]
            total = tap.copy() if total is None else np.maximum(total, tap) if is_max else total + tap
    if not is_max:
        counts = _tap_counts(out_h, kh, sh, dh, lo_h, hi_h, y.dtype)[:, None] \
            * _tap_counts(out_w, kw, sw, dw, lo_w, hi_w, y.dtype)[None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            total = total / counts
    y[...] = total


_COMPILED = "onnx_runtime_ep_cpu.compiled."
_TRANSFORMER, _DECODER = _COMPILED + "transformer.", _COMPILED + "decoder."
_FLOAT = {
    _TRANSFORMER + "add_bias_residual_": add_bias_residual_,
    _TRANSFORMER + "gelu_float32_": gelu_float32_,
    _TRANSFORMER + "layer_norm_rows": layer_norm_rows,
    _TRANSFORMER + "mask_and_shift_": mask_and_shift_,
    _TRANSFORMER + "divide_by_row_sums_": divide_by_row_sums_,
    _TRANSFORMER + "softmax_rows_float32_": softmax_rows_float32_,
    _DECODER + "rms_norm": rms_norm,
    _DECODER + "skip_rms_norm": skip_rms_norm,
    _DECODER + "few_query_attention_float32": few_query_attention_float32,
    _DECODER + "few_query_attention_prefix_float32": few_query_attention_prefix_float32,
    _DECODER + "append_attention_float32": append_attention_float32,
    _DECODER + "rotate_half": rotate_half,
    _DECODER + "swish_mul_float32": swish_mul_float32,
    _DECODER + "gelu_mul_float32": gelu_mul_float32,
    _COMPILED + "log_softmax.log_softmax_rows_float32_": log_softmax_rows_float32_,
    _COMPILED + "smallconv.conv_gathered": conv_gathered,
    _COMPILED + "im2col.fill_columns": fill_columns,
    _COMPILED + "im2col.fill_patches": fill_patches,
    _COMPILED + "im2col.fill_tight_columns": fill_tight_columns,
    _COMPILED + "epilogue.bias_residual_activation": bias_residual_activation,
    _COMPILED + "epilogue.channel_affine": channel_affine,
    _COMPILED + "lrn.lrn_base": lrn_base,
    _COMPILED + "pooling.plane_means": plane_means,
    _COMPILED + "pooling.pool_2d": pool_2d,
    **GENERIC_CONV,
}


def twin(key: str):
    """The numpy equivalent of the loop ``key`` (its module and name), or None. The integer loops' twins
    (generic_int8.py) are imported at the first key the float ones do not hold: a float model's first runs never
    import them."""
    found = _FLOAT.get(key)
    if found is None:
        from .generic_int8 import GENERIC_INT8

        found = GENERIC_INT8.get(key)
    return found


def __getattr__(name: str):
    if name == "GENERIC":  # every twin by key (tests and tools), the integer ones imported with it
        from .generic_int8 import GENERIC_INT8

        return {**_FLOAT, **GENERIC_INT8}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
