// The CUDA kernels for the checksums of abft.h, and their launchers (abft.h's Launchers). No
// torch headers, and fp16/bf16 only through intrinsics, so that torch's __CUDA_NO_HALF_* flags
// hold. The kernels live in headers by what they compute, all of them included here into one
// translation unit (nvcc's, and the emulator's: csrc/emulator/abft_cuda_emulated.cpp):
// cuda_common.cuh (what they share), cuda_block_sums.cuh, cuda_products.cuh, cuda_softmax.cuh
// and cuda_correct.cuh.

#include "kernels/cuda_correct.cuh"

namespace abft {
namespace {

// The element type of a DType and the type its sums accumulate in, as the launchers take them.
template <typename T, typename Acc>
struct Typed {
  using Element = T;
  using Accumulator = Acc;
};

// f(Typed<element, accumulator>{}) for ``dtype``; cudaErrorInvalidValue for one it does not know.
template <typename F>
int with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32:
      return f(Typed<float, float>{});
    case DType::F64:
      return f(Typed<double, double>{});
    case DType::BF16:
      return f(Typed<__nv_bfloat16, float>{});
    case DType::F16:
      return f(Typed<__half, float>{});
  }
  return cudaErrorInvalidValue;
}

// The launchers (abft.h, Launchers).

int bias_terms_cuda(const BiasTerms& t, void* stream) {
  const int64_t items = bias_terms_items(t);
  if (items == 0) return cudaSuccess;
  const unsigned grid = unsigned(min64(ceil_div(items, kThreads), 1024));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (t.f64) {
    ABFT_LAUNCH(grid, kThreads, 0, st, bias_terms_kernel<double>)(t, items);
  } else {
    ABFT_LAUNCH(grid, kThreads, 0, st, bias_terms_kernel<float>)(t, items);
  }
  return cudaGetLastError();
}

int correct_cuda(const Correct& k, bool f64, void* stream) {
  if (k.screen.batch == 0) return cudaSuccess;
  constexpr int kPerBlock = 64;
  const unsigned grid = unsigned(ceil_div(k.screen.batch, kPerBlock));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (f64) {
    ABFT_LAUNCH(grid, kPerBlock, 0, st, correct_kernel<double>)(k);
  } else {
    ABFT_LAUNCH(grid, kPerBlock, 0, st, correct_kernel<float>)(k);
  }
  return cudaGetLastError();
}

int correct_tally_cuda(const Correct& k, const Tally& t, bool f64, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const SoftmaxCheck none{};  // no P to redo
  if (f64) {
    ABFT_LAUNCH(1, kThreads, 0, st, correct_tally_kernel<double>)
    (k, t, none, RowProducts{}, false);
  } else {
    ABFT_LAUNCH(1, kThreads, 0, st, correct_tally_kernel<float>)
    (k, t, none, RowProducts{}, false);
  }
  return cudaGetLastError();
}

int correct_redo_tally_cuda(const Correct& c, const SoftmaxCheck& k, const Tally& t,
                            void* stream) {
  const bool pass = k.products != nullptr;
  const RowProducts pr = pass ? *k.products : RowProducts{};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (k.s.dtype == DType::F64) {
    ABFT_LAUNCH(1, kThreads, 0, st, correct_tally_kernel<double>)(c, t, k, pr, pass);
  } else {
    ABFT_LAUNCH(1, kThreads, 0, st, correct_tally_kernel<float>)(c, t, k, pr, pass);
  }
  return cudaGetLastError();
}

int tally_cuda(const Tally& t, void* stream) {
  ABFT_LAUNCH(1, kThreads, 0, static_cast<cudaStream_t>(stream), tally_kernel)(t);
  return cudaGetLastError();
}

int row_products_cuda(const MatrixBatch& a, const RowProducts& out, void* stream,
                      const MatrixBatch* b = nullptr, const RowProducts* b_out = nullptr) {
  if (b != nullptr && b->dtype != a.dtype) return cudaErrorInvalidValue;
  return with_dtype(a.dtype, [&](auto types) {
    using Types = decltype(types);
    return launch_products<typename Types::Element, typename Types::Accumulator>(
        a, out, b, b_out, static_cast<cudaStream_t>(stream));
  });
}

