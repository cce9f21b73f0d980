// Greedy decoding on the device: the argmax over each logits row, and the token writer that folds the chosen
// token back into the decode bindings. Together they let a token loop run without a host round trip.
//
// Argmax result: two 32-bit words per row at word 2*row: the index of the maximum, then the device's latched
// error bitmask (the current validation flag word, read after every kernel before it on the stream), so
// the host learns whether the step that produced the logits raised a validation flag without reading
// anything else. NaN ranks above every number (numpy's argmax); equal values resolve to the lowest index,
// or the highest with select_last (ONNX ArgMax's select_last_index).

#define ARGMAX_THREADS 256
#define NO_INDEX 0xffffffffu  // a thread that saw no element (the host keeps rows below 2^32 - 1 elements)

__device__ __forceinline__ float logit_value(float v) { return v; }
__device__ __forceinline__ float logit_value(__half v) { return __half2float(v); }
__device__ __forceinline__ float logit_value(__nv_bfloat16 v) { return __bfloat162float(v); }

// Whether candidate (v, i) beats the incumbent (bv, bi).
__device__ __forceinline__ bool argmax_beats(float v, unsigned int i, float bv, unsigned int bi, int select_last) {
    if (i == NO_INDEX) return false;
    if (bi == NO_INDEX) return true;
    const bool v_nan = v != v, b_nan = bv != bv;
    if (v_nan != b_nan) return v_nan;
    if (!v_nan && v != bv) return v > bv;
    return select_last ? i > bi : i < bi;
}

// One block per row (grid-stride over rows); ARGMAX_THREADS threads, a power of two.
template <typename T>
__device__ void argmax_rows(const T* logits, long long elements, long long batch, unsigned int* result,
                            const unsigned int* flags, int select_last) {
    __shared__ float best_value[ARGMAX_THREADS];
    __shared__ unsigned int best_index[ARGMAX_THREADS];
    const int t = threadIdx.x;
    for (long long row = blockIdx.x; row < batch; row += gridDim.x) {
        const T* x = logits + row * elements;
        float value = 0.0f;
        unsigned int index = NO_INDEX;
        for (long long j = t; j < elements; j += blockDim.x) {
            const float v = logit_value(x[j]);
            if (argmax_beats(v, (unsigned int)j, value, index, select_last)) {
                value = v;
                index = (unsigned int)j;
            }
        }
        best_value[t] = value;
        best_index[t] = index;
        __syncthreads();
        for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
            if (t < stride && argmax_beats(best_value[t + stride], best_index[t + stride], best_value[t],
                                           best_index[t], select_last)) {
                best_value[t] = best_value[t + stride];
                best_index[t] = best_index[t + stride];
            }
            __syncthreads();
        }
        if (t == 0) {
            result[2 * row] = best_index[0];
            result[2 * row + 1] = flags ? *(volatile const unsigned int*)flags : 0u;
        }
        __syncthreads();  // the next row reuses the shared arrays
    }
}

#define ARGMAX_ENTRY(SUFFIX, T)                                                                              \
    extern "C" __global__ void argmax_##SUFFIX(const T* logits, long long elements, long long batch,         \
                                               unsigned int* result, const unsigned int* flags,              \
                                               int select_last) {                                            \
        argmax_rows<T>(logits, elements, batch, result, flags, select_last);                                 \
    }
ARGMAX_ENTRY(f32, float)
ARGMAX_ENTRY(f16, __half)
ARGMAX_ENTRY(bf16, __nv_bfloat16)

// Fold result[0] (the token argmax chose) into the decode bindings: input_ids[0] = token (int64); when
// write_position, position_ids[0] = next_position; attention_mask[next_position] = 1 when it lies below
// mask_len; scratch[step] = token; scratch[capacity] |= result[1] (the error word, drained with the tokens).
extern "C" __global__ void token_writer(const unsigned int* result, long long* input_ids, long long* position_ids,
                                        long long* attention_mask, unsigned int* scratch, long long capacity,
                                        long long next_position, long long mask_len, int write_position,
                                        unsigned int step) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const unsigned int token = result[0];
    input_ids[0] = (long long)token;
    if (write_position) position_ids[0] = next_position;
    if (next_position >= 0 && next_position < mask_len) attention_mask[next_position] = 1;
    scratch[step] = token;
    atomicOr(&scratch[capacity], result[1]);
}

// The token writer of a captured decode step: the step index and the position come from the device counter
// (int64 words: step, next position) instead of launch arguments, so one graph serves every step; it then
// advances both words for the next replay. A step outside the token slots (or a negative position) writes
// nothing but the error word.
#define DECODE_STEP_OVERFLOW 0x80000000u  // scratch[capacity] bit: a counter outside the token slots
extern "C" __global__ void token_writer_at(const unsigned int* result, long long* input_ids,
                                           long long* position_ids, long long* attention_mask,
                                           unsigned int* scratch, long long capacity, long long mask_len,
                                           int write_position, long long* counter) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const long long step = counter[0], next_position = counter[1];
    if (step < 0 || step >= capacity || next_position < 0) {
        atomicOr(&scratch[capacity], DECODE_STEP_OVERFLOW);
        return;
    }
    const unsigned int token = result[0];
    input_ids[0] = (long long)token;
    if (write_position) position_ids[0] = next_position;
    if (next_position >= 0 && next_position < mask_len) attention_mask[next_position] = 1;
    scratch[step] = token;
    atomicOr(&scratch[capacity], result[1]);
    counter[0] = step + 1;
    counter[1] = next_position + 1;
}

// Rows of row_bytes from src (at src_pitch) to dst at a row index read from the counter: the destination
// offset is (counter[word] + bias) * dst_unit plus row * dst_pitch. An index outside [0, limit) copies
// nothing (the host cannot check a value only the device knows). One block per row; 4-byte words when
// every address and length allows, else bytes.
extern "C" __global__ void copy_rows_at(const unsigned char* src, long long src_pitch, unsigned char* dst,
                                        long long dst_pitch, long long row_bytes, long long rows,
                                        const long long* counter, int word, long long bias, long long dst_unit,
                                        long long limit) {
    const long long index = counter[word] + bias;
    if (index < 0 || index >= limit) return;
    unsigned char* base = dst + index * dst_unit;
    const bool words = ((((unsigned long long)src) | ((unsigned long long)base) | (unsigned long long)src_pitch |
                         (unsigned long long)dst_pitch | (unsigned long long)row_bytes) & 3ull) == 0;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const unsigned char* from = src + row * src_pitch;
        unsigned char* to = base + row * dst_pitch;
        if (words) {
            const unsigned int* f = (const unsigned int*)from;
            unsigned int* t = (unsigned int*)to;
            for (long long j = threadIdx.x; j < row_bytes / 4; j += blockDim.x) t[j] = f[j];
        } else {
            for (long long j = threadIdx.x; j < row_bytes; j += blockDim.x) to[j] = from[j];
        }
    }
}
