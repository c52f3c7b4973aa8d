// CPU backend: the shared math of qt_math.h in chunk kernels vectorised for AVX2 and AVX-512
// (cpu_simd.h, chosen at run time from CPUID, or forced with qt_cpu_set_isa), run on a persistent
// thread pool (cpu_pool.h) for large inputs. Results do not depend on the instruction set or the
// thread count: min/max use a total order and integer counts are order-independent; each search
// candidate is summed by one thread in bin order.
//
// The observer's hot path is qt_cpu_observe: one pass that computes min/max and, speculatively,
// the histogram at the current range, keeping the counts only when every value was finite and
// inside it (otherwise the caller grows the range and calls again).
#include <algorithm>
#include <atomic>
#include <functional>
#include <new>
#include <vector>

#include "cpu_block_search.h"
#include "cpu_pool.h"
#include "cpu_simd.h"
#include "qt_math.h"
#include "qtool_kernels.h"

namespace {

using qt::BinParams;
using qt::LocalHist;

// Elements per task: large enough that the task counter and the per-task checks are noise, small
// enough that two threads share a tensor of a few MB.
constexpr int64_t kChunk = int64_t(1) << 18;
// Candidates (KL, MSE) per thread at least, in units of their inner loop length.
constexpr int64_t kMinWorkPerThread = int64_t(1) << 18;
// Columns per block-search item: a multiple of every vector width, so only a weight's last
// columns can take the scalar path. Narrower (down to 16) when there are few blocks (one block
// per column: per-channel weights), so every thread gets items.
constexpr int64_t kSearchColumns = 64;

// ---- instruction set dispatch ----

struct Kernels {
  int isa;
  QtMinMax (*minmax)(const float*, int64_t);
  bool (*observe_fast)(const float*, int64_t, const BinParams&, LocalHist&, QtMinMax*);
  void (*observe_exact)(const float*, int64_t, const BinParams&, LocalHist&, QtMinMax*);
  bool (*block_search)(const qt::BlockSearch&, int64_t, int64_t, int64_t);
};

const Kernels kScalar = {QT_ISA_SCALAR, qt::scalar::minmax, qt::scalar::observe_fast,
                         qt::scalar::observe_exact, qt::scalar::columns};
#if defined(__x86_64__)
const Kernels kAvx2 = {QT_ISA_AVX2, qt::avx2::minmax, qt::avx2::observe_fast,
                       qt::avx2::observe_exact, qt::avx2::columns};
const Kernels kAvx512 = {QT_ISA_AVX512, qt::avx512::minmax, qt::avx512::observe_fast,
                         qt::avx512::observe_exact, qt::avx512::columns};
#endif

bool isa_supported(int isa) {
  if (isa == QT_ISA_SCALAR) return true;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (isa == QT_ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == QT_ISA_AVX512) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }
#endif
  return false;
}

int best_isa() {
  if (isa_supported(QT_ISA_AVX512)) return QT_ISA_AVX512;
  if (isa_supported(QT_ISA_AVX2)) return QT_ISA_AVX2;
  return QT_ISA_SCALAR;
}

std::atomic<int>& current_isa() {
  static std::atomic<int> isa{best_isa()};
  return isa;
}

const Kernels& kernels() {
  switch (current_isa().load(std::memory_order_relaxed)) {
#if defined(__x86_64__)
    case QT_ISA_AVX512: return kAvx512;
    case QT_ISA_AVX2: return kAvx2;
#endif
    default: return kScalar;
  }
}

// ---- threading ----

int workers_for(int64_t tasks) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(qt::thread_budget(), tasks)));
}

// Runs fn(task) for task in [0, tasks) on up to `workers` threads sharing a task counter;
// worker(w) is called once per participating worker first. Returns false when a worker threw
// (std::bad_alloc): the caller reports QT_ERR_RESOURCE.
bool parallel_tasks(int64_t tasks, int workers, const std::function<void(int64_t, int)>& fn) {
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::function<void(int)> body = [&](int w) {
    try {
      for (;;) {
        const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
        if (t >= tasks || failed.load(std::memory_order_relaxed)) return;
        fn(t, w);
      }
    } catch (...) {
      failed.store(true);
    }
  };
  qt::pool().run(workers, body);
  return !failed.load();
}

