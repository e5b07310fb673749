// Torch-free checksum kernels of megatron-abft, shared by the C++ implementation (abft_cpu.cpp),
// the CUDA kernels (abft_cuda.cu) and the torch binding (abft_ops.cpp).
//
// block_sums reads a batch of matrices C [*batch, rows, cols] once and produces, for both sides of
// an EEC-ABFT check (docs/abft.md §1), the plain and weighted sums of every checked vector and
// of its magnitudes:
//   column side: per column j and block of `col_block` rows starting at row r0,
//     sums  = (sum_i x_ij,   sum_i w_i x_ij)      sizes = (sum_i |x_ij|, sum_i w_i |x_ij|)
//   row side: the same per row i and block of `row_block` columns,
// with w = 1, 2, ... counted from the block's start. Sums are accumulated in fp32 (fp64 for fp64
// inputs), whatever the input dtype.
//
// row_products reads a batch of operands A [*batch, m, k] once and produces, for the checksums of a
// GEMM that A enters (megatron_abft/check/checksum.py), A u_t and |A| z_t for a few vectors u_t,
// z_t per matrix: the other operand's block sums and magnitudes. One read replaces a copy of |A|
// and two GEMMs over A and |A|.
//
// screen compares both sides' block sums of C with the reference checksums carried from the
// GEMM's inputs and counts, per matrix, the vectors whose differences exceed the rounding
// thresholds of megatron_abft/check/tolerance.py. It is the clean path of a check: a matrix with no
// flagged vector needs nothing more; any other goes to the locate-and-correct path (correct,
// abft_correct.h).
#pragma once

#include <cfloat>
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

// Vectors and outputs in the accumulation type, for row_products: u [*batch, nu, k] and
// z [*batch, nz, k], strided views (a broadcast batch dim has stride 0; each vector's elements
// are contiguous), so that the other operand's block sums are read where they are; contiguous
// outputs products [batch, m, nu], magnitudes [batch, m, nz]. nu = u.rows, nz = z.rows. The
// products come out times `scale` and the magnitudes times |scale| (a GEMM's alpha), each
// rounded once, as a multiplication of the outputs would.
struct RowProducts {
  MatrixBatch u;
  MatrixBatch z;
  void* products;
  void* magnitudes;
  double scale;
};

// One side of a screen. The recomputed sums and sizes are block_sums' outputs; the references
// are strided views of C's batch (batch dims first, then block, pair, vector):
//   ref_sums [*batch, nb, 2, n], magnitude and bias [*batch, nb, n] (bias null without one).
// The thresholds, with S, S_w the sizes and M the magnitude of one vector of length `length`:
//   tau = out S + gemm M + floor,   tau_w = out S_w + gemm length M + floor length,
// where a bias first makes S = 2 S + bias and S_w = 2 S_w + length bias.
struct ScreenSide {
  void* sums;  // written only by correct, which keeps them current
  void* sizes;
  int64_t nb, n;
  const void* ref_sums;
  int64_t ref_strides[kMaxBatchDims + 3];
  const void* magnitude;
  int64_t magnitude_strides[kMaxBatchDims + 2];
  const void* bias;
  int64_t bias_strides[kMaxBatchDims + 2];
  double out, gemm, floor, length;
};

// Both sides of a screen of a batch of matrices, and the output: flagged [batch, slots] int32,
// whose slots sum to the number of flagged vectors of each matrix (flagged_count). The CPU
// kernels keep one slot a matrix; the CUDA block sums that screen (Launchers::block_sums) one a
// tile.
struct Screen {
  int batch_dims;
  int64_t batch_sizes[kMaxBatchDims];
  int64_t batch;
  int sides;
  ScreenSide side[2];
  int32_t* flagged;
  int64_t slots;
};

// The number of flagged vectors of matrix b.
ABFT_HD inline int64_t flagged_count(const Screen& s, int64_t b) {
  int64_t count = 0;
  for (int64_t t = 0; t < s.slots; ++t) count += s.flagged[b * s.slots + t];
  return count;
}

// The screen flags a vector a hair before the reference comparison would (its thresholds are
// tightened by this factor), so that rounding differences in the threshold arithmetic can only
// send a borderline clean vector to the full path, never pass a vector the reference flags.
constexpr double kScreenMargin = 1.0 - 1.0 / 65536;

