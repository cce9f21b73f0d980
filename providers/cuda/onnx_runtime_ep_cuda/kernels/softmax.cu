// Softmax/LogSoftmax over one axis of an (outer, n, inner) view, and LayerNormalization/RMSNormalization
// over the trailing dims of a (rows, n) view. Narrow floats compute in float and round once.
//
// Softmax uses the column tiles of reduce.cuh (inner == 1, the last axis, gives one row per block with all
// threads along it); normalization runs one block per row. Each reads its row three times (max or mean,
// sum, write) rather than staging it in shared memory, so any row length works; the rereads hit L2.
#include "elementwise.cuh"
#include "reduce.cuh"

// Blocks have at most this many threads (ops/normalization.py picks the shape): the bound on the shared
// scratch of block_reduce_y.
#define NORM_THREADS 512

template <class T>
__device__ __forceinline__ void softmax(const T* __restrict__ x, T* __restrict__ y, i64 outer, i64 n, i64 inner,
                                        int log) {
    __shared__ float scratch[NORM_THREADS];
    for_each_tile(outer, inner, [&](i64 o, i64 i, bool valid) {
        const i64 base = o * n * inner + i;
        const auto load = [&](i64 r) { return x[base + r * inner]; };
        float peak = -ew_inf(), total = 0.0f;
        if (valid) for_rows(0, n, load, [&](i64, T v) { peak = nan_max(peak, (float)widen(v)); });
        peak = block_reduce_y(peak, MaxOf(), scratch);
        if (valid) for_rows(0, n, load, [&](i64, T v) { total += expf((float)widen(v) - peak); });
        total = block_reduce_y(total, SumOf(), scratch);
        if (!valid) return;
        const float log_total = logf(total);
        for_rows(0, n, load, [&](i64 r, T v) {
            const float shifted = (float)widen(v) - peak;
            y[base + r * inner] = convert<T>(log ? shifted - log_total : expf(shifted) / total);
        });
    });
}

// (x - mean) / sqrt(var + eps) * scale + bias per row, or x / sqrt(mean(x^2) + eps) * scale with `rms`.
// scale and bias hold n values or one (`*_step` 1 or 0); bias, mean_out and inv_out may be null. The
// centered second pass matches the CPU provider's variance better than E[x^2] - E[x]^2 would.
template <class T>
__device__ __forceinline__ void normalize(const T* __restrict__ x, const T* __restrict__ scale,
                                          const T* __restrict__ bias, T* __restrict__ y, float* mean_out,
                                          float* inv_out, i64 rows, i64 n, i64 scale_step, i64 bias_step, float eps,
                                          int rms) {
    __shared__ float scratch[NORM_THREADS / 32];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * n;
        const auto load = [&](i64 c) { return xr[c]; };
        float mean = 0.0f, squares = 0.0f;
        if (!rms) {
            float total = 0.0f;
            for_rows(0, n, load, [&](i64, T v) { total += (float)widen(v); });
            mean = block_reduce_y(total, SumOf(), scratch) / (float)n;
        }
        for_rows(0, n, load, [&](i64, T v) {
            const float d = (float)widen(v) - mean;
            squares += d * d;
        });
        const float inv = 1.0f / sqrtf(block_reduce_y(squares, SumOf(), scratch) / (float)n + eps);
        T* yr = y + row * n;
        for_rows(0, n, load, [&](i64 c, T value) {
            float v = ((float)widen(value) - mean) * inv * (float)widen(scale[c * scale_step]);
            if (bias != nullptr) v += (float)widen(bias[c * bias_step]);
            yr[c] = convert<T>(v);
        });
        if (threadIdx.y == 0) {
            if (mean_out != nullptr) mean_out[row] = mean;
            if (inv_out != nullptr) inv_out[row] = inv;
        }
    }
}

#define NORM_KERNELS(T, sfx)                                                                                 \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                               \
        softmax_##sfx(const T* x, T* y, i64 outer, i64 n, i64 inner, int log) {                              \
        softmax<T>(x, y, outer, n, inner, log);                                                              \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                               \
        normalize_##sfx(const T* x, const T* scale, const T* bias, T* y, float* mean_out, float* inv_out,    \
                        i64 rows, i64 n, i64 scale_step, i64 bias_step, float eps, int rms) {                \
        normalize<T>(x, scale, bias, y, mean_out, inv_out, rows, n, scale_step, bias_step, eps, rms);        \
    }
NORM_KERNELS(float, f32)
NORM_KERNELS(__half, f16)
NORM_KERNELS(__nv_bfloat16, bf16)
