// Data movement: strided copies (Transpose, Slice, Expand), pitched row copies (Concat, Split), Gather,
// GatherElements, GatherND, ScatterND, and the generators Range and ConstantOfShape.
//
// Moving data never looks at the values, so these kernels are stamped out per element width (u8, u16,
// u32, u64) and serve every dtype of that size. Shapes of up to 8 dimensions arrive as scalar arguments
// (DIMS8: sizes n0..n7, then strides s0..s7, outermost first; only the last `rank` are used), so no launch
// needs a metadata upload. All loops are grid-stride over 64-bit counts.
//
// Index validation: an index outside its axis is clamped into range (no out-of-bounds access ever
// happens) and bit 0 (validation.INDEX_OUT_OF_RANGE) of the device flag word `flags` is raised, for the
// provider to report at the next host-visible boundary.
#include "float_io.cuh"

#define INDEX_OUT_OF_RANGE 1u

#define DIMS8_PARAMS                                                                                       \
    long long n0, long long n1, long long n2, long long n3, long long n4, long long n5, long long n6,       \
        long long n7, long long s0, long long s1, long long s2, long long s3, long long s4, long long s5,   \
        long long s6, long long s7
#define DIMS8_ARGS n0, n1, n2, n3, n4, n5, n6, n7, s0, s1, s2, s3, s4, s5, s6, s7

struct Dims8 {
    long long n[8], s[8];
};

__device__ __forceinline__ Dims8 make_dims(DIMS8_PARAMS) {
    return Dims8{{n0, n1, n2, n3, n4, n5, n6, n7}, {s0, s1, s2, s3, s4, s5, s6, s7}};
}

#define GRID_STRIDE_LOOP(i, count)                                                                         \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (count);                    \
         i += (long long)gridDim.x * blockDim.x)

// Normalize a possibly negative index into [0, dim); out-of-range ones are clamped and flagged.
__device__ __forceinline__ long long checked_index(long long index, long long dim, unsigned int* flags) {
    if (index < 0) index += dim;
    if (index < 0 || index >= dim) {
        if (flags) atomicOr(flags, INDEX_OUT_OF_RANGE);
        index = index < 0 ? 0 : dim - 1;
    }
    return index;
}

// dst[i] = src[sum_d coord_d(i) * s_d], coords of i in the row-major shape n (strides may be 0 or negative).
template <typename T>
__device__ void strided_copy(T* __restrict__ dst, const T* __restrict__ src, long long count, int rank, Dims8 d) {
    GRID_STRIDE_LOOP(i, count) {
        long long rest = i, offset = 0;
#pragma unroll
        for (int k = 7; k >= 0; --k) {
            if (k < 8 - rank) break;
            offset += (rest % d.n[k]) * d.s[k];
            rest /= d.n[k];
        }
        dst[i] = src[offset];
    }
}

// rows x cols elements from src (rows src_pitch apart) to dst (rows dst_pitch apart).
template <typename T>
__device__ void copy_2d(T* __restrict__ dst, long long dst_pitch, const T* __restrict__ src, long long src_pitch,
                        long long cols, long long rows) {
    GRID_STRIDE_LOOP(i, rows * cols) {
        const long long row = i / cols, col = i - row * cols;
        dst[row * dst_pitch + col] = src[row * src_pitch + col];
    }
}

// Gather along an axis: data viewed as (outer, axis_dim, inner), output as (outer, nidx, inner).
template <typename T, typename I>
__device__ void gather(T* __restrict__ dst, const T* __restrict__ src, const I* __restrict__ indices, long long count,
                       long long inner, long long nidx, long long axis_dim, unsigned int* flags) {
    GRID_STRIDE_LOOP(i, count) {
        const long long in = i % inner, rest = i / inner, j = rest % nidx, outer = rest / nidx;
        if (axis_dim == 0) {  // nothing to read: every index is out of range
            if (flags) atomicOr(flags, INDEX_OUT_OF_RANGE);
            dst[i] = T(0);
            continue;
        }
        const long long index = checked_index((long long)indices[j], axis_dim, flags);
        dst[i] = src[(outer * axis_dim + index) * inner + in];
    }
}

