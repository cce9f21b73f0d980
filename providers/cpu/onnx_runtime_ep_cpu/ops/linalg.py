"""Linear-algebra kernels: MatMul, Gemm, MatMulInteger, Einsum (through numpy's BLAS paths; on AVX-512
hosts, float32 products of constant weights through compiled/gemv.py for a few rows, a decode step's or
a CNN's classifier, and compiled/matmul.py for more, a prefill's or a batch's)."""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from ..fusions import FUSED_DOMAIN
from ..registry import register
from ..threads import helper_count, kernel_threads


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """Half-precision floats (float16, bfloat16) multiply in float32: numpy has no BLAS for them,
    and float32 accumulation is more accurate; other types compute as they are."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 and dtype.kind not in "biu" else dtype


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dtype = _compute_dtype(a.dtype)
    return np.matmul(a.astype(dtype, copy=False), b.astype(dtype, copy=False))


_BLAS_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
_FLOAT32 = np.dtype(np.float32)


@register("MatMul", since=1)
def matmul(node, shapes, opset):
    packed = None  # this node's _PackedProduct, made on first use
    # This node's last few-row product of a constant b: (a's shape, b, its _Split, the thread count). A
    # decode step repeats it every run; the lookups it skips cost more than a third of a small product.
    last = (None, None, None, 0)

    def kernel(a, b):
        # Single and double precision go straight to BLAS (or, for float32 times a constant matrix, to
        # compiled/gemv.py for a decode step's few rows and compiled/matmul.py for many): the per-call
        # checks below cost as much as the product of a small decode-step matrix.
        nonlocal packed, last
        shape, weights, kept, threads = last  # one read: another thread running this node may replace it
        if b is weights and a.shape == shape and a.dtype is b.dtype and kernel_threads() == threads:
            return (kept(a, b),)
        if a.dtype is b.dtype and a.dtype in _BLAS_FLOATS and b.ndim > 1:
            if b.ndim == 2 and a.ndim > 1 and a.size <= _GEMV_ROWS * b.shape[0]:
                split = _few_rows_split(a, b, False)
                if split is not None:
                    if not b.flags.writeable and b.flags.c_contiguous:  # a constant: the same array every run
                        last = (a.shape, b, split, kernel_threads())
                    return (split(a, b),)
            elif _PackedProduct.applies(a, b):
                if packed is None:
                    packed = _PackedProduct()
                return (packed(a, b),)
            return (np.matmul(a, b),)
        # asarray: two 1-D inputs make np.matmul return a numpy scalar, and kernels return arrays.
        return (np.asarray(_matmul(a, b)).astype(a.dtype, copy=False),)

    return kernel


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A fresh C-contiguous ``a @ b`` for a 2-D ``b``: one 2-D BLAS call when a's rows are contiguous."""
    if a.dtype is b.dtype and a.dtype in _BLAS_FLOATS and a.ndim > 1 and a.flags.c_contiguous:
        return np.matmul(a.reshape(-1, a.shape[-1]), b).reshape(a.shape[:-1] + (b.shape[-1],))
    return np.asarray(_matmul(a, b)).astype(a.dtype, copy=False)


# Products of at least this many rows (a prefill's or batch's) against constant float32 weights run
# compiled/matmul.py's packed product on the helper threads; from this many multiply-adds per thread
# they are split, from _LONG_MACS per thread a part waits for a sleeping helper (milliseconds).
_PACKED_ROWS = 9  # past the few-row products' _GEMV_ROWS: no float32 product of constant weights is OpenBLAS's
_SPLIT_MACS = 1 << 20
_LONG_MACS = 1 << 28
# Tasks per thread's share, claimed one at a time as the packed convolution's (see nn.py): one, the share
# whole, which the caller still takes over when its helper has not started it. Cut in 2 or 4 a GPT prefill
# ran 2-4% slower unloaded (in-process A/B, both orders), 7% faster with another process on the helper's CPU.
_SUBTASKS = 1


