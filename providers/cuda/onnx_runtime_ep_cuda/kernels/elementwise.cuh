// Element types, conversions and limits shared by the elementwise, reduction and softmax/normalization kernels.
//
// Narrow floats (__half, __nv_bfloat16) are storage types: every kernel widens them to float, computes in
// float and rounds once when storing. Integer and bool values compute in their own type. NVRTC has no
// standard library, so the few traits and limits needed are defined here.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

template <class T> struct ew_is_float { static constexpr bool value = false; };
template <> struct ew_is_float<float> { static constexpr bool value = true; };
template <> struct ew_is_float<double> { static constexpr bool value = true; };

template <class T> struct ew_is_bool { static constexpr bool value = false; };
template <> struct ew_is_bool<bool> { static constexpr bool value = true; };

template <class T> struct ew_is_signed { static constexpr bool value = T(-1) < T(0); };

// The type a value computes in: float for the narrow floats, the type itself otherwise.
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T> __device__ __forceinline__ T widen(T v) { return v; }
template <class T> using wide_t = decltype(widen(T()));

// Conversion to a storage type. Floats become narrow integers through a 64-bit integer, so out-of-range
// values wrap as numpy's casts do on x86 instead of saturating as a direct GPU conversion would.
template <class T> struct Narrow {
    template <class V> static __device__ __forceinline__ T from(V v) {
        if constexpr (ew_is_float<V>::value && !ew_is_float<T>::value && sizeof(T) < 4) {
            return (T)(i64)v;
        } else {
            return (T)v;
        }
    }
};
template <> struct Narrow<__half> {
    template <class V> static __device__ __forceinline__ __half from(V v) { return __float2half_rn((float)v); }
};
template <> struct Narrow<__nv_bfloat16> {
    template <class V> static __device__ __forceinline__ __nv_bfloat16 from(V v) {
        return __float2bfloat16_rn((float)v);
    }
};
template <> struct Narrow<bool> {
    template <class V> static __device__ __forceinline__ bool from(V v) { return v != V(0); }
};

template <class To, class From> __device__ __forceinline__ To convert(From v) {
    return Narrow<To>::from(widen(v));
}

__device__ __forceinline__ float ew_inf() { return __int_as_float(0x7f800000); }

// Identities of max and min reductions: -inf/+inf for floats, the extreme values for integers.
template <class T> struct Limits {
    static __device__ __forceinline__ T lowest() {
        if constexpr (ew_is_signed<T>::value) return (T)((u64)1 << (sizeof(T) * 8 - 1));
        else return (T)0;
    }
    static __device__ __forceinline__ T highest() { return (T)~lowest(); }
};
template <> struct Limits<float> {
    static __device__ __forceinline__ float lowest() { return -ew_inf(); }
    static __device__ __forceinline__ float highest() { return ew_inf(); }
};
template <> struct Limits<bool> {
    static __device__ __forceinline__ bool lowest() { return false; }
    static __device__ __forceinline__ bool highest() { return true; }
};

template <class T> __device__ __forceinline__ bool is_nan(T v) {
    if constexpr (ew_is_float<T>::value) return v != v;
    else return false;
}

// numpy's maximum/minimum: a NaN on either side wins.
template <class T> __device__ __forceinline__ T nan_max(T a, T b) { return (is_nan(a) || a > b) ? a : b; }
template <class T> __device__ __forceinline__ T nan_min(T a, T b) { return (is_nan(a) || a < b) ? a : b; }

// Elements per thread per grid-stride step: enough independent loads in flight to cover memory latency
// (one 4-byte load per thread leaves HBM half idle). ops/elementwise.py sizes grids with the same number.
#define EW_UNROLL 4

// For every i in [0, n): store(i, load(i)), grid-stride. Each thread takes EW_UNROLL elements blockDim.x
// apart per step (each load instruction stays coalesced) and issues all their loads first. `load` should
// only read (raw values, index math); the math belongs in `store`, whose loop stays rolled so a big op
// switch is compiled once, not EW_UNROLL times (the loaded values shift through a register queue).
// Index math is 32-bit when n fits: 64-bit division, which broadcasting needs, is slow on a GPU.
template <int U, class I, class Load, class Store>
__device__ __forceinline__ void grid_stride_as(I n, Load load, Store store) {
    typedef decltype(load(I(0))) V;
    const I step = (I)gridDim.x * blockDim.x * EW_UNROLL;
    for (I base = (I)blockIdx.x * blockDim.x * EW_UNROLL + threadIdx.x; base < n; base += step) {
#pragma unroll 1
        for (int outer = 0; outer < EW_UNROLL; outer += U) {
            V v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const I i = base + (I)(outer + u) * blockDim.x;
                if (i < n) v[u] = load(i);
            }
#pragma unroll 1
            for (int u = 0; u < U; ++u) {
                const I i = base + (I)(outer + u) * blockDim.x;
                if (i < n) store(i, v[0]);
#pragma unroll
                for (int k = 0; k + 1 < U; ++k) v[k] = v[k + 1];
            }
        }
    }
}

// `U` loads in flight per thread (EW_UNROLL, or 1 where the index math is heavy enough to hide latency
// itself and unrolling it would mostly grow the code NVRTC compiles). Tensors of 2^31 elements and more take
// the 64-bit path one element at a time: they are rare.
template <int U = EW_UNROLL, class Load, class Store>
__device__ __forceinline__ void grid_stride(i64 n, Load load, Store store) {
    if (n <= 0x7fffffffLL) grid_stride_as<U, u32>((u32)n, load, store);
    else grid_stride_as<1, u64>((u64)n, load, store);
}

// Two loaded operands.
template <class A, class B> struct Operands {
    A a;
    B b;
};
