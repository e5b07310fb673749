// check_gemm: a GEMM's whole check in one call from Python. C = alpha * A @ B + bias is verified
// and corrected in place against references encoded from its operands: encode_pair, add_bias and
// verify_correct (check_gemm_tally: verify_correct_tally into a guard's ledger), composed of those
// ops on every device, which is what torch.compile traces.
//
// On the CPU a check's host time is mostly the code it runs through, not its arithmetic: some
// thirty tensors and forty dispatches, with cold caches in a training step. So the CPU takes the
// composite's kernels on one workspace of its thread, a matrix of the batch at a time: the same
// kernel calls on the same values, so the same sums bit for bit, with no tensor made but the
// results. A matrix its screen flags, and every other input, goes to the composite, which
// corrects it (and raises for bad input).
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/abft_binding.h"
#include "kernels/abft.h"

namespace {

using Five = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Six = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Both sides' references of alpha * a @ b + bias as verify_correct takes them: encode_pair's
// sums and magnitudes, with add_bias's terms where there is a bias.
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> references(
    const at::Tensor& a, const at::Tensor& b, double alpha, const std::optional<at::Tensor>& bias,
    int64_t block) {
  const auto [col, col_magnitude, row, row_magnitude] =
      abft_binding::encode_pair(a, b, alpha, block);
  if (!bias.has_value()) return {{col, col_magnitude}, {row, row_magnitude}};
  static auto add_bias =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("megatron_abft::add_bias", "")
          .typed<Six(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, int64_t, int64_t)>();
  const auto [c0, c1, r0, r1, c2, r2] =
      add_bias.call(col, col_magnitude, row, row_magnitude, *bias,
                    a.sym_size(-2).guard_int(__FILE__, __LINE__), block);
  return {{c0, c1, c2}, {r0, r1, r2}};
}

Five check_gemm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double alpha,
                const std::optional<at::Tensor>& bias, int64_t block,
                at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds, double near_inf,
                int64_t capacity) {
  static auto verify =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("megatron_abft::verify_correct", "")
          .typed<Five(const at::Tensor&, int64_t, int64_t, at::TensorList, at::TensorList,
                      at::ArrayRef<double>, at::ArrayRef<double>, const at::Tensor&,
                      const at::Tensor&, double, const std::optional<at::Tensor>&, double,
                      int64_t)>();
  const at::NoGradGuard no_grad;
  const at::Tensor x = a.detach(), y = b.detach();  // their views then carry no autograd state
  const auto [col, row] = references(x, y, alpha, bias, block);
  return verify.call(c, block, block, col, row, col_bounds, row_bounds, x, y, alpha, bias,
                     near_inf, capacity);
}

Six check_gemm_tally(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double alpha,
                     const std::optional<at::Tensor>& bias, int64_t block,
                     at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                     double near_inf, int64_t capacity, at::Tensor& counts,
                     const at::Tensor& step, at::Tensor& log, at::Tensor& logged) {
  static auto verify =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("megatron_abft::verify_correct_tally", "")
          .typed<Six(const at::Tensor&, int64_t, int64_t, at::TensorList, at::TensorList,
                     at::ArrayRef<double>, at::ArrayRef<double>, const at::Tensor&,
                     const at::Tensor&, double, const std::optional<at::Tensor>&, double, int64_t,
                     at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&)>();
  const at::NoGradGuard no_grad;
  const at::Tensor x = a.detach(), y = b.detach();
  const auto [col, row] = references(x, y, alpha, bias, block);
  return verify.call(c, block, block, col, row, col_bounds, row_bounds, x, y, alpha, bias,
                     near_inf, capacity, counts, step, log, logged);
}

// --- the CPU's fused screen --------------------------------------------------------------------

bool kernel_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

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

// The calling thread's workspace of at least `count` elements of Acc, reused by its next checks.
template <typename Acc>
Acc* workspace(int64_t count) {
  thread_local std::vector<double> words;
  const size_t needed = (size_t(count) * sizeof(Acc) + sizeof(double) - 1) / sizeof(double);
  if (words.size() < needed) words.resize(needed);
  return reinterpret_cast<Acc*>(words.data());
}

void block_sums(const abft::MatrixBatch& c, abft::BlockSums out,
                const abft::RowProducts* products = nullptr) {
  const auto [matrices, sums] = abft_binding::plan_block_sums(c, out);
  at::parallel_for(0, abft::block_sums_tasks(matrices, sums), 1, [&](int64_t b, int64_t e) {
    abft::block_sums_cpu(matrices, sums, b, e, products);
  });
}

