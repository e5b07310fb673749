// encode_pair: both sides' checksum sums of C = alpha * A @ B in one op, composed of the kernels
// (block_sums, operand_pass, row_products, or their pairs). The steps are those of
// megatron_abft/check/checksum.py (_both_sides_sums, _project), which stays the reference. On a CPU
// the larger operand is read once for its block sums and its products with the smaller one's sums,
// the smaller one twice; on a GPU, where a launch costs more than a read, both operands' block sums
// are one launch and both products another (block_sums_pair, row_products_pair), the larger operand
// read twice. Composed in C++ so that a check pays one dispatch from Python for its encoding
// instead of some thirty, most of them views (check_gemm, abft_check.cpp, adds the bias and the
// verification: a GEMM's whole check in one call).
#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <torch/library.h>

#include <cmath>
#include <functional>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/abft_binding.h"

namespace {

using Pair = std::tuple<at::Tensor, at::Tensor>;
using Four = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Eight = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                         at::Tensor, at::Tensor>;

Four block_sums(const at::Tensor& c, int64_t col_block, int64_t row_block) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("megatron_abft::block_sums", "")
                       .typed<Four(const at::Tensor&, int64_t, int64_t)>();
  return op.call(c, col_block, row_block);
}

Pair row_products(const at::Tensor& a, const at::Tensor& u, const at::Tensor& z, double scale) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("megatron_abft::row_products", "")
          .typed<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op.call(a, u, z, scale);
}

Four operand_pass(const at::Tensor& a, int64_t block, const at::Tensor& u, const at::Tensor& z,
                  double scale) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("megatron_abft::operand_pass", "")
          .typed<Four(const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
                      double)>();
  return op.call(a, block, u, z, scale);
}

Eight block_sums_pair_op(const at::Tensor& a, int64_t a_col_block, int64_t a_row_block,
                         const at::Tensor& b, int64_t b_col_block, int64_t b_row_block) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("megatron_abft::block_sums_pair", "")
                       .typed<Eight(const at::Tensor&, int64_t, int64_t, const at::Tensor&,
                                    int64_t, int64_t)>();
  return op.call(a, a_col_block, a_row_block, b, b_col_block, b_row_block);
}

Four row_products_pair_op(const at::Tensor& a, const at::Tensor& u, const at::Tensor& z,
                          double scale, const at::Tensor& b, const at::Tensor& v,
                          const at::Tensor& y, double b_scale) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("megatron_abft::row_products_pair", "")
          .typed<Four(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op.call(a, u, z, scale, b, v, y, b_scale);
}

Pair mma_products(const at::Tensor& x, const at::Tensor& u, const at::Tensor& z, double scale) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("megatron_abft::mma_products", "")
          .typed<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, u, z, scale);
}

// Whether x's ops run the CUDA kernels: on a GPU, or in _emulator on the CPU.
bool runs_cuda_kernels(const at::Tensor& x) {
  return x.is_cuda() || (x.is_cpu() && abft_binding::kEmulated);
}

// block_sums_pair and row_products_pair on any device: the two ops, one after the other (CUDA
// has its own, one launch each: abft_ops.cpp, which the CPU takes too while emulating CUDA).
Eight block_sums_pair(const at::Tensor& a, int64_t a_col_block, int64_t a_row_block,
                      const at::Tensor& b, int64_t b_col_block, int64_t b_row_block) {
  const auto [a0, a1, a2, a3] = block_sums(a, a_col_block, a_row_block);
  const auto [b0, b1, b2, b3] = block_sums(b, b_col_block, b_row_block);
  return {a0, a1, a2, a3, b0, b1, b2, b3};
}

Four row_products_pair(const at::Tensor& a, const at::Tensor& u, const at::Tensor& z,
                       double scale, const at::Tensor& b, const at::Tensor& v, const at::Tensor& y,
                       double b_scale) {
  const auto [a0, a1] = row_products(a, u, z, scale);
  const auto [b0, b1] = row_products(b, v, y, b_scale);
  return {a0, a1, b0, b1};
}

// Sizes and strides are read as SymInts throughout: traced with dynamic shapes (torch.compile),
// the ops decompose on fake tensors whose sizes are symbols; a branch on them guards.
using Shape = std::vector<c10::SymInt>;

Shape batch_of(const at::Tensor& t) {
  const auto sizes = t.sym_sizes();
  return Shape(sizes.begin(), sizes.end() - 2);
}