class _PackedProduct:
    """One node's products ``a @ b`` (+ bias, Gelu, residual) through compiled/matmul.py, for a float32
    ``a`` of many rows and a constant 2-D float32 ``b`` (an initializer: the same read-only array on
    every run), on AVX-512 hosts; ``applies`` says when. The weights are packed once per constant array,
    the bias padded once per constant array."""

    def __init__(self):
        from ..compiled import matmul
        from .nn import _Prepared

        self._matmul = matmul
        self._weights, self._bias = _Prepared(), _Prepared()
        self._offsets: dict[int, np.ndarray] = {}  # per depth: gemm.packed_offsets
        self._task_cache: dict[tuple, tuple] = {}  # per (panels, threads): _tasks
        self._empty = np.empty(0, dtype=np.float32)

    @staticmethod
    def applies(a: np.ndarray, b: np.ndarray) -> bool:
        return (a.dtype is b.dtype is _FLOAT32 and b.ndim == 2 and a.ndim >= 2 and not b.flags.writeable
                and a.shape[-1] == b.shape[0] and a.size >= _PACKED_ROWS * b.shape[0] and b.shape[1] > 0
                and b.shape[0] > 0 and _gemv_host())

    def __call__(self, a, b, bias=None, residual=None, coefficients=None, weights=None) -> np.ndarray:
        """a @ b (+ bias) [Gelu with ``coefficients``] (+ residual), as a fresh (..., N) array; ``bias``
        (N,) and ``residual`` (a's rows, N) float32, where given. ``weights``: the constant array ``b``
        is a view of (Gemm's transB), which identifies it from call to call (a view is new each time)."""
        from ..compiled import gemm, jobs, workers

        matmul = self._matmul
        depth, n = b.shape
        x = np.ascontiguousarray(a).reshape(-1)
        rows = x.size // depth
        packed = self._weights.get("columns", (b if weights is None else weights,), lambda: matmul.pack_columns(b))
        offsets = self._offsets.get(depth)
        if offsets is None:
            offsets = self._offsets[depth] = gemm.packed_offsets(depth)
        flags = 0
        if bias is not None:
            flags |= gemm.BIAS
            bias = self._bias.get("padded", (bias,), lambda: matmul.pad_bias(bias, n))
        else:
            bias = self._empty
        if residual is not None:
            flags |= gemm.RESIDUAL
            residual = np.ascontiguousarray(residual).reshape(-1)
        else:
            residual = self._empty
        coefficients = self._empty if coefficients is None else coefficients
        y = np.empty(a.shape[:-1] + (n,), dtype=np.float32)
        panels = packed.shape[0]
        macs = rows * depth * n
        threads = max(1, min(kernel_threads(), panels, macs // _SPLIT_MACS))
        bounds, ranges = self._tasks(panels, threads)
        claims = np.zeros(threads, dtype=np.int64)  # per call: what each thread's tasks have given out
        head = (x, depth, rows, depth, packed, offsets, bias, y.reshape(-1), n, residual, flags, coefficients, bounds,
                ranges, claims)
        scratch = matmul.scratch_size(depth)
        if threads > 1 and macs >= _LONG_MACS * threads:
            workers.run(jobs.MATMUL, [(*head, part) for part in range(threads)], helper_count(), True)
            return y
        workers.call(jobs.split_matmul, (*head, workers.local_mailbox(scratch)), jobs.MATMUL.address(), scratch,
                     helper_count() if threads > 1 else 0)
        return y

    def _tasks(self, panels: int, threads: int) -> tuple:
        """(bounds, ranges): each thread's even share of the panels cut into up to _SUBTASKS tasks of
        panels bounds[i] .. bounds[i + 1], thread t's tasks ranges[t] .. ranges[t + 1] (see jobs.MATMUL)."""
        key = (panels, threads)
        tasks = self._task_cache.get(key)
        if tasks is None:
            bounds, ranges = [0], [0]
            for t in range(threads):
                first, end = panels * t // threads, panels * (t + 1) // threads
                cuts = max(1, min(_SUBTASKS, end - first))
                bounds += [first + (end - first) * (c + 1) // cuts for c in range(cuts)]
                ranges.append(len(bounds) - 1)
            tasks = self._task_cache[key] = (np.array(bounds, dtype=np.int64), np.array(ranges, dtype=np.int64))
        return tasks


@register("FusedMatMul", domain=FUSED_DOMAIN, since=1)
def fused_matmul(node, shapes, opset):
    """MatMul + bias [-> Gelu] [+ residual] (see fusions.fuse_matmul_bias): float32 against constant weights
    through compiled/matmul.py, the epilogue fused; otherwise BLAS for the product, then one compiled pass
    over it in place (float64's Gelu: three, numpy's tanh between) for float32/float64; the unfused kernels
    for other dtypes."""
    from ..compiled import transformer as compiled
    from .nn import _gelu_erf, _gelu_series, _gelu_tanh

    activation = node.attr("activation", "none")
    # Each activation as (numpy kernel, the compiled loops' series per dtype); None for "none".
    gelus = {"gelu": (_gelu_erf, "none"), "gelu_tanh": (_gelu_tanh, "tanh")}
    if activation != "none" and activation not in gelus:
        raise InvalidGraphError(f"node {node.name!r} (FusedMatMul): unknown activation {activation!r}")
    gelu, approximate = gelus.get(activation, (None, None))
    series = {np.dtype(t): _gelu_series(approximate, t) for t in _BLAS_FLOATS} if gelu else {}

    packed = None  # this node's _PackedProduct, made on first use

    def kernel(a, b, bias, residual=None):
        nonlocal packed
        if (_PackedProduct.applies(a, b) and bias.dtype is _FLOAT32 and bias.shape == b.shape[1:]
                and (residual is None or (residual.dtype is _FLOAT32 and residual.shape == a.shape[:-1] + b.shape[1:]))
                and (gelu is None or _FLOAT32 in series)):
            if packed is None:
                packed = _PackedProduct()
            return (packed(a, b, bias, residual, series[_FLOAT32] if gelu else None),)
        y = _product(a, b)
        if (y.dtype in _BLAS_FLOATS and y.size and bias.dtype == y.dtype and bias.shape == y.shape[-1:]
                and (residual is None or (residual.shape == y.shape and residual.dtype == y.dtype))):
            rows = y.reshape(-1, y.shape[-1])
            skip = None if residual is None else np.ascontiguousarray(residual).reshape(rows.shape)
            if activation == "none":
                compiled.add_bias_residual(rows, bias, skip)
                return (y,)
            coefficients = series.get(y.dtype)
            if coefficients is not None:
                return (compiled.gelu(rows, coefficients, bias, skip, out=rows).reshape(y.shape),)
        # Anything else: the unfused nodes' arithmetic, in their order.
        y = bias + y
        if gelu is not None:
            with np.errstate(over="ignore", invalid="ignore"):  # as the Gelu kernel
                y = gelu(y).astype(y.dtype, copy=False)
        return (y if residual is None else residual + y,)

    return kernel


def _scale(y: np.ndarray, factor: float) -> np.ndarray:
    """``factor * y``, in place when ``y`` is a fresh float array (integer Gemm rounds at the end)."""
    if factor == 1:
        return y
    if np.issubdtype(y.dtype, np.floating):
        y *= y.dtype.type(factor)
        return y
    return y * factor


# Products of at most this many rows of ``a`` (a classifier's batch) run compiled/gemv.py's loops on
# the convolution helpers' threads instead of BLAS (see that module for why); from this many weights
# on they are split across the threads.
_GEMV_ROWS = 8
_GEMV_SPLIT_WEIGHTS = 1 << 14
_GEMV_LONG_WEIGHTS = 1 << 24  # per thread (milliseconds: waits for a sleeping helper, see workers.py)


def _few_rows_product(a: np.ndarray, b: np.ndarray, transposed: bool) -> np.ndarray | None:
    """``a @ b.T`` (transposed) or ``a @ b`` through compiled/gemv.py for float32 ``a`` with few rows
    (and any leading dimensions: (..., K) @ (K, N) gives (..., N)); None where it does not apply (then
    BLAS computes it)."""
    split = _few_rows_split(a, b, transposed)
    return None if split is None else split(a, b)


def _few_rows_split(a: np.ndarray, b: np.ndarray, transposed: bool) -> _Split | None:
    """The _Split computing _few_rows_product(a, b, transposed), or None where it does not apply."""
    if not (a.dtype is b.dtype is _FLOAT32 and a.size <= _GEMV_ROWS * a.shape[-1] and a.size and b.size
            and a.shape[-1] == b.shape[transposed] and _gemv_host()):
        return None
    key = (a.shape, b.shape, transposed, kernel_threads())
    split = _splits.get(key)
    if split is None:
        if len(_splits) > 1024:  # shapes vary without bound (e.g. a growing sequence): start over
            _splits.clear()
        split = _splits[key] = _Split(a.shape, b.shape, transposed, key[3])
    return split


class _Split:
    """How one shape of few-row product is computed and split across threads (see compiled/gemv.py),
    decided once: the per-call Python is what a decode step's small products would otherwise pay."""

    def __init__(self, shape: tuple, weights: tuple, transposed: bool, threads: int):
        from ..compiled import gemv, jobs, workers

        n, depth = weights if transposed else weights[::-1]
        rows = int(np.prod(shape[:-1]))
        if weights[0] * weights[1] < _GEMV_SPLIT_WEIGHTS:
            threads = 1
        # Block 0 of a @ b sums into sums[0], block b > 0 into sums[b] (added in order after).
        blocks = 1 if transposed else -(-depth // gemv.DEPTH_BLOCK)
        self._shape, self._rows, self._output = (blocks, rows, n), (rows, depth), shape[:-1] + (n,)
        self._transposed = transposed
        self._spans = threads if transposed else gemv.column_spans(blocks, n, threads)
        self._items = blocks * self._spans
        self._parts = min(threads, self._items)
        # Milliseconds per part: posted to sleeping helpers too, waiting for them (see workers.py).
        self._long = weights[0] * weights[1] * rows >= _GEMV_LONG_WEIGHTS * self._parts
        self._runner = jobs.PRODUCT.address() if self._parts > 1 else 0
        self._split, self._product, self._sum = jobs.split_product, jobs.product, gemv.sum_blocks
        self._jobs, self._workers = jobs, workers

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(a).reshape(self._rows)  # the loops read raw rows
        if not b.flags.c_contiguous:
            b = np.ascontiguousarray(b)
        sums = np.empty(self._shape, dtype=np.float32)
        if self._parts > 1:
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


_splits: dict[tuple, _Split] = {}


def _gemv_host() -> bool:
    """Whether the host runs the compiled products (compiled/gemv.py, matmul.py, attention.py): AVX-512, as
    the packed convolution; elsewhere BLAS keeps the threads to itself."""
    global _gemm
    if _gemm is None:
        from ..compiled import gemm

        _gemm = gemm
    return _gemm.AVAILABLE


_gemm = None  # compiled/gemm.py, imported on first use (numba loads only for models that need it)


def _gemm_kernel(node, c_must_match: bool):
    alpha = float(node.attr("alpha", 1.0))
    beta = float(node.attr("beta", 1.0))
    trans_a = bool(node.attr("transA", 0))
    trans_b = bool(node.attr("transB", 0))

    packed = None  # this node's _PackedProduct, made on first use

    def kernel(a, b, c=None):
        nonlocal packed
        if a.ndim != 2 or b.ndim != 2:
            raise InvalidArgumentError(
                f"node {node.name!r} (Gemm): inputs must be matrices, got shapes {a.shape} and {b.shape}"
            )
        left = a.T if trans_a else a
        right = b.T if trans_b else b
        term = c if c is not None and beta != 0 else None  # what C adds
        rows, n = left.shape[0], right.shape[-1]
        if alpha == 1 and rows > _GEMV_ROWS and _PackedProduct.applies(left, right) and (
                term is None or (beta == 1 and term.dtype is _FLOAT32 and term.shape in ((n,), (1, n), (rows, n)))):
            # A batch through a constant layer (a classifier's): compiled/matmul.py, C as its bias (a row) or
            # residual (a whole output; the batch has more than one row).
            if packed is None:
                packed = _PackedProduct()
            row = term is not None and term.size == n
            bias = (term if term.ndim == 1 else term.reshape(n)) if row else None  # (a 1-D C itself: its pad is kept)
            return (packed(left, right, bias, None if row else term, None, b),)
        y = _few_rows_product(left, b, trans_b) if left.shape[1] == b.shape[1 if trans_b else 0] else None
        if y is None:
            y = _matmul(left, b.T if trans_b else b)
        y = _scale(y, alpha)
        if c is not None and beta != 0:
            if c_must_match and c.shape != y.shape:
                raise InvalidArgumentError(
                    f"node {node.name!r} (Gemm): C has shape {c.shape} but broadcast=0 requires the "
                    f"output shape {y.shape}; set broadcast=1 or feed a full C"
                )
            term = c if beta == 1 else c * beta
            if np.issubdtype(y.dtype, np.floating) and np.broadcast_shapes(y.shape, term.shape) == y.shape:
                y += term
            else:
                y = y + term
        return (y.astype(a.dtype, copy=False),)

    return kernel


@register("Gemm", since=1)
def gemm_1(node, shapes, opset):
    # Before opset 7, C broadcasts only when the ``broadcast`` attribute says so.
    return _gemm_kernel(node, c_must_match=not node.attr("broadcast", 0))


@register("Gemm", since=7)
def gemm_7(node, shapes, opset):
    return _gemm_kernel(node, c_must_match=False)


def _zero_point_rows(zero_point: np.ndarray, a: np.ndarray) -> np.ndarray:
    """A per-row zero point given as a length-M vector applies along A's rows, not its columns."""
    if zero_point.ndim == 1 and zero_point.size > 1 and a.ndim >= 2:
        return zero_point.reshape(-1, 1)
    return zero_point


@register("MatMulInteger", since=10)
def matmul_integer(node, shapes, opset):
    def kernel(a, b, a_zero_point=None, b_zero_point=None):
        # float64 holds every partial sum of 8-bit products exactly (K up to ~1e11) and uses BLAS.
        af = a.astype(np.float64)
        if a_zero_point is not None:
            af -= _zero_point_rows(a_zero_point, a)
        bf = b.astype(np.float64)
        if b_zero_point is not None:
            bf -= b_zero_point
        # Through int64 so that sums past int32 wrap like the integer accumulation they stand for.
        return (np.matmul(af, bf).astype(np.int64).astype(np.int32),)

    return kernel


@register("Einsum", since=12)
def einsum(node, shapes, opset):
    equation = node.attr("equation")
    if not isinstance(equation, str) or not equation.strip():
        raise InvalidGraphError(
            f"node {node.name!r} (Einsum): attribute 'equation' is missing or empty; expected e.g. 'ij,jk->ik'"
        )
    equation = equation.replace(" ", "")

    def kernel(*operands):
        dtype = operands[0].dtype
        compute = _compute_dtype(dtype)
        y = np.einsum(equation, *(x.astype(compute, copy=False) for x in operands), optimize=True)
        return (np.asarray(y).astype(dtype, copy=False),)

    return kernel
