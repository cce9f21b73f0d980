"""The model's declared value types checked against onnx shape inference, before anything trusts them.

A model's ``value_info`` (and its outputs' types) are claims its writer made. onnx's inference keeps such a
claim when its own result disagrees (outside strict mode it drops the error), and the session then trusts it:
``Shape`` of a value whose declared shape is stale folded to the wrong numbers, a ``Reshape`` to the declared
shape was removed as a no-op, and kernels were built for shapes that never come.

Inference therefore runs strict first: on a consistent model (every zoo model, all but one of onnx's 1,884
node cases) that is the only pass, and its result is the same as a lenient one. When it fails, inference runs
again on a copy without the intermediate declarations (``value_info``, in subgraphs too) and without the
outputs' shapes, and the declarations are merged back as onnxruntime merges them leniently: a dimension
inference computed wins over the declared one, a dimension inference could not compute keeps the declared one
(nothing can check it before the run, as in onnxruntime), and a declared element type that differs from the
computed one is an ``InvalidGraphError`` (onnxruntime's type error).

A declared shape for an output of an ONNX or com.microsoft node inference cannot compute (no schema for its
opset, no contrib stand-in) is checked by nothing: inference would carry it on to every value computed from it,
and kernels would be built for a rank that may never come (a stale rank let Concat's axis pass for the declared
rank and fail inside numpy). Such shapes are dropped before inference (the element type stays); those values and
what follows them are sized at run time. A node of a custom domain is different: only a provider that implements
it runs it, and its declared output shapes are that operator's contract (onnxruntime trusts them the same way);
device graph capture needs them to size its buffers before the run.
When inference fails altogether nothing is checked, and the same holds for every intermediate declaration
(:func:`without_declared_shapes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import onnx
from onnx import defs

from .contrib_stand_ins import stand_in_contrib_ops
from .errors import InvalidGraphError
from .proto_walk import copy_fields_except, graph_subgraphs

# A strict pass that failed after this much CPU is not followed by another: the failures that take long are
# onnx's inference running away (its data propagation allocating until the memory limit), which a second pass
# would repeat; the model then runs with the shapes found at run time.
SLOW_FAILURE_SECONDS = 1.0

Infer = Callable[..., "onnx.GraphProto | None"]  # infer(model, strict=...) -> annotated graph, or None on failure


def infer_reconciled(light: onnx.ModelProto, infer: Infer) -> onnx.GraphProto | None:
    """``light``'s graph annotated by ``infer`` (see the module docstring), or None when inference fails."""
    started = time.thread_time()
    light = without_unverifiable_shapes(light)
    inferred = infer(light, strict=True)
    if inferred is not None:
        return inferred
    if time.thread_time() - started > SLOW_FAILURE_SECONDS:
        return None  # a slow failure (onnx's data propagation running out of memory) is not repeated
    if not _declares_types(light.graph):
        return infer(light, strict=False)
    bare = onnx.ModelProto()
    bare.CopyFrom(light)
    _strip_declarations(bare.graph)
    inferred = infer(bare, strict=False)
    if inferred is not None:
        _merge_declarations(light.graph, inferred)
    return inferred


def _declares_types(graph: onnx.GraphProto) -> bool:
    return bool(graph.value_info) or any(vi.type.tensor_type.HasField("shape") for vi in graph.output) \
        or any(_declares_types(sub) for sub in graph_subgraphs(graph))


def _strip_declarations(graph: onnx.GraphProto, top: bool = True) -> None:
    """Remove what inference computes anyway: value_info (subgraphs included) and the top-level outputs'
    shapes (their element types stay: the outputs' types are the graph's signature)."""
    del graph.value_info[:]
    if top:
        for vi in graph.output:
            if vi.type.HasField("tensor_type"):
                vi.type.tensor_type.ClearField("shape")
    for sub in graph_subgraphs(graph):
        _strip_declarations(sub, top=False)


