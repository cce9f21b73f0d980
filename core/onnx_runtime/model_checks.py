"""Structural checks a model passes before anything trusts it.

onnx's shape inference, constant folding and function expansion all read the model as written: a required
input left empty crashes the process inside onnx's shape inference (a C++ null dereference), a model-local
function that calls itself expands forever, and a declared dimension in the quintillions sends data
propagation after memory it can never get. ``onnx.checker`` catches these but also refuses models that
onnxruntime runs (nodes out of topological order, as onnxruntime's float16 converter writes them;
onnxruntime's own operators in the default domain, as its transformer optimizer writes them), so this
module checks only what would be unsafe to hand on, against the operator schemas where one exists:

- the opsets of onnx's domains among the versions onnx defines, and names that are UTF-8 text;
- every node's input and output counts within its schema's (and Split's num_outputs, Scan's num_scan_inputs),
  no required input left empty, and every value defined once;
- every attribute of the type its schema declares, and every required one present;
- model-local functions free of call cycles, and each graph's nodes free of cycles (a node reading its own output);
- declared dimensions (graph inputs, outputs, value_info) below ``MAX_DECLARED_DIM`` (a negative one is dynamic),
  and declared element types defined ones;
- after shape inference (:func:`check_types`), each node input's element type among those its schema allows, and
  the inputs that share a type parameter of one type (a float32 + int64 Add is refused, as onnxruntime does).

Operators without a schema (custom domains, onnxruntime's contrib operators) pass; placement reports
later whether a provider runs them.
"""

from __future__ import annotations

import functools
import math
import re

import onnx
from onnx import defs

from .errors import InvalidGraphError
from .proto_walk import node_subgraphs
from .records import FrozenRecord

# Far above any tensor a process can hold (2**40 float32 elements are 4 TiB), far below where a product of
# a few such dimensions overflows int64.
MAX_DECLARED_DIM = 2**40

_SINGLE = defs.OpSchema.FormalParameterOption.Single


class _Rules(FrozenRecord):
    """What a schema allows, read once per operator version (reading a schema's fields builds new objects)."""

    __slots__ = __match_args__ = ("inputs", "outputs", "required", "attributes", "required_attributes", "since",
                                  "variadic")
    inputs: tuple[int, int]
    outputs: tuple[int, int]
    required: tuple[tuple[bool, str], ...]  # per formal input: required (Single), name; the last repeats
    attributes: dict[str, int]
    required_attributes: frozenset[str]
    since: int
    variadic: bool  # the last formal input repeats (Max, Concat, Sum): none of its names may be left empty

    def __init__(self,
                 inputs: tuple[int, int], outputs: tuple[int, int], required: tuple[tuple[bool, str], ...],
                 attributes: dict[str, int], required_attributes: frozenset[str], since: int, variadic: bool) -> None:
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "outputs", outputs)
        object.__setattr__(self, "required", required)
        object.__setattr__(self, "attributes", attributes)
        object.__setattr__(self, "required_attributes", required_attributes)
        object.__setattr__(self, "since", since)
        object.__setattr__(self, "variadic", variadic)


@functools.lru_cache(maxsize=4096)
def _rules(op_type: str, domain: str, version: int) -> _Rules | None:
    try:
        schema = defs.get_schema(op_type, version, domain)
    except defs.SchemaError:
        return None
    return _Rules((schema.min_input, schema.max_input), (schema.min_output, schema.max_output),
                  tuple((p.option == _SINGLE, p.name) for p in schema.inputs),
                  {name: int(a.type) for name, a in schema.attributes.items()},  # type: ignore[call-overload]
                  frozenset(name for name, a in schema.attributes.items() if a.required), schema.since_version,
                  bool(schema.inputs) and schema.inputs[-1].option == defs.OpSchema.FormalParameterOption.Variadic)


def _node_label(node: onnx.NodeProto) -> str:
    return f"node {node.name!r} ({node.op_type})" if node.name else f"a {node.op_type} node"


def _given(names) -> int:
    count = len(names)
    while count and not names[count - 1]:
        count -= 1
    return count


def _check_text(node: onnx.NodeProto, where: str) -> None:
    """protobuf hands string fields that are not UTF-8 over as bytes, which no name lookup expects."""
    for field, value in (("op_type", node.op_type), ("domain", node.domain), ("name", node.name),
                         *(("input", n) for n in node.input), *(("output", n) for n in node.output)):
        if not isinstance(value, str):
            raise InvalidGraphError(f"a node in {where} has a {field} that is not UTF-8 text ({value[:40]!r}); "
                                    "the file is damaged or was not written by an ONNX exporter")


