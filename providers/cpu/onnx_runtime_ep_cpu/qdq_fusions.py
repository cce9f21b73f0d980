"""Quantized models as onnxruntime's quantization tools write them, run on the float and integer fast paths.

QDQ format (static quantization): DequantizeLinear -> MatMul/Gemm -> QuantizeLinear groups run on integers
(``fuse_quantized_matmul``, before the optimizer; ops/qdq_linear.py), as onnxruntime's QDQ transformer makes
QLinearMatMul and QGemm of them. Elsewhere, a QuantizeLinear whose codes only a DequantizeLinear with the same scale and
zero point reads is the rounding of an activation to its quantization grid, spelled as two operators and an
integer tensor. ``fuse_quantize_dequantize`` makes it one QuantizeDequantize node (ops/quantization.py: one
compiled pass, the float32 values DequantizeLinear would give, exactly), so the float operators around it run
on float32 as in the float model. The weights' DequantizeLinear nodes read constants and are folded by the
optimizer's constant folding before this pass runs, so the float convolution and matrix products see float32
weights. The pattern: QuantizeLinear(x, scale, zero) -> q, read by one or more DequantizeLinear(q, scale',
zero'), each with the same constant scale and zero point (by value) and the same axis; q is no graph output
and no subgraph reads it; neither node asks for blocks, an output type or a precision. The first
DequantizeLinear's output becomes the fused node's; the other readers' outputs are renamed to it.

Dynamic quantization: ``fuse_dynamic_matmul`` turns MatMulInteger -> Cast -> Mul by the scales' product
(-> bias Add) into one com.microsoft MatMulIntegerToFloat (see its docstring), and
``fuse_dynamic_quantize_matmul`` the DynamicQuantizeLinear before it and it into DynamicQuantizeMatMul.
QOperator format: ``fuse_qlinear_matmul_bias`` runs QLinearMatMul -> QLinearAdd of the bias as one node.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime.ir import Graph, Node
from onnx_runtime.optimizer.elimination import reshaped

from .fusions import FUSED_DOMAIN, GraphView, bypass, owned, until_fixed
from .qdq_folds import drop_activation_before_quantizing, drop_rounding_before_quantizing
from .qdq_tables import channel_tables_to_codes, fuse_channel_tables, fuse_grid_tables, round_before_moving
from .qoperator_lowering import lower_qoperator_cnn

_CONTRIB = "com.microsoft"  # (QLinearConcat's domain)

# Attributes that change what QuantizeLinear/DequantizeLinear compute beyond scale, zero point and axis.
_EXOTIC = ("block_size", "output_dtype", "precision")
_INTEGER_CODES = frozenset(np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16))


def _params(view: GraphView, node: Node) -> tuple | None:
    """(scale, zero point or None, axis) of a Q or DQ node whose parameters are constants, else None."""
    if node.domain or any(node.attr(name, 0) for name in _EXOTIC):
        return None
    scale = view.constant(node.inputs[1]) if len(node.inputs) > 1 else None
    zero_name = node.inputs[2] if len(node.inputs) > 2 else ""
    zero = view.constant(zero_name) if zero_name else None
    if scale is None or (zero_name and zero is None):
        return None
    return scale, zero, int(node.attr("axis", 1))


def _same(a: tuple, b: tuple) -> bool:
    (scale_a, zero_a, axis_a), (scale_b, zero_b, axis_b) = a, b
    if scale_a.dtype != scale_b.dtype or scale_a.shape != scale_b.shape or not np.array_equal(scale_a, scale_b):
        return False
    if (zero_a is None) != (zero_b is None):
        return False
    if zero_a is not None and (zero_a.dtype != zero_b.dtype or not np.array_equal(zero_a, zero_b)):
        return False
    return scale_a.size == 1 or axis_a == axis_b


def fuse_quantize_dequantize(graph: Graph, owns=None) -> bool:
    view = GraphView(graph)
    for quantize in list(graph.nodes):
        if quantize.op_type != "QuantizeLinear" or quantize.domain:
            continue
        codes = quantize.outputs[0]
        readers = view.consumers.get(codes, [])
        if not readers or codes in view.outputs or codes in view.inner_reads:
            continue
        params = _params(view, quantize)
        # Integer codes only (without a zero point their type is an attribute's; float8 rounds otherwise).
        if params is None or params[1] is None or params[1].dtype not in _INTEGER_CODES:
            continue
        if not all(r.op_type == "DequantizeLinear" and r.inputs[0] == codes and (p := _params(view, r)) is not None
                   and _same(params, p) for r in readers):
            continue
        first, others = readers[0], readers[1:]
        renamed = {r.outputs[0] for r in others}
        if renamed & view.outputs or renamed & view.inner_reads or not owned(owns, [quantize, *readers]):
            continue
        fused = Node("QuantizeDequantize", list(quantize.inputs[:3]), [first.outputs[0]],
                     name=f"{quantize.name}/qdq", domain=FUSED_DOMAIN,
                     attrs={"axis": params[2], "opset": quantize.opset}, opset=1)
        gone = {id(r) for r in readers}
        # Where the QuantizeLinear was: its inputs come before, every reader of the outputs after.
        graph.nodes = [fused if n is quantize else n for n in graph.nodes if id(n) not in gone]
        for node in graph.nodes:
            node.inputs = [first.outputs[0] if name in renamed else name for name in node.inputs]
        return True
    return False


def _made_by(view: GraphView, name: str, op_type: str) -> Node | None:
    node = view.producer.get(name)
    return node if node is not None and node.op_type == op_type and not node.domain else None


def _scales_product(view: GraphView, name: str, a_scale: str) -> tuple[Node, str] | None:
    """(the Mul, the weight's constant scale) when ``name`` is Mul(a_scale, weight scale) in either order."""
    mul = _made_by(view, name, "Mul")
    if mul is None or len(mul.inputs) != 2 or a_scale not in mul.inputs:
        return None
    other = mul.inputs[1] if mul.inputs[0] == a_scale else mul.inputs[0]
    scale = view.const(other)
    return (mul, other) if scale is not None and scale.dtype == np.float32 else None


def _dynamic_chain(view: GraphView, matmul: Node) -> tuple | None:
    """(DynamicQuantizeLinear, Cast, Mul, scales' Mul, weight scale name) around a MatMulInteger of a
    dynamically quantized input by a constant matrix, or None."""
    a, w, a_zero, w_zero = matmul.inputs
    quantize = _made_by(view, a, "DynamicQuantizeLinear")
    weight = view.const(w)
    if quantize is None or quantize.outputs[0] != a or quantize.outputs[2] != a_zero or weight is None \
            or weight.ndim != 2 or view.const(w_zero) is None:
        return None
    cast = view.only_consumer(matmul.outputs[0], "Cast")
    if cast is None or int(cast.attr("to", 0)) != 1:  # to float32
        return None
    scale_mul = view.only_consumer(cast.outputs[0], "Mul")
    if scale_mul is None:
        return None
    other = scale_mul.inputs[1] if scale_mul.inputs[0] == cast.outputs[0] else scale_mul.inputs[0]
    scales = _scales_product(view, other, quantize.outputs[1])
    return None if scales is None else (quantize, cast, scale_mul, *scales)


def fuse_dynamic_matmul(graph: Graph, owns=None) -> bool:
    """onnxruntime's dynamic quantization spells each MatMul as MatMulInteger(DynamicQuantizeLinear(x), W)
    -> Cast to float -> Mul by Mul(x's scale, W's scale), then the float model's bias Add: one
    com.microsoft MatMulIntegerToFloat (with the bias when it is a constant of one value per column) does it
    in one node, the constant W packed once (its int32 product exact, rescaled in float64 and rounded once
    to float32, where the graph rounds the accumulator and the scale product to float32 first)."""
    view = GraphView(graph)
    for matmul in list(graph.nodes):
        if matmul.op_type != "MatMulInteger" or matmul.domain or len(matmul.inputs) != 4:
            continue
        chain = _dynamic_chain(view, matmul)
        if chain is None:
            continue
        quantize, cast, scale_mul, product, w_scale = chain
        a, w, a_zero, w_zero = matmul.inputs
        weight = view.const(w)
        removed = [matmul, cast, scale_mul]
        output, bias = scale_mul.outputs[0], ""
        add = view.only_consumer(output, "Add")
        if add is not None:
            candidate = add.inputs[1] if add.inputs[0] == output else add.inputs[0]
            value = view.const(candidate)
            if value is not None and value.dtype == np.float32 and value.shape == (weight.shape[1],):
                removed.append(add)
                output, bias = add.outputs[0], candidate
        shared = len(view.consumers.get(product.outputs[0], [])) > 1 or product.outputs[0] in view.outputs \
            or product.outputs[0] in view.inner_reads
        if not shared:
            removed.append(product)
        if not owned(owns, removed):
            continue
        inputs = [a, w, quantize.outputs[1], w_scale, a_zero, w_zero] + ([bias] if bias else [])
        fused = Node("MatMulIntegerToFloat", inputs, [output], name=f"{matmul.name}/to_float",
                     domain="com.microsoft", opset=1)
        gone = {id(n) for n in removed}
        # Where the MatMulInteger was: every input exists by then (the scales' Mul reads only the quantizer's
        # output and a constant; the bias is a constant), every reader of the output comes later.
        graph.nodes = [fused if n is matmul else n for n in graph.nodes if id(n) not in gone or n is matmul]
        return True
    return False


def fuse_dynamic_quantize_matmul(graph: Graph, owns=None) -> bool:
    """A DynamicQuantizeLinear read only by MatMulIntegerToFloat nodes, each taking its three outputs as A,
    a_scale and a_zero_point: each becomes one com.microsoft DynamicQuantizeMatMul of the float input, which
    quantizes it with the same loop (several readers, as a layer's query, key and value, each quantize the
    small activation again) and multiplies with MatMulIntegerToFloat's: one node and no uint8 tensor between."""
    view = GraphView(graph)
    for quantize in list(graph.nodes):
        if quantize.op_type != "DynamicQuantizeLinear" or quantize.domain or len(quantize.outputs) != 3 \
                or any(name in view.outputs or name in view.inner_reads for name in quantize.outputs):
            continue
        codes, scale, zero = quantize.outputs
        readers = {id(n): n for name in quantize.outputs for n in view.consumers.get(name, [])}
        if not readers or not all(
                r.op_type == "MatMulIntegerToFloat" and r.domain == "com.microsoft" and len(r.inputs) >= 5
                and (r.inputs[0], r.inputs[2], r.inputs[4]) == (codes, scale, zero)
                and not {r.inputs[1], r.inputs[3], *r.inputs[5:]} & set(quantize.outputs)
                for r in readers.values()):
            continue
        if not owned(owns, [quantize, *readers.values()]):
            continue
        fused = {rid: Node("DynamicQuantizeMatMul", [quantize.inputs[0], r.inputs[1], r.inputs[3],
                                                      *(r.inputs[5:7] if len(r.inputs) > 5 else [])],
                           list(r.outputs), name=f"{r.name}/dynamic", domain="com.microsoft", opset=1)
                 for rid, r in readers.items()}
        graph.nodes = [fused.get(id(n), n) for n in graph.nodes if n is not quantize]
        return True
    return False


def _static(graph: Graph, name: str) -> tuple | None:
    info = graph.type_of(name)
    return info.static_shape if info is not None else None


def _merged_shape(graph: Graph, node: Node) -> tuple | None:
    """The static output shape of a TransposeReshape whose input shape is static (its target may hold a 0,
    copying the transposed input's dimension, or a -1)."""
    x_shape, perm = _static(graph, node.inputs[0]), node.attr("perm")
    target = [int(d) for d in np.asarray(node.attr("shape", [])).reshape(-1)]
    if x_shape is None or perm is None or len(perm) != len(x_shape) or node.attr("allowzero", 0):
        return None
    if sorted(perm) != list(range(len(x_shape))) or any(not isinstance(d, int) for d in x_shape):
        return None
    return reshaped(tuple(x_shape[p] for p in perm), target, False)  # arithmetic: declared sizes may be huge


def _product_weight(view: GraphView, node: Node) -> tuple | None:
    """(K, N) of the constant 2-D weight of a DynamicQuantizeMatMul, or of a QDQ group's QuantizedMatMul
    (weight input 3, transB as Gemm's), else None."""
    if node.op_type == "DynamicQuantizeMatMul" and node.domain == "com.microsoft":
        weight = view.const(node.inputs[1]) if len(node.inputs) > 1 else None
        return weight.shape if weight is not None and weight.ndim == 2 else None
    if node.op_type != "QuantizedMatMul" or node.domain != FUSED_DOMAIN or len(node.inputs) < 8:
        return None
    weight = view.const(node.inputs[3])
    if weight is None or weight.ndim != 2:
        return None
    return weight.shape[::-1] if node.attr("transB", 0) else weight.shape


def _unflatten_match(graph: Graph, view: GraphView, node: Node) -> tuple | None:
    """(the Reshape after ``node``, the node before it, the unflattened input shape) where ``node`` is a
    DynamicQuantizeMatMul or QuantizedMatMul of static (M, K) rows by a constant weight whose product only a
    Reshape to (..., N) with M rows reads."""
    if len(node.outputs) != 1 or not node.inputs or not node.inputs[0]:
        return None
    weight = _product_weight(view, node)
    after = view.only_consumer(node.outputs[0], "Reshape")
    before = view.producer.get(node.inputs[0])
    if weight is None or after is None or before is None:
        return None
    a_shape = _static(graph, node.inputs[0])
    if a_shape is None and before.op_type == "TransposeReshape":
        a_shape = _merged_shape(graph, before)
    out_shape = _static(graph, after.outputs[0])
    if a_shape is None or out_shape is None or len(out_shape) < 3 or out_shape[-1] != weight[1] \
            or a_shape != (math.prod(out_shape[:-1]), weight[0]):
        return None
    return after, before, out_shape[:-1] + (weight[0],)


def _unflattened_input(graph: Graph, view: GraphView, node: Node, before: Node, wanted: tuple) -> tuple | None:
    """(the product's new input, the node that now makes it or None, whether ``before`` goes): the Reshape's
    input where it already has the ``wanted`` shape, else ``before`` (read by the product alone) re-laid."""
    alone = len(view.consumers.get(node.inputs[0], [])) == 1 and node.inputs[0] not in view.outputs \
        and node.inputs[0] not in view.inner_reads
    a = node.inputs[0]
    if before.op_type == "Reshape" and not before.domain and _static(graph, before.inputs[0]) == wanted:
        return before.inputs[0], None, alone
    if not alone:
        return None
    if before.op_type == "Reshape" and not before.domain:  # the view's target made the output's rank
        target = f"{a}/unflattened"
        while target in graph.initializers or target in graph.value_info:
            target += "_"
        graph.initializers[target] = np.asarray(wanted, np.int64)
        return a, Node("Reshape", [before.inputs[0], target], [a], name=before.name,
                       attrs=dict(before.attrs or {}), opset=before.opset), False
    if before.op_type == "TransposeReshape" and before.domain == FUSED_DOMAIN:
        return a, Node(before.op_type, list(before.inputs), [a], name=before.name, domain=before.domain,
                       attrs={**before.attrs, "shape": list(wanted)}, opset=before.opset), False
    return None


def unflatten_dynamic_quantize_matmul(graph: Graph, owns=None) -> bool:
    """Reshape(X (..., K) -> (M, K)) -> DynamicQuantizeMatMul -> Reshape((M, N) -> (..., N)), as both torch
    exporters write GPT-2's Conv1D (addmm over a flattened view) and the optimizer leaves it after quantization:
    the product of X itself, the two Reshapes gone. The same for a static QDQ group's QuantizedMatMul (the
    Gemm of GPT-2's Conv1D, bias and rounded add included: per-tensor A, rows one by one). A flattening Reshape
    or TransposeReshape (the attention's heads merged) of another input, read by the product alone, is given
    the output's leading dimensions instead. A is quantized over all its values and its rows multiplied one by
    one, so the flattening changes no bit; it only cost two nodes per product. Shapes must be static (a
    specialized graph's), the product's output read by that Reshape alone and no graph output."""
    view = GraphView(graph)
    for node in graph.nodes:
        match = _unflatten_match(graph, view, node)
        if match is None or not owned(owns, [node, *match[:2]]):
            continue
        after, before, wanted = match
        found = _unflattened_input(graph, view, node, before, wanted)
        if found is None:
            continue
        a, relaid, drop_before = found
        fused = Node(node.op_type, [a, *node.inputs[1:]], list(after.outputs), name=node.name,
                     domain=node.domain, attrs=dict(node.attrs or {}), opset=node.opset)
        graph.value_info.pop(node.outputs[0], None)
        if drop_before:
            graph.value_info.pop(node.inputs[0], None)
        elif relaid is not None and (info := graph.type_of(a)) is not None and a in graph.value_info:
            graph.value_info[a] = type(graph.value_info[a])(a, type(info)("tensor", info.dtype, wanted))
        drop = {id(after)} | ({id(before)} if drop_before else set())
        replaced = {id(node): fused, **({id(before): relaid} if relaid is not None else {})}
        graph.nodes = [replaced.get(id(n), n) for n in graph.nodes if id(n) not in drop]
        return True
    return False


def group_dynamic_quantize_matmul(graph: Graph, owns=None) -> bool:
    """DynamicQuantizeMatMul nodes of one float input by constant weights of one shape and type, all with a
    bias or none (a layer's query, key and value): one DynamicQuantizeMatMulGroup (ops/dynamic_quantize_group.py)
    quantizes the input once and runs one product, as onnxruntime's quantizer leaves one DynamicQuantizeLinear
    for them. Outputs keep their names; the group sits where its first member was (its inputs are A and
    constants, and every member's readers come after that member)."""
    view = GraphView(graph)
    groups: dict[tuple, list[Node]] = {}
    for node in graph.nodes:
        if node.op_type != "DynamicQuantizeMatMul" or node.domain != "com.microsoft" or len(node.outputs) != 1 \
                or not 3 <= len(node.inputs) <= 5:
            continue
        slots = list(node.inputs[1:]) + [""] * (5 - len(node.inputs))
        weight = view.const(slots[0])
        if weight is None or weight.ndim != 2 or any(name and view.const(name) is None for name in slots[1:]):
            continue
        key = (node.inputs[0], weight.shape, weight.dtype.str, bool(slots[2]), bool(slots[3]))
        groups.setdefault(key, []).append(node)
    for members in groups.values():
        if len(members) < 2 or not owned(owns, members):
            continue
        inputs = [members[0].inputs[0]]
        for m in members:
            inputs += list(m.inputs[1:]) + [""] * (5 - len(m.inputs))
        fused = Node("DynamicQuantizeMatMulGroup", inputs, [m.outputs[0] for m in members],
                     name=f"{members[0].name}/group", domain=FUSED_DOMAIN, opset=1)
        gone = {id(m) for m in members[1:]}
        graph.nodes = [fused if n is members[0] else n for n in graph.nodes if id(n) not in gone]
        return True
    return False


# -- QOperator format: QLinearMatMul -> QLinearAdd of its bias ----------------------------------------


def fuse_qlinear_matmul_bias(graph: Graph, owns=None) -> bool:
    """onnxruntime's QOperator format writes a MatMul with a bias as QLinearMatMul(x, W) then QLinearAdd of the
    bias codes: one QLinearMatMulAdd (ops/qdq_linear.py) runs both in one pass, rounding the product's codes
    and then the sum as the two nodes do. The pattern: a QLinearMatMul by a constant matrix with constant
    parameters, whose output only one com.microsoft QLinearAdd reads (no graph output, no subgraph), the
    Add's other operand and every parameter constant and present."""
    view = GraphView(graph)
    for matmul in list(graph.nodes):
        if matmul.op_type != "QLinearMatMul" or matmul.domain or len(matmul.inputs) != 8:
            continue
        weight = view.const(matmul.inputs[3])
        if weight is None or weight.ndim != 2 or any(view.const(matmul.inputs[i]) is None for i in (1, 2, 4, 5, 6, 7)):
            continue
        product = matmul.outputs[0]
        readers = view.consumers.get(product, [])
        if len(readers) != 1 or product in view.outputs or product in view.inner_reads:
            continue
        add = readers[0]
        if add.op_type != "QLinearAdd" or add.domain != "com.microsoft" or len(add.inputs) != 8 \
                or (add.inputs[0] == product) == (add.inputs[3] == product):
            continue
        bias_first = add.inputs[3] == product
        bias_slots, x_slots = ((0, 1, 2), (4, 5)) if bias_first else ((3, 4, 5), (1, 2))
        names = [add.inputs[i] for i in (*bias_slots, *x_slots, 6, 7)]
        if any(not name or view.const(name) is None for name in names) or not owned(owns, [matmul, add]):
            continue
        fused = Node("QLinearMatMulAdd", list(matmul.inputs) + names, list(add.outputs),
                     name=f"{matmul.name}/bias", domain=FUSED_DOMAIN, attrs={"bias_first": int(bias_first)},
                     opset=1)
        # Where the Add was: the bias and parameters are constants, and the product's inputs come before it.
        graph.nodes = [fused if n is add else n for n in graph.nodes if n is not matmul]
        return True
    return False


# -- DequantizeLinear -> MatMul/Gemm/Conv -> QuantizeLinear on integers -------------------------------

_EIGHT_BIT = frozenset(np.dtype(t) for t in (np.uint8, np.int8))
_F32 = np.dtype(np.float32)
_LINEAR = {"MatMul": "QuantizedMatMul", "Gemm": "QuantizedMatMul", "Conv": "QuantizedConv"}


def _per_tensor(params: tuple) -> bool:
    scale, zero, _ = params
    return scale.size == 1 and zero.size == 1


def _dequantized(view: GraphView, name: str) -> tuple[Node, tuple] | None:
    """(DequantizeLinear, its parameters) when ``name`` dequantizes 8-bit codes to float32 with constant
    parameters and a zero point (which gives the codes' type before shape inference)."""
    dq = _made_by(view, name, "DequantizeLinear")
    params = None if dq is None else _params(view, dq)
    if params is None or params[1] is None or params[1].dtype not in _EIGHT_BIT or params[0].dtype != _F32 \
            or params[0].shape != params[1].shape:
        return None
    return dq, params


def _weight_fits(node: Node, codes: np.ndarray, params: tuple) -> bool:
    """A constant weight with its scale per tensor or one per output channel: MatMul's (K, N) columns, Gemm's
    rows or columns as transB says, Conv's leading (M, C/group, k...) dimension."""
    scale, _, axis = params
    if node.op_type == "Conv":
        wanted, ok_rank = 0, codes.ndim >= 3
    else:
        wanted, ok_rank = (0 if node.op_type == "Gemm" and node.attr("transB", 0) else 1), codes.ndim == 2
    if not ok_rank:
        return False
    if scale.size == 1:
        return True
    return scale.ndim == 1 and -codes.ndim <= axis < codes.ndim and axis % codes.ndim == wanted \
        and scale.shape[0] == codes.shape[wanted]


def _bias_fits(view: GraphView, name: str, columns: int) -> bool:
    """Gemm's C or Conv's B as a constant float32 (N,) (or Gemm's scalar or (1, N)), possibly through a
    DequantizeLinear of constant codes (the int32 bias quantization tools write)."""
    dq = _made_by(view, name, "DequantizeLinear")
    if dq is not None:
        params = _params(view, dq)
        value = view.constant(dq.inputs[0])
        # Per tensor, or one scale per channel along the 1-D bias (per-channel weights give those).
        if params is None or value is None or params[0].dtype != _F32 or params[0].size not in (1, columns) \
                or (params[0].size > 1 and (value.ndim != 1 or params[0].ndim != 1)):
            return False
    else:
        value = view.constant(name)
        if value is None or value.dtype != _F32:
            return False
    return value.size in (1, columns) and (value.ndim <= 1 or value.ndim == 2 and value.shape[0] == 1)


def _linear_group(view: GraphView, node: Node) -> tuple | None:
    """(input DQ, its params, weight DQ, its params, output Q, its params) around a MatMul/Gemm/Conv whose
    quantization the graph spells in QDQ form, else None."""
    if node.domain or len(node.inputs) < 2 or (node.op_type == "Gemm" and node.attr("transA", 0)):
        return None
    a, b = _dequantized(view, node.inputs[0]), _dequantized(view, node.inputs[1])
    if a is None or b is None or not _per_tensor(a[1]):
        return None
    weight = view.constant(b[0].inputs[0])
    if weight is not None:
        if not _weight_fits(node, weight, b[1]):
            return None
        columns = weight.shape[0] if node.op_type == "Conv" or node.attr("transB", 0) else weight.shape[1]
        bias = node.inputs[2] if len(node.inputs) > 2 else ""
        if bias and not _bias_fits(view, bias, columns):
            return None
    elif node.op_type != "MatMul" or not _per_tensor(b[1]):  # two activations: attention's products
        return None
    quantize = view.only_consumer(node.outputs[0], "QuantizeLinear")
    q_params = None if quantize is None else _params(view, quantize)
    if q_params is None or q_params[1] is None or q_params[1].dtype not in _EIGHT_BIT or not _per_tensor(q_params):
        return None
    return (*a, *b, quantize, q_params)


def _drop_if_unread(view: GraphView, node: Node, reader: Node, removed: list[Node]) -> None:
    name = node.outputs[0]
    if all(r is reader for r in view.consumers.get(name, [])) and name not in view.outputs \
            and name not in view.inner_reads and not any(n is node for n in removed):
        removed.append(node)


def fuse_quantized_linear(graph: Graph, owns=None, kinds=frozenset(_LINEAR), conv_ranks=(3, 4, 5),
                          accepts=None) -> bool:
    """DequantizeLinear(codes) -> MatMul/Gemm/Conv (weight: DequantizeLinear of constant codes, per tensor or
    per output channel; or, for MatMul, a second dequantized activation) -> QuantizeLinear: one node computing
    the integer product of the codes, requantized once (ops/qdq_linear.py), as onnxruntime's QDQ transformer
    makes QLinearMatMul, QGemm and QLinearConv. The bias (a DequantizeLinear of int32 codes, or float) stays
    a float input, which constant folding then makes one constant. Runs before the optimizer, whose constant
    folding would otherwise turn the weights' DequantizeLinear into float32 weights. ``accepts``: a further test
    of the MatMul/Gemm/Conv node, accepts(view, node), or None."""
    view = GraphView(graph)
    for node in list(graph.nodes):
        if node.op_type not in kinds or node.domain or (accepts is not None and not accepts(view, node)):
            continue
        group = _linear_group(view, node)
        if group is None:
            continue
        dq_a, a_params, dq_b, b_params, quantize, _ = group
        if node.op_type == "Conv" and view.constant(dq_b.inputs[0]).ndim not in conv_ranks:
            continue
        removed = [node, quantize]
        _drop_if_unread(view, dq_a, node, removed)
        _drop_if_unread(view, dq_b, node, removed)
        if not owned(owns, removed):
            continue
        attrs = {k: v for k, v in node.attrs.items() if k != "transA"}
        if node.op_type != "Conv":
            attrs = {k: v for k, v in attrs.items() if k in ("transB", "alpha", "beta")}
        inputs = [*dq_a.inputs[:3], *dq_b.inputs[:3], *quantize.inputs[1:3]] + list(node.inputs[2:3])
        fused = Node(_LINEAR[node.op_type], inputs, [quantize.outputs[0]], name=f"{node.name}/integer",
                     domain=FUSED_DOMAIN, attrs=attrs, opset=1)
        gone = {id(n) for n in removed}
        graph.nodes = [fused if n is node else n for n in graph.nodes if id(n) not in gone or n is node]
        return True
    return False


def _is_group(node: Node | None) -> bool:
    """Whether ``node`` is a convolution group on the integers (fuse_quantized_linear's QuantizedConv)."""
    return node is not None and node.op_type == "QuantizedConv" and node.domain == FUSED_DOMAIN


def _made_by_group(view: GraphView, name: str) -> bool:
    return _is_group(view.producer.get(name))


def fuse_quantized_add(graph: Graph, owns=None) -> bool:
    """DequantizeLinear(a) + DequantizeLinear(b) (Add, or Caffe2's Sum of two) [-> Relu] -> QuantizeLinear, every
    parameter a constant per tensor: one QuantizedAdd node (attribute ``relu``; ops/qdq_add.py) on the codes, the
    same float32 arithmetic as the nodes. A statically quantized ResNet's residual additions (4-D maps, one input
    a convolution group's codes: fuse_large_quantized_conv's): three float32 passes over a block's activations,
    which also kept the convolution groups around them on float32 in and out. Runs with the integer groups, before
    absorb_dequantize, so those keep their codes."""
    view = GraphView(graph)
    for node in list(graph.nodes):
        if node.domain or node.op_type not in ("Add", "Sum") or len(node.inputs) != 2 \
                or node.inputs[0] == node.inputs[1]:
            continue
        a, b = _dequantized(view, node.inputs[0]), _dequantized(view, node.inputs[1])
        if a is None or b is None or not _per_tensor(a[1]) or not _per_tensor(b[1]) \
                or a[1][1].dtype != b[1][1].dtype:
            continue
        info = graph.type_of(node.outputs[0])
        if info is None or info.shape is None or len(info.shape) != 4:  # (a CNN's maps; not a transformer's stream,
            continue  # whose residual additions the normalization fusions read)
        if not any(_made_by_group(view, dq.inputs[0]) for dq in (a[0], b[0])):
            continue  # (small maps between float convolutions: their fused segments run the nodes faster)
        relu = view.only_consumer(node.outputs[0], "Relu")
        quantize = view.only_consumer((relu or node).outputs[0], "QuantizeLinear")
        params = None if quantize is None else _params(view, quantize)
        if params is None or params[1] is None or params[1].dtype not in _EIGHT_BIT or not _per_tensor(params) \
                or params[0].dtype != a[1][0].dtype:
            continue
        removed = [node, quantize] + ([relu] if relu is not None else [])
        _drop_if_unread(view, a[0], node, removed)
        _drop_if_unread(view, b[0], node, removed)
        if not owned(owns, removed):
            continue
        fused = Node("QuantizedAdd", [*a[0].inputs[:3], *b[0].inputs[:3], *quantize.inputs[1:3]],
                     [quantize.outputs[0]], name=f"{node.name}/codes", domain=FUSED_DOMAIN,
                     attrs={"relu": int(relu is not None)}, opset=1)
        gone = {id(n) for n in removed}
        graph.nodes = [fused if n is node else n for n in graph.nodes if id(n) not in gone or n is node]
        return True
    return False


def pass_codes_through(graph: Graph, owns=None) -> bool:
    """DequantizeLinear -> Concat -> QuantizeLinear, every parameter a constant per tensor, beside a convolution
    group (an input made by one, or the output read by one): the Concat on the codes instead. With every input
    and the output on one grid, a plain Concat: exact, the dequantized codes requantize to themselves and Concat
    only moves them. Otherwise com.microsoft's QLinearConcat, which requantizes each input's codes to the output's
    grid as DequantizeLinear then QuantizeLinear do (ops/contrib_qlinear_concat.py; a 256-code table per input):
    exact too, since Concat only moves the dequantized values. A statically quantized SqueezeNet's fire modules,
    Inception's branches and DenseNet's blocks, whose groups then keep their codes. (MaxPool would commute too,
    but the pool loops take float32 only: RESULTS, "not kept".)"""
    view = GraphView(graph)
    for node in list(graph.nodes):
        if node.domain or node.op_type != "Concat" or len(node.outputs) != 1 or not node.inputs:
            continue
        sources = [_dequantized(view, name) for name in node.inputs]
        if any(s is None or not _per_tensor(s[1]) or s[1][1].dtype != sources[0][1][1].dtype for s in sources):
            continue
        quantize = view.only_consumer(node.outputs[0], "QuantizeLinear")
        params = None if quantize is None else _params(view, quantize)
        if params is None or params[1] is None or not _per_tensor(params) or params[0].dtype != _F32 \
                or params[1].dtype != sources[0][1][1].dtype:
            continue
        codes = [dq.inputs[0] for dq, _ in sources]
        if not any(_made_by_group(view, name) for name in codes) \
                and not any(_is_group(r) for r in view.consumers.get(quantize.outputs[0], [])):
            continue
        removed = [quantize]
        for dq, _ in sources:
            _drop_if_unread(view, dq, node, removed)
        if not owned(owns, [node, *removed]):
            continue
        if all(_same(s[1], params) for s in sources):
            node.inputs, node.outputs = codes, [quantize.outputs[0]]
            fused = node
        elif not all(_is_group(r) for r in view.consumers.get(quantize.outputs[0], [])) \
                or not all(_made_by_group(view, name) for name in codes):
            continue  # (float readers would dequantize the joined codes again, and float inputs quantize first)
        else:
            triples = [name for dq, _ in sources for name in (dq.inputs[0], dq.inputs[1], dq.inputs[2])]
            fused = Node("QLinearConcat", [*quantize.inputs[1:3], *triples], [quantize.outputs[0]],
                         name=f"{node.name}/codes", domain=_CONTRIB, attrs={"axis": int(node.attr("axis", 1))},
                         opset=1)
        gone = {id(n) for n in removed}
        graph.nodes = [fused if n is node else n for n in graph.nodes if id(n) not in gone or n is node]
        return True
    return False


def _float32(graph: Graph, name: str) -> bool:
    info = graph.type_of(name)
    return info is not None and info.is_tensor and info.dtype is not None and info.dtype.numpy == _F32


_GROUPS = ("QuantizedMatMul", "QuantizedConv")


def _group_slots(node: Node) -> tuple:
    """The (codes input, flag) pairs of a fused group that can take float32 data to quantize instead."""
    if node.domain != FUSED_DOMAIN or node.op_type not in _GROUPS:
        return ()
    # A convolution's weight stays codes (constant folding makes them constants).
    return ((0, "quantize_a"),) if node.op_type == "QuantizedConv" else ((0, "quantize_a"), (3, "quantize_b"))


def absorb_quantize(graph: Graph, owns=None) -> bool:
    """A QuantizeLinear whose codes fused QDQ groups read with its parameters (their A, or a MatMul's B), and
    otherwise only DequantizeLinear nodes with them: each group quantizes the float32 tensor itself (attribute
    quantize_a or quantize_b; the same rounding, repeated per reader, in place of a node and a tensor). The
    QuantizeLinear stays for the DequantizeLinear readers (one QuantizeDequantize node later) or goes."""
    view = GraphView(graph)
    for quantize in list(graph.nodes):
        if quantize.op_type != "QuantizeLinear" or quantize.domain:
            continue
        codes = quantize.outputs[0]
        readers = list({id(r): r for r in view.consumers.get(codes, [])}.values())
        params = _params(view, quantize)
        if not readers or codes in view.outputs or codes in view.inner_reads or params is None \
                or params[1] is None or params[1].dtype not in _EIGHT_BIT or not _float32(graph, quantize.inputs[0]):
            continue
        slots, dequantizers = _quantize_readers(view, codes, params, readers)
        if slots is None or not slots or not owned(owns, [quantize, *readers]):
            continue
        for group, slot, flag in slots:
            group.inputs[slot] = quantize.inputs[0]
            group.attrs[flag] = 1
        if not dequantizers:
            graph.nodes = [n for n in graph.nodes if n is not quantize]
        return True
    return False


def _quantize_readers(view: GraphView, codes: str, params: tuple, readers: list[Node]) -> tuple:
    """([(group, input, flag)] of the fused groups reading ``codes``, whether DequantizeLinear nodes read them
    too), or (None, False) when some reader is neither, or reads them with other parameters."""
    slots, dequantizers = [], False
    for reader in readers:
        if reader.op_type == "DequantizeLinear" and not reader.domain:
            mine = _params(view, reader)
            if reader.inputs[0] != codes or codes in reader.inputs[1:] or mine is None or not _same(params, mine):
                return None, False
            dequantizers = True
            continue
        found = [(reader, slot, flag) for slot, flag in _group_slots(reader) if reader.inputs[slot] == codes]
        if len(found) != reader.inputs.count(codes) or any(
                reader.attr(flag, 0) or (mine := _slot_params(view, reader, slot + 1)) is None
                or not _same(params, mine) for _, slot, flag in found):
            return None, False
        slots += found
    return slots, dequantizers


def _slot_params(view: GraphView, node: Node, scale: int) -> tuple | None:
    """_params of the (scale, zero point) pair a fused group reads at inputs ``scale``, ``scale + 1``."""
    return _params(view, Node("DequantizeLinear", ["", *node.inputs[scale:scale + 2]], []))


def absorb_dequantize(graph: Graph, owns=None) -> bool:
    """A fused QDQ group whose codes only DequantizeLinear nodes with its output parameters read: the group
    gives their float32 tensor (attribute dequantize); the readers' outputs become the group's."""
    view = GraphView(graph)
    for node in list(graph.nodes):
        if node.domain != FUSED_DOMAIN or node.op_type not in _GROUPS or node.attr("dequantize", 0):
            continue
        codes = node.outputs[0]
        readers = view.consumers.get(codes, [])
        mine = _slot_params(view, node, 6)
        if not readers or codes in view.outputs or codes in view.inner_reads or mine is None:
            continue
        if not all(r.op_type == "DequantizeLinear" and r.inputs[0] == codes and (p := _params(view, r)) is not None
                   and _same(mine, p) for r in readers):
            continue
        first, others = readers[0], readers[1:]
        renamed = {r.outputs[0] for r in others}
        if renamed & view.outputs or renamed & view.inner_reads or not owned(owns, [node, *readers]):
            continue
        node.outputs = [first.outputs[0]]
        node.attrs["dequantize"] = 1
        gone = {id(r) for r in readers}
        graph.nodes = [n for n in graph.nodes if id(n) not in gone]
        for n in graph.nodes:
            n.inputs = [first.outputs[0] if name in renamed else name for name in n.inputs]
        return True
    return False


# Operators whose output holds only values of their first input (data movement, max): on a quantization grid
# when that input is. Relu adds 0, a grid value wherever the zero point is a code.
_GRID_KEEPING = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand", "Slice",
                           "Gather", "MaxPool", "Relu"})


