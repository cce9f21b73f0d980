"""The CPU provider's segment fusion: a run of consecutive convolution-network nodes becomes one
``FusedSegment`` node (ops/segment.py) whose kernel runs them all.

A light CNN's layers take about a microsecond each in onnxruntime; run node by node here, each pays the
executor's step, its kernel's per-call checks and a fresh output array, several times its arithmetic. A
segment's kernel instead runs, per input signature, a list of prepared calls over buffers allocated once
(the compiled kernels called straight with their arguments bound), falling back to the nodes' own kernels
where a node cannot be prepared. The values computed are those of the nodes: each is still computed by its
operator's algorithm.

A segment is a maximal run of nodes, consecutive in the graph's order, of the operators in SEGMENT_OPS
(convolutions, their activations, pooling, residual sums, squeeze-excitation products, the classifier head)
whose outputs have at most MAX_VALUE_ELEMENTS elements, with at least MIN_CONVOLUTIONS convolutions; integer shape
arithmetic between them that reads none of their outputs moves before the segment. Its inputs are what its nodes
read from outside it (weights included), its outputs what anything after it (or the graph) reads.

Larger maps (an EfficientNet's expanded 96-channel layers, a ResNet's at 224x224) first get segments of
their own (_large_runs): in a run of nodes whose outputs have at most LARGE_VALUE_ELEMENTS elements, the nodes
from the first to the last with an output over MAX_VALUE_ELEMENTS, widened to where what crosses the segment's
edges is small (at most QUIET_SEAM_ELEMENTS where one is near: a block's narrow output, not the depthwise
convolution's wide one before it), where the convolutions' multiply-adds are at least WORK_PER_SEAM_ELEMENT per
element the segment copies in or out. Node by node, each of those layers pays a fresh output and a pass of its
own (an activation's); a segment pays the copies at its edges (ShuffleNet's two grouped convolutions between
channel shuffles do not make up for them). The small-valued runs around a large segment stay segments of their
own: at a batch whose large segment cannot be planned (ops/segment.py), only that one runs node by node.

The environment variable ONNX_RUNTIME_SEGMENTS=0 turns the fusion off (sessions created after it is set run
the nodes one by one, as before it existed: for comparisons).
"""

from __future__ import annotations

import os

import numpy as np
from onnx_runtime.dtypes import DataType
from onnx_runtime.ir import Graph, Node, ValueInfo
from onnx_runtime.loader import implicit_inputs

from .fusions import FUSED_DOMAIN

# (domain, op_type) the segments take: node kernels that read their inputs and return fresh outputs.
SEGMENT_OPS = frozenset({
    ("", "Conv"), (FUSED_DOMAIN, "FusedConv"), ("", "Relu"), ("", "HardSigmoid"), ("", "HardSwish"),
    ("", "Sigmoid"), ("", "Mul"), ("", "Add"), ("", "GlobalAveragePool"), ("", "MaxPool"), ("", "AveragePool"),
    ("", "Flatten"), ("", "Gemm"), ("", "ReduceMean"), ("", "Reshape"), ("", "Clip"), ("", "LeakyRelu"),
    ("", "BatchNormalization"), (FUSED_DOMAIN, "FusedBatchNormalization"), ("", "Swish"),
    # between convolutions in other CNNs (Inception's and SqueezeNet's Concat, AlexNet's LRN, a closing Softmax)
    ("", "Concat"), ("", "Softmax"), ("", "Transpose"), ("", "Squeeze"), ("", "Unsqueeze"), ("", "Identity"),
    ("", "Sub"), ("", "Div"), ("", "Tanh"), ("", "LRN"), ("", "Pad"), ("", "Dropout"),
    # a quantized CNN's roundings (qdq_fusions.fuse_quantize_dequantize) between its convolutions
    (FUSED_DOMAIN, "QuantizeDequantize"),
    # a half-precision model's rounding of its input (precision_fusions.py) before its first convolution
    (FUSED_DOMAIN, "RoundToHalf"),
})
_CONVOLUTIONS = frozenset({"Conv", "FusedConv"})
MIN_CONVOLUTIONS = 2  # a lone convolution (a transformer's patch embedding) gains nothing
ENV = "ONNX_RUNTIME_SEGMENTS"
MAX_VALUE_ELEMENTS = 1 << 16
# (up to an expanded 96-channel 112x112 map: EfficientNet-B0's and MobileNetV2's first blocks at 224x224 joined their
# large segment, where they ran node by node before; VGG's 64-channel 224x224 maps stay out)
LARGE_VALUE_ELEMENTS = 1 << 21
WORK_PER_SEAM_ELEMENT = 64
QUIET_SEAM_ELEMENTS = MAX_VALUE_ELEMENTS // 4


