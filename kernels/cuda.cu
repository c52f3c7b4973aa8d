// CUDA backend: the same C functions as cpu.cpp over device pointers and a stream. The math is
// the shared qt_math.h; this file only adds launches and reductions. Results equal the CPU
// backend's bit for bit wherever the CPU's are exact, because nothing here depends on an order:
// min/max use the total order of qt_less, counts are integers, and every floating-point sum that
// reaches a result (MSE errors, block searches) is added by one thread in the CPU's order. The KL
// divergences are the exception (log differs between libm and CUDA in the last bit).
//
// The observer's pass (min/max + histogram) comes in several designs, the "variants" below,
// selectable at run time (qt_cuda_set_variant) so that one run on a GPU can time them all
// (benchmarks/gpu_observe.py) and check each against the CPU (tests/gpu/). Every variant computes
// the same results; they differ only in speed.
//
// Callers validate histograms (non-negative, positive total) on the host before calling; the
// kernels cannot report data errors without a synchronisation.
#include <cuda_runtime.h>

#include <atomic>
#include <mutex>

#include "qt_math.h"
#include "qtool_kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int kScanThreads = 1024;
constexpr int kFinalThreads = 1024;
constexpr int64_t kMaxSharedBins = 12288;  // 48 KiB of uint32 counters per block (two-pass)
// A fused block reads at least this many elements: a small tensor then launches few blocks, each
// of which zeroes and flushes its shared histogram only once.
constexpr int64_t kMinElementsPerBlock = int64_t(1) << 15;
// Shared uint32 counters must not overflow: no block reads 2^31 elements or more.
constexpr int64_t kMaxElementsPerBlock = int64_t(1) << 31;

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

// Scratch comes from the stream-ordered pool (cudaMallocAsync). Its default release threshold is
// 0: every synchronisation hands the memory back to the driver and the next call allocates again.
// Calibration calls the kernels per tensor per batch, so keep what the pool holds (once per
// device; 64 devices at most, more only miss this tuning).
int keep_pool_memory() {
  static std::atomic<unsigned long long> done{0};
  int dev = 0;
  QT_CUDA_TRY(cudaGetDevice(&dev));
  if (dev >= 64) return QT_OK;
  const unsigned long long bit = 1ull << dev;
  if (done.load(std::memory_order_relaxed) & bit) return QT_OK;
  cudaMemPool_t pool;
  QT_CUDA_TRY(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t threshold = ~uint64_t(0);
  QT_CUDA_TRY(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  done.fetch_or(bit);
  return QT_OK;
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

__device__ void minmax_partial(const float* x, int64_t n, QtMinMax* parts) {
  QtMinMax acc = qt_minmax_init();
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
    qt_minmax_update(acc, x[k]);
  }
  QtMinMax r = block_reduce_minmax(acc);
  if (threadIdx.x == 0) parts[blockIdx.x] = r;
}

__global__ void minmax_partial_kernel(const float* x, int64_t n, QtMinMax* parts) {
  minmax_partial(x, n, parts);
}

// The lean designs' second look (below): runs only when *flag is set (the tensor held NaN/Inf).
__global__ void fixup_partial_kernel(const float* x, int64_t n, const int32_t* flag,
                                     QtMinMax* parts) {
  if (*flag == 0) return;  // uniform across the grid
  minmax_partial(x, n, parts);
}

__global__ void fixup_final_kernel(const QtMinMax* parts, int nparts, const int32_t* flag,
                                   float* out_min, float* out_max, int64_t* out_nonfinite) {
  if (*flag == 0) return;
  QtMinMax acc = qt_minmax_init();
  for (int k = threadIdx.x; k < nparts; k += blockDim.x) qt_minmax_merge(acc, parts[k]);
  QtMinMax r = block_reduce_minmax(acc);
  if (threadIdx.x == 0) {
    qt_minmax_finish(r, out_min, out_max);
    *out_nonfinite = r.nonfinite;
  }
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

// ---- observe variants ----
//
// What calibration calls per tensor and batch is qt_cuda_observe: min/max/non-finite count, and
// the histogram at the current range when every value is finite and inside it. The old design
// ("two-pass") reads the tensor twice: min/max first, then the histogram once the range held.
// The fused designs read it once: each block counts into a shared-memory histogram while it takes
// min/max, flushes it into a zeroed speculative histogram, and one final block merges the
// min/max, decides, and adds the speculative counts to the caller's only when the range held
// (the CPU's speculative pass, cpu.cpp). Out-of-range values are clamped into the edge bins
// meanwhile, which a rejected call discards anyway. They differ in:
//  - loads: one float per thread and step, or float4 (16 bytes), four of them in flight;
//  - copies: warps share 1, 2, 4 copies of the shared histogram, or each warp has its own, so
//    fewer warps contend for one counter (a peaked histogram serialises its atomics);
//  - zeros: exact zeros (half of a ReLU's output) counted in a register instead of one shared
//    counter that every warp hits;
//  - match: lanes of a warp with the same bin add once (__match_any_sync) instead of each;
//  - bins: the float32 power-of-two formula (qt_hist_bin_pow2, every observer geometry) or the
//    double formula (qt_hist_bin) always, to time what the double conversions cost;
//  - lean (below): no per-value finiteness test at all, min/max as integer keys, and a second
//    look only at tensors holding NaN/Inf (about 12 instructions per value in the sm_90 code
//    against about 28 for the others, read off cuobjdump).
// The histograms are integer counts and min/max follow a total order, so every variant gives the
// same results in any block and warp order (tests/gpu/test_cuda_kernels.py checks each against
// the CPU on the same inputs).

enum VariantKind { kTwoPass = 0, kFused = 1 };

struct LaunchArgs;
using LaunchFn = int (*)(const LaunchArgs&);

struct Variant {
  const char* name;
  int kind;
  int copies;  // shared histogram copies per block; 0: one per warp
  int threads;
  bool double_bins;
  LaunchFn launch;  // fused designs: the kernel family (loads, zeros, match)
  LaunchFn lean;    // lean designs: their family for observe and min/max, else null
};

// Histogram geometry of one call, as the kernels read it.
struct HistGeom {
  float half_range;
  double scale;
  int64_t nbins;
  QtPow2Bins pow2;
  int32_t zero_bin;
};

// One fused launch.
struct LaunchArgs {
  const float* x;
  int64_t n;
  HistGeom g;
  bool hist;                        // count a histogram (else min/max only)
  bool pow2;                        // use the float32 bins
  bool shared;                      // shared-memory histogram (else global atomics)
  int copies;                       // shared copies (power of two)
  int threads;
  int blocks_per_sm;                // 0: as many as fit
  int64_t max_blocks;               // `parts` holds this many
  QtMinMax* parts;                  // one per block
  int* out_blocks;                  // blocks launched
  unsigned long long* target;       // histogram counts receiving this call's counts
  cudaStream_t stream;
};

// Per-thread min/max: plain comparisons plus the sign bits of the finite values seen, made
// canonical once at the end (as cpu_simd.h's ScalarMinMax): the same answer as qt_minmax_step's
// total order, without its per-element zero test.
struct ThreadMinMax {
  float mn, mx;
  unsigned nonfinite;
  unsigned any_bits, any_not_bits;  // OR of the bits / of the inverted bits of finite values

  __device__ void init() {
    mn = INFINITY;
    mx = -INFINITY;
    nonfinite = 0;
    any_bits = 0;
    any_not_bits = 0;
  }
  __device__ QtMinMax finish() const {
    QtMinMax r;
    const bool neg_seen = (any_bits >> 31) != 0;      // a finite value with the sign bit set
    const bool pos_seen = (any_not_bits >> 31) != 0;  // ... with it clear
    r.mn = mn == 0.0f ? (neg_seen ? -0.0f : 0.0f) : mn;
    r.mx = mx == 0.0f ? (pos_seen ? 0.0f : -0.0f) : mx;
    r.nonfinite = nonfinite;
    return r;
  }
};

__device__ __forceinline__ QtMinMax shfl_minmax(const QtMinMax& v, int offset) {
  QtMinMax o;
  o.mn = __shfl_xor_sync(0xffffffffu, v.mn, offset);
  o.mx = __shfl_xor_sync(0xffffffffu, v.mx, offset);
  o.nonfinite = __shfl_xor_sync(0xffffffffu, (long long)v.nonfinite, offset);
  return o;
}

// Merge over the block (any blockDim multiple of 32 up to 1024); the result is in every thread.
// qt_minmax_merge is order-independent, so the shuffle tree's order does not matter.
__device__ QtMinMax block_merge_minmax(QtMinMax v) {
  __shared__ QtMinMax warps[32];
  for (int off = 16; off > 0; off >>= 1) qt_minmax_merge(v, shfl_minmax(v, off));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warps[warp] = v;
  __syncthreads();
  const int nwarps = (int)(blockDim.x >> 5);
  QtMinMax r = qt_minmax_init();
  for (int w = 0; w < nwarps; ++w) qt_minmax_merge(r, warps[w]);
  __syncthreads();
  return r;
}

// The fused kernels' dynamic shared memory: the block's histogram copies.
extern __shared__ unsigned fused_smem[];

// counter += 1 at shared address `addr` when `on`: one predicated RED, no branch. Through PTX
// because the compiler otherwise recomputes the shared window's base for every element.
__device__ __forceinline__ void shared_increment(unsigned addr, bool on) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %1, 0;\n\t@p red.shared.add.u32 [%0], 1;\n\t}"
      :
      : "r"(addr), "r"((unsigned)on)
      : "memory");
}

