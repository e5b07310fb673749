// Torch binding of the checksum kernels (abft.h): checks the inputs, allocates the outputs and
// forwards raw pointers. Registers the ops megatron_abft::block_sums, row_products, operand_pass,
// screen, verify_correct, tally, verify_correct_tally and add_bias with torch.library, on CPU
// always and on CUDA in CUDA builds, and the CUDA kernels of block_sums_pair and row_products_pair
// (abft_encode.cpp has them on other devices); their fake implementations for torch.compile are in
// megatron_abft/ops/compiled.py. The helpers other bindings share are declared in abft_binding.h.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#ifdef ABFT_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <vector>
#include <utility>

#include "kernels/abft.h"
#include "bindings/abft_binding.h"
#ifdef ABFT_EMULATED
#include "emulator/cuda_emulator.h"
#endif

namespace abft_binding {

#ifdef ABFT_CUDA_KERNELS
CudaLaunch::CudaLaunch(const at::Tensor& on) : device_(on.device().type()) {
#ifdef ABFT_WITH_CUDA
  if (device_ == at::kCUDA) {
    guard_.emplace(on.device());
    kernels_ = &abft::cuda_launchers;
    stream_ = c10::cuda::getCurrentCUDAStream(on.device().index()).stream();
    return;
  }
#endif
#ifdef ABFT_EMULATED
  if (device_ == at::kCPU) {
    kernels_ = &abft::emulated_launchers;
    cuda_emulator::forget_errors();  // so that a failure below is this op's
    return;
  }
#endif
  TORCH_CHECK(false, "megatron_abft: the CUDA kernels run on a GPU, or emulated on the CPU (",
              "megatron_abft.ops.compiled.emulated_cuda); got a tensor on ", on.device());
}

void CudaLaunch::check(int error, const char* op) const {
  if (error == 0) return;
#ifdef ABFT_WITH_CUDA
  if (device_ == at::kCUDA) C10_CUDA_CHECK(static_cast<cudaError_t>(error));
#endif
#ifdef ABFT_EMULATED
  const std::string why = cuda_emulator::last_message();
  TORCH_CHECK(false, op, ": the emulated CUDA kernels failed (error ", error, "): ",
              why.empty() ? "the launcher refused its arguments" : why);
#endif
}
#endif

// `what` names the tensor in the error message.
abft::DType kernel_dtype(const at::Tensor& c, const char* what) {
  switch (c.scalar_type()) {
    case at::kFloat:
      return abft::DType::F32;
    case at::kDouble:
      return abft::DType::F64;
    case at::kBFloat16:
      return abft::DType::BF16;
    case at::kHalf:
      return abft::DType::F16;
    default:
      TORCH_CHECK(false, what, " must be fp32, fp64, bf16 or fp16; got ", c.scalar_type());
  }
}

void check_inputs(const at::Tensor& c, int64_t col_block, int64_t row_block,
                  at::DeviceType device) {
  TORCH_CHECK(c.device().type() == device, "megatron_abft::block_sums: c is on ", c.device(),
              " but this kernel runs on ", device);
  TORCH_CHECK(c.layout() == at::kStrided,
              "megatron_abft::block_sums: c must be a dense strided tensor (any strides); got ",
              c.layout(), " layout");
  TORCH_CHECK(c.dim() >= 2 && c.dim() <= 2 + abft::kMaxBatchDims,
              "megatron_abft::block_sums: c must be [*batch, m, n] with at most ",
              abft::kMaxBatchDims, " batch dims; got shape ", c.sizes());
  for (auto [name, block] : {std::pair{"col_block", col_block}, std::pair{"row_block", row_block}}) {
    TORCH_CHECK(block == 0 || block >= 2, "megatron_abft::block_sums: ", name,
                " must be 0 (side not checked) or >= 2; got ", block);
  }
  TORCH_CHECK(col_block > 0 || row_block > 0,
              "megatron_abft::block_sums: give col_block or row_block (both are 0)");
}

// The strides of t broadcast to `shape` (which it broadcasts to), as t.expand(shape) has them:
// the kernels' view of a broadcast without the view (a tensor and two calls into ATen).
std::vector<int64_t> broadcast_strides(const at::Tensor& t, at::IntArrayRef shape) {
  std::vector<int64_t> strides(shape.size(), 0);
  const int64_t lead = int64_t(shape.size()) - t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) {
    strides[lead + d] = t.size(d) == 1 && shape[lead + d] != 1 ? 0 : t.stride(d);
  }
  return strides;
}

abft::MatrixBatch describe(const at::Tensor& c, at::IntArrayRef shape) {
  const std::vector<int64_t> strides = broadcast_strides(c, shape);
  const int64_t dims = int64_t(shape.size());
  abft::MatrixBatch matrices{};
  matrices.data = c.data_ptr();
  matrices.dtype = kernel_dtype(c);
  matrices.batch_dims = int(dims - 2);
  matrices.batch = 1;
  for (int64_t d = 0; d < dims - 2; ++d) {
    matrices.batch_sizes[d] = shape[d];
    matrices.batch_strides[d] = strides[d];
    matrices.batch *= shape[d];
  }
  matrices.rows = shape[dims - 2];
  matrices.cols = shape[dims - 1];
  matrices.row_stride = strides[dims - 2];
  matrices.col_stride = strides[dims - 1];
  return matrices;
}

abft::MatrixBatch describe(const at::Tensor& c) { return describe(c, c.sizes()); }

