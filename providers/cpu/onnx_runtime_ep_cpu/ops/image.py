"""Image kernels: GridSample/AffineGrid, Col2Im, DeformConv, MaxUnpool, CenterCropPad and ImageDecoder.
GridSample and DeformConv gather the 2**r (linear) or 4**r (cubic) neighbours of every sampling point at
once (algorithms/sampling.py)."""

from __future__ import annotations

import io
import math

import numpy as np
from onnx_runtime import budget

from ..algorithms.precision import compute_dtype
from ..algorithms.sampling import cast_back, cubic_weights, gather_points, interp_dtype, linear_taps
from ..registry import register
from ._common import argument_error, choice_attr, graph_error, group_count, ints_attr, normalize_axis

_GRID_MODES_16 = {"bilinear": "linear", "nearest": "nearest", "bicubic": "cubic"}


_GRID_MODES_20 = {"linear": "linear", "nearest": "nearest", "cubic": "cubic"}


_GRID_PADDINGS = ("zeros", "border", "reflection")


def _reflect(x: np.ndarray, twice_low: int, twice_high: int) -> np.ndarray:
    """Reflect coordinates back and forth off [low, high] until they land inside it."""
    if twice_low == twice_high:
        return np.zeros_like(x)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    distance = np.abs(x - low)
    extra = np.fmod(distance, span)
    flips = np.floor(distance / span)
    return np.where(flips % 2 == 0, extra + low, span - extra + low).astype(x.dtype, copy=False)


class _GridPadding:
    """Maps input-space coordinates of one spatial dim through the padding mode (PyTorch's rules)."""

    def __init__(self, padding: str, align_corners: bool):
        self.padding = padding
        self.align_corners = align_corners

    def unnormalize(self, g: np.ndarray, size: int) -> np.ndarray:
        if self.align_corners:
            return (g + 1) / 2 * (size - 1)
        return ((g + 1) * size - 1) / 2

    def apply(self, x: np.ndarray, size: int) -> np.ndarray:
        if self.padding == "zeros":
            return x
        if self.padding == "reflection":
            x = _reflect(x, 0, 2 * (size - 1)) if self.align_corners else _reflect(x, -1, 2 * size - 1)
        return np.clip(x, 0, size - 1)


def _grid_taps(mode: str, pad: _GridPadding, coord: np.ndarray, size: int) -> list:
    if mode == "nearest":
        return [(np.rint(pad.apply(coord, size)).astype(np.int64), 1)]
    if mode == "linear":
        return linear_taps(pad.apply(coord, size))
    # Cubic pads each of the four integer taps (the window must stay centred); with border padding a
    # point beyond the sampled area first moves onto its edge, as in ONNX Runtime and the reference.
    if pad.padding == "border":
        low, high = (0, size - 1) if pad.align_corners else (-0.5, size - 0.5)
        coord = np.where((coord < low) | (coord > high), np.clip(coord, 0, size - 1), coord)
    low = np.floor(coord)
    frac = coord - low
    taps = []
    for k in range(-1, 3):
        index = pad.apply(low + k, size).astype(np.int64)
        taps.append((index, cubic_weights(np.abs(frac - k), -0.75)))
    return taps


def _grid_sample_kernel(node, modes: dict):
    mode = modes[choice_attr(node, "mode", next(iter(modes)), tuple(modes))]
    pad = _GridPadding(choice_attr(node, "padding_mode", "zeros", _GRID_PADDINGS), bool(node.attr("align_corners", 0)))

    def kernel(x, grid):
        n, c, *sizes = x.shape
        rank = len(sizes)
        points = grid.shape[1:-1]
        if grid.ndim != x.ndim or grid.shape[0] != n or grid.shape[-1] != rank:
            raise argument_error(node, f"grid shape {grid.shape} does not fit input {x.shape}; "
                                        f"expected (N, *out, {rank})")
        coords = grid.astype(np.promote_types(grid.dtype, np.float32)).reshape(n, -1, rank)
        # The grid's last axis is (x, y, z...): the innermost spatial dim comes first.
        taps = [_grid_taps(mode, pad, pad.unnormalize(coords[..., rank - 1 - d], size), size)
                for d, size in enumerate(sizes)]
        table = np.ascontiguousarray(x.reshape(n, c, -1).transpose(0, 2, 1))
        if table.dtype.kind in "fc" or mode != "nearest":
            table = table.astype(interp_dtype(x.dtype), copy=False)
        y = gather_points(table, (np.arange(n)[:, None],), taps, sizes)
        y = y.transpose(0, 2, 1).reshape(n, c, *points)
        return (cast_back(y, x.dtype),)

    return kernel