def _grid_of(view: GraphView, name: str, depth: int = 0) -> tuple | None:
    """The per-tensor (scale, zero point, axis) whose grid every value of ``name`` lies on, as a
    QuantizeDequantize, a DequantizeLinear or a dequantizing fused group makes it, through data movement;
    else None."""
    node = view.producer.get(name)
    if node is None or depth > 8:
        return None
    if node.op_type in _GRID_KEEPING and not node.domain and node.outputs[0] == name:
        return _grid_of(view, node.inputs[0], depth + 1)
    if node.op_type == "QuantizeDequantize" and node.domain == FUSED_DOMAIN:
        params = _slot_params(view, node, 1)
    elif node.op_type == "DequantizeLinear" and not node.domain:
        params = _params(view, node)
    elif node.op_type in _GROUPS and node.domain == FUSED_DOMAIN and node.attr("dequantize", 0):
        params = _slot_params(view, node, 6)
    else:
        return None
    # float32 scales only: a float32 (q - z) * s divided by s again lies within 255 * 2**-23 of q - z, which
    # rounds back to it (bfloat16's 8-bit significand would not).
    return params if params is not None and params[1] is not None and _per_tensor(params) \
        and params[0].dtype == _F32 else None


def drop_repeated_rounding(graph: Graph, owns=None) -> bool:
    """A QuantizeDequantize of values already on its grid (per tensor: the same scale and zero point, reached
    through data movement, e.g. Add -> Q/DQ -> Reshape -> Q/DQ) returns them unchanged: each value is (q - z) * s,
    and rounding it again to the nearest (x / s) + z gives q back. Its readers read its input instead."""
    view = GraphView(graph)
    for node in list(graph.nodes):
        if node.op_type != "QuantizeDequantize" or node.domain != FUSED_DOMAIN or node.outputs[0] in view.outputs \
                or node.outputs[0] in view.inner_reads:
            continue
        mine, grid = _slot_params(view, node, 1), _grid_of(view, node.inputs[0])
        if mine is None or grid is None or not _per_tensor(mine) or not _same(mine, grid) or not owned(owns, [node]):
            continue
        bypass(graph, node, node.inputs[0])
        return True
    return False


