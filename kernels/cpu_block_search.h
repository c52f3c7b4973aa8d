// Block-wise MSE clipping search of the CPU backend (qt_cpu_block_mse_search), one set of strip
// kernels per instruction set, chosen at run time like cpu_simd.h's.
//
// Layout: x is [rows, columns] row-major; a block is block_len consecutive rows of one column
// (the last block shorter when block_len does not divide rows). Vector lanes are adjacent columns,
// so every lane runs qt_math.h's scalar recipe on its own column: the same IEEE float32 operations
// in the same order (division, not a reciprocal; rint as ROUNDPS to nearest even; min/max whose
// `a < b ? a : b` is the scalar ternary), and the squared differences added to a double
// accumulator in row order. The products are exact in double (24-bit mantissas), so FMA(d, d, acc)
// rounds exactly like acc + d*d. That is why each lane's result equals the scalar one bit for bit
// and results do not depend on the instruction set, the strip width or the thread count.
//
// Symmetric grids skip "+ z" and "- z" (z = 0): that changes only the sign of a zero level, which
// neither the integer stored nor the squared error can see.
#ifndef QTOOL_CPU_BLOCK_SEARCH_H
#define QTOOL_CPU_BLOCK_SEARCH_H

#include <stdint.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "qt_math.h"

namespace qt {

// One qt_cpu_block_mse_search call. Optional outputs are null when not wanted.
struct BlockSearch {
  const float* x;
  int64_t rows, columns, block_len;
  float qmin, qmax;
  bool symmetric;
  bool signed_scales;    // symmetric only: the signed-scale grid competes last (qt_math.h)
  const float* grid;
  int64_t grid_len;
  float* out_scale;      // [num_blocks, columns]
  uint8_t* out_zero;     // [num_blocks, columns], asymmetric only
  int32_t* out_best;     // [num_blocks, columns]
  uint8_t* out_values;   // [rows, columns]: int8 bits when symmetric, else uint8
};

inline int64_t block_rows(const BlockSearch& a, int64_t k, int64_t* r0) {
  *r0 = k * a.block_len;
  const int64_t end = *r0 + a.block_len < a.rows ? *r0 + a.block_len : a.rows;
  return end - *r0;
}

// Outputs of one column of block k from its chosen parameters.
inline void store_choice(const BlockSearch& a, int64_t k, int64_t m, QtBlockQuant p, int32_t j) {
  const int64_t o = k * a.columns + m;
  a.out_scale[o] = p.scale;
  if (!a.symmetric && a.out_zero != nullptr) a.out_zero[o] = (uint8_t)(int32_t)p.zero;
  if (a.out_best != nullptr) a.out_best[o] = j;
}

namespace scalar {

// The reference: column m of block k. Returns false when the block holds NaN or Inf.
inline bool column(const BlockSearch& a, int64_t k, int64_t m) {
  int64_t r0 = 0;
  const int64_t n = block_rows(a, k, &r0);
  const int64_t M = a.columns;
  const float* col = a.x + r0 * M + m;
  float lo = 0.0f, hi = 0.0f;
  bool finite = true;
  for (int64_t r = 0; r < n; ++r) {
    const float v = col[r * M];
    finite = finite && qt_isfinite(v);
    qt_block_range_step(v, lo, hi);
  }
  if (!finite) return false;
  int32_t best_j = 0;
  const QtBlockQuant best = qt_block_column_choice(col, n, M, lo, hi, a.grid, a.grid_len, a.qmin,
                                                   a.qmax, a.symmetric, a.signed_scales, &best_j);
  store_choice(a, k, m, best, best_j);
  if (a.out_values != nullptr) {
    uint8_t* out = a.out_values + r0 * M + m;
    for (int64_t r = 0; r < n; ++r) {
      out[r * M] = (uint8_t)(int32_t)qt_block_level(col[r * M], best, a.qmin, a.qmax);
    }
  }
  return true;
}

// Columns [m0, m1) of block k.
inline bool columns(const BlockSearch& a, int64_t k, int64_t m0, int64_t m1) {
  bool ok = true;
  for (int64_t m = m0; m < m1; ++m) ok = column(a, k, m) && ok;
  return ok;
}

}  // namespace scalar

#if defined(__x86_64__)

// ------------------------------------------------------------------------------------------- AVX2
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {

constexpr int kLanes = 8;
#define QT_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

struct Consts {
  __m256 qmin, qmax, range, min_scale, one, zero, sign;
  explicit Consts(const BlockSearch& a)
      : qmin(_mm256_set1_ps(a.qmin)),
        qmax(_mm256_set1_ps(a.qmax)),
        range(_mm256_set1_ps(a.qmax - a.qmin)),
        min_scale(_mm256_set1_ps(QT_BLOCK_MIN_SCALE)),
        one(_mm256_set1_ps(1.0f)),
        zero(_mm256_setzero_ps()),
        sign(_mm256_set1_ps(-0.0f)) {}
};

// qt_block_quant_params on 8 columns.
inline void params(const Consts& c, bool symmetric, __m256 lo, __m256 hi, float factor,
                   __m256* scale, __m256* zero) {
  const __m256 f = _mm256_set1_ps(factor);
  const __m256 l = _mm256_mul_ps(lo, f), h = _mm256_mul_ps(hi, f);
  __m256 s = symmetric ? _mm256_max_ps(_mm256_div_ps(l, c.qmin), _mm256_div_ps(h, c.qmax))
                       : _mm256_div_ps(_mm256_sub_ps(h, l), c.range);
  const __m256 floored = _mm256_max_ps(s, c.min_scale);
  s = _mm256_blendv_ps(c.one, floored, _mm256_cmp_ps(s, c.zero, _CMP_GT_OQ));
  *scale = s;
  if (symmetric) {
    *zero = c.zero;
  } else {
    const __m256 z = _mm256_round_ps(_mm256_div_ps(_mm256_xor_ps(l, c.sign), s), QT_RN);
    *zero = _mm256_min_ps(_mm256_max_ps(z, c.qmin), c.qmax);
  }
}

template <bool Symmetric>
inline __attribute__((always_inline)) __m256 level(const Consts& c, __m256 v, __m256 s,
                                                   __m256 z) {
  __m256 q = _mm256_round_ps(_mm256_div_ps(v, s), QT_RN);
  if (!Symmetric) q = _mm256_add_ps(q, z);
  return _mm256_min_ps(_mm256_max_ps(q, c.qmin), c.qmax);
}

// Sum over the rows of the squared reconstruction error, per lane, in row order (lanes 0-3 in
// *lo, 4-7 in *hi).
template <bool Symmetric>
inline void errors(const Consts& c, const float* p, int64_t n, int64_t M, __m256 s, __m256 z,
                   __m256d* out_lo, __m256d* out_hi) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (int64_t r = 0; r < n; ++r) {
    const __m256 v = _mm256_loadu_ps(p + r * M);
    const __m256 q = level<Symmetric>(c, v, s, z);
    const __m256 dq = Symmetric ? _mm256_mul_ps(q, s) : _mm256_mul_ps(_mm256_sub_ps(q, z), s);
    const __m256 d = _mm256_sub_ps(dq, v);
    const __m256d dl = _mm256_cvtps_pd(_mm256_castps256_ps128(d));
    const __m256d dh = _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1));
    lo = _mm256_fmadd_pd(dl, dl, lo);
    hi = _mm256_fmadd_pd(dh, dh, hi);
  }
  *out_lo = lo;
  *out_hi = hi;
}

