"""FlexAttention (ai.onnx.preview): attention whose scores and probabilities pass through the node's modifier
subgraphs, score_mod and prob_mod, each run as a Subgraph of the session (ops/transformer.py has Attention).

Its own family module so that a model without it does not import the session's subgraph machinery with the
attention kernels.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime.loader import implicit_inputs
from onnx_runtime.session.subgraph import Subgraph

from ..algorithms.contrib_attention import grouped_matmul, softmax_
from ..algorithms.precision import compute_dtype
from ..registry import register
from ._common import argument_error, graph_error
from .transformer import gqa_heads, softmax_dtype_of


def _modifier(node, attr: str, handle) -> Subgraph | None:
    graph = node.attr(attr)
    if graph is None:
        return None
    if len(graph.inputs) != 1 or len(graph.outputs) != 1:
        raise graph_error(
            node, attr, f"has {len(graph.inputs)} inputs and {len(graph.outputs)} outputs; expected 1 and 1"
        )
    return Subgraph(graph, [handle])


def _modified(node, attr: str, given: np.ndarray, outputs: list) -> np.ndarray:
    """A modifier subgraph's result, which must keep the shape it was given (a scalar reached softmax's axis)."""
    result = np.asarray(outputs[0])
    if result.shape != given.shape:
        raise argument_error(node, f"subgraph {attr!r} returned shape {result.shape}; it must return the shape it "
                                   f"is given, {given.shape}")
    return result


@register("FlexAttention", domain="ai.onnx.preview", since=1, needs=("handle",))
def flex_attention(node, shapes, opset, handle):
    score_mod = _modifier(node, "score_mod", handle)
    prob_mod = _modifier(node, "prob_mod", handle)
    scale_attr = node.attr("scale")
    outer_names = implicit_inputs(node)

    def kernel(q, k, v, *outer_values):
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise argument_error(node, f"Q, K and V must be rank 4; got shapes {q.shape}, {k.shape}, {v.shape}")
        gqa_heads(node, q.shape[1], k.shape[1])
        outer = dict(zip(outer_names, outer_values))
        dtype = compute_dtype(q.dtype)
        # The modifier subgraphs see scores and probabilities in the softmax precision: float32 for
        # float/half inputs, double for double, unless softmax_precision says otherwise.
        mod_dtype = softmax_dtype_of(node, np.float64 if q.dtype == np.float64 else np.float32)
        softmax_dtype = compute_dtype(mod_dtype)
        scale = 1 / math.sqrt(q.shape[3]) if scale_attr is None else float(scale_attr)

        queries = q.astype(dtype) * dtype.type(scale)
        scores = grouped_matmul(queries, k.astype(dtype, copy=False).swapaxes(-1, -2))
        if score_mod is not None:
            scores = _modified(node, "score_mod", scores, score_mod.run([scores.astype(mod_dtype, copy=False)], outer))
        probs = softmax_(scores.astype(softmax_dtype))
        if prob_mod is not None:
            probs = _modified(node, "prob_mod", probs, prob_mod.run([probs.astype(mod_dtype, copy=False)], outer))
        y = grouped_matmul(probs.astype(dtype, copy=False), v.astype(dtype, copy=False))
        return (y.astype(v.dtype, copy=False),)

    return kernel