def absorb_rounded_add(graph: Graph, owns=None) -> bool:
    """A dequantizing QuantizedMatMul group (its float32 output) read only by an Add of a constant float32 row
    (N,) or scalar, whose sum only a per-tensor 8-bit QuantizeDequantize reads: the quantization tools' MatMul
    followed by its bias Add, each output rounded to its grid. The group adds the row and rounds the sum in the
    same pass (inputs row, after_scale, after_zero; ops/qdq_linear.py), the same float32 operations as the two
    nodes; the QuantizeDequantize's output becomes the group's."""
    view = GraphView(graph)
    for node in list(graph.nodes):
        if node.op_type != "QuantizedMatMul" or node.domain != FUSED_DOMAIN or not node.attr("dequantize", 0) \
                or len(node.inputs) > 9 or node.outputs[0] in view.outputs or node.outputs[0] in view.inner_reads:
            continue
        add = view.only_consumer(node.outputs[0], "Add")
        if add is None or len(add.inputs) != 2 or add.inputs[0] == add.inputs[1] \
                or add.outputs[0] in view.outputs or add.outputs[0] in view.inner_reads:
            continue
        row = add.inputs[1] if add.inputs[0] == node.outputs[0] else add.inputs[0]
        value, weight = view.const(row), view.const(node.inputs[3])
        columns = None if weight is None or weight.ndim != 2 else weight.shape[0 if node.attr("transB", 0) else 1]
        if value is None or value.dtype != _F32 or value.ndim > 1 or columns is None or value.size not in (1, columns):
            continue
        readers = view.consumers.get(add.outputs[0], [])
        rounding = readers[0] if len(readers) == 1 else None
        if rounding is None or rounding.op_type != "QuantizeDequantize" or rounding.domain != FUSED_DOMAIN \
                or rounding.inputs[0] != add.outputs[0] or not owned(owns, [node, add, rounding]):
            continue
        params = _slot_params(view, rounding, 1)
        if params is None or params[1] is None or params[1].dtype not in _EIGHT_BIT or not _per_tensor(params) \
                or params[0].dtype != _F32:
            continue
        node.inputs = [*node.inputs[:8], node.inputs[8] if len(node.inputs) > 8 else "", row, *rounding.inputs[1:3]]
        node.outputs = [rounding.outputs[0]]
        graph.nodes = [n for n in graph.nodes if n is not add and n is not rounding]
        return True
    return False