def _check_node(node: onnx.NodeProto, opsets: dict[str, int], where: str) -> None:
    _check_text(node, where)
    for attr in node.attribute:  # with or without a schema: the loader converts every tensor attribute
        for tensor in ([attr.t] if attr.type == onnx.AttributeProto.TENSOR else attr.tensors):
            _check_tensor(tensor, f"{_node_label(node)} in {where}: attribute {attr.name!r}'s tensor",
                          "the file is damaged or its exporter wrote an inconsistent tensor")
    domain = "" if node.domain == "ai.onnx" else node.domain
    version = opsets.get(domain)
    rules = _rules(node.op_type, domain, version) if version is not None else None
    if rules is None:
        _check_attribute_types_any_version(node, domain, where)
        return
    fix = f"the fix is in the model's exporter (schema: {node.op_type}, opset {rules.since})"
    if rules.required and "" in node.input:
        for i, name in enumerate(node.input[:len(rules.required)]):  # past the formals: only a variadic's
            required, formal = rules.required[i]
            if name == "" and required:
                raise InvalidGraphError(f"{_node_label(node)} in {where}: input {i} ({formal}) is required but "
                                        f"named ''; connect it to a value; {fix}")
    if rules.variadic and "" in node.input[len(rules.required) - 1:_given(node.input)]:
        first = node.input[:_given(node.input)].index("", len(rules.required) - 1)
        raise InvalidGraphError(f"{_node_label(node)} in {where}: input {first} of its variadic "
                                f"{rules.required[-1][1]!r} is named ''; a variadic input takes values only: "
                                f"connect it or drop it; {fix}")
    # Trailing empty names are optional inputs or outputs left out: they do not count.
    for kind, count, (low, high) in (("inputs", _given(node.input), rules.inputs),
                                     ("outputs", _given(node.output), rules.outputs)):
        if not low <= count <= high:
            raise InvalidGraphError(f"{_node_label(node)} in {where} has {count} {kind}; its schema takes {low} "
                                    f"to {high}; {fix}")
    _check_attributes(node, rules, where, fix)
    _check_attribute_values(node, domain, where, fix)


def _check_attribute_values(node: onnx.NodeProto, domain: str, where: str, fix: str) -> None:
    """Attributes that count a node's inputs or outputs, which onnx's shape inference indexes by unchecked (a Split
    with more outputs than num_outputs aborts the process) and kernels allocate by; and the attributes that name
    an element type (Cast's ``to``, the generators' ``dtype``), which the optimizer compares with value types."""
    if domain:
        return
    for attr in node.attribute:
        if attr.name in ("to", "dtype") and attr.type in (onnx.AttributeProto.INT, onnx.AttributeProto.STRING):
            _check_element_type_attribute(node, attr, where, fix)
        if node.op_type == "Einsum" and attr.name == "equation" and not _EINSUM.match(attr.s.decode(errors="replace")):
            # onnx's Einsum inference loops forever on some malformed equations ("...\x07i ->(..i").
            raise InvalidGraphError(f"{_node_label(node)} in {where}: equation {attr.s!r} is not an einsum equation "
                                    f"(comma-separated terms of letters, one '...' at most each, optional '->' and "
                                    f"output term); {fix}")
    if node.op_type not in ("Split", "Scan", "GatherND"):
        return
    counts = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
    if node.op_type == "GatherND" and counts.get("batch_dims", 0) < 0:  # onnx's inference indexes by it: a segfault
        raise InvalidGraphError(f"{_node_label(node)} in {where}: batch_dims is {counts['batch_dims']}; it counts "
                                f"leading dimensions and must be >= 0; {fix}")
    # onnx's Split inference indexes every output slot, trailing empty names included: they count here.
    if node.op_type == "Split" and "num_outputs" in counts and counts["num_outputs"] != len(node.output):
        raise InvalidGraphError(f"{_node_label(node)} in {where} has {len(node.output)} outputs (empty names "
                                f"included) but num_outputs {counts['num_outputs']}; drop the empty names or set "
                                f"num_outputs to the output count; {fix}")
    if node.op_type == "Scan" and not 1 <= counts.get("num_scan_inputs", 1) <= len(node.input):
        raise InvalidGraphError(f"{_node_label(node)} in {where}: num_scan_inputs {counts['num_scan_inputs']} is not "
                                f"in [1, {len(node.input)}] (its input count); {fix}")


