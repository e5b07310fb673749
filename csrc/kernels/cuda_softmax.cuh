// The fused softmax (abft.h's softmax_check): the causal softmax of S with S's screen and P's
// checksum pass in one read of S, a warp a row (the row in registers where it fits), and P
// redone from S for a corrected S.
#pragma once

#include "kernels/cuda_block_sums.cuh"
#include "kernels/cuda_products.cuh"

namespace abft {
namespace {

// Row i of matrix b of softmax_check's S as its softmax reads it, for one warp: value(j) is
// scale x_ij, or -10000 where masked; the constructor reads the row twice, for its largest value
// and the sum of its exponentials, so that probability(j) is P_ij before its rounding.
template <typename T, typename Acc>
struct SoftmaxRow {
  const T* x;
  const uint8_t* mask;  // null: none
  int64_t mask_step, open, col_stride;
  Acc scale, top, inverse;

  __device__ SoftmaxRow(const SoftmaxCheck& k, int64_t b, int64_t i, int lane)
      : x(static_cast<const T*>(k.s.data) + batch_offset(k.s, b) + i * k.s.row_stride),
        mask(softmax_mask_row(k, b, i)),
        mask_step(k.mask_strides[k.s.batch_dims + 1]),
        open(k.causal ? min64(k.s.cols, i + 1) : k.s.cols),
        col_stride(k.s.col_stride),
        scale(Acc(k.scale)) {
    const int64_t cols = k.s.cols;
    Acc largest = -largest_finite(Acc(0));
    for (int64_t j = lane; j < cols; j += 32) {
      const Acc v = value(j);
      largest = v > largest ? v : largest;
    }
    top = warp_max(largest);
    Acc sum = 0;
    for (int64_t j = lane; j < cols; j += 32) sum += exponential(value(j) - top);
    inverse = Acc(1) / warp_sum(sum);
  }

  __device__ Acc value(int64_t j) const {
    const bool masked = j >= open || (mask != nullptr && mask[j * mask_step] != 0);
    return masked ? Acc(-10000) : Acc(load(x + j * col_stride)) * scale;
  }

  __device__ Acc probability(int64_t j) const { return exponential(value(j) - top) * inverse; }
};

// softmax_check's softmax alone, for rows too long for the single pass: one warp per row.
template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads) softmax_kernel(SoftmaxCheck k, int64_t total_rows) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  const int64_t rows = k.s.rows, cols = k.s.cols;
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); r < total_rows;
       r += warps) {
    const SoftmaxRow<T, Acc> row(k, r / rows, r % rows, lane);
    T* out = static_cast<T*>(k.p) + r * cols;
    for (int64_t j = lane; j < cols; j += 32) store(out + j, row.probability(j));
  }
}

template <typename T, typename Acc>
int launch_softmax(const SoftmaxCheck& k, cudaStream_t stream) {
  const int64_t total_rows = k.s.batch * k.s.rows;
  if (total_rows == 0) return cudaSuccess;
  const unsigned grid = unsigned(min64(ceil_div(total_rows, kWarps), 0x7fffffff));
  ABFT_LAUNCH(grid, kThreads, 0, stream, softmax_kernel<T, Acc>)(k, total_rows);
  return cudaGetLastError();
}

// A vector's sums, with entry v of weight w added: plain, weighted, and of the magnitudes, plain
// and weighted.
template <typename Acc>
__device__ __forceinline__ void add_to_sums(Acc (&sums)[4], Acc v, Acc w) {
  const Acc a = magnitude(v);
  sums[0] += v;
  sums[1] += w * v;
  sums[2] += a;
  sums[3] += w * a;
}

// A vector's sums (add_to_sums) into BlockSums-shaped outputs: plain and weighted at `at` and
// `at + stride` of `plain`, and of the magnitudes the same in `sizes`.
template <typename Acc>
__device__ __forceinline__ void write_sums(void* plain, void* sizes, int64_t at, int64_t stride,
                                           const Acc (&sums)[4]) {
  static_cast<Acc*>(plain)[at] = sums[0];
  static_cast<Acc*>(plain)[at + stride] = sums[1];
  static_cast<Acc*>(sizes)[at] = sums[2];
  static_cast<Acc*>(sizes)[at + stride] = sums[3];
}