def _sole_reader(view: GraphView, name: str, op_type: str, domain: str = "") -> Node | None:
    """The one node reading ``name`` when it is an ``op_type`` of ``domain`` and nothing else sees the value."""
    readers = view.consumers.get(name, [])
    if len(readers) != 1 or name in view.outputs or name in view.inner_reads:
        return None
    node = readers[0]
    return node if node.op_type == op_type and node.domain == domain and node.inputs.count(name) == 1 else None


def _scalar_f32(view: GraphView, name: str) -> bool:
    value = view.const(name)
    return value is not None and value.dtype == _F32 and value.size == 1


def _grid_rounding(view: GraphView, name: str) -> Node | None:
    """The per-tensor 8-bit QuantizeDequantize with a float32 scale that alone reads ``name``, else None."""
    rounding = _sole_reader(view, name, "QuantizeDequantize", FUSED_DOMAIN)
    params = None if rounding is None or rounding.inputs[0] != name else _slot_params(view, rounding, 1)
    if params is None or params[1] is None or params[1].dtype not in _EIGHT_BIT or not _per_tensor(params) \
            or params[0].dtype != _F32:
        return None
    return rounding


def _operand(node: Node, name: str) -> str | None:
    """The other input of a two-input node that reads ``name`` once."""
    if len(node.inputs) != 2 or node.inputs.count(name) != 1:
        return None
    return node.inputs[1] if node.inputs[0] == name else node.inputs[0]


