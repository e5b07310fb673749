// Locate and correct (abft.h's Correct): the algorithm of megatron_abft/check/eec.py with the
// GEMM's operands, for one matrix, shared by the C++ implementation (abft_cpu.cpp, one matrix per
// task) and the CUDA kernel (cuda_correct.cuh, one thread per matrix). Faults are rare and a clean
// matrix returns at once, so a serial walk over a flagged matrix costs nothing that matters.
//
// A matrix the screen flagged only by its tighter thresholds (abft.h, kScreenMargin) is clean.
// Otherwise the passes go over the column side, the row side, then the column side again (one
// pass with one side), as eec's do, and stop once the matrix checks clean (by the screen's
// thresholds). A pass settles the vectors flagged as found (but on the column side's second
// pass) and those the previous pass wrote into that do not check clean with half their
// thresholds to spare:
//   - the bad element is the single flagged vector of the other side that crosses it (flags as
//     the screen found them); with none, the weighted location round(d2/d1) - 1 of the
//     differences as found, where they are finite and it lies in the block, else the extreme
//     element (NaN counts as the largest), then the most suspect crossing vector (largest
//     |d1| / tau). Each is recomputed from the operands and kept if the vector then checks clean
//     with half its thresholds to spare;
//   - a flagged vector that two or more flagged vectors cross (several errors, more perhaps too
//     small to flag), or that no candidate makes clean, has its whole block recomputed from the
//     operands (if every recomputed value is finite).
// A pass settles at most `vectors` vectors (eec's max_corrections) and as many elements in whole
// blocks, per matrix (eec counts them per call). Every write is logged and updates the sums of
// the two vectors through it. A matrix that still fails the screen on either side afterwards, or
// that needed more, is put back bit for bit and reported unresolved: the caller's PyTorch path
// or its policy takes it from there.
#pragma once

#include <cmath>
#include <cstring>

#include "kernels/abft.h"

namespace abft {

ABFT_HD inline float float_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

ABFT_HD inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

ABFT_HD inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu,
                 mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return float_from_bits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact
    const float value = float(mantissa) * 5.9604644775390625e-8f;
    return sign ? -value : value;
  }
  return float_from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Round to nearest even, as torch converts.
ABFT_HD inline uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u);      // NaN
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);     // 65520 and up round to INF
  if (ax < 0x38800000u) {                                     // below 2^-14: subnormal
    const float scaled = float_from_bits(ax) * 16777216.0f;  // in units of 2^-24, exact
    return uint16_t(sign | uint32_t(rintf(scaled)));
  }
  uint32_t h = (((ax >> 23) - 112) << 10) | ((ax >> 13) & 0x3ffu);
  const uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves up the exponent
  return uint16_t(sign | h);
}

ABFT_HD inline uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

ABFT_HD inline int dtype_bytes(DType t) {
  return t == DType::F64 ? 8 : t == DType::F32 ? 4 : 2;
}

ABFT_HD inline double load_element(const void* data, DType t, int64_t at) {
  switch (t) {
    case DType::F32:
      return static_cast<const float*>(data)[at];
    case DType::F64:
      return static_cast<const double*>(data)[at];
    case DType::BF16:
      return float_from_bits(uint32_t(static_cast<const uint16_t*>(data)[at]) << 16);
    case DType::F16:
      return half_to_float(static_cast<const uint16_t*>(data)[at]);
  }
  return 0;
}

// a * b rounded once, never fused with a following addition into one rounding (as nvcc would
// contract a * b + c by default): the PyTorch path rounds the product and the sum each.
template <typename Acc>
ABFT_HD inline Acc rounded_product(Acc a, Acc b) {
#ifdef __CUDA_ARCH__
  if constexpr (sizeof(Acc) == sizeof(double)) {
    return __dmul_rn(a, b);
  } else {
    return __fmul_rn(a, b);
  }
#else
  return a * b;
#endif
}