// Row i of matrix b of P, written from `row` by its warp, and, where `pass`, the row's products
// with u and z (of the entries this lane wrote, as rounded), which lane 0 writes.
template <typename T, typename Acc>
__device__ __forceinline__ void write_p_row(const SoftmaxCheck& k, const RowProducts& pr,
                                            bool pass, const SoftmaxRow<T, Acc>& row, int64_t b,
                                            int64_t i, int lane) {
  const int64_t rows = k.s.rows, cols = k.s.cols;
  T* p = static_cast<T*>(k.p) + (b * rows + i) * cols;
  for (int64_t j = lane; j < cols; j += 32) store(p + j, row.probability(j));
  if (!pass) return;
  const Acc* u = static_cast<const Acc*>(pr.u.data) + batch_offset(pr.u, b);
  const Acc* z = static_cast<const Acc*>(pr.z.data) + batch_offset(pr.z, b);
  const int64_t nu = pr.u.rows, nz = pr.z.rows;
  for (int64_t t = 0; t < nu + nz; ++t) {
    const bool product = t < nu;
    const Acc* vector = product ? u + t * pr.u.row_stride : z + (t - nu) * pr.z.row_stride;
    Acc dot = 0;
    for (int64_t j = lane; j < cols; j += 32) {
      const Acc v = Acc(load(p + j));
      dot += (product ? v : magnitude(v)) * vector[j];
    }
    dot = warp_sum(dot);
    if (lane == 0 && product) {
      static_cast<Acc*>(pr.products)[(b * rows + i) * nu + t] = dot * Acc(pr.scale);
    } else if (lane == 0) {
      static_cast<Acc*>(pr.magnitudes)[(b * rows + i) * nz + t - nu] = dot * Acc(fabs(pr.scale));
    }
  }
}

// A band's column sums in softmax_check's single pass, kept in shared memory by the thread that
// owns the column: 4 a column of S (s_sums, where S's column side is screened), then 4 of P
// (p_sums, where P's pass is wanted), each [4][cols].
template <typename Acc>
struct BandColumns {
  Acc* s_sums;
  Acc* p_sums;
  bool s_cols, pass;
  int64_t bands;  // of each matrix

  __device__ void zero(int64_t cols, int64_t j) const {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      if (s_cols) s_sums[t * cols + j] = Acc(0);
      if (pass) p_sums[t * cols + j] = Acc(0);
    }
  }

  // Column j's sums written to band blk's block sums of matrix b, and S's screened against
  // x (side_matrix of col_side): whether it fails.
  __device__ int out(const SoftmaxCheck& k, int64_t b, int64_t blk, int64_t j, int col_side,
                     const ScreenMatrix<Acc>& x) const {
    const int64_t cols = k.s.cols, at = (b * bands + blk) * 2 * cols + j;
    if (pass) {
      const Acc sums[4] = {p_sums[j], p_sums[cols + j], p_sums[2 * cols + j], p_sums[3 * cols + j]};
      write_sums(k.p_sums.col_sums, k.p_sums.col_sizes, at, cols, sums);
    }
    if (!s_cols) return 0;
    const Acc sums[4] = {s_sums[j], s_sums[cols + j], s_sums[2 * cols + j], s_sums[3 * cols + j]};
    write_sums(k.s_sums.col_sums, k.s_sums.col_sizes, at, cols, sums);
    return side_fails<Acc>(k.screen, col_side, x, blk, j);
  }
};

// The band's slot of the screen's `flagged`: the sum of its threads' failed vectors (`fails`,
// added to band_fails, which thread 0 zeroed before the band's first barrier); without a screen,
// 0 in a matrix's one slot.
__device__ __forceinline__ void band_flagged(const SoftmaxCheck& k, int64_t b, int64_t blk,
                                             int fails, int& band_fails) {
  if (k.screen.sides > 0) {
    if (fails > 0) atomicAdd(&band_fails, fails);
    __syncthreads();
    if (threadIdx.x == 0) k.screen.flagged[b * k.screen.slots + blk] = band_fails;
  } else if (threadIdx.x == 0 && blk == 0 && k.screen.flagged != nullptr) {
    k.screen.flagged[b * k.screen.slots] = 0;
  }
}

