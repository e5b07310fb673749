// What the kernels of abft_cuda.cu take from CUDA, spelled for the CUDA emulator
// (cuda_emulator.h): its types, intrinsics, qualifiers and launch syntax. Included only by the
// translation unit that builds the kernels for the CPU (abft_cuda_emulated.cpp).
#pragma once

#include "kernels/abft_correct.h"  // the fp16 and bf16 conversions that the C++ kernels use
#include "emulator/cuda_emulator.h"

#define ABFT_CUDA_EMULATOR 1

using cuda_emulator::dim3;
using cudaStream_t = void*;
enum cudaError_t : int {
  cudaSuccess = cuda_emulator::kSuccess,
  cudaErrorInvalidValue = cuda_emulator::kInvalidValue,
};
enum cudaFuncAttribute : int { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
// fp16 and bf16 as stored, converted to nearest even (a NaN becomes torch's NaN, where a GPU
// writes its own: the payload differs, not the value).
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};

inline int cudaGetLastError() { return cuda_emulator::take_error(); }

template <typename... P>
int cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute, int bytes) {
  return cuda_emulator::allow_dynamic_shared(reinterpret_cast<const void*>(kernel), bytes);
}

inline float __half2float(__half x) { return abft::half_to_float(x.bits); }
inline __half __float2half_rn(float x) { return {abft::float_to_half(x)}; }
inline float __bfloat162float(__nv_bfloat16 x) {
  return abft::float_from_bits(uint32_t(x.bits) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) { return {abft::float_to_bf16(x)}; }

template <typename T>
T atomicAdd(T* address, T value) {
  return cuda_emulator::atomic_add(address, value);
}
template <typename T>
T atomicMax(T* address, T value) {
  return cuda_emulator::atomic_max(address, value);
}

// Static __shared__ variables are function statics: one copy, which the threads of the running
// block share (blocks run one at a time).
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)
#define threadIdx (::cuda_emulator::running->thread_idx)
#define blockIdx (::cuda_emulator::running->block_idx)
#define blockDim (::cuda_emulator::running->block_dim)
#define gridDim (::cuda_emulator::running->grid_dim)
#define __syncthreads() ::cuda_emulator::sync_threads(__LINE__)
#define __syncwarp() ::cuda_emulator::sync_warp(__LINE__)
#define __shfl_xor_sync(mask, value, lane_mask) \
  ::cuda_emulator::shfl_xor(mask, value, lane_mask, __LINE__)
#define ABFT_LAUNCH(grid, block, shared, stream, ...) \
  (static_cast<void>(stream),                         \
   ::cuda_emulator::Launch(grid, block, shared, __VA_ARGS__, #__VA_ARGS__))
#define ABFT_DYNAMIC_SHARED(name) unsigned char* const name = ::cuda_emulator::dynamic_shared()
#define ABFT_LAUNCHERS emulated_launchers

#pragma GCC diagnostic ignored "-Wunknown-pragmas"  // #pragma unroll