_EINSUM_TERM = r"[A-Za-z]*(?:\.\.\.[A-Za-z]*)?"
_EINSUM = re.compile(rf"^ *{_EINSUM_TERM}(?: *, *{_EINSUM_TERM})* *(?:-> *{_EINSUM_TERM} *)?$")


def _check_element_type_attribute(node: onnx.NodeProto, attr: onnx.AttributeProto, where: str, fix: str) -> None:
    # Cast before opset 6 names the type as a string ("FLOAT"); later versions and the generators by its number.
    if attr.type == onnx.AttributeProto.STRING:
        name = attr.s.decode("utf-8", errors="replace")
        valid = name in onnx.TensorProto.DataType.keys() and name != "UNDEFINED"
    else:
        name, valid = str(attr.i), attr.i in _ELEMENT_TYPES and attr.i != onnx.TensorProto.UNDEFINED
    if not valid:
        raise InvalidGraphError(f"{_node_label(node)} in {where}: attribute {attr.name!r} is {name!r}, which names no "
                                f"ONNX element type (TensorProto.DataType: FLOAT, INT64, ...); {fix}")


def _check_attributes(node: onnx.NodeProto, rules: _Rules, where: str, fix: str) -> None:
    if rules.required_attributes:
        missing = rules.required_attributes.difference(attr.name for attr in node.attribute)
        if missing:
            raise InvalidGraphError(f"{_node_label(node)} in {where} lacks the required attribute(s) "
                                    f"{', '.join(sorted(missing))}; {fix}")
    for attr in node.attribute:
        expected = rules.attributes.get(attr.name)
        if expected is None:  # onnx's checker and onnxruntime refuse it too; kernels of other versions read it
            raise InvalidGraphError(f"{_node_label(node)} in {where} has attribute {attr.name!r}, which its schema "
                                    f"does not define (it defines {', '.join(sorted(rules.attributes)) or 'none'}); "
                                    f"{fix}")
        if expected is not None and attr.type != onnx.AttributeProto.UNDEFINED and attr.type != expected:
            raise InvalidGraphError(
                f"{_node_label(node)} in {where}: attribute {attr.name!r} is "
                f"{onnx.AttributeProto.AttributeType.Name(attr.type)}; its schema declares "
                f"{onnx.AttributeProto.AttributeType.Name(expected)}; {fix}")


@functools.lru_cache(maxsize=1024)
def _newest_attribute_types(op_type: str, domain: str) -> dict[str, int]:
    try:
        schema = defs.get_schema(op_type, domain)
    except defs.SchemaError:
        return {}
    return {name: int(a.type) for name, a in schema.attributes.items()}  # type: ignore[call-overload]


def _check_attribute_types_any_version(node: onnx.NodeProto, domain: str, where: str) -> None:
    """An operator run outside the opsets that define it (onnx's own light models use ConstantOfShape at opset
    7) still reads its attributes as its schema types them: one typed otherwise reached a kernel or a pass as the
    wrong kind (a STRING ``value`` holding a tensor)."""
    expected_types = _newest_attribute_types(node.op_type, domain)
    for attr in node.attribute:
        expected = expected_types.get(attr.name)
        if expected is not None and attr.type != onnx.AttributeProto.UNDEFINED and attr.type != expected:
            raise InvalidGraphError(
                f"{_node_label(node)} in {where}: attribute {attr.name!r} is "
                f"{onnx.AttributeProto.AttributeType.Name(attr.type)}; its schema declares "
                f"{onnx.AttributeProto.AttributeType.Name(expected)}; the fix is in the model's exporter")


def _check_tensor(tensor: onnx.TensorProto, what: str, fix: str) -> None:
    if tensor.data_type == onnx.TensorProto.UNDEFINED or tensor.data_type not in _ELEMENT_TYPES:
        raise InvalidGraphError(f"{what} has element type {tensor.data_type}, which is no ONNX type (expected one "
                                f"of TensorProto.DataType); {fix}")
    stored, declared = _stored_elements(tensor), math.prod(tensor.dims)
    if stored is not None and stored != declared:
        raise InvalidGraphError(f"{what} declares dims {list(tensor.dims)} ({declared} elements) but holds "
                                f"{stored}; {fix}")