// ---- histogram geometry ----

BinParams make_params(float half_range, int64_t nbins) {
  BinParams p{};
  p.half_range = half_range;
  p.nbins = nbins;
  p.scale = qt_hist_scale(nbins, half_range);
  p.zero_bin = qt_hist_bin(0.0f, half_range, p.scale, nbins);
  p.vector_ok = nbins <= (int64_t(1) << 30);
  p.half = static_cast<int32_t>(p.vector_ok ? nbins / 2 : 0);
  p.last = static_cast<int32_t>(p.vector_ok ? nbins - 1 : 0);
  const QtPow2Bins g = qt_pow2_bins(half_range, nbins);  // shared with the CUDA kernels
  if (g.ok) {
    p.float_path = true;
    p.f_scale = g.scale;
    p.f_bias = g.bias;
    p.f_half = g.half_f;
  }
  return p;
}

// Per-thread counts, reused across calls (pool threads are persistent): the uint16 staging slots
// and the int64 counts are all zero between calls, so a call touches only the bins it uses.
struct ThreadHist {
  std::vector<uint16_t> stage;
  std::vector<int64_t> counts;
  LocalHist view{};
};

ThreadHist& thread_hist() {
  static thread_local ThreadHist h;
  return h;
}

void attach(ThreadHist& h, const BinParams& p, int copies) {
  const int64_t stride = qt::stage_stride(p.nbins);
  const size_t stage = static_cast<size_t>(stride * copies);
  if (h.stage.size() < stage) h.stage.resize(stage, 0);  // old slots are zero already
  if (h.counts.size() < static_cast<size_t>(p.nbins)) h.counts.resize(p.nbins, 0);
  const int first = copies < qt::kFirstCopies ? copies : qt::kFirstCopies;
  h.view = LocalHist{h.stage.data(), stride, copies, first, h.counts.data(), p.nbins, -1};
}

// Adds the thread's counts to `out` (when non-null) and clears them for the next call.
void drain(ThreadHist& h, int64_t* out) {
  LocalHist& v = h.view;
  for (int64_t j = v.lo; j <= v.hi; ++j) {
    if (out != nullptr) out[j] += v.counts[j];
    v.counts[j] = 0;
  }
  v.lo = 0;
  v.hi = -1;
}

// Several copies once a call has enough elements per bin to pay for flushing them (cpu_simd.h).
int copies_for(int64_t n, int64_t nbins) {
  return (n >= 16 * nbins && nbins <= 65536) ? qt::kMaxCopies : 1;
}

bool in_range(const QtMinMax& m, float half_range) {
  return m.nonfinite == 0 && m.mn > -half_range && m.mx < half_range;
}

struct Worker {
  ThreadHist* hist = nullptr;
  QtMinMax mm = qt_minmax_init();
};

// The shared driver of qt_cpu_observe (speculative = true) and qt_cpu_histogram_accumulate.
// Returns QT_OK and sets *accepted when the counts were added.
int run_histogram(const float* x, int64_t n, float half_range, int64_t* counts, int64_t nbins,
                  bool speculative, QtMinMax* total, bool* accepted) {
  const Kernels& k = kernels();
  const BinParams p = make_params(half_range, nbins);
  const int copies = copies_for(n, nbins);
  const int64_t tasks = (n + kChunk - 1) / kChunk;
  const int workers = workers_for(tasks);
  std::vector<Worker> state(workers);
  std::atomic<bool> abandoned{false};
  const bool ok = parallel_tasks(tasks, workers, [&](int64_t t, int w) {
    Worker& me = state[w];
    if (me.hist == nullptr) {
      me.hist = &thread_hist();
      attach(*me.hist, p, copies);
    }
    const int64_t b = t * kChunk, len = std::min(n, b + kChunk) - b;
    QtMinMax m;
    if (!speculative) {
      k.observe_exact(x + b, len, p, me.hist->view, &m);
    } else if (abandoned.load(std::memory_order_relaxed)) {
      m = k.minmax(x + b, len);  // the counts are dropped anyway: min/max only
    } else {
      bool exact = true;
      if (p.float_path) {
        exact = k.observe_fast(x + b, len, p, me.hist->view, &m);
      } else {
        k.observe_exact(x + b, len, p, me.hist->view, &m);
      }
      if (!exact) m = k.minmax(x + b, len);
      if (!exact || !in_range(m, half_range)) abandoned.store(true, std::memory_order_relaxed);
    }
    qt_minmax_merge(me.mm, m);
  });
  QtMinMax all = qt_minmax_init();
  for (const Worker& w : state) qt_minmax_merge(all, w.mm);
  *total = all;
  *accepted = ok && (!speculative || (!abandoned.load() && in_range(all, half_range)));
  for (Worker& w : state) {  // always: the thread's counts must be clear for its next call
    if (w.hist != nullptr) drain(*w.hist, *accepted ? counts : nullptr);
  }
  return ok ? QT_OK : QT_ERR_RESOURCE;
}