@register("GridSample", since=16)
def grid_sample_16(node, shapes, opset):
    return _grid_sample_kernel(node, _GRID_MODES_16)


@register("GridSample", since=20)
def grid_sample_20(node, shapes, opset):
    return _grid_sample_kernel(node, _GRID_MODES_20)


def _base_coords(size: int, align_corners: bool) -> np.ndarray:
    """Evenly spaced positions in [-1, 1]: pixel centres, or corner-pixel centres on +-1."""
    if align_corners:
        return np.linspace(-1.0, 1.0, size) if size > 1 else np.full(size, -1.0)
    return (2 * np.arange(size) + 1) / size - 1


@register("AffineGrid", since=20)
def affine_grid(node, shapes, opset):
    align_corners = bool(node.attr("align_corners", 0))

    def kernel(theta, size):
        n, _, *spatial = (int(v) for v in size.reshape(-1))
        rank = len(spatial)
        if rank not in (2, 3) or theta.shape != (n, rank, rank + 1):
            raise argument_error(node, f"theta {theta.shape} and size {size.tolist()} do not match; "
                                        "expected (N, 2, 3) with (N, C, H, W) or (N, 3, 4) with (N, C, D, H, W)")
        budget.check_shape((max(n, 1), *spatial, rank + 1), 8, "AffineGrid's grid")  # size comes from data
        axes = [_base_coords(s, align_corners) for s in spatial]
        mesh = np.meshgrid(*axes, indexing="ij")
        # Homogeneous points (x, y[, z], 1): x runs along the innermost dim.
        points = np.stack([*reversed(mesh), np.ones(spatial)], axis=-1)
        grid = np.einsum("nij,...j->n...i", theta.astype(np.float64), points)
        return (grid.astype(theta.dtype),)

    return kernel


def _window_attrs(node, rank: int):
    """strides, dilations and (begin, end) pads of a rank-``rank`` sliding window, with defaults."""
    strides = ints_attr(node, "strides", (1,) * rank, 1)
    dilations = ints_attr(node, "dilations", (1,) * rank, 1)
    pads = ints_attr(node, "pads", (0,) * (2 * rank), 0)
    for name, value, size in (("strides", strides, rank), ("dilations", dilations, rank), ("pads", pads, 2 * rank)):
        if len(value) != size:
            raise graph_error(node, name, f"has {len(value)} values; expected {size} for {rank} spatial dims")
    return strides, dilations, pads[:rank], pads[rank:]


def _window_counts(in_shape, kernel, strides, dilations, begin, end) -> tuple[int, ...]:
    return tuple((n + b + e - (k - 1) * d - 1) // s + 1
                 for n, k, s, d, b, e in zip(in_shape, kernel, strides, dilations, begin, end))


@register("Col2Im", since=18)
def col2im(node, shapes, opset):
    def kernel(data, image_shape, block_shape):
        image = tuple(int(v) for v in image_shape.reshape(-1))
        block = tuple(int(v) for v in block_shape.reshape(-1))
        rank = len(image)
        strides, dilations, begin, end = _window_attrs(node, rank)
        counts = _window_counts(image, block, strides, dilations, begin, end)
        n, channels_blocks, length = data.shape
        taps = math.prod(block)
        if len(block) != rank or min(block, default=0) < 1 or channels_blocks % taps or length != math.prod(counts) \
                or min(counts) < 1:
            raise argument_error(node, f"input {data.shape} does not hold blocks {list(block)} of image "
                                        f"{list(image)}; expected (N, C * {taps}, {math.prod(counts)})")
        if data.dtype.kind in "OUS":  # overlapping blocks are summed: a numeric element type
            raise argument_error(node, f"input of {data.dtype} elements cannot be summed where blocks overlap; "
                                       f"expected a numeric tensor (cast it first)")
        c = channels_blocks // taps
        cols = data.astype(compute_dtype(data.dtype), copy=False).reshape(n, c, *block, *counts)
        padded = np.zeros((n, c, *(i + b + e for i, b, e in zip(image, begin, end))), dtype=cols.dtype)
        for offset in np.ndindex(*block):
            window = tuple(slice(o * d, o * d + (k - 1) * s + 1, s)
                           for o, d, k, s in zip(offset, dilations, counts, strides))
            padded[(Ellipsis, *window)] += cols[(slice(None), slice(None), *offset)]
        crop = tuple(slice(b, b + i) for b, i in zip(begin, image))
        return (np.ascontiguousarray(padded[(Ellipsis, *crop)]).astype(data.dtype, copy=False),)

    return kernel


