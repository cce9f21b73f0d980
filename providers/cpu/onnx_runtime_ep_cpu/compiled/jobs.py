"""The kinds of job the helper threads of workers.py run: for each, a writer that puts one part's
arguments into a mailbox (compiled) and a runner entry that reads them back and calls the kernel
(compiled on first use as a C callback, see workers.Kind). Slots are counted from workers.ARGS."""

from __future__ import annotations

import numpy as np

from . import attention, depthwise, epilogue, gemm, gemv, jit, lanes, matmul, pooling, windows
from .workers import (
    ARGS,
    BUFFER,
    BUFFER_SIZE,
    Kind,
    claim_task,
    collect,
    compile_runner,
    float_array,
    int_array,
    mailbox_view,
    offer,
    offset_array,
    run_here,
)


@jit
def _write_conv(m, xp, weights, bias, y, residual, flags, bounds, m_rows, oh, ow, grid, channels, kh, kw, sh, sw, dh,
                dw, wp, plane, by_lanes, taps, packed, tasks, ranges, claims, part):
    a = ARGS
    m[a + 0], m[a + 1], m[a + 2] = xp.ctypes.data, xp.shape[0], xp.shape[1]
    m[a + 3], m[a + 4], m[a + 5], m[a + 6] = weights.ctypes.data, weights.shape[0], weights.shape[1], weights.shape[2]
    m[a + 7], m[a + 8], m[a + 9] = bias.ctypes.data, bias.shape[0], bias.shape[1]
    m[a + 10], m[a + 11], m[a + 12] = y.ctypes.data, y.shape[0], y.shape[1]
    m[a + 13], m[a + 14], m[a + 15] = residual.ctypes.data, residual.shape[0], residual.shape[1]
    m[a + 16] = bounds.ctypes.data
    m[a + 17], m[a + 18] = taps.ctypes.data, taps.shape[0]
    m[a + 19], m[a + 20] = packed.ctypes.data, packed.shape[0]
    m[a + 21], m[a + 22] = tasks.ctypes.data, tasks.shape[0]
    m[a + 23], m[a + 24], m[a + 25], m[a + 26], m[a + 27] = flags, m_rows, oh, ow, grid
    m[a + 28], m[a + 29], m[a + 30], m[a + 31], m[a + 32] = channels, kh, kw, sh, sw
    m[a + 33], m[a + 34], m[a + 35], m[a + 36], m[a + 37] = dh, dw, wp, plane, by_lanes
    m[a + 38], m[a + 39], m[a + 40] = ranges.ctypes.data, claims.ctypes.data, claims.shape[0]
    m[a + 41] = part


def _conv_entry(pointer):
    m = mailbox_view(pointer)
    a = ARGS
    xp = float_array(m[a + 0], (m[a + 1], m[a + 2]))
    weights = float_array(m[a + 3], (m[a + 4], m[a + 5], m[a + 6]))
    bias, y = float_array(m[a + 7], (m[a + 8], m[a + 9])), float_array(m[a + 10], (m[a + 11], m[a + 12]))
    residual, bounds = float_array(m[a + 13], (m[a + 14], m[a + 15])), float_array(m[a + 16], (3,))
    taps, tasks = int_array(m[a + 17], (m[a + 18],)), int_array(m[a + 21], (m[a + 22], 6))
    parts, part = m[a + 40], m[a + 41]
    ranges, claims = int_array(m[a + 38], (parts + 1,)), int_array(m[a + 39], (parts,))
    cursor = np.zeros(1, dtype=np.int64)
    while True:  # the part's own tasks in order, then those the other parts' threads have not claimed yet
        i = claim_task(claims, ranges, part, cursor)
        if i < 0:
            break
        task = tasks[i:i + 1]
        if m[a + 37]:
            lanes.lane_tasks(xp, weights, bias, y, residual, m[a + 23], bounds, m[a + 24], m[a + 25], m[a + 26],
                             m[a + 28], m[a + 31], m[a + 32], m[a + 35], m[a + 36], taps, task)
        else:
            gemm.conv_tasks(xp, weights, bias, y, residual, m[a + 23], bounds, m[a + 24], m[a + 25], m[a + 26],
                            m[a + 27], m[a + 28], m[a + 29], m[a + 30], m[a + 31], m[a + 32], m[a + 33], m[a + 34],
                            m[a + 35], m[a + 36], taps, int_array(m[a + 19], (m[a + 20],)), task,
                            float_array(m[BUFFER], (m[BUFFER_SIZE],)))