// qt_block_signed_params on 8 columns.
inline __m256 signed_scale(const Consts& c, __m256 lo, __m256 hi) {
  const __m256 wider_high = _mm256_cmp_ps(hi, _mm256_xor_ps(lo, c.sign), _CMP_GT_OQ);
  const __m256 s =
      _mm256_blendv_ps(_mm256_div_ps(lo, c.qmin), _mm256_div_ps(hi, c.qmin), wider_high);
  const __m256 m = _mm256_andnot_ps(c.sign, s);
  const __m256 floored = _mm256_or_ps(_mm256_max_ps(m, c.min_scale), _mm256_and_ps(s, c.sign));
  return _mm256_blendv_ps(c.one, floored, _mm256_cmp_ps(m, c.zero, _CMP_GT_OQ));
}

// Two 4 x 64-bit masks -> one 8 x 32-bit mask, lane order kept.
inline __m256 narrow_mask(__m256d lo, __m256d hi) {
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  const __m128 l = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(_mm256_castpd_ps(lo), even));
  const __m128 h = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(_mm256_castpd_ps(hi), even));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(l), h, 1);
}

template <bool Symmetric>
inline void write_values(const Consts& c, const float* p, int64_t n, int64_t M, __m256 s,
                         __m256 z, uint8_t* out) {
  for (int64_t r = 0; r < n; ++r) {
    const __m256i q = _mm256_cvtps_epi32(level<Symmetric>(c, _mm256_loadu_ps(p + r * M), s, z));
    const __m128i w =
        _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));  // int16
    const __m128i b = Symmetric ? _mm_packs_epi16(w, w) : _mm_packus_epi16(w, w);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + r * M), b);
  }
}

