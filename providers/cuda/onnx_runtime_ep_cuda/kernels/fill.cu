// Byte-level fills and copies: zero-initialising buffers, ConstantOfShape-style splats and the
// strided row copies behind Concat/Slice. Loops are grid-stride so any launch size covers any count.

// Fill `count` 32-bit words at `dst` with `value` (the provider replicates a byte into `value`).
extern "C" __global__ void fill_u32(unsigned int* dst, unsigned int value, long long count) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        dst[i] = value;
    }
}

// Fill `count` bytes at `dst` with the low byte of `value`; for unaligned heads and tails.
extern "C" __global__ void fill_u8(unsigned char* dst, unsigned int value, long long count) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const unsigned char byte = (unsigned char)(value & 0xffu);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        dst[i] = byte;
    }
}

// Copy `rows` rows of `row_bytes` bytes from `src` (rows `src_pitch` bytes apart) to `dst` (rows
// `dst_pitch` bytes apart): memcpy when both pitches equal row_bytes, a 2-D gather/scatter otherwise.
extern "C" __global__ void copy_rows(const unsigned char* src, long long src_pitch, unsigned char* dst,
                                     long long dst_pitch, long long row_bytes, long long rows) {
    const long long total = row_bytes * rows;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long row = i / row_bytes;
        const long long col = i - row * row_bytes;
        dst[row * dst_pitch + col] = src[row * src_pitch + col];
    }
}
