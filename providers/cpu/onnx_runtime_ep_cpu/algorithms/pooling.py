"""Pooling by the compiled loops of compiled/pooling.py (1-D/2-D float32/float64 windows, planes split
across the helper threads), and max pooling with the indices of its maxima.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..compiled import deferred, reference_run
from ..compiled import takes as takes_compiled
from ..threads import helper_count, kernel_threads
from .split import thread_spans
from .window import Geometry


def lowest(dtype: np.dtype):
    return np.iinfo(dtype).min if np.issubdtype(dtype, np.integer) else -np.inf


def max_pool_with_indices(geo: Geometry, xp: np.ndarray, x_shape, column_major: bool):
    """Max and its flat index into the unpadded input, row-major (or column-major over spatial dims)."""
    n, c = x_shape[:2]
    rank = len(geo.kernel)
    flat = geo.windows(xp).reshape(n, c, -1, *geo.out)
    arg = flat.argmax(axis=2)
    y = np.take_along_axis(flat, arg[:, :, None], axis=2)[:, :, 0]
    taps = np.unravel_index(arg, geo.kernel)
    spatial = np.zeros(arg.shape, dtype=np.int64)
    order = range(rank - 1, -1, -1) if column_major else range(rank)
    for i in order:
        grid = np.arange(geo.out[i]).reshape((-1,) + (1,) * (rank - 1 - i))
        pos = grid * geo.strides[i] - geo.begin[i] + taps[i] * geo.dilations[i]
        pos = np.clip(pos, 0, geo.in_shape[i] - 1)  # only an all-padding window could point outside
        spatial = spatial * geo.in_shape[i] + pos
    planes = np.arange(n * c, dtype=np.int64).reshape((n, c) + (1,) * rank) * math.prod(geo.in_shape)
    return y, planes + spatial


# A max pool of a few taps up to this many reads (input elements times taps) runs as numpy calls over the taps'
# strided views: each costs about a microsecond on a small map, the compiled loop's call several. More taps
# (and a padded copy) pay off only on the smallest maps.
SMALL_MAX_READS = 1 << 15
SMALL_MAX_TAPS = 4
TINY_MAX_READS = 1 << 11


class SmallMaxPool:
    """Max pooling of one input shape by ``np.maximum`` over the window taps' strided views of the padded input
    (a streaming model's pool on a map of a few hundred values): the views' indices made once per shape."""

    __slots__ = ("geo", "taps")

    def __init__(self, geo: Geometry):
        self.geo = geo
        ranges = [range(k) for k in geo.kernel]
        self.taps = [(Ellipsis, *(slice(t * d, t * d + (o - 1) * s + 1, s)
                                  for t, d, o, s in zip(tap, geo.dilations, geo.out, geo.strides)))
                     for tap in itertools.product(*ranges)]

    @staticmethod
    def fits(x: np.ndarray, geo: Geometry) -> bool:
        taps = math.prod(geo.kernel)
        reads = x.size * taps
        return x.dtype.kind == "f" and 0 not in geo.out and 0 < reads and (
            reads <= TINY_MAX_READS or taps <= SMALL_MAX_TAPS and reads <= SMALL_MAX_READS)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        xp = self.geo.pad(x, -np.inf)
        taps = self.taps
        if len(taps) == 1:
            return xp[taps[0]].copy()
        y = np.maximum(xp[taps[0]], xp[taps[1]])
        for tap in taps[2:]:
            np.maximum(y, xp[tap], out=y)
        return y


class KeptPool:
    """compiled_pool's max pool of one input shape and dtype on this thread alone, its call prepared once: the
    geometry, budget check, thread split and loop arguments cost a small map's pool twice its arithmetic (resnet's
    16x32x32 stem pool 15.6 -> 5.3 us). The same compiled code as compiled_pool's: the pool job's 3x3 kernel called
    on this thread for a float32 window it takes (windows.pool_planes), else pool_2d."""

    __slots__ = ("loop", "arguments", "planes", "rows", "out", "threads")

    @classmethod
    def of(cls, loops, x: np.ndarray, geo: Geometry) -> KeptPool | None:
        """None where compiled_pool would not run it in one part on this thread: numpy serving while numba
        loads, planes split across threads, a segment's reference run, shapes or dtypes the loops do not take."""
        if len(geo.kernel) > 2 or not takes_compiled(x) or x.size == 0 or 0 in geo.out \
                or deferred.state.deferring or reference_run.active():
            return None
        y = np.empty(x.shape[:2] + geo.out, dtype=x.dtype)
        planes, rows, arguments = _pool_call(x, geo, None, y)
        spans = thread_spans(planes.shape[0], x.size, x.dtype)
        if spans is not None and len(spans) > 1:
            return None
        kept = cls()
        kept.loop, kept.arguments = _one_part(loops, spans, arguments), arguments  # (numba is loaded: no deferral)
        kept.planes, kept.rows, kept.out, kept.threads = planes.shape, rows.shape, y.shape, kernel_threads()
        return kept

    def __call__(self, x: np.ndarray) -> np.ndarray | None:
        """The pool of ``x`` (its shape and dtype kept), or None once the kernel threads changed or inside a
        reference run (the caller takes compiled_pool)."""
        if kernel_threads() != self.threads or reference_run.active():
            return None
        y = np.empty(self.out, x.dtype)
        self.loop(np.ascontiguousarray(x).reshape(self.planes), y.reshape(self.rows), *self.arguments)
        return y


