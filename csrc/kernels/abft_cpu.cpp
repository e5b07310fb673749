// C++ implementation of the checksum kernels (abft.h) for CPU tensors: one pass over C produces
// both sides' sums. A task is one band of rows of one matrix (a block of the column side, when
// that side is checked), so tasks write disjoint outputs and run in parallel without atomics.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/abft.h"
#include "kernels/abft_correct.h"

namespace abft {
namespace {

constexpr int64_t kRowBand = 64;  // rows per task when the column side is not checked

// Inlined into each instruction-set clone of the entry points below (lambdas too: a lambda not
// inlined is compiled for the baseline instruction set only).
#define ABFT_INLINE inline __attribute__((always_inline))
#define ABFT_LAMBDA __attribute__((always_inline))

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

ABFT_INLINE float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

ABFT_INLINE uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

ABFT_INLINE float load(const float* p) { return *p; }
ABFT_INLINE double load(const double* p) { return *p; }
ABFT_INLINE float load(const Bf16* p) { return from_bits(uint32_t(p->bits) << 16); }

// IEEE half to float without branches, so that the conversion loop vectorises: normal numbers
// are rebiased by a multiplication, subnormals rebuilt from a magic constant, and a mask picks
// one (exact for all inputs, INF and NaN included).
ABFT_INLINE float load(const F16* p) {
  const uint32_t w = uint32_t(p->bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normal = from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t is_subnormal = 0u - uint32_t((two_w >> 27) == 0);  // all ones or zero
  return from_bits(sign | (to_bits(subnormal) & is_subnormal) | (to_bits(normal) & ~is_subnormal));
}

int64_t band_height(const BlockSums& out) { return out.col_block > 0 ? out.col_block : kRowBand; }

// One segment [0, len) of R = 1 or 2 consecutive rows x0, x1 (weights w0, w1 on the column
// side): adds them into the column sums s0, s1, z0, z1 when kCols, and returns each row's own
// sums over the segment in t when kRows. Two rows per pass halve the traffic to the column sums;
// the eight row sums are independent chains, so the loop is not bound by the adds' latency.
template <int R, bool kCols, bool kRows, typename Acc>
ABFT_INLINE void segment(const Acc* __restrict__ x0, const Acc* __restrict__ x1, int64_t len,
                         const Acc* __restrict__ weight, Acc w0, Acc w1, Acc* __restrict__ s0,
                         Acc* __restrict__ s1, Acc* __restrict__ z0, Acc* __restrict__ z1,
                         Acc (&t)[2][4]) {
  Acc p0 = 0, p1 = 0, p2 = 0, p3 = 0, q0 = 0, q1 = 0, q2 = 0, q3 = 0;
#pragma omp simd reduction(+ : p0, p1, p2, p3, q0, q1, q2, q3)
  for (int64_t j = 0; j < len; ++j) {
    const Acc v0 = x0[j], a0 = std::abs(v0);
    const Acc v1 = R == 2 ? x1[j] : Acc(0), a1 = std::abs(v1);
    if constexpr (kCols) {
      s0[j] += R == 2 ? v0 + v1 : v0;
      s1[j] += R == 2 ? w0 * v0 + w1 * v1 : w0 * v0;
      z0[j] += R == 2 ? a0 + a1 : a0;
      z1[j] += R == 2 ? w0 * a0 + w1 * a1 : w0 * a0;
    }
    if constexpr (kRows) {
      p0 += v0;
      p1 += weight[j] * v0;
      p2 += a0;
      p3 += weight[j] * a0;
      if constexpr (R == 2) {
        q0 += v1;
        q1 += weight[j] * v1;
        q2 += a1;
        q3 += weight[j] * a1;
      }
    }
  }
  t[0][0] = p0, t[0][1] = p1, t[0][2] = p2, t[0][3] = p3;
  t[1][0] = q0, t[1][1] = q1, t[1][2] = q2, t[1][3] = q3;
}

template <typename T, typename Acc>
ABFT_INLINE void load_row(const T* row, int64_t stride, int64_t cols, Acc* __restrict__ x) {
  if (stride == 1) {
    for (int64_t j = 0; j < cols; ++j) x[j] = load(row + j);
  } else {
    for (int64_t j = 0; j < cols; ++j) x[j] = load(row + j * stride);
  }
}

// Rows [i, i + R) of one band, x and x1 (x alone when R = 1): their column sums (when kCols) and
// row sums (when the row side is checked, nbr > 0).
template <int R, bool kCols, typename Acc>
ABFT_INLINE void rows_step(const MatrixBatch& c, const BlockSums& out, int64_t b, int64_t i,
                           int64_t nbr, const Acc* x, const Acc* x1, const Acc* weight, Acc w0,
                           Acc* s0, Acc* s1, Acc* z0, Acc* z1) {
  const int64_t cols = c.cols, rows = c.rows;
  Acc t[2][4];
  if (nbr == 0) {
    segment<R, kCols, false>(x, x1, cols, weight, w0, w0 + 1, s0, s1, z0, z1, t);
    return;
  }
  Acc* row_sums = static_cast<Acc*>(out.row_sums);
  Acc* row_sizes = static_cast<Acc*>(out.row_sizes);
  for (int64_t cb = 0; cb < nbr; ++cb) {
    const int64_t j0 = cb * out.row_block, len = std::min(cols - j0, out.row_block);
    if constexpr (kCols) {
      segment<R, true, true>(x + j0, x1 + j0, len, weight, w0, w0 + 1, s0 + j0, s1 + j0, z0 + j0,
                             z1 + j0, t);
    } else {
      segment<R, false, true>(x + j0, x1 + j0, len, weight, w0, w0 + 1, s0, s1, z0, z1, t);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (b * nbr + cb) * 2 * rows + i + r;
      row_sums[at] = t[r][0];
      row_sums[at + rows] = t[r][1];
      row_sizes[at] = t[r][2];
      row_sizes[at + rows] = t[r][3];
    }
  }
}

// x . v_t for the rows v_t = vectors + t * stride, t < count, into out[t]: four at a time, as
// four independent chains, so that short rows are not bound by the adds' latency.
template <bool kAbs, typename Acc>
ABFT_INLINE void dots(const Acc* __restrict__ x, int64_t k, const Acc* __restrict__ vectors,
                      int64_t stride, int64_t count, Acc scale, Acc* __restrict__ out) {
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) {
    const Acc *v0 = vectors + t * stride, *v1 = v0 + stride, *v2 = v1 + stride,
              *v3 = v2 + stride;
    Acc p0 = 0, p1 = 0, p2 = 0, p3 = 0;
#pragma omp simd reduction(+ : p0, p1, p2, p3)
    for (int64_t j = 0; j < k; ++j) {
      const Acc xj = kAbs ? std::abs(x[j]) : x[j];
      p0 += xj * v0[j];
      p1 += xj * v1[j];
      p2 += xj * v2[j];
      p3 += xj * v3[j];
    }
    out[t] = p0 * scale, out[t + 1] = p1 * scale, out[t + 2] = p2 * scale;
    out[t + 3] = p3 * scale;
  }
  for (; t < count; ++t) {
    const Acc* __restrict__ v = vectors + t * stride;
    Acc p = 0;
#pragma omp simd reduction(+ : p)
    for (int64_t j = 0; j < k; ++j) p += (kAbs ? std::abs(x[j]) : x[j]) * v[j];
    out[t] = p * scale;
  }
}

// Matrix b's vectors u_t and z_t, found once for all its rows (batch_offset divides).
template <typename Acc>
struct MatrixVectors {
  const Acc* u;
  const Acc* z;
};

template <typename Acc>
ABFT_INLINE MatrixVectors<Acc> matrix_vectors(const RowProducts& out, int64_t b) {
  return {static_cast<const Acc*>(out.u.data) + batch_offset(out.u, b),
          static_cast<const Acc*>(out.z.data) + batch_offset(out.z, b)};
}

// Row i of matrix b, loaded in x: its dot products with every u_t and, in magnitude, z_t.
template <typename Acc>
ABFT_INLINE void row_dots(const Acc* __restrict__ x, int64_t k, const RowProducts& out,
                          const MatrixVectors<Acc>& vectors, int64_t b, int64_t rows, int64_t i) {
  const MatrixBatch &u = out.u, &z = out.z;
  dots<false>(x, k, vectors.u, u.row_stride, u.rows, Acc(out.scale),
              static_cast<Acc*>(out.products) + (b * rows + i) * u.rows);
  dots<true>(x, k, vectors.z, z.row_stride, z.rows, Acc(std::abs(out.scale)),
             static_cast<Acc*>(out.magnitudes) + (b * rows + i) * z.rows);
}

template <bool kCols, typename T, typename Acc>
ABFT_INLINE void band(const MatrixBatch& c, const BlockSums& out, int64_t task, Acc* x,
                      const Acc* weight, const RowProducts* products) {
  const int64_t rows = c.rows, cols = c.cols, height = band_height(out);
  const int64_t bands = ceil_div(rows, height);
  const int64_t b = task / bands, r0 = (task % bands) * height, r1 = std::min(rows, r0 + height);
  const T* base = static_cast<const T*>(c.data) + batch_offset(c, b);
  Acc *s0 = nullptr, *s1 = nullptr, *z0 = nullptr, *z1 = nullptr;
  if constexpr (kCols) {  // this band is column block r0 / col_block of matrix b
    const int64_t at = (b * bands + r0 / height) * 2 * cols;
    s0 = static_cast<Acc*>(out.col_sums) + at;
    s1 = s0 + cols;
    z0 = static_cast<Acc*>(out.col_sizes) + at;
    z1 = z0 + cols;
    std::fill(s0, s0 + 2 * cols, Acc(0));
    std::fill(z0, z0 + 2 * cols, Acc(0));
  }
  const int64_t nbr = out.row_block > 0 ? ceil_div(cols, out.row_block) : 0;
  // row r of the band in the accumulation type: read where it is when it already is (fp32 or
  // fp64 rows stored contiguously), else converted into buffer
  auto row = [&](int64_t r, Acc* buffer) -> const Acc* {
    if constexpr (std::is_same_v<T, Acc>) {
      if (c.col_stride == 1) return base + r * c.row_stride;
    }
    load_row(base + r * c.row_stride, c.col_stride, cols, buffer);
    return buffer;
  };
  const MatrixVectors<Acc> vectors =
      products != nullptr ? matrix_vectors<Acc>(*products, b) : MatrixVectors<Acc>{};
  int64_t i = r0;
  for (; i + 1 < r1; i += 2) {
    const Acc *x0 = row(i, x), *x1 = row(i + 1, x + cols);
    if (products != nullptr) {
      row_dots(x0, cols, *products, vectors, b, rows, i);
      row_dots(x1, cols, *products, vectors, b, rows, i + 1);
    }
    rows_step<2, kCols>(c, out, b, i, nbr, x0, x1, weight, Acc(i - r0 + 1), s0, s1, z0, z1);
  }
  if (i < r1) {
    const Acc* x0 = row(i, x);
    if (products != nullptr) row_dots(x0, cols, *products, vectors, b, rows, i);
    rows_step<1, kCols>(c, out, b, i, nbr, x0, x0, weight, Acc(i - r0 + 1), s0, s1, z0, z1);
  }
}

// On x86 compiled once per instruction set, and the best one the CPU has runs.
#if defined(__x86_64__) && defined(__GNUC__)
#define ABFT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ABFT_CLONES
#endif

#define ABFT_BANDS(NAME, T, ACC)                                                            \
  ABFT_CLONES void NAME(const MatrixBatch& c, const BlockSums& out, int64_t begin,          \
                        int64_t end, const RowProducts* products) {                         \
    std::vector<ACC> x(2 * c.cols);                                                         \
    std::vector<ACC> weight(std::max<int64_t>(out.row_block, 0));                           \
    for (size_t j = 0; j < weight.size(); ++j) weight[j] = ACC(j + 1);                      \
    for (int64_t task = begin; task < end; ++task) {                                        \
      if (out.col_block > 0) {                                                              \
        band<true, T, ACC>(c, out, task, x.data(), weight.data(), products);                \
      } else {                                                                              \
        band<false, T, ACC>(c, out, task, x.data(), weight.data(), products);               \
      }                                                                                     \
    }                                                                                       \
  }

ABFT_BANDS(bands_f32, float, float)
ABFT_BANDS(bands_f64, double, double)
ABFT_BANDS(bands_bf16, Bf16, float)
ABFT_BANDS(bands_f16, F16, float)

// Rows [r0, r1) of matrix b of A: each row is loaded once in the accumulation type, then dotted
// with every u_t and, in magnitude, with every z_t.
template <typename T, typename Acc>
ABFT_INLINE void product_rows(const MatrixBatch& a, const RowProducts& out, int64_t b, int64_t r0,
                              int64_t r1, Acc* __restrict__ x) {
  const T* base = static_cast<const T*>(a.data) + batch_offset(a, b);
  const MatrixVectors<Acc> vectors = matrix_vectors<Acc>(out, b);
  for (int64_t i = r0; i < r1; ++i) {
    load_row(base + i * a.row_stride, a.col_stride, a.cols, x);
    row_dots(x, a.cols, out, vectors, b, a.rows, i);
  }
}

// The same for a column-major A (its columns contiguous, row_stride 1): column j's entries in
// the band are loaded once and added, times u_t[j] and in magnitude times z_t[j], to every row's
// products in `acc` ([nu + nz, kRowBand]), vectorised over the band's rows.
template <typename T, typename Acc>
ABFT_INLINE void product_columns(const MatrixBatch& a, const RowProducts& out, int64_t b,
                                 int64_t r0, int64_t r1, Acc* __restrict__ x,
                                 Acc* __restrict__ acc) {
  const MatrixBatch &u = out.u, &z = out.z;
  const int64_t n = r1 - r0, nu = u.rows, nz = z.rows;
  const T* base = static_cast<const T*>(a.data) + batch_offset(a, b) + r0;
  const auto [us, zs] = matrix_vectors<Acc>(out, b);
  std::fill(acc, acc + (nu + nz) * kRowBand, Acc(0));
  for (int64_t j = 0; j < a.cols; ++j) {
    load_row(base + j * a.col_stride, 1, n, x);
    for (int64_t t = 0; t < nu; ++t) {
      const Acc v = us[t * u.row_stride + j];
      Acc* __restrict__ to = acc + t * kRowBand;
#pragma omp simd
      for (int64_t r = 0; r < n; ++r) to[r] += x[r] * v;
    }
    for (int64_t t = 0; t < nz; ++t) {
      const Acc v = zs[t * z.row_stride + j];
      Acc* __restrict__ to = acc + (nu + t) * kRowBand;
#pragma omp simd
      for (int64_t r = 0; r < n; ++r) to[r] += std::abs(x[r]) * v;
    }
  }
  const Acc scale = Acc(out.scale), size_scale = Acc(std::abs(out.scale));
  Acc* products = static_cast<Acc*>(out.products) + (b * a.rows + r0) * nu;
  Acc* magnitudes = static_cast<Acc*>(out.magnitudes) + (b * a.rows + r0) * nz;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t t = 0; t < nu; ++t) products[r * nu + t] = acc[t * kRowBand + r] * scale;
    for (int64_t t = 0; t < nz; ++t) {
      magnitudes[r * nz + t] = acc[(nu + t) * kRowBand + r] * size_scale;
    }
  }
}

