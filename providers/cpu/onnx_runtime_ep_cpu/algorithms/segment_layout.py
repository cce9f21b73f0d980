"""Channel-blocked values inside a segment's bound plan (segment_steps.py).

A value is kept blocked, (N, ceil(C / 16), H, W, 16) as onnxruntime's NCHWc, where a step that can write it
blocked writes it and every reader can read it blocked: direct convolutions (compiled/directconv_blocked.py,
as their input or residual), the steps of compiled/blocked_ops.py (depthwise convolutions, squeeze-excitation
blocks, max and average pools: blocked in, blocked out; global average pools: blocked in, plain out), and the
elementwise loops of activation nodes (SiLU, HardSwish, Sigmoid) and residual Adds over the whole blocked buffer,
and channel Concats whose inputs are not convolutions writing in place (a GhostNet module's cheap half is a
depthwise convolution), each input copied into its channels of the blocked output. So a light CNN's block
(expansion, depthwise, squeeze-excitation, projection, residual) and a ResNet's stem and pool stay blocked end to
end, and the layout changes only inside the convolutions at a run's edges. Every other step
(the head, a node's own kernel) and the segment's outputs see the plain layout. The values are those of the
plain plan, to the order of a depthwise convolution's sums.

A channel concatenation of convolutions (a fire module's or an Inception block's: conv_fusions.fuse_concat_convs)
is written by its parts in place, through conv_blocked's image stride: blocked where each part starts at a block
of 16 channels and all but the last fill whole blocks (each part's blocks are then its blocked output), else
plain (a part's channels of each image); a part's copy of its own output into the concatenation goes.
"""

from __future__ import annotations

import numpy as np

from ..fused_domain import CONV_INTO, CONV_RESIDUAL, concat_part

_ACTIVATIONS = (None, "Relu", "Clip", "LeakyRelu", "HardSwish")
# elementwise loops over flat (x, y, ...) that a node binds alone (segment_steps.py): on a blocked value they run
# over its padded lanes too, which nothing reads
_ELEMENTWISE = frozenset({"swish_float32_into", "hard_sigmoid_into", "sigmoid_float32_into"})


