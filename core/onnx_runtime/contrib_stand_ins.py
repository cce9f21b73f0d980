"""Shape inference through ``com.microsoft`` operators, by standard stand-ins.

onnx's shape inference knows no ``com.microsoft`` schema, so it leaves the outputs of QLinearAdd, MatMulNBits,
QGemm, SkipLayerNormalization and the like without a type, and every ``Shape``/``Reshape`` chain after them stays
unknown: nothing downstream folds, and fusions that need constant shapes do not apply. Before inference each such
node whose output shapes follow from its inputs is replaced by a few standard nodes that compute outputs of the
same shape and element type (an ``Add`` for QLinearAdd, a ``MatMul`` against a ``[K, N]`` placeholder for
MatMulNBits, ...); after inference the original nodes are put back in place of their stand-ins and the stand-ins'
own values are dropped, so the annotated graph is the model's graph with more ``value_info``.

Element types are carried without knowing them: binary elementwise operators and ``MatMul`` take their output type
from their first input, so ``Mul(scalar_of_type_T, x)`` is ``x``'s shape in ``T`` (``ReduceMax`` of any tensor of
``T`` without axes is such a scalar). Operators with no rule, and forms a rule does not cover (a ``channels_last``
pool, a transposed FusedMatMul), keep the old behaviour: their outputs are found at run time.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import helper

from .proto_walk import all_graphs, node_subgraphs

CONTRIB_DOMAIN = "com.microsoft"
# Names of the stand-in nodes and of the values only they produce; restore() removes everything named so.
_MARK = "__contrib_stand_in__"


class _Builder:
    """Stand-in nodes for one original node: helper values get unique names, the original outputs keep theirs."""

    def __init__(self, index: int, node: onnx.NodeProto, known: dict):
        self.node = node
        self.nodes: list[onnx.NodeProto] = []
        self._prefix = f"{_MARK}{index}/"
        self._known = known

    def input(self, i: int) -> str:
        return self.node.input[i] if len(self.node.input) > i else ""

    def output(self, i: int) -> str:
        return self.node.output[i] if len(self.node.output) > i else ""

    def attr(self, name: str, default=None):
        for a in self.node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    def attrs(self, names: tuple[str, ...]) -> dict:
        found = {a.name: helper.get_attribute_value(a) for a in self.node.attribute if a.name in names}
        if isinstance(found.get("auto_pad"), bytes):
            found["auto_pad"] = found["auto_pad"].decode()
        return found

    def static_shape(self, name: str) -> list[int] | None:
        """The shape of ``name`` when the model states it with every dimension known (initializers, typed
        inputs): what a rule sizing a placeholder from a weight needs."""
        return self._known.get(name) if name else None

    def elem_type(self, name: str) -> int | None:
        return self._known.get(("type", name)) if name else None

    def add(self, op_type: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        name = f"{self._prefix}{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, inputs, [output or name], name=name, **attrs))
        return output or name

    def placeholder(self, dims: list[int]) -> str:
        """A float tensor of shape ``dims`` whose values inference never reads (``ConstantOfShape`` of a constant)."""
        shape = self.add("Constant", [], value=helper.make_tensor(f"{self._prefix}dims", onnx.TensorProto.INT64,
                                                                    [len(dims)], [int(d) for d in dims]))
        return self.add("ConstantOfShape", [shape])

    def typed_as(self, like: str, value: str, output: str | None = None) -> str:
        """``value``'s shape in the element type of ``like`` (any tensor): a scalar of that type times ``value``."""
        scalar = self.add("ReduceMax", [like], keepdims=0)
        return self.add("Mul", [scalar, value], output)


# A rule adds stand-ins for the outputs it can describe, and returns False for a form it does not cover.
Rule = Callable[[_Builder], bool]


def _same_as_first(b: _Builder) -> bool:
    """Output 0 (and, for the skip layer norms, 3: the sum) has input 0's shape and type."""
    b.add("Identity", [b.input(0)], b.output(0))
    if b.node.op_type.startswith("Skip") and b.output(3):
        b.add("Identity", [b.input(0)], b.output(3))
    return True


def _qlinear_binary(b: _Builder) -> bool:  # QLinearAdd / QLinearMul: A, A_scale, A_zp, B, B_scale, B_zp, C_scale, C_zp
    b.add("Add", [b.input(0), b.input(3)], b.output(0))
    return True


def _qlinear_concat(b: _Builder) -> bool:  # Y_scale, Y_zp, then (X, X_scale, X_zp) per input
    tensors = list(b.node.input[2::3])
    if not tensors or not all(tensors):
        return False
    b.add("Concat", tensors, b.output(0), axis=int(b.attr("axis", 0)))
    return True