#define ABFT_PRODUCTS(NAME, T, ACC)                                                         \
  ABFT_CLONES void NAME(const MatrixBatch& a, const RowProducts& out, int64_t begin,        \
                        int64_t end) {                                                      \
    const bool by_columns = column_major(a);                                                \
    std::vector<ACC> x(by_columns ? kRowBand : a.cols);                                     \
    std::vector<ACC> acc(by_columns ? (out.u.rows + out.z.rows) * kRowBand : 0);            \
    const int64_t bands = ceil_div(a.rows, kRowBand);                                       \
    for (int64_t task = begin; task < end; ++task) {                                        \
      const int64_t b = task / bands, r0 = (task % bands) * kRowBand;                       \
      const int64_t r1 = std::min(a.rows, r0 + kRowBand);                                   \
      if (by_columns) {                                                                     \
        product_columns<T, ACC>(a, out, b, r0, r1, x.data(), acc.data());                   \
      } else {                                                                              \
        product_rows<T, ACC>(a, out, b, r0, r1, x.data());                                  \
      }                                                                                     \
    }                                                                                       \
  }

ABFT_PRODUCTS(products_f32, float, float)
ABFT_PRODUCTS(products_f64, double, double)
ABFT_PRODUCTS(products_bf16, Bf16, float)
ABFT_PRODUCTS(products_f16, F16, float)