// One value: min/max, and its bin counted unless it is non-finite (or a zero kept in a register).
// `valid` false: a padding lane of the last step (MATCH needs every lane of the warp to take part).
// Written without branches: the bin is computed for every value and the increment is predicated,
// so a warp never splits per element. `base`: this warp's copy in fused_smem, as a shared-space
// byte address.
template <bool HIST, bool ZEROS, bool MATCH, bool POW2, bool SHARED>
__device__ __forceinline__ void take(float v, bool valid, ThreadMinMax& m, unsigned& zeros,
                                     unsigned base, unsigned long long* global_hist,
                                     const HistGeom& g) {
  const bool finite = valid && qt_isfinite(v);
  const unsigned bits = __float_as_uint(v);
  m.mn = finite ? fminf(m.mn, v) : m.mn;
  m.mx = finite ? fmaxf(m.mx, v) : m.mx;
  m.any_bits |= finite ? bits : 0u;
  m.any_not_bits |= finite ? ~bits : 0u;
  m.nonfinite += valid && !finite ? 1u : 0u;
  if (!HIST) return;
  bool count = finite;
  if (ZEROS) {
    const bool zero = v == 0.0f;
    zeros += finite && zero ? 1u : 0u;
    count = count && !zero;
  }
  int bin;
  if (POW2) {
    bin = qt_hist_bin_pow2(v, g.pow2);
  } else {
    bin = (int)qt_hist_bin(v, g.half_range, g.scale, g.nbins);
    count = count && bin >= 0;
  }
  if (!SHARED) {
    if (count) atomicAdd(global_hist + bin, 1ull);
  } else if (MATCH) {
    const unsigned peers = __match_any_sync(0xffffffffu, count ? bin : -1);
    if (count && (threadIdx.x & 31) == __ffs(peers) - 1) {
      asm volatile("red.shared.add.u32 [%0], %1;" : : "r"(base + 4u * (unsigned)bin),
                   "r"((unsigned)__popc(peers)) : "memory");
    }
  } else {
    shared_increment(base + 4u * (unsigned)bin, count);
  }
}

