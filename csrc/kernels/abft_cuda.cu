// CUDA kernels for the checksums of abft.h. No torch headers: this file compiles in about a
// second, and only through intrinsics for fp16/bf16, so that torch's __CUDA_NO_HALF_* flags hold.
//
// One thread block owns one tile of one matrix: a block of the column side (rows) by a block of
// the row side (columns), so every output has one writer and the sums are deterministic. Where
// the rows are contiguous and aligned, each thread reads four elements of a row at once and a
// warp owns whole rows: the row sums reduce across the warp by shuffles, the column sums across
// the block's warps in shared memory. Elsewhere each thread walks one column of the tile, keeping
// its column sums in registers, and each row's sums are reduced across a warp by shuffles and
// across the block's warps in shared memory. A tile completes the vectors it covers, so it can
// screen them at once, in the same launch.
#ifndef ABFT_CUDA_EMULATOR  // nvcc; cuda_emulator_cuda.h defines these for the CPU's build
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

// kernel<<<grid, block, shared, stream>>>(...), written so that the emulator can launch it too
#define ABFT_LAUNCH(grid, block, shared, stream, ...) __VA_ARGS__<<<grid, block, shared, stream>>>
#define ABFT_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#define ABFT_LAUNCHERS cuda_launchers
#endif

#include <cstring>
#include <type_traits>

#include "kernels/abft.h"
#include "kernels/abft_correct.h"