// Column item `item` of add_bias (abft.h, BiasTerms): the term of one column and block of rows,
// each product rounded once as checksum._columns rounds it, added to every matrix's sums.
template <typename Acc>
ABFT_HD inline void bias_column_term(const BiasTerms& t, int64_t item) {
  const int64_t nb = ceil_div(t.m, t.block), blk = item / t.n, j = item % t.n;
  const Acc rows = Acc(min64(t.block, t.m - blk * t.block));
  const Acc x = Acc(load_element(t.bias, t.dtype, j * t.stride));
  const Acc sum = rounded_product(rows, x);
  const Acc weighted = rounded_product(rows * (rows + 1) / 2, x);
  const Acc size = rounded_product(rows, x < 0 ? -x : x);
  static_cast<Acc*>(t.col_bias)[item] = size;
  const int64_t *in = t.col_in_strides, *size_in = t.col_size_in_strides;
  for (int64_t b = 0; b < t.batch; ++b) {
    const int64_t at = (b * nb + blk) * 2 * t.n + j, size_at = (b * nb + blk) * t.n + j;
    const Acc* x = static_cast<const Acc*>(t.col_in) + b * in[0] + blk * in[1] + j * in[3];
    static_cast<Acc*>(t.col_out)[at] = x[0] + sum;
    static_cast<Acc*>(t.col_out)[at + t.n] = x[in[2]] + weighted;
    static_cast<Acc*>(t.col_size_out)[size_at] =
        static_cast<const Acc*>(t.col_size_in)[b * size_in[0] + blk * size_in[1] + j * size_in[2]] +
        size;
  }
}

// The bias's sums over block blk of its columns, in order: plain, weighted, magnitudes.
template <typename Acc>
struct BiasBlock {
  Acc sum, weighted, size;
};

template <typename Acc>
ABFT_HD inline BiasBlock<Acc> bias_block(const BiasTerms& t, int64_t blk) {
  const int64_t first = blk * t.block, length = min64(t.block, t.n - first);
  BiasBlock<Acc> s{0, 0, 0};
  for (int64_t p = 0; p < length; ++p) {
    const Acc x = Acc(load_element(t.bias, t.dtype, (first + p) * t.stride));
    s.sum += x;
    s.weighted += Acc(p + 1) * x;
    s.size += x < 0 ? -x : x;
  }
  return s;
}

// Row item (blk, i) of add_bias: block blk's sums `s` added to row i's, in every matrix.
template <typename Acc>
ABFT_HD inline void bias_row_term(const BiasTerms& t, int64_t blk, int64_t i,
                                  const BiasBlock<Acc>& s) {
  const int64_t nbr = ceil_div(t.n, t.block);
  if (i == 0) static_cast<Acc*>(t.row_bias)[blk] = s.size;
  const int64_t *in = t.row_in_strides, *size_in = t.row_size_in_strides;
  for (int64_t b = 0; b < t.batch; ++b) {
    const int64_t at = (b * nbr + blk) * 2 * t.m + i, size_at = (b * nbr + blk) * t.m + i;
    const Acc* x = static_cast<const Acc*>(t.row_in) + b * in[0] + blk * in[1] + i * in[3];
    static_cast<Acc*>(t.row_out)[at] = x[0] + s.sum;
    static_cast<Acc*>(t.row_out)[at + t.m] = x[in[2]] + s.weighted;
    static_cast<Acc*>(t.row_size_out)[size_at] =
        static_cast<const Acc*>(t.row_size_in)[b * size_in[0] + blk * size_in[1] + i * size_in[2]] +
        s.size;
  }
}

ABFT_HD inline uint64_t element_bits(const void* data, DType t, int64_t at) {
  uint64_t bits = 0;
  memcpy(&bits, static_cast<const char*>(data) + at * dtype_bytes(t), dtype_bytes(t));
  return bits;
}

ABFT_HD inline void set_element_bits(void* data, DType t, int64_t at, uint64_t bits) {
  memcpy(static_cast<char*>(data) + at * dtype_bytes(t), &bits, dtype_bytes(t));
}

