// CPU backend: plain loops over the shared math in qt_math.h, split over std::thread for large
// inputs (calibration tensors reach hundreds of millions of elements; the searches are
// O(nbins^2)). Results do not depend on the thread count: min/max and integer counts are
// order-independent and each candidate's divergence is summed by one thread in bin order.
#include <algorithm>
#include <thread>
#include <vector>

#include "qt_math.h"
#include "qtool_kernels.h"

namespace {

constexpr int64_t kMinPerThread = int64_t(1) << 18;

int thread_count(int64_t work) {
  unsigned hw = std::thread::hardware_concurrency();
  int64_t n = hw == 0 ? 1 : static_cast<int64_t>(std::min(hw, 16u));
  n = std::min(n, std::max<int64_t>(1, work / kMinPerThread));
  return static_cast<int>(n);
}

// Runs fn(begin, end, worker) over [0, n) split into `workers` contiguous chunks.
template <typename Fn>
void parallel_chunks(int64_t n, int workers, Fn fn) {
  if (workers <= 1) {
    fn(int64_t(0), n, 0);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + workers - 1) / workers;
  for (int w = 0; w < workers; ++w) {
    const int64_t b = std::min(n, w * chunk);
    const int64_t e = std::min(n, b + chunk);
    pool.emplace_back([=] { fn(b, e, w); });
  }
  for (auto& t : pool) t.join();
}

// Prefix sums of a histogram (see qt_math.h). Returns QT_ERR_NO_COUNTS for negative or all-zero
// histograms; prefix_hlogh is only filled when non-null.
int build_prefix(const int64_t* hist, int64_t nbins, std::vector<int64_t>& prefix,
                 std::vector<int64_t>& prefix_nz, std::vector<double>* prefix_hlogh = nullptr) {
  prefix.assign(nbins + 1, 0);
  prefix_nz.assign(nbins + 1, 0);
  if (prefix_hlogh != nullptr) prefix_hlogh->assign(nbins + 1, 0.0);
  for (int64_t j = 0; j < nbins; ++j) {
    if (hist[j] < 0) return QT_ERR_NO_COUNTS;
    prefix[j + 1] = prefix[j] + hist[j];
    prefix_nz[j + 1] = prefix_nz[j] + (hist[j] != 0 ? 1 : 0);
    if (prefix_hlogh != nullptr) (*prefix_hlogh)[j + 1] = (*prefix_hlogh)[j] + qt_hlogh(hist[j]);
  }
  return prefix[nbins] > 0 ? QT_OK : QT_ERR_NO_COUNTS;
}

// Min/max of x[0:n] in kLanes independent accumulators: the fixed-width inner loop is what
// g++ turns into SIMD (a single conditional reduction chain is not vectorised without
// -ffast-math, which would break NaN handling).
QtMinMax minmax_range(const float* x, int64_t n) {
  constexpr int kLanes = 16;
  float mn[kLanes], mx[kLanes];
  int32_t nf[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    mn[l] = INFINITY;
    mx[l] = -INFINITY;
    nf[l] = 0;
  }
  QtMinMax acc = qt_minmax_init();
  int64_t k = 0;
  while (k + kLanes <= n) {
    // flush the int32 lane counters before they could overflow
    const int64_t stop = std::min(n - (n - k) % kLanes, k + int64_t(kLanes) * (1 << 30));
    for (; k < stop; k += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        qt_minmax_step(x[k + l], mn[l], mx[l], nf[l]);
      }
    }
    for (int l = 0; l < kLanes; ++l) {
      acc.nonfinite += nf[l];
      nf[l] = 0;
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    QtMinMax lane = qt_minmax_init();
    lane.mn = mn[l];
    lane.mx = mx[l];
    qt_minmax_merge(acc, lane);
  }
  for (; k < n; ++k) qt_minmax_update(acc, x[k]);
  return acc;
}

int64_t argmin(const std::vector<double>& v) {
  int64_t best = 0;
  for (int64_t k = 1; k < static_cast<int64_t>(v.size()); ++k) {
    if (qt_better(v[k], k, v[best], best)) best = k;
  }
  return best;
}

}  // namespace