void row_products(const abft::MatrixBatch& a, const abft::RowProducts& out) {
  at::parallel_for(0, abft::row_products_tasks(a), 1,
                   [&](int64_t b, int64_t e) { abft::row_products_cpu(a, out, b, e); });
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

// Whether the fused screen takes this check: operands the kernels read, whose batches broadcast
// to C's as the composite broadcasts them (the smaller operand no more dims than the larger), on
// the CPU's own kernels, references and C in one accumulation type, a block the kernels take,
// whole bounds.
bool fused_screen_applies(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                          const std::optional<at::Tensor>& bias, int64_t block,
                          at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds) {
  if (abft_binding::emulating_cuda() || !c.is_cpu() || !a.is_cpu() || !b.is_cpu()) return false;
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
  if (!kernel_dtype(c.scalar_type()) || !kernel_dtype(a.scalar_type()) ||
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
    if (!v.is_cpu() || v.dim() != 1 || v.size(0) != c.size(-1) || !kernel_dtype(v.scalar_type())) {
      return false;
    }
  }
  // encode_pair's choice of the larger operand, over whole tensors; it reads its rows
  // (operand_pass)
  const bool x_big = a.numel() >= b.numel();
  if ((x_big ? b : a).dim() > (x_big ? a : b).dim()) return false;
  const abft::MatrixBatch big =
      x_big ? matrix(nullptr, abft::DType::F32, a.size(-2), a.size(-1), a.stride(-2), a.stride(-1))
            : matrix(nullptr, abft::DType::F32, b.size(-1), b.size(-2), b.stride(-1),
                     b.stride(-2));
  return !abft::column_major(big);
}

// A tensor's matrix at element `offset`, by its last two dims' sizes and strides (transposed:
// rows and columns swapped).
abft::MatrixBatch matrix_at(const at::Tensor& t, int64_t offset, bool transposed = false) {
  const void* data = static_cast<const char*>(t.const_data_ptr()) + offset * t.element_size();
  const int r = transposed ? -1 : -2, k = transposed ? -2 : -1;
  return matrix(data, abft_binding::kernel_dtype(t), t.size(r), t.size(k), t.stride(r),
                t.stride(k));
}

// check_gemm's screen on the CPU (fused_screen_applies): whether C passes it, every vector of
// both sides within its bound. The steps and kernel calls are the composite's (abft_encode.cpp:
// small_vectors, operand_pass, project; add_bias; verify_correct's block sums and screen).
template <typename Acc>
bool passes_fused_screen(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                         double alpha, const std::optional<at::Tensor>& bias, int64_t block,
                         at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                         const int64_t (&offsets)[3]) {
  const int64_t m = c.size(-2), n = c.size(-1), k = a.size(-1);
  const abft::DType acc = std::is_same_v<Acc, double> ? abft::DType::F64 : abft::DType::F32;
  // the operands as rows of length k: A [m, k], B^T [n, k]
  const abft::MatrixBatch x = matrix_at(a, offsets[1]);
  const abft::MatrixBatch y = matrix_at(b, offsets[2], true);
  const bool x_big = a.numel() >= b.numel();
  const abft::MatrixBatch& big = x_big ? x : y;
  const abft::MatrixBatch& small = x_big ? y : x;
  const int64_t p = big.rows, q = small.rows;
  const int64_t nbp = abft::ceil_div(p, block), nbq = abft::ceil_div(q, block);
  const int64_t nbm = abft::ceil_div(m, block), nbn = abft::ceil_div(n, block);

  const int64_t sizes[] = {
      2 * nbq * k, 2 * nbq * k, 2 * nbp * k, 2 * nbp * k,  // small's, big's block sums
      p * 2 * nbq, p * nbq, q * 2 * nbp, q * nbp,          // big's, small's products
      2 * nbm * n, 2 * nbm * n, 2 * nbn * m, 2 * nbn * m,  // C's block sums
      2 * nbm * n, nbm * n, 2 * nbn * m, nbn * m,          // the biased references
      2 * nbm * n, nbm * n, 2 * nbn * m, nbn * m,          // their inputs, contiguous
      nbm * n, nbn};                                       // the bias's magnitudes
  const int parts = bias.has_value() ? 22 : 12;
  int64_t total = 0;
  for (int i = 0; i < parts; ++i) total += sizes[i];
  Acc* at = workspace<Acc>(total);
  Acc* part[22] = {};
  for (int i = 0; i < parts; ++i) {
    part[i] = at;
    at += sizes[i];
  }
  Acc *small_w = part[0], *small_size = part[1], *big_w = part[2], *big_size = part[3];
  Acc *big_products = part[4], *big_magnitudes = part[5];
  Acc *small_products = part[6], *small_magnitudes = part[7];

  // the smaller operand's block sums: u [2 nbq, k], z [nbq, k] (the sizes' plain rows)
  block_sums(small, {small_w, small_size, block, nullptr, nullptr, 0});
  const abft::RowProducts on_big{matrix(small_w, acc, 2 * nbq, k, k, 1),
                                 matrix(small_size, acc, nbq, k, 2 * k, 1), big_products,
                                 big_magnitudes, alpha};
  // the larger one's pass: its block sums, and its products with u, z
  block_sums(big, {big_w, big_size, block, nullptr, nullptr, 0}, &on_big);
  // the smaller one's products with the larger one's block sums
  row_products(small, {matrix(big_w, acc, 2 * nbp, k, k, 1),
                       matrix(big_size, acc, nbp, k, 2 * k, 1), small_products,
                       small_magnitudes, alpha});
  // C's columns are B's: the products of the operand whose rows they are, [n, 2 nbm] and
  // [n, nbm]; C's rows the other's, [m, 2 nbn] and [m, nbn]
  const Acc* by_column = x_big ? small_products : big_products;
  const Acc* by_column_size = x_big ? small_magnitudes : big_magnitudes;
  const Acc* by_row = x_big ? big_products : small_products;
  const Acc* by_row_size = x_big ? big_magnitudes : small_magnitudes;

  Acc *c_col = part[8], *c_col_size = part[9], *c_row = part[10], *c_row_size = part[11];
  block_sums(matrix_at(c, offsets[0]), {c_col, c_col_size, block, c_row, c_row_size, block});

  abft::Screen screen{};
  screen.batch = 1;
  screen.sides = 2;
  int32_t flagged = 0;
  screen.flagged = &flagged;
  screen.slots = 1;
  if (!bias.has_value()) {  // the products read where they are: [nb, 2, n] and [nb, n] views
    screen.side[0] = side(c_col, c_col_size, nbm, n, by_column, {2, 1, 2 * nbm}, by_column_size,
                          {1, nbm}, nullptr, {0, 0}, col_bounds);
    screen.side[1] = side(c_row, c_row_size, nbn, m, by_row, {2, 1, 2 * nbn}, by_row_size,
                          {1, nbn}, nullptr, {0, 0}, row_bounds);
  } else {  // add_bias reads contiguous sums
    Acc *col_in = part[16], *col_size_in = part[17], *row_in = part[18], *row_size_in = part[19];
    for (int64_t blk = 0; blk < nbm; ++blk) {
      for (int64_t j = 0; j < n; ++j) {
        col_in[(2 * blk) * n + j] = by_column[j * 2 * nbm + 2 * blk];
        col_in[(2 * blk + 1) * n + j] = by_column[j * 2 * nbm + 2 * blk + 1];
        col_size_in[blk * n + j] = by_column_size[j * nbm + blk];
      }
    }
    for (int64_t blk = 0; blk < nbn; ++blk) {
      for (int64_t i = 0; i < m; ++i) {
        row_in[(2 * blk) * m + i] = by_row[i * 2 * nbn + 2 * blk];
        row_in[(2 * blk + 1) * m + i] = by_row[i * 2 * nbn + 2 * blk + 1];
        row_size_in[blk * m + i] = by_row_size[i * nbn + blk];
      }
    }
    const at::Tensor& v = *bias;
    abft::BiasTerms t{};
    t.bias = v.data_ptr();
    t.dtype = abft_binding::kernel_dtype(v, "megatron_abft::check_gemm: bias");
    t.stride = v.stride(0);
    t.n = n;
    t.m = m;
    t.block = block;
    t.batch = 1;
    t.f64 = std::is_same_v<Acc, double>;
    t.col_in = col_in;
    t.col_size_in = col_size_in;
    t.row_in = row_in;
    t.row_size_in = row_size_in;
    t.col_out = part[12];
    t.col_size_out = part[13];
    t.row_out = part[14];
    t.row_size_out = part[15];
    t.col_bias = part[20];
    t.row_bias = part[21];
    abft::bias_terms_cpu(t);
    screen.side[0] = side(c_col, c_col_size, nbm, n, part[12], {2 * n, n, 1}, part[13], {n, 1},
                          part[20], {n, 1}, col_bounds);
    screen.side[1] = side(c_row, c_row_size, nbn, m, part[14], {2 * m, m, 1}, part[15], {m, 1},
                          part[21], {1, 0}, row_bounds);
  }
  abft::screen_cpu(screen, std::is_same_v<Acc, double>, 0, 1);
  return flagged == 0;
}

// Whether the fused screen takes this check and every matrix of C passes it, each on the
// workspace of the thread that screens it, the operands' broadcast matrices read where they are.
// Matrices run in parallel where each chunk holds at least kParallelElements of C (a matrix's
// own passes run in parallel inside it where it is alone).
constexpr int64_t kParallelElements = int64_t(1) << 15;

bool passes_on_cpu(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double alpha,
                   const std::optional<at::Tensor>& bias, int64_t block,
                   at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                   int64_t capacity) {
  if (!fused_screen_applies(c, a, b, bias, block, col_bounds, row_bounds)) return false;
  abft_binding::check_correct_inputs(c, a, b, bias, capacity);
  const int64_t dims = c.dim() - 2, elements = c.size(-2) * c.size(-1);
  const int64_t count = c.numel() / elements;
  std::atomic<bool> clean{true};
  const int64_t grain = std::max<int64_t>(1, kParallelElements / elements);
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end && clean.load(std::memory_order_relaxed); ++i) {
      int64_t offsets[3] = {0, 0, 0};
      for (int64_t d = dims - 1, rest = i; d >= 0; --d) {  // matrix i's index in C's batch
        const int64_t position = rest % c.size(d);
        rest /= c.size(d);
        offsets[0] += position * c.stride(d);
        int64_t o = 1;
        for (const at::Tensor* t : {&a, &b}) {  // a batch dim of size 1 (or none) broadcasts
          const int64_t td = d - (c.dim() - t->dim());
          if (td >= 0 && t->size(td) != 1) offsets[o] += position * t->stride(td);
          ++o;
        }
      }
      const bool passes =
          c.scalar_type() == at::kDouble
              ? passes_fused_screen<double>(c, a, b, alpha, bias, block, col_bounds,
                                            row_bounds, offsets)
              : passes_fused_screen<float>(c, a, b, alpha, bias, block, col_bounds, row_bounds,
                                           offsets);
      if (!passes) clean.store(false, std::memory_order_relaxed);
    }
  });
  return clean.load();
}