def _qlinear_pool(b: _Builder) -> bool:
    if b.attr("channels_last", 0):
        return False  # NHWC: the standard pools read NCHW
    if b.node.op_type == "QLinearGlobalAveragePool":
        b.add("GlobalAveragePool", [b.input(0)], b.output(0))
    else:
        b.add("AveragePool", [b.input(0)], b.output(0),
              **b.attrs(("auto_pad", "ceil_mode", "count_include_pad", "kernel_shape", "pads", "strides")))
    return True


def _qgemm(b: _Builder) -> bool:  # A, a_scale, a_zp, B, b_scale, b_zp, C, y_scale, y_zp
    product = b.add("Gemm", [b.input(0), b.input(3)], transA=int(b.attr("transA", 0)), transB=int(b.attr("transB", 0)))
    if not b.input(7):
        b.add("Cast", [product], b.output(0), to=onnx.TensorProto.FLOAT)  # no y_scale: float output
    elif b.input(8):
        b.add("Mul", [b.input(8), product], b.output(0))  # quantized, in y_zero_point's type (a scalar)
    else:
        return False
    return True


def _matmul_nbits(b: _Builder) -> bool:  # A [..., K] times a [K, N] weight, in A's type
    k, n = b.attr("K"), b.attr("N")
    if not isinstance(k, int) or not isinstance(n, int) or k <= 0 or n <= 0:
        return False
    b.add("MatMul", [b.input(0), b.placeholder([k, n])], b.output(0))
    return True


def _dynamic_quantize_matmul(b: _Builder) -> bool:  # float A times integer B: in A's type
    b.add("MatMul", [b.input(0), b.input(1)], b.output(0))
    return True


def _matmul_integer_to_float(b: _Builder) -> bool:  # A, B, a_scale, ...: the product in a_scale's type
    b.typed_as(b.input(2), b.add("MatMul", [b.input(0), b.input(1)]), b.output(0))
    return True


def _quantize(b: _Builder) -> bool:  # x, y_scale, y_zero_point: x's shape in the zero point's type
    if b.input(2):
        b.typed_as(b.input(2), b.input(0), b.output(0))
    else:
        b.add("Cast", [b.input(0)], b.output(0), to=onnx.TensorProto.UINT8)
    return True


def _dequantize(b: _Builder) -> bool:  # x, x_scale, x_zero_point: x's shape in the scale's type
    b.typed_as(b.input(1), b.input(0), b.output(0))
    return True


def _gather_block_quantized(b: _Builder) -> bool:  # data, indices, scales, zero_points
    shape = b.static_shape(b.input(0))
    bits = int(b.attr("bits", 4))
    if not shape or bits not in (2, 4, 8):
        return False
    logical = list(shape)
    if b.elem_type(b.input(0)) == onnx.TensorProto.UINT8:
        logical[-1] *= 8 // bits  # uint8 data packs 8 // bits values per byte along its last axis
    gathered = b.add("Gather", [b.placeholder(logical), b.input(1)], axis=int(b.attr("gather_axis", 0)))
    b.typed_as(b.input(2), gathered, b.output(0))
    return True


def _fused_matmul(b: _Builder) -> bool:
    if any(b.attr(name, 0) for name in ("transA", "transB", "transBatchA", "transBatchB")):
        return False
    b.add("MatMul", [b.input(0), b.input(1)], b.output(0))
    return True


def _fused_conv(b: _Builder) -> bool:  # X, W, B, Z: a Conv's shape
    b.add("Conv", list(b.node.input[:3]), b.output(0),
          **b.attrs(("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")))
    return True


def _attention(b: _Builder) -> bool:  # input, weights, bias, ...: [batch, sequence, v_hidden] in input's type
    weights = b.static_shape(b.input(1))
    if weights is None or len(weights) != 2:
        return False
    sizes = b.attr("qkv_hidden_sizes")
    v_hidden = int(sizes[2]) if sizes else weights[1] // 3
    product = b.add("MatMul", [b.input(0), b.placeholder([weights[0], v_hidden])])
    if b.node.op_type == "QAttention":  # input, weight, bias, input_scale: float in the scale's type
        b.typed_as(b.input(3), product, b.output(0))
    else:
        b.add("Identity", [product], b.output(0))
    return True


def _group_query_attention(b: _Builder) -> bool:
    if not b.input(1):
        return False  # packed QKV: the output's hidden size is not the query's
    b.add("Identity", [b.input(0)], b.output(0))
    return True


def _embed_layer_normalization(b: _Builder) -> bool:  # input_ids, segment_ids, word_embedding, ...
    rows = b.add("Gather", [b.input(2), b.input(0)])
    if b.node.op_type == "QEmbedLayerNormalization":  # quantized tables: float in word_embedding_scale's type
        b.typed_as(b.input(8), rows, b.output(0))
    else:
        b.add("Identity", [rows], b.output(0))
    return True


