// Element-wise and per-candidate statistics math shared by the CPU and CUDA backends.
//
// Every formula that decides a number lives here, once, as a QT_HD inline function: the C++
// backend calls it in plain loops, the CUDA backend calls it per thread and only adds the
// reductions. That is why the CPU tests (which run everywhere) check the same math the GPU runs;
// the GPU tests then only have to check the reductions.
//
// Floating point: every operation that decides a number is one correctly rounded IEEE operation,
// written through the qt_fadd/qt_fmul/... helpers below. On the host they are the plain operators
// (the library is built with -ffp-contract=off); on the device they are the _rn intrinsics, which
// nvcc never contracts into an FMA whatever -fmad says (it contracts a*b+c by default, and one
// rounding instead of two changes the last bit). Fused multiply-adds appear only where a formula
// is proven to need exactly one rounding (qt_fma, the power-of-two histogram bins). That is why
// CPU and GPU histograms, min/max, MSE errors and block searches are bit-identical; the KL search
// is not, because libm's log and CUDA's log may differ in the last bit.
#ifndef QTOOL_QT_MATH_H
#define QTOOL_QT_MATH_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define QT_HD __host__ __device__
#else
#define QT_HD
#endif

// Floor for the reference probability Q in KL(P||Q): Q is zero where P has mass only when the
// folded outliers land on an empty last bin (or the kept range is empty); the floor turns that
// into a large finite penalty instead of an infinite divergence.
#define QT_KL_EPS 1e-10

// ---------------------------------------------------------------------------------------------
// correctly rounded arithmetic, never contracted (see the top of the file)
// ---------------------------------------------------------------------------------------------

#ifdef __CUDA_ARCH__
#define QT_RN_OP(host_expr, device_call) return device_call
#else
#define QT_RN_OP(host_expr, device_call) return host_expr
#endif
QT_HD inline float qt_fadd(float a, float b) { QT_RN_OP(a + b, __fadd_rn(a, b)); }
QT_HD inline float qt_fsub(float a, float b) { QT_RN_OP(a - b, __fsub_rn(a, b)); }
QT_HD inline float qt_fmul(float a, float b) { QT_RN_OP(a * b, __fmul_rn(a, b)); }
QT_HD inline float qt_fdiv(float a, float b) { QT_RN_OP(a / b, __fdiv_rn(a, b)); }
QT_HD inline double qt_dadd(double a, double b) { QT_RN_OP(a + b, __dadd_rn(a, b)); }
QT_HD inline double qt_dsub(double a, double b) { QT_RN_OP(a - b, __dsub_rn(a, b)); }
QT_HD inline double qt_dmul(double a, double b) { QT_RN_OP(a * b, __dmul_rn(a, b)); }
QT_HD inline double qt_ddiv(double a, double b) { QT_RN_OP(a / b, __ddiv_rn(a, b)); }
// a*b+c rounded once (glibc's fmaf is exact on every CPU, with or without an FMA unit).
QT_HD inline float qt_fma(float a, float b, float c) { QT_RN_OP(fmaf(a, b, c), __fmaf_rn(a, b, c)); }
#undef QT_RN_OP

// True for finite values. `v - v` is NaN for NaN and +-Inf and exactly 0 otherwise; this avoids
// the host/device differences of isfinite() overloads (valid as long as no -ffast-math is used).
QT_HD inline bool qt_isfinite(float v) { return (v - v) == 0.0f; }

// ---------------------------------------------------------------------------------------------
// min / max
// ---------------------------------------------------------------------------------------------

// Accumulator for min/max that skips non-finite values and counts them. No value was finite
// while mn > mx (the initial +inf / -inf stay).
struct QtMinMax {
  float mn;
  float mx;
  int64_t nonfinite;
};

QT_HD inline QtMinMax qt_minmax_init() {
  QtMinMax a;
  a.mn = INFINITY;
  a.mx = -INFINITY;
  a.nonfinite = 0;
  return a;
}

// Total order for min/max: -0.0 < +0.0. With plain `<` a tensor holding both zeros would report
// whichever its lanes, threads or batches saw first, so the stats file (JSON "min": -0.0 vs 0.0)
// would depend on the thread count and the batch size; with this order the answer is unique.
QT_HD inline bool qt_is_negative(float v) { return copysignf(1.0f, v) < 0.0f; }
QT_HD inline bool qt_less(float a, float b) {
  return a < b || (a == b && qt_is_negative(a) && !qt_is_negative(b));
}

