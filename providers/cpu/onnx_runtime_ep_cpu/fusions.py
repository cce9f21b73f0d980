"""The CPU provider's graph fusions (its ``custom_passes``): operator patterns that exporters spell
out node by node, replaced by one kernel each.

Per-node dispatch costs a few microseconds here, so on a decode step, where tensors are tiny, the
number of nodes decides the time. Each pass matches a pattern exactly (constants by value, every
intermediate read only inside the pattern) and leaves anything else alone:

- RMS normalization: x * (1 / sqrt(mean(x^2, last axis) + eps)) * weight, the reciprocal as 1 / s,
  Reciprocal(s) or x / s, the axes an attribute or (opset 18+) an input  ->  RMSNormalization (opset 23)
- rotate-half rotary embedding: q * cos + concat(-q[..., h:], q[..., :h]) * sin  ->  RotateHalfEmbedding
- SiLU: x * sigmoid(x)  ->  Swish (opset 24)
- exact GELU: x * 0.5 * (1 + erf(x / sqrt(2))), in any Mul order, dividing by sqrt(2) or multiplying by
  1 / sqrt(2)  ->  Gelu (opset 20); its tanh form, x * 0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))
  with x^3 as Pow or products  ->  Gelu(approximate="tanh")
- Gemm over a flattened view whose product a Reshape restores  ->  the view reshaped to the output's
  leading dimensions, MatMul + bias (which the next pass fuses)
- MatMul by a constant matrix + constant bias, then optionally Gelu or a constant per-column scale (folded
  into the weight and bias), then optionally + a residual  ->  FusedMatMul
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime.ir import Graph, Node

from .fused_domain import FUSED_DOMAIN  # (kernels that no ONNX operator matches exactly)


class GraphView:
    """Producer/consumer look-ups over a graph, and its constants by value. The maps are built when a
    match first asks: most passes find no anchor node in most graphs, which then paid for maps nobody
    read (measured in 3ffd566)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.outputs = {vi.name for vi in graph.outputs}
        self._producer: dict[str, Node] | None = None
        self._consumers: dict[str, list[Node]] | None = None
        self._inner_reads: set[str] | None = None

    @property
    def producer(self) -> dict[str, Node]:
        if self._producer is None:
            self._producer = self.graph.producers()
        return self._producer

    @property
    def consumers(self) -> dict[str, list[Node]]:
        if self._consumers is None:
            self._consumers = self.graph.consumers()
        return self._consumers

    @property
    def inner_reads(self) -> set[str]:
        """Names read inside subgraphs (If/Loop/Scan bodies); gathered when a match first asks."""
        if self._inner_reads is None:
            self._inner_reads = {name for node in self.graph.nodes for sub in node.subgraphs()
                                 for name in sub.outer_names}
        return self._inner_reads

    def const(self, name: str):
        return self.graph.initializers.get(name)

    def constant(self, name: str):
        """An initializer or, before the optimizer folds them, a Constant node's tensor (passes that run first)."""
        value = self.const(name) if name else None
        if value is None and name and (node := self.producer.get(name)) is not None and node.op_type == "Constant" \
                and not node.domain and isinstance(node.attr("value"), np.ndarray):
            value = node.attr("value")
        return value

    def scalar(self, name: str, value: float) -> bool:
        array = self.const(name)
        return array is not None and array.size == 1 and float(array.reshape(-1)[0]) == value

    def only_consumer(self, name: str, op_type: str) -> Node | None:
        """The single node reading ``name`` if it is an ``op_type`` and nothing else sees the value."""
        readers = self.consumers.get(name, [])
        if len(readers) != 1 or name in self.outputs or name in self.inner_reads:
            return None
        return readers[0] if readers[0].op_type == op_type and not readers[0].domain else None

    def made_by(self, name: str, op_type: str) -> Node | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and not node.domain else None


def other_input(node: Node, name: str) -> str | None:
    """The input of a two-input node that is not ``name``."""
    if len(node.inputs) != 2 or name not in node.inputs:
        return None
    return node.inputs[1] if node.inputs[0] == name else node.inputs[0]


def owned(owns, nodes: list[Node]) -> bool:
    return owns is None or all(owns(n) for n in nodes)


