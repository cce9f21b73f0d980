"""MatMul and Gemm on the batched GEMM kernels of kernels/gemm.cu.

The kernels address both operands through strides, so Gemm's transposes, MatMul's 1-D operands and its
broadcast batch dimensions cost no copies. Batch dimensions that broadcast in a pattern one stride per
operand cannot describe (e.g. (2, 1) against (1, 3)) get a table of per-batch offsets, uploaded once per
input-shape pair and kept with the kernel.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np
from onnx_runtime import DataType, Tensor
from onnx_runtime.errors import InvalidArgumentError

from .context import f32, i64, ptr
from .registry import FLOATS, register

SUFFIX = {DataType.FLOAT: "f32", DataType.FLOAT16: "f16", DataType.BFLOAT16: "bf16"}
TILE = 64  # the kernels' output tile (rows and columns)
THREADS = 256
MAX_GRID_YZ = 65535  # the kernels stride over row tiles and batch entries beyond this


@dataclass(frozen=True)
class GemmGeometry:
    """One batched product: sizes, operand strides (elements) and batch addressing."""

    m: int
    n: int
    k: int
    a_strides: tuple[int, int]  # (row, reduction) strides of op(A)
    b_strides: tuple[int, int]  # (reduction, column) strides of op(B)
    batch: int = 1
    a_batch_stride: int = 0
    b_batch_stride: int = 0
    offsets: Tensor | None = None  # int64 (a_offset, b_offset) per batch entry, when strides cannot say it


def optional_ptr(tensor: Tensor | None) -> tuple[int, type]:
    """A kernel pointer argument that is null for an omitted tensor."""
    return (tensor.device_ptr if tensor is not None else 0, ctypes.c_void_p)


def gemm_function(ctx, dtype: DataType):
    return ctx.function("gemm.cu", f"gemm_{SUFFIX[DataType.parse(dtype)]}")


def launch_gemm(ctx, function, geo: GemmGeometry, a: Tensor, b: Tensor, y: Tensor, c: Tensor | None = None,
                c_strides=(0, 0), alpha: float = 1.0, beta: float = 0.0) -> None:
    """y[z] = alpha * op(A)[z] @ op(B)[z] + beta * C for every batch entry z; y is dense (batch, m, n)."""
    if geo.m == 0 or geo.n == 0 or geo.batch == 0:
        return
    grid = (-(-geo.n // TILE), min(-(-geo.m // TILE), MAX_GRID_YZ), min(geo.batch, MAX_GRID_YZ))
    ctx.launch(function, grid, THREADS,
               ptr(a), ptr(b), optional_ptr(c), ptr(y),
               i64(geo.m), i64(geo.n), i64(geo.k), i64(geo.a_strides[0]), i64(geo.a_strides[1]),
               i64(geo.b_strides[0]), i64(geo.b_strides[1]), i64(c_strides[0]), i64(c_strides[1]),
               i64(geo.batch), i64(geo.a_batch_stride), i64(geo.b_batch_stride),
               optional_ptr(geo.offsets), f32(alpha), f32(beta))


# -- MatMul ------------------------------------------------------------------------------------------


def _batch_stride(batch_shape: tuple, out_batch: tuple, matrix: int) -> int | None:
    """The batch stride of an operand whose batch dims are ``batch_shape``: dense, broadcast, or None
    when only a per-entry offset table can describe it."""
    padded = (1,) * (len(out_batch) - len(batch_shape)) + tuple(batch_shape)
    if padded == tuple(out_batch):
        return matrix
    if math.prod(batch_shape) == 1:
        return 0
    return None


def _batch_offsets(batch_shape: tuple, out_batch: tuple, matrix: int) -> np.ndarray:
    padded = (1,) * (len(out_batch) - len(batch_shape)) + tuple(batch_shape)
    entries = np.arange(math.prod(padded), dtype=np.int64).reshape(padded)
    return np.broadcast_to(entries, out_batch).reshape(-1) * matrix


class _MatMulPlan:
    """Output shape and GEMM geometry of a MatMul, per (A shape, B shape)."""

    def __init__(self, ctx, node, a_shape: tuple, b_shape: tuple):
        if not a_shape or not b_shape:
            raise InvalidArgumentError(
                f"node {node.name!r} (MatMul): operands must have at least one dimension, got shapes "
                f"{a_shape} and {b_shape}"
            )
        a2 = (1, *a_shape) if len(a_shape) == 1 else a_shape  # a 1-D A is a row vector
        b2 = (*b_shape, 1) if len(b_shape) == 1 else b_shape  # a 1-D B is a column vector
        m, k = a2[-2:]
        k_b, n = b2[-2:]
        if k != k_b:
            raise InvalidArgumentError(
                f"node {node.name!r} (MatMul): A {a_shape} and B {b_shape} do not agree on the reduced "
                f"dimension ({k} vs {k_b})"
            )
        a_batch, b_batch = a2[:-2], b2[:-2]
        try:
            out_batch = tuple(np.broadcast_shapes(a_batch, b_batch))
        except ValueError:
            raise InvalidArgumentError(
                f"node {node.name!r} (MatMul): batch dimensions of {a_shape} and {b_shape} do not broadcast"
            ) from None
        self.out_shape = out_batch + ((m,) if len(a_shape) > 1 else ()) + ((n,) if len(b_shape) > 1 else ())
        batch = math.prod(out_batch)
        if math.prod(b_batch) == 1 and math.prod(a_batch) == batch:
            # A shared B: the batch folds into A's rows, one tall product instead of many small ones.
            self.geo = GemmGeometry(batch * m, n, k, (k, 1), (n, 1))
            return
        a_bs = _batch_stride(a_batch, out_batch, m * k)
        b_bs = _batch_stride(b_batch, out_batch, k * n)
        offsets = None
        if a_bs is None or b_bs is None:
            table = np.stack([_batch_offsets(a_batch, out_batch, m * k), _batch_offsets(b_batch, out_batch, k * n)],
                             axis=1)
            offsets = Tensor.from_numpy(np.ascontiguousarray(table), provider=ctx.handle)
            a_bs = b_bs = 0
        self.geo = GemmGeometry(m, n, k, (k, 1), (n, 1), batch, a_bs, b_bs, offsets)


@register("MatMul", since=1, dtypes=FLOATS)
def matmul(node, shapes, opset, ctx):
    plans: dict[tuple, _MatMulPlan] = {}
    functions = {}

    def kernel(a, b):
        key = (a.shape, b.shape)
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = _MatMulPlan(ctx, node, a.shape, b.shape)
        function = functions.get(a.dtype)
        if function is None:
            function = functions[a.dtype] = gemm_function(ctx, a.dtype)
        y = ctx.empty(a.dtype, plan.out_shape)
        launch_gemm(ctx, function, plan.geo, a, b, y)
        return (y,)

    return kernel


# -- Gemm --------------------------------------------------------------------------------------------


def _gemm_check(node, shapes, dtypes):
    for position, shape in enumerate(shapes[:2]):
        if shape is not None and len(shape) != 2:
            return f"Gemm input {position} must be a matrix, it has rank {len(shape)}"
    if len(shapes) > 2 and shapes[2] is not None and len(shapes[2]) > 2:
        return f"Gemm input C must have rank 2 or less to broadcast to the output, it has rank {len(shapes[2])}"
    return None


def _c_strides(node, c_shape: tuple, m: int, n: int, must_match: bool) -> tuple[int, int]:
    """(row, column) strides that read C broadcast to (m, n)."""
    padded = (1,) * (2 - len(c_shape)) + tuple(c_shape)
    cm, cn = padded[-2:]
    if len(c_shape) > 2 or cm not in (1, m) or cn not in (1, n) or (must_match and padded != (m, n)):
        raise InvalidArgumentError(
            f"node {node.name!r} (Gemm): C of shape {c_shape} does not broadcast to the output ({m}, {n})"
            + ("; before opset 7 it must match unless broadcast=1" if must_match else "")
        )
    return (cn if cm > 1 else 0, 1 if cn > 1 else 0)


@register("Gemm", since=1, dtypes=FLOATS, check=_gemm_check)
def gemm(node, shapes, opset, ctx):
    alpha = float(node.attr("alpha", 1.0))
    beta = float(node.attr("beta", 1.0))
    trans_a = bool(node.attr("transA", 0))
    trans_b = bool(node.attr("transB", 0))
    c_must_match = opset < 7 and not node.attr("broadcast", 0)
    functions = {}

    def kernel(a, b, c=None):
        if len(a.shape) != 2 or len(b.shape) != 2:
            raise InvalidArgumentError(
                f"node {node.name!r} (Gemm): inputs must be matrices, got shapes {a.shape} and {b.shape}"
            )
        m, k = a.shape[::-1] if trans_a else a.shape
        k_b, n = b.shape[::-1] if trans_b else b.shape
        if k != k_b:
            raise InvalidArgumentError(
                f"node {node.name!r} (Gemm): op(A) is {m}x{k} but op(B) is {k_b}x{n}; the inner sizes must agree"
            )
        # Stored A is (k, m) under transA, so op(A)(i, l) sits at l*m + i; likewise for B.
        geo = GemmGeometry(m, n, k, (1, m) if trans_a else (k, 1), (1, k) if trans_b else (n, 1))
        use_c = c is not None and beta != 0  # as on the CPU: beta = 0 ignores C, NaNs and all
        c_strides = _c_strides(node, c.shape, m, n, c_must_match) if use_c else (0, 0)
        function = functions.get(a.dtype)
        if function is None:
            function = functions[a.dtype] = gemm_function(ctx, a.dtype)
        y = ctx.empty(a.dtype, (m, n))
        launch_gemm(ctx, function, geo, a, b, y, c if use_c else None, c_strides, alpha, beta)
        return (y,)

    return kernel