// Scalar form, so host loops can keep per-lane accumulators in registers.
template <typename Count>
QT_HD inline void qt_minmax_step(float v, float& mn, float& mx, Count& nonfinite) {
  const bool finite = qt_isfinite(v);
  mn = (finite && qt_less(v, mn)) ? v : mn;
  mx = (finite && qt_less(mx, v)) ? v : mx;
  nonfinite += finite ? 0 : 1;
}

QT_HD inline void qt_minmax_update(QtMinMax& a, float v) {
  qt_minmax_step(v, a.mn, a.mx, a.nonfinite);
}

QT_HD inline void qt_minmax_merge(QtMinMax& a, const QtMinMax& b) {
  a.mn = qt_less(b.mn, a.mn) ? b.mn : a.mn;
  a.mx = qt_less(a.mx, b.mx) ? b.mx : a.mx;
  a.nonfinite += b.nonfinite;
}

// Writes NaN for both ends when no finite value was seen: a range cannot be derived from it and
// the caller decides whether that is an error (it knows the tensor name).
QT_HD inline void qt_minmax_finish(const QtMinMax& a, float* out_min, float* out_max) {
  if (a.mn > a.mx) {
    *out_min = NAN;
    *out_max = NAN;
  } else {
    *out_min = a.mn;
    *out_max = a.mx;
  }
}

// ---------------------------------------------------------------------------------------------
// histogram over [-R, R]
// ---------------------------------------------------------------------------------------------

// Bins per unit of value. Computed once by the host for both backends.
QT_HD inline double qt_hist_scale(int64_t nbins, float half_range) {
  return (double)nbins / (2.0 * (double)half_range);
}

// Bin of value v in a histogram of nbins uniform bins over [-R, R]; values outside the range fall
// into the edge bins (the observer grows its range separately, clamping keeps mass accounted for).
// Returns -1 for non-finite values, which are not counted.
QT_HD inline int64_t qt_hist_bin(float v, float half_range, double scale, int64_t nbins) {
  if (!qt_isfinite(v)) return -1;
  double t = qt_dmul(qt_dadd((double)v, (double)half_range), scale);
  if (t < 0.0) return 0;
  if (t >= (double)nbins) return nbins - 1;
  return (int64_t)t;  // t >= 0: truncation is floor
}

// The same bins in float32 for a power-of-two geometry, R = 2^k and nbins = 2^b (4 <= nbins <=
// 2^28): for every finite v,
//   qt_hist_bin(v) == min(floor(clamp(fma(v, 2^(b-1-k), 2^(b-55)), -nbins/2, nbins/2)) + nbins/2,
//                         nbins - 1)
// with the fma rounded once (cpu_simd.h's header proves it, check_float_bins.cpp checks every
// float32 bit pattern). The observer's histograms always have this geometry (R doubles, nbins is
// 2 x calibration.bins), so the CPU's vector lanes and the CUDA kernels avoid double arithmetic.
struct QtPow2Bins {
  bool ok;       // the geometry qualifies; otherwise use qt_hist_bin
  float scale;   // 2^(b-1-k)
  float bias;    // 2^(b-55)
  float half_f;  // nbins / 2
  int32_t half;  // nbins / 2
  int32_t last;  // nbins - 1
};

QT_HD inline QtPow2Bins qt_pow2_bins(float half_range, int64_t nbins) {
  QtPow2Bins g;
  g.ok = false;
  g.scale = g.bias = g.half_f = 0.0f;
  g.half = g.last = 0;
  int e = 0;
  const bool pow2_range = half_range > 0.0f && frexpf(half_range, &e) == 0.5f;  // R = 2^(e-1)
  int b = 0;
  while (b < 62 && ((int64_t)1 << b) < nbins) ++b;
  const int k = e - 1, c = b - 1 - k;
  if (pow2_range && ((int64_t)1 << b) == nbins && b >= 2 && b <= 28 && c >= -126 && c <= 127) {
    g.ok = true;
    g.scale = ldexpf(1.0f, c);
    g.bias = ldexpf(1.0f, b - 55);
    g.half_f = (float)(nbins / 2);
    g.half = (int32_t)(nbins / 2);
    g.last = (int32_t)(nbins - 1);
  }
  return g;
}

// qt_hist_bin(v) for a finite v when g.ok. Also defined for +-Inf and NaN (an edge bin, which
// callers discard), so a kernel can compute it without a branch. fminf/fmaxf clamp exactly as the
// CPU's MINPS/MAXPS do for every non-NaN t.
QT_HD inline int32_t qt_hist_bin_pow2(float v, const QtPow2Bins& g) {
  const float t = fminf(fmaxf(qt_fma(v, g.scale, g.bias), -g.half_f), g.half_f);
  const int32_t bin = (int32_t)floorf(t) + g.half;
  return bin < g.last ? bin : g.last;
}