Five check_gemm_cpu(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double alpha,
                    const std::optional<at::Tensor>& bias, int64_t block,
                    at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                    double near_inf, int64_t capacity) {
  if (passes_on_cpu(c, a, b, alpha, bias, block, col_bounds, row_bounds, capacity)) {
    return abft_binding::all_clean(c);
  }
  return check_gemm(c, a, b, alpha, bias, block, col_bounds, row_bounds, near_inf, capacity);
}

Six check_gemm_tally_cpu(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                         double alpha, const std::optional<at::Tensor>& bias, int64_t block,
                         at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                         double near_inf, int64_t capacity, at::Tensor& counts,
                         const at::Tensor& step, at::Tensor& log, at::Tensor& logged) {
  if (passes_on_cpu(c, a, b, alpha, bias, block, col_bounds, row_bounds, capacity)) {
    const auto [status, kind, rows, cols, magnitude] = abft_binding::all_clean(c);
    const at::Tensor failed = abft_binding::tally_cpu(status, kind, rows, cols, magnitude, counts,
                                                      step, log, logged);
    return {status, kind, rows, cols, magnitude, failed};
  }
  return check_gemm_tally(c, a, b, alpha, bias, block, col_bounds, row_bounds, near_inf,
                          capacity, counts, step, log, logged);
}

