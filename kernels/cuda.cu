// CUDA backend: the same C functions as cpu.cpp over device pointers and a stream. The math is
// the shared qt_math.h; this file only adds launches and reductions. Reductions use fixed tree
// orders and explicit tie-breaking (qt_better), so results are deterministic run to run.
//
// Callers validate histograms (non-negative, positive total) on the host before calling; the
// kernels cannot report data errors without a synchronisation.
#include <cuda_runtime.h>

#include "qt_math.h"
#include "qtool_kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int kScanThreads = 1024;
constexpr int64_t kMaxSharedBins = 12288;  // 48 KiB of uint32 counters per block

#define QT_CUDA_TRY(expr)                                       \
  do {                                                          \
    cudaError_t qt_err_ = (expr);                               \
    if (qt_err_ != cudaSuccess) return QT_ERR_CUDA_BASE + (int)qt_err_; \
  } while (0)

inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

int sm_count(int* out) {
  int dev = 0;
  QT_CUDA_TRY(cudaGetDevice(&dev));
  QT_CUDA_TRY(cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, dev));
  return QT_OK;
}

// ---- block reductions (blockDim.x == kThreads, fixed order) ----

__device__ QtMinMax block_reduce_minmax(QtMinMax v) {
  __shared__ QtMinMax sh[kThreads];
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) qt_minmax_merge(sh[threadIdx.x], sh[threadIdx.x + s]);
    __syncthreads();
  }
  return sh[0];
}

__device__ double block_reduce_sum(double v) {
  __shared__ double sh[kThreads];
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  double r = sh[0];
  __syncthreads();
  return r;
}

// ---- min / max ----

__global__ void minmax_partial_kernel(const float* x, int64_t n, QtMinMax* parts) {
  QtMinMax acc = qt_minmax_init();
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
    qt_minmax_update(acc, x[k]);
  }
  QtMinMax r = block_reduce_minmax(acc);
  if (threadIdx.x == 0) parts[blockIdx.x] = r;
}

__global__ void minmax_final_kernel(const QtMinMax* parts, int nparts, float* out_min,
                                    float* out_max, int64_t* out_nonfinite) {
  QtMinMax acc = qt_minmax_init();
  for (int k = threadIdx.x; k < nparts; k += blockDim.x) qt_minmax_merge(acc, parts[k]);
  QtMinMax r = block_reduce_minmax(acc);
  if (threadIdx.x == 0) {
    qt_minmax_finish(r, out_min, out_max);
    *out_nonfinite = r.nonfinite;
  }
}

// The merged QtMinMax itself (for qt_cuda_observe's decision).
__global__ void minmax_total_kernel(const QtMinMax* parts, int nparts, QtMinMax* total) {
  QtMinMax acc = qt_minmax_init();
  for (int k = threadIdx.x; k < nparts; k += blockDim.x) qt_minmax_merge(acc, parts[k]);
  QtMinMax r = block_reduce_minmax(acc);
  if (threadIdx.x == 0) *total = r;
}

__global__ void channel_minmax_kernel(const float* x, int64_t inner, float* out_min,
                                      float* out_max) {
  const float* row = x + (int64_t)blockIdx.x * inner;
  QtMinMax acc = qt_minmax_init();
  for (int64_t k = threadIdx.x; k < inner; k += blockDim.x) qt_minmax_update(acc, row[k]);
  QtMinMax r = block_reduce_minmax(acc);
  if (threadIdx.x == 0) qt_minmax_finish(r, out_min + blockIdx.x, out_max + blockIdx.x);
}

// ---- histogram ----

// Privatised histogram: uint32 counters in shared memory, flushed once per block.
__global__ void histogram_shared_kernel(const float* x, int64_t n, float half_range, double scale,
                                        int64_t nbins, unsigned long long* counts) {
  extern __shared__ unsigned int local[];
  for (int64_t j = threadIdx.x; j < nbins; j += blockDim.x) local[j] = 0;
  __syncthreads();
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
    const int64_t bin = qt_hist_bin(x[k], half_range, scale, nbins);
    if (bin >= 0) atomicAdd(&local[bin], 1u);
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < nbins; j += blockDim.x) {
    if (local[j] != 0) atomicAdd(&counts[j], (unsigned long long)local[j]);
  }
}

