"""The tiled direct convolution of compiled/directconv.py on AVX2 hosts without AVX-512: 2-D float32
convolutions of up to KNOBS.direct_macs multiply-adds per image, in one compiled call with a FusedConv's
bias, residual and activation (the light CNNs' layers, where im2col, a BLAS call and an epilogue pass each
cost about what the arithmetic does).
"""

from __future__ import annotations

import math

import numpy as np

from ..tuning import KNOBS
from .prepared import Prepared
from .window import Geometry


def direct_tiles_apply(geo: Geometry, group: int, x: np.ndarray, w: np.ndarray) -> bool:
    """Whether compiled/directconv.py runs this convolution: 2-D float32 on an AVX2 host, not depthwise (a
    tile's 16 output channels would hold one) nor groups of fewer than 8 outputs, with some output and at
    most KNOBS.direct_macs multiply-adds per image (beyond, the BLAS paths' products are faster)."""
    if x.dtype != np.float32 or len(geo.kernel) != 2 or x.size == 0 or 0 in geo.out or w.shape[0] == 0:
        return False
    if max(geo.strides) > max(x.shape[2:]):  # a step past the whole image: the tiles' margin grows with the step
        return False
    outputs = w.shape[0] // group
    if group > 1 and outputs < 8:
        return False
    from ..compiled import host  # (numba loads with directconv.py, only where it runs)

    return host.AVX2 and w[0].size * w.shape[0] * math.prod(geo.out) <= KNOBS.direct_macs


# On AVX-512 hosts the direct tiles (8 lanes, one compiled call) still beat the packed convolution (16 lanes, a
# task plan and padded or phase-split copies per call) on small convolutions: up to this many multiply-adds per
# image (measured on one thread over the zoo's CNN layers). The choice does not depend on the activation a node
# fuses, so a FusedConv computes bit for bit what its Conv and activation nodes do.
SMALL_MACS = 1 << 20


def direct_tiles_before_packed(geo: Geometry, w: np.ndarray, group: int = 1, images: int = 1) -> bool:
    """Whether a convolution that both the packed convolution and the direct tiles take (direct_tiles_apply)
    is small enough for the direct tiles to win; or, where the packed convolution would run on one thread, a
    stem: at most STEM_CHANNELS input channels per group into whole tiles of 16 output channels (the packed
    convolution's 32-channel tiles run half empty there: 3->16 7x7/2 on 64x64 52 vs 59 us, on 224x224 545 vs
    721 us; with 8 or 32 outputs, or more inputs, the packed one won); or, there too, a single row (a 1-D
    convolution, conv_rows.py) of at most ROW_MACS multiply-adds, where the packed convolution's pixel tiles span
    one short row; or, where it would split across threads, where the direct tiles on the calling thread cost
    less than that split (split_cost_favours_direct). ``images``: the batch, which the packed convolution's split
    counts (packed_threads)."""
    macs = w[0].size * w.shape[0] * math.prod(geo.out)
    if macs <= SMALL_MACS:
        return True
    from .conv_packed import packed_threads

    threads = packed_threads(macs * images)
    if threads != 1:  # (the direct tiles run on one thread, the packed convolution splits)
        return split_cost_favours_direct(geo, w, group, threads)
    if geo.in_shape[0] == 1 and geo.kernel[0] == 1 and macs <= ROW_MACS:
        return True
    outputs = w.shape[0] // group
    return w.shape[1] <= STEM_CHANNELS and outputs == CHANNELS_PER_TILE


STEM_CHANNELS, CHANNELS_PER_TILE = 4, 16
# Multiply-adds per image up to which a single-row convolution takes the direct tiles on one thread (beyond, the
# packed convolution caught up on Whisper-like 1-D layers; measured in this constant's commit).
ROW_MACS = 1 << 22
# Output pixels of one row per direct tile on AVX-512 hosts (compiled/directconv.PIXELS there: the only hosts
# where the packed convolution competes), mirrored so the choice imports no numba.
TILE_PIXELS = 8
# What the helpers add to a split convolution, as a share of a thread each (measured on a 2-core host shared
# with other processes, where a helper is often descheduled: well short of a whole thread; this constant's
# commit), and the split's fixed cost (the job's post, the helpers' wake and claims) in multiply-adds of a
# tile's arithmetic.
HELPER_SHARE = 0.5
SPLIT_MACS = 1 << 18


