// Reductions over one contiguous run of axes, seen as an (outer, extent, inner) tensor: Reduce{Sum, Mean,
// Prod, Max, Min, L1, L2, SumSquare, LogSum, LogSumExp} and ArgMax/ArgMin. ops/reduce.py turns any set of
// axes into one pass per run of adjacent reduced axes.
//
// A block reduces blockDim.x neighbouring `inner` columns of one outer index (a "tile"); its threadIdx.y rows
// stride over the extent (see reduce.cuh). blockIdx.y splits the extent into `chunk`-sized pieces when there
// are too few tiles to fill the GPU; the host then reduces the per-chunk partials in a second pass.
//
// Entry points: reduce_<in>_<out> with the combining op as an argument (warp-uniform, so the switch never
// diverges; one kernel per type pair keeps the module small). Narrow floats accumulate in float; a multi-pass
// reduction keeps its partials in float (the _f32 input/output variants) and rounds once at the end. `pre`
// (first pass: |x| or x*x) and `post` (last pass: divide, sqrt, log) make Mean, L1, L2, SumSquare and LogSum
// sums. arg_<type> writes int64 indices.
#include "elementwise.cuh"
#include "reduce.cuh"

// Blocks have at most this many threads (ops/reduce.py picks the shape), which bounds the shared scratch
// of block_reduce_y: blockDim.x * blockDim.y / 32 <= REDUCE_THREADS values.
#define REDUCE_THREADS 256

// Op codes; ops/reduce.py lists the names in this order.
enum Combine { C_SUM, C_PROD, C_MAX, C_MIN, C_LOG_SUM_EXP };
enum Pre { PRE_NONE, PRE_ABS, PRE_SQUARE };
enum Post { POST_NONE, POST_DIVIDE, POST_SQRT, POST_LOG };

// The accumulator of each input type: float for floats, int64 for int32 (wraps like numpy's int32 sum once
// stored), the type itself otherwise.
template <class T> struct Acc { typedef wide_t<T> type; };
template <> struct Acc<i32> { typedef i64 type; };

template <class A> __device__ __forceinline__ A identity_of(int op) {
    switch (op) {
        case C_PROD: return A(1);
        case C_MAX: return Limits<A>::lowest();
        case C_MIN: return Limits<A>::highest();
        default: return A(0);
    }
}

struct Combiner {
    int op;
    template <class A> __device__ __forceinline__ A operator()(A a, A b) const {
        switch (op) {
            case C_PROD: return a * b;
            case C_MAX: return nan_max(a, b);
            case C_MIN: return nan_min(a, b);
            default: return a + b;
        }
    }
};

template <class A> __device__ __forceinline__ A prepare(A v, int pre) {
    if constexpr (ew_is_signed<A>::value) {
        if (pre == PRE_ABS) return v < A(0) ? A(-v) : v;
    }
    return pre == PRE_SQUARE ? A(v * v) : v;
}

template <class A> __device__ __forceinline__ A finish(A v, int post, float divisor) {
    if constexpr (ew_is_float<A>::value) {
        switch (post) {
            case POST_DIVIDE: return v / divisor;  // Mean; an empty mean is 0 / 0 = NaN, as in numpy
            case POST_SQRT: return sqrtf(v);
            case POST_LOG: return logf(v);
            default: return v;
        }
    }
    return v;
}

// LogSumExp of a column: max first, then log(sum(exp(x - max))) + max, with an infinite or empty max left out
// (as the CPU provider does). Its result is again a log-sum-exp, so split and multi-pass reductions compose.
template <class T>
__device__ __forceinline__ float log_sum_exp(const T* p, i64 begin, i64 end, i64 inner, bool valid, float* scratch) {
    const auto load = [&](i64 r) { return p[r * inner]; };
    float peak = -ew_inf(), total = 0.0f;
    if (valid) for_rows(begin, end, load, [&](i64, T v) { peak = nan_max(peak, (float)widen(v)); });
    peak = block_reduce_y(peak, MaxOf(), scratch);
    if (!(fabsf(peak) < ew_inf())) peak = 0.0f;
    if (valid) for_rows(begin, end, load, [&](i64, T v) { total += expf((float)widen(v) - peak); });
    return logf(block_reduce_y(total, SumOf(), scratch)) + peak;
}

// Column i's reduction over [begin, end), returned to every thread of the column.
template <class TIn, class A>
__device__ __forceinline__ A reduce_column(const TIn* p, i64 begin, i64 end, i64 inner, bool valid, int op, int pre,
                                           A* scratch) {
    if constexpr (ew_is_float<A>::value) {
        if (op == C_LOG_SUM_EXP) return log_sum_exp(p, begin, end, inner, valid, scratch);
    }
    const Combiner combine{op};
    A acc = identity_of<A>(op);
    if (valid) {
        for_rows(begin, end, [&](i64 r) { return p[r * inner]; },
                 [&](i64, TIn v) { acc = combine(acc, prepare<A>(widen(v), pre)); });
    }
    return block_reduce_y(acc, combine, scratch);
}

