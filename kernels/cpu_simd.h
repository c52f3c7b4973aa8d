// Chunk kernels of the CPU backend, one set per instruction set: scalar (any CPU, ARM included),
// AVX2+FMA and AVX-512 (F+BW), the vector ones compiled with per-function target options and
// chosen at run time (cpu.cpp), so the library never needs -march=native.
//
// Every set gives results identical to the scalar reference (qt_minmax_step, qt_hist_bin):
//
// min / max: vector lanes use MINPS/MAXPS, whose `v < acc ? v : acc` is qt_minmax_step's test
// for finite values; vectors holding NaN/Inf take the scalar path. Only the sign of a zero result
// could depend on the lane that saw it, so lanes also collect sign bits and a zero result is made
// canonical (-0.0 if any -0.0 was seen for the minimum, +0.0 if any +0.0 for the maximum), which is
// what qt_less orders.
//
// Histogram bins, float path: when R = 2^k and nbins = 2^b (4 <= nbins <= 2^28), qt_hist_bin's
//   floor((double(v) + R) * nbins / (2R))
// equals, for every finite float v,
//   nbins/2 + floor(x + 2^(b-55)),  x = v * 2^(b-1-k)
// computed in float32, the sum rounded to nearest or toward -inf, or fused (FMA), then clamped:
//  - v * 2^(b-1-k) is a power-of-two scaling, exact unless it underflows; underflow needs
//    |v| < 2^(k-125-b), far below tau = 2^(k-54) (next point).
//  - in double, v + R is exact when 2^(k-28) <= |v| <= 2^(k+30) (at most 53 significant bits);
//    the scaling by nbins/(2R) is exact too, so both formulas are the exact floor. Beyond 2^(k+30)
//    both clamp to an edge bin. Below 2^(k-28) the double sum rounds, but the only bin edge within
//    reach is R itself: a negative v rounds up onto it (bin nbins/2 instead of nbins/2 - 1)
//    exactly when |v| <= tau = R * 2^-54 (half an ulp below R, ties to the even R).
//  - adding 2^(b-55) = tau scaled reproduces that: x in [-2^(b-55), 0) then lands on 0. Elsewhere
//    the bias is below half an ulp of any x within 1 of a nonzero integer (b < 29), so it cannot
//    carry x across an integer; and a nonzero exact sum keeps its sign when rounded.
// This was also checked exhaustively over all 2^32 float bit patterns for several (k, b) while
// writing it. Otherwise (R or nbins not a power of two) the double formula is vectorised as is:
// the same IEEE add and multiply in the same order, no FMA.
//
// Scatter: the counts are uint32 slots in `copies` interleaved copies (lane l adds to copy
// l % copies) so repeated bins do not serialise on one address; exact zeros (half of a Relu
// output) go to one slot per lane and are added to the zero's bin at the end. Indices are
// computed for 4 vectors before any count is stored: loads of the next input then do not wait for
// the address of a pending store (measured 3x on AMD Zen).
#ifndef QTOOL_CPU_SIMD_H
#define QTOOL_CPU_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "qt_math.h"

namespace qt {

constexpr int kMaxLanes = 16;

// Histogram geometry for one call, precomputed once.
struct BinParams {
  float half_range;  // R
  double scale;      // qt_hist_scale(nbins, R)
  int64_t nbins;
  int64_t zero_bin;  // qt_hist_bin(0.0f): where the per-lane zero slots are added
  bool float_path;   // R and nbins powers of two with the float formula valid (header comment)
  float f_scale;     // 2^(b-1-k)
  float f_bias;      // 2^(b-55)
  float f_half;      // nbins / 2
  int32_t half;      // nbins / 2
  int32_t last;      // nbins - 1
  bool vector_ok;    // nbins small enough for int32 lane indices
};

// Per-worker uint32 counts: `copies` copies of `stride` slots; slot [0, nbins) are bins, slot
// nbins counts values the speculative kernel could not bin (non-finite, |v| >= R), slots
// nbins + 1 + lane count exact zeros of that lane.
struct LocalHist {
  uint32_t* slots;
  int64_t stride;
  int copies;
};

inline int64_t overflow_count(const BinParams& p, const LocalHist& h) {
  int64_t total = 0;
  for (int c = 0; c < h.copies; ++c) total += h.slots[c * h.stride + p.nbins];
  return total;
}

// Min/max of finite values with plain comparisons plus sign flags, made canonical at the end
// (the same answer as qt_minmax_step's total order, without its per-element zero test).
struct ScalarMinMax {
  float mn = INFINITY, mx = -INFINITY;
  int64_t nonfinite = 0;
  uint32_t neg = 0, pos = 0;  // a finite value with the sign bit set / clear was seen

