"""``C += A @ B`` through numpy's own BLAS: the one matrix product np.matmul cannot do.

np.matmul always overwrites its output, so a sum of products (a convolution as one product per
kernel tap) costs a temporary and an extra pass per term. BLAS's gemm accumulates in place
(beta = 1) while each output tile is in cache. numpy's wheels bundle an ILP64 OpenBLAS whose cblas
symbols carry a ``64_`` suffix (``scipy_cblas_sgemm64_`` in numpy 2, ``cblas_sgemm64_`` before);
the library is found by name in numpy's folder (threadpoolctl's scan where numpy bundles none). Only those
suffixed symbols are used, as their integer width is known; where none is found (another BLAS,
another platform) :func:`gemm_accumulate` falls back to np.matmul and an add.

Calling numpy's library (not a second BLAS, e.g. scipy's) keeps one BLAS thread pool in the process.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

_ROW_MAJOR, _NO_TRANS = 101, 111
_SYMBOLS = {np.dtype(np.float32): "sgemm", np.dtype(np.float64): "dgemm"}
_PREFIXES = ("scipy_cblas_", "cblas_")


@functools.cache
def bundled_openblas() -> tuple[tuple[str, ctypes.CDLL], ...]:
    """The OpenBLAS libraries numpy's wheel bundles (numpy.libs or numpy/.libs) that this process has loaded,
    found by file name and opened with RTLD_NOLOAD: the library numpy calls, without threadpoolctl's scan of
    every loaded library (and its import), several ms of a fresh process. Looked up once (numpy loaded them when
    it was imported): the session's thread settings and the first product both ask."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(np.__file__)))
    found = []
    for folder in (os.path.join(root, "numpy.libs"), os.path.join(root, "numpy", ".libs")):
        try:  # (a listing, not glob: its pattern's regex compiles in every new process)
            names = sorted(name for name in os.listdir(folder) if "openblas" in name and not name.startswith("."))
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                found.append((path, ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)))
            except OSError:  # not loaded (or not a library)
                continue
    return tuple(found)


def _numpy_blas_libraries() -> list[str]:
    bundled = [path for path, _ in bundled_openblas()]
    if bundled:
        return bundled
    from threadpoolctl import threadpool_info

    numpy_root = os.path.dirname(os.path.dirname(os.path.abspath(np.__file__)))
    paths = [info["filepath"] for info in threadpool_info() if info.get("user_api") == "blas"]
    # numpy's own library (under site-packages/numpy.libs or numpy/.libs) before any other BLAS.
    return sorted(paths, key=lambda path: not os.path.abspath(path).startswith(numpy_root))


@functools.cache
def _gemm(dtype: np.dtype):
    """The ctypes function for ``dtype``'s ILP64 cblas gemm, or None."""
    scalar = ctypes.c_float if dtype == np.float32 else ctypes.c_double
    for path in _numpy_blas_libraries():
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in _PREFIXES:
            function = getattr(library, f"{prefix}{_SYMBOLS[dtype]}64_", None)
            if function is None:
                continue
            size, pointer = ctypes.c_int64, ctypes.c_void_p
            function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, size, size, size, scalar, pointer, size,
                                 pointer, size, scalar, pointer, size]
            function.restype = None
            if _works(function, dtype):
                return function
    return None


def _call(function, a: np.ndarray, b: np.ndarray, c: np.ndarray, beta: float) -> None:
    (m, k), n, item = a.shape, b.shape[1], a.itemsize
    function(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0, a.ctypes.data, a.strides[0] // item,
             b.ctypes.data, b.strides[0] // item, beta, c.ctypes.data, c.strides[0] // item)


def _works(function, dtype) -> bool:
    """A small product checked against numpy before the library is trusted."""
    a = np.arange(6, dtype=dtype).reshape(2, 3)
    b = np.arange(12, dtype=dtype).reshape(3, 4)[:, :3]  # a leading dimension larger than the width
    c = np.ones((2, 3), dtype=dtype)
    _call(function, a, b, c, 1.0)
    return bool(np.array_equal(c, a @ b + 1))


def _blas_matrix(x: np.ndarray) -> bool:
    """Row-major with unit column stride and a whole-element row stride (a leading dimension)."""
    return (x.ndim == 2 and x.strides[1] == x.itemsize and x.strides[0] % x.itemsize == 0
            and x.strides[0] >= x.shape[1] * x.itemsize)


def gemm_accumulate(a: np.ndarray, b: np.ndarray, c: np.ndarray, scratch: np.ndarray | None = None) -> None:
    """``c += a @ b`` for 2-D float32/float64 matrices of one dtype (views with row strides allowed).

    ``scratch`` (c's shape and dtype) serves the fallback's product when BLAS is not reachable."""
    function = _gemm(c.dtype) if c.dtype in _SYMBOLS else None
    if function is not None and a.dtype == b.dtype == c.dtype and all(map(_blas_matrix, (a, b, c))):
        _call(function, a, b, c, 1.0)
        return
    product = np.matmul(a, b, out=scratch) if scratch is not None else np.matmul(a, b)
    c += product


def available(dtype) -> bool:
    """Whether ``gemm_accumulate`` reaches BLAS directly for ``dtype``."""
    dtype = np.dtype(dtype)
    return dtype in _SYMBOLS and _gemm(dtype) is not None
