"""onnxruntime's fused contrib operators spelled as the standard operators this provider fuses best.

onnxruntime's transformer optimizer folds a block's bias, residual, Gelu, normalization and attention into
com.microsoft nodes, each kept apart from the MatMul before it. Run as written, each is a kernel after a plain
MatMul; the same math exported node by node ends in FusedMatMul (the product, its bias, its Gelu and its
residual add in one pass over the product), the compiled normalizations and the ONNX Attention kernel. This
pass rewrites the contrib nodes into that standard form, so the provider's own fusions (fusions.py,
decoder_fusions.py) see the graph an exporter would have written:

- BiasGelu(a, b) of a MatMul's product  ->  Add(a, b), Gelu (opset 20); FastGelu(x, bias)  ->  the same with
  Gelu(approximate="tanh") (any other Gelu runs the contrib kernels, which use the ONNX Gelu's compiled loop)
- SkipLayerNormalization(x, skip, gamma[, beta][, bias])  ->  Add(x, bias), Add(., skip),
  LayerNormalization (opset 17; its Mean and InvStdDev are the node's optional mean and inv_std_var outputs,
  the residual sum its input_skip_bias_sum)
- SkipSimplifiedLayerNormalization(x, skip, gamma[, bias])  ->  the same adds, RMSNormalization (opset 23),
  when its mean and inv_std_var outputs are unread; SimplifiedLayerNormalization  ->  RMSNormalization
- Attention(input, weights, bias[, mask_index]) without a past, an attention bias or rotary embedding  ->
  float32 with Q, K and V of one size: ContribPackedAttention (one product by the packed weight, the attention
  over it in place, the mask index read there); otherwise MatMul and Add per Q, K and V (the weight's blocks),
  ONNX Attention (opset 23; unidirectional is its is_causal), the mask
  as its additive bias (ContribAttentionMask: mask_filter_value on hidden keys, as the contrib kernel adds)
- MultiHeadAttention of 3-D query, key and value without a past, an attention bias or a beam cache  ->  its
  packed bias as one Add per projection (FusedMatMul's bias), ONNX Attention, the mask as above

Only nodes whose parameters (gamma, beta, biases, weights) are constants are rewritten: parameters fed at run
time keep the contrib kernel, which checks them per call. The bias is added to whichever of input and skip a
MatMul made (so the product, bias and residual fuse); the contrib kernels add the three in one pass, so the two
roundings' order differs (float32 tolerance). Only float32 and float64 nodes are rewritten (their type known
from a constant input or the graph's value types; half-precision graphs that precision_fusions.py converted are
float32 by then): a half-precision node keeps the contrib kernel, which rounds once at its output where the
standard ops would round per op.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.dtypes import DataType
from onnx_runtime.ir import Graph, Node, TypeInfo, ValueInfo
from onnx_runtime.optimizer.context import FreshNames

from .fusions import FUSED_DOMAIN, GraphView
from .tuning import KNOBS

CONTRIB = "com.microsoft"
_FLOATS = (DataType.FLOAT, DataType.DOUBLE)
# The contrib normalizations' default epsilon (their schemas').
_CONTRIB_EPSILON = 1e-12
# ContribPackedAttention's compiled loop takes attention up to this many times the few_query_macs knob's
# multiply-adds (Q.K); the ONNX Attention kernel's blocked products were level with it about there on the
# AVX-512 host. Longer sequences declared in the graph keep the split projections.
PACKED_LOOP_MACS = 2
# Where attention_lanes.py's 16-lane loop runs it (AVX-512 hosts, no causal frontier) the packed path outran the
# ONNX Attention kernel over the split projections up to about this many times the knob's multiply-adds.
PACKED_LANES_MACS = 16


def packed_macs_factor(causal: bool) -> int:
    """How many times the few_query_macs knob's Q.K multiply-adds ContribPackedAttention's compiled path takes."""
    from .algorithms.products import gemv_host

    return PACKED_LANES_MACS if not causal and gemv_host() else PACKED_LOOP_MACS
# Producers whose output has the dtype of their constant (weight) input.
_WEIGHTED = frozenset({"MatMul", "Gemm", "Conv", "FusedMatMul"})


def _input(node: Node, index: int) -> str | None:
    return node.inputs[index] if len(node.inputs) > index and node.inputs[index] else None


class _Lowering:
    def __init__(self, graph: Graph, owns):
        self.graph, self.owns = graph, owns
        self.view = GraphView(graph)
        self.fresh = FreshNames(graph)
        self.inputs = {vi.name: vi.type for vi in graph.inputs}
        self.masks: dict[tuple, str] = {}  # (mask, input, fill) -> the additive bias made of it
        self.read = {name for node in graph.nodes for name in node.inputs if name} \
            | {vi.name for vi in graph.outputs} | self.view.inner_reads

    def dtype(self, name: str | None, depth: int = 2) -> DataType | None:
        """The element type of ``name`` where the graph says it: a constant's, a typed value's, or that of a
        weighted product's constant weight."""
        if not name:
            return None
        const = self.graph.initializers.get(name)
        if const is not None:
            return DataType.from_numpy(const.dtype) if isinstance(const, np.ndarray) else None
        info = self.graph.type_of(name) or self.inputs.get(name)
        if info is not None and info.is_tensor and info.dtype is not None:
            return info.dtype
        producer = self.view.producer.get(name)
        if depth and producer is not None and producer.op_type in _WEIGHTED:
            return self.dtype(_input(producer, 1), depth - 1)
        return None

    def float_node(self, node: Node, names) -> DataType | None:
        """The float type the node computes in, if every named input that states one agrees on float32 or
        float64 (and one does)."""
        found = {self.dtype(name) for name in names if name} - {None}
        return found.pop() if len(found) == 1 and next(iter(found)) in _FLOATS else None

    def value(self, base: str, dtype: DataType, like: str, last: int | None = None) -> str:
        """A fresh value name typed ``dtype`` with the shape of ``like`` where known (its last dimension
        ``last`` when given)."""
        name = self.fresh(base)
        info = self.graph.type_of(like)
        shape = info.shape if info is not None and info.is_tensor else None
        if shape and last is not None:
            shape = (*shape[:-1], last)
        self.graph.value_info[name] = ValueInfo(name, TypeInfo("tensor", dtype, shape))
        return name

    def node(self, op_type: str, inputs: list[str], outputs: list[str], base: str, opset: int, **attrs) -> Node:
        return Node(op_type, inputs, outputs, name=self.fresh(base), attrs=attrs, opset=opset)

    def unread(self, node: Node, indices) -> bool:
        return all(_input_output(node, i) is None or _input_output(node, i) not in self.read for i in indices)

    # -- activations

    def parameters(self, names, size: int | None = None) -> int | None:
        """The common length of ``names`` (None entries skipped) if each is a constant vector, else None."""
        sizes = set() if size is None else {size}
        for name in names:
            if name is None:
                continue
            array = self.graph.initializers.get(name)
            if not isinstance(array, np.ndarray) or array.ndim != 1:
                return None
            sizes.add(array.shape[0])
        return sizes.pop() if len(sizes) == 1 else None

    def gelu(self, node: Node, x: str, bias: str | None, approximate: str) -> list[Node] | None:
        """A biased Gelu of a MatMul's product, which FusedMatMul then takes whole (the contrib kernels
        compute any other Gelu in the compiled loop of the ONNX Gelu already)."""
        dtype = self.float_node(node, [x, bias])
        if dtype is None or bias is None or self.parameters([bias]) is None or self.view.made_by(x, "MatMul") is None:
            return None
        biased = self.value(f"{node.outputs[0]}/biased", dtype, x)
        return [self.node("Add", [x, bias], [biased], f"{node.name}/bias", 14),
                self.node("Gelu", [biased], [node.outputs[0]], f"{node.name}/gelu", 20, approximate=approximate)]

    # -- normalizations

    def skip_sum(self, node: Node, dtype: DataType, total: str | None) -> tuple[list[Node], str]:
        """The adds of input, skip and bias; the bias goes to the one a MatMul made (their fusion's bias)."""
        x, skip, bias = node.inputs[0], node.inputs[1], _input(node, 4 if node.op_type ==
                                                                "SkipLayerNormalization" else 3)
        if self.view.made_by(skip, "MatMul") is not None and self.view.made_by(x, "MatMul") is None:
            x, skip = skip, x
        nodes = []
        if bias is not None:
            biased = self.value(f"{node.name}/biased", dtype, x)
            nodes.append(self.node("Add", [x, bias], [biased], f"{node.name}/bias", 14))
            x = biased
        total = total or self.value(f"{node.name}/sum", dtype, node.inputs[0])
        nodes.append(self.node("Add", [x, skip], [total], f"{node.name}/skip", 14))
        return nodes, total

    def skip_layer_norm(self, node: Node) -> list[Node] | None:
        gamma, beta = node.inputs[2], _input(node, 3)
        dtype = self.float_node(node, [*node.inputs[:3], beta, _input(node, 4)])
        if dtype is None or self.parameters([gamma, beta, _input(node, 4)]) is None:
            return None  # parameters fed at run time: the contrib kernel checks them
        nodes, total = self.skip_sum(node, dtype, _input_output(node, 3))
        epsilon = float(node.attr("epsilon", _CONTRIB_EPSILON))
        outputs = [node.outputs[0], *[name or "" for name in node.outputs[1:3]]]
        while outputs and not outputs[-1]:
            outputs.pop()
        nodes.append(self.node("LayerNormalization", [total, gamma, *([beta] if beta else [])], outputs,
                               f"{node.name}/norm", 17, axis=-1, epsilon=epsilon))
        return nodes

    def skip_simplified_norm(self, node: Node) -> list[Node] | None:
        dtype = self.float_node(node, [*node.inputs[:3], _input(node, 3)])
        if dtype is None or not self.unread(node, (1, 2)) or self.parameters([node.inputs[2], _input(node, 3)]) is None:
            return None
        nodes, total = self.skip_sum(node, dtype, _input_output(node, 3))
        epsilon = float(node.attr("epsilon", _CONTRIB_EPSILON))
        nodes.append(self.node("RMSNormalization", [total, node.inputs[2]], [node.outputs[0]], f"{node.name}/norm",
                               23, axis=-1, epsilon=epsilon))
        return nodes

    def simplified_norm(self, node: Node) -> list[Node] | None:
        dtype = self.float_node(node, node.inputs[:2])
        if dtype is None or self.dtype(node.inputs[1]) != dtype or not self.unread(node, (1,)) \
                or int(node.attr("stash_type", 1)) != int(DataType.FLOAT) or self.parameters(node.inputs[1:2]) is None:
            return None
        return [self.node("RMSNormalization", node.inputs[:2], [node.outputs[0]], f"{node.name}/norm", 23,
                          axis=int(node.attr("axis", -1)), epsilon=float(node.attr("epsilon", 1e-5)), stash_type=1)]

    # -- attention

    def attention(self, node: Node) -> list[Node] | None:
        """Attention without a past, an attention bias or rotary embedding: the packed projection as MatMul +
        Add (FusedMatMul's), split into Q, K and V, and the ONNX Attention (opset 23) over them; a key-padding
        mask becomes its additive bias (ContribAttentionMask, one per mask for all layers)."""
        x, weights, bias, mask = node.inputs[0], node.inputs[1], _input(node, 2), _input(node, 3)
        weight = self.graph.initializers.get(weights)
        heads = int(node.attr("num_heads", 0))
        if any(_input(node, i) for i in range(4, len(node.inputs))) or not self.unread(node, (1,)) \
                or int(node.attr("do_rotary", 0)) or int(node.attr("past_present_share_buffer", 0)) \
                or not isinstance(weight, np.ndarray) or weight.ndim != 2 or heads <= 0 \
                or (bias is not None and self.parameters([bias], weight.shape[1]) is None):
            return None
        sizes = node.attr("qkv_hidden_sizes")
        sizes = [weight.shape[1] // 3] * 3 if sizes is None else [int(size) for size in sizes]
        if len(sizes) != 3 or sum(sizes) != weight.shape[1] or sizes[0] != sizes[1] \
                or any(size <= 0 or size % heads for size in sizes):
            return None  # the kernel reports the mismatch
        dtype = self.float_node(node, [x, weights, bias])
        if dtype is None:
            return None
        packed = self.packed_attention(node, weight, heads) if dtype == DataType.FLOAT and sizes[0] == sizes[2] \
            and weight.dtype == np.float32 else None
        if packed is not None:
            return [packed]
        nodes: list[Node] = []
        inputs = self.projections(node, x, weight, bias, sizes, dtype, nodes)
        if mask is not None:
            inputs.append(self.mask_bias(node, mask, x, nodes))
        nodes.append(self.onnx_attention(node, inputs, heads))
        return nodes

    def packed_attention(self, node: Node, weight: np.ndarray, heads: int) -> Node | None:
        """float32 Attention whose Q, K and V are one size: ContribPackedAttention, one product by the packed
        weight (made C-contiguous once here) and one compiled pass reading Q, K, V and the mask index in place."""
        shape, size = self.shape(node.inputs[0]), weight.shape[1] // 3 // heads
        if shape is not None and len(shape) == 3 and isinstance(shape[1], int) \
                and heads * shape[1] * shape[1] * size > \
                packed_macs_factor(bool(node.attr("unidirectional", 0))) * KNOBS.few_query_macs:
            return None  # (a long sequence: the ONNX Attention kernel's products over contiguous projections)
        packed = node.inputs[1]
        if not weight.flags.c_contiguous:
            packed = self.fresh(f"{node.name}/qkv_weight")
            self.graph.initializers[packed] = np.ascontiguousarray(weight)
        attrs = {"num_heads": heads, "unidirectional": int(node.attr("unidirectional", 0)),
                 "mask_filter_value": float(node.attr("mask_filter_value", -10000.0))}
        if node.attr("scale") is not None:
            attrs["scale"] = float(node.attr("scale"))
        inputs = [node.inputs[0], packed, _input(node, 2) or "", _input(node, 3) or ""]
        while not inputs[-1]:
            inputs.pop()
        return Node("ContribPackedAttention", inputs, [node.outputs[0]],
                    name=self.fresh(f"{node.name}/packed"), domain=FUSED_DOMAIN, attrs=attrs, opset=1)

    def projections(self, node: Node, x: str, weight: np.ndarray, bias: str | None, sizes: list[int],
                    dtype: DataType, nodes: list[Node]) -> list[str]:
        """Q, K and V as one MatMul (and bias Add) each by the packed weight's column blocks: FusedMatMul then
        writes each contiguous, which the attention kernels read in place (a split of one packed product
        leaves strided views that they copy into heads first)."""
        vector = None if bias is None else self.graph.initializers[bias]
        outputs, start = [], 0
        for part, size in zip("qkv", sizes):
            block = self.fresh(f"{node.name}/{part}_weight")
            self.graph.initializers[block] = np.ascontiguousarray(weight[:, start:start + size])
            projected = self.value(f"{node.name}/{part}", dtype, x, size)
            nodes.append(self.node("MatMul", [x, block], [projected], f"{node.name}/{part}_projection", 13))
            if vector is not None:
                part_bias = self.fresh(f"{node.name}/{part}_bias")
                self.graph.initializers[part_bias] = np.ascontiguousarray(vector[start:start + size])
                biased = self.value(f"{node.name}/{part}_biased", dtype, x, size)
                nodes.append(self.node("Add", [projected, part_bias], [biased], f"{node.name}/{part}_bias", 14))
                projected = biased
            outputs.append(projected)
            start += size
        return outputs

    def onnx_attention(self, node: Node, inputs: list[str], heads: int) -> Node:
        """The ONNX Attention (opset 23) computing com.microsoft ``node``'s output from ``inputs`` (Q, K, V and
        the mask bias if any), with its scale and causality."""
        scale = float(node.attr("scale", 0.0) or 0.0)
        attrs = {"q_num_heads": heads, "kv_num_heads": heads, "is_causal": int(node.attr("unidirectional", 0))}
        if scale:
            attrs["scale"] = scale
        return self.node("Attention", inputs, [node.outputs[0]], f"{node.name}/attention", 23, **attrs)

    def shape(self, name: str) -> tuple | None:
        info = self.graph.type_of(name)
        return tuple(info.shape) if info is not None and info.is_tensor and info.shape is not None else None

    def mask_bias(self, node: Node, mask: str, x: str, nodes: list[Node], keys: str | None = None) -> str:
        """The additive bias of ``mask`` for the queries of ``x`` and the keys of ``keys`` (``x`` itself when
        None): shared by the layers whose inputs the graph declares of one shape (one symbolic dimension is one
        size), else made per input."""
        fill = float(node.attr("mask_filter_value", -10000.0))
        shapes = [self.shape(name) for name in (x, keys or x)]
        key = (mask, *(shape if shape is not None and None not in shape else name
                       for shape, name in zip(shapes, (x, keys or x))), fill)
        made = self.masks.get(key)
        if made is None:
            made = self.fresh(f"{mask}/attention_bias")  # (B, 1, 1 or S, T): its shape is found per run
            self.graph.value_info[made] = ValueInfo(made, TypeInfo("tensor", DataType.FLOAT, None))
            nodes.append(Node("ContribAttentionMask", [mask, x, *([keys] if keys else [])], [made],
                              name=self.fresh(f"{node.name}/mask"), domain=FUSED_DOMAIN,
                              attrs={"mask_filter_value": fill}, opset=1))
            self.masks[key] = made
        return made

    def multi_head_attention(self, node: Node) -> list[Node] | None:
        """MultiHeadAttention of 3-D query, key and value (hidden layouts) without a past, an attention bias or a
        beam cache: the bias split into Q, K and V adds (their projections' biases, which FusedMatMul takes),
        the ONNX Attention (opset 23) over them, a key-padding mask as its additive bias."""
        q, k, v, bias, mask = node.inputs[0], _input(node, 1), _input(node, 2), _input(node, 3), _input(node, 4)
        heads = int(node.attr("num_heads", 0))
        shapes = [self.shape(name) if name else None for name in (q, k, v)]
        if heads <= 0 or any(shape is None or len(shape) != 3 or not isinstance(shape[2], int) or shape[2] % heads
                             for shape in shapes) or any(_input(node, i) for i in range(5, len(node.inputs))) \
                or not self.unread(node, (1, 2, 3)):
            return None
        dtype = self.float_node(node, [q, k, v, bias])
        sizes = [shape[2] for shape in shapes if shape is not None]
        if dtype is None or (bias is not None and self.parameters([bias], sum(sizes)) is None):
            return None
        nodes: list[Node] = []
        inputs = [q, k, v]
        if bias is not None:
            vector, start = self.graph.initializers[bias], 0
            for index, (name, size) in enumerate(zip(inputs, sizes)):
                part = self.fresh(f"{bias}/{'qkv'[index]}")
                self.graph.initializers[part] = np.ascontiguousarray(vector[start:start + size])
                biased = self.value(f"{name}/biased", dtype, name)
                nodes.append(self.node("Add", [name, part], [biased], f"{node.name}/bias_{'qkv'[index]}", 14))
                inputs[index], start = biased, start + size
        if mask is not None:
            inputs.append(self.mask_bias(node, mask, q, nodes, keys=k))
        nodes.append(self.onnx_attention(node, inputs, heads))
        return nodes

    def lowered(self, node: Node) -> list[Node] | None:
        """``node`` as standard operators, or None to keep it."""
        if self.owns is not None and not self.owns(node):
            return None
        if node.domain == CONTRIB:
            if node.op_type == "BiasGelu" and len(node.inputs) == 2:
                return self.gelu(node, node.inputs[0], node.inputs[1], "none")
            if node.op_type == "FastGelu":
                return self.gelu(node, node.inputs[0], _input(node, 1), "tanh")
            if node.op_type == "SkipLayerNormalization":
                return self.skip_layer_norm(node)
            if node.op_type == "SkipSimplifiedLayerNormalization":
                return self.skip_simplified_norm(node)
            if node.op_type == "Attention":
                return self.attention(node)
            if node.op_type == "MultiHeadAttention":
                return self.multi_head_attention(node)
        elif not node.domain and node.op_type == "SimplifiedLayerNormalization":
            return self.simplified_norm(node)
        return None


def _input_output(node: Node, index: int) -> str | None:
    return node.outputs[index] if len(node.outputs) > index and node.outputs[index] else None


def lower_contrib_operators(graph: Graph, owns=None) -> bool:
    """Rewrite the contrib nodes listed in the module docstring into standard operators."""
    if not any(node.domain == CONTRIB or node.op_type == "SimplifiedLayerNormalization" for node in graph.nodes):
        return False
    lowering = _Lowering(graph, owns)
    nodes, changed = [], False
    for node in graph.nodes:
        replacement = lowering.lowered(node)
        nodes.extend(replacement or [node])
        changed |= replacement is not None
    if changed:
        graph.nodes = nodes
    return changed


lower_contrib_operators.before_optimizer = True  # type: ignore[attr-defined]  # the optimizer sees standard ops
