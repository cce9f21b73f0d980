"""What the LLVM-IR intrinsics of gemm.py, gemv.py and workers.py share: the vector types they
compute in and the declaration of LLVM's own intrinsic functions in the module being built."""

from __future__ import annotations

from llvmlite import ir

LANES = 16  # float32 lanes of an AVX-512 register
F32 = ir.FloatType()
VEC = ir.VectorType(F32, LANES)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
BYTE_PTR = ir.IntType(8).as_pointer()


def declare(module, name: str, function_type):
    """The function ``name`` (an LLVM intrinsic) of ``module``, declared on first use."""
    return module.globals.get(name) or ir.Function(module, function_type, name)


def fma(module):
    """llvm.fma on 16 float32 lanes: a * b + c, rounded once."""
    return declare(module, "llvm.fma.v16f32", ir.FunctionType(VEC, [VEC, VEC, VEC]))