def bypass(graph: Graph, node: Node, source: str) -> None:
    """Remove ``node``, whose one output equals its input ``source``: its readers read ``source`` instead."""
    output = node.outputs[0]
    graph.nodes = [n for n in graph.nodes if n is not node]
    for reader in graph.nodes:
        reader.inputs = [source if name == output else name for name in reader.inputs]


def replace_nodes(graph: Graph, removed: list[Node], fused: Node) -> None:
    """Put ``fused`` where the last removed node was (its inputs are all produced earlier)."""
    gone = {id(n) for n in removed}
    position = max(graph.nodes.index(n) for n in removed)
    nodes = [n for i, n in enumerate(graph.nodes) if id(n) not in gone or i == position]
    nodes[nodes.index(removed[-1]) if removed[-1] in nodes else 0] = fused
    graph.nodes = [n for n in nodes if id(n) not in gone or n is fused]


def fuse_chains(graph: Graph, owns, find, make) -> bool:
    """Each chain ``find(graph, view, node)`` returns (a tuple whose first item is its nodes, last the one its
    result leaves) that ``owns`` allows and that shares no node with a chain taken before becomes ``make(found)``,
    standing where its last node was; the others go, with their value_info. Whether any chain was fused."""
    view = GraphView(graph)
    fused: dict[int, Node] = {}
    gone: set[int] = set()
    for node in graph.nodes:
        found = find(graph, view, node)
        if found is None or not owned(owns, found[0]) or any(id(n) in gone or id(n) in fused for n in found[0]):
            continue
        nodes = found[0]
        fused[id(nodes[-1])] = make(found)
        gone.update(id(n) for n in nodes[:-1])
        for n in nodes[:-1]:
            graph.value_info.pop(n.outputs[0], None)
    if not fused:
        return False
    graph.nodes = [fused.get(id(n), n) for n in graph.nodes if id(n) not in gone]
    return True


def _last_axis(axes, rank_hint) -> bool:
    return axes is not None and len(axes) == 1 and (int(axes[0]) == -1 or (rank_hint and int(axes[0]) == rank_hint - 1))


def _rms_scaled(view: GraphView, root: Node, x: str) -> list[Node] | None:
    """The nodes dividing ``x`` by ``root`` (the Sqrt of mean + eps), as exporters write it: x * (1 / root)
    (TorchScript's rsqrt), x * Reciprocal(root) (dynamo's) or x / root."""
    name = root.outputs[0]
    readers = view.consumers.get(name, [])
    if len(readers) != 1 or name in view.outputs or name in view.inner_reads or readers[0].domain:
        return None
    step = readers[0]
    if step.op_type == "Div" and step.inputs == [x, name]:
        return [step]
    if step.op_type == "Reciprocal" or (step.op_type == "Div" and step.inputs[1] == name
                                        and view.scalar(step.inputs[0], 1.0)):
        scale = view.only_consumer(step.outputs[0], "Mul")
        if scale is not None and other_input(scale, step.outputs[0]) == x:
            return [step, scale]
    return None


def fuse_rms_norm(graph: Graph, owns=None) -> bool:
    view = GraphView(graph)
    for mean in list(graph.nodes):
        if mean.op_type != "ReduceMean" or mean.domain or int(mean.attr("keepdims", 1)) != 1:
            continue
        axes = mean.attr("axes") if len(mean.inputs) < 2 else view.const(mean.inputs[1])
        square = view.made_by(mean.inputs[0], "Pow")
        if square is None or not view.scalar(square.inputs[1], 2.0):
            continue
        x = square.inputs[0]
        info = graph.type_of(x)
        rank = len(info.shape) if info is not None and info.shape is not None else None
        if not _last_axis(None if axes is None else np.asarray(axes).reshape(-1), rank):
            continue
        if view.only_consumer(square.outputs[0], "ReduceMean") is not mean:
            continue
        add = view.only_consumer(mean.outputs[0], "Add")
        eps_name = other_input(add, mean.outputs[0]) if add else None
        eps = view.const(eps_name) if eps_name else None
        root = view.only_consumer(add.outputs[0], "Sqrt") if add else None
        if eps is None or eps.size != 1 or root is None:
            continue
        normed = _rms_scaled(view, root, x)
        if normed is None:
            continue
        weigh = view.only_consumer(normed[-1].outputs[0], "Mul")
        weight = other_input(weigh, normed[-1].outputs[0]) if weigh else None
        if weight is None or view.const(weight) is None or view.const(weight).ndim != 1:
            continue
        matched = [square, mean, add, root, *normed, weigh]
        if not owned(owns, matched):
            continue
        fused = Node("RMSNormalization", [x, weight], list(weigh.outputs), name=f"{weigh.name}/rms_norm",
                     attrs={"axis": -1, "epsilon": float(eps.reshape(-1)[0])}, opset=23)
        replace_nodes(graph, matched, fused)
        return True
    return False


