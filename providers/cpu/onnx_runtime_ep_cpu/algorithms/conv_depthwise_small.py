"""Depthwise convolutions over small planes by compiled/depthwise_small.py's loops: the channels-last pair sums
(5x5-and-larger windows onto few outputs) and the flat planes (stride-1 windows keeping the plane's size), and by
compiled/depthwise_rows.py's output rows across the lanes (5x5 and 7x7 windows on AVX-512 hosts), each
where it measured faster than the plane loops of compiled/depthwise.py (conv_depthwise.py).
"""

from __future__ import annotations

import math

import numpy as np

from ..compiled import takes as takes_compiled
from ..tuning import KNOBS
from .bound_loop import EntryOnce
from .prepared import Prepared
from .window import Geometry

# The channels-last pair sums win where each output sums many taps over a small plane: 5x5 windows (and
# larger) from up to PAIRS_MAX_INPUTS input pixels to up to PAIRS_MAX_OUTPUTS output pixels, with enough
# channels for a vector (the transposes in and out cost a pass each: 3x3 windows and larger planes keep the
# plane loops; measured on MobileNetV3's and an EfficientNet's layers: 4x4 planes and 8x8/2 windows 1.5-2.3x
# faster, 8x8/1 ones 0.9-1.1x).
PAIRS_MAX_INPUTS, PAIRS_MAX_OUTPUTS = 64, 16
PAIRS_MIN_TAPS = 25
PAIRS_MIN_CHANNELS = 16
# ... and 3x3 windows (at least PAIRS_SMALL_TAPS taps) over planes of up to PAIRS_SMALL_INPUTS pixels, where the
# flat planes pay their per-plane setup for a handful of outputs (one thread, min of 50 calls, load 13:
# 1152 channels of 2x2 at batch 32 1190 -> 261 us, at batch 1 64 -> 16 us; 480 of 4x4 752 -> 347 and 28 -> 17 us;
# 240 of 8x8 662 against 717 us, kept flat).
PAIRS_SMALL_TAPS, PAIRS_SMALL_INPUTS = 9, 16
# The flat planes win on planes of up to this many pixels (8x8 3x3 windows: 72 channels 8.3 -> 4.9 us, 240
# channels 19.5 -> 15.5 us; 4x4: 6.2 -> 4.3 us); on 16x16 and larger the plane loops' row tiles are faster.
FLAT_MAX_PIXELS = 64
# The output rows across the lanes (compiled/depthwise_rows.py) win for 5x5 and 7x7 windows (ConvNeXt's, float32 on
# AVX-512 hosts) where the pair sums do not run, against the plane loops (16x16 to 56x56) and the flat planes (8x8),
# on planes of up to ROWS_MAX_PIXELS outputs and work that the plane loops would not split across threads (the
# rows loop runs on one); 3x3 windows keep their tuned loops, and strided windows the plane loops (measured faster
# there than these rows over column phases).
ROWS_MIN_TAPS, ROWS_MAX_PIXELS = 25, 1024


def pairs_depthwise_apply(geo: Geometry, x: np.ndarray, m: int) -> bool:
    """Whether the pair sums run this depthwise convolution (one output per channel): 5x5 windows and larger, or
    3x3 ones over planes of up to PAIRS_SMALL_INPUTS pixels."""
    taps, inputs = math.prod(geo.kernel), math.prod(geo.in_shape)
    return (takes_compiled(x) and len(geo.kernel) == 2 and m == x.shape[1] >= PAIRS_MIN_CHANNELS and x.size > 0
            and (taps >= PAIRS_MIN_TAPS or (taps >= PAIRS_SMALL_TAPS and inputs <= PAIRS_SMALL_INPUTS))
            and 0 < math.prod(geo.out) <= PAIRS_MAX_OUTPUTS and inputs <= PAIRS_MAX_INPUTS)


def rows_depthwise_apply(geo: Geometry, x: np.ndarray, m: int) -> bool:
    """Whether the output rows across the lanes run this depthwise convolution: float32 on an AVX-512 host, one
    output per channel, stride 1, at least ROWS_MIN_TAPS taps onto up to ROWS_MAX_PIXELS outputs per channel, an image's
    multiply-adds within KNOBS.split_depthwise_macs."""
    taps, pixels = math.prod(geo.kernel), math.prod(geo.out)
    if (x.dtype != np.float32 or len(geo.kernel) != 2 or m != x.shape[1] or x.size == 0 or taps < ROWS_MIN_TAPS
            or geo.strides != (1, 1) or not 0 < pixels <= ROWS_MAX_PIXELS
            or m * pixels * taps > KNOBS.split_depthwise_macs):
        return False
    from ..compiled import host

    return host.AVX512


def flat_depthwise_apply(geo: Geometry, x: np.ndarray, m: int) -> bool:
    """Whether the flat planes run this depthwise convolution: one output per channel, stride 1, the output the
    input's size, up to FLAT_MAX_PIXELS pixels."""
    return (takes_compiled(x) and len(geo.kernel) == 2 and m == x.shape[1] and x.size > 0
            and geo.strides == (1, 1) and tuple(geo.out) == tuple(geo.in_shape)
            and 0 < math.prod(geo.out) <= FLAT_MAX_PIXELS)