# gemm.conv_tasks, or lanes.lane_tasks where by_lanes, one part: (xp, weights, bias, y, residual, flags, bounds,
# m_rows, oh, ow, grid, channels, kh, kw, sh, sw, dh, dw, wp, plane, by_lanes, taps, packed, tasks, ranges,
# claims, part). Part p's tasks are tasks[ranges[p]:ranges[p + 1]], claimed one by one through claims[p]
# (zeros at first): the part's thread runs its own, then those no other part's thread has claimed.
CONV = Kind(_write_conv, lambda: compile_runner(_conv_entry),
            scratch=lambda part: gemm.scratch_size(part[11] * part[12] * part[13]))


@jit
def split_conv(xp, weights, bias, y, residual, flags, bounds, geometry, taps, packed, tasks, ranges, claims, own,
               mailboxes, states, runner):
    """A packed convolution's tasks in parts (see CONV): part i > 0 posted to helper i - 1 from here (as
    split_product's), part 0 run on the calling thread through ``own``, its mailbox (workers.local_mailbox),
    by the same runner as the helpers' (conv_tasks compiled into this function measured 2-7% slower on whole
    models); the caller then claims what no helper has (the parts of helpers asleep or missing, and the
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
def _write_matmul(m, x, lda, rows, depth, packed, offsets, bias, y, n, residual, flags, coefficients, bounds, ranges,
                  claims, part):
    a = ARGS
    m[a + 0], m[a + 1], m[a + 2], m[a + 3], m[a + 4] = x.ctypes.data, x.shape[0], lda, rows, depth
    m[a + 5], m[a + 6], m[a + 7] = packed.ctypes.data, packed.shape[0], packed.shape[1]
    m[a + 8], m[a + 9] = offsets.ctypes.data, offsets.shape[0]
    m[a + 10], m[a + 11], m[a + 12], m[a + 13], m[a + 14] = bias.ctypes.data, bias.shape[0], y.ctypes.data, \
        y.shape[0], n
    m[a + 15], m[a + 16], m[a + 17] = residual.ctypes.data, residual.shape[0], flags
    m[a + 18], m[a + 19] = coefficients.ctypes.data, coefficients.shape[0]
    m[a + 20], m[a + 21], m[a + 22] = bounds.ctypes.data, bounds.shape[0], ranges.ctypes.data
    m[a + 23], m[a + 24], m[a + 25] = claims.ctypes.data, claims.shape[0], part


def _matmul_entry(pointer):
    m = mailbox_view(pointer)
    a = ARGS
    bounds = int_array(m[a + 20], (m[a + 21],))
    parts, part = m[a + 24], m[a + 25]
    ranges, claims = int_array(m[a + 22], (parts + 1,)), int_array(m[a + 23], (parts,))
    cursor = np.zeros(1, dtype=np.int64)
    while True:  # the part's own tasks, then those the other parts' threads have not claimed
        i = claim_task(claims, ranges, part, cursor)
        if i < 0:
            break
        matmul.matmul_panels(float_array(m[a + 0], (m[a + 1],)), m[a + 2], m[a + 3], m[a + 4],
                             float_array(m[a + 5], (m[a + 6], m[a + 7])), int_array(m[a + 8], (m[a + 9],)),
                             float_array(m[a + 10], (m[a + 11],)), float_array(m[a + 12], (m[a + 13],)), m[a + 14],
                             float_array(m[a + 15], (m[a + 16],)), m[a + 17], float_array(m[a + 18], (m[a + 19],)),
                             bounds[i], bounds[i + 1], float_array(m[BUFFER], (m[BUFFER_SIZE],)))


# matmul.matmul_panels, one part: (x, lda, rows, depth, packed, offsets, bias, y, n, residual, flags,
# coefficients, bounds, ranges, claims, part). Task i covers panels bounds[i] .. bounds[i + 1]; part p's tasks
# are ranges[p] .. ranges[p + 1], claimed one by one through claims[p] (zeros at first), as jobs.CONV's.
MATMUL = Kind(_write_matmul, lambda: compile_runner(_matmul_entry), scratch=lambda part: matmul.scratch_size(part[3]))


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
def _write_attention(m, q, q_strides, k, k_strides, v, v_strides, y, y_strides, heads, kv_heads, total, head_size,
                     value_size, scale, mask, plan, extents, first, end, status):
    a = ARGS
    m[a + 0], m[a + 1], m[a + 2] = q.ctypes.data, q.shape[0], q_strides.ctypes.data
    m[a + 3], m[a + 4], m[a + 5] = k.ctypes.data, k.shape[0], k_strides.ctypes.data
    m[a + 6], m[a + 7], m[a + 8] = v.ctypes.data, v.shape[0], v_strides.ctypes.data
    m[a + 9], m[a + 10], m[a + 11] = y.ctypes.data, y.shape[0], y_strides.ctypes.data
    m[a + 12], m[a + 13], m[a + 14], m[a + 15], m[a + 16] = heads, kv_heads, total, head_size, value_size
    m[a + 17], m[a + 18], m[a + 19], m[a + 20] = scale.ctypes.data, mask.ctypes.data, mask.shape[0], mask.shape[1]
    m[a + 21], m[a + 22], m[a + 23] = plan.ctypes.data, plan.shape[0], extents.ctypes.data
    m[a + 24], m[a + 25], m[a + 26] = first, end, status.ctypes.data


def _attention_entry(pointer):
    m = mailbox_view(pointer)
    a = ARGS
    attention.attention_units(
        float_array(m[a + 0], (m[a + 1],)), int_array(m[a + 2], (3,)), float_array(m[a + 3], (m[a + 4],)),
        int_array(m[a + 5], (3,)), float_array(m[a + 6], (m[a + 7],)), int_array(m[a + 8], (3,)),
        float_array(m[a + 9], (m[a + 10],)), int_array(m[a + 11], (3,)), m[a + 12], m[a + 13], m[a + 14], m[a + 15],
        m[a + 16], float_array(m[a + 17], (1,))[0], float_array(m[a + 18], (m[a + 19], m[a + 20])),
        int_array(m[a + 21], (m[a + 22], 3)), int_array(m[a + 23], (m[a + 22],)), m[a + 24], m[a + 25],
        float_array(m[BUFFER], (m[BUFFER_SIZE],)), int_array(m[a + 26], (1,)))


# attention.attention_units, one part: (q, q_strides, k, k_strides, v, v_strides, y, y_strides, heads, kv_heads,
# total, head_size, value_size, scale (a float32 array of one), mask, plan, extents, first unit, end unit, status).
ATTENTION = Kind(_write_attention, lambda: compile_runner(_attention_entry),
                 scratch=lambda part: attention.scratch_size(part[11], part[12], part[10]))


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
def _write_product(m, transposed, a, w, sums, spans, first, end):
    s = ARGS
    m[s + 0], m[s + 1], m[s + 2] = a.ctypes.data, a.shape[0], a.shape[1]
    m[s + 3], m[s + 4], m[s + 5] = w.ctypes.data, w.shape[0], w.shape[1]
    m[s + 6], m[s + 7], m[s + 8], m[s + 9] = sums.ctypes.data, sums.shape[0], sums.shape[1], sums.shape[2]
    m[s + 10], m[s + 11], m[s + 12], m[s + 13] = spans, first, end, 1 if transposed else 0


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


def _product_entry(pointer):
    m = mailbox_view(pointer)
    s = ARGS
    product_items(m[s + 13] != 0, float_array(m[s + 0], (m[s + 1], m[s + 2])),
                  float_array(m[s + 3], (m[s + 4], m[s + 5])), float_array(m[s + 6], (m[s + 7], m[s + 8], m[s + 9])),
                  m[s + 10], m[s + 11], m[s + 12])


# product_items, one part: (transposed, a, w, sums, spans, first item, end item).
PRODUCT = Kind(_write_product, lambda: compile_runner(_product_entry))


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


@jit
def _write_pad(m, x, out, top, left, padded_height, padded_width, first, end):
    s = ARGS
    m[s + 0], m[s + 1], m[s + 2], m[s + 3] = x.ctypes.data, x.shape[0], x.shape[1], x.shape[2]
    m[s + 4], m[s + 5], m[s + 6], m[s + 7] = out.ctypes.data, out.shape[0], top, left
    m[s + 8], m[s + 9], m[s + 10], m[s + 11] = padded_height, padded_width, first, end


def _pad_entry(pointer):
    m = mailbox_view(pointer)
    s = ARGS
    pad_channels(float_array(m[s + 0], (m[s + 1], m[s + 2], m[s + 3])), float_array(m[s + 4], (m[s + 5],)), m[s + 6],
                 m[s + 7], m[s + 8], m[s + 9], m[s + 10], m[s + 11])


# pad_channels, one part: (x, out, top, left, padded height, padded width, first channel, end channel).
PAD = Kind(_write_pad, lambda: compile_runner(_pad_entry))


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
def _write_pool(m, planes, rows, kh, kw, sh, sw, dh, dw, ph, pw, is_max, lo_h, hi_h, lo_w, hi_w):
    s = ARGS
    m[s + 0], m[s + 1], m[s + 2], m[s + 3] = planes.ctypes.data, planes.shape[0], planes.shape[1], planes.shape[2]
    m[s + 4], m[s + 5], m[s + 6], m[s + 7] = rows.ctypes.data, rows.shape[0], rows.shape[1], rows.shape[2]
    m[s + 8], m[s + 9], m[s + 10], m[s + 11], m[s + 12], m[s + 13] = kh, kw, sh, sw, dh, dw
    m[s + 14], m[s + 15], m[s + 16] = ph, pw, is_max
    m[s + 17], m[s + 18], m[s + 19], m[s + 20] = lo_h, hi_h, lo_w, hi_w


def _pool_entry(pointer):
    m = mailbox_view(pointer)
    s = ARGS
    planes = float_array(m[s + 0], (m[s + 1], m[s + 2], m[s + 3]))
    rows = float_array(m[s + 4], (m[s + 5], m[s + 6], m[s + 7]))
    kh, kw, sh, sw, dh, dw = m[s + 8], m[s + 9], m[s + 10], m[s + 11], m[s + 12], m[s + 13]
    if windows.takes_pool(kh, kw, sh, sw, dh, dw):
        windows.pool(planes, rows, sh, m[s + 14], m[s + 15], m[s + 16] != 0, m[s + 17], m[s + 18], m[s + 19],
                     m[s + 20])
    else:
        pooling.pool_2d(planes, rows, kh, kw, sh, sw, dh, dw, m[s + 14], m[s + 15], m[s + 16] != 0, m[s + 17],
                        m[s + 18], m[s + 19], m[s + 20])


# pooling.pool_2d, one part: (planes, rows, kh, kw, sh, sw, dh, dw, ph, pw, is_max, lo_h, hi_h, lo_w, hi_w);
# a 3x3 pool of stride 1 or 2 by windows.pool.
POOL = Kind(_write_pool, lambda: compile_runner(_pool_entry))


@jit
def _write_affine(m, x, factor, shift, out, kind, params):
    s = ARGS
    m[s + 0], m[s + 1], m[s + 2], m[s + 3] = x.ctypes.data, x.shape[0], x.shape[1], x.shape[2]
    m[s + 4], m[s + 5], m[s + 6] = factor.ctypes.data, shift.ctypes.data, out.ctypes.data
    m[s + 7], m[s + 8] = kind, params.ctypes.data


def _affine_entry(pointer):
    m = mailbox_view(pointer)
    s = ARGS
    shape = (m[s + 1], m[s + 2], m[s + 3])
    epilogue.channel_affine(float_array(m[s + 0], shape), float_array(m[s + 4], (m[s + 2],)),
                            float_array(m[s + 5], (m[s + 2],)), float_array(m[s + 6], shape), m[s + 7],
                            float_array(m[s + 8], (2,)))


# epilogue.channel_affine, one part: (x, factor, shift, out, kind, params), float32 (N, C, P) arrays.
AFFINE = Kind(_write_affine, lambda: compile_runner(_affine_entry))


@jit
def _write_depthwise(m, x, weights, bias, y, n_images, channels, in_shape, out, strides, begin, taps, rows, width, size,
                     inputs, places, grid, source, activation, direct):
    s = ARGS
    m[s + 0], m[s + 1], m[s + 2], m[s + 3] = x.ctypes.data, x.shape[0], weights.ctypes.data, weights.shape[0]
    m[s + 4], m[s + 5], m[s + 6], m[s + 7] = bias.ctypes.data, bias.shape[0], y.ctypes.data, y.shape[0]
    m[s + 8], m[s + 9] = n_images, channels
    m[s + 10], m[s + 11], m[s + 12], m[s + 13] = in_shape[0], in_shape[1], out[0], out[1]
    m[s + 14], m[s + 15], m[s + 16], m[s + 17] = strides[0], strides[1], begin[0], begin[1]
    m[s + 18], m[s + 19], m[s + 20], m[s + 21], m[s + 22] = taps.ctypes.data, taps.shape[0], rows, width, size
    m[s + 23], m[s + 24], m[s + 25] = inputs.ctypes.data, places.ctypes.data, inputs.shape[0]
    m[s + 26], m[s + 27] = grid.ctypes.data, grid.shape[0]
    m[s + 28], m[s + 29] = source.ctypes.data, source.shape[0]
    m[s + 30], m[s + 31] = activation.ctypes.data, direct


def _depthwise_entry(pointer):
    m = mailbox_view(pointer)
    s = ARGS
    depthwise.run(float_array(m[s + 0], (m[s + 1],)), float_array(m[s + 2], (m[s + 3],)),
                  float_array(m[s + 4], (m[s + 5],)), float_array(m[s + 6], (m[s + 7],)), m[s + 8], m[s + 9],
                  (m[s + 10], m[s + 11]), (m[s + 12], m[s + 13]), (m[s + 14], m[s + 15]), (m[s + 16], m[s + 17]),
                  offset_array(m[s + 18], (m[s + 19],)), m[s + 20], m[s + 21], m[s + 22],
                  offset_array(m[s + 23], (m[s + 25],)), offset_array(m[s + 24], (m[s + 25],)),
                  offset_array(m[s + 26], (m[s + 27],)), offset_array(m[s + 28], (m[s + 29],)),
                  float_array(m[s + 30], (3,)), m[s + 31])


# depthwise.run, one part of DepthwisePlan.split_channels (see split_depthwise).
DEPTHWISE = Kind(_write_depthwise, lambda: compile_runner(_depthwise_entry))


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
    split_conv's (through workers.run's Python a small layer took ~3 us more: 40.7 -> 37.1 us for 544
    channels of 7x7 on two threads). Returns workers.collect's result."""
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