int block_sums_cuda(const MatrixBatch& c, const BlockSums& out, void* stream,
                    const Screen* screen = nullptr) {
  return with_dtype(c.dtype, [&](auto types) {
    using Types = decltype(types);
    return launch<typename Types::Element, typename Types::Accumulator>(
        c, out, screen, static_cast<cudaStream_t>(stream));
  });
}

int block_sums_pair_cuda(const MatrixBatch& a, const BlockSums& a_out, const MatrixBatch& b,
                         const BlockSums& b_out, void* stream) {
  if (a.dtype != b.dtype) return cudaErrorInvalidValue;
  return with_dtype(a.dtype, [&](auto types) {
    using Types = decltype(types);
    return launch_pair<typename Types::Element, typename Types::Accumulator>(
        block_sums_job(a, a_out), block_sums_job(b, b_out), static_cast<cudaStream_t>(stream));
  });
}

int softmax_check_cuda(const SoftmaxCheck& k, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (softmax_single_pass(k.s.cols, k.s.dtype, k.s_sums.col_block > 0, k.products != nullptr)) {
    return with_dtype(k.s.dtype, [&](auto types) {
      using Types = decltype(types);
      return launch_softmax_pass<typename Types::Element, typename Types::Accumulator>(k, st);
    });
  }
  // rows too long for a thread block to hold a band's column sums: S's block sums screened by
  // their tiles, the softmax, then P's block sums and products
  if (k.screen.sides > 0) {
    const int error = block_sums_cuda(k.s, k.s_sums, stream, &k.screen);
    if (error != cudaSuccess) return error;
  }
  int error = with_dtype(k.s.dtype, [&](auto types) {
    using Types = decltype(types);
    return launch_softmax<typename Types::Element, typename Types::Accumulator>(k, st);
  });
  if (error != cudaSuccess || k.products == nullptr) return error;
  MatrixBatch p = k.s;  // P: S's shape, contiguous
  p.data = k.p;
  p.row_stride = p.cols;
  p.col_stride = 1;
  int64_t stride = p.rows * p.cols;
  for (int d = p.batch_dims - 1; d >= 0; --d) {
    p.batch_strides[d] = stride;
    stride *= p.batch_sizes[d];
  }
  error = block_sums_cuda(p, k.p_sums, stream);
  return error == cudaSuccess ? row_products_cuda(p, *k.products, stream) : error;
}

int mma_parts_cuda(const MmaParts& k, void* stream) {
  const int64_t items = (k.u.rows + k.z.rows) * k.u.cols;
  if (items == 0) return cudaSuccess;
  const unsigned grid = unsigned(min64(ceil_div(items, kThreads), 1024));
  ABFT_LAUNCH(grid, kThreads, 0, static_cast<cudaStream_t>(stream), mma_parts_kernel)(k, items);
  return cudaGetLastError();
}

int mma_sums_cuda(const MmaSums& k, void* stream) {
  const int64_t items = k.p * (k.nu + k.nz);
  if (items == 0) return cudaSuccess;
  const unsigned grid = unsigned(min64(ceil_div(items, kThreads), 4096));
  ABFT_LAUNCH(grid, kThreads, 0, static_cast<cudaStream_t>(stream), mma_sums_kernel)(k, items);
  return cudaGetLastError();
}

}  // namespace

// In the order of Launchers' members (each of a type of its own: a wrong order does not compile).
extern const Launchers ABFT_LAUNCHERS = {
    block_sums_cuda, block_sums_pair_cuda, row_products_cuda,
    tally_cuda,      bias_terms_cuda,      softmax_check_cuda,
    correct_redo_tally_cuda, correct_cuda, correct_tally_cuda,
    mma_parts_cuda,  mma_sums_cuda,
};

}  // namespace abft