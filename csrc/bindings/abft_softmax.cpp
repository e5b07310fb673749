// Torch binding of softmax_check, the fused softmax (abft.h): Megatron's scale-mask-softmax of the
// attention scores in one read of S that also screens S against its reference checksums and gives
// P's checksum pass for the context GEMM; and of softmax_correct_tally, the same with the flagged
// matrices of S corrected, their P redone and the outcome tallied into a guard's ledger, with no
// host read. Registered on CPU, and on CUDA in CUDA builds; their fake implementations for
// torch.compile are in megatron_abft/ops/compiled.py.
#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/abft.h"
#include "bindings/abft_binding.h"

namespace {

using Six = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using OptionalTensor = std::optional<at::Tensor>;

constexpr int64_t kRowBand = 64;  // rows per task when neither side needs a block of rows

// The kernel's arguments, its outputs (p, flagged, P's sums, sizes, products, magnitudes) and
// the tensors its pointers read. Not copied: `k.products` points into it.
struct Prepared {
  abft::SoftmaxCheck k{};
  abft::RowProducts row_products{};
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> keep;
  abft_binding::Sums s_sums;  // S's block sums, where screened
};

void check_block(const char* name, int64_t block) {
  TORCH_CHECK(block == 0 || block >= 2, "megatron_abft::softmax_check: ", name,
              " must be 0 (not wanted) or >= 2; got ", block);
}

// cuda_kernels: whether the CUDA kernels run it (on a GPU, or emulated), whose screen has one slot
// a band of the single pass or a tile of the block sums, where the C++ kernels keep one a matrix.
void prepare_softmax(Prepared& out, const at::Tensor& s, int64_t col_block, int64_t row_block,
                     at::TensorList col, at::TensorList row, at::ArrayRef<double> col_bounds,
                     at::ArrayRef<double> row_bounds, const OptionalTensor& mask, bool causal,
                     double scale, int64_t block, const OptionalTensor& u,
                     const OptionalTensor& z, at::DeviceType device, bool cuda_kernels) {
  TORCH_CHECK(s.device().type() == device, "megatron_abft::softmax_check: s is on ", s.device(),
              " but this kernel runs on ", device);
  TORCH_CHECK(s.layout() == at::kStrided && s.dim() >= 2 && s.dim() <= 2 + abft::kMaxBatchDims &&
                  s.stride(-1) == 1,
              "megatron_abft::softmax_check: s must be a strided [*batch, sq, sk] tensor with at ",
              "most ", abft::kMaxBatchDims, " batch dims and contiguous rows; got shape ",
              s.sizes(), " strides ", s.strides());
  abft_binding::kernel_dtype(s, "megatron_abft::softmax_check: s");
  check_block("col_block", col_block);
  check_block("row_block", row_block);
  check_block("block", block);
  TORCH_CHECK(u.has_value() == z.has_value(),
              "megatron_abft::softmax_check: give both u and z (P's checksum pass) or neither");
  const bool pass = u.has_value();
  TORCH_CHECK(!pass || block > 0, "megatron_abft::softmax_check: P's checksum pass needs a block");
  TORCH_CHECK(!pass || col_block == 0 || col_block == block,
              "megatron_abft::softmax_check: the screen's col_block (", col_block,
              ") and P's block (", block, ") must be equal: both are the rows of a task");
  const auto batch = s.sizes().slice(0, s.dim() - 2).vec();
  abft::SoftmaxCheck& k = out.k;
  k.s = abft_binding::describe(s);
  k.causal = causal;
  k.scale = scale;
  k.band = col_block > 0 ? col_block : pass ? block : kRowBand;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->device() == s.device(),
                "megatron_abft::softmax_check: mask must be a bool tensor on ", s.device(),
                " (true: masked out); got ", mask->scalar_type(), " on ", mask->device());
    TORCH_CHECK(mask->layout() == at::kStrided && at::is_expandable_to(mask->sizes(), s.sizes()),
                "megatron_abft::softmax_check: mask of shape ", mask->sizes(),
                " does not broadcast to s ", s.sizes());
    k.mask = static_cast<const uint8_t*>(mask->data_ptr());  // read where it is, broadcast
    const std::vector<int64_t> strides = abft_binding::broadcast_strides(*mask, s.sizes());
    std::copy(strides.begin(), strides.end(), k.mask_strides);
  }
  const at::Tensor p = at::empty(s.sizes(), s.options());  // contiguous
  k.p = p.data_ptr();
  const auto acc = s.options().dtype(s.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor flagged;
  const bool single_pass =
      cuda_kernels && abft::softmax_single_pass(k.s.cols, k.s.dtype, col_block > 0, pass);
  if (col_block > 0 || row_block > 0) {
    auto [sums, matrices, block_sums] = abft_binding::prepare(s, col_block, row_block);
    // the CUDA screen's slots: one a band in the single pass, else one a tile of the block sums
    const abft::Tiling tiling = single_pass ? abft::softmax_bands(k)
                                            : abft::block_sums_tiling(matrices, block_sums);
    auto [screen, found] =
        abft_binding::prepare_screen(s, sums, col_block, row_block, col, row, col_bounds,
                                     row_bounds, cuda_kernels ? &tiling : nullptr);
    out.keep.insert(out.keep.end(), {std::get<0>(sums), std::get<1>(sums), std::get<2>(sums),
                                     std::get<3>(sums)});
    k.s_sums = block_sums;
    k.screen = screen;
    flagged = found;
    out.s_sums = sums;
  } else {
    TORCH_CHECK(col.empty() && row.empty(),
                "megatron_abft::softmax_check: references given but both blocks are 0");
    auto shape = batch;
    shape.push_back(1);
    const auto options = s.options().dtype(at::kInt);
    const bool written = single_pass && abft::softmax_check_tasks(k) > 0;
    flagged = written ? at::empty(shape, options) : at::zeros(shape, options);
    k.screen.flagged = flagged.data_ptr<int32_t>();  // the single pass writes its zeros
    k.screen.slots = 1;
  }
  at::Tensor p_sums = at::empty({0}, acc), p_sizes = at::empty({0}, acc),
             products = at::empty({0}, acc), magnitudes = at::empty({0}, acc);
  if (pass) {
    auto [sums, matrices, block_sums] = abft_binding::prepare(p, block, 0);
    auto [found, matrix, row_products, u_, z_] =
        abft_binding::prepare_products(p, *u, *z, 1.0, device);
    out.keep.insert(out.keep.end(), {u_, z_});
    out.row_products = row_products;
    k.products = &out.row_products;
    k.p_sums = block_sums;
    p_sums = std::get<0>(sums);
    p_sizes = std::get<1>(sums);
    std::tie(products, magnitudes) = found;
  }
  out.outputs = {p, flagged, p_sums, p_sizes, products, magnitudes};
}

