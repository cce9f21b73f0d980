"""Grid tables: in a QDQ model, a float chain that reads one tensor on an 8-bit grid and constant scalars is a
function of that tensor's 256 codes, run as one table lookup (ops/grid_table.py).

quantize_static rounds every activation to its grid (QuantizeLinear -> DequantizeLinear, one QuantizeDequantize
node after qdq_fusions.fuse_quantize_dequantize). GPT-2's tanh GELU is then Pow, Mul, Add, Mul, Tanh, Add, Mul,
Mul with a rounding after each: sixteen steps over small float tensors per layer, every one of whose results is
a function of the one code of the product it reads (both operands of Add(x, f(x)) and Mul(x, g(x)) are
functions of x's code). LLaMA's SiLU gate (Sigmoid, rounding) is another. Each such result becomes one GridTable
node: the chain's own node kernels run once on the grid's 256 values, then each element's code picks its entry.

The root is a float32 tensor whose every value lies on a per-tensor 8-bit grid with a float32 scale: the output
of a QuantizeDequantize, or of a dequantizing QuantizedMatMul/QuantizedConv (qdq_fusions.absorb_dequantize; a
rounded add's grid where it has one). A grid value is the float32 product (code - zero) * scale, which both
make exactly, and from which QuantizeLinear's division gives the code back. Chain nodes are elementwise, with
one output that no subgraph reads and that is no graph output, and every input the root, a chain value or a
constant of one element (so no broadcast moves an element). The values are the chain's own kernels' on the same
float32 inputs, element by element.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.dtypes import DataType
from onnx_runtime.ir import Graph, Node, TypeInfo, ValueInfo

from .fusions import FUSED_DOMAIN, GraphView, owned
from .qdq_epilogues import FOLDED, SUFFIX
from .table_chains import ElementwiseChains, chain_attributes

_F32 = np.dtype(np.float32)
_EIGHT_BIT = frozenset({np.dtype(np.uint8), np.dtype(np.int8)})

# Float operators whose every output element depends only on the same element of each input.
_ELEMENTWISE = frozenset({
    "Abs", "Add", "Ceil", "Celu", "Clip", "Cos", "Div", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid",
    "HardSwish", "Identity", "LeakyRelu", "Log", "Max", "Min", "Mish", "Mul", "Neg", "Pow", "Reciprocal", "Relu",
    "Round", "Selu", "Sigmoid", "Sin", "Softplus", "Softsign", "Sqrt", "Sub", "Tanh", "ThresholdedRelu",
})
_FUSED_ELEMENTWISE = frozenset({"QuantizeDequantize", "RoundedGelu"})
_GROUPS = frozenset({"QuantizedMatMul", "QuantizedConv"})


def _grid_pair(view: GraphView, scale: str, zero: str) -> tuple | None:
    """(scale name, zero name) of a per-tensor 8-bit grid with a float32 scale, else None."""
    s, z = view.const(scale), view.const(zero)
    if s is None or z is None or s.size != 1 or z.size != 1 or s.dtype != _F32 or z.dtype not in _EIGHT_BIT:
        return None
    return scale, zero


# Operators whose outputs hold only values of their first input: on its grid when it is.
_MOVING = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand", "Slice",
                     "Gather", "Split"})
_FUSED_MOVING = frozenset({"ReshapeTranspose", "TransposeReshape"})


def grid_of(view: GraphView, name: str, depth: int = 0) -> tuple | None:
    """(scale name, zero name) of the per-tensor grid every value of ``name`` lies on, as its producer makes it
    (through data movement); else None."""
    node = view.producer.get(name)
    if node is None or depth > 8:
        return None
    if (node.op_type in _MOVING and node.domain in ("", "ai.onnx")) \
            or (node.op_type in _FUSED_MOVING and node.domain == FUSED_DOMAIN):
        return grid_of(view, node.inputs[0], depth + 1)
    if node.domain != FUSED_DOMAIN or node.outputs[0] != name:
        return None
    if node.op_type == "QuantizeDequantize" and len(node.inputs) == 3 and node.inputs[2]:
        return _grid_pair(view, node.inputs[1], node.inputs[2])
    if node.op_type.endswith(SUFFIX) and node.op_type[:-len(SUFFIX)] in FOLDED:  # a rounding epilogue's grid
        return _grid_pair(view, node.inputs[-2], node.inputs[-1])
    if node.op_type in _GROUPS and node.attr("dequantize", 0):
        if node.op_type == "QuantizedMatMul" and len(node.inputs) > 9:  # the rounded add's grid
            return _grid_pair(view, node.inputs[10], node.inputs[11]) if len(node.inputs) == 12 else None
        return _grid_pair(view, node.inputs[6], node.inputs[7]) if len(node.inputs) > 7 else None
    return None


# A convolution's activations run inside compiled segments (segment_fusions.py) that round them in place: a
# table there would cut the segment (mobilenetv3 QDQ went from 4 steps to 28, 185 -> 335 us).
_CONVOLUTIONS = frozenset({"Conv", "ConvTranspose", "QuantizedConv", "FusedConv", "GlobalAveragePool",
                           "AveragePool", "MaxPool"})


def _by_convolution(view: GraphView, name: str) -> bool:
    """Whether ``name`` is a convolution's or pooling's output, rounded (through data movement) or not."""
    node = view.producer.get(name)
    for _ in range(8):
        if node is None:
            return False
        if node.op_type in _CONVOLUTIONS:
            return True
        if node.op_type not in _MOVING | _FUSED_MOVING | {"QuantizeDequantize"}:
            return False
        node = view.producer.get(node.inputs[0])
    return False


def _elementwise(node: Node) -> bool:
    if node.domain == FUSED_DOMAIN:
        return node.op_type in _FUSED_ELEMENTWISE
    return node.domain in ("", "ai.onnx") and node.op_type in _ELEMENTWISE


def _table_node(graph: Graph, root: str, grid: tuple, value: str, cone: list[Node]) -> Node:
    constants, attrs = chain_attributes(graph, root, value, cone)
    return Node("GridTable", [root, *grid, *constants], [value], name=f"{cone[-1].name or cone[-1].op_type}/grid_table",
                domain=FUSED_DOMAIN, attrs=attrs, opset=1)


def fuse_grid_tables(graph: Graph, owns=None) -> bool:
    """Each result of the module doc's chains becomes a GridTable node where its last node was; chain nodes
    nothing reads any more go."""
    if not any(n.op_type == "QuantizeDequantize" and n.domain == FUSED_DOMAIN for n in graph.nodes):
        return False
    view = GraphView(graph)
    grids: dict[str, tuple | None] = {}

    def grid(name: str) -> tuple | None:
        if name not in grids:
            grids[name] = None if _by_convolution(view, name) else grid_of(view, name)
        return grids[name]

    def serves(value: str, outside: list[Node]) -> bool:
        info = graph.type_of(value)
        return not any(r.op_type in _CONVOLUTIONS for r in outside) and info is not None \
            and info.dtype is not None and info.dtype.numpy == _F32

    chains = ElementwiseChains(view, owns, elementwise=_elementwise, root=lambda name: grid(name) is not None,
                               serves=serves, max_constant_rank=1)
    return chains.replace(lambda root, value, cone: _table_node(graph, root, grid(root), value, cone))


# Readers a channel table may serve although they are convolutions: groups on the codes, which quantize their input
# themselves and run outside the float segments the module's other tables keep clear of
_INTEGER_READERS = frozenset({"QuantizedConv", "QuantizedMatMul"})


def _channels_of(view: GraphView, name: str) -> tuple[int, int] | None:
    """(rank, channels) of a 3-D or wider float32 tensor whose channel count (axis 1) is static, else None."""
    info = view.graph.type_of(name)
    shape = None if info is None else info.shape
    if shape is None or len(shape) < 3 or not isinstance(shape[1], int) or shape[1] < 1 \
            or info.dtype is None or info.dtype.numpy != _F32:
        return None
    return len(shape), shape[1]


def _per_channel(value: np.ndarray, rank: int, channels: int) -> bool:
    """Whether a constant broadcast against a (N, C, ...) tensor of ``rank`` dimensions holds one value per
    channel or one value: every dimension 1 but the channel axis, which is C or 1."""
    if value.size == 1:
        return value.ndim <= rank
    if value.ndim > rank or value.ndim < rank - 1:
        return False
    shape = (1,) * (rank - value.ndim) + value.shape
    return shape[1] == channels and all(d == 1 for i, d in enumerate(shape) if i != 1)


def _channel_node(view: GraphView, node: Node, geometry: tuple[int, int]) -> bool:
    """Whether ``node`` maps each element of a (N, C, ...) tensor alone with constants of one value per channel:
    an elementwise operator whose constants are per channel or scalars, or an inference BatchNormalization (its
    four parameters one per channel)."""
    rank, channels = geometry
    if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
        params = [view.const(name) for name in node.inputs[1:5]]
        return len(node.inputs) == 5 and len(node.outputs) == 1 and not node.attr("training_mode", 0) \
            and all(p is not None and p.shape == (channels,) for p in params)
    if not _elementwise(node):
        return False
    constants = [view.const(name) for name in node.inputs if name]
    return all(c is None or _per_channel(c, rank, channels) for c in constants)


def fuse_channel_tables(graph: Graph, owns=None) -> bool:
    """fuse_grid_tables' chains with constants of one value per channel (a batch normalization's, the per-channel
    Mul and Add of a Caffe "Scale" layer): each result becomes a ChannelGridTable, a table of the grid's codes per
    channel, made by the chain's own kernels on a (1, C, ..., 256) tensor of the grid's values in every channel.
    The root is a (N, C, ...) tensor on a per-tensor grid with C static, not a convolution's output (whose
    activations the segments round in place); the results serve any readers but float convolutions. DenseNet's
    pre-activation layers (Concat, rounding, BatchNormalization, rounding, Mul, rounding, Add, then the next
    convolution's quantization) are such chains."""
    if not any(n.op_type == "QuantizeDequantize" and n.domain == FUSED_DOMAIN for n in graph.nodes):
        return False
    view = GraphView(graph)
    roots: dict[str, tuple | None] = {}

    def root(name: str) -> tuple | None:
        if name not in roots:
            geometry = _channels_of(view, name)
            found = None if geometry is None or _by_convolution(view, name) else grid_of(view, name)
            roots[name] = None if found is None else (found, geometry)
        return roots[name]

    geometry_of: dict[str, tuple[int, int]] = {}  # chain value -> its root's (rank, channels)

    def elementwise(node: Node) -> bool:
        sources = [geometry_of.get(n) or (root(n) or (None, None))[1] for n in node.inputs if n]
        found = [g for g in sources if g is not None]
        if not found or any(g != found[0] for g in found) or not _channel_node(view, node, found[0]):
            return False
        geometry_of[node.outputs[0]] = found[0]
        return True

    def serves(value: str, outside: list[Node]) -> bool:
        return not any(r.op_type in _CONVOLUTIONS and r.op_type not in _INTEGER_READERS for r in outside) \
            and _channels_of(view, value) == geometry_of.get(value)

    chains = ElementwiseChains(view, owns, elementwise=elementwise, root=lambda name: root(name) is not None,
                               serves=serves, constant=lambda name: view.const(name) is not None)

    def table(root_name: str, value: str, cone: list[Node]) -> Node:
        constants, attrs = chain_attributes(graph, root_name, value, cone)
        if not any(view.const(c).size > 1 for c in constants) and not any(
                n.op_type == "BatchNormalization" for n in cone):
            return _table_node(graph, root_name, root(root_name)[0], value, cone)  # (scalars only: a grid table)
        return Node("ChannelGridTable", [root_name, *root(root_name)[0], *constants], [value],
                    name=f"{cone[-1].name or cone[-1].op_type}/channel_table", domain=FUSED_DOMAIN, attrs=attrs,
                    opset=1)

    return chains.replace(table)


def _codes_reader(view: GraphView, node: Node, value: str) -> tuple | None:
    """(scale, zero point) of the grid a fused integer group quantizes ``value`` to as its A (quantize_a, input 0
    only), else None."""
    if node.domain != FUSED_DOMAIN or node.op_type not in _INTEGER_READERS or not node.attr("quantize_a", 0) \
            or node.inputs[0] != value or value in node.inputs[1:] or _grid_pair(view, *node.inputs[1:3]) is None:
        return None
    scale, zero = view.const(node.inputs[1]), view.const(node.inputs[2])
    return np.float32(scale.reshape(-1)[0]), zero.reshape(-1)[0]


def channel_tables_to_codes(graph: Graph, owns=None) -> bool:
    """A ChannelGridTable whose values only integer groups read, each quantizing them to one grid (DenseNet's
    pre-activation table before each bottleneck convolution): the table's entries are quantized to that grid once,
    and the node writes those codes (attributes codes_scale, codes_zero; ops/grid_table.py), which the groups read
    as they are (quantize_a 0): the same codes, a byte a value instead of a float32 value written, read back and
    quantized per call."""
    view = GraphView(graph)
    for node in graph.nodes:
        if node.op_type != "ChannelGridTable" or node.domain != FUSED_DOMAIN or "codes_scale" in node.attrs:
            continue
        value = node.outputs[0]
        readers = view.consumers.get(value, [])
        grids = [_codes_reader(view, reader, value) for reader in readers]
        info = graph.type_of(value)
        if not readers or value in view.outputs or value in view.inner_reads or any(g is None for g in grids) \
                or any(g[0] != grids[0][0] or g[1] != grids[0][1] or g[1].dtype != grids[0][1].dtype
                       for g in grids) or not owned(owns, [node, *readers]):
            continue
        scale, zero = grids[0]
        codes = f"{value}/codes"
        node.outputs = [codes]
        node.attrs.update(codes_scale=float(scale), codes_zero=int(zero), codes_signed=int(zero.dtype == np.int8))
        for reader in readers:
            reader.inputs[0] = codes
            reader.attrs["quantize_a"] = 0
        dtype = DataType.INT8 if zero.dtype == np.int8 else DataType.UINT8
        graph.value_info[codes] = ValueInfo(codes, TypeInfo("tensor", dtype, None if info is None else info.shape))
        return True
    return False


# Data movement a per-tensor rounding commutes with (the rounding is elementwise with scalar parameters).
_ROUNDING_MOVES = frozenset({"Unsqueeze", "Squeeze", "Reshape", "Flatten"})


def round_before_moving(graph: Graph, owns=None) -> bool:
    """A rounding after data movement of an elementwise result on a grid's root moves before the movement:
    Unsqueeze(Cos(x)) -> rounding (the dynamo LLaMA's rotary tables) becomes Unsqueeze(rounding(Cos(x))), whose
    Cos and rounding fuse_grid_tables then makes one table lookup of x's codes. Exact: a per-tensor rounding maps
    each value alone, so it gives the same values before or after the movement. Applied where the rounding's scale
    and zero point are constant scalars, the elementwise node's one output only the movement reads, the moved
    value only the rounding, and the elementwise node's first input lies on a per-tensor grid."""
    view = GraphView(graph)
    moved = False
    for rounding in list(graph.nodes):
        if rounding.op_type != "QuantizeDequantize" or rounding.domain != FUSED_DOMAIN or len(rounding.inputs) != 3 \
                or _grid_pair(view, rounding.inputs[1], rounding.inputs[2]) is None:
            continue
        move = view.producer.get(rounding.inputs[0])
        if move is None or move.op_type not in _ROUNDING_MOVES or move.domain not in ("", "ai.onnx") \
                or len(move.outputs) != 1:
            continue
        value = move.inputs[0]
        source = view.producer.get(value)
        if source is None or not _elementwise(source) or source.domain or len(source.outputs) != 1 \
                or grid_of(view, source.inputs[0]) is None or view.const(source.inputs[0]) is not None:
            continue
        if [r for r in view.consumers.get(value, [])] != [move] or move.inputs.count(value) != 1 \
                or [r for r in view.consumers.get(move.outputs[0], [])] != [rounding] \
                or {value, move.outputs[0]} & (view.outputs | view.inner_reads) or not owned(owns, [move, rounding]):
            continue
        info = graph.type_of(value)
        if info is None or info.dtype is None or info.dtype.numpy != _F32:
            continue
        rounded, result = f"{value}/rounded", rounding.outputs[0]
        graph.value_info.pop(move.outputs[0], None)
        graph.value_info[rounded] = type(graph.value_info[value])(rounded, info)
        rounding.inputs = [value, *rounding.inputs[1:]]
        rounding.outputs = [rounded]
        move.inputs = [rounded, *move.inputs[1:]]
        move.outputs = [result]
        nodes = [n for n in graph.nodes if n is not rounding]
        nodes.insert(nodes.index(move), rounding)
        graph.nodes = nodes
        view = GraphView(graph)
        moved = True
    return moved
