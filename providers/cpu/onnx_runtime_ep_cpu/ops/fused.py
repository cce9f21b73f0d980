"""Kernels for the provider's own fused operators (domain ai.onnx_runtime.cpu, see fusions.py)."""

from __future__ import annotations

import numpy as np

from ..fusions import FUSED_DOMAIN
from ..registry import register


@register("RotateHalfEmbedding", domain=FUSED_DOMAIN, since=1)
def rotate_half_embedding(node, shapes, opset):
    """q * cos + concat(-q[..., half:end], q[..., :half]) * sin, in three passes over q."""
    half, end = int(node.attr("half")), int(node.attr("end"))

    def kernel(q, cos, sin):
        rotated = np.concatenate((np.negative(q[..., half:end]), q[..., :half]), axis=-1)
        rotated *= sin
        out = q * cos
        out += rotated
        return (out,)

    return kernel
