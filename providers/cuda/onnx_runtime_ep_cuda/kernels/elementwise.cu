// Elementwise kernels: unary math and activations, binary arithmetic/comparison/logic with numpy
// broadcasting (up to rank 8), Pow, Where, Cast and Clip.
//
// Entry points: unary_<T>, binary_<T> and clip_<T> with T a dtype suffix (f32, f16, bf16, i8, u8, i16, u16, i32,
// u32, i64, u64, b8) and the op as an argument; pow_<base>, where_<element bytes>, cast_<from>_<to>.
// ops/elementwise.py builds the names. All are grid-stride loops over the output (see elementwise.cuh).
//
// Broadcasting: the host collapses the output shape and each input's strides (0 on broadcast dims) to the
// fewest dims that describe them, innermost first, and passes them as scalars (d0..d7 and one stride set per
// input), so no launch uploads metadata. Equal shapes and scalar operands collapse to rank 1, which needs no
// index division.
#include "elementwise.cuh"

// ---- unary -------------------------------------------------------------------------------------------------

// Op codes; ops/elementwise.py lists the names in this order (a test keeps the two in step). The op is a
// launch argument, the same for every thread, so the switch never diverges; sharing one kernel per dtype
// keeps the compiled module small, which is what first-use NVRTC compile time scales with.
enum UnaryOp {
    // floats only
    U_EXP, U_LOG, U_SQRT, U_RECIPROCAL, U_SIGMOID, U_TANH, U_ERF, U_GELU, U_GELU_TANH, U_SOFTPLUS, U_SOFTSIGN,
    U_MISH, U_FLOOR, U_CEIL, U_ROUND, U_SIN, U_COS, U_TAN, U_ASIN, U_ACOS, U_ATAN, U_SINH, U_COSH, U_ASINH,
    U_ACOSH, U_ATANH, U_LEAKY_RELU, U_ELU, U_SELU, U_CELU, U_THRESHOLDED_RELU, U_HARD_SIGMOID, U_HARD_SWISH,
    U_DIV_SCALAR,
    // any type
    U_ABS, U_NEG, U_RELU, U_SIGN, U_NOT,
};

__device__ __forceinline__ float softplus(float x) {
    return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));  // a NaN input stays NaN through fabsf
}
__device__ __forceinline__ float sigmoid(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    const float e = expf(x);  // exp(-x) would overflow for very negative x
    return e / (1.0f + e);
}
__device__ __forceinline__ float hard_sigmoid(float x, float a, float b) {
    return nan_min(nan_max(a * x + b, 0.0f), 1.0f);
}

template <class C> __device__ __forceinline__ C unary_any(int op, C x) {
    switch (op) {
        case U_ABS:
            if constexpr (ew_is_float<C>::value) return fabsf(x);
            else if constexpr (ew_is_signed<C>::value) return x < C(0) ? C(-x) : x;
            else return x;
        case U_NEG: return C(-x);
        case U_RELU: return x < C(0) ? C(0) : x;  // not x > 0: NaN stays NaN, as in numpy's maximum(x, 0)
        case U_SIGN: return is_nan(x) ? x : C((x > C(0)) - (x < C(0)));
        case U_NOT: return C(!x);
        default: return x;
    }
}

// `a` and `b` are the op's attributes (alpha, beta/gamma, ...).
__device__ __forceinline__ float unary_float(int op, float x, float a, float b) {
    switch (op) {
        case U_EXP: return expf(x);
        case U_LOG: return logf(x);
        case U_SQRT: return sqrtf(x);
        case U_RECIPROCAL: return 1.0f / x;
        case U_SIGMOID: return sigmoid(x);
        case U_TANH: return tanhf(x);
        case U_ERF: return erff(x);
        case U_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
        case U_GELU_TANH: return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
        case U_SOFTPLUS: return softplus(x);
        case U_SOFTSIGN: return x / (1.0f + fabsf(x));
        case U_MISH: return x * tanhf(softplus(x));
        case U_FLOOR: return floorf(x);
        case U_CEIL: return ceilf(x);
        case U_ROUND: return rintf(x);  // half to even, as ONNX Round requires
        case U_SIN: return sinf(x);
        case U_COS: return cosf(x);
        case U_TAN: return tanf(x);
        case U_ASIN: return asinf(x);
        case U_ACOS: return acosf(x);
        case U_ATAN: return atanf(x);
        case U_SINH: return sinhf(x);
        case U_COSH: return coshf(x);
        case U_ASINH: return asinhf(x);
        case U_ACOSH: return acoshf(x);
        case U_ATANH: return atanhf(x);
        case U_LEAKY_RELU: return x < 0.0f ? a * x : x;
        case U_ELU: return x < 0.0f ? a * expm1f(x) : x;
        case U_SELU: return b * (x > 0.0f ? x : a * expm1f(x));
        case U_CELU: return nan_max(x, 0.0f) + nan_min(0.0f, a * expm1f(x / a));
        case U_THRESHOLDED_RELU: return x > a ? x : 0.0f;
        case U_HARD_SIGMOID: return hard_sigmoid(x, a, b);
        case U_HARD_SWISH: return x * hard_sigmoid(x, 1.0f / 6.0f, 0.5f);
        case U_DIV_SCALAR: return x / a;  // Mean's division by its input count
        default: return unary_any(op, x);
    }
}

