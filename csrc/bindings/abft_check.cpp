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
// corrects it (and raises for bad input). CUDA takes a 2-D GEMM (the linear layers' projections)
// the same way, its whole check in five launches on one scratch tensor (check_matrix_cuda,
// abft_matrix_check.cpp); any other input goes to the composite.
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

// Whether the CPU's fused screen takes this check: takes_matrices, on the CPU's own kernels.
bool fused_screen_applies(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                          const std::optional<at::Tensor>& bias, int64_t block,
                          at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds) {
  return c.is_cpu() && abft_binding::takes_matrices(c, a, b, bias, block, col_bounds, row_bounds);
}

// check_gemm's screen on the CPU (fused_screen_applies): whether C passes it, every vector of
// both sides within its bound, on the thread's workspace (plan_matrix_check).
template <typename Acc>
bool passes_fused_screen(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                         double alpha, const std::optional<at::Tensor>& bias, int64_t block,
                         at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                         const int64_t (&offsets)[3]) {
  const int64_t m = c.size(-2), n = c.size(-1), k = a.size(-1);
  Acc* work = workspace<Acc>(abft_binding::matrix_check_elements(m, n, k, block, bias.has_value()));
  const abft_binding::MatrixCheck p = abft_binding::plan_matrix_check(
      abft_binding::single_matrix(c, offsets[0]), abft_binding::single_matrix(a, offsets[1]),
      abft_binding::single_matrix(b, offsets[2], true), a.numel() >= b.numel(), alpha,
      bias.has_value() ? &*bias : nullptr, block, col_bounds, row_bounds, work,
      std::is_same_v<Acc, double>);
  block_sums(p.small, p.small_sums);
  block_sums(p.big, p.big_sums, &p.on_big);  // the larger operand's pass: its sums and products
  row_products(p.small, p.on_small);
  if (p.biased) abft::bias_terms_cpu(p.bias);
  block_sums(p.c, p.c_sums);
  abft::Screen screen = p.screen;
  int32_t flagged = 0;
  screen.flagged = &flagged;
  screen.slots = 1;
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

#ifdef ABFT_CUDA_KERNELS
// On CUDA (or emulated): a 2-D GEMM on one scratch tensor (check_matrix_cuda), else the composite.
Five check_gemm_cuda(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double alpha,
                     const std::optional<at::Tensor>& bias, int64_t block,
                     at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                     double near_inf, int64_t capacity) {
  if (const auto found = abft_binding::check_matrix_cuda(c, a, b, alpha, bias, block, col_bounds,
                                                         row_bounds, near_inf, capacity, nullptr)) {
    return found->first;
  }
  return check_gemm(c, a, b, alpha, bias, block, col_bounds, row_bounds, near_inf, capacity);
}

Six check_gemm_tally_cuda(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                          double alpha, const std::optional<at::Tensor>& bias, int64_t block,
                          at::ArrayRef<double> col_bounds, at::ArrayRef<double> row_bounds,
                          double near_inf, int64_t capacity, at::Tensor& counts,
                          const at::Tensor& step, at::Tensor& log, at::Tensor& logged) {
  const abft_binding::LedgerArgs ledger{counts, step, log, logged};
  if (const auto found = abft_binding::check_matrix_cuda(c, a, b, alpha, bias, block, col_bounds,
                                                         row_bounds, near_inf, capacity, &ledger)) {
    const auto& [status, kind, rows, cols, magnitude] = found->first;
    return {status, kind, rows, cols, magnitude, found->second};
  }
  return check_gemm_tally(c, a, b, alpha, bias, block, col_bounds, row_bounds, near_inf,
                          capacity, counts, step, log, logged);
}
#endif

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

#ifndef ABFT_EMULATED  // _C's module functions (abft_ops.cpp)
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

#endif

}  // namespace

#ifndef ABFT_EMULATED
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
#endif

ABFT_OPS(m) {
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
ABFT_IMPLS(CompositeImplicitAutograd, m) {
  m.impl("check_gemm", &check_gemm);
  m.impl("check_gemm_tally", &check_gemm_tally);
}

ABFT_IMPLS(CPU, m) {
  m.impl("check_gemm", &check_gemm_cpu);
  m.impl("check_gemm_tally", &check_gemm_tally_cpu);
}

#ifdef ABFT_CUDA_KERNELS
ABFT_IMPLS(CUDA, m) {
  m.impl("check_gemm", &check_gemm_cuda);
  m.impl("check_gemm_tally", &check_gemm_tally_cuda);
}
#endif

// Checksums take no part in autograd, and the CPU's kernels would otherwise go through its boxed
// fallback; a correction writes C in place without a version bump, as no consumer of C has read
// it before its check.
ABFT_IMPLS(Autograd, m) {
  m.impl("check_gemm", torch::CppFunction::makeFallthrough());
  m.impl("check_gemm_tally", torch::CppFunction::makeFallthrough());
}
