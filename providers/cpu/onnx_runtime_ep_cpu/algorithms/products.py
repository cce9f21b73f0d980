"""Matrix products: numpy's BLAS, and on AVX-512 hosts, float32 products of constant weights through
compiled/gemv.py for a few rows (a decode step's or a CNN's classifier) and compiled/matmul.py for
more (a prefill's or a batch's), split across the helper threads.
"""

from __future__ import annotations

import numpy as np

from ..compiled import deferred
from ..compiled.deferred import numpy_first  # BLAS while numba loads in the background
from ..threads import helper_count, kernel_threads
from ..tuning import KNOBS, when_changed
from .precision import BLAS_FLOATS, FLOAT32, compute_dtype
from .prepared import Prepared


def blas_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dtype = compute_dtype(a.dtype)
    return np.matmul(a.astype(dtype, copy=False), b.astype(dtype, copy=False))


def product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A fresh C-contiguous ``a @ b`` for a 2-D ``b``: one 2-D BLAS call when a's rows are contiguous."""
    if a.dtype is b.dtype and a.dtype in BLAS_FLOATS and a.ndim > 1 and a.flags.c_contiguous:
        return np.matmul(a.reshape(-1, a.shape[-1]), b).reshape(a.shape[:-1] + (b.shape[-1],))
    return np.asarray(blas_matmul(a, b)).astype(a.dtype, copy=False)


# Products of at least this many rows (a prefill's or batch's) against constant float32 weights run
# compiled/matmul.py's packed product on the helper threads; from this many multiply-adds per thread
# they are split, from _LONG_MACS per thread a part waits for a sleeping helper (milliseconds).
PACKED_ROWS = 9  # past the few-row products' GEMV_ROWS: no float32 product of constant weights is OpenBLAS's
# Rows up to which a product of constant weights may take compiled/few_rows.py's tiles (its PANEL_ROWS, here without
# importing numba): Gemm's transB weights from few_rows_transposed_macs up to this many rows, not OpenBLAS's strided
# packing (64x256 by 12-16 rows 1.8-2.2x onnxruntime's time there; measured in the commit that set it).
FEW_TILE_ROWS = 16
# A one-row product takes the tiles from the one_row_tile_weights knob only with a reduction this deep: over shorter
# panels the tiles' per-panel work shows (64x1000 from the L3 cache 14.5 against BLAS's 9.4 us).
ONE_ROW_DEPTH = 128
# A product of a normalized input (bound with its normalization in front: one compiled call instead of two kernels)
# takes the tiles below the size rule up to this many weights: a decoder's small q/k/v and feed-forward products gained
# there, while over a wide head the tiles' product lost more to BLAS's than the fold saved (measured in the commit that
# set it).
NORMED_TILE_WEIGHTS = 1 << 15


