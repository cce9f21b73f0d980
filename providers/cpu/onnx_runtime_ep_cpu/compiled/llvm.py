"""What the LLVM-IR intrinsics of gemm.py, gemv.py, lanes.py, windows.py and workers.py share: the vector
types they compute in, the declaration of LLVM's own intrinsic functions in the module being built, the
counted loop that carries accumulators in registers, and the conv epilogue's activation on a vector."""

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


def counted_loop(builder, count, initial: list, body, name: str) -> list:
    """Emit ``for k in range(count)`` carrying the values ``initial`` through ``body(k, values) -> new
    values`` in phi nodes (registers, where a loop over memory would spill them); returns the values
    after the loop (``initial`` when count <= 0), with the builder placed after it."""
    zero = ir.Constant(I64, 0)
    entry = builder.block
    loop = builder.append_basic_block(f"{name}.loop")
    done = builder.append_basic_block(f"{name}.done")
    builder.cbranch(builder.icmp_signed(">", count, zero), loop, done)
    builder.position_at_end(loop)
    k = builder.phi(I64)
    k.add_incoming(zero, entry)
    carried = []
    for value in initial:
        phi = builder.phi(value.type)
        phi.add_incoming(value, entry)
        carried.append(phi)
    updated = body(k, carried)
    following = builder.add(k, ir.Constant(I64, 1))
    tail = builder.block
    k.add_incoming(following, tail)
    for phi, value in zip(carried, updated):
        phi.add_incoming(value, tail)
    builder.cbranch(builder.icmp_signed("<", following, count), loop, done)
    builder.position_at_end(done)
    return merged(builder, (initial, entry), (updated, tail))


def merged(builder, first: tuple, second: tuple) -> list:
    """Where two paths join: per value, a phi of (values, block) ``first`` and ``second``."""
    (values_a, block_a), (values_b, block_b) = first, second
    phis = []
    for a, b in zip(values_a, values_b):
        phi = builder.phi(a.type)
        phi.add_incoming(a, block_a)
        phi.add_incoming(b, block_b)
        phis.append(phi)
    return phis


MASK = ir.VectorType(ir.IntType(1), LANES)  # a lane mask
LANE_INDEX = ir.VectorType(I32, LANES)  # 32-bit integers per lane
LANE_NUMBERS = ir.Constant(LANE_INDEX, list(range(LANES)))  # 0 .. 15: each lane's own number
ZEROS = ir.Constant(VEC, [0.0] * LANES)
ALIGN = ir.Constant(I32, 4)  # the alignment masked loads and stores may assume: a float's


def masked_load(module):
    """llvm.masked.load on 16 float32 lanes: (pointer, alignment, mask, passthru); lanes off the mask
    are not read (they may lie outside the array) and take passthru's value."""
    return declare(module, "llvm.masked.load.v16f32.p0",
                   ir.FunctionType(VEC, [VEC.as_pointer(), I32, MASK, VEC]))


def masked_store(module):
    """llvm.masked.store on 16 float32 lanes: (value, pointer, alignment, mask); lanes off the mask are
    not written."""
    return declare(module, "llvm.masked.store.v16f32.p0",
                   ir.FunctionType(ir.VoidType(), [VEC, VEC.as_pointer(), I32, MASK]))


def splat(builder, scalar, vector_type=VEC):
    """``scalar`` in every lane of a vector of ``vector_type``."""
    undef = ir.Constant(vector_type, ir.Undefined)
    first = builder.insert_element(undef, scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(first, undef, ir.Constant(ir.VectorType(I32, vector_type.count),
                                                            [0] * vector_type.count))


def activated(builder, v, bounds):
    """compiled/epilogue.py's activate on a vector: v*slope below zero, then max with low, then min with
    high (``bounds``: those three, splat); comparisons with NaN are false, so NaN passes through."""
    low, high, slope = bounds
    v = builder.select(builder.fcmp_ordered("<", v, ZEROS), builder.fmul(v, slope), v)
    v = builder.select(builder.fcmp_ordered("<", v, low), low, v)
    return builder.select(builder.fcmp_ordered(">", v, high), high, v)
