// The row products kernels (abft.h's row_products): each row of A against a pass of vectors, a
// warp a row (two, or a lane a row of a column-major A); and mma_products' kernels, which split
// its vectors into bf16 parts and add up the parts' products.
#pragma once

#include "kernels/cuda_common.cuh"

namespace abft {
namespace {

// The vectors of each kind a pass: two where no job has more (a GEMM of one block a side, the
// attention's operands), so that their passes neither hold nor issue kProductsPerPass.
constexpr int kFewProducts = 2;

// The warp's shares of a row's products summed by shuffles; lane 0 writes them.
template <typename Acc, int kPer>
__device__ __forceinline__ void write_row_products(const RowProducts& out, int64_t row,
                                                   int64_t first, int pu, int pz, Acc (&p)[kPer],
                                                   Acc (&q)[kPer]) {
#pragma unroll
  for (int t = 0; t < kPer; ++t) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      p[t] += __shfl_xor_sync(kFullMask, p[t], offset);
      q[t] += __shfl_xor_sync(kFullMask, q[t], offset);
    }
  }
  if ((threadIdx.x & 31) == 0) {
    Acc* products = static_cast<Acc*>(out.products) + row * out.u.rows + first;
    Acc* magnitudes = static_cast<Acc*>(out.magnitudes) + row * out.z.rows + first;
    const Acc scale = Acc(out.scale), size_scale = Acc(fabs(out.scale));
#pragma unroll
    for (int t = 0; t < kPer; ++t) {
      if (t < pu) products[t] = p[t] * scale;
      if (t < pz) magnitudes[t] = q[t] * size_scale;
    }
  }
}

// row_products: one warp per row of A (of a column-major A: column_product_tiles below), for
// the pass of the vectors from `first` on, kPer of each kind at most (more vectors take more
// passes: ProductsJob). Each lane walks every 32nd entry of the row, keeping its share of the
// pass's dot products in registers; the warp then reduces them by shuffles and lane 0 writes the
// row's results. The rows of the batch are shared by `blocks` thread blocks of kThreads, this one
// the block-th. kPer is the launch's, so that a pass of two vectors neither holds nor issues the
// sixteen of a wide one.
template <typename T, typename Acc, int kPer>
__device__ __forceinline__ void row_product_rows(const MatrixBatch& a, const RowProducts& out,
                                                 int64_t block, int64_t blocks, int64_t first) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = blocks * kWarps, total_rows = a.batch * a.rows;
  const int64_t k = a.cols, nu = out.u.rows, nz = out.z.rows;
  const int pu = int(min64(nu - first, kPer)), pz = int(min64(nz - first, kPer));
  const int64_t u_stride = out.u.row_stride, z_stride = out.z.row_stride;
  for (int64_t row = block * kWarps + (threadIdx.x >> 5); row < total_rows; row += warps) {
    const int64_t b = row / a.rows, i = row % a.rows;
    const T* x = static_cast<const T*>(a.data) + batch_offset(a, b) + i * a.row_stride;
    const Acc* u = static_cast<const Acc*>(out.u.data) + batch_offset(out.u, b) + first * u_stride;
    const Acc* z = static_cast<const Acc*>(out.z.data) + batch_offset(out.z, b) + first * z_stride;
    Acc p[kPer], q[kPer];
#pragma unroll
    for (int t = 0; t < kPer; ++t) p[t] = q[t] = Acc(0);
    for (int64_t j = lane; j < k; j += 32) {
      const Acc v = Acc(load(x + j * a.col_stride)), m = magnitude(v);
#pragma unroll
      for (int t = 0; t < kPer; ++t) {
        if (t < pu) p[t] += v * u[t * u_stride + j];
        if (t < pz) q[t] += m * z[t * z_stride + j];
      }
    }
    write_row_products<Acc, kPer>(out, row, first, pu, pz, p, q);
  }
}

// Four consecutive floats at p (16-byte aligned) in one load.
__device__ __forceinline__ void load_floats(const float* p, float (&w)[kVec]) {
  const Bytes16 bits = *reinterpret_cast<const Bytes16*>(p);
  memcpy(w, &bits, sizeof(bits));
}

