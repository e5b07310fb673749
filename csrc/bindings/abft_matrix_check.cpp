// A GEMM's check a matrix at a time on one workspace (abft_binding.h): plan_matrix_check fills
// in the kernels' arguments, for the CPU's fused screen (abft_check.cpp) and for check_matrix_cuda,
// a 2-D GEMM's whole check on CUDA as five launches on one scratch tensor (Megatron's linear
// layers: the projections). The steps are the composite's (abft_encode.cpp's encode_split and
// from_pass, add_bias, verify_correct's block sums, screen and correction), on the same values,
// so the sums and the corrections are its own, bit for bit; what the composite costs beyond them
// is host time: for a projection's check 37 tensors and 119 calls into ATen, where this makes
// seven tensors and nothing else (tools/bench_host.py, sync_free_calls). Where the operands are
// large enough for the tensor cores to take the products (takes_mma_products), mma_products
// writes them into views of the scratch, as the composite's op makes them.
#include <algorithm>
#include <initializer_list>
#include <optional>
#include <utility>

#include "bindings/abft_binding.h"

namespace abft_binding {
namespace {

// A single matrix in the kernels' view.
abft::MatrixBatch matrix(const void* data, abft::DType dtype, int64_t rows, int64_t cols,
                         int64_t row_stride, int64_t col_stride) {
  abft::MatrixBatch m{};
  m.data = data;
  m.dtype = dtype;
  m.batch = 1;
  m.rows = rows;
  m.cols = cols;
  m.row_stride = row_stride;
  m.col_stride = col_stride;
  return m;
}

// One side of the screen: references `ref` [nb, 2, n] and `magnitude` [nb, n] (and `bias`), with
// their strides in elements, against C's sums and sizes; `bounds` as verify_correct's.
abft::ScreenSide side(void* sums, void* sizes, int64_t nb, int64_t n, const void* ref,
                      std::initializer_list<int64_t> ref_strides, const void* magnitude,
                      std::initializer_list<int64_t> magnitude_strides, const void* bias,
                      std::initializer_list<int64_t> bias_strides,
                      at::ArrayRef<double> bounds) {
  abft::ScreenSide s{};
  s.sums = sums;
  s.sizes = sizes;
  s.nb = nb;
  s.n = n;
  s.ref_sums = ref;
  std::copy(ref_strides.begin(), ref_strides.end(), s.ref_strides);
  s.magnitude = magnitude;
  std::copy(magnitude_strides.begin(), magnitude_strides.end(), s.magnitude_strides);
  s.bias = bias;
  std::copy(bias_strides.begin(), bias_strides.end(), s.bias_strides);
  s.out = bounds[0];
  s.gemm = bounds[1];
  s.floor = bounds[2];
  s.length = bounds[3];
  return s;
}

bool kernel_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

template <size_t N>
void set(int64_t (&to)[N], std::initializer_list<int64_t> values) {
  std::copy(values.begin(), values.end(), to);
}

}  // namespace

int64_t matrix_check_elements(int64_t m, int64_t n, int64_t k, int64_t block, bool biased) {
  const int64_t nbm = abft::ceil_div(m, block), nbn = abft::ceil_div(n, block);
  // both operands' block sums and sizes, their products, C's block sums and sizes
  int64_t total = 4 * (nbm + nbn) * k + 3 * (m * nbn + n * nbm) + 4 * (nbm * n + nbn * m);
  // the biased references and the bias's magnitudes
  if (biased) total += 3 * (nbm * n + nbn * m) + nbm * n + nbn;
  return total;
}

MatrixCheck plan_matrix_check(const abft::MatrixBatch& c, const abft::MatrixBatch& x,
                              const abft::MatrixBatch& y, bool x_big, double alpha,
                              const at::Tensor* bias, int64_t block,
                              at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                              void* workspace, bool f64) {
  const int64_t m = c.rows, n = c.cols, k = x.cols;
  const abft::DType acc = f64 ? abft::DType::F64 : abft::DType::F32;
  const int64_t size = f64 ? 8 : 4;
  char* cursor = static_cast<char*>(workspace);
  auto take = [&](int64_t elements) {
    void* part = cursor;
    cursor += elements * size;
    return part;
  };
  MatrixCheck p{};
  p.big = x_big ? x : y;
  p.small = x_big ? y : x;
  const int64_t rows = p.big.rows, small_rows = p.small.rows;
  const int64_t nbp = abft::ceil_div(rows, block), nbq = abft::ceil_div(small_rows, block);
  const int64_t nbm = abft::ceil_div(m, block), nbn = abft::ceil_div(n, block);

  // the smaller operand's block sums: u [2 nbq, k], z [nbq, k] (the sizes' plain rows); the
  // larger one's likewise
  void *small_w = take(2 * nbq * k), *small_size = take(2 * nbq * k);
  void *big_w = take(2 * nbp * k), *big_size = take(2 * nbp * k);
  p.small_sums = {small_w, small_size, block, nullptr, nullptr, 0};
  p.big_sums = {big_w, big_size, block, nullptr, nullptr, 0};
  // the larger one's products with u, z; the smaller one's with the larger one's sums
  void *big_products = take(rows * 2 * nbq), *big_magnitudes = take(rows * nbq);
  void *small_products = take(small_rows * 2 * nbp), *small_magnitudes = take(small_rows * nbp);
  p.on_big = {matrix(small_w, acc, 2 * nbq, k, k, 1), matrix(small_size, acc, nbq, k, 2 * k, 1),
              big_products, big_magnitudes, alpha};
  p.on_small = {matrix(big_w, acc, 2 * nbp, k, k, 1), matrix(big_size, acc, nbp, k, 2 * k, 1),
                small_products, small_magnitudes, alpha};
  // C's columns are Y's rows: the products of the operand whose rows they are, [n, 2 nbm] and
  // [n, nbm]; C's rows X's, [m, 2 nbn] and [m, nbn]
  const void* by_column = x_big ? small_products : big_products;
  const void* by_column_size = x_big ? small_magnitudes : big_magnitudes;
  const void* by_row = x_big ? big_products : small_products;
  const void* by_row_size = x_big ? big_magnitudes : small_magnitudes;

  p.c = c;
  void *c_col = take(2 * nbm * n), *c_col_size = take(2 * nbm * n);
  void *c_row = take(2 * nbn * m), *c_row_size = take(2 * nbn * m);
  p.c_sums = {c_col, c_col_size, block, c_row, c_row_size, block};
  p.screen.batch = 1;
  p.screen.sides = 2;
  p.biased = bias != nullptr;
  if (!p.biased) {  // the products read where they are: [nb, 2, n] and [nb, n] views
    p.screen.side[0] = side(c_col, c_col_size, nbm, n, by_column, {2, 1, 2 * nbm},
                            by_column_size, {1, nbm}, nullptr, {0, 0}, col_bounds);
    p.screen.side[1] = side(c_row, c_row_size, nbn, m, by_row, {2, 1, 2 * nbn}, by_row_size,
                            {1, nbn}, nullptr, {0, 0}, row_bounds);
    return p;
  }
  abft::BiasTerms& t = p.bias;
  t.bias = bias->const_data_ptr();
  t.dtype = kernel_dtype(*bias, "megatron_abft::check_gemm: bias");
  t.stride = bias->stride(0);
  t.n = n;
  t.m = m;
  t.block = block;
  t.batch = 1;
  t.f64 = f64;
  t.col_in = by_column;  // the products where they are, as the screen reads them
  set(t.col_in_strides, {0, 2, 1, 2 * nbm});
  t.col_size_in = by_column_size;
  set(t.col_size_in_strides, {0, 1, nbm});
  t.row_in = by_row;
  set(t.row_in_strides, {0, 2, 1, 2 * nbn});
  t.row_size_in = by_row_size;
  set(t.row_size_in_strides, {0, 1, nbn});
  t.col_out = take(2 * nbm * n);
  t.col_size_out = take(nbm * n);
  t.row_out = take(2 * nbn * m);
  t.row_size_out = take(nbn * m);
  t.col_bias = take(nbm * n);
  t.row_bias = take(nbn);
  p.screen.side[0] = side(c_col, c_col_size, nbm, n, t.col_out, {2 * n, n, 1}, t.col_size_out,
                          {n, 1}, t.col_bias, {n, 1}, col_bounds);
  p.screen.side[1] = side(c_row, c_row_size, nbn, m, t.row_out, {2 * m, m, 1}, t.row_size_out,
                          {m, 1}, t.row_bias, {1, 0}, row_bounds);
  return p;
}

bool takes_matrices(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                    const std::optional<at::Tensor>& bias, int64_t block,
                    at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds) {
  if (a.device() != c.device() || b.device() != c.device()) return false;
  if (c.dim() < 2 || a.dim() < 2 || b.dim() < 2 || a.dim() > c.dim() || b.dim() > c.dim() ||
      c.numel() == 0 || a.numel() == 0 || b.numel() == 0) {
    return false;
  }
  if (a.size(-2) != c.size(-2) || b.size(-1) != c.size(-1) || a.size(-1) != b.size(-2)) {
    return false;
  }
  for (const at::Tensor* t : {&a, &b}) {
    const int64_t lead = c.dim() - t->dim();
    for (int64_t d = 0; d + 2 < t->dim(); ++d) {
      if (t->size(d) != 1 && t->size(d) != c.size(lead + d)) return false;
    }
  }
  if (!kernel_type(c.scalar_type()) || !kernel_type(a.scalar_type()) ||
      a.scalar_type() != b.scalar_type()) {
    return false;
  }
  if ((a.scalar_type() == at::kDouble) != (c.scalar_type() == at::kDouble)) return false;
  if (block < 2 || col_bounds.size() != 4 || row_bounds.size() != 4) return false;
  if (a.layout() != at::kStrided || b.layout() != at::kStrided || c.layout() != at::kStrided) {
    return false;
  }
  if (bias.has_value()) {
    const at::Tensor& v = *bias;
    if (v.device() != c.device() || v.dim() != 1 || v.size(0) != c.size(-1) ||
        !kernel_type(v.scalar_type())) {
      return false;
    }
  }
  // encode_pair's choice of the larger operand, over whole tensors; it reads its rows
  // (operand_pass)
  const bool x_big = a.numel() >= b.numel();
  if ((x_big ? b : a).dim() > (x_big ? a : b).dim()) return false;
  return !abft::column_major(single_matrix(x_big ? a : b, 0, !x_big));
}

// The products `r` of x (a row_products' arguments on the workspace) by mma_products.
void products_by_mma(const at::Tensor& x, const abft::RowProducts& r) {
  const auto acc = x.options().dtype(at::kFloat);
  auto view = [&](const abft::MatrixBatch& v) {
    return at::from_blob(const_cast<void*>(v.data), {v.rows, v.cols}, {v.row_stride, v.col_stride},
                         acc);
  };
  at::Tensor products = at::from_blob(r.products, {x.size(0), r.u.rows}, acc);
  at::Tensor magnitudes = at::from_blob(r.magnitudes, {x.size(0), r.z.rows}, acc);
  mma_products(x, view(r.u), view(r.z), r.scale, products, magnitudes);
}

abft::MatrixBatch single_matrix(const at::Tensor& t, int64_t offset, bool transposed) {
  const void* data = static_cast<const char*>(t.const_data_ptr()) + offset * t.element_size();
  const int r = transposed ? -1 : -2, k = transposed ? -2 : -1;
  return matrix(data, kernel_dtype(t), t.size(r), t.size(k), t.stride(r), t.stride(k));
}

#ifdef ABFT_CUDA_KERNELS
std::optional<std::pair<Found, at::Tensor>> check_matrix_cuda(
    const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double alpha,
    const std::optional<at::Tensor>& bias, int64_t block, at::ArrayRef<double> col_bounds,
    at::ArrayRef<double> row_bounds, double near_inf, int64_t capacity, const LedgerArgs* ledger) {
  if (c.dim() != 2 || a.dim() != 2 || b.dim() != 2 ||
      !takes_matrices(c, a, b, bias, block, col_bounds, row_bounds)) {
    return std::nullopt;
  }
  const CudaLaunch launch(c);
  check_correct_inputs(c, a, b, bias, capacity);
  if (ledger != nullptr) check_ledger(*ledger, c);
  const int64_t m = c.size(0), n = c.size(1), k = a.size(1);
  const bool f64 = c.scalar_type() == at::kDouble;
  const int64_t size = f64 ? 8 : 4, nbm = abft::ceil_div(m, block), nbn = abft::ceil_div(n, block);
  const abft::MatrixBatch c_matrix = single_matrix(c, 0);
  // the scratch: the correction's log, the plan's parts, the sums the correction keeps, the
  // screen's slots (one a tile of C's block sums)
  const int64_t log = correction_log(capacity, m, n, block);
  const int64_t plan_bytes = matrix_check_elements(m, n, k, block, bias.has_value()) * size;
  const int64_t kept_bytes = 4 * (nbm * n + nbn * m) * size;
  const auto [planned_c, planned_sums] =
      plan_block_sums(c_matrix, {nullptr, nullptr, block, nullptr, nullptr, block});
  const abft::Tiling tiling = abft::block_sums_tiling(planned_c, planned_sums);
  const int64_t slots = tiling.row_tiles * tiling.col_tiles;
  const at::Tensor scratch =
      at::empty({2 * log * 8 + plan_bytes + kept_bytes + slots * 4}, c.options().dtype(at::kByte));
  char* cursor = static_cast<char*>(scratch.data_ptr());
  auto take = [&](int64_t bytes) {
    char* part = cursor;
    cursor += bytes;
    return part;
  };
  int64_t* log_at = reinterpret_cast<int64_t*>(take(log * 8));
  uint64_t* log_bits = reinterpret_cast<uint64_t*>(take(log * 8));
  const bool x_big = a.numel() >= b.numel();
  const MatrixCheck p = plan_matrix_check(
      c_matrix, single_matrix(a, 0), single_matrix(b, 0, true), x_big, alpha,
      bias.has_value() ? &*bias : nullptr, block, col_bounds, row_bounds, take(plan_bytes), f64);

  const auto acc = f64 ? at::kDouble : at::kFloat;
  const auto index = c.options().dtype(at::kLong);
  Found found{at::empty({}, c.options().dtype(at::kChar)),
              at::empty({}, c.options().dtype(at::kChar)), at::empty({}, index),
              at::empty({}, index), at::empty({}, c.options().dtype(acc))};
  auto& [status, kind, row, col, magnitude] = found;
  abft::Correct fix{};
  fix.screen = p.screen;
  fix.col_side = 0;
  fix.row_side = 1;
  fix.col_block = fix.row_block = block;
  fix.c = describe(c);
  fix.data = c.data_ptr();
  fix.a = describe(a);
  fix.b = describe(b);
  fix.alpha = alpha;
  if (bias.has_value()) {
    fix.bias = bias->data_ptr();
    fix.bias_dtype = kernel_dtype(*bias, "megatron_abft::check_gemm: bias");
    fix.bias_stride = bias->stride(0);
  }
  fix.near_inf = near_inf;
  fix.vectors = capacity;
  fix.capacity = log;
  fix.initial_sums[0] = take(2 * nbm * n * size);
  fix.initial_sizes[0] = take(2 * nbm * n * size);
  fix.initial_sums[1] = take(2 * nbn * m * size);
  fix.initial_sizes[1] = take(2 * nbn * m * size);
  fix.log_at = log_at;
  fix.log_bits = log_bits;
  fix.status = status.data_ptr<int8_t>();
  fix.kind = kind.data_ptr<int8_t>();
  fix.row = row.data_ptr<int64_t>();
  fix.col = col.data_ptr<int64_t>();
  fix.magnitude = magnitude.data_ptr();
  fix.screen.flagged = reinterpret_cast<int32_t*>(take(slots * 4));
  fix.screen.slots = slots;

  const abft::Launchers& kernels = launch.kernels();
  void* stream = launch.stream();
  const char* op =
      ledger != nullptr ? "megatron_abft::check_gemm_tally" : "megatron_abft::check_gemm";
  const auto [small, small_sums] = plan_block_sums(p.small, p.small_sums);
  const auto [big, big_sums] = plan_block_sums(p.big, p.big_sums);
  launch.check(kernels.block_sums_pair(small, small_sums, big, big_sums, stream), op);
  if (takes_mma_products(x_big ? a : b, x_big ? b : a)) {  // b's view as rows made only here
    products_by_mma(x_big ? a : b.mT(), p.on_big);
    products_by_mma(x_big ? b.mT() : a, p.on_small);
  } else {
    launch.check(kernels.row_products(p.big, p.on_big, stream, &p.small, &p.on_small), op);
  }
  if (p.biased) launch.check(kernels.bias_terms(p.bias, stream), op);
  const auto [c_read, c_sums] = plan_block_sums(p.c, p.c_sums);
  launch.check(kernels.block_sums(c_read, c_sums, stream, &fix.screen), op);
  if (ledger == nullptr) {
    launch.check(kernels.correct(fix, f64, stream), op);
    return std::pair{found, at::Tensor()};
  }
  const at::Tensor failed = at::empty({}, c.options().dtype(at::kBool));
  const abft::Tally t = tally_of(status, kind, row, col, magnitude, failed, *ledger);
  launch.check(kernels.correct_tally(fix, t, f64, stream), op);
  return std::pair{found, failed};
}
#endif

}  // namespace abft_binding
