"""Linear-algebra kernels: MatMul, Gemm, Einsum (through numpy's BLAS paths; on AVX-512
hosts, float32 products of constant weights through compiled/gemv.py for a few rows, a decode step's or
a CNN's classifier, and compiled/matmul.py for more, a prefill's or a batch's)."""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from ..algorithms.precision import BLAS_FLOATS, FLOAT32, compute_dtype
from ..algorithms.products import (
    FEW_TILE_ROWS,
    GEMV_ROWS,
    PACKED_ROWS,
    PackedProduct,
    blas_matmul,
    entry_point,
    few_rows_product,
    few_rows_split,
    gemv_host,
    product,
)
from ..compiled.deferred import numpy_first
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ..threads import kernel_threads
from ..tuning import KNOBS, knobs_epoch


@register("MatMul", since=1)
def matmul(node, shapes, opset):
    packed = None  # this node's PackedProduct, made on first use
    # This node's last product of a constant b: (a's shape, b, what computed it (a Split, BLAS, or the PackedProduct's
    # bound call), the thread count, the knobs' epoch). A decode step repeats it every run, and the lookups it skips
    # are a large part of a small product's cost (measured in 2faee0e, and for the bound call in the commit that
    # added it).
    last = (None, None, None, 0, -1)

    def kernel(a, b):
        # Single and double precision go straight to BLAS (or, for float32 times a constant matrix, to
        # compiled/gemv.py for a decode step's few rows and compiled/matmul.py for many): the per-call
        # checks below cost as much as the product of a small decode-step matrix.
        nonlocal packed, last
        shape, weights, kept, threads, epoch = last  # one read: another thread running this node may replace it
        if b is weights and a.shape == shape and a.dtype is b.dtype and kernel_threads() == threads \
                and knobs_epoch[0] == epoch:
            return (kept(a, b),)
        if a.dtype is b.dtype and a.dtype in BLAS_FLOATS and b.ndim > 1:
            if b.ndim == 2 and a.ndim > 1 and a.size <= GEMV_ROWS * b.shape[0]:
                if PackedProduct.takes_few(a, b):  # constant weights: few_rows.py's tiles
                    if packed is None:
                        packed = PackedProduct()
                    split = packed
                else:
                    split = few_rows_split(a, b, False) or _one_product(a.shape, b.shape)  # (None: BLAS's)
            elif PackedProduct.applies(a, b):
                if packed is None:
                    packed = PackedProduct()
                split = packed
            else:
                return (np.matmul(a, b),)
            y = split(a, b)
            if not b.flags.writeable and b.flags.c_contiguous:  # a constant: the same array every run
                kept = (packed.bound(a, b) if split is packed else None) or split
                last = (a.shape, b, kept, kernel_threads(), knobs_epoch[0])
            return (y,)
        # asarray: two 1-D inputs make np.matmul return a numpy scalar, and kernels return arrays.
        return (np.asarray(blas_matmul(a, b)).astype(a.dtype, copy=False),)

    return kernel if gemv_host() else _blas_products(kernel)


def _one_product(a_shape: tuple, b_shape: tuple):
    """np.matmul for A of ``a_shape`` by a matrix of ``b_shape``. Where A's leading axes hold one matrix (a decode
    step's (1, 1, K)) of b's depth, np.dot's C function on that matrix: the same BLAS call (the same bits) without the
    generalized ufunc's and the array-function dispatch, which cost a one-row product of a small matrix about as much
    as BLAS's call. Otherwise np.matmul itself (and its error for a depth that does not match)."""
    if len(a_shape) < 2 or math.prod(a_shape[:-2]) != 1 or a_shape[-1] != b_shape[0]:
        return np.matmul
    matrix, out_shape, dot = a_shape[-2:], a_shape[:-1] + (b_shape[1],), getattr(np.dot, "_implementation", np.dot)

    def product(a, b):
        return dot(a.reshape(matrix), b).reshape(out_shape)

    return product


def _blas_products(general):
    """MatMul where the host has no compiled products, so every float product is BLAS's: ``general``'s checks
    for them (a few microseconds, a decode step's small product's own cost) are skipped."""

    def kernel(a, b):
        if a.dtype is b.dtype and a.dtype in BLAS_FLOATS and b.ndim > 1:
            return (np.matmul(a, b),)
        return general(a, b)

    return kernel


