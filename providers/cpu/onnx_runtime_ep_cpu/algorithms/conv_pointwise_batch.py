"""A 1x1 convolution (any stride, no pads) with few output pixels per image over a batch, as one product
over every image's pixels.

Per image such a convolution is an (M, C) x (C, P) product with P a handful of pixels (a squeeze-excite
block's pooled pixel, a late stage's 2x2 map, a strided shortcut's 4x4 map): the packed convolution fills
its pixel panels or channel lanes a few columns at a time, image after image. Gathered as the (N*P, C) rows
of every image's pixels, the whole batch is one (N*P, C) x (C, M) product that BLAS runs at full width; the
gather and the scatter back to (N, M, P) copy N*P*(C + M) values against N*P*C*M multiply-adds. Which
convolutions it takes: conv_choice.pointwise_batch_applies.
"""

from __future__ import annotations

import math

import numpy as np

from .prepared import Prepared
from .window import Geometry


class PointwiseBatch:
    """``compute(x, w, b)`` and its ``bind`` for conv_path: the product over the batch's pixels."""

    binds_residual = True  # its bind's finish (a FusedConv's epilogue) adds the residual with the bias

    def __init__(self, geo: Geometry, prepared: Prepared, dtype):
        self.geo, self.prepared, self.dtype = geo, prepared, np.dtype(dtype)
        self.pixels = math.prod(geo.out)
        # The strided window's pixels of each spatial axis: one step per output, the first at 0.
        self.picks = (Ellipsis, *(slice(0, (o - 1) * s + 1, s) for o, s in zip(geo.out, geo.strides)))

    def _columns(self, w) -> np.ndarray:
        """The (C, M) weights, transposed once per constant array."""
        m, c = w.shape[0], w.shape[1]
        return self.prepared.get("pointwise_batch", (w,), lambda: np.ascontiguousarray(
            w.reshape(m, c).T, dtype=self.dtype))

    def _rows(self, x, into=None) -> np.ndarray:
        """x's output pixels as (N*P, C) rows: a view where there is one pixel per image."""
        n, c = x.shape[0], x.shape[1]
        picked = x[self.picks]
        if self.pixels == 1 and into is None:
            return picked.reshape(n, c)
        # (Transposed whole: reshaping a strided view to (N, C, P) first would copy it once more.)
        moved = picked.transpose(0, *range(2, picked.ndim), 1)  # (N, *out, C)
        if into is None:
            return np.ascontiguousarray(moved).reshape(n * self.pixels, c)
        np.copyto(into.reshape(moved.shape), moved)
        return into

    def __call__(self, xc, w, b):
        n, m = xc.shape[0], w.shape[0]
        product = self._rows(xc) @ self._columns(w)  # (N*P, M)
        if b is not None:
            product += b.astype(self.dtype, copy=False)
        if self.pixels == 1:
            return product.reshape(n, m, *self.geo.out)
        y = np.empty((n, m, self.pixels), self.dtype)
        np.copyto(y, product.reshape(n, self.pixels, m).transpose(0, 2, 1))
        return y.reshape(n, m, *self.geo.out)

    def bind(self, xc, w, b, finish, y):
        """The product into ``y`` as prepared calls over buffers made once (a segment's bound plan): gather,
        product, scatter, then the bias or a FusedConv's epilogue."""
        n, c, m, pixels = xc.shape[0], xc.shape[1], w.shape[0], self.pixels
        columns = self._columns(w)
        flat = y.reshape(n, m, pixels)
        steps: list = []
        if pixels == 1 and math.prod(xc.shape[2:]) == 1:  # the rows are a view of the plan's input buffer
            rows, product = xc.reshape(n, c), y.reshape(n, m)
        else:
            rows, product = np.empty((n * pixels, c), self.dtype), np.empty((n * pixels, m), self.dtype)
            steps.append((self._rows, (xc, rows)))
        steps.append((np.matmul, (rows, columns, product)))
        if finish is None and b is not None:
            steps.append((np.add, (product, b.astype(self.dtype, copy=False), product)))
        if pixels != 1:
            steps.append((np.copyto, (flat, product.reshape(n, pixels, m).transpose(0, 2, 1))))
        if finish is not None:
            steps.append((finish.rows, (flat, 0, pixels)))
        return steps
