"""Depthwise 2-D convolution (one input channel per group) as one compiled loop.

Each input channel is copied once into zero-padded phase planes: for strides (sh, sw), plane
(a, b) holds the padded input's rows a, a + sh, ... and columns b, b + sw, ... Every kernel tap then
reads one plane at a fixed offset from the output position, so an output channel is a few long
contiguous passes over the flattened output grid, each summing several taps (the grid is a few
columns wider than the output, so that a row's taps never wrap into the next row; the extra columns
are dropped when the grid is copied out). Pads need no bounds checks: the planes hold the zeros.

The loop indexes flat arrays with unsigned offsets: numba wraps a negative signed index around,
and that per-element test keeps LLVM from vectorizing, while array views (slices) made inside the
loops were measured to cost reference counting on every row.

On AVX-512 hosts a float32 3x3 window of stride 1 or 2 (the depthwise layers of MobileNet, ShuffleNet,
EfficientNet) skips the planes: windows.py's kernel reads the input rows in place with masked vector
loads, 7 output rows of 16 columns at a time, bias and activation applied as it stores. On small
planes the copies into and out of the planes cost more than the taps themselves (measured in d57ce75).
"""

from __future__ import annotations

import numpy as np

from . import compiler, gemm, llvm, windows
from .epilogue import activate

# As compiled.jit, and the loop may fuse each multiply-add of a tap into one instruction: half the
# floating-point work, and one rounding instead of two, as in the BLAS products of the numpy path.
_fused = compiler(fastmath={"contract"})
# Helpers are inlined into the loop (a call between compiled functions costs tens of nanoseconds).
_inline = compiler(inline="always")

_U = np.uint64  # offsets: numba types a signed/unsigned mix as float64, so every index term is cast
_TWO = np.uint64(2)

# Output grid elements summed per pass: the accumulator and the plane rows it reads stay in L1.
_BLOCK = 2048
# Passes run over a multiple of this many grid elements (the planes have the tail they read): the
# vectorized loop steps this far at a time, and a short grid would otherwise run element by element.
_STEP = 32
# Row length up to which the copies in and out of the planes go through index maps: one loop per
# channel instead of one per row, which costs more than the copy itself on short rows (measured:
# up to 8 outputs per row out, and 16 inputs per row in, or 32 read as stride-2 pairs).
_SHORT_ROW = 8