// Fallback for histograms too large for shared memory: global 64-bit atomics.
__global__ void histogram_global_kernel(const float* x, int64_t n, float half_range, double scale,
                                        int64_t nbins, unsigned long long* counts) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
    const int64_t bin = qt_hist_bin(x[k], half_range, scale, nbins);
    if (bin >= 0) atomicAdd(&counts[bin], 1ull);
  }
}

// ---- observe: min/max, then the histogram only when the range held (decided on the device) ----

// accept[0] = 1 when every value was finite and inside (-R, R); writes the caller's outputs.
__global__ void observe_decide_kernel(const QtMinMax* total, float half_range, float* out_min,
                                      float* out_max, int64_t* out_nonfinite, int32_t* accept,
                                      int32_t* out_accumulated) {
  const QtMinMax r = *total;
  qt_minmax_finish(r, out_min, out_max);
  *out_nonfinite = r.nonfinite;
  const int32_t ok =
      half_range > 0.0f && r.nonfinite == 0 && r.mn > -half_range && r.mx < half_range ? 1 : 0;
  *accept = ok;
  *out_accumulated = ok;
}

__global__ void observe_histogram_shared_kernel(const float* x, int64_t n, float half_range,
                                                double scale, int64_t nbins,
                                                unsigned long long* counts,
                                                const int32_t* accept) {
  if (*accept == 0) return;  // uniform across the grid: no __syncthreads is skipped divergently
  extern __shared__ unsigned int local[];
  for (int64_t j = threadIdx.x; j < nbins; j += blockDim.x) local[j] = 0;
  __syncthreads();
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
    const int64_t bin = qt_hist_bin(x[k], half_range, scale, nbins);
    if (bin >= 0) atomicAdd(&local[bin], 1u);
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < nbins; j += blockDim.x) {
    if (local[j] != 0) atomicAdd(&counts[j], (unsigned long long)local[j]);
  }
}

__global__ void observe_histogram_global_kernel(const float* x, int64_t n, float half_range,
                                                double scale, int64_t nbins,
                                                unsigned long long* counts,
                                                const int32_t* accept) {
  if (*accept == 0) return;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
    const int64_t bin = qt_hist_bin(x[k], half_range, scale, nbins);
    if (bin >= 0) atomicAdd(&counts[bin], 1ull);
  }
}

// ---- prefix sums of a histogram (one block) ----

// prefix[k] = sum(hist[:k]), prefix_nz[k] = count_nonzero(hist[:k]),
// prefix_hlogh[k] = sum(h log h, hist[:k]) for k = 0..nbins: chunked serial sums + block scan.
__global__ void prefix_kernel(const int64_t* hist, int64_t nbins, int64_t* prefix,
                              int64_t* prefix_nz, double* prefix_hlogh) {
  __shared__ int64_t sh_sum[kScanThreads];
  __shared__ int64_t sh_nz[kScanThreads];
  __shared__ double sh_hl[kScanThreads];
  const int t = threadIdx.x;
  const int64_t chunk = (nbins + kScanThreads - 1) / kScanThreads;
  const int64_t b = t * chunk < nbins ? t * chunk : nbins;
  const int64_t e = b + chunk < nbins ? b + chunk : nbins;
  int64_t s = 0, z = 0;
  double hl = 0.0;
  for (int64_t j = b; j < e; ++j) {
    s += hist[j];
    z += hist[j] != 0 ? 1 : 0;
    hl += qt_hlogh(hist[j]);
  }
  sh_sum[t] = s;
  sh_nz[t] = z;
  sh_hl[t] = hl;
  __syncthreads();
  for (int off = 1; off < kScanThreads; off <<= 1) {  // inclusive Hillis-Steele scan
    int64_t as = 0, az = 0;
    double ah = 0.0;
    if (t >= off) {
      as = sh_sum[t - off];
      az = sh_nz[t - off];
      ah = sh_hl[t - off];
    }
    __syncthreads();
    sh_sum[t] += as;
    sh_nz[t] += az;
    sh_hl[t] += ah;
    __syncthreads();
  }
  s = t > 0 ? sh_sum[t - 1] : 0;
  z = t > 0 ? sh_nz[t - 1] : 0;
  hl = t > 0 ? sh_hl[t - 1] : 0.0;
  if (t == 0) {
    prefix[0] = 0;
    prefix_nz[0] = 0;
    prefix_hlogh[0] = 0.0;
  }
  for (int64_t j = b; j < e; ++j) {
    s += hist[j];
    z += hist[j] != 0 ? 1 : 0;
    hl += qt_hlogh(hist[j]);
    prefix[j + 1] = s;
    prefix_nz[j + 1] = z;
    prefix_hlogh[j + 1] = hl;
  }
}