// The outputs, once the kernel has run.
Six result(const Prepared& out) {
  const auto& o = out.outputs;
  return {o[0], abft_binding::flagged_per_matrix(o[1]), o[2], o[3], o[4], o[5]};
}

Six softmax_check_cpu(const at::Tensor& s, int64_t col_block, int64_t row_block,
                      at::TensorList col, at::TensorList row, at::ArrayRef<double> col_bounds,
                      at::ArrayRef<double> row_bounds, const OptionalTensor& mask, bool causal,
                      double scale, int64_t block, const OptionalTensor& u,
                      const OptionalTensor& z) {
  Prepared out;
  prepare_softmax(out, s, col_block, row_block, col, row, col_bounds, row_bounds, mask, causal,
                  scale, block, u, z, at::kCPU, false);
  const abft::SoftmaxCheck& k = out.k;
  at::parallel_for(0, abft::softmax_check_tasks(k), 1, [&](int64_t begin, int64_t end) {
    abft::softmax_check_cpu(k, begin, end);
  });
  return result(out);
}

#ifdef ABFT_CUDA_KERNELS
Six softmax_check_cuda(const at::Tensor& s, int64_t col_block, int64_t row_block,
                       at::TensorList col, at::TensorList row, at::ArrayRef<double> col_bounds,
                       at::ArrayRef<double> row_bounds, const OptionalTensor& mask, bool causal,
                       double scale, int64_t block, const OptionalTensor& u,
                       const OptionalTensor& z) {
  const abft_binding::CudaLaunch launch(s);
  Prepared out;
  prepare_softmax(out, s, col_block, row_block, col, row, col_bounds, row_bounds, mask, causal,
                  scale, block, u, z, launch.device(), true);
  const abft::SoftmaxCheck& k = out.k;
  const char* op = "megatron_abft::softmax_check";
  launch.check(launch.kernels().softmax_check(k, launch.stream()), op);
  return result(out);
}
#endif