def _rounded_gelu_chain(view: GraphView, erf: Node) -> tuple | None:
    """(x, nodes in run order, fused inputs) of Div(x, d) -> Erf -> round -> Add(c) -> round -> Mul(x) -> round
    -> Mul(h) with scalar float32 constants, each value read only by the next node; else None."""
    div = _made_by(view, erf.inputs[0], "Div") if erf.inputs else None
    if div is None or len(div.inputs) != 2 or not _scalar_f32(view, div.inputs[1]) \
            or _sole_reader(view, div.outputs[0], "Erf") is not erf or not _float32(view.graph, div.inputs[0]):
        return None
    x = div.inputs[0]
    first = _grid_rounding(view, erf.outputs[0])
    add = None if first is None else _sole_reader(view, first.outputs[0], "Add")
    one = None if add is None else _operand(add, first.outputs[0])
    second = None if one is None or not _scalar_f32(view, one) else _grid_rounding(view, add.outputs[0])
    product = None if second is None else _sole_reader(view, second.outputs[0], "Mul")
    third = None if product is None or _operand(product, second.outputs[0]) != x \
        else _grid_rounding(view, product.outputs[0])
    last = None if third is None else _sole_reader(view, third.outputs[0], "Mul")
    half = None if last is None else _operand(last, third.outputs[0])
    if half is None or not _scalar_f32(view, half):
        return None
    nodes = [div, erf, first, add, second, product, third, last]
    inputs = [x, div.inputs[1], *first.inputs[1:3], one, *second.inputs[1:3], *third.inputs[1:3], half]
    return x, nodes, inputs


