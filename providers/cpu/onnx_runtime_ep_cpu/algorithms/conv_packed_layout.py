"""How the packed convolution (conv_packed.py) lays a window out over its lanes, and what that costs: output
channels across the lanes or pixel panels (lanes_apply), strided windows split into their stride's phases
(phase_split), and its work per useful multiply-add (lane_work), which conv_choice weighs against the direct
tiles'. Plain arithmetic over the tiles' shapes, so weighing a layout imports no numba.
"""

from __future__ import annotations

import math

from ..tuning import KNOBS
from .window import Geometry


def lane_grid(geo: Geometry, padded_width: int) -> int:
    """The width of the rows the packed convolution's lanes run over: the padded width for stride-1
    windows (each column row of a panel is then one contiguous copy) unless the columns past the
    output's width would waste more than the copies save (narrow images); else the output's width."""
    if geo.strides == (1, 1) and padded_width <= geo.out[1] * _GRID_WASTE:
        return padded_width
    return geo.out[1]


_GRID_WASTE = 1.3


def lanes_apply(geo: Geometry, outputs: int, depth: int) -> bool:
    """Whether the packed convolution puts output channels across its lanes (compiled/lanes.py) for this
    window with ``outputs`` channels per group and a reduction of ``depth``: column strides 1 and 2 (the
    kernel's pixel steps), where its share of useful lanes (channels in tiles of 32, pixels in row chunks
    of 14) times its gain at equal shares (_LANES_GAIN; _LANES_GAIN_SHALLOW for shallow stems, where each
    panel tile mostly stores; measured in 14dd70b) beats the pixel panels' (pixels in panels of 32 over the
    lane grid, channels in tiles of 8 or 12)."""
    shares = _lane_shares(geo, outputs)
    return shares is not None and shares[0] * _lanes_gain(depth) >= shares[1]


def _lanes_gain(depth: int) -> float:
    return _LANES_GAIN_SHALLOW if depth < 64 else _LANES_GAIN


# The tiles' shapes (compiled/lanes.py's CHANNELS x PIXELS and shape(), gemm.py's NR and tile_rows), mirrored so
# that weighing a layout (here and conv_direct's choice at plan time) imports no numba; test_conv_cost checks them.
LANE_CHANNELS, LANE_PIXELS, PANEL_PIXELS = 32, 14, 32


def lane_tile(out_width: int) -> tuple[int, int]:
    """compiled/lanes.shape: (pixels per row chunk, rows) of a lane tile."""
    return (LANE_PIXELS // 2, 2) if out_width <= LANE_PIXELS // 2 else (LANE_PIXELS, 1)


def panel_rows(m: int) -> int:
    """compiled/gemm.tile_rows: output channels per panel tile, 12 or 8."""
    return 8 if -(-m // 12) * 12 > 1.06 * (-(-m // 8) * 8) else 12


def _lane_shares(geo: Geometry, outputs: int) -> tuple[float, float] | None:
    """(the channel-lane tiles' share of useful lanes, the pixel panels'), or None where the lanes do not
    take this window (column strides other than 1 and 2) or the output is empty."""
    if geo.strides[1] not in (1, 2):
        return None
    (oh, ow), pixels = geo.out, math.prod(geo.out)
    if not pixels or not outputs:  # an empty output: nothing to weigh
        return None
    columns, rows = lane_tile(ow)
    tiles = LANE_CHANNELS * -(-outputs // LANE_CHANNELS)
    by_lanes = outputs / tiles * pixels / (-(-oh // rows) * rows * -(-ow // columns) * columns)
    return by_lanes, _panel_share(geo, outputs)


def _panel_share(geo: Geometry, outputs: int) -> float:
    (oh, _), pixels = geo.out, math.prod(geo.out)
    grid = lane_grid(geo, geo.padded_shape(geo.in_shape)[1])
    mr = panel_rows(outputs)
    return pixels / (PANEL_PIXELS * -(-(oh * grid) // PANEL_PIXELS)) * outputs / (mr * -(-outputs // mr))


def lane_work(geo: Geometry, outputs: int, depth: int) -> float:
    """The packed convolution's work per useful multiply-add on one thread, in channel-lane tile steps (the
    unit of the direct tiles, conv_direct.DirectConv, whose tiles also hold output channels across the
    lanes), for the layout it takes (lanes_apply): one over the lanes' useful share; or the pixel panels'
    _lanes_gain over theirs, plus, for a strided window not split into phases, the packing of each panel
    (a gather of its input values, PANEL_GATHER lane steps each, shared by the output channels). A pointwise
    window runs as one row of pixels, as PackedConv runs it. (For conv_direct's choice between the two.)"""
    if math.prod(geo.out) == 0 or outputs == 0:
        return math.inf
    if geo.kernel == (1, 1) and geo.strides == (1, 1) and geo.unpadded:
        pixels = math.prod(geo.out)
        geo = Geometry((1, pixels), (1, 1), (1, 1), (1, 1), (0, 0), (0, 0), (1, pixels))
    shares = _lane_shares(geo, outputs)
    gain = _lanes_gain(depth)
    if shares is not None and shares[0] * gain >= shares[1]:
        return 1 / shares[0]
    work = gain / _panel_share(geo, outputs)
    if geo.strides != (1, 1) and phase_split(geo, geo.padded_shape(geo.in_shape), outputs) is None:
        work += PANEL_GATHER / outputs
    return work


# A strided panel's gathered input value, in lane tile steps (fitted to shallow 7x7/2 stems of 16-64 outputs on
# one thread, the panels against the direct tiles: this constant's commit).
PANEL_GATHER = 8


_LANES_GAIN, _LANES_GAIN_SHALLOW = 1.25, 1.8


def phase_split(geo: Geometry, padded: tuple, outputs: int) -> tuple[int, int] | None:
    """(phase height, phase width) when the packed convolution runs this strided window over the padded
    image split into its stride's phases, else None. Phase (p, q) holds every sh-th row from p and sw-th
    column from q; an output's taps then lie at its own position in the phases they read, so the window
    reads them in place, as a stride-1 window does its image (compiled/gemm.phase_tap_offsets), where the
    strided window otherwise packs every panel first (a gather per run of a few pixels). For windows whose
    taps read every phase (3x3/2, 7x7/2, 11x11/4; a 1x1/2 window reads one, and its packed panels, a
    gather of those pixels only, measured faster than copying that phase in d171de6), with at least
    _PHASE_MACS multiply-adds per input value (the split is a copy of the input), and phases no wider than
    _GRID_WASTE times the output (the lanes past its width are dropped)."""
    (sh, sw), (kh, kw), (dh, dw), ow = geo.strides, geo.kernel, geo.dilations, geo.out[1]
    phase_h, phase_w = -(-padded[0] // sh), -(-padded[1] // sw)
    read = {(i * dh % sh, j * dw % sw) for i in range(kh) for j in range(kw)}
    if (sh, sw) == (1, 1) or len(read) < sh * sw or phase_w > ow * _GRID_WASTE\
            or outputs * kh * kw < KNOBS.phase_macs * sh * sw:
        return None
    return phase_h, phase_w
