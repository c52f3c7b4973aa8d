// Plain C interface of the qtool statistics kernels.
//
// A C ABI (pointers, sizes, a stream handle) lets Python drive both libraries through ctypes, so
// building and loading needs neither torch, CuPy nor pybind. Every function returns a status
// code (QT_OK on success) and writes results through pointers.
//
// libqtool_cpu.so exports qt_cpu_*; pointers are host pointers.
// libqtool_cuda.so exports qt_cuda_*; data pointers are device pointers (allocate with
// qt_cuda_malloc), `stream` is a cudaStream_t or NULL for the default stream; results are ready
// after qt_cuda_stream_sync(stream). The CUDA searches cannot report data errors without a
// synchronisation: callers check histograms (non-negative, positive total) on the host first.
//
// Both backends order min/max totally (-0.0 < +0.0), so a result never depends on the thread
// count, the instruction set or the batch size.
#ifndef QTOOL_KERNELS_H
#define QTOOL_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#define QT_ABI_VERSION 5

#define QT_OK 0
#define QT_ERR_EMPTY 1       /* zero elements / zero channels */
#define QT_ERR_BAD_ARG 2     /* nbins < 1, num_levels < 1, half_range <= 0, percentile range */
#define QT_ERR_NO_COUNTS 3   /* histogram sums to zero (or has a negative count) */
#define QT_ERR_RESOURCE 4    /* out of memory or threads */
#define QT_ERR_NONFINITE 5   /* input has NaN or Inf (block search) */
#define QT_ERR_CUDA_BASE 1000 /* QT_ERR_CUDA_BASE + cudaError_t */

