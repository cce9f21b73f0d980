// Loads and stores of float32/float16/bfloat16 (and the 8-bit integers MaxPool takes) through float: the
// GEMM, convolution and pooling kernels accumulate in float whatever the storage type, so every template
// reads with to_float and writes with from_float<T>. 8-bit integers are exact in float.
#pragma once

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(signed char v) { return (float)v; }
__device__ __forceinline__ float to_float(unsigned char v) { return (float)v; }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ signed char from_float<signed char>(float v) { return (signed char)v; }
template <>
__device__ __forceinline__ unsigned char from_float<unsigned char>(float v) { return (unsigned char)v; }

// Stamp out one extern "C" entry point per storage type: NAME_f32, NAME_f16, NAME_bf16.
#define ORT_FOR_FLOATS(MACRO) MACRO(f32, float) MACRO(f16, __half) MACRO(bf16, __nv_bfloat16)
