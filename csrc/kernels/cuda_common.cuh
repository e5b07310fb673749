// What the CUDA kernels of abft_cuda.cu share: the launch macros (nvcc's, or the emulator's,
// cuda_emulator_cuda.h), the thread block's shape, and reads, stores and warp reductions of the
// element types. Included by abft_cuda.cu alone, in one translation unit.
#pragma once

#ifndef ABFT_CUDA_EMULATOR  // nvcc; cuda_emulator_cuda.h defines these for the CPU's build
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

// kernel<<<grid, block, shared, stream>>>(...), written so that the emulator can launch it too
#define ABFT_LAUNCH(grid, block, shared, stream, ...) __VA_ARGS__<<<grid, block, shared, stream>>>
#define ABFT_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#define ABFT_LAUNCHERS cuda_launchers
#endif

#include <cstring>
#include <type_traits>

#include "kernels/abft.h"
#include "kernels/abft_correct.h"

namespace abft {
namespace {

constexpr int kThreads = 256;  // columns per pass over a tile: one per thread
constexpr int kWarps = kThreads / 32;
static_assert(kCudaTileCols == kThreads, "a tile with an unchecked row side is one pass wide");
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ double load(const double* p) { return *p; }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }

__device__ __forceinline__ float magnitude(float x) { return fabsf(x); }
__device__ __forceinline__ double magnitude(double x) { return fabs(x); }

// Four consecutive elements of a row, the unit block_sums_tile_vectors reads: 8 bytes of fp16
// or bf16, 16 of fp32 (eight 2-byte elements a thread would hold more sums than its registers).
constexpr int kVec = 4;
#ifdef ABFT_CUDA_EMULATOR
struct alignas(8) Bytes8 {
  uint32_t x, y;
};
struct alignas(16) Bytes16 {
  uint32_t x, y, z, w;
};
#else
using Bytes8 = uint2;
using Bytes16 = uint4;
#endif
template <typename T>
using VectorBits = typename std::conditional<sizeof(T) == 2, Bytes8, Bytes16>::type;

// The kVec elements at p (aligned to their size) in one load, as floats.
// kVec elements of T as one load's bits, and as floats.
template <typename T>
__device__ __forceinline__ void unpack_vector(const VectorBits<T>& bits, float (&v)[kVec]) {
  static_assert(kVec * sizeof(T) == sizeof(VectorBits<T>), "one load");
  T raw[kVec];
  memcpy(raw, &bits, sizeof(bits));  // not a cast of &bits: that breaks strict aliasing
#pragma unroll
  for (int k = 0; k < kVec; ++k) v[k] = load(raw + k);
}

template <typename T>
__device__ __forceinline__ void load_vector(const T* p, float (&v)[kVec]) {
  const VectorBits<T> bits = *reinterpret_cast<const VectorBits<T>*>(p);  // one load
  unpack_vector<T>(bits, v);
}

// Whether m's rows can be read kVec elements at a time: rows contiguous, and every matrix's rows
// and vectors starting on a vector's boundary (elements of `element` bytes).
inline bool matrix_in_vectors(const MatrixBatch& m, size_t element) {
  if (m.col_stride != 1 || m.cols % kVec != 0 || m.row_stride % kVec != 0 ||
      reinterpret_cast<uintptr_t>(m.data) % (kVec * element) != 0) {
    return false;
  }
  for (int d = 0; d < m.batch_dims; ++d) {
    if (m.batch_sizes[d] > 1 && m.batch_strides[d] % kVec != 0) return false;
  }
  return true;
}

// Stores v rounded to the element type and returns the value stored.
__device__ __forceinline__ float store(float* p, float v) { return *p = v; }
__device__ __forceinline__ double store(double* p, double v) { return *p = v; }
__device__ __forceinline__ float store(__nv_bfloat16* p, float v) {
  const __nv_bfloat16 x = __float2bfloat16_rn(v);
  *p = x;
  return __bfloat162float(x);
}
__device__ __forceinline__ float store(__half* p, float v) {
  const __half x = __float2half_rn(v);
  *p = x;
  return __half2float(x);
}

__device__ __forceinline__ float exponential(float x) { return expf(x); }
__device__ __forceinline__ double exponential(double x) { return exp(x); }

template <typename Acc>
__device__ __forceinline__ Acc warp_max(Acc v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Acc other = __shfl_xor_sync(kFullMask, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

}  // namespace
}  // namespace abft
