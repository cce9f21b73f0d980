// The per-channel normalizations of CNNs over NCHW-like tensors viewed as (n, channels, spatial):
// BatchNormalization in inference mode and LocalResponseNormalization (LRN). Both are elementwise given
// per-channel data, so one grid-stride thread per element; narrow floats compute in float.
#include "float_io.cuh"

typedef long long i64;

// BatchNormalization with the running statistics: y = (x - mean[c]) * scale[c] / sqrt(var[c] + eps) + bias[c].
// The four parameter vectors have the element type of x (ops/channel_norm.py declines other mixes).
template <typename T>
__device__ __forceinline__ void batch_norm(const T* __restrict__ x, const T* __restrict__ scale,
                                           const T* __restrict__ bias, const T* __restrict__ mean,
                                           const T* __restrict__ var, T* __restrict__ y, i64 count, i64 channels,
                                           i64 spatial, float epsilon) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < count; i += (i64)gridDim.x * blockDim.x) {
        const i64 c = (i / spatial) % channels;
        const float gain = to_float(scale[c]) * rsqrtf(to_float(var[c]) + epsilon);
        y[i] = from_float<T>((to_float(x[i]) - to_float(mean[c])) * gain + to_float(bias[c]));
    }
}

// LRN across channels: y = x / (bias + alpha / size * sum of x^2 over channels [c - lo, c + hi]) ^ beta with
// lo = floor((size - 1) / 2), hi = ceil((size - 1) / 2), clipped to the tensor's channels.
template <typename T>
__device__ __forceinline__ void lrn(const T* __restrict__ x, T* __restrict__ y, i64 count, i64 channels,
                                    i64 spatial, int size, float alpha, float beta, float bias) {
    const int lo = (size - 1) / 2, hi = size - 1 - lo;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < count; i += (i64)gridDim.x * blockDim.x) {
        const i64 c = (i / spatial) % channels;
        const i64 first = c - lo < 0 ? 0 : c - lo, last = c + hi >= channels ? channels - 1 : c + hi;
        const T* column = x + (i - c * spatial);  // this position in channel 0
        float squares = 0.0f;
        for (i64 k = first; k <= last; ++k) {
            const float v = to_float(column[k * spatial]);
            squares += v * v;
        }
        y[i] = from_float<T>(to_float(x[i]) * powf(bias + alpha / size * squares, -beta));
    }
}

#define CHANNEL_NORM_KERNELS(SUFFIX, T)                                                                        \
    extern "C" __global__ void batch_norm_##SUFFIX(const T* x, const T* scale, const T* bias, const T* mean,   \
                                                   const T* var, T* y, i64 count, i64 channels, i64 spatial,   \
                                                   float epsilon) {                                            \
        batch_norm<T>(x, scale, bias, mean, var, y, count, channels, spatial, epsilon);                        \
    }                                                                                                          \
    extern "C" __global__ void lrn_##SUFFIX(const T* x, T* y, i64 count, i64 channels, i64 spatial, int size,  \
                                            float alpha, float beta, float bias) {                             \
        lrn<T>(x, y, count, channels, spatial, size, alpha, beta, bias);                                       \
    }

ORT_FOR_FLOATS(CHANNEL_NORM_KERNELS)