def _direct_call(steps, span):
    """The arguments of a node's steps where they are one direct-tiles call, of one group or of groups whose input
    and output channels are whole blocks of 16 (a RegNet's grouped 3x3: each group a call of its own, _grouped),
    else None."""
    from ..compiled import directconv
    from .conv_direct import whole_call

    start, end = span
    if end - start != 1:
        return None
    function, arguments = steps[start]
    if function is not directconv.conv_direct:
        arguments = whole_call(function, arguments)  # (its groups or rows split outside a chain: taken whole here)
        if arguments is None:
            return None
    groups = arguments[1].shape[0]
    if groups > 1 and (arguments[0].shape[1] // groups % 16 or arguments[7].shape[1] // groups % 16):
        return None
    return arguments


def _part_call(steps, span):
    """For a convolution writing its channels of a concatenation of several images (ops/conv.py's into_concat bind:
    the direct tiles into a buffer of its own, then that copied into its channels): the direct call's arguments
    and the channels' view, where the call is one group's without a residual, else None."""
    start, end = span
    if end - start != 2 or steps[start + 1][0] is not np.copyto:
        return None
    arguments = _direct_call(steps, (start, start + 1))
    target, own = steps[start + 1][1]
    y = arguments[7] if arguments is not None else None  # (own, or a 1x1 convolution's row view of it)
    if y is None or y.size != own.size or y.ctypes.data != own.ctypes.data or arguments[4].size \
            or target.dtype != np.float32 or target.strides[1:] != own.strides[1:]:
        return None
    return arguments, target


def _only_call(steps, span, *names: str):
    """The arguments of a node's single step where its loop is one of ``names``, else None."""
    start, end = span
    if end - start != 1 or getattr(steps[start][0], "__name__", "") not in names:
        return None
    return steps[start][1]


def _depthwise(inner, env):
    """(x shape, y shape, packed weights, bias, bounds, hard_swish, geometry) of a float32 2-D depthwise
    convolution with constant weights and explicit pads, else None."""
    from ..compiled import blocked_ops, epilogue
    from ..ops._common import activation_code

    node, slots = inner.node, inner.inputs
    if node.op_type not in ("Conv", "FusedConv") or node.domain not in ("", "ai.onnx", "ai.onnx_runtime.cpu") \
            or len(slots) < 2 or (len(slots) > CONV_RESIDUAL and slots[CONV_RESIDUAL] >= 0) \
            or node.attr("activation") not in _ACTIVATIONS or node.attr("auto_pad", "NOTSET") != "NOTSET":
        return None
    x, w, y = env[slots[0]], env[slots[1]], env[inner.outputs[0]]
    b = env[slots[2]] if len(slots) > 2 and slots[2] >= 0 else None
    if not all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in (x, w, y)) or x.ndim != 4 \
            or w.ndim != 4 or y.ndim != 4 or w.flags.writeable or (b is not None and b.flags.writeable):
        return None
    channels = x.shape[1]
    if int(node.attr("group", 1)) != channels or w.shape[:2] != (channels, 1) or y.shape[:2] != x.shape[:2]:
        return None
    kh, kw = w.shape[2:]
    sh, sw = (int(s) for s in node.attr("strides", (1, 1)))
    dh, dw = (int(d) for d in node.attr("dilations", (1, 1)))
    pads = [int(p) for p in node.attr("pads", (0, 0, 0, 0))]
    expect = tuple((size + pads[a] + pads[a + 2] - d * (k - 1) - 1) // s + 1
                   for a, (size, k, s, d) in enumerate(((x.shape[2], kh, sh, dh), (x.shape[3], kw, sw, dw))))
    if expect != y.shape[2:]:
        return None
    hard_swish = node.attr("activation") == "HardSwish"
    kind, params = activation_code(node) if node.op_type == "FusedConv" and not hard_swish else (epilogue.NONE, ())
    weights, bias = blocked_ops.pack_depthwise(np.asarray(w, np.float32), b, channels)
    return (x.shape, y.shape, weights, bias, epilogue.activation_bounds(kind, params, np.float32), hard_swish,
            (sh, sw, pads[0], pads[1], kh, kw, dh, dw))


