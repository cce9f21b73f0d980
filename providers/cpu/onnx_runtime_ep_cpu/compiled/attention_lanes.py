"""Small float32 attention (a short sequence's few query rows over few keys, head sizes of 16 to 64) in 16-lane
vectors written as LLVM IR: the few-row loop of attention.py with its per-key and per-column steps across lanes.

numba runs LLVM's loop vectorizer but not its SLP vectorizer, and the loop vectorizer wants several whole
vectors' worth of iterations before its vector body runs: over 16-64 keys or value columns it leaves a loop to
the scalar remainder. Here each step is one vector per 16 keys (or columns), the keys' tail and the padding
masked, so a head of 16 keys is one vector per query component. Per (batch, head): K^T is packed once into
rows of keys padded to whole vectors; per query row, the scores are a sum of query-weighted K^T rows, then the
bias, the row's maximum, exp (attention.py's polynomial) with the weights' sum, and Y's row as a sum of
weighted V rows times the sum's reciprocal. The same sums as attention.py's loop, in another order.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import jit, llvm
from .vector_math import constant, exp_nonpositive

LANES = llvm.LANES
_VEC_PTR = llvm.VEC.as_pointer()


def _pointer(context, builder, sig, args, index):
    return context.make_array(sig.args[index])(context, builder, args[index]).data


def _vector_at(builder, base, offset):
    return builder.bitcast(builder.gep(base, [offset]), _VEC_PTR)


def _lanes_below(builder, count):
    """The mask of lanes whose number is below ``count`` (an i64; all lanes for 16 or more)."""
    limit = builder.trunc(builder.select(builder.icmp_signed(">", count, ir.Constant(llvm.I64, LANES)),
                                         ir.Constant(llvm.I64, LANES), count), llvm.I32)
    return builder.icmp_signed("<", llvm.LANE_NUMBERS, llvm.splat(builder, limit, llvm.LANE_INDEX))


def _tree(builder, vector, combine):
    """The lanes of ``vector`` combined pairwise (a tree: four steps deep, where a chain is fifteen)."""
    values = [builder.extract_element(vector, ir.Constant(llvm.I32, lane)) for lane in range(LANES)]
    while len(values) > 1:
        values = [combine(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


ROWS = 4  # query rows computed together: independent multiply-add chains sharing each load of K^T or V


@intrinsic
def _scores_rows(typingctx, packed, padded, size, q, q_step, scale, scores):
    """scores[i * padded + c * 16 + lane] = sum over d < size of (q[i * q_step + d] * scale) * packed[d * padded +
    c * 16 + lane] for the ROWS query rows i and every block c of padded / 16 keys (float32): blocks in pairs,
    per query component one load of K^T per block and ROWS 16-lane multiply-adds each, one chain per row and
    block (2 x ROWS chains: a pair hides the multiply-add's latency that one block's ROWS chains leave
    exposed, and shares each scaled query component), then an odd last block alone."""
    signature = types.void(packed, padded, size, q, q_step, scale, scores)

    def codegen(context, builder, sig, args):
        packed_ptr, q_ptr, scores_ptr = (_pointer(context, builder, sig, args, i) for i in (0, 3, 6))
        padded, size, q_step, scale = args[1], args[2], args[4], args[5]
        fma = llvm.fma(builder.module)
        blocks = builder.sdiv(padded, ir.Constant(llvm.I64, LANES))

        def run(first_blocks):
            """The blocks starting at keys ``first_blocks`` (one or two), summed over the components."""
            def component(d, carried):
                keys = [builder.load(_vector_at(builder, packed_ptr, builder.add(builder.mul(d, padded), first)),
                                     align=4) for first in first_blocks]
                sums = []
                for i in range(ROWS):
                    at = builder.add(builder.mul(q_step, ir.Constant(llvm.I64, i)), d)
                    weight = llvm.splat(builder, builder.fmul(builder.load(builder.gep(q_ptr, [at])), scale))
                    sums += [builder.call(fma, [weight, block, carried[len(sums) + j]])
                             for j, block in enumerate(keys)]
                return sums

            totals = llvm.counted_loop(builder, size, [llvm.ZEROS] * (ROWS * len(first_blocks)), component,
                                       "component")
            for i in range(ROWS):
                for j, first in enumerate(first_blocks):
                    at = builder.add(builder.mul(padded, ir.Constant(llvm.I64, i)), first)
                    builder.store(totals[i * len(first_blocks) + j], _vector_at(builder, scores_ptr, at), align=4)

        def pair(c, _):
            first = builder.mul(c, ir.Constant(llvm.I64, 2 * LANES))
            run((first, builder.add(first, ir.Constant(llvm.I64, LANES))))
            return []

        pairs = builder.sdiv(blocks, ir.Constant(llvm.I64, 2))
        llvm.counted_loop(builder, pairs, [], pair, "pair")

        def last(c, _):
            run((builder.mul(builder.add(c, builder.mul(pairs, ir.Constant(llvm.I64, 2))),
                             ir.Constant(llvm.I64, LANES)),))
            return []

        llvm.counted_loop(builder, builder.sub(blocks, builder.mul(pairs, ir.Constant(llvm.I64, 2))), [], last,
                          "last")
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _biased_peak(typingctx, scores, padded, bias, keys):
    """scores[t] += bias[t] for t < keys, -inf for the padding keys .. padded; returns the row's largest
    non-NaN score (-inf if none). ``bias`` has ``keys`` floats (it is not read past them)."""
    signature = types.float32(scores, padded, bias, keys)

    def codegen(context, builder, sig, args):
        scores_ptr, bias_ptr = _pointer(context, builder, sig, args, 0), _pointer(context, builder, sig, args, 2)
        padded, keys = args[1], args[3]
        masked_load = llvm.masked_load(builder.module)
        lowest = constant(-np.inf)
        blocks = builder.sdiv(padded, ir.Constant(llvm.I64, LANES))

        def block(c, carried):
            first = builder.mul(c, ir.Constant(llvm.I64, LANES))
            visible = _lanes_below(builder, builder.sub(keys, first))
            at = _vector_at(builder, scores_ptr, first)
            added = builder.call(masked_load, [_vector_at(builder, bias_ptr, first), llvm.ALIGN, visible,
                                               llvm.ZEROS])
            row = builder.select(visible, builder.fadd(builder.load(at, align=4), added), lowest)
            builder.store(row, at, align=4)
            return [builder.select(builder.fcmp_ordered(">", row, carried[0]), row, carried[0])]

        peaks, = llvm.counted_loop(builder, blocks, [lowest], block, "peak")
        return _tree(builder, peaks, lambda a, b: builder.select(builder.fcmp_ordered(">", b, a), b, a))

    return signature, codegen


def _halves_tree(builder, vector, combine):
    """_tree's result (the same pairs combined in the same order) in vectors: each step combines the even lanes
    with the odd ones, four shuffles and four combines where _tree extracts all sixteen lanes."""
    count = LANES
    while count > 1:
        count //= 2
        even = builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(llvm.I32, count),
                                                                  list(range(0, 2 * count, 2))))
        odd = builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(llvm.I32, count),
                                                                 list(range(1, 2 * count, 2))))
        vector = combine(even, odd)
    return builder.extract_element(vector, ir.Constant(llvm.I32, 0))


@intrinsic
def _exp_sum(typingctx, scores, padded, peak):
    """scores = exp(scores - peak) in place (padding keys at -inf become 0); returns their sum."""
    signature = types.float32(scores, padded, peak)

    def codegen(context, builder, sig, args):
        scores_ptr, padded, peak = _pointer(context, builder, sig, args, 0), args[1], args[2]
        shift = llvm.splat(builder, peak)
        blocks = builder.sdiv(padded, ir.Constant(llvm.I64, LANES))

        def block(c, carried):
            at = _vector_at(builder, scores_ptr, builder.mul(c, ir.Constant(llvm.I64, LANES)))
            weights = exp_nonpositive(builder, builder.fsub(builder.load(at, align=4), shift))
            builder.store(weights, at, align=4)
            return [builder.fadd(carried[0], weights)]

        sums, = llvm.counted_loop(builder, blocks, [llvm.ZEROS], block, "exp")
        return _tree(builder, sums, builder.fadd)

    return signature, codegen


def _group_softmax_codegen(biased: bool):
    """_group_softmax's body, with the bias rows added (``biased``) or not read at all."""
    def codegen(context, builder, sig, args):
        scores_ptr, bias_ptr, reciprocals_ptr = (_pointer(context, builder, sig, args, i) for i in (0, 3, 5))
        padded, keys, bias_step = args[1], args[2], args[4]
        masked_load = llvm.masked_load(builder.module)
        lowest = constant(-np.inf)
        blocks = builder.sdiv(padded, ir.Constant(llvm.I64, LANES))

        def row_at(i, first):
            return _vector_at(builder, scores_ptr, builder.add(builder.mul(padded, ir.Constant(llvm.I64, i)), first))

        def peak_block(c, carried):
            first = builder.mul(c, ir.Constant(llvm.I64, LANES))
            visible = _lanes_below(builder, builder.sub(keys, first))
            peaks = []
            for i in range(ROWS):
                at = row_at(i, first)
                row = builder.load(at, align=4)
                if biased:
                    bias_at = builder.add(builder.mul(bias_step, ir.Constant(llvm.I64, i)), first)
                    row = builder.fadd(row, builder.call(masked_load, [_vector_at(builder, bias_ptr, bias_at),
                                                                       llvm.ALIGN, visible, llvm.ZEROS]))
                row = builder.select(visible, row, lowest)
                builder.store(row, at, align=4)
                peaks.append(builder.select(builder.fcmp_ordered(">", row, carried[i]), row, carried[i]))
            return peaks

        peaks = llvm.counted_loop(builder, blocks, [lowest] * ROWS, peak_block, "peak")
        peaks = [_halves_tree(builder, p, lambda a, b: builder.select(builder.fcmp_ordered(">", b, a), b, a))
                 for p in peaks]
        infinity = ir.Constant(llvm.F32, float("inf"))
        fabs = llvm.declare(builder.module, "llvm.fabs.f32", ir.FunctionType(llvm.F32, [llvm.F32]))
        finite = [builder.fcmp_ordered("<", builder.call(fabs, [p]), infinity) for p in peaks]
        every = finite[0]
        for f in finite[1:]:
            every = builder.and_(every, f)
        with builder.if_then(every):
            shifts = [llvm.splat(builder, p) for p in peaks]

            def exp_block(c, carried):
                first = builder.mul(c, ir.Constant(llvm.I64, LANES))
                sums = []
                for i in range(ROWS):
                    at = row_at(i, first)
                    weights = exp_nonpositive(builder, builder.fsub(builder.load(at, align=4), shifts[i]))
                    builder.store(weights, at, align=4)
                    sums.append(builder.fadd(carried[i], weights))
                return sums

            sums = llvm.counted_loop(builder, blocks, [llvm.ZEROS] * ROWS, exp_block, "exp")
            one = ir.Constant(llvm.F32, 1.0)
            for i in range(ROWS):
                builder.store(builder.fdiv(one, _halves_tree(builder, sums[i], builder.fadd)),
                              builder.gep(reciprocals_ptr, [ir.Constant(llvm.I64, i)]))
        return every

    return codegen