namespace abft {
namespace {

constexpr int kThreads = 256;  // columns per pass over a tile: one per thread
constexpr int kWarps = kThreads / 32;
static_assert(kCudaTileCols == kThreads, "a tile with an unchecked row side is one pass wide");
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ double load(const double* p) { return *p; }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }

__device__ __forceinline__ float magnitude(float x) { return fabsf(x); }
__device__ __forceinline__ double magnitude(double x) { return fabs(x); }

// Four consecutive elements of a row, the unit block_sums_tile_vectors reads: 8 bytes of fp16
// or bf16, 16 of fp32 (eight 2-byte elements a thread would hold more sums than its registers).
constexpr int kVec = 4;
#ifdef ABFT_CUDA_EMULATOR
struct alignas(8) Bytes8 {
  uint32_t x, y;
};
struct alignas(16) Bytes16 {
  uint32_t x, y, z, w;
};
#else
using Bytes8 = uint2;
using Bytes16 = uint4;
#endif
template <typename T>
using VectorBits = typename std::conditional<sizeof(T) == 2, Bytes8, Bytes16>::type;

// The kVec elements at p (aligned to their size) in one load, as floats.
// kVec elements of T as one load's bits, and as floats.
template <typename T>
__device__ __forceinline__ void unpack_vector(const VectorBits<T>& bits, float (&v)[kVec]) {
  static_assert(kVec * sizeof(T) == sizeof(VectorBits<T>), "one load");
  T raw[kVec];
  memcpy(raw, &bits, sizeof(bits));  // not a cast of &bits: that breaks strict aliasing
#pragma unroll
  for (int k = 0; k < kVec; ++k) v[k] = load(raw + k);
}

template <typename T>
__device__ __forceinline__ void load_vector(const T* p, float (&v)[kVec]) {
  const VectorBits<T> bits = *reinterpret_cast<const VectorBits<T>*>(p);  // one load
  unpack_vector<T>(bits, v);
}

// Whether m's rows can be read kVec elements at a time: rows contiguous, and every matrix's rows
// and vectors starting on a vector's boundary (elements of `element` bytes).
inline bool matrix_in_vectors(const MatrixBatch& m, size_t element) {
  if (m.col_stride != 1 || m.cols % kVec != 0 || m.row_stride % kVec != 0 ||
      reinterpret_cast<uintptr_t>(m.data) % (kVec * element) != 0) {
    return false;
  }
  for (int d = 0; d < m.batch_dims; ++d) {
    if (m.batch_sizes[d] > 1 && m.batch_strides[d] % kVec != 0) return false;
  }
  return true;
}

// Whether the tiles of c can be read kVec elements at a time: 2- and 4-byte elements, c's rows
// in vectors (matrix_in_vectors), and so its tiles. The launchers decide, so that each path is a
// kernel of its own, with registers of its own.
template <typename T>
bool rows_in_vectors(const MatrixBatch& c, const Tiling& tiling) {
  return sizeof(T) <= 4 && tiling.width % kVec == 0 && matrix_in_vectors(c, sizeof(T));
}

// Side `side` (0 or 1) of s at matrix b (screen_matrix), each side indexed by a constant, so
// that it stays in the parameter space. Its batch offsets take a division a batch dim: a kernel
// that screens many vectors of one matrix finds them once.
template <typename Acc>
__device__ __forceinline__ ScreenMatrix<Acc> side_matrix(const Screen& s, int side, int64_t b) {
  return side == 0 ? screen_matrix<Acc>(s, s.side[0], b) : screen_matrix<Acc>(s, s.side[1], b);
}

// Whether vector j of block blk of x (side_matrix's, of the same side) fails the screen.
template <typename Acc>
__device__ __forceinline__ int side_fails(const Screen& s, int side, const ScreenMatrix<Acc>& x,
                                          int64_t blk, int64_t j) {
  return side == 0 ? screen_flags<Acc>(s, s.side[0], x, blk, j)
                   : screen_flags<Acc>(s, s.side[1], x, blk, j);
}

// A screened tile's start: thread 0 finds the tile's matrix b on each screened side (col_side,
// row_side: -1 for none) into screens (column side first) and zeroes the tile's count of failed
// vectors. A screen then reads its matrix from shared memory: its batch offsets take a division
// a batch dim, found once a tile rather than once a screened vector, and held there rather than
// in the sums' registers.
template <typename Acc>
__device__ __forceinline__ void start_screens(const Screen& s, int64_t b, int col_side,
                                              int row_side, ScreenMatrix<Acc> (&screens)[2],
                                              int& tile_fails) {
  if (threadIdx.x == 0) {
    if (col_side >= 0) screens[0] = side_matrix<Acc>(s, col_side, b);
    if (row_side >= 0) screens[1] = side_matrix<Acc>(s, row_side, b);
    tile_fails = 0;
  }
  __syncthreads();
}

// A warp's staging of four rows' sums in shared memory (both walks of block_sums): each lane puts
// its shares of a row's four sums (put, row q of the quad), and two lanes then add up each of the
// quad's sixteen sums over the 32 lanes (reduce, into totals[q][k]: lanes 2(4q + k) and
// 2(4q + k) + 1 add up lanes 0-15 and 16-31, then add each other's). Sum (q, k) is a segment of
// kQuadSegment values, 32 and four of padding, so that neither the writes (a lane a value) nor
// the reads (a lane four vectors of four) of a warp meet on a bank: every address is a lane's
// base plus a constant.
constexpr int kQuadSegment = 36;
constexpr int kQuadStage = 16 * kQuadSegment;  // values a warp stages

struct QuadStage {
  int lane;

  template <typename Acc>
  __device__ __forceinline__ void put(Acc* stage, int q, const Acc (&t)[4]) const {
#pragma unroll
    for (int k = 0; k < 4; ++k) stage[(4 * q + k) * kQuadSegment + lane] = t[k];
  }