// Stores an accumulation-type value (float, or double for F64) rounded to C's dtype.
template <typename Acc>
ABFT_HD inline void store_element(void* data, DType t, int64_t at, Acc value) {
  switch (t) {
    case DType::F32:
      static_cast<float*>(data)[at] = float(value);
      return;
    case DType::F64:
      static_cast<double*>(data)[at] = double(value);
      return;
    case DType::BF16:
      static_cast<uint16_t*>(data)[at] = float_to_bf16(float(value));
      return;
    case DType::F16:
      static_cast<uint16_t*>(data)[at] = float_to_half(float(value));
      return;
  }
}

ABFT_HD inline bool is_finite(double x) { return x - x == 0; }

template <typename Acc>
class Corrector {
 public:
  ABFT_HD Corrector(const Correct& k, int64_t b)
      : k_(k), b_(b), base_(batch_offset(k.c, b)), log_at_(k.log_at + b * k.capacity),
        log_bits_(k.log_bits + b * k.capacity) {}

  ABFT_HD void run() {
    Acc* magnitude = static_cast<Acc*>(k_.magnitude) + b_;
    k_.status[b_] = 0;
    k_.kind[b_] = 0;
    k_.row[b_] = k_.col[b_] = -1;
    *magnitude = 0;
    if (flagged_count(k_.screen, b_) == 0) return;
    keep_initial_sums();
    if (!describe(magnitude)) return;  // flagged only by the screen's tighter thresholds
    const int passes = k_.col_side >= 0 && k_.row_side >= 0 ? 3 : 1;
    bool settled = true;
    int64_t previous = 0;  // the previous pass's writes are log entries [previous, pass_start)
    for (int pass = 0; pass < passes && settled; ++pass) {
      const int side = pass == 1 || k_.col_side < 0 ? k_.row_side : k_.col_side;
      const int64_t pass_start = writes_;
      settled = settle_side(side, pass, previous, pass_start);
      previous = pass_start;
      if (settled && clean()) {
        k_.status[b_] = 1;
        return;
      }
    }
    while (writes_ > 0) {  // put the matrix back as it was
      --writes_;
      set_element_bits(k_.data, k_.c.dtype, offset(log_at_[writes_]), log_bits_[writes_]);
    }
    k_.status[b_] = 2;
  }

 private:
  const Correct& k_;
  int64_t b_, base_;
  int64_t* log_at_;  // C's row * cols + column of each write
  uint64_t* log_bits_;
  int64_t writes_ = 0;
  int64_t blocks_left_ = 0;  // whole blocks this pass may still recompute
  ScreenSide initial_[2];    // the sides with the sums as the screen found them

  ABFT_HD bool is_col(int side) const { return side == k_.col_side; }
  ABFT_HD int other(int side) const { return is_col(side) ? k_.row_side : k_.col_side; }
  ABFT_HD int64_t block(int side) const { return is_col(side) ? k_.col_block : k_.row_block; }
  ABFT_HD int64_t checked(int side) const { return is_col(side) ? k_.c.rows : k_.c.cols; }
  ABFT_HD int64_t length(int side, int64_t blk) const {
    return min64(block(side), checked(side) - blk * block(side));
  }
  // C's (row, column) of position p of vector j in block blk of a side.
  ABFT_HD void element(int side, int64_t blk, int64_t j, int64_t p, int64_t& r,
                       int64_t& c) const {
    r = is_col(side) ? blk * block(side) + p : j;
    c = is_col(side) ? j : blk * block(side) + p;
  }
  ABFT_HD int64_t offset(int64_t index) const {
    return base_ + (index / k_.c.cols) * k_.c.row_stride + (index % k_.c.cols) * k_.c.col_stride;
  }
  ABFT_HD Acc value(int64_t r, int64_t c) const {
    return Acc(load_element(k_.data, k_.c.dtype, offset(r * k_.c.cols + c)));
  }

