// Exhaustive check of cpu_simd.h's float path: for every float32 bit pattern, the bins of the
// vector kernels' float formulas equal qt_hist_bin (the double formula the scalar code, the CUDA
// backend and numpy use). Not part of the build; run it after changing either formula:
//
//   g++ -O2 -mfma -std=c++17 -ffp-contract=off -pthread kernels/check_float_bins.cpp -o /tmp/chk
//   /tmp/chk 12 3     # nbins = 2^12, R = 2^3; about a minute per (b, k) on 2 cores
//
// Checked: the exact kernel (FMA rounded to nearest, clamp, floor) for every finite value, and the
// speculative kernel (FMA and conversion rounded toward -inf, unsigned clamp to the overflow slot)
// bins every |v| < R exactly and sends everything else except v = -R (which the caller rejects by
// its minimum) to the overflow slot. Rounding toward -inf is emulated exactly from the
// round-to-nearest FMA with an error-free sum in double.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <thread>
#include <atomic>
#include "qt_math.h"
static float asf(uint32_t u){ float f; memcpy(&f,&u,4); return f; }
// floor(fl_down(v*s + bias)) emulated exactly from RN results
static double floor_fma_rd(float v, float s, float bias){
  float r = fmaf(v, s, bias);             // RN
  if (!isfinite(r)) return r;
  double x = (double)v * (double)s;       // exact (power-of-two scale, double range)
  double hi = x + (double)bias;           // TwoSum
  double bb = hi - x; double lo = (x - (hi - bb)) + ((double)bias - bb);
  bool lt = (hi < (double)r) || (hi == (double)r && lo < 0);
  float d = lt ? nextafterf(r, -INFINITY) : r;
  return floor((double)d);
}
int main(int argc, char** argv){
  int b = atoi(argv[1]), k = atoi(argv[2]);
  int64_t nbins = 1LL << b; float R = ldexpf(1, k); double scale = qt_hist_scale(nbins, R);
  int c = b - 1 - k; float s = ldexpf(1, c), bias = ldexpf(1, b - 55), fh = (float)(nbins/2);
  if (c < -126 || c > 127) { printf("b=%d k=%d: no float path\n", b, k); return 0; }
  std::atomic<int64_t> bad_exact{0}, bad_fast{0}, bad_over{0}, checked{0};
  auto work = [&](uint64_t lo, uint64_t hi){
    int64_t be=0, bf=0, bo=0, ch=0;
    for (uint64_t u = lo; u < hi; ++u) {
      float v = asf((uint32_t)u);
      int64_t ref = qt_hist_bin(v, R, scale, nbins);
      // exact kernel: RN fma, clamp, floor, +half, min last ; NaN/Inf handled by scalar path
      if (ref >= 0) {
        float t = fmaf(v, s, bias); t = fminf(fmaxf(t, -fh), fh);
        int64_t e = (int64_t)floorf(t) + nbins/2; if (e > nbins-1) e = nbins-1;
        if (e != ref) { if (be < 5) printf("exact mismatch v=%a ref=%ld got=%ld\n", v, (long)ref, (long)e); ++be; }
      }
      // fast kernel: RD fma, cvt (floor), +half, unsigned min with nbins (overflow slot)
      double f = floor_fma_rd(v, s, bias);
      uint32_t idx;
      if (!(f >= -2147483648.0 && f <= 2147483647.0)) idx = 0x80000000u; else idx = (uint32_t)(int32_t)f;
      idx = idx + (uint32_t)(nbins/2); if (idx > (uint32_t)nbins) idx = (uint32_t)nbins;
      bool inrange = ref >= 0 && fabsf(v) < R;
      if (inrange) { if ((int64_t)idx != ref) { if (bf < 5) printf("fast mismatch v=%a ref=%ld got=%u\n", v, (long)ref, idx); ++bf; } }
      else if (!(v == -R) && idx != (uint32_t)nbins) { if (bo < 5) printf("fast not overflow v=%a idx=%u\n", v, idx); ++bo; }
      ++ch;
    }
    bad_exact += be; bad_fast += bf; bad_over += bo; checked += ch;
  };
  std::thread t1(work, 0ull, 1ull<<31), t2(work, 1ull<<31, 1ull<<32); t1.join(); t2.join();
  printf("b=%d k=%d checked=%ld exact_bad=%ld fast_bad=%ld fast_not_overflow=%ld\n", b, k, (long)checked.load(), (long)bad_exact.load(), (long)bad_fast.load(), (long)bad_over.load());
}
