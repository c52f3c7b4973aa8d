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
// Counting (one design for every vector set, kernels/cpu_simd_body.inc): bins are computed for 4
// vectors, then extracted to general registers and counted with one increment each into uint16
// staging slots. What limits the speed is the increments, not the arithmetic (the same loop
// without them runs at ~6.5 G elements/s per core on AMD Zen 4), so:
//  - `copies` interleaved copies (lane l counts into copy l % copies, its offset added to the
//    lane's index): runs of equal bins (constant tensors, discrete values, heavy tails) then do
//    not chain every increment on one address (a store-to-load round trip each). More copies
//    cost L1 space, so each block of 32768 * copies elements picks them
//    from the block before (copies_for_peak): 8 when its fullest bin held over 1/32 of it, 4 over
//    1/256, else 2. Measured on Zen 4, 10^8 elements, G elements per CPU-second: t4 data
//    (R = 256) 1.8 / 2.0 / 2.2 with 2 / 4 / 8 copies, uniform over the range 2.2 / 1.45 / -,
//    normal 2.2-2.4 with 2 or 4;
//  - uint16 slots, so 4 copies of 4096 bins take 32 KB, not 64 (4 uint32 copies: 1.7 G/s on
//    normal data against 2.4). They are flushed into the thread's int64 counts after every block
//    (no slot can pass 32768; tails and vectors holding NaN/Inf are counted straight into the
//    int64 counts by scalar_observe), only over the bins the block's min/max can reach;
//  - exact zeros (half of a Relu output) count into a slot per lane and unrolled vector, added to
//    the zero's bin at the flush, so they never chain either;
//  - bins of 4 vectors are computed before any is counted: a load that follows a pending store
//    whose address is unknown waits for it on some CPUs (AMD Zen), which would chain every element.
// The speculative kernel checks its overflow slot at every flush and stops at the first block
// holding a value it cannot bin (the caller then drops the counts and only needs min/max).
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
constexpr int kUnroll = 4;  // vectors whose bins are computed before any is counted
// Zero slots per copy: one per (unrolled vector, lane) position.
constexpr int kZeroSlots = kUnroll * kMaxLanes;
// Elements per copy between two flushes of the uint16 staging slots: no slot can exceed it.
constexpr int64_t kFlushPerCopy = int64_t(1) << 15;
// Copies of the staging slots, chosen per block from the share of the block's fullest bin
// (header comment): 8 above 1/32, 4 above 1/256, else 2; a large call starts with 4.
constexpr int kMaxCopies = 8;
constexpr int kFirstCopies = 4;

inline int copies_for_peak(int64_t peak, int64_t block) {
  return peak * 32 > block ? 8 : (peak * 256 > block ? 4 : 2);
}

// Histogram geometry for one call, precomputed once.
struct BinParams {
  float half_range;  // R
  double scale;      // qt_hist_scale(nbins, R)
  int64_t nbins;
  int64_t zero_bin;  // qt_hist_bin(0.0f): where the zero slots are added
  bool float_path;   // R and nbins powers of two with the float formula valid (header comment)
  float f_scale;     // 2^(b-1-k)
  float f_bias;      // 2^(b-55)
  float f_half;      // nbins / 2
  int32_t half;      // nbins / 2
  int32_t last;      // nbins - 1
  bool vector_ok;    // nbins small enough for int32 lane indices
};

// One worker's counts. `stage`: up to `copies` copies of `stride` uint16 slots, all zero between
// flushes: slots [0, nbins) are bins, slot nbins counts values the speculative kernel could not
// bin (non-finite, |v| >= R), slots nbins + 1 + (u * kMaxLanes + lane) count exact zeros.
// `active` copies are in use (chosen per block). `counts`: nbins int64, zero outside [lo, hi],
// so a call only adds and clears the bins it used.
struct LocalHist {
  uint16_t* stage;
  int64_t stride;
  int copies;
  int active;
  int64_t* counts;
  int64_t lo, hi;  // lo > hi: no count yet

  void touch(int64_t a, int64_t b) {
    lo = a < lo ? a : lo;
    hi = b > hi ? b : hi;
  }
};

inline int64_t stage_stride(int64_t nbins) { return (nbins + 1 + kZeroSlots + 31) / 32 * 32; }

