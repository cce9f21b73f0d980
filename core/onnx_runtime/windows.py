"""Sliding-window geometry of Conv and pooling operators, as ONNX defines it.

Every provider that implements these operators needs the same arithmetic (explicit pads or
auto_pad SAME_UPPER/SAME_LOWER/VALID, strides, dilations, ceil_mode), so it lives here once.
"""

from __future__ import annotations

from .errors import InvalidArgumentError, InvalidGraphError


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


AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def _attribute_error(node, attribute: str, problem: str) -> InvalidGraphError:
    return InvalidGraphError(f"node {node.name!r} ({node.op_type}): attribute {attribute!r} {problem}")


class WindowAttributes:
    """A Conv/pooling node's window attributes (auto_pad, ceil_mode, kernel_shape, strides, dilations,
    pads), validated once per node; :meth:`geometry` applies them to a concrete spatial shape."""

    def __init__(self, node, *, needs_kernel: bool):
        self.node = node
        self.auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
        if self.auto_pad not in AUTO_PADS:
            raise _attribute_error(node, "auto_pad", f"is {self.auto_pad!r}; expected one of {', '.join(AUTO_PADS)}")
        self.ceil_mode = bool(node.attr("ceil_mode", 0))
        kernel = node.attr("kernel_shape")
        if kernel is None and needs_kernel:
            raise _attribute_error(node, "kernel_shape", "is missing; pooling operators require it")
        self.kernel = None if kernel is None else tuple(int(k) for k in kernel)
        self.strides = self._ints("strides", 1)
        self.dilations = self._ints("dilations", 1)
        self.pads = self._ints("pads", 0)
        if self.kernel is not None and any(k < 1 for k in self.kernel):
            raise _attribute_error(node, "kernel_shape", f"is {list(self.kernel)}; expected positive sizes")

    def _ints(self, name: str, minimum: int) -> tuple[int, ...] | None:
        value = self.node.attr(name)
        if value is None:
            return None
        value = tuple(int(v) for v in value)
        if any(v < minimum for v in value):
            raise _attribute_error(self.node, name, f"is {list(value)}; expected values >= {minimum}")
        return value

    def check_rank(self, rank: int) -> None:
        """Every given attribute has one value per spatial dimension (pads: two)."""
        for name, value, size in (("kernel_shape", self.kernel, rank), ("strides", self.strides, rank),
                                  ("dilations", self.dilations, rank), ("pads", self.pads, 2 * rank)):
            if value is not None and len(value) != size:
                raise _attribute_error(self.node, name, f"has {len(value)} values; expected {size} for {rank} "
                                                        f"spatial dims")

    def geometry(self, in_shape, weight_kernel=None):
        """(kernel, strides, dilations, pads before, pads after, output size) for spatial ``in_shape``;
        ``weight_kernel`` is the kernel a Conv weight implies, which must agree with kernel_shape."""
        rank = len(in_shape)
        if self.kernel is not None and weight_kernel is not None and self.kernel != tuple(weight_kernel):
            raise _attribute_error(self.node, "kernel_shape",
                                   f"is {list(self.kernel)} but the weight has kernel {list(weight_kernel)}")
        implied = weight_kernel if weight_kernel is not None else self.kernel
        if implied is None:
            raise _attribute_error(self.node, "kernel_shape", "is missing and no weight implies it")
        kernel = tuple(implied)
        self.check_rank(rank)
        strides = self.strides or (1,) * rank
        dilations = self.dilations or (1,) * rank
        pads = self.pads or (0,) * (2 * rank)
        begin, end, out = window_geometry(self.node, in_shape, kernel, strides, dilations, pads, self.auto_pad,
                                          self.ceil_mode)
        return kernel, tuple(strides), tuple(dilations), begin, end, out
