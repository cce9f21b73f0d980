"""8-bit codes looked up in a 256-entry byte table (QLinearConcat's requantized parts, written in place in its
output): with AVX-512 VBMI 64 codes at a time, each half of the table two registers that vpermi2b picks from by a
code's low seven bits, the code's top bit choosing the half; elsewhere a byte at a time (a scalar load per code).
"""

from __future__ import annotations

from . import host, jit
from .deferred import Loop

VBMI = host.AVX512VBMI  # code_lookup_lanes runs here (the callers choose)
BYTES = 64  # codes per vector


def _lookup_codegen(masked: bool):
    from llvmlite import ir

    from . import llvm

    byte_vec, lane_type = ir.VectorType(ir.IntType(8), BYTES), ir.VectorType(llvm.I32, BYTES)
    mask_type, align = ir.VectorType(ir.IntType(1), BYTES), ir.Constant(llvm.I32, 1)

    def codegen(context, builder, sig, args):
        def data(index):
            return context.make_array(sig.args[index])(context, builder, args[index]).data

        table, codes, out = data(0), data(1), data(2)
        source_at, target_at, count = args[3], args[4], args[5]
        module = builder.module
        quarters = [builder.load(builder.bitcast(builder.gep(table, [ir.Constant(llvm.I64, q * BYTES)]),
                                                 byte_vec.as_pointer()), align=1) for q in range(4)]
        source = builder.bitcast(builder.gep(codes, [source_at]), byte_vec.as_pointer())
        target = builder.bitcast(builder.gep(out, [target_at]), byte_vec.as_pointer())
        if masked:
            mask = builder.icmp_signed("<", ir.Constant(lane_type, list(range(BYTES))),
                                       llvm.splat(builder, builder.trunc(count, llvm.I32), lane_type))
            load = llvm.declare(module, "llvm.masked.load.v64i8.p0",
                                ir.FunctionType(byte_vec, [byte_vec.as_pointer(), llvm.I32, mask_type, byte_vec]))
            index = builder.call(load, [source, align, mask, ir.Constant(byte_vec, [0] * BYTES)])
        else:
            index = builder.load(source, align=1)
        permute = llvm.declare(module, "llvm.x86.avx512.vpermi2var.qi.512",
                               ir.FunctionType(byte_vec, [byte_vec, byte_vec, byte_vec]))
        low = builder.call(permute, [quarters[0], index, quarters[1]])  # (index bit 6 picks the second register)
        high = builder.call(permute, [quarters[2], index, quarters[3]])
        upper = builder.icmp_signed("<", index, ir.Constant(byte_vec, [0] * BYTES))  # bit 7 set: codes 128..255
        result = builder.select(upper, high, low)
        if masked:
            store = llvm.declare(module, "llvm.masked.store.v64i8.p0", ir.FunctionType(
                ir.VoidType(), [byte_vec, byte_vec.as_pointer(), llvm.I32, mask_type]))
            builder.call(store, [result, target, align, mask])
        else:
            builder.store(result, target, align=1)
        return context.get_dummy_value()

    return codegen


# The intrinsics, globals for code_lookup_lanes: made when it compiles (_define_intrinsics), so that importing this
# module imports neither numba nor llvmlite (a first run served by numpy must not load them).
_lookup_vector = _lookup_tail = None


def _define_intrinsics() -> None:
    global _lookup_vector, _lookup_tail
    if _lookup_vector is None:
        from numba import types
        from numba.extending import intrinsic

        def made(masked: bool):
            def typer(typingctx, table, codes, out, source_at, target_at, count):
                return types.void(table, codes, out, source_at, target_at, count), _lookup_codegen(masked)

            return intrinsic(typer)

        _lookup_tail = made(True)
        _lookup_vector = made(False)


def _with_intrinsics(function):
    """``jit(function)`` for a loop that calls the intrinsics: they are defined before numba compiles it."""
    standard = jit(function)
    return Loop(function, lambda _: (_define_intrinsics(), standard.dispatcher())[1])


@jit
def code_lookup_rows(table, codes, out, at):
    """out[r, at + j] = table[codes[r, j]] for 2-D uint8 ``codes`` (8-bit codes viewed as bytes), a 256-entry uint8
    ``table`` and a 2-D uint8 ``out``, a code at a time (any host)."""
    for r in range(codes.shape[0]):
        for j in range(codes.shape[1]):
            out[r, at + j] = table[codes[r, j]]


@_with_intrinsics
def code_lookup_lanes(table, codes, out, at):
    """code_lookup_rows 64 codes at a time by vpermi2b, for C-contiguous ``codes`` and ``out``: only where ``VBMI``
    (the instruction exists on no other host)."""
    rows, width = codes.shape
    source, target = codes.reshape(-1), out.reshape(-1)
    whole = width - width % BYTES
    stride = out.shape[1]
    for r in range(rows):
        for j in range(0, whole, BYTES):
            _lookup_vector(table, source, target, r * width + j, r * stride + at + j, BYTES)
        if whole < width:
            _lookup_tail(table, source, target, r * width + whole, r * stride + at + whole, width - whole)