// GatherElements: the output has the indices' shape (d.n); d.s are the data's strides. Along `axis` the
// coordinate comes from the index instead of the position.
template <typename T, typename I>
__device__ void gather_elements(T* __restrict__ dst, const T* __restrict__ src, const I* __restrict__ indices,
                                long long count, int rank, int axis, long long axis_dim, Dims8 d,
                                unsigned int* flags) {
    GRID_STRIDE_LOOP(i, count) {
        long long rest = i, offset = 0;
#pragma unroll
        for (int k = 7; k >= 0; --k) {
            if (k < 8 - rank) break;
            if (k != axis) offset += (rest % d.n[k]) * d.s[k];
            rest /= d.n[k];
        }
        if (axis_dim == 0) {
            if (flags) atomicOr(flags, INDEX_OUT_OF_RANGE);
            dst[i] = T(0);
            continue;
        }
        dst[i] = src[offset + checked_index((long long)indices[i], axis_dim, flags) * d.s[axis]];
    }
}

// Offset in `out` of the slice that index tuple j (k int64 values) addresses; d.n/d.s hold the sizes and
// strides of the data's first k dimensions in their last k slots.
__device__ __forceinline__ long long scatter_offset(const long long* __restrict__ indices, long long j, int k,
                                                    const Dims8& d, unsigned int* flags) {
    long long offset = 0;
    for (int q = 0; q < k; ++q) {
        const int slot = 8 - k + q;
        offset += checked_index(indices[j * k + q], d.n[slot], flags) * d.s[slot];
    }
    return offset;
}

// GatherND: output element i is element `within` of the slice that index tuple j = i / slice names, in the
// data of batch j / per_batch (batch_stride elements apart; the batch dimensions lead both tensors).
template <typename T>
__device__ void gather_nd(T* __restrict__ dst, const T* __restrict__ src, const long long* __restrict__ indices,
                          long long count, long long slice, int k, long long per_batch, long long batch_stride,
                          Dims8 d, unsigned int* flags) {
    GRID_STRIDE_LOOP(i, count) {
        const long long j = i / slice, within = i - j * slice;
        dst[i] = src[(j / per_batch) * batch_stride + scatter_offset(indices, j, k, d, flags) + within];
    }
}

// ScatterND without reduction: `out` already holds a copy of the data; every update element lands in the
// slice its index tuple names. (Duplicate tuples are unspecified by ONNX; the last writer wins.)
template <typename T>
__device__ void scatter_nd(T* __restrict__ out, const T* __restrict__ updates, const long long* __restrict__ indices,
                           long long count, long long slice, int k, Dims8 d, unsigned int* flags) {
    GRID_STRIDE_LOOP(u, count) {
        const long long j = u / slice, within = u - j * slice;
        out[scatter_offset(indices, j, k, d, flags) + within] = updates[u];
    }
}

struct ReduceAdd {
    __device__ static float apply(float a, float b) { return a + b; }
    __device__ static double apply(double a, double b) { return a + b; }
    __device__ static long long apply(long long a, long long b) { return a + b; }
};
struct ReduceMul {
    __device__ static float apply(float a, float b) { return a * b; }
    __device__ static double apply(double a, double b) { return a * b; }
    __device__ static long long apply(long long a, long long b) { return a * b; }
};
struct ReduceMax {
    template <typename V>
    __device__ static V apply(V a, V b) { return b > a || b != b ? b : a; }
};
struct ReduceMin {
    template <typename V>
    __device__ static V apply(V a, V b) { return b < a || b != b ? b : a; }
};

// How a reduction sees an element: 16-bit floats through float, other floats and integers as they are.
template <typename T> struct Wide { using type = T; };
template <> struct Wide<__half> { using type = float; };
template <> struct Wide<__nv_bfloat16> { using type = float; };
template <> struct Wide<int> { using type = long long; };

template <typename T>
__device__ __forceinline__ typename Wide<T>::type widen(T v) { return (typename Wide<T>::type)to_float(v); }
template <> __device__ __forceinline__ double widen<double>(double v) { return v; }
template <> __device__ __forceinline__ long long widen<int>(int v) { return v; }
template <> __device__ __forceinline__ long long widen<long long>(long long v) { return v; }
template <typename T>
__device__ __forceinline__ T narrow(typename Wide<T>::type v) { return from_float<T>(v); }
template <> __device__ __forceinline__ double narrow<double>(double v) { return v; }
template <> __device__ __forceinline__ int narrow<int>(long long v) { return (int)v; }
template <> __device__ __forceinline__ long long narrow<long long>(long long v) { return v; }

