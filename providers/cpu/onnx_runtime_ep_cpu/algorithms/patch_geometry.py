"""The geometry of a convolution run as patch rows times a packed weight (compiled/dynamic_conv.py): strides,
dilations and explicit pads from the node, a 1-D convolution as a 2-D one of height 1."""

from __future__ import annotations

import math

SCRATCH = 1 << 28  # bytes of padded codes and patch rows a compiled call may allocate


def _ints(node, name: str, count: int, default: int) -> list[int]:
    values = node.attr(name)
    return [default] * count if values is None else [int(v) for v in values]


def patch_geometry(node, x_shape, w_shape) -> tuple | None:
    """(X's shape as N x C x H x W, (kh, kw, sh, sw, dh, dw, top, bottom, left, right), the output shape,
    (OH, OW)), or None where the patch-row call does not apply: other ranks or channel counts, an empty input
    or output, or padded codes and rows over SCRATCH bytes (fuzzed pads; the callers' general path checks
    those)."""
    if len(x_shape) != len(w_shape) or len(x_shape) not in (3, 4) or 0 in x_shape or x_shape[1] != w_shape[1]:
        return None
    spatial = len(x_shape) - 2
    kernel_shape = list(w_shape[2:])
    strides = _ints(node, "strides", spatial, 1)
    dilations = _ints(node, "dilations", spatial, 1)
    pads = _ints(node, "pads", 2 * spatial, 0)
    if len(strides) != spatial or len(dilations) != spatial or len(pads) != 2 * spatial or min(pads) < 0 \
            or min(strides) < 1 or min(dilations) < 1:
        return None
    sizes = [(x_shape[2 + a] + pads[a] + pads[a + spatial] - dilations[a] * (kernel_shape[a] - 1) - 1)
             // strides[a] + 1 for a in range(spatial)]
    if min(sizes) <= 0:
        return None
    padded = x_shape[0] * x_shape[1] * math.prod(x_shape[2 + a] + pads[a] + pads[a + spatial] for a in range(spatial))
    if padded + math.prod(sizes) * x_shape[0] * math.prod(w_shape[1:]) > SCRATCH:
        return None
    one = spatial == 1
    shape4 = tuple(x_shape[:2]) + ((1,) if one else ()) + tuple(x_shape[2:])
    (kh, kw), (sh, sw), (dh, dw) = ((([1] if one else []) + v) for v in (kernel_shape, strides, dilations))
    top, bottom, left, right = (0, 0, pads[0], pads[1]) if one else (pads[0], pads[2], pads[1], pads[3])
    return (shape4, (kh, kw, sh, sw, dh, dw, top, bottom, left, right), (x_shape[0], w_shape[0], *sizes),
            (1, sizes[0]) if one else (sizes[0], sizes[1]))