def split_cost_favours_direct(geo: Geometry, w: np.ndarray, group: int, threads: int) -> bool:
    """Whether the direct tiles on the calling thread cost no more than the packed convolution split across
    ``threads``: both hold output channels across the lanes, so each costs its multiply-adds over its share
    of useful lanes (the direct tiles': 16 channels x TILE_PIXELS pixels of a row; the packed one's:
    conv_packed.lane_work, whose pixel panels cost more per lane), the split one divided by the threads'
    speed-up (HELPER_SHARE each helper) plus SPLIT_MACS. A shallow strided stem (resnet's 3->16 7x7/2, whose
    packed panels gather every window) stays on the direct tiles; deeper, wider layers split."""
    from .conv_packed import lane_work

    outputs = w.shape[0] // group
    macs = w[0].size * w.shape[0] * math.prod(geo.out)
    ow = geo.out[1]
    direct = macs * (CHANNELS_PER_TILE * -(-outputs // CHANNELS_PER_TILE) / outputs) * (
        TILE_PIXELS * -(-ow // TILE_PIXELS) / ow)
    packed = macs * lane_work(geo, outputs, w[0].size) / (1 + (threads - 1) * HELPER_SHARE) + SPLIT_MACS
    return direct <= packed


_IDENTITY_BOUNDS = np.array([-np.inf, np.inf, 1.0], dtype=np.float32)


class DirectConv:
    """One geometry's tiled direct convolution: weights packed once per constant array, the bias padded
    to whole tiles once per constant array, and a FusedConv's epilogue applied as each tile is stored."""

    takes_residual = True  # (run adds one)

    def __init__(self, geo: Geometry, group: int, x_shape, w_shape, prepared: Prepared):
        from ..compiled import directconv

        self._kernel, self._group, self._prepared = directconv, group, prepared
        n, c, height, width = x_shape
        (kh, kw), (sh, sw), (dh, dw), (oh, ow) = geo.kernel, geo.strides, geo.dilations, geo.out
        self._out = (n, w_shape[0], oh, ow)
        self._view = None  # a pointwise window's input and output as one row of pixels
        if geo.kernel == (1, 1) and geo.strides == (1, 1) and geo.unpadded:
            height, width, oh, ow = 1, height * width, 1, oh * ow
            self._view = ((n, c, 1, width), (n, w_shape[0], 1, ow))
        # The windows read x itself where it needs no pads and its rows hold a whole tile; else its
        # padded copy, as far as the windows reach.
        self._in_place = geo.unpadded and ow >= directconv.PIXELS
        if self._in_place:
            padded = (height, width)
        else:
            padded = ((oh - 1) * sh + (kh - 1) * dh + 1, (ow - 1) * sw + (kw - 1) * dw + 1)
        self._geometry = (sh, sw, *geo.begin, *padded, self._in_place)
        self._offsets = directconv.tap_offsets(c // group, kh, kw, dh, dw, padded[1], padded[0] * padded[1])
        self._tiles = -(-(w_shape[0] // group) // directconv.CHANNELS)
        self._bias_cache = (None, None)  # (the bias array last seen, its padded copy)
        self._no_residual = np.empty(0, dtype=np.float32)
        self._weights_held = (None, None)  # (the read-only weights last seen, packed)

    def _bias(self, b) -> np.ndarray:
        """The bias padded to whole tiles per group, kept while the same read-only array comes in."""
        seen, padded = self._bias_cache  # one read: another thread may swap in a new pair meanwhile
        if seen is not None and seen is b:
            return padded
        padded = self._kernel.pack_bias(b if b is not None and b.size else None, self._group, self._tiles)
        if b is not None and not b.flags.writeable:
            self._bias_cache = (b, padded)
        return padded

    def __call__(self, x, w, b, finish, out=None):
        """conv_path's compute: the convolution, with ``finish`` (an _Epilogue) applied as it is stored."""
        if finish is None:
            return self.run(x, w, b, None, _IDENTITY_BOUNDS, False, out)
        residual = finish.residual if finish.residual.size else None
        return self.run(x, w, finish.bias, residual, finish.bounds, False, out)

    def bind(self, x, w, b, residual, bounds, hard_swish, y):
        """``[(loop, arguments)]``: the call of ``run`` into ``y`` for these arrays, prepared once (a segment's
        bound plan, ops/segment.py; x, y and ``residual`` C-contiguous buffers, w and b constants)."""
        kernel = self._kernel
        weights = self._prepared.get("direct_tiles", (w,), lambda: kernel.pack_weights(w, self._group))
        flags = (kernel.BIAS if b is not None and b.size else 0) | (kernel.HARD_SWISH if hard_swish else 0)
        if residual is None:
            residual = self._no_residual
        else:
            residual, flags = residual.reshape(-1), flags | kernel.RESIDUAL
        if self._view is not None:
            x, y = x.reshape(self._view[0]), y.reshape(self._view[1])
        return [(kernel.conv_direct, (x, weights, self._offsets, self._bias(b), residual, bounds, flags, y,
                                      *self._geometry))]

    def bound_run(self, x, w, b, bounds, hard_swish: bool, shape: tuple | None = None):
        """``run(x)``: run(x, w, b, None, bounds, hard_swish) (shaped ``shape``, the output's by default) for a float32
        x of x's size (a 1-D convolution's (N, C, L) for its row view, say), as one call
        of the compiled loop's entry point (the weights, bias, flags and loop looked up once: a streaming model's
        small convolution costs about as much in those as in its arithmetic); None where w or b is not a constant
        (read-only) array or the loop has no linked overload for these types."""
        from .products import entry_point

        if w.flags.writeable or (b is not None and b.flags.writeable) or not x.flags.c_contiguous:
            return None
        kernel = self._kernel
        weights = self._prepared.get("direct_tiles", (w,), lambda: kernel.pack_weights(w, self._group))
        flags = (kernel.BIAS if b is not None and b.size else 0) | (kernel.HARD_SWISH if hard_swish else 0)
        offsets, bias, residual, geometry, out = self._offsets, self._bias(b), self._no_residual, self._geometry, \
            self._out
        x_view, y_view = self._view if self._view is not None else (x.shape, out)
        arguments = (x.reshape(x_view), weights, offsets, bias, residual, bounds, flags,
                     np.empty(out, np.float32).reshape(y_view), *geometry)
        entry = entry_point(kernel.conv_direct, arguments)
        if entry is None:
            return None

        result = out if shape is None else shape

        def run(x):
            y = np.empty(result, np.float32)
            entry(x.reshape(x_view), weights, offsets, bias, residual, bounds, flags, y.reshape(y_view), *geometry)
            return y

        return run

    def run(self, x, w, b, residual, bounds, hard_swish=False, out=None):
        """The convolution of float32 x by w, + b (None or empty: none), + ``residual`` (the output's shape,
        or None) and the activation ``bounds`` (epilogue.activation_bounds), into ``out`` (C-contiguous)
        or a new array, then HardSwish where ``hard_swish``: a FusedConv calls this straight (ops/conv.py),
        without an _Epilogue."""
        kernel = self._kernel
        held, weights = self._weights_held  # one read: another thread may swap in a new pair meanwhile
        if held is not w:
            weights = self._prepared.get("direct_tiles", (w,), lambda: kernel.pack_weights(w, self._group))
            if not w.flags.writeable:
                self._weights_held = (w, weights)
        flags = (kernel.BIAS if b is not None and b.size else 0) | (kernel.HARD_SWISH if hard_swish else 0)
        if residual is None:
            residual = self._no_residual
        else:
            residual, flags = np.ascontiguousarray(residual).reshape(-1), flags | kernel.RESIDUAL
        y = np.empty(self._out, dtype=np.float32) if out is None else out
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        if self._view is not None:
            kernel.conv_direct(x.reshape(self._view[0]), weights, self._offsets, self._bias(b), residual, bounds,
                               flags, y.reshape(self._view[1]), *self._geometry)
        else:
            kernel.conv_direct(x, weights, self._offsets, self._bias(b), residual, bounds, flags, y, *self._geometry)
        return y
