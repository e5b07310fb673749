// mma_products: row_products' products (scale x @ u^T and |scale| |x| @ z^T) as GEMMs on the tensor
// cores, for a bf16 operand x. The vectors u, z (fp32 checksum sums) are split into three bf16
// parts each, hi + mid + lo, which hold every bit of an fp32 but the last three (|v - hi - mid - lo|
// <= 2^-27 |v|, under the 2^-24 of an fp32 rounding); the products of bf16 values are exact in fp32
// and cuBLAS sums them in fp32, so the products are row_products' up to fp32 accumulation, which
// the thresholds already bound (megatron_abft/check/tolerance.py). The CUDA cores' row_products
// pays an fp32 multiply-add an element of x a vector; a projection's check at 16384 tokens has 36
// vectors on x and 192 on the weight, so its products took most of the check's 0.51 ms on an
// H200 (docs/benchmarks.md). Here each operand is read twice and its absolute values written and
// read once (two skinny GEMMs): memory-bound work, but a dozen small ops an operand where the
// kernel is one launch for both, so encode_pair and check_matrix_cuda take it only for operands
// large enough (takes_mma_products).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "bindings/abft_binding.h"

namespace abft_binding {
namespace {

// v [r, k] fp32 as [3 r, k] bf16: the hi, mid and lo parts of every row, in three blocks of r
// rows. Each subtraction is exact: a part is v's remainder rounded to 8 significant bits.
at::Tensor bf16_parts(const at::Tensor& v) {
  const at::Tensor hi = v.to(at::kBFloat16);
  const at::Tensor rest = v - hi;
  const at::Tensor mid = rest.to(at::kBFloat16);
  const at::Tensor lo = (rest - mid).to(at::kBFloat16);
  return at::cat({hi, mid, lo}, 0);
}

// x [p, k] bf16 times parts^T [k, 3 r] in fp32: cuBLAS on a GPU; elsewhere (the emulator's CPU
// tensors) the same exact products summed in fp32.
at::Tensor times_parts(const at::Tensor& x, const at::Tensor& parts) {
  if (x.is_cuda()) return at::mm(x, parts.t(), at::kFloat);
  return at::mm(x.to(at::kFloat), parts.t().to(at::kFloat));
}

// The sum of a GEMM's three parts [p, 3 r], columns [first, first + count) of each part, times
// scale, into out [p, count].
void sum_parts(const at::Tensor& found, const c10::SymInt& first, const c10::SymInt& count,
               double scale, at::Tensor& out) {
  const c10::SymInt r = found.sym_size(1) / 3;
  at::sum_out(out, found.view_symint({found.sym_size(0), 3, r}).narrow_symint(2, first, count), 1);
  if (scale != 1.0) out.mul_(scale);
}

Products mma_products_op(const at::Tensor& x, const at::Tensor& u, const at::Tensor& z,
                         double scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "megatron_abft::mma_products: x must be a 2-D bf16 matrix; got ", x.sym_sizes(), " ",
              x.scalar_type());
  for (const at::Tensor* v : {&u, &z}) {
    TORCH_CHECK(v->dim() == 2 && v->sym_size(1) == x.sym_size(1) &&
                    v->scalar_type() == at::kFloat && v->device() == x.device(),
                "megatron_abft::mma_products: u and z must be fp32 [r, ", x.sym_size(1), "] on ",
                x.device(), "; got ", v->sym_sizes(), " ", v->scalar_type(), " on ", v->device());
  }
  const auto acc = x.options().dtype(at::kFloat);
  at::Tensor products = at::empty_symint({x.sym_size(0), u.sym_size(0)}, acc);
  at::Tensor magnitudes = at::empty_symint({x.sym_size(0), z.sym_size(0)}, acc);
  mma_products(x, u, z, scale, products, magnitudes);
  return {products, magnitudes};
}

}  // namespace

bool takes_mma_products(const at::Tensor& big, const at::Tensor& small) {
  return big.scalar_type() == at::kBFloat16 && small.scalar_type() == at::kBFloat16 &&
         big.dim() == 2 && small.dim() == 2 && big.sym_numel() >= kMmaProductsMinElements;
}

void mma_products(const at::Tensor& x, const at::Tensor& u, const at::Tensor& z, double scale,
                  at::Tensor& products, at::Tensor& magnitudes) {
  const c10::SymInt nu = u.sym_size(0), nz = z.sym_size(0);
  const at::Tensor parts = bf16_parts(at::cat({u, z}, 0));  // [3 (nu + nz), k]
  sum_parts(times_parts(x, parts), 0, nu, scale, products);
  sum_parts(times_parts(x.abs(), parts), nu, nz, std::abs(scale), magnitudes);
}

}  // namespace abft_binding

ABFT_OPS(m) {
  m.def("mma_products(Tensor x, Tensor u, Tensor z, float scale=1.0) -> (Tensor, Tensor)");
}

ABFT_IMPLS(CompositeImplicitAutograd, m) { m.impl("mma_products", &abft_binding::mma_products_op); }
