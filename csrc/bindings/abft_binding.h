// Helpers of the torch binding (abft_ops.cpp) that the other bindings share: the kernels' view of
// a tensor, and the outputs and views of block_sums, row_products, screen, the correction and the
// tally.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#ifdef ABFT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/abft.h"

// These files are built twice. Into megatron_abft._C: the ops, their C++ kernels for CPU tensors
// and, in builds for GPUs (ABFT_WITH_CUDA), the CUDA kernels' bindings. Into the test-only
// extension megatron_abft._emulator (ABFT_EMULATED): the CUDA kernels' bindings again, for CPU
// tensors, whose kernels are abft_cuda.cu built for the CPU through the CUDA emulator
// (csrc/emulator/cuda_emulator.h); nothing of it is in _C.
#if defined(ABFT_WITH_CUDA) || defined(ABFT_EMULATED)
#define ABFT_CUDA_KERNELS 1
#endif

namespace abft_binding {

// Whether these bindings run the CUDA kernels on CPU tensors (megatron_abft._emulator).
#ifdef ABFT_EMULATED
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif

// How the bindings register with torch.library: ABFT_OPS(m) { m.def(...); } for the ops' schemas,
// ABFT_IMPLS(key, m) { m.impl(...); } for their kernels of a dispatch key. In _C these are torch's
// registrations at load. _emulator registers nothing at load (the schemas and C++ kernels are
// _C's): while megatron_abft.ops.compiled.emulated_cuda() is on, emulate(true) registers its CUDA
// kernels' bindings for CPU tensors, and its composites (whose CPU tensors take the CUDA path)
// over _C's, until emulate(false).
#ifndef ABFT_EMULATED
#define ABFT_OPS(m) TORCH_LIBRARY_FRAGMENT(megatron_abft, m)
#define ABFT_IMPLS(key, m) TORCH_LIBRARY_IMPL(megatron_abft, key, m)
#else
using Registration = void (*)(torch::Library&);

// The registrations emulate(true) makes, for CPU tensors and over the composites.
std::vector<Registration>& emulated_registrations(c10::DispatchKey key);

struct Registrar {
  Registrar(c10::DispatchKey key, Registration registration) {
    emulated_registrations(key).push_back(registration);
  }
};

// Registers (true) or withdraws (false) the emulated kernels; returns whether they were on.
bool emulate(bool on);

#define ABFT_OPS(m) ABFT_UNUSED_(m, C10_UID)
#define ABFT_IMPLS(key, m) ABFT_IMPLS_##key(m)
#define ABFT_IMPLS_CPU(m) ABFT_UNUSED_(m, C10_UID)
#define ABFT_IMPLS_Autograd(m) ABFT_UNUSED_(m, C10_UID)
#define ABFT_IMPLS_CompositeExplicitAutograd(m) ABFT_UNUSED_(m, C10_UID)
#define ABFT_IMPLS_CUDA(m) ABFT_EMULATED_(m, C10_UID, CPU)
#define ABFT_IMPLS_CompositeImplicitAutograd(m) \
  ABFT_EMULATED_(m, C10_UID, CompositeImplicitAutograd)
#define ABFT_UNUSED_(m, uid) \
  [[maybe_unused]] static void C10_CONCATENATE(abft_unused_, uid)(torch::Library & m)
#define ABFT_EMULATED_(m, uid, key)                                                      \
  static void C10_CONCATENATE(abft_emulated_, uid)(torch::Library&);                     \
  static const abft_binding::Registrar C10_CONCATENATE(abft_registrar_, uid)(            \
      c10::DispatchKey::key, &C10_CONCATENATE(abft_emulated_, uid));                     \
  void C10_CONCATENATE(abft_emulated_, uid)(torch::Library & m)
#endif

#ifdef ABFT_CUDA_KERNELS
// Where an op's CUDA kernels run: on the GPU that holds `on`, on torch's current stream there,
// that device current while the launch lives; or, in _emulator, for a tensor on the CPU, through
// the emulator. Any other tensor is an error that says so.
class CudaLaunch {
 public:
  explicit CudaLaunch(const at::Tensor& on);
  at::DeviceType device() const { return device_; }
  const abft::Launchers& kernels() const { return *kernels_; }
  void* stream() const { return stream_; }
  // Raises a launcher's error (0: none) as c10::Error, `op` and the cause named.
  void check(int error, const char* op) const;