class _Kinds:
    """The nodes that can take part, by kind, and what each reads and writes blocked."""

    def __init__(self, segment, steps, spans, env, blocks):
        self.direct, self.depthwise, self.excite, self.means, self.pools = {}, {}, {}, {}, {}
        self.elementwise: dict[int, tuple] = {}
        self.sums: set[int] = set()  # Adds of two values of the output's shape
        self.joins: dict[int, tuple] = {}  # channel Concats of values that are not its convolutions' parts: shape
        # convolutions writing their channels of a concatenation (conv_fusions.fuse_concat_convs): they may read
        # blocked; they write the blocked concatenation where its parts are in whole blocks (concats), else plain
        self.into_concat = {index for index, inner in enumerate(segment.inner) if concat_part(inner.node)}
        self.parts: dict[int, np.ndarray] = {}  # into_concat nodes of several images: the view of their channels
        for index, span in spans.items():
            inner = segment.inner[index]
            if index in blocks:
                members, product, _ = blocks[index]
                arguments = _only_call(steps, span, "squeeze_excite")
                if arguments is not None:
                    self.excite[index] = (set(members), inner.inputs[0], product, arguments)
                continue
            arguments = self._direct_arguments(index, steps, span)
            if arguments is not None:
                self.direct[index] = arguments
                continue
            if span[1] - span[0] == 1 and getattr(steps[span[0]][0], "__name__", "") in _ELEMENTWISE \
                    and len(inner.inputs) == 1 and steps[span[0]][1][0].dtype == np.float32 \
                    and steps[span[0]][1][0].size == steps[span[0]][1][1].size == env[inner.inputs[0]].size:
                self.elementwise[index] = steps[span[0]]
                continue
            if not self._pool(index, inner, steps, span, env) and not self._sum_or_join(index, inner, steps, span, env):
                found = _depthwise(inner, env)
                if found is not None:
                    self.depthwise[index] = found
        self.concats: dict[int, tuple[int, list[int]]] = self._concatenations(segment, env)

    def _direct_arguments(self, index, steps, span):
        """The direct-tiles call's arguments of a convolution that can read or write blocked, else None: a part of
        a concatenation (one group only) through its own buffer and copy (_part_call) where it has one."""
        arguments = _direct_call(steps, span)
        if index not in self.into_concat:
            return arguments
        if arguments is not None and arguments[1].shape[0] == 1:
            return arguments
        found = _part_call(steps, span)
        if found is None or found[0][1].shape[0] > 1:
            return None
        arguments, self.parts[index] = found
        return arguments

    def _concatenations(self, segment, env) -> dict:
        """final slot -> (first slot, part indices) of each concatenation whose parts (into_concat, in order) all
        run as direct tiles without a residual, each starting at a block of 16 channels and all but the last
        filling whole blocks: its blocked value is then each part's blocked output at its blocks, which the parts
        write in place (conv_blocked's image stride)."""
        following = {segment.inner[i].inputs[CONV_INTO]: i for i in self.into_concat
                     if len(segment.inner[i].inputs) > CONV_INTO and segment.inner[i].inputs[CONV_INTO] >= 0}
        found = {}
        for first in self.into_concat:
            inputs = segment.inner[first].inputs
            if len(inputs) > CONV_INTO and inputs[CONV_INTO] >= 0:
                continue  # (not the first part)
            chain = [first]
            while segment.inner[chain[-1]].outputs[0] in following:
                chain.append(following[segment.inner[chain[-1]].outputs[0]])
            total = int(segment.inner[chain[-1]].node.attr("concat_channels"))
            if all(self._whole_blocks(segment.inner[i], self.direct.get(i), i == chain[-1], total, env)
                   for i in chain):
                found[segment.inner[chain[-1]].outputs[0]] = (segment.inner[first].outputs[0], chain)
        return found

    @staticmethod
    def _whole_blocks(inner, arguments, last: bool, total: int, env) -> bool:
        """Whether a part (its direct call's ``arguments``) can write its blocks of the blocked concatenation."""
        if arguments is None or arguments[4].size or int(inner.node.attr("concat_channels")) != total:
            return False
        offset, channels = int(inner.node.attr("concat_offset", 0)), arguments[7].shape[1]
        return offset % 16 == 0 and (last or channels % 16 == 0) and env[inner.outputs[0]].shape[1] == total

    def _pool(self, index, inner, steps, span, env) -> bool:
        """Whether the node is a pool (a mean over its planes, a max or average pool): kept where it can read
        blocked."""
        op = inner.node.op_type if inner.node.domain in ("", "ai.onnx") else None
        if op in ("GlobalAveragePool", "ReduceMean"):
            means = _only_call(steps, span, "plane_means")
            shape = env[inner.inputs[0]].shape  # (a mean over the last two axes of a 4-D value: its planes)
            if means is not None and len(shape) == 4 and means[2] == shape[2] * shape[3] \
                    and means[0].shape == (shape[0] * shape[1], shape[2] * shape[3]):
                self.means[index] = shape
            return True
        if op not in ("MaxPool", "AveragePool"):
            return False
        # (pooling.pool_2d's arguments, is_max the 11th: the op's own loop, or windows.pool_planes for its 3x3 kernel)
        arguments = _only_call(steps, span, "pool_2d", "pool_planes")
        if arguments is not None and bool(arguments[10]) == (op == "MaxPool") and env[inner.inputs[0]].ndim == 4 \
                and env[inner.inputs[0]].dtype == np.float32 and len(inner.node.outputs) == 1:
            self.pools[index] = (env[inner.inputs[0]].shape, env[inner.outputs[0]].shape, arguments)
        return True

    def _sum_or_join(self, index, inner, steps, span, env) -> bool:
        """Whether the node is an Add of two float32 values of its output's 4-D shape or a channel Concat of 4-D
        float32 values, each one numpy step (segment_steps' binds): kept where its inputs and output are blocked."""
        op = inner.node.op_type if inner.node.domain in ("", "ai.onnx") else None
        if op not in ("Add", "Concat") or span[1] - span[0] != 1 or len(inner.node.outputs) != 1:
            return False
        function, _ = steps[span[0]]
        y = env[inner.outputs[0]]
        values = [env[slot] if slot >= 0 else None for slot in inner.inputs]
        if not isinstance(y, np.ndarray) or y.dtype != np.float32 or y.ndim != 4 \
                or not all(isinstance(v, np.ndarray) and v.dtype == np.float32 and v.ndim == 4 for v in values):
            return False
        if op == "Add":
            if function is np.add and len(values) == 2 and all(v.shape == y.shape for v in values):
                self.sums.add(index)
            return True
        if getattr(function, "func", None) is np.concatenate and function.keywords.get("axis") == 1 \
                and all(v.shape[0] == y.shape[0] and v.shape[2:] == y.shape[2:] for v in values):
            self.joins[index] = y.shape
        return True

    def writers(self, segment) -> dict:
        """slot -> the index of the node that can write it blocked."""
        found = {segment.inner[i].outputs[0]: i for i in (*self.direct, *self.depthwise, *self.pools,
                                                          *self.elementwise, *self.sums, *self.joins)
                 if i not in self.into_concat}
        found.update({product: i for i, (_, _, product, _) in self.excite.items()})
        found.update({final: parts[-1] for final, (_, parts) in self.concats.items()})
        return found

    def reads(self, index: int, position: int, slot: int) -> bool:
        """Whether node ``index`` can read its input ``position`` (``slot``) blocked."""
        if index in self.direct:
            return position in (0, CONV_RESIDUAL)
        if index in self.depthwise or index in self.pools or index in self.means or index in self.elementwise:
            return position == 0
        if index in self.sums or index in self.joins:
            return True
        return any(index in members and slot == x for members, x, _, _ in self.excite.values())

    def pairs(self, segment):
        """(input slot, output slot) pairs that must share a layout."""
        for index in (*self.depthwise, *self.pools, *self.elementwise):
            yield segment.inner[index].inputs[0], segment.inner[index].outputs[0]
        for index in (*self.sums, *self.joins):  # (all inputs in the output's layout)
            for slot in segment.inner[index].inputs:
                yield slot, segment.inner[index].outputs[0]
        for _, x, product, _ in self.excite.values():
            yield x, product
        for index in self.direct:
            inner = segment.inner[index]
            if len(inner.inputs) > CONV_RESIDUAL and inner.inputs[CONV_RESIDUAL] >= 0:
                yield inner.inputs[CONV_RESIDUAL], inner.outputs[0]


