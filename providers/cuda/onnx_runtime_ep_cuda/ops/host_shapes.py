"""Shape computations kept on the host: the nodes whose integer values only ever decide shapes.

Exported transformers compute their reshape targets at run time: ``Shape`` of an activation, then
``Gather``/``Unsqueeze``/``Concat``/arithmetic on those few integers, ending in a declared host input
(Reshape's shape, Expand's shape, Slice's bounds, Range's scalars, ...). Run on the device, each such
chain uploads the shape, computes on it and reads it back at its end: a download and a synchronization
per chain and step (twenty and more per decode step of GPT-2 or LLaMA).

Such a node is a *host node* when its outputs are integers (or booleans) of rank 0 or 1 and every input is
a constant, a host node's output, or (``Shape``, ``Size``) any tensor, of which only the shape is read. Its
kernel computes with numpy: no driver call, no transfer. Its values are functions of the run's input shapes
and the constants only, so they are the same at every run of one feed signature.

Where every consumer reads the values at a declared host-input position or is a host node, the kernel
returns numpy arrays. Where some consumer reads them on the device (or they are a graph output), it returns
a device tensor *mirrored* on the host: the tensor is a stream-ordered device copy of an upload made once per
distinct value (so a device-graph capture records a device copy, as for any kernel), and the host value stays
attached to it (:func:`host_value`), so host consumers never read it back.

The analysis is a fixed point over the graph (a candidate with an input computed on the device is dropped,
which can drop its consumers), made once per graph.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime import DataType, Tensor

from .context import host_value, mirror_on_host
from .registry import declared_host_inputs

_INTEGERS = {DataType.INT64, DataType.INT32, DataType.BOOL}
_METADATA_ONLY = {"Shape", "Size"}  # read only their input's shape
_MAX_ELEMENTS = 64  # a shape value; a larger known size is data, computed where it is used


def host_nodes(graph, cache: dict) -> dict[str, bool]:
    """The host nodes of ``graph`` by name, each with whether its outputs are mirrored on the device (see the
    module docstring); kept in ``cache`` (the provider's)."""
    if graph is None:
        return {}
    entry = cache.get(id(graph))
    if entry is None or entry[0] is not graph:
        entry = cache[id(graph)] = (graph, _analyze(graph))
    return entry[1]


def _analyze(graph) -> dict[str, bool]:
    if any(node.subgraphs() for node in graph.nodes):
        return {}  # values read implicitly by control-flow bodies stay where they are
    graph_outputs = {vi.name for vi in graph.outputs}
    producers, consumers = graph.producers(), graph.consumers()
    initializers = graph.initializers
    opset = graph.opsets.get("", graph.opsets.get("ai.onnx", 0))
    candidates = {node.name: node for node in graph.nodes if node.domain in ("", "ai.onnx")
                  and node.op_type in _KERNELS and not (node.op_type == "Slice" and opset < 10)
                  and _integer_outputs(graph, node)}
    changed = True
    while changed:
        changed = False
        for name, node in list(candidates.items()):
            if not _inputs_on_host(node, producers, initializers, candidates):
                del candidates[name]
                changed = True
    return {name: not _read_as_shapes(graph, node, consumers, candidates, graph_outputs)
            for name, node in candidates.items()}


def _integer_outputs(graph, node) -> bool:
    for name in node.outputs:
        info = graph.type_of(name) if name else None
        if not name:
            continue
        if info is None or not info.is_tensor or info.dtype not in _INTEGERS or info.shape is None:
            return False
        if len(info.shape) > 1 or any(isinstance(d, int) and d > _MAX_ELEMENTS for d in info.shape):
            return False
    return True


def _inputs_on_host(node, producers, initializers, candidates) -> bool:
    for position, name in enumerate(node.inputs):
        if not name or name in initializers or (position == 0 and node.op_type in _METADATA_ONLY):
            continue
        producer = producers.get(name)
        if producer is None or producer.name not in candidates:
            return False  # a feed, or a value computed on the device
    return True


def _read_as_shapes(graph, node, consumers, candidates, graph_outputs) -> bool:
    for name in node.outputs:
        if not name:
            continue
        if name in graph_outputs:
            return False
        for consumer in consumers.get(name, ()):
            if consumer.name in candidates:
                continue
            opset = graph.opsets.get(consumer.domain or "", graph.opsets.get("", 0))
            hosts = declared_host_inputs(consumer, opset) or ()
            if any(value == name and position not in hosts for position, value in enumerate(consumer.inputs)):
                return False
    return True


# -- the kernels: numpy on the host ------------------------------------------------------------------------
def host_kernel(node, opset: int, graph, ctx, mirrored: bool):
    """The numpy kernel of host node ``node``. Its constant inputs are read from ``graph`` (the session hands the
    kernel their device copies); the others are host values (:func:`host_value`), or any tensor at a metadata-only
    input. ``mirrored``: return device tensors mirrored on the host (see the module docstring)."""
    compute = _KERNELS[node.op_type](node, opset)
    constants = {position: np.asarray(graph.initializers[name]) for position, name in enumerate(node.inputs)
                 if name in graph.initializers}
    metadata = node.op_type in _METADATA_ONLY
    uploaded: dict[tuple, Tensor] = {}  # per distinct value: the device copy outputs are copied from

    def on_host(position: int, value):
        if position in constants:
            return constants[position]
        if value is None or (metadata and position == 0):
            return value
        host = host_value(value)
        return host if host is not None else value.numpy()  # not reached for inputs the analysis admitted

    def mirror(array: np.ndarray) -> Tensor:
        array = np.array(array, order="C")  # a copy the caller cannot change (ascontiguousarray makes 0-d 1-d)
        key = (array.dtype.str, array.shape, array.tobytes())
        source = uploaded.get(key)
        if source is None:
            source = uploaded[key] = Tensor.from_numpy(array, provider=ctx.handle)
        tensor = ctx.empty(DataType.from_numpy(array.dtype), array.shape)
        ctx.device.copy_device(tensor.device_ptr, source.device_ptr, tensor.nbytes)
        mirror_on_host(tensor, array)
        return tensor

    def kernel(*inputs):
        results = compute(*(on_host(position, value) for position, value in enumerate(inputs)))
        if mirrored:
            return tuple(mirror(np.asarray(result)) for result in results)
        return tuple(np.asarray(result) for result in results)
    return kernel


def _axes(node, opset: int, since: int, inputs, position: int = 1):
    """Axes from the attribute before opset ``since``, from input ``position`` after (None: omitted)."""
    if opset < since:
        axes = node.attr("axes")
        return None if axes is None else [int(a) for a in axes]
    if len(inputs) > position and inputs[position] is not None:
        return [int(a) for a in np.asarray(inputs[position]).reshape(-1)]
    return None


def _shape(node, opset):
    start_attr = int(node.attr("start", 0)) if opset >= 15 else 0
    end_attr = node.attr("end") if opset >= 15 else None

    def kernel(x):
        dims = tuple(x.shape)
        end = len(dims) if end_attr is None else int(end_attr)
        return (np.array(dims[slice(start_attr, end)], dtype=np.int64),)
    return kernel


def _size(node, opset):
    return lambda x: (np.array(int(np.prod(x.shape, dtype=np.int64)), dtype=np.int64),)


def _gather(node, opset):
    axis = int(node.attr("axis", 0))
    return lambda data, indices: (np.take(np.asarray(data), np.asarray(indices).astype(np.int64), axis=axis),)


def _unsqueeze(node, opset):
    def kernel(*inputs):
        data = np.asarray(inputs[0])
        rank = data.ndim + len(_axes(node, opset, 13, inputs))
        axes = sorted(a + rank if a < 0 else a for a in _axes(node, opset, 13, inputs))
        for axis in axes:
            data = np.expand_dims(data, axis)
        return (data,)
    return kernel


def _squeeze(node, opset):
    def kernel(*inputs):
        data = np.asarray(inputs[0])
        axes = _axes(node, opset, 13, inputs)
        return (np.squeeze(data) if axes is None else np.squeeze(data, axis=tuple(axes)),)
    return kernel


def _concat(node, opset):
    axis = int(node.attr("axis"))
    return lambda *inputs: (np.concatenate([np.asarray(x) for x in inputs], axis=axis),)


def _cast(node, opset):
    target = DataType.parse(int(node.attr("to"))).numpy
    return lambda x: (np.asarray(x).astype(target),)


def _slice(node, opset):
    def kernel(data, starts, ends, axes=None, steps=None):
        data = np.asarray(data)
        starts, ends = np.asarray(starts).reshape(-1), np.asarray(ends).reshape(-1)
        axes = range(len(starts)) if axes is None else np.asarray(axes).reshape(-1)
        steps = [1] * len(starts) if steps is None else np.asarray(steps).reshape(-1)
        index = [slice(None)] * data.ndim
        for start, end, axis, step in zip(starts, ends, axes, steps):
            index[int(axis)] = slice(int(start), int(end), int(step))  # numpy clamps as ONNX does
        return (data[tuple(index)],)
    return kernel


def _binary(function):
    def make(node, opset):
        def kernel(a, b):
            a, b = np.asarray(a), np.asarray(b)
            return (function(a, b).astype(np.result_type(a, b)) if function is not np.equal else np.equal(a, b),)
        return kernel
    return make


def _divide(a, b):
    # Integer Div truncates toward zero (C semantics, as onnxruntime); numpy's // floors.
    return np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))