_RULES: dict[str, Rule] = {
    **dict.fromkeys(("QLinearAdd", "QLinearMul"), _qlinear_binary),
    **dict.fromkeys(("QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax", "Gelu", "FastGelu", "QuickGelu",
                     "BiasGelu", "BiasAdd", "RotaryEmbedding", "SkipLayerNormalization",
                     "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization", "LayerNormalization"),
                    _same_as_first),
    "QLinearConcat": _qlinear_concat,
    **dict.fromkeys(("QLinearGlobalAveragePool", "QLinearAveragePool"), _qlinear_pool),
    "QGemm": _qgemm,
    "MatMulNBits": _matmul_nbits,
    "DynamicQuantizeMatMul": _dynamic_quantize_matmul,
    "MatMulIntegerToFloat": _matmul_integer_to_float,
    "QuantizeLinear": _quantize,
    "DequantizeLinear": _dequantize,
    "GatherBlockQuantized": _gather_block_quantized,
    "FusedMatMul": _fused_matmul,
    "FusedConv": _fused_conv,
    **dict.fromkeys(("Attention", "QAttention"), _attention),
    "GroupQueryAttention": _group_query_attention,
    **dict.fromkeys(("EmbedLayerNormalization", "QEmbedLayerNormalization"), _embed_layer_normalization),
}


def covered_operators() -> frozenset[str]:
    """The ``com.microsoft`` operators shape inference sees through (in the forms their rules cover)."""
    return frozenset(_RULES)


class StandIns:
    """A model prepared for onnx shape inference, and the way back from its inferred graph to the model's nodes."""

    def __init__(self, model: onnx.ModelProto, originals: list[onnx.NodeProto]):
        self.model = model
        self._originals = originals

    def restore(self, inferred: onnx.GraphProto) -> onnx.GraphProto:
        """``inferred`` (the top-level graph inference returned for :attr:`model`) with the original nodes back in
        place of their stand-ins and the stand-ins' own values gone."""
        if self._originals:
            self._restore(inferred)
        return inferred

    def _restore(self, graph: onnx.GraphProto) -> None:
        nodes: list[onnx.NodeProto] = []
        put_back: set[int] = set()
        for node in graph.node:
            if node.name.startswith(_MARK):
                index = int(node.name[len(_MARK):].split("/", 1)[0])
                if index not in put_back:  # where its first stand-in was: the order stays topological
                    put_back.add(index)
                    nodes.append(self._originals[index])
                continue
            for sub in node_subgraphs(node):
                self._restore(sub)
            nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)
        kept = [vi for vi in graph.value_info if not vi.name.startswith(_MARK)]
        del graph.value_info[:]
        graph.value_info.extend(kept)


def stand_in_contrib_ops(model: onnx.ModelProto) -> StandIns:
    """``model`` with its ``com.microsoft`` nodes that have a rule replaced by standard stand-ins, in every graph (a
    copy; the model itself where there is nothing to replace). A node whose rule fails stays as it is."""
    if not any(_has_contrib(graph) for graph in all_graphs(model.graph)):
        return StandIns(model, [])
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    originals: list[onnx.NodeProto] = []
    _replace(copy.graph, {}, originals)
    return StandIns(copy, originals) if originals else StandIns(model, [])


def _has_contrib(graph: onnx.GraphProto) -> bool:
    return any(_rule(node) is not None for node in graph.node)


def _rule(node: onnx.NodeProto) -> Callable[[_Builder], bool] | None:
    """A com.microsoft node's rule, or SimplifiedLayerNormalization's (onnxruntime registers it in the ONNX
    domain, which onnx does not know it in)."""
    if node.domain == CONTRIB_DOMAIN or (node.domain in ("", "ai.onnx")
                                         and node.op_type == "SimplifiedLayerNormalization"):
        return _RULES.get(node.op_type)
    return None


def _replace(graph: onnx.GraphProto, outer: dict, originals: list[onnx.NodeProto]) -> None:
    known = dict(outer)
    known.update(_known_shapes(graph))
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        for sub in node_subgraphs(node):
            _replace(sub, known, originals)
        rule = _rule(node)
        if rule is not None:
            builder = _Builder(len(originals), node, known)
            try:
                covered = rule(builder)
            except (ValueError, TypeError, IndexError):  # a malformed attribute: the kernel reports it
                covered = False
            if covered and builder.nodes:
                original = onnx.NodeProto()
                original.CopyFrom(node)
                originals.append(original)
                nodes.extend(builder.nodes)
                continue
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _known_shapes(graph: onnx.GraphProto) -> dict:
    """Fully static shapes (by name) and element types (by ``("type", name)``) that the graph states for its
    initializers, inputs and annotated values."""
    found: dict = {}
    for vi in (*graph.input, *graph.value_info):
        if not vi.type.HasField("tensor_type"):
            continue
        tensor = vi.type.tensor_type
        found[("type", vi.name)] = tensor.elem_type
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim):
            found[vi.name] = [d.dim_value for d in tensor.shape.dim]
    for init in graph.initializer:
        found[init.name] = list(init.dims)
        found[("type", init.name)] = init.data_type
    return found
