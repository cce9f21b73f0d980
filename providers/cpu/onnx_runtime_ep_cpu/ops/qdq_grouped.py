"""GroupedQuantizedMatMul (qdq_repeat_kv.fold_repeated_kv): a QDQ attention product of A (batch, heads, rows,
depth) against keys or values with heads / ``group`` heads, each read by its group of A's heads, without the
repeated copy: A is read as (batch, kv heads, group * rows, depth) and multiplied by QuantizedMatMul's stacked
kernel (the same per-row integer product and requantization), the result read back as (batch, heads, rows,
columns).

Inputs: QuantizedMatMul's eight with B the unrepeated kv (batch, kv heads, length, depth), then the targets of
the Expand and (optionally: else attribute ``target``) the Reshape the fold took out; attributes ``group``,
``allowzero`` (the Reshape's) and ``transposed_b`` (the keys of the scores' product: B used transposed). Where
the targets do not only repeat kv's heads ``group`` times, kv goes through Unsqueeze(2), Expand and Reshape (and
the transposition) as the nodes did, with their errors typed.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime.ir import Node

from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import argument_error
from .qdq_linear import quantized_matmul

_OWN = ("group", "transposed_b", "allowzero", "target")


def _resolved(target: tuple, shape: tuple, allowzero: bool) -> tuple:
    """Reshape's output shape for ``target`` over a tensor of ``shape`` (0 copies the dimension unless
    ``allowzero``; one -1 takes the rest); a target with no such shape gives itself (numpy's reshape refuses it)."""
    dims = [shape[i] if d == 0 and not allowzero and i < len(shape) else d for i, d in enumerate(target)]
    if dims.count(-1) == 1:
        known = math.prod(d for d in dims if d != -1)
        size = math.prod(shape)
        if known and size % known == 0:
            dims[dims.index(-1)] = size // known
    return tuple(dims)


def _only_repeats(group: int, allowzero: bool, shape: tuple, spread_to: tuple, reshape_to: tuple) -> bool:
    """Whether Unsqueeze(2), Expand to ``spread_to`` and Reshape to ``reshape_to`` of a kv of ``shape`` only repeat
    each of its heads ``group`` times."""
    if len(shape) != 4:
        return False
    batch, heads, length, depth = shape
    try:
        spread = np.broadcast_shapes((batch, heads, 1, length, depth), spread_to)
    except ValueError:
        return False
    return spread == (batch, heads, group, length, depth) \
        and _resolved(reshape_to, spread, allowzero) == (batch, heads * group, length, depth)


def repeats_heads(group: int, allowzero: bool, shape: tuple, spread_to, reshape_to) -> bool:
    """_only_repeats for the targets as a grouped product's inputs give them (``reshape_to`` an array, or the
    attribute's list)."""
    return _only_repeats(group, allowzero, shape, tuple(int(d) for d in np.asarray(spread_to).reshape(-1)),
                         tuple(int(d) for d in np.asarray(reshape_to).reshape(-1)))


@register("GroupedQuantizedMatMul", domain=FUSED_DOMAIN, since=1)
def grouped_quantized_matmul(node, shapes, opset):
    group, transposed = int(node.attr("group", 1)), bool(node.attr("transposed_b", 0))
    allowzero, fixed = bool(node.attr("allowzero", 0)), node.attr("target")
    inner = quantized_matmul(Node("QuantizedMatMul", list(node.inputs[:8]), list(node.outputs), name=node.name,
                                  domain=FUSED_DOMAIN, opset=1,
                                  attrs={k: v for k, v in (node.attrs or {}).items() if k not in _OWN}),
                             [None] * 8, 1)
    checked: list = [None, False]  # the last (kv shape, targets) and whether they only repeat kv's heads

    def repeated(b, spread_to, reshape_to):
        """kv through the nodes the fold took out: Unsqueeze(2), Expand, Reshape (and the transposition)."""
        try:
            spread = np.broadcast_to(b[:, :, None], np.broadcast_shapes(b[:, :, None].shape, spread_to))
            full = spread.reshape(_resolved(reshape_to, spread.shape, allowzero))
        except ValueError as error:
            raise argument_error(node, f"B {b.shape} does not expand to {spread_to} and reshape to {reshape_to}: "
                                 f"{error}") from None
        if transposed and full.ndim != 4:
            raise argument_error(node, f"the repeated B {full.shape} is not 4-D: its last two axes cannot swap")
        return full.swapaxes(2, 3) if transposed else full

    def kernel(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero, spread_to, reshape_to=None):
        spread_to = tuple(int(d) for d in spread_to.reshape(-1))
        reshape_to = tuple(int(d) for d in (fixed if reshape_to is None else reshape_to.reshape(-1)))
        key = (b.shape, spread_to, reshape_to)
        if checked[0] != key:
            checked[:] = [key, _only_repeats(group, allowzero, b.shape, spread_to, reshape_to)]
        params = (b_scale, b_zero, y_scale, y_zero)
        if not checked[1] or a.ndim != 4 or a.shape[:2] != (b.shape[0], b.shape[1] * group):
            return inner(a, a_scale, a_zero, repeated(b, spread_to, reshape_to), *params)
        batch, heads, rows, depth = a.shape
        grouped = np.ascontiguousarray(a).reshape(batch, b.shape[1], group * rows, depth)
        (y,) = inner(grouped, a_scale, a_zero, b.swapaxes(2, 3) if transposed else b, *params)
        return (y.reshape(batch, heads, rows, y.shape[-1]),)

    return kernel