// ---- searches: one block per candidate ----

// Candidate i = num_levels + blockIdx.x; threads split the groups.
__global__ void kl_kernel(const int64_t* hist, const int64_t* prefix, const int64_t* prefix_nz,
                          const double* prefix_hlogh, int64_t nbins, int64_t num_levels,
                          double* out) {
  const int64_t i = num_levels + blockIdx.x;
  double acc = 0.0;
  for (int64_t g = threadIdx.x; g < num_levels; g += blockDim.x) {
    acc += qt_kl_group_term(prefix, prefix_nz, prefix_hlogh, nbins, g, i, num_levels);
  }
  const double r = block_reduce_sum(acc);
  if (threadIdx.x == 0) {
    out[blockIdx.x] = r + qt_kl_last_term(hist, prefix, prefix_nz, nbins, i, num_levels);
  }
}

__global__ void mse_kernel(const int64_t* hist, const int64_t* prefix, int64_t nbins,
                           int64_t num_steps, double* out) {
  const int64_t t = (int64_t)blockIdx.x + 1;
  double acc = 0.0;
  for (int64_t j = threadIdx.x; j < nbins; j += blockDim.x) {
    acc += qt_mse_term(hist[j], j, t, num_steps);
  }
  const double r = block_reduce_sum(acc);
  if (threadIdx.x == 0) out[blockIdx.x] = r / (double)prefix[nbins];
}

// out = (OutT)(argmin(v) + offset); one block.
template <typename OutT>
__global__ void argmin_kernel(const double* v, int64_t n, int64_t offset, OutT* out) {
  __shared__ double sv[kThreads];
  __shared__ int64_t si[kThreads];
  double bv = INFINITY;
  int64_t bi = -1;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    if (bi < 0 || qt_better(v[k], k, bv, bi)) {
      bv = v[k];
      bi = k;
    }
  }
  sv[threadIdx.x] = bv;
  si[threadIdx.x] = bi;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const int64_t oi = si[threadIdx.x + s];
      if (oi >= 0 && (si[threadIdx.x] < 0 ||
                      qt_better(sv[threadIdx.x + s], oi, sv[threadIdx.x], si[threadIdx.x]))) {
        sv[threadIdx.x] = sv[threadIdx.x + s];
        si[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = (OutT)(si[0] + offset);
}

__global__ void fill_int64_kernel(int64_t* out, int64_t value) { *out = value; }

// ---- block-wise MSE clipping search: one thread per (block, column), rows in order ----
// Exactly the scalar CPU reference (cpu_block_search.h scalar::column) on qt_math.h's functions:
// per-thread sequential sums need no reduction, so the result is bit-identical to the CPU one.
// Adjacent threads read adjacent columns of a row: coalesced.
__global__ void block_mse_kernel(const float* x, int64_t rows, int64_t columns, int64_t block_len,
                                 int64_t num_blocks, float qmin, float qmax, int symmetric,
                                 const float* grid, int64_t grid_len, float* out_scale,
                                 uint8_t* out_zero, int32_t* out_best, uint8_t* out_values) {
  const bool sym = symmetric != 0;
  const int64_t total = num_blocks * columns;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += stride) {
    const int64_t k = t / columns, m = t % columns;
    const int64_t r0 = k * block_len;
    const int64_t n = (r0 + block_len < rows ? r0 + block_len : rows) - r0;
    const float* col = x + r0 * columns + m;
    float lo = 0.0f, hi = 0.0f;
    for (int64_t r = 0; r < n; ++r) qt_block_range_step(col[r * columns], lo, hi);
    QtBlockQuant best = qt_block_quant_params(lo, hi, grid[0], qmin, qmax, sym);
    int32_t best_j = 0;
    if (grid_len > 1) {
      double best_err = 0.0;
      for (int64_t r = 0; r < n; ++r) best_err += qt_block_sq_error(col[r * columns], best, qmin, qmax);
      for (int64_t j = 1; j < grid_len; ++j) {
        const QtBlockQuant p = qt_block_quant_params(lo, hi, grid[j], qmin, qmax, sym);
        double err = 0.0;
        for (int64_t r = 0; r < n; ++r) err += qt_block_sq_error(col[r * columns], p, qmin, qmax);
        if (err < best_err) {
          best_err = err;
          best = p;
          best_j = (int32_t)j;
        }
      }
    }
    out_scale[t] = best.scale;
    if (!sym && out_zero != nullptr) out_zero[t] = (uint8_t)(int32_t)best.zero;
    if (out_best != nullptr) out_best[t] = best_j;
    if (out_values != nullptr) {
      uint8_t* out = out_values + r0 * columns + m;
      for (int64_t r = 0; r < n; ++r) {
        out[r * columns] = (uint8_t)(int32_t)qt_block_level(col[r * columns], best, qmin, qmax);
      }
    }
  }
}

