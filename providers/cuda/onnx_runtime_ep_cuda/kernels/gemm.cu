// Batched GEMM behind MatMul and Gemm: y[z] = alpha * op(A)[z] (m x k) * op(B)[z] (k x n) + beta * C.
//
// Operands are addressed through strides, so transposes and broadcast batch dimensions cost no copies:
// A(i, l) = a[a_off(z) + i*a_sm + l*a_sk], B(l, j) = b[b_off(z) + l*b_sk + j*b_sn], C(i, j) = c[i*c_sm + j*c_sn]
// (strides of 0 broadcast C). Batch offsets are z*a_bs and z*b_bs, or (a_off, b_off) pairs read from
// `offsets` when the batch dimensions broadcast in a pattern no single stride describes. y is a dense
// row-major (m, n) matrix per batch entry. Accumulation is in float for every storage type.
//
// Launch: 256 threads per block; grid (ceil(n/64), min(ceil(m/64), 65535), min(batch, 65535)). Blocks
// stride over row tiles and batch entries, so any m and batch fit the grid limits.
//
// Two bodies share that launch shape: a shared-memory tiled kernel (64x64 output tile, 4x4 outputs per
// thread) for every type and architecture, and for float16/bfloat16 on sm_80+ a tensor-core kernel issuing
// mma.sync.m16n8k16 (8 warps, each a 32x16 slice of the 64x64 tile) with float accumulators.
#include "float_io.cuh"
#include "tile_fma.cuh"

#define GEMM_TILE 64
#define GEMM_THREADS 256

#define GEMM_PARAMS(T)                                                                                        \
    const T *__restrict__ a, const T *__restrict__ b, const T *__restrict__ c, T *__restrict__ y, long long m, \
        long long n, long long k, long long a_sm, long long a_sk, long long b_sk, long long b_sn, long long c_sm, \
        long long c_sn, long long batch, long long a_bs, long long b_bs, const long long *__restrict__ offsets,  \
        float alpha, float beta
#define GEMM_ARGS a, b, c, y, m, n, k, a_sm, a_sk, b_sk, b_sn, c_sm, c_sn, batch, a_bs, b_bs, offsets, alpha, beta

template <typename T>
__device__ __forceinline__ void store_output(T* y, const T* c, long long m, long long n, long long i, long long j,
                                             long long c_sm, long long c_sn, float value, float alpha, float beta) {
    if (i >= m || j >= n) return;
    float out = alpha * value;
    if (c != nullptr) out += beta * to_float(c[i * c_sm + j * c_sn]);
    y[i * n + j] = from_float<T>(out);
}

// The portable body: 16-deep slabs of A and B staged in shared memory as float; thread (ty, tx) owns rows
// ty + 16r and columns tx + 16c of the tile, so neighbouring threads read neighbouring shared words.
template <typename T>
__device__ void gemm_tiled(GEMM_PARAMS(T)) {
    constexpr int TK = 16;
    __shared__ float tile_a[TK][GEMM_TILE + 1];
    __shared__ float tile_b[TK][GEMM_TILE + 1];
    const int t = threadIdx.x, tx = t % 16, ty = t / 16;
    const long long tiles_m = (m + GEMM_TILE - 1) / GEMM_TILE;
    const long long col0 = (long long)blockIdx.x * GEMM_TILE;
    for (long long z = blockIdx.z; z < batch; z += gridDim.z) {
        const T* A = a + (offsets ? offsets[2 * z] : z * a_bs);
        const T* B = b + (offsets ? offsets[2 * z + 1] : z * b_bs);
        T* Y = y + z * m * n;
        for (long long tm = blockIdx.y; tm < tiles_m; tm += gridDim.y) {
            const long long row0 = tm * GEMM_TILE;
            float acc[4][4] = {};
            for (long long k0 = 0; k0 < k; k0 += TK) {
                for (int e = 0; e < GEMM_TILE * TK / GEMM_THREADS; ++e) {
                    const int lin = t + e * GEMM_THREADS;
                    const int ai = lin / TK, ak = lin % TK;
                    const long long gi = row0 + ai, gk = k0 + ak;
                    tile_a[ak][ai] = (gi < m && gk < k) ? to_float(A[gi * a_sm + gk * a_sk]) : 0.0f;
                    const int bk = lin / GEMM_TILE, bj = lin % GEMM_TILE;
                    const long long gl = k0 + bk, gj = col0 + bj;
                    tile_b[bk][bj] = (gl < k && gj < n) ? to_float(B[gl * b_sk + gj * b_sn]) : 0.0f;
                }
                __syncthreads();
                tile_fma_4x4<TK, GEMM_TILE + 1>(tile_a, tile_b, ty, tx, acc);
                __syncthreads();
            }
            for (int r = 0; r < 4; ++r) {
                for (int q = 0; q < 4; ++q) {
                    store_output(Y, c, m, n, row0 + ty + 16 * r, col0 + tx + 16 * q, c_sm, c_sn, acc[r][q], alpha,
                                 beta);
                }
            }
        }
    }
}

