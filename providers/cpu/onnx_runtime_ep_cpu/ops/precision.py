"""The conversions a half-precision model computed in float32 keeps (domain ai.onnx_runtime.cpu, see
precision_fusions.py), each over any number of tensors (input i to output i), so that a model's edges convert in
one node:

- RoundToHalf: float values rounded to float16 or bfloat16 (attribute ``to``) and kept in their own type, the
  Cast to the half type and back where the model rounds;
- HalfToFloat: float16 or bfloat16 values widened to float32 (a half-precision graph input);
- FloatToHalf: float32 values narrowed to float16 or bfloat16 (attribute ``to``; a half-precision graph output).

float32 and float16 convert in compiled passes (algorithms/precision.py)."""

from __future__ import annotations

import sys

from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidArgumentError

from ..algorithms.precision import FLOAT16, FLOAT32, HALF_FLOATS, narrow, round_all, widen
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import graph_error, shape_free

# Operators that read only their input's shape.
_SHAPE_READERS = frozenset({"Shape", "Size"})
_HALF = {int(DataType.FLOAT16): DataType.FLOAT16.numpy, int(DataType.BFLOAT16): DataType.BFLOAT16.numpy}


def _half_attr(node):
    to = int(node.attr("to", int(DataType.FLOAT16)))
    if to not in _HALF:
        raise graph_error(node, "to", f"is {to}; expected float16 (10) or bfloat16 (16)")
    return _HALF[to]


def _check(node, inputs, accepts, expected: str) -> None:
    for index, x in enumerate(inputs):
        if not accepts(x.dtype):
            raise InvalidArgumentError(f"node {node.name!r} ({node.op_type}): input {index} "
                                       f"({node.inputs[index]!r}) is {x.dtype}; expected {expected}")


@register("RoundToHalf", domain=FUSED_DOMAIN, since=1, hints=("graph",))
def round_to_half(node, shapes, opset, graph=None):
    dtype = _half_attr(node)
    in_place = _rounded_in_place(node, graph) if dtype == FLOAT16 else ()

    def kernel(*inputs):
        _check(node, inputs, lambda d: d.kind == "f", "a float tensor")
        return round_all(inputs, dtype)

    if not in_place:
        return shape_free(kernel)
    row_rounding: list = []  # made at the first bound cache: a model never run so imports none of its modules

    def rounding_caches(*inputs):
        # A decode loop's bound caches: rounded where they lie and passed on themselves, so the attention still
        # finds the windows it appends the step's rows to in place (kv_append.py) instead of a rounded copy.
        windows = _cache_windows(inputs, in_place)
        if not windows:
            return kernel(*inputs)
        results = list(inputs)
        if len(windows) < len(inputs):  # (the windows are float32: the others checked and rounded as before)
            _check(node, inputs, lambda d: d.kind == "f", "a float tensor")
            rest = [index for index in range(len(inputs)) if index not in windows]
            for index, rounded in zip(rest, round_all(tuple(inputs[index] for index in rest), dtype)):
                results[index] = rounded
        if not row_rounding:
            from ..algorithms.half_caches import CacheRowRounding

            row_rounding.append(CacheRowRounding())
        row_rounding[0]([(window.physical, window.axis, inputs[index].shape[window.axis])
                         for index, window in windows.items()])
        return tuple(results)

    # (any shapes: a decode step's caches grow every run, and a kernel per length walked the graph each step)
    return shape_free(rounding_caches)


def _cache_windows(inputs: tuple, in_place: tuple[int, ...]) -> dict:
    """Position -> the window of this thread's bound run fed there (kv_append.fed_window), for the positions
    ``in_place`` allows whose cache is a C-contiguous float32 buffer."""
    kv_append = sys.modules.get("onnx_runtime.kv_append")  # (a run with windows has imported it)
    windows = {}
    if kv_append is not None:
        for index in in_place:
            x = inputs[index]
            window = kv_append.fed_window(x) if x.dtype == FLOAT32 else None
            if window is not None and window.contiguous and window.physical.dtype == FLOAT32:
                windows[index] = window
    return windows


def _rounded_in_place(node, graph) -> tuple[int, ...]:
    """The positions of ``node``'s inputs that it may round where a bound run's cache holds them: graph inputs,
    not graph outputs, that no other node reads but for their shape (Shape and Size). A cache fed so is also its
    present's buffer, and the present is written from the rounded rows, so no reader sees the fed values change."""
    if graph is None or any(other.subgraphs() for other in graph.nodes):
        return ()
    inputs = {info.name for info in graph.inputs} - {info.name for info in graph.outputs}
    readers = graph.consumers()
    return tuple(index for index, name in enumerate(node.inputs) if name in inputs and all(
        reader is node or (reader.op_type in _SHAPE_READERS and not reader.domain and reader.inputs.index(name) == 0)
        for reader in readers.get(name, ())))


@register("HalfToFloat", domain=FUSED_DOMAIN, since=1)
def half_to_float(node, shapes, opset):
    def kernel(*inputs):
        _check(node, inputs, lambda d: d in HALF_FLOATS, "a float16 or bfloat16 tensor")
        return tuple(widen(x) for x in inputs)

    return shape_free(kernel)


@register("FloatToHalf", domain=FUSED_DOMAIN, since=1)
def float_to_half(node, shapes, opset):
    dtype = _half_attr(node)

    def kernel(*inputs):
        _check(node, inputs, lambda d: d == FLOAT32, "a float32 tensor")
        return tuple(narrow(x, dtype) for x in inputs)

    return shape_free(kernel)