// Device scratch freed on the stream when it goes out of scope.
struct Scratch {
  void* ptr = nullptr;
  cudaStream_t stream;
  explicit Scratch(cudaStream_t s) : stream(s) {}
  cudaError_t alloc(size_t bytes) { return cudaMallocAsync(&ptr, bytes, stream); }
  ~Scratch() {
    if (ptr != nullptr) cudaFreeAsync(ptr, stream);
  }
};

struct Prefix {
  int64_t* sum = nullptr;
  int64_t* nz = nullptr;
  double* hlogh = nullptr;
};

int launch_prefix(const int64_t* hist, int64_t nbins, Scratch& scratch, Prefix* p,
                  cudaStream_t s) {
  QT_CUDA_TRY(scratch.alloc(3 * (size_t)(nbins + 1) * sizeof(int64_t)));
  p->sum = static_cast<int64_t*>(scratch.ptr);
  p->nz = p->sum + (nbins + 1);
  p->hlogh = reinterpret_cast<double*>(p->nz + (nbins + 1));
  prefix_kernel<<<1, kScanThreads, 0, s>>>(hist, nbins, p->sum, p->nz, p->hlogh);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

}  // namespace

extern "C" {

int qt_cuda_abi_version(void) { return QT_ABI_VERSION; }

const char* qt_cuda_status_string(int status) {
  if (status >= QT_ERR_CUDA_BASE) {
    return cudaGetErrorString(static_cast<cudaError_t>(status - QT_ERR_CUDA_BASE));
  }
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

int qt_cuda_device_count(int* out_count) {
  *out_count = 0;
  QT_CUDA_TRY(cudaGetDeviceCount(out_count));
  return QT_OK;
}

int qt_cuda_malloc(void** out_ptr, size_t bytes) {
  QT_CUDA_TRY(cudaMalloc(out_ptr, bytes));
  return QT_OK;
}

int qt_cuda_free(void* ptr) {
  QT_CUDA_TRY(cudaFree(ptr));
  return QT_OK;
}

int qt_cuda_memcpy_h2d(void* dst, const void* src, size_t bytes, void* stream) {
  QT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, as_stream(stream)));
  return QT_OK;
}

int qt_cuda_memcpy_d2h(void* dst, const void* src, size_t bytes, void* stream) {
  QT_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, as_stream(stream)));
  return QT_OK;
}

int qt_cuda_stream_sync(void* stream) {
  QT_CUDA_TRY(cudaStreamSynchronize(as_stream(stream)));
  return QT_OK;
}