def _variadic(function):
    def make(node, opset):
        def kernel(*inputs):
            result = np.asarray(inputs[0])
            for value in inputs[1:]:
                result = function(result, np.asarray(value))
            return (result,)
        return kernel
    return make


def _where(node, opset):
    return lambda condition, a, b: (np.where(np.asarray(condition), np.asarray(a), np.asarray(b)),)


def _reshape(node, opset):
    allow_zero = int(node.attr("allowzero", 0))

    def kernel(data, shape):
        data, shape = np.asarray(data), [int(d) for d in np.asarray(shape).reshape(-1)]
        if not allow_zero:
            shape = [data.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return (data.reshape(shape),)
    return kernel


def _neg(node, opset):
    return lambda x: (np.negative(np.asarray(x)),)


def _reduce_prod(node, opset):
    keepdims = bool(node.attr("keepdims", 1))

    def kernel(*inputs):
        axes = _axes(node, opset, 18, inputs)
        data = np.asarray(inputs[0])
        return (np.prod(data, axis=None if axes is None else tuple(axes), keepdims=keepdims).astype(data.dtype),)
    return kernel


_KERNELS = {
    "Shape": _shape, "Size": _size, "Gather": _gather, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze,
    "Concat": _concat, "Cast": _cast, "Slice": _slice, "Reshape": _reshape, "Neg": _neg, "Where": _where,
    "Add": _binary(np.add), "Sub": _binary(np.subtract), "Mul": _binary(np.multiply), "Div": _binary(_divide),
    "Equal": _binary(np.equal), "Max": _variadic(np.maximum), "Min": _variadic(np.minimum),
    "ReduceProd": _reduce_prod,
}