ABFT_HD inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

ABFT_HD inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The tiles of the CUDA block sums, each one thread block's: a block of the column side's rows
// (kCudaTileRows where that side is not checked) by a block of the row side's columns
// (kCudaTileCols where it is not). A tile completes the vectors it covers: its block of each of
// its columns, its block of each of its rows.
constexpr int64_t kCudaTileRows = 64;
constexpr int64_t kCudaTileCols = 256;
struct Tiling {
  int64_t height, width, row_tiles, col_tiles;
};

ABFT_HD inline Tiling block_sums_tiling(const MatrixBatch& c, const BlockSums& out) {
  const int64_t height = out.col_block > 0 ? out.col_block : kCudaTileRows;
  const int64_t width = out.row_block > 0 ? out.row_block : kCudaTileCols;
  return {height, width, ceil_div(c.rows, height), ceil_div(c.cols, width)};
}

// Whether a batch's matrices are stored column by column (row_products then reads columns).
ABFT_HD inline bool column_major(const MatrixBatch& a) {
  return a.row_stride == 1 && a.col_stride != 1 && a.rows > 1;
}

// The offset of matrix b (< the product of `sizes`) in a batch of `dims` dims. Where each dim's
// stride is the next one's times that one's size (a contiguous batch; the batch and heads of
// Megatron's [s, b, h, d]), one multiply; else an int64 division a dim (on a GPU about 20
// instructions where both values fit in 32 bits, else a call), which the kernels that find an
// offset a row (the products) would pay at every row.
ABFT_HD inline int64_t nested_batch_offset(int dims, const int64_t* sizes, const int64_t* strides,
                                           int64_t b) {
  if (dims == 0) return 0;
  bool nested = true;
  for (int d = 0; d + 1 < dims; ++d) nested = nested && strides[d] == strides[d + 1] * sizes[d + 1];
  if (nested) return b * strides[dims - 1];
  int64_t offset = 0;
  for (int d = dims - 1; d >= 0; --d) {
    offset += (b % sizes[d]) * strides[d];
    b /= sizes[d];
  }
  return offset;
}

ABFT_HD inline int64_t batch_offset(const MatrixBatch& c, int64_t b) {
  return nested_batch_offset(c.batch_dims, c.batch_sizes, c.batch_strides, b);
}

// The offset of matrix b in a tensor with C's batch dims and these batch strides.
ABFT_HD inline int64_t strided_batch_offset(const Screen& s, const int64_t* strides, int64_t b) {
  return nested_batch_offset(s.batch_dims, s.batch_sizes, strides, b);
}

ABFT_HD inline float abs_value(float x) { return x < 0 ? -x : x; }
ABFT_HD inline double abs_value(double x) { return x < 0 ? -x : x; }
ABFT_HD inline float largest_finite(float) { return FLT_MAX; }
ABFT_HD inline double largest_finite(double) { return DBL_MAX; }

// One side's tensors at matrix b: its recomputed sums and sizes, and its references.
template <typename Acc>
struct ScreenMatrix {
  const Acc* sums;
  const Acc* sizes;
  const Acc* ref;
  const Acc* magnitude;
  const Acc* bias;  // null without a bias
};

template <typename Acc>
ABFT_HD inline ScreenMatrix<Acc> screen_matrix(const Screen& s, const ScreenSide& side,
                                               int64_t b) {
  const int64_t at = b * side.nb * 2 * side.n;
  return {static_cast<const Acc*>(side.sums) + at, static_cast<const Acc*>(side.sizes) + at,
          static_cast<const Acc*>(side.ref_sums) + strided_batch_offset(s, side.ref_strides, b),
          static_cast<const Acc*>(side.magnitude) +
              strided_batch_offset(s, side.magnitude_strides, b),
          side.bias == nullptr
              ? nullptr
              : static_cast<const Acc*>(side.bias) + strided_batch_offset(s, side.bias_strides, b)};
}

// The differences d1, d2 of vector j of block blk of matrix x from its references, and their
// thresholds tau, tau_w.
template <typename Acc>
struct Residual {
  Acc d1, d2, tau, tau_w;
};

