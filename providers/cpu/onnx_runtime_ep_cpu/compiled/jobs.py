"""The kinds of job the helper threads of workers.py run: for each, its arguments described once as
mailbox fields (mailbox.py), from which workers.Kind generates the compiled writer that puts one part's
arguments into a mailbox and the reader of its runner (compiled on first use as a C callback), which
calls the kind's body with them by name; and the compiled callers that post the parts (split_*)."""

from __future__ import annotations

import numpy as np

from . import (
    attention,
    depthwise,
    depthwise_blocks,
    directconv,
    epilogue,
    few_rows,
    gemm,
    gemv,
    jit,
    lanes,
    matmul,
    pooling,
    quantize,
    segment_loops,
    windows,
)
from .mailbox import STORED, byte_codes, flag, floats, ints, offsets, pair, scalar
from .workers import Kind, claim_task, collect, float_array, offer, run_here


@jit
def _run_conv(xp, weights, bias, y, residual, flags, bounds, m_rows, oh, ow, grid, channels, kh, kw, sh, sw, dh, dw,
              wp, plane, by_lanes, taps, packed, tasks, ranges, claims, part, scratch):
    cursor = np.zeros(1, dtype=np.int64)
    while True:  # the part's own tasks in order, then those the other parts' threads have not claimed yet
        i = claim_task(claims, ranges, part, cursor)
        if i < 0:
            break
        task = tasks[i:i + 1]
        if by_lanes:
            lanes.lane_tasks(xp, weights, bias, y, residual, flags, bounds, m_rows, oh, ow, channels, sh, sw, wp,
                             plane, taps, task)
        else:
            gemm.conv_tasks(xp, weights, bias, y, residual, flags, bounds, m_rows, oh, ow, grid, channels, kh, kw,
                            sh, sw, dh, dw, wp, plane, taps, packed, task, scratch)


# gemm.conv_tasks, or lanes.lane_tasks where by_lanes, one part. Part p's tasks (image, group, first panel,
# end panel, first tile, end tile) are tasks[ranges[p]:ranges[p + 1]], claimed one by one through claims[p]
# (zeros at first): the part's thread runs its own, then those no other part's thread has claimed.
CONV = Kind("conv", (
    floats("xp", 2), floats("weights", 3), floats("bias", 2), floats("y", 2), floats("residual", 2), scalar("flags"),
    floats("bounds", shape=(3,)), scalar("m_rows"), scalar("oh"), scalar("ow"), scalar("grid"), scalar("channels"),
    scalar("kh"), scalar("kw"), scalar("sh"), scalar("sw"), scalar("dh"), scalar("dw"), scalar("wp"), scalar("plane"),
    scalar("by_lanes"), ints("taps"), ints("packed"), ints("tasks", shape=(STORED, 6)),
    ints("ranges", shape=("claims.shape[0] + 1",)), ints("claims"), scalar("part"),
), _run_conv, scratch=lambda channels, kh, kw: gemm.scratch_size(channels * kh * kw), home=__name__)
_write_conv = CONV.writer


@jit
def split_conv(xp, weights, bias, y, residual, flags, bounds, geometry, taps, packed, tasks, ranges, claims, own,
               mailboxes, states, runner):
    """A packed convolution's tasks in parts (see CONV): part i > 0 posted to helper i - 1 from here (as
    split_product's), part 0 run on the calling thread through ``own``, its mailbox (workers.local_mailbox),
    by the same runner as the helpers' (conv_tasks compiled into this function was slower on whole models:
    6ce6c5d); the caller then claims what no helper has (the parts of helpers asleep or missing, and the
    tasks of a helper that fell behind). ``geometry`` holds conv_tasks' scalars (m_rows, oh, ow, grid,
    channels, kh, kw, sh, sw, dh, dw, wp, plane) and by_lanes (lanes.lane_tasks runs the parts); ``claims``
    zeros, one per part. Returns workers.collect's result."""
    m_rows, oh, ow, grid, channels, kh, kw = geometry[0], geometry[1], geometry[2], geometry[3], geometry[4], \
        geometry[5], geometry[6]
    sh, sw, dh, dw, wp, plane = geometry[7], geometry[8], geometry[9], geometry[10], geometry[11], geometry[12]
    by_lanes = geometry[13]
    parts = ranges.shape[0] - 1
    helpers = min(parts - 1, mailboxes.shape[0])
    for part in range(1, helpers + 1):
        _write_conv(mailboxes[part - 1], xp, weights, bias, y, residual, flags, bounds, m_rows, oh, ow, grid,
                    channels, kh, kw, sh, sw, dh, dw, wp, plane, by_lanes, taps, packed, tasks, ranges, claims, part)
        offer(mailboxes, states, part - 1, runner)
    _write_conv(own, xp, weights, bias, y, residual, flags, bounds, m_rows, oh, ow, grid, channels, kh, kw, sh, sw,
                dh, dw, wp, plane, by_lanes, taps, packed, tasks, ranges, claims, 0)
    run_here(runner, own)
    return collect(mailboxes, states, helpers)


