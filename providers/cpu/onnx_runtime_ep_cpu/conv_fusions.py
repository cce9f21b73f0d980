"""The CPU provider's convolution fusions: an activation (and a residual Add before it) folded into
the Conv or inference BatchNormalization that produces its input.

CNN exporters write ``Conv -> Relu`` and ``Conv -> Add(residual) -> Relu`` as separate nodes; each
then reads and writes a whole feature map and allocates a new one. Fused, the Conv's fresh output
takes the residual and the activation in place (see ``FusedConv`` in ops/conv.py), as onnxruntime's
FusedConv does. The results are the same values: the same float operations run in the same order.

- Conv [-> Add/Sum(other)] [-> Relu | Clip(constant bounds) | LeakyRelu | HardSwish]  ->  FusedConv
- BatchNormalization (inference) -> Relu | Clip | LeakyRelu  ->  FusedBatchNormalization
- Concat(axis=1) of convolutions read nowhere else  ->  a chain of FusedConv writing into one tensor
- channel shuffle (Reshape -> Transpose -> Reshape) -> depthwise Conv  ->  FusedConv reading through it
- Concat(Concat(Concat(x0, conv1), conv2), ...)  ->  ConcatBuffer(x0) and FusedConv appending to it
"""

from __future__ import annotations

import math

from onnx_runtime.ir import Graph, Node
from onnx_runtime.optimizer.rewrite import Uses, constant, remove_nodes

from .fusions import FUSED_DOMAIN
from .segment_fusions import fuse_segments, segments_on, small_value

ACTIVATIONS = ("Relu", "Clip", "LeakyRelu", "HardSwish")
# What FusedBatchNormalization applies (FusedConv also takes HardSwish: MobileNetV3's Conv -> HardSwish).
_NORMALIZATION_ACTIVATIONS = ("Relu", "Clip", "LeakyRelu")


def _plain(node: Node | None, *op_types: str) -> bool:
    return node is not None and node.op_type in op_types and node.domain in ("", "ai.onnx")


def activation_params(graph: Graph, node: Node) -> list[float] | None:
    """The constant parameters of an activation node, or None when they are not constants."""
    if node.op_type in ("Relu", "HardSwish"):
        return []
    if node.op_type == "LeakyRelu":
        return [float(node.attr("alpha", 0.01))]
    if node.opset < 11:  # Clip-1/6: bounds are attributes
        return [float(node.attr("min", -math.inf)), float(node.attr("max", math.inf))]
    bounds = []
    for index, default in ((1, -math.inf), (2, math.inf)):
        name = node.inputs[index] if len(node.inputs) > index else ""
        value = constant(graph, name)
        if name and (value is None or value.size != 1):
            return None
        bounds.append(float(value.reshape(-1)[0]) if name else default)
    return bounds


def _is_inference_batchnorm(node: Node) -> bool:
    if node.opset >= 14 and node.attr("training_mode", 0):
        return False
    if node.opset < 9 and not node.attr("spatial", 1):
        return False  # per-activation statistics: the kernel's general path, not worth a fused op
    return len(node.inputs) == 5 and not any(node.outputs[1:])


def _residual_add(node: Node | None) -> bool:
    """An elementwise sum of two values with numpy broadcasting (Add-1/6 broadcast differently)."""
    if _plain(node, "Sum"):
        return len(node.inputs) == 2
    return _plain(node, "Add") and node.opset >= 7