// Bins that finite values in [mn, mx] can land in (both formulas are monotonic in v); none when
// mn > mx, the edges for infinite ends.
inline void bin_span(const BinParams& p, float mn, float mx, int64_t* lo, int64_t* hi) {
  if (!(mn <= mx)) {
    *lo = 1;
    *hi = 0;
    return;
  }
  *lo = qt_isfinite(mn) ? qt_hist_bin(mn, p.half_range, p.scale, p.nbins) : 0;
  *hi = qt_isfinite(mx) ? qt_hist_bin(mx, p.half_range, p.scale, p.nbins) : p.nbins - 1;
}

struct Flushed {
  int64_t overflow;  // values the speculative kernel could not bin
  int64_t peak;      // the fullest bin's count
};

// Moves the staged counts of bins [lo, hi] and of the zero slots into h.counts and clears them.
// C copies at h.stage + c * h.stride.
template <int C>
inline Flushed flush_stage(const BinParams& p, LocalHist& h, int64_t lo, int64_t hi) {
  uint16_t* const s = h.stage;
  const int64_t st = h.stride;
  uint32_t peak = 0;
  for (int64_t j = lo; j <= hi; ++j) {
    uint32_t sum = 0;
    for (int c = 0; c < C; ++c) {
      sum += s[c * st + j];
      s[c * st + j] = 0;
    }
    h.counts[j] += sum;
    peak = sum > peak ? sum : peak;
  }
  if (lo <= hi) h.touch(lo, hi);
  int64_t zeros = 0, overflow = 0;
  for (int c = 0; c < C; ++c) {
    uint16_t* row = s + c * st;
    overflow += row[p.nbins];
    row[p.nbins] = 0;
    for (int z = 0; z < kZeroSlots; ++z) {
      zeros += row[p.nbins + 1 + z];
      row[p.nbins + 1 + z] = 0;
    }
  }
  if (zeros != 0) {
    h.counts[p.zero_bin] += zeros;
    h.touch(p.zero_bin, p.zero_bin);
  }
  return Flushed{overflow, peak};
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

// Exact scalar min/max + histogram of x[0:n], counted straight into h.counts (reference, tails,
// vectors holding NaN/Inf). Bins of 16 values are computed before any is counted (see the
// header comment).
inline void scalar_observe(const float* x, int64_t n, const BinParams& p, LocalHist& h,
                           QtMinMax& acc) {
  constexpr int kBatch = 16;
  ScalarMinMax m;
  int64_t bins[kBatch];
  int64_t lo = p.nbins, hi = -1;
  for (int64_t i = 0; i < n; i += kBatch) {
    const int len = static_cast<int>(n - i < kBatch ? n - i : kBatch);
    for (int j = 0; j < len; ++j) {
      const float v = x[i + j];
      m.step(v);
      bins[j] = qt_hist_bin(v, p.half_range, p.scale, p.nbins);
    }
    __asm__ __volatile__("" ::: "memory");
    for (int j = 0; j < len; ++j) {
      const int64_t b = bins[j];
      if (b < 0) continue;
      h.counts[b] += 1;
      lo = b < lo ? b : lo;
      hi = b > hi ? b : hi;
    }
  }
  if (lo <= hi) h.touch(lo, hi);
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
  scalar_observe(x, n, p, h, acc);
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

// ------------------------------------------------------------------------------------------- AVX2
// The vector operations the shared kernel body needs (cpu_simd_body.inc), on 8 lanes.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {

struct Vec {
  static constexpr int W = 8;
  using F = __m256;
  using I = __m256i;

  // Rounding toward -inf for CVTPS2DQ (floor) and the FMA of the speculative bins; restored on
  // scope exit so no other code runs under it. The asm statements are memory barriers: the
  // loop's loads and stores, and so all arithmetic between them, stay inside the region (plain
  // _mm_setcsr does not order arithmetic).
  struct FastScope {
    unsigned saved;
    static void load(unsigned v) { __asm__ __volatile__("vldmxcsr %0" : : "m"(v) : "memory"); }
    FastScope() {
      __asm__ __volatile__("vstmxcsr %0" : "=m"(saved) : : "memory");
      load((saved & ~0x6000u) | 0x2000u);
    }
    ~FastScope() { load(saved); }
  };

  // Broadcast constants of one call.
  struct Consts {
    F scale, bias, fhalf, nfhalf, zero;
    __m256d r, sc, dzero, dlast;
    I half, last, over;
    explicit Consts(const BinParams& p)
        : scale(_mm256_set1_ps(p.f_scale)),
          bias(_mm256_set1_ps(p.f_bias)),
          fhalf(_mm256_set1_ps(p.f_half)),
          nfhalf(_mm256_set1_ps(-p.f_half)),
          zero(_mm256_setzero_ps()),
          r(_mm256_set1_pd((double)p.half_range)),
          sc(_mm256_set1_pd(p.scale)),
          dzero(_mm256_setzero_pd()),
          dlast(_mm256_set1_pd((double)p.last)),
          half(_mm256_set1_epi32(p.half)),
          last(_mm256_set1_epi32(p.last)),
          over(_mm256_set1_epi32((int32_t)p.nbins)) {}
  };

  static F load(const float* x) { return _mm256_loadu_ps(x); }
  static F splat(float v) { return _mm256_set1_ps(v); }
  static F all_ones() { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }
  // MINPS/MAXPS return the second operand when either is NaN: a NaN v never enters acc.
  static F min(F v, F acc) { return _mm256_min_ps(v, acc); }
  static F max(F v, F acc) { return _mm256_max_ps(v, acc); }
  static F bit_or(F a, F b) { return _mm256_or_ps(a, b); }
  static F bit_and(F a, F b) { return _mm256_and_ps(a, b); }
  static uint32_t sign_bits(F v) { return (uint32_t)_mm256_movemask_ps(v); }
  // v - v is NaN exactly for NaN and +-Inf; sums of such terms stay NaN.
  static F nan_probe(F acc, F v) { return _mm256_add_ps(acc, _mm256_sub_ps(v, v)); }
  static bool any_nan(F d) { return _mm256_movemask_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q)) != 0; }

  // Speculative float bins (under FastScope): floor(x + bias), NaN/Inf/|v| >= R -> nbins.
  static I fast_bins(const Consts& c, F v) {
    const I k = _mm256_cvtps_epi32(_mm256_fmadd_ps(v, c.scale, c.bias));
    return _mm256_min_epu32(_mm256_add_epi32(k, c.half), c.over);
  }
  // Exact bins of finite values: the float formula rounded to nearest, clamped, floored...
  static I float_bins(const Consts& c, F v) {
    F t = _mm256_fmadd_ps(v, c.scale, c.bias);
    t = _mm256_min_ps(_mm256_max_ps(t, c.nfhalf), c.fhalf);
    const I bin = _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_floor_ps(t)), c.half);
    return _mm256_min_epi32(bin, c.last);
  }
  // ... or qt_hist_bin's double formula as is.
  static I double_bins(const Consts& c, F v) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    lo = _mm256_mul_pd(_mm256_add_pd(lo, c.r), c.sc);
    hi = _mm256_mul_pd(_mm256_add_pd(hi, c.r), c.sc);
    lo = _mm256_min_pd(_mm256_max_pd(lo, c.dzero), c.dlast);
    hi = _mm256_min_pd(_mm256_max_pd(hi, c.dzero), c.dlast);
    const I bin = _mm256_set_m128i(_mm256_cvttpd_epi32(hi), _mm256_cvttpd_epi32(lo));
    return _mm256_min_epi32(bin, c.last);
  }
  // Lanes holding an exact zero take their zero slot instead of their bin.
  static I zeros_to(const Consts& c, F v, I bin, I zslot) {
    const F is_zero = _mm256_cmp_ps(v, c.zero, _CMP_EQ_OQ);
    return _mm256_blendv_epi8(bin, zslot, _mm256_castps_si256(is_zero));
  }
  static I zero_slots(const BinParams& p, int u) {
    return _mm256_add_epi32(_mm256_set1_epi32((int32_t)(p.nbins + 1 + u * kMaxLanes)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static void quarters(I idx, __m128i* q) {
    q[0] = _mm256_castsi256_si128(idx);
    q[1] = _mm256_extracti128_si256(idx, 1);
  }
  static void store(float* out, F v) { _mm256_storeu_ps(out, v); }
  static I load_i(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const I*>(p)); }
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
};

#include "cpu_simd_body.inc"

}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------------------------------- AVX-512
// The same on 16 lanes. Rounding is embedded in the instructions (no MXCSR change).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")
#endif
namespace avx512 {

#define QT_RD (_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)

struct Vec {
  static constexpr int W = 16;
  using F = __m512;
  using I = __m512i;