  // The quad's sums into totals ([4][4]: by row of the quad, then sum), once every lane put them.
  template <typename Acc>
  __device__ __forceinline__ void reduce(const Acc* stage, Acc* totals) const {
    __syncwarp();
    const Acc* at = stage + (lane >> 1) * kQuadSegment + 16 * (lane & 1);
    Acc total = Acc(0);
#pragma unroll
    for (int e = 0; e < 16; ++e) total += at[e];
    total += __shfl_xor_sync(kFullMask, total, 1);
    if ((lane & 1) == 0) totals[lane >> 1] = total;
    __syncwarp();  // read before the next quad's puts
  }
};

// Column j's four block sums (the plain and weighted sums and sizes) of row tile rt, matrix b.
template <typename Acc>
__device__ __forceinline__ void write_column(const BlockSums& out, const MatrixBatch& c,
                                             int64_t b, int64_t rt, int64_t row_tiles, int64_t j,
                                             Acc s0, Acc s1, Acc z0, Acc z1) {
  const int64_t at = (b * row_tiles + rt) * 2 * c.cols + j;
  Acc* sums = static_cast<Acc*>(out.col_sums);
  Acc* sizes = static_cast<Acc*>(out.col_sizes);
  sums[at] = s0;
  sums[at + c.cols] = s1;
  sizes[at] = z0;
  sizes[at + c.cols] = z1;
}

// Row i's four block sums of column block cb, matrix b, from this pass's `t`: added to what the
// tile's earlier passes over the block wrote (later: one did).
template <typename Acc>
__device__ __forceinline__ void write_row(const BlockSums& out, const MatrixBatch& c, int64_t b,
                                          int64_t nbr, int64_t cb, int64_t i, const Acc (&t)[4],
                                          bool later) {
  const int64_t at = (b * nbr + cb) * 2 * c.rows + i;
  Acc* sums = static_cast<Acc*>(out.row_sums);
  Acc* sizes = static_cast<Acc*>(out.row_sizes);
  Acc total[4] = {t[0], t[1], t[2], t[3]};
  if (later) {
    total[0] += sums[at];
    total[1] += sums[at + c.rows];
    total[2] += sizes[at];
    total[3] += sizes[at + c.rows];
  }
  sums[at] = total[0];
  sums[at + c.rows] = total[1];
  sizes[at] = total[2];
  sizes[at + c.rows] = total[3];
}

// block_sums_tile where rows_in_vectors: a thread reads kVec consecutive columns of a row in one
// load, and a warp owns whole rows (every warps-th of the tile). Each warp keeps its columns' sums
// over its rows in registers; once a group of columns is done the block adds the warps' sums, in
// warp order, in shared memory. A row's four sums are spread over the warp's lanes, and meet in
// shared memory four rows at a time (QuadStage), in fewer instructions than a reduction by
// shuffles takes for each row. The same outputs and screen as the column-per-thread walk
// (block_sums_tile_columns), summed in another fixed order.
template <typename T, typename Acc, bool Screened>
__device__ __forceinline__ void block_sums_tile_vectors(const MatrixBatch& c,
                                                        const BlockSums& out,
                                                        const Tiling& tiling, int64_t tile,
                                                        const Screen& s, int col_side,
                                                        int row_side) {
  constexpr int kGroup = 32 * kVec;  // the columns a warp reads of a row at once
  // per warp: its sums of the group's columns (4 x kGroup); before that, in the row loop, the
  // lanes' shares of a quad of rows' sums (QuadStage)
  constexpr int kPart = 4 * kGroup > kQuadStage ? 4 * kGroup : kQuadStage;
  __align__(16) __shared__ Acc part[kWarps][kPart];
  __shared__ Acc row_totals[kWarps][32][4];  // per warp: the four sums of a chunk's rows
  __shared__ int tile_fails;
  __shared__ ScreenMatrix<Acc> screens[2];  // the tile's matrix on each screened side
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const bool cols_checked = out.col_block > 0, rows_checked = out.row_block > 0;
  const int64_t row_tiles = tiling.row_tiles, col_tiles = tiling.col_tiles;
  const int64_t nbr = rows_checked ? ceil_div(c.cols, out.row_block) : 0;
  const int64_t ct = tile % col_tiles, rt = (tile / col_tiles) % row_tiles;
  const int64_t b = tile / (col_tiles * row_tiles);
  const int64_t r0 = rt * tiling.height, r1 = min64(c.rows, r0 + tiling.height);
  const int64_t c0 = ct * tiling.width, c1 = min64(c.cols, c0 + tiling.width);
  const T* base = static_cast<const T*>(c.data) + batch_offset(c, b);
  const int64_t step = int64_t(warps) * c.row_stride;  // from a warp's row to its next
  Acc* const stage = part[warp];
  const QuadStage quad{lane};
  int fails = 0;  // this thread's failed vectors of the tile
  if (Screened) start_screens<Acc>(s, b, col_side, row_side, screens, tile_fails);
  for (int64_t g = c0; g < c1; g += kGroup) {  // one pass per group of columns
    const int64_t j0 = g + lane * kVec;
    const bool valid = j0 < c1;  // whole vectors: c1 and j0 are multiples of kVec
    const bool last_pass = g + kGroup >= c1;
    Acc s0[kVec], s1[kVec], z0[kVec], z1[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) s0[k] = s1[k] = z0[k] = z1[k] = Acc(0);
    Acc wj[kVec];  // the row side's weights of this thread's columns
#pragma unroll
    for (int k = 0; k < kVec; ++k) wj[k] = Acc(j0 - c0 + 1 + k);
    // this warp's rows (every warps-th) by chunks of 32, four at a time; then lane r writes and
    // screens the chunk's r-th row
    for (int64_t i0 = r0 + warp; i0 < r1; i0 += 32 * int64_t(warps)) {
      const int n = int(min64(32, ceil_div(r1 - i0, warps)));
      // row r's vector (zeros past the tile's columns or the chunk's rows), loaded rows ahead of
      // its sums: four buffers, each reloaded with the row four on once its row is summed, so
      // that three rows' loads are in flight while a row is summed (where each row was loaded
      // as it was summed, a warp waited out every load's latency). The rows are fetched in
      // order, through a pointer stepped a row at a time.
      const T* next = base + i0 * c.row_stride + j0;
      int fetched = 0;
      auto fetch = [&]() {
        VectorBits<T> bits{};
        if (valid && fetched < n) bits = *reinterpret_cast<const VectorBits<T>*>(next);
        next += step;
        ++fetched;
        return bits;
      };
      // row r's weight on the column side, i0 + r * warps - r0 + 1, a float stepped by warps
      // (exact while a tile has fewer than 2^24 rows: ABFTConfig.block_size is at most 65536)
      Acc wi = Acc(i0 - r0 + 1);
      const Acc wstep = Acc(warps);
      auto sum_row = [&](const VectorBits<T>& bits, int q) {
        float v[kVec];
        unpack_vector<T>(bits, v);
        const Acc x0 = Acc(v[0]), a0 = magnitude(x0);
        Acc t[4] = {x0, wj[0] * x0, a0, wj[0] * a0};  // this thread's share of the row's sums
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const Acc x = Acc(v[k]), a = magnitude(x);
          s0[k] += x;
          s1[k] += wi * x;
          z0[k] += a;
          z1[k] += wi * a;
          if (k > 0) {
            t[0] += x;
            t[1] += wj[k] * x;
            t[2] += a;
            t[3] += wj[k] * a;
          }
        }
        wi += wstep;
        if (rows_checked) quad.put(stage, q, t);
      };
      VectorBits<T> row0 = fetch(), row1 = fetch(), row2 = fetch(), row3 = fetch();
#pragma unroll 1
      for (int r = 0; r < n; r += 4) {  // rows past n read zeros, and their sums are not kept
        sum_row(row0, 0);
        row0 = fetch();
        sum_row(row1, 1);
        row1 = fetch();
        sum_row(row2, 2);
        row2 = fetch();
        sum_row(row3, 3);
        row3 = fetch();
        if (rows_checked) quad.reduce(stage, &row_totals[warp][r][0]);
      }
      if (rows_checked) {
        __syncwarp();  // the quads' totals, from the lanes that added them up
        if (lane < n) {
          const int64_t i = i0 + int64_t(lane) * warps;
          Acc mine[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) mine[k] = row_totals[warp][lane][k];
          write_row<Acc>(out, c, b, nbr, c0 / out.row_block, i, mine, g != c0);
          if (Screened && row_side >= 0 && last_pass) {
            fails += side_fails<Acc>(s, row_side, screens[1], ct, i);
          }
        }
        __syncwarp();  // row_totals read before the next chunk writes them
      }
    }
    if (cols_checked) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        part[warp][0 * kGroup + lane * kVec + k] = s0[k];
        part[warp][1 * kGroup + lane * kVec + k] = s1[k];
        part[warp][2 * kGroup + lane * kVec + k] = z0[k];
        part[warp][3 * kGroup + lane * kVec + k] = z1[k];
      }
      __syncthreads();
      for (int col = threadIdx.x; col < kGroup; col += blockDim.x) {
        const int64_t j = g + col;
        if (j < c1) {
          Acc total[4] = {0, 0, 0, 0};
          for (int w = 0; w < warps; ++w) {
#pragma unroll
            for (int k = 0; k < 4; ++k) total[k] += part[w][k * kGroup + col];
          }
          write_column<Acc>(out, c, b, rt, row_tiles, j, total[0], total[1], total[2], total[3]);
          if (Screened && col_side >= 0) fails += side_fails<Acc>(s, col_side, screens[0], rt, j);
        }
      }
      __syncthreads();
    }
  }
  if (Screened) {
    if (fails > 0) atomicAdd(&tile_fails, fails);
    __syncthreads();
    if (threadIdx.x == 0) s.flagged[b * s.slots + rt * col_tiles + ct] = tile_fails;
  }
}