def pool_loops():
    """The compiled pooling loops; imported by the op factories, so numba loads only for models that pool."""
    from ..compiled import pooling

    return pooling


def _pool_call(x: np.ndarray, geo: Geometry, include_pad: bool | None, y: np.ndarray):
    """(planes, rows, arguments) of the compiled pooling loop for ``x`` into ``y``."""
    rank = len(geo.kernel)
    fields = (geo.kernel, geo.strides, geo.dilations, geo.begin, geo.end, geo.in_shape)
    if rank == 1:
        fields = tuple((unit, *field) for unit, field in zip((1, 1, 1, 0, 0, 1), fields))
    (kh, kw), (sh, sw), (dh, dw), (ph, pw), (eh, ew), (h, w) = fields
    planes = np.ascontiguousarray(x).reshape(-1, h, w)
    rows = y.reshape(planes.shape[0], -1, y.shape[-1])
    # An axis of one output window never steps, so its stride is any; the loops size row buffers by the
    # stride, and a stride of 2**62 there would ask for exabytes. (Strides within the input keep their routes.)
    sh = 1 if rows.shape[1] == 1 and sh > ph + h + eh else sh
    sw = 1 if rows.shape[2] == 1 and sw > pw + w + ew else sw
    # The positions an average counts, in padded coordinates: the input, plus the declared pads
    # with count_include_pad; a ceil_mode overhang never counts.
    (lo_h, hi_h), (lo_w, hi_w) = (
        (0, p + n + e) if include_pad else (p, p + n) for p, n, e in ((ph, h, eh), (pw, w, ew))
    )
    return planes, rows, (kh, kw, sh, sw, dh, dw, ph, pw, include_pad is None, lo_h, hi_h, lo_w, hi_w)


def _one_part(loops, spans, arguments: tuple):
    """The loop that pools one part (all the planes) on the calling thread: the pool job's 3x3 kernel
    (windows.pool_planes, the job's own code) for a float32 window it takes, else pool_2d."""
    if spans is not None and _windowed(arguments):
        from ..compiled import windows

        return windows.pool_planes
    return loops.pool_2d


def _windowed(arguments: tuple) -> bool:
    """Whether the pool job would run windows.pool (its 3x3 kernel) rather than pool_2d: one part of any other
    window calls pool_2d here, without the job's mailbox round trip (several times a small pool's arithmetic)."""
    from ..compiled import windows

    return windows.takes_pool.py_func(*arguments[:6])  # (its Python predicate: no compiled call for a test)


def bound_pool(loops, x: np.ndarray, geo: Geometry, include_pad: bool | None, y: np.ndarray):
    """compiled_pool's loop into the C-contiguous ``y``, prepared once (a segment's bound plan):
    ``[(loop, arguments)]``, its planes' spans as jobs of the helper threads where they split across threads (a
    224x224 stem's pool), the job's 3x3 kernel (windows.pool_planes) where one thread runs a window it takes, or
    None where the loops do not apply."""
    if len(geo.kernel) > 2 or not takes_compiled(x) or x.size == 0 or 0 in geo.out or y.dtype != x.dtype \
            or not x.flags.c_contiguous:
        return None
    planes, rows, arguments = _pool_call(x, geo, include_pad, y)
    spans = thread_spans(planes.shape[0], x.size, x.dtype)
    if spans is not None and len(spans) > 1:
        from ..compiled import jobs, workers

        parts = [(planes[a:b], rows[a:b], *arguments) for a, b in spans]
        return [(workers.run, (jobs.POOL, parts, helper_count()))]
    return [(_one_part(loops, spans, arguments), (planes, rows, *arguments))]


def compiled_pool(loops, x: np.ndarray, geo: Geometry, include_pad: bool | None = None):
    """Max pooling (``include_pad`` None) or average pooling of ``x`` by the compiled loops, which
    take float32/float64 with 1-D or 2-D windows (a 1-D window is a 2-D one over a single row);
    None where they do not apply."""
    rank = len(geo.kernel)
    if rank > 2 or not takes_compiled(x) or x.size == 0 or 0 in geo.out:
        return None
    y = np.empty(x.shape[:2] + geo.out, dtype=x.dtype)
    planes, rows, arguments = _pool_call(x, geo, include_pad, y)
    spans = thread_spans(planes.shape[0], x.size, x.dtype)
    # (the helper threads' parts are compiled code; the part's types only built while numpy serves; the deferral
    # is asked before _windowed, whose module import would load numba on the run thread. A segment's reference
    # run takes the loop's numpy equivalent: the job's entry points, linked for it alone, are never called again)
    if spans is None or (deferred.numpy_first(("jobs.POOL", (planes, rows, *arguments)))
                         if deferred.state.deferring else reference_run.active()) \
            or len(spans) == 1 and not _windowed(arguments):
        loops.pool_2d(planes, rows, *arguments)
    else:
        from ..compiled import jobs, workers

        workers.run(jobs.POOL, [(planes[a:b], rows[a:b], *arguments) for a, b in spans], helper_count())
    return y