// The fused pass over x[0:n]. VEC 4: float4 loads after a scalar head up to 16-byte alignment;
// kUnroll loads are issued before any is used. Loop bounds are uniform per warp (MATCH). At most
// 512 threads per block (every design's), which leaves the compiler up to 128 registers.
template <int VEC, bool HIST, bool ZEROS, bool MATCH, bool POW2, bool SHARED>
__global__ void __launch_bounds__(512) fused_observe_kernel(const float* __restrict__ x,
                                                             int64_t n, HistGeom g, int copies,
                                                             QtMinMax* parts,
                                                             unsigned long long* target) {
  constexpr int kUnroll = 4;
  // this warp's copy, fused_smem[copy * nbins : (copy + 1) * nbins], as a shared byte address
  unsigned hist = 0;
  if (HIST && SHARED) {
    const unsigned words = (unsigned)copies * (unsigned)g.nbins;  // fits shared memory
    for (unsigned j = threadIdx.x; j < words; j += blockDim.x) fused_smem[j] = 0;
    const unsigned copy = (threadIdx.x >> 5) & (unsigned)(copies - 1);
    hist = (unsigned)__cvta_generic_to_shared(fused_smem) + 4u * copy * (unsigned)g.nbins;
    __syncthreads();
  }
  ThreadMinMax m;
  m.init();
  unsigned zeros = 0;
  const int lane = threadIdx.x & 31;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t warp_first = (int64_t)blockIdx.x * blockDim.x + (threadIdx.x & ~31);

  int64_t head = 0;  // scalar elements before the first 16-byte boundary
  if (VEC == 4) {
    const unsigned mis = (unsigned)(((uintptr_t)x >> 2) & 3);
    head = mis != 0 ? 4 - mis : 0;
    head = head < n ? head : n;
  }
  const int64_t body = VEC == 4 ? (n - head) / 4 : n;  // vectors (VEC 4) or elements
  const int64_t tail_first = head + body * VEC;
  if (VEC == 4 && blockIdx.x == 0 && threadIdx.x < 32) {  // head and tail: at most 6 elements
    const int64_t rest = n - tail_first;
    const bool in_head = lane < head;
    const bool in_tail = lane >= 4 && lane - 4 < rest;
    const int64_t idx = in_head ? lane : tail_first + (lane - 4);
    const bool valid = in_head || in_tail;
    take<HIST, ZEROS, MATCH, POW2, SHARED>(valid ? x[idx] : 0.0f, valid, m, zeros, hist, target, g);
  }

  const int64_t chunk = (int64_t)kUnroll * stride;
  const int64_t full = body / chunk;  // steps where every load of every thread is in range
  int64_t i = warp_first + lane;
  if (VEC == 4) {
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x + head);
    for (int64_t step = 0; step < full; ++step, i += chunk) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(x4 + i + u * stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        take<HIST, ZEROS, MATCH, POW2, SHARED>(v[u].x, true, m, zeros, hist, target, g);
        take<HIST, ZEROS, MATCH, POW2, SHARED>(v[u].y, true, m, zeros, hist, target, g);
        take<HIST, ZEROS, MATCH, POW2, SHARED>(v[u].z, true, m, zeros, hist, target, g);
        take<HIST, ZEROS, MATCH, POW2, SHARED>(v[u].w, true, m, zeros, hist, target, g);
      }
    }
    for (int64_t b = full * chunk + warp_first; b < body; b += stride) {
      const int64_t k = b + lane;
      const bool valid = k < body;
      const float4 v = valid ? __ldg(x4 + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      take<HIST, ZEROS, MATCH, POW2, SHARED>(v.x, valid, m, zeros, hist, target, g);
      take<HIST, ZEROS, MATCH, POW2, SHARED>(v.y, valid, m, zeros, hist, target, g);
      take<HIST, ZEROS, MATCH, POW2, SHARED>(v.z, valid, m, zeros, hist, target, g);
      take<HIST, ZEROS, MATCH, POW2, SHARED>(v.w, valid, m, zeros, hist, target, g);
    }
  } else {
    for (int64_t step = 0; step < full; ++step, i += chunk) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(x + i + u * stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        take<HIST, ZEROS, MATCH, POW2, SHARED>(v[u], true, m, zeros, hist, target, g);
      }
    }
    for (int64_t b = full * chunk + warp_first; b < body; b += stride) {
      const int64_t k = b + lane;
      const bool valid = k < body;
      take<HIST, ZEROS, MATCH, POW2, SHARED>(valid ? __ldg(x + k) : 0.0f, valid, m, zeros, hist,
                                             target, g);
    }
  }

  const QtMinMax r = block_merge_minmax(m.finish());
  if (threadIdx.x == 0) parts[blockIdx.x] = r;
  if (!HIST) return;
  if (ZEROS) {
    const unsigned warp_zeros = __reduce_add_sync(0xffffffffu, zeros);
    if (lane == 0 && warp_zeros != 0) {
      if (SHARED) {
        asm volatile("red.shared.add.u32 [%0], %1;" : : "r"(hist + 4u * (unsigned)g.zero_bin),
                     "r"(warp_zeros) : "memory");
      } else {
        atomicAdd(target + g.zero_bin, (unsigned long long)warp_zeros);
      }
    }
  }
  if (!SHARED) return;
  __syncthreads();
  for (unsigned j = threadIdx.x; j < (unsigned)g.nbins; j += blockDim.x) {
    unsigned sum = 0;  // < 2^31: a block reads fewer elements (kMaxElementsPerBlock)
    for (int c = 0; c < copies; ++c) sum += fused_smem[(unsigned)c * (unsigned)g.nbins + j];
    if (sum != 0) atomicAdd(target + j, (unsigned long long)sum);
  }
}