  struct FastScope {};

  struct Consts {
    F scale, bias, fhalf, nfhalf, zero;
    __m512d r, sc, dzero, dlast;
    I half, last, over;
    explicit Consts(const BinParams& p)
        : scale(_mm512_set1_ps(p.f_scale)),
          bias(_mm512_set1_ps(p.f_bias)),
          fhalf(_mm512_set1_ps(p.f_half)),
          nfhalf(_mm512_set1_ps(-p.f_half)),
          zero(_mm512_setzero_ps()),
          r(_mm512_set1_pd((double)p.half_range)),
          sc(_mm512_set1_pd(p.scale)),
          dzero(_mm512_setzero_pd()),
          dlast(_mm512_set1_pd((double)p.last)),
          half(_mm512_set1_epi32(p.half)),
          last(_mm512_set1_epi32(p.last)),
          over(_mm512_set1_epi32((int32_t)p.nbins)) {}
  };

  static F load(const float* x) { return _mm512_loadu_ps(x); }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static F all_ones() { return _mm512_castsi512_ps(_mm512_set1_epi32(-1)); }
  static F min(F v, F acc) { return _mm512_min_ps(v, acc); }
  static F max(F v, F acc) { return _mm512_max_ps(v, acc); }
  static F bit_or(F a, F b) {
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
  static F bit_and(F a, F b) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
  static uint32_t sign_bits(F v) {
    return (uint32_t)_mm512_cmplt_epi32_mask(_mm512_castps_si512(v), _mm512_setzero_si512());
  }
  static F nan_probe(F acc, F v) { return _mm512_add_ps(acc, _mm512_sub_ps(v, v)); }
  static bool any_nan(F d) { return _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q) != 0; }

