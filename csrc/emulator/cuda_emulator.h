// A CUDA emulator for the kernels of abft_cuda.cu, so that their source runs, and is tested,
// on machines without a GPU. abft_cuda_emulated.cpp includes cuda_emulator_cuda.h (CUDA's names
// for what this header provides), then abft_cuda.cu, and the C++ compiler builds the kernels for
// the CPU. This header is the emulator's own interface, which the binding uses too.
//
// Each thread of a thread block runs as a fiber on one CPU thread, and the blocks of a grid run
// one after another. A block runs warp by warp: each warp runs as far as it can, its lanes taking
// turns between its shuffles, until every lane waits at __syncthreads (or has exited), before
// the next warp starts; so warps drift as far apart as a GPU lets them. The emulator also checks
// what real hardware does not report:
//   - every thread of a block reaches the same __syncthreads (same source line), none exited;
//   - every lane of a warp takes part in a shuffle and a __syncwarp (full mask, same line, none
//     exited);
//   - a launch's shape is valid (grid and block not empty, at most 1024 threads a block), and
//     dynamic shared memory above 48 KiB has been allowed with cudaFuncSetAttribute;
//   - dynamic shared memory is poisoned (0xff bytes: NaN as floats) before each block, so that a
//     read before a write shows.
// The order of the warps, of the lanes of a warp and of the blocks is the schedule
// (set_schedule): running a kernel under several schedules and comparing the results finds
// races that depend on that order, between warps above all. What it cannot show: timing, the
// memory model of a real GPU, the precision of its intrinsics (expf here is the C library's),
// or out-of-bounds accesses (the memory is the CPU's).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace cuda_emulator {

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// The errors a launch returns, with cudaError_t's values.
enum Error : int { kSuccess = 0, kInvalidValue = 1, kInvalidConfiguration = 9 };

// The indices of the running emulated thread.
struct Thread {
  dim3 thread_idx, block_idx, block_dim, grid_dim;
};

extern Thread* running;  // the running emulated thread (null outside a launch)

// __syncthreads: waits until every thread of the block has reached the barrier at `line`.
void sync_threads(int line);
// The warp's part of a shuffle: lane's `bytes` of `in` published, then what lane `source` published
// read into `out`, once every lane of the warp has reached the shuffle at `line`.
void exchange(const void* in, void* out, size_t bytes, unsigned mask, int source, int line);
// __syncwarp: waits until every lane of the warp has reached the barrier at `line`.
void sync_warp(int line);
// The block's dynamic shared memory (the launch's third argument, in bytes).
unsigned char* dynamic_shared();

// Runs body in every thread of every block of grid; returns 0 or a cudaError_t value, and keeps
// the message (last_message). `name` is the kernel as the launch writes it, kept in the log of
// launches (take_launches).
int launch(dim3 grid, dim3 block, size_t shared, const void* kernel, const char* name,
           const std::function<void()>& body);
// The names of the kernels launched since the last call, in order (tests: which of a launcher's
// kernels ran).
std::vector<std::string> take_launches();
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes).
int allow_dynamic_shared(const void* kernel, int bytes);

// The error of the last failed launch since the last call, and clears it (cudaGetLastError).
int take_error();
// What went wrong in the last failed launch ("" if none failed since forget_errors).
const char* last_message();
// Clears the error and the message of earlier launches.
void forget_errors();

// The order of warps, lanes and blocks: 0 in order, 1 reversed, any other value a seed of a
// random order drawn anew at every barrier. Returns the previous schedule.
int64_t set_schedule(int64_t schedule);

// kernel<<<grid, block, shared, stream>>>(args...): the arguments are converted to the kernel's
// parameter types and copied, as a launch copies them, and every thread calls the kernel on them.
template <typename... P>
class Launch {
 public:
  Launch(dim3 grid, dim3 block, size_t shared, void (*kernel)(P...), const char* name)
      : grid_(grid), block_(block), shared_(shared), kernel_(kernel), name_(name) {}

  template <typename... A>
  void operator()(A&&... args) const {
    const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    launch(grid_, block_, shared_, reinterpret_cast<const void*>(kernel_), name_,
           [&] { std::apply(kernel_, params); });
  }

 private:
  dim3 grid_, block_;
  size_t shared_;
  void (*kernel_)(P...);
  const char* name_;
};

template <typename T>
T shfl_xor(unsigned mask, T value, int lane_mask, int line) {
  static_assert(sizeof(T) <= 8, "the emulator shuffles values of at most 8 bytes");
  const int lane = int(running->thread_idx.x & 31);
  T out;
  exchange(&value, &out, sizeof(T), mask, lane ^ lane_mask, line);
  return out;
}

// Fibers take turns and never run at once, so a read-modify-write is atomic as it stands.
template <typename T>
T atomic_add(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}

template <typename T>
T atomic_max(T* address, T value) {
  const T old = *address;
  if (value > old) *address = value;
  return old;
}

}  // namespace cuda_emulator