// The fused softmax in one pass (abft.h's softmax_check), for any S: one thread block per band of
// one matrix, its warps taking the band's rows kWarps at a time, a warp per row. A warp reads its
// row of S (for its maximum and its sum in SoftmaxRow, then for P: the second and third reads
// from the cache), writes P, and reduces, reading them back, the row's products with u and z and,
// where screened, S's row-side block sums, which its lane 0 writes and screens. After a barrier,
// each thread adds the group's rows of S and P (from the cache) to its own columns j = t +
// kThreads q of the band's BandColumns, until the band ends, when it writes and screens them; no
// other thread touches them, so they need no barrier. col_side and row_side are S's sides in the
// screen (-1: none). softmax_rows_kernel is the fast one, for the rows it takes.
template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads, 3)  // 3 blocks an SM: at most 80 registers
    softmax_pass_kernel(SoftmaxCheck k, RowProducts pr, bool pass, int64_t tasks, int col_side,
                        int row_side) {
  ABFT_DYNAMIC_SHARED(shared);
  __shared__ int band_fails;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const MatrixBatch& s = k.s;
  const int64_t rows = s.rows, cols = s.cols, bands = ceil_div(rows, k.band);
  const bool s_cols = col_side >= 0;
  const int64_t row_block = k.s_sums.row_block;
  const int64_t nbr = row_side >= 0 ? ceil_div(cols, row_block) : 0;
  Acc* const s_sums = reinterpret_cast<Acc*>(shared);
  const BandColumns<Acc> band{s_sums, s_sums + (s_cols ? 4 * cols : 0), s_cols, pass, bands};

  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    const int64_t b = task / bands, blk = task % bands, r0 = blk * k.band;
    const int64_t r1 = min64(rows, r0 + k.band);
    const T* base = static_cast<const T*>(s.data) + batch_offset(s, b);
    T* out = static_cast<T*>(k.p) + b * rows * cols;
    const ScreenMatrix<Acc> row_screen =
        row_side >= 0 ? side_matrix<Acc>(k.screen, row_side, b) : ScreenMatrix<Acc>{};
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) band.zero(cols, j);
    int fails = 0;  // this thread's failed vectors of S in the band
    if (threadIdx.x == 0) band_fails = 0;  // added to only after the band's first barrier

    for (int64_t g0 = r0; g0 < r1; g0 += kWarps) {
      const int64_t i = g0 + warp;
      if (i < r1) {  // the warp's row
        const SoftmaxRow<T, Acc> row(k, b, i, lane);
        write_p_row<T, Acc>(k, pr, pass, row, b, i, lane);
        for (int64_t cb = 0; cb < nbr; ++cb) {  // S's row side: block cb of row i
          const int64_t j0 = cb * row_block, j1 = min64(cols, j0 + row_block);
          Acc sums[4] = {0, 0, 0, 0};
          for (int64_t j = j0 + lane; j < j1; j += 32) {
            add_to_sums(sums, Acc(load(row.x + j * s.col_stride)), Acc(j - j0 + 1));
          }
#pragma unroll
          for (int t = 0; t < 4; ++t) sums[t] = warp_sum(sums[t]);
          if (lane == 0) {
            const int64_t at = (b * nbr + cb) * 2 * rows + i;
            write_sums(k.s_sums.row_sums, k.s_sums.row_sizes, at, rows, sums);
            fails += side_fails<Acc>(k.screen, row_side, row_screen, cb, i);
          }
        }
      }
      __syncthreads();  // the group's rows of P are written
      const int64_t g1 = min64(r1, g0 + kWarps);
      for (int64_t j = threadIdx.x; j < cols; j += kThreads) {  // the group's rows, in order
        for (int m = 0; m < 2; ++m) {  // S, then P
          if (m == 0 ? !s_cols : !pass) continue;
          Acc* target = m == 0 ? band.s_sums : band.p_sums;
          Acc sums[4];
#pragma unroll
          for (int t = 0; t < 4; ++t) sums[t] = target[t * cols + j];
          for (int64_t r = g0; r < g1; ++r) {
            const Acc v = m == 0 ? Acc(load(base + r * s.row_stride + j * s.col_stride))
                                 : Acc(load(out + r * cols + j));
            add_to_sums(sums, v, Acc(r - r0 + 1));
          }
#pragma unroll
          for (int t = 0; t < 4; ++t) target[t * cols + j] = sums[t];
        }
      }
    }

    const ScreenMatrix<Acc> col_screen =
        s_cols ? side_matrix<Acc>(k.screen, col_side, b) : ScreenMatrix<Acc>{};
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
      fails += band.out(k, b, blk, j, col_side, col_screen);
    }
    band_flagged(k, b, blk, fails, band_fails);
  }
}

