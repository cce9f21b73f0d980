"""Conv, FusedConv (a convolution with its bias, residual and activation, see conv_fusions.py), ConcatBuffer
and ConvTranspose. Which algorithm computes a convolution is algorithms/conv_path.py's choice.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime import budget
from onnx_runtime.errors import InvalidArgumentError

from ..algorithms.conv_choice import direct_tiles, tiles
from ..algorithms.conv_path import conv_path, lanes_depthwise
from ..algorithms.conv_rows import RowWeights, as_row, lifts, row_geometry
from ..algorithms.precision import compute_dtype
from ..algorithms.prepared import Prepared
from ..algorithms.window import Window
from ..compiled import deferred, reference_run
from ..compiled import takes as takes_compiled
from ..fused_domain import CONV_INTO, FUSED_DOMAIN
from ..registry import register
from ._common import activation_code, channel_param, graph_error, group_count, in_place_activation


@register("Conv", since=1)
def conv(node, shapes, opset):
    resolve = _conv_resolver(node, shapes)
    row_weights = RowWeights()

    def kernel(x, w, b=None):
        rows = lifts(x, w)  # 1-D float32: a 2-D convolution over one row (algorithms/conv_rows.py)
        if rows:
            x, w = as_row(x), row_weights(w)
        path = resolve(x, w, b, rows)[0]
        direct = path.direct
        if reference_run.active():  # (as FusedConv's convolve)
            direct, path = None, path.numpy
        y = None if direct is None else direct_call(path, direct, x, w, b, None, _NO_ACTIVATION)
        if y is None:
            y = path(x, w, b, None) if direct is None else path.numpy(x, w, b, None)
        return (y.reshape(y.shape[:2] + y.shape[3:]) if rows else y,)

    kernel.bind = lambda inputs, outputs, constant: _bind(resolve, inputs, outputs, constant, _NO_ACTIVATION, False,
                                                          None)
    return kernel


def direct_call(path, direct, *arguments):
    """``direct.run(*arguments)``, or None where a loop it calls misses numba's cache on this thread while the
    background loader guards (compiled/deferred.py): the caller then serves the call by ``path.numpy``. Until one
    such call has run whole it is tried inside a Trial: the caller's bias, residual and bounds are types the
    path's own tried call may not have used, and a miss outside a Trial compiles here."""
    if path.direct_tried:
        return direct.run(*arguments)
    return deferred.tried(path, "direct_tried", direct.run, *arguments)


def _bind(resolve, inputs, outputs, constant, bounds, hard_swish, prepare):
    """A convolution node's computation into ``outputs[0]`` as prepared calls (a segment's bound plan,
    algorithms/segment_steps.py): the direct tiles, or the path's own ``bind``; None where neither takes it
    (weights that are not constants, a residual the path does not add, an activation applied in numpy)."""
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    z = inputs[3] if len(inputs) > 3 else None
    if not constant[1] or (b is not None and not constant[2]):
        return None
    y = outputs[0]
    rows = lifts(x, w) and all(a is None or (a.ndim == 3 and a.flags.c_contiguous) for a in (x, y, z))
    if rows:  # (views of the plan's buffers, which the bound calls read and write: contiguous ones, no copies)
        x, w, y, z = as_row(x), as_row(w), as_row(y), None if z is None else as_row(z)
    path, out_shape = resolve(x, w, b, rows)
    path.settle()  # (numpy served a reference run's call: the compiled convolution is bound)
    direct = path.direct
    if tiles(direct) and (z is None or (z.shape == out_shape and z.dtype == x.dtype)):
        return direct.bind(x, w, b, z, bounds, hard_swish, y)
    if z is None and lanes_depthwise(direct):  # (AVX2 hosts) as convolve calls it: run straight
        return direct.bind_run(x, w, b, bounds, hard_swish, y)
    if z is not None:
        if not (path.binds_residual and prepare is not None and takes_compiled(x) and z.shape == out_shape
                and z.dtype == x.dtype):
            return None
        return path.bind(x, w, None, prepare(b, z, x.dtype), y)
    if hard_swish:  # (as convolve: the convolution with its bias, then HardSwish's operations in place)
        from ..algorithms.activations import hard_swish_steps

        steps = path.bind(x, w, b, None, y)
        return None if steps is None else steps + hard_swish_steps(y, y)
    if prepare is None:
        return path.bind(x, w, b, None, y)
    return path.bind(x, w, None, prepare(b, None, x.dtype), y) if takes_compiled(x) else None


