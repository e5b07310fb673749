// The runtime of the CUDA emulator (cuda_emulator.h): fibers on one CPU thread, a block's warps
// in turn, each as far as it goes. x86-64 only: a fiber switch is eight instructions here, where
// swapcontext costs a system call (about 290 ns, so a second a kernel at the tests' shapes).
#include "emulator/cuda_emulator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#if !defined(__x86_64__) || !defined(__linux__)
#error "the CUDA emulator is built for x86-64 Linux only (setup.py leaves it out elsewhere)"
#endif

// switch_fiber(save, load): saves the callee-saved registers and the stack pointer of the running
// context in *save, and resumes the one whose stack pointer is load.
extern "C" void cuda_emulator_switch_fiber(void** save, void* load);
asm(R"(
  .text
  .p2align 4
  .globl cuda_emulator_switch_fiber
  .hidden cuda_emulator_switch_fiber
  .type cuda_emulator_switch_fiber, @function
cuda_emulator_switch_fiber:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emulator_switch_fiber, .-cuda_emulator_switch_fiber
)");

namespace cuda_emulator {

Thread* running = nullptr;

namespace {

constexpr size_t kStackBytes = 256 * 1024;  // a fiber's stack, with a guard page below it
constexpr size_t kPage = 4096;
constexpr int kMaxThreads = 1024;
constexpr size_t kDefaultShared = 48 * 1024;  // dynamic shared memory without an attribute
constexpr size_t kMaxShared = 163 * 1024;     // an A100's (sm_80) opt-in limit, the lower one built

enum class State { Ready, AtBlockBarrier, AtWarpBarrier, Done };

struct Fiber {
  Thread thread;
  State state = State::Ready;
  int line = 0;  // of the barrier it waits at
  void* sp = nullptr;
};

// What one lane publishes for a shuffle; two sets, alternating, so that a lane may publish for the
// next shuffle while a slower one still reads this one's.
struct Exchange {
  unsigned char slot[2][32][8];
  int round[32] = {};  // each lane's shuffles so far
};

struct Emulator {
  std::mutex mutex;  // one launch at a time: static __shared__ variables are one copy
  std::vector<Fiber> fibers;
  std::vector<Exchange> warps;
  std::vector<unsigned char*> stacks;  // one a thread, made once and kept
  std::vector<unsigned char> shared;
  std::unordered_map<const void*, size_t> allowed_shared;
  std::vector<std::string> launches;  // since the last take_launches
  const std::function<void()>* body = nullptr;
  void* scheduler_sp = nullptr;
  int current = -1;
  int64_t schedule = 0;
  std::mt19937_64 random{0};
  int error = 0;
  std::string message, last;
};

Emulator& emulator() {
  static Emulator e;
  return e;
}

Fiber& me() { return emulator().fibers[size_t(emulator().current)]; }

void fail(int code, std::string message) {
  Emulator& e = emulator();
  if (e.error == 0) {
    e.error = code;
    e.message = std::move(message);
  }
}

void yield() {
  Emulator& e = emulator();
  cuda_emulator_switch_fiber(&me().sp, e.scheduler_sp);
}

[[noreturn]] void fiber_main() {
  Emulator& e = emulator();
  (*e.body)();
  me().state = State::Done;
  yield();
  __builtin_unreachable();
}

unsigned char* stack_of(size_t index) {
  Emulator& e = emulator();
  while (e.stacks.size() <= index) {
    void* p = mmap(nullptr, kStackBytes + kPage, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    mprotect(p, kPage, PROT_NONE);  // a stack overflow faults instead of writing below
    e.stacks.push_back(static_cast<unsigned char*>(p) + kPage + kStackBytes);
  }
  return e.stacks[index];
}

// A fresh stack that switch_fiber resumes in fiber_main: six saved registers, then fiber_main's
// address for its ret, then a slot where a return address would be, so that fiber_main starts
// with the stack aligned as after a call.
void* fresh_stack(unsigned char* top) {
  auto* sp = reinterpret_cast<uintptr_t*>(top);
  *--sp = 0;
  *--sp = reinterpret_cast<uintptr_t>(&fiber_main);
  for (int i = 0; i < 6; ++i) *--sp = 0;
  return sp;
}

std::vector<int> order_of(int n) {
  Emulator& e = emulator();
  std::vector<int> order(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) order[size_t(i)] = i;
  if (e.schedule == 1) {
    std::reverse(order.begin(), order.end());
  } else if (e.schedule != 0) {
    std::shuffle(order.begin(), order.end(), e.random);
  }
  return order;
}

std::string where(const Fiber& f) {
  return "thread " + std::to_string(f.thread.thread_idx.x) + " of block " +
         std::to_string(f.thread.block_idx.x);
}

// Releases warp w's shuffle or __syncwarp where all its lanes have reached it; false where they
// have not, or on an error (set).
bool release_warp(int w) {
  std::vector<Fiber>& fibers = emulator().fibers;
  const int n = int(fibers.size()), first = w * 32, last = std::min(n, first + 32);
  int waiting = 0;
  for (int i = first; i < last; ++i) waiting += fibers[size_t(i)].state == State::AtWarpBarrier;
  if (waiting == 0) return false;
  const int line = fibers[size_t(first)].line;
  if (last - first < 32) {
    fail(kInvalidValue, "warp " + std::to_string(w) + " has " + std::to_string(last - first) +
                            " lanes; a full-mask shuffle needs 32");
    return false;
  }
  for (int i = first; i < last; ++i) {
    const Fiber& f = fibers[size_t(i)];
    if (f.state == State::Done) {
      fail(kInvalidValue, "a lane of warp " + std::to_string(w) +
                              " exited while its warp meets at line " + std::to_string(line));
      return false;
    }
    if (f.state == State::AtWarpBarrier && f.line != line) {
      fail(kInvalidValue, "warp " + std::to_string(w) + " meets at lines " +
                              std::to_string(line) + " and " + std::to_string(f.line));
      return false;
    }
  }
  if (waiting < last - first) return false;
  for (int i = first; i < last; ++i) fibers[size_t(i)].state = State::Ready;
  return true;
}

// Releases the block's __syncthreads where every thread has reached it; false where they have
// not, or on an error (set).
bool release_block() {
  std::vector<Fiber>& fibers = emulator().fibers;
  const Fiber* first = nullptr;
  for (const Fiber& f : fibers) {
    if (f.state == State::AtBlockBarrier) {
      first = &f;
      break;
    }
  }
  if (first == nullptr) return false;
  for (const Fiber& f : fibers) {
    if (f.state == State::Done) {
      fail(kInvalidValue, where(f) + " exited before the __syncthreads at line " +
                              std::to_string(first->line) + " that the others wait at");
      return false;
    }
    if (f.state != State::AtBlockBarrier) return false;
    if (f.line != first->line) {
      fail(kInvalidValue, "__syncthreads at lines " + std::to_string(first->line) + " and " +
                              std::to_string(f.line) + " (" + where(*first) + ", " + where(f) +
                              ")");
      return false;
    }
  }
  for (Fiber& f : fibers) f.state = State::Ready;
  return true;
}

// Runs warp w as far as it goes: its lanes by turns, its shuffles released as they complete,
// until every lane waits at __syncthreads, has exited, or waits at a shuffle that cannot
// complete. Whether any lane ran.
bool run_warp(int w) {
  Emulator& e = emulator();
  const int n = int(e.fibers.size()), first = w * 32, lanes = std::min(32, n - first);
  bool ran = false;
  for (;;) {
    bool progressed = false;
    for (int lane : order_of(lanes)) {
      Fiber& f = e.fibers[size_t(first + lane)];
      if (f.state != State::Ready) continue;
      e.current = first + lane;
      running = &f.thread;
      cuda_emulator_switch_fiber(&e.scheduler_sp, f.sp);
      running = nullptr;
      progressed = ran = true;
      if (e.error != 0) return ran;
    }
    if (!release_warp(w) && !progressed) return ran;
    if (e.error != 0) return ran;
  }
}

// One block: warp by warp, each as far as it goes before the next starts (the most a GPU lets
// warps drift apart between two __syncthreads), in the schedule's order of warps.
void run_block(dim3 grid, dim3 block, unsigned index) {
  Emulator& e = emulator();
  const int n = int(block.x), warps = (n + 31) / 32;
  e.fibers.assign(size_t(n), Fiber{});
  e.warps.assign(size_t(warps), Exchange{});
  std::fill(e.shared.begin(), e.shared.end(), 0xff);
  for (int i = 0; i < n; ++i) {
    Fiber& f = e.fibers[size_t(i)];
    f.thread = {dim3(unsigned(i)), dim3(index), block, grid};
    unsigned char* top = stack_of(size_t(i));
    if (top == nullptr) return fail(kInvalidValue, "no memory for the fibers' stacks");
    f.sp = fresh_stack(top);
  }
  for (;;) {
    bool ran = false;
    for (int w : order_of(warps)) {
      ran = run_warp(w) || ran;
      if (e.error != 0) return;
    }
    if (std::all_of(e.fibers.begin(), e.fibers.end(),
                    [](const Fiber& f) { return f.state == State::Done; })) {
      return;
    }
    if (!release_block() && !ran) {
      if (e.error == 0) {
        fail(kInvalidValue, "the threads of block " + std::to_string(index) +
                                " wait at barriers that can never complete");
      }
      return;
    }
    if (e.error != 0) return;
  }
}

}  // namespace

void sync_threads(int line) {
  Fiber& f = me();
  f.state = State::AtBlockBarrier;
  f.line = line;
  yield();
}

void exchange(const void* in, void* out, size_t bytes, unsigned mask, int source, int line) {
  Emulator& e = emulator();
  Fiber& f = me();
  const int lane = int(f.thread.thread_idx.x & 31);
  if (mask != 0xffffffffu) {
    fail(kInvalidValue, "a shuffle with a partial mask at line " + std::to_string(line));
    f.state = State::Done;
    yield();
  }
  Exchange& x = e.warps[size_t(f.thread.thread_idx.x / 32)];
  const int set = x.round[lane]++ & 1;
  std::memcpy(x.slot[set][lane], in, bytes);
  f.state = State::AtWarpBarrier;
  f.line = line;
  yield();
  std::memcpy(out, x.slot[set][source & 31], bytes);
}

void sync_warp(int line) {
  const char mine = 0;
  char theirs;
  exchange(&mine, &theirs, 1, 0xffffffffu, int(me().thread.thread_idx.x & 31), line);
}

unsigned char* dynamic_shared() { return emulator().shared.data(); }

int launch(dim3 grid, dim3 block, size_t shared, const void* kernel, const char* name,
           const std::function<void()>& body) {
  Emulator& e = emulator();
  const std::lock_guard<std::mutex> lock(e.mutex);
  e.launches.emplace_back(name);
  e.error = 0;
  e.message.clear();
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  const auto allowed = e.allowed_shared.find(kernel);
  const size_t limit = allowed == e.allowed_shared.end() ? kDefaultShared : allowed->second;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > kMaxThreads) {
    fail(kInvalidConfiguration,
         "launch of " + std::to_string(grid.x) + "x" + std::to_string(grid.y) + "x" +
             std::to_string(grid.z) + " blocks of " + std::to_string(threads) + " threads");
  } else if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) {
    fail(kInvalidConfiguration, "the emulator runs one-dimensional launches only");
  } else if (shared > limit) {
    fail(kInvalidValue, "launch with " + std::to_string(shared) +
                                    " bytes of dynamic shared memory; the kernel allows " +
                                    std::to_string(limit) + " (cudaFuncSetAttribute)");
  } else {
    e.body = &body;
    e.shared.assign(shared, 0xff);
    std::vector<int> blocks = order_of(int(grid.x));
    for (int b : blocks) {
      run_block(grid, block, unsigned(b));
      if (e.error != 0) break;
    }
    e.body = nullptr;
    e.fibers.clear();
  }
  if (e.error != 0) e.last = e.message;
  return e.error;
}