class PackedProduct:
    """One node's products ``a @ b`` (+ bias, Gelu, residual) through compiled/matmul.py, for a float32
    ``a`` of many rows and a constant 2-D float32 ``b`` (an initializer: the same read-only array on
    every run), on AVX-512 hosts; ``applies`` says when. The weights are packed once per constant array,
    the bias padded once per constant array."""

    def __init__(self):
        from ..compiled import few_rows, matmul

        self._matmul, self._few_rows = matmul, few_rows
        self._weights, self._bias = Prepared(), Prepared()
        self._offsets: dict[int, np.ndarray] = {}  # per depth: gemm.packed_offsets
        self._task_cache: dict[tuple, tuple] = {}  # per (panels, threads): _tasks
        self._empty = np.empty(0, dtype=np.float32)
        self._last: tuple | None = None  # (a's shape, b, bias, coefficients, no residual, knobs, the plan)
        self._jobs = self._workers = None  # compiled.jobs and .workers, imported by the first _plan
        # Where the background loader guards, the first call is tried (deferred.Trial): a loop or runner that
        # numba's cache misses is compiled by the loader's child while BLAS and the epilogue's loops serve.
        self._tried = not deferred.guarding()
        # (tiles, threads) of the last plan made: "few rows" (compiled/few_rows.py) or "panels" (matmul.py)
        self.route: tuple[str, int] | None = None

    @staticmethod
    def applies(a: np.ndarray, b: np.ndarray) -> bool:
        return (a.dtype is b.dtype is FLOAT32 and b.ndim == 2 and a.ndim >= 2 and not b.flags.writeable
                and a.shape[-1] == b.shape[0] and a.size >= PACKED_ROWS * b.shape[0] and b.shape[1] > 0
                and b.shape[0] > 0 and a.size * b.shape[1] >= KNOBS.packed_macs and gemv_host()
                and not numpy_first("jobs.MATMUL"))

    @staticmethod
    def takes_few(a: np.ndarray, b: np.ndarray, normalized: bool = False) -> bool:
        """Whether a product of at most FEW_TILE_ROWS rows of ``a`` by a constant float32 ``b`` (K x N, or a view of
        a constant) runs compiled/few_rows.py's tiles: from the few_rows_packed_macs knob (few_rows_transposed_macs
        for rows by transposed weights), or where it is split across threads (below, BLAS's one call costs less
        than the tiles' call), or up to NORMED_TILE_WEIGHTS where ``a`` is ``normalized`` (the normalization before
        it then runs in the tiles' call: bound's ``norm``)."""
        if not (a.dtype is b.dtype is FLOAT32 and b.ndim == 2 and a.ndim >= 2 and a.shape[-1] == b.shape[0]
                and a.size <= FEW_TILE_ROWS * b.shape[0] and b.size and a.size and not b.flags.writeable):
            return False
        return PackedProduct.few_sized(a.size // b.shape[0], b.size, not b.flags.c_contiguous, kernel_threads(),
                                       b.shape[0], normalized) and gemv_host() and not numpy_first("jobs.MATMUL")

    @staticmethod
    def few_sized(rows: int, weights: int, transposed: bool, threads: int, depth: int = 0,
                  normalized: bool = False) -> bool:
        """takes_few's size rule for ``rows`` by ``weights`` constant weights (``transposed``: a view of their
        transpose) on ``threads`` threads, ``depth`` (K) deep, of a ``normalized`` input (see takes_few)."""
        if normalized and weights <= NORMED_TILE_WEIGHTS:
            return True
        if rows == 1 and depth >= ONE_ROW_DEPTH and weights >= KNOBS.one_row_tile_weights:
            return True
        least = KNOBS.few_rows_transposed_macs if rows > 1 and transposed else KNOBS.few_rows_packed_macs
        return rows * weights >= least or (weights >= KNOBS.gemv_split_weights and threads > 1)

    def __call__(self, a, b, bias=None, residual=None, coefficients=None, weights=None) -> np.ndarray:
        """a @ b (+ bias) [Gelu with ``coefficients``] (+ residual), as a fresh (..., N) array; ``bias``
        (N,) and ``residual`` (a's rows, N) float32, where given. ``weights``: the constant array ``b``
        is a view of (Gemm's transB), which identifies it from call to call (a view is new each time)."""
        if not self._tried and not deferred.in_trial():
            try:
                with deferred.Trial():
                    y = self(a, b, bias, residual, coefficients, weights)
            except deferred.WouldCompile:
                return blas_product(a, b, bias, residual, coefficients)
            self._tried = True
            return y
        source = b if weights is None else weights
        # The last call's plan: a node's product repeats every run with the same shape, arrays and knobs, and
        # working the plan out again (lookups, the task split, the job's address) costs about as much as a
        # short sequence's product (measured with this change's commit).
        last = self._last  # one read: another thread running this node may replace it
        knobs = (kernel_threads(), KNOBS.helpers, KNOBS.split_macs, KNOBS.long_macs, KNOBS.product_tasks_per_thread)
        if last is not None and a.shape == last[0] and source is last[1] and bias is last[2] \
                and coefficients is last[3] and (residual is None) is last[4] and knobs == last[5]:
            plan = last[6]
        else:
            plan = self._plan(a, b, source, bias, residual is not None, coefficients, knobs[0])
            if not source.flags.writeable and (bias is None or not bias.flags.writeable):  # (as Prepared keeps)
                self._last = (a.shape, source, bias, coefficients, residual is None, knobs, plan)
        (depth, rows, n, packed, offsets, padded_bias, flags, coefficients, threads, bounds, ranges, scratch,
         spread, run, call, address, helpers) = plan
        x = np.ascontiguousarray(a).reshape(-1)
        residual = self._empty if residual is None else np.ascontiguousarray(residual).reshape(-1)
        y = np.empty(a.shape[:-1] + (n,), dtype=np.float32)
        if threads == 1:  # every panel on this thread: one compiled call, without posting a job to itself
            few = rows <= self._few_rows.PANEL_ROWS
            panels = self._few_rows.few_row_panels if few else self._matmul.matmul_panels
            panels(x, depth, rows, depth, packed, offsets, padded_bias, y.reshape(-1), n, residual, flags, coefficients,
                   0, packed.shape[0], np.empty(scratch, np.float32))
            return y
        claims = np.zeros(threads, dtype=np.int64)  # per call: what each thread's tasks have given out
        head = (x, depth, rows, depth, packed, offsets, padded_bias, y.reshape(-1), n, residual, flags, coefficients,
                bounds, ranges, claims)
        if spread:
            run(self._jobs.MATMUL, [(*head, part) for part in range(threads)], helpers, True)
            return y
        call(self._jobs.split_matmul, (*head, self._workers.local_mailbox(scratch)), address, scratch, helpers)
        return y

    def bound(self, a, b, bias=None, coefficients=None, weights=None, residual: bool = False,
              norm: tuple | None = None):
        """``run(a, b=None)``: this product (``b``, ``bias``, ``coefficients`` and ``weights`` as the last call
        passed them, no residual) of arrays shaped as ``a``, as one call of the compiled tiles' entry point for the
        argument types the last call passed, the plan and its lookups done here. A caller keeps it while the
        thread count and the knobs' epoch stay the same (the dispatcher's typing of fifteen arguments and __call__'s
        checks cost a 64-wide product's arithmetic); ``b`` is ignored, so it stands where a Split is called. With
        ``residual`` (the last call passed one): ``run(a, b, skip)``, ``skip`` a float32 array of a's rows by N in C
        order, which the caller checks. None where the last call was not this one, ran on more threads, through
        matmul.py's tiles, or has not run whole (a first call's trial). With ``norm`` = (scale, shift, epsilon, rms),
        float32 ``scale`` and ``shift`` (K,) (``shift`` None for none): ``run(x)`` for ``x`` shaped as ``a`` that ``a``
        is the normalization of (RMS with ``rms``, else LayerNormalization over the last axis), normalized and
        multiplied in one call (compiled/normed_rows.py); not with ``residual``."""
        last = self._last
        source = b if weights is None else weights
        if not self._tried or last is None or a.shape != last[0] or source is not last[1] or bias is not last[2] \
                or coefficients is not last[3] or last[4] is residual or last[5][0] != kernel_threads():
            return None
        (depth, rows, n, packed, offsets, padded_bias, flags, coefficients, threads, *_) = last[6]
        if threads != 1 or rows > self._few_rows.PANEL_ROWS:
            return None
        from ..compiled.gemm import NR

        empty, end, out_shape = self._empty, packed.shape[0], a.shape[:-1] + (n,)
        # The tiles write a scratch only for a last panel past y's columns (one tile's output there)
        spare = self._few_rows.ROWS * NR if n % NR else 0
        if norm is not None:
            return None if residual else self._bound_normed(a, norm, plan=last[6], spare=spare, out_shape=out_shape)
        arguments = (np.ascontiguousarray(a).reshape(-1), depth, rows, depth, packed, offsets, padded_bias,
                     np.empty(rows * n, np.float32), n, empty, flags, coefficients, 0, end, np.empty(spare, np.float32))
        entry = entry_point(self._few_rows.few_row_panels, arguments)
        if entry is None:
            return None

        def run(x, _b=None):
            y = np.empty(out_shape, np.float32)
            entry(x.reshape(-1), depth, rows, depth, packed, offsets, padded_bias, y.reshape(-1), n, empty, flags,
                  coefficients, 0, end, np.empty(spare, np.float32) if spare else empty)
            return y

        def run_adding(x, _b, skip):
            y = np.empty(out_shape, np.float32)
            entry(x.reshape(-1), depth, rows, depth, packed, offsets, padded_bias, y.reshape(-1), n, skip.reshape(-1),
                  flags, coefficients, 0, end, np.empty(spare, np.float32) if spare else empty)
            return y

        return run_adding if residual else run

    def _bound_normed(self, a, norm: tuple, plan: tuple, spare: int, out_shape: tuple):
        """bound's run(x) with the normalization ``norm`` in front (see bound), or None where its loop is not linked."""
        from ..compiled import normed_rows

        scale, shift, epsilon, rms = norm
        depth, rows, n, packed, offsets, padded_bias, flags, coefficients = plan[:8]
        shift = self._empty if shift is None else shift
        if scale.dtype is not FLOAT32 or scale.shape != (depth,) or shift.dtype is not FLOAT32 \
                or shift.shape not in ((0,), (depth,)):
            return None
        empty, epsilon, rms = self._empty, float(epsilon), bool(rms)
        arguments = (np.ascontiguousarray(a).reshape(-1), scale, shift, epsilon, rms, rows, depth, packed, offsets,
                     padded_bias, np.empty(rows * n, FLOAT32), n, empty, flags, coefficients, spare)
        entry = entry_point(normed_rows.normed_panels, arguments)
        if entry is None:
            return None

        def run(x, _b=None):
            y = np.empty(out_shape, np.float32)
            entry(x.reshape(-1), scale, shift, epsilon, rms, rows, depth, packed, offsets, padded_bias,
                  y.reshape(-1), n, empty, flags, coefficients, spare)
            return y

        return run

    def _plan(self, a, b, source, bias, with_residual: bool, coefficients, threads_now: int) -> tuple:
        """What a call of these shapes, arrays and knobs passes besides its operands (see __call__)."""
        from ..compiled import gemm, jobs, workers

        self._jobs, self._workers = jobs, workers
        matmul = self._matmul
        depth, n = b.shape
        rows = a.size // depth
        packed = self._weights.get("columns", (source,), lambda: matmul.pack_columns(b))
        offsets = self._offsets.get(depth)
        if offsets is None:
            offsets = self._offsets[depth] = gemm.packed_offsets(depth)
        flags = 0
        if bias is not None:
            flags |= gemm.BIAS
            padded_bias = self._bias.get("padded", (bias,), lambda: matmul.pad_bias(bias, n))
        else:
            padded_bias = self._empty
        if with_residual:
            flags |= gemm.RESIDUAL
        coefficients = self._empty if coefficients is None else coefficients
        panels = packed.shape[0]
        macs = rows * depth * n
        if rows <= GEMV_ROWS:  # few rows (few_rows.py's tiles): split by weights, as the few-row Split
            threads = 1 if depth * n < KNOBS.gemv_split_weights else max(1, min(threads_now, panels))
        else:
            threads = max(1, min(threads_now, panels, macs // KNOBS.split_macs))
        bounds, ranges = self._tasks(panels, threads)
        spread = threads > 1 and macs >= KNOBS.long_macs * threads
        helpers = helper_count() if spread or threads > 1 else 0
        self.route = ("few rows" if rows <= self._few_rows.PANEL_ROWS else "panels", threads)
        return (depth, rows, n, packed, offsets, padded_bias, flags, coefficients, threads, bounds, ranges,
                matmul.scratch_size(depth), spread, workers.run, workers.call, jobs.MATMUL.address(), helpers)

    def _tasks(self, panels: int, threads: int) -> tuple:
        """(bounds, ranges): each thread's even share of the panels cut into up to the product_tasks_per_thread knob's
        tasks of panels bounds[i] .. bounds[i + 1], thread t's tasks ranges[t] .. ranges[t + 1] (see jobs.MATMUL)."""
        key = (panels, threads, KNOBS.product_tasks_per_thread)
        tasks = self._task_cache.get(key)
        if tasks is None:
            bounds, ranges = [0], [0]
            for t in range(threads):
                first, end = panels * t // threads, panels * (t + 1) // threads
                cuts = max(1, min(KNOBS.product_tasks_per_thread, end - first))
                bounds += [first + (end - first) * (c + 1) // cuts for c in range(cuts)]
                ranges.append(len(bounds) - 1)
            tasks = self._task_cache[key] = (np.array(bounds, dtype=np.int64), np.array(ranges, dtype=np.int64))
        return tasks


def entry_point(loop, arguments: tuple):
    """The compiled ``loop``'s linked overload for ``arguments``' types, called without numba's dispatcher; None where
    it is not a built compiled loop or has no such overload linked (the background loader's child compiles it)."""
    if not isinstance(loop, deferred.Loop):
        return None
    try:
        dispatcher = loop.dispatcher()
        return deferred.overload(loop, tuple(dispatcher.typeof_pyval(value) for value in arguments))
    except (TypeError, ValueError):
        return None


def blas_product(a, b, bias=None, residual=None, coefficients=None) -> np.ndarray:
    """PackedProduct's result by BLAS and compiled/transformer.py's epilogue in place (their numpy equivalents
    serve where numba's cache misses them): a @ b (+ bias) [Gelu with ``coefficients``] (+ residual)."""
    from ..compiled import transformer

    n = b.shape[1]
    rows = np.matmul(np.ascontiguousarray(a).reshape(-1, a.shape[-1]), b)
    skip = None if residual is None else np.ascontiguousarray(residual).reshape(rows.shape)
    if coefficients is not None:
        transformer.gelu(rows, coefficients, bias, skip, out=rows)
    elif bias is not None or skip is not None:
        transformer.add_bias_residual(rows, bias, skip)
    return rows.reshape(a.shape[:-1] + (n,))


# Products of at most this many rows of ``a`` (a classifier's batch) run compiled/gemv.py's loops on
# the convolution helpers' threads instead of BLAS (see that module for why); from this many weights
# on they are split across the threads.
GEMV_ROWS = 8


def few_rows_product(a: np.ndarray, b: np.ndarray, transposed: bool) -> np.ndarray | None:
    """``a @ b.T`` (transposed) or ``a @ b`` through compiled/gemv.py for float32 ``a`` with few rows
    (and any leading dimensions: (..., K) @ (K, N) gives (..., N)); None where it does not apply (then
    BLAS computes it)."""
    split = few_rows_split(a, b, transposed)
    return None if split is None else split(a, b)


def few_rows_split(a: np.ndarray, b: np.ndarray, transposed: bool) -> Split | None:
    """The Split computing few_rows_product(a, b, transposed), or None where it does not apply or would run on one
    thread below the few_rows_blas_macs knob (where BLAS is as fast)."""
    if not (a.dtype is b.dtype is FLOAT32 and a.size <= GEMV_ROWS * a.shape[-1] and a.size and b.size
            and a.shape[-1] == b.shape[transposed] and gemv_host() and not numpy_first("jobs.PRODUCT")):
        return None
    key = (a.shape, b.shape, transposed, kernel_threads())
    split = _splits.get(key, False)
    if split is False:
        if len(_splits) > 1024:  # shapes vary without bound (e.g. a growing sequence): start over
            _splits.clear()
        rows, weights = a.size // a.shape[-1], b.shape[0] * b.shape[1]
        one_thread = key[3] == 1 or weights < KNOBS.gemv_split_weights
        split = _splits[key] = None if one_thread and rows * weights < KNOBS.few_rows_blas_macs else \
            Split(a.shape, b.shape, transposed, key[3])
    return split


class Split:
    """How one shape of few-row product is computed and split across threads (see compiled/gemv.py),
    decided once: the per-call Python is what a decode step's small products would otherwise pay."""

    def __init__(self, shape: tuple, weights: tuple, transposed: bool, threads: int):
        from ..compiled import gemv, jobs, workers

        n, depth = weights if transposed else weights[::-1]
        rows = int(np.prod(shape[:-1]))
        if weights[0] * weights[1] < KNOBS.gemv_split_weights:
            threads = 1
        # Block 0 of a @ b sums into sums[0], block b > 0 into sums[b] (added in order after).
        blocks = 1 if transposed else -(-depth // gemv.DEPTH_BLOCK)
        self._shape, self._rows, self._output = (blocks, rows, n), (rows, depth), shape[:-1] + (n,)
        self._transposed = transposed
        self._spans = threads if transposed else gemv.column_spans(blocks, n, threads)
        self._items = blocks * self._spans
        self._parts = min(threads, self._items)
        # Milliseconds per part: posted to sleeping helpers too, waiting for them (see workers.py).
        self._long = weights[0] * weights[1] * rows >= KNOBS.gemv_long_weights * self._parts
        self._tried = not deferred.guarding()  # else its first call is tried (deferred.Trial), BLAS the fallback
        self._runner = jobs.PRODUCT.address() if self._parts > 1 and self._tried else 0
        self._split, self._product, self._sum = jobs.split_product, jobs.product, gemv.sum_blocks
        self._jobs, self._workers = jobs, workers

    @property
    def route(self) -> tuple[int, int]:
        """(threads, work items): how this shape's calls are split."""
        return self._parts, self._items

    def _trial(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        try:
            with deferred.Trial():
                y = self(a, b)
        except deferred.WouldCompile:
            return np.matmul(a, b.T if self._transposed else b)
        self._tried = True
        return y

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if not self._tried and not deferred.in_trial():
            return self._trial(a, b)
        a = np.ascontiguousarray(a).reshape(self._rows)  # the loops read raw rows
        if not b.flags.c_contiguous:
            b = np.ascontiguousarray(b)
        sums = np.empty(self._shape, dtype=np.float32)
        if self._parts > 1:
            if not self._runner:  # (first here inside a Trial, its own or a caller's: the lookup may raise there)
                self._runner = self._jobs.PRODUCT.address()
            # The process's helpers, looked up per call: a forked child has none of its parent's.
            pool = self._workers.helpers(helper_count())
            if self._long:
                self._run_long(a, b, sums)
                return sums[0].reshape(self._output)
            if pool.call(self._split, (self._transposed, a, b, sums, self._spans, self._items, self._parts),
                         self._runner) is not None:
                return sums[0].reshape(self._output)
        # One thread, or another thread's kernel holds the helpers.
        self._product(self._transposed, a, b, sums, self._spans, self._items)
        return sums[0].reshape(self._output)

    def _run_long(self, a, b, sums) -> None:
        items, parts = self._items, self._parts
        bounds = [items * p // parts for p in range(parts + 1)]
        self._workers.run(self._jobs.PRODUCT, [(self._transposed, a, b, sums, self._spans, first, end)
                                               for first, end in zip(bounds, bounds[1:])], helper_count(), True)
        self._sum(sums)


_splits: dict[tuple, Split | None] = {}  # None: BLAS computes that shape
when_changed(_splits.clear)  # a Split's threads and waits follow the knobs it was made with


def gemv_host() -> bool:
    """Whether the host runs the compiled products (compiled/gemv.py, matmul.py, attention.py): AVX-512, as
    the packed convolution; elsewhere BLAS keeps the threads to itself."""
    global _avx512
    if _avx512 is None:
        from ..compiled import host  # not gemm.py, which imports numba

        _avx512 = host.AVX512
    return _avx512


_avx512 = None  # compiled/host.py's AVX512, read on first use