_NO_ACTIVATION = np.array([-np.inf, np.inf, 1.0], dtype=np.float32)  # activation bounds of none
_FLOAT32 = np.dtype(np.float32)


def _conv_resolver(node, shapes):
    """``resolve(x, w, b) -> (path, out_shape)``: the node's convolution path for these inputs'
    signature (see conv_path), chosen on the first call with that signature and kept."""
    window = Window(node, shapes, needs_kernel=False)
    group = group_count(node)
    prepared = Prepared()
    paths: dict[tuple, tuple] = {}  # per input signature: the path, with its geometry resolved

    def resolve(x, w, b, rows=False):
        """``rows``: x and w are (N, C, 1, L) and (M, C/G, 1, K) views of a 1-D convolution's (conv_rows.py)."""
        key = (x.shape, w.shape, x.dtype, None if b is None else b.shape, w.flags.writeable, rows)
        found = paths.get(key)
        if found is None:
            # checked on the node's own shapes: a lifted 1-D convolution's errors name its (N, C, L) and (M, C/G, K)
            _check_channels(node, *((a.shape[:2] + a.shape[3:]) if rows else a.shape for a in (x, w)), group,
                            transpose=False)
            if b is not None and b.shape != (w.shape[0],):
                raise InvalidArgumentError(f"node {node.name!r} ({node.op_type}): bias has shape {b.shape}; expected "
                                           f"({w.shape[0]},), one value per output channel (the weight's first dim)")
            geo = row_geometry(window.resolve(x.shape[3:], w.shape[3:])) if rows else\
                window.resolve(x.shape[2:], w.shape[2:])
            # Padding sizes the output (and the padded rows): within the session's budget before allocating.
            budget.check_shape((x.shape[0], w.shape[0], *geo.out), max(x.dtype.itemsize, 4), f"{node.op_type}'s output")
            found = paths[key] = (conv_path(geo, group, x, w, prepared), (x.shape[0], w.shape[0], *geo.out))
        return found

    return resolve


def _check_channels(node, x_shape, w_shape, group: int, transpose: bool) -> None:
    if len(x_shape) < 3 or len(w_shape) != len(x_shape):
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): input {tuple(x_shape)} and weight {tuple(w_shape)} must have one "
            f"rank of at least 3 (batch, channels, spatial axes)"
        )
    # A kernel without taps, or a Conv without output channels, left every path's weight layout empty.
    empty = [axis for axis in range(2, len(w_shape)) if w_shape[axis] == 0] + ([0] if w_shape[0] == 0 and not transpose
                                                                             else [])
    if empty:
        weight = node.inputs[1] if len(node.inputs) > 1 else "(unnamed)"
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): weight {weight!r} has shape {tuple(w_shape)}, empty in axis "
            f"{empty[0]}; a convolution needs at least one output channel and a kernel of at least 1 in every "
            f"spatial axis: fix the weight's shape")
    x_channels = x_shape[1]
    # Conv weights are (M, C/group, *k); ConvTranspose weights are (C, M/group, *k).
    w_in = w_shape[0] if transpose else w_shape[1] * group
    if x_channels != w_in or w_shape[0] % group:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): input has {x_channels} channels but the weight "
            f"{tuple(w_shape)} with group={group} expects {w_in}"
        )