@jit
def _run_matmul(x, lda, rows, depth, packed, offsets, bias, y, n, residual, flags, coefficients, bounds, ranges, claims,
                part, scratch):
    cursor = np.zeros(1, dtype=np.int64)
    while True:  # the part's own tasks, then those the other parts' threads have not claimed
        i = claim_task(claims, ranges, part, cursor)
        if i < 0:
            break
        if rows <= few_rows.PANEL_ROWS:  # (a few rows' product: the same sums in tiles of all its rows)
            few_rows.few_row_panels(x, lda, rows, depth, packed, offsets, bias, y, n, residual, flags, coefficients,
                                    bounds[i], bounds[i + 1], scratch)
        else:
            matmul.matmul_panels(x, lda, rows, depth, packed, offsets, bias, y, n, residual, flags, coefficients,
                                 bounds[i], bounds[i + 1], scratch)


# matmul.matmul_panels, one part. Task i covers panels bounds[i] .. bounds[i + 1]; part p's tasks are
# ranges[p] .. ranges[p + 1], claimed one by one through claims[p] (zeros at first), as CONV's.
MATMUL = Kind("matmul", (
    floats("x"), scalar("lda"), scalar("rows"), scalar("depth"), floats("packed", 2), ints("offsets"), floats("bias"),
    floats("y"), scalar("n"), floats("residual"), scalar("flags"), floats("coefficients"), ints("bounds"),
    ints("ranges", shape=("claims.shape[0] + 1",)), ints("claims"), scalar("part"),
), _run_matmul, scratch=lambda depth: matmul.scratch_size(depth), home=__name__)
_write_matmul = MATMUL.writer


@jit
def split_matmul(x, lda, rows, depth, packed, offsets, bias, y, n, residual, flags, coefficients, bounds, ranges,
                 claims, own, mailboxes, states, runner):
    """A packed MatMul's panel tasks in parts (see MATMUL), posted as split_conv's: part 0 on the calling
    thread through ``own``, which then claims what no helper has. Returns workers.collect's result."""
    parts = ranges.shape[0] - 1
    helpers = min(parts - 1, mailboxes.shape[0])
    for part in range(1, helpers + 1):
        _write_matmul(mailboxes[part - 1], x, lda, rows, depth, packed, offsets, bias, y, n, residual, flags,
                      coefficients, bounds, ranges, claims, part)
        offer(mailboxes, states, part - 1, runner)
    _write_matmul(own, x, lda, rows, depth, packed, offsets, bias, y, n, residual, flags, coefficients, bounds, ranges,
                  claims, 0)
    run_here(runner, own)
    return collect(mailboxes, states, helpers)


@jit
def _run_attention(q, q_strides, k, k_strides, v, v_strides, y, y_strides, heads, kv_heads, total, head_size,
                   value_size, scale, mask, plan, extents, first, end, status, scratch):
    attention.attention_units(q, q_strides, k, k_strides, v, v_strides, y, y_strides, heads, kv_heads, total,
                              head_size, value_size, scale[0], mask, plan, extents, first, end, scratch, status)


# attention.attention_units, one part: units first .. end; ``scale`` a float32 array of one.
ATTENTION = Kind("attention", (
    floats("q"), ints("q_strides", shape=(3,)), floats("k"), ints("k_strides", shape=(3,)), floats("v"),
    ints("v_strides", shape=(3,)), floats("y"), ints("y_strides", shape=(3,)), scalar("heads"), scalar("kv_heads"),
    scalar("total"), scalar("head_size"), scalar("value_size"), floats("scale", shape=(1,)), floats("mask", 2),
    ints("plan", shape=(STORED, 3)), ints("extents", shape=("plan.shape[0]",)), scalar("first"), scalar("end"),
    ints("status", shape=(1,)),
), _run_attention, scratch=lambda head_size, value_size, total: attention.scratch_size(head_size, value_size, total),
    home=__name__)