// e^x for x <= 0 (an entry of a softmax row minus the row's largest), branch free so that the
// row loops vectorise: Cephes' expf (x = n ln 2 + r, |r| <= ln 2 / 2, a degree-5 polynomial in
// r, times 2^n set in the exponent bits); 0 where e^x is below the smallest normal float, and
// NaN for NaN, as std::exp (a NaN score makes its row of P NaN, as torch's softmax does).
ABFT_INLINE float exp_nonpositive(float x) {
  constexpr float kLowest = -87.3365448f;  // e^x below the smallest normal float
  const float input = x;
  const uint32_t keep = 0u - uint32_t(x >= kLowest);  // all ones, or 0 (NaN too): no branch
  x = x >= kLowest ? x : kLowest;
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float q = 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  // bit casts, not memcpy: a memcpy in the loop body stops it vectorising
  const float e = (q * r * r + r + 1.0f) *
                  __builtin_bit_cast(float, uint32_t(int32_t(n) + 127) << 23);
  const float kept = __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, e) & keep);
  return input == input ? kept : input;
}
ABFT_INLINE double exp_nonpositive(double x) { return std::exp(x); }

ABFT_INLINE void store(float v, float* p) { *p = v; }
ABFT_INLINE void store(double v, double* p) { *p = v; }
ABFT_INLINE void store(float v, Bf16* p) { p->bits = float_to_bf16(v); }
ABFT_INLINE void store(float v, F16* p) { p->bits = float_to_half(v); }