// softmax_correct_tally: softmax_check with a screen; then the matrices of S it flags corrected in
// place from the operands a, b (S = alpha a @ b), their rows of P and P's pass redone from the
// corrected S, and the correction's results tallied into the ledger (counts, step, log, logged).
// Returns P, failed (whether a matrix stayed uncorrectable) and P's pass (softmax_check's last
// four).
struct Corrected {
  Prepared softmax;
  abft_binding::Correction correction;
};

Corrected prepare_corrected(const at::Tensor& s, int64_t col_block, int64_t row_block,
                            at::TensorList col, at::TensorList row,
                            at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                            const OptionalTensor& mask, bool causal, double scale, int64_t block,
                            const OptionalTensor& u, const OptionalTensor& z, const at::Tensor& a,
                            const at::Tensor& b, double alpha, double near_inf, int64_t capacity,
                            at::DeviceType device, bool cuda_kernels) {
  TORCH_CHECK(col_block > 0 || row_block > 0,
              "megatron_abft::softmax_correct_tally: needs the screen of S (a col_block or a "
              "row_block)");
  Corrected out;
  prepare_softmax(out.softmax, s, col_block, row_block, col, row, col_bounds, row_bounds, mask,
                  causal, scale, block, u, z, device, cuda_kernels);
  out.correction = abft_binding::prepare_correct(s, out.softmax.s_sums, out.softmax.k.screen,
                                                 col_block, row_block, a, b, alpha, std::nullopt,
                                                 near_inf, capacity);
  return out;
}

// softmax_check's kernel without the screen: what redoes P from a corrected S.
abft::SoftmaxCheck unscreened(abft::SoftmaxCheck k) {
  k.screen.sides = 0;
  return k;
}

Six corrected_outputs(const Corrected& c, const at::Tensor& failed) {
  const auto& o = c.softmax.outputs;
  return {o[0], failed, o[2], o[3], o[4], o[5]};
}

Six softmax_correct_tally_cpu(const at::Tensor& s, int64_t col_block, int64_t row_block,
                              at::TensorList col, at::TensorList row,
                              at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                              const OptionalTensor& mask, bool causal, double scale,
                              int64_t block, const OptionalTensor& u, const OptionalTensor& z,
                              const at::Tensor& a, const at::Tensor& b, double alpha,
                              double near_inf, int64_t capacity, at::Tensor& counts,
                              const at::Tensor& step, at::Tensor& log, at::Tensor& logged) {
  const Corrected c =
      prepare_corrected(s, col_block, row_block, col, row, col_bounds, row_bounds, mask, causal,
                        scale, block, u, z, a, b, alpha, near_inf, capacity, at::kCPU, false);
  const abft::SoftmaxCheck& k = c.softmax.k;
  at::parallel_for(0, abft::softmax_check_tasks(k), 1, [&](int64_t begin, int64_t end) {
    abft::softmax_check_cpu(k, begin, end);
  });
  const bool f64 = s.scalar_type() == at::kDouble;
  at::parallel_for(0, k.s.batch, 1, [&](int64_t begin, int64_t end) {
    abft::correct_cpu(c.correction.k, f64, begin, end);
  });
  const auto& [status, kind, rows, cols, magnitude] = c.correction.found;
  const abft::SoftmaxCheck redo = unscreened(k);
  const int64_t bands = k.s.batch > 0 ? abft::softmax_check_tasks(k) / k.s.batch : 0;
  const int8_t* settled = status.data_ptr<int8_t>();
  at::parallel_for(0, k.s.batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (settled[m] == 1) abft::softmax_check_cpu(redo, m * bands, (m + 1) * bands);
    }
  });
  auto [t, failed, flat] = abft_binding::prepare_tally(status, kind, rows, cols, magnitude,
                                                       {counts, step, log, logged});
  abft::tally_cpu(t);
  return corrected_outputs(c, failed);
}