@intrinsic
def _group_softmax(typingctx, scores, padded, keys, bias, bias_step, reciprocals):
    """_softmax_rows for a whole group of ROWS rows, the rows interleaved: scores[i * padded + t] += bias[i *
    bias_step + t] for t < keys (bias: the first row's), -inf for the padding keys; then, where every row's
    largest score is finite, the rows' unnormalized weights in place and the reciprocals of their sums. Returns
    whether every largest score was finite. The same values as _softmax_rows's, summed in the same order."""
    return types.boolean(scores, padded, keys, bias, bias_step, reciprocals), _group_softmax_codegen(True)


@intrinsic
def _group_softmax_unbiased(typingctx, scores, padded, keys, reciprocals):
    """_group_softmax without a bias (nothing added, no bias row read)."""
    def codegen(context, builder, sig, args):
        scores_v, padded_v, keys_v, reciprocals_v = args
        types_ = sig.args
        inner = types.boolean(types_[0], types_[1], types_[2], types_[0], types_[1], types_[3])
        return _group_softmax_codegen(False)(context, builder, inner,
                                             [scores_v, padded_v, keys_v, scores_v, padded_v, reciprocals_v])

    return types.boolean(scores, padded, keys, reciprocals), codegen


@intrinsic
def _weighted_rows(typingctx, weights, padded, keys, v, v_stride, value_size, y, y_step, reciprocals):
    """y[i * y_step + j] = reciprocals[i] * sum over t < keys of weights[i * padded + t] * v[t * v_stride + j] for
    the ROWS rows i and j < value_size, 16 columns at a time (the last block masked: nothing is read or written
    past value_size): per key one load of V per block and ROWS multiply-adds each, one chain per row and block.
    Blocks go in pairs (2 x ROWS chains, each key's weights loaded once for both), an odd last block alone. (Two
    chains per row over a single block's even and odd keys measured slower: 16 keys 5.1 -> 5.4 us.)"""
    signature = types.void(weights, padded, keys, v, v_stride, value_size, y, y_step, reciprocals)

    def codegen(context, builder, sig, args):
        weights_ptr, v_ptr, y_ptr, reciprocals_ptr = (_pointer(context, builder, sig, args, i) for i in (0, 3, 6, 8))
        padded, keys, v_stride, value_size, y_step = args[1], args[2], args[4], args[5], args[7]
        fma, masked_load, masked_store = (f(builder.module) for f in (llvm.fma, llvm.masked_load, llvm.masked_store))
        blocks = builder.sdiv(builder.add(value_size, ir.Constant(llvm.I64, LANES - 1)),
                              ir.Constant(llvm.I64, LANES))
        two = ir.Constant(llvm.I64, 2)

        def accumulate(t, firsts, columns, carried):
            """carried[i * len(firsts) + j] plus key t's weight of row i times V's block j (columns: its mask)."""
            rows = [builder.call(masked_load, [_vector_at(builder, v_ptr, builder.add(builder.mul(t, v_stride), first)),
                                               llvm.ALIGN, mask, llvm.ZEROS]) for first, mask in zip(firsts, columns)]
            sums = []
            for i in range(ROWS):
                at = builder.add(builder.mul(padded, ir.Constant(llvm.I64, i)), t)
                weight = llvm.splat(builder, builder.load(builder.gep(weights_ptr, [at])))
                sums += [builder.call(fma, [weight, row, carried[i * len(firsts) + j]])
                         for j, row in enumerate(rows)]
            return sums

        def store(totals, firsts, columns):
            for i in range(ROWS):
                reciprocal = builder.load(builder.gep(reciprocals_ptr, [ir.Constant(llvm.I64, i)]))
                reciprocal = llvm.splat(builder, reciprocal)
                for j, (first, mask) in enumerate(zip(firsts, columns)):
                    at = builder.add(builder.mul(y_step, ir.Constant(llvm.I64, i)), first)
                    builder.call(masked_store, [builder.fmul(totals[i * len(firsts) + j], reciprocal),
                                                _vector_at(builder, y_ptr, at), llvm.ALIGN, mask])

        def block_mask(first):
            return _lanes_below(builder, builder.sub(value_size, first))

        def pair(c, _):
            first = builder.mul(c, ir.Constant(llvm.I64, 2 * LANES))
            firsts = (first, builder.add(first, ir.Constant(llvm.I64, LANES)))
            columns = [block_mask(f) for f in firsts]
            totals = llvm.counted_loop(builder, keys, [llvm.ZEROS] * (2 * ROWS),
                                       lambda t, carried: accumulate(t, firsts, columns, carried), "key")
            store(totals, firsts, columns)
            return []

        pairs = builder.sdiv(blocks, two)
        llvm.counted_loop(builder, pairs, [], pair, "pairs")

        def last(c, _):
            firsts = (builder.mul(builder.add(c, builder.mul(pairs, two)), ir.Constant(llvm.I64, LANES)),)
            columns = [block_mask(firsts[0])]
            totals = llvm.counted_loop(builder, keys, [llvm.ZEROS] * ROWS,
                                       lambda t, carried: accumulate(t, firsts, columns, carried), "key")
            store(totals, firsts, columns)
            return []

        llvm.counted_loop(builder, builder.sub(blocks, builder.mul(pairs, two)), [], last, "last")
        return context.get_dummy_value()

    return signature, codegen