QtMinMax parallel_minmax(const float* x, int64_t n, bool* ok) {
  const Kernels& k = kernels();
  const int64_t tasks = (n + kChunk - 1) / kChunk;
  const int workers = workers_for(tasks);
  std::vector<QtMinMax> parts(workers, qt_minmax_init());
  *ok = parallel_tasks(tasks, workers, [&](int64_t t, int w) {
    const int64_t b = t * kChunk;
    qt_minmax_merge(parts[w], k.minmax(x + b, std::min(n, b + kChunk) - b));
  });
  QtMinMax total = qt_minmax_init();
  for (const auto& part : parts) qt_minmax_merge(total, part);
  return total;
}

// Work split for the searches: `items` independent items of `cost` inner steps each.
template <typename Fn>
bool parallel_items(int64_t items, int64_t cost, Fn fn) {
  const int64_t per_task = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(cost, 1));
  const int64_t tasks = (items + per_task - 1) / per_task;
  return parallel_tasks(tasks, workers_for(tasks), [&](int64_t t, int) {
    const int64_t b = t * per_task, e = std::min(items, b + per_task);
    for (int64_t i = b; i < e; ++i) fn(i);
  });
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

int64_t argmin(const std::vector<double>& v) {
  int64_t best = 0;
  for (int64_t k = 1; k < static_cast<int64_t>(v.size()); ++k) {
    if (qt_better(v[k], k, v[best], best)) best = k;
  }
  return best;
}

}  // namespace

// Exceptions (std::bad_alloc, thread creation) must not cross the C boundary.
#define QT_GUARD_BEGIN try {
#define QT_GUARD_END \
  }                  \
  catch (...) {      \
    return QT_ERR_RESOURCE; \
  }

