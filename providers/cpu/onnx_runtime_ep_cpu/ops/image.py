"""Image and detection kernels: Resize/Upsample, GridSample/AffineGrid, RoiAlign, NonMaxSuppression,
Col2Im, DeformConv, MaxUnpool, CenterCropPad and ImageDecoder.

Resampling is separable: Resize maps each output coordinate of one axis to a few input taps with
weights (computed once per axis, in float64) and folds the taps with ``np.take``; GridSample and
DeformConv gather the 2**r (linear) or 4**r (cubic) neighbours of every sampling point at once.
"""

from __future__ import annotations

import io
import itertools
import math
from dataclasses import dataclass

import numpy as np
from onnx_runtime.errors import InvalidArgumentError

from ..algorithms.precision import compute_dtype
from ..registry import register
from ._common import graph_error, group_count, normalize_axis

# -- shared helpers ------------------------------------------------------------------------------


def _choice(node, attr: str, default: str, allowed) -> str:
    value = node.attr(attr, default)
    if value not in allowed:
        raise graph_error(node, attr, f"is {value!r}; expected one of {', '.join(map(repr, allowed))}")
    return value


def _ints_attr(node, attr: str, default, minimum: int) -> tuple[int, ...] | None:
    value = node.attr(attr)
    if value is None:
        return default
    value = tuple(int(v) for v in value)
    if any(v < minimum for v in value):
        raise graph_error(node, attr, f"is {list(value)}; expected values >= {minimum}")
    return value


def _argument_error(node, message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"node {node.name!r} ({node.op_type}): {message}")


def _present(value) -> bool:
    """Whether an optional input was fed with data (old opsets pass empty tensors for 'absent')."""
    return value is not None and value.size > 0