def scratch_size(head_size: int, keys: int) -> int:
    """Floats few_rows_in_lanes needs: K^T packed in rows of whole vectors, ROWS scores rows, ROWS zero query
    and output rows (the padding of a last group of rows), a zero bias row."""
    padded = -(-keys // LANES) * LANES
    return head_size * padded + ROWS * padded + ROWS * head_size + keys


def _transposed(builder, rows):
    """The 16 x 16 block ``rows`` (16 vectors) transposed, in four perfect-shuffle steps: rows i and i + 8
    interleaved into rows 2i and 2i + 1 rotates each element's (row, lane) bits left by one, so four steps
    swap them (64 two-vector shuffles, where a scalar copy moves each element alone)."""
    low = ir.Constant(llvm.LANE_INDEX, [j // 2 + (LANES if j % 2 else 0) for j in range(LANES)])
    high = ir.Constant(llvm.LANE_INDEX, [LANES // 2 + j // 2 + (LANES if j % 2 else 0) for j in range(LANES)])
    for _ in range(4):
        half = LANES // 2
        shuffled = []
        for i in range(half):
            shuffled += [builder.shuffle_vector(rows[i], rows[i + half], low),
                         builder.shuffle_vector(rows[i], rows[i + half], high)]
        rows = shuffled
    return rows


@intrinsic
def _pack_block(typingctx, k, first, key_step, keys, components, packed, at, padded):
    """packed[(at + j * padded) + i] = k[first + i * key_step + j] for i < 16 and j < components (at most 16):
    a block of 16 keys' first ``components`` components transposed, keys from ``keys`` on (fewer than 16 left)
    as zeros; rows of packed from ``components`` on are not written."""
    signature = types.void(k, first, key_step, keys, components, packed, at, padded)

    def codegen(context, builder, sig, args):
        k_ptr, packed_ptr = _pointer(context, builder, sig, args, 0), _pointer(context, builder, sig, args, 5)
        first, key_step, keys, components, at, padded = args[1], args[2], args[3], args[4], args[6], args[7]
        masked_load, masked_store = llvm.masked_load(builder.module), llvm.masked_store(builder.module)
        columns = _lanes_below(builder, components)
        nothing = ir.Constant(ir.VectorType(ir.IntType(1), LANES), [0] * LANES)
        rows = []
        for i in range(LANES):
            present = builder.icmp_signed(">", keys, ir.Constant(llvm.I64, i))
            offset = builder.add(first, builder.mul(key_step, ir.Constant(llvm.I64, i)))
            rows.append(builder.call(masked_load, [_vector_at(builder, k_ptr, offset), llvm.ALIGN,
                                                   builder.select(present, columns, nothing), llvm.ZEROS]))
        everything = ir.Constant(ir.VectorType(ir.IntType(1), LANES), [1] * LANES)
        for j, row in enumerate(_transposed(builder, rows)):
            wanted = builder.icmp_signed(">", components, ir.Constant(llvm.I64, j))
            target = _vector_at(builder, packed_ptr, builder.add(at, builder.mul(padded, ir.Constant(llvm.I64, j))))
            builder.call(masked_store, [row, target, llvm.ALIGN, builder.select(wanted, everything, nothing)])
        return context.get_dummy_value()

    return signature, codegen


@jit
def _pack_keys(k, first, key_step, keys, size, packed, padded):
    """K^T of one KV head, key t's components at k[first + t * key_step:][:size] (flat k), into rows of ``padded``
    keys (packed[d * padded + t]), zeros after the keys: blocks of 16 keys by 16 components transposed in
    registers (_pack_block)."""
    for t0 in range(0, padded, LANES):
        for d0 in range(0, size, LANES):
            _pack_block(k, first + t0 * key_step + d0, key_step, keys - t0, min(LANES, size - d0), packed,
                        d0 * padded + t0, padded)


@jit
def _softmax_rows(scores, padded, count, bias, b, h, r0, zeros, reciprocals):
    """The ROWS scores rows (of query rows r0 ...) turned into unnormalized weights in place, the reciprocals of
    their sums; rows from ``count`` on (past the last query) weigh nothing. ``bias`` as few_rows_in_lanes's,
    ``zeros`` a row of keys zeros. False when a row's largest score is not finite."""
    keys = zeros.shape[0]
    with_bias = bias.size > 0
    bias_b, bias_h, bias_r = bias.shape[0] > 1, bias.shape[1] > 1, bias.shape[2] > 1
    for i in range(ROWS):
        row = scores[i * padded: (i + 1) * padded]
        if i >= count:
            row[:] = 0
            reciprocals[i] = 0
            continue
        r = r0 + i
        row_bias = bias[b if bias_b else 0, h if bias_h else 0, r if bias_r else 0] if with_bias else zeros
        peak = _biased_peak(row, padded, row_bias, keys)
        if not abs(peak) < np.float32(np.inf):
            return False
        reciprocals[i] = np.float32(1) / _exp_sum(row, padded, peak)
    return True


@jit
def few_rows_in_lanes(q, k, v, scale, bias, y, scratch):
    """attention.few_rows_by_position's result (same arguments: (B, S, H, D) heads by position, float32, y
    C-contiguous) through the 16-lane steps above, ROWS query rows at a time; ``scratch`` holds scratch_size(head
    size, keys) floats. q, k and v may be views (column slices of one projection product): each head's
    components contiguous, every stride non-negative, none of them empty. False, with y partly written, when a
    row's largest score is not finite (the caller's general path decides those)."""
    batch, rows, heads = q.shape[0], q.shape[1], q.shape[2]
    keys, kv_heads, value_size = k.shape[1], k.shape[2], v.shape[3]
    size = q.shape[3]
    return _few_rows(_flat(q), (q.strides[0] // 4, q.strides[1] // 4, q.strides[2] // 4), _flat(k),
                     (k.strides[0] // 4, k.strides[1] // 4, k.strides[2] // 4), _flat(v),
                     (v.strides[0] // 4, v.strides[1] // 4, v.strides[2] // 4), y.reshape(-1),
                     (rows * heads * value_size, heads * value_size, value_size),
                     batch, rows, heads, kv_heads, keys, size, value_size, scale, bias, scratch)


@jit
def few_rows_into(q, k, v, scale, bias, y, y_steps, scratch):
    """few_rows_in_lanes writing row (b, s, h) of the result at y[b * y_steps[0] + s * y_steps[1] + h * y_steps[2]]
    of a flat float32 y: a group of heads' columns inside a wider output (each head's value_size components
    contiguous there), which the group's thread writes in place."""
    batch, rows, heads = q.shape[0], q.shape[1], q.shape[2]
    keys, kv_heads, value_size = k.shape[1], k.shape[2], v.shape[3]
    return _few_rows(_flat(q), (q.strides[0] // 4, q.strides[1] // 4, q.strides[2] // 4), _flat(k),
                     (k.strides[0] // 4, k.strides[1] // 4, k.strides[2] // 4), _flat(v),
                     (v.strides[0] // 4, v.strides[1] // 4, v.strides[2] // 4), y, y_steps,
                     batch, rows, heads, kv_heads, keys, q.shape[3], value_size, scale, bias, scratch)


@jit
def few_rows_of_tokens(q, k, v, heads, kv_heads, scale, bias, y):
    """few_rows_in_lanes over 3-D (B, S, H * D) q, k, v and y as an encoder's Attention node has them (``heads``
    query and ``kv_heads`` KV heads side by side in each token's row; y C-contiguous), its scratch made here:
    the caller reshapes nothing. q, k and v may be column views of one product: rows at any non-negative
    stride, components contiguous. False, with y partly written, when a row's largest score is not finite."""
    batch, rows, keys = q.shape[0], q.shape[1], k.shape[1]
    size, value_size = q.shape[2] // heads, v.shape[2] // kv_heads
    padded = -(-keys // LANES) * LANES
    scratch = np.empty(size * padded + ROWS * padded + ROWS * size + keys, np.float32)  # scratch_size's floats
    return _few_rows(_flat(q), (q.strides[0] // 4, q.strides[1] // 4, size), _flat(k),
                     (k.strides[0] // 4, k.strides[1] // 4, size), _flat(v),
                     (v.strides[0] // 4, v.strides[1] // 4, value_size), y.reshape(-1),
                     (rows * heads * value_size, heads * value_size, value_size),
                     batch, rows, heads, kv_heads, keys, size, value_size, scale, bias, scratch)


@jit
def few_rows_by_head(q, k, v, scale, bias, y, scratch):
    """few_rows_in_lanes over (B, H, S, D) heads (a decoder's heads after its split, its past and present keys and
    values), y (B, H, S, Dv) C-contiguous. q, k and v may be views (a head split that only transposed): each
    head's components contiguous, every stride non-negative, none of them empty."""
    batch, heads, rows, size = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    kv_heads, keys, value_size = k.shape[1], k.shape[2], v.shape[3]
    return _few_rows(_flat(q), (q.strides[0] // 4, q.strides[2] // 4, q.strides[1] // 4), _flat(k),
                     (k.strides[0] // 4, k.strides[2] // 4, k.strides[1] // 4), _flat(v),
                     (v.strides[0] // 4, v.strides[2] // 4, v.strides[1] // 4), y.reshape(-1),
                     (heads * rows * value_size, value_size, rows * value_size),
                     batch, rows, heads, kv_heads, keys, size, value_size, scale, bias, scratch)


@jit
def _flat(a):
    """A float32 array's memory from its first element to its last as one flat array (non-negative strides)."""
    span = 1
    for d in range(a.ndim):
        span += (a.shape[d] - 1) * (a.strides[d] // 4)
    return np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(4,))


@jit
def _few_rows(q, q_steps, k, k_steps, v, v_steps, y, y_steps, batch, rows, heads, kv_heads, keys, size,  # noqa: C901
              value_size, scale, bias, scratch):
    """The loop of few_rows_in_lanes and few_rows_by_head over flat q, k, v and y: element (b, s, h, :) of each at
    b * steps[0] + s * steps[1] + h * steps[2] (its head's components contiguous)."""
    padded = -(-keys // LANES) * LANES
    group = heads // kv_heads
    packed = scratch[: size * padded]
    scores = scratch[size * padded: (size + ROWS) * padded]
    spare = scratch[(size + ROWS) * padded: (size + ROWS) * padded + ROWS * size]  # a last group's missing rows
    zeros = scratch[(size + ROWS) * padded + ROWS * size: (size + ROWS) * padded + ROWS * size + keys]
    zeros[:] = 0
    reciprocals = np.empty(ROWS, np.float32)
    q_step, v_step, y_step = q_steps[1], v_steps[1], y_steps[1]
    out = np.empty(ROWS * value_size, np.float32)  # a last group's rows, copied out to y's
    packed_for = -1
    with_bias = bias.size > 0
    bias_b, bias_h, bias_r = bias.shape[0] > 1, bias.shape[1] > 1, bias.shape[2] > 1
    bias_step = bias.strides[2] // 4
    for b in range(batch):
        for h in range(heads):
            g = h // group
            if b * kv_heads + g != packed_for:
                _pack_keys(k, b * k_steps[0] + g * k_steps[2], k_steps[1], keys, size, packed, padded)
                packed_for = b * kv_heads + g
            v_first = b * v_steps[0] + g * v_steps[2]
            for r0 in range(0, rows, ROWS):
                count = min(ROWS, rows - r0)
                q_first = b * q_steps[0] + r0 * q_step + h * q_steps[2]
                if count == ROWS:
                    _scores_rows(packed, padded, size, q[q_first:], q_step, scale, scores)
                else:  # the last rows, with zero rows after them
                    spare[:] = 0
                    for i in range(count):
                        spare[i * size: (i + 1) * size] = q[q_first + i * q_step: q_first + i * q_step + size]
                    _scores_rows(packed, padded, size, spare, size, scale, scores)
                if count < ROWS:  # (a whole group's softmax in one pass: a helper call per group cost 3-8%)
                    if not _softmax_rows(scores, padded, count, bias, b, h, r0, zeros, reciprocals):
                        return False
                elif not with_bias:
                    if not _group_softmax_unbiased(scores, padded, keys, reciprocals):
                        return False
                elif not _group_softmax(scores, padded, keys, bias[b if bias_b else 0, h if bias_h else 0,
                                                                      r0 if bias_r else 0:],
                                        bias_step if bias_r else 0, reciprocals):
                    return False
                y_first = b * y_steps[0] + r0 * y_step + h * y_steps[2]
                if count == ROWS:
                    _weighted_rows(scores, padded, keys, v[v_first:], v_step, value_size, y[y_first:], y_step,
                                   reciprocals)
                else:
                    _weighted_rows(scores, padded, keys, v[v_first:], v_step, value_size, out, value_size,
                                   reciprocals)
                    for i in range(count):
                        y[y_first + i * y_step: y_first + i * y_step + value_size] = \
                            out[i * value_size: (i + 1) * value_size]
    return True