// Merges the blocks' min/max; with `counts`, decides as qt_cpu_observe does and adds the
// speculative histogram to the caller's counts when every value was finite and in (-R, R).
// Outputs that are null are not written. One block of kFinalThreads.
__global__ void fused_final_kernel(const QtMinMax* parts, int nparts, float half_range,
                                   const unsigned long long* spec, int64_t nbins,
                                   int64_t* counts, float* out_min, float* out_max,
                                   int64_t* out_nonfinite, int32_t* out_accumulated) {
  QtMinMax acc = qt_minmax_init();
  for (int k = threadIdx.x; k < nparts; k += blockDim.x) qt_minmax_merge(acc, parts[k]);
  const QtMinMax r = block_merge_minmax(acc);
  const bool ok = half_range > 0.0f && r.nonfinite == 0 && r.mn > -half_range && r.mx < half_range;
  if (threadIdx.x == 0) {
    if (out_min != nullptr) qt_minmax_finish(r, out_min, out_max);
    if (out_nonfinite != nullptr) *out_nonfinite = r.nonfinite;
    if (out_accumulated != nullptr) *out_accumulated = ok ? 1 : 0;
  }
  if (ok && spec != nullptr && counts != nullptr) {
    for (int64_t j = threadIdx.x; j < nbins; j += blockDim.x) counts[j] += (int64_t)spec[j];
  }
}

// ---- lean designs: per value only what an accepted observe needs ----
//
// A call whose tensor holds NaN or Inf is rejected whatever its histogram, and calibration stops
// on it; so the lean pass neither tests finiteness nor excludes non-finite values per value. It
// keeps min/max as integer keys in the total order of qt_less (order_key: -0.0 < +0.0, NaN and
// Inf at the ends), counts every value (non-finite ones into some edge bin), and sends exact
// zeros to one counter per lane (no contention, added to the zero's bin at the flush). The final
// block sees from the keys alone whether a NaN/Inf was present; only then, two more kernels
// (launched every time, returning at once otherwise) compute the exact min/max and non-finite
// count with qt_minmax_update, and the call is rejected as qt_cpu_observe rejects it.

__device__ __forceinline__ int order_key(float v) {
  const int i = __float_as_int(v);
  return i ^ ((i >> 31) & 0x7fffffff);
}
__device__ __forceinline__ float from_key(int k) {
  return __int_as_float(k ^ ((k >> 31) & 0x7fffffff));
}
constexpr int kKeyPosInf = 0x7f800000;        // order_key(+Inf); +NaN above
constexpr int kKeyNegInf = (int)0x807fffffu;  // order_key(-Inf); -NaN below

template <bool HIST, bool ZEROS, bool POW2>
__device__ __forceinline__ void lean_take(float v, int& kmin, int& kmax, unsigned base,
                                          unsigned zero_slot, const HistGeom& g) {
  const int key = order_key(v);
  kmin = min(kmin, key);
  kmax = max(kmax, key);
  if (!HIST) return;
  int bin;
  if (POW2) {
    bin = qt_hist_bin_pow2(v, g.pow2);  // an edge bin for +-Inf and NaN
  } else {
    bin = (int)qt_hist_bin(v, g.half_range, g.scale, g.nbins);
    bin = bin > 0 ? bin : 0;  // -1 (NaN/Inf): any bin, the call is rejected
  }
  unsigned addr = base + 4u * (unsigned)bin;
  if (ZEROS) addr = v == 0.0f ? zero_slot : addr;
  asm volatile("red.shared.add.u32 [%0], 1;" : : "r"(addr) : "memory");
}

template <bool HIST, bool ZEROS, bool POW2>
__global__ void __launch_bounds__(512) lean_observe_kernel(const float* __restrict__ x, int64_t n,
                                                           HistGeom g, int copies, int2* parts,
                                                           unsigned long long* target) {
  constexpr int kUnroll = 4;
  const unsigned words_per_copy = (unsigned)g.nbins + (ZEROS ? 32u : 0u);  // bins, lane zeros
  const int lane = threadIdx.x & 31;
  unsigned base = 0, zero_slot = 0;
  if (HIST) {
    const unsigned words = (unsigned)copies * words_per_copy;
    for (unsigned j = threadIdx.x; j < words; j += blockDim.x) fused_smem[j] = 0;
    const unsigned copy = (threadIdx.x >> 5) & (unsigned)(copies - 1);
    base = (unsigned)__cvta_generic_to_shared(fused_smem) + 4u * copy * words_per_copy;
    zero_slot = base + 4u * ((unsigned)g.nbins + (unsigned)lane);
    __syncthreads();
  }
  int kmin = 0x7fffffff, kmax = (int)0x80000000u;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned mis = (unsigned)(((uintptr_t)x >> 2) & 3);
  int64_t head = mis != 0 ? 4 - mis : 0;
  head = head < n ? head : n;
  const int64_t body = (n - head) / 4;
  const int64_t tail_first = head + body * 4;
  if (first < head) lean_take<HIST, ZEROS, POW2>(x[first], kmin, kmax, base, zero_slot, g);
  if (first < n - tail_first) {
    lean_take<HIST, ZEROS, POW2>(x[tail_first + first], kmin, kmax, base, zero_slot, g);
  }
  const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x + head);
  const int64_t chunk = (int64_t)kUnroll * stride;
  const int64_t full = body / chunk;
  int64_t i = first;
  for (int64_t step = 0; step < full; ++step, i += chunk) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(x4 + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      lean_take<HIST, ZEROS, POW2>(v[u].x, kmin, kmax, base, zero_slot, g);
      lean_take<HIST, ZEROS, POW2>(v[u].y, kmin, kmax, base, zero_slot, g);
      lean_take<HIST, ZEROS, POW2>(v[u].z, kmin, kmax, base, zero_slot, g);
      lean_take<HIST, ZEROS, POW2>(v[u].w, kmin, kmax, base, zero_slot, g);
    }
  }
  for (; i < body; i += stride) {
    const float4 v = __ldg(x4 + i);
    lean_take<HIST, ZEROS, POW2>(v.x, kmin, kmax, base, zero_slot, g);
    lean_take<HIST, ZEROS, POW2>(v.y, kmin, kmax, base, zero_slot, g);
    lean_take<HIST, ZEROS, POW2>(v.z, kmin, kmax, base, zero_slot, g);
    lean_take<HIST, ZEROS, POW2>(v.w, kmin, kmax, base, zero_slot, g);
  }

  __shared__ int warp_min[32], warp_max[32];
  kmin = __reduce_min_sync(0xffffffffu, kmin);
  kmax = __reduce_max_sync(0xffffffffu, kmax);
  if (lane == 0) {
    warp_min[threadIdx.x >> 5] = kmin;
    warp_max[threadIdx.x >> 5] = kmax;
  }
  __syncthreads();  // also: every increment of the block is done
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
      kmin = min(kmin, warp_min[w]);
      kmax = max(kmax, warp_max[w]);
    }
    parts[blockIdx.x] = make_int2(kmin, kmax);
  }
  if constexpr (HIST) {
    for (unsigned j = threadIdx.x; j < (unsigned)g.nbins; j += blockDim.x) {
      unsigned sum = 0;  // < 2^31: a block reads fewer elements (kMaxElementsPerBlock)
      for (int c = 0; c < copies; ++c) sum += fused_smem[(unsigned)c * words_per_copy + j];
      if (sum != 0) atomicAdd(target + j, (unsigned long long)sum);
    }
    if (ZEROS && threadIdx.x < 32) {  // warp 0: the lane counters of exact zeros
      unsigned sum = 0;
      for (int c = 0; c < copies; ++c) {
        sum += fused_smem[(unsigned)c * words_per_copy + (unsigned)g.nbins + (unsigned)lane];
      }
      sum = __reduce_add_sync(0xffffffffu, sum);
      if (lane == 0 && sum != 0) atomicAdd(target + g.zero_bin, (unsigned long long)sum);
    }
  }
}