// block_sums_tile where the rows are not read in vectors: each thread walks a column, a warp's
// lanes holding 32 consecutive elements of a row. A row's four sums meet across the warp in
// shared memory four rows at a time (QuadStage), then across the warps.
template <typename T, typename Acc, bool Screened>
__device__ __forceinline__ void block_sums_tile_columns(const MatrixBatch& c,
                                                        const BlockSums& out,
                                                        const Tiling& tiling, int64_t tile,
                                                        const Screen& s, int col_side,
                                                        int row_side) {
  __shared__ Acc part[kWarps][32][4];  // per warp, per row of a chunk: the warp's row sums
  __align__(16) __shared__ Acc staged[kWarps][kQuadStage];  // per warp: a quad's shares
  __shared__ int tile_fails;
  __shared__ ScreenMatrix<Acc> screens[2];  // the tile's matrix on each screened side
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const bool cols_checked = out.col_block > 0, rows_checked = out.row_block > 0;
  const int64_t height = tiling.height, width = tiling.width;
  const int64_t row_tiles = tiling.row_tiles, col_tiles = tiling.col_tiles;
  const int64_t nbr = rows_checked ? ceil_div(c.cols, out.row_block) : 0;
  const QuadStage quad{lane};
  {
    const int64_t ct = tile % col_tiles, rt = (tile / col_tiles) % row_tiles;
    const int64_t b = tile / (col_tiles * row_tiles);
    const int64_t r0 = rt * height, r1 = min64(c.rows, r0 + height);
    const int64_t c0 = ct * width, c1 = min64(c.cols, c0 + width);
    const T* base = static_cast<const T*>(c.data) + batch_offset(c, b);
    int fails = 0;  // this thread's failed vectors of the tile
    if (Screened) start_screens<Acc>(s, b, col_side, row_side, screens, tile_fails);

    for (int64_t g = c0; g < c1; g += blockDim.x) {  // one pass per group of columns
      const int64_t j = g + threadIdx.x;
      const bool valid = j < c1, last_pass = g + blockDim.x >= c1;
      const T* column = base + (valid ? j : c0) * c.col_stride;
      const Acc wj = Acc(j - c0 + 1);
      Acc s0 = 0, s1 = 0, z0 = 0, z1 = 0;
      const T* next = column + r0 * c.row_stride;  // the rows in order, a pointer stepped
      Acc wi = Acc(1);  // row i's weight on the column side, i - r0 + 1, a float stepped
      for (int64_t q0 = r0; q0 < r1; q0 += 32) {  // chunks of 32 rows
        const int n = int(min64(32, r1 - q0));
#pragma unroll 1
        for (int r = 0; r < n; r += 4) {  // rows past n read zeros, and their sums are not kept
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const Acc v = valid && r + q < n ? Acc(load(next)) : Acc(0);
            const Acc a = magnitude(v);
            next += c.row_stride;
            s0 += v;
            s1 += wi * v;
            z0 += a;
            z1 += wi * a;
            wi += Acc(1);
            if (rows_checked) {
              const Acc t[4] = {v, wj * v, a, wj * a};
              quad.put(staged[warp], q, t);
            }
          }
          if (rows_checked) quad.reduce(staged[warp], &part[warp][r][0]);
        }
        if (rows_checked) {
          __syncthreads();  // every warp's sums of the chunk's rows
          if (warp == 0 && lane < n) {
            Acc total[4] = {0, 0, 0, 0};
            for (int w = 0; w < warps; ++w) {
#pragma unroll
              for (int k = 0; k < 4; ++k) total[k] += part[w][lane][k];
            }
            write_row<Acc>(out, c, b, nbr, c0 / out.row_block, q0 + lane, total, g != c0);
            if (Screened && row_side >= 0 && last_pass) {
              fails += side_fails<Acc>(s, row_side, screens[1], ct, q0 + lane);
            }
          }
          __syncthreads();
        }
      }
      if (cols_checked && valid) {
        write_column<Acc>(out, c, b, rt, row_tiles, j, s0, s1, z0, z1);
        if (Screened && col_side >= 0) fails += side_fails<Acc>(s, col_side, screens[0], rt, j);
      }
    }
    if (Screened) {
      if (fails > 0) atomicAdd(&tile_fails, fails);
      __syncthreads();
      if (threadIdx.x == 0) s.flagged[b * s.slots + rt * col_tiles + ct] = tile_fails;
    }
  }
}

