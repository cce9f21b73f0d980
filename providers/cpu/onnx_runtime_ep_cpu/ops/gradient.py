"""Gradient (ai.onnx.preview.training): reverse-mode differentiation of the nodes between ``xs``
and ``y`` in the graph that holds the Gradient node.

The factory slices the forward computation of ``y`` out of the graph (its leaves must be ``xs``,
``zs`` or initializers), compiles its nodes with this provider's kernels, and pairs each with a
vector-Jacobian product. The kernel runs the slice forward, seeds dy with ones (the gradient of
the sum of y, as the operator defines), and propagates back, summing over broadcast axes.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import InvalidGraphError

from ..registry import lookup, register

TRAINING = "ai.onnx.preview.training"


def _unbroadcast(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum ``grad`` down to ``shape`` (undo numpy broadcasting)."""
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, size in enumerate(shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


def _matmul_vjp(g, inputs, outputs, node):
    a, b = inputs
    a2, b2 = (a[None, :] if a.ndim == 1 else a), (b[:, None] if b.ndim == 1 else b)
    g2 = g.reshape(np.matmul(a2, b2).shape)
    ga = np.matmul(g2, np.swapaxes(b2, -1, -2))
    gb = np.matmul(np.swapaxes(a2, -1, -2), g2)
    ga = ga.reshape(ga.shape[:-2] + (ga.shape[-1],)) if a.ndim == 1 else ga
    gb = gb.reshape(gb.shape[:-1]) if b.ndim == 1 else gb
    return ga, gb


def _transpose_vjp(g, inputs, outputs, node):
    perm = node.attr("perm") or list(range(inputs[0].ndim))[::-1]
    return (np.transpose(g, np.argsort(perm)),)


# op_type -> vjp(g, inputs, outputs, node) -> one gradient per input (None: not differentiable)
VJP = {
    "Add": lambda g, i, o, n: (g, g),
    "Sub": lambda g, i, o, n: (g, -g),
    "Mul": lambda g, i, o, n: (g * i[1], g * i[0]),
    "Div": lambda g, i, o, n: (g / i[1], -g * i[0] / (i[1] * i[1])),
    "Neg": lambda g, i, o, n: (-g,),
    "Identity": lambda g, i, o, n: (g,),
    "Relu": lambda g, i, o, n: (g * (i[0] > 0),),
    "Sigmoid": lambda g, i, o, n: (g * o[0] * (1 - o[0]),),
    "Tanh": lambda g, i, o, n: (g * (1 - o[0] * o[0]),),
    "Exp": lambda g, i, o, n: (g * o[0],),
    "Log": lambda g, i, o, n: (g / i[0],),
    "Sqrt": lambda g, i, o, n: (g / (2 * o[0]),),
    "Pow": lambda g, i, o, n: (g * i[1] * np.power(i[0], i[1] - 1), g * o[0] * np.log(i[0])),
    "Sum": lambda g, i, o, n: tuple(g for _ in i),
    "MatMul": _matmul_vjp,
    "Transpose": _transpose_vjp,
    "Reshape": lambda g, i, o, n: (g.reshape(i[0].shape), None),
}


def _forward_slice(node, graph, leaves: set[str], y: str):
    producers = graph.producers()
    needed, stack = set(), [y]
    while stack:
        name = stack.pop()
        if name in leaves or name in graph.initializers or name in needed:
            continue
        producer = producers.get(name)
        if producer is None:
            raise InvalidGraphError(
                f"node {node.name!r} (Gradient): {y!r} depends on {name!r}, which is neither in 'xs' or 'zs' nor "
                f"produced in the graph; list it in 'zs'"
            )
        needed.add(name)
        stack.extend(n for n in producer.inputs if n)
    return [n for n in graph.nodes if any(o in needed for o in n.outputs)]


@register("Gradient", domain=TRAINING, since=1, needs=("graph",))
def gradient(node, shapes, opset, graph):
    xs, zs, y = list(node.attr("xs", [])), list(node.attr("zs", [])), node.attr("y")
    if not xs or not y:
        raise InvalidGraphError(f"node {node.name!r} (Gradient): attributes 'xs' and 'y' are required")
    steps = []
    for forward in _forward_slice(node, graph, set(xs) | set(zs), y):
        factory = lookup(forward.op_type, forward.domain, forward.opset)
        if forward.op_type not in VJP or factory is None:
            raise InvalidGraphError(
                f"node {node.name!r} (Gradient): differentiating {forward.op_type} (node {forward.name!r}) is not "
                f"supported; differentiable operators: {sorted(VJP)}"
            )
        steps.append((forward, factory(forward, [None] * len(forward.inputs), forward.opset)))

    def kernel(*values):
        env = dict(graph.initializers)
        env.update(zip(xs + zs, values))
        for forward, compute in steps:
            env.update(zip(forward.outputs, compute(*[env[n] if n else None for n in forward.inputs])))
        grads = {y: np.ones_like(env[y])}
        for forward, _ in reversed(steps):
            g = grads.get(forward.outputs[0])
            if g is None:
                continue
            inputs = [env[n] if n else None for n in forward.inputs]
            outputs = [env[n] for n in forward.outputs if n]
            for name, value, grad in zip(forward.inputs, inputs, VJP[forward.op_type](g, inputs, outputs, forward)):
                if name and grad is not None:
                    grad = _unbroadcast(np.asarray(grad), np.shape(value))
                    grads[name] = grads[name] + grad if name in grads else grad
        return tuple(
            np.asarray(grads.get(x, np.zeros_like(env[x])), dtype=np.asarray(env[x]).dtype) for x in xs
        )

    return kernel
