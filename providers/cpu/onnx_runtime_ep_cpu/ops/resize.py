"""Resize and Upsample. Resampling is separable: each output coordinate of one axis maps to a few input
taps with weights (computed once per axis, in float64), folded with ``np.take``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx_runtime import budget

from ..algorithms.sampling import cast_back, cubic_weights, interp_dtype, linear_weights
from ..registry import register
from ._common import argument_error, choice_attr, graph_error, normalize_axis, present

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
        weights = linear_weights(distance)
    else:
        weights = cubic_weights(distance, s.cubic_a)
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
    working = x.dtype if s.mode == "nearest" else np.dtype(interp_dtype(x.dtype))
    budget.check_shape(out_shape, max(x.dtype.itemsize, working.itemsize), "Resize's output")
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
    y = x.astype(interp_dtype(x.dtype))
    for plan in plans:
        y = _resample_axis(y, s, plan)
    return cast_back(y, x.dtype)


def _roi_per_axis(node, roi, axes, rank: int, opset: int) -> dict[int, tuple[float, float]]:
    """Crop regions by axis: before opset 18 ``roi`` spans every axis, from 18 only ``axes``."""
    if not present(roi):
        return {}
    listed = axes if opset >= 18 else list(range(rank))
    values = roi.astype(np.float32).reshape(-1)
    if values.size != 2 * len(listed):
        raise argument_error(node, f"roi has {values.size} values; expected {2 * len(listed)} (starts then ends)")
    return {a: (values[i], values[len(listed) + i]) for i, a in enumerate(listed)}


def _plans_from_scales(node, shape, axes, scales, rois) -> list[_AxisPlan]:
    scales = scales.astype(np.float64).reshape(-1)
    if scales.size != len(axes):
        raise argument_error(node, f"scales has {scales.size} values; expected {len(axes)} (one per resized axis)")
    if np.any(scales <= 0):
        raise argument_error(node, f"scales {scales.tolist()} must be positive")
    # The output length ignores any crop region, as onnx shape inference and ONNX Runtime do.
    return [_AxisPlan(a, int(math.floor(shape[a] * scale)), scale, shape[a] * scale, rois.get(a, (0.0, 1.0)))
            for a, scale in zip(axes, scales.tolist())]


def _plans_from_sizes(node, shape, axes, sizes, rois, policy: str) -> list[_AxisPlan]:
    sizes = sizes.astype(np.int64).reshape(-1).tolist()
    if len(sizes) != len(axes):
        raise argument_error(node, f"sizes has {len(sizes)} values; expected {len(axes)} (one per resized axis)")
    if any(n < 0 for n in sizes):
        raise argument_error(node, f"sizes {sizes} must not be negative")
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
    mode = choice_attr(node, "mode", "nearest", _RESIZE_MODES)
    s = _Sampling(
        mode=mode,
        coordinates=choice_attr(node, "coordinate_transformation_mode", "half_pixel", coordinate_modes),
        nearest=choice_attr(node, "nearest_mode", "round_prefer_floor", _NEAREST_MODES),
        cubic_a=float(node.attr("cubic_coeff_a", -0.75)),
        exclude_outside=bool(node.attr("exclude_outside", 0)),
        extrapolation=float(node.attr("extrapolation_value", 0.0)),
        antialias=newer and mode != "nearest" and bool(node.attr("antialias", 0)),
    )
    policy = choice_attr(node, "keep_aspect_ratio_policy", "stretch", _ASPECT_POLICIES) if newer else "stretch"

    def kernel(x, roi=None, scales=None, sizes=None):
        axes = _resize_axes(node, x.ndim) if newer else list(range(x.ndim))
        rois = _roi_per_axis(node, roi, axes, x.ndim, opset)
        if present(scales) == present(sizes):
            raise argument_error(node, "feed exactly one of the 'scales' and 'sizes' inputs")
        if present(scales):
            plans = _plans_from_scales(node, x.shape, axes, scales, rois)
        else:
            plans = _plans_from_sizes(node, x.shape, axes, sizes, rois, policy)
        return (_resize(x, s, plans),)

    return kernel


def _legacy_resize(node, scales_attr: bool):
    """Upsample and Resize-10: per-axis scales, asymmetric coordinates, nearest or linear."""
    s = _Sampling(mode=choice_attr(node, "mode", "nearest", ("nearest", "linear")),
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
            raise argument_error(node, "the 'scales' input is missing")
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
