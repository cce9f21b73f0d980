"""Optimizer kernels of the ai.onnx.preview.training domain: Momentum, Adagrad and Adam.

Each takes a scalar learning rate R and update count T, then one group of inputs per optimizer
tensor kind, each group listing the n optimized tensors in order (X_1..X_n, G_1..G_n, ...). The
update is elementwise and independent per tensor, so the kernels apply it to each i in turn and
return the new values group by group (X_new_1..X_new_n, then the new state tensors).
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from ..registry import register

TRAINING = "ai.onnx.preview.training"


def _float_attr(node, name: str, default: float | None = None) -> float:
    value = node.attr(name, default)
    if value is None:
        raise InvalidGraphError(f"node {node.name!r} ({node.op_type}): attribute {name!r} is missing; it is required")
    return float(value)


def _groups(node, inputs: tuple, kinds: int) -> list[tuple]:
    """``inputs`` after R and T split into ``kinds`` equal groups, zipped per optimized tensor."""
    tensors = inputs[2:]
    if not tensors or len(tensors) % kinds:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): got {len(tensors)} tensor inputs after R and T; "
            f"expected a positive multiple of {kinds}"
        )
    n = len(tensors) // kinds
    return list(zip(*(tensors[k * n:(k + 1) * n] for k in range(kinds))))


def _scalars(r: np.ndarray, t: np.ndarray) -> tuple[float, int]:
    return float(np.asarray(r).reshape(())), int(np.asarray(t).reshape(()))


def _regularized(x: np.ndarray, g: np.ndarray, norm_coefficient: float) -> np.ndarray:
    """The gradient of loss + 0.5 * norm_coefficient * ||X||^2."""
    return x.dtype.type(norm_coefficient) * x + g


def _cast(dtype, *values) -> list[np.ndarray]:
    return [np.asarray(v).astype(dtype, copy=False) for v in values]


def _regroup(updates: list[tuple]) -> tuple:
    """Per-tensor (X_new, state_new, ...) tuples as the output order: all X_new, then each state."""
    return tuple(value for kind in zip(*updates) for value in kind)


@register("Momentum", domain=TRAINING, since=1)
def momentum(node, shapes, opset):
    alpha, beta = _float_attr(node, "alpha"), _float_attr(node, "beta")
    norm_coefficient = _float_attr(node, "norm_coefficient")
    mode = node.attr("mode")
    if mode not in ("standard", "nesterov"):
        raise InvalidGraphError(
            f"node {node.name!r} (Momentum): attribute 'mode' is {mode!r}; expected 'standard' or 'nesterov'"
        )

    def update(r, t, x, g, v):
        g_reg = _regularized(x, g, norm_coefficient)
        beta_t = beta if t > 0 else 1.0  # the first step takes the whole gradient
        v_new = x.dtype.type(alpha) * v + x.dtype.type(beta_t) * g_reg
        step = v_new if mode == "standard" else g_reg + x.dtype.type(alpha) * v_new
        return _cast(x.dtype, x - x.dtype.type(r) * step, v_new)

    def kernel(*inputs):
        r, t = _scalars(inputs[0], inputs[1])
        return _regroup([update(r, t, *group) for group in _groups(node, inputs, 3)])

    return kernel


@register("Adagrad", domain=TRAINING, since=1)
def adagrad(node, shapes, opset):
    norm_coefficient = _float_attr(node, "norm_coefficient", 0.0)
    decay_factor = _float_attr(node, "decay_factor", 0.0)
    epsilon = _float_attr(node, "epsilon", 1e-6)

    def update(rate, x, g, h):
        g_reg = _regularized(x, g, norm_coefficient)
        h_new = h + g_reg * g_reg
        x_new = x - x.dtype.type(rate) * g_reg / (np.sqrt(h_new) + x.dtype.type(epsilon))
        return _cast(x.dtype, x_new, h_new)

    def kernel(*inputs):
        r, t = _scalars(inputs[0], inputs[1])
        with np.errstate(all="ignore"):  # (a decay that zeroes the divisor: inf or NaN, as numpy's reference gives)
            rate = np.float64(r) / (1 + np.float64(t) * np.float64(decay_factor))
        return _regroup([update(rate, *group) for group in _groups(node, inputs, 3)])

    return kernel


@register("Adam", domain=TRAINING, since=1)
def adam(node, shapes, opset):
    alpha, beta = _float_attr(node, "alpha", 0.9), _float_attr(node, "beta", 0.999)
    epsilon = _float_attr(node, "epsilon", 1e-6)
    norm_coefficient = _float_attr(node, "norm_coefficient", 0.0)
    norm_coefficient_post = _float_attr(node, "norm_coefficient_post", 0.0)

    def update(rate, x, g, v, h):
        f = x.dtype.type
        g_reg = _regularized(x, g, norm_coefficient)
        v_new = f(alpha) * v + f(1 - alpha) * g_reg
        h_new = f(beta) * h + f(1 - beta) * g_reg * g_reg
        x_new = x - f(rate) * (v_new / (np.sqrt(h_new) + f(epsilon)))
        return _cast(x.dtype, f(1 - norm_coefficient_post) * x_new, v_new, h_new)

    def kernel(*inputs):
        r, t = _scalars(inputs[0], inputs[1])
        # Bias correction of both moving averages folds into the learning rate once T > 0; in float64 numpy, as
        # the reference computes it (alpha 1 or beta past 1: inf or NaN, not Python's ZeroDivision or domain error)
        with np.errstate(all="ignore"):
            a, b = np.float64(alpha), np.float64(beta)
            rate = np.float64(r) * np.sqrt(1 - b**t) / (1 - a**t) if t > 0 else np.float64(r)
        return _regroup([update(rate, *group) for group in _groups(node, inputs, 4)])

    return kernel
