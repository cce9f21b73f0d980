"""An LSTM cell written out in elementwise operations, as torch's exporters write ``nn.LSTMCell`` (and a one-step
``nn.LSTM`` the dynamo exporter unrolls), fused into one ``LSTMCell`` step of this provider's domain:

    gates = Gemm(x, W_ih, b_ih) + Gemm(h, W_hh, b_hh)        (transB=1: torch's (4H, in) weights)
    i, f, g, o = Split(gates, 4)                              (torch's gate order)
    c' = Sigmoid(f) * c + Sigmoid(i) * Tanh(g)
    h' = Sigmoid(o) * Tanh(c')

A streaming model (silero-vad's op18 export) runs these thirteen nodes per frame; the fused step is one call of the
compiled LSTM loop (ops/recurrent.py's kernel). The weights are reordered once, here, to that loop's gate order
(i, o, f, c) and layout (transposed), and the two biases summed.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node
from onnx_runtime.optimizer.rewrite import add_initializer

from .fusions import FUSED_DOMAIN, GraphView, other_input, owned, replace_nodes, until_fixed


def _gemm_parts(view: GraphView, gemm: Node) -> tuple[str, np.ndarray, np.ndarray | None] | None:
    """(input, weight as (4H, in), bias or None) of a ``Gemm(a, B, C)`` computing a @ B^T + C with constant B, C."""
    if gemm.op_type != "Gemm" or gemm.domain or len(gemm.inputs) < 2 or float(gemm.attr("alpha", 1.0)) != 1.0 \
            or float(gemm.attr("beta", 1.0)) != 1.0 or int(gemm.attr("transA", 0)):
        return None
    weight = view.const(gemm.inputs[1])
    bias = view.const(gemm.inputs[2]) if len(gemm.inputs) > 2 and gemm.inputs[2] else None
    if weight is None or weight.ndim != 2 or (len(gemm.inputs) > 2 and gemm.inputs[2] and bias is None):
        return None
    if not int(gemm.attr("transB", 0)):
        weight = weight.T
    if bias is not None and bias.size != weight.shape[0]:
        return None  # a bias broadcast over rows is not a per-gate vector
    return gemm.inputs[0], weight, None if bias is None else bias.reshape(-1)


def _equal_split(view: GraphView, split: Node, width: int) -> bool:
    if split.op_type != "Split" or split.domain or len(split.outputs) != 4 or int(split.attr("axis", 0)) not in (1, -1):
        return False
    sizes = split.attr("split") if len(split.inputs) < 2 or not split.inputs[1] else view.const(split.inputs[1])
    return sizes is None or [int(s) for s in np.asarray(sizes).reshape(-1)] == [width // 4] * 4


def _match(view: GraphView, split: Node) -> tuple[list[Node], list[str], tuple] | None:
    """(the cell's nodes, [x, h, c, h', c'], (the two Gemms' parts)) when ``split`` splits such a cell's gates."""
    add = view.producer.get(split.inputs[0]) if split.inputs else None
    if add is None or add.op_type != "Add" or add.domain or len(add.inputs) != 2 \
            or view.only_consumer(add.outputs[0], "Split") is not split:
        return None
    gemms = [view.producer.get(name) for name in add.inputs]
    if any(g is None or view.only_consumer(g.outputs[0], "Add") is not add for g in gemms):
        return None
    parts = [_gemm_parts(view, g) for g in gemms]  # type: ignore[arg-type]
    if parts[0] is None or parts[1] is None or parts[0][1].shape[0] != parts[1][1].shape[0] \
            or not _equal_split(view, split, parts[0][1].shape[0]):
        return None
    acts = [view.only_consumer(out, op) for out, op in zip(split.outputs, ("Sigmoid", "Sigmoid", "Tanh", "Sigmoid"))]
    if any(a is None for a in acts):
        return None
    i, f, g, o = acts
    forget = view.only_consumer(f.outputs[0], "Mul")  # type: ignore[union-attr]
    write = view.only_consumer(i.outputs[0], "Mul")  # type: ignore[union-attr]
    if forget is None or write is None or other_input(write, i.outputs[0]) != g.outputs[0] \
            or view.only_consumer(g.outputs[0], "Mul") is not write:  # type: ignore[union-attr]
        return None
    c = other_input(forget, f.outputs[0])  # type: ignore[union-attr]
    cell = view.only_consumer(forget.outputs[0], "Add")
    if c is None or cell is None or other_input(cell, forget.outputs[0]) != write.outputs[0] \
            or view.only_consumer(write.outputs[0], "Add") is not cell:
        return None
    squash = [n for n in view.consumers.get(cell.outputs[0], []) if n.op_type == "Tanh" and not n.domain]
    if len(squash) != 1:
        return None
    out = view.only_consumer(squash[0].outputs[0], "Mul")
    if out is None or other_input(out, squash[0].outputs[0]) != o.outputs[0] \
            or view.only_consumer(o.outputs[0], "Mul") is not out:  # type: ignore[union-attr]
        return None
    nodes = [*gemms, add, split, *acts, forget, write, cell, squash[0], out]
    return nodes, [parts[0][0], parts[1][0], c, out.outputs[0], cell.outputs[0]], (parts[0], parts[1])  # type: ignore