@register("DeformConv", since=19)
def deform_conv(node, shapes, opset):
    group = group_count(node)
    offset_group = int(node.attr("offset_group", 1))
    if offset_group < 1:
        raise graph_error(node, "offset_group", f"is {offset_group}; expected a positive group count")
    kernel_attr = ints_attr(node, "kernel_shape", None, 1)

    def sample(x, offset, mask, kshape, strides, dilations, begin, out):
        """The im2col matrix (N, C, K, L) of the input sampled at the offset kernel positions."""
        n, c, *sizes = x.shape
        rank, taps = len(sizes), math.prod(kshape)
        positions = math.prod(out)
        cg = c // offset_group
        off = offset.reshape(n, offset_group, taps, rank, positions)
        out_index = np.indices(out).reshape(rank, 1, positions)
        tap_index = np.indices(kshape).reshape(rank, taps, 1)
        base = out_index * np.array(strides)[:, None, None] - np.array(begin)[:, None, None]\
            + tap_index * np.array(dilations)[:, None, None]
        corners = [linear_taps(base[d] + off[:, :, :, d]) for d in range(rank)]
        table = np.ascontiguousarray(x.reshape(n, offset_group, cg, -1).transpose(0, 1, 3, 2))
        lead = (np.arange(n)[:, None, None, None], np.arange(offset_group)[None, :, None, None])
        vals = gather_points(table, lead, corners, sizes)  # (N, G, K, L, cg)
        if mask is not None:
            vals *= mask.astype(vals.dtype).reshape(n, offset_group, taps, positions, 1)
        return vals.transpose(0, 1, 4, 2, 3).reshape(n, c, taps, positions)

    def kernel(x, w, offset, b=None, mask=None):
        n, c, *sizes = x.shape
        rank = len(sizes)
        kshape = tuple(w.shape[2:])
        if kernel_attr is not None and kernel_attr != kshape:
            raise graph_error(node, "kernel_shape", f"is {list(kernel_attr)} but the weight has kernel {list(kshape)}")
        strides, dilations, begin, end = _window_attrs(node, rank)
        out = _window_counts(sizes, kshape, strides, dilations, begin, end)
        m = w.shape[0]
        taps = math.prod(kshape)
        if c % group or c % offset_group or m % group or w.shape[1] * group != c:
            raise argument_error(node, f"input channels {c}, weight {w.shape}, group={group} and "
                                        f"offset_group={offset_group} do not divide evenly")
        if offset.shape != (n, offset_group * taps * rank, *out):
            raise argument_error(node, f"offset shape {offset.shape}; expected "
                                        f"{(n, offset_group * taps * rank, *out)}")
        dtype = compute_dtype(x.dtype)
        cols = sample(x.astype(dtype, copy=False), offset.astype(dtype, copy=False), mask,
                      kshape, strides, dilations, begin, out)
        weights = w.astype(dtype, copy=False).reshape(group, m // group, -1)
        y = np.matmul(weights, cols.reshape(n, group, (c // group) * taps, -1)).reshape(n, m, *out)
        if b is not None:
            y += b.astype(dtype).reshape((m,) + (1,) * rank)
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("MaxUnpool", since=9)
def max_unpool(node, shapes, opset):
    kshape = ints_attr(node, "kernel_shape", None, 1)
    if kshape is None:
        raise graph_error(node, "kernel_shape", "is missing; MaxUnpool requires it")
    rank = len(kshape)
    strides = ints_attr(node, "strides", (1,) * rank, 1)
    pads = ints_attr(node, "pads", (0,) * (2 * rank), 0)
    if len(strides) != rank or len(pads) != 2 * rank:
        raise graph_error(node, "strides", f"and pads have {len(strides)} and {len(pads)} values; "
                                            f"expected {rank} and {2 * rank}")

    def kernel(x, indices, output_shape=None):
        if x.ndim != rank + 2 or indices.shape != x.shape:
            raise argument_error(node, f"X {x.shape} and I {indices.shape} must match with {rank} spatial dims")
        # Indices address the unpadded size MaxPool saw; output_shape only pads that at the end.
        inferred = x.shape[:2] + tuple((n - 1) * s - pb - pe + k for n, s, pb, pe, k
                                       in zip(x.shape[2:], strides, pads[:rank], pads[rank:], kshape))
        total = math.prod(inferred)
        budget.check_shape(inferred, x.dtype.itemsize, "MaxUnpool's output")  # strides size it: before allocating
        if indices.size and (indices.min() < 0 or indices.max() >= total):
            raise argument_error(node, f"indices must lie in [0, {total}) for the unpooled shape {inferred}")
        y = np.zeros(total, dtype=x.dtype)
        y[indices.reshape(-1)] = x.reshape(-1)
        y = y.reshape(inferred)
        if output_shape is None:
            return (y,)
        target = tuple(int(v) for v in output_shape.reshape(-1))
        if len(target) != x.ndim:
            raise argument_error(node, f"output_shape {list(target)} must have {x.ndim} values")
        budget.check_shape(target, x.dtype.itemsize, "MaxUnpool's output_shape")
        result = np.zeros(target, dtype=x.dtype)
        overlap = tuple(slice(0, min(a, b)) for a, b in zip(inferred, target))
        result[overlap] = y[overlap]
        return (result,)

    return kernel


@register("CenterCropPad", since=18)
def center_crop_pad(node, shapes, opset):
    axes_attr = node.attr("axes")

    def kernel(x, shape):
        axes = list(range(x.ndim)) if axes_attr is None else [normalize_axis(node, int(a), x.ndim) for a in axes_attr]
        target = [int(v) for v in shape.reshape(-1)]
        if len(target) != len(axes) or any(t < 0 for t in target):
            raise argument_error(node, f"shape {target} must hold one non-negative size per axis {axes}")
        out_shape = list(x.shape)
        src = [slice(None)] * x.ndim
        dst = [slice(None)] * x.ndim
        for axis, t in zip(axes, target):
            n = x.shape[axis]
            out_shape[axis] = t
            if t <= n:  # crop: the window starts half a pixel left of centre when uneven
                start = (n - t) // 2
                src[axis] = slice(start, start + t)
            else:  # pad: the odd extra pixel goes on the right
                start = (t - n) // 2
                dst[axis] = slice(start, start + n)
        budget.check_shape(out_shape, x.dtype.itemsize, "CenterCropPad's output")  # the shape input sizes it
        y = np.zeros(out_shape, dtype=x.dtype) if x.dtype != object else np.full(out_shape, "", dtype=object)
        y[tuple(dst)] = x[tuple(src)]
        return (y,)

    return kernel


@register("ImageDecoder", since=20)
def image_decoder(node, shapes, opset):
    pixel_format = choice_attr(node, "pixel_format", "RGB", ("RGB", "BGR", "Grayscale"))
    from PIL import Image, UnidentifiedImageError  # imported on first use: only this op needs Pillow

    channels = 1 if pixel_format == "Grayscale" else 3

    def kernel(encoded):
        try:
            with Image.open(io.BytesIO(encoded.tobytes())) as image:
                image = image.convert("L" if channels == 1 else "RGB")
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
            # The spec's answer to an undecodable stream is an empty image, not an error.
            return (np.zeros((0, 0, channels), dtype=np.uint8),)
        pixels = np.asarray(image, dtype=np.uint8)
        if channels == 1:
            pixels = pixels[:, :, None]
        elif pixel_format == "BGR":
            pixels = pixels[:, :, ::-1]
        return (np.ascontiguousarray(pixels),)

    return kernel