// The exponentials of softmax_rows_kernel, e^(v scale - top) of an entry v: for fp32 scores, expf
// of the argument; for 2-byte scores, whose P keeps 8 or 11 bits, the GPU's 2^x (ex2.approx.ftz:
// a few ulps, results below 2^-126 flushed to 0) of the argument in base 2, one FMA with log2(e)
// folded into the scale and top, so that an entry takes 2 instructions where expf takes 9 and
// __expf 6; the fold's roundings add |v scale| 2^-24 and |top| 2^-24 to the relative error.
template <typename T>
struct SoftmaxExp {
  static constexpr bool kBase2 = sizeof(T) == 2;
  static constexpr float kUnit = kBase2 ? 1.4426950408889634f : 1.0f;  // log2(e), or 1
  float scale, shift;  // the argument is v scale - shift

  __device__ SoftmaxExp(float softmax_scale, float top)
      : scale(softmax_scale * kUnit), shift(top * kUnit) {}

  __device__ float arg(float v) const { return fmaf(v, scale, -shift); }
  // the argument of a masked entry, whose value is -10000
  __device__ float masked_arg() const { return -10000.0f * kUnit - shift; }
  // e to the argument
  __device__ float of(float arg) const {
    if constexpr (kBase2) {
#ifdef ABFT_CUDA_EMULATOR
      return exp2f(arg);
#else
      float y;
      asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(arg));
      return y;
#endif
    } else {
      return expf(arg);
    }
  }
};

// softmax_rows_kernel's rows: a lane holds the row's vectors q = lane + 32 r, r < kRowSlots, in
// 128 bytes of registers (32 registers); a slot of every lane is kRowSpan elements.
template <typename T>
constexpr int kRowSlots = 128 / int(sizeof(VectorBits<T>));
constexpr int64_t kRowSpan = 32 * kVec;

// Which entries of the vector at j (kVec of them) the softmax masks, bit e for entry j + e: those
// from `open` on, and those set in `mask` (a row of bools, null: none) read as one word. In a
// few instructions, without a branch: a row takes it for every vector.
__device__ __forceinline__ unsigned masked_entries(const uint8_t* mask, int j, int open) {
  const int before = open - j;  // entries before open, clamped to [0, kVec] below
  unsigned bits = (0xfu << (before < 0 ? 0 : before > kVec ? kVec : before)) & 0xfu;
  if (mask != nullptr) {
    const uint32_t word = *reinterpret_cast<const uint32_t*>(mask + j);
    // bit 7 of each byte set where the byte is not 0, then those four bits gathered into bits
    // 21-24 by one multiplication (its partial products meet no other bit, so never carry)
    const uint32_t set = (((word & 0x7f7f7f7fu) + 0x7f7f7f7fu) | word) & 0x80808080u;
    bits |= (((set >> 7) * 0x204081u) >> 21) & 0xfu;
  }
  return bits;
}