def _takes(node: Node) -> bool:
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    if (domain, node.op_type) not in SEGMENT_OPS or node.subgraphs():
        return False
    if node.op_type == "FusedConv" and any(node.attr(a) is not None for a in ("append", "shuffle_shape")):
        return False  # appends behind another node's channels, or reads through a shuffle
    # (a convolution writing its channels of a Concat, conv_fusions.fuse_concat_convs, is taken: the plan writes
    # them into the concatenation's buffer, segment_steps.py)
    # one output each (MaxPool's indices, BatchNormalization's training statistics stay out)
    return len([o for o in node.outputs if o]) == 1 and bool(node.outputs[0])


def small_value(graph: Graph, node: Node, limit: int | None = None) -> bool:
    """Whether the node's output has at most ``limit`` (MAX_VALUE_ELEMENTS) elements (a symbolic or unknown
    dimension counted as 1: a batch): a value where a node's Python costs about what its arithmetic does."""
    return _elements(graph, node.outputs[0]) <= (MAX_VALUE_ELEMENTS if limit is None else limit)


def _elements(graph: Graph, name: str) -> int:
    """The value's elements, a symbolic or unknown dimension counted as 1 (0 where its shape is unknown)."""
    info = graph.type_of(name)
    shape = info.shape if info is not None and info.is_tensor else None
    if shape is None:
        return 0
    count = 1
    for dim in shape:
        count *= dim if isinstance(dim, int) else 1
    return count


_SHAPE_TYPES = frozenset({DataType.INT64, DataType.INT32})


def shape_arithmetic(graph: Graph, node: Node) -> bool:
    """Whether the node computes integer values (int64 or int32 tensors): a dynamic export's shape arithmetic (a
    channel shuffle's Reshape target from Shape, Gather, Div, Unsqueeze and Concat), which a segment does not
    take: its plan holds arrays, and a Div of two scalars is none."""
    infos = [graph.type_of(name) for name in node.outputs if name]
    return bool(infos) and all(info is not None and info.is_tensor and info.dtype in _SHAPE_TYPES for info in infos)


def _runs(graph: Graph, owns, limit: int | None = None) -> list[tuple[list[Node], list[Node]]]:
    """(run, hoisted) per segment: the run's nodes (outputs of at most ``limit`` elements), and the shape arithmetic
    between them that reads nothing the run makes, which goes before the segment (a Reshape in the run may read
    it)."""
    runs: list[tuple[list[Node], list[Node]]] = []
    current: list[Node] = []
    hoisted: list[Node] = []
    made: set[str] = set()
    for node in graph.nodes:
        shapes = shape_arithmetic(graph, node)
        if not shapes and _takes(node) and (owns is None or owns(node)) and small_value(graph, node, limit):
            current.append(node)
            made.update(name for name in node.outputs if name)
            continue
        if current and shapes and not node.subgraphs() \
                and not any(name in made for name in [*node.inputs, *implicit_inputs(node)]):
            hoisted.append(node)
            continue
        if current:
            runs.append((current, hoisted))
        current, hoisted, made = [], [], set()
    if current:
        runs.append((current, hoisted))
    return [(run, hoisted) for run, hoisted in runs
            if sum(n.op_type in _CONVOLUTIONS for n in run) >= MIN_CONVOLUTIONS]


def segments_on() -> bool:
    """Whether sessions made now fuse segments (ENV)."""
    return os.environ.get(ENV, "1").strip() != "0"


def _work(graph: Graph, nodes: list[Node]) -> int:
    """The multiply-adds per image of the convolutions and products among ``nodes`` (0 for one whose shapes or
    weights are unknown)."""
    total = 0
    for node in nodes:
        if node.op_type in _CONVOLUTIONS or node.op_type == "Gemm":
            weight = graph.initializers.get(node.inputs[1]) if len(node.inputs) > 1 else None
            if weight is None or weight.ndim < 2:
                continue
            if node.op_type == "Gemm":  # (one row per image)
                total += int(np.prod(weight.shape))
            else:  # each output element reads Cin/group x kernel inputs
                total += _elements(graph, node.outputs[0]) * int(np.prod(weight.shape[1:]))
    return total


