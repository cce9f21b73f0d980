// Block reductions shared by the reduction, softmax and normalization kernels.
//
// Their blocks are 2-D: threadIdx.x walks `inner` (the contiguous dims after the reduced axis, so a warp's
// loads are coalesced) and threadIdx.y splits the reduced axis. blockDim.x is a power of two up to 32 (1 when
// the reduced axis is the innermost one) and the block a whole number of warps, so each warp holds
// 32 / blockDim.x rows of y that warp shuffles combine before one shared-memory step across warps.
#pragma once
#include "elementwise.cuh"

// Warp shuffles move 32 or 64 bits; narrower accumulators (bool, 8-bit integers) travel as int.
template <class T> __device__ __forceinline__ T shfl_xor(T v, int lane_mask) {
    if constexpr (sizeof(T) < 4) return (T)__shfl_xor_sync(0xffffffffu, (int)v, lane_mask);
    else return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

// Value and index of an ArgMax/ArgMin candidate; index -1 marks "no element yet".
template <class A> struct ArgPair {
    A v;
    i64 i;
};
template <class A> __device__ __forceinline__ ArgPair<A> shfl_xor(ArgPair<A> p, int lane_mask) {
    return ArgPair<A>{shfl_xor(p.v, lane_mask), __shfl_xor_sync(0xffffffffu, p.i, lane_mask)};
}

// Combines `v` over threadIdx.y with `f(a, b)` and returns the result to every thread of the column
// threadIdx.x. Every thread of the block must call it (no early exit). `scratch` holds at least
// blockDim.x * blockDim.y / 32 values; consecutive calls may reuse it.
template <class T, class F> __device__ __forceinline__ T block_reduce_y(T v, F f, T* scratch) {
    const unsigned tx = blockDim.x, tid = threadIdx.y * tx + threadIdx.x;
    const unsigned lane = tid & 31u, warp = tid >> 5, warps = (tx * blockDim.y) >> 5;
    for (unsigned offset = 16; offset >= tx; offset >>= 1) v = f(v, shfl_xor(v, (int)offset));
    __syncthreads();  // a previous call's readers are done with scratch
    if (lane < tx) scratch[warp * tx + lane] = v;
    __syncthreads();
    if (tid < tx) {  // column tid's partials sit at scratch[w * tx + tid]; only this thread reads them
        T r = scratch[tid];
        for (unsigned w = 1; w < warps; ++w) r = f(r, scratch[w * tx + tid]);
        scratch[tid] = r;
    }
    __syncthreads();
    return scratch[threadIdx.x];
}

// The loop over (outer, inner) columns, blockDim.x neighbouring columns of one outer index per block (a
// "tile"): `body(o, i, valid)` handles column i of outer index o. Every thread runs every iteration (block
// reductions inside need all of them); `valid` is false for columns past `inner`.
template <class Body> __device__ __forceinline__ void for_each_tile(i64 outer, i64 inner, Body body) {
    const i64 per_row = (inner + blockDim.x - 1) / blockDim.x;
    for (i64 tile = blockIdx.x; tile < outer * per_row; tile += gridDim.x) {
        const i64 o = tile / per_row;
        const i64 i = (tile - o * per_row) * blockDim.x + threadIdx.x;
        body(o, i, i < inner);
    }
}

// Visits this thread's rows of a column, r = begin + threadIdx.y, then every blockDim.y-th below `end`, in
// order: use(r, load(r)). U loads are issued before they are used (as grid_stride does), so a thread keeps
// several in flight; `use` stays a rolled loop and is compiled once.
template <int U = 8, class Load, class Use>
__device__ __forceinline__ void for_rows(i64 begin, i64 end, Load load, Use use) {
    typedef decltype(load(i64(0))) V;
    const i64 step = blockDim.y;
    for (i64 r = begin + threadIdx.y; r < end; r += U * step) {
        V v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (r + u * step < end) v[u] = load(r + u * step);
        }
#pragma unroll 1
        for (int u = 0; u < U; ++u) {
            if (r + u * step < end) use(r + u * step, v[0]);
#pragma unroll
            for (int k = 0; k + 1 < U; ++k) v[k] = v[k + 1];
        }
    }
}

struct SumOf {
    template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOf {
    template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return nan_max(a, b); }
};
