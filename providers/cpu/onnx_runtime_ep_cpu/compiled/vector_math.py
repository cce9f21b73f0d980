"""transformer.py's float32 exp and logistic sigmoid written on 16 LLVM lanes, for the intrinsics that compute them
over whole vectors: attention_lanes.py's softmax, and sigmoid_lanes, the loop of segment_loops.py's and silu.py's SiLU
and Sigmoid.

numba vectorizes exp_float32.sigmoid_float32 itself, but LLVM's tuning for AVX-512 server CPUs prefers 256-bit
vectors, so those loops ran 8 lanes at a time (a SiLU pass over 401,408 values 338-349 us, onnxruntime's 235-256;
on 16 lanes 222-238). Making numba prefer 512-bit vectors everywhere instead (NUMBA_CPU_FEATURES without
prefer-256-bit) did as much for the SiLU but slowed a GPT-2 int8 decode step by a fifth. exp_nonpositive's
operations are transformer.py's, each rounded (no contraction into fused multiply-adds), so a lane computes what
the scalar formula does without fastmath. The sigmoid fuses its exp's multiply-adds and takes its quotient from a
refined reciprocal estimate (on AVX-512): a division per vector bound its loops, and the sigmoid's values stay
within a few ulp of float64.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import host, jit, llvm
from .exp_float32 import EXP_C2, EXP_C3, EXP_C4, EXP_C5, EXP_C6, EXP_FLOOR, LN2_HIGH, LN2_LOW, LOG2E, ROUNDER


def constant(value) -> ir.Constant:
    """``value`` as float32 in every lane."""
    return ir.Constant(llvm.VEC, [float(np.float32(value))] * llvm.LANES)


def exp_nonpositive(builder, a, fused: bool = False):
    """exp_float32.exp_nonpositive_float32 on 16 lanes (NaN stays NaN, 0 below its floor): each operation rounded,
    or with ``fused`` each multiply-add one fused multiply-add (one rounding: as exp_float32.sigmoid_float32,
    compiled with contraction, may round; the sigmoid's)."""
    fma = llvm.fma(builder.module)

    def mul_add(x, y, z):  # x * y + z
        return builder.call(fma, [x, y, z]) if fused else builder.fadd(builder.fmul(x, y), z)

    def sub_mul(z, x, y):  # z - x * y
        return builder.call(fma, [builder.fsub(llvm.ZEROS, x), y, z]) if fused else builder.fsub(z, builder.fmul(x, y))

    floor = constant(EXP_FLOOR)
    below = builder.fcmp_ordered("<", a, floor)
    clamped = builder.select(below, floor, a)
    rounder = constant(ROUNDER)
    n = builder.fsub(mul_add(clamped, constant(LOG2E), rounder), rounder)
    r = sub_mul(sub_mul(clamped, n, constant(LN2_HIGH)), n, constant(LN2_LOW))
    p = constant(EXP_C6)
    for coefficient in (EXP_C5, EXP_C4, EXP_C3, EXP_C2):
        p = mul_add(p, r, constant(coefficient))
    p = builder.fadd(mul_add(p, builder.fmul(r, r), r), constant(1.0))
    exponent = builder.add(builder.fptosi(n, llvm.LANE_INDEX), ir.Constant(llvm.LANE_INDEX, [127] * llvm.LANES))
    two_to_n = builder.bitcast(builder.shl(exponent, ir.Constant(llvm.LANE_INDEX, [23] * llvm.LANES)), llvm.VEC)
    return builder.select(below, llvm.ZEROS, builder.fmul(p, two_to_n))


def _reciprocal(builder, d):
    """1 / d for d in [1, 2] (or NaN): on AVX-512 the 14-bit estimate (vrcp14ps) and one Newton step, within an
    ulp of the quotient, where a division's throughput bound the sigmoid loops; a division elsewhere."""
    if not host.AVX512:
        return builder.fdiv(constant(1.0), d)
    estimate = llvm.declare(builder.module, "llvm.x86.avx512.rcp14.ps.512",
                            ir.FunctionType(llvm.VEC, [llvm.VEC, llvm.VEC, ir.IntType(16)]))
    fma = llvm.fma(builder.module)
    r = builder.call(estimate, [d, llvm.ZEROS, ir.Constant(ir.IntType(16), -1)])
    error = builder.call(fma, [builder.fsub(llvm.ZEROS, d), r, constant(1.0)])
    return builder.call(fma, [r, error, r])


def sigmoid(builder, z):
    """The logistic sigmoid on 16 lanes, as exp_float32.sigmoid_float32: e / (1 + e) for e = exp(-|z|) where z < 0,
    else 1 / (1 + e); the exp's multiply-adds fused and the quotient a refined reciprocal's (_reciprocal): within
    a few ulp of the float64 sigmoid, exactly 0.5 at 0, 0 and 1 at the infinities, NaN for NaN."""
    fabs = llvm.declare(builder.module, "llvm.fabs.v16f32", ir.FunctionType(llvm.VEC, [llvm.VEC]))
    e = exp_nonpositive(builder, builder.fsub(llvm.ZEROS, builder.call(fabs, [z])), fused=True)
    one = constant(1.0)
    top = builder.select(builder.fcmp_ordered(">=", z, llvm.ZEROS), one, e)
    return builder.fmul(top, _reciprocal(builder, builder.fadd(one, e)))


def _sigmoid_codegen(masked: bool):
    def codegen(context, builder, sig, args):
        def data(index):
            return context.make_array(sig.args[index])(context, builder, args[index]).data

        x_ptr, y_ptr = data(0), data(1)
        at, count, alpha, swish = args[2], args[3], args[4], args[5]
        source = builder.bitcast(builder.gep(x_ptr, [at]), llvm.VEC.as_pointer())
        target = builder.bitcast(builder.gep(y_ptr, [at]), llvm.VEC.as_pointer())
        if masked:
            mask = builder.icmp_signed("<", llvm.LANE_NUMBERS,
                                       llvm.splat(builder, builder.trunc(count, llvm.I32), llvm.LANE_INDEX))
            v = builder.call(llvm.masked_load(builder.module), [source, llvm.ALIGN, mask, llvm.ZEROS])
        else:
            v = builder.load(source, align=4)
        gate = sigmoid(builder, builder.fmul(v, llvm.splat(builder, alpha)))
        flag = builder.icmp_signed("!=", swish, ir.Constant(swish.type, 0))
        result = builder.select(flag, builder.fmul(v, gate), gate)
        if masked:
            builder.call(llvm.masked_store(builder.module), [result, target, llvm.ALIGN, mask])
        else:
            builder.store(result, target, align=4)
        return context.get_dummy_value()

    return codegen


@intrinsic
def _sigmoid_vector(typingctx, x, y, at, count, alpha, times_x):
    return types.void(x, y, at, count, alpha, times_x), _sigmoid_codegen(False)


@intrinsic
def _sigmoid_tail(typingctx, x, y, at, count, alpha, times_x):
    return types.void(x, y, at, count, alpha, times_x), _sigmoid_codegen(True)


@jit
def sigmoid_lanes(x, y, alpha, times_x):
    """y = sigmoid(alpha * x), times x where ``times_x`` (SiLU, Swish), over flat float32 arrays of one size (y may be
    x), ``alpha`` float32: whole vectors of 16 lanes, then the tail's lanes masked (nothing past it is read or
    written)."""
    size = x.shape[0]
    whole = size - size % llvm.LANES
    for i in range(0, whole, llvm.LANES):
        _sigmoid_vector(x, y, i, llvm.LANES, alpha, times_x)
    if whole < size:
        _sigmoid_tail(x, y, whole, size - whole, alpha, times_x)