  // This matrix's block sums and sizes as the screen found them, kept in the workspace: eec
  // locates from them, and picks the vectors of each pass by them, all passes long.
  ABFT_HD void keep_initial_sums() {
    for (int side = 0; side < k_.screen.sides; ++side) {
      initial_[side] = k_.screen.side[side];
      const int64_t count = initial_[side].nb * 2 * initial_[side].n, first = b_ * count;
      const Acc* sums = static_cast<const Acc*>(k_.screen.side[side].sums) + first;
      const Acc* sizes = static_cast<const Acc*>(k_.screen.side[side].sizes) + first;
      Acc* kept_sums = static_cast<Acc*>(k_.initial_sums[side]);
      Acc* kept_sizes = static_cast<Acc*>(k_.initial_sizes[side]);
      for (int64_t i = 0; i < count; ++i) {
        kept_sums[first + i] = sums[i];
        kept_sizes[first + i] = sizes[i];
      }
      initial_[side].sums = kept_sums;
      initial_[side].sizes = kept_sizes;
    }
  }

  ABFT_HD Residual<Acc> residual_of(const ScreenSide& s, int64_t blk, int64_t j) const {
    return residual<Acc>(k_.screen, s, screen_matrix<Acc>(k_.screen, s, b_), blk, j);
  }
  ABFT_HD Residual<Acc> current(int side, int64_t blk, int64_t j) const {
    return residual_of(k_.screen.side[side], blk, j);
  }
  ABFT_HD Residual<Acc> initial(int side, int64_t blk, int64_t j) const {
    return residual_of(initial_[side], blk, j);
  }

  // Kind, most wrong row and column, and largest |d1|, over the vectors flagged by the
  // reference's thresholds (eec._kind, eec._where). False when there is none.
  ABFT_HD bool describe(Acc* magnitude) const {
    int kind = 0;
    bool any = false;
    for (int side = 0; side < k_.screen.sides; ++side) {
      const ScreenSide& s = k_.screen.side[side];
      Acc worst = -1;
      int64_t where = -1;
      for (int64_t blk = 0; blk < s.nb; ++blk) {
        for (int64_t j = 0; j < s.n; ++j) {
          const Residual<Acc> r = initial(side, blk, j);
          if (within(r, Acc(1))) continue;
          any = true;
          const Acc d1 = abs_value(r.d1);
          const bool nan = d1 != d1 || r.d2 != r.d2;
          const int this_kind = nan                      ? 3
                                : !is_finite(double(d1)) ? 2
                                : double(d1) >= k_.near_inf / 2 ? 1
                                                                : 0;
          kind = this_kind > kind ? this_kind : kind;
          const Acc error = d1 != d1 ? Acc(INFINITY) : d1;
          if (error > worst) {
            worst = error;
            where = j;
          }
          if (d1 != d1 || d1 > *magnitude) *magnitude = d1;  // NaN sticks, as amax's does
        }
      }
      (is_col(side) ? k_.col : k_.row)[b_] = where;
    }
    k_.kind[b_] = int8_t(kind);
    return any;
  }

  ABFT_HD bool clean() const {
    for (int side = 0; side < k_.screen.sides; ++side) {
      const ScreenSide& s = k_.screen.side[side];
      for (int64_t blk = 0; blk < s.nb; ++blk) {
        for (int64_t j = 0; j < s.n; ++j) {
          if (!within(current(side, blk, j), Acc(kScreenMargin))) return false;
        }
      }
    }
    return true;
  }

  // The sums and sizes of one vector's block, recomputed from C.
  ABFT_HD void refresh(int side, int64_t blk, int64_t j) {
    const ScreenSide& s = k_.screen.side[side];
    Acc s0 = 0, s1 = 0, z0 = 0, z1 = 0;
    for (int64_t p = 0; p < length(side, blk); ++p) {
      int64_t r, c;
      element(side, blk, j, p, r, c);
      const Acc x = value(r, c), w = Acc(p + 1), a = abs_value(x);
      s0 += x;
      s1 += w * x;
      z0 += a;
      z1 += w * a;
    }
    const int64_t first = (b_ * s.nb + blk) * 2 * s.n + j;
    static_cast<Acc*>(s.sums)[first] = s0;
    static_cast<Acc*>(s.sums)[first + s.n] = s1;
    static_cast<Acc*>(s.sizes)[first] = z0;
    static_cast<Acc*>(s.sizes)[first + s.n] = z1;
  }