_write_attention = ATTENTION.writer


@jit
def split_attention(q, q_strides, k, k_strides, v, v_strides, y, y_strides, heads, kv_heads, total, head_size,
                    value_size, scale, mask, plan, extents, bounds, status, own, mailboxes, states, runner):
    """Attention's units in parts, bounds[i] .. bounds[i + 1] for part i, posted as split_conv's. Returns
    workers.collect's result."""
    parts = bounds.shape[0] - 1
    helpers = min(parts - 1, mailboxes.shape[0])
    here = np.ones(parts, dtype=np.bool_)
    for part in range(1, helpers + 1):
        _write_attention(mailboxes[part - 1], q, q_strides, k, k_strides, v, v_strides, y, y_strides, heads,
                         kv_heads, total, head_size, value_size, scale, mask, plan, extents, bounds[part],
                         bounds[part + 1], status)
        here[part] = not offer(mailboxes, states, part - 1, runner)
    for part in range(parts):
        if here[part]:
            _write_attention(own, q, q_strides, k, k_strides, v, v_strides, y, y_strides, heads, kv_heads, total,
                             head_size, value_size, scale, mask, plan, extents, bounds[part], bounds[part + 1],
                             status)
            run_here(runner, own)
    return collect(mailboxes, states, helpers)


@jit
def product_items(transposed, a, w, sums, spans, first, end):
    """Work items first .. end of a few-row product: column spans of y = a @ w.T (``transposed``, w
    N x K; ``spans`` of them) into sums[0], or gemv.rows_times's (block, span) items of y = a @ w
    (block b's sums into sums[b]; gemv.sum_blocks adds them into sums[0])."""
    if transposed:
        n = w.shape[0]
        gemv.rows_times_transposed(a, w, sums[0], n * first // spans, n * end // spans)
    else:
        gemv.rows_times(a, w, sums, spans, first, end)


@jit
def product(transposed, a, w, sums, spans, items):
    """Every item of a few-row product on the calling thread; the result in sums[0]."""
    product_items(transposed, a, w, sums, spans, 0, items)
    gemv.sum_blocks(sums)


# product_items, one part: items first .. end.
PRODUCT = Kind("product", (
    flag("transposed"), floats("a", 2), floats("w", 2), floats("sums", 3), scalar("spans"), scalar("first"),
    scalar("end"),
), product_items, home=__name__)
_write_product = PRODUCT.writer


@jit
def split_product(transposed, a, w, sums, spans, items, parts, mailboxes, states, runner):
    """A few-row product's ``items`` in ``parts`` parts: part 0 on the calling thread, part i on helper
    i - 1 (on the caller when that helper is asleep or missing), posted from here (workers.offer:
    the per-call Python of workers.run would cost as much as a decode step's product), then the
    block sums added. Returns workers.collect's result."""
    helpers = min(parts - 1, mailboxes.shape[0])
    for part in range(1, parts):
        first, end = items * part // parts, items * (part + 1) // parts
        if part - 1 < helpers:
            _write_product(mailboxes[part - 1], transposed, a, w, sums, spans, first, end)
            if offer(mailboxes, states, part - 1, runner):
                continue
        product_items(transposed, a, w, sums, spans, first, end)
    product_items(transposed, a, w, sums, spans, 0, items // parts)
    result = collect(mailboxes, states, helpers)
    gemv.sum_blocks(sums)
    return result


@jit
def pad_channels(x, out, top, left, padded_height, padded_width, first, end):
    """gemm.pad_planes for channels first .. end of x (C, H, W) into their planes of ``out`` (the last
    channels' part also zeroes the margin past the planes)."""
    plane = padded_height * padded_width
    stop = out.shape[0] if end == x.shape[0] else end * plane
    gemm.pad_planes(x[first:end], out[first * plane:stop], top, left, padded_height, padded_width)


# pad_channels, one part: channels first .. end.
PAD = Kind("pad", (
    floats("x", 3), floats("out"), scalar("top"), scalar("left"), scalar("padded_height"), scalar("padded_width"),
    scalar("first"), scalar("end"),
), pad_channels, home=__name__)
_write_pad = PAD.writer


@jit
def split_pad(x, out, top, left, padded_height, padded_width, mailboxes, states, runner):
    """A convolution's padded input (gemm.pad_planes) with its channels split between the calling thread and
    the helpers, posted as split_product's parts (a helper asleep or missing: its part here). Memory-bound,
    so the second core's bandwidth halves it. Returns workers.collect's result."""
    channels = x.shape[0]
    parts = min(mailboxes.shape[0] + 1, channels)
    for part in range(1, parts):
        first, end = channels * part // parts, channels * (part + 1) // parts
        _write_pad(mailboxes[part - 1], x, out, top, left, padded_height, padded_width, first, end)
        if not offer(mailboxes, states, part - 1, runner):
            pad_channels(x, out, top, left, padded_height, padded_width, first, end)
    pad_channels(x, out, top, left, padded_height, padded_width, 0, channels // parts)
    return collect(mailboxes, states, parts - 1)


@jit
def _run_direct(x, weights, offsets, bias, residual, bounds, flags, y, sh, sw, top, left, padded_height, padded_width,
                in_place, cuts, ranges, claims, part):
    groups = weights.shape[0]
    channels, outputs = x.shape[1] // groups, y.shape[1] // groups
    plane, out_plane, depth, width = x.shape[2] * x.shape[3], y.shape[2] * y.shape[3], weights[0].size, bias.shape[1]
    cursor = np.zeros(1, dtype=np.int64)
    while True:  # the part's own tasks, then those the other parts' threads have not claimed
        i = claim_task(claims, ranges, part, cursor)
        if i < 0:
            break
        first, count = cuts[i], cuts[i + 1] - cuts[i]
        part_residual = residual if residual.size == 0 else float_array(
            residual.ctypes.data + 4 * first * outputs * out_plane, (count * outputs * out_plane,))
        directconv.conv_direct(
            float_array(x.ctypes.data + 4 * first * channels * plane, (1, count * channels, x.shape[2], x.shape[3])),
            float_array(weights.ctypes.data + 4 * first * depth,
                        (count, weights.shape[1], weights.shape[2], weights.shape[3])),
            offsets, float_array(bias.ctypes.data + 4 * first * width, (count, width)), part_residual, bounds, flags,
            float_array(y.ctypes.data + 4 * first * outputs * out_plane, (1, count * outputs, y.shape[2], y.shape[3])),
            sh, sw, top, left, padded_height, padded_width, in_place)


# directconv.conv_direct over one image's groups, claimed as tasks: task i is groups cuts[i] .. cuts[i + 1] (their
# input channels, packed weights, bias rows, output channels and residual apart: conv_direct.DirectConv's group
# tasks), part p's tasks ranges[p] .. ranges[p + 1] claimed through claims[p] (zeros at each run's start).
DIRECT = Kind("direct", (
    floats("x", 4), floats("weights", 4), ints("offsets"), floats("bias", 2), floats("residual"),
    floats("bounds", shape=(3,)), scalar("flags"), floats("y", 4), scalar("sh"), scalar("sw"), scalar("top"),
    scalar("left"), scalar("padded_height"), scalar("padded_width"), flag("in_place"), ints("cuts"),
    ints("ranges", shape=("claims.shape[0] + 1",)), ints("claims"), scalar("part"),
), _run_direct, home=__name__)


@jit
def _run_direct_rows(x, weights, offsets, bias, residual, bounds, flags, y, sh, sw, cuts, ranges, claims, part):
    image = x[0].reshape(-1)
    cursor = np.zeros(1, dtype=np.int64)
    while True:  # the part's own tasks, then those the other parts' threads have not claimed
        i = claim_task(claims, ranges, part, cursor)
        if i < 0:
            break
        directconv.conv_direct_span(image, weights, offsets, bias, residual, bounds, flags, y, 0, 0, sh, sw,
                                    x.shape[3], cuts[i], cuts[i + 1])


# directconv.conv_direct of one image and one group that reads x in place (no pads), its row chunks claimed as
# tasks: task i is chunks cuts[i] .. cuts[i + 1] of every channel tile (directconv.conv_direct_span), part p's tasks
# ranges[p] .. ranges[p + 1] claimed through claims[p] (zeros at each run's start).
DIRECT_ROWS = Kind("direct_rows", (
    floats("x", 4), floats("weights", 4), ints("offsets"), floats("bias", 2), floats("residual"),
    floats("bounds", shape=(3,)), scalar("flags"), floats("y", 4), scalar("sh"), scalar("sw"), ints("cuts"),
    ints("ranges", shape=("claims.shape[0] + 1",)), ints("claims"), scalar("part"),
), _run_direct_rows, home=__name__)


@jit
def _run_pool(planes, rows, kh, kw, sh, sw, dh, dw, ph, pw, is_max, lo_h, hi_h, lo_w, hi_w):
    windows.pool_planes(planes, rows, kh, kw, sh, sw, dh, dw, ph, pw, is_max, lo_h, hi_h, lo_w, hi_w)


# pooling.pool_2d, one part (its planes); a 3x3 pool of stride 1 or 2 by windows.pool.
POOL = Kind("pool", (
    floats("planes", 3), floats("rows", 3), scalar("kh"), scalar("kw"), scalar("sh"), scalar("sw"), scalar("dh"),
    scalar("dw"), scalar("ph"), scalar("pw"), flag("is_max"), scalar("lo_h"), scalar("hi_h"), scalar("lo_w"),
    scalar("hi_w"),
), _run_pool, home=__name__)
_write_pool = POOL.writer


# quantize.dequantized_sum, one part (its span of the flat codes' bytes): QuantizedAdd (ops/qdq_add.py).
DEQUANTIZED_SUM = Kind("dequantized_sum", (
    byte_codes("a"), byte_codes("b"), floats("params", shape=(8,)), flag("relu"), flag("signed"),
    byte_codes("out", shape=("a.shape[0]",)),
), quantize.dequantized_sum, home=__name__)


# epilogue.channel_affine, one part (its channels): float32 (N, C, P) arrays.
AFFINE = Kind("affine", (
    floats("x", 3), floats("factor", shape=("x.shape[1]",)), floats("shift", shape=("x.shape[1]",)),
    floats("out", shape=("x.shape[0]", "x.shape[1]", "x.shape[2]")), scalar("kind"), floats("params", shape=(2,)),
), epilogue.channel_affine, home=__name__)
_write_affine = AFFINE.writer


# depthwise.run, one part of DepthwisePlan.split_channels (see split_depthwise).
DEPTHWISE = Kind("depthwise", (
    floats("x"), floats("weights"), floats("bias"), floats("y"), scalar("n_images"), scalar("channels"),
    pair("in_shape"), pair("out"), pair("strides"), pair("begin"), offsets("taps"), scalar("rows"), scalar("width"),
    scalar("size"), offsets("inputs"), offsets("places", shape=("inputs.shape[0]",)), offsets("grid"),
    offsets("source"), floats("activation", shape=(3,)), scalar("direct"),
), depthwise.run, home=__name__)
_write_depthwise = DEPTHWISE.writer


@jit
def _run_depthwise_blocks(x, weights, offsets, bias, bounds, y, images, channels, height, width, oh, ow, sh, sw,
                          padded_width, places, starts, source, out, cuts, ranges, claims, part):
    cursor = np.zeros(1, dtype=np.int64)
    while True:  # the part's own tasks, then those the other parts' threads have not claimed
        i = claim_task(claims, ranges, part, cursor)
        if i < 0:
            break
        depthwise_blocks.depthwise_channel_blocks(x, weights, offsets, bias, bounds, y, images, channels, height,
                                                  width, oh, ow, sh, sw, padded_width, places, starts, source, out,
                                                  cuts[i], cuts[i + 1])


# depthwise_blocks.depthwise_channel_blocks over claimed tasks: task i is channel blocks cuts[i] .. cuts[i + 1] of
# every image, part p's tasks ranges[p] .. ranges[p + 1] claimed through claims[p] (zeros at each run's start), each
# part with scratch planes of its own (``source``, ``out``).
DEPTHWISE_BLOCKS = Kind("depthwise_blocks", (
    floats("x"), floats("weights"), ints("offsets"), floats("bias"), floats("bounds", shape=(3,)), floats("y"),
    scalar("images"), scalar("channels"), scalar("height"), scalar("width"), scalar("oh"), scalar("ow"), scalar("sh"),
    scalar("sw"), scalar("padded_width"), ints("places"), ints("starts"), floats("source"), floats("out"),
    ints("cuts"), ints("ranges", shape=("claims.shape[0] + 1",)), ints("claims"), scalar("part"),
), _run_depthwise_blocks, home=__name__)


# ELEMENTWISE's ``loop`` codes: segment_loops' elementwise loops, and a squeeze-excitation block's plane means and
# scaling of its planes
SWISH, SIGMOID, HARD_SIGMOID, ADD, MEANS, SCALE = 0, 1, 2, 3, 4, 5


@jit
def _run_elementwise(loop, x, b, y, params, flag, width, cuts, ranges, claims, part):
    cursor = np.zeros(1, dtype=np.int64)
    while True:  # the part's own tasks, then those the other parts' threads have not claimed
        i = claim_task(claims, ranges, part, cursor)
        if i < 0:
            break
        first, end = cuts[i], cuts[i + 1]
        if loop == SWISH:
            segment_loops.swish_float32_into(x[first:end], y[first:end], params[0])
        elif loop == SIGMOID:
            segment_loops.sigmoid_float32_into(x[first:end], y[first:end])
        elif loop == HARD_SIGMOID:
            segment_loops.hard_sigmoid_into(x[first:end], y[first:end], params[0], params[1], flag)
        elif loop == ADD:
            segment_loops.add_float32_into(x[first:end], b[first:end], y[first:end])
        elif loop == MEANS:
            pooling.plane_means(x[first * width:end * width].reshape((end - first, width)), b[first:end],
                                np.float32(width))
        else:
            for c in range(first, end):
                factor = b[c]
                for p in range(c * width, (c + 1) * width):
                    y[p] = x[p] * factor


# Over flat float32 arrays, claimed as tasks (part p's tasks ranges[p] .. ranges[p + 1] claimed through claims[p],
# zeros at each run's start): an elementwise loop of segment_loops (``loop`` SWISH .. ADD; ``b`` the sum's second
# operand, ``params`` alpha and beta), task i elements cuts[i] .. cuts[i + 1]; or one image's squeeze-excitation
# passes over its planes of ``width`` values, task i planes cuts[i] .. cuts[i + 1]: MEANS, each plane's mean of x into
# ``b``, or SCALE, y = x times ``b`` per plane.
ELEMENTWISE = Kind("elementwise", (
    scalar("loop"), floats("x"), floats("b"), floats("y"), floats("params", shape=(2,)), flag("flag"), scalar("width"),
    ints("cuts"), ints("ranges", shape=("claims.shape[0] + 1",)), ints("claims"), scalar("part"),
), _run_elementwise, home=__name__)


@jit
def _write_depthwise_channels(m, x, weights, bias, y, multiplier, in_shape, out, strides, begin, taps, rows, width,
                              size, inputs, places, grid, source, activation, direct, first, end):
    """_write_depthwise for channels first .. end of one image (weights (M, K), bias (M,), y (M, P))."""
    a, b = first * multiplier, end * multiplier
    _write_depthwise(m, x, weights[a:b].reshape(-1), bias[a:b], y[a:b].reshape(-1), 1, end - first, in_shape, out,
                     strides, begin, taps, rows, width, size, inputs, places, grid, source[first:end], activation,
                     direct)


@jit
def split_depthwise(x, weights, bias, y, multiplier, in_shape, out, strides, begin, taps, rows, width, size, inputs,
                    places, grid, source, activation, direct, bounds, own, mailboxes, states, runner):
    """One image's depthwise convolution in parts, channels bounds[i] .. bounds[i + 1] for part i (weights
    (M, K), bias (M,) and y (M, P) per output channel, ``multiplier`` outputs per channel), posted as
    split_conv's (workers.run's Python cost a small layer measurably more: 8de201a). Returns
    workers.collect's result."""
    parts = bounds.shape[0] - 1
    helpers = min(parts - 1, mailboxes.shape[0])
    here = np.ones(parts, dtype=np.bool_)
    for part in range(1, helpers + 1):
        _write_depthwise_channels(mailboxes[part - 1], x, weights, bias, y, multiplier, in_shape, out, strides, begin,
                                  taps, rows, width, size, inputs, places, grid, source, activation, direct,
                                  bounds[part], bounds[part + 1])
        here[part] = not offer(mailboxes, states, part - 1, runner)
    for part in range(parts):
        if here[part]:
            _write_depthwise_channels(own, x, weights, bias, y, multiplier, in_shape, out, strides, begin, taps, rows,
                                      width, size, inputs, places, grid, source, activation, direct, bounds[part],
                                      bounds[part + 1])
            run_here(runner, own)
    return collect(mailboxes, states, helpers)