// How project reads an operand x [..., p, k] with vectors sums [..., q, k] and sizes [..., q', k]
// whose batch dims broadcast to x's: x, and the vectors with x's broadcast batch dims folded into
// their rows (so that x is read once for all the matrices that share it), both with one batch;
// `back` maps a result [*kept, folded q, p] (row_products', transposed) to [*batch, q, p].
struct Projection {
  at::Tensor x, sums, sizes;
  std::function<at::Tensor(const at::Tensor&)> back;
};

Projection projection(at::Tensor x, const at::Tensor& sums, const at::Tensor& sizes) {
  const Shape batch = at::infer_size_symint(batch_of(x), batch_of(sums));
  if (batch_of(x) == batch) return {x, sums, sizes, [](const at::Tensor& t) { return t; }};
  const int64_t dims = int64_t(batch.size());
  const c10::SymInt p = x.sym_size(-2), k = x.sym_size(-1);
  Shape padded(dims + 2 - x.dim(), 1);
  padded.insert(padded.end(), x.sym_sizes().begin(), x.sym_sizes().end());
  x = x.reshape_symint(padded);
  std::vector<int64_t> fold, keep, order(dims);
  Shape kept;
  c10::SymInt folded = 1;
  for (int64_t d = 0; d < dims; ++d) {
    if (x.sym_size(d) == 1 && batch[d] > 1) {
      fold.push_back(d);
      folded *= batch[d];
    } else {
      keep.push_back(d);
      kept.push_back(batch[d]);
    }
  }
  auto kept_shape = [&](std::initializer_list<c10::SymInt> last) {
    auto shape = kept;
    shape.insert(shape.end(), last);
    return shape;
  };
  x = x.reshape_symint(kept_shape({p, k}));  // a view: x is 1 along the folded dims
  std::vector<int64_t> permutation = keep;
  permutation.insert(permutation.end(), fold.begin(), fold.end());
  permutation.insert(permutation.end(), {dims, dims + 1});
  auto fold_rows = [&](const at::Tensor& rows) {  // [*batch, q, k] -> [*kept, folded * q, k]
    const c10::SymInt q = rows.sym_size(-2);
    auto full = batch;
    full.insert(full.end(), {q, k});
    return rows.expand_symint(full).permute(permutation).reshape_symint(
        kept_shape({folded * q, k}));
  };
  for (size_t i = 0; i < keep.size(); ++i) order[keep[i]] = int64_t(i);
  for (size_t i = 0; i < fold.size(); ++i) order[fold[i]] = int64_t(keep.size() + i);
  order.insert(order.end(), {dims, dims + 1});
  auto back = [kept, fold, batch, folded, order](const at::Tensor& t) {
    Shape shape = kept;  // [*kept, folded * q, p] -> [*batch, q, p]
    for (int64_t d : fold) shape.push_back(batch[d]);
    shape.insert(shape.end(), {t.sym_size(-2) / folded, t.sym_size(-1)});
    return t.reshape_symint(shape).permute(order);
  };
  return {x, fold_rows(sums), fold_rows(sizes), back};
}

// project's results, [..., q, p] and [..., q', p], from row_products' for a projection (the
// kernels apply the scale as they write them).
Pair projected(const Projection& p, const Pair& products) {
  return {p.back(std::get<0>(products).mT()), p.back(std::get<1>(products).mT())};
}

// scale sums @ x^T and |scale| sizes @ |x|^T for an operand x [..., p, k]: [..., q, p] and
// [..., q', p], as checksum._project, then _scaled.
Pair project(const at::Tensor& x, const at::Tensor& sums, const at::Tensor& sizes, double scale) {
  const Projection p = projection(x, sums, sizes);
  return projected(p, row_products(p.x, p.sums, p.sizes, scale));
}

// [..., 2 nb, n] products as [..., nb, 2, n] sums, and magnitudes.
Pair paired(const Pair& found) {
  const auto& [sums, magnitude] = found;
  return {sums.unflatten_symint(-2, Shape{sums.sym_size(-2) / 2, 2}), magnitude};
}

// The larger operand of encode_pair, and whether it is x = a (else y = b^T).
std::pair<bool, at::Tensor> larger(const at::Tensor& a, const at::Tensor& b) {
  const bool x_big = a.sym_numel() >= b.sym_numel();
  return {x_big, x_big ? a : b.mT()};
}