// Columns [m, m + 8) of block k. Returns false when the block holds NaN or Inf.
template <bool Symmetric>
inline bool strip(const BlockSearch& a, const Consts& c, int64_t k, int64_t m) {
  int64_t r0 = 0;
  const int64_t n = block_rows(a, k, &r0);
  const int64_t M = a.columns;
  const float* p = a.x + r0 * M + m;
  __m256 lo = c.zero, hi = c.zero, check = c.zero;
  for (int64_t r = 0; r < n; ++r) {
    const __m256 v = _mm256_loadu_ps(p + r * M);
    lo = _mm256_min_ps(v, lo);
    hi = _mm256_max_ps(v, hi);
    check = _mm256_add_ps(check, _mm256_sub_ps(v, v));  // NaN once any value is NaN or Inf
  }
  if (_mm256_movemask_ps(_mm256_cmp_ps(check, check, _CMP_UNORD_Q)) != 0) return false;
  // the first candidate is the best so far; a later one replaces it where its error is smaller
  __m256 best_s, best_z;
  params(c, Symmetric, lo, hi, a.grid[0], &best_s, &best_z);
  __m256 best_j = _mm256_setzero_ps();  // int32 bits
  if (a.grid_len > 1 || (Symmetric && a.signed_scales)) {
    __m256d best_lo, best_hi;
    errors<Symmetric>(c, p, n, M, best_s, best_z, &best_lo, &best_hi);
    for (int64_t j = 1; j < a.grid_len; ++j) {
      __m256 s, z;
      params(c, Symmetric, lo, hi, a.grid[j], &s, &z);
      __m256d e_lo, e_hi;
      errors<Symmetric>(c, p, n, M, s, z, &e_lo, &e_hi);
      const __m256d b_lo = _mm256_cmp_pd(e_lo, best_lo, _CMP_LT_OQ);
      const __m256d b_hi = _mm256_cmp_pd(e_hi, best_hi, _CMP_LT_OQ);
      const __m256 better = narrow_mask(b_lo, b_hi);
      best_lo = _mm256_blendv_pd(best_lo, e_lo, b_lo);
      best_hi = _mm256_blendv_pd(best_hi, e_hi, b_hi);
      best_s = _mm256_blendv_ps(best_s, s, better);
      best_z = _mm256_blendv_ps(best_z, z, better);
      const __m256 jv = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(j)));
      best_j = _mm256_blendv_ps(best_j, jv, better);
    }
    if (Symmetric && a.signed_scales) {
      const __m256 s = signed_scale(c, lo, hi);
      __m256d e_lo, e_hi;
      errors<true>(c, p, n, M, s, c.zero, &e_lo, &e_hi);
      const __m256 better = narrow_mask(_mm256_cmp_pd(e_lo, best_lo, _CMP_LT_OQ),
                                        _mm256_cmp_pd(e_hi, best_hi, _CMP_LT_OQ));
      best_s = _mm256_blendv_ps(best_s, s, better);
      const __m256 jv =
          _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(a.grid_len)));
      best_j = _mm256_blendv_ps(best_j, jv, better);
    }
  }
  alignas(32) float sv[kLanes], zv[kLanes];
  alignas(32) int32_t jv[kLanes];
  _mm256_store_ps(sv, best_s);
  _mm256_store_ps(zv, best_z);
  _mm256_store_si256(reinterpret_cast<__m256i*>(jv), _mm256_castps_si256(best_j));
  for (int l = 0; l < kLanes; ++l) store_choice(a, k, m + l, QtBlockQuant{sv[l], zv[l]}, jv[l]);
  if (a.out_values != nullptr) {
    write_values<Symmetric>(c, p, n, M, best_s, best_z, a.out_values + r0 * M + m);
  }
  return true;
}

inline bool columns(const BlockSearch& a, int64_t k, int64_t m0, int64_t m1) {
  const Consts c(a);
  bool ok = true;
  int64_t m = m0;
  for (; m + kLanes <= m1; m += kLanes) {
    ok = (a.symmetric ? strip<true>(a, c, k, m) : strip<false>(a, c, k, m)) && ok;
  }
  return scalar::columns(a, k, m, m1) && ok;
}