// One tile of block_sums, by the whole thread block (any multiple of 32 threads up to kThreads),
// and where Screened the screen of the vectors the tile completes, read back by the thread that
// wrote them: col_side and row_side say which side of s the tile's columns and rows are (-1: not
// screened). A template parameter, so that the plain sums keep their registers. Where the rows
// are read in vectors (Vectors: rows_in_vectors), block_sums_tile_vectors; else each thread walks
// a column.
template <typename T, typename Acc, bool Screened, bool Vectors>
__device__ __forceinline__ void block_sums_tile(const MatrixBatch& c, const BlockSums& out,
                                                const Tiling& tiling, int64_t tile,
                                                const Screen& s, int col_side, int row_side) {
  if constexpr (Vectors) {
    block_sums_tile_vectors<T, Acc, Screened>(c, out, tiling, tile, s, col_side, row_side);
  } else {
    block_sums_tile_columns<T, Acc, Screened>(c, out, tiling, tile, s, col_side, row_side);
  }
}

template <typename T, typename Acc, bool Screened, bool Vectors>
__global__ void __launch_bounds__(kThreads, 3)
    block_sums_kernel(MatrixBatch c, BlockSums out, Tiling tiling, int64_t tiles, Screen s,
                      int col_side, int row_side) {
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    block_sums_tile<T, Acc, Screened, Vectors>(c, out, tiling, tile, s, col_side, row_side);
  }
}