def _interp_dtype(dtype: np.dtype) -> np.dtype:
    """The float type interpolation of ``dtype`` values runs in: wide ints and float64 need float64."""
    dtype = np.dtype(dtype)
    if dtype == np.float64 or (np.issubdtype(dtype, np.integer) and dtype.itemsize >= 4):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def _cast_back(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Interpolated values in the input's type: integers round half to even and saturate."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.clip(np.rint(y), info.min, info.max).astype(dtype)
    return y.astype(dtype, copy=False)


def _cubic_weights(distance: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel at ``distance`` (>= 0), with coefficient ``a``."""
    d = distance
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _linear_weights(distance: np.ndarray) -> np.ndarray:
    return np.maximum(1 - distance, 0.0)


# -- Resize / Upsample ---------------------------------------------------------------------------

_RESIZE_MODES = ("nearest", "linear", "cubic")
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
_ASPECT_POLICIES = ("stretch", "not_larger", "not_smaller")
_COORDINATES_13 = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize")
_COORDINATES_11 = _COORDINATES_13 + ("tf_half_pixel_for_nn",)
_COORDINATES_19 = _COORDINATES_13 + ("half_pixel_symmetric",)


@dataclass(frozen=True)
class _Sampling:
    """How a Resize node maps output coordinates to input samples: its validated attributes.

    ``nearest="simple"`` is Resize-10/Upsample rounding (floor when upsampling, ceil when
    downsampling), as ONNX Runtime defines it for those opsets.
    """

    mode: str
    coordinates: str = "half_pixel"
    nearest: str = "round_prefer_floor"
    cubic_a: float = -0.75
    exclude_outside: bool = False
    extrapolation: float = 0.0
    antialias: bool = False


@dataclass(frozen=True)
class _AxisPlan:
    """The resampling of one axis: output length, the scale the coordinate transform uses, the
    (possibly fractional) output width that scale implies, and the axis's crop region."""

    axis: int
    out_len: int
    scale: float
    width: float
    roi: tuple[float, float] = (0.0, 1.0)


def _source_coords(s: _Sampling, plan: _AxisPlan, in_len: int) -> np.ndarray:
    """Each output index's coordinate in the input (the coordinate_transformation_mode formulas).

    align_corners and tf_crop_and_resize divide by the fractional output width, as the ONNX test
    data do, so a scale like 0.6 keeps its exact value instead of the rounded output length.
    """
    y = np.arange(plan.out_len, dtype=np.float64)
    scale, width, mode = plan.scale, plan.width, s.coordinates
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - plan.out_len / width)
        return offset + (y + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (y + 0.5) / scale - 0.5 if plan.out_len > 1 else np.zeros_like(y)
    if mode == "asymmetric":
        return y / scale
    if mode == "tf_half_pixel_for_nn":
        return (y + 0.5) / scale
    if mode == "align_corners":
        return y * (in_len - 1) / (width - 1) if width != 1 else np.zeros_like(y)
    # tf_crop_and_resize. The crop's span and offset are float32 arithmetic, as in ONNX Runtime and
    # the ONNX test data: nearest sampling at ties depends on that rounding.
    start, end = (np.float32(v) for v in plan.roi)
    span, offset = end - start, start * np.float32(in_len - 1)
    if width == 1:
        return np.full_like(y, span * np.float32(in_len - 1) / np.float32(2) + offset)
    return y * span * (in_len - 1) / (width - 1) + offset


def _nearest_index(s: _Sampling, x: np.ndarray, scale: float) -> np.ndarray:
    floor = np.floor(x)
    if s.nearest == "simple":
        index = np.ceil(x) if scale < 1 else floor
    elif s.nearest == "round_prefer_floor":
        index = floor + (x - floor > 0.5)
    elif s.nearest == "round_prefer_ceil":
        index = floor + (x - floor >= 0.5)
    elif s.nearest == "floor":
        index = floor
    else:
        index = np.ceil(x)
    return index.astype(np.int64)


def _filter_taps(s: _Sampling, x: np.ndarray, in_len: int, scale: float):
    """(indices, weights), each (out, taps), of a linear or cubic filter centred on coordinates ``x``.

    Antialiasing widens the filter by 1/scale when downsampling and renormalizes its weights; taps
    past the edges read the edge pixel, unless exclude_outside drops them and renormalizes.
    """
    stretch = min(scale, 1.0) if s.antialias else 1.0
    support = 1 if s.mode == "linear" else 2
    reach = math.ceil(support / stretch)
    index = np.floor(x)[:, None] + np.arange(1 - reach, reach + 1)
    distance = np.abs(index - x[:, None]) * stretch
    if s.mode == "linear":
        weights = _linear_weights(distance)
    else:
        weights = _cubic_weights(distance, s.cubic_a)
    if s.antialias:
        weights /= weights.sum(axis=1, keepdims=True)
    index = index.astype(np.int64)
    if s.exclude_outside:
        weights = np.where((index >= 0) & (index < in_len), weights, 0.0)
        total = weights.sum(axis=1, keepdims=True)
        weights /= np.where(total == 0, 1.0, total)
    return np.clip(index, 0, in_len - 1), weights


def _along(vector: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """A per-output-index vector shaped to broadcast along ``axis`` of a rank-``ndim`` array."""
    return vector.reshape((-1,) + (1,) * (ndim - axis - 1))


def _resample_axis(y: np.ndarray, s: _Sampling, plan: _AxisPlan) -> np.ndarray:
    in_len = y.shape[plan.axis]
    x = _source_coords(s, plan, in_len)
    if s.mode == "nearest":
        index = np.clip(_nearest_index(s, x, plan.scale), 0, in_len - 1)
        out = np.take(y, index, axis=plan.axis)
    else:
        index, weights = _filter_taps(s, x, in_len, plan.scale)
        weights = weights.astype(y.dtype)
        out = None
        for tap in range(index.shape[1]):
            term = np.take(y, index[:, tap], axis=plan.axis)
            term *= _along(weights[:, tap], plan.axis, y.ndim)
            out = term if out is None else np.add(out, term, out=out)
    if s.coordinates == "tf_crop_and_resize":
        outside = (x < 0) | (x > in_len - 1)
        if outside.any():
            fill = np.asarray(s.extrapolation).astype(out.dtype)
            out = np.where(_along(outside, plan.axis, y.ndim), fill, out)
    return out


def _resize(x: np.ndarray, s: _Sampling, plans: list[_AxisPlan]) -> np.ndarray:
    out_shape = list(x.shape)
    for plan in plans:
        out_shape[plan.axis] = plan.out_len
    if x.size == 0 or 0 in out_shape:
        return np.zeros(out_shape, dtype=x.dtype)
    cropping = s.coordinates == "tf_crop_and_resize"
    # An axis kept at its length with scale 1 maps every index to itself (unless a crop moves it).
    plans = [p for p in plans if not (p.out_len == x.shape[p.axis] and p.scale == 1.0
                                      and (not cropping or p.roi == (0.0, 1.0)))]
    if s.mode == "nearest":
        y = x
        for plan in plans:
            y = _resample_axis(y, s, plan)
        return y if y is not x else x.copy()
    y = x.astype(_interp_dtype(x.dtype))
    for plan in plans:
        y = _resample_axis(y, s, plan)
    return _cast_back(y, x.dtype)


def _roi_per_axis(node, roi, axes, rank: int, opset: int) -> dict[int, tuple[float, float]]:
    """Crop regions by axis: before opset 18 ``roi`` spans every axis, from 18 only ``axes``."""
    if not _present(roi):
        return {}
    listed = axes if opset >= 18 else list(range(rank))
    values = roi.astype(np.float32).reshape(-1)
    if values.size != 2 * len(listed):
        raise _argument_error(node, f"roi has {values.size} values; expected {2 * len(listed)} (starts then ends)")
    return {a: (values[i], values[len(listed) + i]) for i, a in enumerate(listed)}


def _plans_from_scales(node, shape, axes, scales, rois) -> list[_AxisPlan]:
    scales = scales.astype(np.float64).reshape(-1)
    if scales.size != len(axes):
        raise _argument_error(node, f"scales has {scales.size} values; expected {len(axes)} (one per resized axis)")
    if np.any(scales <= 0):
        raise _argument_error(node, f"scales {scales.tolist()} must be positive")
    # The output length ignores any crop region, as onnx shape inference and ONNX Runtime do.
    return [_AxisPlan(a, int(math.floor(shape[a] * scale)), scale, shape[a] * scale, rois.get(a, (0.0, 1.0)))
            for a, scale in zip(axes, scales.tolist())]


def _plans_from_sizes(node, shape, axes, sizes, rois, policy: str) -> list[_AxisPlan]:
    sizes = sizes.astype(np.int64).reshape(-1).tolist()
    if len(sizes) != len(axes):
        raise _argument_error(node, f"sizes has {len(sizes)} values; expected {len(axes)} (one per resized axis)")
    if any(n < 0 for n in sizes):
        raise _argument_error(node, f"sizes {sizes} must not be negative")
    if any(shape[a] == 0 for a in axes):
        return [_AxisPlan(a, n, 1.0, float(n), rois.get(a, (0.0, 1.0))) for a, n in zip(axes, sizes)]
    ratios = [n / shape[a] for a, n in zip(axes, sizes)]
    if policy != "stretch":
        # One scale for every axis keeps the aspect ratio; lengths round half up.
        common = min(ratios) if policy == "not_larger" else max(ratios)
        ratios = [common] * len(axes)
        sizes = [int(common * shape[a] + 0.5) for a in axes]
    return [_AxisPlan(a, n, r, r * shape[a], rois.get(a, (0.0, 1.0))) for a, n, r in zip(axes, sizes, ratios)]


def _resize_axes(node, rank: int) -> list[int]:
    axes = node.attr("axes")
    if axes is None:
        return list(range(rank))
    axes = [normalize_axis(node, int(a), rank) for a in axes]
    if len(set(axes)) != len(axes):
        raise graph_error(node, "axes", f"is {list(node.attr('axes'))}; expected distinct axes")
    return axes


def _resize_factory(node, opset: int, coordinate_modes):
    newer = opset >= 18
    mode = _choice(node, "mode", "nearest", _RESIZE_MODES)
    s = _Sampling(
        mode=mode,
        coordinates=_choice(node, "coordinate_transformation_mode", "half_pixel", coordinate_modes),
        nearest=_choice(node, "nearest_mode", "round_prefer_floor", _NEAREST_MODES),
        cubic_a=float(node.attr("cubic_coeff_a", -0.75)),
        exclude_outside=bool(node.attr("exclude_outside", 0)),
        extrapolation=float(node.attr("extrapolation_value", 0.0)),
        antialias=newer and mode != "nearest" and bool(node.attr("antialias", 0)),
    )
    policy = _choice(node, "keep_aspect_ratio_policy", "stretch", _ASPECT_POLICIES) if newer else "stretch"

    def kernel(x, roi=None, scales=None, sizes=None):
        axes = _resize_axes(node, x.ndim) if newer else list(range(x.ndim))
        rois = _roi_per_axis(node, roi, axes, x.ndim, opset)
        if _present(scales) == _present(sizes):
            raise _argument_error(node, "feed exactly one of the 'scales' and 'sizes' inputs")
        if _present(scales):
            plans = _plans_from_scales(node, x.shape, axes, scales, rois)
        else:
            plans = _plans_from_sizes(node, x.shape, axes, sizes, rois, policy)
        return (_resize(x, s, plans),)

    return kernel


def _legacy_resize(node, scales_attr: bool):
    """Upsample and Resize-10: per-axis scales, asymmetric coordinates, nearest or linear."""
    s = _Sampling(mode=_choice(node, "mode", "nearest", ("nearest", "linear")),
                  coordinates="asymmetric", nearest="simple")
    fixed = None
    if scales_attr:
        fixed = node.attr("scales")
        if fixed is None or any(v < 1 for v in fixed):
            raise graph_error(node, "scales", f"is {fixed}; expected one value >= 1 per input axis")
        fixed = np.asarray(fixed, dtype=np.float32)

    def kernel(x, scales=None):
        scales = fixed if scales is None else scales
        if scales is None:
            raise _argument_error(node, "the 'scales' input is missing")
        return (_resize(x, s, _plans_from_scales(node, x.shape, list(range(x.ndim)), scales, {})),)

    return kernel


@register("Upsample", since=7)
def upsample_7(node, shapes, opset):
    return _legacy_resize(node, scales_attr=True)


@register("Upsample", since=9)
def upsample_9(node, shapes, opset):
    return _legacy_resize(node, scales_attr=False)


@register("Resize", since=10)
def resize_10(node, shapes, opset):
    return _legacy_resize(node, scales_attr=False)


@register("Resize", since=11)
def resize_11(node, shapes, opset):
    return _resize_factory(node, 11, _COORDINATES_11)


@register("Resize", since=13)
def resize_13(node, shapes, opset):
    return _resize_factory(node, 13, _COORDINATES_13)


@register("Resize", since=18)
def resize_18(node, shapes, opset):
    return _resize_factory(node, 18, _COORDINATES_13)


@register("Resize", since=19)
def resize_19(node, shapes, opset):
    return _resize_factory(node, 19, _COORDINATES_19)


# -- point sampling (GridSample, DeformConv) -----------------------------------------------------


def _gather_points(table: np.ndarray, lead: tuple, taps: list, sizes) -> np.ndarray:
    """Sum over every combination of per-dim taps of weight * table value at that point.

    ``table`` is (*lead, P, C): P flattened spatial positions of extent ``sizes``. ``taps[d]`` lists
    (index, weight) pairs of arrays shaped like the sampling points (*lead, *points); out-of-range
    indices contribute zero. ``lead`` holds the broadcastable index arrays of the leading dims.
    """
    strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    total = None
    for combo in itertools.product(*taps):
        flat = 0
        weight = 1
        for (index, w), size, stride in zip(combo, sizes, strides):
            inside = (index >= 0) & (index < size)
            flat = flat + np.clip(index, 0, size - 1) * stride
            weight = weight * np.where(inside, w, 0)
        term = table[(*lead, flat)] * weight[..., None]
        total = term if total is None else np.add(total, term, out=total)
    return total


def _linear_taps(position: np.ndarray) -> list:
    low = np.floor(position)
    frac = position - low
    low = low.astype(np.int64)
    return [(low, 1 - frac), (low + 1, frac)]


# -- GridSample ----------------------------------------------------------------------------------

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
        return _linear_taps(pad.apply(coord, size))
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
        taps.append((index, _cubic_weights(np.abs(frac - k), -0.75)))
    return taps


def _grid_sample_kernel(node, modes: dict):
    mode = modes[_choice(node, "mode", next(iter(modes)), tuple(modes))]
    pad = _GridPadding(_choice(node, "padding_mode", "zeros", _GRID_PADDINGS), bool(node.attr("align_corners", 0)))

    def kernel(x, grid):
        n, c, *sizes = x.shape
        rank = len(sizes)
        points = grid.shape[1:-1]
        if grid.ndim != x.ndim or grid.shape[0] != n or grid.shape[-1] != rank:
            raise _argument_error(node, f"grid shape {grid.shape} does not fit input {x.shape}; "
                                        f"expected (N, *out, {rank})")
        coords = grid.astype(np.promote_types(grid.dtype, np.float32)).reshape(n, -1, rank)
        # The grid's last axis is (x, y, z...): the innermost spatial dim comes first.
        taps = [_grid_taps(mode, pad, pad.unnormalize(coords[..., rank - 1 - d], size), size)
                for d, size in enumerate(sizes)]
        table = np.ascontiguousarray(x.reshape(n, c, -1).transpose(0, 2, 1))
        if table.dtype.kind in "fc" or mode != "nearest":
            table = table.astype(_interp_dtype(x.dtype), copy=False)
        y = _gather_points(table, (np.arange(n)[:, None],), taps, sizes)
        y = y.transpose(0, 2, 1).reshape(n, c, *points)
        return (_cast_back(y, x.dtype),)

    return kernel


@register("GridSample", since=16)
def grid_sample_16(node, shapes, opset):
    return _grid_sample_kernel(node, _GRID_MODES_16)


@register("GridSample", since=20)
def grid_sample_20(node, shapes, opset):
    return _grid_sample_kernel(node, _GRID_MODES_20)


# -- AffineGrid ----------------------------------------------------------------------------------


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
            raise _argument_error(node, f"theta {theta.shape} and size {size.tolist()} do not match; "
                                        "expected (N, 2, 3) with (N, C, H, W) or (N, 3, 4) with (N, C, D, H, W)")
        axes = [_base_coords(s, align_corners) for s in spatial]
        mesh = np.meshgrid(*axes, indexing="ij")
        # Homogeneous points (x, y[, z], 1): x runs along the innermost dim.
        points = np.stack([*reversed(mesh), np.ones(spatial)], axis=-1)
        grid = np.einsum("nij,...j->n...i", theta.astype(np.float64), points)
        return (grid.astype(theta.dtype),)

    return kernel


# -- RoiAlign ------------------------------------------------------------------------------------


def _roi_axis_samples(start: float, extent: float, bins: int, grid: int, size: int):
    """Bilinear taps along one axis for every (bin, sample) of an RoI: low/high indices, their
    weights, and which samples fall inside [-1, size] (the others read zero)."""
    step = extent / bins
    pos = start + np.arange(bins)[:, None] * step + (np.arange(grid)[None, :] + 0.5) * step / grid
    pos = pos.reshape(-1)
    inside = (pos >= -1.0) & (pos <= size)
    pos = np.maximum(pos, 0.0)
    low = pos.astype(np.int64)
    at_edge = low >= size - 1
    low = np.where(at_edge, size - 1, low)
    high = np.where(at_edge, size - 1, low + 1)
    pos = np.where(at_edge, low, pos)
    frac = pos - low
    return low, high, np.where(inside, 1 - frac, 0.0), np.where(inside, frac, 0.0)


def _roi_align_kernel(node, half_pixel: bool):
    mode = _choice(node, "mode", "avg", ("avg", "max"))
    out_h, out_w = int(node.attr("output_height", 1)), int(node.attr("output_width", 1))
    if out_h < 1 or out_w < 1:
        raise graph_error(node, "output_height", f"and output_width are {out_h}, {out_w}; expected positive sizes")
    ratio = int(node.attr("sampling_ratio", 0))
    if ratio < 0:
        raise graph_error(node, "sampling_ratio", f"is {ratio}; expected a value >= 0")
    spatial_scale = float(node.attr("spatial_scale", 1.0))
    shift = 0.5 if half_pixel else 0.0

    def pool(plane: np.ndarray, roi: np.ndarray) -> np.ndarray:
        c, height, width = plane.shape
        x0, y0, x1, y1 = (float(v) * spatial_scale - shift for v in roi)
        roi_w, roi_h = x1 - x0, y1 - y0
        if not half_pixel:  # the legacy mode forces at least one-pixel RoIs
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        grid_h = ratio or math.ceil(roi_h / out_h)
        grid_w = ratio or math.ceil(roi_w / out_w)
        y_lo, y_hi, wy_lo, wy_hi = _roi_axis_samples(y0, roi_h, out_h, grid_h, height)
        x_lo, x_hi, wx_lo, wx_hi = _roi_axis_samples(x0, roi_w, out_w, grid_w, width)
        corners = [
            plane[:, yi[:, None], xi[None, :]] * (wy[:, None] * wx[None, :]).astype(plane.dtype)
            for yi, wy in ((y_lo, wy_lo), (y_hi, wy_hi))
            for xi, wx in ((x_lo, wx_lo), (x_hi, wx_hi))
        ]
        shape = (c, out_h, max(grid_h, 1), out_w, max(grid_w, 1))
        if mode == "avg":
            samples = (corners[0] + corners[1] + corners[2] + corners[3]).reshape(shape)
            return samples.sum(axis=(2, 4)) / max(grid_h * grid_w, 1)
        # Max mode takes the largest weighted corner of each sample, then the largest sample.
        samples = np.maximum(np.maximum(corners[0], corners[1]), np.maximum(corners[2], corners[3]))
        return samples.reshape(shape).max(axis=(2, 4))

    def kernel(x, rois, batch_indices):
        if rois.ndim != 2 or rois.shape[1] != 4 or batch_indices.shape != (rois.shape[0],):
            raise _argument_error(node, f"rois {rois.shape} and batch_indices {batch_indices.shape} must be "
                                        "(num_rois, 4) and (num_rois,)")
        if np.any((batch_indices < 0) | (batch_indices >= x.shape[0])):
            raise _argument_error(node, f"batch_indices {batch_indices.tolist()} must lie in [0, {x.shape[0]})")
        xc = x.astype(compute_dtype(x.dtype), copy=False)
        y = np.zeros((rois.shape[0], x.shape[1], out_h, out_w), dtype=xc.dtype)
        for i, (roi, b) in enumerate(zip(rois, batch_indices)):
            y[i] = pool(xc[b], roi)
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("RoiAlign", since=10)
def roi_align_10(node, shapes, opset):
    return _roi_align_kernel(node, half_pixel=False)


@register("RoiAlign", since=16)
def roi_align_16(node, shapes, opset):
    transform = _choice(node, "coordinate_transformation_mode", "half_pixel", ("half_pixel", "output_half_pixel"))
    return _roi_align_kernel(node, half_pixel=transform == "half_pixel")


# -- NonMaxSuppression ---------------------------------------------------------------------------


def _box_corners(boxes: np.ndarray, center_point: bool) -> np.ndarray:
    """(..., 4) boxes as (y_min, x_min, y_max, x_max) whatever their corner order or format."""
    if center_point:
        xc, yc, w, h = np.moveaxis(boxes, -1, 0)
        return np.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], axis=-1)
    y1, x1, y2, x2 = np.moveaxis(boxes, -1, 0)
    return np.stack([np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)], axis=-1)