  void step(float v) {
    if (!qt_isfinite(v)) {
      ++nonfinite;
      return;
    }
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    neg |= bits >> 31;
    pos |= (bits >> 31) ^ 1u;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }

  // Merges into `acc` in qt_less order.
  void finish_into(QtMinMax& acc) const {
    QtMinMax r;
    r.mn = mn == 0.0f ? (neg ? -0.0f : 0.0f) : mn;
    r.mx = mx == 0.0f ? (pos ? 0.0f : -0.0f) : mx;
    r.nonfinite = nonfinite;
    qt_minmax_merge(acc, r);
  }
};

inline void scalar_minmax(const float* x, int64_t n, QtMinMax& acc) {
  ScalarMinMax m;
  for (int64_t i = 0; i < n; ++i) m.step(x[i]);
  m.finish_into(acc);
}

// Exact scalar min/max + histogram of x[0:n] into copy 0 (reference, tails, NaN vectors). Bins of
// 16 values are computed before any is counted: a load that follows a pending store with an
// unknown address waits for it on some CPUs (AMD Zen), which would chain every element.
inline void scalar_observe(const float* x, int64_t n, const BinParams& p, uint32_t* slots,
                           QtMinMax& acc) {
  constexpr int kBatch = 16;
  ScalarMinMax m;
  int64_t bins[kBatch];
  for (int64_t i = 0; i < n; i += kBatch) {
    const int len = static_cast<int>(n - i < kBatch ? n - i : kBatch);
    for (int j = 0; j < len; ++j) {
      const float v = x[i + j];
      m.step(v);
      bins[j] = qt_hist_bin(v, p.half_range, p.scale, p.nbins);
    }
    __asm__ __volatile__("" ::: "memory");
    for (int j = 0; j < len; ++j) {
      if (bins[j] >= 0) slots[bins[j]] += 1;
    }
  }
  m.finish_into(acc);
}

// Lane minima/maxima of finite values plus their sign bits -> one canonical QtMinMax.
inline QtMinMax lanes_finish(const float* mn, const float* mx, int lanes, uint32_t neg_any,
                             uint32_t neg_all, uint32_t all_mask) {
  QtMinMax r = qt_minmax_init();
  for (int l = 0; l < lanes; ++l) {
    r.mn = mn[l] < r.mn ? mn[l] : r.mn;
    r.mx = mx[l] > r.mx ? mx[l] : r.mx;
  }
  if (r.mn == 0.0f) r.mn = neg_any != 0 ? -0.0f : 0.0f;
  if (r.mx == 0.0f) r.mx = neg_all != all_mask ? 0.0f : -0.0f;
  return r;
}

namespace scalar {

inline QtMinMax minmax(const float* x, int64_t n) {
  QtMinMax acc = qt_minmax_init();
  scalar_minmax(x, n, acc);
  return acc;
}

inline void observe_exact(const float* x, int64_t n, const BinParams& p, LocalHist& h,
                          QtMinMax* out) {
  QtMinMax acc = qt_minmax_init();
  scalar_observe(x, n, p, h.slots, acc);
  *out = acc;
}

// The scalar kernel is exact, so the speculative entry point is the exact one.
inline bool observe_fast(const float* x, int64_t n, const BinParams& p, LocalHist& h,
                         QtMinMax* out) {
  observe_exact(x, n, p, h, out);
  return true;
}

}  // namespace scalar

#if defined(__x86_64__)

#define QT_COMPILER_BARRIER() __asm__ __volatile__("" ::: "memory")

// ------------------------------------------------------------------------------------------- AVX2
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {

constexpr int W = 8;
constexpr int kUnroll = 4;

// Rounding toward -inf for CVTPS2DQ (floor) and the FMA in the speculative kernel; restored on
// scope exit so no other code runs under it.
// The asm statements are memory barriers: the loop's loads and stores, and so all arithmetic
// between them, stay inside the region (plain _mm_setcsr does not order arithmetic).
struct RoundDown {
  unsigned saved;
  static void load(unsigned v) { __asm__ __volatile__("vldmxcsr %0" : : "m"(v) : "memory"); }
  RoundDown() {
    __asm__ __volatile__("vstmxcsr %0" : "=m"(saved) : : "memory");
    load((saved & ~0x6000u) | 0x2000u);
  }
  ~RoundDown() { load(saved); }
};

// Slot offset of each lane's copy (lane l counts into copy l % C), added to the bin indices.
template <int C>
inline __m256i lane_offsets(int64_t s) {
  const int32_t o = static_cast<int32_t>(s);
  return _mm256_setr_epi32(0, (1 % C) * o, (2 % C) * o, (3 % C) * o, (4 % C) * o, (5 % C) * o,
                           (6 % C) * o, (7 % C) * o);
}

// One increment per lane; idx already holds the copy offsets.
inline __attribute__((always_inline)) void scatter(__m256i idx, uint32_t* base) {
  const __m128i lo = _mm256_castsi256_si128(idx);
  const __m128i hi = _mm256_extracti128_si256(idx, 1);
  const uint64_t a = (uint64_t)_mm_cvtsi128_si64(lo), b = (uint64_t)_mm_extract_epi64(lo, 1);
  const uint64_t c = (uint64_t)_mm_cvtsi128_si64(hi), d = (uint64_t)_mm_extract_epi64(hi, 1);
  base[(uint32_t)a] += 1;
  base[a >> 32] += 1;
  base[(uint32_t)b] += 1;
  base[b >> 32] += 1;
  base[(uint32_t)c] += 1;
  base[c >> 32] += 1;
  base[(uint32_t)d] += 1;
  base[d >> 32] += 1;
}

inline QtMinMax finish(__m256 mn, __m256 mx, uint32_t neg_any, uint32_t neg_all) {
  float a[W], b[W];
  _mm256_storeu_ps(a, mn);
  _mm256_storeu_ps(b, mx);
  return lanes_finish(a, b, W, neg_any, neg_all, 0xffu);
}

inline QtMinMax minmax(const float* x, int64_t n) {
  __m256 mn0 = _mm256_set1_ps(INFINITY), mn1 = mn0;
  __m256 mx0 = _mm256_set1_ps(-INFINITY), mx1 = mx0;
  uint32_t neg_any = 0, neg_all = 0xffu;
  QtMinMax slow = qt_minmax_init();
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + W);
    // v - v is NaN exactly for NaN and +-Inf; the sum is NaN if either is
    const __m256 d = _mm256_add_ps(_mm256_sub_ps(v0, v0), _mm256_sub_ps(v1, v1));
    if (_mm256_movemask_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q)) != 0) {
      scalar_minmax(x + i, 2 * W, slow);
      continue;
    }
    mn0 = _mm256_min_ps(v0, mn0);
    mn1 = _mm256_min_ps(v1, mn1);
    mx0 = _mm256_max_ps(v0, mx0);
    mx1 = _mm256_max_ps(v1, mx1);
    neg_any |= (uint32_t)_mm256_movemask_ps(_mm256_or_ps(v0, v1));
    neg_all &= (uint32_t)_mm256_movemask_ps(_mm256_and_ps(v0, v1));
  }
  scalar_minmax(x + i, n - i, slow);
  QtMinMax r = finish(_mm256_min_ps(mn0, mn1), _mm256_max_ps(mx0, mx1), neg_any, neg_all);
  qt_minmax_merge(r, slow);
  return r;
}