// The sums of four values over a warp's lanes, each lane's own t[0..3]: lane l gets sum l % 4.
// The first two steps halve what a lane sends: 6 shuffles, where four warp_sums take 20.
__device__ __forceinline__ float warp_sums4(const float (&t)[4], int lane) {
  const bool high = lane & 2, odd = lane & 1;
  // lanes with bit 1 clear keep sums 0 and 1, the others 2 and 3; then bit 0 picks one of them
  float a = high ? t[2] : t[0], c = high ? t[3] : t[1];
  a += __shfl_xor_sync(kFullMask, high ? t[0] : t[2], 2);
  c += __shfl_xor_sync(kFullMask, high ? t[1] : t[3], 2);
  float v = odd ? c : a;
  v += __shfl_xor_sync(kFullMask, odd ? a : c, 1);
#pragma unroll
  for (int offset = 4; offset < 32; offset <<= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// p's kVec entries rounded to T and stored at `to` (aligned) in one store; p becomes the values
// stored.
template <typename T>
__device__ __forceinline__ void store_vector(T* to, float (&p)[kVec]) {
  T raw[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) p[e] = store(raw + e, p[e]);
  VectorBits<T> bits;
  memcpy(&bits, raw, sizeof(bits));
  *reinterpret_cast<VectorBits<T>*>(to) = bits;
}

// Four consecutive floats to p (16-byte aligned) in one store.
__device__ __forceinline__ void store_floats(float* p, const float (&w)[kVec]) {
  Bytes16 bits;
  memcpy(&bits, w, sizeof(bits));
  *reinterpret_cast<Bytes16*>(p) = bits;
}

// A task of softmax_rows_kernel: band blk of matrix b, where it reads and writes.
template <typename T>
struct RowsTask {
  int64_t b, blk;
  const T* s;  // matrix b of S
  T* p;  // and of P
  const uint8_t* mask;  // row 0 of its mask (null: none)
  const float* u;  // P's pass's vectors at b, two u and one z (null: no pass)
  const float* z;
};

// Row i of a task's matrix, by its warp, with the row in registers: read once; its maximum (and,
// where S's row side is screened, S's row block sums, which lanes 0-3 write, and then lane c
// screens block c), the sum of its exponentials, then P written and its products with u and z
// (lanes 0-2 write them). Vectors wholly masked take the masked value's exponential, found once.
// Returns this lane's failed vectors of S.
template <typename T>
__device__ __forceinline__ int softmax_row_in_registers(const SoftmaxCheck& k,
                                                        const RowProducts& pr, bool pass,
                                                        const RowsTask<T>& task, int64_t i,
                                                        int lane, int row_side,
                                                        const ScreenMatrix<float>& row_screen) {
  constexpr int kSlots = kRowSlots<T>;
  const int64_t rows = k.s.rows;
  const int cols = int(k.s.cols), vectors = cols / kVec;  // at most kRowSpan kSlots
  const float scale = float(k.scale);
  const int open = k.causal ? int(min64(cols, i + 1)) : cols;
  const uint8_t* mask =
      task.mask == nullptr ? nullptr : task.mask + i * k.mask_strides[k.s.batch_dims];
  const T* x = task.s + i * k.s.row_stride;
  VectorBits<T> row[kSlots];
  uint64_t masked = 0;  // 4 bits a slot (masked_entries)
#pragma unroll
  for (int r = 0; r < kSlots; ++r) {
    const int q = lane + 32 * r;
    if (q < vectors) {
      row[r] = *reinterpret_cast<const VectorBits<T>*>(x + kVec * q);
      masked |= uint64_t(masked_entries(mask, kVec * q, open)) << (kVec * r);
    }
  }

  // the largest value, and S's row block sums: a block is row_block / kRowSpan slots; lane t < 4
  // writes sum t of each (warp_sums4) at `to`, stepping a block (2 rows) at a time
  const int slots_a_block = row_side >= 0 ? int(k.s_sums.row_block / kRowSpan) : 0;
  const int blocks = row_side >= 0 ? int(ceil_div(cols, k.s_sums.row_block)) : 0;
  float* to = static_cast<float*>(lane < 2 ? k.s_sums.row_sums : k.s_sums.row_sizes) +
              (task.b * blocks * 2 + (lane & 1)) * rows + i;
  float largest = -largest_finite(0.0f);
  float sums[4] = {0, 0, 0, 0};  // this lane's share of the block's
  float start = float(kVec * lane + 1);  // the weight of this lane's first entry in the slot
  int left = slots_a_block;
#pragma unroll
  for (int r = 0; r < kSlots; ++r) {
    const int q = lane + 32 * r;
    if (q < vectors) {
      float v[kVec];
      unpack_vector<T>(row[r], v);
      const unsigned m = unsigned(masked >> (kVec * r)) & 0xfu;
      if (m == 0) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) largest = fmaxf(largest, v[e] * scale);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          largest = fmaxf(largest, (m >> e) & 1u ? -10000.0f : v[e] * scale);
        }
      }
      if (row_side >= 0) {  // the weight of entry e is start + e
        float plain = v[0], weighted = 0, size = fabsf(v[0]), weighted_size = 0;
#pragma unroll
        for (int e = 1; e < kVec; ++e) {
          plain += v[e];
          weighted += float(e) * v[e];
          size += fabsf(v[e]);
          weighted_size += float(e) * fabsf(v[e]);
        }
        sums[0] += plain;
        sums[1] += start * plain + weighted;
        sums[2] += size;
        sums[3] += start * size + weighted_size;
      }
    }
    if (row_side >= 0 && kRowSpan * r < cols) {
      start += float(kRowSpan);
      if (--left == 0 || kRowSpan * (r + 1) >= cols) {  // a block ends with this slot
        const float total = warp_sums4(sums, lane);
        if (lane < 4) *to = total;
        to += 2 * rows;
        sums[0] = sums[1] = sums[2] = sums[3] = 0;
        start = float(kVec * lane + 1);
        left = slots_a_block;
      }
    }
  }

  int fails = 0;
  if (row_side >= 0) {  // the row's blocks screened, a lane a block, once the sums are written
    __syncwarp();
    for (int c = lane; c < blocks; c += 32) {
      fails += side_fails<float>(k.screen, row_side, row_screen, c, i);
    }
  }

  // the sum of the exponentials: of each entry's argument, or of closed_arg where masked (a
  // select of the argument, not of two exponentials, which the compiler would branch around)
  const SoftmaxExp<T> exps(scale, warp_max(largest));
  const float closed_arg = exps.masked_arg(), closed = exps.of(closed_arg);  // a masked entry's
  float sum = 0;