// row_product_rows where products_in_vectors: each lane reads kVec consecutive entries of the
// row in one load, and of each vector the same kVec in one load. A pass of few vectors takes two
// such steps an iteration, so that a warp keeps 512 bytes of A in flight (the entry-a-load walk
// keeps 64, too few to cover the memory's latency); a wide one does enough work per byte with
// one, and holds no more registers.
template <typename T, int kPer>
__device__ __forceinline__ void row_product_vectors(const MatrixBatch& a, const RowProducts& out,
                                                    int64_t block, int64_t blocks,
                                                    int64_t first) {
  constexpr int64_t kStep = 32 * kVec;
  constexpr int kSteps = kPer > kFewProducts ? 1 : 2;
  const int lane = threadIdx.x & 31;
  const int64_t warps = blocks * kWarps, total_rows = a.batch * a.rows;
  const int64_t k = a.cols, nu = out.u.rows, nz = out.z.rows;
  const int pu = int(min64(nu - first, kPer)), pz = int(min64(nz - first, kPer));
  // 32-bit (products_in_vectors): a vector's address is then one multiply-add from the row's
  const int u_stride = int(out.u.row_stride), z_stride = int(out.z.row_stride);
  for (int64_t row = block * kWarps + (threadIdx.x >> 5); row < total_rows; row += warps) {
    const int64_t b = row / a.rows, i = row % a.rows;
    const T* x = static_cast<const T*>(a.data) + batch_offset(a, b) + i * a.row_stride;
    const float* u =
        static_cast<const float*>(out.u.data) + batch_offset(out.u, b) + first * u_stride;
    const float* z =
        static_cast<const float*>(out.z.data) + batch_offset(out.z, b) + first * z_stride;
    float p[kPer], q[kPer];
#pragma unroll
    for (int t = 0; t < kPer; ++t) p[t] = q[t] = 0.0f;
    // the row's entries an iteration ahead of their products (zeros past the row): loaded where
    // they were multiplied, a warp waited out each load's latency
    auto fetch = [&](int64_t j) {
      VectorBits<T> bits{};
      if (j < k) bits = *reinterpret_cast<const VectorBits<T>*>(x + j);
      return bits;
    };
    VectorBits<T> ahead[kSteps];
#pragma unroll
    for (int h = 0; h < kSteps; ++h) ahead[h] = fetch(lane * kVec + h * kStep);
    for (int64_t j0 = lane * kVec; j0 < k; j0 += kSteps * kStep) {
      float v[kSteps][kVec];
#pragma unroll
      for (int h = 0; h < kSteps; ++h) {
        unpack_vector<T>(ahead[h], v[h]);
        ahead[h] = fetch(j0 + (kSteps + h) * kStep);
      }
      const bool second = kSteps == 2 && j0 + kStep < k;
#pragma unroll
      for (int h = 0; h < kSteps; ++h) {
        if (h == 1 && !second) break;
        const float* uj = u + (j0 + h * kStep);
        const float* zj = z + (j0 + h * kStep);
#pragma unroll
        for (int t = 0; t < kPer; ++t) {
          float w[kVec];
          if (t < pu) {
            load_floats(uj + t * u_stride, w);
#pragma unroll
            for (int e = 0; e < kVec; ++e) p[t] += v[h][e] * w[e];
          }
          if (t < pz) {
            load_floats(zj + t * z_stride, w);
#pragma unroll
            for (int e = 0; e < kVec; ++e) q[t] += fabsf(v[h][e]) * w[e];
          }
        }
      }
    }
    write_row_products<float, kPer>(out, row, first, pu, pz, p, q);
  }
}

