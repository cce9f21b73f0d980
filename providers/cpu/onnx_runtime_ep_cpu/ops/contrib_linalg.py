"""onnxruntime's contrib FusedMatMul and FusedConv (domain com.microsoft, docs/ContribOperators.md).

These are not the provider's own FusedMatMul/FusedConv (fusions.FUSED_DOMAIN), which carry a bias, residual
and Gelu of this runtime's fusions: com.microsoft's FusedMatMul is alpha * op(A) @ op(B) with transposes of
the matrix and batch axes, its FusedConv a Conv plus an optional Z, then an activation named by a string.
Half-precision inputs compute in float32 and are rounded once, at the output.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.activations import hard_sigmoid_of, sigmoid
from ..algorithms.normalization import broadcasts_into
from ..algorithms.precision import compute_dtype, upcast
from ..algorithms.products import blas_matmul
from ..registry import lookup, register
from ._common import CONTRIB_DOMAIN, argument_error, graph_error

# -- FusedMatMul ---------------------------------------------------------------------------------


def _operand(x: np.ndarray, trans: bool, trans_batch: bool) -> np.ndarray:
    """op(x): the first axis moved behind the batch axes (transBatch), then the last two swapped (trans);
    a vector is never transposed."""
    if trans_batch:
        x = np.moveaxis(x, 0, -2)
    return x.swapaxes(-1, -2) if trans and x.ndim >= 2 else x


@register("FusedMatMul", domain=CONTRIB_DOMAIN, since=1)
def fused_matmul(node, shapes, opset):
    """alpha * op(A) @ op(B), numpy.matmul's broadcasting over the batch axes."""
    alpha = float(node.attr("alpha", 1.0))
    trans_a, trans_b = bool(node.attr("transA", 0)), bool(node.attr("transB", 0))
    batch_a, batch_b = bool(node.attr("transBatchA", 0)), bool(node.attr("transBatchB", 0))

    def kernel(a, b):
        if (batch_a or batch_b) and not (a.ndim == b.ndim >= 3):
            raise argument_error(node, f"transBatchA/transBatchB need A and B of one rank >= 3; got shapes "
                                 f"{a.shape} and {b.shape}")
        left, right = _operand(a, trans_a, batch_a), _operand(b, trans_b, batch_b)
        inner = right.shape[0] if right.ndim == 1 else right.shape[-2]
        if left.shape[-1] != inner:
            raise argument_error(node, f"op(A) {left.shape} and op(B) {right.shape} do not multiply (A's last axis "
                                 f"{left.shape[-1]} against B's {inner})")
        y = np.asarray(blas_matmul(left, right))
        if alpha != 1:
            y = y * y.dtype.type(alpha)
        return (y.astype(a.dtype, copy=False),)

    return kernel


# -- FusedConv -----------------------------------------------------------------------------------


def _activation(node):
    """The activation attribute as a function over a fresh float array (or None)."""
    kind = node.attr("activation")
    if isinstance(kind, bytes):
        kind = kind.decode()
    params = [float(p) for p in node.attr("activation_params", [])]
    if kind in (None, "", "Identity"):
        return None
    if kind == "Relu":
        return lambda y: np.maximum(y, y.dtype.type(0), out=y)
    if kind == "Tanh":
        return lambda y: np.tanh(y, out=y)
    if kind == "Sigmoid":
        return _sigmoid
    if kind == "LeakyRelu":
        alpha = params[0] if params else 0.01
        return lambda y: np.multiply(y, y.dtype.type(alpha), out=y, where=y < 0)
    if kind == "HardSigmoid":
        alpha, beta = (params + [0.2, 0.5][len(params):])[:2]
        return lambda y: hard_sigmoid_of(y, alpha, beta)
    if kind == "Clip":
        low, high = (params + [-np.inf, np.inf][len(params):])[:2]
        return lambda y: np.minimum(np.maximum(y, y.dtype.type(low)), y.dtype.type(high))
    raise graph_error(node, "activation", f"is {kind!r}; expected Relu, Tanh, Sigmoid, LeakyRelu, Clip or "
                      f"HardSigmoid")


def _sigmoid(y: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp overflow for very negative y: the sigmoid is 0 there
        return sigmoid(y)


@register("FusedConv", domain=CONTRIB_DOMAIN, since=1)
def fused_conv(node, shapes, opset):
    """activation(Conv(X, W, B) + Z), the Conv attributes as Conv's."""
    activate = _activation(node)
    convolve = lookup("Conv", "", 11)(node, shapes[:3], 11)

    def kernel(x, w, b=None, z=None):
        dtype = compute_dtype(x.dtype)
        (y,) = convolve(upcast(x), w.astype(dtype, copy=False), None if b is None else b.astype(dtype, copy=False))
        y = np.array(y, dtype=dtype)  # a fresh array: the activation works in place
        if z is not None:
            if not broadcasts_into(z.shape, y.shape):
                raise argument_error(node, f"Z has shape {z.shape}; expected the output's shape {y.shape}")
            y += z.astype(dtype, copy=False)
        if activate is not None:
            y = activate(y)
        return (y.astype(x.dtype, copy=False),)

    return kernel