// Speculative fused min/max + histogram for the observer's common case (every |v| < R, all
// finite). Values it cannot bin land in the overflow slot; it then returns false and `out` is not
// exact (the caller discards the histogram and recomputes min/max).
template <int C>
bool observe_fast_c(const float* x, int64_t n, const BinParams& p, LocalHist& h, QtMinMax* out) {
  uint32_t* base = h.slots;
  const int64_t s = h.stride;
  const int64_t before = overflow_count(p, h);
  const __m256 scale = _mm256_set1_ps(p.f_scale), bias = _mm256_set1_ps(p.f_bias);
  const __m256 zero = _mm256_setzero_ps();
  const __m256i half = _mm256_set1_epi32(p.half), over = _mm256_set1_epi32((int32_t)p.nbins);
  const __m256i offsets = lane_offsets<C>(s);
  const __m256i zslot = _mm256_add_epi32(
      _mm256_set1_epi32((int32_t)p.nbins + 1),
      _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), offsets));
  __m256 mn = _mm256_set1_ps(INFINITY), mx = _mm256_set1_ps(-INFINITY);
  uint32_t neg_any = 0, neg_all = 0xffu;
  int64_t i = 0;
  {
    RoundDown rd;
    for (; i + kUnroll * W <= n; i += kUnroll * W) {
      __m256i idx[kUnroll];
      for (int u = 0; u < kUnroll; ++u) {
        const __m256 v = _mm256_loadu_ps(x + i + u * W);
        mn = _mm256_min_ps(v, mn);
        mx = _mm256_max_ps(v, mx);
        const uint32_t m = (uint32_t)_mm256_movemask_ps(v);
        neg_any |= m;
        neg_all &= m;
        // floor(x + bias) under round-down; NaN/Inf/huge convert to INT_MIN -> overflow slot
        const __m256i k = _mm256_cvtps_epi32(_mm256_fmadd_ps(v, scale, bias));
        __m256i bin = _mm256_min_epu32(_mm256_add_epi32(k, half), over);
        if (C > 1) bin = _mm256_add_epi32(bin, offsets);
        const __m256 is_zero = _mm256_cmp_ps(v, zero, _CMP_EQ_OQ);
        idx[u] = _mm256_blendv_epi8(bin, zslot, _mm256_castps_si256(is_zero));
      }
      QT_COMPILER_BARRIER();
      for (int u = 0; u < kUnroll; ++u) scatter(idx[u], base);
    }
  }
  QtMinMax r = finish(mn, mx, neg_any, neg_all);
  QtMinMax tail = qt_minmax_init();
  scalar_observe(x + i, n - i, p, base, tail);
  qt_minmax_merge(r, tail);
  *out = r;
  return overflow_count(p, h) == before;
}