template <class T>
__device__ __forceinline__ void unary(const T* __restrict__ x, T* __restrict__ y, int op, i64 n, float a, float b) {
    grid_stride(n, [&](auto i) { return x[i]; }, [&](auto i, T v) {
        if constexpr (ew_is_float<wide_t<T>>::value) y[i] = convert<T>(unary_float(op, widen(v), a, b));
        else y[i] = convert<T>(unary_any(op, widen(v)));
    });
}

#define UNARY_KERNEL(T, sfx)                                                                                 \
    extern "C" __global__ void unary_##sfx(const T* x, T* y, int op, i64 n, float a, float b) {             \
        unary<T>(x, y, op, n, a, b);                                                                         \
    }
#define FOR_NUMERIC(M)                                                                                       \
    M(float, f32) M(__half, f16) M(__nv_bfloat16, bf16) M(i8, i8) M(u8, u8) M(i16, i16) M(u16, u16)         \
    M(i32, i32) M(u32, u32) M(i64, i64) M(u64, u64)

FOR_NUMERIC(UNARY_KERNEL)
UNARY_KERNEL(bool, b8)

// ---- broadcasting ------------------------------------------------------------------------------------------

#define EW_PARAMS(p) i64 p##0, i64 p##1, i64 p##2, i64 p##3, i64 p##4, i64 p##5, i64 p##6, i64 p##7
#define EW_ARRAY(p) {p##0, p##1, p##2, p##3, p##4, p##5, p##6, p##7}

// Offsets of output element i in each of N inputs: dims and strides innermost first, `rank` >= 1 of them.
// Every array index is a compile-time constant once the loops unroll, so dims and strides stay in registers
// (a data-dependent index would copy them to local memory in every thread).
template <int N, class I>
__device__ __forceinline__ void broadcast_offsets(I i, int rank, const i64 (&dims)[8], const i64 (&strides)[N][8],
                                                  I (&offset)[N]) {
#pragma unroll
    for (int j = 0; j < N; ++j) offset[j] = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (k < rank) {
            I c = i;
            if (k < rank - 1) {  // the outermost dim needs no division
                const I q = i / (I)dims[k];
                c = i - q * (I)dims[k];
                i = q;
            }
#pragma unroll
            for (int j = 0; j < N; ++j) offset[j] += c * (I)strides[j][k];
        }
    }
}

// ---- binary ------------------------------------------------------------------------------------------------

// Op codes, as for UnaryOp. Arithmetic ops produce the input type, the others bool.
enum BinaryOp {
    B_ADD, B_SUB, B_MUL, B_DIV, B_MAX, B_MIN,
    B_EQUAL, B_LESS, B_GREATER, B_LESS_EQUAL, B_GREATER_EQUAL, B_AND, B_OR, B_XOR,
};

// Unsigned arithmetic of a type's width: integer overflow wraps (as numpy's does) without undefined behaviour.
template <int Size> struct ew_unsigned { typedef u32 type; };
template <> struct ew_unsigned<8> { typedef u64 type; };

template <class C> __device__ __forceinline__ C arithmetic(int op, C a, C b) {
    if constexpr (ew_is_float<C>::value) {
        switch (op) {
            case B_ADD: return a + b;
            case B_SUB: return a - b;
            case B_MUL: return a * b;
            case B_DIV: return a / b;
            case B_MAX: return nan_max(a, b);
            default: return nan_min(a, b);
        }
    } else {
        typedef typename ew_unsigned<sizeof(C)>::type U;
        switch (op) {
            case B_ADD: return C((U)a + (U)b);
            case B_SUB: return C((U)a - (U)b);
            case B_MUL: return C((U)a * (U)b);
            case B_DIV:  // truncates toward zero; x / 0 is 0 as in numpy, INT_MIN / -1 wraps instead of trapping
                if (b == C(0)) return C(0);
                if (ew_is_signed<C>::value && b == C(-1)) return C((U)0 - (U)a);
                return C(a / b);
            case B_MAX: return a > b ? a : b;
            default: return a < b ? a : b;
        }
    }
}

