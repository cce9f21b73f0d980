"""RoundedAttention (qdq_attention.fuse_rounded_attention): a QDQ decoder's attention from the scores' product to
the context's, in one compiled call (compiled/rounded_attention.py).

Inputs: the chain's outside inputs, in the order its nodes read them; attributes ``chain``, ``wiring`` and
``{index}.{name}`` hold its nodes (table_chains.py's spelling): an optional Transpose of the keys, the scores'
QuantizedMatMul or GroupedQuantizedMatMul, up to two GridTable and two AddRounded steps, the Softmax, and the
context's product. The compiled call takes 4-D float32 operands (heads repeated only as a grouped product's
targets say), per-tensor 8-bit grids, tables on the grid their step reads and addends that broadcast onto the
scores without enlarging them; any other call runs the chain's own kernels, with their errors.
"""

from __future__ import annotations

from operator import is_, itemgetter

import numpy as np
from onnx_runtime.errors import OnnxRuntimeError

from ..algorithms.bound_loop import EntryOnce
from ..algorithms.quantize import integer_range
from ..fused_domain import FUSED_DOMAIN
from ..registry import NEEDS, lookup, register
from ._common import argument_error
from .grid_table import table_of_grid
from .qdq_grouped import repeats_heads
from .qdq_linear import Requantization
from .table_chain import TableChain, chain_nodes

_F32 = np.dtype(np.float32)
_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_NO_ADDENDS = [np.zeros((1, 1, 1, 1), np.float32)] * 2
_NO_TABLES = np.zeros((1, 256), np.float32)
# The most scores per head (query rows x keys) the compiled call takes: one thread runs every head, where the
# chain's products split across threads; decode steps, short prefills and small encoders (whisper's 50 x 50)
# stay under it.
MOST_SCORES = 4096


class _Roles:
    """Where each operand of the compiled call is among the fused node's inputs."""

    def __init__(self, node, inner: list):
        position = {name: i for i, name in enumerate(node.inputs)}
        first = 1 if inner[0].op_type == "Transpose" else 0
        scores, context = inner[first], inner[-1]
        self.grouped = scores.op_type == "GroupedQuantizedMatMul"
        self.fast = self.grouped == (context.op_type == "GroupedQuantizedMatMul")
        self.group = int(scores.attr("group", 1)) if self.grouped else 1
        if self.grouped and int(context.attr("group", 1)) != self.group:
            self.fast = False
        self.q = position[scores.inputs[0]]
        self.keys = position[inner[0].inputs[0] if first else scores.inputs[3]]
        self.keys_transposed = not first and not self.grouped  # (B, H, D, L): swapped here
        self.values = position[context.inputs[3]]
        self.scores_params = [position[name] for name in scores.inputs[1:3] + scores.inputs[4:8]]
        self.context_params = [position[name] for name in context.inputs[1:3] + context.inputs[4:8]]
        self.targets = [[position.get(name) if name else None for name in n.inputs[8:10]] + [None] * (10 - len(
            n.inputs)) for n in (scores, context)] if self.grouped else []
        self.grouped_attrs = [(bool(n.attr("allowzero", 0)), n.attr("target")) for n in (scores, context)]
        self.steps: list[tuple] = []  # (TABLE, chain, grid positions, constant positions) or (ADD, addend, grid)
        current = scores.outputs[0]
        for n in inner[first + 1:-2]:
            if n.op_type == "GridTable":
                self.steps.append(("table", TableChain(n), [position[x] for x in n.inputs[1:3]],
                                   [position[x] for x in n.inputs[3:]]))
            else:
                other = n.inputs[1] if n.inputs[0] == current else n.inputs[0]
                self.steps.append(("add", position[other], [position[x] for x in n.inputs[2:4]]))
            current = n.outputs[0]
        self.addends = [step[1] for step in self.steps if step[0] == "add"]
        variable = {self.q, self.keys, self.values, *self.addends}
        variable.update(p for pair in self.targets for p in pair if p is not None)
        self.constants = [i for i in range(len(node.inputs)) if i not in variable]