class _SmallDepthwise:
    """One geometry's loop of compiled/depthwise_small.py: ``__call__(x, w, b, finish)`` for conv_path (the bias
    and activation of ``finish``, an _Epilogue or None, applied as it stores; a residual added after), ``bind``
    for a segment's bound plan. Subclasses give the loop, the weights' layout and the loop's tables."""

    channels_last = False

    def __init__(self, geo: Geometry, prepared: Prepared, dtype):
        from ..compiled import depthwise_small, epilogue

        self._module, self._prepared, self._dtype = depthwise_small, prepared, np.dtype(dtype)
        self._out, self._pixels, self._inputs = geo.out, math.prod(geo.out), math.prod(geo.in_shape)
        self._identity = epilogue.activation_bounds(epilogue.NONE, (), dtype)
        # A plain Conv node's calls (no epilogue) repeat their argument types every run: the loop's entry point,
        # bound once, skips the dispatcher's typing of a dozen or more arguments per call.
        self._plain: EntryOnce | None = None  # (made at the first call: a subclass's loop module is set after this)

    def _weights(self, w, b):
        def arranged():
            m = w.shape[0]
            bias = np.zeros(m, self._dtype) if b is None else np.array(b.reshape(-1), dtype=self._dtype)
            flat = w.reshape(m, -1)
            return np.ascontiguousarray(flat.T if self.channels_last else flat, dtype=self._dtype).reshape(-1), bias

        return self._prepared.get(f"depthwise_small_{type(self).__name__}", (w, b), arranged)

    def _arguments(self, x, w, b, finish, y):
        weights, bias = self._weights(w, b)
        bounds = self._identity
        if finish is not None:
            bounds = finish.bounds
            if finish.bias.size:
                bias = finish.bias
        return self._loop_arguments(x.reshape(-1), weights, bias, bounds, y.reshape(-1), x.shape[1])

    def __call__(self, x, w, b, finish):
        residual = finish is not None and finish.residual.size > 0
        y = np.empty((x.shape[0], x.shape[1], *self._out), dtype=self._dtype)
        xc = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        loop = self._loop()
        if residual:  # finish adds the bias after the residual
            loop(*self._arguments(xc, w, None, None, y))
            finish.rows(y.reshape(y.shape[0], y.shape[1], -1), 0, self._pixels)
        elif finish is None:
            plain = self._plain
            if plain is None:
                plain = self._plain = EntryOnce(loop)
            plain.run(self._arguments(xc, w, b, None, y))
        else:
            loop(*self._arguments(xc, w, b, finish, y))
        return y

    def bind(self, x, w, b, finish, y):
        """``[(loop, arguments)]`` into the C-contiguous ``y``, prepared once; None with a residual."""
        if finish is not None and finish.residual.size:
            return None
        return [(self._loop(), self._arguments(x, w, b, finish, y))]


class PairsDepthwise(_SmallDepthwise):
    """The channels-last pair sums (depthwise_small.depthwise_pairs)."""

    channels_last = True

    def __init__(self, geo: Geometry, prepared: Prepared, dtype):
        super().__init__(geo, prepared, dtype)
        self._pairs, self._starts = self._module.window_pairs(geo.in_shape, geo.kernel, geo.strides, geo.dilations,
                                                              geo.begin, geo.out)

    def _loop(self):
        return self._module.depthwise_pairs

    def _loop_arguments(self, x, weights, bias, bounds, y, c):
        return (x, weights, bias, self._pairs, self._starts, bounds, y, np.empty(self._inputs * c, self._dtype),
                np.empty(self._pixels * c, self._dtype))


class FlatDepthwise(_SmallDepthwise):
    """The flat planes (depthwise_small.depthwise_flat)."""

    def __init__(self, geo: Geometry, prepared: Prepared, dtype):
        super().__init__(geo, prepared, dtype)
        self._shifts, self._masks, self._margin = self._module.flat_taps(geo.in_shape, geo.kernel, geo.dilations,
                                                                         geo.begin, self._dtype)

    def _loop(self):
        return self._module.depthwise_flat

    def _loop_arguments(self, x, weights, bias, bounds, y, c):
        return (x, weights, bias, self._shifts, self._masks, bounds, y,
                np.zeros(self._pixels + 2 * self._margin, self._dtype), np.empty(self._pixels, self._dtype))


class RowsDepthwise(_SmallDepthwise):
    """The output rows across the lanes (depthwise_rows.depthwise_rows), float32."""

    def __init__(self, geo: Geometry, prepared: Prepared, dtype):
        super().__init__(geo, prepared, dtype)
        from ..compiled import depthwise_rows

        self._rows_module = depthwise_rows
        (oh, ow), (sh, sw) = geo.out, geo.strides
        self._lanes = 8 if ow <= 8 else 16
        self._taps, phase_width, size = depthwise_rows.plane_layout(geo.in_shape, geo.kernel, geo.strides,
                                                                    geo.dilations, geo.begin, geo.out, self._lanes)
        self._plane_floats = sw * size
        self._geometry = (*geo.in_shape, *geo.begin, sw, phase_width, size, oh, ow, sh, self._lanes,
                          depthwise_rows.shared_height(geo.kernel, geo.strides, geo.dilations))

    def _loop(self):
        return self._rows_module.depthwise_rows

    def _loop_arguments(self, x, weights, bias, bounds, y, c):
        return (x, weights, bias, bounds, y, np.zeros(self._plane_floats, self._dtype), self._taps, *self._geometry)