# A FusedMatMul with Gelu takes the packed product from this many times the packed_macs knob: the packed
# product's Gelu epilogue is slower than BLAS and the compiled Gelu pass up to about 2M multiply-adds
# (50x64x128: 18.8 against 13.4 us; 128x64x256: 56 against 55; one thread, with this change).
GELU_PACKED_FACTOR = 4


@register("FusedMatMul", domain=FUSED_DOMAIN, since=1)
def fused_matmul(node, shapes, opset):
    """MatMul + bias [-> Gelu] [+ residual] (see fusions.fuse_matmul_bias): float32 against constant weights
    through compiled/matmul.py, the epilogue fused; otherwise BLAS for the product, then one compiled pass
    over it in place (float64's Gelu: three, numpy's tanh between) for float32/float64; the unfused kernels
    for other dtypes. With attribute ``normalize`` (norm_in_front.py), inputs 4 and 5 are the normalization's scale
    and optional shift, applied to A first (input 3, the residual, may be empty)."""
    from ..algorithms.activations import gelu_erf, gelu_series, gelu_tanh  # (MatMul and Gemm never load it)
    from ..compiled import transformer as compiled

    activation = node.attr("activation", "none")
    if activation == "relu":  # (gemm_epilogues.py) the product and bias as "none", then max(0, .) in place
        return _relu_after(fused_matmul(_with_activation(node, "none"), shapes, opset))
    # Each activation as (numpy kernel, the compiled loops' series per dtype); None for "none".
    gelus = {"gelu": (gelu_erf, "none"), "gelu_tanh": (gelu_tanh, "tanh")}
    if activation != "none" and activation not in gelus:
        raise InvalidGraphError(f"node {node.name!r} (FusedMatMul): unknown activation {activation!r}")
    gelu, approximate = gelus.get(activation, (None, None))
    series = {np.dtype(t): gelu_series(approximate, t) for t in BLAS_FLOATS} if gelu else {}

    packed = None  # this node's PackedProduct, made on first use

    def kernel(a, b, bias, residual=None):
        nonlocal packed
        if (PackedProduct.applies(a, b) and bias.dtype is FLOAT32 and bias.shape == b.shape[1:]
                and (residual is None or (residual.dtype is FLOAT32 and residual.shape == a.shape[:-1] + b.shape[1:]))
                and (gelu is None or (FLOAT32 in series
                                      and a.size * b.shape[1] >= GELU_PACKED_FACTOR * KNOBS.packed_macs))):
            if packed is None:
                packed = PackedProduct()
            return (packed(a, b, bias, residual, series[FLOAT32] if gelu else None),)
        y = product(a, b)
        if (y.dtype in BLAS_FLOATS and y.size and bias.dtype == y.dtype and bias.shape == y.shape[-1:]
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

    return _planned_fused_matmul(node, shapes, activation == "none", series, kernel)


def _planned_fused_matmul(node, shapes, plain: bool, series: dict, kernel):
    """FusedMatMul's kernel: ``kernel`` (any shapes) behind its normalization where the node has one, and the
    planned shape's kernel in front where the shapes are known."""
    from .norm_in_front import norm_in_front

    norm = norm_in_front(node, shapes)
    if norm is None:
        return _fused_matmul_for_shape(shapes, plain, series, kernel, kernel, None) or kernel

    def normalizing(a, b, bias, residual=None, scale=None, shift=None):
        return kernel(norm(a, scale, shift), b, bias, residual)

    return _fused_matmul_for_shape(shapes, plain, series, normalizing, kernel, norm) or normalizing


def _with_activation(node, activation: str):
    from onnx_runtime.ir import Node

    return Node(node.op_type, list(node.inputs), list(node.outputs), name=node.name, domain=node.domain,
                attrs={**node.attrs, "activation": activation}, opset=node.opset)


def _relu_after(product):
    """FusedMatMul with activation relu: ``product``'s (the "none" kernel's) fresh result clamped at zero in place
    (NaN stays NaN, as Relu's), then the residual added."""

    def kernel(a, b, bias, residual=None, scale=None, shift=None):
        # Without a normalization in front the product may be the 4-argument kernel (no planned shape).
        y = (product(a, b, bias) if scale is None else product(a, b, bias, None, scale, shift))[0]
        np.maximum(y, y.dtype.type(0), out=y)
        return (y if residual is None else residual + y,)

    return kernel


def _fused_matmul_for_shape(shapes, plain: bool, series: dict, general, unnormalized, norm):
    """FusedMatMul for the one shape of ``a`` and ``b`` the kernel is made for (a planned shape), where the
    packed product does not take it: BLAS's product of a's rows, then the compiled epilogue in place, the
    row count, output shape and "none" operands decided here (working them out per call cost a short
    sequence's products about as much as their arithmetic). The same calls as ``general``'s BLAS path, so
    the same bits; other shapes, dtypes or layouts go to ``general``. None where the shapes are not known.
    ``norm``: the normalization in front (norm_in_front.py), or None; ``unnormalized``: ``general`` without it."""
    a_shape, b_shape = (shapes[0], shapes[1]) if shapes and len(shapes) > 1 else (None, None)
    if not a_shape or not b_shape or len(b_shape) != 2 or len(a_shape) < 2 or a_shape[-1] != b_shape[0] \
            or not all(isinstance(d, int) and d > 0 for d in (*a_shape, *b_shape)):
        return None
    rows, depth, n = math.prod(a_shape[:-1]), b_shape[0], b_shape[1]
    least = KNOBS.packed_macs * (1 if plain else GELU_PACKED_FACTOR)
    if gemv_host() and rows >= PACKED_ROWS and rows * depth * n >= least:  # the packed product's
        return None
    dtypes = BLAS_FLOATS if plain else {dtype for dtype, coefficients in series.items() if coefficients is not None}
    out_shape, bias_shape = a_shape[:-1] + (n,), (n,)
    # np.dot: the same BLAS call as np.matmul on 2-D float32/float64 operands (the same bits) without the
    # generalized ufunc's dispatch, which a short sequence's products pay on every call; its C function itself where
    # numpy exposes it (NEP 18's ``_implementation``), without the array-function dispatch in front
    product = getattr(np.dot, "_implementation", np.dot) if dtypes <= BLAS_FLOATS else np.matmul
    # A decode step's few rows by constant float32 weights of this size: few_rows.py's tiles, bias and residual in
    # their epilogue (as MatMul's and Gemm's; a step's out-projection streams its weights from the L3 cache, where
    # BLAS's call was 2.6x the tiles' at 256x256). Any thread count here: each call's takes_few reads the running one.
    # (Gelu too: its epilogue after the tiles' product, where the series has a float32 form.)
    tiles_series = None if plain else series.get(FLOAT32)
    # (and smaller ones with a normalization in front: the two then run as one compiled call)
    few = (plain or tiles_series is not None) and rows <= GEMV_ROWS and gemv_host() \
        and PackedProduct.few_sized(rows, depth * n, False, 2, depth, norm is not None)
    packed = None  # this node's PackedProduct, made on first use
    # Its bound call (PackedProduct.bound), as MatMul keeps one: (b, bias, whether it adds a residual, the call, the
    # thread count, the knobs' epoch, the normalization's scale), for constant b and bias.
    kept: tuple = (None, None, False, None, 0, -1, None)
    # Where the shape takes BLAS's product (not the tiles, no normalization in front): the constant b and bias of the
    # last call that did, their dtype and, once the epilogue's entry point is bound, the product through it for them
    # (_blas_product's ``bound``); a call with the same arrays then checks only A and the residual (every check below
    # costs a decode step's small product about a third of its BLAS call again).
    blas_kept: tuple = (None, None, None, None)
    keeps_blas = norm is None and not few  # (the tiles' shapes keep their bound call instead)
    blas, bound = _blas_product(product, a_shape, n, plain, series)

    def kernel(a, b, bias, residual=None, scale=None, shift=None):
        nonlocal packed, kept, blas_kept
        a = a if a.flags.c_contiguous else _planned_copy(a, a_shape)  # (ConvNeXt's channels-last views)
        if residual is not None and not residual.flags.c_contiguous:  # (a residual transpose_sinking moved)
            residual = _planned_copy(residual, out_shape)
        y, blas_kept = (_kept_fused_run(kept, a, b, bias, residual, a_shape, out_shape, scale), blas_kept) if few \
            else _kept_blas(blas_kept, a, b, bias, residual, a_shape, out_shape, blas, bound)
        if y is not None:
            return (y,)
        dtype = a.dtype
        if a.shape != a_shape or dtype not in dtypes or b.dtype is not dtype or bias.dtype is not dtype \
                or b.ndim != 2 or bias.shape != bias_shape or not a.flags.c_contiguous or (residual is not None and (
                    residual.shape != out_shape or residual.dtype is not dtype or not residual.flags.c_contiguous)):
            return general(a, b, bias, residual) if norm is None else general(a, b, bias, residual, scale, shift)
        a, spec = (a, None) if norm is None else (norm(a, scale, shift), norm.spec(scale, shift))
        if a.dtype is not dtype or not a.flags.c_contiguous:  # (the normalization's output of another dtype)
            return unnormalized(a, b, bias, residual)
        if few and dtype is FLOAT32 and PackedProduct.takes_few(a.reshape(rows, depth), b, norm is not None):
            if packed is None:
                packed = PackedProduct()
            y = packed(a.reshape(rows, depth), b, bias, residual, tiles_series).reshape(out_shape)
            kept = _kept_fused(packed, a.reshape(rows, depth), b, bias, residual is not None, tiles_series, spec) \
                or kept
            return (y,)
        blas_kept = _constants(keeps_blas, b, bias, dtype, blas_kept)
        return (blas(a, b, bias, residual, dtype),)

    return kernel


def _blas_product(product, a_shape: tuple, n: int, plain: bool, series: dict):
    """``blas(a, b, bias, residual, dtype)``: a planned FusedMatMul's BLAS ``product`` of A's rows (A of ``a_shape``)
    by its (K, ``n``) weights with the bias (and Gelu: not ``plain``, ``series`` per dtype) and the residual added in
    place by the compiled epilogue, as A's shape."""
    from ..algorithms.bound_loop import EntryOnce  # (here: a CNN's classifier MatMul need not import it)
    from ..compiled import transformer as compiled

    rows, depth, out_shape = math.prod(a_shape[:-1]), a_shape[-1], a_shape[:-1] + (n,)
    add, gelu = compiled.add_bias_residual_, compiled.gelu
    no_residual = {dtype: np.empty((0, 0), dtype) for dtype in BLAS_FLOATS}
    # The epilogue's entry point per dtype (bound_loop.EntryOnce): a decode step adds its bias every step with the same
    # argument types (numba's dispatcher typing its three arguments cost a one-row product's epilogue half its call).
    # Only C-contiguous operands of that dtype take it: the entry point does not check its arguments.
    adds = {dtype: EntryOnce(add) for dtype in BLAS_FLOATS}

    def blas(a, b, bias, residual, dtype):
        y = product(a.reshape(rows, depth), b)
        skip = no_residual[dtype] if residual is None else residual.reshape(rows, n)
        if plain:
            if y.dtype is dtype and bias.dtype is dtype and skip.dtype is dtype and y.flags.c_contiguous \
                    and bias.flags.c_contiguous and skip.flags.c_contiguous:
                adds[dtype].run((y, bias, skip))
            else:
                add(y, bias, skip)
            return y.reshape(out_shape)
        return gelu(y, series[dtype], bias, None if residual is None else skip, out=y).reshape(out_shape)

    def bound(bias, dtype):
        """``run(a, b, residual)``: ``blas(a, b, bias, residual, dtype)`` of a plain product through the epilogue's
        entry point with none of blas's checks, for this constant ``bias`` (C-contiguous, of ``dtype``): the caller
        passes A of the planned shape and the weights of ``dtype`` and a residual C-contiguous of the output's shape
        and dtype, or none (np.dot's y is a new C-contiguous array of their dtype). None before the entry point is
        bound (the epilogue's first compiled call binds it) or for a Gelu product."""
        entry = adds[dtype].entry if plain and dtype in adds else None
        if entry is None or bias.dtype is not dtype or bias.ndim != 1 or not bias.flags.c_contiguous:
            return None
        empty = no_residual[dtype]

        def run(a, b, residual):
            y = product(a.reshape(rows, depth), b)
            entry(y, bias, empty if residual is None else residual.reshape(rows, n))
            return y.reshape(out_shape)

        return run

    return blas, bound


def _planned_copy(a: np.ndarray, a_shape: tuple) -> np.ndarray:
    """A non-contiguous ``a`` (or residual) of the planned shape as one C-contiguous copy, for the planned kernel (the
    general one costs more than the copy); others as they are."""
    return np.ascontiguousarray(a) if a.shape == a_shape else a


def _kept_blas(kept: tuple, a, b, bias, residual, a_shape: tuple, out_shape: tuple, blas, bound) -> tuple:
    """(y, what to keep): a planned FusedMatMul's ``blas(a, b, bias, residual, dtype)`` where this call's operands are
    those ``kept`` (b, bias, their dtype: the same constant b and bias, A of the planned shape and their dtype, a
    residual of the output's shape and dtype or none, C-contiguous as the kernel makes one of that shape), through
    the kept run (_blas_product's ``bound``) once there is one, ``kept`` with that run once ``bound`` has it (the
    epilogue's entry point binds at its first compiled call); else (None, ``kept``): the checked path."""
    weights, kept_bias, dtype, run = kept  # one read: another thread may replace it
    if b is weights and bias is kept_bias and a.shape == a_shape and a.dtype is dtype \
            and (residual is None or (residual.shape == out_shape and residual.dtype is dtype)):
        if run is not None:
            return run(a, b, residual), kept
        y = blas(a, b, bias, residual, dtype)
        run = bound(kept_bias, dtype)
        return y, kept if run is None else (weights, kept_bias, dtype, run)
    return None, kept


def _constants(keeping: bool, b: np.ndarray, bias: np.ndarray, dtype, kept: tuple) -> tuple:
    """(b, bias, dtype, None) as a FusedMatMul's kept BLAS operands where it keeps them and both are constants
    (read-only: the same values on every run), else what it ``kept``."""
    return (b, bias, dtype, None) if keeping and not (b.flags.writeable or bias.flags.writeable) else kept


def _kept_fused(packed: PackedProduct, rows: np.ndarray, b: np.ndarray, bias: np.ndarray, adding: bool,
                coefficients, norm: tuple | None) -> tuple | None:
    """A planned FusedMatMul's ``kept`` for the PackedProduct call it just made (``rows``: A as a matrix; ``adding``:
    with a residual; ``coefficients``: its Gelu's; ``norm``: the normalization in front, PackedProduct.bound's):
    (b, bias, adding, the bound call, the thread count, the knobs' epoch, the normalization's scale) for constant b,
    bias, scale and shift, else None."""
    if b.flags.writeable or bias.flags.writeable or (norm is not None and (
            norm[0].flags.writeable or (norm[1] is not None and norm[1].flags.writeable))):
        return None
    bound = packed.bound(rows, b, bias, coefficients, residual=adding, norm=norm)
    return None if bound is None else (b, bias, adding, bound, kernel_threads(), knobs_epoch[0],
                                       None if norm is None else norm[0])


def _kept_fused_run(kept: tuple, a, b, bias, residual, a_shape: tuple, out_shape: tuple, scale) -> np.ndarray | None:
    """The FusedMatMul's product by its kept bound call where these operands are the ones it was kept for (float32,
    the planned shapes, the same constant b, bias and normalization ``scale``, a residual where it adds one); None
    otherwise."""
    weights, kept_bias, adding, run, threads, epoch, kept_scale = kept  # one read: another thread may replace it
    if b is not weights or bias is not kept_bias or scale is not kept_scale or a.shape != a_shape \
            or a.dtype is not FLOAT32 \
            or not a.flags.c_contiguous or kernel_threads() != threads or knobs_epoch[0] != epoch:
        return None
    if residual is None:
        return None if adding else run(a).reshape(out_shape)
    if not adding or residual.dtype is not FLOAT32 or residual.shape != out_shape or not residual.flags.c_contiguous:
        return None
    return run(a, b, residual).reshape(out_shape)


def _scale(y: np.ndarray, factor: float) -> np.ndarray:
    """``factor * y``, in place when ``y`` is a fresh float array (integer Gemm rounds at the end)."""
    if factor == 1:
        return y
    if np.issubdtype(y.dtype, np.floating):
        y *= y.dtype.type(factor)
        return y
    return y * factor


def _gemm_kernel(node, c_must_match: bool):
    alpha = float(node.attr("alpha", 1.0))
    beta = float(node.attr("beta", 1.0))
    trans_a = bool(node.attr("transA", 0))
    trans_b = bool(node.attr("transB", 0))

    packed = None  # this node's PackedProduct, made on first use
    # The last call's PackedProduct.bound product, as MatMul keeps it: (a's shape, b, c, the bound call, the thread
    # count, the knobs' epoch), for constant B and C (or none) where C adds as a bias.
    last = (None, None, None, None, 0, -1)

    def kernel(a, b, c=None):
        nonlocal packed, last
        shape, weights, term_kept, kept, threads, epoch = last  # one read (as MatMul's)
        if b is weights and c is term_kept and a.shape == shape and a.dtype is FLOAT32 \
                and kernel_threads() == threads and knobs_epoch[0] == epoch:
            return (kept(a),)
        if a.ndim != 2 or b.ndim != 2:
            raise InvalidArgumentError(
                f"node {node.name!r} (Gemm): inputs must be matrices, got shapes {a.shape} and {b.shape}"
            )
        left = a.T if trans_a else a
        right = b.T if trans_b else b
        term = c if c is not None and beta != 0 else None  # what C adds
        rows, n = left.shape[0], right.shape[-1]
        fits = term is None or (beta == 1 and term.dtype is FLOAT32 and term.shape in ((n,), (1, n), (rows, n))
                                and (not c_must_match or term.shape == (rows, n)))
        few = rows <= FEW_TILE_ROWS and PackedProduct.takes_few(left, right)
        if few or (alpha == 1 and fits and rows > GEMV_ROWS and PackedProduct.applies(left, right)):
            # Constant weights: compiled/matmul.py for a batch (a classifier's), few_rows.py for a few rows, C as
            # the bias (a row) or residual (a whole output) where it adds as one.
            if packed is None:
                packed = PackedProduct()
            if alpha == 1 and fits:
                row = term is not None and term.size == n
                bias = (term if term.ndim == 1 else term.reshape(n)) if row else None  # (a 1-D C: its pad is kept)
                y = packed(left, right, bias, None if row else term, None, b)
                if (term is None or row) and not trans_a:
                    last = _kept_gemm(packed, a, right, b, c, bias) or last
                return (y,)
            y = packed(left, right, None, None, None, b)
        else:
            y = few_rows_product(left, b, trans_b) if left.shape[1] == b.shape[1 if trans_b else 0] else None
            if y is None:
                y = blas_matmul(left, b.T if trans_b else b)
        y = _scale(y, alpha)
        if c is not None and beta != 0:
            y = _add_c(node, y, c, beta, c_must_match)
        return (y.astype(a.dtype, copy=False),)

    return kernel


def _kept_gemm(packed: PackedProduct, a: np.ndarray, right: np.ndarray, b: np.ndarray, c: np.ndarray | None,
               bias) -> tuple | None:
    """A Gemm kernel's ``last`` for the PackedProduct call it just made: a (not transposed) by ``right`` (constant b,
    or its transpose), C none or constant, added as ``bias``; None where that is not kept."""
    if b.flags.writeable or (c is not None and c.flags.writeable):
        return None
    kept = packed.bound(a, right, bias, None, b)
    return None if kept is None else (a.shape, b, c, kept, kernel_threads(), knobs_epoch[0])


def _add_c(node, y: np.ndarray, c: np.ndarray, beta: float, c_must_match: bool) -> np.ndarray:
    """Gemm's ``y + beta * C``, in place where C broadcasts into y."""
    if c_must_match and c.shape != y.shape:
        raise InvalidArgumentError(
            f"node {node.name!r} (Gemm): C has shape {c.shape} but broadcast=0 requires the "
            f"output shape {y.shape}; set broadcast=1 or feed a full C"
        )
    term = c if beta == 1 else c * beta
    # (Dtype kind and shapes compared directly: np.issubdtype and np.broadcast_shapes cost more than
    # a one-row product's arithmetic.)
    if y.dtype.kind == "f" and term.ndim <= y.ndim and all(
            t == 1 or t == d for t, d in zip(term.shape[::-1], y.shape[::-1])):
        y += term
        return y
    return y + term


@register("Gemm", since=1)
def gemm_1(node, shapes, opset):
    # Before opset 7, C broadcasts only when the ``broadcast`` attribute says so.
    return _gemm_kernel(node, c_must_match=not node.attr("broadcast", 0))


@register("Gemm", since=7)
def gemm_7(node, shapes, opset):
    general = _gemm_kernel(node, c_must_match=False)
    return _gemm_for_shape(node, shapes, general) or general


def _gemm_for_shape(node, shapes, general):
    """Gemm with alpha 1 and beta 1 (or no C) for the one shape of A, B and C the kernel is made for (a planned
    shape), where ``general``'s product is BLAS's anyway (no compiled products, or a product too small for
    them: _blas_sized): the same calls, so the same bits, without its per-call checks and lookups, which cost
    a classifier's or pooler's one-row product several times its arithmetic; a float32 product of at most
    SMALL_GEMM_MACS by constant B (and C) through compiled/small_gemm.py's loop, kept bound. Other shapes and dtypes
    go to ``general``. None where it does not apply."""
    a_shape, b_shape, c_shape = (tuple(s) if s is not None else None
                                 for s in (list(shapes or ()) + [None, None, None])[:3])
    if float(node.attr("alpha", 1.0)) != 1 \
            or (c_shape is not None and float(node.attr("beta", 1.0)) != 1) \
            or not a_shape or not b_shape or len(a_shape) != 2 or len(b_shape) != 2 \
            or not all(isinstance(d, int) and d > 0 for d in (*a_shape, *b_shape)):
        return None
    trans_a, trans_b = bool(node.attr("transA", 0)), bool(node.attr("transB", 0))
    rows, depth = a_shape[::-1] if trans_a else a_shape
    columns = b_shape[0] if trans_b else b_shape[1]
    if depth != (b_shape[1] if trans_b else b_shape[0]):
        return None  # (the general kernel reports a mismatch)
    # A product BLAS does not take at every thread count is the general kernel's (the packed product's, few_rows.py's
    # tiles or the few-row split); the rest is BLAS's as below (a decoder's small one-row Gemm, which the general
    # kernel's checks and lookups made twice as slow).
    if gemv_host() and not _blas_sized(rows, depth, columns, trans_b):
        return None
    if not _adds_in_place(c_shape, rows, columns):
        return None  # C that does not add in place (it would widen the output): the general kernel broadcasts it

    def kernel(a, b, c=None):
        dtype = a.dtype
        if a.shape != a_shape or b.shape != b_shape or dtype not in BLAS_FLOATS or b.dtype is not dtype \
                or (c is None) != (c_shape is None) or (c is not None and (c.shape != c_shape or c.dtype is not dtype)):
            return general(a, b, c)
        # np.dot: np.matmul's BLAS call on 2-D operands (the same bits), without the generalized ufunc's dispatch
        # (0.3 us of a streaming classifier's 1x64 by 64x12 Gemm)
        y = np.dot(a.T if trans_a else a, b.T if trans_b else b)
        if c is not None:
            y += c
        return (y,)

    if _small_loop(rows, depth, columns, trans_a, trans_b, c_shape):
        return _small_gemm(kernel, (a_shape, b_shape, c_shape), trans_b)
    return kernel


# Float32 Gemms of up to this many multiply-adds (by transposed weights, or of one or two rows by K x N weights) run
# compiled/small_gemm.py's loop, product and bias in one call, instead of BLAS's call and the bias add (a streaming
# classifier's 64 features into 12-30 classes: 0.6-1.3 against 1.6-3.0 us, one thread, measured in the commit that
# added it); beyond, BLAS's blocked products win. One row by transposed weights (a dot product per output) up to
# ONE_ROW_SMALL_GEMM_MACS: a character model's 128 features into 96 classes 1.3 against 2.0 us, 256x128 2.5 against
# 3.1 (load 14; at 64K even).
SMALL_GEMM_MACS = 8192
ONE_ROW_SMALL_GEMM_MACS = 32768


def _small_loop(rows: int, depth: int, columns: int, trans_a: bool, trans_b: bool, c_shape: tuple | None) -> bool:
    """Whether a planned Gemm of this shape (alpha 1, beta 1) may run compiled/small_gemm.py's loop."""
    macs = rows * depth * columns
    fits = macs <= SMALL_GEMM_MACS or (rows == 1 and trans_b and macs <= ONE_ROW_SMALL_GEMM_MACS)
    return not trans_a and fits and (trans_b or rows <= 2) and c_shape in (None, (columns,), (1, columns))


_NO_BIAS = np.empty(0, np.float32)
_NO_BIAS.flags.writeable = False


def _small_gemm(kernel, planned: tuple, trans_b: bool):
    """``kernel`` (Gemm for the ``planned`` shapes) whose float32 calls by constant B and C run compiled/small_gemm.py's
    loop through its entry point once bound (_bind_small): the product and the bias in one call, without the checks;
    every other call is ``kernel``'s."""
    a_shape = planned[0]
    out_shape = (a_shape[0], planned[1][0] if trans_b else planned[1][1])
    # (b, c, C as the bias row, the entry point) of the bound call; tries: the calls left before binding is tried
    # again (a cache miss the background loader fills later, numba still loading), doubling each time.
    bound: tuple = (None, None, None, None)
    tries = [1, 1]

    def small(a, b, c=None):
        nonlocal bound
        kept_b, kept_c, bias, entry = bound  # one read: another thread may bind meanwhile
        if b is kept_b and c is kept_c and a.shape == a_shape and a.dtype is FLOAT32 and a.flags.c_contiguous:
            y = np.empty(out_shape, FLOAT32)
            entry(a, b, bias, y)
            return (y,)
        tries[0] -= 1
        if tries[0] <= 0 and a.dtype is FLOAT32:
            tries[1] = tries[0] = tries[1] * 2
            bound = _bind_small(a, b, c, planned, trans_b) or bound
        return kernel(a, b, c)

    return small


def _bind_small(a, b, c, planned: tuple, trans_b: bool) -> tuple | None:
    """(b, c, the bias row, the loop's entry point) for float32 A, B and C of the ``planned`` shapes (C none or a
    row), B and C constant (read-only) and all C-contiguous, where numba is loaded and the loop is linked; None
    otherwise (numba still loading, a fed B or C, or a cache miss the background loader fills)."""
    a_shape, b_shape, c_shape = planned
    if a.shape != a_shape or b.shape != b_shape or (None if c is None else c.shape) != c_shape \
            or not a.flags.c_contiguous or b.dtype is not FLOAT32 or b.flags.writeable \
            or not b.flags.c_contiguous or (c is not None and (c.dtype is not FLOAT32 or c.flags.writeable
                                                              or not c.flags.c_contiguous)):
        return None
    if numpy_first():  # numba loads in the background meanwhile: BLAS serves
        return None
    from ..compiled import small_gemm

    loop = small_gemm.rows_by_transposed_bias_ if trans_b else small_gemm.rows_by_weights_bias_
    bias = _NO_BIAS if c is None else c.reshape(-1)
    out = np.empty((a_shape[0], b_shape[0] if trans_b else b_shape[1]), FLOAT32)
    entry = entry_point(loop, (a, b, bias, out))
    return None if entry is None else (b, c, bias, entry)


def _adds_in_place(c_shape: tuple | None, rows: int, columns: int) -> bool:
    """Whether a Gemm's C of this shape (or none) adds into the (rows, columns) product without widening it."""
    return c_shape is None or (len(c_shape) <= 2 and all(c in (1, d) for c, d in zip(c_shape[::-1], (columns, rows))))


def _blas_sized(rows: int, depth: int, columns: int, transposed: bool) -> bool:
    """Whether a float32 product of this size against constant weights (``transposed``: Gemm's transB) is BLAS's at
    every thread count: below the packed product's knob for many rows; for few, too few weights to split and below
    the knobs of few_rows.py's tiles and of the few-row split's loops (up to GEMV_ROWS rows) or of the packed
    product."""
    macs = rows * depth * columns
    if rows > FEW_TILE_ROWS:
        return macs < KNOBS.packed_macs
    other = KNOBS.few_rows_blas_macs if rows <= GEMV_ROWS else KNOBS.packed_macs
    return not PackedProduct.few_sized(rows, depth * columns, transposed, 2, depth) and macs < other


def zero_point_rows(zero_point: np.ndarray, a: np.ndarray) -> np.ndarray:
    """A per-row zero point given as a length-M vector applies along A's rows, not its columns."""
    if zero_point.ndim == 1 and zero_point.size > 1 and a.ndim >= 2:
        return zero_point.reshape(-1, 1)
    return zero_point


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
        compute = compute_dtype(dtype)
        y = np.einsum(equation, *(x.astype(compute, copy=False) for x in operands), optimize=True)
        return (np.asarray(y).astype(dtype, copy=False),)

    return kernel