// Argument i of a screen_passes call as a tensor, or null with a TypeError set.
const at::Tensor* tensor_arg(PyObject* const* args, int i, const char* name) {
  if (!THPVariable_Check(args[i])) {
    PyErr_Format(PyExc_TypeError, "screen_passes: %s must be a tensor", name);
    return nullptr;
  }
  return &THPVariable_Unpack(args[i]);
}

// A sequence of floats as a vector; false with an error set where it is not one.
bool doubles_arg(PyObject* object, std::vector<double>& out, const char* name) {
  PyObject* items = PySequence_Fast(object, name);
  if (items == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(items, i));
  }
  Py_DECREF(items);
  return !PyErr_Occurred();
}

}  // namespace

namespace abft_binding {

// _C.screen_passes(c, a, b, alpha, bias, block, col_bounds, row_bounds, capacity) -> bool: whether
// check_gemm's fused screen takes this check on the CPU and every matrix of C passes it, which
// is check_gemm's finding for such a C (all clean, nothing corrected), with no tensor made and
// no dispatch. False: call check_gemm, which screens again and corrects. For the checks whose
// results the host reads (megatron_abft.check.checker.CompiledChecker.run); the GIL is
// released while the screen runs.
PyObject* screen_passes(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9) {
    PyErr_SetString(PyExc_TypeError, "screen_passes takes 9 arguments");
    return nullptr;
  }
  const at::Tensor* c = tensor_arg(args, 0, "c");
  const at::Tensor* a = c == nullptr ? nullptr : tensor_arg(args, 1, "a");
  const at::Tensor* b = a == nullptr ? nullptr : tensor_arg(args, 2, "b");
  if (b == nullptr) return nullptr;
  std::optional<at::Tensor> bias;
  if (args[4] != Py_None) {
    const at::Tensor* given = tensor_arg(args, 4, "bias");
    if (given == nullptr) return nullptr;
    bias = *given;
  }
  const double alpha = PyFloat_AsDouble(args[3]);
  const long long block = PyLong_AsLongLong(args[5]);
  const long long capacity = PyLong_AsLongLong(args[8]);
  std::vector<double> col_bounds, row_bounds;
  if (PyErr_Occurred() || !doubles_arg(args[6], col_bounds, "col_bounds") ||
      !doubles_arg(args[7], row_bounds, "row_bounds")) {
    return nullptr;
  }
  bool passes = false;
  std::string error;
  Py_BEGIN_ALLOW_THREADS
  try {
    passes = passes_on_cpu(*c, *a, *b, alpha, bias, block, col_bounds, row_bounds, capacity);
  } catch (const std::exception& e) {
    error = e.what();
  }
  Py_END_ALLOW_THREADS
  if (!error.empty()) {
    PyErr_SetString(PyExc_RuntimeError, error.c_str());
    return nullptr;
  }
  return PyBool_FromLong(passes);
}

