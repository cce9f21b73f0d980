"""Loading: ONNX bytes/path/ModelProto -> :class:`onnx_runtime.ir.Model`.

onnx parses the protobuf, resolves external data and infers shapes; this module turns the result
into the runtime's IR, sorts nodes topologically, records outer-scope reads of subgraphs, and
turns every way a file can be wrong into a :class:`ModelLoadError` or :class:`InvalidGraphError`
that names the problem.
"""

from __future__ import annotations

import heapq
import math
import os
import sys
import threading

import numpy as np
import onnx
from onnx import numpy_helper

from .contrib_stand_ins import stand_in_contrib_ops
from .declared_shapes import infer_reconciled, without_declared_shapes
from .dtypes import DataType
from .errors import InvalidGraphError, ModelContentError, ModelLoadError, ModelNotFoundError, ModelParseError
from .ir import Graph, Model, Node, TypeInfo, ValueInfo
from .memory.mapped import load_external_data
from .model_checks import MAX_DECLARED_DIM, check_model_structure, check_types
from .propagation_bounds import propagates_large_values
from .proto_walk import copy_fields_except

_ATTR = onnx.AttributeProto


def load_model(model, infer_shapes: bool = True, free_dims: tuple[dict, dict] | None = None,
               map_weights: bool = True) -> Model:
    """Load ``model`` (a path, bytes, or an ``onnx.ModelProto``) into the IR. ``free_dims``: symbolic graph-input
    dimensions fixed by name and by denotation (SessionOptions.add_free_dimension_override_by_*).
    ``map_weights``: weights in external data files are memory-mapped, not read (memory/mapped.py)."""
    mapped: dict[str, np.ndarray] = {}
    proto, path = _read_proto(model, mapped if map_weights else None)
    _check_header(proto, path)
    check_model_structure(proto, _label(path))  # before shape inference: what it would crash or run away on
    if free_dims is not None and any(free_dims):
        proto = _override_free_dims(proto if path is not None or not isinstance(model, onnx.ModelProto)
                                    else _copied(proto), *free_dims)
    top = proto.graph
    light = None
    if infer_shapes:
        light, top = _infer_shapes(proto)
    opsets = {("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in proto.opset_import}
    check_types(top, opsets, _label(path))  # with the inferred types: mixed or disallowed input types
    try:
        graph = convert_graph(top, opsets, outer_scope=(), initializer_protos=proto.graph.initializer,
                              mapped=mapped)
    except (InvalidGraphError, ModelLoadError):
        raise
    except Exception as exc:
        raise InvalidGraphError(f"model {_label(path)} could not be converted: {type(exc).__name__}: {exc}") from exc
    return model_of(proto, path, graph, light)


class SerializedModel:
    """A ModelProto kept as its bytes until its first read (``parsed``): a cached plan's inference model, which only
    a signature the specializer resolves itself reads (a session whose plans all come from the cache never does)."""

    __slots__ = ("_data", "_proto", "_lock")

    def __init__(self, data: bytes):
        self._data = data
        self._proto: onnx.ModelProto | None = None
        self._lock = threading.Lock()

    def parsed(self) -> onnx.ModelProto:
        with self._lock:
            proto = self._proto
            if proto is None:
                proto = onnx.ModelProto()
                proto.ParseFromString(self._data)
                self._proto = proto
            return proto

    def SerializeToString(self) -> bytes:  # noqa: N802  (ModelProto's name, for writers of either)
        return self._data


def model_of(proto: onnx.ModelProto, path: str | None, graph: Graph, inference_proto) -> Model:
    """The :class:`Model` of ``proto`` (read from ``path``) with the IR ``graph``."""
    opsets = {("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in proto.opset_import}
    return Model(
        graph=graph,
        opsets=opsets,
        ir_version=int(proto.ir_version),
        producer_name=proto.producer_name,
        producer_version=proto.producer_version,
        domain=proto.domain,
        model_version=int(proto.model_version),
        doc_string=proto.doc_string,
        metadata={p.key: p.value for p in proto.metadata_props},
        functions={(f.domain, f.name): f for f in proto.functions},
        path=path,
        inference_proto=inference_proto,
    )


def read_model(model, map_weights: bool = True) -> tuple[onnx.ModelProto, str | None, dict[str, np.ndarray]]:
    """The parsed model, its path and its memory-mapped external weights (by name), header checked; what a
    session whose plan is cached (plan_cache.py) reads of the model: no checks, inference or conversion."""
    mapped: dict[str, np.ndarray] = {}
    proto, path = _read_proto(model, mapped if map_weights else None)
    _check_header(proto, path)
    return proto, path, mapped


# Element types whose raw_data is the array's bytes as they are (little-endian hosts): read by np.frombuffer
# without numpy_helper.to_array's general dispatch (packed, external, string and typed-field tensors take it).
_RAW_DTYPES = {int(code): np.dtype(kind) for code, kind in (
    (onnx.TensorProto.FLOAT, np.float32), (onnx.TensorProto.DOUBLE, np.float64), (onnx.TensorProto.FLOAT16, np.float16),
    (onnx.TensorProto.INT8, np.int8), (onnx.TensorProto.UINT8, np.uint8), (onnx.TensorProto.INT16, np.int16),
    (onnx.TensorProto.UINT16, np.uint16), (onnx.TensorProto.INT32, np.int32), (onnx.TensorProto.UINT32, np.uint32),
    (onnx.TensorProto.INT64, np.int64), (onnx.TensorProto.UINT64, np.uint64), (onnx.TensorProto.BOOL, np.bool_))
} if sys.byteorder == "little" else {}
_EXTERNAL = onnx.TensorProto.EXTERNAL


def tensor_array(tensor: onnx.TensorProto) -> np.ndarray:
    """numpy_helper.to_array(tensor), the same array, with plain raw_data tensors (most weights) read directly."""
    dtype = _RAW_DTYPES.get(tensor.data_type)
    if dtype is not None and tensor.HasField("raw_data") and tensor.data_location != _EXTERNAL \
            and not tensor.HasField("segment"):
        return np.frombuffer(tensor.raw_data, dtype=dtype).reshape(tuple(tensor.dims))
    return numpy_helper.to_array(tensor)


def initializer_arrays(proto: onnx.ModelProto, mapped: dict[str, np.ndarray], names) -> dict[str, np.ndarray]:
    """The top-level initializers ``names`` of ``proto`` as arrays (``mapped`` ones as mapped)."""
    wanted = set(names)
    found: dict[str, np.ndarray] = {}
    for init in proto.graph.initializer:
        if init.name in wanted:
            found[init.name] = mapped[init.name] if init.name in mapped else tensor_array(init)
    for sparse in proto.graph.sparse_initializer:
        if sparse.values.name in wanted:
            found[sparse.values.name] = _sparse_to_dense(sparse)
    return found


def graph_from_plan(proto: onnx.ModelProto, references: dict[str, np.ndarray], lazy: bool = False) -> Graph:
    """The IR of a graph serialize.py wrote (an optimized plan), with the initializers ``references`` (left out
    of ``proto``) added; its operators of later opsets read back as the standard ones. ``lazy``: its nodes and
    value types are converted at their first use (:class:`PlanGraph`)."""
    opsets = {("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in proto.opset_import}
    stand_ins = [onnx.TensorProto(name=name) for name in references]
    protos = [*proto.graph.initializer, *stand_ins]
    if not lazy:
        return convert_graph(proto.graph, opsets, outer_scope=(), initializer_protos=protos, mapped=references)
    gp = proto.graph
    initializers: dict[str, np.ndarray] = {}
    for init in protos:
        try:
            initializers[init.name] = references[init.name] if init.name in references \
                else tensor_array(init)
        except Exception as exc:
            raise ModelLoadError(f"initializer {init.name!r} could not be read: {exc}") from exc
    for sparse in gp.sparse_initializer:
        initializers[sparse.values.name] = _sparse_to_dense(sparse)

    def convert() -> Graph:  # the whole graph again, its initializers the arrays above
        return convert_graph(gp, opsets, outer_scope=(), initializer_protos=protos, mapped=initializers)

    return PlanGraph(gp.name, [_value_info(vi) for vi in gp.input if vi.name not in initializers],
                     [_value_info(vi) for vi in gp.output], initializers, opsets, gp.doc_string, convert)


_NODES, _VALUE_INFO = Graph.__dict__["nodes"], Graph.__dict__["value_info"]  # the base class's slots


class PlanGraph(Graph):
    """A cached plan's graph whose nodes and value types are converted at their first read (or write): a session
    whose signature plans all come from the plan cache runs none of its generic graph's nodes, and converting them
    was most of reading that plan. Name, inputs, outputs, initializers and opsets are there from the start. The
    conversion is the eager one's (``convert_graph``), so it raises what that would, at the first use."""

    __slots__ = ("_convert", "_converting")

    def __init__(self, name: str, inputs, outputs, initializers, opsets, doc: str, convert):
        self.name, self.inputs, self.outputs, self.initializers = name, inputs, outputs, initializers
        self.opsets, self.outer_names, self.doc = opsets, [], doc
        self._convert, self._converting = convert, threading.Lock()

    def _converted(self) -> None:
        with self._converting:  # two threads' first reads convert once
            if self._convert is not None:
                whole = self._convert()
                _NODES.__set__(self, whole.nodes)
                _VALUE_INFO.__set__(self, whole.value_info)
                self._convert = None

    @property
    def nodes(self) -> list[Node]:
        if self._convert is not None:
            self._converted()
        return _NODES.__get__(self)

    @nodes.setter
    def nodes(self, value: list[Node]) -> None:
        if self._convert is not None:
            self._converted()
        _NODES.__set__(self, value)

    @property
    def value_info(self) -> dict[str, ValueInfo]:
        if self._convert is not None:
            self._converted()
        return _VALUE_INFO.__get__(self)

    @value_info.setter
    def value_info(self, value: dict[str, ValueInfo]) -> None:
        if self._convert is not None:
            self._converted()
        _VALUE_INFO.__set__(self, value)

    @property
    def converted(self) -> bool:
        """Whether the nodes were read (converted) yet."""
        return self._convert is None


def _label(path: str | None) -> str:
    return repr(path) if path else "(from bytes)"


def _copied(proto: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)  # the caller's ModelProto stays as it was
    return copy


def _override_free_dims(proto: onnx.ModelProto, by_name: dict, by_denotation: dict) -> onnx.ModelProto:
    """Graph-input dimensions named in ``by_name`` (their dim_param) or ``by_denotation`` set to the given values
    before shape inference, so every shape derived from them is static, as onnxruntime's overrides do."""
    for vi in proto.graph.input:
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        for dim in vi.type.tensor_type.shape.dim:
            value = by_name.get(dim.dim_param) if dim.HasField("dim_param") else None
            if value is None and dim.denotation:
                value = by_denotation.get(dim.denotation)
            if value is not None:
                dim.dim_value = value
    return proto


def _read_proto(model, mapped: dict | None = None) -> tuple[onnx.ModelProto, str | None]:
    """The parsed model and its path; with ``mapped`` (a dict), large external weights are mapped into it."""
    if isinstance(model, onnx.ModelProto):
        return model, None
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _parse(bytes(model), None), None
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.exists(path):
            raise ModelNotFoundError(f"model file {path!r} does not exist; check the path")
        if os.path.isdir(path):
            raise ModelParseError(f"model path {path!r} is a directory; pass the .onnx file inside it")
        data = model_bytes(path)
        proto = _parse(data, path)
        if len(data) <= _SCAN_LIMIT and _EXTERNAL_KEY not in data:
            return proto, path  # no tensor can name a data file: skip onnx's walk over every tensor
        folder = os.path.dirname(os.path.abspath(path))
        try:
            load_external_data(proto, folder, mapped, SHAPE_VALUE_LIMIT)
            for tensor in _sparse_parts(proto):  # onnx's walk skips them: they would be read from the cwd
                if tensor.data_location == onnx.TensorProto.EXTERNAL:
                    onnx.external_data_helper.load_external_data_for_tensor(tensor, folder)
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:  # missing/escaping file
            raise ModelLoadError(
                f"model {path!r} references external data that could not be read: {exc}; keep the data "
                f"files next to the model as saved"
            ) from exc
        return proto, path
    raise ModelLoadError(
        f"cannot load a model from {type(model).__name__}; pass a file path, the model's bytes, or an onnx.ModelProto"
    )


# A model file's bytes as the plan cache's key hashed them (plan_cache.source_digest), held for the parse that
# follows in the same creation: one read of the file instead of two. By path, with the file's identity when read;
# the next read of the path takes them if the file is unchanged since, else reads it again. Files past
# READ_AHEAD_BYTES are read twice rather than held between the two steps.
_READ_AHEAD: dict[str, tuple[tuple, bytes]] = {}
READ_AHEAD_BYTES = 64 << 20


def model_bytes(path: str, keep: bool = False) -> bytes:
    """The bytes of the model file ``path``; ``keep``: held for the next call with the same path (see above)."""
    kept = _READ_AHEAD.pop(path, None)
    if kept is not None:
        try:
            if _identity(os.stat(path)) == kept[0]:
                return kept[1]
        except OSError:
            pass
    with open(path, "rb") as handle:
        identity = _identity(os.fstat(handle.fileno()))  # before the read: a change during it reads again
        data = handle.read()
    if keep and len(data) <= READ_AHEAD_BYTES:
        if len(_READ_AHEAD) >= 4:  # (creations that failed between the two steps: never more than a few)
            _READ_AHEAD.clear()
        _READ_AHEAD[path] = (identity, data)
    return data


def _identity(stat: os.stat_result) -> tuple:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


# A tensor stored outside the model names its file under this key (onnx requires it); bytes without
# it cannot have external data. Up to _SCAN_LIMIT bytes the search is cheaper than onnx's walk over every
# tensor; past it, weights make most of the bytes and the walk is cheaper (measured in 50054a1, dc8afb1).
_EXTERNAL_KEY = b"location"
_SCAN_LIMIT = 1 << 20


def _parse(data: bytes, path: str | None) -> onnx.ModelProto:
    if not data:
        raise ModelContentError(f"model {_label(path)} is empty (0 bytes)")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ModelParseError(
            f"model {_label(path)} is not a valid ONNX protobuf ({type(exc).__name__}: {exc}); the file is "
            f"truncated or not an ONNX model"
        ) from None
    return proto


def _check_header(proto: onnx.ModelProto, path: str | None) -> None:
    if proto.ir_version <= 0 or not proto.HasField("graph"):
        raise ModelContentError(
            f"model {_label(path)} has no ir_version or graph: the bytes parsed, but this is not an ONNX model "
            f"(or it is truncated)"
        )
    if not proto.opset_import and proto.ir_version >= 3:
        raise ModelContentError(f"model {_label(path)} declares no opset_import; re-export it with an opset")


# Initializers with more elements than this are weights, not shapes: shape inference (data propagation
# included) reads the values of shape-like inputs only, so weights reach it as typed graph inputs rather
# than being serialized into its copy of the model (megabytes per session, and > 2 GiB models fail).
SHAPE_VALUE_LIMIT = 1024


def _infer_shapes(proto: onnx.ModelProto) -> tuple[onnx.ModelProto | None, onnx.GraphProto]:
    """(the model as shape inference reads it, without its large initializers; the top-level graph of
    ``proto`` annotated by onnx shape inference: ``value_info``, subgraphs included). When inference
    fails: (None, ``proto.graph``)."""
    light, stand_ins = _without_weights(proto) if _has_weights(proto) else (proto, set())
    inferred = infer_reconciled(light, infer_graph) if _statistics_axes_fit(light) else None
    if inferred is None:
        # Shape inference is an optimization aid: models it cannot handle still run, with shapes
        # resolved at run time (the declared ones unchecked, so not trusted).
        return None, without_declared_shapes(proto.graph)
    if stand_ins:
        inputs = [vi for vi in inferred.input if vi.name not in stand_ins]
        del inferred.input[:]
        inferred.input.extend(inputs)
    return light, inferred


def _statistics_axes_fit(light: onnx.ModelProto) -> bool:
    """Whether onnx can infer the shapes of every LayerNormalization's Mean and InvStdDev outputs: it sizes them
    by ``axis`` unchecked, and an axis outside [-rank, rank) hangs or crashes the process. The ranks come from an
    inference without those outputs; an axis out of range raises ``InvalidGraphError``, an unknown rank gives
    False (the model then runs with its shapes found at run time)."""
    nodes = [n for n in light.graph.node if n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx")
             and len([o for o in n.output[1:] if o])]
    if not nodes:
        return True
    bare = onnx.ModelProto()
    bare.CopyFrom(light)
    for node in bare.graph.node:
        if node.op_type == "LayerNormalization":
            del node.output[1:]
    inferred = infer_graph(bare)
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in (*inferred.input, *inferred.value_info)
             if vi.type.tensor_type.HasField("shape")} if inferred is not None else {}
    for node in nodes:
        rank = ranks.get(node.input[0])
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        if rank is None:
            return False
        if not -rank <= axis < rank:
            raise InvalidGraphError(f"node {node.name!r} (LayerNormalization): axis {axis} is outside [-{rank}, "
                                    f"{rank}) for its input {node.input[0]!r} of rank {rank}; fix the exporter")
    return True


def infer_graph(light: onnx.ModelProto, strict: bool = False) -> onnx.GraphProto | None:
    """``light``'s graph annotated by onnx shape inference (data propagation included), or None when
    inference fails (``strict``: also when a declared type disagrees with the inferred one)."""
    try:
        data_prop = not _generates_large_values(light.graph) and not propagates_large_values(light)
        standing = stand_in_contrib_ops(light)  # com.microsoft nodes seen through standard stand-ins
        return standing.restore(onnx.shape_inference.infer_shapes(standing.model, check_type=False,
                                                                  strict_mode=strict, data_prop=data_prop).graph)
    except Exception:
        return None


# onnx's data propagation computes the 1-D values of the operators below in memory, whatever their size: a
# Range or a 1-D ConstantOfShape of constants asking for 2**40 elements allocates until the process dies (values
# of higher rank are not propagated). Shape values are short; a model with a 1-D generator of more elements
# than this is inferred without data propagation.
_GENERATORS = frozenset({"Range", "ConstantOfShape", "Tile", "Expand"})
_DATA_PROP_ELEMENTS = 1 << 20


def _generates_large_values(graph: onnx.GraphProto) -> bool:
    """Whether a Range, ConstantOfShape, Tile or Expand of constants (initializers, Constant nodes) would
    make a 1-D value of more than ``_DATA_PROP_ELEMENTS`` elements."""
    if not any(node.op_type in _GENERATORS for node in graph.node):
        return False
    constants = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    for node in graph.node:
        if node.op_type not in _GENERATORS or not all(name in constants for name in node.input if name):
            continue
        try:
            arrays = [numpy_helper.to_array(constants[name]) for name in node.input if name]
            values = [a.reshape(-1) for a in arrays]
            if node.op_type == "Range":
                start, limit, delta = (float(v[0]) for v in values[:3])
                count = math.ceil((limit - start) / delta) if delta else 0
            elif node.op_type == "ConstantOfShape":
                count = int(values[0][0]) if values[0].size == 1 else 0
            elif node.op_type == "Tile":
                count = values[0].size * max(int(values[1][0]), 0) if arrays[0].ndim == 1 else 0
            else:  # Expand: 1-D when both the input and the target are
                count = max(values[0].size, int(values[1][0])) if arrays[0].ndim <= 1 and values[1].size == 1 else 0
        except (ValueError, IndexError, OverflowError, TypeError):
            continue  # malformed: inference or the kernel reports it
        if count > _DATA_PROP_ELEMENTS:
            return True
    return False


def _has_weights(proto: onnx.ModelProto) -> bool:
    return any(_element_count(init) > SHAPE_VALUE_LIMIT for init in proto.graph.initializer)


def _without_weights(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, set[str]]:
    """A copy of ``proto`` whose large initializers are typed inputs (the "stand-ins")."""
    light = onnx.ModelProto()
    copy_fields_except(proto, light, skip="graph")
    graph = light.graph
    copy_fields_except(proto.graph, graph, skip="initializer")
    declared = {vi.name for vi in proto.graph.input}
    stand_ins: set[str] = set()
    for init in proto.graph.initializer:
        if _element_count(init) <= SHAPE_VALUE_LIMIT:
            graph.initializer.append(init)
        elif init.name not in declared:
            graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
            stand_ins.add(init.name)
    return light, stand_ins


def _element_count(init: onnx.TensorProto) -> int:
    count = 1
    for dim in init.dims:
        count *= int(dim)
    return count
# -- types ---------------------------------------------------------------------------------------
_DATA_TYPES = {member.value: member for member in DataType}  # a dict lookup: Enum calls are slow per value


def convert_type(tp: onnx.TypeProto) -> TypeInfo:
    which = tp.WhichOneof("value")
    if which == "tensor_type" or which == "sparse_tensor_type":
        tt = getattr(tp, which)
        shape = None
        if tt.HasField("shape"):
            # (A list comprehension, and HasField only where the value reads 0: each protobuf access
            # costs, and value infos are read for every tensor of the graph at session creation.)
            # A negative dim_value (Paddle2ONNX writes -1) is dynamic, as onnxruntime reads it.
            shape = tuple([
                (d.dim_value if d.dim_value > 0 else None) if d.dim_value
                else (0 if d.HasField("dim_value") else (d.dim_param or None)) for d in tt.shape.dim
            ])
        dtype = _DATA_TYPES.get(tt.elem_type)
        return TypeInfo("tensor" if which == "tensor_type" else "sparse_tensor", dtype, shape)
    if which == "sequence_type":
        return TypeInfo("sequence", elem=convert_type(tp.sequence_type.elem_type))
    if which == "optional_type":
        return TypeInfo("optional", elem=convert_type(tp.optional_type.elem_type))
    if which == "map_type":
        return TypeInfo("map", key_dtype=DataType(tp.map_type.key_type), elem=convert_type(tp.map_type.value_type))
    return TypeInfo("unknown")


# Flat tensor types by their serialized bytes: a graph's values repeat a few types, and reading a shape dimension
# by dimension costs most of a value's conversion (plans are decoded at every cached creation and first run).
# Equal bytes are an equal TypeProto; each value still gets a TypeInfo of its own (passes may change one).
TENSOR_TYPES: dict[bytes, tuple] = {}
TENSOR_TYPES_KEPT = 4096


def _value_info(vi: onnx.ValueInfoProto) -> ValueInfo:
    tp = vi.type
    key = tp.SerializeToString()
    known = TENSOR_TYPES.get(key)
    if known is None:
        info = convert_type(tp)
        if info.elem is not None or info.key_dtype is not None:
            return ValueInfo(vi.name, info, vi.doc_string)
        if len(TENSOR_TYPES) >= TENSOR_TYPES_KEPT:
            TENSOR_TYPES.clear()
        TENSOR_TYPES[key] = (info.kind, info.dtype, info.shape)
        return ValueInfo(vi.name, info, vi.doc_string)
    return ValueInfo(vi.name, TypeInfo(*known), vi.doc_string)


# -- attributes ------------------------------------------------------------------------------------
def convert_attribute(attr: onnx.AttributeProto, opsets: dict[str, int], outer_scope) -> object:
    kind = attr.type
    if kind == _ATTR.FLOAT:
        return float(attr.f)
    if kind == _ATTR.INT:
        return int(attr.i)
    if kind == _ATTR.STRING:
        return attr.s.decode("utf-8", errors="surrogateescape")
    if kind == _ATTR.TENSOR:
        return tensor_array(attr.t)
    if kind == _ATTR.SPARSE_TENSOR:
        return _sparse_to_dense(attr.sparse_tensor)
    if kind == _ATTR.GRAPH:
        return convert_graph(attr.g, opsets, outer_scope)
    if kind == _ATTR.TYPE_PROTO:
        return convert_type(attr.tp)
    if kind == _ATTR.FLOATS:
        return list(attr.floats)  # (protobuf's repeated scalars iterate as Python floats and ints)
    if kind == _ATTR.INTS:
        return list(attr.ints)
    if kind == _ATTR.STRINGS:
        return [s.decode("utf-8", errors="surrogateescape") for s in attr.strings]
    if kind == _ATTR.TENSORS:
        return [numpy_helper.to_array(t) for t in attr.tensors]
    if kind == _ATTR.GRAPHS:
        return [convert_graph(g, opsets, outer_scope) for g in attr.graphs]
    if kind == _ATTR.TYPE_PROTOS:
        return [convert_type(t) for t in attr.type_protos]
    if kind == _ATTR.SPARSE_TENSORS:
        return [_sparse_to_dense(t) for t in attr.sparse_tensors]
    raise InvalidGraphError(f"attribute {attr.name!r} has unknown type {kind}")


def _sparse_parts(proto: onnx.ModelProto):
    """The values and indices tensors of every sparse tensor in the model (initializers and attributes,
    subgraphs and functions included)."""
    def of_graph(graph):
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        yield from of_nodes(graph.node)

    def of_nodes(nodes):
        for node in nodes:
            for attr in node.attribute:
                single = [attr.sparse_tensor] if attr.HasField("sparse_tensor") else []
                for sparse in single + list(attr.sparse_tensors):
                    yield sparse.values
                    yield sparse.indices
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    yield from of_graph(sub)

    yield from of_graph(proto.graph)
    for function in proto.functions:
        yield from of_nodes(function.node)


def _sparse_to_dense(sparse: onnx.SparseTensorProto) -> np.ndarray:
    name = sparse.values.name or "(unnamed)"
    if onnx.TensorProto.EXTERNAL in (sparse.values.data_location, sparse.indices.data_location):
        raise ModelLoadError(f"sparse tensor {name!r} keeps its data in an external file, which only a model "
                             "loaded from its path can resolve (next to the model); pass the model's path")
    try:
        values = numpy_helper.to_array(sparse.values).reshape(-1)
        indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    except Exception as exc:
        raise ModelLoadError(f"sparse tensor {name!r} could not be read: {exc}") from exc
    dims = tuple(int(d) for d in sparse.dims)
    size = int(np.prod(dims, dtype=object)) if dims else 1
    count = values.shape[0]
    flat = indices.ndim == 1
    if any(d < 0 for d in dims) or size >= MAX_DECLARED_DIM or (
            indices.shape != ((count,) if flat else (count, len(dims)))) or (
            indices.size and (indices.min() < 0 or (indices.max() >= size if flat
                                                    else (indices >= np.array(dims)).any()))):
        raise InvalidGraphError(
            f"sparse tensor {name!r}: {count} values at indices of shape {indices.shape} do not fit dims "
            f"{list(dims)} (indices must be [NNZ] linear or [NNZ, rank], each within the dims)")
    dense = np.zeros(dims, dtype=values.dtype)
    if flat:  # linearized indices
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return dense


# -- graphs ------------------------------------------------------------------------------------------
# A written optimized model (serialize.py) imports the default domain at one opset, but fusions make standard
# operators of later opsets; those are written in domain LATER_OPSET_DOMAIN + "<opset>", imported at that opset,
# and read back here as standard operators of that opset.
LATER_OPSET_DOMAIN = "ai.onnx_runtime.opset"


def convert_graph(gp: onnx.GraphProto, opsets: dict[str, int], outer_scope, initializer_protos=None,
                  mapped: dict | None = None) -> Graph:
    """Convert one graph; ``outer_scope`` holds the names visible from enclosing graphs.
    ``initializer_protos`` replaces ``gp.initializer`` (the loader's shape-inferred graph lacks the weights);
    ``mapped``: initializers already memory-mapped, by name."""
    initializers: dict[str, np.ndarray] = {}
    for init in gp.initializer if initializer_protos is None else initializer_protos:
        try:
            initializers[init.name] = mapped[init.name] if mapped and init.name in mapped \
                else tensor_array(init)
        except Exception as exc:
            raise ModelLoadError(f"initializer {init.name!r} could not be read: {exc}") from exc
    for sparse in gp.sparse_initializer:
        initializers[sparse.values.name] = _sparse_to_dense(sparse)

    value_info: dict[str, ValueInfo] = {}
    for vi in list(gp.value_info) + list(gp.input) + list(gp.output):
        value_info[vi.name] = _value_info(vi)
    for name, array in initializers.items():
        if name not in value_info:
            value_info[name] = ValueInfo(name, TypeInfo("tensor", _dtype_of(array), tuple(array.shape)))

    inputs = [_value_info(vi) for vi in gp.input if vi.name not in initializers]
    outputs = [_value_info(vi) for vi in gp.output]

    scope = None  # the names a subgraph may read from here: built at the first node that has one

    nodes = []
    for index, np_node in enumerate(gp.node):
        if scope is None and any(a.type in _SUBGRAPH_KINDS for a in np_node.attribute):
            scope = _scope(gp, initializers, outer_scope)
        nodes.append(convert_node(np_node, index, opsets, scope))

    graph = Graph(
        name=gp.name, nodes=nodes, inputs=inputs, outputs=outputs, initializers=initializers,
        value_info=value_info, opsets=opsets, doc=gp.doc_string,
    )
    graph.nodes = topological_order(graph, set(outer_scope))
    graph.outer_names = sorted(outer_reads(graph, set(outer_scope))) if outer_scope else []
    return graph


_SUBGRAPH_KINDS = (_ATTR.GRAPH, _ATTR.GRAPHS)


def convert_node(np_node: onnx.NodeProto, index: int, opsets: dict[str, int], scope) -> Node:
    """One node of a graph (its ``index`` there names a node without a name); ``scope``: the names its subgraphs
    may read from the enclosing graphs (None where it has none)."""
    domain = "" if np_node.domain == "ai.onnx" else np_node.domain
    attrs = {a.name: convert_attribute(a, opsets, scope) for a in np_node.attribute}
    if domain not in opsets and domain != "":
        raise InvalidGraphError(
            f"node {np_node.name or index!r} ({np_node.op_type}) uses domain {domain!r}, which the model "
            f"does not import; add an opset_import for it"
        )
    opset = opsets.get(domain, 0)
    if domain.startswith(LATER_OPSET_DOMAIN):
        domain = ""  # a standard operator at the later opset this domain is imported at (serialize.py)
    node_inputs = list(np_node.input)
    while node_inputs and not node_inputs[-1]:  # trailing empty names are left-out optionals: no argument
        node_inputs.pop()
    return Node(
        op_type=np_node.op_type, inputs=node_inputs, outputs=list(np_node.output),
        name=np_node.name or f"{np_node.op_type}_{index}", domain=domain, attrs=attrs,
        opset=opset, doc=np_node.doc_string, proto=np_node,
    )


def _scope(gp: onnx.GraphProto, initializers, outer_scope) -> tuple[str, ...]:
    """The outer scope of ``gp``'s subgraphs: everything visible here, enclosing graphs included."""
    local = set(initializers) | {vi.name for vi in gp.input}
    for node in gp.node:
        local.update(o for o in node.output if o)
    return tuple(outer_scope) + tuple(local)


def _dtype_of(array: np.ndarray) -> DataType | None:
    try:
        return DataType.from_numpy(array.dtype)
    except Exception:
        return None


def implicit_inputs(node: Node) -> list[str]:
    """Outer-scope values a node's subgraphs read (they order the node after their producers)."""
    names: list[str] = []
    for sub in node.subgraphs():
        names.extend(n for n in sub.outer_names if n not in names)
    return names


def outer_reads(graph: Graph, outer: set[str]) -> set[str]:
    defined = set(graph.initializers) | {vi.name for vi in graph.inputs}
    reads: set[str] = set()
    for node in graph.nodes:
        for name in list(node.inputs) + implicit_inputs(node):
            if name and name not in defined and name in outer:
                reads.add(name)
        defined.update(o for o in node.outputs if o)
    for out in graph.outputs:
        if out.name not in defined and out.name in outer:
            reads.add(out.name)
    return reads


def topological_order(graph: Graph, outer: set[str]) -> list[Node]:
    """Nodes in dependency order (stable: ties keep file order); rejects cycles and undefined inputs."""
    inputs = {vi.name for vi in graph.inputs}
    available = set(graph.initializers) | inputs | outer | {""}
    producer: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for out in node.outputs:
            if not out:
                continue
            if out in producer or out in graph.initializers or out in inputs:
                raise InvalidGraphError(
                    f"value {out!r} is produced by more than one node (second: {node.name!r}); ONNX graphs are SSA"
                )
            producer[out] = index
    if _in_order(graph, producer, available):  # the usual case (exporters, our plans): no reordering to do
        return list(graph.nodes)
    waiting = [0] * len(graph.nodes)
    dependents: list[list[int]] = [[] for _ in graph.nodes]
    for index, node in enumerate(graph.nodes):
        for name in set(node.inputs) | set(implicit_inputs(node)):
            if name in available and name not in producer:
                continue
            if name not in producer:
                raise InvalidGraphError(
                    f"node {node.name!r} ({node.op_type}) reads {name!r}, which no node, input or initializer defines"
                )
            waiting[index] += 1
            dependents[producer[name]].append(index)
    order: list[int] = []
    heap = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(heap)
    while heap:
        index = heapq.heappop(heap)
        order.append(index)
        for dep in dependents[index]:
            waiting[dep] -= 1
            if waiting[dep] == 0:
                heapq.heappush(heap, dep)
    if len(order) != len(graph.nodes):
        stuck = [graph.nodes[i].name for i in range(len(graph.nodes)) if waiting[i] > 0][:5]
        raise InvalidGraphError(f"graph {graph.name!r} has a cycle through nodes {stuck}")
    for output in graph.outputs:
        if output.name not in producer and output.name not in available:
            raise InvalidGraphError(f"graph output {output.name!r} is not produced by any node, input or initializer")
    return [graph.nodes[i] for i in order]


def _in_order(graph: Graph, producer: dict[str, int], available: set[str]) -> bool:
    """Whether every node reads only values defined before it and every graph output is defined: then the
    stable order topological_order would make is the file order (its smallest ready index is always the next
    node). Anything else (a later producer, a cycle, an undefined name) is left to it, which names the fault."""
    for index, node in enumerate(graph.nodes):
        for name in node.inputs:
            made = producer.get(name)
            if made is None:
                if name not in available:
                    return False
            elif made >= index:
                return False
        if node.attrs:
            for name in implicit_inputs(node):
                made = producer.get(name)
                if (made is None and name not in available) or (made is not None and made >= index):
                    return False
    return all(out.name in producer or out.name in available for out in graph.outputs)
