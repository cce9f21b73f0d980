"""The packed convolution of compiled/gemm.py on AVX-512 hosts: output channels across the vector lanes
(compiled/lanes.py) or pixel panels, whichever uses more of its lanes; strided windows read in place
from the input split into its stride's phases; weights packed once per constant array; the output's
panels or tiles split across the helper threads as tasks claimed one at a time. Which convolutions take it:
conv_choice.py.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from ..threads import helper_count, kernel_threads
from ..tuning import KNOBS
from .activations import hard_swish_in_place
from .conv_choice import packed_threads
from .conv_packed_layout import lane_grid, lanes_apply, phase_split
from .prepared import Prepared
from .split import scratch, uneven
from .window import Geometry


class PackedConv:
    """One geometry's packed convolution, output channels across the vector lanes (compiled/lanes.py) or
    pixel panels (compiled/gemm.py), whichever uses more of its lanes (lanes_apply): weights packed once
    per constant array, the output's pixel blocks or panels (or its channel tiles) split evenly across the
    kernel threads (threads.py), and a FusedConv's bias, residual and activation applied as each output
    tile is stored."""

    takes_residual = True  # (run adds one)

    def __init__(self, geo: Geometry, group: int, x_shape, w_shape, prepared: Prepared):
        from ..compiled import gemm, jobs, lanes, workers

        self._gemm, self._jobs, self._lanes, self._workers = gemm, jobs, lanes, workers
        self._out = (x_shape[0], w_shape[0], *geo.out)
        self._flat = None  # the input's shape as one row of pixels, for a pointwise window
        if geo.kernel == (1, 1) and geo.strides == (1, 1) and geo.unpadded:
            # A pointwise window is a product over the pixels, which may run as one long row: tiles
            # take its chunks without each row's tail, and a plane narrower than a tile's 14 pixels
            # (squeezenet's 13x13) needs no margin, so no padded copy of the input (with the copy, two
            # threads ran no faster than one; measured in 8827030).
            pixels = math.prod(geo.out)
            geo = Geometry((1, pixels), (1, 1), (1, 1), (1, 1), (0, 0), (0, 0), (1, pixels))
            x_shape = self._flat = (x_shape[0], x_shape[1], 1, pixels)
        self._geo, self._group, self._prepared = geo, group, prepared
        self._n, c = x_shape[:2]
        self._m = w_shape[0]
        self._cg, self._mg = c // group, self._m // group
        self._pixels = math.prod(geo.out)
        self._padded = geo.padded_shape(tuple(x_shape))[2:]
        (kh, kw), (dh, dw), (hp, wp) = geo.kernel, geo.dilations, self._padded
        (sh, sw), (oh, ow) = geo.strides, geo.out
        # Output channels across the lanes (compiled/lanes.py), or pixel panels (gemm.py).
        self._by_lanes = lanes_apply(geo, self._mg, self._cg * kh * kw)
        self._phases = None if self._by_lanes else phase_split(geo, self._padded, self._mg)
        self._margin = 0
        if self._by_lanes:
            self._rows = lanes.CHANNELS
            columns, rows = lanes.shape(ow)
            self._blocks = -(-oh // rows) * -(-ow // columns)  # the tasks' unit: a tile's pixels
            if ow < columns or oh < rows:  # a tile reads past the image
                self._margin = lanes.margin(sh, sw, wp)
            self._grid = ow
        else:
            self._rows = gemm.tile_rows(self._mg)  # output channels per tile
            self._grid = self._phases[1] if self._phases else lane_grid(geo, self._padded[1])
            self._blocks = -(-(oh * self._grid) // gemm.NR)  # the tasks' unit: a panel
        self._macs = self._n * self._m * self._cg * math.prod(geo.kernel) * self._pixels
        self._plans: dict[tuple, tuple] = {}  # per (thread count, tasks per thread): the task arrays
        self._no_residual = np.empty((1, 0), dtype=np.float32)
        # conv_tasks' arguments that stay the same from call to call.
        if self._phases:  # a strided window as a stride-1 window over the phases (see phase_split)
            phase_h, phase_w = self._phases
            self._geometry = np.array([self._mg, oh, ow, self._grid, self._cg, kh, kw, 1, 1, dh, dw, phase_w,
                                       sh * sw * phase_h * phase_w, 0], dtype=np.int64)
            taps = gemm.phase_tap_offsets(self._cg, kh, kw, sh, sw, dh, dw, phase_h, phase_w)
        else:
            self._geometry = np.array([self._mg, oh, ow, self._grid, self._cg, kh, kw, sh, sw, dh, dw, wp, hp * wp,
                                       int(self._by_lanes)], dtype=np.int64)
            taps = gemm.tap_offsets(self._cg, kh, kw, dh, dw, wp, hp * wp)
        self._offsets = (taps, gemm.packed_offsets(self._cg * kh * kw))
        self._scratch = 0 if self._by_lanes else gemm.scratch_size(self._cg * kh * kw)
        self._bias_cache = (None, None)  # (the bias array last seen, its padded copy)
        self._padded_inputs: dict[int, np.ndarray] = {}  # per calling thread: a phase-split input buffer
        if self._phases:
            self._phase_shape = (self._n, group, *geo.strides, self._cg, *self._phases)
            self._keeps_padded = 4 * math.prod(self._phase_shape) <= KNOBS.kept_padded_bytes

    def _plan(self, threads: int) -> tuple:
        """(per thread its tasks, all of them in one array, where each thread's start there): tasks
        (image, group, first panel, end panel, first tile, end tile) that split the panels of every
        (image, group) evenly, or, where there are too few panels to go round (small images), each
        unit's weight tiles, so each thread also reads only its share of the weights."""
        key = (threads, KNOBS.conv_tasks_per_thread)
        plan = self._plans.get(key)
        if plan is None:
            panels = self._blocks
            tiles = -(-self._mg // self._rows)
            units = [(n, g) for n in range(self._n) for g in range(self._group)]
            by_tiles = threads > 1 and panels * len(units) < 4 * threads and tiles >= 2 * threads
            if self._by_lanes and threads > 1 and tiles >= 2 * threads:
                # Split by tiles where the pixel blocks go round unevenly and the tiles do better
                # (squeezenet's classifier: 13 blocks 7/6, 32 tiles 16/16; 6d569bd), or where the weights
                # outweigh the input 4 to 1 (each thread then reads its share of them, not all; 1427375).
                # Splitting by tiles wherever both splits are even measured slower (6d569bd).
                blocks = uneven(panels * len(units), threads)
                heavy = self._mg * math.prod(self._geo.kernel) > 4 * math.prod(self._padded)
                by_tiles = (blocks > 1.05 and uneven(tiles, threads) < blocks) or (
                    heavy and uneven(tiles, threads) <= 1.2)
            total = (tiles if by_tiles else panels) * len(units)
            parts, taken = [], 0
            for t in range(threads):
                goal = total * (t + 1) // threads
                step = -(-(goal - taken) // KNOBS.conv_tasks_per_thread)  # claimed a task at a time: jobs.CONV
                tasks = []
                while taken < goal:
                    unit, first = divmod(taken, tiles if by_tiles else panels)
                    end = min(tiles if by_tiles else panels, first + min(goal - taken, step))
                    if by_tiles:
                        tasks.append((*units[unit], 0, panels, first, end))
                    else:
                        tasks.append((*units[unit], first, end, 0, tiles))
                    taken += end - first
                parts.append(np.array(tasks, dtype=np.int64).reshape(-1, 6))
            # For jobs.split_conv: every part's tasks in one array, and where each part's start.
            ranges = np.cumsum([0] + [len(tasks) for tasks in parts]).astype(np.int64)
            plan = self._plans[key] = (parts, np.concatenate(parts), ranges)
        return plan

    def packed_weights(self, w):
        """The panels of weight ``w`` (G, tiles, K * tile rows), packed once per constant array."""

        def build():
            from ..compiled.aligned import aligned_zeros

            flat = w.astype(np.float32, copy=False).reshape(self._group, self._mg, -1)
            lanes = self._lanes
            depth = lanes.packed_depth(flat.shape[2]) if self._by_lanes else flat.shape[2]
            # Every group's panels written in place into one array on a cache line (a stack of them would copy
            # each once more, onto numpy's 16-byte alignment).
            packed = aligned_zeros((self._group, -(-self._mg // self._rows), depth * self._rows))
            for g in range(self._group):
                if self._by_lanes:  # (the lane tiles' own order of k: lanes.pack_weights)
                    lanes.pack_weights(flat[g], packed[g])
                else:
                    self._gemm.pack_weights(flat[g], self._rows, packed[g])
            return packed

        return self._prepared.get("packed", (w,), build)

    def _bias(self, b, tiles: int) -> np.ndarray:
        """The bias padded to whole tiles per group, kept while the same read-only array comes in."""
        seen, padded = self._bias_cache  # one read: another thread may swap in a new pair meanwhile
        if seen is not None and seen is b:
            return padded
        padded = np.zeros((self._group, tiles * self._rows), dtype=np.float32)
        if b is not None and b.size:
            padded[:, : self._mg] = b.reshape(self._group, self._mg)
            if not b.flags.writeable:
                self._bias_cache = (b, padded)
        return padded

    def _phase_input(self, x) -> np.ndarray:
        """x zero-padded and split into the stride's phases, as (N, G * sh * sw * Cg * phase plane) (see
        phase_split): phase (p, q) of a group's channel holds the padded image's rows p, p + sh, ... and
        columns q, q + sw, ...; for small inputs in a buffer of the calling thread whose zeros (the pads,
        and the cells past the padded image) stay from call to call, so only x's cells are copied."""
        geo = self._geo
        shape = self._phase_shape
        buffer = self._kept_buffer(shape) if self._keeps_padded else np.zeros(shape, dtype=np.float32)
        n, _, h, w = x.shape
        grouped = x.reshape(n, self._group, self._cg, h, w)
        (sh, sw), (bh, bw) = geo.strides, geo.begin
        for p in range(sh):
            y0 = max(0, -(-(bh - p) // sh))  # the first phase row on the image: padded row y0 * sh + p
            r0 = y0 * sh + p - bh
            for q in range(sw):
                x0 = max(0, -(-(bw - q) // sw))
                c0 = x0 * sw + q - bw
                if r0 < h and c0 < w:
                    rows, cols = len(range(r0, h, sh)), len(range(c0, w, sw))
                    buffer[:, :, p, q, :, y0:y0 + rows, x0:x0 + cols] = grouped[:, :, :, r0::sh, c0::sw]
        return buffer.reshape(n, -1)

    def _padded_input(self, x) -> np.ndarray:
        """x zero-padded, as (N, C * plane) plus the margin a channel-lane tile may read past it: x itself
        without pads or margin; else the calling thread's scratch buffer, every cell written by
        gemm.pad_planes (pads and margin zero). numpy's copy into a padded view went row by row, and a
        fresh buffer per call paid its page faults (measured in 41debc9)."""
        geo = self._geo
        x = np.ascontiguousarray(x)
        if geo.unpadded and not self._margin:
            return x.reshape(self._n, -1)
        _, _, padded_height, padded_width = geo.padded_shape(x.shape)
        size = x.shape[1] * padded_height * padded_width
        buffer = scratch(self._n * (size + self._margin)).reshape(self._n, -1)
        (top, left) = geo.begin
        split = x[0].nbytes >= KNOBS.split_pad_bytes and kernel_threads() > 1
        for image in range(self._n):  # (rows of the buffer, margin included)
            if split:  # the helpers' share of the channels (memory-bound: the second core's bandwidth)
                self._workers.call(self._jobs.split_pad, (x[image], buffer[image], top, left, padded_height,
                                                          padded_width), self._jobs.PAD.address(), 0, helper_count())
            else:
                self._gemm.pad_planes(x[image], buffer[image], top, left, padded_height, padded_width)
        return buffer

    def _kept_buffer(self, shape) -> np.ndarray:
        """The calling thread's zeroed phase-split input buffer for this node, kept from call to call (its
        zeros, the pads, stay: only the input's cells are written); for the buffers' memory, up to
        _KEPT_PADDED_BYTES per node and a few threads."""
        thread = threading.get_ident()
        buffer = self._padded_inputs.get(thread)
        if buffer is None:
            if len(self._padded_inputs) >= 8:  # callers come and go: keep the buffers of a few
                self._padded_inputs.clear()
            buffer = self._padded_inputs[thread] = np.zeros(shape, dtype=np.float32)
        return buffer

    def __call__(self, x, w, b, finish, out=None):
        """conv_path's compute: the convolution, with ``finish`` (an _Epilogue) applied as it is stored."""
        if finish is None:
            return self.run(x, w, b, None, _IDENTITY_BOUNDS, False, out)
        return self.run(x, w, finish.bias, finish.residual if finish.residual.size else None, finish.bounds,
                        False, out)

    def bind(self, x, w, b, residual, bounds, hard_swish, y):
        """``[(run, arguments)]`` into the C-contiguous ``y`` (a segment's bound plan, ops/segment.py): the plan
        writes the output in place, where a node's kernel returns a new array that the plan would copy."""
        return [(self.run, (x, w, b, residual, bounds, hard_swish, y))]

    def run(self, x, w, b, residual, bounds, hard_swish=False, out=None):
        """The convolution of float32 x by w, + b (None or empty: none), + ``residual`` (the output's shape,
        or None) and the activation ``bounds`` (epilogue.activation_bounds), into ``out`` (C-contiguous) or
        a new array, then HardSwish where ``hard_swish`` (a pass after: the tiles do not apply it): a
        FusedConv calls this straight (ops/conv.py), without an _Epilogue."""
        weights = self.packed_weights(w)
        flags = 0
        if residual is None:
            residual = self._no_residual
        else:
            residual, flags = np.ascontiguousarray(residual, dtype=np.float32).reshape(self._n, -1), 2
        if b is not None and b.size:
            flags |= 1
        bias = self._bias(b, weights.shape[1])
        if self._flat is not None:
            x = x.reshape(self._flat)
        xp = self._phase_input(x) if self._phases else self._padded_input(x)
        y = np.empty(self._out, dtype=np.float32) if out is None else out
        threads = packed_threads(self._macs)
        parts, tasks, ranges = self._plan(threads)
        head = (xp, weights, bias, y.reshape(self._n, -1), residual, flags, bounds)
        workers = self._workers
        claims = np.zeros(len(parts), dtype=np.int64)  # per call: what each part's tasks have given out
        if threads > 1 and self._macs >= KNOBS.long_macs * threads:
            # Milliseconds per part: through workers.run, whose parts wait for a sleeping helper.
            fixed = (*self._geometry.tolist(), *self._offsets)
            workers.run(self._jobs.CONV, [(*head, *fixed, tasks, ranges, claims, part) for part in range(len(parts))],
                        helper_count(), True)
        else:
            # Posted from compiled code (jobs.split_conv): per call, the Python of workers.run cost about as
            # much as a small convolution's arithmetic.
            arguments = (*head, self._geometry, *self._offsets, tasks, ranges, claims,
                         workers.local_mailbox(self._scratch))
            workers.call(self._jobs.split_conv, arguments, self._jobs.CONV.address(), self._scratch,
                         helper_count() if threads > 1 else 0)
        if hard_swish:
            hard_swish_in_place(y)
        return y


_IDENTITY_BOUNDS = np.array([-np.inf, np.inf, 1.0], dtype=np.float32)