// The block sums (unscreened) of one batch of matrices, as a job of a paired launch.
struct BlockSumsJob {
  MatrixBatch c;
  BlockSums out;
  Tiling tiling;
  int64_t tiles;
};

BlockSumsJob block_sums_job(const MatrixBatch& c, const BlockSums& out) {
  const Tiling tiling = block_sums_tiling(c, out);
  return {c, out, tiling, c.batch * tiling.row_tiles * tiling.col_tiles};
}

// The threads a launch of block sums takes: one a column of the widest tile, in whole warps.
int64_t block_sums_threads(const BlockSumsJob& job) {
  return min64(kThreads, ceil_div(min64(job.tiling.width, job.c.cols), 32) * 32);
}

// Two jobs' block sums in one launch: the tiles of the first, then those of the second, each
// read in vectors or not (First, Second: rows_in_vectors).
template <typename T, typename Acc, bool First, bool Second>
__global__ void __launch_bounds__(kThreads, 3)
    block_sums_pair_kernel(BlockSumsJob first, BlockSumsJob second, Screen none) {
  for (int64_t tile = blockIdx.x; tile < first.tiles + second.tiles; tile += gridDim.x) {
    if (tile < first.tiles) {
      block_sums_tile<T, Acc, false, First>(first.c, first.out, first.tiling, tile, none, -1, -1);
    } else {
      block_sums_tile<T, Acc, false, Second>(second.c, second.out, second.tiling,
                                             tile - first.tiles, none, -1, -1);
    }
  }
}