class _Matcher:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.uses = Uses(graph)
        self.producer = graph.producers()

    def feeds_only(self, name: str, reader: Node) -> Node | None:
        """The producer of ``name`` when ``reader`` is the only thing that reads it."""
        return self.producer.get(name) if self.uses.only_reader(name) is reader else None

    def conv_into(self, add: Node) -> tuple[Node, str] | None:
        """A Conv feeding one side of ``add`` (read nowhere else), and the other side."""
        a, b = add.inputs
        for mine, other in ((a, b), (b, a)):
            conv = self.feeds_only(mine, add)
            if _plain(conv, "Conv") and mine != other and other:
                return conv, other
        return None

    def match(self, node: Node):
        """(the nodes replaced, the fused node) for a pattern ending at ``node``, or None."""
        params, residual, add = [], "", None
        if _plain(node, *ACTIVATIONS):
            params = activation_params(self.graph, node)
            source = self.feeds_only(node.inputs[0], node) if params is not None else None
            if _plain(source, "BatchNormalization") and _is_inference_batchnorm(source) \
                    and _plain(node, *_NORMALIZATION_ACTIVATIONS):
                return [source, node], self._fused("FusedBatchNormalization", source, node, params)
            if _residual_add(source) and self.conv_into(source) is not None:
                add, source = source, None
        elif _residual_add(node) and not self._activation_follows(node):
            add, source = node, None
        else:
            return None
        if add is not None:
            found = self.conv_into(add)
            if found is None:
                return None
            source, residual = found
        if not _plain(source, "Conv"):
            return None
        matched = list(dict.fromkeys(n for n in (source, add, node) if n is not None))  # node may be the add
        return matched, self._fused("FusedConv", source, node, params, residual)

    def _activation_follows(self, add: Node) -> bool:
        reader = self.uses.only_reader(add.outputs[0])
        return _plain(reader, *ACTIVATIONS) and activation_params(self.graph, reader) is not None

    def _fused(self, op_type: str, source: Node, last: Node, params: list[float], residual: str = "") -> Node:
        attrs = dict(source.attrs)
        if _plain(last, *ACTIVATIONS):
            attrs.update(activation=last.op_type, activation_params=params)
        inputs = list(source.inputs)
        if residual:
            inputs += [""] * (3 - len(inputs)) + [residual]  # Conv's optional bias keeps its place
        return Node(op_type, inputs, list(last.outputs), name=f"{last.name or source.name}/fused",
                    domain=FUSED_DOMAIN, attrs=attrs, opset=1)


def _has(graph: Graph, *op_types: str) -> bool:
    """Whether any node of ``graph`` is one of ``op_types``: a pass whose patterns start at one returns at
    once without (a long chain of elementwise ops spent a share of its session creation matching; e599751)."""
    return any(node.op_type in op_types for node in graph.nodes)


def fuse_conv_activations(graph: Graph, owns=None) -> bool:
    """Fold activations and residual Adds into the Conv/BatchNormalization before them."""
    if not _has(graph, "Conv", "BatchNormalization"):
        return False
    matcher = _Matcher(graph)
    removed: list[Node] = []
    replaced: dict[int, Node] = {}
    taken: set[int] = set()
    for node in list(graph.nodes):
        found = matcher.match(node)
        if found is None:
            continue
        nodes, fused = found
        if any(id(n) in taken for n in nodes) or (owns is not None and not all(owns(n) for n in nodes)):
            continue
        taken.update(id(n) for n in nodes)
        replaced[id(node)] = fused
        removed += [n for n in nodes if n is not node]
    if not replaced:
        return False
    graph.nodes = [replaced.get(id(n), n) for n in graph.nodes]
    remove_nodes(graph, removed)  # the fused node sits where the last one was; the session re-sorts
    return True


def _concat_axis(node: Node) -> int | None:
    axis = node.attr("axis")
    return None if axis is None else int(axis)


def _rewritable_conv(node: Node | None) -> bool:
    """A Conv, or a FusedConv with none of the roles these passes give (a concat part, a shuffle reader,
    an appender): those keep the extra input they were given."""
    if _plain(node, "Conv"):
        return True
    return (node is not None and node.op_type == "FusedConv" and node.domain == FUSED_DOMAIN
            and not any(node.attr(role) is not None for role in ("concat_channels", "shuffle_shape", "append")))


def _sole_conv(graph: Graph, matcher: _Matcher, reader: Node, name: str) -> tuple[Node, int] | None:
    """The 2-D convolution producing ``name`` for ``reader`` alone, and its output channel count (from
    its constant weights)."""
    conv = matcher.feeds_only(name, reader) if name else None
    if not _rewritable_conv(conv) or len(conv.outputs) != 1:
        return None
    weights = constant(graph, conv.inputs[1]) if len(conv.inputs) > 1 else None
    if weights is None or weights.ndim != 4:
        return None
    return conv, int(weights.shape[0])


def _conv_producers(graph: Graph, matcher: _Matcher, concat: Node) -> list[tuple[Node, int]] | None:
    """For a channel Concat of 2-D convolution outputs that it alone reads: each producing Conv/FusedConv
    with its output channel count; None otherwise."""
    if not _plain(concat, "Concat") or _concat_axis(concat) != 1 or len(concat.inputs) < 2 \
            or len(set(concat.inputs)) != len(concat.inputs):
        return None
    found = [_sole_conv(graph, matcher, concat, name) for name in concat.inputs]
    return None if None in found else found


