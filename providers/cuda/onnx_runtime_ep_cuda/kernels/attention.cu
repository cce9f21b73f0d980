// ONNX Attention (opset 23+): softmax(q . k * scale [softcapped] + bias) . v for each query row, with
// the causal frontier, sliding windows, attn_mask (bool or float, broadcast, short masks padded with -inf),
// an external KV cache's per-batch valid length (nonpad_kv_seqlen), past_key/past_value ahead of the new
// keys and grouped-query heads. Built for decode (one or a few query rows over a long KV sequence),
// correct for any shape.
//
// One block per (batch, KV head, query row, query-head subgroup of up to GROUP heads, KV split):
// the heads of a subgroup share a KV head, so each K/V row is read once for all of them. Each warp takes
// ATT_KEYS consecutive keys at a time: every lane holds SLOTS consecutive values of the head dimension
// (one vector load per row when the layout allows), the dot products are summed across the warp with xor
// shuffles (which leave the same value in every lane, so the softmax state below is warp-uniform), and an
// online softmax (running max m, running sum l, unnormalized output acc) folds them in, so any sequence
// length runs in registers with no scores buffer. The warps of a block merge their states through shared
// memory.
//
// Few rows (decode) cannot fill the GPU, so the sequence is also cut into gridDim.y splits of `chunk`
// keys: each block then writes its state (m, l, acc) to a float workspace and attention_combine merges
// the splits. Keys outside the visible range (causal frontier, window, valid length, short mask) are
// never read. The optional qk_matmul_output (a debugging output) has its own unfused kernels below, and
// present_key/present_value a copy kernel.
#include "float_io.cuh"

typedef long long i64;

#define ATT_WARPS 4
#define ATT_THREADS (ATT_WARPS * 32)
#define ATT_KEYS 4          // keys a warp scores per step: their loads and shuffles overlap
#define ATT_MAX_SPLITS 256  // bound on gridDim.y (attention_combine's shared weights)

// attn_mask element types (ops/attention.py passes the code).
#define MASK_NONE 0
#define MASK_BOOL 1
#define MASK_F32 2
#define MASK_F16 3
#define MASK_BF16 4

__device__ __forceinline__ float att_neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ i64 att_min(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 att_max(i64 a, i64 b) { return a > b ? a : b; }

// The additive bias of one mask element: 0 or -inf for a bool mask, the value of a float one.
__device__ __forceinline__ float mask_bias(const void* __restrict__ mask, int kind, i64 at) {
    switch (kind) {
        case MASK_BOOL: return static_cast<const unsigned char*>(mask)[at] ? 0.0f : att_neg_inf();
        case MASK_F32: return static_cast<const float*>(mask)[at];
        case MASK_F16: return __half2float(static_cast<const __half*>(mask)[at]);
        case MASK_BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(mask)[at]);
        default: return 0.0f;
    }
}

// The keys [lo, hi) query row i of batch b may attend: the valid length (nonpad_kv_seqlen), a short mask,
// the causal frontier and the windows around its absolute position (past_len + i, or nonpad - q_len + i).
__device__ __forceinline__ void visible_keys(const i64* __restrict__ nonpad, i64 b, i64 i, i64 q_len, i64 past_len,
                                             i64 total, int mask_kind, i64 mask_len, int causal, i64 left,
                                             i64 right, i64& lo, i64& hi) {
    i64 valid = total, offset = past_len;
    if (nonpad != nullptr) {
        valid = att_max(0, att_min(nonpad[b], total));
        offset = nonpad[b] - q_len;
    }
    const i64 pos = i + offset;
    lo = 0;
    hi = valid;
    if (mask_kind != MASK_NONE) hi = att_min(hi, mask_len);  // keys past a short mask are masked
    if (causal) hi = att_min(hi, pos + 1);
    if (right >= 0) hi = att_min(hi, pos + right + 1);
    if (left >= 0) lo = att_max(lo, pos - left);
}

