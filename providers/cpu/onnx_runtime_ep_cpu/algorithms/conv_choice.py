"""Which compiled convolution takes a geometry, answered without importing the modules that run them: the
packed convolution (conv_packed.py, AVX-512 hosts), the tiled direct convolution (conv_direct.py, AVX2 hosts),
the product over a batch's pixels (conv_pointwise_batch.py) and the patch product (conv_patches.py). conv_path
weighs them for every convolution at plan time, while a model's first runs are served by numpy
(compiled/deferred.py); their modules load with the builder of the one chosen, when it is built.
"""

from __future__ import annotations

import contextvars
import math
import sys

import numpy as np

from ..threads import kernel_threads
from ..tuning import KNOBS
from .window import Geometry

# Set while a segment's nodes run one by one (ops/segment.py), where their convolutions are chosen: a segment plan
# of one image shares its direct tiles' rows with the helpers (compiled/conv_chain.run_chain_split).
SEGMENT_NODES: contextvars.ContextVar[bool] = contextvars.ContextVar("segment_nodes", default=False)


def packed_conv_applies(geo: Geometry, group: int, x: np.ndarray) -> bool:
    """Whether compiled/gemm.py's packed convolution runs this one: 2-D float32 windows with some output
    on AVX-512 hosts (depthwise convolutions keep their own loop)."""
    if x.dtype != np.float32 or len(geo.kernel) != 2 or (group == x.shape[1] and group > 1)\
            or x.size == 0 or 0 in geo.out:
        return False
    if max(geo.strides) > max(x.shape[2:]):  # a step past the whole image: the padded input grows with the step
        return False
    from ..compiled import host  # gemm.py (numba, the IR microkernel) loads only where it runs

    return host.AVX512


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
# image (measured on the zoo's CNN layers, then on an Inception-style CNN's 1.8M and 3.5M layers, where the
# direct tiles also keep a segment's values blocked and its steps chained; this constant's commit). The choice
# does not depend on the activation a node fuses, so a FusedConv computes bit for bit what its Conv and
# activation nodes do.
SMALL_MACS = 1 << 22


def direct_tiles_before_packed(geo: Geometry, w: np.ndarray, group: int = 1, images: int = 1) -> bool:
    """Whether a convolution that both the packed convolution and the direct tiles take (direct_tiles_apply)
    is small enough for the direct tiles to win; or, where the packed convolution would run on one thread, a
    stem: at most STEM_CHANNELS input channels per group into whole tiles of 16 output channels (the packed
    convolution's 32-channel tiles run half empty there: 3->16 7x7/2 on 64x64 52 vs 59 us, on 224x224 545 vs
    721 us; with 8 or 32 outputs, or more inputs, the packed one won); or, there too, a single row (a 1-D
    convolution, conv_rows.py) of at most ROW_MACS multiply-adds, where the packed convolution's pixel tiles span
    one short row; or, there too, one whose lanes the direct tiles fill enough better (LANE_MACS); or, where it
    would split across threads, where the direct tiles on the calling thread cost less than that split
    (split_cost_favours_direct). ``images``: the batch, which the packed convolution's split counts
    (packed_threads)."""
    macs = w[0].size * w.shape[0] * math.prod(geo.out)
    if macs <= SMALL_MACS:
        return True
    threads = packed_threads(macs * images)
    if threads != 1:  # (the direct tiles run on one thread, the packed convolution splits)
        if images == 1 and SEGMENT_NODES.get() and _fills_lanes(geo, w, group, macs):
            return True  # (a segment's chain shares one image's direct tiles with the helpers: weighed as on one)
        return split_cost_favours_direct(geo, w, group, threads)
    if geo.in_shape[0] == 1 and geo.kernel[0] == 1 and macs <= ROW_MACS:
        return True
    if _fills_lanes(geo, w, group, macs):
        return True
    outputs = w.shape[0] // group
    return w.shape[1] <= STEM_CHANNELS and outputs == CHANNELS_PER_TILE


def _fills_lanes(geo: Geometry, w: np.ndarray, group: int, macs: int) -> bool:
    """The one-thread rule: up to LANE_MACS, the direct tiles' useful lanes outweigh the packed convolution's by
    DIRECT_LANE_COST."""
    if macs > LANE_MACS or len(geo.out) != 2:
        return False
    direct, packed = _lane_costs(geo, w, group)
    return direct * DIRECT_LANE_COST <= packed