_ELEMENT_TYPES = frozenset(onnx.TensorProto.DataType.values())


def _check_initializers(graph: onnx.GraphProto, where: str) -> None:
    """Each initializer of a defined element type, and the type and shape its graph input declares: kernels get
    the initializer's data, so a declaration that disagrees would type-check (and fold ``Shape`` from) what never
    runs. A symbolic or missing dimension matches any size (onnxruntime refuses the same mismatches)."""
    declared = {vi.name: vi.type.tensor_type for vi in graph.input if vi.type.HasField("tensor_type")}
    fix = "the file is damaged or its exporter wrote inconsistent types"
    for init in graph.initializer:
        _check_tensor(init, f"initializer {init.name!r} in {where}", fix)
        tensor_type = declared.get(init.name)
        if tensor_type is None:
            continue
        if tensor_type.elem_type and tensor_type.elem_type != init.data_type:
            raise InvalidGraphError(
                f"initializer {init.name!r} in {where} is {onnx.TensorProto.DataType.Name(init.data_type)} but the "
                f"graph input of that name declares {_type_string(tensor_type.elem_type)}; {fix}")
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if tensor_type.HasField("shape") and (len(dims) != len(init.dims) or any(
                d is not None and d != actual for d, actual in zip(dims, init.dims))):
            shown = [d if d is not None else "?" for d in dims]
            raise InvalidGraphError(
                f"initializer {init.name!r} in {where} has shape {list(init.dims)} but the graph input of that name "
                f"declares {shown}; {fix}")


# Element types whose elements fill whole bytes in raw_data and one entry each in their typed field.
_WHOLE: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float_data", onnx.TensorProto.DOUBLE: "double_data",
    onnx.TensorProto.INT64: "int64_data", onnx.TensorProto.UINT64: "uint64_data",
    onnx.TensorProto.INT32: "int32_data", onnx.TensorProto.INT16: "int32_data",
    onnx.TensorProto.INT8: "int32_data", onnx.TensorProto.UINT8: "int32_data",
    onnx.TensorProto.UINT16: "int32_data", onnx.TensorProto.BOOL: "int32_data",
    onnx.TensorProto.FLOAT16: "int32_data", onnx.TensorProto.BFLOAT16: "int32_data",
    onnx.TensorProto.UINT32: "uint64_data", onnx.TensorProto.STRING: "string_data"}


def _stored_elements(tensor: onnx.TensorProto) -> int | None:
    """How many elements ``tensor`` holds in the file (None: external, or a type packed below a byte): a
    declared shape that disagrees sizes every value computed from it (onnx inference took ranks of a million
    from one such weight) and fails only at conversion."""
    field = _WHOLE.get(tensor.data_type)
    if field is None or tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None
    if tensor.HasField("raw_data") and field != "string_data":
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        return len(tensor.raw_data) // itemsize if len(tensor.raw_data) % itemsize == 0 else -1
    return len(getattr(tensor, field))


def _check_dims(values, where: str) -> None:
    for vi in values:
        tensor = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if tensor is None or not tensor.HasField("shape"):
            continue
        for axis, dim in enumerate(tensor.shape.dim):
            # A negative dim_value (Paddle2ONNX writes -1) is a dynamic dimension, as onnxruntime reads it.
            if dim.HasField("dim_value") and dim.dim_value >= MAX_DECLARED_DIM:
                raise InvalidGraphError(
                    f"value {vi.name!r} in {where} declares dimension {axis} as {dim.dim_value}; a dimension must be "
                    f"below {MAX_DECLARED_DIM}; declare it symbolic (a dim_param) or fix the exporter")