// Q/K/V/Y address element (b, head, s, d) at b * sb + head * sh + s * ss + d: the 4-D (B, H, S, D) layout
// and the 3-D (B, S, H * D) one differ only in these strides. past_key/past_value are (B, Hkv, P, D).
#define ATT_PARAMS(T)                                                                                         \
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, const T *__restrict__ past_k,  \
        const T *__restrict__ past_v, const void *__restrict__ mask, int mask_kind,                           \
        const i64 *__restrict__ nonpad, T *__restrict__ y, float *__restrict__ partial, i64 batch,            \
        i64 q_heads, i64 kv_heads, i64 q_len, i64 kv_len, i64 past_len, i64 head_size, i64 v_head_size,       \
        i64 q_sb, i64 q_sh, i64 q_ss, i64 k_sb, i64 k_sh, i64 k_ss, i64 v_sb, i64 v_sh, i64 v_ss, i64 y_sb,   \
        i64 y_sh, i64 y_ss, i64 m_sb, i64 m_sh, i64 m_ss, i64 mask_len, float scale, float softcap,           \
        int causal, i64 left, i64 right, i64 chunk, int k_vec, int v_vec
#define ATT_ARGS                                                                                              \
    q, k, v, past_k, past_v, mask, mask_kind, nonpad, y, partial, batch, q_heads, kv_heads, q_len, kv_len,    \
        past_len, head_size, v_head_size, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, y_sb, y_sh,   \
        y_ss, m_sb, m_sh, m_ss, mask_len, scale, softcap, causal, left, right, chunk, k_vec, v_vec

// A lane's slice of a row: SLOTS consecutive elements, kept in the storage type until used.
template <class T, int N>
struct __align__(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
    T v[N];
};

// Loads a Pack as one vector access (two or more for 32 bytes): `p` is aligned to min(sizeof(Pack), 16).
template <class T, int N>
__device__ __forceinline__ void load_pack(Pack<T, N>& out, const T* p) {
    constexpr int bytes = (int)sizeof(T) * N;
    if constexpr (bytes >= 16) {
#pragma unroll
        for (int c = 0; c < bytes / 16; ++c) reinterpret_cast<uint4*>(&out)[c] = reinterpret_cast<const uint4*>(p)[c];
    } else if constexpr (bytes == 8) {
        *reinterpret_cast<uint2*>(&out) = *reinterpret_cast<const uint2*>(p);
    } else if constexpr (bytes == 4) {
        *reinterpret_cast<unsigned int*>(&out) = *reinterpret_cast<const unsigned int*>(p);
    } else {
        out.v[0] = p[0];
    }
}

// Elements lane * N .. lane * N + N - 1 of a row of n (zeros past the end, or for a null row). `vec` says the
// slices never straddle n (n % N == 0) and the row is aligned for load_pack: one access per lane.
template <class T, int N>
__device__ __forceinline__ void load_slice(Pack<T, N>& out, const T* row, int lane, i64 n, int vec) {
    const i64 first = (i64)lane * N;
    if (row != nullptr && vec && first < n) {
        load_pack(out, row + first);
        return;
    }
#pragma unroll
    for (int t = 0; t < N; ++t) out.v[t] = row != nullptr && first + t < n ? row[first + t] : from_float<T>(0.0f);
}

