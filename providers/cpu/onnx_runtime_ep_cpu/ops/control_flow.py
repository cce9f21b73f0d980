"""If, Loop and Scan: host-driven control flow over subgraphs compiled by the session layer.

Each factory compiles its subgraph attributes once (placement, function expansion, planning) with
this provider's handle. Values the subgraphs read from enclosing scopes arrive after the node's
explicit inputs, in ``implicit_inputs(node)`` order, and are passed to the subgraph by name.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime import budget
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError
from onnx_runtime.loader import implicit_inputs
from onnx_runtime.session.subgraph import Subgraph

from ..registry import register


def _scalar_bool(value) -> bool:
    if isinstance(value, np.ndarray) and value.size == 1:
        return bool(value)
    array = np.asarray(value)
    if array.size != 1:
        raise InvalidArgumentError(f"a condition must hold exactly one boolean; got a tensor of shape {array.shape}; "
                                   "compute the condition as a single boolean (a scalar or one-element tensor)")
    return bool(array.reshape(-1)[0])


def _empty_like_type(info, leading: int = 0) -> np.ndarray:
    dtype = info.dtype.numpy if info is not None and info.dtype is not None else np.float32
    shape = info.static_shape if info is not None else None
    return np.empty((leading, *(shape or ())), dtype=dtype)


def _check_body_inputs(node, body: Subgraph, values, first: int = 0) -> None:
    """Values handed to the body must have the element types its inputs declare (onnxruntime checks them too):
    a string state declared float reached the body's kernels as an internal TypeError."""
    for info, value in zip(body.graph.inputs[first:], values):
        declared = info.type.dtype if info.type.is_tensor else None
        if declared is None or not isinstance(value, np.ndarray) or value.dtype == declared.numpy \
                or (value.dtype.kind in "OUS" and declared.numpy.kind == "O"):
            continue
        raise InvalidArgumentError(f"node {node.name!r} ({node.op_type}): body input {info.name!r} is declared "
                                   f"{declared.name} but is given {value.dtype}; feed that type or fix the body's "
                                   f"declaration")


def _check_body_arity(node, body: Subgraph, given: int, what: str) -> None:
    """The body takes exactly the values the node hands it (a missing one reached a kernel as None)."""
    if len(body.input_names) != given:
        raise InvalidGraphError(f"node {node.name!r} ({node.op_type}): attribute 'body' has {len(body.input_names)} "
                                f"inputs; it must take {given} ({what})")


def _check_scan_states(node, body: Subgraph, state_count: int) -> None:
    """The body gives back every state it takes (a state it left out shifted the scan inputs by one: a None
    reached a kernel)."""
    if len(body.output_names) < state_count:
        raise InvalidGraphError(f"node {node.name!r} (Scan): attribute 'body' has {len(body.output_names)} outputs; it "
                                f"must return each of the node's {state_count} states (its inputs less "
                                f"num_scan_inputs) before its scan outputs: fix num_scan_inputs or the body")


def _outer(node, args, explicit: int) -> dict:
    return dict(zip(implicit_inputs(node), args[explicit:]))


@register("If", since=1, needs=("handle",))
def if_(node, shapes, opset, handle):
    names = implicit_inputs(node)
    then_branch = Subgraph(node.attr("then_branch"), [handle]).runner(names)
    else_branch = Subgraph(node.attr("else_branch"), [handle]).runner(names)

    def kernel(cond, *outer_values):
        return tuple((then_branch if _scalar_bool(cond) else else_branch)(outer_values))

    return kernel


@register("Loop", since=1, needs=("handle",))
def loop(node, shapes, opset, handle):
    body = Subgraph(node.attr("body"), [handle])
    explicit = len(node.inputs)
    carried_count = explicit - 2
    scan_count = len(body.output_names) - 1 - carried_count
    if scan_count < 0:
        raise InvalidGraphError(
            f"node {node.name!r} (Loop): attribute 'body' has {len(body.output_names)} outputs; it needs the "
            f"condition plus one per loop-carried value ({carried_count})"
        )
    scan_types = body.output_types[1 + carried_count:]
    _check_body_arity(node, body, 2 + carried_count, "the iteration number, the condition and each loop-carried value")

    def kernel(max_trip=None, cond=None, *rest):
        carried = list(rest[:carried_count])
        _check_body_inputs(node, body, carried, first=2)
        outer = _outer(node, (max_trip, cond, *rest), explicit)
        trips = None if max_trip is None or np.asarray(max_trip).size == 0 else int(np.asarray(max_trip).reshape(-1)[0])
        keep_going = True if cond is None or np.asarray(cond).size == 0 else _scalar_bool(cond)
        scans: list[list] = [[] for _ in range(scan_count)]
        iteration = 0
        while keep_going and (trips is None or iteration < trips):
            budget.check_cancelled(f"node {node.name!r} (Loop) at iteration {iteration}")
            out = body.run([np.array(iteration, np.int64), np.array(keep_going), *carried], outer)
            keep_going = _scalar_bool(out[0])
            carried = list(out[1:1 + carried_count])
            for collected, value in zip(scans, out[1 + carried_count:]):
                collected.append(value)
            if iteration == 0 and trips is not None and scans:
                _check_stacked_size(node, out[1 + carried_count:], trips)
            iteration += 1
        stacked = [_stack(collected, info, node) for collected, info in zip(scans, scan_types)]
        return (*carried, *stacked)

    return kernel