// GEMM_EMULATE_MMA (a compile option, for tests) runs the tensor-core body on the simulator with each
// mma.sync computed from warp shuffles under the same fragment layouts, so its shared-memory staging,
// fragment loads and epilogue are checked without a GPU.
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800) || (defined(ORT_CUDA_SIM) && defined(GEMM_EMULATE_MMA))
#define GEMM_TENSOR_CORES 1
#endif

#ifdef GEMM_TENSOR_CORES
#ifdef ORT_CUDA_SIM
__device__ __forceinline__ float raw_to_float(unsigned bits, bool bf16) {
    const unsigned short raw = (unsigned short)(bits & 0xffffu);
    return bf16 ? __bfloat162float(__ushort_as_bfloat16(raw)) : __half2float(__ushort_as_half(raw));
}

// d += A (16x16) * B (16x8) where lane l holds A(g, 2q..2q+1), A(g+8, ..), A(g, 2q+8..), A(g+8, 2q+8..) in
// fa[0..3] and B(2q..2q+1, g), B(2q+8.., g) in fb[0..1] (g = l / 4, q = l % 4), and gets D(g, 2q..2q+1) and
// D(g+8, 2q..2q+1) in d[0..3]: the PTX ISA's m16n8k16 fragment layouts.
template <bool BF16>
__device__ void mma_16816(float (&d)[4], const unsigned (&fa)[4], const unsigned (&fb)[2]) {
    unsigned a[32][4], b[32][2];
    for (int src = 0; src < 32; ++src) {
        for (int r = 0; r < 4; ++r) a[src][r] = __shfl_sync(0xffffffffu, fa[r], src);
        for (int r = 0; r < 2; ++r) b[src][r] = __shfl_sync(0xffffffffu, fb[r], src);
    }
    const int lane = threadIdx.x % 32, group = lane >> 2, quad = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const int row = group + (i >= 2 ? 8 : 0), col = quad * 2 + (i & 1);
        for (int k = 0; k < 16; ++k) {
            const int half = k & 1, pair = (k & 7) >> 1, high_k = k >= 8 ? 1 : 0;
            const unsigned av = a[(row & 7) * 4 + pair][(row >= 8 ? 1 : 0) + 2 * high_k] >> (16 * half);
            const unsigned bv = b[col * 4 + pair][high_k] >> (16 * half);
            d[i] += raw_to_float(av, BF16) * raw_to_float(bv, BF16);
        }
    }
}
#else
// One m16n8k16 tensor-core product with float accumulators (PTX ISA fragment layouts: A row-major,
// B column-major, two 16-bit elements per 32-bit register, the lower index in the low half).
template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&fa)[4], const unsigned (&fb)[2]) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(fa[0]), "r"(fa[1]), "r"(fa[2]), "r"(fa[3]), "r"(fb[0]), "r"(fb[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(fa[0]), "r"(fa[1]), "r"(fa[2]), "r"(fa[3]), "r"(fb[0]), "r"(fb[1]));
    }
}
#endif