// The outputs, and the kernels' view of C and of the outputs (plan_block_sums).
std::tuple<Sums, abft::MatrixBatch, abft::BlockSums> prepare(const at::Tensor& c,
                                                            int64_t col_block,
                                                            int64_t row_block) {
  const int64_t dims = c.dim(), m = c.size(-2), n = c.size(-1);
  auto batch = c.sizes().slice(0, dims - 2).vec();
  auto shape = [&](int64_t block, int64_t checked, int64_t across) {
    auto s = batch;
    s.insert(s.end(), {block > 0 ? abft::ceil_div(checked, block) : 0, 2, across});
    return s;
  };
  const auto options = c.options().dtype(c.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  Sums sums{at::empty(shape(col_block, m, n), options), at::empty(shape(col_block, m, n), options),
            at::empty(shape(row_block, n, m), options), at::empty(shape(row_block, n, m), options)};
  auto& [col_sums, col_sizes, row_sums, row_sizes] = sums;

  const auto [matrices, out] =
      plan_block_sums(describe(c), {col_sums.data_ptr(), col_sizes.data_ptr(), col_block,
                                    row_sums.data_ptr(), row_sizes.data_ptr(), row_block});
  return {std::move(sums), matrices, out};
}

std::pair<abft::MatrixBatch, abft::BlockSums> plan_block_sums(abft::MatrixBatch c,
                                                              abft::BlockSums out) {
  if (abft::column_major(c)) {
    std::swap(c.rows, c.cols);
    std::swap(c.row_stride, c.col_stride);
    out = {out.row_sums, out.row_sizes, out.row_block, out.col_sums, out.col_sizes, out.col_block};
  }
  return {c, out};
}

Sums block_sums_cpu(const at::Tensor& c, int64_t col_block, int64_t row_block) {
  check_inputs(c, col_block, row_block, at::kCPU);
  auto [sums, matrices, out] = prepare(c, col_block, row_block);
  const int64_t tasks = abft::block_sums_tasks(matrices, out);
  at::parallel_for(0, tasks, 1, [&, &matrices = matrices, &out = out](int64_t begin, int64_t end) {
    abft::block_sums_cpu(matrices, out, begin, end);
  });
  return sums;
}

// row_products: checks a like block_sums' c, and u, z [*batch', r, k] in the accumulation dtype
// with batch dims that broadcast to a's; returns scale a @ u^T and |scale| |a| @ z^T as
// [*batch, m, r].
std::tuple<Products, abft::MatrixBatch, abft::RowProducts, at::Tensor, at::Tensor> prepare_products(
    const at::Tensor& a, const at::Tensor& u, const at::Tensor& z, double scale,
    at::DeviceType device) {
  TORCH_CHECK(a.device().type() == device, "megatron_abft::row_products: a is on ", a.device(),
              " but this kernel runs on ", device);
  TORCH_CHECK(a.layout() == at::kStrided,
              "megatron_abft::row_products: a must be a dense strided tensor; got ", a.layout());
  TORCH_CHECK(a.dim() >= 2 && a.dim() <= 2 + abft::kMaxBatchDims,
              "megatron_abft::row_products: a must be [*batch, m, k] with at most ",
              abft::kMaxBatchDims, " batch dims; got shape ", a.sizes());
  const auto acc = a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  kernel_dtype(a, "megatron_abft::row_products: a");
  auto batch = a.sizes().slice(0, a.dim() - 2).vec();
  std::vector<at::Tensor> vectors;  // read where they are, unless a vector is strided
  std::vector<abft::MatrixBatch> views;
  for (auto [name, v] : {std::pair{"u", &u}, std::pair{"z", &z}}) {
    TORCH_CHECK(v->device() == a.device(), "megatron_abft::row_products: ", name, " is on ",
                v->device(), " but a is on ", a.device());
    TORCH_CHECK(v->scalar_type() == acc, "megatron_abft::row_products: ", name, " must be ", acc,
                " (the accumulation dtype of a ", a.scalar_type(), "); got ", v->scalar_type());
    TORCH_CHECK(v->dim() == a.dim() && v->size(-1) == a.size(-1),
                "megatron_abft::row_products: ", name, " must be [*batch, r, ", a.size(-1),
                "] with as many dims as a ", a.sizes(), "; got ", v->sizes());
    auto shape = batch;
    shape.insert(shape.end(), {v->size(-2), a.size(-1)});
    for (int64_t d = 0; d < a.dim() - 2; ++d) {
      TORCH_CHECK(v->size(d) == 1 || v->size(d) == a.size(d), "megatron_abft::row_products: ",
                  name, " ", v->sizes(), " does not broadcast to the batch of a ", a.sizes());
    }
    vectors.push_back(v->size(-1) > 1 && v->stride(-1) != 1 ? v->contiguous() : *v);
    views.push_back(describe(vectors.back(), shape));
  }
  const int64_t nu = u.size(-2), nz = z.size(-2);
  auto shape = [&](int64_t r) {
    auto s = batch;
    s.insert(s.end(), {a.size(-2), r});
    return s;
  };
  Products out{at::empty(shape(nu), a.options().dtype(acc)),
               at::empty(shape(nz), a.options().dtype(acc))};
  abft::RowProducts products{views[0], views[1], std::get<0>(out).data_ptr(),
                             std::get<1>(out).data_ptr(), scale};
  return {std::move(out), describe(a), products, vectors[0], vectors[1]};
}

Products row_products_cpu(const at::Tensor& a, const at::Tensor& u, const at::Tensor& z,
                          double scale) {
  auto [out, matrix, products, u_, z_] = prepare_products(a, u, z, scale, at::kCPU);
  const int64_t tasks = abft::row_products_tasks(matrix);
  at::parallel_for(0, tasks, 1, [&, &matrix = matrix, &products = products](int64_t b, int64_t e) {
    abft::row_products_cpu(matrix, products, b, e);
  });
  return out;
}

// operand_pass: block_sums of a's column side and row_products of a, one read of a on CPU.
using Pass = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

std::tuple<Pass, abft::MatrixBatch, abft::BlockSums, abft::RowProducts, at::Tensor, at::Tensor>
prepare_pass(const at::Tensor& a, int64_t block, const at::Tensor& u, const at::Tensor& z,
             double scale, at::DeviceType device) {
  TORCH_CHECK(block >= 2, "megatron_abft::operand_pass: block must be >= 2; got ", block);
  check_inputs(a, block, 0, device);
  TORCH_CHECK(!(a.stride(-2) == 1 && a.stride(-1) != 1 && a.size(-2) > 1),
              "megatron_abft::operand_pass: a must not be column-major (strides ", a.strides(),
              "); use block_sums and row_products");
  auto [sums, matrices, out] = prepare(a, block, 0);
  auto [products, matrix, row_products, u_, z_] = prepare_products(a, u, z, scale, device);
  Pass result{std::get<0>(sums), std::get<1>(sums), std::get<0>(products),
              std::get<1>(products)};
  return {std::move(result), matrices, out, row_products, u_, z_};
}

Pass operand_pass_cpu(const at::Tensor& a, int64_t block, const at::Tensor& u,
                      const at::Tensor& z, double scale) {
  auto [result, matrices, out, products, u_, z_] =
      prepare_pass(a, block, u, z, scale, at::kCPU);
  const int64_t tasks = abft::block_sums_tasks(matrices, out);
  at::parallel_for(0, tasks, 1,
                   [&, &matrices = matrices, &out = out, &products = products](int64_t b,
                                                                             int64_t e) {
                     abft::block_sums_cpu(matrices, out, b, e, &products);
                   });
  return result;
}

#ifdef ABFT_CUDA_KERNELS
Pass operand_pass_cuda(const at::Tensor& a, int64_t block, const at::Tensor& u,
                       const at::Tensor& z, double scale) {
  const CudaLaunch launch(a);
  auto [result, matrices, out, products, u_, z_] =
      prepare_pass(a, block, u, z, scale, launch.device());
  const char* op = "megatron_abft::operand_pass";
  launch.check(launch.kernels().block_sums(matrices, out, launch.stream(), nullptr), op);
  launch.check(
      launch.kernels().row_products(matrices, products, launch.stream(), nullptr, nullptr), op);
  return result;
}

Products row_products_cuda(const at::Tensor& a, const at::Tensor& u, const at::Tensor& z,
                           double scale) {
  const CudaLaunch launch(a);
  auto [out, matrix, products, u_, z_] = prepare_products(a, u, z, scale, launch.device());
  const char* op = "megatron_abft::row_products";
  launch.check(
      launch.kernels().row_products(matrix, products, launch.stream(), nullptr, nullptr), op);
  return out;
}

Sums block_sums_cuda(const at::Tensor& c, int64_t col_block, int64_t row_block) {
  const CudaLaunch launch(c);
  check_inputs(c, col_block, row_block, launch.device());
  auto [sums, matrices, out] = prepare(c, col_block, row_block);
  launch.check(launch.kernels().block_sums(matrices, out, launch.stream(), nullptr),
               "megatron_abft::block_sums");
  return sums;
}

// block_sums_pair and row_products_pair on CUDA: the two ops' work in one launch (on other
// devices they are the two ops: abft_encode.cpp). a and b share a device and a dtype.
void check_pair(const char* op, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device() == b.device() && a.scalar_type() == b.scalar_type(), op, ": a (",
              a.scalar_type(), " on ", a.device(), ") and b (", b.scalar_type(), " on ",
              b.device(), ") must share a dtype and a device");
}