  // The element (r, c) recomputed from the operands: alpha * A[r, :] B[:, c] + bias[c], summed
  // in double with compensation (products of fp32 and narrower are exact in double), so that it
  // is at least as close to the exact product as the GEMM's own result.
  ABFT_HD Acc recompute(int64_t r, int64_t c) const {
    const MatrixBatch &a = k_.a, &bm = k_.b;
    const int64_t a0 = batch_offset(a, b_) + r * a.row_stride;
    const int64_t b0 = batch_offset(bm, b_) + c * bm.col_stride;
    double sum = 0, compensation = 0;
    for (int64_t t = 0; t < a.cols; ++t) {
      const double term = load_element(a.data, a.dtype, a0 + t * a.col_stride) *
                          load_element(bm.data, bm.dtype, b0 + t * bm.row_stride);
      const double next = sum + term;  // Neumaier's two-sum
      compensation += abs_value(sum) >= abs_value(term) ? (sum - next) + term : (term - next) + sum;
      sum = next;
    }
    double result = k_.alpha * (sum + compensation);
    if (k_.bias != nullptr) result += load_element(k_.bias, k_.bias_dtype, c * k_.bias_stride);
    return Acc(result);
  }

  // Writes x at (r, c), logged, and refreshes the sums of both vectors through it. False when
  // the log is full (nothing written).
  ABFT_HD bool write(int64_t r, int64_t c, Acc x) {
    if (writes_ == k_.capacity) return false;
    const int64_t index = r * k_.c.cols + c;
    log_at_[writes_] = index;
    log_bits_[writes_++] = element_bits(k_.data, k_.c.dtype, offset(index));
    store_element<Acc>(k_.data, k_.c.dtype, offset(index), x);
    refresh_through(r, c);
    return true;
  }

  // Takes back the last write, at (r, c).
  ABFT_HD void undo_last(int64_t r, int64_t c) {
    --writes_;
    set_element_bits(k_.data, k_.c.dtype, offset(log_at_[writes_]), log_bits_[writes_]);
    refresh_through(r, c);
  }

  ABFT_HD void refresh_through(int64_t r, int64_t c) {
    if (k_.col_side >= 0) refresh(k_.col_side, r / k_.col_block, c);
    if (k_.row_side >= 0) refresh(k_.row_side, c / k_.row_block, r);
  }