 private:
  at::DeviceType device_;
  const abft::Launchers* kernels_ = nullptr;
  void* stream_ = nullptr;
#ifdef ABFT_WITH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard_;
#endif
};
#endif

using Sums = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Products = std::tuple<at::Tensor, at::Tensor>;

// The kernels' dtype of c; `what` names the tensor in the error message.
abft::DType kernel_dtype(const at::Tensor& c, const char* what = "megatron_abft::block_sums: c");

// The strides of t broadcast to `shape` (which it broadcasts to), as t.expand(shape) has them.
std::vector<int64_t> broadcast_strides(const at::Tensor& t, at::IntArrayRef shape);

// The kernels' view of a dense strided [*batch, rows, cols] tensor; with `shape`, of c broadcast
// to it (as c.expand(shape), without the view).
abft::MatrixBatch describe(const at::Tensor& c);
abft::MatrixBatch describe(const at::Tensor& c, at::IntArrayRef shape);

// block_sums' outputs for c, and the kernels' view of c and of them.
std::tuple<Sums, abft::MatrixBatch, abft::BlockSums> prepare(const at::Tensor& c,
                                                            int64_t col_block, int64_t row_block);

// How block_sums reads c into `out` (contiguous, shaped as prepare's outputs): a c stored column
// by column is handed to the kernels as c^T, whose rows are contiguous, its column side being
// c's row side.
std::pair<abft::MatrixBatch, abft::BlockSums> plan_block_sums(abft::MatrixBatch c,
                                                              abft::BlockSums out);

// row_products' outputs for a and the vectors u, z (checked), broadcast over a's batch; the
// vectors the kernels read (a copy of one whose entries are strided) are the last two tensors.
std::tuple<Products, abft::MatrixBatch, abft::RowProducts, at::Tensor, at::Tensor> prepare_products(
    const at::Tensor& a, const at::Tensor& u, const at::Tensor& z, double scale,
    at::DeviceType device);

#ifdef ABFT_CUDA_KERNELS
using Eight = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                         at::Tensor, at::Tensor>;

// block_sums_pair and row_products_pair by the CUDA kernels, one launch each (elsewhere the two
// ops each, abft_encode.cpp).
Eight block_sums_pair_cuda(const at::Tensor& a, int64_t a_col_block, int64_t a_row_block,
                           const at::Tensor& b, int64_t b_col_block, int64_t b_row_block);
Sums row_products_pair_cuda(const at::Tensor& a, const at::Tensor& u, const at::Tensor& z,
                            double scale, const at::Tensor& b, const at::Tensor& v,
                            const at::Tensor& y, double b_scale);
#endif


// The screen of c given its block sums, and its flagged counts [*batch, slots]: without a
// tiling one slot a matrix, zeros (the CPU kernels); with the tiling of the CUDA block sums that
// screen, one slot a tile, which each tile writes. The references are read where they are,
// broadcast over c's batch.
std::tuple<abft::Screen, at::Tensor> prepare_screen(const at::Tensor& c, const Sums& sums,
                                                    int64_t col_block, int64_t row_block,
                                                    at::TensorList col, at::TensorList row,
                                                    at::ArrayRef<double> col_bounds,
                                                    at::ArrayRef<double> row_bounds,
                                                    const abft::Tiling* tiling = nullptr);

// The flagged counts per matrix [*batch] of a screen's slots [*batch, slots], once they are
// written.
at::Tensor flagged_per_matrix(const at::Tensor& flagged);

// The correction's per-matrix results: status, kind, row, col, magnitude.
using Found = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct Correction {
  abft::Correct k;
  Found found;
  at::Tensor scratch;  // the sums the correction keeps and the log of its writes
};

// The correction (abft.h's Correct) of the matrices of c that `screen` flags, from c's block sums
// and the operands a [*, m, k], b [*, k, n] and bias [n] (checked here; a and b expanded to c's
// batch), at most `capacity` vectors per side and pass.
Correction prepare_correct(const at::Tensor& c, const Sums& sums, const abft::Screen& screen,
                           int64_t col_block, int64_t row_block, const at::Tensor& a,
                           const at::Tensor& b, double alpha,
                           const std::optional<at::Tensor>& bias, double near_inf,
                           int64_t capacity);

// The writes a correction can undo in each matrix of an m x n C (abft.h's Correct::capacity),
// with `capacity` vectors per side and pass in blocks of at most `block`: a pass writes at most
// that many single elements, or about as many in whole blocks.
inline int64_t correction_log(int64_t capacity, int64_t m, int64_t n, int64_t block) {
  return 2 * std::min(capacity, m * n) + 2 * block;
}

// verify_correct's checks of the operands a, b and bias of c, and of capacity.
void check_correct_inputs(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                          const std::optional<at::Tensor>& bias, int64_t capacity);

// verify_correct's results where the screen flagged no matrix of c.
Found all_clean(const at::Tensor& c);

// tally on the CPU: verify_correct's results into a ledger, in place. Returns failed.
at::Tensor tally_cpu(const at::Tensor& status, const at::Tensor& kind, const at::Tensor& row,
                     const at::Tensor& col, const at::Tensor& magnitude, at::Tensor& counts,
                     const at::Tensor& step, at::Tensor& log, at::Tensor& logged);

// encode_pair (abft_encode.cpp): both sides' sums and magnitudes of alpha * a @ b.
Sums encode_pair(const at::Tensor& a, const at::Tensor& b, double alpha, int64_t block);

// The fewest elements of a GEMM's larger operand from which its encoding takes the products on the
// tensor cores (mma_products) rather than by row_products: below it (a GPT-3 350M projection at
// micro-batch 1, where the host bounds the step) the products kernel's one launch costs less than
// mma_products' ten (five an operand). A prediction; tools/bench_kernels.py times both.
constexpr int64_t kMmaProductsMinElements = int64_t(1) << 22;

// Whether encode_pair and check_matrix_cuda take both operands' products by mma_products: 2-D
// bf16 operands, the larger with at least kMmaProductsMinElements.
bool takes_mma_products(const at::Tensor& big, const at::Tensor& small);

// row_products' products of a 2-D bf16 x [p, k] with fp32 vectors u [r, k], z [r', k] (rows of
// any stride) by GEMMs on the tensor cores (abft_mma_products.cpp), into products [p, r] and
// magnitudes [p, r'] (fp32, contiguous): scale x @ u^T and |scale| |x| @ z^T. On a GPU (and in
// the emulator) five launches; CPU tensors take ATen ops.
void mma_products(const at::Tensor& x, const at::Tensor& u, const at::Tensor& z, double scale,
                  at::Tensor& products, at::Tensor& magnitudes);

// A guard's ledger (megatron_abft/check/ledger.py) as tally writes it: counts [3, kinds] int64,
// step [1] float64, log [capacity, 7] float64 and logged [1] int64, all on the results' device.
struct LedgerArgs {
  const at::Tensor& counts;
  const at::Tensor& step;
  const at::Tensor& log;
  const at::Tensor& logged;
};

// That `ledger` is one tally writes, on the device of the results `status` (raises otherwise).
void check_ledger(const LedgerArgs& ledger, const at::Tensor& status);

// tally's kernel arguments for contiguous results (checked by the caller) and failed.
abft::Tally tally_of(const at::Tensor& status, const at::Tensor& kind, const at::Tensor& row,
                     const at::Tensor& col, const at::Tensor& magnitude, const at::Tensor& failed,
                     const LedgerArgs& ledger);

// tally's kernel arguments (checked), its output (failed) and the flattened results it reads.
using TallyArgs = std::tuple<abft::Tally, at::Tensor, std::vector<at::Tensor>>;
TallyArgs prepare_tally(const at::Tensor& status, const at::Tensor& kind, const at::Tensor& row,
                        const at::Tensor& col, const at::Tensor& magnitude,
                        const LedgerArgs& ledger);

// One matrix's whole check in the kernels' view, on a workspace: C = alpha * X @ Y^T (+ bias),
// X [m, k] and Y [n, k] the operands as rows of length k, both sides in blocks of `block`. The
// kernels take, in order: the smaller operand's block sums (small_sums), the larger one's
// (big_sums) and its products with the smaller one's (on_big; the CPU reads the larger operand
// once for both), the smaller one's products with the larger one's (on_small), the bias's terms
// (where `biased`) and C's block sums (c_sums; block_sums and the screen plan them with
// plan_block_sums), compared with the references by `screen`, whose flagged and slots are the
// caller's. Every pointer but the operands', C's and the bias's is into the workspace.
struct MatrixCheck {
  abft::MatrixBatch small, big, c;
  abft::BlockSums small_sums, big_sums, c_sums;
  abft::RowProducts on_big, on_small;
  bool biased;
  abft::BiasTerms bias;
  abft::Screen screen;
};

// The workspace a MatrixCheck of C [m, n] = X [m, k] Y^T takes, in elements of the accumulation
// type (either operand the larger).
int64_t matrix_check_elements(int64_t m, int64_t n, int64_t k, int64_t block, bool biased);

// A MatrixCheck of c = alpha * x @ y^T (+ bias [n], or null) on `workspace`
// (matrix_check_elements of the accumulation type: double where f64, else float); x_big: x is
// the larger operand, as encode_pair chooses it over the whole tensors.
MatrixCheck plan_matrix_check(const abft::MatrixBatch& c, const abft::MatrixBatch& x,
                              const abft::MatrixBatch& y, bool x_big, double alpha,
                              const at::Tensor* bias, int64_t block,
                              at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                              void* workspace, bool f64);

// The matrix of t's last two dims at element `offset` (transposed: rows and columns swapped).
abft::MatrixBatch single_matrix(const at::Tensor& t, int64_t offset, bool transposed = false);

// Whether the kernels take check_gemm's check of c = alpha * a @ b (+ bias) a matrix at a time:
// operands the kernels read, on c's device, whose batches broadcast to c's as the composite
// broadcasts them (the smaller operand no more dims than the larger, and read by rows),
// references and c in one accumulation type, a block the kernels take, whole bounds.
bool takes_matrices(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                    const std::optional<at::Tensor>& bias, int64_t block,
                    at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds);

#ifdef ABFT_CUDA_KERNELS
// check_gemm (ledger null) or check_gemm_tally of a 2-D GEMM by the CUDA kernels (on a GPU, or
// emulated) on one scratch tensor: verify_correct's five results, and tally's failed where
// there is a ledger; nullopt where takes_matrices does not take it (the composite does).
std::optional<std::pair<Found, at::Tensor>> check_matrix_cuda(
    const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double alpha,
    const std::optional<at::Tensor>& bias, int64_t block, at::ArrayRef<double> col_bounds,
    at::ArrayRef<double> row_bounds, double near_inf, int64_t capacity, const LedgerArgs* ledger);
#endif

}  // namespace abft_binding