class _Seams:
    """The values a segment of consecutive nodes would copy in (what they read that is neither theirs nor a weight)
    and out (what they make that anything else, or the graph, reads)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.readers = graph.consumers()
        for node in graph.nodes:
            for name in implicit_inputs(node):
                self.readers.setdefault(name, []).append(node)
        self.graph_outputs = {vi.name for vi in graph.outputs}

    def fed(self, nodes: list[Node]) -> set[str]:
        made = {name for n in nodes for name in n.outputs if name}
        return {name for n in nodes for name in n.inputs
                if name and name not in made and name not in self.graph.initializers}

    def kept(self, nodes: list[Node]) -> set[str]:
        members = {id(n) for n in nodes}
        return {name for n in nodes for name in n.outputs if name
                and (name in self.graph_outputs or any(id(r) not in members for r in self.readers.get(name, ())))}

    def elements(self, names: set[str]) -> int:
        return sum(_elements(self.graph, name) for name in names)

    def size(self, names: set[str]) -> float:
        """Their elements; infinite where one is over MAX_VALUE_ELEMENTS."""
        sizes = [_elements(self.graph, name) for name in names]
        return float("inf") if any(n > MAX_VALUE_ELEMENTS for n in sizes) else sum(sizes)


def _edge(positions: range, seam) -> int:
    """The first of ``positions`` whose ``seam(position)`` is at most QUIET_SEAM_ELEMENTS (the later ones not
    weighed), else the one of the smallest seam (the first of equals)."""
    best, smallest = positions[0], float("inf")
    for position in positions:
        size = seam(position)
        if size <= QUIET_SEAM_ELEMENTS:
            return position
        if size < smallest:
            best, smallest = position, size
    return best


def _widened(seams: _Seams, run: list[Node], start: int, end: int) -> list[Node]:
    """run[start:end] widened to the nearest edges where what crosses them is small (_edge): its end first, then its
    start."""
    end = _edge(range(end, len(run) + 1), lambda e: seams.size(seams.kept(run[start:e])))
    start = _edge(range(start, -1, -1), lambda b: seams.size(seams.fed(run[b:end])))
    return run[start:end]


def _large_runs(graph: Graph, owns) -> list[tuple[list[Node], list[Node]]]:
    """(run, hoisted) per large segment (see the module doc): within each run of nodes of at most
    LARGE_VALUE_ELEMENTS, its nodes from the first to the last with an output over MAX_VALUE_ELEMENTS, widened to
    the nearest nodes before and after where what it copies in and out is small (a block's narrow output rather
    than a depthwise convolution's wide one), where their work pays for that seam; the shape arithmetic hoisted is
    what lies among them."""
    found = []
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    seams = _Seams(graph)
    for run, hoisted in _runs(graph, owns, LARGE_VALUE_ELEMENTS):
        large = [i for i, node in enumerate(run) if not small_value(graph, node)]
        if not large:
            continue
        middle = _widened(seams, run, large[0], large[-1] + 1)
        seam = seams.elements(seams.fed(middle) | seams.kept(middle))
        if sum(n.op_type in _CONVOLUTIONS for n in middle) < MIN_CONVOLUTIONS \
                or _work(graph, middle) < WORK_PER_SEAM_ELEMENT * seam:
            continue
        first, last = position[id(middle[0])], position[id(middle[-1])]
        found.append((middle, [n for n in hoisted if first < position[id(n)] < last]))
    return found


def fuse_segments(graph: Graph, owns=None) -> bool:
    """Replace each segment (see the module doc) by one FusedSegment node holding its nodes as its body: the large
    segments first, then the runs of small values left between them."""
    if not segments_on():
        return False
    count = 0
    for find in (_large_runs, _runs):
        for run, hoisted in find(graph, owns):
            count += _fuse(graph, count, run, hoisted)
    return count > 0


def _fuse(graph: Graph, index: int, run: list[Node], hoisted: list[Node]) -> bool:
    """The run as a FusedSegment named ``segment_<index>`` after its first node, the hoisted nodes before it."""
    members = {id(n) for n in run}
    moved = {id(n) for n in hoisted}
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    producer = graph.producers()
    produced: list[str] = [o for n in run for o in n.outputs if o]
    produced_set = set(produced)
    inputs: list[str] = []
    for n in run:
        for name in n.inputs:
            if name and name not in produced_set and name not in inputs:
                inputs.append(name)
    read_after: set[str] = {vi.name for vi in graph.outputs}
    for other in graph.nodes:
        if id(other) not in members:
            read_after.update(other.inputs)
            read_after.update(implicit_inputs(other))
    outputs = [name for name in produced if name in read_after]
    last = position[id(run[-1])]
    if not outputs or any(name in producer and position[id(producer[name])] > last for name in inputs):
        return False  # (an input made after the run: the graph is not in topological order here)
    body = Graph(
        name=f"segment_{index}", nodes=list(run),
        inputs=[ValueInfo(name, graph.type_of(name) or ValueInfo(name).type) for name in inputs],
        outputs=[ValueInfo(name, graph.type_of(name) or ValueInfo(name).type) for name in outputs],
        initializers={}, value_info={name: graph.value_info[name] for name in produced if name in graph.value_info},
        opsets=dict(graph.opsets),
    )
    fused = Node("FusedSegment", inputs, outputs, name=f"{run[0].name or run[0].op_type}/segment_{index}",
                 domain=FUSED_DOMAIN, attrs={"body": body}, opset=1)
    nodes = graph.nodes
    at = nodes.index(run[0])
    graph.nodes = nodes[:at] + hoisted + [fused] + [n for n in nodes[at:] if id(n) not in members | moved]
    return True