#pragma unroll
  for (int r = 0; r < kSlots; ++r) {
    if (lane + 32 * r < vectors) {
      float v[kVec];
      unpack_vector<T>(row[r], v);
      const unsigned m = unsigned(masked >> (kVec * r)) & 0xfu;
      if (m == 0) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum += exps.of(exps.arg(v[e]));
      } else if (m == 0xfu) {
        sum += float(kVec) * closed;
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          sum += exps.of((m >> e) & 1u ? closed_arg : exps.arg(v[e]));
        }
      }
    }
  }

  // P, and its products
  const float inverse = 1.0f / warp_sum(sum), closed_p = closed * inverse;
  T* p = task.p + i * cols;
  float dots[4] = {0, 0, 0, 0};  // with u's rows 0 and 1, |P| with z's row 0
#pragma unroll
  for (int r = 0; r < kSlots; ++r) {
    const int q = lane + 32 * r;
    if (q < vectors) {
      float v[kVec];
      unpack_vector<T>(row[r], v);
      const unsigned m = unsigned(masked >> (kVec * r)) & 0xfu;
      if (m == 0) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] = exps.of(exps.arg(v[e])) * inverse;
      } else if (m == 0xfu) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] = closed_p;
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          v[e] = exps.of((m >> e) & 1u ? closed_arg : exps.arg(v[e])) * inverse;
        }
      }
      store_vector<T>(p + kVec * q, v);
      if (pass) {  // two u, one z (softmax_rows_take)
        float w[kVec];
        load_floats(task.u + kVec * q, w);
#pragma unroll
        for (int e = 0; e < kVec; ++e) dots[0] += v[e] * w[e];
        load_floats(task.u + pr.u.row_stride + kVec * q, w);
#pragma unroll
        for (int e = 0; e < kVec; ++e) dots[1] += v[e] * w[e];
        load_floats(task.z + kVec * q, w);
#pragma unroll
        for (int e = 0; e < kVec; ++e) dots[2] += fabsf(v[e]) * w[e];
      }
    }
  }
  if (pass) {
    const float total = warp_sums4(dots, lane);
    const int64_t at = task.b * rows + i;
    if (lane < 2) static_cast<float*>(pr.products)[at * 2 + lane] = total * float(pr.scale);
    if (lane == 2) static_cast<float*>(pr.magnitudes)[at] = total * float(fabs(pr.scale));
  }
  return fails;
}

// Column sums of `rows` (at most kWarps) consecutive rows of a matrix from `from` (row_stride
// apart), the kVec columns there, added to the band's (sums, [4][cols]: at its columns) with the
// rows' weights from `weight` on. The rows past `rows` add zeros.
template <typename T>
__device__ __forceinline__ void add_rows(float* sums, int64_t cols, const T* from,
                                         int64_t row_stride, int rows, float weight) {
  VectorBits<T> bits[kWarps];  // every load issued before the first is used; zeros past `rows`
#pragma unroll
  for (int r = 0; r < kWarps; ++r) {
    bits[r] = r < rows ? *reinterpret_cast<const VectorBits<T>*>(from + r * row_stride)
                       : VectorBits<T>{};
  }
  float t[4][kVec];
#pragma unroll
  for (int s = 0; s < 4; ++s) load_floats(sums + s * cols, t[s]);
#pragma unroll
  for (int r = 0; r < kWarps; ++r) {
    float v[kVec];
    unpack_vector<T>(bits[r], v);
    const float w = weight + float(r);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float a = fabsf(v[e]);
      t[0][e] += v[e];
      t[1][e] += w * v[e];
      t[2][e] += a;
      t[3][e] += w * a;
    }
  }
#pragma unroll
  for (int s = 0; s < 4; ++s) store_floats(sums + s * cols, t[s]);
}