def _add_residual(y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """y + z, into ``y`` when the sum keeps its shape and dtype (the common residual connection)."""
    if z.shape == y.shape and z.dtype == y.dtype:
        return np.add(y, z, out=y)
    return np.add(y, z)


class _Epilogue:
    """A FusedConv's bias, residual and activation for one run, applied by the compiled loops of
    compiled/epilogue.py to a float32/float64 conv output (N, M, P) in place: to a block of output
    pixels right after the matmul that wrote it (still in cache), or while the taps path crops its
    padded rows. The same arithmetic, in the same order, as conv-then-epilogue. The packed
    convolution reads ``bias`` (empty for none), ``residual`` (N, M, P; empty for none) and
    ``bounds`` (the activation as low, high, slope) and applies them itself."""

    __slots__ = ("_loops", "bias", "residual", "bounds")

    def __init__(self, loops, bias, residual, bounds):
        self._loops, self.bias, self.residual, self.bounds = loops, bias, residual, bounds

    def rows(self, y, first: int, end: int, image: int | None = None) -> None:
        """Finish pixels first .. end of every channel of ``y`` (N, M, P), or of one image of it."""
        residual = self.residual
        if image is not None:
            y, residual = y[image:image + 1], residual[image:image + 1]
        self._loops.bias_residual_activation(y, self.bias, residual, self.bounds, first, end)

    def crop(self, rows, y, width: int, image: int) -> None:
        """Write image ``image`` of ``y`` (N, M, OH*width) from its padded-row results ``rows``
        (M, OH*Wp), finished."""
        self._loops.crop_bias_residual_activation(rows.reshape(1, *rows.shape), y[image:image + 1], width,
                                                  self.bias, self.residual[image:image + 1], self.bounds)


def _compiled_epilogue(node):
    """``prepare(b, z, dtype) -> _Epilogue``: the node's bias ``b``, residual ``z`` (the output's
    shape, or None) and activation ready for the compiled loops, for a float32/float64 output."""
    from ..compiled import epilogue

    kind, params = activation_code(node)
    # Per dtype, built once per activation in the process (every FusedConv with a Relu shares them; the loops only
    # read them): the activation's bounds and the empty stand-ins for no bias/residual.
    key = (kind, *params)
    constants = _EPILOGUE_CONSTANTS.get(key)
    if constants is None:
        constants = {np.dtype(t): (epilogue.activation_bounds(kind, params, t), epilogue.absent(t, 1),
                                   epilogue.absent(t, 3))
                     for t in (np.float32, np.float64)}
        if len(_EPILOGUE_CONSTANTS) >= 256:
            _EPILOGUE_CONSTANTS.clear()
        _EPILOGUE_CONSTANTS[key] = constants

    def prepare(b, z, dtype):
        bounds, no_bias, no_residual = constants[dtype]
        if b is None:
            bias = no_bias
        elif b.ndim == 1 and b.dtype == dtype and b.flags.c_contiguous:
            bias = b  # the array itself, so the kernels' caches keyed on it (a padded copy) hold from run to run
        else:
            bias = np.ascontiguousarray(b.reshape(-1), dtype=dtype)
        if z is None:
            residual = no_residual
        else:
            residual = np.ascontiguousarray(z).reshape(*z.shape[:2], math.prod(z.shape[2:]))
        return _Epilogue(epilogue, bias, residual, bounds)

    prepare.float32_bounds = constants[np.dtype(np.float32)][0]  # for the direct tiles, which take float32
    return prepare


_EPILOGUE_CONSTANTS: dict[tuple, dict] = {}  # _compiled_epilogue's per activation (code, parameters), bounded


@register("FusedConv", domain=FUSED_DOMAIN, since=1)
def fused_conv(node, shapes, opset):
    """Conv (the node's Conv attributes), then an optional residual ``z`` added and an activation
    (without either, the Conv itself: conv_fusions.py's Concat and channel-shuffle fusions).

    For float32/float64 the bias, residual and activation are one compiled pass over each block of
    the output as the convolution writes it (see _Epilogue); other dtypes, and residuals that only
    broadcast to the output, take numpy passes in place after the convolution."""
    resolve = _conv_resolver(node, shapes)
    hard_swish = node.attr("activation") == "HardSwish"
    if hard_swish:  # the direct tiles apply it as they store; other paths after, in numpy
        from ..algorithms.activations import hard_swish_in_place  # (only HardSwish's convolutions load it)

        activate, prepare, bounds = hard_swish_in_place, None, _NO_ACTIVATION
    else:
        activate = in_place_activation(node)
        prepare = _compiled_epilogue(node)
        bounds = prepare.float32_bounds
    concat = node.attr("concat_channels")
    shuffled = _ChannelShuffle(node) if node.attr("shuffle_shape") is not None else None
    row_weights = RowWeights()

    def convolve(x, w, b, z, out=None):
        if out is None and shuffled is None and lifts(x, w) and (z is None or z.ndim == 3):
            # 1-D float32: a 2-D convolution over one row (algorithms/conv_rows.py)
            y = convolve_rows(as_row(x), row_weights(w), b, None if z is None else as_row(z))
            return y.reshape(y.shape[:2] + y.shape[3:])
        return convolve_rows(x, w, b, z, out, False)

    def convolve_rows(x, w, b, z, out=None, rows=True):
        shuffle = None
        if shuffled is not None:  # x is the shuffle's input: the convolution reads it through the shuffle
            shuffle = shuffled.over(x)
            if shuffle is None:
                x = shuffled.apply(x)
        path, out_shape = resolve(x, w, b, rows)
        direct = path.direct
        if reference_run.active():  # (numpy's convolution: a compiled one would link its loops for these types)
            direct, path = None, path.numpy
        if direct is not None and shuffle is None and out is None and (z is None or (
                direct.takes_residual and z.shape == out_shape and z.dtype == x.dtype)):
            y = direct_call(path, direct, x, w, b, z, bounds, hard_swish)
            if y is not None:
                return y
            path = path.numpy  # (this call by numpy's algorithm, the loop compiled meanwhile)
        if activate is None and z is None:  # the Conv itself (into a Concat, or through a shuffle)
            return path(x, w, b, None, out, shuffle)
        if prepare is not None and takes_compiled(x) and (z is None or (z.shape == out_shape and z.dtype == x.dtype)):
            return path(x, w, None, prepare(b, z, x.dtype), out, shuffle)
        y = path(x, w, b, None, None, shuffle)  # a fresh array, so it may be overwritten
        if z is not None:
            y = _add_residual(y, z)
        if activate is not None:
            activate(y)
        if out is not None:
            out[...] = y
            return out
        return y

    if node.attr("append"):
        return _appending(node, resolve, convolve)
    if not concat:
        # The last call's DirectConv.bound_run, for constant w and b and no residual: (x's shape, w, b, the call)
        last = (None, None, None, None)

        def kernel(x, w, b=None, z=None):
            nonlocal last
            shape, weights, bias, kept = last  # one read: another thread running this node may replace it
            if w is weights and b is bias and z is None and x.shape == shape and x.dtype is _FLOAT32:
                return (kept(x),)
            y = convolve(x, w, b, z)
            if z is None and shuffled is None:
                last = _kept_direct(resolve, row_weights, x, w, b, bounds, hard_swish) or last
            return (y,)

        if shuffled is None:
            kernel.bind = lambda inputs, outputs, constant: _bind(resolve, inputs, outputs, constant, bounds,
                                                                  hard_swish, prepare)
        return kernel
    concat, offset = int(concat), int(node.attr("concat_offset", 0))

    def into_concat(x, w, b=None, z=None, into=None):
        """Write the output's channels at ``offset`` of the concatenated tensor: ``into`` (filled by the
        convolutions before this one, see conv_fusions.fuse_concat_convs), or a new one for the first."""
        _, out_shape = resolve(x, w, b)
        shape = (out_shape[0], concat, *out_shape[2:])
        if into is None:
            into = np.empty(shape, dtype=x.dtype)
        elif into.shape != shape or into.dtype != x.dtype:
            raise InvalidArgumentError(
                f"node {node.name!r} (FusedConv into a Concat): the concatenation so far is {into.dtype}"
                f"{list(into.shape)}, this convolution's output {x.dtype}{list(out_shape)} needs "
                f"{x.dtype}{list(shape)}; the Concat's inputs must agree in every axis but 1"
            )
        target = into[:, offset:offset + out_shape[1]]
        if target.shape != out_shape:
            raise InvalidArgumentError(
                f"node {node.name!r} (FusedConv into a Concat): {out_shape[1]} output channels do not fit at "
                f"channel {offset} of the {concat} concatenated; the weights must keep the shape they were "
                f"fused with"
            )
        convolve(x, w, b, z, target)
        return (into,)

    def bind(inputs, outputs, constant):
        """The convolution's calls writing its channels of ``outputs[0]``, the concatenation's buffer (a segment's
        plan, algorithms/segment_steps.py): straight into them where they are contiguous (one image), else into a
        buffer of the plan's, then copied into them."""
        x, w = inputs[0], inputs[1]
        b = inputs[2] if len(inputs) > 2 else None
        into = outputs[0]
        if len(inputs) > CONV_INTO and inputs[CONV_INTO] is not None and inputs[CONV_INTO] is not into:
            return None  # (the channels before its own are in another buffer: the kernel fills that one)
        _, out_shape = resolve(x, w, b)
        if into.shape != (out_shape[0], concat, *out_shape[2:]) or into.dtype != x.dtype \
                or offset + out_shape[1] > concat:
            return None  # (the kernel's call raises its error)
        target = into[:, offset:offset + out_shape[1]]
        own = target if target.flags.c_contiguous else np.empty(out_shape, x.dtype)
        steps = _bind(resolve, inputs[:4], [own], constant[:4], bounds, hard_swish, prepare)
        return steps if steps is None or own is target else [*steps, (np.copyto, (target, own))]

    into_concat.bind = bind
    return into_concat


def _kept_direct(resolve, row_weights, x, w, b, bounds, hard_swish: bool) -> tuple | None:
    """A FusedConv kernel's ``last`` after a call without a residual: x's shape, w, b and the bound call of its
    path's direct tiles (algorithms/conv_direct.py), which skips the path lookup and the tiles' argument setup (a
    keyword spotter's one-frame Conv1d paid more there than in its arithmetic); None where another path runs it
    or the direct tiles have not run whole yet."""
    if x.dtype is not _FLOAT32:
        return None
    rows = lifts(x, w)
    path, out_shape = resolve(as_row(x), row_weights(w), b, True) if rows else resolve(x, w, b)
    if not direct_tiles(path.direct) or not path.direct_tried:
        return None
    run = path.direct.bound_run(as_row(x) if rows else x, row_weights(w) if rows else w, b, bounds, hard_swish,
                                out_shape[:2] + out_shape[3:] if rows else None)
    return None if run is None else (x.shape, w, b, run)


def _appending(node, resolve, convolve):
    """A FusedConv that appends its output channels to ``so_far``, the channels a ConcatBuffer chain has
    filled (conv_fusions.fuse_dense_concats): written into the buffer behind them, the result being the
    view of every channel up to its own. Anything but such a view is concatenated as Concat would."""

    def append(x, w, b=None, z=None, so_far=None):
        _, out_shape = resolve(x, w, b)
        base, filled = so_far.base, so_far.shape[1]
        others = out_shape[:1] + out_shape[2:]  # the dimensions besides the channels
        if not (isinstance(base, np.ndarray) and base.ndim == so_far.ndim == 4 and base.flags.c_contiguous
                and base.dtype == so_far.dtype == x.dtype and base.shape[1] >= filled + out_shape[1]
                and so_far.shape[:1] + so_far.shape[2:] == base.shape[:1] + base.shape[2:] == others
                and so_far.strides == base.strides and so_far.ctypes.data == base.ctypes.data):
            return (np.concatenate([so_far, convolve(x, w, b, z)], axis=1),)
        convolve(x, w, b, z, base[:, filled:filled + out_shape[1]])
        return (base[:, :filled + out_shape[1]],)

    return append


@register("ConcatBuffer", domain=FUSED_DOMAIN, since=1)
def concat_buffer(node, shapes, opset):
    """x copied into a tensor with ``extra`` more channels (axis 1) behind it, returned as the view of x's
    channels: the start of a chain of appending FusedConv nodes (conv_fusions.fuse_dense_concats)."""
    extra = int(node.attr("extra", 0))

    def kernel(x):
        if x.ndim < 2:
            raise InvalidArgumentError(
                f"node {node.name!r} (ConcatBuffer): the input has shape {list(x.shape)}; channels (axis 1) "
                f"are appended, so it needs at least two dimensions"
            )
        buffer = np.empty((x.shape[0], x.shape[1] + extra, *x.shape[2:]), dtype=x.dtype)
        buffer[:, :x.shape[1]] = x
        return (buffer[:, :x.shape[1]],)

    return kernel


class _ChannelShuffle:
    """A FusedConv's channel shuffle (conv_fusions.fuse_channel_shuffle): its input x (N, C, H, W) is read
    as Reshape(x, (N, g, C/g, H, W)) -> Transpose(0, 2, 1, 3, 4) -> Reshape((N, C, H, W)), the node's
    ``shuffle_shape`` being the first shape; shuffled channel c is x's channel (c % g) * C/g + c // g."""

    def __init__(self, node):
        self.split = tuple(int(d) for d in node.attr("shuffle_shape"))
        n, groups, per_group, h, w = self.split
        self.shape = (n, groups * per_group, h, w)
        channels = np.arange(groups * per_group)
        self.source = ((channels % groups) * per_group + channels // groups).astype(np.uint64)

    def over(self, x):
        """This shuffle when x has the shape it was fused for (else None: apply it)."""
        return self if x.shape == self.shape else None

    def apply(self, x):
        """The shuffled tensor itself, as the three nodes compute it."""
        return np.reshape(x, self.split).transpose(0, 2, 1, 3, 4).reshape(self.shape)


class _TransposeWindow:
    """ConvTranspose geometry: output size, the pads cropped off the full scatter, per input shape."""

    def __init__(self, node, shapes):
        self.node = node
        self.window = Window(node, shapes, needs_kernel=False)
        self.output_padding = node.attr("output_padding")
        self.output_shape = node.attr("output_shape")
        self._cache: dict[tuple, tuple] = {}

    def resolve(self, in_shape, kernel):
        key = (in_shape, kernel)
        if key not in self._cache:
            self._cache[key] = self._resolve(in_shape, kernel)
        return self._cache[key]

    def _resolve(self, in_shape, kernel):
        w = self.window
        rank = len(in_shape)
        w.check_rank(rank)
        strides = w.strides or (1,) * rank
        dilations = w.dilations or (1,) * rank
        extra = tuple(int(v) for v in self.output_padding) if self.output_padding is not None else (0,) * rank
        if len(extra) != rank:
            raise graph_error(self.node, "output_padding", f"has {len(extra)} values; expected {rank}")
        full = tuple(s * (n - 1) + p + (k - 1) * d + 1
                     for s, n, p, k, d in zip(strides, in_shape, extra, kernel, dilations))
        target = None
        if self.output_shape is not None:
            target = tuple(int(v) for v in self.output_shape)[-rank:]
            if len(target) != rank:
                raise graph_error(self.node, "output_shape", f"has {len(target)} values; expected {rank}")
        elif w.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            target = tuple(n * s for n, s in zip(in_shape, strides))
        if target is not None:
            # Pads are derived from the requested output size; SAME_UPPER crops less at the start.
            totals = [f - t for f, t in zip(full, target)]
            if w.auto_pad == "SAME_UPPER":
                begin = tuple(t // 2 for t in totals)
            else:
                begin = tuple(t - t // 2 for t in totals)
            out = target
        else:
            pads = (0,) * (2 * rank) if w.auto_pad == "VALID" or w.pads is None else w.pads
            begin = pads[:rank]
            out = tuple(f - b - e for f, b, e in zip(full, begin, pads[rank:]))
        if any(o < 1 for o in out):
            raise InvalidArgumentError(
                f"node {self.node.name!r} (ConvTranspose): pads crop the whole output {list(full)}; "
                f"expected a positive output size"
            )
        return tuple(strides), tuple(dilations), full, begin, out


@register("ConvTranspose", since=1)
def conv_transpose(node, shapes, opset):
    window = _TransposeWindow(node, shapes)
    group = group_count(node)

    def kernel(x, w, b=None):
        _check_channels(node, x.shape, w.shape, group, transpose=True)
        in_shape, kshape = x.shape[2:], w.shape[2:]
        strides, dilations, full, begin, out = window.resolve(in_shape, kshape)
        dtype = compute_dtype(x.dtype)
        n, c = x.shape[:2]
        m = w.shape[1] * group
        # Every input pixel times every kernel tap: (N, G, Mg*K, pixels), one matmul.
        budget.check_shape((n, m, *kshape, *in_shape), np.dtype(dtype).itemsize, "ConvTranspose's taps")
        xg = x.astype(dtype, copy=False).reshape(n, group, c // group, -1)
        wg = w.astype(dtype, copy=False).reshape(group, c // group, -1).transpose(0, 2, 1)
        cols = np.matmul(wg, xg).reshape(n, m, *kshape, *in_shape)
        # Scatter-add each tap into a buffer covering both the full result and the requested output.
        origin = tuple(max(0, -bg) for bg in begin)
        size = tuple(o + max(f, bg + t) for o, f, bg, t in zip(origin, full, begin, out))
        # Strides, dilations and pads size the buffer: within the session's budget before allocating.
        budget.check_shape((n, m, *size), np.dtype(dtype).itemsize, "ConvTranspose's scatter buffer")
        buf = np.zeros((n, m, *size), dtype=dtype)
        for offset in np.ndindex(*kshape):
            index = tuple(
                slice(o + k * d, o + k * d + (i - 1) * s + 1, s)
                for o, k, d, i, s in zip(origin, offset, dilations, in_shape, strides)
            )
            buf[(Ellipsis, *index)] += cols[(slice(None), slice(None), *offset)]
        crop = tuple(slice(o + bg, o + bg + t) for o, bg, t in zip(origin, begin, out))
        y = buf[(Ellipsis, *crop)]
        if b is not None:
            y = y + channel_param(b, y.ndim, dtype)
        return (np.ascontiguousarray(y).astype(x.dtype, copy=False),)

    return kernel