Eight block_sums_pair_cuda(const at::Tensor& a, int64_t a_col_block, int64_t a_row_block,
                           const at::Tensor& b, int64_t b_col_block, int64_t b_row_block) {
  const char* op = "megatron_abft::block_sums_pair";
  check_pair(op, a, b);
  const CudaLaunch launch(a);
  check_inputs(a, a_col_block, a_row_block, launch.device());
  check_inputs(b, b_col_block, b_row_block, launch.device());
  auto [a_sums, a_matrices, a_out] = prepare(a, a_col_block, a_row_block);
  auto [b_sums, b_matrices, b_out] = prepare(b, b_col_block, b_row_block);
  launch.check(
      launch.kernels().block_sums_pair(a_matrices, a_out, b_matrices, b_out, launch.stream()), op);
  const auto& [a0, a1, a2, a3] = a_sums;
  const auto& [b0, b1, b2, b3] = b_sums;
  return {a0, a1, a2, a3, b0, b1, b2, b3};
}

Sums row_products_pair_cuda(const at::Tensor& a, const at::Tensor& u, const at::Tensor& z,
                            double scale, const at::Tensor& b, const at::Tensor& v,
                            const at::Tensor& y, double b_scale) {
  const char* op = "megatron_abft::row_products_pair";
  check_pair(op, a, b);
  const CudaLaunch launch(a);
  auto [a_found, a_matrix, a_products, u_, z_] =
      prepare_products(a, u, z, scale, launch.device());
  auto [b_found, b_matrix, b_products, v_, y_] =
      prepare_products(b, v, y, b_scale, launch.device());
  launch.check(launch.kernels().row_products(a_matrix, a_products, launch.stream(), &b_matrix,
                                             &b_products),
               op);
  const auto& [a0, a1] = a_found;
  const auto& [b0, b1] = b_found;
  return {a0, a1, b0, b1};
}
#endif

// screen: one side's references checked against c and broadcast to its batch, in the kernels'
// view. refs is [sums, magnitude] or [sums, magnitude, bias_magnitude]; bounds is (out, gemm,
// floor, length) of abft.h's ScreenSide.
abft::ScreenSide screen_side(const at::Tensor& c, const char* name, int64_t block, int64_t checked,
                             int64_t across, at::TensorList refs, at::ArrayRef<double> bounds) {
  TORCH_CHECK(refs.size() == 2 || refs.size() == 3, "megatron_abft::screen: ", name,
              " must be [sums, magnitude] or [sums, magnitude, bias_magnitude]; got ",
              refs.size(), " tensors");
  TORCH_CHECK(bounds.size() == 4, "megatron_abft::screen: ", name,
              "_bounds must be (out, gemm, floor, length); got ", bounds.size(), " numbers");
  const auto acc = c.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t nb = abft::ceil_div(checked, block);
  auto batch = c.sizes().slice(0, c.dim() - 2).vec();
  auto sums_shape = batch, vector_shape = batch;
  sums_shape.insert(sums_shape.end(), {nb, 2, across});
  vector_shape.insert(vector_shape.end(), {nb, across});
  const char* parts[] = {"sums", "magnitude", "bias_magnitude"};
  std::vector<int64_t> strides[3];
  for (size_t k = 0; k < refs.size(); ++k) {
    const at::Tensor& ref = refs[k];
    const auto& shape = k == 0 ? sums_shape : vector_shape;
    TORCH_CHECK(ref.device() == c.device(), "megatron_abft::screen: ", name, " ", parts[k],
                " is on ", ref.device(), " but c is on ", c.device());
    TORCH_CHECK(ref.scalar_type() == acc, "megatron_abft::screen: ", name, " ", parts[k],
                " must be ", acc, " (the accumulation dtype of c ", c.scalar_type(), "); got ",
                ref.scalar_type());
    TORCH_CHECK(ref.layout() == at::kStrided && at::is_expandable_to(ref.sizes(), shape),
                "megatron_abft::screen: ", name, " ", parts[k], " of shape ", ref.sizes(),
                " does not broadcast to ", at::IntArrayRef(shape), " for c of shape ", c.sizes(),
                " and block ", block);
    strides[k] = broadcast_strides(ref, shape);
  }
  abft::ScreenSide side{};
  side.nb = nb;
  side.n = across;
  side.ref_sums = refs[0].data_ptr();
  side.magnitude = refs[1].data_ptr();
  side.bias = refs.size() == 3 ? refs[2].data_ptr() : nullptr;
  std::copy(strides[0].begin(), strides[0].end(), side.ref_strides);
  std::copy(strides[1].begin(), strides[1].end(), side.magnitude_strides);
  std::copy(strides[2].begin(), strides[2].end(), side.bias_strides);
  side.out = bounds[0];
  side.gemm = bounds[1];
  side.floor = bounds[2];
  side.length = bounds[3];
  return side;
}