def fuse_concat_convs(graph: Graph, owns=None) -> bool:
    """Channel Concats of convolution outputs: each convolution writes its channels straight into the
    concatenated tensor (a chain of FusedConv nodes, each taking the buffer the previous one filled
    part of and filling its own channels), so the Concat's copy of every input goes (a SqueezeNet fire
    module's, an Inception block's)."""
    if not _has(graph, "Conv", "FusedConv"):
        return False
    matcher = _Matcher(graph)  # one view for every match: the matches share no node
    replaced: dict[int, Node] = {}
    removed: list[Node] = []
    for concat in list(graph.nodes):
        producers = _conv_producers(graph, matcher, concat)
        if producers is None or (owns is not None and not all(owns(n) for n in [concat, *(c for c, _ in producers)])):
            continue
        total = sum(channels for _, channels in producers)
        previous, offset, fused = "", 0, []
        for index, (conv, channels) in enumerate(producers):
            attrs = dict(conv.attrs, concat_channels=total, concat_offset=offset)
            inputs = list(conv.inputs) + [""] * (4 - len(conv.inputs)) + [previous] if previous else list(conv.inputs)
            last = index == len(producers) - 1
            output = concat.outputs[0] if last else f"{concat.outputs[0]}/concat_part{index}"
            name = f"{conv.name or concat.name}/into_concat"
            fused.append(Node("FusedConv", inputs, [output], name=name, domain=FUSED_DOMAIN, attrs=attrs, opset=1))
            previous, offset = output, offset + channels
        replaced.update({id(conv): node for (conv, _), node in zip(producers, fused)})
        removed.append(concat)  # each part now reads the one before
    return _rewrite(graph, replaced, removed)


def _reshape_target(graph: Graph, node: Node | None) -> tuple[int, ...] | None:
    """A Reshape's constant target shape when every dimension is given (no 0 or -1), else None."""
    if not _plain(node, "Reshape") or node.opset < 5 or len(node.inputs) != 2:
        return None
    shape = constant(graph, node.inputs[1])
    if shape is None or shape.dtype.kind not in "iu" or shape.ndim != 1 or (shape <= 0).any():
        return None
    return tuple(int(d) for d in shape)


def _shuffle_into(graph: Graph, matcher: _Matcher, conv: Node) -> tuple[list[Node], tuple[int, ...]] | None:
    """For a depthwise convolution of a channel shuffle that it alone reads (ShuffleNet's
    Reshape(N, g, C/g, H, W) -> Transpose(0, 2, 1, 3, 4) -> Reshape(N, C, H, W)): the shuffle's three
    nodes and its first shape."""
    if not _rewritable_conv(conv):
        return None
    merge = matcher.feeds_only(conv.inputs[0], conv)
    transpose = matcher.feeds_only(merge.inputs[0], merge) if _plain(merge, "Reshape") else None
    split = matcher.feeds_only(transpose.inputs[0], transpose) if _plain(transpose, "Transpose") else None
    first, last = _reshape_target(graph, split), _reshape_target(graph, merge)
    perm = [int(p) for p in transpose.attr("perm", [])] if transpose is not None else []
    if first is None or last is None or len(first) != 5 or perm != [0, 2, 1, 3, 4]:
        return None
    n, groups, per_group, h, w = first
    weights = constant(graph, conv.inputs[1]) if len(conv.inputs) > 1 else None
    depthwise = (weights is not None and weights.ndim == 4 and weights.shape[:2] == (groups * per_group, 1)
                 and int(conv.attr("group", 1)) == groups * per_group)
    if last != (n, groups * per_group, h, w) or not depthwise:
        return None
    return [split, transpose, merge], first


def fuse_channel_shuffle(graph: Graph, owns=None) -> bool:
    """A depthwise convolution reads its input's channel shuffle in place: each of its channels from the
    input channel the shuffle would move there (a FusedConv with ``shuffle_shape``), so the shuffled
    copy of the feature map goes (ShuffleNet: one per unit)."""
    if not _has(graph, "Conv", "FusedConv"):
        return False
    matcher = _Matcher(graph)  # one view for every match: the matches share no node
    replaced: dict[int, Node] = {}
    removed: list[Node] = []
    for conv in list(graph.nodes):
        found = _shuffle_into(graph, matcher, conv)
        if found is None:
            continue
        shuffle, shape = found
        if owns is not None and not all(owns(n) for n in [*shuffle, conv]):
            continue
        attrs = dict(conv.attrs, shuffle_shape=list(shape))
        replaced[id(conv)] = Node("FusedConv", [shuffle[0].inputs[0], *conv.inputs[1:]], list(conv.outputs),
                                  name=f"{conv.name}/shuffled", domain=FUSED_DOMAIN, attrs=attrs, opset=1)
        removed += shuffle
    return _rewrite(graph, replaced, removed)