// ScatterND with a reduction: one thread per element of a slice applies every update tuple in order, so
// duplicate tuples combine deterministically (as the specification's sequential loop does) without atomics.
template <typename T, typename Op>
__device__ void scatter_nd_reduce(T* __restrict__ out, const T* __restrict__ updates,
                                  const long long* __restrict__ indices, long long tuples, long long slice, int k,
                                  Dims8 d, unsigned int* flags) {
    GRID_STRIDE_LOOP(within, slice) {
        for (long long j = 0; j < tuples; ++j) {
            T* target = out + scatter_offset(indices, j, k, d, flags) + within;
            *target = narrow<T>(Op::apply(widen(*target), widen(updates[j * slice + within])));
        }
    }
}

template <typename T>
__device__ void fill(T* __restrict__ dst, T value, long long count) {
    GRID_STRIDE_LOOP(i, count) dst[i] = value;
}

// Range: start + i * delta, rounded after the multiply and after the add exactly as the CPU provider's
// numpy arithmetic does (no fused multiply-add).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ long long mul_rn(long long a, long long b) { return a * b; }
__device__ __forceinline__ long long add_rn(long long a, long long b) { return a + b; }
#ifdef ORT_CUDA_SIM  // host code never contracts into FMAs without -mfma, and the header lacks __dmul_rn
__device__ __forceinline__ double mul_rn(double a, double b) { return a * b; }
__device__ __forceinline__ double add_rn(double a, double b) { return a + b; }
#else
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
#endif

template <typename T, typename C>
__device__ void range_fill(T* __restrict__ dst, long long count, C start, C delta) {
    GRID_STRIDE_LOOP(i, count) dst[i] = (T)add_rn(start, mul_rn((C)i, delta));
}

// A 16-bit float range computed in its own precision: each product and sum rounds to the type.
template <typename T>
__device__ void range_narrow(T* __restrict__ dst, long long count, float start, float delta) {
    GRID_STRIDE_LOOP(i, count) {
        const float product = to_float(from_float<T>(to_float(from_float<T>((float)i)) * delta));
        dst[i] = from_float<T>(product + start);
    }
}

// ---- entry points -------------------------------------------------------------------------------------------
#define WIDTH_ENTRY_POINTS(W, T)                                                                                \
    extern "C" __global__ void strided_copy_##W(T* dst, const T* src, long long count, int rank, DIMS8_PARAMS) { \
        strided_copy<T>(dst, src, count, rank, make_dims(DIMS8_ARGS));                                          \
    }                                                                                                          \
    extern "C" __global__ void copy_2d_##W(T* dst, long long dst_pitch, const T* src, long long src_pitch,     \
                                           long long cols, long long rows) {                                   \
        copy_2d<T>(dst, dst_pitch, src, src_pitch, cols, rows);                                                \
    }                                                                                                          \
    extern "C" __global__ void gather_##W##_i32(T* dst, const T* src, const int* indices, long long count,     \
                                                long long inner, long long nidx, long long axis_dim,            \
                                                unsigned int* flags) {                                          \
        gather<T, int>(dst, src, indices, count, inner, nidx, axis_dim, flags);                                \
    }                                                                                                          \
    extern "C" __global__ void gather_##W##_i64(T* dst, const T* src, const long long* indices, long long count, \
                                                long long inner, long long nidx, long long axis_dim,            \
                                                unsigned int* flags) {                                          \
        gather<T, long long>(dst, src, indices, count, inner, nidx, axis_dim, flags);                          \
    }                                                                                                          \
    extern "C" __global__ void gather_elements_##W##_i32(T* dst, const T* src, const int* indices,             \
                                                         long long count, int rank, int axis, long long axis_dim, \
                                                         DIMS8_PARAMS, unsigned int* flags) {                   \
        gather_elements<T, int>(dst, src, indices, count, rank, axis, axis_dim, make_dims(DIMS8_ARGS), flags); \
    }                                                                                                          \
    extern "C" __global__ void gather_elements_##W##_i64(T* dst, const T* src, const long long* indices,       \
                                                         long long count, int rank, int axis, long long axis_dim, \
                                                         DIMS8_PARAMS, unsigned int* flags) {                   \
        gather_elements<T, long long>(dst, src, indices, count, rank, axis, axis_dim, make_dims(DIMS8_ARGS),   \
                                      flags);                                                                  \
    }                                                                                                          \
    extern "C" __global__ void gather_nd_##W(T* dst, const T* src, const long long* indices, long long count,   \
                                             long long slice, int k, long long per_batch, long long batch_stride, \
                                             DIMS8_PARAMS, unsigned int* flags) {                              \
        gather_nd<T>(dst, src, indices, count, slice, k, per_batch, batch_stride, make_dims(DIMS8_ARGS), flags); \
    }                                                                                                          \
    extern "C" __global__ void scatter_nd_##W(T* out, const T* updates, const long long* indices, long long count, \
                                              long long slice, int k, DIMS8_PARAMS, unsigned int* flags) {     \
        scatter_nd<T>(out, updates, indices, count, slice, k, make_dims(DIMS8_ARGS), flags);                   \
    }                                                                                                          \
    extern "C" __global__ void fill_##W(T* dst, unsigned long long bits, long long count) {                    \
        fill<T>(dst, (T)bits, count);                                                                          \
    }