def _blocked_slots(segment, kinds: _Kinds) -> set:
    """The slots some node writes blocked and all readers read blocked, never a segment input or output, with
    each pair of kinds.pairs in one layout."""
    readers: dict[int, list[tuple[int, int]]] = {}
    for index, inner in enumerate(segment.inner):
        for position, slot in enumerate(inner.inputs):
            readers.setdefault(slot, []).append((index, position))
    results = set(segment.results)
    chosen = set()
    for slot in kinds.writers(segment):
        uses = readers.get(slot, [])
        if slot in results or slot < segment.feeds or not uses:
            continue
        if all(kinds.reads(r, p, slot) for r, p in uses):
            chosen.add(slot)
    pairs = list(kinds.pairs(segment))
    changed = True
    while changed:
        changed = False
        for a, b in pairs:
            if (a in chosen) != (b in chosen):
                chosen.discard(a)
                chosen.discard(b)
                changed = True
    return chosen


def _blocked_size(shape) -> int:
    from ..compiled.directconv import CHANNELS

    return shape[0] * -(-shape[1] // CHANNELS) * CHANNELS * int(np.prod(shape[2:]))


def block_direct_runs(segment, steps: list, spans: dict, env: list, blocks: dict, pool) -> tuple[list, int]:
    """``steps`` with the blocked values of the module doc, and the bytes of the scratch they add (the blocked
    values are ``pool``'s: segment_arena); ``spans``: node index -> (first, end) of its steps; ``env``: the
    node-by-node run's values by slot; ``blocks``: segment_blocks.squeeze_excitations."""
    kinds = _Kinds(segment, steps, spans, env, blocks)
    chosen = _blocked_slots(segment, kinds)
    if not chosen and not kinds.parts:
        return steps, 0
    buffers, into = _blocked_buffers(kinds, chosen, env, pool)
    steps = list(steps)
    for index, arguments in kinds.direct.items():
        _block_direct(segment.inner[index], arguments, chosen, buffers, steps, spans[index][0],
                      kinds.parts.get(index), into.get(index))
    for index, found in kinds.depthwise.items():
        if segment.inner[index].inputs[0] in chosen:
            _block_depthwise(segment.inner[index], found, buffers, steps, spans[index])
    _block_excitations(kinds, chosen, buffers, steps, spans)
    _block_elementwise(segment, kinds, chosen, buffers, steps, spans)
    for index, shape in kinds.means.items():
        x_slot = segment.inner[index].inputs[0]
        if x_slot in chosen:
            steps[spans[index][0]] = (_blocked_ops().plane_means_blocked, (
                buffers[x_slot], steps[spans[index][0]][1][1], shape[0], shape[1], int(np.prod(shape[2:])),
                np.zeros(8 * 16, np.float32)))
    for index, found in kinds.pools.items():
        if segment.inner[index].inputs[0] in chosen:
            _block_pool(segment.inner[index], found, buffers, steps, spans[index][0])
    _block_sums_and_joins(segment, kinds, chosen, buffers, steps, spans, env)
    steps = [each for step in steps if step is not None for each in (step if isinstance(step, list) else [step])]
    tiled = (_blocked_ops().depthwise_blocked, _blocked_ops().max_pool_blocked, _blocked_ops().average_pool_blocked)
    scratch = sum(a.nbytes for f, arguments in steps if f in tiled for a in arguments[-4::3])  # (block, tile)
    from ..compiled.directconv_blocked import conv_blocked

    # the direct convolutions' padded sources (and the gathered ones' pixel starts), once each: a grouped
    # convolution's groups share theirs
    owned = {conv_blocked: slice(8, 9), _gathered().conv_gathered: slice(8, 11)}
    shared = {id(a): a for f, arguments in steps if f in owned for a in arguments[owned[f]]}
    scratch += sum(a.nbytes for a in shared.values())
    return steps, scratch


def _blocked_buffers(kinds, chosen, env, pool) -> tuple[dict, dict]:
    """The chosen slots' blocked buffers, and part index -> the blocked concatenation it writes."""
    # (a concatenation's blocked value lives from its first part on: taken as the first part's slot's)
    buffers = {slot: pool.take(kinds.concats[slot][0] if slot in kinds.concats else slot,
                               (_blocked_size(env[slot].shape),), np.float32, True) for slot in chosen}
    into: dict[int, np.ndarray] = {}
    for final, (_, parts) in kinds.concats.items():
        if final in chosen:
            into.update(dict.fromkeys(parts, buffers[final]))
    return buffers, into


def _block_sums_and_joins(segment, kinds, chosen, buffers, steps, spans, env) -> None:
    """Each Add of two blocked values as one flat sum over their blocked buffers; each channel Concat of blocked
    values as one copy per input into its channels of the blocked output, in input order (a list of steps in
    the Concat's place)."""
    from ..compiled.segment_loops import add_float32_into

    for index in kinds.sums:
        inner = segment.inner[index]
        if inner.outputs[0] in chosen:
            a, b = inner.inputs
            steps[spans[index][0]] = (add_float32_into, (buffers[a], buffers[b], buffers[inner.outputs[0]]))
    for index, shape in kinds.joins.items():
        inner = segment.inner[index]
        if inner.outputs[0] in chosen:
            y, copies, offset = buffers[inner.outputs[0]], [], 0
            for slot in inner.inputs:
                channels = env[slot].shape[1]
                copies.append((_blocked_ops().copy_channels_blocked, (
                    buffers[slot], y, shape[0], channels, offset, shape[1], shape[2] * shape[3])))
                offset += channels
            steps[spans[index][0]] = copies


def _block_excitations(kinds, chosen, buffers, steps, spans) -> None:
    """Each squeeze-excitation block over a blocked value as its blocked loop."""
    for index, (_, x_slot, product, arguments) in kinds.excite.items():
        if x_slot in chosen:
            n, c, pixels = arguments[0].shape
            blocked = -(-c // 16) * 16
            steps[spans[index][0]] = (_blocked_ops().squeeze_excite_blocked, (
                buffers[x_slot], *arguments[1:11], buffers[product], n, c, pixels, np.zeros(blocked, np.float32),
                arguments[13], np.zeros(blocked, np.float32)))


def _block_elementwise(segment, kinds, chosen, buffers, steps, spans) -> None:
    """Each activation loop over a blocked value over its blocked buffers."""
    for index, (function, arguments) in kinds.elementwise.items():
        inner = segment.inner[index]
        if inner.inputs[0] in chosen:
            steps[spans[index][0]] = (function, (buffers[inner.inputs[0]], buffers[inner.outputs[0]], *arguments[2:]))


def _block_depthwise(inner, found, buffers, steps, span) -> None:
    """A depthwise convolution's steps as one blocked step (its span's further places None)."""
    ops = _blocked_ops()
    x_shape, y_shape, weights, bias, bounds, hard_swish, (sh, sw, top, left, kh, kw, dh, dw) = found
    rows, columns, size = ops.padded_size(*x_shape[2:], *y_shape[2:], sh, sw, top, left, kh, kw, dh, dw)
    steps[span[0]:span[1]] = [(ops.depthwise_blocked, (
        buffers[inner.inputs[0]], weights, ops.depthwise_taps(kh, kw, dh, dw, columns), bias, bounds, int(hard_swish),
        buffers[inner.outputs[0]], x_shape[0], -(-x_shape[1] // 16), x_shape[2], x_shape[3], y_shape[2], y_shape[3],
        sh, sw, top, left, np.zeros(size, np.float32), rows, columns, np.zeros(ops.PIXELS * 16, np.float32)))] \
        + [None] * (span[1] - span[0] - 1)


def _block_pool(inner, found, buffers, steps, at) -> None:
    """A max or average pool's step (pooling.pool_2d's arguments) over its blocked input and output: the window
    sums' reciprocal tap counts precomputed for an average, whose pads are zeros (a max's -inf)."""
    ops = _blocked_ops()
    x_shape, y_shape, arguments = found
    kh, kw, sh, sw, dh, dw, top, left, is_max, lo_h, hi_h, lo_w, hi_w = arguments[2:15]
    rows, columns, size = ops.padded_size(*x_shape[2:], *y_shape[2:], sh, sw, top, left, kh, kw, dh, dw)
    geometry = (x_shape[0], -(-x_shape[1] // 16), x_shape[2], x_shape[3], y_shape[2], y_shape[3], sh, sw, top, left)
    taps = ops.depthwise_taps(kh, kw, dh, dw, columns)
    tile = np.zeros(ops.PIXELS * 16, np.float32)
    x, y = buffers[inner.inputs[0]], buffers[inner.outputs[0]]
    if is_max:
        steps[at] = (ops.max_pool_blocked, (x, taps, y, *geometry, np.full(size, -np.inf, np.float32), rows, columns,
                                            tile))
    else:
        scale = ops.mean_scale(y_shape[2], y_shape[3], kh, kw, sh, sw, dh, dw, (lo_h, hi_h), (lo_w, hi_w))
        steps[at] = (ops.average_pool_blocked, (x, taps, scale, y, *geometry, np.zeros(size, np.float32), rows,
                                                columns, tile))


def _blocked_ops():
    from ..compiled import blocked_ops

    return blocked_ops


def _block_direct(inner, arguments, chosen, buffers, steps, at, part=None, concatenation=None) -> None:
    """A direct convolution's step over its blocked input, output or residual. A part of a concatenation
    (into_concat) writes its channels there: where ``concatenation`` is given, at its blocks of that blocked value;
    else, where ``part`` is the view of its channels in the plain one of several images (_part_call), through it
    (its copy dropped either way)."""
    from ..compiled import directconv_blocked as kernel

    x_slot, y_slot = inner.inputs[0], inner.outputs[0]
    residual_slot = inner.inputs[CONV_RESIDUAL] if len(inner.inputs) > CONV_RESIDUAL else -1
    if x_slot not in chosen and y_slot not in chosen and part is None and concatenation is None:
        return
    x, weights, offsets, bias, residual, bounds, flags, y, sh, sw, top, left, height, width, in_place = arguments
    if x_slot in chosen:
        offsets = kernel.blocked_taps(offsets, int(height) * int(width))
    flat_x = buffers[x_slot] if x_slot in chosen else x.reshape(-1)
    flat_y = buffers[y_slot] if y_slot in chosen else y.reshape(-1)
    y_image, y_blocked = 0, y_slot in chosen
    if part is not None:
        steps[at + 1] = None
    if concatenation is not None:
        plane = y.shape[2] * y.shape[3]
        total = -(-int(inner.node.attr("concat_channels")) // 16) * 16
        flat_y = concatenation[int(inner.node.attr("concat_offset", 0)) * plane:]
        y_image, y_blocked = total * plane, True
    elif part is not None:  # (from its first channel of the first image to its last of the last, one flat view)
        y_image = part.strides[0] // part.itemsize
        flat_y = np.lib.stride_tricks.as_strided(part, ((part.shape[0] - 1) * y_image + part[0].size,),
                                                 (part.itemsize,))
    if residual.size and residual_slot in chosen:
        residual = buffers[residual_slot]
    if weights.shape[0] > 1:
        steps[at] = _grouped(arguments, flat_x, x_slot in chosen, flat_y, y_blocked, residual, offsets,
                             gathered=x_slot in chosen and y_blocked and concatenation is None and part is None
                             and y.shape[3] < _gathered().PIXELS and (not residual.size or residual_slot in chosen))
        return
    if x_slot in chosen and y_slot in chosen and concatenation is None and y.shape[3] < _gathered().PIXELS \
            and (not residual.size or residual_slot in chosen):
        steps[at] = _gathered_step(flat_x, weights, offsets, bias, residual, bounds, flags, flat_y, x.shape,
                                   y.shape, (sh, sw, top, left, int(height), int(width)))
        return
    source = np.zeros(kernel.source_size(x.shape[1], int(height), int(width), int(sw), x_slot in chosen,
                                         bool(in_place)), np.float32)  # (the pads stay zero: calls fill the rest)
    steps[at] = (kernel.conv_blocked, (
        flat_x, weights, offsets, bias, residual, bounds, flags, flat_y, source, sh, sw, top, left, height, width,
        in_place, *x.shape, x_slot in chosen, *y.shape[1:], y_blocked, y_image))


def _grouped(arguments, flat_x, x_blocked: bool, flat_y, y_blocked: bool, residual, offsets,
             gathered: bool = False) -> list:
    """A grouped convolution's steps over blocked or plain values: one conv_blocked call per image and group, each
    over its group's channels (whole blocks of 16 in and out: _direct_call), sharing one padded source. Where
    ``gathered`` (blocked input, output and residual, output rows narrower than a tile: RegNet's 4x4 and 7x7 maps),
    conv_gathered calls instead, whose tiles span rows (a 4-pixel row filled half of conv_blocked's), sharing their
    source and pixel starts."""
    from ..compiled import directconv_blocked as kernel

    x, weights, _, bias, _, bounds, flags, y, sh, sw, top, left, height, width, in_place = arguments
    images, channels, rows, columns = x.shape
    groups, outputs, oh, ow = weights.shape[0], y.shape[1], y.shape[2], y.shape[3]
    per_group, out_group = channels // groups, outputs // groups
    x_image, y_image = channels * rows * columns, outputs * oh * ow  # (whole blocks: as long blocked as plain)
    flat_residual = residual.reshape(-1)
    if gathered:  # (group 0's call: its source, pixel starts and offsets serve every group)
        gathered_call, shared = _gathered_step(flat_x, weights[:1], offsets, bias[:1], residual, bounds, flags,
                                               flat_y, (1, per_group, rows, columns), (1, out_group, oh, ow),
                                               (sh, sw, top, left, int(height), int(width)))
    else:
        source = np.zeros(kernel.source_size(per_group, int(height), int(width), int(sw), x_blocked,
                                             bool(in_place)), np.float32)
    steps = []
    for n in range(images):
        for g in range(groups):
            into = n * y_image + g * out_group * oh * ow
            group_x, group_residual = flat_x[n * x_image + g * per_group * rows * columns:], \
                flat_residual[into:] if residual.size else residual
            if gathered:
                steps.append((gathered_call, (group_x, weights[g:g + 1], shared[2], bias[g:g + 1], group_residual,
                                         *shared[5:7], flat_y[into:], *shared[8:])))
                continue
            steps.append((kernel.conv_blocked, (
                group_x, weights[g:g + 1], offsets, bias[g:g + 1], group_residual, bounds, flags, flat_y[into:],
                source, sh, sw, top, left, height, width, in_place, 1, per_group, rows, columns, x_blocked,
                out_group, oh, ow, y_blocked, 0)))
    return steps


def _gathered():
    from ..compiled import directconv_gathered

    return directconv_gathered


def _gathered_step(x, weights, offsets, bias, residual, bounds, flags, y, x_shape, y_shape, geometry):
    """A blocked convolution whose output rows are narrower than a tile, in tiles of any pixels across rows and
    images (compiled/directconv_gathered.py); a pointwise one without pads reads its input in place."""
    from ..compiled import directconv, directconv_blocked

    ops = _gathered()
    sh, sw, top, left, padded_height, padded_width = geometry
    images, channels, height, width = x_shape
    stored = -(-channels // 16) * 16
    in_place = top == left == 0 and weights.shape[2] == channels  # (one tap per channel: a 1x1 kernel)
    if in_place:
        padded_height, padded_width = height, width
        offsets = directconv_blocked.blocked_taps(directconv.tap_offsets(
            channels, 1, 1, 1, 1, width, height * width), height * width)
    source = np.zeros(0 if in_place else images * stored * padded_height * padded_width, np.float32)
    starts, outs = ops.gathered_offsets(images, stored, padded_height, padded_width, y_shape[2], y_shape[3], sh, sw,
                                        weights.shape[1])
    return (ops.conv_gathered, (
        x, weights, offsets, bias, residual, bounds, flags, y, source, starts, outs, images * y_shape[2] * y_shape[3],
        images, stored, height, width, top, left, padded_height, padded_width, in_place, y_shape[2] * y_shape[3]))