// Exact fused min/max + histogram for any input: non-finite values are counted and skipped (their
// vectors go through the scalar code), out-of-range values clamp into the edge bins.
template <int C, bool FloatPath>
void observe_exact_c(const float* x, int64_t n, const BinParams& p, LocalHist& h, QtMinMax* out) {
  uint32_t* base = h.slots;
  const int64_t s = h.stride;
  const __m256 scale = _mm256_set1_ps(p.f_scale), bias = _mm256_set1_ps(p.f_bias);
  const __m256 fhalf = _mm256_set1_ps(p.f_half), nfhalf = _mm256_set1_ps(-p.f_half);
  const __m256 zero = _mm256_setzero_ps();
  const __m256d r = _mm256_set1_pd((double)p.half_range), sc = _mm256_set1_pd(p.scale);
  const __m256d dzero = _mm256_setzero_pd(), dlast = _mm256_set1_pd((double)p.last);
  const __m256i half = _mm256_set1_epi32(p.half), last = _mm256_set1_epi32(p.last);
  const __m256i offsets = lane_offsets<C>(s);
  const __m256i zslot = _mm256_add_epi32(
      _mm256_set1_epi32((int32_t)p.nbins + 1),
      _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), offsets));
  __m256 mn = _mm256_set1_ps(INFINITY), mx = _mm256_set1_ps(-INFINITY);
  uint32_t neg_any = 0, neg_all = 0xffu;
  QtMinMax slow = qt_minmax_init();
  int64_t i = 0;
  for (; i + kUnroll * W <= n; i += kUnroll * W) {
    __m256 v[kUnroll];
    __m256 d = zero;
    for (int u = 0; u < kUnroll; ++u) {
      v[u] = _mm256_loadu_ps(x + i + u * W);
      d = _mm256_add_ps(d, _mm256_sub_ps(v[u], v[u]));
    }
    if (_mm256_movemask_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q)) != 0) {
      scalar_observe(x + i, kUnroll * W, p, base, slow);
      continue;
    }
    __m256i idx[kUnroll];
    for (int u = 0; u < kUnroll; ++u) {
      mn = _mm256_min_ps(v[u], mn);
      mx = _mm256_max_ps(v[u], mx);
      const uint32_t m = (uint32_t)_mm256_movemask_ps(v[u]);
      neg_any |= m;
      neg_all &= m;
      __m256i bin;
      if (FloatPath) {
        __m256 t = _mm256_fmadd_ps(v[u], scale, bias);
        t = _mm256_min_ps(_mm256_max_ps(t, nfhalf), fhalf);
        bin = _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_floor_ps(t)), half);
      } else {
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v[u]));
        __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v[u], 1));
        lo = _mm256_mul_pd(_mm256_add_pd(lo, r), sc);
        hi = _mm256_mul_pd(_mm256_add_pd(hi, r), sc);
        lo = _mm256_min_pd(_mm256_max_pd(lo, dzero), dlast);
        hi = _mm256_min_pd(_mm256_max_pd(hi, dzero), dlast);
        bin = _mm256_set_m128i(_mm256_cvttpd_epi32(hi), _mm256_cvttpd_epi32(lo));
      }
      bin = _mm256_min_epi32(bin, last);
      if (C > 1) bin = _mm256_add_epi32(bin, offsets);
      const __m256 is_zero = _mm256_cmp_ps(v[u], zero, _CMP_EQ_OQ);
      idx[u] = _mm256_blendv_epi8(bin, zslot, _mm256_castps_si256(is_zero));
    }
    QT_COMPILER_BARRIER();
    for (int u = 0; u < kUnroll; ++u) scatter(idx[u], base);
  }
  scalar_observe(x + i, n - i, p, base, slow);
  QtMinMax res = finish(mn, mx, neg_any, neg_all);
  qt_minmax_merge(res, slow);
  *out = res;
}