class DepthwisePlan:
    """The phase planes of one geometry, and ``plan(x, weights, bias) -> y`` running the loop.

    x is (N, C, H, W); ``weights`` (M, KH*KW) and ``bias`` (M,), C-contiguous in x's dtype, with
    M a multiple of C. Pads are zeros; ``begin`` holds the pads before each dim.
    """

    def __init__(self, in_shape, kernel, strides, dilations, begin, out):
        (kh, kw), (sh, sw), (dh, dw), (oh, ow) = kernel, strides, dilations, out
        last_row, last_col = (kh - 1) * dh // sh, (kw - 1) * dw // sw
        self.rows, self.width = oh + last_row, ow + last_col
        self.size = self.rows * self.width + last_col  # the last grid row's extra columns read this far
        # Where each tap (row-major) reads the planes, relative to an output's grid position.
        self.taps = np.array(
            [((i * dh % sh) * sw + j * dw % sw) * self.size + (i * dh // sh) * self.width + j * dw // sw
             for i in range(kh) for j in range(kw)],
            dtype=np.uint64,
        )
        self.in_shape, self.strides, self.begin, self.out = tuple(in_shape), tuple(strides), tuple(begin), tuple(out)
        # Copies into the planes go through index maps unless the input rows are long runs (a
        # column stride of 1, or of 2 read as pairs); copies out unless the output rows are long
        # (the map then takes the whole grid as one block). Empty maps select the row loops.
        none = np.zeros(0, np.uint64)
        self.fill_map = self._fill_map() if sw > 2 or in_shape[1] <= _SHORT_ROW * 2 * sw else (none, none)
        self.crop_map = self._crop_map() if ow <= _SHORT_ROW and oh * self.width <= _BLOCK else none
        # The direct kernel (float32 only): 3x3 windows, strides (1, 1) or (2, 2), no dilation.
        self.direct = int(gemm.AVAILABLE and (kh, kw) == (3, 3) and (dh, dw) == (1, 1) and (sh, sw) in ((1, 1), (2, 2)))

    def _fill_map(self):
        """(inputs, places): the flat input positions that land in the phase planes, and where."""
        (h, w), (sh, sw), (bh, bw) = self.in_shape, self.strides, self.begin
        rr, cc = np.meshgrid(np.arange(h) + bh, np.arange(w) + bw, indexing="ij")
        inside = ((rr // sh < self.rows) & (cc // sw < self.width)).reshape(-1)
        places = ((rr % sh) * sw + cc % sw) * self.size + (rr // sh) * self.width + cc // sw
        return np.flatnonzero(inside).astype(np.uint64), places.reshape(-1)[inside].astype(np.uint64)

    def _crop_map(self):
        """The grid position of each flat output."""
        (oh, ow) = self.out
        return (np.arange(oh)[:, None] * self.width + np.arange(ow)[None, :]).reshape(-1).astype(np.uint64)

    def __call__(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray, activation: np.ndarray,
                 source=None) -> np.ndarray:
        """The convolution of every image of x, then the activation (low, high, slope: see
        epilogue.activation_bounds); ``source`` (uint64, one per channel) reads channel c of each image
        from x's channel source[c] (a channel shuffle folded in; the identity when None)."""
        n, c = x.shape[:2]
        y = np.empty((n, weights.shape[0], *self.out), dtype=x.dtype)
        arguments = (x.reshape(-1), weights.reshape(-1), bias, y.reshape(-1), n, c, self.in_shape, self.out,
                     self.strides, self.begin, self.taps, self.rows, self.width, self.size, *self.fill_map,
                     self.crop_map, identity_channels(c) if source is None else source, activation)
        if x.dtype == np.float32:
            run(*arguments, self.direct)
        else:
            _depthwise(*arguments)
        return y

    def bound(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray, activation: np.ndarray, y: np.ndarray):
        """``(loop, arguments)``: __call__'s computation into ``y`` for these arrays (C-contiguous), prepared
        once (a segment's bound plan, ops/segment.py)."""
        n, c = x.shape[:2]
        arguments = (x.reshape(-1), weights.reshape(-1), bias, y.reshape(-1), n, c, self.in_shape, self.out,
                     self.strides, self.begin, self.taps, self.rows, self.width, self.size, *self.fill_map,
                     self.crop_map, identity_channels(c), activation)
        if x.dtype == np.float32:
            return run, (*arguments, self.direct)
        return _depthwise, arguments

    def split_channels(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray, activation: np.ndarray,
                       bounds: np.ndarray, source, run) -> np.ndarray:
        """The float32 output for one image ``x`` (1, C, H, W), its channels bounds[i] .. bounds[i + 1]
        computed as part i of jobs.split_depthwise, whose arguments up to ``bounds`` ``run`` takes (it
        adds the rest); ``activation`` and ``source`` as for __call__."""
        y = np.empty((1, weights.shape[0], *self.out), dtype=x.dtype)
        run(self.split_arguments(x, weights, bias, activation, bounds, source, y))
        return y

    def split_arguments(self, x: np.ndarray, weights: np.ndarray, bias: np.ndarray, activation: np.ndarray,
                        bounds: np.ndarray, source, y: np.ndarray) -> tuple:
        """jobs.split_depthwise's arguments up to ``bounds`` for split_channels' computation into ``y`` (1, M,
        OH, OW), C-contiguous (a segment's bound plan prepares them once)."""
        c, outputs = x.shape[1], weights.shape[0]
        return (x.reshape(-1), weights.reshape(outputs, -1), bias, y.reshape(outputs, -1), outputs // c,
                self.in_shape, self.out, self.strides, self.begin, self.taps, self.rows, self.width, self.size,
                *self.fill_map, self.crop_map, identity_channels(c) if source is None else source, activation,
                self.direct, bounds)


_identities: dict[int, np.ndarray] = {}


def identity_channels(count: int) -> np.ndarray:
    """0 .. count - 1 as uint64: the channel map of a convolution without a shuffle."""
    found = _identities.get(count)
    if found is None:
        found = _identities[count] = np.arange(count, dtype=np.uint64)
    return found




@_inline
def _fill_planes(planes, x, start, h, w, begin_h, begin_w, sh, sw, rows, width, size):
    """Copy the (H, W) channel at x[start:] into its phase planes, one input row at a time; the pad
    positions keep their zeros. Input (r, v) goes to plane ((r + begin_h) % sh, (v + begin_w) % sw),
    at row (r + begin_h) // sh, column (v + begin_w) // sw. Column strides 1 and 2 only (larger
    ones copy through the index maps), each with its own row loop: a stride test inside the row
    loop measured slower."""
    last = min(h, rows * sh - begin_h)
    if sw == 1:
        run = _U(max(0, min(w, width - begin_w)))
        for r in range(last):
            u = (r + begin_h) // sh
            dst, src = _U((r + begin_h - u * sh) * size + u * width + begin_w), _U(start + r * w)
            for v in range(run):
                planes[dst + v] = x[src + v]
    else:
        # A row is read as pairs of neighbours, the first of each on an even padded column.
        first = begin_w % 2
        start_v = (first + begin_w) // 2
        pairs = max(0, min((w - first) // 2, width - start_v))
        for r in range(last):
            u = (r + begin_h) // sh
            base = (r + begin_h - u * sh) * 2 * size + u * width + start_v
            even, odd, src = _U(base), _U(base + size), _U(start + r * w + first)
            for k in range(_U(pairs)):
                planes[even + k] = x[src + _TWO * k]
                planes[odd + k] = x[src + _TWO * k + _U(1)]
            if first and start_v - 1 < width:  # input column 0 lands on an odd padded column
                planes[base + size - 1] = x[start + r * w]
            if first + 2 * pairs < w and start_v + pairs < width:  # a last unpaired input column
                planes[base + pairs] = x[start + r * w + first + 2 * pairs]


@_inline
def _sum_taps(acc, planes, start, count, taps, weights, first_tap, bias):
    """acc[:count] = bias + sum of weights[first_tap + t] * planes[start + taps[t] + p], adding the
    taps in order, up to nine per pass (fewer passes over acc; the same sums as one tap at a time).
    A first pass of nine taps starts from the bias itself (LLVM hoists the test out of the loop)."""
    k = taps.shape[0]
    n = _U(count)
    if k < 9:
        for p in range(n):
            acc[p] = bias
    t = 0
    while t + 9 <= k:
        w0, w1, w2 = weights[first_tap + t], weights[first_tap + t + 1], weights[first_tap + t + 2]
        w3, w4, w5 = weights[first_tap + t + 3], weights[first_tap + t + 4], weights[first_tap + t + 5]
        w6, w7, w8 = weights[first_tap + t + 6], weights[first_tap + t + 7], weights[first_tap + t + 8]
        o0, o1, o2 = _U(start) + taps[t], _U(start) + taps[t + 1], _U(start) + taps[t + 2]
        o3, o4, o5 = _U(start) + taps[t + 3], _U(start) + taps[t + 4], _U(start) + taps[t + 5]
        o6, o7, o8 = _U(start) + taps[t + 6], _U(start) + taps[t + 7], _U(start) + taps[t + 8]
        for p in range(n):
            acc[p] = ((acc[p] if t else bias) + w0 * planes[o0 + p] + w1 * planes[o1 + p] + w2 * planes[o2 + p]
                      + w3 * planes[o3 + p] + w4 * planes[o4 + p] + w5 * planes[o5 + p]
                      + w6 * planes[o6 + p] + w7 * planes[o7 + p] + w8 * planes[o8 + p])
        t += 9
    while t + 3 <= k:
        w0, w1, w2 = weights[first_tap + t], weights[first_tap + t + 1], weights[first_tap + t + 2]
        o0, o1, o2 = _U(start) + taps[t], _U(start) + taps[t + 1], _U(start) + taps[t + 2]
        for p in range(n):
            acc[p] = acc[p] + w0 * planes[o0 + p] + w1 * planes[o1 + p] + w2 * planes[o2 + p]
        t += 3
    while t < k:
        w0, o0 = weights[first_tap + t], _U(start) + taps[t]
        for p in range(n):
            acc[p] = acc[p] + w0 * planes[o0 + p]
        t += 1


@_fused
def _depthwise(x, weights, bias, y, n_images, channels, in_shape, out, strides, begin, taps, rows, width, size,
               inputs, places, grid, source, activation):
    """y[n, m] = act(bias[m] + the convolution of x[n, m // multiplier] with weights[m]), on flat arrays;
    copies in go through the index maps ``inputs``/``places`` and copies out through ``grid`` when
    those are not empty. Channel c of image n is read from x's channel source[c] of that image (x may
    hold more channels per image than ``channels``: a part of them, or a shuffle's source).
    ``activation``: (low, high, slope), as epilogue.activation_bounds."""
    low, high, slope = activation[0], activation[1], activation[2]
    h, w = in_shape
    oh, ow = out
    sh, sw = strides
    outputs = bias.shape[0]
    multiplier, k = outputs // channels, taps.shape[0]
    fill_maps, crop_maps = inputs.shape[0] > 0, grid.shape[0] > 0
    planes = np.zeros(sh * sw * size + _STEP, dtype=x.dtype)
    block_rows = oh if crop_maps else max(1, min(oh, _BLOCK // width))
    acc = np.empty(block_rows * width + _STEP, dtype=x.dtype)
    image_channels = x.shape[0] // max(1, n_images * h * w)
    for n in range(n_images):
        for c in range(channels):
            start = (n * image_channels + np.int64(source[c])) * h * w
            if fill_maps:
                for e in range(inputs.shape[0]):
                    planes[places[e]] = x[_U(start) + inputs[e]]
            else:
                _fill_planes(planes, x, start, h, w, begin[0], begin[1], sh, sw, rows, width, size)
            for m in range(c * multiplier, (c + 1) * multiplier):
                target = (n * outputs + m) * oh * ow
                for r0 in range(0, oh, block_rows):
                    r1 = min(oh, r0 + block_rows)
                    count = -(-(r1 - r0) * width // _STEP) * _STEP
                    _sum_taps(acc, planes, r0 * width, count, taps, weights, m * k, bias[m])
                    if crop_maps:
                        for e in range(grid.shape[0]):
                            y[_U(target) + _U(e)] = activate(acc[grid[e]], low, high, slope)
                    else:
                        for r in range(r0, r1):
                            dst, src = _U(target + r * ow), _U((r - r0) * width)
                            for q in range(_U(ow)):
                                y[dst + q] = activate(acc[src + q], low, high, slope)


# -- the direct kernel (compiled/windows.py) -------------------------------------------------------

_LANES = llvm.LANES


@_fused
def _direct(x, weights, bias, y, n_images, channels, in_shape, out, strides, begin, source, activation):
    """_depthwise for float32 3x3 windows of strides (1, 1) or (2, 2) by the direct kernel: for each output
    channel, blocks of windows.ROWS output rows x 16 columns."""
    h, w = in_shape
    oh, ow = out
    stride = strides[0]
    outputs = bias.shape[0]
    multiplier, k = outputs // channels, 9
    image_channels = x.shape[0] // max(1, n_images * h * w)
    reach = (windows.ROWS - 1) * stride + 3
    rows = np.empty(reach, dtype=np.int64)  # where each input row of a block starts in x, -1 for a pad row
    zero = np.zeros(w + _LANES, dtype=np.float32)
    activating = 0 if activation[0] == -np.inf and activation[1] == np.inf and activation[2] == 1 else 1
    for n in range(n_images):
        for c in range(channels):
            start = (n * image_channels + np.int64(source[c])) * h * w
            for r0 in range(0, oh, windows.ROWS):
                windows.row_starts(rows, start, r0 * stride - begin[0], h, w)
                for m in range(c * multiplier, (c + 1) * multiplier):
                    target = (n * outputs + m) * oh * ow + r0 * ow
                    for q0 in range(0, ow, _LANES):
                        windows.window(stride, x, rows, weights, m * k, stride * q0 - begin[1], w, zero, y,
                                       target + q0, ow, oh - r0, min(_LANES, ow - q0), bias[m], activation, activating)


@_fused
def run(x, weights, bias, y, n_images, channels, in_shape, out, strides, begin, taps, rows, width, size, inputs,
        places, grid, source, activation, direct):
    """The float32 convolution (DepthwisePlan.__call__, and the parts of split_channels: jobs.DEPTHWISE):
    the direct kernel where ``direct``, else the loop over phase planes."""
    if direct:
        _direct(x, weights, bias, y, n_images, channels, in_shape, out, strides, begin, source, activation)
    else:
        _depthwise(x, weights, bias, y, n_images, channels, in_shape, out, strides, begin, taps, rows, width, size,
                   inputs, places, grid, source, activation)