def fuse_rounded_gelu(graph: Graph, owns=None) -> bool:
    """The erf form of GELU in a QDQ model (torch's Div -> Erf -> Add -> Mul -> Mul, each activation rounded
    to its grid by a QuantizeDequantize in between): one RoundedGelu node (ops/qdq_gelu.py), the same float32
    operations and roundings in one pass, where onnxruntime runs the float operators and Q/DQ nodes apart.
    The fused node stands where the last Mul was (its inputs are x and constants)."""
    view = GraphView(graph)
    for erf in list(graph.nodes):
        if erf.op_type != "Erf" or erf.domain:
            continue
        chain = _rounded_gelu_chain(view, erf)
        if chain is None or not owned(owns, chain[1]):
            continue
        _, nodes, inputs = chain
        last = nodes[-1]
        fused = Node("RoundedGelu", inputs, list(last.outputs), name=f"{last.name}/rounded_gelu",
                     domain=FUSED_DOMAIN, opset=1)
        gone = {id(n) for n in nodes}
        graph.nodes = [fused if n is last else n for n in graph.nodes if id(n) not in gone or n is last]
        return True
    return False


def _early(graph_pass):
    graph_pass.before_optimizer = True  # the weights' DequantizeLinear nodes are still there to read
    return graph_pass