// row_product_vectors for a wide pass, two rows of a matrix a warp: each load of the pass's
// vectors (up to 32, 16 bytes a lane a step) serves both rows, which halves the vectors' traffic
// from the cache and their loads and addresses an entry of A. Each row's products are summed
// in the order of row_product_vectors' walk. A matrix's last row, where its count is odd, is
// read twice, its second products not written.
template <typename T, int kPer>
__device__ __forceinline__ void row_product_vector_pairs(const MatrixBatch& a,
                                                         const RowProducts& out, int64_t block,
                                                         int64_t blocks, int64_t first) {
  constexpr int64_t kStep = 32 * kVec;
  const int lane = threadIdx.x & 31;
  const int64_t warps = blocks * kWarps, pairs = ceil_div(a.rows, 2);
  const int64_t k = a.cols, nu = out.u.rows, nz = out.z.rows;
  const int pu = int(min64(nu - first, kPer)), pz = int(min64(nz - first, kPer));
  const int u_stride = int(out.u.row_stride), z_stride = int(out.z.row_stride);
  for (int64_t pair = block * kWarps + (threadIdx.x >> 5); pair < a.batch * pairs;
       pair += warps) {
    const int64_t b = pair / pairs, i = (pair % pairs) * 2;
    const bool both = i + 1 < a.rows;
    const T* x = static_cast<const T*>(a.data) + batch_offset(a, b) + i * a.row_stride;
    const T* y = both ? x + a.row_stride : x;
    const float* u =
        static_cast<const float*>(out.u.data) + batch_offset(out.u, b) + first * u_stride;
    const float* z =
        static_cast<const float*>(out.z.data) + batch_offset(out.z, b) + first * z_stride;
    float p[2][kPer], q[2][kPer];
#pragma unroll
    for (int t = 0; t < kPer; ++t) p[0][t] = p[1][t] = q[0][t] = q[1][t] = 0.0f;
    for (int64_t j0 = lane * kVec; j0 < k; j0 += kStep) {
      float v[2][kVec];
      load_vector<T>(x + j0, v[0]);
      load_vector<T>(y + j0, v[1]);
      const float* uj = u + j0;
      const float* zj = z + j0;
#pragma unroll
      for (int t = 0; t < kPer; ++t) {
        float w[kVec];
        if (t < pu) {
          load_floats(uj + t * u_stride, w);
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            p[0][t] += v[0][e] * w[e];
            p[1][t] += v[1][e] * w[e];
          }
        }
        if (t < pz) {
          load_floats(zj + t * z_stride, w);
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            q[0][t] += fabsf(v[0][e]) * w[e];
            q[1][t] += fabsf(v[1][e]) * w[e];
          }
        }
      }
    }
    const int64_t row = b * a.rows + i;  // in the batch's rows
    write_row_products<float, kPer>(out, row, first, pu, pz, p[0], q[0]);
    if (both) write_row_products<float, kPer>(out, row + 1, first, pu, pz, p[1], q[1]);
  }
}

// Whether row_product_vectors can read A and the vectors: 2- and 4-byte elements, A's rows and
// the vectors contiguous, every row and vector starting on its load's boundary, and a pass's
// vectors within 32-bit offsets of its first (strides up to 2^26 floats).
template <typename T>
bool products_in_vectors(const MatrixBatch& a, const RowProducts& out) {
  if (sizeof(T) > 4 || !matrix_in_vectors(a, sizeof(T))) return false;
  const MatrixBatch* vectors[2] = {&out.u, &out.z};
  for (const MatrixBatch* v : vectors) {
    if (v->rows > 0 && (v->row_stride > (1 << 26) || !matrix_in_vectors(*v, sizeof(float)))) {
      return false;
    }
  }
  return true;
}

