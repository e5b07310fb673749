// Kernels that probe the CUDA emulator (csrc/emulator/cuda_emulator.h), built and run by
// tests/ops/test_cuda_emulator.py. Each probe prints one line: its name, the launch's error code, then
// what it computed or the emulator's message.
#include <cstdio>
#include <vector>

#include "emulator/cuda_emulator_cuda.h"

namespace {

// Each block's sum of x by warp shuffles, then across warps in shared memory.
__global__ void block_sum(const float* x, float* out) {
  __shared__ float part[32];
  float v = x[blockIdx.x * blockDim.x + threadIdx.x];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) total += part[w];
    out[blockIdx.x] = total;
  }
}

__global__ void divergent_barriers(int* out) {
  if (threadIdx.x < 5) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[0] = 1;
}

__global__ void exit_before_barrier(int* out) {
  if (threadIdx.x == 3) return;
  __syncthreads();
  out[0] = 1;
}

// Half a warp shuffles while the other half waits at __syncthreads: neither can complete.
__global__ void split_warp(float* out) {
  float v = 1;
  if ((threadIdx.x & 31) < 16) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

// The first word of the dynamic shared memory, read before anything writes it.
__global__ void read_dynamic_shared(unsigned* out) {
  ABFT_DYNAMIC_SHARED(shared);
  if (threadIdx.x == 0) out[0] = *reinterpret_cast<unsigned*>(shared);
}

// Every block writes the same word: which one lands depends on the order of the blocks.
__global__ void blocks_race(int* out) {
  if (threadIdx.x == 0) out[0] = int(blockIdx.x);
}

// Thread i reads its neighbour's shared slot with no barrier between the write and the read.
__global__ void threads_race(int* out) {
  __shared__ int slot[64];
  slot[threadIdx.x] = int(threadIdx.x);
  out[threadIdx.x] = slot[(threadIdx.x + 1) % 64];
}

// As threads_race within a warp, with a __syncwarp between the write and the read: lane i reads
// lane i + 1's slot, whatever the order of the lanes.
__global__ void warp_synced(int* out) {
  __shared__ int slot[32];
  slot[threadIdx.x] = int(threadIdx.x);
  __syncwarp();
  out[threadIdx.x] = slot[(threadIdx.x + 1) % 32];
}

// Half the warp waits at one __syncwarp, half at another.
__global__ void divergent_syncwarp(int* out) {
  if ((threadIdx.x & 31) < 16) {
    __syncwarp();
  } else {
    __syncwarp();
  }
  out[threadIdx.x] = 1;
}

// Every thread adds its index to one counter: atomic, whatever the order.
__global__ void atomic_count(int* out) { atomicAdd(out, int(threadIdx.x)); }

void report(const char* name, const char* result) {
  const int error = cudaGetLastError();
  std::printf("%s: %d %s\n", name, error, error != 0 ? cuda_emulator::last_message() : result);
}

}  // namespace

int main() {
  std::vector<float> x(4 * 256), sums(4), floats(64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i % 7);
  char text[256];
  for (long long schedule : {0LL, 1LL, 12345LL}) {
    cuda_emulator::set_schedule(schedule);
    ABFT_LAUNCH(4, 256, 0, nullptr, block_sum)(x.data(), sums.data());
    std::snprintf(text, sizeof text, "%g %g %g %g", sums[0], sums[1], sums[2], sums[3]);
    std::snprintf(text + 128, 64, "block_sum schedule %lld", schedule);
    report(text + 128, text);
  }
  cuda_emulator::set_schedule(0);
  int word = 0;
  ABFT_LAUNCH(1, 64, 0, nullptr, divergent_barriers)(&word);
  report("divergent_barriers", "");
  ABFT_LAUNCH(1, 64, 0, nullptr, exit_before_barrier)(&word);
  report("exit_before_barrier", "");
  ABFT_LAUNCH(1, 64, 0, nullptr, split_warp)(floats.data());
  report("split_warp", "");
  ABFT_LAUNCH(1, 48, 0, nullptr, block_sum)(x.data(), sums.data());
  report("partial_warp", "");
  std::vector<int> ones(32);
  ABFT_LAUNCH(1, 32, 0, nullptr, divergent_syncwarp)(ones.data());
  report("divergent_syncwarp", "");
  ABFT_LAUNCH(0, 64, 0, nullptr, block_sum)(x.data(), sums.data());
  report("empty_grid", "");
  ABFT_LAUNCH(1, 2048, 0, nullptr, block_sum)(x.data(), sums.data());
  report("too_many_threads", "");
  unsigned first = 0;
  ABFT_LAUNCH(1, 32, 64 * 1024, nullptr, read_dynamic_shared)(&first);
  report("shared_over_48k", "");
  cudaFuncSetAttribute(read_dynamic_shared, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       64 * 1024);
  ABFT_LAUNCH(1, 32, 64 * 1024, nullptr, read_dynamic_shared)(&first);
  std::snprintf(text, sizeof text, "%08x", first);
  report("shared_allowed", text);
  for (long long schedule : {0LL, 1LL}) {
    cuda_emulator::set_schedule(schedule);
    ABFT_LAUNCH(8, 32, 0, nullptr, blocks_race)(&word);
    std::snprintf(text, sizeof text, "%d", word);
    report(schedule == 0 ? "blocks_race forward" : "blocks_race reversed", text);
    std::vector<int> seen(64);
    ABFT_LAUNCH(1, 64, 0, nullptr, threads_race)(seen.data());
    std::snprintf(text, sizeof text, "%d", seen[0]);
    report(schedule == 0 ? "threads_race forward" : "threads_race reversed", text);
    ABFT_LAUNCH(1, 32, 0, nullptr, warp_synced)(seen.data());
    std::snprintf(text, sizeof text, "%d %d", seen[0], seen[31]);
    report(schedule == 0 ? "warp_synced forward" : "warp_synced reversed", text);
    int count = 0;
    ABFT_LAUNCH(1, 64, 0, nullptr, atomic_count)(&count);
    std::snprintf(text, sizeof text, "%d", count);
    report(schedule == 0 ? "atomic_count forward" : "atomic_count reversed", text);
  }
  return 0;
}
