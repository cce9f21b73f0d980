"""Which algorithm computes a convolution, chosen once per input signature: a few-row product for a 1x1
kernel over a 1x1 image, the packed convolution (2-D float32 on AVX-512 hosts), the tiled direct
convolution (small 2-D float32 ones on AVX2 hosts), the depthwise loops, a
direct gathered loop for few output positions, per-tap products, Winograd, a plain product for 1x1
kernels, im2col over contiguous rows, or im2col.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from ..blas import available as blas_accumulates
from ..compiled import deferred
from ..compiled import takes as takes_compiled
from ..tuning import KNOBS
from .conv_blas import (
    conv_by_taps,
    conv_im2col,
    conv_pointwise,
    conv_tight_rows,
    conv_winograd,
    grouped_weights,
    rows_fit,
    tap_weights,
    tight_fits,
    winograd_weights,
)
from .conv_choice import (
    direct_tiles_apply,
    direct_tiles_before_packed,
    packed_conv_applies,
    patches_apply,
    pointwise_batch_applies,
    tiles,
)
from .precision import compute_dtype
from .prepared import Prepared
from .products import GEMV_ROWS, few_rows_product
from .window import Geometry


def use_taps(geo: Geometry, group: int, c: int, m: int, dtype) -> bool:
    """Per-tap matmuls pay off for stride-1 2-D kernels with a few outputs per input channel, and,
    where BLAS accumulates in place, for few input channels on wide images: the im2col copy (K times
    the input) then costs more than the shorter products, and the padded rows waste little."""
    if group != 1 or not rows_fit(geo):
        return False
    column_bytes = c * math.prod(geo.kernel) * math.prod(geo.out) * dtype.itemsize
    # (the size first: asking whether BLAS accumulates probes the library once per process, with a test product)
    return 4 * m <= c or (column_bytes >= KNOBS.taps_column_bytes and blas_accumulates(dtype))


def use_winograd(geo: Geometry, group: int, c: int, m: int) -> bool:
    """Winograd pays where the channel-mixing products dominate: enough input channels for long
    products (K = C) and enough outputs, on images with enough tiles per product (a 7x7 image loses,
    1880a80; below 192 channels the im2col paths are faster, afcca01: both measured on the CNNs) but small
    enough for the tile stacks to stay near the cache."""
    return (geo.kernel == (3, 3) and geo.strides == (1, 1) and geo.dilations == (1, 1) and group == 1
            and c >= 192 and m >= 192 and 12 * 12 <= math.prod(geo.out) <= 28 * 28)


# A direct loop pays while the products are too short for BLAS's setup: up to this many output positions
# per image, with a gather table (and gathered columns) of at most _DIRECT_TABLE entries, which stay in the
# L1/L2 cache while every output channel's row passes over them.
DIRECT_POSITIONS = 16
_DIRECT_TABLE = 1 << 14


def direct_applies(geo: Geometry, group: int, x: np.ndarray, w: np.ndarray) -> bool:
    """Whether a convolution has so few output positions per image (a streaming model's frames) that the
    compiled direct loop (compiled/smallconv.py) beats im2col and a BLAS product."""
    positions = math.prod(geo.out)
    pointwise = all(k == 1 for k in geo.kernel) and geo.unpadded and all(s == 1 for s in geo.strides)
    # (A pointwise convolution's pixels are its columns already: conv_pointwise is one product, nothing to gather.)
    return (not pointwise and takes_compiled(x) and compute_dtype(x.dtype) == x.dtype
            and 0 < positions <= DIRECT_POSITIONS
            and positions * w[0].size <= _DIRECT_TABLE and x.shape[0] > 0 and w.shape[0] > 0)


def direct_conv(geo: Geometry, group: int, x_shape, w_shape, prepared: Prepared, dtype):
    """``compute(x, w, b)`` by compiled/smallconv.py's gathered loop; its offset table is built here, once."""
    from ..compiled.smallconv import conv_gathered, gather_table

    n, c, m = x_shape[0], x_shape[1], w_shape[0]
    cg, mg = c // group, m // group
    table = gather_table(geo.in_shape, geo.kernel, geo.strides, geo.dilations, geo.begin, geo.out, cg)
    shape, flat = (n, group, mg, table.shape[0]), (n, group, -1)
    no_bias = np.empty((0, 0), dtype)

    def arranged(w, b):
        weights = np.ascontiguousarray(w.astype(dtype, copy=False).reshape(group, mg, -1))
        return weights, no_bias if b is None else np.ascontiguousarray(b.astype(dtype, copy=False).reshape(group, mg))

    kept: list = [(None, None, None)]  # (w, b, arranged): Prepared's rule, inlined for one call's worth of Python

    def compute(xc, w, b):
        held_w, held_b, weights_bias = kept[0]
        if held_w is not w or held_b is not b:
            weights_bias = prepared.get("direct", (w, b), lambda: arranged(w, b))
            if not w.flags.writeable and (b is None or not b.flags.writeable):
                kept[0] = (w, b, weights_bias)
        weights, bias = weights_bias
        y = np.empty(shape, dtype)
        conv_gathered((xc if xc.flags.c_contiguous else np.ascontiguousarray(xc)).reshape(flat), weights, bias,
                      table, y)
        return y

    return compute


def pixel_product_applies(geo: Geometry, group: int, x: np.ndarray) -> bool:
    """Whether a convolution is a few-row product: a 1x1 kernel over a 1x1 image (a convolutional
    classifier after global pooling, as DenseNet's and MobileNet's) of float32 with a few images. The
    packed convolution would compute 32 lanes for its one pixel (measured in 09463a0)."""
    return (group == 1 and x.dtype == np.float32 and len(geo.kernel) == 2 and geo.kernel == (1, 1)
            and geo.in_shape == (1, 1) and geo.unpadded and 0 < x.shape[0] <= GEMV_ROWS and x.shape[1] > 0)


def pixel_product(x: np.ndarray, w: np.ndarray, b) -> np.ndarray:
    """y (N, M, 1, 1) = w (M, C, 1, 1) applied to x's one pixel per image (N, C, 1, 1) (+ b), through
    linalg's few-row products (compiled/gemv.py on AVX-512 hosts, BLAS elsewhere)."""
    n, c, m = x.shape[0], x.shape[1], w.shape[0]
    rows, weights = x.reshape(n, c), w.reshape(m, c)
    y = few_rows_product(rows, weights, True)
    if y is None:
        y = rows @ weights.T
    if b is not None:
        y += b.astype(np.float32, copy=False)
    return y.reshape(n, m, 1, 1)


def compiled_compute(geo: Geometry, group: int, x: np.ndarray, w: np.ndarray, prepared: Prepared, dtype):
    """``build() -> (compute, blocks)`` of the compiled convolution (packed, direct tiles, depthwise lanes or
    loop) that takes this geometry, whose modules import numba; None where none does."""
    c, m = x.shape[1], w.shape[0]
    if pixel_product_applies(geo, group, x) or pointwise_batch_applies(geo, group, x, w):  # (numpy_compute's)
        return None
    if patches_apply(geo, group, x, w):  # (before the direct tiles, whose lanes such a map leaves mostly empty)
        def patches():
            from .conv_patches import PatchConv  # (with the first convolution that takes it)

            return PatchConv(geo, x.shape, w.shape, prepared), True

        return patches
    direct = direct_tiles_apply(geo, group, x, w)
    if packed_conv_applies(geo, group, x) and not (direct and direct_tiles_before_packed(geo, w, group, x.shape[0])):
        return _running(lambda: (_packed(geo, group, x.shape, w.shape, prepared), True), "jobs.CONV", "jobs.PAD")
    if direct:
        build = lambda: (_direct_tiles(geo, group, x.shape, w.shape, prepared), True)  # noqa: E731
        # (a plan's groups, or an ungrouped one's rows, split: DirectConv.bind)
        return _running(build, "jobs.DIRECT" if group > 1 else "jobs.DIRECT_ROWS")
    if group == c and group > 1:
        return _compiled_depthwise(geo, x, m, prepared, dtype)
    return None


def _packed(geo: Geometry, group: int, x_shape, w_shape, prepared: Prepared):
    from .conv_packed import PackedConv  # (loaded with its builder: the choice weighs it by conv_choice)

    return PackedConv(geo, group, x_shape, w_shape, prepared)


def _direct_tiles(geo: Geometry, group: int, x_shape, w_shape, prepared: Prepared):
    from .conv_direct import DirectConv  # (as _packed)

    return DirectConv(geo, group, x_shape, w_shape, prepared)


def _compiled_depthwise(geo: Geometry, x: np.ndarray, m: int, prepared: Prepared, dtype):
    """compiled_compute's builder for a depthwise convolution, or None. The depthwise modules load here, at a
    model's first depthwise convolution: a model without one never imports them."""
    from . import conv_depthwise as depthwise
    from . import conv_depthwise_blocks as blocks
    from . import conv_depthwise_small as small

    if small.pairs_depthwise_apply(geo, x, m):
        return lambda: (small.PairsDepthwise(geo, prepared, dtype), True)
    if small.rows_depthwise_apply(geo, x, m):
        return lambda: (small.RowsDepthwise(geo, prepared, dtype), True)
    if blocks.blocks_depthwise_apply(geo, x, m):
        return _running(lambda: (blocks.BlocksDepthwise(geo, prepared), True), "jobs.DEPTHWISE_BLOCKS")
    if small.flat_depthwise_apply(geo, x, m):
        return lambda: (small.FlatDepthwise(geo, prepared, dtype), True)
    if depthwise.depthwise_lanes_apply(geo, x, m):
        return lambda: (depthwise.LanesDepthwise(geo, prepared), True)
    if depthwise.depthwise_compiles(geo, x):
        return _running(lambda: (depthwise.compiled_depthwise(geo, m, prepared, dtype), True), "jobs.DEPTHWISE")
    return None


def lanes_depthwise(compute) -> bool:
    """Whether ``compute`` is the depthwise lanes loop (conv_depthwise.LanesDepthwise), without importing its
    module: none is, until a depthwise convolution has loaded it."""
    module = sys.modules.get(f"{__package__}.conv_depthwise")
    return module is not None and isinstance(compute, module.LanesDepthwise)


def _running(build, *kinds: str):
    """``build`` with the job kinds its convolution runs (``build.kinds``), which the background loader has
    ready before the numpy path gives way (compiled/deferred.numpy_first)."""
    build.kinds = kinds
    return build


def numpy_compute(geo: Geometry, group: int, x: np.ndarray, w: np.ndarray, prepared: Prepared, dtype,
                  interim: bool = False):
    """``(compute, blocks)``: the convolution by numpy and BLAS (the loops it calls have numpy equivalents
    that serve while numba loads, compiled/generic.py), for what no compiled convolution takes and for the
    first runs of what one does (see conv_path). ``interim``: it serves only until a compiled convolution takes
    over, so the direct gathered loop's offset table (a few hundred microseconds per convolution to build) is
    not made for it: im2col serves those few calls."""
    c, m = x.shape[1], w.shape[0]

    def grouped(w, b):
        return prepared.get("grouped", (w, b), lambda: grouped_weights(w, b, group, dtype))

    if pixel_product_applies(geo, group, x):
        def compute(xc, w, b):
            return pixel_product(xc, w, b)

        def bind(xc, w, b, finish, y):
            """The product into ``y`` prepared once (a segment's bound plan): BLAS, then bias and activation."""
            n, c, m = xc.shape[0], xc.shape[1], w.shape[0]
            weights = prepared.get("pixel_columns", (w,), lambda: np.ascontiguousarray(w.reshape(m, c).T))
            rows = y.reshape(n, m)
            steps = [(np.matmul, (xc.reshape(n, c), weights, rows))]
            if finish is not None:
                steps.append((finish.rows, (y.reshape(n, m, 1), 0, 1)))
            elif b is not None:
                steps.append((np.add, (rows, b.astype(np.float32, copy=False), rows)))
            return steps

        compute.bind = bind
        return compute, False
    if pointwise_batch_applies(geo, group, x, w):
        from .conv_pointwise_batch import PointwiseBatch  # (loaded where it is chosen)

        return PointwiseBatch(geo, prepared, dtype), False
    if group == c and group > 1:
        from . import conv_depthwise as depthwise  # (loaded at the first depthwise convolution)

        def compute(xc, w, b):
            return depthwise.conv_depthwise(xc, grouped(w, b), geo, b is not None)
        return compute, False
    if not interim and direct_applies(geo, group, x, w):
        return direct_conv(geo, group, x.shape, w.shape, prepared, dtype), False
    if use_taps(geo, group, c, m, dtype):
        def compute(xc, w, b, finish):
            return conv_by_taps(xc, prepared.get("taps", (w,), lambda: tap_weights(w, dtype)), b, geo, finish)
        return compute, True
    if use_winograd(geo, group, c, m) and not w.flags.writeable:  # its weight transform is done once
        def compute(xc, w, b):
            return conv_winograd(xc, prepared.get("winograd", (w,), lambda: winograd_weights(w, dtype)), b, geo)
        return compute, False
    if all(k == 1 for k in geo.kernel) and geo.unpadded and all(s == 1 for s in geo.strides):
        def compute(xc, w, b):
            return conv_pointwise(xc, grouped(w, b), group, b is not None)
        return compute, False
    if group == 1 and tight_fits(geo):
        def compute(xc, w, b, finish):
            return conv_tight_rows(xc, grouped(w, b), geo, b is not None, finish)
        return compute, True

    def compute(xc, w, b, finish):
        return conv_im2col(xc, grouped(w, b), geo, group, b is not None, finish)
    return compute, True


def conv_path(geo: Geometry, group: int, x: np.ndarray, w: np.ndarray, prepared: Prepared) -> ConvPath:
    """``path(x, w, b, finish) -> y`` for inputs shaped like ``x`` and ``w``: the convolution algorithm
    for this geometry, chosen once per input signature. ``finish`` (an _Epilogue for float32/float64,
    or None) is a FusedConv's bias, residual and activation: the im2col, tight-row and taps paths
    apply it to each block of output as they write it, the others to the whole output at the end.

    A compiled convolution's modules import numba, which a new process loads in the background while
    numpy serves its first runs (compiled/deferred.py): while that loader has not finished, the path takes
    numpy_compute's algorithm, and switches to the compiled one at its first call after."""
    return ConvPath(geo, group, x, w, prepared)


class ConvPath:
    """conv_path's callable: an object, not closures calling each other, so that a dropped session's
    convolutions are freed as their last reference goes rather than at the next cyclic collection.

    ``direct``: the packed convolution, direct tiles or depthwise lanes chosen, for callers that pass bias,
    residual and activation straight (a call costs a few microseconds of Python less than through the path),
    else None; ``direct_tried``: whether one such call ran (ops/conv.py; their arguments are the caller's,
    not the tried call's); ``binds_residual``: whether ``bind`` applies a finish's residual too."""

    def __init__(self, geo: Geometry, group: int, x: np.ndarray, w: np.ndarray, prepared: Prepared):
        self._geo, self._group, self._prepared = geo, group, prepared
        self._dtype = dtype = compute_dtype(x.dtype)
        self._out_shape = (x.shape[0], w.shape[0], *geo.out)
        build = compiled_compute(geo, group, x, w, prepared, dtype)
        self._pending = None  # the compiled convolution's builder, while numpy serves
        self._kinds = getattr(build, "kinds", ())
        # (guarding: until a call of the compiled one has run, numba's cache may miss a loop it calls: tried first)
        if build is not None and (deferred.numpy_first(*self._kinds) or deferred.guarding()):
            chosen, self._pending = numpy_compute(geo, group, x, w, prepared, dtype, interim=True), build
        else:
            chosen = build() if build is not None else numpy_compute(geo, group, x, w, prepared, dtype)
        # (compute, blocks, reads_shuffled), read once per call: runs from several threads see one whole choice
        self._current: tuple = (None, False, False)
        self._served: tuple | None = None  # numpy's algorithm, made at the first direct call that missed the cache
        self._take(chosen)

    def _take(self, choice) -> None:
        compute, blocks = choice
        self._current = (compute, blocks, getattr(compute, "reads_shuffled", False))
        self.direct = compute if tiles(compute) or lanes_depthwise(compute) else None
        self.direct_tried = False
        self.binds_residual = getattr(compute, "binds_residual", False)

    def __call__(self, x, w, b, finish, out=None, shuffle=None):
        """The convolution; with ``out`` (the output's shape and dtype), written there (in place by the
        packed convolution when ``out`` is C-contiguous: one image's channels of a larger tensor); with
        ``shuffle`` (a _ChannelShuffle), of x's channels shuffled."""
        builder = self._pending
        if builder is not None and not deferred.numpy_first(*self._kinds):
            # Tried: a loop it calls that numba's cache misses is compiled by the loader's child meanwhile
            # (compiled/deferred.Trial), and numpy serves this call. (Two threads may both build it: the same
            # algorithm, the last one kept.)
            served = self._current
            try:
                with deferred.Trial():
                    self._take(builder())
                    y = self._run(x, w, b, finish, out, shuffle)
            except deferred.WouldCompile:
                self._current, self.direct = served, None
            else:
                self._pending = None
                return y
        return self._run(x, w, b, finish, out, shuffle)

    def numpy(self, x, w, b, finish, out=None, shuffle=None):
        """The path by numpy's algorithm: for a call whose direct loop missed numba's cache inside a Trial (the
        loader's child compiles it meanwhile), which must not compile on this thread."""
        if self._served is None:
            compute, blocks = numpy_compute(self._geo, self._group, x, w, self._prepared, self._dtype, interim=True)
            self._served = (compute, blocks, getattr(compute, "reads_shuffled", False))
        return self._run(x, w, b, finish, out, shuffle, self._served)

    def _run(self, x, w, b, finish, out, shuffle, choice=None):
        compute, blocks, reads_shuffled = self._current if choice is None else choice
        if shuffle is not None and not reads_shuffled:
            x, shuffle = shuffle.apply(x), None
        dtype = self._dtype
        xc = x.astype(dtype, copy=False)
        if out is not None and dtype == x.dtype and out.flags.c_contiguous and tiles(compute):
            return compute(xc, w, b, finish, out)
        if out is not None:
            out[...] = self._run(x, w, b, finish, None, shuffle, choice)
            return out
        if blocks:
            y = compute(xc, w, b, finish) if shuffle is None else compute(xc, w, b, finish, shuffle.source)
        else:
            y = compute(xc, w, b)
            if finish is not None:
                y = np.ascontiguousarray(y)  # finished in place, through a reshaped view
                pixels = math.prod(self._geo.out)
                finish.rows(y.reshape(self._out_shape[0], self._out_shape[1], pixels), 0, pixels)
        return y.reshape(self._out_shape).astype(x.dtype, copy=False)

    def settle(self) -> None:
        """Where numpy served the calls so far (compiled/deferred.py, compiled/reference_run.py) and need not now:
        the compiled convolution, for a bound plan's calls; numpy's stays where a loop it needs misses the cache
        while the loader guards (its child compiles it; the plan is made again once it has)."""
        builder = self._pending
        if builder is None or deferred.numpy_first(*self._kinds):
            return
        try:
            with deferred.Trial():
                self._take(builder())
        except deferred.WouldCompile:
            return
        self._pending = None

    def bind(self, x, w, b, finish, y):
        """The current algorithm's call into the C-contiguous ``y`` prepared once, as ``[(function, arguments)]``
        (a segment's bound plan, ops/segment.py), where it can be (its ``bind``); else None."""
        compute = self._current[0]
        prepare = getattr(compute, "bind", None)
        dtype = self._dtype
        if prepare is None or self._pending is not None or x.dtype != dtype or y.dtype != dtype \
                or y.shape != self._out_shape:
            return None
        return prepare(x, w, b, finish, y)