template <class TIn, class TOut>
__device__ __forceinline__ void reduce(const TIn* __restrict__ x, TOut* __restrict__ y, int op, i64 outer,
                                       i64 extent, i64 inner, i64 chunk, int pre, int post, float divisor) {
    typedef typename Acc<TIn>::type A;
    __shared__ A scratch[REDUCE_THREADS];
    const i64 begin = (i64)blockIdx.y * chunk, end = min(extent, begin + chunk);
    for_each_tile(outer, inner, [&](i64 o, i64 i, bool valid) {
        const A acc = reduce_column<TIn, A>(x + o * extent * inner + i, begin, end, inner, valid, op, pre, scratch);
        if (threadIdx.y == 0 && valid) {
            y[(o * gridDim.y + blockIdx.y) * inner + i] = convert<TOut>(finish(acc, post, divisor));
        }
    });
}

#define REDUCE_KERNEL(TIn, si, TOut, so)                                                                     \
    extern "C" __global__ void __launch_bounds__(REDUCE_THREADS)                                             \
        reduce_##si##_##so(const TIn* x, TOut* y, int op, i64 outer, i64 extent, i64 inner, i64 chunk, int pre, \
                           int post, float divisor) {                                                        \
        reduce<TIn, TOut>(x, y, op, outer, extent, inner, chunk, pre, post, divisor);                        \
    }
// Floats: single pass (T -> T), first of several (T -> f32), last of several (f32 -> T); f32 -> f32 serves all.
REDUCE_KERNEL(float, f32, float, f32)
REDUCE_KERNEL(__half, f16, __half, f16)
REDUCE_KERNEL(__half, f16, float, f32)
REDUCE_KERNEL(float, f32, __half, f16)
REDUCE_KERNEL(__nv_bfloat16, bf16, __nv_bfloat16, bf16)
REDUCE_KERNEL(__nv_bfloat16, bf16, float, f32)
REDUCE_KERNEL(float, f32, __nv_bfloat16, bf16)
// Integers keep partials in their own type: wrapping sums and products compose, max and min are exact.
REDUCE_KERNEL(i32, i32, i32, i32)
REDUCE_KERNEL(i64, i64, i64, i64)
REDUCE_KERNEL(u8, u8, u8, u8)
REDUCE_KERNEL(i8, i8, i8, i8)
REDUCE_KERNEL(bool, b8, bool, b8)

// ---- ArgMax / ArgMin ---------------------------------------------------------------------------------------

// The better of two candidates. NaN beats every number (numpy's argmax and argmin both return the first NaN);
// ties go to the lower index, or the higher one with select_last_index.
struct ArgBetter {
    bool is_max, last;
    template <class A> __device__ __forceinline__ ArgPair<A> operator()(ArgPair<A> a, ArgPair<A> b) const {
        if (b.i < 0) return a;
        if (a.i < 0) return b;
        const bool a_nan = is_nan(a.v), b_nan = is_nan(b.v);
        const bool b_index_wins = last ? b.i > a.i : b.i < a.i;
        bool take_b;
        if (a_nan || b_nan) take_b = b_nan && (!a_nan || b_index_wins);
        else if (a.v == b.v) take_b = b_index_wins;
        else take_b = is_max ? b.v > a.v : b.v < a.v;
        return take_b ? b : a;
    }
};

template <class T>
__device__ __forceinline__ void arg_reduce(const T* __restrict__ x, i64* __restrict__ y, i64 outer, i64 extent,
                                           i64 inner, int is_max, int last) {
    typedef ArgPair<wide_t<T>> P;
    __shared__ P scratch[REDUCE_THREADS];
    const ArgBetter better{is_max != 0, last != 0};
    for_each_tile(outer, inner, [&](i64 o, i64 i, bool valid) {
        P best{wide_t<T>(0), -1};
        if (valid) {
            const T* p = x + o * extent * inner + i;
            for_rows(0, extent, [&](i64 r) { return p[r * inner]; },
                     [&](i64 r, T v) { best = better(best, P{widen(v), r}); });
        }
        best = block_reduce_y(best, better, scratch);
        if (threadIdx.y == 0 && valid) y[o * inner + i] = best.i;
    });
}

#define ARG_KERNEL(T, sfx)                                                                                   \
    extern "C" __global__ void __launch_bounds__(REDUCE_THREADS)                                             \
        arg_##sfx(const T* x, i64* y, i64 outer, i64 extent, i64 inner, int is_max, int last) {             \
        arg_reduce<T>(x, y, outer, extent, inner, is_max, last);                                             \
    }
ARG_KERNEL(float, f32)
ARG_KERNEL(__half, f16)
ARG_KERNEL(__nv_bfloat16, bf16)
ARG_KERNEL(i32, i32)
ARG_KERNEL(i64, i64)
ARG_KERNEL(u8, u8)
ARG_KERNEL(i8, i8)
