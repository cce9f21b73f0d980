"""Dropout: the identity at inference; with training_mode, a random mask from numpy's MT19937.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import InvalidArgumentError

from ..algorithms.precision import upcast
from ..registry import register
from ._common import wants_output


@register("Dropout", since=1)
def dropout_1(node, shapes, opset):
    # Inference: the output is the input; is_test and ratio only matter for training.
    if wants_output(node, 1):
        return lambda x: (x, np.ones(x.shape, dtype=x.dtype))
    return lambda x: (x,)


@register("Dropout", since=10)
def dropout_10(node, shapes, opset):
    if wants_output(node, 1):
        return lambda x: (x, np.ones(x.shape, dtype=np.bool_))
    return lambda x: (x,)


@register("Dropout", since=12)
def dropout_12(node, shapes, opset):
    # ratio and training_mode became inputs; with training_mode true the drop is random. The mask
    # comes from numpy's MT19937 RandomState, so a seeded node draws the same mask as onnx's reference.
    seed = node.attr("seed")
    rng = np.random.RandomState(None if seed is None else int(seed) % 2**32)
    with_mask = wants_output(node, 1)

    def kernel(x, ratio=None, training_mode=None):
        ratio = 0.5 if ratio is None else float(_scalar(node, "ratio", ratio))
        if training_mode is None or not bool(_scalar(node, "training_mode", training_mode)) or ratio == 0:
            return (x, np.ones(x.shape, dtype=np.bool_)) if with_mask else (x,)
        if not 0 <= ratio < 1:
            raise InvalidArgumentError(
                f"node {node.name!r} (Dropout): ratio {ratio} is outside [0, 1); feed a ratio below 1"
            )
        mask = rng.random_sample(x.shape) >= ratio
        y = (upcast(x) * mask / (1 - ratio)).astype(x.dtype, copy=False)
        return (y, mask) if with_mask else (y,)

    return kernel


def _scalar(node, name: str, value):
    """A scalar input's value; an array of another size is refused (numpy would raise a TypeError, or take the
    first of one element with a deprecation warning)."""
    array = np.asarray(value)
    if array.size != 1:
        raise InvalidArgumentError(
            f"node {node.name!r} (Dropout): input {name!r} must be a scalar, got shape {list(array.shape)}")
    return array.reshape(()).item()