// The screen of c given its block sums (col_sums, col_sizes, row_sums, row_sizes).
std::tuple<abft::Screen, at::Tensor> prepare_screen(const at::Tensor& c, const Sums& sums,
                                                    int64_t col_block, int64_t row_block,
                                                    at::TensorList col, at::TensorList row,
                                                    at::ArrayRef<double> col_bounds,
                                                    at::ArrayRef<double> row_bounds,
                                                    const abft::Tiling* tiling) {
  const int64_t m = c.size(-2), n = c.size(-1);
  abft::Screen screen{};
  screen.batch_dims = int(c.dim() - 2);
  screen.batch = 1;
  for (int d = 0; d < screen.batch_dims; ++d) {
    screen.batch_sizes[d] = c.size(d);
    screen.batch *= c.size(d);
  }
  const at::Tensor* found[] = {&std::get<0>(sums), &std::get<1>(sums), &std::get<2>(sums),
                               &std::get<3>(sums)};
  for (int k = 0; k < 2; ++k) {
    const bool is_col = k == 0;
    const int64_t block = is_col ? col_block : row_block;
    const at::TensorList refs = is_col ? col : row;
    const char* name = is_col ? "col" : "row";
    if (block == 0) {
      TORCH_CHECK(refs.empty(), "megatron_abft::screen: ", name, "_block is 0 but ", name,
                  " references were given");
      continue;
    }
    abft::ScreenSide side =
        screen_side(c, name, block, is_col ? m : n, is_col ? n : m, refs,
                    is_col ? col_bounds : row_bounds);
    side.sums = found[2 * k]->data_ptr();
    side.sizes = found[2 * k + 1]->data_ptr();
    screen.side[screen.sides++] = side;
  }
  auto shape = c.sizes().slice(0, c.dim() - 2).vec();
  shape.push_back(tiling == nullptr ? 1 : tiling->row_tiles * tiling->col_tiles);
  const auto options = c.options().dtype(at::kInt);
  auto flagged = tiling == nullptr ? at::zeros(shape, options) : at::empty(shape, options);
  screen.flagged = flagged.data_ptr<int32_t>();
  screen.slots = shape.back();
  return {screen, flagged};
}

at::Tensor flagged_per_matrix(const at::Tensor& flagged) {
  return flagged.size(-1) == 1 ? flagged.select(-1, 0) : flagged.sum(-1, false, at::kInt);
}

at::Tensor screen_cpu(const at::Tensor& c, int64_t col_block, int64_t row_block,
                      at::TensorList col, at::TensorList row, at::ArrayRef<double> col_bounds,
                      at::ArrayRef<double> row_bounds) {
  const Sums sums = block_sums_cpu(c, col_block, row_block);
  auto [screen, flagged] =
      prepare_screen(c, sums, col_block, row_block, col, row, col_bounds, row_bounds);
  const bool f64 = c.scalar_type() == at::kDouble;
  at::parallel_for(0, screen.batch, 1, [&, &screen = screen](int64_t begin, int64_t end) {
    abft::screen_cpu(screen, f64, begin, end);
  });
  return flagged_per_matrix(flagged);
}

#ifdef ABFT_CUDA_KERNELS
at::Tensor screen_cuda(const at::Tensor& c, int64_t col_block, int64_t row_block,
                       at::TensorList col, at::TensorList row, at::ArrayRef<double> col_bounds,
                       at::ArrayRef<double> row_bounds) {
  const CudaLaunch launch(c);
  check_inputs(c, col_block, row_block, launch.device());
  const auto [sums, matrices, out] = prepare(c, col_block, row_block);
  const abft::Tiling tiling = abft::block_sums_tiling(matrices, out);
  auto [screen, flagged] = prepare_screen(c, sums, col_block, row_block, col, row, col_bounds,
                                          row_bounds, &tiling);
  launch.check(launch.kernels().block_sums(matrices, out, launch.stream(), &screen),
               "megatron_abft::screen");
  return flagged_per_matrix(flagged);
}
#endif

// verify_correct: the screen, then the flagged matrices located and corrected in place from the
// operands (abft.h's Correct), at most `capacity` vectors per side and pass. a [*, m, k],
// b [*, k, n] and bias [n] are checked here (check_correct_inputs) and a, b expanded to c's batch;
// the outputs are per matrix of c's batch.
void check_correct_inputs(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                          const std::optional<at::Tensor>& bias, int64_t capacity) {
  const int64_t m = c.size(-2), n = c.size(-1);
  for (auto [name, t] : {std::pair{"a", &a}, std::pair{"b", &b}}) {
    TORCH_CHECK(t->device() == c.device(), "megatron_abft::verify_correct: ", name, " is on ",
                t->device(), " but c is on ", c.device());
    TORCH_CHECK(t->layout() == at::kStrided && t->dim() >= 2,
                "megatron_abft::verify_correct: ", name, " must be a dense strided matrix batch");
    kernel_dtype(*t, name[0] == 'a' ? "megatron_abft::verify_correct: a"
                                    : "megatron_abft::verify_correct: b");
  }
  TORCH_CHECK(a.size(-2) == m && b.size(-1) == n && a.size(-1) == b.size(-2),
              "megatron_abft::verify_correct: a ", a.sizes(), " and b ", b.sizes(),
              " do not produce c of shape ", c.sizes());
  TORCH_CHECK(capacity >= 1, "megatron_abft::verify_correct: capacity must be >= 1; got ",
              capacity);

  auto batch = c.sizes().slice(0, c.dim() - 2).vec();
  auto shape = [&](int64_t rows, int64_t cols) {
    auto s = batch;
    s.insert(s.end(), {rows, cols});
    return s;
  };
  for (auto [name, t, rows, cols] :
       {std::tuple{"a", &a, m, a.size(-1)}, std::tuple{"b", &b, b.size(-2), n}}) {
    TORCH_CHECK(t->dim() <= c.dim() && at::is_expandable_to(t->sizes(), shape(rows, cols)),
                "megatron_abft::verify_correct: ", name, " ", t->sizes(),
                " does not broadcast to the batch of c ", c.sizes());
  }
  if (bias.has_value()) {
    const at::Tensor& v = *bias;
    TORCH_CHECK(v.device() == c.device() && v.dim() == 1 && v.size(0) == n,
                "megatron_abft::verify_correct: bias must be [", n, "] on ", c.device(),
                "; got ", v.sizes(), " on ", v.device());
    kernel_dtype(v, "megatron_abft::verify_correct: bias");
  }
}