// GROUP: query heads per block (1 for plain multi-head attention, where more would only cost registers);
// SLOTS * 32 >= max(head_size, v_head_size): the head-dimension values each lane holds.
template <class T, int GROUP, int SLOTS>
__device__ __forceinline__ void attention_rows(ATT_PARAMS(T)) {
    __shared__ float s_m[ATT_WARPS][GROUP], s_l[ATT_WARPS][GROUP];
    __shared__ float s_acc[ATT_WARPS][GROUP][SLOTS * 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 group = q_heads / kv_heads;
    const i64 subgroups = (group + GROUP - 1) / GROUP;
    const i64 total = past_len + kv_len;
    const i64 blocks = batch * kv_heads * q_len * subgroups;
    const i64 split = blockIdx.y, splits = gridDim.y;
    const float inf = -att_neg_inf();

    for (i64 block = blockIdx.x; block < blocks; block += gridDim.x) {
        // Consecutive blocks share a KV head, so the K/V rows they all read stay in L2.
        i64 rest = block;
        const i64 sub = rest % subgroups;
        rest /= subgroups;
        const i64 i = rest % q_len;
        rest /= q_len;
        const i64 hk = rest % kv_heads, b = rest / kv_heads;
        const i64 h0 = hk * group + sub * GROUP;
        const int heads = (int)att_min(GROUP, group - sub * GROUP);

        i64 lo, hi;
        visible_keys(nonpad, b, i, q_len, past_len, total, mask_kind, mask_len, causal, left, right, lo, hi);
        const i64 start = att_max(lo, split * chunk), stop = att_min(hi, (split + 1) * chunk);

        float qr[GROUP][SLOTS], acc[GROUP][SLOTS], m[GROUP], l[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const T* row = q + b * q_sb + (h0 + g) * q_sh + i * q_ss;
#pragma unroll
            for (int t = 0; t < SLOTS; ++t) {
                const i64 d = lane * SLOTS + t;
                qr[g][t] = g < heads && d < head_size ? to_float(row[d]) * scale : 0.0f;
                acc[g][t] = 0.0f;
            }
            m[g] = -inf;
            l[g] = 0.0f;
        }
        const i64 mask_row = b * m_sb + i * m_ss;
        const i64 k_base = b * k_sb + hk * k_sh, v_base = b * v_sb + hk * v_sh;
        const i64 past_base = (b * kv_heads + hk) * past_len;

        for (i64 first = start + warp * ATT_KEYS; first < stop; first += ATT_WARPS * ATT_KEYS) {
            // The V rows load with the K rows (they do not depend on the scores): twice the bytes in flight.
            Pack<T, SLOTS> kw[ATT_KEYS], vw[ATT_KEYS];
#pragma unroll
            for (int u = 0; u < ATT_KEYS; ++u) {
                const i64 j = first + u;
                const bool past = j < past_len;
                load_slice(kw[u], j >= stop ? nullptr : past ? past_k + (past_base + j) * head_size
                                                             : k + k_base + (j - past_len) * k_ss,
                           lane, head_size, k_vec);
                load_slice(vw[u], j >= stop ? nullptr : past ? past_v + (past_base + j) * v_head_size
                                                             : v + v_base + (j - past_len) * v_ss,
                           lane, v_head_size, v_vec);
            }
            float s[ATT_KEYS][GROUP];
#pragma unroll
            for (int u = 0; u < ATT_KEYS; ++u) {
                float kr[SLOTS];
#pragma unroll
                for (int t = 0; t < SLOTS; ++t) kr[t] = to_float(kw[u].v[t]);
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    float dot = 0.0f;
#pragma unroll
                    for (int t = 0; t < SLOTS; ++t) dot += qr[g][t] * kr[t];
                    s[u][g] = dot;
                }
            }
#pragma unroll
            for (int offset_lanes = 16; offset_lanes > 0; offset_lanes >>= 1) {
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) {
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) {
                        if (g < heads) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], offset_lanes);
                    }
                }
            }
            // Scores of this step, then one rescale of the running state per head.
            float p[ATT_KEYS][GROUP];
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float peak = m[g];
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) {
                    const i64 j = first + u;
                    float score = -inf;
                    if (j < stop && g < heads) {
                        score = s[u][g];
                        if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
                        if (mask_kind != MASK_NONE) score += mask_bias(mask, mask_kind, mask_row + (h0 + g) * m_sh + j);
                    }
                    s[u][g] = score;
                    peak = fmaxf(peak, score);
                }
                if (peak == -inf) {  // nothing visible yet: the state stays empty
#pragma unroll
                    for (int u = 0; u < ATT_KEYS; ++u) p[u][g] = 0.0f;
                    continue;
                }
                const float rescale = expf(m[g] - peak);  // 0 while m is -inf
                float sum = 0.0f;
#pragma unroll
                for (int u = 0; u < ATT_KEYS; ++u) {
                    p[u][g] = expf(s[u][g] - peak);
                    sum += p[u][g];
                }
                m[g] = peak;
                l[g] = l[g] * rescale + sum;
#pragma unroll
                for (int t = 0; t < SLOTS; ++t) acc[g][t] *= rescale;
            }
#pragma unroll
            for (int u = 0; u < ATT_KEYS; ++u) {
#pragma unroll
                for (int t = 0; t < SLOTS; ++t) {
                    const float value = to_float(vw[u].v[t]);
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) acc[g][t] += p[u][g] * value;
                }
            }
        }

        // Merge the warps' states; threads then cover the (head, d) outputs of the block.
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            if (lane == 0) {
                s_m[warp][g] = m[g];
                s_l[warp][g] = l[g];
            }