def _check_element_types(values, where: str) -> None:
    """Each declared tensor type (inside sequences, optionals and maps too) names an ONNX element type: an
    UNDEFINED one let a feed or folded value of any kind through unchecked (a raw TensorProto reached Cast), and
    onnxruntime refuses it at load."""
    for vi in values:
        tp, container = vi.type, None
        while tp is not None:
            kind = tp.WhichOneof("value")
            if kind is None and container is not None:
                # a sequence of nothing let any feed through unchecked (a list of raw TensorProtos reached Cast)
                raise InvalidGraphError(
                    f"value {vi.name!r} in {where} declares a {container} without the type of its elements; "
                    f"declare the element type or drop the declaration")
            if kind in ("tensor_type", "sparse_tensor_type"):
                elem_type = getattr(tp, kind).elem_type
                if elem_type == onnx.TensorProto.UNDEFINED or elem_type not in _ELEMENT_TYPES:
                    raise InvalidGraphError(
                        f"value {vi.name!r} in {where} declares element type {elem_type}, which is no ONNX type "
                        f"(expected one of TensorProto.DataType); declare its type or drop the declaration")
            tp = {"sequence_type": lambda t: t.sequence_type.elem_type,
                  "optional_type": lambda t: t.optional_type.elem_type,
                  "map_type": lambda t: t.map_type.value_type}.get(kind or "", lambda t: None)(tp)
            container = (kind or "").removesuffix("_type")


def _check_graph(graph: onnx.GraphProto, opsets: dict[str, int], where: str, top_level: bool = False) -> None:
    _check_dims([*graph.input, *graph.output, *graph.value_info], where)
    _check_element_types([*graph.input, *graph.output, *graph.value_info], where)
    _check_initializers(graph, where)
    defined: dict[str, str | None] = dict.fromkeys([vi.name for vi in graph.input] +
                                                   [init.name for init in graph.initializer] +
                                                   [sparse.values.name for sparse in graph.sparse_initializer])
    for node in graph.node:
        _check_node(node, opsets, where)
        for name in node.output:
            if name in defined:  # one definition per value (SSA): shape inference and the IR key values by name
                first = defined[name]
                problem = (f"is produced by more than one node ({first}, then {_node_label(node)})" if first else
                           f"is a graph input or initializer and also produced by {_node_label(node)}")
                raise InvalidGraphError(f"value {name!r} in {where} {problem}; ONNX graphs are SSA: rename one")
            if name:
                defined[name] = _node_label(node)
        for body in node_subgraphs(node):
            _check_graph(body, opsets, f"a subgraph of {_node_label(node)} in {where}")
    _check_acyclic(graph, where)
    if top_level:  # a subgraph may read its enclosing graphs' values: only the top level's reads are all local
        _check_reads(graph, defined, where)


def _check_acyclic(graph: onnx.GraphProto, where: str) -> None:
    """The graph's nodes can be ordered so that each reads only values defined before it: onnx's shape inference
    dereferences the type of a value read before it is produced (a node reading its own output crashed the
    process). Nodes may be listed out of order; reads of enclosing graphs' values are not edges here."""
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output if name}
    readers: list[list[int]] = [[] for _ in graph.node]
    waiting = [0] * len(graph.node)
    for index, node in enumerate(graph.node):
        for source in {producer[name] for name in node.input if name in producer}:
            readers[source].append(index)
            waiting[index] += 1
    ready = [index for index, count in enumerate(waiting) if count == 0]
    for index in ready:  # (grows while it is walked: Kahn's order)
        for reader in readers[index]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
    if len(ready) < len(graph.node):
        # walk back through producers that are themselves stuck until one repeats: that stretch is a cycle
        path = [next(index for index, count in enumerate(waiting) if count)]
        while path.count(path[-1]) < 2:
            path.append(next(producer[name] for name in graph.node[path[-1]].input
                             if name in producer and waiting[producer[name]]))
        cycle = path[path.index(path[-1]):][::-1]
        names = " -> ".join(_node_label(graph.node[index]) for index in cycle)
        raise InvalidGraphError(f"{_node_label(graph.node[cycle[0]])} in {where} depends on its own output through "
                                f"a cycle of nodes ({names}); ONNX graphs are acyclic: feed it from a graph input, "
                                f"an initializer or an earlier node")


def _check_reads(graph: onnx.GraphProto, defined: dict, where: str) -> None:
    """Every input a top-level node reads is a graph input, an initializer (dense or sparse) or some node's output
    (nodes may be out of order): onnx's shape inference dereferences the type of an undefined one (a LabelEncoder
    whose graph input lost its name crashed the process)."""
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                raise InvalidGraphError(f"{_node_label(node)} in {where} reads {name!r}, which no graph input, "
                                        f"initializer or node defines; connect it or declare it as an input")