Correction prepare_correct(const at::Tensor& c, const Sums& sums, const abft::Screen& screen,
                           int64_t col_block, int64_t row_block, const at::Tensor& a,
                           const at::Tensor& b, double alpha,
                           const std::optional<at::Tensor>& bias, double near_inf,
                           int64_t capacity) {
  check_correct_inputs(c, a, b, bias, capacity);
  const int64_t m = c.size(-2), n = c.size(-1);
  auto batch = c.sizes().slice(0, c.dim() - 2).vec();
  auto shape = [&](int64_t rows, int64_t cols) {
    auto s = batch;
    s.insert(s.end(), {rows, cols});
    return s;
  };
  Correction out;
  abft::Correct& k = out.k;
  k.screen = screen;
  k.col_side = k.row_side = -1;
  int side = 0;
  if (col_block > 0) k.col_side = side++;
  if (row_block > 0) k.row_side = side++;
  k.col_block = col_block;
  k.row_block = row_block;
  k.c = describe(c);
  k.data = c.data_ptr();
  k.a = describe(a, shape(m, a.size(-1)));  // the operands broadcast to c's batch
  k.b = describe(b, shape(b.size(-2), n));
  k.alpha = alpha;
  k.bias = nullptr;
  if (bias.has_value()) {
    const at::Tensor& v = *bias;
    k.bias = v.data_ptr();
    k.bias_dtype = kernel_dtype(v, "megatron_abft::verify_correct: bias");
    k.bias_stride = v.stride(0);
  }
  k.near_inf = near_inf;
  k.vectors = capacity;
  k.capacity = correction_log(capacity, m, n, std::max(col_block, row_block));
  // one scratch: the sums and sizes the correction keeps, each side's shaped as its block sums,
  // then the log of its writes
  const at::Tensor* found[] = {&std::get<0>(sums), &std::get<1>(sums), &std::get<2>(sums),
                               &std::get<3>(sums)};
  int64_t bytes = 2 * screen.batch * k.capacity * 8;
  for (const at::Tensor* t : found) bytes += t->numel() * t->element_size();
  out.scratch = at::empty({bytes}, c.options().dtype(at::kByte));
  char* cursor = static_cast<char*>(out.scratch.data_ptr());
  k.log_at = reinterpret_cast<int64_t*>(cursor);
  k.log_bits = reinterpret_cast<uint64_t*>(cursor + screen.batch * k.capacity * 8);
  cursor += 2 * screen.batch * k.capacity * 8;
  for (int s = 0, side = 0; s < 2; ++s) {
    if ((s == 0 ? col_block : row_block) == 0) continue;
    k.initial_sums[side] = cursor;
    cursor += found[2 * s]->numel() * found[2 * s]->element_size();
    k.initial_sizes[side++] = cursor;
    cursor += found[2 * s + 1]->numel() * found[2 * s + 1]->element_size();
  }
  const auto index = c.options().dtype(at::kLong);
  const auto acc = c.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  out.found = {at::empty(batch, c.options().dtype(at::kChar)),
               at::empty(batch, c.options().dtype(at::kChar)), at::empty(batch, index),
               at::empty(batch, index), at::empty(batch, c.options().dtype(acc))};
  auto& [status, kind, row, col, magnitude] = out.found;
  k.status = status.data_ptr<int8_t>();
  k.kind = kind.data_ptr<int8_t>();
  k.row = row.data_ptr<int64_t>();
  k.col = col.data_ptr<int64_t>();
  k.magnitude = magnitude.data_ptr();
  return out;
}

// verify_correct's results where the screen flagged no matrix, as the correction writes them.
Found all_clean(const at::Tensor& c) {
  const auto batch = c.sizes().slice(0, c.dim() - 2);
  const auto acc = c.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto index = c.options().dtype(at::kLong);
  return {at::zeros(batch, c.options().dtype(at::kChar)),
          at::zeros(batch, c.options().dtype(at::kChar)), at::full(batch, -1, index),
          at::full(batch, -1, index), at::zeros(batch, c.options().dtype(acc))};
}

// On the CPU the screen runs before the correction, which is prepared only where it flagged a
// matrix: a clean check (nearly every one) allocates no scratch for it.
Found verify_correct_cpu(const at::Tensor& c, int64_t col_block, int64_t row_block,
                         at::TensorList col, at::TensorList row, at::ArrayRef<double> col_bounds,
                         at::ArrayRef<double> row_bounds, const at::Tensor& a,
                         const at::Tensor& b, double alpha, const std::optional<at::Tensor>& bias,
                         double near_inf, int64_t capacity) {
  check_correct_inputs(c, a, b, bias, capacity);
  const Sums sums = block_sums_cpu(c, col_block, row_block);
  const auto [screen, flagged] =
      prepare_screen(c, sums, col_block, row_block, col, row, col_bounds, row_bounds);
  const bool f64 = c.scalar_type() == at::kDouble;
  at::parallel_for(0, screen.batch, 1, [&, &screen = screen](int64_t begin, int64_t end) {
    abft::screen_cpu(screen, f64, begin, end);
  });
  const int32_t* counts = flagged.const_data_ptr<int32_t>();
  if (std::all_of(counts, counts + flagged.numel(), [](int32_t n) { return n == 0; })) {
    return all_clean(c);
  }
  const Correction correction = prepare_correct(c, sums, screen, col_block, row_block, a, b,
                                                alpha, bias, near_inf, capacity);
  at::parallel_for(0, screen.batch, 1, [&](int64_t begin, int64_t end) {
    abft::correct_cpu(correction.k, f64, begin, end);
  });
  return correction.found;
}

#ifdef ABFT_CUDA_KERNELS
// The screen and the correction of c given its block sums, for one launch each; the tensors they
// point into are kept alive here.
struct Verification {
  abft::Screen screen;
  at::Tensor flagged;
  Correction correction;
};

Verification prepare_verification(const at::Tensor& c, const Sums& sums, int64_t col_block,
                                  int64_t row_block, at::TensorList col, at::TensorList row,
                                  at::ArrayRef<double> col_bounds,
                                  at::ArrayRef<double> row_bounds, const at::Tensor& a,
                                  const at::Tensor& b, double alpha,
                                  const std::optional<at::Tensor>& bias, double near_inf,
                                  int64_t capacity, const abft::Tiling* tiling) {
  Verification v;
  std::tie(v.screen, v.flagged) = prepare_screen(c, sums, col_block, row_block, col, row,
                                                 col_bounds, row_bounds, tiling);
  v.correction = prepare_correct(c, sums, v.screen, col_block, row_block, a, b, alpha, bias,
                                 near_inf, capacity);
  return v;
}

// What verify_correct and verify_correct_tally run on CUDA: C's block sums, screened by their
// tiles, then the correction, or, given a guard's ledger (written in place), the correction and
// the tally of what it found in one launch.
struct CudaVerification {
  Found found;
  at::Tensor failed;
};

