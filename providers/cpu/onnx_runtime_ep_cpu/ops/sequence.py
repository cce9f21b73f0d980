"""Sequence and optional operators. A sequence value is a Python list of numpy arrays; an empty
optional is None."""

from __future__ import annotations

import numpy as np
from onnx_runtime import budget
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError
from onnx_runtime.loader import implicit_inputs
from onnx_runtime.session.subgraph import Subgraph

from ..registry import register


def _position(node, sequence: list, position, inserting: bool = False) -> int:
    if np.asarray(position).size != 1 or np.asarray(position).dtype.kind not in "iu":
        raise InvalidArgumentError(f"node {node.name!r} ({node.op_type}): position must be one integer, got "
                                   f"{np.asarray(position).dtype} of shape {np.shape(position)}")
    index = int(np.asarray(position).reshape(-1)[0])
    size = len(sequence)
    low, high = -size, size if inserting else size - 1
    if not low <= index <= high:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): position {index} is outside [{low}, {high}] for a sequence of "
            f"{size} tensors"
        )
    return index + size if index < 0 else index


@register("SequenceEmpty", since=11)
def sequence_empty(node, shapes, opset):
    return lambda: ([],)


@register("SequenceConstruct", since=11)
def sequence_construct(node, shapes, opset):
    return lambda *tensors: (list(tensors),)


@register("SequenceInsert", since=11)
def sequence_insert(node, shapes, opset):
    def kernel(sequence, tensor, position=None):
        if not isinstance(sequence, list):
            raise InvalidArgumentError(f"node {node.name!r} (SequenceInsert): input 0 must be a sequence, got "
                                       f"{type(sequence).__name__}; feed it a sequence of tensors")
        result = list(sequence)
        index = len(result) if position is None else _position(node, result, position, inserting=True)
        result.insert(index, tensor)
        return (result,)

    return kernel


@register("SequenceErase", since=11)
def sequence_erase(node, shapes, opset):
    def kernel(sequence, position=None):
        result = list(sequence)
        del result[len(result) - 1 if position is None else _position(node, result, position)]
        return (result,)

    return kernel


@register("SequenceAt", since=11)
def sequence_at(node, shapes, opset):
    return lambda sequence, position: (sequence[_position(node, sequence, position)],)


@register("SequenceLength", since=11)
def sequence_length(node, shapes, opset):
    return lambda sequence: (np.array(len(sequence), dtype=np.int64),)


@register("SplitToSequence", since=11)
def split_to_sequence(node, shapes, opset):
    axis = int(node.attr("axis", 0))
    keepdims = int(node.attr("keepdims", 1))

    def kernel(x, split=None):
        if not -x.ndim <= axis < x.ndim:
            raise InvalidArgumentError(f"node {node.name!r} (SplitToSequence): axis {axis} is outside "
                                       f"[-{x.ndim}, {x.ndim}) for its rank-{x.ndim} input")
        ax = axis + x.ndim if axis < 0 else axis
        if split is None:
            parts = np.split(x, x.shape[ax], axis=ax)
            return ([np.squeeze(p, axis=ax) if not keepdims else p for p in parts],)
        split = np.asarray(split)
        if split.ndim == 0:
            size = int(split)
            if size < 1:
                raise InvalidArgumentError(f"node {node.name!r} (SplitToSequence): split {size} must be at least 1")
            bounds = list(range(size, x.shape[ax], size))
        else:
            if int(split.sum()) != x.shape[ax]:
                raise InvalidArgumentError(
                    f"node {node.name!r} (SplitToSequence): split sizes {split.tolist()} do not add up to the "
                    f"axis length {x.shape[ax]}"
                )
            bounds = np.cumsum(split)[:-1].tolist()
        return (np.split(x, bounds, axis=ax),)

    return kernel


@register("ConcatFromSequence", since=11)
def concat_from_sequence(node, shapes, opset):
    axis = int(node.attr("axis"))
    new_axis = int(node.attr("new_axis", 0))

    def kernel(sequence):
        if new_axis:
            rank = sequence[0].ndim + 1
            return (np.stack(sequence, axis=axis + rank if axis < 0 else axis),)
        return (np.concatenate(sequence, axis=axis),)

    return kernel


@register("SequenceMap", since=17, needs=("handle",))
def sequence_map(node, shapes, opset, handle):
    body = Subgraph(node.attr("body"), [handle])
    explicit = len(node.inputs)
    outer_names = implicit_inputs(node)
    if len(body.input_names) != explicit or len(body.output_names) != len(node.outputs):
        # (a body input left unfed reached its kernels as None)
        raise InvalidGraphError(
            f"node {node.name!r} (SequenceMap): attribute 'body' has {len(body.input_names)} inputs and "
            f"{len(body.output_names)} outputs; it must have one per input ({explicit}) and output "
            f"({len(node.outputs)}) of the node")

    def kernel(*args):
        inputs, outer = args[:explicit], dict(zip(outer_names, args[explicit:]))
        lengths = {len(v) for v in inputs if isinstance(v, list)}
        if len(lengths) != 1:
            raise InvalidArgumentError(
                f"node {node.name!r} (SequenceMap): input sequences have lengths {sorted(lengths)}; they must match"
            )
        results: list[list] = [[] for _ in body.output_names]
        for i in range(lengths.pop()):
            budget.check_cancelled(f"node {node.name!r} (SequenceMap) at element {i}")
            outs = body.run([v[i] if isinstance(v, list) else v for v in inputs], outer)
            for collected, value in zip(results, outs):
                collected.append(value)
        return tuple(results)

    return kernel


@register("Optional", since=15)
def optional(node, shapes, opset):
    return lambda value=None: (value,)


@register("OptionalHasElement", since=15)
def optional_has_element(node, shapes, opset):
    return lambda value=None: (np.array(value is not None),)


@register("OptionalGetElement", since=15)
def optional_get_element(node, shapes, opset):
    def kernel(value=None):
        if value is None:
            raise InvalidArgumentError(
                f"node {node.name!r} (OptionalGetElement): the optional is empty; check it with OptionalHasElement"
            )
        return (value,)

    return kernel