// row_products of a column-major A, the pass from `first` on as row_product_rows: one thread
// block per 32 rows of one matrix (a tile), a lane per row, so that a warp reads 32 consecutive
// entries of a column; warp w takes columns w, w + kWarps, ...; the warps' shares of each product
// are then summed in order in shared memory. The tiles are shared by `blocks` thread blocks, this
// one the block-th.
template <typename T, typename Acc, int kPer>
__device__ __forceinline__ void column_product_tiles(const MatrixBatch& a,
                                                     const RowProducts& out, int64_t block,
                                                     int64_t blocks, int64_t first) {
  __shared__ Acc part[kWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nu = out.u.rows, nz = out.z.rows, row_tiles = ceil_div(a.rows, 32);
  const int pu = int(min64(nu - first, kPer)), pz = int(min64(nz - first, kPer));
  const int64_t u_stride = out.u.row_stride, z_stride = out.z.row_stride;
  const Acc scale = Acc(out.scale), size_scale = Acc(fabs(out.scale));
  for (int64_t tile = block; tile < a.batch * row_tiles; tile += blocks) {
    const int64_t b = tile / row_tiles, i = (tile % row_tiles) * 32 + lane;
    const bool valid = i < a.rows;
    const T* x = static_cast<const T*>(a.data) + batch_offset(a, b) + (valid ? i : 0);
    const Acc* u = static_cast<const Acc*>(out.u.data) + batch_offset(out.u, b) + first * u_stride;
    const Acc* z = static_cast<const Acc*>(out.z.data) + batch_offset(out.z, b) + first * z_stride;
    Acc p[kPer], q[kPer];
#pragma unroll
    for (int t = 0; t < kPer; ++t) p[t] = q[t] = Acc(0);
    for (int64_t j = warp; j < a.cols; j += kWarps) {
      const Acc v = valid ? Acc(load(x + j * a.col_stride)) : Acc(0), m = magnitude(v);
#pragma unroll
      for (int t = 0; t < kPer; ++t) {
        if (t < pu) p[t] += v * u[t * u_stride + j];
        if (t < pz) q[t] += m * z[t * z_stride + j];
      }
    }
    // unrolled, so that p[s] and q[s] stay in registers; pu and pz are the same for every
    // thread, so every thread reaches the same barriers
#pragma unroll
    for (int t = 0; t < 2 * kPer; ++t) {
      const bool product = t < kPer;
      const int s = product ? t : t - kPer;
      if (s >= (product ? pu : pz)) continue;
      part[warp][lane] = product ? p[s] : q[s];
      __syncthreads();
      if (warp == 0 && valid) {
        Acc total = 0;
        for (int w = 0; w < kWarps; ++w) total += part[w][lane];
        if (product) {
          static_cast<Acc*>(out.products)[(b * a.rows + i) * nu + first + s] = total * scale;
        } else {
          static_cast<Acc*>(out.magnitudes)[(b * a.rows + i) * nz + first + s] =
              total * size_scale;
        }
      }
      __syncthreads();
    }
  }
}

// How A is read: by columns (column_product_tiles), rows a vector at a time
// (row_product_vectors), or rows an entry at a time (row_product_rows).
enum ProductsPath : int { kColumns = 0, kRowVectors = 1, kRowEntries = 2 };

// The products of one batch of operands, as a job of a launch: its first thread block and how
// many it has, and how it reads A. Its vectors are split into passes of the launch's kPer of
// each kind (one pass where there are none), each pass on its own `per_pass` thread blocks, so
// that a pass's bounds come from the block's index, not from a loop that would hold them in
// registers.
struct ProductsJob {
  MatrixBatch a;
  RowProducts out;
  int64_t first_block, per_pass, blocks;
  int path;
};

// How row_products reads `a`.
template <typename T>
int products_path(const MatrixBatch& a, const RowProducts& out) {
  return column_major(a) ? kColumns : products_in_vectors<T>(a, out) ? kRowVectors : kRowEntries;
}

// A job of `out` over `a`, read by `path`, from thread block `first_block` on, `per` vectors of
// each kind a pass: a tile of 32 rows each pass for a column-major A, else kWarps warps of
// `rows` rows each.
ProductsJob products_job(const MatrixBatch& a, const RowProducts& out, int path,
                         int64_t first_block, int per, int rows) {
  const int64_t units = path == kColumns
                            ? a.batch * ceil_div(a.rows, 32)
                            : ceil_div(a.batch * ceil_div(a.rows, rows), kWarps);
  const int64_t vectors = out.u.rows > out.z.rows ? out.u.rows : out.z.rows;
  const int64_t passes = vectors > 0 ? ceil_div(vectors, per) : 1;
  const int64_t per_pass = min64(units, 0x3fffffff / passes);
  return {a, out, first_block, per_pass, per_pass * passes, path};
}

// row_products of one or two jobs in one launch, each on its own range of thread blocks. kRows
// 2: every job reads its rows in vectors, two a warp (row_product_vector_pairs), whose products
// take twice the registers: two thread blocks an SM (128 registers) where the others run three.
template <typename T, typename Acc, int kPer, int kRows>
__global__ void __launch_bounds__(kThreads, kRows > 1 ? 2 : 3)
    products_kernel(ProductsJob first, ProductsJob second) {
  const ProductsJob& job = blockIdx.x < second.first_block ? first : second;
  const int64_t block = int64_t(blockIdx.x) - job.first_block;
  const int64_t pass = block / job.per_pass, at = block % job.per_pass;
  if constexpr (kRows > 1) {
    row_product_vector_pairs<T, kPer>(job.a, job.out, at, job.per_pass, pass * kPer);
  } else {
    if (job.path == kColumns) {
      column_product_tiles<T, Acc, kPer>(job.a, job.out, at, job.per_pass, pass * kPer);
      return;
    }
    if constexpr (std::is_same<Acc, float>::value) {
      if (job.path == kRowVectors) {
        row_product_vectors<T, kPer>(job.a, job.out, at, job.per_pass, pass * kPer);
        return;
      }
    }
    row_product_rows<T, Acc, kPer>(job.a, job.out, at, job.per_pass, pass * kPer);
  }
}

// A launch of kPer vectors of each kind a pass; a wide pass whose jobs all read rows in vectors
// (the projections' operands) two rows a warp.
template <typename T, typename Acc, int kPer>
int launch_products_of(const MatrixBatch& a, const RowProducts& out, const MatrixBatch* b,
                       const RowProducts* b_out, cudaStream_t stream) {
  const int a_path = products_path<T>(a, out);
  const int b_path = b == nullptr ? kRowVectors : products_path<T>(*b, *b_out);
  const bool pairs = std::is_same<Acc, float>::value && kPer > kFewProducts &&
                     a_path == kRowVectors && b_path == kRowVectors;
  const int rows = pairs ? 2 : 1;
  const ProductsJob first = products_job(a, out, a_path, 0, kPer, rows);
  const ProductsJob second = b == nullptr
                                 ? ProductsJob{a, out, first.blocks, 1, 0, kRowEntries}
                                 : products_job(*b, *b_out, b_path, first.blocks, kPer, rows);
  const int64_t blocks = first.blocks + second.blocks;
  if (blocks == 0) return cudaSuccess;
  if constexpr (std::is_same<Acc, float>::value && kPer > kFewProducts) {
    if (pairs) {
      ABFT_LAUNCH(unsigned(blocks), kThreads, 0, stream, products_kernel<T, Acc, kPer, 2>)
      (first, second);
      return cudaGetLastError();
    }
  }
  ABFT_LAUNCH(unsigned(blocks), kThreads, 0, stream, products_kernel<T, Acc, kPer, 1>)
  (first, second);
  return cudaGetLastError();
}

template <typename T, typename Acc>
int launch_products(const MatrixBatch& a, const RowProducts& out, const MatrixBatch* b,
                    const RowProducts* b_out, cudaStream_t stream) {
  int64_t most = out.u.rows > out.z.rows ? out.u.rows : out.z.rows;
  if (b != nullptr) {
    most = b_out->u.rows > most ? b_out->u.rows : most;
    most = b_out->z.rows > most ? b_out->z.rows : most;
  }
  if (most <= kFewProducts) {
    return launch_products_of<T, Acc, kFewProducts>(a, out, b, b_out, stream);
  }
  return launch_products_of<T, Acc, kProductsPerPass>(a, out, b, b_out, stream);
}

// mma_products' vectors split into bf16 parts (MmaParts): a thread an entry of a vector, which
// writes its three parts.
__global__ void __launch_bounds__(kThreads) mma_parts_kernel(MmaParts k, int64_t items) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x, cols = k.u.cols, nu = k.u.rows;
  for (int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; item < items; item += step) {
    const int64_t r = item / cols, j = item % cols;
    const bool of_u = r < nu;
    const MatrixBatch& v = of_u ? k.u : k.z;
    const int64_t i = of_u ? r : r - nu;
    const float x = static_cast<const float*>(v.data)[i * v.row_stride + j * v.col_stride];
    __nv_bfloat16* part = static_cast<__nv_bfloat16*>(k.parts) + (of_u ? 0 : 3 * nu * cols) +
                          i * cols + j;
    const int64_t next = v.rows * cols;  // from a vector's hi to its mid, and to its lo
    const float rest = x - store(part, x);
    store(part + 2 * next, rest - store(part + next, rest));
  }
}

// mma_products' sums of its parts' products (MmaSums): a thread an output.
__global__ void __launch_bounds__(kThreads) mma_sums_kernel(MmaSums k, int64_t items) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x, products = k.p * k.nu;
  const float scale = float(k.scale), size = float(fabs(k.scale));
  for (int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; item < items; item += step) {
    const bool of_u = item < products;
    const int64_t n = of_u ? k.nu : k.nz, at = of_u ? item : item - products;
    const float* found = (of_u ? k.found_u : k.found_z) + at / n * 3 * n + at % n;
    const float sum = (found[0] + found[n]) + found[2 * n];
    (of_u ? k.products : k.magnitudes)[at] = sum * (of_u ? scale : size);
  }
}

}  // namespace
}  // namespace abft