def _check_function_cycles(functions) -> None:
    local = {(f.domain, f.name): f for f in functions}
    calls = {key: {(n.domain, n.op_type) for n in f.node if (n.domain, n.op_type) in local}
             for key, f in local.items()}
    state: dict[tuple[str, str], int] = {}  # 1: on the current call path, 2: finished

    def visit(path):
        state[path[-1]] = 1
        for callee in sorted(calls[path[-1]]):
            if state.get(callee) == 1:
                cycle = " -> ".join(f"{d}::{n}" for d, n in [*path[path.index(callee):], callee])
                raise InvalidGraphError(f"model-local functions call each other in a cycle ({cycle}); a function "
                                        "cannot expand into itself: inline or break the recursion in the exporter")
            if callee not in state:
                visit([*path, callee])
        state[path[-1]] = 2

    for key in sorted(local):
        if key not in state:
            visit([key])


@functools.lru_cache(maxsize=1)
def _latest_opsets() -> dict[str, int]:
    """The newest version of each domain onnx defines operators in: onnx's registry keeps the map (microseconds);
    reading it from every schema cost a fresh process's first session creation 40-140 ms."""
    version_map = getattr(defs.C, "schema_version_map", None)
    if version_map is not None:
        return {domain: int(high) for domain, (_, high) in version_map().items()}
    latest: dict[str, int] = {}
    for schema in defs.get_all_schemas():
        latest[schema.domain] = max(latest.get(schema.domain, 1), schema.since_version)
    latest[""] = max(latest.get("", 1), defs.onnx_opset_version())
    return latest


def _check_opsets(opsets: dict[str, int], label: str) -> None:
    """An opset of an onnx domain outside [1, the newest onnx defines] names no schema: nothing it holds can be
    checked or run as written."""
    latest = _latest_opsets()
    for domain, version in opsets.items():
        newest = latest.get(domain)
        if newest is not None and not 1 <= version <= newest:
            raise InvalidGraphError(f"model {label} imports opset {version} of domain {domain or 'ai.onnx'!r}; "
                                    f"the versions defined are 1 to {newest}: re-export it at a released opset")