// ---------------------------------------------------------------------------------------------
// KL-divergence threshold search (TensorRT entropy calibration)
// ---------------------------------------------------------------------------------------------
// Input: a histogram of |x| with nbins uniform bins starting at 0, and num_levels (128 for int8).
// For each candidate i in [num_levels, nbins]:
//   P = hist[0:i] with the outlier mass sum(hist[i:]) added to P[i-1]           (sums to total)
//   Q: bins 0..i-1 split into num_levels groups, bin j in group floor(j*L/i) (sizes differ by at
//      most one); each group's mass is spread evenly over its nonzero bins of hist[0:i]; zero
//      bins stay zero                                                          (sums to sum(hist[:i]))
//   KL(P||Q) = sum_{P_j > 0} p_j log(p_j / max(q_j, QT_KL_EPS)) with p, q normalised.
// The best candidate is the smallest divergence, the smallest i on ties.
//
// Evaluated per group, not per bin: inside group g every nonzero bin has the same q_g, so
//   sum_{j in g, j != i-1} p_j log(p_j / q_g) = (HL_g - H_g (log T + log q_g)) / T
// with H_g = sum h_j and HL_g = sum h_j log h_j over the group (T = total count). Bin i-1 carries
// the outliers and is added on its own. With prefix sums
//   prefix[k] = sum(hist[:k]), prefix_nz[k] = count_nonzero(hist[:k]),
//   prefix_hlogh[k] = sum(h log h for h in hist[:k])                          (k = 0..nbins)
// a candidate costs O(num_levels) instead of O(i), and backends can parallelise over groups and
// candidates freely.

QT_HD inline double qt_hlogh(int64_t h) { return h > 0 ? (double)h * log((double)h) : 0.0; }

QT_HD inline int64_t qt_kl_group_start(int64_t g, int64_t i, int64_t num_levels) {
  return (g * i + num_levels - 1) / num_levels;  // ceil(g * i / L): bin j is in group j*L/i
}

// log of the (floored) normalised Q value of a nonzero bin in group g of candidate i.
QT_HD inline double qt_kl_log_q(const int64_t* prefix, const int64_t* prefix_nz, int64_t g,
                                int64_t i, int64_t num_levels) {
  const int64_t s = qt_kl_group_start(g, i, num_levels);
  const int64_t e = qt_kl_group_start(g + 1, i, num_levels);
  const int64_t gsum = prefix[e] - prefix[s];
  const int64_t gnz = prefix_nz[e] - prefix_nz[s];
  double q = gnz > 0 ? qt_ddiv(qt_ddiv((double)gsum, (double)gnz), (double)prefix[i]) : 0.0;
  if (q < QT_KL_EPS) q = QT_KL_EPS;
  return log(q);
}

// Contribution of group g to KL(P||Q) for candidate i, without bin i-1.
QT_HD inline double qt_kl_group_term(const int64_t* prefix, const int64_t* prefix_nz,
                                     const double* prefix_hlogh, int64_t nbins, int64_t g,
                                     int64_t i, int64_t num_levels) {
  const int64_t s = qt_kl_group_start(g, i, num_levels);
  int64_t e = qt_kl_group_start(g + 1, i, num_levels);
  if (e == i) e = i - 1;  // the last group; bin i-1 is qt_kl_last_term
  const int64_t h = prefix[e] - prefix[s];
  if (h <= 0) return 0.0;
  const double total = (double)prefix[nbins];
  const double hl = prefix_hlogh[e] - prefix_hlogh[s];
  const double lq = qt_kl_log_q(prefix, prefix_nz, g, i, num_levels);
  return qt_ddiv(qt_dsub(hl, qt_dmul((double)h, qt_dadd(log(total), lq))), total);
}

// Contribution of bin i-1, which holds its own count plus all outliers sum(hist[i:]).
QT_HD inline double qt_kl_last_term(const int64_t* hist, const int64_t* prefix,
                                    const int64_t* prefix_nz, int64_t nbins, int64_t i,
                                    int64_t num_levels) {
  const int64_t total = prefix[nbins];
  const int64_t pc = hist[i - 1] + (total - prefix[i]);
  if (pc <= 0) return 0.0;
  const double p = qt_ddiv((double)pc, (double)total);
  const double lq = hist[i - 1] > 0 ? qt_kl_log_q(prefix, prefix_nz, num_levels - 1, i, num_levels)
                                    : log(QT_KL_EPS);
  return qt_dmul(p, qt_dsub(log(p), lq));
}