int qt_cuda_tensor_minmax(const float* x, int64_t n, float* out_min, float* out_max,
                          int64_t* out_nonfinite, void* stream) {
  if (n < 1) return QT_ERR_EMPTY;
  cudaStream_t s = as_stream(stream);
  int sms = 0;
  int status = sm_count(&sms);
  if (status != QT_OK) return status;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int blocks = (int)(want < (int64_t)sms * 8 ? want : (int64_t)sms * 8);
  Scratch parts(s);
  QT_CUDA_TRY(parts.alloc((size_t)blocks * sizeof(QtMinMax)));
  QtMinMax* p = static_cast<QtMinMax*>(parts.ptr);
  minmax_partial_kernel<<<blocks, kThreads, 0, s>>>(x, n, p);
  QT_CUDA_TRY(cudaGetLastError());
  minmax_final_kernel<<<1, kThreads, 0, s>>>(p, blocks, out_min, out_max, out_nonfinite);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

int qt_cuda_channel_minmax(const float* x, int64_t channels, int64_t inner, float* out_min,
                           float* out_max, void* stream) {
  if (channels < 1 || inner < 1) return QT_ERR_EMPTY;
  if (channels > 0x7fffffffLL) return QT_ERR_BAD_ARG;
  channel_minmax_kernel<<<(unsigned)channels, kThreads, 0, as_stream(stream)>>>(x, inner, out_min,
                                                                                 out_max);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

int qt_cuda_histogram_accumulate(const float* x, int64_t n, float half_range, int64_t* counts,
                                 int64_t nbins, void* stream) {
  if (n < 1) return QT_ERR_EMPTY;
  if (nbins < 1 || !qt_isfinite(half_range) || !(half_range > 0.0f)) return QT_ERR_BAD_ARG;
  cudaStream_t s = as_stream(stream);
  int sms = 0;
  int status = sm_count(&sms);
  if (status != QT_OK) return status;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int blocks = (int)(want < (int64_t)sms * 4 ? want : (int64_t)sms * 4);
  const double scale = qt_hist_scale(nbins, half_range);
  auto* c = reinterpret_cast<unsigned long long*>(counts);
  // uint32 shared counters must not overflow: a block sees at most ceil(n / blocks) values.
  const bool fits = nbins <= kMaxSharedBins && (n / blocks) < 0x7fffffffLL;
  if (fits) {
    histogram_shared_kernel<<<blocks, kThreads, (size_t)nbins * sizeof(unsigned int), s>>>(
        x, n, half_range, scale, nbins, c);
  } else {
    histogram_global_kernel<<<blocks, kThreads, 0, s>>>(x, n, half_range, scale, nbins, c);
  }
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

int qt_cuda_observe(const float* x, int64_t n, float half_range, int64_t* counts, int64_t nbins,
                    float* out_min, float* out_max, int64_t* out_nonfinite,
                    int32_t* out_accumulated, void* stream) {
  if (n < 1) return QT_ERR_EMPTY;
  if (nbins < 1 || !qt_isfinite(half_range) || !(half_range >= 0.0f)) return QT_ERR_BAD_ARG;
  cudaStream_t s = as_stream(stream);
  int sms = 0;
  int status = sm_count(&sms);
  if (status != QT_OK) return status;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int mm_blocks = (int)(want < (int64_t)sms * 8 ? want : (int64_t)sms * 8);
  const int hist_blocks = (int)(want < (int64_t)sms * 4 ? want : (int64_t)sms * 4);
  // scratch: mm_blocks partial results, the total, the accept flag
  Scratch scratch(s);
  QT_CUDA_TRY(scratch.alloc((size_t)(mm_blocks + 1) * sizeof(QtMinMax) + 16));
  QtMinMax* parts = static_cast<QtMinMax*>(scratch.ptr);
  QtMinMax* total = parts + mm_blocks;
  int32_t* accept = reinterpret_cast<int32_t*>(total + 1);
  minmax_partial_kernel<<<mm_blocks, kThreads, 0, s>>>(x, n, parts);
  QT_CUDA_TRY(cudaGetLastError());
  minmax_total_kernel<<<1, kThreads, 0, s>>>(parts, mm_blocks, total);
  QT_CUDA_TRY(cudaGetLastError());
  observe_decide_kernel<<<1, 1, 0, s>>>(total, half_range, out_min, out_max, out_nonfinite, accept,
                                        out_accumulated);
  QT_CUDA_TRY(cudaGetLastError());
  if (half_range == 0.0f) return QT_OK;
  const double scale = qt_hist_scale(nbins, half_range);
  auto* c = reinterpret_cast<unsigned long long*>(counts);
  const bool fits = nbins <= kMaxSharedBins && (n / hist_blocks) < 0x7fffffffLL;
  if (fits) {
    observe_histogram_shared_kernel<<<hist_blocks, kThreads, (size_t)nbins * sizeof(unsigned int),
                                      s>>>(x, n, half_range, scale, nbins, c, accept);
  } else {
    observe_histogram_global_kernel<<<hist_blocks, kThreads, 0, s>>>(x, n, half_range, scale,
                                                                     nbins, c, accept);
  }
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

int qt_cuda_kl_divergences(const int64_t* hist, int64_t nbins, int64_t num_levels, double* out,
                           void* stream) {
  if (nbins < 1 || num_levels < 1 || nbins < num_levels) return QT_ERR_BAD_ARG;
  if (nbins - num_levels + 1 > 0x7fffffffLL) return QT_ERR_BAD_ARG;
  cudaStream_t s = as_stream(stream);
  Scratch scratch(s);
  Prefix p;
  int status = launch_prefix(hist, nbins, scratch, &p, s);
  if (status != QT_OK) return status;
  kl_kernel<<<(unsigned)(nbins - num_levels + 1), kThreads, 0, s>>>(
      hist, p.sum, p.nz, p.hlogh, nbins, num_levels, out);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

int qt_cuda_kl_threshold(const int64_t* hist, int64_t nbins, int64_t num_levels,
                         int64_t* out_bins, void* stream) {
  if (nbins < 1 || num_levels < 1) return QT_ERR_BAD_ARG;
  cudaStream_t s = as_stream(stream);
  if (nbins <= num_levels) {
    fill_int64_kernel<<<1, 1, 0, s>>>(out_bins, nbins);
    QT_CUDA_TRY(cudaGetLastError());
    return QT_OK;
  }
  const int64_t ncand = nbins - num_levels + 1;
  Scratch kl(s);
  QT_CUDA_TRY(kl.alloc((size_t)ncand * sizeof(double)));
  double* d = static_cast<double*>(kl.ptr);
  int status = qt_cuda_kl_divergences(hist, nbins, num_levels, d, stream);
  if (status != QT_OK) return status;
  argmin_kernel<int64_t><<<1, kThreads, 0, s>>>(d, ncand, num_levels, out_bins);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

int qt_cuda_mse_errors(const int64_t* hist, int64_t nbins, int64_t num_steps, double* out,
                       void* stream) {
  if (nbins < 1 || num_steps < 1 || nbins > 0x7fffffffLL) return QT_ERR_BAD_ARG;
  cudaStream_t s = as_stream(stream);
  Scratch scratch(s);
  Prefix p;
  int status = launch_prefix(hist, nbins, scratch, &p, s);
  if (status != QT_OK) return status;
  mse_kernel<<<(unsigned)nbins, kThreads, 0, s>>>(hist, p.sum, nbins, num_steps, out);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

int qt_cuda_mse_threshold(const int64_t* hist, int64_t nbins, int64_t num_steps,
                          double* out_bins, void* stream) {
  if (nbins < 1 || num_steps < 1) return QT_ERR_BAD_ARG;
  cudaStream_t s = as_stream(stream);
  Scratch err(s);
  QT_CUDA_TRY(err.alloc((size_t)nbins * sizeof(double)));
  double* d = static_cast<double*>(err.ptr);
  int status = qt_cuda_mse_errors(hist, nbins, num_steps, d, stream);
  if (status != QT_OK) return status;
  argmin_kernel<double><<<1, kThreads, 0, s>>>(d, nbins, 1, out_bins);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

int qt_cuda_block_mse_search(const float* x, int64_t rows, int64_t columns, int64_t block_len,
                             int32_t qmin, int32_t qmax, int32_t symmetric, const float* grid,
                             int64_t grid_len, float* out_scale, uint8_t* out_zero_point,
                             int32_t* out_best, uint8_t* out_values, void* stream) {
  if (rows < 1 || columns < 1) return QT_ERR_EMPTY;
  if (block_len < 1 || grid_len < 1 || grid_len > 0x7fffffffLL || out_scale == nullptr) {
    return QT_ERR_BAD_ARG;
  }
  if (!qt_block_qrange_ok(qmin, qmax, symmetric != 0)) return QT_ERR_BAD_ARG;
  if (symmetric == 0 && out_zero_point == nullptr) return QT_ERR_BAD_ARG;
  cudaStream_t s = as_stream(stream);
  int sms = 0;
  int status = sm_count(&sms);
  if (status != QT_OK) return status;
  const int64_t num_blocks = (rows + block_len - 1) / block_len;
  const int64_t want = (num_blocks * columns + kThreads - 1) / kThreads;
  const int blocks = (int)(want < (int64_t)sms * 32 ? want : (int64_t)sms * 32);
  block_mse_kernel<<<blocks, kThreads, 0, s>>>(
      x, rows, columns, block_len, num_blocks, (float)qmin, (float)qmax, symmetric, grid,
      grid_len, out_scale, out_zero_point, out_best, out_values);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

}  // extern "C"