def fuse_quantized_matmul(graph: Graph, owns=None) -> bool:
    """fuse_quantized_linear of MatMul and Gemm groups and of 1-D convolutions (a 3-D weight: an audio
    encoder's Conv1d stem), whose patch rows run QuantizedMatMul's integer product."""
    return fuse_quantized_linear(graph, owns, _PRODUCTS, (3,))


_PRODUCTS = frozenset({"MatMul", "Gemm", "Conv"})


# A 2-D convolution group of at least this many multiply-adds an image runs on the integers where VNNI's byte
# products run it (compiled/quantized_conv_blocks); smaller ones stay in the float chains with their roundings,
# whose fused segments run them faster than a call each.
LARGE_CONV_MACS = 1 << 20


def fuse_large_quantized_conv(graph: Graph, owns=None) -> bool:
    """fuse_quantized_linear of 2-D convolution groups (group 1) of LARGE_CONV_MACS an image or more, by their
    output's inferred shape, on hosts with AVX-512 VNNI."""
    from .compiled import qgemm_quads  # (imports neither numba nor llvmlite)

    return qgemm_quads.AVAILABLE and fuse_quantized_linear(graph, owns, frozenset({"Conv"}), (4,), _large_conv)


def _large_conv(view: GraphView, node: Node) -> bool:
    info = view.graph.type_of(node.outputs[0])
    dq = _made_by(view, node.inputs[1], "DequantizeLinear") if len(node.inputs) > 1 else None
    weight = None if dq is None else view.constant(dq.inputs[0])
    if int(node.attr("group", 1)) != 1 or weight is None or info is None or info.shape is None \
            or len(info.shape) != 4:
        return False
    height, width = info.shape[2], info.shape[3]
    return isinstance(height, int) and isinstance(width, int) and height * width * weight.size >= LARGE_CONV_MACS