// The sm_80+ body for 16-bit types: 32-deep slabs of raw 16-bit elements in shared memory, A as [m][k]
// and B as [n][k] so both fragments are pairs of k-adjacent elements (one 32-bit load each). The +8
// padding spreads a fragment load's eight rows over distinct banks.
template <typename T, bool BF16>
__device__ void gemm_mma(GEMM_PARAMS(T)) {
    constexpr int TK = 32, PITCH = TK + 8;
    __shared__ __align__(16) unsigned short tile_a[GEMM_TILE][PITCH];
    __shared__ __align__(16) unsigned short tile_b[GEMM_TILE][PITCH];
    const int t = threadIdx.x, warp = t / 32, lane = t % 32, group = lane >> 2, quad = lane & 3;
    const int warp_row = (warp / 4) * 32, warp_col = (warp % 4) * 16;
    const long long tiles_m = (m + GEMM_TILE - 1) / GEMM_TILE;
    const long long col0 = (long long)blockIdx.x * GEMM_TILE;
    for (long long z = blockIdx.z; z < batch; z += gridDim.z) {
        const unsigned short* A = reinterpret_cast<const unsigned short*>(a + (offsets ? offsets[2 * z] : z * a_bs));
        const unsigned short* B =
            reinterpret_cast<const unsigned short*>(b + (offsets ? offsets[2 * z + 1] : z * b_bs));
        T* Y = y + z * m * n;
        for (long long tm = blockIdx.y; tm < tiles_m; tm += gridDim.y) {
            const long long row0 = tm * GEMM_TILE;
            float acc[2][2][4] = {};
            for (long long k0 = 0; k0 < k; k0 += TK) {
#pragma unroll
                for (int e = 0; e < GEMM_TILE * TK / GEMM_THREADS; ++e) {
                    const int lin = t + e * GEMM_THREADS;
                    const int ai = lin / TK, ak = lin % TK;
                    const long long gi = row0 + ai, gk = k0 + ak;
                    tile_a[ai][ak] = (gi < m && gk < k) ? A[gi * a_sm + gk * a_sk] : (unsigned short)0;
                    const int bk = lin / GEMM_TILE, bj = lin % GEMM_TILE;
                    const long long gl = k0 + bk, gj = col0 + bj;
                    tile_b[bj][bk] = (gl < k && gj < n) ? B[gl * b_sk + gj * b_sn] : (unsigned short)0;
                }
                __syncthreads();
#pragma unroll
                for (int ks = 0; ks < TK; ks += 16) {
                    const int col = ks + quad * 2;
                    unsigned fa[2][4], fb[2][2];
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        const int row = warp_row + mt * 16 + group;
                        fa[mt][0] = *reinterpret_cast<const unsigned*>(&tile_a[row][col]);
                        fa[mt][1] = *reinterpret_cast<const unsigned*>(&tile_a[row + 8][col]);
                        fa[mt][2] = *reinterpret_cast<const unsigned*>(&tile_a[row][col + 8]);
                        fa[mt][3] = *reinterpret_cast<const unsigned*>(&tile_a[row + 8][col + 8]);
                    }
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) {
                        const int ncol = warp_col + nt * 8 + group;
                        fb[nt][0] = *reinterpret_cast<const unsigned*>(&tile_b[ncol][col]);
                        fb[nt][1] = *reinterpret_cast<const unsigned*>(&tile_b[ncol][col + 8]);
                    }
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
                        for (int nt = 0; nt < 2; ++nt) mma_16816<BF16>(acc[mt][nt], fa[mt], fb[nt]);
                    }
                }
                __syncthreads();
            }
            for (int mt = 0; mt < 2; ++mt) {
                for (int nt = 0; nt < 2; ++nt) {
                    for (int i = 0; i < 4; ++i) {
                        const long long row = row0 + warp_row + mt * 16 + group + (i >= 2 ? 8 : 0);
                        const long long col = col0 + warp_col + nt * 8 + quad * 2 + (i & 1);
                        store_output(Y, c, m, n, row, col, c_sm, c_sn, acc[mt][nt][i], alpha, beta);
                    }
                }
            }
        }
    }
}
#define GEMM_HALF_BODY(T, BF16) gemm_mma<T, BF16>(GEMM_ARGS)
#else
#define GEMM_HALF_BODY(T, BF16) gemm_tiled<T>(GEMM_ARGS)
#endif

// Entry points gemm_f32, gemm_f16, gemm_bf16: one signature, one launch shape for every body.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm_f32(GEMM_PARAMS(float)) {
    gemm_tiled<float>(GEMM_ARGS);
}
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm_f16(GEMM_PARAMS(__half)) {
    GEMM_HALF_BODY(__half, false);
}
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm_bf16(GEMM_PARAMS(__nv_bfloat16)) {
    GEMM_HALF_BODY(__nv_bfloat16, true);
}