  static I fast_bins(const Consts& c, F v) {
    const F t = _mm512_fmadd_round_ps(v, c.scale, c.bias, QT_RD);
    const I k = _mm512_cvt_roundps_epi32(t, QT_RD);
    return _mm512_min_epu32(_mm512_add_epi32(k, c.half), c.over);
  }
  static I float_bins(const Consts& c, F v) {
    F t = _mm512_fmadd_ps(v, c.scale, c.bias);
    t = _mm512_min_ps(_mm512_max_ps(t, c.nfhalf), c.fhalf);
    const I bin = _mm512_add_epi32(_mm512_cvt_roundps_epi32(t, QT_RD), c.half);
    return _mm512_min_epi32(bin, c.last);
  }
  static I double_bins(const Consts& c, F v) {
    const __m256 vlo = _mm512_castps512_ps256(v);
    const __m256 vhi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m512d lo = _mm512_mul_pd(_mm512_add_pd(_mm512_cvtps_pd(vlo), c.r), c.sc);
    __m512d hi = _mm512_mul_pd(_mm512_add_pd(_mm512_cvtps_pd(vhi), c.r), c.sc);
    lo = _mm512_min_pd(_mm512_max_pd(lo, c.dzero), c.dlast);
    hi = _mm512_min_pd(_mm512_max_pd(hi, c.dzero), c.dlast);
    const I bin = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvttpd_epi32(lo)),
                                     _mm512_cvttpd_epi32(hi), 1);
    return _mm512_min_epi32(bin, c.last);
  }
  static I zeros_to(const Consts& c, F v, I bin, I zslot) {
    return _mm512_mask_mov_epi32(bin, _mm512_cmp_ps_mask(v, c.zero, _CMP_EQ_OQ), zslot);
  }
  static I zero_slots(const BinParams& p, int u) {
    return _mm512_add_epi32(
        _mm512_set1_epi32((int32_t)(p.nbins + 1 + u * kMaxLanes)),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static void quarters(I idx, __m128i* q) {
    q[0] = _mm512_castsi512_si128(idx);
    q[1] = _mm512_extracti32x4_epi32(idx, 1);
    q[2] = _mm512_extracti32x4_epi32(idx, 2);
    q[3] = _mm512_extracti32x4_epi32(idx, 3);
  }
  static void store(float* out, F v) { _mm512_storeu_ps(out, v); }
  static I load_i(const int32_t* p) { return _mm512_load_si512(p); }
  static I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
};

#undef QT_RD

#include "cpu_simd_body.inc"

}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // __x86_64__

}  // namespace qt

#endif  // QTOOL_CPU_SIMD_H