def _rewrite(graph: Graph, replaced: dict[int, Node], removed: list[Node], added: list[Node] = ()) -> bool:
    """Swap in the ``replaced`` nodes (by the id of the node each replaces), add ``added`` and drop
    ``removed``; the session re-sorts the nodes. Whether anything changed."""
    if not replaced and not added:
        return False
    graph.nodes = list(added) + [replaced.get(id(n), n) for n in graph.nodes]
    remove_nodes(graph, removed)
    return True


def _dense_step(graph: Graph, matcher: _Matcher, concat: Node) -> tuple[Node, int] | None:
    """For Concat(axis=1)(previous, new convolution): the convolution and its channel count."""
    if not _plain(concat, "Concat") or _concat_axis(concat) != 1 or len(concat.inputs) != 2 \
            or concat.inputs[0] == concat.inputs[1]:
        return None
    return _sole_conv(graph, matcher, concat, concat.inputs[1])


def _dense_chain(graph: Graph, matcher: _Matcher, head: Node, step, owns) -> list[tuple]:
    """(Concat, its convolution, its channels) from ``head`` (its _dense_step ``step``) on, each link the only
    Concat reading the one before first."""
    chain = [(head, *step)]
    while True:
        readers = matcher.uses.readers.get(chain[-1][0].outputs[0], [])
        concats = [r for r in readers if _plain(r, "Concat")]
        if len(concats) != 1 or concats[0].inputs[0] != chain[-1][0].outputs[0]:
            return chain
        following = _dense_step(graph, matcher, concats[0])
        if following is None or (owns is not None and not owns(concats[0])):
            return chain
        chain.append((concats[0], *following))


def fuse_dense_concats(graph: Graph, owns=None) -> bool:
    """DenseNet's growing Concats (each layer's features appended to everything before them): the chain
    C1 = Concat(x0, n1), C2 = Concat(C1, n2), ... becomes one tensor allocated once (ConcatBuffer, x0
    copied in), each layer's convolution writing its channels after the others' and returning the
    channels so far as a view (FusedConv with ``append``), so the copy of all earlier features per
    layer goes. A link C(k-1) -> C(k) needs C(k) to be C(k-1)'s only Concat reader (a second append
    would write the same channels); C(k-1)'s other readers (the next layer) see a view."""
    if not _has(graph, "Conv", "FusedConv"):
        return False
    matcher = _Matcher(graph)  # one view for every chain: the chains share no node
    replaced: dict[int, Node] = {}
    removed: list[Node] = []
    added: list[Node] = []
    for head in list(graph.nodes):
        step = _dense_step(graph, matcher, head)
        if step is None or (owns is not None and not owns(head)):
            continue
        previous = matcher.producer.get(head.inputs[0])
        if previous is not None and _dense_step(graph, matcher, previous) is not None \
                and [r.op_type for r in matcher.uses.readers.get(previous.outputs[0], [])].count("Concat") == 1:
            continue  # not the chain's first link: taken with its head
        chain = _dense_chain(graph, matcher, head, step, owns)
        if owns is not None and not all(owns(conv) for _, conv, _ in chain):
            continue
        if segments_on() and all(small_value(graph, concat) for concat, _, _ in chain):
            continue  # (a segment takes the Concats: its plan writes each once, in a buffer of its own)
        buffer = f"{head.outputs[0]}/buffer"
        added.append(Node("ConcatBuffer", [head.inputs[0]], [buffer], name=f"{head.name}/buffer", domain=FUSED_DOMAIN,
                          attrs={"extra": sum(channels for _, _, channels in chain)}, opset=1))
        previous_name = buffer
        for concat, conv, _ in chain:
            inputs = list(conv.inputs) + [""] * (4 - len(conv.inputs)) + [previous_name]
            replaced[id(conv)] = Node("FusedConv", inputs, list(concat.outputs),
                                      name=f"{conv.name or concat.name}/append", domain=FUSED_DOMAIN,
                                      attrs=dict(conv.attrs, append=1), opset=1)
            previous_name = concat.outputs[0]
            removed.append(concat)
    return _rewrite(graph, replaced, removed, added)


# fuse_segments after the passes whose FusedConv nodes it takes; fuse_channel_shuffle after it, on the shuffles no
# segment took (a segment's plan copies a shuffle's permuted view once; a shuffled FusedConv would end its segment).
CONV_PASSES = [fuse_conv_activations, fuse_concat_convs, fuse_dense_concats, fuse_segments, fuse_channel_shuffle]
