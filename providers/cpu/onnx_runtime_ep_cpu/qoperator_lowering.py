"""QOperator convolution networks spelled in the QDQ format, so that they run the QDQ CNN path.

onnxruntime's QOperator format writes a quantized CNN as QLinearConv, QLinearAdd, QLinearMul and
QLinearGlobalAveragePool nodes that pass 8-bit codes to each other. Run node by node, each is a kernel of its
own between the float activations (HardSwish, HardSigmoid) that the format keeps as DequantizeLinear -> f ->
QuantizeLinear, and none of them joins the compiled convolution segments. The QDQ format of the same network
runs as a few segments (the roundings are plan steps; qdq_fusions.fuse_quantize_dequantize), so this pass
rewrites each QOperator node as the QDQ format writes it:

- QLinearConv(x, xs, xz, w, ws, wz, ys, yz[, B])  ->  DequantizeLinear(x) -> Conv(w', B') -> QuantizeLinear,
  with w' = (w - wz) * ws (per output channel where ws is) and B' = B * (xs * ws) as float32 constants: what
  constant folding makes of the QDQ model's DequantizeLinear of the weight and of the int32 bias;
- QLinearAdd / QLinearMul(a, as, az, b, bs, bz, cs, cz)  ->  Add / Mul of the two DequantizeLinear, then
  QuantizeLinear;
- QLinearGlobalAveragePool(x, xs, xz, ys, yz) (channels first)  ->  DequantizeLinear -> GlobalAveragePool ->
  QuantizeLinear;
- QLinearConcat(ys, yz, (x, xs, xz)...)  ->  Concat of the DequantizeLinear of each part, then QuantizeLinear
  (a SqueezeNet's fire module);
- MaxPool of codes between them  ->  DequantizeLinear -> MaxPool -> QuantizeLinear (the same codes).

The codes each step writes are those of the QDQ model: the real result rounded to the output's grid. The
integer kernels form that real value exactly and the float path in float32, so a code can differ by one where
the real value lies within float32 rounding of a half-integer: the same bound the QDQ CNNs keep against
onnxruntime's integer kernels. Only nodes whose scales and zero points are constants (8-bit codes, float32
scales, per-tensor activations) are rewritten, a QLinearConv only with a constant weight. Every node is rewritten
only where each operand's codes come from a QuantizeLinear (which a rewritten convolution ends in) or are
constants, a QLinearConv only where its codes are read by DequantizeLinear or nodes of this list: next to the
integer products of a transformer (QLinearMatMul), which read and write codes themselves, and after a
transformer's patch embedding, nodes stay as they are.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.dtypes import DataType
from onnx_runtime.ir import Graph, Node, TypeInfo, ValueInfo
from onnx_runtime.optimizer.context import FreshNames

from .fusions import GraphView, owned

_CONTRIB = "com.microsoft"
_EIGHT_BIT = frozenset(np.dtype(t) for t in (np.uint8, np.int8))
_F32 = np.dtype(np.float32)
_ELEMENTWISE = {"QLinearAdd": "Add", "QLinearMul": "Mul"}
_POOL_AND_CONCAT = ("QLinearGlobalAveragePool", "QLinearConcat")


class _Lowering:
    def __init__(self, graph: Graph, owns):
        self.graph, self.owns = graph, owns
        self.view = GraphView(graph)
        self.fresh = FreshNames(graph)
        self.dequantized: dict[tuple, str] = {}  # (codes, scale, zero point) -> the float32 value made of them
        self.opset = int(graph.opsets.get("", graph.opsets.get("ai.onnx", 13)))

    def const(self, name: str) -> np.ndarray | None:
        return self.view.const(name) if name else None

    def activation(self, scale: str, zero: str) -> bool:
        """A per-tensor float32 scale and 8-bit zero point, both constants."""
        s, z = self.const(scale), self.const(zero)
        return s is not None and z is not None and s.dtype == _F32 and s.size == 1 and z.size == 1 \
            and z.dtype in _EIGHT_BIT

    def from_quantize(self, codes: str) -> bool:
        """Codes a QuantizeLinear made (a float value rounded to its grid) or constants."""
        if self.const(codes) is not None:
            return True
        producer = self.view.producer.get(codes)
        return producer is not None and producer.op_type == "QuantizeLinear" and not producer.domain

    def read_on_float_side(self, codes: str, depth: int = 0) -> bool:
        """Every reader of ``codes`` dequantizes them or is a node this pass rewrites (a transformer's patch
        embedding, whose codes go on to a Reshape and a QLinearConcat, keeps its QLinearConv)."""
        readers = self.view.consumers.get(codes, [])
        return bool(readers) and codes not in self.view.outputs and codes not in self.view.inner_reads and all(
            (r.op_type in ("DequantizeLinear", "QLinearConv") and not r.domain)
            or (r.domain == _CONTRIB and (r.op_type in _ELEMENTWISE or r.op_type in _POOL_AND_CONCAT))
            or (depth < 4 and self.max_pool_of_codes(r) and self.read_on_float_side(r.outputs[0], depth + 1))
            for r in readers)

    @staticmethod
    def max_pool_of_codes(node: Node) -> bool:
        return node.op_type == "MaxPool" and not node.domain and len(node.outputs) == 1 and len(node.inputs) == 1

    def max_pool(self, node: Node) -> list[Node] | None:
        """MaxPool of codes a QuantizeLinear made  ->  DequantizeLinear -> MaxPool -> QuantizeLinear with the same
        parameters: dequantizing is increasing (a positive scale), so the maximum of the values is the value of
        the maximum code, and rounding it to its own grid gives that code back."""
        producer = self.view.producer.get(node.inputs[0])
        if producer is None or producer.op_type != "QuantizeLinear" or producer.domain or len(producer.inputs) != 3:
            return None
        _, scale, zero = producer.inputs
        if not self.activation(scale, zero) or not float(self.const(scale).reshape(())) > 0 \
                or not self.read_on_float_side(node.outputs[0]):
            return None
        made: list[Node] = []
        pooled = self.float_value(f"{node.outputs[0]}_float", node.outputs[0])
        made.append(Node("MaxPool", [self.dequantize(node.inputs[0], scale, zero, made)], [pooled],
                         name=f"{node.name}/float", attrs=dict(node.attrs), opset=node.opset))
        self.quantize(node, pooled, scale, zero, made)
        return made

    def float_value(self, base: str, like: str) -> str:
        name = self.fresh(base)
        info = self.graph.type_of(like)
        shape = info.shape if info is not None and info.is_tensor else None
        self.graph.value_info[name] = ValueInfo(name, TypeInfo("tensor", DataType.FLOAT, shape))
        return name

    def dequantize(self, codes: str, scale: str, zero: str, made: list[Node]) -> str:
        key = (codes, scale, zero)
        name = self.dequantized.get(key)
        if name is None:
            name = self.dequantized[key] = self.float_value(f"{codes}_dequantized", codes)
            made.append(Node("DequantizeLinear", [codes, scale, zero], [name], name=f"{name}/dq", opset=self.opset))
        return name

    def quantize(self, node: Node, value: str, scale: str, zero: str, made: list[Node]) -> None:
        made.append(Node("QuantizeLinear", [value, scale, zero], [node.outputs[0]], name=f"{node.name}/q",
                         opset=self.opset))

    def constant(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        self.graph.initializers[name] = value
        return name

    def lowered(self, node: Node) -> list[Node] | None:
        if not owned(self.owns, [node]) or len(node.outputs) != 1:
            return None
        if node.op_type == "QLinearConv" and not node.domain:
            return self.conv(node)
        if self.max_pool_of_codes(node) and self.const(node.inputs[0]) is None:
            return self.max_pool(node)
        if node.domain != _CONTRIB:
            return None
        if node.op_type in _ELEMENTWISE:
            return self.elementwise(node)
        if node.op_type == "QLinearGlobalAveragePool":
            return self.pool(node)
        if node.op_type == "QLinearConcat":
            return self.concat(node)
        return None

    def concat(self, node: Node) -> list[Node] | None:
        if len(node.inputs) < 5 or (len(node.inputs) - 2) % 3 or node.attr("axis") is None:
            return None
        ys, yz, *triples = node.inputs
        parts = [triples[i:i + 3] for i in range(0, len(triples), 3)]
        if not self.activation(ys, yz) or not all(self.activation(s, z) and self.from_quantize(x) for x, s, z in parts):
            return None
        made: list[Node] = []
        values = [self.dequantize(x, s, z, made) for x, s, z in parts]
        joined = self.float_value(f"{node.outputs[0]}_float", node.outputs[0])
        made.append(Node("Concat", values, [joined], name=f"{node.name}/float", attrs={"axis": int(node.attr("axis"))},
                         opset=self.opset))
        self.quantize(node, joined, ys, yz, made)
        return made

    def conv(self, node: Node) -> list[Node] | None:
        if len(node.inputs) not in (8, 9):
            return None
        x, xs, xz, w, ws, wz, ys, yz = node.inputs[:8]
        bias_name = node.inputs[8] if len(node.inputs) > 8 else ""
        weight, w_scale, w_zero = self.const(w), self.const(ws), self.const(wz)
        bias = self.const(bias_name) if bias_name else None
        if not (self.activation(xs, xz) and self.activation(ys, yz)) or weight is None or w_scale is None \
                or w_zero is None or weight.dtype not in _EIGHT_BIT or weight.ndim < 3 or w_scale.dtype != _F32 \
                or w_zero.dtype != weight.dtype or (bias_name and (bias is None or bias.dtype != np.int32)) \
                or not self.from_quantize(x) or not self.read_on_float_side(node.outputs[0]):
            return None
        channels = weight.shape[0]
        if w_scale.size not in (1, channels) or w_zero.size not in (1, channels) \
                or (bias is not None and bias.size != channels):
            return None
        per_channel = (-1,) + (1,) * (weight.ndim - 1)
        centred = weight.astype(np.int32) - w_zero.astype(np.int32).reshape(per_channel if w_zero.size > 1 else ())
        real_weight = centred.astype(_F32) * w_scale.reshape(per_channel if w_scale.size > 1 else ())
        made: list[Node] = []
        inputs = [self.dequantize(x, xs, xz, made), self.constant(f"{w}_float", real_weight)]
        if bias is not None:
            # The quantization tools' bias scale: the float32 product of the input's and the weight's scales.
            bias_scale = self.const(xs).reshape(()) * w_scale.reshape(-1)
            inputs.append(self.constant(f"{bias_name}_float", bias.reshape(-1).astype(_F32) * bias_scale))
        product = self.float_value(f"{node.outputs[0]}_float", node.outputs[0])
        made.append(Node("Conv", inputs, [product], name=f"{node.name}/float", attrs=dict(node.attrs),
                         opset=self.opset))
        self.quantize(node, product, ys, yz, made)
        return made

    def elementwise(self, node: Node) -> list[Node] | None:
        if len(node.inputs) != 8:
            return None
        a, a_s, az, b, bs, bz, cs, cz = node.inputs
        if not all(self.activation(s, z) for s, z in ((a_s, az), (bs, bz), (cs, cz))) \
                or not (self.from_quantize(a) and self.from_quantize(b)):
            return None
        made: list[Node] = []
        left = self.dequantize(a, a_s, az, made)
        right = self.dequantize(b, bs, bz, made)
        result = self.float_value(f"{node.outputs[0]}_float", node.outputs[0])
        made.append(Node(_ELEMENTWISE[node.op_type], [left, right], [result], name=f"{node.name}/float",
                         opset=self.opset))
        self.quantize(node, result, cs, cz, made)
        return made

    def pool(self, node: Node) -> list[Node] | None:
        if len(node.inputs) != 5 or int(node.attr("channels_last", 0)):
            return None
        x, xs, xz, ys, yz = node.inputs
        if not (self.activation(xs, xz) and self.activation(ys, yz)) or not self.from_quantize(x):
            return None
        made: list[Node] = []
        pooled = self.float_value(f"{node.outputs[0]}_float", node.outputs[0])
        made.append(Node("GlobalAveragePool", [self.dequantize(x, xs, xz, made)], [pooled], name=f"{node.name}/float",
                         opset=self.opset))
        self.quantize(node, pooled, ys, yz, made)
        return made


def lower_qoperator_cnn(graph: Graph, owns=None) -> bool:
    """Rewrite the QOperator nodes listed in the module docstring into their QDQ form (one sweep in graph
    order: a rewritten convolution ends in the QuantizeLinear that lets the elementwise node after it go too)."""
    if not any(node.op_type == "QLinearConv" and not node.domain for node in graph.nodes):
        return False
    lowering = _Lowering(graph, owns)
    nodes, changed = [], False
    for node in graph.nodes:
        replacement = lowering.lowered(node)
        if replacement is not None:
            lowering.view.producer.update({out: n for n in replacement for out in n.outputs})
        nodes.extend(replacement or [node])
        changed |= replacement is not None
    if changed:
        graph.nodes = nodes
    return changed


lower_qoperator_cnn.before_optimizer = True  # type: ignore[attr-defined]  # constant folding and the QDQ passes follow
