"""Blocks of several nodes that a segment's bound plan (segment_steps.py) runs as one compiled call.

Squeeze-excitation (MobileNetV3, EfficientNet, RegNetY): x -> GlobalAveragePool (or ReduceMean over the planes)
-> 1x1 convolution [+ its activation, or a Relu or SiLU node] -> 1x1 convolution [+ its activation] ->
HardSigmoid or Sigmoid -> Mul with x. Run node by node it is seven prepared calls on vectors of a few hundred
values, each costing more than its arithmetic; as one (compiled/segment_loops.squeeze_excite) it is one.
Matched on the segment's nodes as the CPU fusions leave them (a convolution's activation fused into it or a
node after it), whichever exporter wrote them; every value inside the block must be read by the block's next
node alone.
"""

from __future__ import annotations

import numpy as np

from ..ops._common import activation_code

_ACTIVATIONS = (None, "Relu", "Clip", "LeakyRelu")  # what a FusedConv's epilogue bounds express


def _plain(node, *ops) -> bool:
    return node.op_type in ops and node.domain in ("", "ai.onnx")


def _pointwise_conv(inner, env, constants, channels_in: int):
    """(weights (out, in), bias (out,) or None, activation bounds) of a 1x1 convolution over one pixel with
    constant weights (``inner``: a segment node), or None."""
    from ..compiled import epilogue

    node, slots = inner.node, inner.inputs
    if node.op_type not in ("Conv", "FusedConv") or node.domain not in ("", "ai.onnx", "ai.onnx_runtime.cpu"):
        return None
    if len(slots) < 2 or slots[1] not in constants or (len(slots) > 2 and slots[2] >= 0 and slots[2] not in constants)\
            or (len(slots) > 3 and slots[3] >= 0) or node.attr("activation") not in _ACTIVATIONS:
        return None
    w = env[slots[1]]
    if w.ndim != 4 or w.shape[1] != channels_in or w.shape[2:] != (1, 1) or w.dtype != np.float32:
        return None
    bias = env[slots[2]] if len(slots) > 2 and slots[2] >= 0 else None
    kind, params = activation_code(node) if node.op_type == "FusedConv" else (epilogue.NONE, ())
    return w.reshape(w.shape[0], channels_in), bias, epilogue.activation_bounds(kind, params, np.float32)


def _spatial_mean(inner, env, constants) -> bool:
    """Whether a segment node is the mean over a 4-D tensor's planes, kept as (N, C, 1, 1): GlobalAveragePool,
    or ReduceMean over axes 2 and 3 (the dynamo exporter's spelling) with keepdims."""
    node = inner.node
    if _plain(node, "GlobalAveragePool"):
        return True
    if not _plain(node, "ReduceMean") or not node.attr("keepdims", 1):
        return False
    axes = node.attr("axes")
    if len(inner.inputs) > 1 and inner.inputs[1] >= 0:
        axes = env[inner.inputs[1]] if inner.inputs[1] in constants else None
    return axes is not None and sorted(int(a) % 4 for a in np.asarray(axes).reshape(-1)) == [2, 3]


def squeeze_excitations(segment, env, constants) -> dict:
    """{index of the block's pooling node: (indices of its nodes, the slot of its product, bind)} for each
    squeeze-excitation block of ``segment`` (ops/segment.Segment) whose values in ``env`` (its node-by-node
    run) are float32; ``bind(buffers, output) -> (loop, arguments)``."""
    chain = _Chain(segment, env, constants)
    found = {}
    for first, pool in enumerate(segment.inner):
        x_slot = pool.inputs[0] if pool.inputs else -1
        x = env[x_slot] if x_slot >= 0 else None
        if isinstance(x, np.ndarray) and x.ndim == 4 and x.dtype == np.float32 and _spatial_mean(pool, env, constants):
            block = chain.match(first, x_slot, x)
            if block is not None:
                found[first] = block
    return found


class _Chain:
    """Follows a squeeze-excitation block from its pool, each value read by the next node alone."""

    def __init__(self, segment, env, constants):
        self.inner, self.env, self.constants = segment.inner, env, constants
        self.readers: dict[int, list[int]] = {}
        for index, node in enumerate(self.inner):
            for slot in node.inputs:
                self.readers.setdefault(slot, []).append(index)
        self.results = set(segment.results)

    def next(self, index: int, members: list) -> int | None:
        """The sole reader of node ``index``'s output (appended to ``members``), or None."""
        slot = self.inner[index].outputs[0]
        found = self.readers.get(slot, [])
        if len(found) != 1 or slot in self.results:
            return None
        members.append(found[0])
        return found[0]

    def conv(self, index, channels_in: int):
        if index is None:
            return None
        return _pointwise_conv(self.inner[index], self.env, self.constants, channels_in)

    def match(self, first: int, x_slot: int, x: np.ndarray):
        from ..compiled import epilogue, segment_loops

        members = [first]
        step = self.next(first, members)
        squeeze = self.conv(step, x.shape[1])
        if squeeze is None:
            return None
        step = self.next(step, members)
        swish = False
        if step is not None and _plain(self.inner[step].node, "Relu") and squeeze[2][0] == -np.inf:
            squeeze = (squeeze[0], squeeze[1], epilogue.activation_bounds(epilogue.RELU, (), np.float32))
            step = self.next(step, members)
        elif step is not None and _plain(self.inner[step].node, "Swish") \
                and float(self.inner[step].node.attr("alpha", 1.0)) == 1.0:
            swish = True  # SiLU (EfficientNet's squeeze activation), after the convolution's own
            step = self.next(step, members)
        excite = self.conv(step, squeeze[0].shape[0])
        if excite is None or excite[0].shape[0] != x.shape[1]:
            return None
        gate = self.next(step, members)
        mul = self.next(gate, members) if gate is not None else None
        if mul is None or not _plain(self.inner[gate].node, "HardSigmoid", "Sigmoid") \
                or not _plain(self.inner[mul].node, "Mul") or x_slot not in self.inner[mul].inputs:
            return None
        product = self.inner[mul].outputs[0]
        if self.env[product].shape != x.shape or self.env[product].dtype != x.dtype:
            return None
        node = self.inner[gate].node
        hard = node.op_type == "HardSigmoid"
        gating = (segment_loops.HARD_SIGMOID_GATE if hard else segment_loops.SIGMOID_GATE,
                  np.float32(node.attr("alpha", 0.2) if hard else 0), np.float32(node.attr("beta", 0.5) if hard else 0))
        return members, product, _binder(x_slot, squeeze, swish, excite, gating)


def _binder(x_slot, squeeze, swish, excite, gate):
    from ..compiled import segment_loops

    w1, b1, bounds1 = squeeze
    w2, b2, bounds2 = excite
    b1 = np.zeros(w1.shape[0], np.float32) if b1 is None else np.array(b1, dtype=np.float32)
    b2 = np.zeros(w2.shape[0], np.float32) if b2 is None else np.array(b2, dtype=np.float32)
    w1, w2 = np.ascontiguousarray(w1.T), np.ascontiguousarray(w2.T)  # (squeeze_excite's (C, R) and (R, C))

    def bind(buffers, output):
        x = buffers[x_slot]
        n, c = x.shape[:2]
        flat = x.reshape(n, c, -1)
        scratch = [np.empty(size, np.float32) for size in (c, w1.shape[1], c)]
        return (segment_loops.squeeze_excite, (flat, w1, b1, bounds1, swish, w2, b2, bounds2, *gate,
                                               output.reshape(n, c, -1), *scratch))

    return bind