template <typename Acc>
ABFT_HD inline Residual<Acc> residual(const Screen& s, const ScreenSide& side,
                                      const ScreenMatrix<Acc>& x, int64_t blk, int64_t j) {
  const int d = s.batch_dims;
  const int64_t at = blk * 2 * side.n + j;
  const int64_t* rs = side.ref_strides;
  const Acc* ref = x.ref + blk * rs[d] + j * rs[d + 2];
  const int64_t* ms = side.magnitude_strides;
  const Acc magnitude = x.magnitude[blk * ms[d] + j * ms[d + 1]];
  const Acc length = Acc(side.length);
  Acc size = x.sizes[at], size_w = x.sizes[at + side.n];
  if (x.bias != nullptr) {
    const int64_t* bs = side.bias_strides;
    const Acc bias = x.bias[blk * bs[d] + j * bs[d + 1]];
    size = 2 * size + bias;
    size_w = 2 * size_w + length * bias;
  }
  const Acc out = Acc(side.out), gemm = Acc(side.gemm), floor = Acc(side.floor);
  return {ref[0] - x.sums[at], ref[rs[d + 1]] - x.sums[at + side.n],
          size * out + gemm * magnitude + floor,
          size_w * out + Acc(side.gemm * side.length) * magnitude + Acc(side.floor * side.length)};
}

// Whether both differences lie within `factor` times their (finite) thresholds (NaN does not).
template <typename Acc>
ABFT_HD inline bool within(const Residual<Acc>& r, Acc factor) {
  return r.tau_w <= Acc(0.5) * largest_finite(Acc(0)) && abs_value(r.d1) <= r.tau * factor &&
         abs_value(r.d2) <= r.tau_w * factor;
}

// Whether vector j of block blk of matrix x fails the screen on this side (NaN fails).
template <typename Acc>
ABFT_HD inline bool screen_flags(const Screen& s, const ScreenSide& side,
                                 const ScreenMatrix<Acc>& x, int64_t blk, int64_t j) {
  return !within(residual<Acc>(s, side, x, blk, j), Acc(kScreenMargin));
}

// Locate and correct, in place, the matrices a screen flagged: the fused path of
// megatron_abft/check/eec.py with the GEMM's operands (abft_correct.h has the algorithm). The
// screen's block sums are kept current as C is written. Per matrix: status (0 clean, 1
// corrected, 2 unresolved: C put back bit for bit as it was), kind (index into eec.KINDS), the
// most wrong flagged row and column (-1: none) and the largest |d1| of a flagged vector.
struct Correct {
  Screen screen;  // with its flagged counts filled in
  int col_side, row_side;  // index of each side in screen.side; -1 where it is not checked
  int64_t col_block, row_block;
  MatrixBatch c;  // C's geometry; it is written through `data`
  void* data;
  MatrixBatch a, b;  // the operands, expanded to C's batch: A [*batch, m, k], B [*batch, k, n]
  double alpha;
  const void* bias;  // [n] (stride bias_stride), or null
  DType bias_dtype;
  int64_t bias_stride;
  double near_inf;
  int64_t vectors;     // vectors per side and pass that may be corrected
  int64_t capacity;    // writes per matrix that can be undone
  void* initial_sums[2];   // workspaces shaped as each side's sums and sizes: the sums as the
  void* initial_sizes[2];  // screen found them, kept by the matrices that are corrected
  int64_t* log_at;     // [batch, capacity]: row * cols + column of each written element
  uint64_t* log_bits;  // [batch, capacity]: their bits before the write
  int8_t* status;
  int8_t* kind;
  int64_t* row;
  int64_t* col;
  void* magnitude;  // in the accumulation type
};

// Tally what a check found, for a guard's ledger (megatron_abft/check/ledger.py), with no host
// read: over the per-matrix results of a batch (status 0 clean / 1 corrected / 2 uncorrectable,
// kind an index into eec.KINDS) it adds 1 to counts[outcome][kind] for outcome 0 (detected: status
// != 0), 1 (corrected) and 2 (uncorrectable) and sets *failed to whether a matrix is uncorrectable;
// if a matrix is not clean, it adds 1 to *logged and, while that stays within capacity, writes the
// record of the worst matrix, the first of the highest status, to the log: step (read from *step,
// so that a CUDA graph's replays read the current one), status, matrix, kind, row, col, magnitude
// (ledger.EVENT_FIELDS). Results outside those ranges are not counted. batch >= 1.
struct Tally {
  const int8_t* status;
  const int8_t* kind;
  const int64_t* row;
  const int64_t* col;
  const void* magnitude;  // float, or double where magnitude_f64
  bool magnitude_f64;
  int64_t batch;
  int kinds;  // at most kMaxKinds
  int64_t* counts;  // [3, kinds], added to
  bool* failed;
  const double* step;  // [1]
  double* log;  // [capacity, kEventFields]
  int64_t* logged;  // [1], added to
  int64_t capacity;
};
constexpr int kMaxKinds = 8;
constexpr int kEventFields = 7;