// The lean designs' decision: min/max from the keys; with a NaN/Inf present, *flag = 1 (the fixup
// kernels write min/max and the count) and the call is rejected; else as fused_final_kernel.
__global__ void lean_final_kernel(const int2* parts, int nparts, float half_range,
                                  const unsigned long long* spec, int64_t nbins, int64_t* counts,
                                  float* out_min, float* out_max, int64_t* out_nonfinite,
                                  int32_t* out_accumulated, int32_t* flag) {
  int kmin = 0x7fffffff, kmax = (int)0x80000000u;
  for (int k = threadIdx.x; k < nparts; k += blockDim.x) {
    kmin = min(kmin, parts[k].x);
    kmax = max(kmax, parts[k].y);
  }
  __shared__ int warp_min[32], warp_max[32];
  kmin = __reduce_min_sync(0xffffffffu, kmin);
  kmax = __reduce_max_sync(0xffffffffu, kmax);
  if ((threadIdx.x & 31) == 0) {
    warp_min[threadIdx.x >> 5] = kmin;
    warp_max[threadIdx.x >> 5] = kmax;
  }
  __syncthreads();
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
    kmin = min(kmin, warp_min[w]);
    kmax = max(kmax, warp_max[w]);
  }
  const bool nonfinite = kmax >= kKeyPosInf || kmin <= kKeyNegInf;
  const float mn = from_key(kmin), mx = from_key(kmax);
  const bool ok = half_range > 0.0f && !nonfinite && mn > -half_range && mx < half_range;
  if (threadIdx.x == 0) {
    *flag = nonfinite ? 1 : 0;
    if (!nonfinite) {
      *out_min = mn;
      *out_max = mx;
      *out_nonfinite = 0;
    }
    if (out_accumulated != nullptr) *out_accumulated = ok ? 1 : 0;
  }
  if (ok && spec != nullptr && counts != nullptr) {
    for (int64_t j = threadIdx.x; j < nbins; j += blockDim.x) counts[j] += (int64_t)spec[j];
  }
}

template <bool HIST, bool ZEROS, bool POW2>
int launch_lean_kernel(const LaunchArgs& a) {
  auto kernel = lean_observe_kernel<HIST, ZEROS, POW2>;
  const size_t words = (size_t)a.g.nbins + (ZEROS ? 32 : 0);
  const size_t smem = HIST ? (size_t)a.copies * words * sizeof(unsigned) : 0;
  if (smem > 48 * 1024) {
    QT_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem));
  }
  int sms = 0, fit = 0;
  int status = sm_count(&sms);
  if (status != QT_OK) return status;
  QT_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, a.threads, smem));
  if (fit < 1) return QT_ERR_RESOURCE;
  const int per_sm = a.blocks_per_sm > 0 ? a.blocks_per_sm : fit;
  int64_t blocks = (int64_t)sms * per_sm;
  const int64_t useful = (a.n + kMinElementsPerBlock - 1) / kMinElementsPerBlock;
  blocks = blocks < useful ? blocks : useful;
  const int64_t needed = (a.n + kMaxElementsPerBlock - 1) / kMaxElementsPerBlock;
  blocks = blocks > needed ? blocks : needed;
  blocks = blocks > 1 ? blocks : 1;
  if (blocks > a.max_blocks || blocks > 0x7fffffffLL) return QT_ERR_RESOURCE;
  *a.out_blocks = (int)blocks;
  kernel<<<(unsigned)blocks, a.threads, smem, a.stream>>>(
      a.x, a.n, a.g, a.copies, reinterpret_cast<int2*>(a.parts), a.target);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

