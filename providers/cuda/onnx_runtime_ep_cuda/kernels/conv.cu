// 2-D convolution and pooling over NCHW tensors (1-D ones run as height-1 2-D ones).
//
// conv2d_igemm: an implicit GEMM per group. Output channels of the group are the rows, output pixels of
// every image (n, oy, ox) the columns, and (input channel, ky, kx) the reduction; the input "matrix" is never
// built: each 64x16 slab is gathered from x straight into shared memory, zero outside the padded input.
// Launch: 256 threads; grid (ceil(N*OH*OW / 64), min(ceil(Mg / 64), 65535), min(groups, 65535)).
//
// conv2d_direct: one thread per output for convolutions whose groups have one input channel each
// (depthwise), where a GEMM tile would be almost all padding. Pooling kernels are one thread per output too.
// Everything accumulates in float and is stored in the tensor's type.
#include "float_io.cuh"
#include "tile_fma.cuh"

#define CONV_TILE 64
#define CONV_TK 16
#define CONV_THREADS 256

// Shapes and window geometry shared by every kernel here: input (planes, h, w) -> output (oh, ow),
// window kh x kw, strides, leading pads, dilations.
#define WINDOW_PARAMS                                                                                      \
    long long h, long long w, long long oh, long long ow, int kh, int kw, int sh, int sw, int ph, int pw, int dh, \
        int dw

template <typename T>
__device__ void conv2d_igemm(const T* __restrict__ x, const T* __restrict__ wt, const T* __restrict__ bias,
                             T* __restrict__ y, long long batch, long long channels, long long outputs,
                             long long groups, WINDOW_PARAMS) {
    __shared__ float tile_a[CONV_TK][CONV_TILE + 1];
    __shared__ float tile_b[CONV_TK][CONV_TILE + 1];
    const long long cg = channels / groups, mg = outputs / groups;
    const long long taps = (long long)kh * kw, kdim = cg * taps, pixels = oh * ow, cols = batch * pixels;
    const int t = threadIdx.x, tx = t % 16, ty = t / 16;
    // Each thread gathers the same input column on every slab: decompose it once.
    const long long col0 = (long long)blockIdx.x * CONV_TILE;
    const long long my_col = col0 + t % CONV_TILE;
    const bool col_ok = my_col < cols;
    const long long my_n = col_ok ? my_col / pixels : 0, my_pix = col_ok ? my_col % pixels : 0;
    const long long base_y = (my_pix / ow) * sh - ph, base_x = (my_pix % ow) * sw - pw;
    const long long tiles_m = (mg + CONV_TILE - 1) / CONV_TILE;
    for (long long g = blockIdx.z; g < groups; g += gridDim.z) {
        const T* xg = x + (my_n * channels + g * cg) * h * w;
        const T* wg = wt + g * mg * kdim;
        for (long long tm = blockIdx.y; tm < tiles_m; tm += gridDim.y) {
            const long long row0 = tm * CONV_TILE;
            float acc[4][4] = {};
            for (long long k0 = 0; k0 < kdim; k0 += CONV_TK) {
                for (int e = 0; e < CONV_TILE * CONV_TK / CONV_THREADS; ++e) {
                    const int lin = t + e * CONV_THREADS;
                    const int ai = lin / CONV_TK, ak = lin % CONV_TK;
                    const long long gi = row0 + ai, gk = k0 + ak;
                    tile_a[ak][ai] = (gi < mg && gk < kdim) ? to_float(wg[gi * kdim + gk]) : 0.0f;
                    const int bk = lin / CONV_TILE;
                    const long long kk = k0 + bk;
                    float v = 0.0f;
                    if (col_ok && kk < kdim) {
                        const long long c = kk / taps, tap = kk % taps;
                        const long long iy = base_y + (tap / kw) * dh, ix = base_x + (tap % kw) * dw;
                        if (iy >= 0 && iy < h && ix >= 0 && ix < w) v = to_float(xg[(c * h + iy) * w + ix]);
                    }
                    tile_b[bk][t % CONV_TILE] = v;
                }
                __syncthreads();
                tile_fma_4x4<CONV_TK, CONV_TILE + 1>(tile_a, tile_b, ty, tx, acc);
                __syncthreads();
            }
            for (int q = 0; q < 4; ++q) {
                const long long col = col0 + tx + 16 * q;
                if (col >= cols) continue;
                const long long img = col / pixels, pix = col % pixels;
                for (int r = 0; r < 4; ++r) {
                    const long long row = row0 + ty + 16 * r;
                    if (row >= mg) continue;
                    const long long channel = g * mg + row;
                    const float b = bias ? to_float(bias[channel]) : 0.0f;
                    y[(img * outputs + channel) * pixels + pix] = from_float<T>(acc[r][q] + b);
                }
            }
        }
    }
}