// u [..., 2 nb, k] and z [..., nb, k]: the smaller operand's block sums and sizes over blocks of
// its rows (block_sums' column side), with as many dims as the larger operand, as its products
// take them.
Pair vectors_of(const at::Tensor& big, const at::Tensor& small, const Four& small_sums) {
  const at::Tensor& small_w = std::get<0>(small_sums);
  const at::Tensor small_size = std::get<1>(small_sums).select(-2, 0);
  const c10::SymInt k = small.sym_size(-1);
  const int64_t lead = big.dim() - small.dim();
  Shape u_shape(lead, 1), z_shape(lead, 1);
  const auto w_sizes = small_w.sym_sizes();
  u_shape.insert(u_shape.end(), w_sizes.begin(), w_sizes.end() - 3);
  u_shape.insert(u_shape.end(), {w_sizes[w_sizes.size() - 3] * w_sizes[w_sizes.size() - 2], k});
  z_shape.insert(z_shape.end(), small_size.sym_sizes().begin(), small_size.sym_sizes().end());
  return {small_w.flatten(-3, -2).reshape_symint(u_shape), small_size.reshape_symint(z_shape)};
}

Pair small_vectors(const at::Tensor& big, const at::Tensor& small, int64_t block) {
  return vectors_of(big, small, block_sums(small, block, 0));
}

// Both sides' (sums, magnitude), in encode_pair's order, from the blocks of the larger operand's
// rows projected on the smaller one (of_big) and the blocks of the smaller one's rows projected
// on the larger one (of_small), each as (products [..., 2 nb, n], magnitudes).
Four both_sides(bool x_big, const Pair& of_big, const Pair& of_small) {
  const Pair col = paired(x_big ? of_big : of_small);
  const Pair row = paired(x_big ? of_small : of_big);
  return {std::get<0>(col), std::get<1>(col), std::get<0>(row), std::get<1>(row)};
}

// Both sides' (sums, magnitude) from the larger operand's pass: its block sums and sizes, and its
// products with small_vectors' u, z times alpha (operand_pass with scale alpha).
Four from_pass(bool x_big, const at::Tensor& small, double alpha, const Four& big_pass) {
  const auto& [big_w, big_sizes, products, magnitudes] = big_pass;
  // blocks of big's rows, projected on small; blocks of small's rows, from big's pass
  const Pair of_big = project(small, big_w.flatten(-3, -2), big_sizes.select(-2, 0), alpha);
  return both_sides(x_big, of_big, {products.mT(), magnitudes.mT()});
}

// encode_pair_split's steps: both operands' block sums in one op, then the larger one's products
// with the smaller one's sums and the smaller one's with the larger one's in another (by
// mma_products, on the tensor cores, where takes_mma_products: two ops, of five launches
// each).
Four encode_split(bool x_big, const at::Tensor& big, const at::Tensor& small, double alpha,
                  int64_t block) {
  const auto [s0, s1, s2, s3, big_w, big_sizes, b2, b3] =
      block_sums_pair_op(small, block, 0, big, block, 0);
  const auto [u, z] = vectors_of(big, small, {s0, s1, s2, s3});
  const Projection p = projection(small, big_w.flatten(-3, -2), big_sizes.select(-2, 0));
  const auto [products, magnitudes, small_products, small_magnitudes] =
      abft_binding::takes_mma_products(big, small)
          ? std::tuple_cat(mma_products(big, u, z, alpha),
                           mma_products(p.x, p.sums, p.sizes, alpha))
          : row_products_pair_op(big, u, z, alpha, p.x, p.sums, p.sizes, alpha);
  return both_sides(x_big, projected(p, {small_products, small_magnitudes}),
                    {products.mT(), magnitudes.mT()});
}

void check_pair(const char* op, const at::Tensor& a, const at::Tensor& b) {
  const auto [x_big, big] = larger(a, b);
  const int64_t small_dims = x_big ? b.dim() : a.dim();
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && small_dims <= big.dim(), op, ": a ",
              a.sym_sizes(), " ", a.scalar_type(), " and b ", b.sym_sizes(), " ", b.scalar_type(),
              " need one dtype, and the smaller operand no more dims than the larger");
}

// Both sides' (sums, magnitude) of alpha * a @ b: column side [..., nb(m), 2, n], [..., nb(m), n],
// row side [..., nb(n), 2, m], [..., nb(n), m]. megatron_abft/ops/compiled.py's encode_pair checks
// that the kernels take these operands before it calls this.
Four encode_pair(const at::Tensor& a, const at::Tensor& b, double alpha, int64_t block) {
  check_pair("megatron_abft::encode_pair", a, b);
  const auto [x_big, big] = larger(a, b);
  const at::Tensor small = x_big ? b.mT() : a;  // the operands as rows of length k
  if (runs_cuda_kernels(big)) return encode_split(x_big, big, small, alpha, block);
  const auto [u, z] = small_vectors(big, small, block);
  return from_pass(x_big, small, alpha, operand_pass(big, block, u, z, alpha));
}