CudaVerification verify_on_cuda(const at::Tensor& c, int64_t col_block, int64_t row_block,
                                at::TensorList col, at::TensorList row,
                                at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                                const at::Tensor& a, const at::Tensor& b, double alpha,
                                const std::optional<at::Tensor>& bias, double near_inf,
                                int64_t capacity, const LedgerArgs* ledger) {
  const CudaLaunch launch(c);
  check_inputs(c, col_block, row_block, launch.device());
  const auto [sums, matrices, out] = prepare(c, col_block, row_block);
  const abft::Tiling tiling = abft::block_sums_tiling(matrices, out);
  const Verification v = prepare_verification(c, sums, col_block, row_block, col, row,
                                              col_bounds, row_bounds, a, b, alpha, bias,
                                              near_inf, capacity, &tiling);
  const bool f64 = c.scalar_type() == at::kDouble;
  const abft::Launchers& kernels = launch.kernels();
  const char* op = "megatron_abft::verify_correct";
  launch.check(kernels.block_sums(matrices, out, launch.stream(), &v.screen), op);
  CudaVerification result{v.correction.found, {}};
  if (ledger == nullptr) {
    launch.check(kernels.correct(v.correction.k, f64, launch.stream()), op);
    return result;
  }
  const auto& [status, kind, rows, cols, magnitude] = result.found;
  auto [t, failed, flat] = prepare_tally(status, kind, rows, cols, magnitude, *ledger);
  launch.check(kernels.correct_tally(v.correction.k, t, f64, launch.stream()),
               "megatron_abft::verify_correct_tally");
  result.failed = failed;
  return result;
}

Found verify_correct_cuda(const at::Tensor& c, int64_t col_block, int64_t row_block,
                          at::TensorList col, at::TensorList row, at::ArrayRef<double> col_bounds,
                          at::ArrayRef<double> row_bounds, const at::Tensor& a,
                          const at::Tensor& b, double alpha,
                          const std::optional<at::Tensor>& bias, double near_inf,
                          int64_t capacity) {
  return verify_on_cuda(c, col_block, row_block, col, row, col_bounds, row_bounds, a, b, alpha,
                        bias, near_inf, capacity, nullptr)
      .found;
}
#endif

void check_ledger(const LedgerArgs& ledger, const at::Tensor& status) {
  const at::Tensor& counts = ledger.counts;
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 2 && counts.size(0) == 3 &&
                  counts.size(1) >= 1 && counts.size(1) <= abft::kMaxKinds &&
                  counts.is_contiguous() && counts.device() == status.device(),
              "megatron_abft::tally: counts ", counts.sizes(), " ", counts.scalar_type(),
              "; want a contiguous int64 [3, kinds <= ", abft::kMaxKinds, "] on ",
              status.device());
  const at::Tensor &step = ledger.step, &log = ledger.log, &logged = ledger.logged;
  TORCH_CHECK(step.scalar_type() == at::kDouble && step.numel() == 1 &&
                  step.device() == status.device(),
              "megatron_abft::tally: step ", step.sizes(), " ", step.scalar_type(),
              "; want one float64 on ", status.device());
  TORCH_CHECK(log.scalar_type() == at::kDouble && log.dim() == 2 &&
                  log.size(1) == abft::kEventFields && log.is_contiguous() &&
                  log.device() == status.device(),
              "megatron_abft::tally: log ", log.sizes(), " ", log.scalar_type(),
              "; want a contiguous float64 [capacity, ", abft::kEventFields, "] on ",
              status.device());
  TORCH_CHECK(logged.scalar_type() == at::kLong && logged.numel() == 1 &&
                  logged.device() == status.device(),
              "megatron_abft::tally: logged ", logged.sizes(), " ", logged.scalar_type(),
              "; want one int64 on ", status.device());
}

// tally (abft.h): the per-matrix results of verify_correct (or of the PyTorch path), flattened,
// into a ledger written in place. Returns failed (bool).
TallyArgs prepare_tally(const at::Tensor& status, const at::Tensor& kind, const at::Tensor& row,
                        const at::Tensor& col, const at::Tensor& magnitude,
                        const LedgerArgs& ledger) {
  const int64_t batch = status.numel();
  TORCH_CHECK(batch >= 1, "megatron_abft::tally: no matrices");
  const std::pair<const at::Tensor*, at::ScalarType> fields[] = {
      {&status, at::kChar}, {&kind, at::kChar}, {&row, at::kLong}, {&col, at::kLong}};
  const char* names[] = {"status", "kind", "row", "col"};
  for (int i = 0; i < 4; ++i) {
    const at::Tensor& t = *fields[i].first;
    TORCH_CHECK(t.scalar_type() == fields[i].second && t.numel() == batch &&
                    t.device() == status.device(),
                "megatron_abft::tally: ", names[i], " ", t.sizes(), " ", t.scalar_type(), " on ",
                t.device(), "; want ", batch, " ", fields[i].second, " on ", status.device());
  }
  TORCH_CHECK((magnitude.scalar_type() == at::kFloat || magnitude.scalar_type() == at::kDouble) &&
                  magnitude.numel() == batch && magnitude.device() == status.device(),
              "megatron_abft::tally: magnitude ", magnitude.sizes(), " ",
              magnitude.scalar_type(), "; want ", batch, " float or double on ", status.device());
  check_ledger(ledger, status);
  std::vector<at::Tensor> flat = {status, kind, row, col, magnitude};
  for (at::Tensor& t : flat) {  // as the kernel reads them (the correction's are already)
    if (!t.is_contiguous()) t = t.contiguous();
  }
  at::Tensor failed = at::empty({}, status.options().dtype(at::kBool));
  const abft::Tally t = tally_of(flat[0], flat[1], flat[2], flat[3], flat[4], failed, ledger);
  return {t, failed, std::move(flat)};
}

abft::Tally tally_of(const at::Tensor& status, const at::Tensor& kind, const at::Tensor& row,
                     const at::Tensor& col, const at::Tensor& magnitude, const at::Tensor& failed,
                     const LedgerArgs& ledger) {
  return {status.data_ptr<int8_t>(), kind.data_ptr<int8_t>(),
          row.data_ptr<int64_t>(),   col.data_ptr<int64_t>(),
          magnitude.data_ptr(),      magnitude.scalar_type() == at::kDouble,
          status.numel(),            int(ledger.counts.size(1)),
          ledger.counts.data_ptr<int64_t>(), failed.data_ptr<bool>(),
          ledger.step.data_ptr<double>(),    ledger.log.data_ptr<double>(),
          ledger.logged.data_ptr<int64_t>(), ledger.log.size(0)};
}

at::Tensor tally_cpu(const at::Tensor& status, const at::Tensor& kind, const at::Tensor& row,
                     const at::Tensor& col, const at::Tensor& magnitude, at::Tensor& counts,
                     const at::Tensor& step, at::Tensor& log, at::Tensor& logged) {
  auto [t, failed, flat] =
      prepare_tally(status, kind, row, col, magnitude, {counts, step, log, logged});
  abft::tally_cpu(t);
  return failed;
}