// Groups of one input channel: output channel m reads input channel m / (outputs / channels).
template <typename T>
__device__ void conv2d_direct(const T* __restrict__ x, const T* __restrict__ wt, const T* __restrict__ bias,
                              T* __restrict__ y, long long batch, long long channels, long long outputs,
                              WINDOW_PARAMS) {
    const long long total = batch * outputs * oh * ow, per_channel = outputs / channels;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long ox = i % ow, oy = (i / ow) % oh, plane = i / (ow * oh);
        const long long m = plane % outputs, img = plane / outputs;
        const T* xp = x + (img * channels + m / per_channel) * h * w;
        const T* wp = wt + m * kh * kw;
        float acc = bias ? to_float(bias[m]) : 0.0f;
        for (int ky = 0; ky < kh; ++ky) {
            const long long iy = oy * sh - ph + (long long)ky * dh;
            if (iy < 0 || iy >= h) continue;
            for (int kx = 0; kx < kw; ++kx) {
                const long long ix = ox * sw - pw + (long long)kx * dw;
                if (ix >= 0 && ix < w) acc = fmaf(to_float(xp[iy * w + ix]), to_float(wp[ky * kw + kx]), acc);
            }
        }
        y[i] = from_float<T>(acc);
    }
}

// Max over each window; taps in the padding or past a ceil_mode edge are skipped. NaN wins, as in
// numpy's maximum. `indices` (optional) gets the flat input index of the max: row-major within the
// plane, or column-major when `column_major` (MaxPool's storage_order=1).
template <typename T>
__device__ void max_pool2d(const T* __restrict__ x, T* __restrict__ y, long long* __restrict__ indices,
                           long long planes, WINDOW_PARAMS, int column_major) {
    const long long total = planes * oh * ow, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long ox = i % ow, oy = (i / ow) % oh, plane = i / (ow * oh);
        const T* xp = x + plane * h * w;
        float best = __int_as_float(0xff800000);  // -inf
        long long best_y = -1, best_x = -1;
        for (int ky = 0; ky < kh; ++ky) {
            const long long iy = oy * sh - ph + (long long)ky * dh;
            if (iy < 0 || iy >= h) continue;
            for (int kx = 0; kx < kw; ++kx) {
                const long long ix = ox * sw - pw + (long long)kx * dw;
                if (ix < 0 || ix >= w) continue;
                const float v = to_float(xp[iy * w + ix]);
                if (best_y < 0 || v > best || (v != v && best == best)) {
                    best = v;
                    best_y = iy;
                    best_x = ix;
                }
            }
        }
        y[i] = from_float<T>(best);
        if (indices) {
            const long long at = best_y < 0 ? 0 : (column_major ? best_x * h + best_y : best_y * w + best_x);
            indices[i] = plane * h * w + at;
        }
    }
}