// Row i of matrix b of S, x in the accumulation type: its softmax written to out, and kept in
// p as written (rounded to T), for P's sums.
template <typename T, typename Acc>
ABFT_INLINE void softmax_row(const SoftmaxCheck& k, int64_t b, int64_t i, const Acc* __restrict__ x,
                             Acc* __restrict__ p, T* __restrict__ out) {
  const int64_t cols = k.s.cols;
  const Acc scale = Acc(k.scale), fill = Acc(-10000);
  const int64_t open = k.causal ? std::min(cols, i + 1) : cols;  // entries j >= open: masked
  const uint8_t* mask = softmax_mask_row(k, b, i);
  const int64_t mask_step = k.mask_strides[k.s.batch_dims + 1];
  // the causally masked tail is filled apart: in one loop, the compiler splits it off as a
  // scalar loop with the running maximum carried through memory
  Acc top = open < cols ? fill : -std::numeric_limits<Acc>::infinity();
  if (mask != nullptr) {
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < open; ++j) {
      const Acc v = mask[j * mask_step] == 0 ? x[j] * scale : fill;
      p[j] = v;
      top = v > top ? v : top;
    }
  } else {
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < open; ++j) {
      const Acc v = x[j] * scale;
      p[j] = v;
      top = v > top ? v : top;
    }
  }
  std::fill(p + open, p + cols, fill);
  Acc sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < cols; ++j) {
    const Acc e = exp_nonpositive(p[j] - top);
    p[j] = e;
    sum += e;
  }
  const Acc inverse = Acc(1) / sum;
  for (int64_t j = 0; j < cols; ++j) {
    store(p[j] * inverse, out + j);
    p[j] = load(out + j);
  }
}

