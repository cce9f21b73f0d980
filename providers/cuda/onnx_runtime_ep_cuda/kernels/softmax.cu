// Softmax/LogSoftmax over one axis of an (outer, n, inner) view, and LayerNormalization/RMSNormalization
// over the trailing dims of a (rows, n) view. Narrow floats compute in float and round once.
//
// A row of the last axis (and every normalization row) is read once into registers when it fits in
// ROW_CACHE values per thread: all of a thread's loads are then in flight together and the later passes
// (sum, write) cost no memory traffic. Longer rows, and softmax over an inner axis (reduce.cuh's column
// tiles), stream from memory once per pass instead; the rereads mostly hit L2.
#include "elementwise.cuh"
#include "reduce.cuh"

// Blocks have at most this many threads (ops/normalization.py picks the shape): the bound on the shared
// scratch of block_reduce_y.
#define NORM_THREADS 512
// Values per thread of a register-cached row: rows up to ROW_CACHE * NORM_THREADS elements are cached.
#define ROW_CACHE 16

// Loads this thread's values of a row of n (element c = threadIdx.y + k * blockDim.y), `fill` past the end.
template <class T>
__device__ __forceinline__ void cache_row(const T* __restrict__ row, i64 n, float fill, float (&v)[ROW_CACHE]) {
#pragma unroll
    for (int k = 0; k < ROW_CACHE; ++k) {
        const int c = threadIdx.y + k * blockDim.y;  // < ROW_CACHE * NORM_THREADS
        v[k] = c < n ? (float)widen(row[c]) : fill;
    }
}

// Softmax of one last-axis row held in registers (blockDim.x is 1 here).
template <class T>
__device__ __forceinline__ void softmax_cached_row(const T* __restrict__ x, T* __restrict__ y, i64 n, int log,
                                                   float* scratch) {
    float v[ROW_CACHE];
    cache_row(x, n, -ew_inf(), v);
    float peak = -ew_inf(), total = 0.0f;
#pragma unroll
    for (int k = 0; k < ROW_CACHE; ++k) peak = nan_max(peak, v[k]);
    peak = block_reduce_y(peak, MaxOf(), scratch);
#pragma unroll
    for (int k = 0; k < ROW_CACHE; ++k) {
        if (threadIdx.y + k * blockDim.y < n) total += expf(v[k] - peak);
    }
    total = block_reduce_y(total, SumOf(), scratch);
    const float log_total = logf(total);
#pragma unroll
    for (int k = 0; k < ROW_CACHE; ++k) {
        const int c = threadIdx.y + k * blockDim.y;  // < ROW_CACHE * NORM_THREADS
        if (c < n) y[c] = convert<T>(log ? v[k] - peak - log_total : expf(v[k] - peak) / total);
    }
}

template <class T>
__device__ __forceinline__ void softmax(const T* __restrict__ x, T* __restrict__ y, i64 outer, i64 n, i64 inner,
                                        int log) {
    __shared__ float scratch[NORM_THREADS];
    if (inner == 1 && n <= (i64)ROW_CACHE * blockDim.y) {
        for (i64 o = blockIdx.x; o < outer; o += gridDim.x) softmax_cached_row(x + o * n, y + o * n, n, log, scratch);
        return;
    }
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

// One normalization row streamed from memory (rows too long for the register cache): three passes.
// Returns 1 / sqrt(var + eps) and sets `mean` (0 with `rms`).
template <class T>
__device__ __forceinline__ float normalize_streamed_row(const T* __restrict__ xr, const T* __restrict__ scale,
                                                        const T* __restrict__ bias, T* __restrict__ yr, i64 n,
                                                        i64 scale_step, i64 bias_step, float eps, int rms,
                                                        float* scratch, float& mean) {
    const auto load = [&](i64 c) { return xr[c]; };
    float squares = 0.0f;
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
    for_rows(0, n, load, [&](i64 c, T value) {
        float v = ((float)widen(value) - mean) * inv * (float)widen(scale[c * scale_step]);
        if (bias != nullptr) v += (float)widen(bias[c * bias_step]);
        yr[c] = convert<T>(v);
    });
    return inv;
}

// (x - mean) / sqrt(var + eps) * scale + bias per row, or x / sqrt(mean(x^2) + eps) * scale with `rms`, one
// block (blockDim.x 1) per row. scale and bias hold n values or one (`*_step` 1 or 0); bias, mean_out and
// inv_out may be null. The variance is the mean of squared deviations from the mean (a second pass over the
// cached or streamed row), which tracks the CPU provider better than E[x^2] - E[x]^2 would.
template <class T>
__device__ __forceinline__ void normalize(const T* __restrict__ x, const T* __restrict__ scale,
                                          const T* __restrict__ bias, T* __restrict__ y, float* mean_out,
                                          float* inv_out, i64 rows, i64 n, i64 scale_step, i64 bias_step, float eps,
                                          int rms) {
    __shared__ float scratch[NORM_THREADS / 32];
    const bool cached = n <= (i64)ROW_CACHE * blockDim.y;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * n;
        T* yr = y + row * n;
        float mean = 0.0f, inv;
        if (cached) {
            float v[ROW_CACHE];
            cache_row(xr, n, 0.0f, v);
            if (!rms) {
                float total = 0.0f;
#pragma unroll
                for (int k = 0; k < ROW_CACHE; ++k) total += v[k];
                mean = block_reduce_y(total, SumOf(), scratch) / (float)n;
            }
            float squares = 0.0f;
#pragma unroll
            for (int k = 0; k < ROW_CACHE; ++k) {
                const float d = threadIdx.y + k * blockDim.y < n ? v[k] - mean : 0.0f;
                squares += d * d;
            }
            inv = 1.0f / sqrtf(block_reduce_y(squares, SumOf(), scratch) / (float)n + eps);
#pragma unroll
            for (int k = 0; k < ROW_CACHE; ++k) {
                const int c = threadIdx.y + k * blockDim.y;  // < ROW_CACHE * NORM_THREADS
                if (c < n) {
                    float out = (v[k] - mean) * inv * (float)widen(scale[c * scale_step]);
                    if (bias != nullptr) out += (float)widen(bias[c * bias_step]);
                    yr[c] = convert<T>(out);
                }
            }
        } else {
            inv = normalize_streamed_row(xr, scale, bias, yr, n, scale_step, bias_step, eps, rms, scratch, mean);
        }
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
