// Torch-free checksum kernels of megatron-abft, shared by the C++ implementation (abft_cpu.cpp),
// the CUDA kernels (abft_cuda.cu) and the torch binding (abft_ops.cpp).
//
// block_sums reads a batch of matrices C [*batch, rows, cols] once and produces, for both sides of
// an EEC-ABFT check (DESIGN.md section 2), the plain and weighted sums of every checked vector and
// of its magnitudes:
//   column side: per column j and block of `col_block` rows starting at row r0,
//     sums  = (sum_i x_ij,   sum_i w_i x_ij)      sizes = (sum_i |x_ij|, sum_i w_i |x_ij|)
//   row side: the same per row i and block of `row_block` columns,
// with w = 1, 2, ... counted from the block's start. Sums are accumulated in fp32 (fp64 for fp64
// inputs), whatever the input dtype.
//
// row_products reads a batch of operands A [*batch, m, k] once and produces, for the checksums of
// a GEMM that A enters (megatron_abft/checksum.py), A u_t and |A| z_t for a few vectors u_t, z_t
// per matrix: the other operand's block sums and magnitudes. One read replaces a copy of |A| and
// two GEMMs over A and |A|.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define ABFT_HD __host__ __device__
#else
#define ABFT_HD
#endif

namespace abft {

enum class DType : int { F32 = 0, F64 = 1, BF16 = 2, F16 = 3 };

constexpr int kMaxBatchDims = 8;

// A strided batch of matrices: element (b, i, j) is at data + offset(b) + i * row_stride +
// j * col_stride (in elements), where offset(b) unravels b over batch_sizes / batch_strides.
struct MatrixBatch {
  const void* data;
  DType dtype;
  int batch_dims;
  int64_t batch_sizes[kMaxBatchDims];
  int64_t batch_strides[kMaxBatchDims];
  int64_t batch;  // product of batch_sizes
  int64_t rows, cols;
  int64_t row_stride, col_stride;
};

// Contiguous outputs in the accumulation type (double for F64 inputs, float otherwise):
//   col_sums, col_sizes [batch, ceil(rows / col_block), 2, cols]
//   row_sums, row_sizes [batch, ceil(cols / row_block), 2, rows]
// A block of 0 skips that side; its pointers are then ignored.
struct BlockSums {
  void* col_sums;
  void* col_sizes;
  int64_t col_block;
  void* row_sums;
  void* row_sizes;
  int64_t row_block;
};

// Contiguous vectors and outputs in the accumulation type, for row_products:
//   u [batch, nu, k], z [batch, nz, k]; products [batch, m, nu], magnitudes [batch, m, nz].
struct RowProducts {
  const void* u;
  int64_t nu;
  const void* z;
  int64_t nz;
  void* products;
  void* magnitudes;
};

ABFT_HD inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

ABFT_HD inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

ABFT_HD inline int64_t batch_offset(const MatrixBatch& c, int64_t b) {
  int64_t offset = 0;
  for (int d = c.batch_dims - 1; d >= 0; --d) {
    offset += (b % c.batch_sizes[d]) * c.batch_strides[d];
    b /= c.batch_sizes[d];
  }
  return offset;
}

// CPU: the work splits into independent tasks (one band of rows of one matrix each); the binding
// runs tasks [begin, end) on each of its threads.
// With `products`, the same pass also gives row_products of C (operand_pass: an operand's block
// sums and its checksum products in one read).
int64_t block_sums_tasks(const MatrixBatch& c, const BlockSums& out);
void block_sums_cpu(const MatrixBatch& c, const BlockSums& out, int64_t begin, int64_t end,
                    const RowProducts* products = nullptr);

// CPU, as block_sums: tasks of one band of rows of one matrix.
int64_t row_products_tasks(const MatrixBatch& a);
void row_products_cpu(const MatrixBatch& a, const RowProducts& out, int64_t begin, int64_t end);

// CUDA: launches on `stream` (a cudaStream_t) and returns the launch's cudaError_t (0: success).
int block_sums_cuda(const MatrixBatch& c, const BlockSums& out, void* stream);
// At most kMaxRowProducts vectors of each kind (u, z); the binding checks it.
constexpr int kMaxRowProducts = 16;
int row_products_cuda(const MatrixBatch& a, const RowProducts& out, void* stream);

}  // namespace abft