def slice_bounds(view: GraphView, node: Node):
    """(start, end) of a Slice over the last axis with step 1, from constant inputs; else None. The axis may
    be -1 or, where the input's rank is known, rank - 1 (the dynamo exporter's spelling); an end past the
    axis (INT64_MAX, "to the end") is clamped to its size where that is known."""
    if node.op_type != "Slice" or node.domain or len(node.inputs) < 4:
        return None
    starts, ends, axes = (view.const(n) for n in node.inputs[1:4])
    steps = view.const(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else np.array([1])
    if any(v is None or v.size != 1 for v in (starts, ends, axes, steps)) or int(steps.reshape(-1)[0]) != 1:
        return None
    info = view.graph.type_of(node.inputs[0])
    shape = info.shape if info is not None else None
    axis = int(axes.reshape(-1)[0])
    if axis != -1 and (shape is None or axis != len(shape) - 1):
        return None
    start, end = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
    size = shape[-1] if shape else None
    if isinstance(size, int):
        if start < 0 or end < 0:  # negative bounds count from the end: only a known size says where
            start, end = (b + size if b < 0 else b for b in (start, end))
        end = min(end, size)
    elif start < 0 or end < 0:
        return None
    return start, end


def fuse_rotate_half(graph: Graph, owns=None) -> bool:
    view = GraphView(graph)
    for concat in list(graph.nodes):
        if concat.op_type != "Concat" or concat.domain or int(concat.attr("axis", 0)) != -1 or len(concat.inputs) != 2:
            continue
        neg = view.made_by(concat.inputs[0], "Neg")
        high = view.producer.get(neg.inputs[0]) if neg else None
        low = view.producer.get(concat.inputs[1])
        if high is None or low is None or high.inputs[0] != low.inputs[0]:
            continue
        q = low.inputs[0]
        low_bounds, high_bounds = slice_bounds(view, low), slice_bounds(view, high)
        if low_bounds is None or high_bounds is None or low_bounds[0] != 0 or high_bounds[0] != low_bounds[1]:
            continue
        if view.only_consumer(high.outputs[0], "Neg") is not neg or view.only_consumer(neg.outputs[0], "Concat") \
                is not concat or view.only_consumer(low.outputs[0], "Concat") is not concat:
            continue
        rotate = view.only_consumer(concat.outputs[0], "Mul")
        sin = other_input(rotate, concat.outputs[0]) if rotate else None
        add = view.only_consumer(rotate.outputs[0], "Add") if rotate else None
        direct = view.producer.get(other_input(add, rotate.outputs[0])) if add else None
        if sin is None or direct is None or direct.op_type != "Mul" or direct.domain or q not in direct.inputs \
                or view.only_consumer(direct.outputs[0], "Add") is not add:
            continue
        cos = other_input(direct, q)
        matched = [direct, low, high, neg, concat, rotate, add]
        if not owned(owns, matched):
            continue
        fused = Node("RotateHalfEmbedding", [q, cos, sin], list(add.outputs), name=f"{add.name}/rotate_half",
                     domain=FUSED_DOMAIN, attrs={"half": low_bounds[1], "end": high_bounds[1]}, opset=1)
        replace_nodes(graph, matched, fused)
        return True
    return False


def fuse_silu(graph: Graph, owns=None) -> bool:
    view = GraphView(graph)
    for sigmoid in list(graph.nodes):
        if sigmoid.op_type != "Sigmoid" or sigmoid.domain:
            continue
        gate = view.only_consumer(sigmoid.outputs[0], "Mul")
        if (gate is None or other_input(gate, sigmoid.outputs[0]) != sigmoid.inputs[0]
                or not owned(owns, [sigmoid, gate])):
            continue
        fused = Node("Swish", [sigmoid.inputs[0]], list(gate.outputs), name=f"{gate.name}/silu",
                     attrs={"alpha": 1.0}, opset=24)
        replace_nodes(graph, [sigmoid, gate], fused)
        return True
    return False


def _constant_of(view: GraphView, name: str, value: float, like: str) -> bool:
    """Whether ``name`` is a constant ``value`` (rounded to its own dtype, or to float16: a half-precision
    model's constant, widened by precision_fusions) that leaves ``like``'s shape alone when broadcast
    against it (a scalar, or a size-1 array of no higher rank)."""
    array = view.const(name)
    if array is None or array.size != 1 or array.dtype.kind != "f" \
            or array.reshape(-1)[0] not in (np.asarray(value, dtype=array.dtype), np.float16(value)):
        return False
    info = view.graph.type_of(like)
    return array.ndim == 0 or (info is not None and info.shape is not None and array.ndim <= len(info.shape))


def _gelu_input(view: GraphView, erf: Node) -> tuple[str, Node] | None:
    """(x, the node computing x / sqrt(2)) when Erf reads x / sqrt(2) or x * (1 / sqrt(2))."""
    if not erf.inputs:  # a malformed Erf: left for the kernel's typed error
        return None
    scale = view.producer.get(erf.inputs[0])
    if scale is None or scale.domain or len(scale.inputs) != 2:
        return None
    if scale.op_type == "Div" and _constant_of(view, scale.inputs[1], math.sqrt(2), scale.inputs[0]):
        return scale.inputs[0], scale
    if scale.op_type == "Mul":
        for x, c in (scale.inputs, scale.inputs[::-1]):
            if _constant_of(view, c, 1 / math.sqrt(2), x):
                return x, scale
    return None


def _gelu_product(view: GraphView, x: str, mul: Node, factor: str) -> list[Node] | None:
    """The two Muls forming x * 0.5 * (1 + erf) from ``mul`` = (1 + erf) * ``factor``, in the order they
    run: (x * (1 + erf)) * 0.5, ((1 + erf) * 0.5) * x, or (x * 0.5) * (1 + erf)."""
    if factor == x or _constant_of(view, factor, 0.5, x):
        outer = view.only_consumer(mul.outputs[0], "Mul")
        last = other_input(outer, mul.outputs[0]) if outer else None
        if last is None or not (_constant_of(view, last, 0.5, x) if factor == x else last == x):
            return None
        return [mul, outer]
    half = view.made_by(factor, "Mul")
    if half is None or view.only_consumer(factor, "Mul") is not mul or x not in half.inputs \
            or not _constant_of(view, other_input(half, x), 0.5, x):
        return None
    return [half, mul]


def _gelu_tail(view: GraphView, x: str, activation: str) -> list[Node] | None:
    """The nodes computing x * 0.5 * (1 + ``activation``) after it (the Add, then the two Muls in the order
    _gelu_product finds), each read only here; the erf and tanh forms share them."""
    add = view.only_consumer(activation, "Add")
    if add is None or not _constant_of(view, other_input(add, activation), 1.0, x):
        return None
    mul = view.only_consumer(add.outputs[0], "Mul")
    factor = other_input(mul, add.outputs[0]) if mul else None
    product = _gelu_product(view, x, mul, factor) if factor else None
    return None if product is None else [add, *product]


def _replace_with_gelu(graph: Graph, matched: list[Node], x: str, approximate: str) -> None:
    fused = Node("Gelu", [x], list(matched[-1].outputs), name=f"{matched[-1].name}/gelu",
                 attrs={"approximate": approximate}, opset=20)
    replace_nodes(graph, matched, fused)


def _cubed(view: GraphView, name: str, x: str) -> list[Node] | None:
    """The nodes computing ``name`` = x^3: Pow(x, 3), x * (x * x) or (x * x) * x, each read only here."""
    node = view.producer.get(name)
    if node is None or node.domain:
        return None
    if node.op_type == "Pow" and node.inputs[0] == x and _constant_of(view, node.inputs[1], 3.0, x):
        return [node]
    if node.op_type != "Mul" or x not in node.inputs:
        return None
    square = view.producer.get(other_input(node, x) or "")
    if square is None or square.op_type != "Mul" or square.domain or square.inputs != [x, x] \
            or view.only_consumer(square.outputs[0], "Mul") is not node:
        return None
    return [square, node]


def _gelu_tanh_input(view: GraphView, tanh: Node) -> tuple[str, list[Node]] | None:
    """(x, the nodes computing sqrt(2 / pi) * (x + 0.044715 * x^3)) for the Tanh of the Gelu's tanh form."""
    scaled = view.made_by(tanh.inputs[0], "Mul")
    if scaled is None or view.only_consumer(scaled.outputs[0], "Tanh") is not tanh:
        return None
    for total, factor in (scaled.inputs, scaled.inputs[::-1]):
        add = view.made_by(total, "Add")
        if add is None or view.only_consumer(total, "Mul") is not scaled:
            continue
        for x, term in (add.inputs, add.inputs[::-1]):
            inner = view.made_by(term, "Mul")
            if inner is None or not _constant_of(view, factor, math.sqrt(2 / math.pi), x) \
                    or view.only_consumer(term, "Add") is not add:
                continue
            for cube, coefficient in (inner.inputs, inner.inputs[::-1]):
                cubing = _cubed(view, cube, x) if _constant_of(view, coefficient, 0.044715, x) else None
                if cubing is not None and view.only_consumer(cube, "Mul") is inner:
                    return x, [*cubing, inner, add, scaled]
    return None


def fuse_gelu(graph: Graph, owns=None) -> bool:
    """Gelu in both of its forms: exact (Erf) and tanh."""
    return _fuse_gelu_exact(graph, owns) or _fuse_gelu_tanh(graph, owns)


def _fuse_gelu_tanh(graph: Graph, owns=None) -> bool:
    """x * 0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), in any Mul order and with x^3 as Pow or
    products -> Gelu(approximate="tanh")."""
    view = GraphView(graph)
    for tanh in list(graph.nodes):
        if tanh.op_type != "Tanh" or tanh.domain:
            continue
        found = _gelu_tanh_input(view, tanh)
        if found is None:
            continue
        x, inner = found
        tail = _gelu_tail(view, x, tanh.outputs[0])
        if tail is None:
            continue
        matched = [*inner, tanh, *tail]
        if owned(owns, matched):
            _replace_with_gelu(graph, matched, x, "tanh")
            return True
    return False


def _fuse_gelu_exact(graph: Graph, owns=None) -> bool:
    view = GraphView(graph)
    for erf in list(graph.nodes):
        if erf.op_type != "Erf" or erf.domain:
            continue
        found = _gelu_input(view, erf)
        if found is None or view.only_consumer(erf.inputs[0], "Erf") is not erf:
            continue
        x, scale = found
        tail = _gelu_tail(view, x, erf.outputs[0])
        if tail is None:
            continue
        matched = [scale, erf, *tail]
        if owned(owns, matched):
            _replace_with_gelu(graph, matched, x, "none")
            return True
    return False


def _gemm_view(view: GraphView, gemm: Node):
    """(Reshape after ``gemm``, A's producer, the shape A takes now, C's name or None) when ``gemm`` is
    A [M, K] x B + C of constants (no transposes, alpha = beta = 1), its product read only by a Reshape to
    lead + (N,) with M = prod(lead), and A, read only by it, a Transpose's output reshaped (or the
    provider's TransposeReshape)."""
    if gemm.attr("transA", 0) or gemm.attr("transB", 0) or float(gemm.attr("alpha", 1.0)) != 1.0 \
            or float(gemm.attr("beta", 1.0)) != 1.0:
        return None
    weight = view.const(gemm.inputs[1])
    bias_name = gemm.inputs[2] if len(gemm.inputs) > 2 and gemm.inputs[2] else None
    bias = view.const(bias_name) if bias_name else None
    if weight is None or weight.ndim != 2 or weight.dtype not in (np.float32, np.float64) \
            or (bias_name and (bias is None or bias.dtype != weight.dtype or bias.shape != (weight.shape[1],))):
        return None
    reshape = view.only_consumer(gemm.outputs[0], "Reshape")
    a_info = view.graph.type_of(gemm.inputs[0])
    out_info = view.graph.type_of(reshape.outputs[0]) if reshape else None
    a_shape = a_info.static_shape if a_info is not None else None
    out_shape = out_info.static_shape if out_info is not None else None
    if a_shape is None or out_shape is None or len(out_shape) < 3 or 0 in out_shape \
            or a_shape != (math.prod(out_shape[:-1]), weight.shape[0]) or out_shape[-1] != weight.shape[1]:
        return None
    producer = view.producer.get(gemm.inputs[0])
    readers = view.consumers.get(gemm.inputs[0], [])
    if producer is None or len(readers) != 1 or gemm.inputs[0] in view.outputs or gemm.inputs[0] in view.inner_reads:
        return None
    # A heads layout flattened (Transpose then Reshape, or the pair fused): the optimizer's unflatten_gemm
    # takes a Reshape of a value whose last axis is already K.
    if not ((producer.op_type == "TransposeReshape" and producer.domain == FUSED_DOMAIN)
            or (producer.op_type == "Reshape" and not producer.domain and view.const(producer.inputs[1]) is not None
                and view.made_by(producer.inputs[0], "Transpose") is not None)):
        return None
    return reshape, producer, out_shape[:-1] + (weight.shape[0],), bias_name


def fuse_gemm_view(graph: Graph, owns=None) -> bool:
    """Gemm over a flattened view restored by a Reshape -> the view reshaped to the output's leading
    dimensions and MatMul [+ Add bias], which fuse_matmul_bias then fuses with the bias and a residual
    (the dynamo GPT-2 export's attention projection: addmm over the heads' [B * S, H * D] view)."""
    view = GraphView(graph)
    for gemm in list(graph.nodes):
        if gemm.op_type != "Gemm" or gemm.domain or len(gemm.inputs) < 2:
            continue
        found = _gemm_view(view, gemm)
        if found is None:
            continue
        reshape, producer, shape, bias_name = found
        if not owned(owns, [producer, gemm, reshape]):
            continue
        a = gemm.inputs[0]
        if producer.domain == FUSED_DOMAIN:
            relaid = Node(producer.op_type, list(producer.inputs), [a], name=producer.name, domain=producer.domain,
                          attrs={**producer.attrs, "shape": list(shape)}, opset=producer.opset)
        else:
            target = f"{producer.name or a}/shape"
            while target in graph.initializers or target in graph.value_info:
                target += "_"
            graph.initializers[target] = np.asarray(shape, dtype=np.int64)
            relaid = Node("Reshape", [producer.inputs[0], target], [a], name=producer.name,
                          attrs=dict(producer.attrs or {}), opset=producer.opset)
        replace_nodes(graph, [producer], relaid)
        info = graph.type_of(a)
        graph.value_info[a] = type(graph.value_info[a])(a, type(info)("tensor", info.dtype, tuple(shape)))
        out = reshape.outputs[0]
        product = out if bias_name is None else f"{gemm.name or out}/product"
        fused = [Node("MatMul", [a, gemm.inputs[1]], [product], name=f"{gemm.name}/matmul", opset=13)]
        if bias_name is not None:
            graph.value_info[product] = type(graph.value_info[out])(product, graph.type_of(out))
            fused.append(Node("Add", [product, bias_name], [out], name=f"{gemm.name}/bias", opset=14))
        position = graph.nodes.index(reshape)
        graph.nodes[position:position + 1] = fused
        graph.nodes.remove(gemm)
        graph.value_info.pop(gemm.outputs[0], None)
        return True
    return False


# FusedMatMul's activation for each Gelu approximation.
_GELU_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_tanh"}


def fuse_matmul_bias(graph: Graph, owns=None) -> bool:
    """MatMul(A, B) + bias [-> Gelu | * column scale] [+ residual] -> FusedMatMul(A, B, bias[, residual],
    activation): the bias, activation and residual become one pass over the fresh product instead of a node
    each; a constant column scale (ConvNeXt's layer scale) is folded into new B and bias constants.
    B is a constant float matrix and bias a constant vector of its column count; A may have any rank
    (the optimizer's Gemm fusion takes the 2-D products of static shape first)."""
    view = GraphView(graph)
    for matmul in list(graph.nodes):
        if matmul.op_type != "MatMul" or matmul.domain or len(matmul.inputs) != 2:
            continue
        weight = view.const(matmul.inputs[1])
        add = view.only_consumer(matmul.outputs[0], "Add")
        bias_name = other_input(add, matmul.outputs[0]) if add else None
        bias = view.const(bias_name) if bias_name else None
        if weight is None or weight.ndim != 2 or weight.dtype not in (np.float32, np.float64) or bias is None \
                or bias.dtype != weight.dtype or bias.shape != (weight.shape[1],):
            continue
        matched, inputs, activation = [matmul, add], [*matmul.inputs, bias_name], "none"
        gelu = view.only_consumer(add.outputs[0], "Gelu")
        if gelu is not None and gelu.attr("approximate", "none") in _GELU_ACTIVATIONS:
            matched.append(gelu)
            activation = _GELU_ACTIVATIONS[gelu.attr("approximate", "none")]
        scaled = _channel_scale(view, add, weight) if gelu is None else None
        if scaled is not None:
            matched.append(scaled[0])
        residual_add = view.only_consumer(matched[-1].outputs[0], "Add")
        residual = other_input(residual_add, matched[-1].outputs[0]) if residual_add else None
        if residual is not None and residual != matched[-1].outputs[0]:
            matched.append(residual_add)
            inputs.append(residual)
        if not owned(owns, matched):
            continue
        if scaled is not None:
            inputs[1:3] = _scaled_weights(graph, view, matmul, weight, bias, scaled[1])
        fused = Node("FusedMatMul", inputs, list(matched[-1].outputs), name=f"{matmul.name}/fused",
                     domain=FUSED_DOMAIN, attrs={"activation": activation}, opset=1)
        replace_nodes(graph, matched, fused)
        _drop_unread(graph, view, [matmul.inputs[1], bias_name, *(scaled[0].inputs if scaled else ())])
        return True
    return False


def _channel_scale(view: GraphView, add: Node, weight: np.ndarray):
    """(the Mul, its constant) when the biased product is read only by a Mul with a constant of one value per
    output column (ConvNeXt's layer scale: shape (N,) or ones then N, of the weight's dtype, broadcasting over
    nothing but the last axis), which then folds into the weight's columns and the bias: a column scale
    commutes with the product, so only the rounding of the scaled weights differs."""
    mul = view.only_consumer(add.outputs[0], "Mul")
    name = other_input(mul, add.outputs[0]) if mul is not None else None
    scale = view.const(name) if name and name != add.outputs[0] else None
    if scale is None or scale.dtype != weight.dtype or scale.size != weight.shape[1] or scale.ndim == 0 \
            or scale.shape[-1] != weight.shape[1]:
        return None
    info = view.graph.type_of(add.outputs[0])
    rank = len(info.shape) if info is not None and info.is_tensor and info.shape is not None else 1
    return (mul, scale.reshape(-1)) if scale.ndim <= rank else None


def _scaled_weights(graph: Graph, view: GraphView, matmul: Node, weight, bias, scale) -> list[str]:
    """New initializers for the weight and bias with the column scale folded in (the originals may have
    other readers)."""
    names = []
    for role, value in (("weight", weight * scale), ("bias", bias * scale)):
        name = f"{matmul.name or matmul.outputs[0]}/scaled_{role}"
        while name in graph.initializers or name in graph.value_info or name in view.consumers:
            name += "_"
        graph.initializers[name] = np.ascontiguousarray(value, dtype=weight.dtype)
        names.append(name)
    return names


def _drop_unread(graph: Graph, view: GraphView, names) -> None:
    """Remove the initializers among ``names`` that no node, subgraph or graph output reads any more."""
    read = {name for node in graph.nodes for name in node.inputs} | view.outputs | view.inner_reads
    for name in names:
        if name and name in graph.initializers and name not in read:
            del graph.initializers[name]
            graph.value_info.pop(name, None)


def until_fixed(fuse):
    """A pass applying ``fuse`` until it finds nothing more (each call rewrites one match)."""

    def graph_pass(graph: Graph, owns) -> bool:
        changed = False
        while fuse(graph, owns):
            changed = True
        return changed

    graph_pass.__name__ = fuse.__name__
    return graph_pass


# fuse_matmul_bias after fuse_gelu: it folds the Gelu nodes that pass makes.
PASSES = [until_fixed(f) for f in (fuse_rms_norm, fuse_rotate_half, fuse_silu, fuse_gelu, fuse_gemm_view,
                                   fuse_matmul_bias)]
