"""Loss kernels: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both pick, for every sample position (n, d1, ..., dk), the log-probability of its target class
from an (N, C, d1, ..., dk) input, optionally weight it per class, zero the positions whose target
equals ``ignore_index``, and reduce ('none', 'sum', or 'mean' = sum of losses / sum of weights).
Later opset versions of both ops only added element types, so one registration covers each.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from ..algorithms.precision import upcast
from ..algorithms.softmax import log_softmax
from ..registry import register
from ._common import wants_output

_REDUCTIONS = ("none", "sum", "mean")


class _LossAttrs:
    """The reduction and ignore_index attributes of a loss node, validated once per node."""

    def __init__(self, node):
        self.node = node
        self.reduction = node.attr("reduction", "mean")
        if self.reduction not in _REDUCTIONS:
            raise InvalidGraphError(
                f"node {node.name!r} ({node.op_type}): attribute 'reduction' is {self.reduction!r}; "
                f"expected one of {', '.join(_REDUCTIONS)}"
            )
        ignore_index = node.attr("ignore_index")
        self.ignore_index = None if ignore_index is None else int(ignore_index)

    def error(self, message: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"node {self.node.name!r} ({self.node.op_type}): {message}")


def _class_labels(attrs: _LossAttrs, log_prob: np.ndarray, target: np.ndarray):
    """Target classes safe to index with (ignored positions point at class 0) and the ignore mask."""
    expected = log_prob.shape[:1] + log_prob.shape[2:]
    if log_prob.ndim < 2 or target.shape != expected:
        raise attrs.error(f"target shape {target.shape} does not match input shape {log_prob.shape}; "
                          f"expected a target of shape {expected} for an (N, C, d1, ..., dk) input")
    ignored = None if attrs.ignore_index is None else target == attrs.ignore_index
    labels = target.astype(np.intp) if ignored is None else np.where(ignored, 0, target).astype(np.intp)
    classes = log_prob.shape[1]
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise attrs.error(f"target holds a class outside [0, {classes}) that is not the ignore_index "
                          f"{attrs.ignore_index}; fix the labels or set ignore_index")
    return labels, ignored


def _nll(attrs: _LossAttrs, log_prob: np.ndarray, target: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
    """The (reduced) negative log-likelihood loss in log_prob's dtype; log_prob is (N, C, d1, ..., dk)."""
    labels, ignored = _class_labels(attrs, log_prob, target)
    loss = -np.take_along_axis(log_prob, labels[:, None], axis=1)[:, 0]
    if weight is not None and weight.shape != (log_prob.shape[1],):
        raise attrs.error(f"weight {weight.shape} must hold one weight per class: ({log_prob.shape[1]},)")
    weights = None if weight is None else weight.astype(loss.dtype, copy=False)[labels]
    if ignored is not None:
        # where, not a zero weight: the placeholder class 0 may hold an infinite log-probability
        loss = np.where(ignored, 0, loss if weights is None else loss * weights).astype(loss.dtype, copy=False)
        weights = np.where(ignored, 0, 1 if weights is None else weights).astype(loss.dtype, copy=False)
    elif weights is not None:
        loss = loss * weights
    if attrs.reduction == "none":
        return loss
    total = loss.sum(dtype=loss.dtype)
    if attrs.reduction == "sum":
        return np.asarray(total)
    with np.errstate(invalid="ignore", divide="ignore"):  # every position ignored: 0 / 0 is nan
        count = loss.dtype.type(loss.size) if weights is None else weights.sum(dtype=loss.dtype)
        return np.asarray(total / count)


@register("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss(node, shapes, opset):
    attrs = _LossAttrs(node)

    def kernel(x, target, weight=None):
        return (_nll(attrs, upcast(x), target, weight).astype(x.dtype, copy=False),)

    return kernel


@register("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(node, shapes, opset):
    attrs = _LossAttrs(node)
    with_log_prob = wants_output(node, 1)

    def kernel(scores, labels, weights=None):
        if scores.ndim < 2:
            raise attrs.error(f"scores have shape {scores.shape}; expected (N, C) or (N, C, d1, ..., dk)")
        log_prob = log_softmax(upcast(scores), 1)
        loss = _nll(attrs, log_prob, labels, weights).astype(scores.dtype, copy=False)
        return (loss, log_prob.astype(scores.dtype, copy=False)) if with_log_prob else (loss,)

    return kernel