extern "C" {

int qt_cpu_abi_version(void) { return QT_ABI_VERSION; }

const char* qt_cpu_status_string(int status) {
  switch (status) {
    case QT_OK: return "ok";
    case QT_ERR_EMPTY: return "empty input";
    case QT_ERR_BAD_ARG: return "invalid argument";
    case QT_ERR_NO_COUNTS: return "histogram has no counts or a negative count";
    default: return "unknown status";
  }
}

int qt_cpu_tensor_minmax(const float* x, int64_t n, float* out_min, float* out_max,
                         int64_t* out_nonfinite) {
  if (n < 1) return QT_ERR_EMPTY;
  const int workers = thread_count(n);
  std::vector<QtMinMax> parts(workers, qt_minmax_init());
  parallel_chunks(n, workers, [&](int64_t b, int64_t e, int w) {
    parts[w] = minmax_range(x + b, e - b);
  });
  QtMinMax total = qt_minmax_init();
  for (const auto& p : parts) qt_minmax_merge(total, p);
  qt_minmax_finish(total, out_min, out_max);
  *out_nonfinite = total.nonfinite;
  return QT_OK;
}

int qt_cpu_channel_minmax(const float* x, int64_t channels, int64_t inner, float* out_min,
                          float* out_max) {
  if (channels < 1 || inner < 1) return QT_ERR_EMPTY;
  const int workers = std::min<int64_t>(thread_count(channels * inner), channels);
  parallel_chunks(channels, workers, [&](int64_t b, int64_t e, int) {
    for (int64_t c = b; c < e; ++c) {
      qt_minmax_finish(minmax_range(x + c * inner, inner), out_min + c, out_max + c);
    }
  });
  return QT_OK;
}

int qt_cpu_histogram_accumulate(const float* x, int64_t n, float half_range, int64_t* counts,
                                int64_t nbins) {
  if (n < 1) return QT_ERR_EMPTY;
  if (nbins < 1 || !qt_isfinite(half_range) || !(half_range > 0.0f)) return QT_ERR_BAD_ARG;
  const double scale = qt_hist_scale(nbins, half_range);
  const int workers = thread_count(n);
  std::vector<std::vector<int64_t>> parts(workers);
  parallel_chunks(n, workers, [&](int64_t b, int64_t e, int w) {
    std::vector<int64_t>& local = parts[w];
    local.assign(nbins, 0);
    for (int64_t k = b; k < e; ++k) {
      const int64_t bin = qt_hist_bin(x[k], half_range, scale, nbins);
      if (bin >= 0) local[bin] += 1;
    }
  });
  for (const auto& local : parts) {
    for (int64_t j = 0; j < nbins; ++j) counts[j] += local[j];
  }
  return QT_OK;
}

int qt_cpu_kl_divergences(const int64_t* hist, int64_t nbins, int64_t num_levels, double* out) {
  if (nbins < 1 || num_levels < 1 || nbins < num_levels) return QT_ERR_BAD_ARG;
  std::vector<int64_t> prefix, prefix_nz;
  std::vector<double> prefix_hlogh;
  const int status = build_prefix(hist, nbins, prefix, prefix_nz, &prefix_hlogh);
  if (status != QT_OK) return status;
  const int64_t ncand = nbins - num_levels + 1;
  const int workers = std::min<int64_t>(thread_count(ncand * num_levels), ncand);
  parallel_chunks(ncand, workers, [&](int64_t b, int64_t e, int) {
    for (int64_t k = b; k < e; ++k) {
      const int64_t i = num_levels + k;
      double kl = qt_kl_last_term(hist, prefix.data(), prefix_nz.data(), nbins, i, num_levels);
      for (int64_t g = 0; g < num_levels; ++g) {
        kl += qt_kl_group_term(prefix.data(), prefix_nz.data(), prefix_hlogh.data(), nbins, g, i,
                               num_levels);
      }
      out[k] = kl;
    }
  });
  return QT_OK;
}

int qt_cpu_kl_threshold(const int64_t* hist, int64_t nbins, int64_t num_levels,
                        int64_t* out_bins) {
  if (nbins < 1 || num_levels < 1) return QT_ERR_BAD_ARG;
  if (nbins <= num_levels) {
    // Nothing to clip: every bin gets its own level. Still reject unusable histograms.
    std::vector<int64_t> prefix, prefix_nz;
    const int status = build_prefix(hist, nbins, prefix, prefix_nz);
    if (status != QT_OK) return status;
    *out_bins = nbins;
    return QT_OK;
  }
  std::vector<double> kl(nbins - num_levels + 1);
  const int status = qt_cpu_kl_divergences(hist, nbins, num_levels, kl.data());
  if (status != QT_OK) return status;
  *out_bins = num_levels + argmin(kl);
  return QT_OK;
}

int qt_cpu_percentile_bin(const int64_t* hist, int64_t nbins, double percentile,
                          double* out_position) {
  if (nbins < 1 || !(percentile > 0.0 && percentile <= 100.0)) return QT_ERR_BAD_ARG;
  std::vector<int64_t> prefix, prefix_nz;
  const int status = build_prefix(hist, nbins, prefix, prefix_nz);
  if (status != QT_OK) return status;
  *out_position = qt_percentile_position(hist, nbins, percentile);
  return QT_OK;
}

int qt_cpu_mse_errors(const int64_t* hist, int64_t nbins, int64_t num_steps, double* out) {
  if (nbins < 1 || num_steps < 1) return QT_ERR_BAD_ARG;
  std::vector<int64_t> prefix, prefix_nz;
  const int status = build_prefix(hist, nbins, prefix, prefix_nz);
  if (status != QT_OK) return status;
  const double total = static_cast<double>(prefix[nbins]);
  const int workers = std::min<int64_t>(thread_count(nbins * nbins), nbins);
  parallel_chunks(nbins, workers, [&](int64_t b, int64_t e, int) {
    for (int64_t k = b; k < e; ++k) {
      double err = 0.0;
      for (int64_t j = 0; j < nbins; ++j) err += qt_mse_term(hist[j], j, k + 1, num_steps);
      out[k] = err / total;
    }
  });
  return QT_OK;
}

int qt_cpu_mse_threshold(const int64_t* hist, int64_t nbins, int64_t num_steps,
                         double* out_bins) {
  if (nbins < 1 || num_steps < 1) return QT_ERR_BAD_ARG;
  std::vector<double> err(nbins);
  const int status = qt_cpu_mse_errors(hist, nbins, num_steps, err.data());
  if (status != QT_OK) return status;
  *out_bins = static_cast<double>(argmin(err) + 1);
  return QT_OK;
}

}  // extern "C"