def _grid(scale, zero) -> tuple:
    if scale.size != 1 or scale.dtype != _F32 or zero.size != 1 or zero.dtype not in _EIGHT_BIT:
        raise ValueError("not a per-tensor 8-bit grid")
    return (scale.reshape(-1)[0], zero.reshape(-1)[0], *integer_range(zero.dtype))


def _product_params(node, inputs: list, columns: int) -> list:
    """(a: scale, zero, low, high), (b: the same), (multiplier, y zero, low, high, y scale) of a stacked product."""
    a_scale, a_zero, b_scale, b_zero, y_scale, y_zero = inputs
    p = Requantization(node, columns, a_scale, a_zero, b_scale, b_zero, y_scale, y_zero, None)
    if not p.per_tensor or b_scale.size != 1 or p.multiplier.size != 1:
        raise ValueError("not per tensor")
    return [p.a_scale, p.a_zero, p.a_low, p.a_high, p.b_scale, p.b_zeros[0], p.b_low, p.b_high,
            p.multiplier[0], p.y_zero, p.y_low, p.y_high, p.y_scale]


def _prepare(node, roles: _Roles, loop, args):
    """(params, tables, steps) for the compiled call from the constant inputs, or None where it cannot take them."""
    try:
        params = np.zeros(loop.PARAMS)
        scores = _product_params(node, [args[i] for i in roles.scores_params], 1)
        context = _product_params(node, [args[i] for i in roles.context_params], 1)
        params[loop.Q:loop.Q + 8] = scores[:8]
        params[loop.SCORES:loop.SCORES + 5] = scores[8:]
        params[loop.P:loop.P + 4] = context[:4]
        params[loop.V:loop.V + 4] = context[4:8]
        params[loop.CONTEXT:loop.CONTEXT + 5] = context[8:]
        tables, steps = [], np.zeros((len(roles.steps), loop.STEP_COLUMNS), _F32)
        for t, step in enumerate(roles.steps):
            grid = _grid(*(args[i] for i in step[2]))
            if step[0] == "table":
                table, *_, rank = table_of_grid(step[1], args[step[2][0]], args[step[2][1]],
                                             tuple(args[i] for i in step[3]))
                if rank > 4 or table.size != grid[3] - grid[2] + 1:
                    return None
                steps[t] = (loop.TABLE, len(tables), *grid)
                tables.append(table)
            else:
                steps[t] = (loop.ADD, roles.addends.index(step[1]), *grid)
    except (ValueError, OnnxRuntimeError):
        return None  # (the chain's kernels give the error, or serve what the call cannot take)
    return params, np.stack(tables) if tables else _NO_TABLES, steps


def _takes(roles: _Roles, q, keys, values, addends, args) -> bool:
    """Whether the compiled call takes these operands (4-D float32, heads repeated only as the targets say)."""
    if not (q.ndim == keys.ndim == values.ndim == 4 and q.dtype is keys.dtype is values.dtype is _F32):
        return False
    batch, heads, rows, depth = q.shape
    if keys.shape[0] != batch or keys.shape[1] * roles.group != heads or keys.shape[3] != depth \
            or values.shape[:3] != keys.shape[:3] or not q.size or not values.size:
        return False
    scores = (batch, heads, rows, keys.shape[2])
    for a in addends:
        if a.dtype is not _F32 or a.ndim > 4 or any(d not in (1, s) for d, s in zip(a.shape[::-1], scores[::-1])):
            return False
    for (allowzero, fixed), (spread, reshape), kv in zip(roles.grouped_attrs, roles.targets, (keys, values)):
        target = fixed if reshape is None else args[reshape]
        if not repeats_heads(roles.group, allowzero, kv.shape, args[spread], target):
            return False
    return True