// ---------------------------------------------------------------------------------------------
// MSE threshold search on a one-sided histogram
// ---------------------------------------------------------------------------------------------
// Bin j covers [j, j+1) in bin units and is represented by its centre j + 0.5. For a threshold
// t (an integer bin edge, 1..nbins) quantization is uniform with num_steps steps over [0, t]:
// values above t clip to t, others round to the nearest multiple of t / num_steps.

// Squared error of bin j's centre at threshold t, weighted by the bin count.
QT_HD inline double qt_mse_term(int64_t count, int64_t j, int64_t t, int64_t num_steps) {
  if (count == 0) return 0.0;
  const double c = qt_dadd((double)j, 0.5);
  double d;
  if (c >= (double)t) {
    d = qt_dsub(c, (double)t);
  } else {
    const double step = qt_ddiv((double)t, (double)num_steps);
    const double q = qt_dmul(floor(qt_dadd(qt_ddiv(c, step), 0.5)), step);
    d = qt_dsub(c, q);
  }
  return qt_dmul(qt_dmul((double)count, d), d);
}

// ---------------------------------------------------------------------------------------------
// shared helpers
// ---------------------------------------------------------------------------------------------

// Argmin order: smaller value first, then smaller index, so every reduction order picks the same
// candidate.
QT_HD inline bool qt_better(double a, int64_t ia, double b, int64_t ib) {
  return a < b || (a == b && ia < ib);
}

// Fractional bin position x such that percentile% of the histogram mass lies below x, assuming
// mass is spread uniformly inside each bin. Requires a positive total and 0 < percentile <= 100.
QT_HD inline double qt_percentile_position(const int64_t* hist, int64_t nbins, double percentile) {
  int64_t total = 0;
  for (int64_t j = 0; j < nbins; ++j) total += hist[j];
  const double target = (double)total * (percentile / 100.0);
  int64_t cum = 0;
  for (int64_t j = 0; j < nbins; ++j) {
    const int64_t next = cum + hist[j];
    if ((double)next >= target && hist[j] > 0) {
      double frac = (target - (double)cum) / (double)hist[j];
      frac = frac < 0.0 ? 0.0 : (frac > 1.0 ? 1.0 : frac);
      return (double)j + frac;
    }
    cum = next;
  }
  return (double)nbins;
}

// ---------------------------------------------------------------------------------------------
// block-wise MSE clipping search (qtool/quantize/int4.py)
// ---------------------------------------------------------------------------------------------
// A block is block_len values of one column. Its range [lo, hi] = [min(min x, 0), max(max x, 0)]
// is shrunk by a factor f of the grid; f picks a scale (and zero point) as numpy does, in float32:
//   symmetric:  s = max((lo*f) / qmin, (hi*f) / qmax),                      z = 0
//   asymmetric: s = ((hi*f) - (lo*f)) / (qmax - qmin),  z = clip(rint(-(lo*f) / s), qmin, qmax)
//   s = s > 0 ? max(s, 1e-8) : 1
// and reconstructs x as (clip(rint(x / s) + z, qmin, qmax) - z) * s. The error of f is the sum of
// the squared float32 differences, each widened to double (exact: 24-bit mantissas squared) and
// added in row order; the least error wins, the lower grid index on ties (strict `<`, NaN never
// wins). Every operation is one correctly rounded IEEE float32 operation with no FMA, rint rounds
// half to even: what numpy computes, on every backend and lane.

// Smallest scale, float32(1e-8) as numpy's np.float32(1e-8) rounds it (via double).
#define QT_BLOCK_MIN_SCALE ((float)1e-8)

QT_HD inline float qt_rint(float v) { return rintf(v); }  // default mode: half to even

struct QtBlockQuant {
  float scale;
  float zero;  // 0 when symmetric
};

// Integer ranges the search supports: int8/int4-like symmetric ones (qmin < 0 < qmax) and
// uint8-like asymmetric ones; levels then fit a byte.
QT_HD inline bool qt_block_qrange_ok(int32_t qmin, int32_t qmax, bool symmetric) {
  if (symmetric) return qmin >= -128 && qmin < 0 && qmax > 0 && qmax <= 127;
  return qmin >= 0 && qmin < qmax && qmax <= 255;
}

// Range step over the block's values: lo and hi start at 0.
QT_HD inline void qt_block_range_step(float v, float& lo, float& hi) {
  lo = v < lo ? v : lo;
  hi = v > hi ? v : hi;
}

