// mma_products: row_products' products (scale x @ u^T and |scale| |x| @ z^T) as GEMMs on the tensor
// cores, for a bf16 operand x. The vectors u, z (fp32 checksum sums) are split into three bf16
// parts each, hi + mid + lo, which hold every bit of an fp32 but the last three (|v - hi - mid - lo|
// <= 2^-27 |v|, under the 2^-24 of an fp32 rounding); the products of bf16 values are exact in fp32
// and cuBLAS sums them in fp32, so the products are row_products' up to fp32 accumulation, which
// the thresholds already bound (megatron_abft/check/tolerance.py). The CUDA cores' row_products
// pays an fp32 multiply-add an element of x a vector; a projection's check at 16384 tokens has 36
// vectors on x and 192 on the weight, so its products took most of the check's 0.51 ms on an
// H200 (docs/benchmarks.md). Here x is read twice and its absolute values written and read once
// (two skinny GEMMs): memory-bound work in five launches an operand (the split, |x|, the two
// GEMMs, the sums of the parts: cuda_products.cuh's mma_parts and mma_sums) where the products
// kernel is one launch for both operands, so encode_pair and check_matrix_cuda take it only for
// operands large enough (takes_mma_products). CPU tensors (outside the emulator) take the same
// steps as ATen ops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "bindings/abft_binding.h"

namespace abft_binding {
namespace {

constexpr const char* kOp = "megatron_abft::mma_products";

// x [p, k] bf16 times parts^T [k, 3 r] in fp32: cuBLAS on a GPU; elsewhere (CPU tensors, the
// emulator's too) the same exact products summed in fp32.
at::Tensor times_parts(const at::Tensor& x, const at::Tensor& parts) {
  if (x.is_cuda()) return at::mm(x, parts.t(), at::kFloat);
  return at::mm(x.to(at::kFloat), parts.t().to(at::kFloat));
}

// v [r, k] fp32 as [3 r, k] bf16: the hi, mid and lo parts of every row, in three blocks of r
// rows (MmaParts). Each subtraction is exact: a part is v's remainder rounded to 8 significant
// bits.
at::Tensor bf16_parts(const at::Tensor& v) {
  const at::Tensor hi = v.to(at::kBFloat16);
  const at::Tensor rest = v - hi;
  const at::Tensor mid = rest.to(at::kBFloat16);
  return at::cat({hi, mid, (rest - mid).to(at::kBFloat16)}, 0);
}

// The sums of a GEMM's three parts, found [p, 3 r], times scale, into out [p, r], as
// cuda_products.cuh's mma_sums adds them: hi's + mid's, then + lo's.
void sum_parts(const at::Tensor& found, double scale, at::Tensor& out) {
  const int64_t r = out.size(1);
  at::add_out(out, found.narrow(1, 0, r), found.narrow(1, r, r)).add_(found.narrow(1, 2 * r, r));
  if (scale != 1.0) out.mul_(scale);
}

#ifdef ABFT_CUDA_KERNELS
// The same on the CUDA kernels (or the emulator's): the split and the sums a launch each.
void kernel_products(const at::Tensor& x, const at::Tensor& u, const at::Tensor& z, double scale,
                     at::Tensor& products, at::Tensor& magnitudes) {
  const CudaLaunch launch(x);
  const int64_t nu = u.size(0), nz = z.size(0);
  const at::Tensor parts = at::empty({3 * (nu + nz), x.size(1)}, x.options());
  launch.check(launch.kernels().mma_parts({describe(u), describe(z), parts.data_ptr()},
                                          launch.stream()),
               kOp);
  const at::Tensor found_u = times_parts(x, parts.narrow(0, 0, 3 * nu));
  const at::Tensor found_z = times_parts(x.abs(), parts.narrow(0, 3 * nu, 3 * nz));
  const abft::MmaSums sums{found_u.const_data_ptr<float>(), found_z.const_data_ptr<float>(),
                           products.data_ptr<float>(), magnitudes.data_ptr<float>(), x.size(0),
                           nu, nz, scale};
  launch.check(launch.kernels().mma_sums(sums, launch.stream()), kOp);
}
#endif

Products mma_products_op(const at::Tensor& x, const at::Tensor& u, const at::Tensor& z,
                         double scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, kOp,
              ": x must be a 2-D bf16 matrix; got ", x.sizes(), " ", x.scalar_type());
  for (const at::Tensor* v : {&u, &z}) {
    TORCH_CHECK(v->dim() == 2 && v->size(1) == x.size(1) && v->scalar_type() == at::kFloat &&
                    v->device() == x.device(),
                kOp, ": u and z must be fp32 [r, ", x.size(1), "] on ", x.device(), "; got ",
                v->sizes(), " ", v->scalar_type(), " on ", v->device());
  }
  const auto acc = x.options().dtype(at::kFloat);
  at::Tensor products = at::empty({x.size(0), u.size(0)}, acc);
  at::Tensor magnitudes = at::empty({x.size(0), z.size(0)}, acc);
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
  TORCH_INTERNAL_ASSERT(products.is_contiguous() && magnitudes.is_contiguous());
#ifdef ABFT_CUDA_KERNELS
  if (x.is_cuda() || kEmulated) return kernel_products(x, u, z, scale, products, magnitudes);
#endif
  sum_parts(times_parts(x, bf16_parts(u)), scale, products);
  sum_parts(times_parts(x.abs(), bf16_parts(z)), std::abs(scale), magnitudes);
}

}  // namespace abft_binding

ABFT_OPS(m) {
  m.def("mma_products(Tensor x, Tensor u, Tensor z, float scale=1.0) -> (Tensor, Tensor)");
}

// It writes no input and takes no part in autograd (abft_ops.cpp's ops alike).
ABFT_IMPLS(Autograd, m) { m.impl("mma_products", torch::CppFunction::makeFallthrough()); }

ABFT_IMPLS(CPU, m) { m.impl("mma_products", &abft_binding::mma_products_op); }

#ifdef ABFT_CUDA_KERNELS
ABFT_IMPLS(CUDA, m) { m.impl("mma_products", &abft_binding::mma_products_op); }
#endif