// One band of softmax_check (abft.h): rows [r0, r1) of matrix b, two at a time as in band.
template <typename T, typename Acc>
ABFT_INLINE void softmax_band(const SoftmaxCheck& k, int64_t task, Acc* x, Acc* p,
                              const Acc* weight) {
  const MatrixBatch& s = k.s;
  const int64_t rows = s.rows, cols = s.cols, bands = ceil_div(rows, k.band);
  const int64_t b = task / bands, blk = task % bands, r0 = blk * k.band;
  const int64_t r1 = std::min(rows, r0 + k.band);
  const T* base = static_cast<const T*>(s.data) + batch_offset(s, b);
  T* out = static_cast<T*>(k.p) + b * rows * cols;
  const bool screened = k.screen.sides > 0, s_cols = screened && k.s_sums.col_block > 0;
  const int64_t nbr = screened && k.s_sums.row_block > 0 ? ceil_div(cols, k.s_sums.row_block) : 0;
  // a band's column accumulators: sums then sizes, each (plain, weighted), of block blk
  auto accumulators = [&](const BlockSums& sums, bool used, Acc* (&to)[4]) ABFT_LAMBDA {
    if (!used) return;
    const int64_t at = (b * bands + blk) * 2 * cols;
    to[0] = static_cast<Acc*>(sums.col_sums) + at;
    to[1] = to[0] + cols;
    to[2] = static_cast<Acc*>(sums.col_sizes) + at;
    to[3] = to[2] + cols;
    std::fill(to[0], to[0] + 2 * cols, Acc(0));
    std::fill(to[2], to[2] + 2 * cols, Acc(0));
  };
  Acc *sc[4] = {}, *pc[4] = {};
  accumulators(k.s_sums, s_cols, sc);
  accumulators(k.p_sums, k.products != nullptr, pc);
  const MatrixVectors<Acc> vectors =
      k.products != nullptr ? matrix_vectors<Acc>(*k.products, b) : MatrixVectors<Acc>{};
  auto row = [&](int64_t r, Acc* buffer) ABFT_LAMBDA -> const Acc* {
    if constexpr (std::is_same_v<T, Acc>) {
      if (s.col_stride == 1) return base + r * s.row_stride;
    }
    load_row(base + r * s.row_stride, s.col_stride, cols, buffer);
    return buffer;
  };
  auto rows_of = [&](auto pair, int64_t i) ABFT_LAMBDA {
    constexpr int R = decltype(pair)::value;
    const Acc *x0 = row(i, x), *x1 = R == 2 ? row(i + 1, x + cols) : x0;
    const Acc w0 = Acc(i - r0 + 1);
    if (s_cols) {
      rows_step<R, true>(s, k.s_sums, b, i, nbr, x0, x1, weight, w0, sc[0], sc[1], sc[2], sc[3]);
    } else if (screened) {
      rows_step<R, false>(s, k.s_sums, b, i, nbr, x0, x1, weight, w0, sc[0], sc[1], sc[2], sc[3]);
    }
    for (int r = 0; r < R; ++r) softmax_row<T, Acc>(k, b, i + r, r ? x1 : x0, p + r * cols,
                                                   out + (i + r) * cols);
    if (k.products != nullptr) {
      for (int r = 0; r < R; ++r) {
        row_dots(p + r * cols, cols, *k.products, vectors, b, rows, i + r);
      }
      rows_step<R, true>(s, k.p_sums, b, i, 0, p, p + cols, weight, w0, pc[0], pc[1], pc[2],
                         pc[3]);
    }
  };
  int64_t i = r0;
  for (; i + 1 < r1; i += 2) rows_of(std::integral_constant<int, 2>{}, i);
  if (i < r1) rows_of(std::integral_constant<int, 1>{}, i);
  if (!screened) return;
  // the screen of S's vectors this band completed: its block of every column, its rows
  int32_t count = 0;
  int side = 0;
  if (k.s_sums.col_block > 0) {
    const ScreenSide& col = k.screen.side[side++];
    const ScreenMatrix<Acc> m = screen_matrix<Acc>(k.screen, col, b);
    for (int64_t j = 0; j < cols; ++j) count += screen_flags<Acc>(k.screen, col, m, blk, j);
  }
  if (nbr > 0) {
    const ScreenSide& row_side = k.screen.side[side];
    const ScreenMatrix<Acc> m = screen_matrix<Acc>(k.screen, row_side, b);
    for (int64_t cb = 0; cb < nbr; ++cb) {
      for (int64_t r = r0; r < r1; ++r) count += screen_flags<Acc>(k.screen, row_side, m, cb, r);
    }
  }
  if (count > 0) __atomic_fetch_add(k.screen.flagged + b * k.screen.slots, count, __ATOMIC_RELAXED);
}