#undef QT_RN
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------------------------------- AVX-512
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")
#endif
namespace avx512 {

constexpr int kLanes = 16;
#define QT_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

struct Consts {
  __m512 qmin, qmax, range, min_scale, one, zero, sign;
  explicit Consts(const BlockSearch& a)
      : qmin(_mm512_set1_ps(a.qmin)),
        qmax(_mm512_set1_ps(a.qmax)),
        range(_mm512_set1_ps(a.qmax - a.qmin)),
        min_scale(_mm512_set1_ps(QT_BLOCK_MIN_SCALE)),
        one(_mm512_set1_ps(1.0f)),
        zero(_mm512_setzero_ps()),
        sign(_mm512_set1_ps(-0.0f)) {}
};

inline __m512 neg(__m512 v, __m512 sign) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_castps_si512(sign)));
}

inline void params(const Consts& c, bool symmetric, __m512 lo, __m512 hi, float factor,
                   __m512* scale, __m512* zero) {
  const __m512 f = _mm512_set1_ps(factor);
  const __m512 l = _mm512_mul_ps(lo, f), h = _mm512_mul_ps(hi, f);
  __m512 s = symmetric ? _mm512_max_ps(_mm512_div_ps(l, c.qmin), _mm512_div_ps(h, c.qmax))
                       : _mm512_div_ps(_mm512_sub_ps(h, l), c.range);
  const __mmask16 positive = _mm512_cmp_ps_mask(s, c.zero, _CMP_GT_OQ);
  s = _mm512_mask_blend_ps(positive, c.one, _mm512_max_ps(s, c.min_scale));
  *scale = s;
  if (symmetric) {
    *zero = c.zero;
  } else {
    const __m512 z = _mm512_roundscale_ps(_mm512_div_ps(neg(l, c.sign), s), QT_RN);
    *zero = _mm512_min_ps(_mm512_max_ps(z, c.qmin), c.qmax);
  }
}

// qt_block_signed_params on 16 columns.
inline __m512 signed_scale(const Consts& c, __m512 lo, __m512 hi) {
  const __mmask16 wider_high = _mm512_cmp_ps_mask(hi, neg(lo, c.sign), _CMP_GT_OQ);
  const __m512 s =
      _mm512_mask_blend_ps(wider_high, _mm512_div_ps(lo, c.qmin), _mm512_div_ps(hi, c.qmin));
  const __m512i bits = _mm512_castps_si512(s), sign = _mm512_castps_si512(c.sign);
  const __m512 m = _mm512_castsi512_ps(_mm512_andnot_si512(sign, bits));
  const __m512 floored = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(_mm512_max_ps(m, c.min_scale)), _mm512_and_si512(bits, sign)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, c.zero, _CMP_GT_OQ), c.one, floored);
}

template <bool Symmetric>
inline __attribute__((always_inline)) __m512 level(const Consts& c, __m512 v, __m512 s,
                                                   __m512 z) {
  __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v, s), QT_RN);
  if (!Symmetric) q = _mm512_add_ps(q, z);
  return _mm512_min_ps(_mm512_max_ps(q, c.qmin), c.qmax);
}

template <bool Symmetric>
inline void errors(const Consts& c, const float* p, int64_t n, int64_t M, __m512 s, __m512 z,
                   __m512d* out_lo, __m512d* out_hi) {
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (int64_t r = 0; r < n; ++r) {
    const __m512 v = _mm512_loadu_ps(p + r * M);
    const __m512 q = level<Symmetric>(c, v, s, z);
    const __m512 dq = Symmetric ? _mm512_mul_ps(q, s) : _mm512_mul_ps(_mm512_sub_ps(q, z), s);
    const __m512 d = _mm512_sub_ps(dq, v);
    const __m512d dl = _mm512_cvtps_pd(_mm512_castps512_ps256(d));
    const __m512d dh =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1)));
    lo = _mm512_fmadd_pd(dl, dl, lo);
    hi = _mm512_fmadd_pd(dh, dh, hi);
  }
  *out_lo = lo;
  *out_hi = hi;
}

template <bool Symmetric>
inline void write_values(const Consts& c, const float* p, int64_t n, int64_t M, __m512 s,
                         __m512 z, uint8_t* out) {
  for (int64_t r = 0; r < n; ++r) {
    const __m512i q = _mm512_cvtps_epi32(level<Symmetric>(c, _mm512_loadu_ps(p + r * M), s, z));
    // levels lie in [-128, 255]: the low byte is the int8 / uint8 value
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * M), _mm512_cvtepi32_epi8(q));
  }
}

