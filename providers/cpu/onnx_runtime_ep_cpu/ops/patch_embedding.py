"""PatchEmbedding (patch_embedding.py): a convolution whose stride is its kernel, as tokens, through one product."""

from __future__ import annotations

import numpy as np

from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import argument_error, required_attr

_F32 = np.dtype(np.float32)
_PATCH_ORDER = (0, 2, 4, 1, 3, 5)  # (N, C, Hp, kh, Wp, kw) -> (N, Hp, Wp, C, kh, kw): a row per patch


@register("PatchEmbedding", domain=FUSED_DOMAIN, since=1)
def patch_embedding(node, shapes, opset):
    """Inputs: x (N, C, H, W), the weight as a (C * kh * kw, M) matrix (rows in C, kh, kw order), an optional
    bias (M,); output (N, (H // kh) * (W // kw), M): the tokens of Conv(x, W, b; kernel = stride = (kh, kw))
    flattened and transposed. Rows and columns past the last whole patch are read by no output, as the
    convolution's. Two more optional inputs (fuse_patch_tokens): ``head`` (c, M), rows put before every image's
    tokens, and ``positions`` (T, M), added to each image's T tokens after the bias: the output is then
    (N, c + T, M)."""
    kernel = [int(k) for k in required_attr(node, "kernel_shape", "the patch's (height, width)")]
    if len(kernel) != 2 or min(kernel) <= 0:
        raise argument_error(node, f"attribute 'kernel_shape' is {kernel}; expected a positive (height, width)")
    general = _general(node, kernel[0], kernel[1])
    return _planned(shapes, kernel[0], kernel[1], general) or general


def _shape_of(value) -> tuple | None:
    return None if value is None else value.shape


def _general(node, kh: int, kw: int):
    def kernel(x, w, bias=None, head=None, positions=None):
        count = (x.shape[2] // kh) * (x.shape[3] // kw) if x.ndim == 4 else -1
        if x.ndim != 4 or w.ndim != 2 or w.shape[0] != x.shape[1] * kh * kw or x.shape[2] < kh or x.shape[3] < kw \
                or (bias is not None and bias.shape != (w.shape[1],)) \
                or (head is not None and (head.ndim != 2 or head.shape[1] != w.shape[1])) \
                or (positions is not None and positions.shape != (count, w.shape[1])):
            raise argument_error(node, f"x {x.shape}, weight {w.shape}, bias {_shape_of(bias)}, head "
                                       f"{_shape_of(head)}, positions {_shape_of(positions)}; expected x (N, C, H, W) "
                                       f"with H >= {kh} and W >= {kw}, the weight (C * {kh * kw}, M), a bias (M,), "
                                       f"head rows (c, M) and positions (T, M) for the T = {count} patches")
        batch, channels, rows, columns = x.shape[0], x.shape[1], x.shape[2] // kh, x.shape[3] // kw
        x = x[:, :, :rows * kh, :columns * kw].reshape(batch, channels, rows, kh, columns, kw)
        y = np.matmul(x.transpose(_PATCH_ORDER).reshape(batch * rows * columns, -1), w)
        if bias is not None:
            y += bias
        y = y.reshape(batch, rows * columns, w.shape[1])
        if positions is not None:
            y += positions
        if head is not None:
            y = np.concatenate([np.broadcast_to(head, (batch, *head.shape)).astype(y.dtype), y], axis=1)
        return (y,)

    return kernel


def _planned(shapes, kh: int, kw: int, general):
    """The kernel for the one planned shape of x, a whole number of patches: the patches copied as rows, one
    BLAS product, the bias added in place; other shapes and dtypes go to ``general``. None where it does not
    apply."""
    x_shape = tuple(shapes[0]) if shapes and shapes[0] is not None else None
    if not x_shape or len(x_shape) != 4 or not all(isinstance(d, int) and d > 0 for d in x_shape) \
            or x_shape[2] % kh or x_shape[3] % kw:
        return None
    from ..compiled import transformer as compiled  # once here: an import statement costs each call microseconds

    batch, channels, rows, columns = x_shape[0], x_shape[1], x_shape[2] // kh, x_shape[3] // kw
    split, depth = (batch, channels, rows, kh, columns, kw), channels * kh * kw
    no_residual, add = np.empty((0, 0), _F32), compiled.add_bias_residual_

    count = rows * columns
    no_bias = np.empty(0, _F32)

    def kernel(x, w, bias=None, head=None, positions=None):
        width = w.shape[1] if w.ndim == 2 else -1
        if x.shape != x_shape or x.dtype is not _F32 or w.dtype is not _F32 or w.ndim != 2 or w.shape[0] != depth \
                or (bias is not None and (bias.dtype is not _F32 or bias.shape != (width,))) \
                or (head is not None and (head.dtype is not _F32 or head.ndim != 2 or head.shape[1] != width)) \
                or (positions is not None and (positions.dtype is not _F32 or positions.shape != (count, width)
                                               or not positions.flags.c_contiguous)):
            return general(x, w, bias, head, positions)
        patches = x.reshape(split).transpose(_PATCH_ORDER).reshape(-1, depth)  # (the reshape copies)
        if head is None:
            y = np.dot(patches, w)
            if positions is not None:
                for image in range(batch):
                    add(y[image * count: (image + 1) * count], no_bias if bias is None else bias, positions)
            elif bias is not None:
                add(y, bias, no_residual)
            return (y.reshape(batch, count, width),)
        lead = head.shape[0]
        y = np.empty((batch, lead + count, width), _F32)
        b, table = no_bias if bias is None else bias, no_residual if positions is None else positions
        for image in range(batch):
            tokens = y[image, lead:]
            np.dot(patches[image * count: (image + 1) * count], w, out=tokens)
            if bias is not None or positions is not None:
                add(tokens, b, table)
            y[image, :lead] = head
        return (y,)

    return kernel