  // Whether a log entry in [begin, end) lies in vector j of block blk of a side.
  ABFT_HD bool written(int side, int64_t blk, int64_t j, int64_t begin, int64_t end) const {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = log_at_[w] / k_.c.cols, c = log_at_[w] % k_.c.cols;
      const int64_t vector = is_col(side) ? c : r, position = is_col(side) ? r : c;
      if (vector == j && position / block(side) == blk) return true;
    }
    return false;
  }

  // One pass over a side (eec's correct_side): the vectors the screen flagged (but on the
  // side's second pass), and those the previous pass wrote into (log entries [begin, end)) that
  // do not check clean with half their thresholds to spare. At most k_.vectors vectors, and as
  // many elements in whole blocks. False when there were more, or the log is full.
  ABFT_HD bool settle_side(int side, int pass, int64_t begin, int64_t end) {
    const ScreenSide& s = k_.screen.side[side];
    int64_t vectors_left = k_.vectors;
    blocks_left_ = ceil_div(k_.vectors, int64_t(s.length));
    for (int64_t blk = 0; blk < s.nb; ++blk) {
      for (int64_t j = 0; j < s.n; ++j) {
        const bool flagged = !within(initial(side, blk, j), Acc(1));
        const bool exposed = begin < end && !within(current(side, blk, j), Acc(0.5)) &&
                             written(side, blk, j, begin, end);
        if (!(flagged && pass < 2) && !exposed) continue;
        if (vectors_left-- == 0 || !settle(side, blk, j, flagged)) return false;
      }
    }
    return true;
  }

  // Settles one vector (`flagged`: by the screen): a single element recomputed that makes it
  // clean, else its whole block. False when the log is full.
  ABFT_HD bool settle(int side, int64_t blk, int64_t j, bool flagged) {
    const int64_t len = length(side, blk);
    const int o = other(side);
    int64_t crossing = 0, suspect = 0;
    if (o >= 0) {  // the other side's vectors through this block, in the block of j, as found
      Acc best = -1;
      for (int64_t p = 0; p < len; ++p) {
        int64_t r, c;
        element(side, blk, j, p, r, c);
        const int64_t vector = is_col(side) ? r : c;
        const int64_t oblk = is_col(side) ? c / block(o) : r / block(o);
        const Residual<Acc> x = initial(o, oblk, vector);
        const bool hit = !within(x, Acc(1));
        crossing += hit;
        Acc score = hit ? Acc(INFINITY) : abs_value(x.d1) / x.tau;
        if (!is_finite(double(score)) && !hit) score = 0;
        if (score > best) {
          best = score;
          suspect = p;
        }
      }
    }
    if (!(flagged && crossing >= 2)) {  // several errors, perhaps more below the thresholds
      int64_t candidates[2];
      int n = 0;
      if (flagged && crossing == 1) {
        candidates[n++] = suspect;
      } else {
        candidates[n++] = first_guess(side, blk, j, len);
        if (o >= 0 && suspect != candidates[0]) candidates[n++] = suspect;
      }
      for (int t = 0; t < n; ++t) {
        int64_t r, c;
        element(side, blk, j, candidates[t], r, c);
        const Acc x = recompute(r, c);
        if (!is_finite(double(x))) continue;
        if (!write(r, c, x)) return false;
        if (within(current(side, blk, j), Acc(0.5))) return true;
        undo_last(r, c);
      }
    }
    return blocks_left_-- > 0 ? recompute_block(side, blk, j, len) : true;
  }

  // The weighted location from the differences as found, where they are finite and it lies in
  // the block, else the extreme element (eec's first candidate).
  ABFT_HD int64_t first_guess(int side, int64_t blk, int64_t j, int64_t len) const {
    const Residual<Acc> x = initial(side, blk, j);
    if (is_finite(double(x.d1)) && is_finite(double(x.d2))) {
      const double ratio = double(x.d2 / x.d1), top = double(block(side));
      if (is_finite(ratio)) {
        const double loc = rint(ratio < -1 ? -1 : ratio > top ? top : ratio) - 1;
        if (loc >= 0 && loc < double(len)) return int64_t(loc);
      }
    }
    int64_t extreme = 0;
    Acc largest = -1;
    for (int64_t p = 0; p < len; ++p) {
      int64_t r, c;
      element(side, blk, j, p, r, c);
      const Acc v = value(r, c);
      const Acc size = v != v ? Acc(INFINITY) : abs_value(v);
      if (size > largest) {
        largest = size;
        extreme = p;
      }
    }
    return extreme;
  }

  // The whole block of a vector recomputed from the operands, if every value is finite.
  // False when the log is full.
  ABFT_HD bool recompute_block(int side, int64_t blk, int64_t j, int64_t len) {
    for (int64_t p = 0; p < len; ++p) {
      int64_t r, c;
      element(side, blk, j, p, r, c);
      const Acc x = recompute(r, c);
      if (!is_finite(double(x))) {  // none of the block is written: take back what was
        for (int64_t q = p - 1; q >= 0; --q) {
          element(side, blk, j, q, r, c);
          undo_last(r, c);
        }
        return true;  // the re-verification fails
      }
      if (!write(r, c, x)) return false;
    }
    return true;
  }
};

}  // namespace abft
