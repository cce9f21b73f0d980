"""A convolution whose windows tile the image (kernel = stride, no padding, dilation or groups) onto a map of
few output columns: ConvNeXt's downsampling layers (2x2 stride 2 onto 4x4 and 2x2 maps), a patch merge.

Each output pixel reads its own patch and no other, so the convolution is one product: the weight as an
(M, C * kh * kw) matrix times the patches as columns (C * kh * kw, OH * OW), which compiled/im2col.py's
fill_columns gathers from the unpadded input (a copy, no zeros), written by BLAS straight into the output's
channels-first rows. The direct tiles (conv_direct.py) run one output row's pixels across their lanes, which
such a map leaves mostly empty (TILE_PIXELS lanes for 2 or 4 pixels).
"""

from __future__ import annotations

import numpy as np

from .prepared import Prepared
from .window import Geometry


class PatchConv:
    """``compute(x, w, b, finish) -> y`` (N, M, OH, OW) of a convolution conv_choice.patches_apply takes, with
    ``bind`` for a segment's bound plan (per image: the gather, the product into the output, the bias or the
    FusedConv's epilogue)."""

    def __init__(self, geo: Geometry, x_shape, w_shape, prepared: Prepared):
        (self.kh, self.kw), (self.oh, self.ow) = geo.kernel, geo.out
        self.m, self.depth = w_shape[0], w_shape[1] * self.kh * self.kw
        self.pixels = self.oh * self.ow
        self.prepared = prepared

    def _weights(self, w: np.ndarray, b) -> np.ndarray:
        """The weight as (M, C * kh * kw) float32 rows in the patches' (c, i, j) order, the bias (where given) as one
        more column (the columns' last row is ones), kept per constant."""
        def arranged():
            rows = w.astype(np.float32, copy=False).reshape(self.m, -1)
            if b is None:
                return np.ascontiguousarray(rows)
            return np.concatenate([rows, b.astype(np.float32, copy=False).reshape(self.m, 1)], axis=1)

        return self.prepared.get("patch_rows", (w, b), arranged)

    def _columns(self, with_bias: bool) -> np.ndarray:
        columns = np.empty((self.depth + with_bias, self.pixels), np.float32)
        if with_bias:
            columns[-1] = 1  # (the gather writes the rows above it only)
        return columns

    def calls(self, x: np.ndarray, w: np.ndarray, b, finish, y: np.ndarray) -> list:
        """``[(function, arguments)]`` computing ``y`` from the C-contiguous ``x``: per image, the gather and one
        product (its bias column included) into the image's channel rows; then a FusedConv's epilogue."""
        from ..compiled.im2col import fill_patches

        bias = b if finish is None else None  # (a FusedConv's epilogue carries its bias)
        weights, columns = self._weights(w, bias), self._columns(bias is not None)
        rows = y.reshape(x.shape[0], self.m, self.pixels)
        steps: list = []
        for image in range(x.shape[0]):
            steps.append((fill_patches, (x[image], columns, self.kh, self.kw)))
            steps.append((np.matmul, (weights, columns, rows[image])))
        if finish is not None:
            steps.append((finish.rows, (rows, 0, self.pixels)))
        return steps

    def __call__(self, x: np.ndarray, w: np.ndarray, b, finish) -> np.ndarray:
        x = np.ascontiguousarray(x)
        y = np.empty((x.shape[0], self.m, self.oh, self.ow), np.float32)
        for function, arguments in self.calls(x, w, b, finish, y):
            function(*arguments)
        return y

    def bind(self, x: np.ndarray, w: np.ndarray, b, finish, y: np.ndarray) -> list | None:
        """The calls into the plan's ``y`` from its buffer ``x`` (see calls), their columns made once."""
        if not (x.flags.c_contiguous and y.flags.c_contiguous) or w.flags.writeable \
                or (b is not None and b.flags.writeable):
            return None
        return self.calls(x, w, b, finish, y)