int allow_dynamic_shared(const void* kernel, int bytes) {
  Emulator& e = emulator();
  const std::lock_guard<std::mutex> lock(e.mutex);
  if (bytes < 0 || size_t(bytes) > kMaxShared) {
    e.last = "cudaFuncSetAttribute: " + std::to_string(bytes) +
             " bytes of dynamic shared memory, more than an sm_80 block has (" +
             std::to_string(kMaxShared) + ")";
    return kInvalidValue;
  }
  e.allowed_shared[kernel] = size_t(bytes);
  return kSuccess;
}

std::vector<std::string> take_launches() {
  Emulator& e = emulator();
  const std::lock_guard<std::mutex> lock(e.mutex);
  std::vector<std::string> launches;
  launches.swap(e.launches);
  return launches;
}

int take_error() {
  Emulator& e = emulator();
  const int error = e.error;
  e.error = 0;
  return error;
}

const char* last_message() { return emulator().last.c_str(); }

void forget_errors() {
  Emulator& e = emulator();
  const std::lock_guard<std::mutex> lock(e.mutex);
  e.error = 0;
  e.last.clear();
}

int64_t set_schedule(int64_t schedule) {
  Emulator& e = emulator();
  const std::lock_guard<std::mutex> lock(e.mutex);
  const int64_t previous = e.schedule;
  e.schedule = schedule;
  e.random.seed(uint64_t(schedule));
  return previous;
}

}  // namespace cuda_emulator