// _C.layouts(*tensors) -> tuple | None: the layouts of a check's tensors as one tuple of ints,
// for the signature a guard keeps its checker by (megatron_abft.check.checker.signature), in one
// call that makes no shape, stride or device object: a tensor as its dims, its sizes and strides,
// its dtype and its device's type and index, None as -1. None where an argument is neither.
PyObject* layouts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  std::vector<int64_t> key;
  key.reserve(static_cast<size_t>(nargs) * 12);
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (args[i] == Py_None) {
      key.push_back(-1);
      continue;
    }
    if (!THPVariable_Check(args[i])) Py_RETURN_NONE;
    const at::Tensor& t = THPVariable_Unpack(args[i]);
    key.push_back(t.dim());
    for (const int64_t size : t.sizes()) key.push_back(size);
    for (const int64_t stride : t.strides()) key.push_back(stride);
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(t.device().type()));
    key.push_back(t.device().index());
  }
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(key.size()));
  if (tuple == nullptr) return nullptr;
  for (size_t i = 0; i < key.size(); ++i) {
    PyObject* item = PyLong_FromLongLong(key[i]);
    if (item == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), item);
  }
  return tuple;
}

}  // namespace abft_binding

TORCH_LIBRARY_FRAGMENT(megatron_abft, m) {
  m.def(
      "check_gemm(Tensor(a!) c, Tensor a, Tensor b, float alpha, Tensor? bias, int block, "
      "float[] col_bounds, float[] row_bounds, float near_inf, int capacity) -> (Tensor, Tensor, "
      "Tensor, Tensor, Tensor)");
  m.def(
      "check_gemm_tally(Tensor(a!) c, Tensor a, Tensor b, float alpha, Tensor? bias, int block, "
      "float[] col_bounds, float[] row_bounds, float near_inf, int capacity, Tensor(b!) counts, "
      "Tensor step, Tensor(c!) log, Tensor(d!) logged) -> (Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor)");
}

// Traced (torch.compile, meta) the two decompose into their ops, whose fakes give the outputs'
// layouts.
TORCH_LIBRARY_IMPL(megatron_abft, CompositeImplicitAutograd, m) {
  m.impl("check_gemm", &check_gemm);
  m.impl("check_gemm_tally", &check_gemm_tally);
}

TORCH_LIBRARY_IMPL(megatron_abft, CPU, m) {
  m.impl("check_gemm", &check_gemm_cpu);
  m.impl("check_gemm_tally", &check_gemm_tally_cpu);
}

// Checksums take no part in autograd, and the CPU's kernels would otherwise go through its boxed
// fallback; a correction writes C in place without a version bump, as no consumer of C has read
// it before its check.
TORCH_LIBRARY_IMPL(megatron_abft, Autograd, m) {
  m.impl("check_gemm", torch::CppFunction::makeFallthrough());
  m.impl("check_gemm_tally", torch::CppFunction::makeFallthrough());
}