def _gate_order(array: np.ndarray, hidden: int) -> np.ndarray:
    """Torch's (i, f, g, o) rows to the compiled loop's (i, o, f, c)."""
    i, f, g, o = (array[k * hidden:(k + 1) * hidden] for k in range(4))
    return np.ascontiguousarray(np.concatenate([i, o, f, g]))


def _oriented(x: str, h: str, x_parts: tuple, h_parts: tuple) -> tuple[str, str, tuple, tuple] | None:
    """(x, h, x's Gemm parts, h's) with h the product whose weight reads a hidden-sized state."""
    hidden = x_parts[1].shape[0] // 4
    if h_parts[1].shape[1] == hidden:
        return x, h, x_parts, h_parts
    if x_parts[1].shape[1] == hidden:
        return h, x, h_parts, x_parts
    return None


def _cell_weights(x_parts: tuple, h_parts: tuple) -> list[np.ndarray] | None:
    """W^T (I, 4H), R^T (H, 4H) and the summed bias in the compiled loop's gate order; None unless float32."""
    (_, w_x, b_x), (_, w_h, b_h) = x_parts, h_parts
    dtype = np.result_type(w_x.dtype, w_h.dtype)
    if dtype != np.float32:
        return None  # the compiled loop's type
    hidden = w_x.shape[0] // 4
    bias = np.zeros(4 * hidden, dtype)
    for b in (b_x, b_h):
        if b is not None:
            bias = bias + b.astype(dtype)
    w_x, w_h, bias = (_gate_order(np.asarray(array, dtype), hidden) for array in (w_x, w_h, bias))
    return [np.ascontiguousarray(w_x.T), np.ascontiguousarray(w_h.T), bias]  # the loop reads W^T and R^T


def fuse_lstm_cells(graph: Graph, owns=None) -> bool:
    view = GraphView(graph)
    for split in list(graph.nodes):
        if split.op_type != "Split" or split.domain:
            continue
        found = _match(view, split)
        if found is None or not owned(owns, found[0]):
            continue
        nodes, (x, h, c, h_out, c_out), parts = found
        oriented = _oriented(x, h, *parts)
        arrays = None if oriented is None else _cell_weights(oriented[2], oriented[3])
        base = f"{split.name or split.outputs[0]}/lstm_cell"
        names = [f"{base}_{part}" for part in ("W", "R", "B")]
        if oriented is None or arrays is None \
                or any(name in graph.initializers or name in graph.value_info for name in names):
            continue
        for name, array in zip(names, arrays):
            add_initializer(graph, name, array)
        fused = Node("LSTMCell", [oriented[0], oriented[1], c, *names], [h_out, c_out], name=base,
                     domain=FUSED_DOMAIN, opset=1)
        replace_nodes(graph, nodes, fused)
        return True
    return False


RECURRENT_PASSES = [until_fixed(fuse_lstm_cells)]