inline bool observe_fast(const float* x, int64_t n, const BinParams& p, LocalHist& h,
                         QtMinMax* out) {
  return h.copies == 4 ? observe_fast_c<4>(x, n, p, h, out) : observe_fast_c<1>(x, n, p, h, out);
}

inline void observe_exact(const float* x, int64_t n, const BinParams& p, LocalHist& h,
                          QtMinMax* out) {
  if (!p.vector_ok) return scalar::observe_exact(x, n, p, h, out);
  if (p.float_path) {
    if (h.copies == 4) return observe_exact_c<4, true>(x, n, p, h, out);
    return observe_exact_c<1, true>(x, n, p, h, out);
  }
  if (h.copies == 4) return observe_exact_c<4, false>(x, n, p, h, out);
  return observe_exact_c<1, false>(x, n, p, h, out);
}

}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------------------------------- AVX-512
// The same kernels on 16 lanes. Rounding is embedded in the instructions (no MXCSR change); the
// scatter stores the indices and adds them with scalar code.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")
#endif
namespace avx512 {

constexpr int W = 16;
constexpr int kUnroll = 4;
#define QT_RD (_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)

inline uint32_t sign_mask(__m512 v) {
  return (uint32_t)_mm512_cmplt_epi32_mask(_mm512_castps_si512(v), _mm512_setzero_si512());
}

inline uint32_t nonfinite_mask(__m512 v) {
  const __m512 d = _mm512_sub_ps(v, v);
  return (uint32_t)_mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q);
}

template <int C>
inline __m512i lane_offsets(int64_t s) {
  const int32_t o = static_cast<int32_t>(s);
  return _mm512_setr_epi32(0, (1 % C) * o, (2 % C) * o, (3 % C) * o, (4 % C) * o, (5 % C) * o,
                           (6 % C) * o, (7 % C) * o, (8 % C) * o, (9 % C) * o, (10 % C) * o,
                           (11 % C) * o, (12 % C) * o, (13 % C) * o, (14 % C) * o,
                           (15 % C) * o);
}

// One increment per lane; idx already holds the copy offsets.
inline __attribute__((always_inline)) void scatter(const int32_t* idx, uint32_t* base) {
  for (int l = 0; l < W; ++l) base[idx[l]] += 1;
}

inline QtMinMax finish(__m512 mn, __m512 mx, uint32_t neg_any, uint32_t neg_all) {
  float a[W], b[W];
  _mm512_storeu_ps(a, mn);
  _mm512_storeu_ps(b, mx);
  return lanes_finish(a, b, W, neg_any, neg_all, 0xffffu);
}

