"""Sliding-window geometry of Conv and pooling operators, as ONNX defines it.

Every provider that implements these operators needs the same arithmetic (explicit pads or
auto_pad SAME_UPPER/SAME_LOWER/VALID, strides, dilations, ceil_mode), so it lives here once.
"""

from __future__ import annotations

from .errors import InvalidArgumentError


def window_geometry(node, in_shape, kernel, strides, dilations, pads, auto_pad: str = "NOTSET",
                    ceil_mode: bool = False) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(pads before, pads after, output size) per spatial dimension of ``node``'s window.

    ``pads`` lists the begin pads then the end pads; it is ignored under SAME_* and VALID auto_pad.
    Raises :class:`InvalidArgumentError` naming the node when an input is smaller than its window.
    """
    rank = len(in_shape)
    begin, end, out = [], [], []
    for i, (n, k, s, d) in enumerate(zip(in_shape, kernel, strides, dilations)):
        span = (k - 1) * d + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-n // s)
            total = max(0, (o - 1) * s + span - n)
            b = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            e = total - b
        else:
            b, e = (0, 0) if auto_pad == "VALID" else (pads[i], pads[rank + i])
            room = n + b + e - span
            o = (-(-room // s) if ceil_mode else room // s) + 1
            # A ceil_mode window must start inside the input or the leading pad.
            if ceil_mode and (o - 1) * s >= n + b:
                o -= 1
        if o < 1:
            raise InvalidArgumentError(
                f"node {node.name!r} ({node.op_type}): spatial input size {n} with pads ({b}, {e}) is smaller "
                f"than the dilated kernel size {span}; feed a larger input"
            )
        begin.append(b)
        end.append(e)
        out.append(o)
    return tuple(begin), tuple(end), tuple(out)