// softmax_pass_kernel where its rows fit a warp's registers (softmax_rows_take): the same
// outputs, summed in other orders. A warp reads its row of S once, in vectors of kVec entries,
// and keeps it in registers for the row's three passes (softmax_row_in_registers); after each
// group's barrier, a thread adds the group's rows of S and P (from the cache), kVec columns a
// load, to the band's BandColumns of its own columns: those of its vectors q = t + kThreads n.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2)  // 2 blocks an SM: at most 128 registers
    softmax_rows_kernel(SoftmaxCheck k, RowProducts pr, bool pass, int64_t tasks, int col_side,
                        int row_side) {
  ABFT_DYNAMIC_SHARED(shared);
  __shared__ int band_fails;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const MatrixBatch& s = k.s;
  const int64_t rows = s.rows, cols = s.cols, vectors = cols / kVec;
  const int64_t bands = ceil_div(rows, k.band);
  const bool s_cols = col_side >= 0;
  float* const s_sums = reinterpret_cast<float*>(shared);
  const BandColumns<float> band{s_sums, s_sums + (s_cols ? 4 * cols : 0), s_cols, pass, bands};

  // S's row side at the task's matrix, for the rows' screens: out of their registers
  __shared__ ScreenMatrix<float> row_screen;
  for (int64_t t = blockIdx.x; t < tasks; t += gridDim.x) {
    RowsTask<T> task;
    task.b = t / bands;
    task.blk = t % bands;
    task.s = static_cast<const T*>(s.data) + batch_offset(s, task.b);
    task.p = static_cast<T*>(k.p) + task.b * rows * cols;
    task.mask = softmax_mask_row(k, task.b, 0);
    task.u = pass ? static_cast<const float*>(pr.u.data) + batch_offset(pr.u, task.b) : nullptr;
    task.z = pass ? static_cast<const float*>(pr.z.data) + batch_offset(pr.z, task.b) : nullptr;
    __syncthreads();  // the last task's screens done
    if (threadIdx.x == 0) {
      if (row_side >= 0) row_screen = side_matrix<float>(k.screen, row_side, task.b);
      band_fails = 0;
    }
    for (int64_t q = threadIdx.x; q < vectors; q += kThreads) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) band.zero(cols, kVec * q + e);
    }
    __syncthreads();  // row_screen written
    const int64_t r0 = task.blk * k.band, r1 = min64(rows, r0 + k.band);
    int fails = 0;  // this thread's failed vectors of S in the band

    for (int64_t g0 = r0; g0 < r1; g0 += kWarps) {
      if (g0 + warp < r1) {
        fails += softmax_row_in_registers<T>(k, pr, pass, task, g0 + warp, lane, row_side,
                                              row_screen);
      }
      __syncthreads();  // the group's rows of P are written
      const int group = int(min64(r1 - g0, kWarps));
      const float weight = float(g0 - r0 + 1);
      for (int64_t q = threadIdx.x; q < vectors; q += kThreads) {
        const int64_t j = kVec * q;
#pragma unroll 1
        for (int m = s_cols ? 0 : 1; m < (pass ? 2 : 1); ++m) {  // S, then P
          const bool of_s = m == 0;
          add_rows<T>((of_s ? band.s_sums : band.p_sums) + j, cols,
                      (of_s ? task.s + g0 * s.row_stride : task.p + g0 * cols) + j,
                      of_s ? s.row_stride : cols, group, weight);
        }
      }
    }

    const ScreenMatrix<float> col_screen =
        s_cols ? side_matrix<float>(k.screen, col_side, task.b) : ScreenMatrix<float>{};
    for (int64_t j = threadIdx.x * kVec; j < cols; j += kThreads * kVec) {  // its own columns
#pragma unroll 1
      for (int e = 0; e < kVec; ++e) {
        fails += band.out(k, task.b, task.blk, j + e, col_side, col_screen);
      }
    }
    band_flagged(k, task.b, task.blk, fails, band_fails);
  }
}

// Whether softmax_rows_kernel takes k (with P's pass pr where `pass`): 2- and 4-byte elements;
// S's rows in vectors, each within kRowSlots vectors a lane; S's row blocks, where screened,
// whole slots; a mask, if any, read a word at a time (its rows contiguous and 4-byte aligned);
// and P's pass, if any, of two vectors u and one z (V's columns in one block), read in vectors.
template <typename T>
bool softmax_rows_take(const SoftmaxCheck& k, const RowProducts& pr, bool pass, int row_side) {
  static_assert(sizeof(T) <= 4, "2- and 4-byte elements");
  const int d = k.s.batch_dims;
  if (!matrix_in_vectors(k.s, sizeof(T)) || k.s.cols > kRowSpan * kRowSlots<T>) return false;
  if (row_side >= 0 && k.s_sums.row_block % kRowSpan != 0) return false;
  if (k.mask != nullptr) {
    if (k.mask_strides[d + 1] != 1 || reinterpret_cast<uintptr_t>(k.mask) % 4 != 0) return false;
    for (int t = 0; t <= d; ++t) {
      if (k.mask_strides[t] % 4 != 0) return false;
    }
  }
  return !pass || (pr.u.rows == 2 && pr.z.rows == 1 && products_in_vectors<T>(k.s, pr));
}