#pragma unroll
            for (int t = 0; t < SLOTS; ++t) s_acc[warp][g][lane * SLOTS + t] = acc[g][t];
        }
        __syncthreads();
        for (i64 at = threadIdx.x; at < heads * v_head_size; at += ATT_THREADS) {
            const int g = (int)(at / v_head_size);
            const i64 d = at - g * v_head_size;
            float peak = -inf;
#pragma unroll
            for (int w = 0; w < ATT_WARPS; ++w) peak = fmaxf(peak, s_m[w][g]);
            float sum = 0.0f, out = 0.0f;
            if (peak != -inf) {
#pragma unroll
                for (int w = 0; w < ATT_WARPS; ++w) {
                    const float weight = expf(s_m[w][g] - peak);  // 0 for a warp that saw no key
                    sum += weight * s_l[w][g];
                    out += weight * s_acc[w][g][d];
                }
            }
            const i64 h = h0 + g;
            if (splits == 1) {
                // A row with no visible key (fully masked) outputs zeros, not NaN.
                y[b * y_sb + h * y_sh + i * y_ss + d] = from_float<T>(peak == -inf ? 0.0f : out / sum);
            } else {
                float* state = partial + (((b * q_heads + h) * q_len + i) * splits + split) * (v_head_size + 2);
                if (d == 0) {
                    state[0] = peak;
                    state[1] = sum;
                }
                state[2 + d] = out;
            }
        }
        __syncthreads();  // the next row reuses the shared state
    }
}

// Merges the split states (m, l, acc) of every output row (b, h, i): one block per row, threads over d.
template <class T>
__device__ __forceinline__ void attention_combine(const float* __restrict__ partial, T* __restrict__ y, i64 batch,
                                                  i64 q_heads, i64 q_len, i64 v_head_size, i64 splits, i64 y_sb,
                                                  i64 y_sh, i64 y_ss) {
    __shared__ float s_weight[ATT_MAX_SPLITS];
    __shared__ float s_peak, s_sum;
    const i64 rows = batch * q_heads * q_len, width = v_head_size + 2;
    const float inf = -att_neg_inf();
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* state = partial + r * splits * width;
        for (i64 s = threadIdx.x; s < splits; s += blockDim.x) s_weight[s] = state[s * width];
        __syncthreads();
        if (threadIdx.x == 0) {
            float peak = -inf, sum = 0.0f;
            for (i64 s = 0; s < splits; ++s) peak = fmaxf(peak, s_weight[s]);
            for (i64 s = 0; s < splits; ++s) {
                const float weight = peak == -inf ? 0.0f : expf(s_weight[s] - peak);
                s_weight[s] = weight;
                sum += weight * state[s * width + 1];
            }
            s_peak = peak;
            s_sum = sum;
        }
        __syncthreads();
        const i64 i = r % q_len, bh = r / q_len;
        T* out = y + (bh / q_heads) * y_sb + (bh % q_heads) * y_sh + i * y_ss;
        for (i64 d = threadIdx.x; d < v_head_size; d += blockDim.x) {
            float total = 0.0f;
            for (i64 s = 0; s < splits; ++s) total += s_weight[s] * state[s * width + 2 + d];
            out[d] = from_float<T>(s_peak == -inf ? 0.0f : total / s_sum);
        }
        __syncthreads();
    }
}

// qk_matmul_output (B, Hq, Sq, total), a debugging output the fused kernel never materializes: one thread
// per score. Modes: 0 the scaled q . k, 1 after softcap, 2 after the bias (masked keys -inf), 3 the softmax
// probabilities, for which this writes the mode-2 scores to the float `scores` and attention_probs follows.
template <class T>
__device__ __forceinline__ void attention_scores(ATT_PARAMS(T), T* __restrict__ qk, float* __restrict__ scores,
                                                 int mode) {
    const i64 total = past_len + kv_len, group = q_heads / kv_heads;
    const i64 count = batch * q_heads * q_len * total;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 at = (i64)blockIdx.x * blockDim.x + threadIdx.x; at < count; at += stride) {
        const i64 j = at % total, row = at / total;
        const i64 i = row % q_len, bh = row / q_len;
        const i64 h = bh % q_heads, b = bh / q_heads, hk = h / group;
        const T* qrow = q + b * q_sb + h * q_sh + i * q_ss;
        const T* krow = j < past_len ? past_k + ((b * kv_heads + hk) * past_len + j) * head_size
                                     : k + b * k_sb + hk * k_sh + (j - past_len) * k_ss;
        float score = 0.0f;
        for (i64 d = 0; d < head_size; ++d) score += to_float(qrow[d]) * scale * to_float(krow[d]);
        if (mode >= 1 && softcap > 0.0f) score = softcap * tanhf(score / softcap);
        if (mode >= 2) {
            i64 lo, hi;
            visible_keys(nonpad, b, i, q_len, past_len, total, mask_kind, mask_len, causal, left, right, lo, hi);
            if (j < lo || j >= hi) score = att_neg_inf();
            else if (mask_kind != MASK_NONE) score += mask_bias(mask, mask_kind, b * m_sb + h * m_sh + i * m_ss + j);
        }
        if (mode == 3) scores[at] = score;
        else qk[at] = from_float<T>(score);
    }
}

