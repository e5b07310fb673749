// Helpers of the torch binding (abft_ops.cpp) that the other bindings share: the kernels' view of
// a tensor, and the outputs and views of block_sums, row_products and screen.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "abft.h"

namespace abft_binding {

using Sums = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Products = std::tuple<at::Tensor, at::Tensor>;

// The kernels' dtype of c; `what` names the tensor in the error message.
abft::DType kernel_dtype(const at::Tensor& c, const char* what = "megatron_abft::block_sums: c");

// The kernels' view of a dense strided [*batch, rows, cols] tensor.
abft::MatrixBatch describe(const at::Tensor& c);

// block_sums' outputs for c, and the kernels' view of c and of them.
std::tuple<Sums, abft::MatrixBatch, abft::BlockSums> prepare(const at::Tensor& c,
                                                            int64_t col_block, int64_t row_block);

// row_products' outputs for a and the vectors u, z (checked); the views are kept alive by the
// last two tensors.
std::tuple<Products, abft::MatrixBatch, abft::RowProducts, at::Tensor, at::Tensor> prepare_products(
    const at::Tensor& a, const at::Tensor& u, const at::Tensor& z, double scale,
    at::DeviceType device);

// That the CUDA products kernel takes p's vectors (at most kMaxRowProducts of each kind); `op`
// names the op in the error.
void check_cuda_products(const char* op, const abft::RowProducts& p);

// The screen of c given its block sums, and its flagged counts [*batch, slots]: without a
// tiling one slot a matrix, zeros (the CPU kernels); with the tiling of the CUDA block sums that
// screen, one slot a tile, which each tile writes. The expanded reference views are kept alive in
// `keep`.
std::tuple<abft::Screen, at::Tensor> prepare_screen(const at::Tensor& c, const Sums& sums,
                                                    int64_t col_block, int64_t row_block,
                                                    at::TensorList col, at::TensorList row,
                                                    at::ArrayRef<double> col_bounds,
                                                    at::ArrayRef<double> row_bounds,
                                                    std::vector<at::Tensor>& keep,
                                                    const abft::Tiling* tiling = nullptr);

// The flagged counts per matrix [*batch] of a screen's slots [*batch, slots], once they are
// written.
at::Tensor flagged_per_matrix(const at::Tensor& flagged);

}  // namespace abft_binding