# The integer groups compute what onnxruntime's QDQ kernels compute. For MatMul and Gemm they are the default:
# one node per group in place of a rounding node, a float product and the next rounding node, which on the
# zoo's transformer encoders measured 1.56 -> 1.39 (t5), 2.07 -> 1.73 (vit), 1.86 -> 1.81 (bert), one thread,
# CPU time against onnxruntime. 1-D convolution groups (whisper's Conv1d) are in; 2-D ones where VNNI's or AMX's
# byte products take them and they are large (fuse_large_quantized_conv: small ones run faster in the float chains'
# segments), with the residual additions and one-grid Concats beside them on the codes (INTEGER_GROUP_PASSES has
# every rank, for a caller to add before QDQ_PASSES).
_MATMUL_GROUP_PASSES = [_early(until_fixed(drop_activation_before_quantizing)),
                        _early(until_fixed(fuse_quantized_matmul)), _early(until_fixed(fuse_large_quantized_conv)),
                        _early(until_fixed(fuse_quantized_add)), _early(until_fixed(pass_codes_through)),
                        _early(until_fixed(absorb_quantize)),
                        _early(until_fixed(absorb_dequantize))]
INTEGER_GROUP_PASSES = [_early(until_fixed(drop_activation_before_quantizing)),
                        _early(until_fixed(fuse_quantized_linear)), _early(until_fixed(absorb_quantize)),
                        _early(until_fixed(absorb_dequantize))]
# QOperator CNNs first take the QDQ form (qoperator_lowering.py), which the passes after it treat as the QDQ model.
QDQ_PASSES = [lower_qoperator_cnn, *_MATMUL_GROUP_PASSES, until_fixed(fuse_quantize_dequantize),
              until_fixed(drop_repeated_rounding),
              until_fixed(fuse_rounded_gelu),
              until_fixed(absorb_rounded_add), until_fixed(drop_rounding_before_quantizing), round_before_moving,
              fuse_grid_tables, fuse_channel_tables, until_fixed(channel_tables_to_codes),
              until_fixed(fuse_dynamic_matmul), until_fixed(fuse_dynamic_quantize_matmul),
              until_fixed(unflatten_dynamic_quantize_matmul),
              until_fixed(group_dynamic_quantize_matmul),
              until_fixed(fuse_qlinear_matmul_bias)]
