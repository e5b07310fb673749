// Torch binding of the checksum kernels (abft.h): checks the inputs, allocates the outputs and
// forwards raw pointers. Registers megatron_abft::block_sums with torch.library, on CPU always and
// on CUDA in CUDA builds; the fake implementation for torch.compile is in megatron_abft/_ext.py.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef ABFT_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <tuple>
#include <utility>

#include "abft.h"

namespace {

using Sums = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

abft::DType kernel_dtype(const at::Tensor& c) {
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
      TORCH_CHECK(false, "megatron_abft::block_sums: c must be fp32, fp64, bf16 or fp16; got ",
                  c.scalar_type());
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

// The outputs, and the kernels' view of C and of the outputs. A C stored column by column is
// handed to the kernels as C^T, whose rows are contiguous: its column side is C's row side.
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

  abft::MatrixBatch matrices{};
  matrices.data = c.data_ptr();
  matrices.dtype = kernel_dtype(c);
  matrices.batch_dims = int(dims - 2);
  matrices.batch = 1;
  for (int64_t d = 0; d < dims - 2; ++d) {
    matrices.batch_sizes[d] = c.size(d);
    matrices.batch_strides[d] = c.stride(d);
    matrices.batch *= c.size(d);
  }
  abft::BlockSums out{col_sums.data_ptr(), col_sizes.data_ptr(), col_block,
                      row_sums.data_ptr(), row_sizes.data_ptr(), row_block};
  matrices.rows = m;
  matrices.cols = n;
  matrices.row_stride = c.stride(-2);
  matrices.col_stride = c.stride(-1);
  if (c.stride(-2) == 1 && c.stride(-1) != 1 && m > 1) {
    std::swap(matrices.rows, matrices.cols);
    std::swap(matrices.row_stride, matrices.col_stride);
    out = {row_sums.data_ptr(), row_sizes.data_ptr(), row_block,
           col_sums.data_ptr(), col_sizes.data_ptr(), col_block};
  }
  return {std::move(sums), matrices, out};
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

#ifdef ABFT_WITH_CUDA
Sums block_sums_cuda(const at::Tensor& c, int64_t col_block, int64_t row_block) {
  check_inputs(c, col_block, row_block, at::kCUDA);
  const c10::cuda::CUDAGuard guard(c.device());
  auto [sums, matrices, out] = prepare(c, col_block, row_block);
  const auto stream = c10::cuda::getCurrentCUDAStream(c.device().index());
  C10_CUDA_CHECK(static_cast<cudaError_t>(abft::block_sums_cuda(matrices, out, stream.stream())));
  return sums;
}
#endif

}  // namespace

TORCH_LIBRARY(megatron_abft, m) {
  m.def(
      "block_sums(Tensor c, int col_block, int row_block) -> (Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(megatron_abft, CPU, m) { m.impl("block_sums", &block_sums_cpu); }

#ifdef ABFT_WITH_CUDA
TORCH_LIBRARY_IMPL(megatron_abft, CUDA, m) { m.impl("block_sums", &block_sums_cuda); }
#endif

// Importing megatron_abft._C registers the ops above; the module itself only says how it was
// built (cuda = 1 when the CUDA kernels are in).
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_C", "megatron-abft checksum kernels", -1, nullptr, nullptr, nullptr,
      nullptr, nullptr};
  PyObject* m = PyModule_Create(&module);
#ifdef ABFT_WITH_CUDA
  const long cuda = 1;
#else
  const long cuda = 0;
#endif
  if (m != nullptr && PyModule_AddIntConstant(m, "cuda", cuda) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