def check_model_structure(proto: onnx.ModelProto, label: str) -> None:
    """Raise ``InvalidGraphError`` naming the node, value or function and the rule, for what this module
    checks (see the module docstring)."""
    opsets = {("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in proto.opset_import}
    _check_opsets(opsets, label)
    _check_function_cycles(proto.functions)
    for vi in proto.graph.input:  # the IR requires them typed: a feed is checked against the type, kernels rely on it
        if vi.type.WhichOneof("value") is None:
            raise InvalidGraphError(f"graph input {vi.name!r} of model {label} has no type; the ONNX IR requires one "
                                    f"for the top-level graph's inputs: declare it")
    _check_graph(proto.graph, opsets, f"model {label}", top_level=True)
    for function in proto.functions:
        inner = dict(opsets)
        inner.update({("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in function.opset_import})
        for node in function.node:
            _check_node(node, inner, f"function {function.domain}::{function.name}")


@functools.lru_cache(maxsize=4096)
def _input_types(op_type: str, domain: str, version: int):
    """Per formal input: (allowed type strings, the type parameter when inputs share it); None without a schema."""
    try:
        schema = defs.get_schema(op_type, version, domain)
    except defs.SchemaError:
        return None
    allowed = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    return tuple((allowed.get(p.type_str, frozenset({p.type_str})),
                  p.type_str if p.type_str in allowed and p.is_homogeneous else None) for p in schema.inputs)


@functools.lru_cache(maxsize=4096)
def _output_params(op_type: str, domain: str, version: int) -> tuple[str | None, ...]:
    """Per formal output: the type parameter it shares with the inputs (None when its type comes from elsewhere)."""
    try:
        schema = defs.get_schema(op_type, version, domain)
    except defs.SchemaError:
        return ()
    params = {c.type_param_str for c in schema.type_constraints}
    return tuple(p.type_str if p.type_str in params and p.is_homogeneous else None for p in schema.outputs)


def _type_string(elem_type: int) -> str:
    try:
        return f"tensor({onnx.TensorProto.DataType.Name(elem_type).lower()})"
    except ValueError:  # a number no ONNX type has: allowed by no schema
        return f"tensor(undefined type {elem_type})"


# The domains whose schemas onnx defines, so whose type constraints hold for every implementation (contrib
# operators' schemas live in onnxruntime, not here).
_TYPED_DOMAINS = frozenset({"", "ai.onnx.ml", "ai.onnx.preview", "ai.onnx.preview.training"})


def check_types(graph: onnx.GraphProto, opsets: dict[str, int], label: str) -> None:
    """Raise ``InvalidGraphError`` for a node of ``graph`` (shape-inferred) fed an element type its schema does not
    allow, or inputs of one type parameter of different types. Values of unknown type pass. A node output that
    shares a type parameter with the node's inputs takes their type, over a declared one: when shape inference
    failed, a string graph input reached LogSoftmax through Reshape and Transpose unchecked, and a stale
    declaration is not what the kernel receives. Subgraphs are checked too, seeing their enclosing graphs' values
    (a float fed to a Reshape's shape inside a Scan body reached the kernel)."""
    _check_graph_types(graph, opsets, label, {})


def _declared_types(graph: onnx.GraphProto, outer: dict[str, str]) -> dict[str, str]:
    """The type strings ``graph`` declares (initializers first), over its enclosing graphs' (which it shadows)."""
    known: dict[str, str] = {init.name: _type_string(init.data_type) for init in graph.initializer}
    for vi in (*graph.input, *graph.value_info, *graph.output):
        given = _value_type_string(vi.type)
        if given is not None and vi.name not in known:
            known[vi.name] = given
    return {**outer, **known}


def _check_graph_types(graph: onnx.GraphProto, opsets: dict[str, int], label: str, outer: dict[str, str]) -> None:
    known = _declared_types(graph, outer)
    for node in graph.node:
        for body in node_subgraphs(node):
            _check_graph_types(body, opsets, label, known)
        domain = "" if node.domain == "ai.onnx" else node.domain
        version = opsets.get(domain)
        formals = _input_types(node.op_type, domain, version) if version is not None and domain in _TYPED_DOMAINS \
            else None
        if not formals:
            continue
        bound = _check_node_types(node, formals, known, label)
        outputs = _output_params(node.op_type, domain, version)
        for j, name in enumerate(node.output):
            param = outputs[min(j, len(outputs) - 1)] if outputs and name else None
            if param is not None and param in bound:
                known[name] = bound[param][0]


def _check_node_types(node: onnx.NodeProto, formals, known: dict[str, str], label: str) -> dict[str, tuple[str, int]]:
    """Check ``node``'s inputs of known type against its schema's ``formals``; the types its parameters bind."""
    bound: dict[str, tuple[str, int]] = {}
    for i, name in enumerate(node.input):
        if not name or name not in known:
            continue
        allowed, param = formals[min(i, len(formals) - 1)]
        given = known[name]
        # Another precision of a float the schema takes is left to placement: a provider may implement it
        # (bfloat16 on CUDA), and one that does not declines the node with its reason.
        if given not in allowed and not (_is_float(given) and any(_is_float(t) for t in allowed)):
            raise InvalidGraphError(f"{_node_label(node)} in model {label}: input {i} ({name!r}) is {given}; its "
                                    f"schema allows {', '.join(sorted(allowed))}; cast it in the exporter")
        if param is not None:
            first = bound.setdefault(param, (given, i))
            if first[0] != given:
                raise InvalidGraphError(
                    f"{_node_label(node)} in model {label}: inputs {first[1]} and {i} share type {param} but are "
                    f"{first[0]} and {given}; cast one of them in the exporter")
    return bound


def _value_type_string(tp: onnx.TypeProto) -> str | None:
    """``tp`` as a schema writes types ("tensor(float)", "seq(tensor(int64))"); None where it says too little."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        return _type_string(tp.tensor_type.elem_type) if tp.tensor_type.elem_type else None
    if kind == "sparse_tensor_type":  # no schema's tensor parameter allows it (onnxruntime refuses it the same way)
        elem_type = tp.sparse_tensor_type.elem_type
        return f"sparse_{_type_string(elem_type)}" if elem_type else None
    inner_type = {"sequence_type": lambda: tp.sequence_type.elem_type,
                  "optional_type": lambda: tp.optional_type.elem_type}.get(kind or "")
    if inner_type is None:
        return None
    inner = _value_type_string(inner_type())
    return None if inner is None else f"{'seq' if kind == 'sequence_type' else 'optional'}({inner})"


def _is_float(type_string: str) -> bool:
    return type_string.startswith(("tensor(float", "tensor(bfloat", "tensor(double"))
