"""The arithmetic of the normalizations: per-channel affine passes (one compiled pass with the activation
for float32/float64, channels split across the helper threads), standardization over axes or rows (BLAS
for the sums), and LRN's denominator by its compiled loop.
"""

from __future__ import annotations

import math

import numpy as np

from ..compiled import takes as takes_compiled
from ..threads import helper_count


def affine_params(mean, var, scale, bias, epsilon, dtype):
    """The factor and shift that turn scale * (x - mean) / sqrt(var + epsilon) + bias into one
    multiply-add over x."""
    factor = scale / np.sqrt(var + dtype.type(epsilon))
    return factor, bias - mean * factor


def affine_normalize(x, mean, var, scale, bias, epsilon, dtype):
    factor, shift = affine_params(mean, var, scale, bias, epsilon, dtype)
    return x.astype(dtype, copy=False) * factor + shift


def per_channel_affine(x: np.ndarray, factor: np.ndarray, shift: np.ndarray, dtype) -> np.ndarray:
    """x * factor + shift for (C,) parameters, over x viewed as (N, C, pixels): two passes
    without temporaries, each broadcasting a channel's value along its contiguous pixels."""
    n, c = x.shape[:2]
    y = np.multiply(x.astype(dtype, copy=False).reshape(n, c, math.prod(x.shape[2:])), factor.reshape(c, 1))
    y += shift.reshape(c, 1)
    return y.reshape(x.shape)


def batch_norm_stats(x, axes, mean, var, momentum, dtype):
    """Batch mean/variance and the running statistics updated with them (training mode)."""
    xc = x.astype(dtype, copy=False)
    batch_mean = xc.mean(axis=axes, keepdims=True)
    batch_var = xc.var(axis=axes, keepdims=True)
    running_mean = mean * momentum + batch_mean.reshape(mean.shape) * (1 - momentum)
    running_var = var * momentum + batch_var.reshape(var.shape) * (1 - momentum)
    return batch_mean, batch_var, running_mean, running_var


def channel_affine_loop(code):
    """``affine(x, factor, shift)``: x * factor + shift for (C,) parameters, then the activation
    ``code`` = (kind, params), in one compiled pass (float32/float64 ``x``; numba loads on the first call)."""
    kind, params = code
    arguments = {np.dtype(t): np.array(params, dtype=t) for t in (np.float32, np.float64)}

    def affine(x, factor, shift):
        from ..compiled import epilogue
        from .split import thread_spans  # (BatchNormalization's alone: LayerNormalization's models skip split.py)

        n, c = x.shape[:2]
        rows = np.ascontiguousarray(x).reshape(n, c, math.prod(x.shape[2:]))
        y = np.empty_like(rows)
        factor = np.ascontiguousarray(factor, dtype=x.dtype)
        shift = np.ascontiguousarray(shift, dtype=x.dtype)
        spans = thread_spans(c, x.size, x.dtype) if n == 1 else None  # one image: its channels are contiguous
        if spans is None:
            epilogue.channel_affine(rows, factor, shift, y, kind, arguments[x.dtype])
        else:
            from ..compiled import jobs, workers

            workers.run(jobs.AFFINE, [(rows[:, a:b], factor[a:b], shift[a:b], y[:, a:b], kind, arguments[x.dtype])
                                      for a, b in spans], helper_count())
        return y.reshape(x.shape)

    def bind(x, factor, shift, y):
        """``[(loop, arguments)]``: affine's one pass from x into y (C-contiguous buffers of one float dtype), for a
        segment's bound plan (algorithms/segment_steps.py)."""
        from ..compiled import epilogue

        n, c = x.shape[:2]
        rows = (n, c, math.prod(x.shape[2:]))
        return [(epilogue.channel_affine, (x.reshape(rows), np.ascontiguousarray(factor, dtype=x.dtype),
                                           np.ascontiguousarray(shift, dtype=x.dtype), y.reshape(rows), kind,
                                           arguments[x.dtype]))]

    affine.bind = bind
    return affine


def standardize(x: np.ndarray, axes, epsilon: float):
    """(x - mean) * inv_std over ``axes`` (computed in x's dtype), with the mean and inv_std."""
    mean = x.mean(axis=axes, keepdims=True)
    centered = x - mean
    var = np.square(centered).mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(var + x.dtype.type(epsilon))
    return centered * inv_std, mean, inv_std


def broadcasts_into(shape: tuple, target: tuple) -> bool:
    """Whether an operand of ``shape`` broadcasts onto ``target`` without growing it (in-place safe)."""
    return len(shape) <= len(target) and all(d in (1, t) for d, t in zip(reversed(shape), reversed(target)))


def row_sums(rows: np.ndarray) -> np.ndarray:
    """Sums of a 2-D array's rows as a column: a BLAS matrix-vector product, several times faster than
    numpy's reduction over short contiguous rows."""
    return rows @ np.ones((rows.shape[1], 1), dtype=rows.dtype)


def standardize_rows(rows: np.ndarray, epsilon: float):
    """:func:`standardize` over the rows of a 2-D float32/float64 array, in place on one fresh array:
    BLAS for the sums, no squared temporary."""
    count = rows.shape[1]
    mean = row_sums(rows)
    mean /= count
    centered = np.subtract(rows, mean)
    var = np.einsum("ij,ij->i", centered, centered)[:, None]
    var /= count
    var += rows.dtype.type(epsilon)
    inv_std = np.reciprocal(np.sqrt(var, out=var), out=var)
    centered *= inv_std
    return centered, mean, inv_std


def layer_norm_compiles(x, scale, bias, start: int, stash) -> bool:
    """Whether the compiled loop takes this LayerNormalization: statistics in x's own float32/float64,
    and scale and bias (if any) of x's dtype covering the normalized axes exactly (no broadcasting)."""
    if x.dtype != stash or not x.size or not takes_compiled(x):
        return False
    params = (scale,) if bias is None else (scale, bias)
    return all(p.dtype == x.dtype and p.shape == x.shape[start:] for p in params)


def lrn_compiled(loops, x: np.ndarray, size: int, before: int, alpha: float, beta: float, bias: float) -> np.ndarray:
    """LRN with the denominator base from the compiled loop (the same bits as the numpy path:
    the scale and bias are rounded to x's dtype as numpy rounds Python floats), then numpy's
    vectorized power and division in place."""
    x3 = np.ascontiguousarray(x).reshape(x.shape[0], x.shape[1], -1)
    y = np.empty_like(x3)
    loops.lrn_base(x3, y, size, before, x.dtype.type(alpha / size), x.dtype.type(bias))
    np.power(y, beta, out=y)
    np.divide(x3, y, out=y)
    return y.reshape(x.shape)