// Softmax of each row of `scores` (rows x n) into qk, one warp per row; a row with no finite score (every
// key masked) becomes zeros.
template <class T>
__device__ __forceinline__ void attention_probs(const float* __restrict__ scores, T* __restrict__ qk, i64 rows, i64 n) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const float inf = -att_neg_inf();
    for (i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows; row += warps) {
        const float* in = scores + row * n;
        float peak = -inf, sum = 0.0f;
        for (i64 j = lane; j < n; j += 32) peak = fmaxf(peak, in[j]);
        for (int offset = 16; offset > 0; offset >>= 1) peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, offset));
        if (peak != -inf) {
            for (i64 j = lane; j < n; j += 32) sum += expf(in[j] - peak);
        }
        for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        for (i64 j = lane; j < n; j += 32) {
            qk[row * n + j] = from_float<T>(peak == -inf ? 0.0f : expf(in[j] - peak) / sum);
        }
    }
}

// present (B, H, P + S, D) = past (B, H, P, D) followed by the new rows of src (strided as Q/K/V above),
// moved as raw words of the element size.
template <class W>
__device__ __forceinline__ void kv_concat(const W* __restrict__ past, const W* __restrict__ src, W* __restrict__ dst,
                                          i64 batch, i64 heads, i64 past_len, i64 new_len, i64 dim, i64 s_sb,
                                          i64 s_sh, i64 s_ss) {
    const i64 total = past_len + new_len, count = batch * heads * total * dim;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 at = (i64)blockIdx.x * blockDim.x + threadIdx.x; at < count; at += stride) {
        const i64 row = at / dim, d = at - row * dim;
        const i64 j = row % total, bh = row / total;
        dst[at] = j < past_len ? past[(bh * past_len + j) * dim + d]
                               : src[(bh / heads) * s_sb + (bh % heads) * s_sh + (j - past_len) * s_ss + d];
    }
}

#define ATT_ENTRY(sfx, T, GROUP, SLOTS)                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                                  \
        attention_##sfx##_g##GROUP##_s##SLOTS(ATT_PARAMS(T)) {                                                 \
        attention_rows<T, GROUP, SLOTS>(ATT_ARGS);                                                            \
    }
#define ATT_KERNELS(sfx, T)                                                                                   \
    ATT_ENTRY(sfx, T, 1, 1) ATT_ENTRY(sfx, T, 1, 2) ATT_ENTRY(sfx, T, 1, 4) ATT_ENTRY(sfx, T, 1, 8)           \
    ATT_ENTRY(sfx, T, 4, 1) ATT_ENTRY(sfx, T, 4, 2) ATT_ENTRY(sfx, T, 4, 4) ATT_ENTRY(sfx, T, 4, 8)           \
    extern "C" __global__ void attention_combine_##sfx(const float* partial, T* y, i64 batch, i64 q_heads,     \
                                                       i64 q_len, i64 v_head_size, i64 splits, i64 y_sb,       \
                                                       i64 y_sh, i64 y_ss) {                                   \
        attention_combine<T>(partial, y, batch, q_heads, q_len, v_head_size, splits, y_sb, y_sh, y_ss);        \
    }                                                                                                         \
    extern "C" __global__ void attention_scores_##sfx(ATT_PARAMS(T), T* qk, float* scores, int mode) {        \
        attention_scores<T>(ATT_ARGS, qk, scores, mode);                                                      \
    }                                                                                                         \
    extern "C" __global__ void attention_probs_##sfx(const float* scores, T* qk, i64 rows, i64 n) {           \
        attention_probs<T>(scores, qk, rows, n);                                                              \
    }
ORT_FOR_FLOATS(ATT_KERNELS)

#define KV_CONCAT(bits, W)                                                                                    \
    extern "C" __global__ void kv_concat_##bits(const W* past, const W* src, W* dst, i64 batch, i64 heads,     \
                                                i64 past_len, i64 new_len, i64 dim, i64 s_sb, i64 s_sh,        \
                                                i64 s_ss) {                                                    \
        kv_concat<W>(past, src, dst, batch, heads, past_len, new_len, dim, s_sb, s_sh, s_ss);                 \
    }
KV_CONCAT(16, unsigned short)
KV_CONCAT(32, unsigned int)
