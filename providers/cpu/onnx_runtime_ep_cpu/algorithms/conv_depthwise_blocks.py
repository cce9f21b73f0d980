"""Depthwise convolutions of the plain layout by compiled/depthwise_blocks.py: 16 channels across the vector lanes,
each block of channels transposed into a padded blocked plane and back, where the plane loops, flat planes and rows
(conv_depthwise.py, conv_depthwise_small.py), which hold a plane's pixels across the lanes, fill them badly.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from ..tuning import KNOBS
from .bound_loop import EntryOnce
from .prepared import Prepared
from .split import claimed_tasks, run_claimed, thread_spans
from .window import Geometry

# The blocks win for 5x5 windows and larger (each tap a vector multiply-add per pixel, where the plane loops pass
# over a plane-wide grid per tap), and for 3x3 windows over planes of up to BLOCKS_MAX_PIXELS outputs (a 7x7
# plane fills half of the flat planes' lanes); the 3x3 windows of larger planes keep their tuned plane loops
# (faster on 14x14 to 112x112). Measured on EfficientNet-B0's and MobileNetV2's layers at 224x224 (this
# constant's commit).
BLOCKS_MIN_TAPS, BLOCKS_MAX_PIXELS = 25, 64
TASKS_PER_THREAD = 4  # spans of blocks per thread, claimed one by one: a descheduled helper's go to the others
_ALIGNMENT = 64  # bytes: a tile's vector loads from the scratch planes stay within one cache line


def blocks_depthwise_apply(geo: Geometry, x: np.ndarray, m: int) -> bool:
    """Whether the channel blocks run this depthwise convolution: 2-D float32 on an AVX-512 host, one output per
    channel, at least BLOCKS_MIN_TAPS taps or at most BLOCKS_MAX_PIXELS output pixels per channel."""
    taps, pixels = math.prod(geo.kernel), math.prod(geo.out)
    if x.dtype != np.float32 or len(geo.kernel) != 2 or m != x.shape[1] or x.size == 0 or pixels == 0 \
            or (taps < BLOCKS_MIN_TAPS and pixels > BLOCKS_MAX_PIXELS):
        return False
    from ..compiled import host

    return host.AVX512


def _aligned_zeros(floats: int) -> np.ndarray:
    """float32 zeros whose first element starts a cache line."""
    raw = np.zeros(floats + _ALIGNMENT // 4, np.float32)
    skip = (-raw.ctypes.data % _ALIGNMENT) // 4
    return raw[skip:skip + floats]


class BlocksDepthwise:
    """One geometry's channel blocks: ``__call__(x, w, b, finish)`` for conv_path (the bias and activation of
    ``finish``, an _Epilogue or None, applied as each tile is stored; a residual added after), ``bind`` for a
    segment's bound plan. The blocks split across the helper threads from KNOBS.split_depthwise_macs of work, as
    claimed tasks (jobs.DEPTHWISE_BLOCKS), each thread's part with scratch planes of its own."""

    def __init__(self, geo: Geometry, prepared: Prepared):
        from ..compiled import blocked_ops, depthwise_blocks, epilogue

        self._kernel, self._prepared = depthwise_blocks, prepared
        (kh, kw), (sh, sw), (dh, dw), (oh, ow) = geo.kernel, geo.strides, geo.dilations, geo.out
        (height, width), (top, left) = geo.in_shape, geo.begin
        rows, columns, _ = blocked_ops.padded_size(height, width, oh, ow, sh, sw, top, left, kh, kw, dh, dw)
        self._floats = (depthwise_blocks.source_floats(rows, columns, sw), depthwise_blocks.out_floats(oh, ow))
        self._offsets = blocked_ops.depthwise_taps(kh, kw, dh, dw, columns)
        self._places = depthwise_blocks.source_places(height, width, top, left, columns)
        self._starts = depthwise_blocks.lane_starts(oh * ow)
        self._geometry = (height, width, oh, ow, sh, sw, columns)
        self._out, self._work = geo.out, math.prod(geo.out) * kh * kw
        self._identity = epilogue.activation_bounds(epilogue.NONE, (), np.float32)
        self._scratch = threading.local()  # a calling thread's parts' planes (its own: calls may overlap)
        # a node's one-part calls repeat their argument types: the loop's entry point, bound once, skips the
        # dispatcher's typing of its 21 arguments per call
        self._entry = EntryOnce(depthwise_blocks.depthwise_channel_blocks)

    def _weights(self, w, b, channels: int):
        """(packed weights, padded bias) of blocked_ops.pack_depthwise, once per constant pair."""
        from ..compiled import blocked_ops

        def packed():
            weights, bias = blocked_ops.pack_depthwise(np.asarray(w, np.float32), b, channels)
            aligned = _aligned_zeros(weights.size)
            aligned[:] = weights
            return aligned, bias

        return self._prepared.get("depthwise_blocks", (w, b), packed)

    def _threads(self, x) -> int:
        """The threads an image's blocks split across (split.thread_spans, the work counted as multiply-adds)."""
        images, channels = x.shape[:2]
        spans = thread_spans(-(-channels // 16), images * channels * self._work, x.dtype, KNOBS.split_depthwise_macs)
        return len(spans) if spans else 1

    def _parts(self, x, w, b, finish, y, scratches) -> list[tuple]:
        """The kernel's arguments: all the blocks in one call where ``scratches`` (each part's planes) holds one, else
        jobs.DEPTHWISE_BLOCKS's parts, one per thread, sharing TASKS_PER_THREAD spans of blocks per thread as claimed
        tasks."""
        images, channels = x.shape[:2]
        blocks = -(-channels // 16)
        weights, bias = self._weights(w, b, channels)
        bounds = self._identity
        if finish is not None:
            bounds = finish.bounds
            if finish.bias.size:
                bias = self._prepared_bias(finish.bias, blocks)
        common = (x.reshape(-1), weights, self._offsets, bias, bounds, y.reshape(-1), images, channels,
                  *self._geometry, self._places, self._starts)
        threads = len(scratches)
        if threads == 1:
            return [(*common, *scratches[0], 0, blocks)]
        tasks = min(blocks, TASKS_PER_THREAD * threads)
        cuts, ranges, claims = claimed_tasks(blocks, tasks, threads)
        return [(*common, *planes, cuts, ranges, claims, part) for part, planes in enumerate(scratches)]

    def _planes(self) -> tuple[np.ndarray, np.ndarray]:
        source, out = self._floats
        return _aligned_zeros(source), _aligned_zeros(out)

    def _prepared_bias(self, bias, blocks: int) -> np.ndarray:
        def padded():
            found = np.zeros(blocks * 16, np.float32)
            found[:bias.size] = bias.reshape(-1)
            return found

        return self._prepared.get("depthwise_blocks_bias", (bias,), padded)

    def _thread_planes(self, count: int) -> list:
        found = getattr(self._scratch, "planes", None)
        if found is None or len(found) < count:
            found = self._scratch.planes = [self._planes() for _ in range(count)]
        return found

    def __call__(self, x, w, b, finish):
        residual = finish is not None and finish.residual.size > 0
        y = np.empty((x.shape[0], x.shape[1], *self._out), dtype=np.float32)
        xc = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        threads = self._threads(xc)
        parts = self._parts(xc, w, None if residual else b, None if residual else finish, y,
                            self._thread_planes(threads)[:threads])
        if len(parts) == 1:
            self._entry.run(parts[0])
        else:
            _claimed(parts)
        if residual:  # finish adds the bias after the residual
            finish.rows(y.reshape(y.shape[0], y.shape[1], -1), 0, math.prod(self._out))
        return y

    def bind(self, x, w, b, finish, y):
        """``[(loop, arguments)]`` into the C-contiguous ``y``, prepared once with planes of its own; None with a
        residual."""
        if finish is not None and finish.residual.size:
            return None
        parts = self._parts(x, w, b, finish, y, [self._planes() for _ in range(self._threads(x))])
        if len(parts) == 1:
            return [(self._kernel.depthwise_channel_blocks, parts[0])]
        return [(_claimed, (parts,))]


def _claimed(parts: list) -> None:
    """jobs.DEPTHWISE_BLOCKS's parts on the calling thread and the helpers, their claims (shared) zeroed first."""
    from ..compiled import jobs

    run_claimed(jobs.DEPTHWISE_BLOCKS, parts)