inline __m512i zero_slots(const BinParams& p, __m512i offsets) {
  const __m512i lanes =
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_add_epi32(_mm512_set1_epi32((int32_t)p.nbins + 1),
                          _mm512_add_epi32(lanes, offsets));
}

inline QtMinMax minmax(const float* x, int64_t n) {
  __m512 mn0 = _mm512_set1_ps(INFINITY), mn1 = mn0;
  __m512 mx0 = _mm512_set1_ps(-INFINITY), mx1 = mx0;
  uint32_t neg_any = 0, neg_all = 0xffffu;
  QtMinMax slow = qt_minmax_init();
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + W);
    if ((nonfinite_mask(v0) | nonfinite_mask(v1)) != 0) {
      scalar_minmax(x + i, 2 * W, slow);
      continue;
    }
    mn0 = _mm512_min_ps(v0, mn0);
    mn1 = _mm512_min_ps(v1, mn1);
    mx0 = _mm512_max_ps(v0, mx0);
    mx1 = _mm512_max_ps(v1, mx1);
    const uint32_t s0 = sign_mask(v0), s1 = sign_mask(v1);
    neg_any |= s0 | s1;
    neg_all &= s0 & s1;
  }
  scalar_minmax(x + i, n - i, slow);
  QtMinMax r = finish(_mm512_min_ps(mn0, mn1), _mm512_max_ps(mx0, mx1), neg_any, neg_all);
  qt_minmax_merge(r, slow);
  return r;
}

template <int C>
bool observe_fast_c(const float* x, int64_t n, const BinParams& p, LocalHist& h, QtMinMax* out) {
  uint32_t* base = h.slots;
  const int64_t s = h.stride;
  const int64_t before = overflow_count(p, h);
  const __m512 scale = _mm512_set1_ps(p.f_scale), bias = _mm512_set1_ps(p.f_bias);
  const __m512 zero = _mm512_setzero_ps();
  const __m512i half = _mm512_set1_epi32(p.half), over = _mm512_set1_epi32((int32_t)p.nbins);
  const __m512i offsets = lane_offsets<C>(s);
  const __m512i zslot = zero_slots(p, offsets);
  __m512 mn = _mm512_set1_ps(INFINITY), mx = _mm512_set1_ps(-INFINITY);
  uint32_t neg_any = 0, neg_all = 0xffffu;
  alignas(64) int32_t idx[kUnroll * W];
  int64_t i = 0;
  for (; i + kUnroll * W <= n; i += kUnroll * W) {
    for (int u = 0; u < kUnroll; ++u) {
      const __m512 v = _mm512_loadu_ps(x + i + u * W);
      mn = _mm512_min_ps(v, mn);
      mx = _mm512_max_ps(v, mx);
      const uint32_t m = sign_mask(v);
      neg_any |= m;
      neg_all &= m;
      const __m512 t = _mm512_fmadd_round_ps(v, scale, bias, QT_RD);
      const __m512i k = _mm512_cvt_roundps_epi32(t, QT_RD);
      __m512i bin = _mm512_min_epu32(_mm512_add_epi32(k, half), over);
      if (C > 1) bin = _mm512_add_epi32(bin, offsets);
      const __mmask16 is_zero = _mm512_cmp_ps_mask(v, zero, _CMP_EQ_OQ);
      _mm512_store_si512(idx + u * W, _mm512_mask_mov_epi32(bin, is_zero, zslot));
    }
    for (int u = 0; u < kUnroll; ++u) scatter(idx + u * W, base);
  }
  QtMinMax r = finish(mn, mx, neg_any, neg_all);
  QtMinMax tail = qt_minmax_init();
  scalar_observe(x + i, n - i, p, base, tail);
  qt_minmax_merge(r, tail);
  *out = r;
  return overflow_count(p, h) == before;
}