def _merge_declarations(declared: onnx.GraphProto, inferred: onnx.GraphProto) -> None:
    """Top-level declarations of ``declared`` merged into ``inferred`` (see the module docstring)."""
    found = {vi.name: vi for vi in (*inferred.value_info, *inferred.output)}
    producers = {name: node for node in declared.node for name in node.output if name}
    for claim in (*declared.value_info, *declared.output):
        have = found.get(claim.name)
        if have is None:
            if claim.name not in {vi.name for vi in inferred.input}:
                inferred.value_info.append(claim)  # nothing computed it: kept unchecked, as onnxruntime does
                found[claim.name] = inferred.value_info[-1]
            continue
        if not (claim.type.HasField("tensor_type") and have.type.HasField("tensor_type")):
            if have.type.WhichOneof("value") is None:
                have.type.CopyFrom(claim.type)
            continue
        _merge_tensor(claim, have, producers.get(claim.name))


def _merge_tensor(claim: onnx.ValueInfoProto, have: onnx.ValueInfoProto, producer) -> None:
    said, computed = claim.type.tensor_type, have.type.tensor_type
    if said.elem_type and computed.elem_type and said.elem_type != computed.elem_type:
        node = f"node {producer.name!r} ({producer.op_type})" if producer is not None else "the graph"
        raise InvalidGraphError(
            f"value {claim.name!r} is declared {_type_name(said.elem_type)} but {node} computes "
            f"{_type_name(computed.elem_type)}; fix or remove the declaration (value_info or graph output)")
    if not computed.elem_type:
        computed.elem_type = said.elem_type
    if not said.HasField("shape"):
        return
    if not computed.HasField("shape"):
        computed.shape.CopyFrom(said.shape)
        return
    if len(said.shape.dim) != len(computed.shape.dim):
        return  # the declared rank is stale: the computed shape stands
    for mine, theirs in zip(computed.shape.dim, said.shape.dim):
        if mine.HasField("dim_value"):
            continue  # computed: it wins over a declaration that disagrees
        if theirs.HasField("dim_value"):
            mine.dim_value = theirs.dim_value
        elif theirs.HasField("dim_param") and not mine.HasField("dim_param"):
            mine.dim_param = theirs.dim_param


def _type_name(elem_type: int) -> str:
    try:
        return onnx.TensorProto.DataType.Name(elem_type).lower()
    except ValueError:
        return f"element type {elem_type}"


def without_unverifiable_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the declared shapes of top-level values that only a node inference cannot compute produces
    cleared (a copy; ``model`` itself when there are none). See the module docstring."""
    graph = model.graph
    declared = {vi.name for vi in (*graph.value_info, *graph.output) if vi.type.tensor_type.HasField("shape")}
    if not declared:
        return model
    opsets = {("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in model.opset_import}
    local = {(f.domain, f.name) for f in model.functions}
    blind = [n for n in graph.node if any(o in declared for o in n.output) and (n.domain, n.op_type) not in local
             and n.domain in _INFERRED_DOMAINS and not _has_schema(n, opsets)]
    if not blind:
        return model
    remaining = {(n.domain, n.op_type) for n in stand_in_contrib_ops(model).model.graph.node}
    unchecked = {o for n in blind if (n.domain, n.op_type) in remaining for o in n.output} & declared
    if not unchecked:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for vi in (*copy.graph.value_info, *copy.graph.output):
        if vi.name in unchecked:
            vi.type.tensor_type.ClearField("shape")
    return copy


# Domains whose operators onnx's schemas or the contrib stand-ins are meant to infer; any other is a custom domain.
_INFERRED_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview", "ai.onnx.preview.training",
                               "com.microsoft"})


def _has_schema(node: onnx.NodeProto, opsets: dict[str, int]) -> bool:
    domain = "" if node.domain == "ai.onnx" else node.domain
    try:
        defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except defs.SchemaError:
        return False
    return True


def without_declared_shapes(graph: onnx.GraphProto) -> onnx.GraphProto:
    """A copy of ``graph`` without its initializers (the caller has them) whose ``value_info`` (subgraphs included)
    keep their element types but not their shapes: what the session reads when inference failed, so that no
    kernel is built for a declared shape nothing checked (a stale rank let Concat's axis through to numpy)."""
    copy = onnx.GraphProto()
    copy_fields_except(graph, copy, skip="initializer")
    _clear_shapes(copy)
    return copy


def _clear_shapes(graph: onnx.GraphProto) -> None:
    for vi in graph.value_info:
        if vi.type.HasField("tensor_type"):
            vi.type.tensor_type.ClearField("shape")
    for sub in graph_subgraphs(graph):
        _clear_shapes(sub)