// A matrix's rank for the event record: the highest status first, then the lowest index.
ABFT_HD inline uint64_t tally_rank(int8_t status, int64_t b) {
  constexpr uint64_t kIndexMask = (uint64_t(1) << 48) - 1;
  return (uint64_t(uint8_t(status)) << 48) | (kIndexMask - uint64_t(b));
}
ABFT_HD inline int64_t tally_matrix(uint64_t rank) {
  constexpr uint64_t kIndexMask = (uint64_t(1) << 48) - 1;
  return int64_t(kIndexMask - (rank & kIndexMask));
}

// Whether the check failed, and the event record of matrix b (rank's) where it is not clean.
ABFT_HD inline void tally_event(const Tally& t, int64_t b) {
  *t.failed = t.status[b] == 2;
  if (t.status[b] == 0) return;
  const int64_t n = (*t.logged)++;
  if (n >= t.capacity) return;
  const double magnitude = t.magnitude_f64 ? static_cast<const double*>(t.magnitude)[b]
                                           : double(static_cast<const float*>(t.magnitude)[b]);
  const double record[kEventFields] = {*t.step,          double(t.status[b]), double(b),
                                       double(t.kind[b]), double(t.row[b]),   double(t.col[b]),
                                       magnitude};
  for (int i = 0; i < kEventFields; ++i) t.log[n * kEventFields + i] = record[i];
}

// add_bias: what a bias [n] adds to both sides' checksums of C = alpha * A @ B + bias, C with m
// rows (megatron_abft/check/checksum.py, _columns and _rows), added to the sums of alpha * A @ B:
// per block of rows, (rows, sum of their weights) x bias_j and rows x |bias_j|; per block of
// columns, (sum bias_j, sum w_j bias_j) and sum |bias_j|, the same for every row. In the
// accumulation type (double where f64, else float), over `batch` matrices:
//   col_in, col_out [batch, ceil(m / block), 2, n], col_size_in, col_size_out [.., n]
//   row_in, row_out [batch, ceil(n / block), 2, m], row_size_in, row_size_out [.., m]
// and the bias's magnitudes col_bias [ceil(m / block), n], row_bias [ceil(n / block)]; the
// inputs at their strides in elements (the products as encode_pair leaves them, transposed),
// the outputs contiguous. One item per column term, then one per block of columns and row of C
// (bias_terms_items).
struct BiasTerms {
  const void* bias;
  DType dtype;
  int64_t stride;  // of bias, in elements
  int64_t n, m, block, batch;
  bool f64;
  const void* col_in;
  int64_t col_in_strides[4];  // batch, block, pair, column
  const void* col_size_in;
  int64_t col_size_in_strides[3];  // batch, block, column
  const void* row_in;
  int64_t row_in_strides[4];  // batch, block, pair, row
  const void* row_size_in;
  int64_t row_size_in_strides[3];  // batch, block, row
  void* col_out;
  void* col_size_out;
  void* row_out;
  void* row_size_out;
  void* col_bias;
  void* row_bias;
};

ABFT_HD inline int64_t bias_column_items(const BiasTerms& t) {
  return ceil_div(t.m, t.block) * t.n;
}

ABFT_HD inline int64_t bias_terms_items(const BiasTerms& t) {
  return bias_column_items(t) + ceil_div(t.n, t.block) * t.m;
}