QT_HD inline QtBlockQuant qt_block_quant_params(float lo, float hi, float factor, float qmin,
                                                float qmax, bool symmetric) {
  const float l = qt_fmul(lo, factor), h = qt_fmul(hi, factor);
  QtBlockQuant p;
  float s;
  if (symmetric) {
    const float a = qt_fdiv(l, qmin), b = qt_fdiv(h, qmax);
    s = a > b ? a : b;
  } else {
    s = qt_fdiv(qt_fsub(h, l), qt_fsub(qmax, qmin));
  }
  s = s > 0.0f ? (s > QT_BLOCK_MIN_SCALE ? s : QT_BLOCK_MIN_SCALE) : 1.0f;
  p.scale = s;
  if (symmetric) {
    p.zero = 0.0f;
  } else {
    float z = qt_rint(qt_fdiv(-l, s));
    z = z > qmin ? z : qmin;
    p.zero = z < qmax ? z : qmax;
  }
  return p;
}

// The integer level of v (as a float): clip(rint(v / s) + z, qmin, qmax).
QT_HD inline float qt_block_level(float v, QtBlockQuant p, float qmin, float qmax) {
  float q = qt_fadd(qt_rint(qt_fdiv(v, p.scale)), p.zero);
  q = q > qmin ? q : qmin;
  return q < qmax ? q : qmax;
}

QT_HD inline double qt_block_sq_error(float v, QtBlockQuant p, float qmin, float qmax) {
  const float d = qt_fsub(qt_fmul(qt_fsub(qt_block_level(v, p, qmin, qmax), p.zero), p.scale), v);
  return qt_dmul((double)d, (double)d);
}

// The signed-scale grid of a symmetric block (qtool/write/int4.py _signed_scales): the value of
// largest magnitude lands on qmin, so the scale is negative when that value is positive and all
// of qmin's side serves the wider half, as ONNX Runtime's round-to-nearest INT4 quantizer does:
//   s = hi > -lo ? hi / qmin : lo / qmin;   s = |s| > 0 ? copysign(max(|s|, 1e-8), s) : 1
QT_HD inline QtBlockQuant qt_block_signed_params(float lo, float hi, float qmin) {
  const float s = hi > -lo ? qt_fdiv(hi, qmin) : qt_fdiv(lo, qmin);
  const float m = s < 0.0f ? -s : s;
  const float floored = m > QT_BLOCK_MIN_SCALE ? m : QT_BLOCK_MIN_SCALE;
  QtBlockQuant p;
  p.scale = m > 0.0f ? (s < 0.0f ? -floored : floored) : 1.0f;
  p.zero = 0.0f;
  return p;
}

QT_HD inline double qt_block_column_error(const float* col, int64_t n, int64_t stride,
                                          QtBlockQuant p, float qmin, float qmax) {
  double err = 0.0;
  for (int64_t r = 0; r < n; ++r) err += qt_block_sq_error(col[r * stride], p, qmin, qmax);
  return err;
}

// One block column's choice: n values at `stride`, range [lo, hi]. The grid factor of least
// error (grid[0] on ties; grid_len == 1 skips the errors), then, when `signed_scales` (symmetric
// only), the signed-scale grid where its error is strictly smaller; *out_j is the grid index
// chosen, grid_len for the signed grid. The CPU reference and the CUDA kernel both run this.
QT_HD inline QtBlockQuant qt_block_column_choice(const float* col, int64_t n, int64_t stride,
                                                 float lo, float hi, const float* grid,
                                                 int64_t grid_len, float qmin, float qmax,
                                                 bool symmetric, bool signed_scales,
                                                 int32_t* out_j) {
  QtBlockQuant best = qt_block_quant_params(lo, hi, grid[0], qmin, qmax, symmetric);
  int32_t best_j = 0;
  if (grid_len > 1 || signed_scales) {
    double best_err = qt_block_column_error(col, n, stride, best, qmin, qmax);
    for (int64_t j = 1; j < grid_len; ++j) {
      const QtBlockQuant p = qt_block_quant_params(lo, hi, grid[j], qmin, qmax, symmetric);
      const double err = qt_block_column_error(col, n, stride, p, qmin, qmax);
      if (err < best_err) {
        best_err = err;
        best = p;
        best_j = (int32_t)j;
      }
    }
    if (signed_scales) {
      const QtBlockQuant p = qt_block_signed_params(lo, hi, qmin);
      if (qt_block_column_error(col, n, stride, p, qmin, qmax) < best_err) {
        best = p;
        best_j = (int32_t)grid_len;
      }
    }
  }
  *out_j = best_j;
  return best;
}

#endif  // QTOOL_QT_MATH_H