WIDTH_ENTRY_POINTS(u8, unsigned char)
WIDTH_ENTRY_POINTS(u16, unsigned short)
WIDTH_ENTRY_POINTS(u32, unsigned int)
WIDTH_ENTRY_POINTS(u64, unsigned long long)

#define REDUCE_ENTRY_POINT(NAME, OP, SUFFIX, T)                                                                 \
    extern "C" __global__ void scatter_nd_##NAME##_##SUFFIX(T* out, const T* updates, const long long* indices, \
                                                            long long tuples, long long slice, int k,          \
                                                            DIMS8_PARAMS, unsigned int* flags) {                \
        scatter_nd_reduce<T, OP>(out, updates, indices, tuples, slice, k, make_dims(DIMS8_ARGS), flags);       \
    }
#define REDUCE_ENTRY_POINTS(SUFFIX, T)                                                                          \
    REDUCE_ENTRY_POINT(add, ReduceAdd, SUFFIX, T)                                                               \
    REDUCE_ENTRY_POINT(mul, ReduceMul, SUFFIX, T)                                                               \
    REDUCE_ENTRY_POINT(max, ReduceMax, SUFFIX, T)                                                               \
    REDUCE_ENTRY_POINT(min, ReduceMin, SUFFIX, T)

ORT_FOR_FLOATS(REDUCE_ENTRY_POINTS)
REDUCE_ENTRY_POINTS(f64, double)
REDUCE_ENTRY_POINTS(i32, int)
REDUCE_ENTRY_POINTS(i64, long long)

#define RANGE_ENTRY_POINT(SUFFIX, T, C)                                                                          \
    extern "C" __global__ void range_##SUFFIX(T* dst, long long count, C start, C delta) {                     \
        range_fill<T, C>(dst, count, start, delta);                                                            \
    }
RANGE_ENTRY_POINT(f32, float, float)
RANGE_ENTRY_POINT(f64, double, double)
RANGE_ENTRY_POINT(i16, short, long long)
RANGE_ENTRY_POINT(i32, int, long long)
RANGE_ENTRY_POINT(i64, long long, long long)

// 16-bit float ranges: computed in float and rounded once (stash_type=1), or in the type itself.
RANGE_ENTRY_POINT(f16, __half, float)
RANGE_ENTRY_POINT(bf16, __nv_bfloat16, float)
extern "C" __global__ void range_narrow_f16(__half* dst, long long count, float start, float delta) {
    range_narrow<__half>(dst, count, start, delta);
}
extern "C" __global__ void range_narrow_bf16(__nv_bfloat16* dst, long long count, float start, float delta) {
    range_narrow<__nv_bfloat16>(dst, count, start, delta);
}