#define ABFT_SOFTMAX(NAME, T, ACC)                                                          \
  ABFT_CLONES void NAME(const SoftmaxCheck& k, int64_t begin, int64_t end) {                \
    std::vector<ACC> x(2 * k.s.cols), p(2 * k.s.cols);                                      \
    std::vector<ACC> weight(std::max<int64_t>(k.s_sums.row_block, 0));                      \
    for (size_t j = 0; j < weight.size(); ++j) weight[j] = ACC(j + 1);                      \
    for (int64_t task = begin; task < end; ++task) {                                        \
      softmax_band<T, ACC>(k, task, x.data(), p.data(), weight.data());                     \
    }                                                                                       \
  }

ABFT_SOFTMAX(softmax_f32, float, float)
ABFT_SOFTMAX(softmax_f64, double, double)
ABFT_SOFTMAX(softmax_bf16, Bf16, float)
ABFT_SOFTMAX(softmax_f16, F16, float)

template <typename Acc>
void screen_matrices(const Screen& s, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    int32_t count = 0;
    for (int k = 0; k < s.sides; ++k) {
      const ScreenSide& side = s.side[k];
      const ScreenMatrix<Acc> x = screen_matrix<Acc>(s, side, b);
      for (int64_t blk = 0; blk < side.nb; ++blk) {
        for (int64_t j = 0; j < side.n; ++j) count += screen_flags<Acc>(s, side, x, blk, j);
      }
    }
    s.flagged[b * s.slots] = count;
  }
}

}  // namespace