def _check_stacked_size(node, first: tuple, trips: int) -> None:
    """Fail fast when ``trips`` iterations of scan outputs the size of the first would pass the budget (every
    iteration must give the same shape), before running the rest."""
    for k, array in enumerate(first):
        if not isinstance(array, np.ndarray):
            continue
        budget.check(array.size * trips, array.itemsize, f"node {node.name!r} (Loop) scan output {k} over {trips:,} "
                     f"iterations")


def _stack(values: list, info, node, axis: int = 0) -> np.ndarray:
    if not values:
        return _empty_like_type(info)
    shapes = {np.shape(v) for v in values}
    if len(shapes) > 1:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): scan output shapes differ between iterations ({sorted(shapes)}); "
            f"every iteration must produce the same shape"
        )
    return np.stack([np.asarray(v) for v in values], axis=axis)


def _scan_attrs(node, scan_inputs: int, scan_outputs: int):
    in_axes = list(node.attr("scan_input_axes", [0] * scan_inputs))
    in_dirs = list(node.attr("scan_input_directions", [0] * scan_inputs))
    out_axes = list(node.attr("scan_output_axes", [0] * scan_outputs))
    out_dirs = list(node.attr("scan_output_directions", [0] * scan_outputs))
    return in_axes, in_dirs, out_axes, out_dirs


def _run_scan(body: Subgraph, node, states: list, scans: list, outer: dict, attrs) -> list:
    in_axes, in_dirs, out_axes, out_dirs = attrs
    _check_body_inputs(node, body, [*states, *scans])
    for index, (a, x) in enumerate(zip(in_axes, scans)):
        if not -x.ndim <= a < x.ndim:
            raise InvalidArgumentError(
                f"node {node.name!r} (Scan): scan_input_axes[{index}] is {a}, outside [-{x.ndim}, {x.ndim}) for scan "
                f"input {index} of shape {x.shape}; fix the axis or num_scan_inputs")
    axes = [a + x.ndim if a < 0 else a for a, x in zip(in_axes, scans)]
    lengths = {x.shape[a] for a, x in zip(axes, scans)}
    if len(lengths) > 1:
        raise InvalidArgumentError(
            f"node {node.name!r} (Scan): scan inputs have different lengths {sorted(lengths)} along their scan axes"
        )
    steps = lengths.pop() if lengths else 0
    state_count = len(states)
    collected: list[list] = [[] for _ in range(len(body.output_names) - state_count)]
    for t in range(steps):
        budget.check_cancelled(f"node {node.name!r} ({node.op_type}) at step {t}")
        slices = [np.take(x, steps - 1 - t if d else t, axis=a) for x, a, d in zip(scans, axes, in_dirs)]
        out = body.run([*states, *slices], outer)
        states = list(out[:state_count])
        for values, value in zip(collected, out[state_count:]):
            values.append(value)
    results = []
    types = body.output_types[state_count:]
    for values, axis, direction, info in zip(collected, out_axes, out_dirs, types):
        if direction:
            values = values[::-1]
        if not values:
            results.append(_empty_like_type(info))
            continue
        rank = np.ndim(values[0]) + 1
        results.append(_stack(values, info, node, axis + rank if axis < 0 else axis))
    return [*states, *results]


@register("Scan", since=9, needs=("handle",))
def scan(node, shapes, opset, handle):
    body = Subgraph(node.attr("body"), [handle])
    scan_inputs = int(node.attr("num_scan_inputs"))
    explicit = len(node.inputs)
    state_count = explicit - scan_inputs
    _check_body_arity(node, body, explicit, "one per state and per scan input of the node")
    _check_scan_states(node, body, state_count)
    attrs = _scan_attrs(node, scan_inputs, len(body.output_names) - state_count)

    def kernel(*args):
        outer = _outer(node, args, explicit)
        return tuple(_run_scan(body, node, list(args[:state_count]), list(args[state_count:explicit]), outer, attrs))

    return kernel


@register("Scan", since=8, needs=("handle",))
def scan_8(node, shapes, opset, handle):
    # Opset 8 adds a leading batch axis to every state and scan input, and an optional first input
    # of per-batch sequence lengths; each batch item is an independent opset-9 scan along axis 0.
    body = Subgraph(node.attr("body"), [handle])
    scan_inputs = int(node.attr("num_scan_inputs"))
    explicit = len(node.inputs)
    state_count = explicit - 1 - scan_inputs
    _check_body_arity(node, body, explicit - 1, "one per state and per scan input after sequence_lens")
    _check_scan_states(node, body, state_count)
    directions = list(node.attr("directions", [0] * scan_inputs))
    attrs = ([0] * scan_inputs, directions, [0] * (len(body.output_names) - state_count),
             [0] * (len(body.output_names) - state_count))

    def kernel(sequence_lens, *args):
        outer = _outer(node, (sequence_lens, *args), explicit)
        states, scans = list(args[:state_count]), list(args[state_count:explicit - 1])
        batch = (states or scans)[0].shape[0]
        per_item = []
        for b in range(batch):
            length = scans[0].shape[1] if sequence_lens is None else int(np.asarray(sequence_lens)[b])
            per_item.append(_run_scan(body, node, [s[b] for s in states], [x[b, :length] for x in scans], outer, attrs))
        return tuple(np.stack([item[k] for item in per_item]) for k in range(len(per_item[0])))

    return kernel
