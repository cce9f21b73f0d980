// The inner step of the 64x64-tile SIMT kernels (gemm.cu's fallback GEMM, conv.cu's implicit GEMM): a
// block's 256 threads as 16x16, each accumulating a 4x4 register tile (rows ty + 16r, columns tx + 16q)
// over the TK slices of the A and B tiles in shared memory.
#pragma once

template <int TK, int PITCH>
__device__ __forceinline__ void tile_fma_4x4(const float (*tile_a)[PITCH], const float (*tile_b)[PITCH], int ty, int tx,
                                             float (&acc)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < TK; ++kk) {
        float av[4], bv[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) av[r] = tile_a[kk][ty + 16 * r];
#pragma unroll
        for (int q = 0; q < 4; ++q) bv[q] = tile_b[kk][tx + 16 * q];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[r][q] = fmaf(av[r], bv[q], acc[r][q]);
        }
    }
}
