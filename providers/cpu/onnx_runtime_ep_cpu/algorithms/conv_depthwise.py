"""Depthwise convolution (one input channel per group): the compiled loop of compiled/depthwise.py for
1-D/2-D float32/float64 windows (bias and activation applied as it stores, one image's channels split
across the helper threads), else per-channel products over cache-sized blocks of channels.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..compiled import takes as takes_compiled
from ..threads import helper_count
from ..tuning import KNOBS
from .conv_blas import crop_rows, tap_source
from .prepared import Prepared
from .split import span_bounds, thread_spans
from .window import Geometry


def conv_depthwise(x, weights, geo: Geometry, with_bias: bool) -> np.ndarray:
    """Convolution with one input channel per group: per channel, a (multiplier, K) matmul over its
    K kernel taps, for a cache-sized block of channels at a time (one batched matmul over all the
    channels would stream a column matrix K times the input through memory). The path for what the
    compiled loop does not take (see depthwise_compiles): dtypes other than float32/float64, 3-D windows.

    Stride-1 2-D windows copy their taps as long contiguous runs of the flattened rows (see
    tap_source); outputs computed on a grid wider than the output are cropped at the end.
    """
    n, c = x.shape[:2]
    multiplier, depth = weights.shape[1:]
    taps = math.prod(geo.kernel)
    source, run, wrapped = tap_source(x, geo)
    length = math.prod(run)
    block = max(1, min(c, KNOBS.depthwise_block_bytes // max(1, depth * length * x.itemsize)))
    cols = np.empty((block, depth, length), dtype=x.dtype)
    if with_bias:
        cols[:, taps] = 1
    y = np.empty((n, c * multiplier, *geo.out), dtype=x.dtype)
    rows = np.empty((c, multiplier, length), dtype=x.dtype) if tuple(run) != geo.out else None
    for image in range(n):
        target = rows if rows is not None else y[image].reshape(c, multiplier, length, copy=False)
        for start in range(0, c, block):
            stop = min(c, start + block)
            part = cols[: stop - start]
            tap_cols = part[:, :taps].reshape(stop - start, *geo.kernel, *run, copy=False)
            np.copyto(tap_cols, source[image, start:stop])
            for j, first, end in wrapped:
                tap_cols[:, :, j, :, first:end] = 0
            np.matmul(weights[start:stop], part, out=target[start:stop])
        if rows is not None:
            crop_rows(rows.reshape(-1, length), geo, y[image])
    return y


def depthwise_compiles(geo: Geometry, x: np.ndarray) -> bool:
    """Whether the compiled depthwise loop takes this convolution: 1-D or 2-D, float32/float64."""
    return len(geo.kernel) <= 2 and takes_compiled(x)


def compiled_depthwise(geo: Geometry, m: int, prepared: Prepared, dtype):
    """``compute(x, w, b, finish, source=None)`` for a depthwise convolution by the compiled loop
    (compiled/depthwise.py), which adds the bias and applies the activation of ``finish`` (an
    _Epilogue, or None) as it stores; a residual is added after. A 1-D window runs as a 2-D one of
    height 1."""
    from ..compiled import epilogue
    from ..compiled.depthwise import DepthwisePlan  # numba loads only for models that need it

    lift = (1,) * (2 - len(geo.kernel))
    plan = DepthwisePlan(lift + geo.in_shape, lift + geo.kernel, lift + geo.strides, lift + geo.dilations,
                         (0,) * len(lift) + geo.begin, lift + geo.out)
    identity = epilogue.activation_bounds(epilogue.NONE, (), dtype)

    def weights(w, b):
        # Fresh writeable copies: numba compiles a read-only array argument separately.
        bias = np.zeros(m, dtype) if b is None else np.array(b, dtype=dtype)
        return np.array(w.reshape(m, -1), dtype=dtype, order="C"), bias

    def compute(x, w, b, finish, source=None):
        """``source``: the channel map of a channel shuffle folded in (see _ChannelShuffle), or None."""
        flat_w, bias = prepared.get("depthwise", (w, b), lambda: weights(w, b))
        activation, residual = identity, finish is not None and finish.residual.size > 0
        if finish is not None and not residual:  # (with a residual, finish adds the bias after it)
            activation = finish.bounds
            if finish.bias.size:
                bias = finish.bias
        x = np.ascontiguousarray(x)
        spans = _channel_spans(geo, m, x)
        if spans is None or len(spans) == 1:  # (one span: the loop itself, without posting a job: ~2 us less)
            # A writeable bias: numba compiles a read-only array argument separately (the parts below
            # get arrays by address).
            y = plan(x, flat_w, bias if bias.flags.writeable else bias.copy(), activation, source)
        else:  # one image: its channels are independent
            y = plan.split_channels(x, flat_w, bias, activation, span_bounds(spans), source, _split_channels)
        if residual:
            finish.rows(y.reshape(y.shape[0], m, -1), 0, math.prod(geo.out))
        return y

    compute.reads_shuffled = True  # takes a channel map instead of a shuffled copy of x
    compute.bind = functools.partial(_bind_depthwise, plan, prepared, weights, identity, geo, m)
    return compute


def _bind_depthwise(plan, prepared: Prepared, weights, identity, geo: Geometry, m: int, x, w, b, finish, y):
    """compiled_depthwise's computation into ``y`` prepared once (a segment's bound plan): ``[(loop,
    arguments)]`` (one image's channels split across threads as compute splits them: a step posting the parts),
    or None where it adds a residual."""
    if (finish is not None and finish.residual.size) or x.dtype != y.dtype or y.shape[1] != m:
        return None
    spans = _channel_spans(geo, m, x)
    flat_w, bias = prepared.get("depthwise", (w, b), lambda: weights(w, b))
    activation = identity
    if finish is not None:
        activation = finish.bounds
        if finish.bias.size:
            bias = finish.bias
    if not bias.flags.writeable:
        bias = bias.copy()
    x, y = x.reshape(x.shape[0], x.shape[1], *plan.in_shape), y.reshape(y.shape[0], m, *plan.out)
    if spans is not None and len(spans) > 1:
        return [(_split_channels, (plan.split_arguments(x, flat_w, bias, activation, span_bounds(spans), None, y),))]
    return [plan.bound(x, flat_w, bias, activation, y)]


def _channel_spans(geo: Geometry, m: int, x: np.ndarray):
    """split.thread_spans of one image's channels (None for a batch), the work counted as elements times taps: each
    output reads a window of the input."""
    if x.shape[0] != 1:
        return None
    return thread_spans(x.shape[1], max(x.size, math.prod(geo.out) * m) * math.prod(geo.kernel), x.dtype,
                        KNOBS.split_depthwise_macs)


def _split_channels(arguments) -> None:
    """jobs.split_depthwise's parts of one image's channels (DepthwisePlan.split_arguments), posted from compiled
    code as the packed convolution's parts: compute's split, and a bound plan's step."""
    from ..compiled import jobs, workers

    workers.call(jobs.split_depthwise, (*arguments, workers.local_mailbox(0)), jobs.DEPTHWISE.address(), 0,
                 helper_count())


def depthwise_lanes_apply(geo: Geometry, x: np.ndarray, m: int) -> bool:
    """Whether compiled/depthwise_lanes.py runs this depthwise convolution: 2-D float32, one output per
    channel, on an AVX2 host without AVX-512 (which keeps windows.py's kernel)."""
    if x.dtype != np.float32 or len(geo.kernel) != 2 or m != x.shape[1] or x.size == 0 or 0 in geo.out:
        return False
    from ..compiled import host

    return host.AVX2 and not host.AVX512


class LanesDepthwise:
    """compiled/depthwise_lanes.py for one geometry: ``__call__(x, w, b, finish)`` for conv_path (the bias
    and activation of ``finish``, an _Epilogue or None, applied as each tile is stored, a residual added
    after), ``run`` for a FusedConv without a residual (ops/conv.py calls it straight)."""

    takes_residual = False

    def __init__(self, geo: Geometry, prepared: Prepared):
        from ..compiled import depthwise_lanes

        self._kernel, self._prepared = depthwise_lanes, prepared
        (kh, kw), (sh, sw), (dh, dw), (oh, ow) = geo.kernel, geo.strides, geo.dilations, geo.out
        padded = ((oh - 1) * sh + (kh - 1) * dh + 1, (ow - 1) * sw + (kw - 1) * dw + 1)
        self._geometry = (sh, sw, *geo.begin, *padded)
        self._offsets = depthwise_lanes.tap_offsets(kh, kw, dh, dw, padded[1])
        self._out, self._pixels = geo.out, oh * ow
        self._no_bias = np.empty(0, dtype=np.float32)
        self._identity = np.array([-np.inf, np.inf, 1.0], dtype=np.float32)

    def __call__(self, x, w, b, finish):
        if finish is None:
            return self.run(x, w, b, None, self._identity)
        if finish.residual.size:  # finish adds the bias after the residual
            y = self.run(x, w, None, None, self._identity)
            finish.rows(y.reshape(y.shape[0], y.shape[1], -1), 0, self._pixels)
            return y
        return self.run(x, w, finish.bias, None, finish.bounds)

    def bind(self, x, w, b, finish, y):
        """``[(loop, arguments)]``: __call__'s computation into the C-contiguous ``y`` prepared once (a segment's
        bound plan); None with a residual."""
        if finish is None:
            return self.bind_run(x, w, b, self._identity, False, y)
        return None if finish.residual.size else self.bind_run(x, w, finish.bias, finish.bounds, False, y)

    def bind_run(self, x, w, b, bounds, hard_swish, y):
        """``run``'s call (without a residual) into ``y``, prepared once."""
        kernel = self._kernel
        weights = self._prepared.get("depthwise_lanes", (w,), lambda: kernel.pack_weights(w))
        bias = self._no_bias if b is None or not b.size else b.astype(np.float32).reshape(-1)
        return [(kernel.conv_depthwise, (x, weights, self._offsets, bias, bounds, y, *self._geometry, hard_swish))]

    def run(self, x, w, b, residual, bounds, hard_swish=False):
        """activation(the convolution + b) (then HardSwish where ``hard_swish``); ``residual`` must be None."""
        kernel = self._kernel
        weights = self._prepared.get("depthwise_lanes", (w,), lambda: kernel.pack_weights(w))
        bias = self._no_bias if b is None or not b.size else b.astype(np.float32, copy=False).reshape(-1)
        y = np.empty((x.shape[0], x.shape[1], *self._out), dtype=np.float32)
        kernel.conv_depthwise(x if x.flags.c_contiguous else np.ascontiguousarray(x), weights, self._offsets, bias,
                              bounds, y, *self._geometry, hard_swish)
        return y