def _overlaps(box: np.ndarray, others: np.ndarray, threshold) -> np.ndarray:
    """Whether each of ``others`` has IoU with ``box`` strictly above ``threshold``."""
    inter_h = np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0])
    inter_w = np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1])
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    inter = inter_h * inter_w
    union = area + areas - inter
    valid = (inter_h > 0) & (inter_w > 0) & (area > 0) & (areas > 0) & (union > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return valid & (inter / union > threshold)


def _select_boxes(corners: np.ndarray, scores: np.ndarray, limit: int, iou, score_threshold) -> list[int]:
    """Greedy NMS of one class: best score first (lower index on ties), dropping overlapping boxes."""
    candidates = np.arange(scores.size)
    if score_threshold is not None:
        candidates = candidates[scores > score_threshold]
    candidates = candidates[np.argsort(-scores[candidates], kind="stable")]
    selected = []
    while candidates.size and len(selected) < limit:
        best = candidates[0]
        selected.append(int(best))
        rest = candidates[1:]
        candidates = rest[~_overlaps(corners[best], corners[rest], iou)]
    return selected


@register("NonMaxSuppression", since=10)
def non_max_suppression(node, shapes, opset):
    center_point = int(node.attr("center_point_box", 0))
    if center_point not in (0, 1):
        raise graph_error(node, "center_point_box", f"is {center_point}; expected 0 or 1")

    def kernel(boxes, scores, max_output_boxes_per_class=None, iou_threshold=None, score_threshold=None):
        if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.ndim != 3 or scores.shape[0] != boxes.shape[0]\
                or scores.shape[2] != boxes.shape[1]:
            raise _argument_error(node, f"boxes {boxes.shape} and scores {scores.shape} must be "
                                        "(batch, boxes, 4) and (batch, classes, boxes)")
        limit = int(max_output_boxes_per_class.reshape(-1)[0]) if _present(max_output_boxes_per_class) else 0
        iou = iou_threshold.reshape(-1)[0] if _present(iou_threshold) else np.float32(0)
        floor = score_threshold.reshape(-1)[0] if _present(score_threshold) else None
        corners = _box_corners(boxes, bool(center_point))
        found = []
        for b, c in itertools.product(range(scores.shape[0]), range(scores.shape[1])):
            if limit <= 0:
                break
            found += [(b, c, i) for i in _select_boxes(corners[b], scores[b, c], limit, iou, floor)]
        return (np.array(found, dtype=np.int64).reshape(-1, 3),)

    return kernel


# -- Col2Im --------------------------------------------------------------------------------------


def _window_attrs(node, rank: int):
    """strides, dilations and (begin, end) pads of a rank-``rank`` sliding window, with defaults."""
    strides = _ints_attr(node, "strides", (1,) * rank, 1)
    dilations = _ints_attr(node, "dilations", (1,) * rank, 1)
    pads = _ints_attr(node, "pads", (0,) * (2 * rank), 0)
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
        if len(block) != rank or channels_blocks % taps or length != math.prod(counts) or min(counts) < 1:
            raise _argument_error(node, f"input {data.shape} does not hold blocks {list(block)} of image "
                                        f"{list(image)}; expected (N, C * {taps}, {math.prod(counts)})")
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


# -- DeformConv ----------------------------------------------------------------------------------


@register("DeformConv", since=19)
def deform_conv(node, shapes, opset):
    group = group_count(node)
    offset_group = int(node.attr("offset_group", 1))
    if offset_group < 1:
        raise graph_error(node, "offset_group", f"is {offset_group}; expected a positive group count")
    kernel_attr = _ints_attr(node, "kernel_shape", None, 1)

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
        corners = [_linear_taps(base[d] + off[:, :, :, d]) for d in range(rank)]
        table = np.ascontiguousarray(x.reshape(n, offset_group, cg, -1).transpose(0, 1, 3, 2))
        lead = (np.arange(n)[:, None, None, None], np.arange(offset_group)[None, :, None, None])
        vals = _gather_points(table, lead, corners, sizes)  # (N, G, K, L, cg)
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
            raise _argument_error(node, f"input channels {c}, weight {w.shape}, group={group} and "
                                        f"offset_group={offset_group} do not divide evenly")
        if offset.shape != (n, offset_group * taps * rank, *out):
            raise _argument_error(node, f"offset shape {offset.shape}; expected "
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


# -- MaxUnpool -----------------------------------------------------------------------------------


@register("MaxUnpool", since=9)
def max_unpool(node, shapes, opset):
    kshape = _ints_attr(node, "kernel_shape", None, 1)
    if kshape is None:
        raise graph_error(node, "kernel_shape", "is missing; MaxUnpool requires it")
    rank = len(kshape)
    strides = _ints_attr(node, "strides", (1,) * rank, 1)
    pads = _ints_attr(node, "pads", (0,) * (2 * rank), 0)
    if len(strides) != rank or len(pads) != 2 * rank:
        raise graph_error(node, "strides", f"and pads have {len(strides)} and {len(pads)} values; "
                                            f"expected {rank} and {2 * rank}")

    def kernel(x, indices, output_shape=None):
        if x.ndim != rank + 2 or indices.shape != x.shape:
            raise _argument_error(node, f"X {x.shape} and I {indices.shape} must match with {rank} spatial dims")
        # Indices address the unpadded size MaxPool saw; output_shape only pads that at the end.
        inferred = x.shape[:2] + tuple((n - 1) * s - pb - pe + k for n, s, pb, pe, k
                                       in zip(x.shape[2:], strides, pads[:rank], pads[rank:], kshape))
        total = math.prod(inferred)
        if indices.size and (indices.min() < 0 or indices.max() >= total):
            raise _argument_error(node, f"indices must lie in [0, {total}) for the unpooled shape {inferred}")
        y = np.zeros(total, dtype=x.dtype)
        y[indices.reshape(-1)] = x.reshape(-1)
        y = y.reshape(inferred)
        if output_shape is None:
            return (y,)
        target = tuple(int(v) for v in output_shape.reshape(-1))
        if len(target) != x.ndim:
            raise _argument_error(node, f"output_shape {list(target)} must have {x.ndim} values")
        result = np.zeros(target, dtype=x.dtype)
        overlap = tuple(slice(0, min(a, b)) for a, b in zip(inferred, target))
        result[overlap] = y[overlap]
        return (result,)

    return kernel


# -- CenterCropPad -------------------------------------------------------------------------------


@register("CenterCropPad", since=18)
def center_crop_pad(node, shapes, opset):
    axes_attr = node.attr("axes")

    def kernel(x, shape):
        axes = list(range(x.ndim)) if axes_attr is None else [normalize_axis(node, int(a), x.ndim) for a in axes_attr]
        target = [int(v) for v in shape.reshape(-1)]
        if len(target) != len(axes) or any(t < 0 for t in target):
            raise _argument_error(node, f"shape {target} must hold one non-negative size per axis {axes}")
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
        y = np.zeros(out_shape, dtype=x.dtype) if x.dtype != object else np.full(out_shape, "", dtype=object)
        y[tuple(dst)] = x[tuple(src)]
        return (y,)

    return kernel


# -- ImageDecoder --------------------------------------------------------------------------------


@register("ImageDecoder", since=20)
def image_decoder(node, shapes, opset):
    pixel_format = _choice(node, "pixel_format", "RGB", ("RGB", "BGR", "Grayscale"))
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