STEM_CHANNELS, CHANNELS_PER_TILE = 4, 16
# On one thread, up to LANE_MACS multiply-adds per image, the direct tiles take a convolution whose lanes they
# fill enough better than the packed convolution (_lane_costs) to pay DIRECT_LANE_COST, their cost per lane step
# over the packed one's: 48 outputs fill three 16-channel tiles, one and a half of the packed 32-channel ones.
# Both constants fitted to 3x3 layers on 14x14 to 32x32 maps; past LANE_MACS (a 56x56 map) the direct tiles lost
# even where they filled more lanes (benchmarks/RESULTS.md, thirty-fifth session).
LANE_MACS, DIRECT_LANE_COST = 1 << 25, 1.15
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
    ``threads``: each costs its multiply-adds over its share of useful lanes (_lane_costs), the split one
    divided by the threads' speed-up (HELPER_SHARE each helper) plus SPLIT_MACS. A shallow strided stem
    (resnet's 3->16 7x7/2, whose packed panels gather every window) stays on the direct tiles; deeper, wider
    layers split."""
    direct, packed = _lane_costs(geo, w, group)
    return direct <= packed / (1 + (threads - 1) * HELPER_SHARE) + SPLIT_MACS


def _lane_costs(geo: Geometry, w: np.ndarray, group: int) -> tuple[float, float]:
    """(direct tiles, packed convolution on one thread): the multiply-adds over each one's share of useful
    lanes. Both hold output channels across the lanes: the direct tiles' 16 channels x TILE_PIXELS pixels of a
    row, the packed one's conv_packed_layout.lane_work (whose pixel panels cost more per lane)."""
    from .conv_packed_layout import lane_work  # (loaded where the two are weighed)

    outputs = w.shape[0] // group
    macs = w[0].size * w.shape[0] * math.prod(geo.out)
    ow = geo.out[1]
    direct = macs * (CHANNELS_PER_TILE * -(-outputs // CHANNELS_PER_TILE) / outputs) * (
        TILE_PIXELS * -(-ow // TILE_PIXELS) / ow)
    return direct, macs * lane_work(geo, outputs, w[0].size)


def packed_threads(macs: int) -> int:
    """The threads a packed convolution of ``macs`` multiply-adds (all its images) splits across: none below
    KNOBS.split_macs per thread. conv_direct weighs the direct tiles against this split, not against one that
    does not happen (Whisper's 80 -> 64 front-end layer at two threads ran packed on one thread)."""
    return max(1, min(kernel_threads(), macs // KNOBS.split_macs))


# One output pixel per image (a squeeze-excite block's pooled pixel, a classifier after pooling), or up to
# MAX_PIXELS where the per-image product is large (C*M of at least MIN_PRODUCT: a late stage's 2x2 map); with
# at least _MIN_ROWS rows over the batch (fewer: the few-row products). Measured against the packed
# convolution at batch 32, whole models: it kept 4x4 maps, and small products of 2x2 ones (strided ones too).
MAX_PIXELS = 4
MIN_PRODUCT = 1 << 15
_MIN_ROWS = 16


def pointwise_batch_applies(geo: Geometry, group: int, x: np.ndarray, w: np.ndarray) -> bool:
    """Whether the convolution is a 1x1 window (any stride, no pads) of float32/float64 with few output
    pixels per image and enough images that their pixels make a product of full width."""
    pixels = math.prod(geo.out)
    fits = pixels == 1 or (pixels <= MAX_PIXELS and x.shape[1] * w.shape[0] >= MIN_PRODUCT)
    return (group == 1 and x.dtype in (np.float32, np.float64) and len(geo.kernel) >= 1
            and all(k == 1 for k in geo.kernel) and geo.unpadded and pixels > 0 and fits
            and x.shape[0] * pixels >= _MIN_ROWS and x.shape[1] > 0 and w.shape[0] > 0)


def tiles(compute) -> bool:
    """Whether ``compute`` is the packed convolution or the direct tiles (they write into a given C-contiguous
    output, and take bias, residual and activation straight), without importing their modules: none is, until
    one has been built."""
    packed = sys.modules.get(_PACKED)
    return (packed is not None and isinstance(compute, packed.PackedConv)) or direct_tiles(compute)


def direct_tiles(compute) -> bool:
    """Whether ``compute`` is the direct tiles (conv_direct.DirectConv), without importing its module."""
    direct = sys.modules.get(_DIRECT)
    return direct is not None and isinstance(compute, direct.DirectConv)


_PACKED, _DIRECT = f"{__package__}.conv_packed", f"{__package__}.conv_direct"


_FLOAT32 = np.dtype(np.float32)


def patches_apply(geo: Geometry, group: int, x: np.ndarray, w: np.ndarray) -> bool:
    """Whether a float32 2-D convolution's windows of more than one tap tile its input (kernel = stride, unpadded,
    undilated, one group) onto fewer output columns than a direct tile's pixels (a pointwise convolution keeps its
    own paths)."""
    return (x.dtype == _FLOAT32 and len(geo.kernel) == 2 and group == 1 and tuple(geo.kernel) == tuple(geo.strides)
            and geo.kernel[0] * geo.kernel[1] > 1 and geo.unpadded and tuple(geo.dilations) == (1, 1)
            and 0 < geo.out[1] < TILE_PIXELS and geo.out[0] > 0 and x.shape[0] > 0 and w.shape[0] > 0 and x.ndim == 4)
