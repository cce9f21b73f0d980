"""Neural-network kernels: convolution, pooling, normalization, softmax family, dropout, Gelu.

Sliding-window ops share :class:`_Window` (attribute parsing and validation) and :class:`_Geometry`
(pads and output size resolved for one input shape). Convolution is im2col over a strided view of
the padded input followed by batched ``np.matmul`` calls; pooling folds strided views of the
padded input one spatial dim at a time, so Python only loops over the (few) kernel taps.
"""

from __future__ import annotations

import math
from functools import reduce

import numpy as np
from numpy.lib.stride_tricks import as_strided
from numpy.polynomial import chebyshev
from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from ..registry import register

_AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


# -- shared helpers ------------------------------------------------------------------------------


def _graph_error(node, attr: str, message: str) -> InvalidGraphError:
    return InvalidGraphError(f"node {node.name!r} ({node.op_type}): attribute {attr!r} {message}")


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """Half-precision floats (float16, bfloat16) compute in float32: numpy has no fast float16
    BLAS, and float32 accumulation is more accurate; other types compute as they are."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 and dtype.kind not in "biu" else dtype


def _upcast(x: np.ndarray) -> np.ndarray:
    return x.astype(_compute_dtype(x.dtype), copy=False)


def _wants(node, index: int) -> bool:
    """Whether the node lists an optional output at ``index``."""
    return len(node.outputs) > index


def _normalize_axis(node, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): axis {axis} is out of range for a rank-{rank} input; "
            f"expected a value in [{-rank}, {rank - 1}]"
        )
    return axis % rank


def _channel_param(p: np.ndarray, ndim: int, dtype) -> np.ndarray:
    """A per-channel (C,) or per-activation (C, D1, ...) parameter shaped to broadcast over (N, C, ...)."""
    return p.astype(dtype, copy=False).reshape(p.shape + (1,) * (ndim - 1 - p.ndim))


def _stash_dtype(node) -> np.dtype:
    stash_type = int(node.attr("stash_type", 1))
    try:
        dtype = DataType(stash_type)
    except ValueError:
        dtype = None
    if dtype not in (DataType.FLOAT, DataType.DOUBLE, DataType.FLOAT16, DataType.BFLOAT16):
        raise _graph_error(node, "stash_type", f"is {stash_type}; expected a float type (1, 10, 11 or 16)")
    return dtype.numpy


# -- sliding-window geometry ---------------------------------------------------------------------


class _Geometry:
    """Pads and output size of a sliding window over one concrete spatial input shape."""

    def __init__(self, in_shape, kernel, strides, dilations, begin, end, out):
        self.in_shape = in_shape
        self.kernel = kernel
        self.strides = strides
        self.dilations = dilations
        self.begin = begin  # pads before each spatial dim
        self.end = end  # declared (or auto) pads after each spatial dim
        self.out = out
        # The padded array must hold the last window; with ceil_mode it may overhang the declared pads.
        self.reach = tuple(
            max(0, (o - 1) * s + (k - 1) * d + 1 - n - b)
            for o, s, k, d, n, b in zip(out, strides, kernel, dilations, in_shape, begin)
        )

    @property
    def unpadded(self) -> bool:
        return not any(self.begin) and not any(self.reach)

    def pad(self, x: np.ndarray, value) -> np.ndarray:
        """``x`` with its trailing spatial dims padded by ``value`` (only the borders are filled)."""
        if self.unpadded:
            return x
        rank = len(self.in_shape)
        lead = x.ndim - rank
        shape = x.shape[:lead] + tuple(n + b + r for n, b, r in zip(self.in_shape, self.begin, self.reach))
        xp = np.empty(shape, dtype=x.dtype)
        inner = tuple(slice(b, b + n) for b, n in zip(self.begin, self.in_shape))
        xp[(Ellipsis, *inner)] = x
        for i, (b, n) in enumerate(zip(self.begin, self.in_shape)):
            before = (slice(None),) * (lead + i)
            xp[(*before, slice(0, b))] = value
            xp[(*before, slice(b + n, None))] = value
        return xp

    def reduce_windows(self, xp: np.ndarray, combine) -> np.ndarray:
        """Fold every window of padded ``xp`` with ``combine`` (np.maximum or np.add) into a fresh
        (*lead, *out) array.

        Max and sum over a box are separable, so this folds one spatial dim at a time, each pass
        combining the k strided views of that dim's taps: k1 + k2 + ... whole-array operations
        instead of k1 * k2 * ..., and numpy runs every one of them.
        """
        y = xp
        lead = xp.ndim - len(self.kernel)
        for i, (k, s, d, o) in enumerate(zip(self.kernel, self.strides, self.dilations, self.out)):
            before = (slice(None),) * (lead + i)
            taps = [y[(*before, slice(t * d, t * d + (o - 1) * s + 1, s))] for t in range(k)]
            if k == 1:
                y = taps[0]
                continue
            y = combine(taps[0], taps[1])
            for tap in taps[2:]:
                combine(y, tap, out=y)
        return y.copy() if np.may_share_memory(y, xp) else y

    def windows(self, xp: np.ndarray) -> np.ndarray:
        """Read-only view (*lead, *kernel, *out) of padded ``xp``; reshaping it is the im2col copy."""
        rank = len(self.kernel)
        lead = xp.ndim - rank
        spatial = xp.strides[lead:]
        strides = (
            xp.strides[:lead]
            + tuple(st * d for st, d in zip(spatial, self.dilations))
            + tuple(st * s for st, s in zip(spatial, self.strides))
        )
        return as_strided(xp, xp.shape[:lead] + self.kernel + self.out, strides, writeable=False)

    def tap_counts(self, include_pad: bool) -> np.ndarray | None:
        """How many taps of each output window land on counted positions, or None if all of them do.

        Counted positions are the input, plus the declared pads when ``include_pad``; a ceil_mode
        overhang never counts.
        """
        per_dim = []
        for o, k, s, d, n, b, e in zip(
            self.out, self.kernel, self.strides, self.dilations, self.in_shape, self.begin, self.end
        ):
            lo, hi = (0, b + n + e) if include_pad else (b, b + n)
            pos = np.arange(o)[:, None] * s + np.arange(k)[None, :] * d
            per_dim.append(((pos >= lo) & (pos < hi)).sum(axis=1))
        counts = reduce(np.multiply.outer, per_dim)
        return None if np.all(counts == math.prod(self.kernel)) else counts


class _Window:
    """The window attributes of a Conv/ConvTranspose/pooling node, validated once per node."""

    def __init__(self, node, shapes, *, needs_kernel: bool):
        self.node = node
        auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
        if auto_pad not in _AUTO_PADS:
            raise _graph_error(node, "auto_pad", f"is {auto_pad!r}; expected one of {', '.join(_AUTO_PADS)}")
        self.auto_pad = auto_pad
        self.ceil_mode = bool(node.attr("ceil_mode", 0))
        kernel = node.attr("kernel_shape")
        if kernel is None and needs_kernel:
            raise _graph_error(node, "kernel_shape", "is missing; pooling operators require it")
        self.kernel = None if kernel is None else tuple(int(k) for k in kernel)
        self.strides = self._ints("strides", 1)
        self.dilations = self._ints("dilations", 1)
        self.pads = self._ints("pads", 0)
        if self.kernel is not None and any(k < 1 for k in self.kernel):
            raise _graph_error(node, "kernel_shape", f"is {list(self.kernel)}; expected positive sizes")
        rank = self._known_rank(shapes)
        if rank is not None:
            self.check_rank(rank)
        self._cache: dict[tuple, _Geometry] = {}

    def _ints(self, name: str, minimum: int) -> tuple[int, ...] | None:
        value = self.node.attr(name)
        if value is None:
            return None
        value = tuple(int(v) for v in value)
        if any(v < minimum for v in value):
            raise _graph_error(self.node, name, f"is {list(value)}; expected values >= {minimum}")
        return value

    def _known_rank(self, shapes) -> int | None:
        if self.kernel is not None:
            return len(self.kernel)
        if shapes and shapes[0] is not None:
            return len(shapes[0]) - 2
        return None

    def check_rank(self, rank: int) -> None:
        for name, value, size in (
            ("kernel_shape", self.kernel, rank),
            ("strides", self.strides, rank),
            ("dilations", self.dilations, rank),
            ("pads", self.pads, 2 * rank),
        ):
            if value is not None and len(value) != size:
                raise _graph_error(
                    self.node, name, f"has {len(value)} values; expected {size} for {rank} spatial dims"
                )

    def resolve(self, in_shape: tuple[int, ...], kernel: tuple[int, ...] | None = None) -> _Geometry:
        """The geometry for spatial input shape ``in_shape`` (``kernel`` from the weight when given)."""
        key = (in_shape, kernel)
        geometry = self._cache.get(key)
        if geometry is None:
            geometry = self._cache[key] = self._resolve(in_shape, kernel)
        return geometry

    def _resolve(self, in_shape, kernel) -> _Geometry:
        rank = len(in_shape)
        if self.kernel is not None and kernel is not None and self.kernel != tuple(kernel):
            raise _graph_error(
                self.node, "kernel_shape", f"is {list(self.kernel)} but the weight has kernel {list(kernel)}"
            )
        kernel = tuple(kernel if kernel is not None else self.kernel)
        self.check_rank(rank)
        strides = self.strides or (1,) * rank
        dilations = self.dilations or (1,) * rank
        pads = self.pads or (0,) * (2 * rank)
        begin, end, out = [], [], []
        for i, (n, k, s, d) in enumerate(zip(in_shape, kernel, strides, dilations)):
            span = (k - 1) * d + 1
            if self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
                o = -(-n // s)
                total = max(0, (o - 1) * s + span - n)
                b = total // 2 if self.auto_pad == "SAME_UPPER" else total - total // 2
                e = total - b
            else:
                b, e = (0, 0) if self.auto_pad == "VALID" else (pads[i], pads[rank + i])
                room = n + b + e - span
                o = (-(-room // s) if self.ceil_mode else room // s) + 1
                # A ceil_mode window must start inside the input or the leading pad.
                if self.ceil_mode and (o - 1) * s >= n + b:
                    o -= 1
            if o < 1:
                raise InvalidArgumentError(
                    f"node {self.node.name!r} ({self.node.op_type}): spatial input size {n} with pads "
                    f"({b}, {e}) is smaller than the dilated kernel size {span}; feed a larger input"
                )
            begin.append(b)
            end.append(e)
            out.append(o)
        return _Geometry(tuple(in_shape), kernel, tuple(strides), tuple(dilations),
                         tuple(begin), tuple(end), tuple(out))


# -- convolution ---------------------------------------------------------------------------------


def _group(node) -> int:
    group = int(node.attr("group", 1))
    if group < 1:
        raise _graph_error(node, "group", f"is {group}; expected a positive group count")
    return group


def _check_channels(node, x_channels: int, w_shape, group: int, transpose: bool) -> None:
    # Conv weights are (M, C/group, *k); ConvTranspose weights are (C, M/group, *k).
    w_in = w_shape[0] if transpose else w_shape[1] * group
    if x_channels != w_in or w_shape[0] % group:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): input has {x_channels} channels but the weight "
            f"{tuple(w_shape)} with group={group} expects {w_in}"
        )


# Column-buffer size per matmul: small enough to stay in cache (large images run in row blocks).
_IM2COL_BYTES = 1 << 22


def _im2col_matmul(weights: np.ndarray, windows: np.ndarray, geo: _Geometry) -> np.ndarray:
    """(G, Mg, Cg*K) weights times the im2col matrix of ``windows`` (N, G, Cg, *kernel, *out).

    The column matrix is copied out of the strided view one block of output rows at a time, each
    block feeding one batched matmul that writes straight into its rows of the result.
    """
    n, group = windows.shape[:2]
    mg = weights.shape[1]
    y = np.empty((n, group, mg, *geo.out), dtype=weights.dtype)
    row_bytes = windows.itemsize * math.prod(windows.shape) // geo.out[0]
    rows = max(1, min(geo.out[0], _IM2COL_BYTES // row_bytes))
    for start in range(0, geo.out[0], rows):
        block = (Ellipsis, slice(start, start + rows)) + (slice(None),) * (len(geo.out) - 1)
        cols = windows[block].reshape(n, group, weights.shape[2], -1)
        np.matmul(weights, cols, out=y[block].reshape(n, group, mg, -1))
    return y


@register("Conv", since=1)
def conv(node, shapes, opset):
    window = _Window(node, shapes, needs_kernel=False)
    group = _group(node)

    def kernel(x, w, b=None):
        _check_channels(node, x.shape[1], w.shape, group, transpose=False)
        geo = window.resolve(x.shape[2:], w.shape[2:])
        dtype = _compute_dtype(x.dtype)
        n, m = x.shape[0], w.shape[0]
        cg = x.shape[1] // group
        xc = x.astype(dtype, copy=False)
        weights = w.astype(dtype, copy=False).reshape(group, m // group, -1)
        if all(k == 1 for k in geo.kernel) and geo.unpadded:
            # 1x1 convolution: a plain matmul over the (strided) input pixels.
            xs = xc[(Ellipsis, *(slice(None, None, s) for s in geo.strides))]
            y = np.matmul(weights, xs.reshape(n, group, cg, -1))
        else:
            xp = geo.pad(xc, 0)
            y = _im2col_matmul(weights, geo.windows(xp.reshape(n, group, cg, *xp.shape[2:])), geo)
        y = y.reshape(n, m, *geo.out)
        if b is not None:
            y += _channel_param(b, y.ndim, dtype)
        return (y.astype(x.dtype, copy=False),)

    return kernel


class _TransposeWindow:
    """ConvTranspose geometry: output size, the pads cropped off the full scatter, per input shape."""

    def __init__(self, node, shapes):
        self.node = node
        self.window = _Window(node, shapes, needs_kernel=False)
        self.output_padding = node.attr("output_padding")
        self.output_shape = node.attr("output_shape")
        self._cache: dict[tuple, tuple] = {}

    def resolve(self, in_shape, kernel):
        key = (in_shape, kernel)
        if key not in self._cache:
            self._cache[key] = self._resolve(in_shape, kernel)
        return self._cache[key]

    def _resolve(self, in_shape, kernel):
        w = self.window
        rank = len(in_shape)
        w.check_rank(rank)
        strides = w.strides or (1,) * rank
        dilations = w.dilations or (1,) * rank
        extra = tuple(int(v) for v in self.output_padding) if self.output_padding is not None else (0,) * rank
        if len(extra) != rank:
            raise _graph_error(self.node, "output_padding", f"has {len(extra)} values; expected {rank}")
        full = tuple(s * (n - 1) + p + (k - 1) * d + 1
                     for s, n, p, k, d in zip(strides, in_shape, extra, kernel, dilations))
        target = None
        if self.output_shape is not None:
            target = tuple(int(v) for v in self.output_shape)[-rank:]
            if len(target) != rank:
                raise _graph_error(self.node, "output_shape", f"has {len(target)} values; expected {rank}")
        elif w.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            target = tuple(n * s for n, s in zip(in_shape, strides))
        if target is not None:
            # Pads are derived from the requested output size; SAME_UPPER crops less at the start.
            totals = [f - t for f, t in zip(full, target)]
            if w.auto_pad == "SAME_UPPER":
                begin = tuple(t // 2 for t in totals)
            else:
                begin = tuple(t - t // 2 for t in totals)
            out = target
        else:
            pads = (0,) * (2 * rank) if w.auto_pad == "VALID" or w.pads is None else w.pads
            begin = pads[:rank]
            out = tuple(f - b - e for f, b, e in zip(full, begin, pads[rank:]))
        if any(o < 1 for o in out):
            raise InvalidArgumentError(
                f"node {self.node.name!r} (ConvTranspose): pads crop the whole output {list(full)}; "
                f"expected a positive output size"
            )
        return tuple(strides), tuple(dilations), full, begin, out


@register("ConvTranspose", since=1)
def conv_transpose(node, shapes, opset):
    window = _TransposeWindow(node, shapes)
    group = _group(node)

    def kernel(x, w, b=None):
        _check_channels(node, x.shape[1], w.shape, group, transpose=True)
        in_shape, kshape = x.shape[2:], w.shape[2:]
        strides, dilations, full, begin, out = window.resolve(in_shape, kshape)
        dtype = _compute_dtype(x.dtype)
        n, c = x.shape[:2]
        m = w.shape[1] * group
        # Every input pixel times every kernel tap: (N, G, Mg*K, pixels), one matmul.
        xg = x.astype(dtype, copy=False).reshape(n, group, c // group, -1)
        wg = w.astype(dtype, copy=False).reshape(group, c // group, -1).transpose(0, 2, 1)
        cols = np.matmul(wg, xg).reshape(n, m, *kshape, *in_shape)
        # Scatter-add each tap into a buffer covering both the full result and the requested output.
        origin = tuple(max(0, -bg) for bg in begin)
        size = tuple(o + max(f, bg + t) for o, f, bg, t in zip(origin, full, begin, out))
        buf = np.zeros((n, m, *size), dtype=dtype)
        for offset in np.ndindex(*kshape):
            index = tuple(
                slice(o + k * d, o + k * d + (i - 1) * s + 1, s)
                for o, k, d, i, s in zip(origin, offset, dilations, in_shape, strides)
            )
            buf[(Ellipsis, *index)] += cols[(slice(None), slice(None), *offset)]
        crop = tuple(slice(o + bg, o + bg + t) for o, bg, t in zip(origin, begin, out))
        y = buf[(Ellipsis, *crop)]
        if b is not None:
            y = y + _channel_param(b, y.ndim, dtype)
        return (np.ascontiguousarray(y).astype(x.dtype, copy=False),)

    return kernel


# -- pooling -------------------------------------------------------------------------------------


def _lowest(dtype: np.dtype):
    return np.iinfo(dtype).min if np.issubdtype(dtype, np.integer) else -np.inf


def _max_pool_with_indices(geo: _Geometry, xp: np.ndarray, x_shape, column_major: bool):
    """Max and its flat index into the unpadded input, row-major (or column-major over spatial dims)."""
    n, c = x_shape[:2]
    rank = len(geo.kernel)
    flat = geo.windows(xp).reshape(n, c, -1, *geo.out)
    arg = flat.argmax(axis=2)
    y = np.take_along_axis(flat, arg[:, :, None], axis=2)[:, :, 0]
    taps = np.unravel_index(arg, geo.kernel)
    spatial = np.zeros(arg.shape, dtype=np.int64)
    order = range(rank - 1, -1, -1) if column_major else range(rank)
    for i in order:
        grid = np.arange(geo.out[i]).reshape((-1,) + (1,) * (rank - 1 - i))
        pos = grid * geo.strides[i] - geo.begin[i] + taps[i] * geo.dilations[i]
        pos = np.clip(pos, 0, geo.in_shape[i] - 1)  # only an all-padding window could point outside
        spatial = spatial * geo.in_shape[i] + pos
    planes = np.arange(n * c, dtype=np.int64).reshape((n, c) + (1,) * rank) * math.prod(geo.in_shape)
    return y, planes + spatial


@register("MaxPool", since=1)
def max_pool(node, shapes, opset):
    window = _Window(node, shapes, needs_kernel=True)
    storage_order = int(node.attr("storage_order", 0))
    if storage_order not in (0, 1):
        raise _graph_error(node, "storage_order", f"is {storage_order}; expected 0 (row major) or 1")
    with_indices = _wants(node, 1)

    def kernel(x):
        geo = window.resolve(x.shape[2:])
        xp = geo.pad(x, _lowest(x.dtype))
        if with_indices:
            return _max_pool_with_indices(geo, xp, x.shape, column_major=storage_order == 1)
        return (geo.reduce_windows(xp, np.maximum),)

    return kernel


@register("AveragePool", since=1)
def average_pool(node, shapes, opset):
    window = _Window(node, shapes, needs_kernel=True)
    include_pad = bool(node.attr("count_include_pad", 0))

    def kernel(x):
        geo = window.resolve(x.shape[2:])
        total = geo.reduce_windows(geo.pad(_upcast(x), 0), np.add)
        counts = geo.tap_counts(include_pad)
        if counts is None:
            total /= math.prod(geo.kernel)
        else:
            total /= counts
        return (total.astype(x.dtype, copy=False),)

    return kernel


def _lp_power(node) -> float:
    p = node.attr("p", 2)
    if p <= 0:
        raise _graph_error(node, "p", f"is {p}; expected a positive norm order")
    return p


def _lp_root(total: np.ndarray, p: float) -> np.ndarray:
    return np.sqrt(total) if p == 2 else np.power(total, 1.0 / p)


def _lp_terms(x: np.ndarray, p: float) -> np.ndarray:
    x = _upcast(x)
    return np.square(x) if p == 2 else np.power(np.abs(x), p)


@register("LpPool", since=1)
def lp_pool(node, shapes, opset):
    window = _Window(node, shapes, needs_kernel=True)
    p = _lp_power(node)

    def kernel(x):
        geo = window.resolve(x.shape[2:])
        total = geo.reduce_windows(geo.pad(_lp_terms(x, p), 0), np.add)
        return (_lp_root(total, p).astype(x.dtype, copy=False),)

    return kernel


def _spatial_axes(x: np.ndarray) -> tuple[int, ...]:
    return tuple(range(2, x.ndim))


@register("GlobalAveragePool", since=1)
def global_average_pool(node, shapes, opset):
    def kernel(x):
        y = x.mean(axis=_spatial_axes(x), keepdims=True, dtype=_compute_dtype(x.dtype))
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("GlobalMaxPool", since=1)
def global_max_pool(node, shapes, opset):
    return lambda x: (x.max(axis=_spatial_axes(x), keepdims=True),)


@register("GlobalLpPool", since=1)
def global_lp_pool(node, shapes, opset):
    p = _lp_power(node)

    def kernel(x):
        total = _lp_terms(x, p).sum(axis=_spatial_axes(x), keepdims=True)
        return (_lp_root(total, p).astype(x.dtype, copy=False),)

    return kernel


# -- normalization -------------------------------------------------------------------------------


def _affine_normalize(x, mean, var, scale, bias, epsilon, dtype):
    """scale * (x - mean) / sqrt(var + epsilon) + bias, folded into one multiply-add over x."""
    factor = scale / np.sqrt(var + dtype.type(epsilon))
    return x.astype(dtype, copy=False) * factor + (bias - mean * factor)


def _batch_norm_stats(x, axes, mean, var, momentum, dtype):
    """Batch mean/variance and the running statistics updated with them (training mode)."""
    xc = x.astype(dtype, copy=False)
    batch_mean = xc.mean(axis=axes, keepdims=True)
    batch_var = xc.var(axis=axes, keepdims=True)
    running_mean = mean * momentum + batch_mean.reshape(mean.shape) * (1 - momentum)
    running_var = var * momentum + batch_var.reshape(var.shape) * (1 - momentum)
    return batch_mean, batch_var, running_mean, running_var


def _batch_norm_kernel(node, training: bool, spatial: bool):
    """BatchNormalization returning as many outputs as the node lists.

    Training mode normalizes with the batch statistics and returns the updated running mean/var
    (and, before opset 14, the batch mean/var). Inference mode passes the running statistics
    through for any optional outputs listed, as they do not change.
    """
    epsilon = float(node.attr("epsilon", 1e-5))
    momentum = float(node.attr("momentum", 0.9))
    n_outputs = len(node.outputs)

    def kernel(x, scale, bias, mean, var):
        dtype = _compute_dtype(x.dtype)
        s, b, mu, v = (_channel_param(p, x.ndim, dtype) for p in (scale, bias, mean, var))
        if not training:
            y = _affine_normalize(x, mu, v, s, b, epsilon, dtype).astype(x.dtype, copy=False)
            return (y, mean, var, mean, var)[:n_outputs]
        axes = (0,) if not spatial else (0, *range(2, x.ndim))
        batch_mean, batch_var, run_mean, run_var = _batch_norm_stats(
            x, axes, mean.astype(dtype), var.astype(dtype), momentum, dtype)
        y = _affine_normalize(x, batch_mean[0], batch_var[0], s, b, epsilon, dtype)
        outputs = (y, run_mean, run_var, batch_mean.reshape(mean.shape), batch_var.reshape(var.shape))
        return tuple(t.astype(x.dtype, copy=False) for t in outputs[:n_outputs])

    return kernel


def _lists_training_outputs(node) -> bool:
    return any(node.outputs[1:])


@register("BatchNormalization", since=1)
def batch_normalization_1(node, shapes, opset):
    # Before opset 14 training mode is implied by naming the optional statistics outputs (opset < 7
    # also requires is_test=0); plain inference ignores is_test, which old exporters left unset.
    training = _lists_training_outputs(node) and not int(node.attr("is_test", 0))
    return _batch_norm_kernel(node, training=training, spatial=bool(node.attr("spatial", 1)))


@register("BatchNormalization", since=9)
def batch_normalization_9(node, shapes, opset):
    return _batch_norm_kernel(node, training=_lists_training_outputs(node), spatial=True)


@register("BatchNormalization", since=14)
def batch_normalization_14(node, shapes, opset):
    return _batch_norm_kernel(node, training=bool(node.attr("training_mode", 0)), spatial=True)


def _standardize(x: np.ndarray, axes, epsilon: float):
    """(x - mean) * inv_std over ``axes`` (computed in x's dtype), with the mean and inv_std."""
    mean = x.mean(axis=axes, keepdims=True)
    centered = x - mean
    var = np.square(centered).mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(var + x.dtype.type(epsilon))
    return centered * inv_std, mean, inv_std


@register("InstanceNormalization", since=1)
def instance_normalization(node, shapes, opset):
    epsilon = float(node.attr("epsilon", 1e-5))

    def kernel(x, scale, bias):
        dtype = _compute_dtype(x.dtype)
        normalized, _, _ = _standardize(x.astype(dtype, copy=False), _spatial_axes(x), epsilon)
        y = normalized * _channel_param(scale, x.ndim, dtype) + _channel_param(bias, x.ndim, dtype)
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("LayerNormalization", since=17)
def layer_normalization(node, shapes, opset):
    epsilon = float(node.attr("epsilon", 1e-5))
    axis = int(node.attr("axis", -1))
    stash = _stash_dtype(node)
    n_outputs = len(node.outputs)

    def kernel(x, scale, bias=None):
        axes = tuple(range(_normalize_axis(node, axis, x.ndim), x.ndim))
        normalized, mean, inv_std = _standardize(x.astype(stash), axes, epsilon)
        # Scale and shift happen in x's precision, after casting back (the spec's second stage).
        y = normalized.astype(x.dtype) * scale
        if bias is not None:
            y += bias
        return (y.astype(x.dtype, copy=False), mean, inv_std)[:n_outputs]

    return kernel


def _group_norm_kernel(node, per_group_params: bool, stash: np.dtype | None):
    epsilon = float(node.attr("epsilon", 1e-5))
    groups = node.attr("num_groups")
    if groups is None or int(groups) < 1:
        raise _graph_error(node, "num_groups", f"is {groups}; expected a positive group count")
    groups = int(groups)

    def kernel(x, scale, bias):
        n, c = x.shape[:2]
        if c % groups:
            raise InvalidArgumentError(
                f"node {node.name!r} (GroupNormalization): {c} channels do not split into "
                f"num_groups={groups} equal groups"
            )
        grouped = x.astype(stash or _compute_dtype(x.dtype)).reshape(n, groups, -1)
        normalized, _, _ = _standardize(grouped, (2,), epsilon)
        normalized = normalized.reshape(x.shape).astype(x.dtype)
        if per_group_params:
            scale, bias = (np.repeat(p, c // groups) for p in (scale, bias))
        y = normalized * _channel_param(scale, x.ndim, x.dtype) + _channel_param(bias, x.ndim, x.dtype)
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("GroupNormalization", since=18)
def group_normalization_18(node, shapes, opset):
    # Opset 18 takes scale/bias per group and has no stash_type (half precision computes in float32).
    return _group_norm_kernel(node, per_group_params=True, stash=None)


@register("GroupNormalization", since=21)
def group_normalization_21(node, shapes, opset):
    return _group_norm_kernel(node, per_group_params=False, stash=_stash_dtype(node))


@register("LRN", since=1)
def lrn(node, shapes, opset):
    size = node.attr("size")
    if size is None or int(size) < 1:
        raise _graph_error(node, "size", f"is {size}; expected a positive channel window size")
    size = int(size)
    alpha = float(node.attr("alpha", 1e-4))
    beta = float(node.attr("beta", 0.75))
    bias = float(node.attr("bias", 1.0))
    before = (size - 1) // 2  # the window over channels is [c - before, c - before + size)

    def kernel(x):
        xc = _upcast(x)
        squares = np.zeros((x.shape[0], x.shape[1] + size - 1, *x.shape[2:]), dtype=xc.dtype)
        np.square(xc, out=squares[:, before:before + x.shape[1]])
        total = squares[:, : x.shape[1]].copy()
        for offset in range(1, size):
            total += squares[:, offset:offset + x.shape[1]]
        y = xc / np.power(bias + (alpha / size) * total, beta)
        return (y.astype(x.dtype, copy=False),)

    return kernel


# -- dropout -------------------------------------------------------------------------------------


@register("Dropout", since=1)
def dropout_1(node, shapes, opset):
    # Inference: the output is the input; is_test and ratio only matter for training.
    if _wants(node, 1):
        return lambda x: (x, np.ones(x.shape, dtype=x.dtype))
    return lambda x: (x,)


@register("Dropout", since=10)
def dropout_10(node, shapes, opset):
    if _wants(node, 1):
        return lambda x: (x, np.ones(x.shape, dtype=np.bool_))
    return lambda x: (x,)


@register("Dropout", since=12)
def dropout_12(node, shapes, opset):
    # ratio and training_mode became inputs; with training_mode true the drop is random. The mask
    # comes from numpy's MT19937 RandomState, so a seeded node draws the same mask as onnx's reference.
    seed = node.attr("seed")
    rng = np.random.RandomState(None if seed is None else int(seed) % 2**32)
    with_mask = _wants(node, 1)

    def kernel(x, ratio=None, training_mode=None):
        ratio = 0.5 if ratio is None else float(ratio)
        if training_mode is None or not bool(training_mode) or ratio == 0:
            return (x, np.ones(x.shape, dtype=np.bool_)) if with_mask else (x,)
        if not 0 <= ratio < 1:
            raise InvalidArgumentError(
                f"node {node.name!r} (Dropout): ratio {ratio} is outside [0, 1); feed a ratio below 1"
            )
        mask = rng.random_sample(x.shape) >= ratio
        y = (_upcast(x) * mask / (1 - ratio)).astype(x.dtype, copy=False)
        return (y, mask) if with_mask else (y,)

    return kernel


# -- shape and softmax family --------------------------------------------------------------------


@register("Flatten", since=1)
def flatten(node, shapes, opset):
    axis = int(node.attr("axis", 1))

    def kernel(x):
        if not -x.ndim <= axis <= x.ndim:
            raise InvalidArgumentError(
                f"node {node.name!r} (Flatten): axis {axis} is out of range for a rank-{x.ndim} input; "
                f"expected a value in [{-x.ndim}, {x.ndim}]"
            )
        split = axis % x.ndim if axis < 0 else axis
        return (x.reshape(math.prod(x.shape[:split]), math.prod(x.shape[split:])),)

    return kernel


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    e /= e.sum(axis=axis, keepdims=True)
    return e


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def _hardmax(x: np.ndarray, axis: int) -> np.ndarray:
    y = np.zeros_like(x)
    np.put_along_axis(y, np.expand_dims(x.argmax(axis=axis), axis), 1, axis=axis)
    return y


def _along_axis(node, fn, default_axis: int, coerce_2d: bool):
    """Apply ``fn(x, axis)`` per axis (opset 13+) or over the input flattened to 2-D at axis (<13)."""
    axis = int(node.attr("axis", default_axis))

    def kernel(x):
        if x.size == 0:
            return (x,)
        a = _normalize_axis(node, axis, x.ndim)
        xc = _upcast(x)
        if coerce_2d:
            y = fn(xc.reshape(math.prod(x.shape[:a]), -1), 1).reshape(x.shape)
        else:
            y = fn(xc, a)
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("Softmax", since=1)
def softmax_1(node, shapes, opset):
    return _along_axis(node, _softmax, 1, coerce_2d=True)


@register("Softmax", since=13)
def softmax_13(node, shapes, opset):
    return _along_axis(node, _softmax, -1, coerce_2d=False)


@register("LogSoftmax", since=1)
def log_softmax_1(node, shapes, opset):
    return _along_axis(node, _log_softmax, 1, coerce_2d=True)


@register("LogSoftmax", since=13)
def log_softmax_13(node, shapes, opset):
    return _along_axis(node, _log_softmax, -1, coerce_2d=False)


@register("Hardmax", since=1)
def hardmax_1(node, shapes, opset):
    return _along_axis(node, _hardmax, 1, coerce_2d=True)


@register("Hardmax", since=13)
def hardmax_13(node, shapes, opset):
    return _along_axis(node, _hardmax, -1, coerce_2d=False)


# -- Gelu ----------------------------------------------------------------------------------------


def _erf_pieces(degree: int = 18) -> list[np.ndarray]:
    """Chebyshev coefficients of erf on [i, i+1] for i = 0..5 (erf(x)/x on the first piece, for
    relative accuracy near 0), interpolated from math.erf; beyond 6, erf is 1 in float64."""
    scalar = np.vectorize(math.erf, otypes=[np.float64])

    def first(u):
        t = 0.5 + 0.5 * u
        return scalar(t) / t

    pieces = [chebyshev.chebinterpolate(first, degree)]
    for i in range(1, 6):
        pieces.append(chebyshev.chebinterpolate(lambda u, i=i: scalar(i + 0.5 + 0.5 * u), degree))
    return pieces


_ERF_PIECES = _erf_pieces()


def _erf(x: np.ndarray) -> np.ndarray:
    """Vectorized float64 erf (absolute error ~1e-15): piecewise Chebyshev series on |x|."""
    t = np.abs(x.astype(np.float64))
    y = np.where(np.isnan(t), np.nan, 1.0)
    piece = np.floor(np.where(t < 6, t, 6)).astype(np.intp, copy=False)
    for i, coefs in enumerate(_ERF_PIECES):
        mask = piece == i
        u = 2 * (t[mask] - i) - 1
        y[mask] = chebyshev.chebval(u, coefs) * (t[mask] if i == 0 else 1)
    return np.copysign(y, x)


@register("Gelu", since=20)
def gelu(node, shapes, opset):
    approximate = node.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise _graph_error(node, "approximate", f"is {approximate!r}; expected 'none' or 'tanh'")

    def exact(x):
        xd = x.astype(np.float64)
        return ((0.5 * xd * (1 + _erf(xd / math.sqrt(2)))).astype(x.dtype, copy=False),)

    def tanh(x):
        xc = _upcast(x)
        inner = math.sqrt(2 / math.pi) * (xc + 0.044715 * xc**3)
        return ((0.5 * xc * (1 + np.tanh(inner))).astype(x.dtype, copy=False),)

    return exact if approximate == "none" else tanh