// The lean family; zeros fixed, the rest per call. Only for observe and min/max (the histogram
// alone must skip NaN/Inf: the exact family does it) and shared-memory histograms.
template <bool ZEROS>
int launch_lean(const LaunchArgs& a) {
  if (!a.hist) return launch_lean_kernel<false, false, false>(a);
  return a.pow2 ? launch_lean_kernel<true, ZEROS, true>(a)
                : launch_lean_kernel<true, ZEROS, false>(a);
}

int max_shared_optin(int* out) {
  int dev = 0;
  QT_CUDA_TRY(cudaGetDevice(&dev));
  QT_CUDA_TRY(cudaDeviceGetAttribute(out, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return QT_OK;
}

template <int VEC, bool HIST, bool ZEROS, bool MATCH, bool POW2, bool SHARED>
int launch_kernel(const LaunchArgs& a) {
  auto kernel = fused_observe_kernel<VEC, HIST, ZEROS, MATCH, POW2, SHARED>;
  const size_t smem = HIST && SHARED ? (size_t)a.copies * (size_t)a.g.nbins * sizeof(unsigned) : 0;
  if (smem > 48 * 1024) {
    QT_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem));
  }
  int sms = 0, fit = 0;
  int status = sm_count(&sms);
  if (status != QT_OK) return status;
  QT_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, a.threads, smem));
  if (fit < 1) return QT_ERR_RESOURCE;
  const int per_sm = a.blocks_per_sm > 0 ? a.blocks_per_sm : fit;
  int64_t blocks = (int64_t)sms * per_sm;
  const int64_t useful = (a.n + kMinElementsPerBlock - 1) / kMinElementsPerBlock;
  blocks = blocks < useful ? blocks : useful;
  const int64_t needed = (a.n + kMaxElementsPerBlock - 1) / kMaxElementsPerBlock;
  blocks = blocks > needed ? blocks : needed;
  blocks = blocks > 1 ? blocks : 1;
  if (blocks > a.max_blocks || blocks > 0x7fffffffLL) return QT_ERR_RESOURCE;
  *a.out_blocks = (int)blocks;
  kernel<<<(unsigned)blocks, a.threads, smem, a.stream>>>(a.x, a.n, a.g, a.copies, a.parts,
                                                          a.target);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

// A kernel family: the loads, zeros and match choices fixed, the rest picked per call.
template <int VEC, bool ZEROS, bool MATCH>
int launch_family(const LaunchArgs& a) {
  if (!a.hist) return launch_kernel<VEC, false, false, false, false, true>(a);
  if (!a.shared) {  // too many bins for shared memory: global atomics, no warp tricks
    return a.pow2 ? launch_kernel<VEC, true, ZEROS, false, true, false>(a)
                  : launch_kernel<VEC, true, ZEROS, false, false, false>(a);
  }
  return a.pow2 ? launch_kernel<VEC, true, ZEROS, MATCH, true, true>(a)
                : launch_kernel<VEC, true, ZEROS, MATCH, false, true>(a);
}

// Index 0 is the two-pass design as it was before the variants; kDefaultVariant is the one
// qt_cuda_observe & co. use unless qt_cuda_set_variant picks another.
constexpr Variant kVariants[] = {
    {"two-pass", kTwoPass, 1, kThreads, true, nullptr, nullptr},
    {"fused-f1-c1", kFused, 1, 256, false, launch_family<1, false, false>, nullptr},
    {"fused-f4-c1", kFused, 1, 256, false, launch_family<4, false, false>, nullptr},
    {"fused-f4-c4", kFused, 4, 256, false, launch_family<4, false, false>, nullptr},
    {"fused-f4-c1-zeros", kFused, 1, 256, false, launch_family<4, true, false>, nullptr},
    {"fused-f4-c4-zeros", kFused, 4, 256, false, launch_family<4, true, false>, nullptr},
    {"fused-f4-warp-zeros", kFused, 0, 256, false, launch_family<4, true, false>, nullptr},
    {"fused-f4-c4-zeros-t512", kFused, 4, 512, false, launch_family<4, true, false>, nullptr},
    {"fused-f4-c1-match", kFused, 1, 256, false, launch_family<4, false, true>, nullptr},
    {"fused-f4-c4-zeros-double", kFused, 4, 256, true, launch_family<4, true, false>, nullptr},
    {"lean-c1", kFused, 1, 256, false, launch_family<4, false, false>, launch_lean<false>},
    {"lean-c4", kFused, 4, 256, false, launch_family<4, false, false>, launch_lean<false>},
    {"lean-c1-zeros", kFused, 1, 256, false, launch_family<4, true, false>, launch_lean<true>},
    {"lean-c4-zeros", kFused, 4, 256, false, launch_family<4, true, false>, launch_lean<true>},
    {"lean-c4-zeros-t512", kFused, 4, 512, false, launch_family<4, true, false>,
     launch_lean<true>},
};
constexpr int kNumVariants = (int)(sizeof(kVariants) / sizeof(kVariants[0]));

constexpr bool same_name(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || same_name(a + 1, b + 1));
}
constexpr int variant_index(const char* name, int i = 0) {
  return i == kNumVariants ? -1 : same_name(kVariants[i].name, name) ? i : variant_index(name, i + 1);
}
// The fastest design measured (benchmarks/README.md, "GPU kernels (H200)"): on an H200, 4 GiB
// of Gaussian, ReLU and Student-t(3) data, lean-c1 observes at 4478-4510 GB/s, 105% of the same
// GPU's device-to-device copy bandwidth (read + write: 4256 GB/s); the other lean designs at
// 84-104%, the fused ones at 12-95%, the former two-pass design at 16%. Blocks per SM: as many as
// fit (the sweep of 1-16 found none faster).
constexpr int kDefaultVariant = variant_index("lean-c1");
static_assert(kDefaultVariant >= 0, "the default design must be in kVariants");

std::atomic<int>& current_variant() {
  static std::atomic<int> v{kDefaultVariant};
  return v;
}
std::atomic<int>& blocks_per_sm_setting() {
  static std::atomic<int> v{0};
  return v;
}