// The sides of `screen` that are out's column and row sides (-1: none), or false where a side of
// the screen is neither, or its slots are not one a tile.
bool tile_sides(const Screen& screen, const BlockSums& out, const Tiling& tiling, int& col_side,
                int& row_side) {
  for (int k = 0; k < screen.sides; ++k) {
    if (out.col_block > 0 && screen.side[k].sums == out.col_sums) col_side = k;
    if (out.row_block > 0 && screen.side[k].sums == out.row_sums) row_side = k;
  }
  return int(col_side >= 0) + int(row_side >= 0) == screen.sides &&
         screen.slots == tiling.row_tiles * tiling.col_tiles;
}

// block_sums_kernel on one path (Vectors: rows_in_vectors), screened or not.
template <typename T, typename Acc, bool Vectors>
int launch_path(unsigned grid, int threads, cudaStream_t stream, bool screened,
                const MatrixBatch& c, const BlockSums& out, const Tiling& tiling, int64_t tiles,
                const Screen& s, int col_side, int row_side) {
  if (screened) {
    ABFT_LAUNCH(grid, threads, 0, stream, block_sums_kernel<T, Acc, true, Vectors>)
    (c, out, tiling, tiles, s, col_side, row_side);
  } else {
    ABFT_LAUNCH(grid, threads, 0, stream, block_sums_kernel<T, Acc, false, Vectors>)
    (c, out, tiling, tiles, s, col_side, row_side);
  }
  return cudaGetLastError();
}

template <typename T, typename Acc>
int launch(const MatrixBatch& c, const BlockSums& out, const Screen* screen, cudaStream_t stream) {
  const BlockSumsJob job = block_sums_job(c, out);
  const Tiling& tiling = job.tiling;
  const int64_t tiles = job.tiles;
  if (tiles == 0) return cudaSuccess;
  Screen s{};
  int col_side = -1, row_side = -1;
  if (screen != nullptr) {
    s = *screen;
    if (!tile_sides(s, out, tiling, col_side, row_side)) return cudaErrorInvalidValue;
  }
  const int threads = int(block_sums_threads(job));
  const unsigned grid = unsigned(min64(tiles, 0x7fffffff));
  const bool screened = screen != nullptr;
  if constexpr (sizeof(T) <= 4) {
    if (rows_in_vectors<T>(c, tiling)) {
      return launch_path<T, Acc, true>(grid, threads, stream, screened, c, out, tiling, tiles, s,
                                       col_side, row_side);
    }
  }
  return launch_path<T, Acc, false>(grid, threads, stream, screened, c, out, tiling, tiles, s,
                                    col_side, row_side);
}

template <typename T, typename Acc>
int launch_pair(const BlockSumsJob& first, const BlockSumsJob& second, cudaStream_t stream) {
  const int64_t tiles = first.tiles + second.tiles;
  if (tiles == 0) return cudaSuccess;
  const int64_t wide = block_sums_threads(first), other = block_sums_threads(second);
  const int threads = int(wide > other ? wide : other);
  const unsigned grid = unsigned(min64(tiles, 0x7fffffff));
  if constexpr (sizeof(T) <= 4) {
    const bool a = rows_in_vectors<T>(first.c, first.tiling);
    const bool b = rows_in_vectors<T>(second.c, second.tiling);
    if (a && b) {
      ABFT_LAUNCH(grid, threads, 0, stream, block_sums_pair_kernel<T, Acc, true, true>)
      (first, second, Screen{});
      return cudaGetLastError();
    }
    if (a || b) {
      if (a) {
        ABFT_LAUNCH(grid, threads, 0, stream, block_sums_pair_kernel<T, Acc, true, false>)
        (first, second, Screen{});
      } else {
        ABFT_LAUNCH(grid, threads, 0, stream, block_sums_pair_kernel<T, Acc, false, true>)
        (first, second, Screen{});
      }
      return cudaGetLastError();
    }
  }
  ABFT_LAUNCH(grid, threads, 0, stream, block_sums_pair_kernel<T, Acc, false, false>)
  (first, second, Screen{});
  return cudaGetLastError();
}

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