void screen_cpu(const Screen& s, bool f64, int64_t begin, int64_t end) {
  if (f64) {
    screen_matrices<double>(s, begin, end);
  } else {
    screen_matrices<float>(s, begin, end);
  }
}

void softmax_check_cpu(const SoftmaxCheck& k, int64_t begin, int64_t end) {
  switch (k.s.dtype) {
    case DType::F32:
      return softmax_f32(k, begin, end);
    case DType::F64:
      return softmax_f64(k, begin, end);
    case DType::BF16:
      return softmax_bf16(k, begin, end);
    case DType::F16:
      return softmax_f16(k, begin, end);
  }
}

void correct_cpu(const Correct& k, bool f64, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    if (f64) {
      Corrector<double>(k, b).run();
    } else {
      Corrector<float>(k, b).run();
    }
  }
}

template <typename Acc>
void bias_terms(const BiasTerms& t) {
  for (int64_t item = 0; item < bias_column_items(t); ++item) bias_column_term<Acc>(t, item);
  for (int64_t blk = 0; blk < ceil_div(t.n, t.block); ++blk) {
    const BiasBlock<Acc> sums = bias_block<Acc>(t, blk);
    for (int64_t i = 0; i < t.m; ++i) bias_row_term<Acc>(t, blk, i, sums);
  }
}

void bias_terms_cpu(const BiasTerms& t) {
  if (t.f64) {
    bias_terms<double>(t);
  } else {
    bias_terms<float>(t);
  }
}

void tally_cpu(const Tally& t) {
  uint64_t worst = 0;
  for (int64_t b = 0; b < t.batch; ++b) {
    const int8_t status = t.status[b], kind = t.kind[b];
    worst = std::max(worst, tally_rank(status, b));
    if (status < 1 || status > 2 || kind < 0 || kind >= t.kinds) continue;
    t.counts[kind] += 1;
    t.counts[status * t.kinds + kind] += 1;
  }
  tally_event(t, tally_matrix(worst));
}

int64_t row_products_tasks(const MatrixBatch& a) { return a.batch * ceil_div(a.rows, kRowBand); }

void row_products_cpu(const MatrixBatch& a, const RowProducts& out, int64_t begin, int64_t end) {
  switch (a.dtype) {
    case DType::F32:
      return products_f32(a, out, begin, end);
    case DType::F64:
      return products_f64(a, out, begin, end);
    case DType::BF16:
      return products_bf16(a, out, begin, end);
    case DType::F16:
      return products_f16(a, out, begin, end);
  }
}

int64_t block_sums_tasks(const MatrixBatch& c, const BlockSums& out) {
  return c.batch * ceil_div(c.rows, band_height(out));
}

void block_sums_cpu(const MatrixBatch& c, const BlockSums& out, int64_t begin, int64_t end,
                    const RowProducts* products) {
  switch (c.dtype) {
    case DType::F32:
      return bands_f32(c, out, begin, end, products);
    case DType::F64:
      return bands_f64(c, out, begin, end, products);
    case DType::BF16:
      return bands_bf16(c, out, begin, end, products);
    case DType::F16:
      return bands_f16(c, out, begin, end, products);
  }
}

}  // namespace abft