template <int C, bool FloatPath>
void observe_exact_c(const float* x, int64_t n, const BinParams& p, LocalHist& h, QtMinMax* out) {
  uint32_t* base = h.slots;
  const int64_t s = h.stride;
  const __m512 scale = _mm512_set1_ps(p.f_scale), bias = _mm512_set1_ps(p.f_bias);
  const __m512 fhalf = _mm512_set1_ps(p.f_half), nfhalf = _mm512_set1_ps(-p.f_half);
  const __m512 zero = _mm512_setzero_ps();
  const __m512d r = _mm512_set1_pd((double)p.half_range), sc = _mm512_set1_pd(p.scale);
  const __m512d dzero = _mm512_setzero_pd(), dlast = _mm512_set1_pd((double)p.last);
  const __m512i half = _mm512_set1_epi32(p.half), last = _mm512_set1_epi32(p.last);
  const __m512i offsets = lane_offsets<C>(s);
  const __m512i zslot = zero_slots(p, offsets);
  __m512 mn = _mm512_set1_ps(INFINITY), mx = _mm512_set1_ps(-INFINITY);
  uint32_t neg_any = 0, neg_all = 0xffffu;
  QtMinMax slow = qt_minmax_init();
  alignas(64) int32_t idx[kUnroll * W];
  int64_t i = 0;
  for (; i + kUnroll * W <= n; i += kUnroll * W) {
    __m512 v[kUnroll];
    uint32_t bad = 0;
    for (int u = 0; u < kUnroll; ++u) {
      v[u] = _mm512_loadu_ps(x + i + u * W);
      bad |= nonfinite_mask(v[u]);
    }
    if (bad != 0) {
      scalar_observe(x + i, kUnroll * W, p, base, slow);
      continue;
    }
    for (int u = 0; u < kUnroll; ++u) {
      mn = _mm512_min_ps(v[u], mn);
      mx = _mm512_max_ps(v[u], mx);
      const uint32_t m = sign_mask(v[u]);
      neg_any |= m;
      neg_all &= m;
      __m512i bin;
      if (FloatPath) {
        __m512 t = _mm512_fmadd_ps(v[u], scale, bias);
        t = _mm512_min_ps(_mm512_max_ps(t, nfhalf), fhalf);
        bin = _mm512_add_epi32(_mm512_cvt_roundps_epi32(t, QT_RD), half);
      } else {
        const __m256 vlo = _mm512_castps512_ps256(v[u]);
        const __m256 vhi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[u]), 1));
        __m512d lo = _mm512_mul_pd(_mm512_add_pd(_mm512_cvtps_pd(vlo), r), sc);
        __m512d hi = _mm512_mul_pd(_mm512_add_pd(_mm512_cvtps_pd(vhi), r), sc);
        lo = _mm512_min_pd(_mm512_max_pd(lo, dzero), dlast);
        hi = _mm512_min_pd(_mm512_max_pd(hi, dzero), dlast);
        bin = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvttpd_epi32(lo)),
                                 _mm512_cvttpd_epi32(hi), 1);
      }
      bin = _mm512_min_epi32(bin, last);
      if (C > 1) bin = _mm512_add_epi32(bin, offsets);
      const __mmask16 is_zero = _mm512_cmp_ps_mask(v[u], zero, _CMP_EQ_OQ);
      _mm512_store_si512(idx + u * W, _mm512_mask_mov_epi32(bin, is_zero, zslot));
    }
    for (int u = 0; u < kUnroll; ++u) scatter(idx + u * W, base);
  }
  scalar_observe(x + i, n - i, p, base, slow);
  QtMinMax res = finish(mn, mx, neg_any, neg_all);
  qt_minmax_merge(res, slow);
  *out = res;
}
#undef QT_RD

inline bool observe_fast(const float* x, int64_t n, const BinParams& p, LocalHist& h,
                         QtMinMax* out) {
  return h.copies == 4 ? observe_fast_c<4>(x, n, p, h, out) : observe_fast_c<1>(x, n, p, h, out);
}

inline void observe_exact(const float* x, int64_t n, const BinParams& p, LocalHist& h,
                          QtMinMax* out) {
  if (!p.vector_ok) return scalar::observe_exact(x, n, p, h, out);
  if (p.float_path) {
    if (h.copies == 4) return observe_exact_c<4, true>(x, n, p, h, out);
    return observe_exact_c<1, true>(x, n, p, h, out);
  }
  if (h.copies == 4) return observe_exact_c<4, false>(x, n, p, h, out);
  return observe_exact_c<1, false>(x, n, p, h, out);
}

}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#undef QT_COMPILER_BARRIER
#endif  // __x86_64__

}  // namespace qt

#endif  // QTOOL_CPU_SIMD_H