// The correction of matrix b by one thread (a clean one returns at once).
template <typename Acc>
__device__ __forceinline__ void correct_matrix(const Correct& k, int64_t b) {
  Corrector<Acc>(k, b).run();
}

// correct: one thread per matrix.
template <typename Acc>
__global__ void correct_kernel(Correct k) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < k.screen.batch) correct_matrix<Acc>(k, b);
}

// tally by one thread block: counts in shared memory, the worst matrix by an atomic max of its
// rank.
__device__ void tally_block(const Tally& t) {
  __shared__ int counts[3 * kMaxKinds];
  __shared__ unsigned long long worst;
  for (int i = threadIdx.x; i < 3 * kMaxKinds; i += blockDim.x) counts[i] = 0;
  if (threadIdx.x == 0) worst = 0;
  __syncthreads();
  unsigned long long mine = 0;
  for (int64_t b = threadIdx.x; b < t.batch; b += blockDim.x) {
    const int8_t status = t.status[b], kind = t.kind[b];
    const unsigned long long rank = tally_rank(status, b);
    mine = rank > mine ? rank : mine;
    if (status < 1 || status > 2 || kind < 0 || kind >= t.kinds) continue;
    atomicAdd(counts + kind, 1);
    atomicAdd(counts + status * t.kinds + kind, 1);
  }
  atomicMax(&worst, mine);
  __syncthreads();
  for (int i = threadIdx.x; i < 3 * t.kinds; i += blockDim.x) t.counts[i] += counts[i];
  if (threadIdx.x == 0) tally_event(t, tally_matrix(worst));
}

__global__ void __launch_bounds__(kThreads) tally_kernel(Tally t) { tally_block(t); }

// add_bias: one thread per item; a row item sums its block of the bias itself (a block of a
// vector, from the cache), so that the items are independent.
template <typename Acc>
__global__ void __launch_bounds__(kThreads) bias_terms_kernel(BiasTerms t, int64_t items) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x, columns = bias_column_items(t);
  for (int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; item < items; item += step) {
    if (item < columns) {
      bias_column_term<Acc>(t, item);
    } else {
      const int64_t blk = (item - columns) / t.m, i = (item - columns) % t.m;
      bias_row_term<Acc>(t, blk, i, bias_block<Acc>(t, blk));
    }
  }
}

// Stores v rounded to the element type and returns the value stored.
__device__ __forceinline__ float store(float* p, float v) { return *p = v; }
__device__ __forceinline__ double store(double* p, double v) { return *p = v; }
__device__ __forceinline__ float store(__nv_bfloat16* p, float v) {
  const __nv_bfloat16 x = __float2bfloat16_rn(v);
  *p = x;
  return __bfloat162float(x);
}
__device__ __forceinline__ float store(__half* p, float v) {
  const __half x = __float2half_rn(v);
  *p = x;
  return __half2float(x);
}

__device__ __forceinline__ float exponential(float x) { return expf(x); }
__device__ __forceinline__ double exponential(double x) { return exp(x); }

template <typename Acc>
__device__ __forceinline__ Acc warp_max(Acc v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Acc other = __shfl_xor_sync(kFullMask, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

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

// correct, then tally what it found, in one launch: one thread block, a thread per matrix in
// turn (a clean matrix returns at once); once every matrix is settled, where `redo` is the
// softmax_check that read C as S (its p not null: correct_redo_tally_cuda), the block redoes
// P for each matrix corrected; then the tally. One instance an accumulation type (S's element
// type is read at run time): the correction is slow to compile.
template <typename Acc>
__global__ void __launch_bounds__(kThreads)
    correct_tally_kernel(Correct c, Tally t, SoftmaxCheck redo, RowProducts pr, bool pass) {
  for (int64_t b = threadIdx.x; b < c.screen.batch; b += blockDim.x) correct_matrix<Acc>(c, b);
  __syncthreads();  // every matrix's status written
  for (int64_t b = 0; redo.p != nullptr && b < c.screen.batch; ++b) {
    if (c.status[b] == 1) redo_matrix_of<Acc>(redo, pr, pass, b);  // one branch for all threads
  }
  tally_block(t);
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