template <class C> __device__ __forceinline__ bool compare(int op, C a, C b) {
    switch (op) {
        case B_EQUAL: return a == b;
        case B_LESS: return a < b;
        case B_GREATER: return a > b;
        case B_LESS_EQUAL: return a <= b;
        case B_GREATER_EQUAL: return a >= b;
        case B_AND: return a && b;
        case B_OR: return a || b;
        default: return a != b;  // B_XOR
    }
}

// Arithmetic ops write T, comparisons and logic write bool: one kernel per type serves both, which halves
// the copies of the broadcasting index math the module holds.
template <class T>
__device__ __forceinline__ void binary(int op, const T* __restrict__ a, const T* __restrict__ b, void* __restrict__ y,
                                       i64 n, int rank, const i64 (&dims)[8], const i64 (&strides)[2][8]) {
    const bool to_bool = op >= B_EQUAL;
    const auto store = [&](auto i, Operands<T, T> v) {
        if (to_bool) static_cast<bool*>(y)[i] = compare(op, widen(v.a), widen(v.b));
        else static_cast<T*>(y)[i] = convert<T>(arithmetic(op, widen(v.a), widen(v.b)));
    };
    if (rank == 1) {  // equal shapes or a scalar operand
        const i64 sa = strides[0][0], sb = strides[1][0];
        grid_stride(n, [&](auto i) { return Operands<T, T>{a[i * sa], b[i * sb]}; }, store);
    } else {
        grid_stride<1>(
            n,
            [&](auto i) {
                decltype(i) o[2];
                broadcast_offsets<2>(i, rank, dims, strides, o);
                return Operands<T, T>{a[o[0]], b[o[1]]};
            },
            store);
    }
}

#define BINARY_KERNEL(T, sfx)                                                                                \
    extern "C" __global__ void binary_##sfx(const T* a, const T* b, void* y, int op, i64 n, int rank,       \
                                            EW_PARAMS(d), EW_PARAMS(sa), EW_PARAMS(sb)) {                    \
        const i64 dims[8] = EW_ARRAY(d);                                                                     \
        const i64 strides[2][8] = {EW_ARRAY(sa), EW_ARRAY(sb)};                                              \
        binary<T>(op, a, b, y, n, rank, dims, strides);                                                      \
    }

FOR_NUMERIC(BINARY_KERNEL)
BINARY_KERNEL(bool, b8)  // comparisons and logic only

// Pow: the result has the base's type; the exponent may have another (`exponent_type`, an ONNX DataType code).
// Integer powers of integers are exact and wrap like numpy's; a negative or float exponent on an integer base
// goes through double, as the CPU provider does.
struct Exponent {
    double f;
    i64 i;
    bool integral;
};

template <class I> __device__ __forceinline__ Exponent load_exponent(const void* p, int type, I k) {
    switch (type) {
        case 1: return {(double)((const float*)p)[k], 0, false};
        case 10: return {(double)widen(((const __half*)p)[k]), 0, false};
        case 16: return {(double)widen(((const __nv_bfloat16*)p)[k]), 0, false};
        case 11: return {((const double*)p)[k], 0, false};
        case 2: return {0.0, (i64)((const u8*)p)[k], true};
        case 3: return {0.0, (i64)((const i8*)p)[k], true};
        case 4: return {0.0, (i64)((const u16*)p)[k], true};
        case 5: return {0.0, (i64)((const i16*)p)[k], true};
        case 6: return {0.0, (i64)((const i32*)p)[k], true};
        case 12: return {0.0, (i64)((const u32*)p)[k], true};
        case 13: return {0.0, (i64)((const u64*)p)[k], true};
        default: return {0.0, ((const i64*)p)[k], true};  // 7: int64
    }
}

template <class C> __device__ __forceinline__ C power(C a, Exponent e) {
    if constexpr (ew_is_float<C>::value) {
        return powf(a, e.integral ? (float)e.i : (float)e.f);
    } else {
        if (!e.integral || e.i < 0) return (C)(i64)pow((double)a, e.integral ? (double)e.i : e.f);
        typedef typename ew_unsigned<sizeof(C)>::type U;
        U result = 1, base = (U)a;
        for (u64 k = (u64)e.i; k; k >>= 1) {
            if (k & 1) result *= base;
            base *= base;
        }
        return (C)result;
    }
}

#define POW_KERNEL(T, sfx)                                                                                   \
    extern "C" __global__ void pow_##sfx(const T* a, const void* b, T* y, int exponent_type, i64 n, int rank, \
                                         EW_PARAMS(d), EW_PARAMS(sa), EW_PARAMS(sb)) {                       \
        const i64 dims[8] = EW_ARRAY(d);                                                                     \
        const i64 strides[2][8] = {EW_ARRAY(sa), EW_ARRAY(sb)};                                              \
        grid_stride<1>(                                                                                      \
            n,                                                                                               \
            [&](auto i) {                                                                                    \
                decltype(i) o[2];                                                                            \
                broadcast_offsets<2>(i, rank, dims, strides, o);                                             \
                return Operands<T, Exponent>{a[o[0]], load_exponent(b, exponent_type, o[1])};               \
            },                                                                                               \
            [&](auto i, Operands<T, Exponent> v) { y[i] = convert<T>(power(widen(v.a), v.b)); });            \
    }