// S's column and row sides in softmax_check's screen (-1: none), or false where a side of the
// screen is neither, or its slots are not one a band (tile_sides over softmax_bands).
bool band_sides(const SoftmaxCheck& k, int& col_side, int& row_side) {
  if (k.screen.sides == 0) return true;
  return tile_sides(k.screen, k.s_sums, softmax_bands(k), col_side, row_side) &&
         (col_side < 0 || k.s_sums.col_block == k.band);
}

// Lets `kernel` launch with `bytes` of dynamic shared memory (the default limit is 48 KiB).
template <typename Kernel>
int allow_shared(Kernel kernel, int64_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

template <typename T, typename Acc>
int launch_softmax_pass(const SoftmaxCheck& k, cudaStream_t stream) {
  const int64_t tasks = softmax_check_tasks(k);
  if (tasks == 0) return cudaSuccess;
  int col_side = -1, row_side = -1;
  if (!band_sides(k, col_side, row_side)) return cudaErrorInvalidValue;
  const bool pass = k.products != nullptr;
  const RowProducts pr = pass ? *k.products : RowProducts{};
  const int64_t bytes = softmax_pass_bytes(k.s.cols, k.s.dtype, col_side >= 0, pass);
  const unsigned grid = unsigned(min64(tasks, 0x7fffffff));
  if constexpr (sizeof(T) <= 4) {
    if (softmax_rows_take<T>(k, pr, pass, row_side)) {
      const int error = allow_shared(softmax_rows_kernel<T>, bytes);
      if (error != cudaSuccess) return error;
      ABFT_LAUNCH(grid, kThreads, size_t(bytes), stream, softmax_rows_kernel<T>)
      (k, pr, pass, tasks, col_side, row_side);
      return cudaGetLastError();
    }
  }
  const int error = allow_shared(softmax_pass_kernel<T, Acc>, bytes);
  if (error != cudaSuccess) return error;
  ABFT_LAUNCH(grid, kThreads, size_t(bytes), stream, softmax_pass_kernel<T, Acc>)
  (k, pr, pass, tasks, col_side, row_side);
  return cudaGetLastError();
}

// Matrix b's rows of P, and where `pass` P's checksum pass, redone from S by the whole thread
// block: a warp per row (write_p_row), then, once they are written, a thread per column of each
// band for P's column block sums.
template <typename T, typename Acc>
__device__ void redo_matrix(const SoftmaxCheck& k, const RowProducts& pr, bool pass, int64_t b) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = k.s.rows, cols = k.s.cols, bands = ceil_div(rows, k.band);
  for (int64_t i = threadIdx.x >> 5; i < rows; i += blockDim.x >> 5) {
    write_p_row<T, Acc>(k, pr, pass, SoftmaxRow<T, Acc>(k, b, i, lane), b, i, lane);
  }
  __syncthreads();  // P's rows are written
  if (pass) {
    const T* p = static_cast<const T*>(k.p) + b * rows * cols;
    for (int64_t blk = 0; blk < bands; ++blk) {
      const int64_t r0 = blk * k.band, r1 = min64(rows, r0 + k.band);
      for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
        Acc sums[4] = {0, 0, 0, 0};
        for (int64_t r = r0; r < r1; ++r) {
          add_to_sums(sums, Acc(load(p + r * cols + j)), Acc(r - r0 + 1));
        }
        write_sums(k.p_sums.col_sums, k.p_sums.col_sizes, (b * bands + blk) * 2 * cols + j, cols,
                   sums);
      }
    }
  }
  __syncthreads();
}

// redo_matrix for S's element type, which accumulates in Acc.
template <typename Acc>
__device__ void redo_matrix_of(const SoftmaxCheck& k, const RowProducts& pr, bool pass,
                               int64_t b) {
  if constexpr (std::is_same_v<Acc, double>) {
    redo_matrix<double, double>(k, pr, pass, b);
  } else if (k.s.dtype == DType::BF16) {
    redo_matrix<__nv_bfloat16, float>(k, pr, pass, b);
  } else if (k.s.dtype == DType::F16) {
    redo_matrix<__half, float>(k, pr, pass, b);
  } else {
    redo_matrix<float, float>(k, pr, pass, b);
  }
}

}  // namespace
}  // namespace abft