// Mean over each window. The divisor counts the taps inside the input, or with count_include_pad the
// taps inside the declared pads as well (pe_h/pe_w: trailing pads); a ceil_mode overhang never counts.
template <typename T>
__device__ void average_pool2d(const T* __restrict__ x, T* __restrict__ y, long long planes, WINDOW_PARAMS,
                               int pe_h, int pe_w, int count_include_pad) {
    const long long total = planes * oh * ow, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long ox = i % ow, oy = (i / ow) % oh, plane = i / (ow * oh);
        const T* xp = x + plane * h * w;
        float sum = 0.0f;
        long long count = 0;
        for (int ky = 0; ky < kh; ++ky) {
            const long long iy = oy * sh - ph + (long long)ky * dh;
            const bool row_in = iy >= 0 && iy < h;
            const bool row_counted = count_include_pad ? (iy >= -ph && iy < h + pe_h) : row_in;
            for (int kx = 0; kx < kw; ++kx) {
                const long long ix = ox * sw - pw + (long long)kx * dw;
                const bool col_in = ix >= 0 && ix < w;
                if (row_in && col_in) sum += to_float(xp[iy * w + ix]);
                if (row_counted && (count_include_pad ? (ix >= -pw && ix < w + pe_w) : col_in)) ++count;
            }
        }
        y[i] = from_float<T>(count ? sum / (float)count : 0.0f);
    }
}

// One block per (n, c) plane at a time: a strided partial sum per thread, then a shuffle and
// shared-memory reduction. Launch with a multiple of 32 threads, at most 1,024.
template <typename T>
__device__ void global_average_pool(const T* __restrict__ x, T* __restrict__ y, long long planes, long long size) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (long long plane = blockIdx.x; plane < planes; plane += gridDim.x) {
        const T* xp = x + plane * size;
        float sum = 0.0f;
        for (long long i = threadIdx.x; i < size; i += blockDim.x) sum += to_float(xp[i]);
        for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
        if (lane == 0) partial[warp] = sum;
        __syncthreads();
        if (warp == 0) {
            sum = lane < warps ? partial[lane] : 0.0f;
            for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
            if (lane == 0) y[plane] = from_float<T>(sum / (float)size);
        }
        __syncthreads();  // partial[] is reused by the next plane
    }
}

#define WINDOW_ARGS h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw
#define CONV_ENTRY_POINTS(SUFFIX, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(CONV_THREADS)                                              \
        conv2d_igemm_##SUFFIX(const T* x, const T* wt, const T* bias, T* y, long long batch, long long channels, \
                              long long outputs, long long groups, WINDOW_PARAMS) {                          \
        conv2d_igemm<T>(x, wt, bias, y, batch, channels, outputs, groups, WINDOW_ARGS);                     \
    }                                                                                                       \
    extern "C" __global__ void conv2d_direct_##SUFFIX(const T* x, const T* wt, const T* bias, T* y,          \
                                                      long long batch, long long channels, long long outputs, \
                                                      WINDOW_PARAMS) {                                      \
        conv2d_direct<T>(x, wt, bias, y, batch, channels, outputs, WINDOW_ARGS);                            \
    }                                                                                                       \
    extern "C" __global__ void max_pool2d_##SUFFIX(const T* x, T* y, long long* indices, long long planes,   \
                                                   WINDOW_PARAMS, int column_major) {                       \
        max_pool2d<T>(x, y, indices, planes, WINDOW_ARGS, column_major);                                    \
    }                                                                                                       \
    extern "C" __global__ void average_pool2d_##SUFFIX(const T* x, T* y, long long planes, WINDOW_PARAMS,    \
                                                       int pe_h, int pe_w, int count_include_pad) {         \
        average_pool2d<T>(x, y, planes, WINDOW_ARGS, pe_h, pe_w, count_include_pad);                        \
    }                                                                                                       \
    extern "C" __global__ void global_average_pool_##SUFFIX(const T* x, T* y, long long planes, long long size) { \
        global_average_pool<T>(x, y, planes, size);                                                         \
    }

ORT_FOR_FLOATS(CONV_ENTRY_POINTS)

// MaxPool also takes 8-bit integers (opset 12).
#define MAX_POOL_ENTRY_POINT(SUFFIX, T)                                                                      \
    extern "C" __global__ void max_pool2d_##SUFFIX(const T* x, T* y, long long* indices, long long planes,   \
                                                   WINDOW_PARAMS, int column_major) {                       \
        max_pool2d<T>(x, y, indices, planes, WINDOW_ARGS, column_major);                                    \
    }
MAX_POOL_ENTRY_POINT(i8, signed char)
MAX_POOL_ENTRY_POINT(u8, unsigned char)