// encode_pair as it runs on a GPU, on any device: two launches there (block_sums_pair, then
// row_products_pair), the larger operand read twice.
Four encode_pair_split(const at::Tensor& a, const at::Tensor& b, double alpha, int64_t block) {
  check_pair("megatron_abft::encode_pair_split", a, b);
  const auto [x_big, big] = larger(a, b);
  return encode_split(x_big, big, x_big ? b.mT() : a, alpha, block);
}

// encode_pair's first half, for a pass over a made elsewhere (softmax_check): the u, z that the
// pass over a needs, a being the larger operand.
Pair pair_vectors(const at::Tensor& a, const at::Tensor& b, int64_t block) {
  check_pair("megatron_abft::pair_vectors", a, b);
  TORCH_CHECK(larger(a, b).first, "megatron_abft::pair_vectors: a ", a.sym_sizes(),
              " must be the larger operand (b is ", b.sym_sizes(), ")");
  return small_vectors(a, b.mT(), block);
}

// encode_pair's second half: the column side from a's pass (its block sums and sizes, as
// operand_pass(a, block, u, z, alpha) gives them with pair_vectors' u, z), projected on b. The
// row side is the pass's products and magnitudes themselves, which checksum.encode_from_pass
// takes as views (an op's output may not alias its input: returned here, they were copies).
Pair encode_pair_from(const at::Tensor& a, const at::Tensor& b, double alpha, int64_t block,
                      const at::Tensor& sums, const at::Tensor& sizes) {
  check_pair("megatron_abft::encode_pair_from", a, b);
  TORCH_CHECK(larger(a, b).first, "megatron_abft::encode_pair_from: a ", a.sym_sizes(),
              " must be the larger operand (b is ", b.sym_sizes(), ")");
  return paired(project(b.mT(), sums.flatten(-3, -2), sizes.select(-2, 0), alpha));
}

}  // namespace

namespace abft_binding {
Sums encode_pair(const at::Tensor& a, const at::Tensor& b, double alpha, int64_t block) {
  return ::encode_pair(a, b, alpha, block);
}
}  // namespace abft_binding

ABFT_OPS(m) {
  m.def(
      "encode_pair(Tensor a, Tensor b, float alpha, int block) -> (Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def(
      "encode_pair_split(Tensor a, Tensor b, float alpha, int block) -> (Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def("pair_vectors(Tensor a, Tensor b, int block) -> (Tensor, Tensor)");
  m.def(
      "encode_pair_from(Tensor a, Tensor b, float alpha, int block, Tensor sums, Tensor sizes) "
      "-> (Tensor, Tensor)");
  m.def(
      "block_sums_pair(Tensor a, int a_col_block, int a_row_block, Tensor b, int b_col_block, "
      "int b_row_block) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "row_products_pair(Tensor a, Tensor u, Tensor z, float scale, Tensor b, Tensor v, Tensor y, "
      "float b_scale) -> (Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
}

// Composites of other ops on every backend, fake tensors included: traced (torch.compile,
// meta), they decompose into those ops, whose fakes give their outputs' layouts, so these four
// need no fake of their own and report the strides they really have, whichever path they take.
ABFT_IMPLS(CompositeImplicitAutograd, m) {
  m.impl("encode_pair", &encode_pair);
  m.impl("encode_pair_split", &encode_pair_split);
  m.impl("pair_vectors", &pair_vectors);
  m.impl("encode_pair_from", &encode_pair_from);
}

// As abft_ops.cpp's kernels: outside autograd.
ABFT_IMPLS(Autograd, m) {
  m.impl("block_sums_pair", torch::CppFunction::makeFallthrough());
  m.impl("row_products_pair", torch::CppFunction::makeFallthrough());
}

// On every backend but CUDA's (abft_ops.cpp: one launch each), from the ops they are composed
// of; their fakes (torch.compile) are in ops/compiled.py.
ABFT_IMPLS(CompositeExplicitAutograd, m) {
  m.impl("block_sums_pair", &block_sums_pair);
  m.impl("row_products_pair", &row_products_pair);
}