template <bool Symmetric>
inline bool strip(const BlockSearch& a, const Consts& c, int64_t k, int64_t m) {
  int64_t r0 = 0;
  const int64_t n = block_rows(a, k, &r0);
  const int64_t M = a.columns;
  const float* p = a.x + r0 * M + m;
  __m512 lo = c.zero, hi = c.zero;
  __mmask16 bad = 0;
  for (int64_t r = 0; r < n; ++r) {
    const __m512 v = _mm512_loadu_ps(p + r * M);
    lo = _mm512_min_ps(v, lo);
    hi = _mm512_max_ps(v, hi);
    const __m512 d = _mm512_sub_ps(v, v);
    bad |= _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q);
  }
  if (bad != 0) return false;
  __m512 best_s, best_z;
  params(c, Symmetric, lo, hi, a.grid[0], &best_s, &best_z);
  __m512i best_j = _mm512_setzero_si512();
  if (a.grid_len > 1 || (Symmetric && a.signed_scales)) {
    __m512d best_lo, best_hi;
    errors<Symmetric>(c, p, n, M, best_s, best_z, &best_lo, &best_hi);
    for (int64_t j = 1; j < a.grid_len; ++j) {
      __m512 s, z;
      params(c, Symmetric, lo, hi, a.grid[j], &s, &z);
      __m512d e_lo, e_hi;
      errors<Symmetric>(c, p, n, M, s, z, &e_lo, &e_hi);
      const __mmask8 b_lo = _mm512_cmp_pd_mask(e_lo, best_lo, _CMP_LT_OQ);
      const __mmask8 b_hi = _mm512_cmp_pd_mask(e_hi, best_hi, _CMP_LT_OQ);
      const __mmask16 better = static_cast<__mmask16>(b_lo | (static_cast<unsigned>(b_hi) << 8));
      best_lo = _mm512_mask_blend_pd(b_lo, best_lo, e_lo);
      best_hi = _mm512_mask_blend_pd(b_hi, best_hi, e_hi);
      best_s = _mm512_mask_blend_ps(better, best_s, s);
      best_z = _mm512_mask_blend_ps(better, best_z, z);
      best_j = _mm512_mask_blend_epi32(better, best_j, _mm512_set1_epi32(static_cast<int32_t>(j)));
    }
    if (Symmetric && a.signed_scales) {
      const __m512 s = signed_scale(c, lo, hi);
      __m512d e_lo, e_hi;
      errors<true>(c, p, n, M, s, c.zero, &e_lo, &e_hi);
      const __mmask8 b_lo = _mm512_cmp_pd_mask(e_lo, best_lo, _CMP_LT_OQ);
      const __mmask8 b_hi = _mm512_cmp_pd_mask(e_hi, best_hi, _CMP_LT_OQ);
      const __mmask16 better = static_cast<__mmask16>(b_lo | (static_cast<unsigned>(b_hi) << 8));
      best_s = _mm512_mask_blend_ps(better, best_s, s);
      best_j = _mm512_mask_blend_epi32(better, best_j,
                                       _mm512_set1_epi32(static_cast<int32_t>(a.grid_len)));
    }
  }
  alignas(64) float sv[kLanes], zv[kLanes];
  alignas(64) int32_t jv[kLanes];
  _mm512_store_ps(sv, best_s);
  _mm512_store_ps(zv, best_z);
  _mm512_store_si512(jv, best_j);
  for (int l = 0; l < kLanes; ++l) store_choice(a, k, m + l, QtBlockQuant{sv[l], zv[l]}, jv[l]);
  if (a.out_values != nullptr) {
    write_values<Symmetric>(c, p, n, M, best_s, best_z, a.out_values + r0 * M + m);
  }
  return true;
}

inline bool columns(const BlockSearch& a, int64_t k, int64_t m0, int64_t m1) {
  const Consts c(a);
  bool ok = true;
  int64_t m = m0;
  for (; m + kLanes <= m1; m += kLanes) {
    ok = (a.symmetric ? strip<true>(a, c, k, m) : strip<false>(a, c, k, m)) && ok;
  }
  // 8-column strips for the rest, so a width that is a multiple of 8 stays vectorised
  return avx2::columns(a, k, m, m1) && ok;
}

#undef QT_RN
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // __x86_64__

}  // namespace qt

#endif  // QTOOL_CPU_BLOCK_SEARCH_H
