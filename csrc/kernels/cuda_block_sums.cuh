// The block sums kernels (abft.h's block_sums) and their launchers by element type.
//
// One thread block owns one tile of one matrix: a block of the column side (rows) by a block of
// the row side (columns), so every output has one writer and the sums are deterministic. Where
// the rows are contiguous and aligned, each thread reads four elements of a row at once and a
// warp owns whole rows: the row sums reduce across the warp by shuffles, the column sums across
// the block's warps in shared memory. Elsewhere each thread walks one column of the tile, keeping
// its column sums in registers, and each row's sums are reduced across a warp by shuffles and
// across the block's warps in shared memory. A tile completes the vectors it covers, so it can
// screen them at once, in the same launch.
#pragma once

#include "kernels/cuda_common.cuh"

namespace abft {
namespace {

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

}  // namespace
}  // namespace abft