#ifdef ABFT_CUDA_KERNELS
at::Tensor tally_cuda(const at::Tensor& status, const at::Tensor& kind, const at::Tensor& row,
                      const at::Tensor& col, const at::Tensor& magnitude, at::Tensor& counts,
                      const at::Tensor& step, at::Tensor& log, at::Tensor& logged) {
  const CudaLaunch launch(status);
  auto [t, failed, flat] =
      prepare_tally(status, kind, row, col, magnitude, {counts, step, log, logged});
  launch.check(launch.kernels().tally(t, launch.stream()), "megatron_abft::tally");
  return failed;
}
#endif

// verify_correct_tally: verify_correct, then tally of what it found into a ledger (in place), as
// one op: verify_correct's five outputs, then tally's failed. A guard's sync-free check on CUDA,
// where the correction and the tally are one launch.
using Six = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Six verify_correct_tally_cpu(const at::Tensor& c, int64_t col_block, int64_t row_block,
                             at::TensorList col, at::TensorList row,
                             at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                             const at::Tensor& a, const at::Tensor& b, double alpha,
                             const std::optional<at::Tensor>& bias, double near_inf,
                             int64_t capacity, at::Tensor& counts, const at::Tensor& step,
                             at::Tensor& log, at::Tensor& logged) {
  const auto [status, kind, rows, cols, magnitude] =
      verify_correct_cpu(c, col_block, row_block, col, row, col_bounds, row_bounds, a, b, alpha,
                         bias, near_inf, capacity);
  const at::Tensor failed =
      tally_cpu(status, kind, rows, cols, magnitude, counts, step, log, logged);
  return {status, kind, rows, cols, magnitude, failed};
}

#ifdef ABFT_CUDA_KERNELS
Six verify_correct_tally_cuda(const at::Tensor& c, int64_t col_block, int64_t row_block,
                              at::TensorList col, at::TensorList row,
                              at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                              const at::Tensor& a, const at::Tensor& b, double alpha,
                              const std::optional<at::Tensor>& bias, double near_inf,
                              int64_t capacity, at::Tensor& counts, const at::Tensor& step,
                              at::Tensor& log, at::Tensor& logged) {
  const LedgerArgs ledger{counts, step, log, logged};
  const CudaVerification v = verify_on_cuda(c, col_block, row_block, col, row, col_bounds,
                                            row_bounds, a, b, alpha, bias, near_inf, capacity,
                                            &ledger);
  const auto& [status, kind, rows, cols, magnitude] = v.found;
  return {status, kind, rows, cols, magnitude, v.failed};
}
#endif

// add_bias: both sides' checksum sums and magnitudes of alpha * a @ b (encode_pair's outputs) with
// a bias [n] added to every row of C (m rows), and the bias's magnitudes [nb(m), n], [nb(n), 1],
// in one launch (abft.h, BiasTerms).

struct BiasAdd {
  abft::BiasTerms t;
  std::vector<at::Tensor> keep;  // the inputs, as the kernels read them
  Six out;
};

BiasAdd prepare_bias(const at::Tensor& col, const at::Tensor& col_magnitude,
                     const at::Tensor& row, const at::Tensor& row_magnitude,
                     const at::Tensor& bias, int64_t m, int64_t block) {
  const char* what = "megatron_abft::add_bias";
  TORCH_CHECK(block >= 1 && m >= 1, what, ": block and m must be >= 1; got ", block, " and ", m);
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) >= 1 && bias.device() == col.device(), what,
              ": bias must be a vector on ", col.device(), "; got ", bias.sizes(), " on ",
              bias.device());
  const int64_t n = bias.size(0);
  const auto acc = col.scalar_type();
  TORCH_CHECK(acc == at::kFloat || acc == at::kDouble, what, ": sums must be fp32 or fp64; got ",
              acc);
  for (const at::Tensor* t : {&col_magnitude, &row, &row_magnitude}) {
    TORCH_CHECK(t->scalar_type() == acc && t->device() == col.device(), what,
                ": sums and magnitudes need one dtype and device");
  }
  const int64_t col_blocks = abft::ceil_div(m, block), row_blocks = abft::ceil_div(n, block);
  TORCH_CHECK(col.dim() >= 3 && col.size(-3) == col_blocks && col.size(-2) == 2 &&
                  col.size(-1) == n && row.dim() >= 3 && row.size(-3) == row_blocks &&
                  row.size(-2) == 2 && row.size(-1) == m,
              what, ": sums ", col.sizes(), " and ", row.sizes(), " are not those of ", m,
              " rows and ", n, " columns in blocks of ", block);
  const auto batch = col.sizes().slice(0, col.dim() - 3);
  auto magnitude_shape = [&](int64_t blocks, int64_t across) {
    auto shape = batch.vec();
    shape.insert(shape.end(), {blocks, across});
    return shape;
  };
  TORCH_CHECK(row.sizes().slice(0, row.dim() - 3) == batch &&
                  col_magnitude.sizes() == at::IntArrayRef(magnitude_shape(col_blocks, n)) &&
                  row_magnitude.sizes() == at::IntArrayRef(magnitude_shape(row_blocks, m)),
              what, ": sums ", col.sizes(), ", ", row.sizes(), " and magnitudes ",
              col_magnitude.sizes(), ", ", row_magnitude.sizes(),
              " do not share their batch dims, or a magnitude is not its sums' shape");
  BiasAdd add;
  // the inputs read where they are, their batch dims as one (copied only where those dims do
  // not flatten to one stride)
  const int64_t count = c10::multiply_integers(batch);
  add.keep = {col.reshape({count, col_blocks, 2, n}),
              col_magnitude.reshape({count, col_blocks, n}),
              row.reshape({count, row_blocks, 2, m}),
              row_magnitude.reshape({count, row_blocks, m})};
  const auto options = col.options();
  add.out = {at::empty(col.sizes(), options),     at::empty(col_magnitude.sizes(), options),
             at::empty(row.sizes(), options),     at::empty(row_magnitude.sizes(), options),
             at::empty({col_blocks, n}, options), at::empty({row_blocks, 1}, options)};
  const auto& [col_out, col_size_out, row_out, row_size_out, col_bias, row_bias] = add.out;
  abft::BiasTerms& t = add.t;
  t.bias = bias.data_ptr();
  t.dtype = kernel_dtype(bias, "megatron_abft::add_bias: bias");
  t.stride = bias.stride(0);
  t.n = n;
  t.m = m;
  t.block = block;
  t.batch = count;
  t.f64 = acc == at::kDouble;
  t.col_in = add.keep[0].data_ptr();
  t.col_size_in = add.keep[1].data_ptr();
  t.row_in = add.keep[2].data_ptr();
  t.row_size_in = add.keep[3].data_ptr();
  std::copy_n(add.keep[0].strides().begin(), 4, t.col_in_strides);
  std::copy_n(add.keep[1].strides().begin(), 3, t.col_size_in_strides);
  std::copy_n(add.keep[2].strides().begin(), 4, t.row_in_strides);
  std::copy_n(add.keep[3].strides().begin(), 3, t.row_size_in_strides);
  t.col_out = col_out.data_ptr();
  t.col_size_out = col_size_out.data_ptr();
  t.row_out = row_out.data_ptr();
  t.row_size_out = row_size_out.data_ptr();
  t.col_bias = col_bias.data_ptr();
  t.row_bias = row_bias.data_ptr();
  return add;
}

