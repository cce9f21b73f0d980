"""Object detection: RoiAlign (average or max of bilinear samples per bin) and NonMaxSuppression."""

from __future__ import annotations

import itertools
import math

import numpy as np
from onnx_runtime import budget

from ..algorithms.precision import compute_dtype
from ..registry import register
from ._common import argument_error, choice_attr, graph_error, present


def _roi_axis_samples(start: float, extent: float, bins: int, grid: int, size: int):
    """Bilinear taps along one axis for every (bin, sample) of an RoI: low/high indices, their
    weights, and which samples fall inside [-1, size] (the others read zero)."""
    step = extent / bins
    pos = start + np.arange(bins)[:, None] * step + (np.arange(grid)[None, :] + 0.5) * step / grid
    pos = pos.reshape(-1)
    inside = (pos >= -1.0) & (pos <= size)
    pos = np.clip(pos, 0.0, size)  # far outside (weights 0): an index that cannot overflow int64
    low = pos.astype(np.int64)
    at_edge = low >= size - 1
    low = np.where(at_edge, size - 1, low)
    high = np.where(at_edge, size - 1, low + 1)
    pos = np.where(at_edge, low, pos)
    frac = pos - low
    return low, high, np.where(inside, 1 - frac, 0.0), np.where(inside, frac, 0.0)


def _finite_scale(node) -> float:
    spatial_scale = float(node.attr("spatial_scale", 1.0))
    if not math.isfinite(spatial_scale):
        raise graph_error(node, "spatial_scale", f"is {spatial_scale}; expected a finite number")
    return spatial_scale


def _check_roi_inputs(node, x, rois, batch_indices) -> None:
    if x.ndim != 4:
        raise argument_error(node, f"input {x.shape} must be (N, C, H, W)")
    if rois.ndim != 2 or rois.shape[1] != 4 or batch_indices.shape != (rois.shape[0],):
        raise argument_error(node, f"rois {rois.shape} and batch_indices {batch_indices.shape} must be "
                                    "(num_rois, 4) and (num_rois,)")
    if np.any((batch_indices < 0) | (batch_indices >= x.shape[0])):
        raise argument_error(node, f"batch_indices {batch_indices.tolist()} must lie in [0, {x.shape[0]})")
    if not np.all(np.isfinite(rois)):  # a NaN corner indexes nothing: its sample positions become INT64_MIN
        raise argument_error(node, "rois must be finite coordinates")


def _roi_align_kernel(node, half_pixel: bool):
    mode = choice_attr(node, "mode", "avg", ("avg", "max"))
    out_h, out_w = int(node.attr("output_height", 1)), int(node.attr("output_width", 1))
    if out_h < 1 or out_w < 1:
        raise graph_error(node, "output_height", f"and output_width are {out_h}, {out_w}; expected positive sizes")
    ratio = int(node.attr("sampling_ratio", 0))
    if ratio < 0:
        raise graph_error(node, "sampling_ratio", f"is {ratio}; expected a value >= 0")
    spatial_scale = _finite_scale(node)
    shift = 0.5 if half_pixel else 0.0

    def pool(plane: np.ndarray, roi: np.ndarray) -> np.ndarray:
        c, height, width = plane.shape
        x0, y0, x1, y1 = (float(v) * spatial_scale - shift for v in roi)
        roi_w, roi_h = x1 - x0, y1 - y0
        if not half_pixel:  # the legacy mode forces at least one-pixel RoIs
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        grid_h = ratio or math.ceil(roi_h / out_h)
        grid_w = ratio or math.ceil(roi_w / out_w)
        budget.check(c * out_h * max(grid_h, 1) * out_w * max(grid_w, 1), 4 * plane.itemsize, "RoiAlign's samples")
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
        _check_roi_inputs(node, x, rois, batch_indices)
        xc = x.astype(compute_dtype(x.dtype), copy=False)
        budget.check_shape((rois.shape[0], x.shape[1], out_h, out_w), xc.itemsize, "RoiAlign's output")
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
    transform = choice_attr(node, "coordinate_transformation_mode", "half_pixel", ("half_pixel", "output_half_pixel"))
    return _roi_align_kernel(node, half_pixel=transform == "half_pixel")


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
            raise argument_error(node, f"boxes {boxes.shape} and scores {scores.shape} must be "
                                        "(batch, boxes, 4) and (batch, classes, boxes)")
        limit = int(max_output_boxes_per_class.reshape(-1)[0]) if present(max_output_boxes_per_class) else 0
        iou = iou_threshold.reshape(-1)[0] if present(iou_threshold) else np.float32(0)
        floor = score_threshold.reshape(-1)[0] if present(score_threshold) else None
        corners = _box_corners(boxes, bool(center_point))
        found = []
        for b, c in itertools.product(range(scores.shape[0]), range(scores.shape[1])):
            if limit <= 0:
                break
            found += [(b, c, i) for i in _select_boxes(corners[b], scores[b, c], limit, iou, floor)]
        return (np.array(found, dtype=np.int64).reshape(-1, 3),)

    return kernel