#ifdef ABFT_CUDA_KERNELS
Six softmax_correct_tally_cuda(const at::Tensor& s, int64_t col_block, int64_t row_block,
                               at::TensorList col, at::TensorList row,
                               at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                               const OptionalTensor& mask, bool causal, double scale,
                               int64_t block, const OptionalTensor& u, const OptionalTensor& z,
                               const at::Tensor& a, const at::Tensor& b, double alpha,
                               double near_inf, int64_t capacity, at::Tensor& counts,
                               const at::Tensor& step, at::Tensor& log, at::Tensor& logged) {
  const abft_binding::CudaLaunch launch(s);
  const Corrected c =
      prepare_corrected(s, col_block, row_block, col, row, col_bounds, row_bounds, mask, causal,
                        scale, block, u, z, a, b, alpha, near_inf, capacity, launch.device(),
                        true);
  const abft::SoftmaxCheck& k = c.softmax.k;
  const char* op = "megatron_abft::softmax_correct_tally";
  const auto& [status, kind, rows, cols, magnitude] = c.correction.found;
  auto [t, failed, flat] = abft_binding::prepare_tally(status, kind, rows, cols, magnitude,
                                                       {counts, step, log, logged});
  const abft::Launchers& kernels = launch.kernels();
  launch.check(kernels.softmax_check(k, launch.stream()), op);
  launch.check(kernels.correct_redo_tally(c.correction.k, unscreened(k), t, launch.stream()), op);
  return corrected_outputs(c, failed);
}
#endif

}  // namespace

ABFT_OPS(m) {
  m.def(
      "softmax_check(Tensor s, int col_block, int row_block, Tensor[] col, Tensor[] row, "
      "float[] col_bounds, float[] row_bounds, Tensor? mask, bool causal, float scale, int block, "
      "Tensor? u, Tensor? z) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "softmax_correct_tally(Tensor(a!) s, int col_block, int row_block, Tensor[] col, "
      "Tensor[] row, float[] col_bounds, float[] row_bounds, Tensor? mask, bool causal, "
      "float scale, int block, Tensor? u, Tensor? z, Tensor a, Tensor b, float alpha, "
      "float near_inf, int capacity, Tensor(b!) counts, Tensor step, Tensor(c!) log, "
      "Tensor(d!) logged) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
}

// As abft_ops.cpp's kernels: softmax_check writes no input, and takes no part in autograd.
ABFT_IMPLS(Autograd, m) {
  m.impl("softmax_check", torch::CppFunction::makeFallthrough());
}

ABFT_IMPLS(CPU, m) {
  m.impl("softmax_check", &softmax_check_cpu);
  m.impl("softmax_correct_tally", &softmax_correct_tally_cpu);
}

#ifdef ABFT_CUDA_KERNELS
ABFT_IMPLS(CUDA, m) {
  m.impl("softmax_check", &softmax_check_cuda);
  m.impl("softmax_correct_tally", &softmax_correct_tally_cuda);
}
#endif