Six add_bias_cpu(const at::Tensor& col, const at::Tensor& col_magnitude, const at::Tensor& row,
                 const at::Tensor& row_magnitude, const at::Tensor& bias, int64_t m,
                 int64_t block) {
  const BiasAdd add = prepare_bias(col, col_magnitude, row, row_magnitude, bias, m, block);
  abft::bias_terms_cpu(add.t);
  return add.out;
}

#ifdef ABFT_CUDA_KERNELS
Six add_bias_cuda(const at::Tensor& col, const at::Tensor& col_magnitude, const at::Tensor& row,
                  const at::Tensor& row_magnitude, const at::Tensor& bias, int64_t m,
                  int64_t block) {
  const CudaLaunch launch(col);
  const BiasAdd add = prepare_bias(col, col_magnitude, row, row_magnitude, bias, m, block);
  launch.check(launch.kernels().bias_terms(add.t, launch.stream()), "megatron_abft::add_bias");
  return add.out;
}
#endif

}  // namespace abft_binding

using namespace abft_binding;

ABFT_OPS(m) {
  m.def(
      "block_sums(Tensor c, int col_block, int row_block) -> (Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("row_products(Tensor a, Tensor u, Tensor z, float scale=1.0) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def(
      "operand_pass(Tensor a, int block, Tensor u, Tensor z, float scale=1.0) -> (Tensor, Tensor, "
      "Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "screen(Tensor c, int col_block, int row_block, Tensor[] col, Tensor[] row, "
      "float[] col_bounds, float[] row_bounds) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "verify_correct(Tensor(a!) c, int col_block, int row_block, Tensor[] col, Tensor[] row, "
      "float[] col_bounds, float[] row_bounds, Tensor a, Tensor b, float alpha, Tensor? bias, "
      "float near_inf, int capacity) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "tally(Tensor status, Tensor kind, Tensor row, Tensor col, Tensor magnitude, "
      "Tensor(a!) counts, Tensor step, Tensor(b!) log, Tensor(c!) logged) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "verify_correct_tally(Tensor(a!) c, int col_block, int row_block, Tensor[] col, "
      "Tensor[] row, float[] col_bounds, float[] row_bounds, Tensor a, Tensor b, float alpha, "
      "Tensor? bias, float near_inf, int capacity, Tensor(b!) counts, Tensor step, "
      "Tensor(c!) log, Tensor(d!) logged) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "add_bias(Tensor col, Tensor col_magnitude, Tensor row, Tensor row_magnitude, Tensor bias, "
      "int m, int block) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
}

// The ops that write no input take no part in autograd (checksums are not differentiated): they
// fall through its key, not into its boxed fallback, which costs a check's host time per call.
ABFT_IMPLS(Autograd, m) {
  for (const char* name : {"block_sums", "row_products", "operand_pass", "screen", "add_bias"}) {
    m.impl(name, torch::CppFunction::makeFallthrough());
  }
}

ABFT_IMPLS(CPU, m) {
  m.impl("block_sums", &block_sums_cpu);
  m.impl("row_products", &row_products_cpu);
  m.impl("operand_pass", &operand_pass_cpu);
  m.impl("screen", &screen_cpu);
  m.impl("verify_correct", &verify_correct_cpu);
  m.impl("tally", &tally_cpu);
  m.impl("verify_correct_tally", &verify_correct_tally_cpu);
  m.impl("add_bias", &add_bias_cpu);
}

#ifdef ABFT_CUDA_KERNELS
ABFT_IMPLS(CUDA, m) {
  m.impl("block_sums", &block_sums_cuda);
  m.impl("row_products", &row_products_cuda);
  m.impl("operand_pass", &operand_pass_cuda);
  m.impl("screen", &screen_cuda);
  m.impl("verify_correct", &verify_correct_cuda);
  m.impl("tally", &tally_cuda);
  m.impl("verify_correct_tally", &verify_correct_tally_cuda);
  m.impl("add_bias", &add_bias_cuda);
  m.impl("block_sums_pair", &block_sums_pair_cuda);
  m.impl("row_products_pair", &row_products_pair_cuda);
}
#endif

#ifndef ABFT_EMULATED  // the module _C (megatron_abft._emulator's is emulator_module.cpp)
namespace abft_binding {
// _C.screen_passes and _C.layouts (abft_check.cpp): functions of the module rather than ops.
PyObject* screen_passes(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* layouts(PyObject*, PyObject* const* args, Py_ssize_t nargs);
}  // namespace abft_binding

namespace {
PyMethodDef methods[] = {
    {"screen_passes", reinterpret_cast<PyCFunction>(abft_binding::screen_passes), METH_FASTCALL,
     "screen_passes(c, a, b, alpha, bias, block, col_bounds, row_bounds, capacity) -> bool: "
     "whether check_gemm's CPU screen takes the check and C passes it"},
    {"layouts", reinterpret_cast<PyCFunction>(abft_binding::layouts), METH_FASTCALL,
     "layouts(*tensors) -> tuple | None: the tensors' layouts as ints (None as -1), for a "
     "check's signature; None where an argument is neither a tensor nor None"},
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

// Importing megatron_abft._C registers the ops above; the module says how it was built: cuda = 1
// when the CUDA kernels are in, openmp = 1 when the CPU kernels' tasks run on torch's threads
// (at::parallel_for is serial in code compiled without OpenMP).
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_C", "megatron-abft checksum kernels", -1, methods, nullptr,
      nullptr, nullptr, nullptr};
  PyObject* m = PyModule_Create(&module);
#ifdef ABFT_WITH_CUDA
  const long cuda = 1;
#else
  const long cuda = 0;
#endif
#ifdef _OPENMP
  const long openmp = 1;
#else
  const long openmp = 0;
#endif
  if (m != nullptr && (PyModule_AddIntConstant(m, "cuda", cuda) != 0 ||
                       PyModule_AddIntConstant(m, "openmp", openmp) != 0)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
#endif  // ABFT_EMULATED
