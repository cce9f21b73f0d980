"""The tiled direct convolution of compiled/directconv.py on AVX2 hosts without AVX-512: 2-D float32
convolutions of up to KNOBS.direct_macs multiply-adds per image, in one compiled call with a FusedConv's
bias, residual and activation (the light CNNs' layers, where im2col, a BLAS call and an epilogue pass each
cost about what the arithmetic does). Which convolutions take it, and where it goes before the packed
convolution: conv_choice.py.
"""

from __future__ import annotations

import numpy as np

from ..threads import helper_count, kernel_threads
from ..tuning import KNOBS
from .prepared import Prepared
from .split import claimed_tasks, run_claimed
from .window import Geometry

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
        arguments = (x, weights, self._offsets, self._bias(b), residual, bounds, flags, y, *self._geometry)
        parts = self._group_tasks(arguments)
        if parts is not None:
            return [(_claimed_groups, (parts,))]
        parts = self._row_tasks(arguments)
        if parts is not None:
            return [(_claimed_rows, (parts,))]
        return [(kernel.conv_direct, arguments)]

    def _row_tasks(self, arguments) -> list | None:
        """One image's row chunks as claimed tasks, one part per thread (the kernel's threads, KNOBS.split_macs of
        multiply-adds a thread at least), each part jobs.DIRECT_ROWS' arguments: a plan's ungrouped convolution that
        reads its input in place (a pointwise one, or one without pads; SqueezeNet's squeeze convolutions) shares
        its outputs' rows with the helpers, a late helper's tasks taken by the others. None where one thread runs
        it (a padded input's copy would be made by each task)."""
        x, weights, offsets, bias, residual, bounds, flags, y = arguments[:8]
        if weights.shape[0] != 1 or x.shape[0] != 1 or not self._in_place:
            return None
        units = y.shape[2] * -(-y.shape[3] // self._kernel.PIXELS)
        threads = min(units, kernel_threads(), 1 + helper_count(), y.size * offsets.size // KNOBS.split_macs)
        if threads < 2:
            return None
        cuts, ranges, claims = claimed_tasks(units, min(units, ROW_TASKS_PER_THREAD * threads), threads)
        sh, sw = self._geometry[:2]
        return [(x, weights, offsets, bias, residual, bounds, flags, y, sh, sw, cuts, ranges, claims, part)
                for part in range(threads)]

    def _group_tasks(self, arguments) -> list | None:
        """One image's groups as claimed tasks, one part per thread (the kernel's threads, KNOBS.split_macs of
        multiply-adds a thread at least), each part jobs.DIRECT's arguments (conv_direct's groups are independent:
        their input channels, weights, bias and output channels apart): a segment plan's grouped convolution that no
        blocked tiles take (ShuffleNet's 1x1 ones of 34 or 68 channels a group) shares its groups with the helpers,
        a late helper's tasks taken by the others. None where one thread runs it."""
        x, weights, offsets, bias, residual, bounds, flags, y = arguments[:8]
        groups = weights.shape[0]
        if groups < 2 or x.shape[0] != 1:
            return None
        macs = y.size * offsets.size  # (each output's taps: a group's channels x the window)
        threads = min(groups, kernel_threads(), 1 + helper_count(), macs // KNOBS.split_macs)
        if threads < 2:
            return None
        tasks = min(groups, GROUP_TASKS_PER_THREAD * threads)
        cuts, ranges, claims = claimed_tasks(groups, tasks, threads)
        return [(*arguments, cuts, ranges, claims, part) for part in range(threads)]

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


# Tasks per thread a plan's grouped convolution is cut into (whole groups each): a descheduled helper leaves most of
# its share to the caller, which claims it.
GROUP_TASKS_PER_THREAD = 4


def _claimed_groups(parts) -> None:
    """A bound plan's step: jobs.DIRECT's parts of one image's groups, their claims (shared) zeroed first."""
    from ..compiled import jobs

    run_claimed(jobs.DIRECT, parts)


# Tasks per thread a plan's ungrouped convolution is cut into (whole row chunks each), as GROUP_TASKS_PER_THREAD.
ROW_TASKS_PER_THREAD = 4


def whole_call(function, arguments):
    """conv_direct's arguments of a bound step that is a convolution split into claimed tasks (its groups,
    _claimed_groups, or its rows, _claimed_rows), else None: a blocked segment's chain takes the convolution whole
    (algorithms/segment_layout.py) and shares its rows itself."""
    part = arguments[0][0] if function is _claimed_groups or function is _claimed_rows else None
    if part is None:
        return None
    if function is _claimed_groups:  # (conv_direct's arguments, then the tasks')
        return part[:15]
    x, weights, offsets, bias, residual, bounds, flags, y, sh, sw = part[:10]  # (an in-place read: no pads)
    return x, weights, offsets, bias, residual, bounds, flags, y, sh, sw, 0, 0, x.shape[2], x.shape[3], True


def _claimed_rows(parts) -> None:
    """A bound plan's step: jobs.DIRECT_ROWS' parts of one image's row chunks, their claims zeroed first."""
    from ..compiled import jobs

    run_claimed(jobs.DIRECT_ROWS, parts)