// Mode of one fused call.
enum FusedMode { kModeMinmax, kModeHistogram, kModeObserve };

// The fused path of qt_cuda_tensor_minmax (kModeMinmax), qt_cuda_histogram_accumulate
// (kModeHistogram: counts += histogram, no decision) and qt_cuda_observe (kModeObserve).
int run_fused(const Variant& v, FusedMode mode, const float* x, int64_t n, float half_range,
              int64_t* counts, int64_t nbins, float* out_min, float* out_max,
              int64_t* out_nonfinite, int32_t* out_accumulated, cudaStream_t s) {
  int status = keep_pool_memory();
  if (status != QT_OK) return status;
  LaunchArgs a{};
  a.x = x;
  a.n = n;
  a.hist = mode != kModeMinmax && half_range > 0.0f;
  a.threads = v.threads;
  a.blocks_per_sm = blocks_per_sm_setting().load(std::memory_order_relaxed);
  a.stream = s;
  if (a.hist) {
    a.g.half_range = half_range;
    a.g.nbins = nbins;
    a.g.scale = qt_hist_scale(nbins, half_range);
    a.g.pow2 = qt_pow2_bins(half_range, nbins);
    a.g.zero_bin = (int32_t)qt_hist_bin(0.0f, half_range, a.g.scale, nbins);
    a.pow2 = a.g.pow2.ok && !v.double_bins;
    if (nbins > 0x7fffffffLL) return QT_ERR_BAD_ARG;
    int optin = 0;
    status = max_shared_optin(&optin);
    if (status != QT_OK) return status;
    // words per copy: the bins, and 32 lane counters of exact zeros in the lean designs
    const int64_t words = nbins + (v.lean != nullptr ? 32 : 0);
    int copies = v.copies > 0 ? v.copies : v.threads / 32;
    while (copies > 1 && (int64_t)copies * words * 4 > optin) copies /= 2;
    a.copies = copies;
    a.shared = (int64_t)copies * words * 4 <= optin;
  } else {
    a.copies = 1;
    a.shared = true;
  }
  const bool lean = v.lean != nullptr && mode != kModeHistogram && a.shared;
  // scratch: the speculative histogram, and one partial min/max per block launched (at most
  // the resident blocks of every multiprocessor, or the count a blocks-per-SM setting asks for,
  // or as many as keep every block under kMaxElementsPerBlock)
  int sms = 0, dev = 0, resident = 0;
  status = sm_count(&sms);
  if (status != QT_OK) return status;
  QT_CUDA_TRY(cudaGetDevice(&dev));
  QT_CUDA_TRY(cudaDeviceGetAttribute(&resident, cudaDevAttrMaxBlocksPerMultiprocessor, dev));
  const int64_t per_sm = a.blocks_per_sm > resident ? a.blocks_per_sm : resident;
  const int64_t needed = (n + kMaxElementsPerBlock - 1) / kMaxElementsPerBlock;
  const int64_t parts_cap = (int64_t)sms * per_sm > needed ? (int64_t)sms * per_sm : needed;
  const bool spec = mode == kModeObserve && a.hist;
  const size_t spec_bytes = spec ? (size_t)nbins * sizeof(unsigned long long) : 0;
  // lean: the fixup flag and the fixup pass's partial min/max (as the two-pass design's)
  const int64_t fix_want = (n + kThreads - 1) / kThreads;
  const int fix_blocks = (int)(fix_want < (int64_t)sms * 8 ? fix_want : (int64_t)sms * 8);
  const size_t parts_bytes = (size_t)parts_cap * sizeof(QtMinMax);
  const size_t lean_bytes = lean ? 16 + (size_t)fix_blocks * sizeof(QtMinMax) : 0;
  Scratch scratch(s);
  QT_CUDA_TRY(scratch.alloc(spec_bytes + parts_bytes + lean_bytes));
  char* base = static_cast<char*>(scratch.ptr);
  unsigned long long* spec_counts = reinterpret_cast<unsigned long long*>(base);
  a.parts = reinterpret_cast<QtMinMax*>(base + spec_bytes);
  int32_t* flag = reinterpret_cast<int32_t*>(base + spec_bytes + parts_bytes);
  QtMinMax* fix_parts = reinterpret_cast<QtMinMax*>(base + spec_bytes + parts_bytes + 16);
  a.max_blocks = parts_cap;
  if (spec) QT_CUDA_TRY(cudaMemsetAsync(spec_counts, 0, spec_bytes, s));
  a.target = spec ? spec_counts : reinterpret_cast<unsigned long long*>(counts);
  int blocks = 0;
  a.out_blocks = &blocks;
  status = lean ? v.lean(a) : v.launch(a);
  if (status != QT_OK) return status;
  if (mode == kModeHistogram) return QT_OK;
  if (lean) {
    lean_final_kernel<<<1, kFinalThreads, 0, s>>>(
        reinterpret_cast<const int2*>(a.parts), blocks, mode == kModeObserve ? half_range : 0.0f,
        spec ? spec_counts : nullptr, nbins, counts, out_min, out_max, out_nonfinite,
        mode == kModeObserve ? out_accumulated : nullptr, flag);
    QT_CUDA_TRY(cudaGetLastError());
    fixup_partial_kernel<<<fix_blocks, kThreads, 0, s>>>(x, n, flag, fix_parts);
    QT_CUDA_TRY(cudaGetLastError());
    fixup_final_kernel<<<1, kThreads, 0, s>>>(fix_parts, fix_blocks, flag, out_min, out_max,
                                              out_nonfinite);
    QT_CUDA_TRY(cudaGetLastError());
    return QT_OK;
  }
  fused_final_kernel<<<1, kFinalThreads, 0, s>>>(
      a.parts, blocks, mode == kModeObserve ? half_range : 0.0f, spec ? spec_counts : nullptr,
      nbins, counts, out_min, out_max, out_nonfinite,
      mode == kModeObserve ? out_accumulated : nullptr);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

// ---- the two-pass design (variant "two-pass") ----

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

// One thread per candidate t = k + 1, bins added in order: the CPU's sum, bit for bit.
__global__ void mse_kernel(const int64_t* hist, const int64_t* prefix, int64_t nbins,
                           int64_t num_steps, double* out) {
  const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= nbins) return;
  double err = 0.0;
  for (int64_t j = 0; j < nbins; ++j) err += qt_mse_term(hist[j], j, k + 1, num_steps);
  out[k] = qt_ddiv(err, (double)prefix[nbins]);
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
                                 int signed_scales, const float* grid, int64_t grid_len,
                                 float* out_scale, uint8_t* out_zero, int32_t* out_best,
                                 uint8_t* out_values) {
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
    int32_t best_j = 0;
    const QtBlockQuant best = qt_block_column_choice(col, n, columns, lo, hi, grid, grid_len, qmin,
                                                     qmax, sym, signed_scales != 0, &best_j);
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

// The two-pass entry points (variant "two-pass"), as they were before the fused designs.
int two_pass_minmax(const float* x, int64_t n, float* out_min, float* out_max,
                    int64_t* out_nonfinite, void* stream) {
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

int two_pass_histogram(const float* x, int64_t n, float half_range, int64_t* counts,
                       int64_t nbins, void* stream) {
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

int two_pass_observe(const float* x, int64_t n, float half_range, int64_t* counts, int64_t nbins,
                     float* out_min, float* out_max, int64_t* out_nonfinite,
                     int32_t* out_accumulated, void* stream) {
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
  const Variant& v = kVariants[current_variant().load()];
  if (v.kind == kTwoPass) return two_pass_minmax(x, n, out_min, out_max, out_nonfinite, stream);
  return run_fused(v, kModeMinmax, x, n, 0.0f, nullptr, 0, out_min, out_max, out_nonfinite,
                   nullptr, as_stream(stream));
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
  const Variant& v = kVariants[current_variant().load()];
  if (v.kind == kTwoPass) return two_pass_histogram(x, n, half_range, counts, nbins, stream);
  return run_fused(v, kModeHistogram, x, n, half_range, counts, nbins, nullptr, nullptr, nullptr,
                   nullptr, as_stream(stream));
}

int qt_cuda_observe(const float* x, int64_t n, float half_range, int64_t* counts, int64_t nbins,
                    float* out_min, float* out_max, int64_t* out_nonfinite,
                    int32_t* out_accumulated, void* stream) {
  if (n < 1) return QT_ERR_EMPTY;
  if (nbins < 1 || !qt_isfinite(half_range) || !(half_range >= 0.0f)) return QT_ERR_BAD_ARG;
  const Variant& v = kVariants[current_variant().load()];
  if (v.kind == kTwoPass) {
    return two_pass_observe(x, n, half_range, counts, nbins, out_min, out_max, out_nonfinite,
                            out_accumulated, stream);
  }
  return run_fused(v, kModeObserve, x, n, half_range, counts, nbins, out_min, out_max,
                   out_nonfinite, out_accumulated, as_stream(stream));
}

int qt_cuda_variant_count(void) { return kNumVariants; }

const char* qt_cuda_variant_name(int variant) {
  return variant >= 0 && variant < kNumVariants ? kVariants[variant].name : nullptr;
}

int qt_cuda_set_variant(int variant) {
  if (variant == QT_CUDA_VARIANT_DEFAULT) variant = kDefaultVariant;
  if (variant < 0 || variant >= kNumVariants) return QT_ERR_BAD_ARG;
  current_variant().store(variant);
  return QT_OK;
}

int qt_cuda_get_variant(void) { return current_variant().load(); }

int qt_cuda_default_variant(void) { return kDefaultVariant; }

int qt_cuda_set_blocks_per_sm(int blocks) {
  if (blocks < 0 || blocks > 64) return QT_ERR_BAD_ARG;
  blocks_per_sm_setting().store(blocks);
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
  constexpr int kMseThreads = 128;
  mse_kernel<<<(unsigned)((nbins + kMseThreads - 1) / kMseThreads), kMseThreads, 0, s>>>(
      hist, p.sum, nbins, num_steps, out);
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
                             int32_t qmin, int32_t qmax, int32_t symmetric, int32_t signed_scales,
                             const float* grid, int64_t grid_len, float* out_scale,
                             uint8_t* out_zero_point, int32_t* out_best, uint8_t* out_values,
                             void* stream) {
  if (rows < 1 || columns < 1) return QT_ERR_EMPTY;
  if (block_len < 1 || grid_len < 1 || grid_len > 0x7fffffffLL || out_scale == nullptr) {
    return QT_ERR_BAD_ARG;
  }
  if (!qt_block_qrange_ok(qmin, qmax, symmetric != 0)) return QT_ERR_BAD_ARG;
  if (symmetric == 0 && (out_zero_point == nullptr || signed_scales != 0)) {
    return QT_ERR_BAD_ARG;
  }
  cudaStream_t s = as_stream(stream);
  int sms = 0;
  int status = sm_count(&sms);
  if (status != QT_OK) return status;
  const int64_t num_blocks = (rows + block_len - 1) / block_len;
  const int64_t want = (num_blocks * columns + kThreads - 1) / kThreads;
  const int blocks = (int)(want < (int64_t)sms * 32 ? want : (int64_t)sms * 32);
  block_mse_kernel<<<blocks, kThreads, 0, s>>>(
      x, rows, columns, block_len, num_blocks, (float)qmin, (float)qmax, symmetric, signed_scales,
      grid, grid_len, out_scale, out_zero_point, out_best, out_values);
  QT_CUDA_TRY(cudaGetLastError());
  return QT_OK;
}

}  // extern "C"