def _ruled(node, roles: _Roles, args, out):
    """``out``, the chain's result, where it has the shape of the node's rule (MatMul's over q and the values):
    the pass took no chain whose shapes showed otherwise, and a symbolic plan gives the graph after it the rule's
    shape, so any other is a typed error."""
    q, values = args[0], args[1]
    if q.ndim != 4 or values.ndim != 4 or out.ndim != 4:
        return out
    batch = q.shape[:2] if roles.grouped else np.broadcast_shapes(q.shape[:2], values.shape[:2])
    if out.shape != batch + (q.shape[2], values.shape[3]):
        raise argument_error(node, f"an addend or the keys broadcast the scores of q {q.shape} to {out.shape[:3]}; "
                             "the fused attention keeps q's batch, head and row dimensions")
    return out


def _chain_kernels(node, inner: list) -> list:
    """The kernels of the chain's own nodes (they serve the calls the compiled one does not take)."""
    kernels = []
    for n in inner:
        factory = lookup(n.op_type, n.domain, n.opset)
        if factory is None or NEEDS.get(factory):
            raise OnnxRuntimeError(f"node {node.name!r} ({node.op_type}): its node {n.name!r} ({n.op_type}) has no "
                                   "CPU kernel that runs on its inputs alone")
        kernels.append(factory(n, [None] * len(n.inputs), n.opset))
    return kernels


@register("RoundedAttention", domain=FUSED_DOMAIN, since=1)
def rounded_attention(node, shapes, opset):
    from ..compiled import rounded_attention as loop  # once here: an import statement costs each call microseconds

    inner = chain_nodes(node)
    kernels = _chain_kernels(node, inner)
    roles = _Roles(node, inner)
    # the constant inputs last seen and what was made of them (params, tables, steps), or None: the chain serves
    kept: list = [(), None]
    shaped: list = [None, False]  # the last call's shapes and whether the compiled call takes them
    bind = EntryOnce(loop.rounded_attention)

    def chained(args):
        known = dict(zip(node.inputs, args))
        for n, run in zip(inner, kernels):
            known[n.outputs[0]] = run(*[known[name] if name else None for name in n.inputs])[0]
        return (_ruled(node, roles, args, known[inner[-1].outputs[0]]),)

    constants_of = itemgetter(*roles.constants) if len(roles.constants) > 1 else \
        (lambda a: tuple(a[i] for i in roles.constants))  # (itemgetter of one index gives the item, not a tuple)
    operands_of = itemgetter(roles.q, roles.keys, roles.values)
    addends_of = [itemgetter(i) for i in roles.addends]
    targets = [i for pair in roles.targets for i in pair if i is not None]
    kept[0] = (None,) * len(roles.constants)

    def kernel(*args):
        constants = constants_of(args)
        made = kept[1]
        if not all(map(is_, kept[0], constants)):
            made = _prepare(node, roles, loop, args) if roles.fast else None
            if all(c is None or not c.flags.writeable for c in constants):
                kept[:] = [constants, made]
        if made is None:
            return chained(args)
        q, keys, values = operands_of(args)
        if roles.keys_transposed and keys.ndim == 4:
            keys = keys.swapaxes(2, 3)
        addends = [get(args) for get in addends_of]
        key = (q.shape, keys.shape, values.shape, q.dtype, keys.dtype, values.dtype, *(a.shape for a in addends),
               *(a.dtype for a in addends), *(args[i].tobytes() for i in targets))
        if key != shaped[0]:
            shaped[:] = [key, _takes(roles, q, keys, values, addends, args)
                         and q.shape[2] * keys.shape[2] <= MOST_SCORES]
        if not shaped[1]:
            return chained(args)
        params, tables, steps = made
        out = np.empty(q.shape[:3] + values.shape[3:], _F32)
        four = [a if a.ndim == 4 and a.flags.c_contiguous else
                np.ascontiguousarray(a).reshape((1,) * (4 - a.ndim) + a.shape) for a in addends]
        four += _NO_ADDENDS[len(four):]
        bind.run((np.ascontiguousarray(q), np.ascontiguousarray(keys), np.ascontiguousarray(values), four[0], four[1],
                  roles.group, tables, steps, params, out))
        return (out,)

    return kernel