POW_KERNEL(float, f32)
POW_KERNEL(__half, f16)
POW_KERNEL(__nv_bfloat16, bf16)
POW_KERNEL(i32, i32)
POW_KERNEL(i64, i64)

// ---- Where -------------------------------------------------------------------------------------------------

// Where only moves elements, so one kernel per element size serves every type.
template <class T>
__device__ __forceinline__ void where(const bool* __restrict__ c, const T* __restrict__ x, const T* __restrict__ y,
                                      T* __restrict__ out, i64 n, int rank, const i64 (&dims)[8],
                                      const i64 (&strides)[3][8]) {
    grid_stride<1>(
        n,
        [&](auto i) {
            decltype(i) o[3];
            broadcast_offsets<3>(i, rank, dims, strides, o);
            return c[o[0]] ? x[o[1]] : y[o[2]];
        },
        [&](auto i, T v) { out[i] = v; });
}

#define WHERE_KERNEL(T, bytes)                                                                               \
    extern "C" __global__ void where_##bytes(const bool* c, const T* x, const T* y, T* out, i64 n, int rank, \
                                             EW_PARAMS(d), EW_PARAMS(sc), EW_PARAMS(sx), EW_PARAMS(sy)) {    \
        const i64 dims[8] = EW_ARRAY(d);                                                                     \
        const i64 strides[3][8] = {EW_ARRAY(sc), EW_ARRAY(sx), EW_ARRAY(sy)};                                \
        where<T>(c, x, y, out, n, rank, dims, strides);                                                      \
    }
WHERE_KERNEL(u8, 1)
WHERE_KERNEL(u16, 2)
WHERE_KERNEL(u32, 4)
WHERE_KERNEL(u64, 8)

// ---- Cast --------------------------------------------------------------------------------------------------

#define CAST_KERNEL(F, sf, T, st)                                                                            \
    extern "C" __global__ void cast_##sf##_##st(const F* __restrict__ x, T* __restrict__ y, i64 n) {        \
        grid_stride(n, [&](auto i) { return x[i]; }, [&](auto i, F v) { y[i] = convert<T>(v); });            \
    }
#define CAST_FROM(F, sf)                                                                                     \
    CAST_KERNEL(F, sf, float, f32) CAST_KERNEL(F, sf, __half, f16) CAST_KERNEL(F, sf, __nv_bfloat16, bf16)  \
    CAST_KERNEL(F, sf, i32, i32) CAST_KERNEL(F, sf, i64, i64) CAST_KERNEL(F, sf, bool, b8)                  \
    CAST_KERNEL(F, sf, u8, u8) CAST_KERNEL(F, sf, i8, i8)
CAST_FROM(float, f32)
CAST_FROM(__half, f16)
CAST_FROM(__nv_bfloat16, bf16)
CAST_FROM(i32, i32)
CAST_FROM(i64, i64)
CAST_FROM(bool, b8)
CAST_FROM(u8, u8)
CAST_FROM(i8, i8)

// ---- Clip --------------------------------------------------------------------------------------------------

// Bounds come from the optional scalar inputs `lo`/`hi` (Clip-11+, read on the device so nothing syncs) or,
// for Clip < 11, from attributes (`has` bit 0: min, bit 1: max). Max-then-min gives `hi` when lo > hi.
template <class T>
__device__ __forceinline__ void clip(const T* __restrict__ x, T* __restrict__ y, i64 n, const T* lo, const T* hi,
                                     float lo_attr, float hi_attr, int has) {
    typedef wide_t<T> C;
    const bool has_lo = lo != nullptr || (has & 1), has_hi = hi != nullptr || (has & 2);
    const C low = lo != nullptr ? widen(lo[0]) : (C)lo_attr;
    const C high = hi != nullptr ? widen(hi[0]) : (C)hi_attr;
    grid_stride(n, [&](auto i) { return x[i]; }, [&](auto i, T value) {
        C v = widen(value);
        if (has_lo && v < low) v = low;
        if (has_hi && v > high) v = high;
        y[i] = convert<T>(v);
    });
}

#define CLIP_KERNEL(T, sfx)                                                                                  \
    extern "C" __global__ void clip_##sfx(const T* x, T* y, i64 n, const T* lo, const T* hi, float lo_attr, \
                                          float hi_attr, int has) {                                          \
        clip<T>(x, y, n, lo, hi, lo_attr, hi_attr, has);                                                     \
    }
FOR_NUMERIC(CLIP_KERNEL)
