"""SpectralMagnitude (spectral_fusions.py): the magnitude of a short-time Fourier transform written as a
convolution by its basis, one product per call.

Inputs x (N, 1, L) float32, the basis rows (2F, K) (real part first) and optionally their bias (2F, 1);
attribute ``stride`` (the hop). Output (N, F, T), T = (L - K) // stride + 1:
sqrt((basis[:F] . frame_t + bias[:F]) ** 2 + (basis[F:] . frame_t + bias[F:]) ** 2) per frame t, the frames read
in place through a strided view of x (no copy, no im2col).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided
from onnx_runtime.errors import InvalidArgumentError

from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import shape_free


@register("SpectralMagnitude", domain=FUSED_DOMAIN, since=1)
def spectral_magnitude(node, shapes, opset):
    stride = int(node.attr("stride", 1))

    def kernel(x, basis, bias=None):
        rows, width = basis.shape
        if x.ndim != 3 or x.shape[1] != 1 or x.shape[2] < width or x.dtype != np.float32:
            raise InvalidArgumentError(
                f"node {node.name!r} (SpectralMagnitude): input {node.inputs[0]!r} is {x.dtype} {x.shape}; it must be "
                f"float32 (batch, 1, length) with length at least the window ({width}): feed the shape the model's "
                f"STFT was exported for")
        x = np.ascontiguousarray(x)
        n, length = x.shape[0], x.shape[2]
        count = (length - width) // stride + 1
        item = x.itemsize
        # (N, K, T): frame t's samples down a column, so the product is (2F, K) @ (K, T) per image
        frames = as_strided(x, (n, width, count), (x.strides[0], item, stride * item), writeable=False)
        spectrum = np.dot(basis, frames[0])[None] if n == 1 else np.matmul(basis, frames)
        if bias is not None:
            spectrum += bias
        half = rows // 2
        np.multiply(spectrum, spectrum, out=spectrum)
        magnitude = spectrum[:, :half]
        np.add(magnitude, spectrum[:, half:], out=magnitude)
        return (np.sqrt(magnitude, out=magnitude),)

    return shape_free(kernel)