// softmax_check, the fused softmax: Megatron's scale-mask-softmax of the attention scores S
// [*batch, rows, cols] (rows contiguous) in one read of S that also screens S and gives the
// checksum sums of P, the operand of the context GEMM:
//   P = softmax(mask(scale S)) row by row, where masked entries (mask nonzero, or j > i when
//   causal) become -10000 as in Megatron's attention_mask_func; computed in the accumulation
//   type, written contiguous in S's dtype;
//   with screen.sides > 0, S's block sums into s_sums and the number of S's vectors that fail
//   the screen into screen.flagged (on the CPU added to each matrix's one slot, zeroed by the
//   caller; on CUDA as softmax_single_pass says);
//   with products, P's column block sums into p_sums (row_block 0) and P's row products: what
//   operand_pass gives for P as written (rounded to its dtype).
// A task is a band of `band` rows of one matrix: the column side's block of S and of P.
struct SoftmaxCheck {
  MatrixBatch s;
  void* p;
  const uint8_t* mask;  // null: no mask tensor
  int64_t mask_strides[kMaxBatchDims + 2];  // over S's batch dims, rows and columns (bytes)
  bool causal;
  double scale;
  int64_t band;
  BlockSums s_sums;
  Screen screen;
  BlockSums p_sums;
  const RowProducts* products;  // null: P's sums are not wanted
};

ABFT_HD inline int64_t softmax_check_tasks(const SoftmaxCheck& k) {
  return k.s.batch * ceil_div(k.s.rows, k.band);
}

// On CUDA, softmax_check reads S once where a thread block can hold a band's column sums in
// shared memory (softmax_pass_bytes: 4 a column of S where its column side is screened, 4 of P
// where its pass is wanted, in the accumulation type) within kSoftmaxPassBytes: the single pass,
// one launch, with one slot of `flagged` a band (one a matrix, written 0, without a screen).
// Otherwise S's screened block sums, the softmax, P's block sums and P's products run in turn
// (one slot a tile; S and P each read twice).
constexpr int64_t kSoftmaxPassBytes = 96 * 1024;
ABFT_HD inline int64_t softmax_pass_bytes(int64_t cols, DType dtype, bool s_cols, bool pass) {
  const int64_t size = dtype == DType::F64 ? 8 : 4;
  return 4 * (int64_t(s_cols) + int64_t(pass)) * cols * size;
}
ABFT_HD inline bool softmax_single_pass(int64_t cols, DType dtype, bool s_cols, bool pass) {
  return softmax_pass_bytes(cols, dtype, s_cols, pass) <= kSoftmaxPassBytes;
}
// The single pass's tiles: its bands of rows, each the whole width of S (one slot a band).
ABFT_HD inline Tiling softmax_bands(const SoftmaxCheck& k) {
  return {k.band, k.s.cols, ceil_div(k.s.rows, k.band), 1};
}

// Row i of matrix b of softmax_check's mask (null without one); its entries are mask_strides[
// batch_dims + 1] apart.
ABFT_HD inline const uint8_t* softmax_mask_row(const SoftmaxCheck& k, int64_t b, int64_t i) {
  if (k.mask == nullptr) return nullptr;
  int64_t at = i * k.mask_strides[k.s.batch_dims];
  for (int d = k.s.batch_dims - 1; d >= 0; --d) {
    at += (b % k.s.batch_sizes[d]) * k.mask_strides[d];
    b /= k.s.batch_sizes[d];
  }
  return k.mask + at;
}

// CPU: the work splits into independent tasks (one band of rows of one matrix each); the binding
// runs tasks [begin, end) on each of its threads.
// With `products`, the same pass also gives row_products of C (operand_pass: an operand's block
// sums and its checksum products in one read).
int64_t block_sums_tasks(const MatrixBatch& c, const BlockSums& out);
void block_sums_cpu(const MatrixBatch& c, const BlockSums& out, int64_t begin, int64_t end,
                    const RowProducts* products = nullptr);

// CPU, as block_sums: tasks of one band of rows of one matrix, read row by row, or column by
// column where A is column_major.
int64_t row_products_tasks(const MatrixBatch& a);
void row_products_cpu(const MatrixBatch& a, const RowProducts& out, int64_t begin, int64_t end);

// CPU, matrices [begin, end) of the batch: their flagged counts, both sides, in one slot each.
// (CUDA screens in its block sums: Launchers::block_sums.)
void screen_cpu(const Screen& s, bool f64, int64_t begin, int64_t end);

// CPU, one loop.
void tally_cpu(const Tally& t);

// CPU, all items, each block of columns summed once.
void bias_terms_cpu(const BiasTerms& t);