extern "C" {

int qt_cpu_abi_version(void) { return QT_ABI_VERSION; }

const char* qt_cpu_status_string(int status) {
  switch (status) {
    case QT_OK: return "ok";
    case QT_ERR_EMPTY: return "empty input";
    case QT_ERR_BAD_ARG: return "invalid argument";
    case QT_ERR_NO_COUNTS: return "histogram has no counts or a negative count";
    case QT_ERR_RESOURCE: return "out of memory or threads";
    case QT_ERR_NONFINITE: return "input has NaN or Inf";
    default: return "unknown status";
  }
}

int qt_cpu_isa_supported(int isa) { return isa_supported(isa) ? 1 : 0; }

int qt_cpu_set_isa(int isa) {
  if (isa == QT_ISA_BEST) isa = best_isa();
  if (!isa_supported(isa)) return QT_ERR_BAD_ARG;
  current_isa().store(isa);
  return QT_OK;
}

int qt_cpu_get_isa(void) { return current_isa().load(); }

int qt_cpu_set_num_threads(int threads) {
  if (threads > qt::kMaxThreads) return QT_ERR_BAD_ARG;
  qt::configured_threads().store(threads < 1 ? 0 : threads);
  return QT_OK;
}

int qt_cpu_get_num_threads(void) { return qt::thread_budget(); }

int qt_cpu_tensor_minmax(const float* x, int64_t n, float* out_min, float* out_max,
                         int64_t* out_nonfinite) {
  if (n < 1) return QT_ERR_EMPTY;
  QT_GUARD_BEGIN
  bool ok = true;
  const QtMinMax total = parallel_minmax(x, n, &ok);
  if (!ok) return QT_ERR_RESOURCE;
  qt_minmax_finish(total, out_min, out_max);
  *out_nonfinite = total.nonfinite;
  return QT_OK;
  QT_GUARD_END
}

int qt_cpu_channel_minmax(const float* x, int64_t channels, int64_t inner, float* out_min,
                          float* out_max) {
  if (channels < 1 || inner < 1) return QT_ERR_EMPTY;
  QT_GUARD_BEGIN
  const Kernels& k = kernels();
  const bool ok = parallel_items(channels, inner, [&](int64_t c) {
    qt_minmax_finish(k.minmax(x + c * inner, inner), out_min + c, out_max + c);
  });
  return ok ? QT_OK : QT_ERR_RESOURCE;
  QT_GUARD_END
}

int qt_cpu_histogram_accumulate(const float* x, int64_t n, float half_range, int64_t* counts,
                                int64_t nbins) {
  if (n < 1) return QT_ERR_EMPTY;
  if (nbins < 1 || !qt_isfinite(half_range) || !(half_range > 0.0f)) return QT_ERR_BAD_ARG;
  QT_GUARD_BEGIN
  QtMinMax total;
  bool accepted = false;
  return run_histogram(x, n, half_range, counts, nbins, false, &total, &accepted);
  QT_GUARD_END
}

int qt_cpu_observe(const float* x, int64_t n, float half_range, int64_t* counts, int64_t nbins,
                   float* out_min, float* out_max, int64_t* out_nonfinite,
                   int32_t* out_accumulated) {
  if (n < 1) return QT_ERR_EMPTY;
  if (nbins < 1 || !qt_isfinite(half_range) || !(half_range >= 0.0f)) return QT_ERR_BAD_ARG;
  QT_GUARD_BEGIN
  QtMinMax total;
  bool accepted = false;
  if (half_range == 0.0f) {
    bool ok = true;
    total = parallel_minmax(x, n, &ok);
    if (!ok) return QT_ERR_RESOURCE;
  } else {
    const int status = run_histogram(x, n, half_range, counts, nbins, true, &total, &accepted);
    if (status != QT_OK) return status;
  }
  qt_minmax_finish(total, out_min, out_max);
  *out_nonfinite = total.nonfinite;
  *out_accumulated = accepted ? 1 : 0;
  return QT_OK;
  QT_GUARD_END
}

int qt_cpu_kl_divergences(const int64_t* hist, int64_t nbins, int64_t num_levels, double* out) {
  if (nbins < 1 || num_levels < 1 || nbins < num_levels) return QT_ERR_BAD_ARG;
  QT_GUARD_BEGIN
  std::vector<int64_t> prefix, prefix_nz;
  std::vector<double> prefix_hlogh;
  const int status = build_prefix(hist, nbins, prefix, prefix_nz, &prefix_hlogh);
  if (status != QT_OK) return status;
  const int64_t ncand = nbins - num_levels + 1;
  const bool ok = parallel_items(ncand, num_levels, [&](int64_t k) {
    const int64_t i = num_levels + k;
    double kl = qt_kl_last_term(hist, prefix.data(), prefix_nz.data(), nbins, i, num_levels);
    for (int64_t g = 0; g < num_levels; ++g) {
      kl += qt_kl_group_term(prefix.data(), prefix_nz.data(), prefix_hlogh.data(), nbins, g, i,
                             num_levels);
    }
    out[k] = kl;
  });
  return ok ? QT_OK : QT_ERR_RESOURCE;
  QT_GUARD_END
}

int qt_cpu_kl_threshold(const int64_t* hist, int64_t nbins, int64_t num_levels,
                        int64_t* out_bins) {
  if (nbins < 1 || num_levels < 1) return QT_ERR_BAD_ARG;
  QT_GUARD_BEGIN
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
  QT_GUARD_END
}

int qt_cpu_percentile_bin(const int64_t* hist, int64_t nbins, double percentile,
                          double* out_position) {
  if (nbins < 1 || !(percentile > 0.0 && percentile <= 100.0)) return QT_ERR_BAD_ARG;
  QT_GUARD_BEGIN
  std::vector<int64_t> prefix, prefix_nz;
  const int status = build_prefix(hist, nbins, prefix, prefix_nz);
  if (status != QT_OK) return status;
  *out_position = qt_percentile_position(hist, nbins, percentile);
  return QT_OK;
  QT_GUARD_END
}

int qt_cpu_mse_errors(const int64_t* hist, int64_t nbins, int64_t num_steps, double* out) {
  if (nbins < 1 || num_steps < 1) return QT_ERR_BAD_ARG;
  QT_GUARD_BEGIN
  std::vector<int64_t> prefix, prefix_nz;
  const int status = build_prefix(hist, nbins, prefix, prefix_nz);
  if (status != QT_OK) return status;
  const double total = static_cast<double>(prefix[nbins]);
  const bool ok = parallel_items(nbins, nbins, [&](int64_t k) {
    double err = 0.0;
    for (int64_t j = 0; j < nbins; ++j) err += qt_mse_term(hist[j], j, k + 1, num_steps);
    out[k] = err / total;
  });
  return ok ? QT_OK : QT_ERR_RESOURCE;
  QT_GUARD_END
}

int qt_cpu_mse_threshold(const int64_t* hist, int64_t nbins, int64_t num_steps,
                         double* out_bins) {
  if (nbins < 1 || num_steps < 1) return QT_ERR_BAD_ARG;
  QT_GUARD_BEGIN
  std::vector<double> err(nbins);
  const int status = qt_cpu_mse_errors(hist, nbins, num_steps, err.data());
  if (status != QT_OK) return status;
  *out_bins = static_cast<double>(argmin(err) + 1);
  return QT_OK;
  QT_GUARD_END
}

int qt_cpu_block_mse_search(const float* x, int64_t rows, int64_t columns, int64_t block_len,
                            int32_t qmin, int32_t qmax, int32_t symmetric, int32_t signed_scales,
                            const float* grid, int64_t grid_len, float* out_scale,
                            uint8_t* out_zero_point, int32_t* out_best, uint8_t* out_values) {
  if (rows < 1 || columns < 1) return QT_ERR_EMPTY;
  if (block_len < 1 || grid_len < 1 || grid_len > 0x7fffffffLL || out_scale == nullptr) {
    return QT_ERR_BAD_ARG;
  }
  if (!qt_block_qrange_ok(qmin, qmax, symmetric != 0)) return QT_ERR_BAD_ARG;
  if (symmetric == 0 && (out_zero_point == nullptr || signed_scales != 0)) {
    return QT_ERR_BAD_ARG;
  }
  for (int64_t j = 0; j < grid_len; ++j) {
    if (!(grid[j] > 0.0f && grid[j] <= 1.0f)) return QT_ERR_BAD_ARG;
  }
  QT_GUARD_BEGIN
  qt::BlockSearch a{};
  a.x = x;
  a.rows = rows;
  a.columns = columns;
  a.block_len = block_len;
  a.qmin = static_cast<float>(qmin);
  a.qmax = static_cast<float>(qmax);
  a.symmetric = symmetric != 0;
  a.signed_scales = signed_scales != 0;
  a.grid = grid;
  a.grid_len = grid_len;
  a.out_scale = out_scale;
  a.out_zero = out_zero_point;
  a.out_best = out_best;
  a.out_values = out_values;
  const Kernels& k = kernels();
  const int64_t num_blocks = (rows + block_len - 1) / block_len;
  int64_t width = kSearchColumns;
  while (width > 16 && num_blocks * ((columns + width - 1) / width) < 4 * qt::thread_budget()) {
    width /= 2;
  }
  const int64_t strips = (columns + width - 1) / width;
  const int64_t per_block = std::min(block_len, rows);
  std::atomic<bool> finite{true};
  const int64_t candidates = grid_len + (signed_scales != 0 ? 1 : 0);
  const bool ok = parallel_items(num_blocks * strips, per_block * width * candidates,
                                 [&](int64_t item) {
                                   const int64_t b = item / strips;
                                   const int64_t m0 = (item % strips) * width;
                                   const int64_t m1 = std::min(columns, m0 + width);
                                   if (!k.block_search(a, b, m0, m1)) finite.store(false);
                                 });
  if (!ok) return QT_ERR_RESOURCE;
  return finite.load() ? QT_OK : QT_ERR_NONFINITE;
  QT_GUARD_END
}

}  // extern "C"