#ifdef __cplusplus
extern "C" {
#endif

/* Instruction sets of the CPU kernels (qt_cpu_set_isa); every one gives identical results. */
#define QT_ISA_BEST (-1)
#define QT_ISA_SCALAR 0
#define QT_ISA_AVX2 1   /* AVX2 + FMA */
#define QT_ISA_AVX512 2 /* AVX-512 F + BW */

/* ---- libqtool_cpu.so ---- */
int qt_cpu_abi_version(void);
const char* qt_cpu_status_string(int status);
int qt_cpu_isa_supported(int isa); /* 1 when this CPU (and OS) can run `isa` */
/* QT_ERR_BAD_ARG when unsupported; QT_ISA_BEST picks the best. Process-wide, for tests. */
int qt_cpu_set_isa(int isa);
int qt_cpu_get_isa(void);
/* Threads a call may use, the caller included; < 1 restores the default (QTOOL_CPU_THREADS, else
   the CPUs in the affinity mask). Threads are started once and reused. */
int qt_cpu_set_num_threads(int threads);
int qt_cpu_get_num_threads(void);
int qt_cpu_tensor_minmax(const float* x, int64_t n, float* out_min, float* out_max,
                         int64_t* out_nonfinite);
int qt_cpu_channel_minmax(const float* x, int64_t channels, int64_t inner, float* out_min,
                          float* out_max);
int qt_cpu_histogram_accumulate(const float* x, int64_t n, float half_range, int64_t* counts,
                                int64_t nbins);
/* One pass for a streaming observer: min/max/non-finite count as qt_cpu_tensor_minmax, and when
   half_range > 0, every value is finite and -half_range < x < half_range, also adds the histogram
   of x (as qt_cpu_histogram_accumulate) to counts and sets *out_accumulated = 1. Otherwise counts
   are left untouched and *out_accumulated = 0 (the caller grows its range and calls again).
   half_range == 0: min/max only. */
int qt_cpu_observe(const float* x, int64_t n, float half_range, int64_t* counts, int64_t nbins,
                   float* out_min, float* out_max, int64_t* out_nonfinite,
                   int32_t* out_accumulated);
/* out: nbins - num_levels + 1 divergences, candidate i = num_levels + k */
int qt_cpu_kl_divergences(const int64_t* hist, int64_t nbins, int64_t num_levels, double* out);
int qt_cpu_kl_threshold(const int64_t* hist, int64_t nbins, int64_t num_levels,
                        int64_t* out_bins);
int qt_cpu_percentile_bin(const int64_t* hist, int64_t nbins, double percentile,
                          double* out_position);
/* out: nbins mean squared errors, candidate t = k + 1 */
int qt_cpu_mse_errors(const int64_t* hist, int64_t nbins, int64_t num_steps, double* out);
int qt_cpu_mse_threshold(const int64_t* hist, int64_t nbins, int64_t num_steps,
                         double* out_bins);
/* MSE-optimal clipping per block, for block-wise weight quantization (qtool/quantize/int4.py).
   x: float32 [rows, columns] row-major. A block is block_len consecutive rows of one column
   (num_blocks = ceil(rows / block_len); the last block is shorter when block_len does not divide
   rows, which equals padding it with zero rows). Per block, range [lo, hi] = [min(min x, 0),
   max(max x, 0)]; each factor grid[j] (0 < f <= 1) shrinks it and gives a scale (and zero point):
     symmetric (qmin < 0 < qmax):  s = max(lo*f / qmin, hi*f / qmax), z = 0
     asymmetric (0 <= qmin):       s = (hi*f - lo*f) / (qmax - qmin), z = clip(rint(-lo*f / s))
     s = s > 0 ? max(s, 1e-8) : 1
   error(j) = sum over the block's rows, in row order, in double, of the squared float32
   ((clip(rint(x / s) + z, qmin, qmax) - z) * s - x); all float32 steps as numpy rounds them
   (rint half to even). The least error wins, the lowest j on ties; grid_len == 1 skips the
   errors. signed_scales (symmetric only, else QT_ERR_BAD_ARG): then the signed-scale grid
   s = (hi > -lo ? hi : lo) / qmin (its sign kept, |s| floored at 1e-8, 1 when 0) replaces the
   winner where its error is strictly smaller, and out_best holds grid_len there. Outputs: out_scale float32 [num_blocks, columns]; out_zero_point uint8 [num_blocks,
   columns] (asymmetric only, may be NULL when symmetric); out_best int32 [num_blocks, columns]
   the chosen j (may be NULL); out_values [rows, columns] the levels clip(rint(x / s) + z) as
   bytes, int8 two's complement when symmetric, uint8 otherwise (may be NULL).
   Supported ranges: symmetric -128 <= qmin < 0 < qmax <= 127, asymmetric 0 <= qmin < qmax <= 255.
   QT_ERR_NONFINITE when x holds NaN or Inf (outputs then unspecified). Identical results on every
   instruction set, thread count and on the CUDA backend. */
int qt_cpu_block_mse_search(const float* x, int64_t rows, int64_t columns, int64_t block_len,
                            int32_t qmin, int32_t qmax, int32_t symmetric, int32_t signed_scales,
                            const float* grid, int64_t grid_len, float* out_scale,
                            uint8_t* out_zero_point, int32_t* out_best, uint8_t* out_values);

/* ---- libqtool_cuda.so ---- */
int qt_cuda_abi_version(void);
const char* qt_cuda_status_string(int status);
int qt_cuda_device_count(int* out_count);
int qt_cuda_malloc(void** out_ptr, size_t bytes);
int qt_cuda_free(void* ptr);
int qt_cuda_memcpy_h2d(void* dst, const void* src, size_t bytes, void* stream);
int qt_cuda_memcpy_d2h(void* dst, const void* src, size_t bytes, void* stream);
int qt_cuda_stream_sync(void* stream);
int qt_cuda_tensor_minmax(const float* x, int64_t n, float* out_min, float* out_max,
                          int64_t* out_nonfinite, void* stream);
int qt_cuda_channel_minmax(const float* x, int64_t channels, int64_t inner, float* out_min,
                           float* out_max, void* stream);
int qt_cuda_histogram_accumulate(const float* x, int64_t n, float half_range, int64_t* counts,
                                 int64_t nbins, void* stream);
/* qt_cpu_observe on the device; every output is a device pointer (results after a sync). */
int qt_cuda_observe(const float* x, int64_t n, float half_range, int64_t* counts, int64_t nbins,
                    float* out_min, float* out_max, int64_t* out_nonfinite,
                    int32_t* out_accumulated, void* stream);
/* Designs of the observe pass (used by qt_cuda_observe, qt_cuda_tensor_minmax and
   qt_cuda_histogram_accumulate), all with identical results; they exist so that one run on a GPU
   can time each (benchmarks/gpu_observe.py). Process-wide, like qt_cpu_set_isa.
   qt_cuda_variant_name returns NULL outside [0, qt_cuda_variant_count()). */
#define QT_CUDA_VARIANT_DEFAULT (-1)
int qt_cuda_variant_count(void);
const char* qt_cuda_variant_name(int variant);
int qt_cuda_set_variant(int variant); /* QT_CUDA_VARIANT_DEFAULT: the built-in default */
int qt_cuda_get_variant(void);
int qt_cuda_default_variant(void);
/* Blocks per multiprocessor of the fused designs' grid, 0 (default): as many as fit at once. */
int qt_cuda_set_blocks_per_sm(int blocks);
int qt_cuda_kl_divergences(const int64_t* hist, int64_t nbins, int64_t num_levels, double* out,
                           void* stream);
int qt_cuda_kl_threshold(const int64_t* hist, int64_t nbins, int64_t num_levels,
                         int64_t* out_bins, void* stream);
int qt_cuda_mse_errors(const int64_t* hist, int64_t nbins, int64_t num_steps, double* out,
                       void* stream);
int qt_cuda_mse_threshold(const int64_t* hist, int64_t nbins, int64_t num_steps,
                          double* out_bins, void* stream);
/* qt_cpu_block_mse_search on the device, bit-identical to it: every pointer (grid included) is a
   device pointer. The argument checks that need no data are the same; the caller checks that x
   is finite and the grid factors lie in (0, 1] on the host (non-finite x gives unspecified
   outputs, never out-of-bounds accesses). One thread per block column, rows in order. */
int qt_cuda_block_mse_search(const float* x, int64_t rows, int64_t columns, int64_t block_len,
                             int32_t qmin, int32_t qmax, int32_t symmetric, int32_t signed_scales,
                             const float* grid, int64_t grid_len, float* out_scale,
                             uint8_t* out_zero_point, int32_t* out_best, uint8_t* out_values,
                             void* stream);

#ifdef __cplusplus
}
#endif

#endif  /* QTOOL_KERNELS_H */