// CPU, tasks [begin, end) (softmax_check_tasks), one pass over S.
void softmax_check_cpu(const SoftmaxCheck& k, int64_t begin, int64_t end);

// CPU, matrices [begin, end) of the batch.
void correct_cpu(const Correct& k, bool f64, int64_t begin, int64_t end);

// mma_products' split of fp32 vectors into bf16 parts for the tensor cores: u [nu, k] and
// z [nz, k] (2-D, any strides; fp32) into parts [3 nu + 3 nz, k] (bf16, contiguous): u's hi
// rows, then its mid rows, then its lo rows, then z's three blocks alike, where hi = bf16(v),
// mid = bf16(v - hi) and lo = bf16(v - hi - mid) (each subtraction exact in fp32).
struct MmaParts {
  MatrixBatch u;
  MatrixBatch z;
  void* parts;
};

// The products of mma_products from its two GEMMs' outputs (fp32, contiguous): found_u
// [p, 3 nu] (x times u's parts) and found_z [p, 3 nz] (|x| times z's parts) into products
// [p, nu] and magnitudes [p, nz] (fp32, contiguous): the three parts of a vector summed, hi's
// + mid's, then + lo's, then times scale (|scale| for the magnitudes), in fp32.
struct MmaSums {
  const float* found_u;
  const float* found_z;
  float* products;
  float* magnitudes;
  int64_t p, nu, nz;
  double scale;
};

// The vectors of each kind (u, z) whose products with a row of A the CUDA products kernel holds
// in registers: more take more passes over the row.
constexpr int kProductsPerPass = 16;

// The CUDA kernels' launchers (abft_cuda.cu). Each launches on `stream` (a cudaStream_t) and
// returns the launch's cudaError_t (0: success). abft_cuda.cu is built twice: by nvcc for GPUs
// (cuda_launchers, in CUDA builds of _C), and by the C++ compiler with cuda_emulator.h, which
// runs the same kernels on the CPU, for tests on machines without a GPU (emulated_launchers, in
// the test-only extension megatron_abft._emulator).
struct Launchers {
  // With a screen whose sides are out's (C's, or C^T's where C is read transposed), each tile
  // also screens the vectors it completes, in the same launch, and writes how many failed to its
  // slot of screen->flagged (screen->slots = row_tiles * col_tiles of block_sums_tiling; no zero
  // fill). screen may be null.
  int (*block_sums)(const MatrixBatch& c, const BlockSums& out, void* stream,
                    const Screen* screen);
  // The block sums of two batches of one dtype (unscreened) in one launch.
  int (*block_sums_pair)(const MatrixBatch& a, const BlockSums& a_out, const MatrixBatch& b,
                         const BlockSums& b_out, void* stream);
  // With b (or null), b's products (b_out; b of a's dtype) in the same launch.
  int (*row_products)(const MatrixBatch& a, const RowProducts& out, void* stream,
                      const MatrixBatch* b, const RowProducts* b_out);
  // One thread block.
  int (*tally)(const Tally& t, void* stream);
  int (*bias_terms)(const BiasTerms& t, void* stream);
  // The single pass, or the four kernels, as softmax_single_pass says.
  int (*softmax_check)(const SoftmaxCheck& k, void* stream);
  // What a sync-free check of the scores runs after softmax_check with a screen: c corrects the
  // flagged matrices of the S that k read, from the block sums k wrote; each matrix corrected
  // has its rows of P and P's checksum pass (where k has products) redone from the corrected S;
  // t tallies c's results. One thread block: one launch. (The CPU composes correct_cpu,
  // softmax_check_cpu over the corrected matrices' bands without the screen, and tally_cpu.)
  int (*correct_redo_tally)(const Correct& c, const SoftmaxCheck& k, const Tally& t,
                            void* stream);
  // After the screen's launches.
  int (*correct)(const Correct& k, bool f64, void* stream);
  // correct, then tally its results (t reads k's outputs; batch >= 1), in one launch.
  int (*correct_tally)(const Correct& k, const Tally& t, bool f64, void* stream);
  // mma_products' split of its vectors and its sums of the parts' products: a launch each.
  int (*mma_parts)(const MmaParts& k, void* stream);
  int (*mma_sums)(const MmaSums& k, void* stream);
};
extern const Launchers cuda_launchers;
extern const Launchers emulated_launchers;

}  // namespace abft
