"""Statistics kernels: numpy in, numpy out, computed by the compiled libraries in qtool/_lib/.

The libraries are built at install time (see setup.py) and loaded with ctypes on first use, so
importing qtool never needs a compiler, torch or CuPy. `device="cpu"` runs libqtool_cpu.so;
`device="cuda"` copies the inputs to the GPU, runs libqtool_cuda.so and copies results back
(`observe_on_device` runs on memory already there). Both backends share the math header
kernels/qt_math.h, so they agree bit for bit on histograms, min/max, MSE errors and thresholds
and block MSE searches; KL divergences differ in the last bits (libm's log and CUDA's differ)
and may pick another candidate only on such a near-tie.

A missing CPU library is an error (reinstall), never a silent numpy fallback: calibration
results must come from one implementation.

The CPU library picks the best instruction set it can run (AVX-512, AVX2, scalar; identical results
on each) and keeps a persistent thread pool. `QTOOL_CPU_ISA=scalar|avx2|avx512` and
`QTOOL_CPU_THREADS=N` override them for the process (read when the library loads; an instruction
set this CPU lacks is an error); `set_cpu_isa` / `set_cpu_threads` change them at run time (tests).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from qtool.errors import KernelError

LIB_DIR = Path(__file__).resolve().parent / "_lib"
CPU_LIB = LIB_DIR / "libqtool_cpu.so"
CUDA_LIB = LIB_DIR / "libqtool_cuda.so"
BUILD_INFO = LIB_DIR / "build_info.json"

_ABI_VERSION = 5
_OK = 0
_STATUS = {
    1: "empty input",
    2: "invalid argument",
    3: "histogram has no counts or a negative count",
    4: "out of memory or threads",
    5: "input has NaN or Inf",
}
# qtool_kernels.h QT_ISA_*: the order is also the preference order, best last
CPU_ISAS = ("scalar", "avx2", "avx512")
_ISA_ENV = "QTOOL_CPU_ISA"
_THREADS_ENV = "QTOOL_CPU_THREADS"

_i64 = ctypes.c_int64
_f32p = ctypes.POINTER(ctypes.c_float)
_f64p = ctypes.POINTER(ctypes.c_double)
_i64p = ctypes.POINTER(ctypes.c_int64)
_i32p = ctypes.POINTER(ctypes.c_int32)
_u8p = ctypes.POINTER(ctypes.c_uint8)
_i32 = ctypes.c_int32
_vp = ctypes.c_void_p

# name: argtypes (all functions return int status)
_CPU_SIGNATURES: dict[str, list[Any]] = {
    "qt_cpu_abi_version": [],
    "qt_cpu_isa_supported": [ctypes.c_int],
    "qt_cpu_set_isa": [ctypes.c_int],
    "qt_cpu_get_isa": [],
    "qt_cpu_set_num_threads": [ctypes.c_int],
    "qt_cpu_get_num_threads": [],
    "qt_cpu_observe": [_f32p, _i64, ctypes.c_float, _i64p, _i64, _f32p, _f32p, _i64p, _i32p],
    "qt_cpu_tensor_minmax": [_f32p, _i64, _f32p, _f32p, _i64p],
    "qt_cpu_channel_minmax": [_f32p, _i64, _i64, _f32p, _f32p],
    "qt_cpu_histogram_accumulate": [_f32p, _i64, ctypes.c_float, _i64p, _i64],
    "qt_cpu_kl_divergences": [_i64p, _i64, _i64, _f64p],
    "qt_cpu_kl_threshold": [_i64p, _i64, _i64, _i64p],
    "qt_cpu_percentile_bin": [_i64p, _i64, ctypes.c_double, _f64p],
    "qt_cpu_mse_errors": [_i64p, _i64, _i64, _f64p],
    "qt_cpu_mse_threshold": [_i64p, _i64, _i64, _f64p],
    "qt_cpu_block_mse_search": [
        *[_f32p, _i64, _i64, _i64, _i32, _i32, _i32, _i32, _f32p, _i64],
        *[_f32p, _u8p, _i32p, _u8p],
    ],
}
# CUDA data pointers are device addresses, passed as void*.
_CUDA_SIGNATURES: dict[str, list[Any]] = {
    "qt_cuda_abi_version": [],
    "qt_cuda_device_count": [ctypes.POINTER(ctypes.c_int)],
    "qt_cuda_malloc": [ctypes.POINTER(_vp), ctypes.c_size_t],
    "qt_cuda_free": [_vp],
    "qt_cuda_memcpy_h2d": [_vp, _vp, ctypes.c_size_t, _vp],
    "qt_cuda_memcpy_d2h": [_vp, _vp, ctypes.c_size_t, _vp],
    "qt_cuda_stream_sync": [_vp],
    "qt_cuda_tensor_minmax": [_vp, _i64, _vp, _vp, _vp, _vp],
    "qt_cuda_channel_minmax": [_vp, _i64, _i64, _vp, _vp, _vp],
    "qt_cuda_histogram_accumulate": [_vp, _i64, ctypes.c_float, _vp, _i64, _vp],
    "qt_cuda_observe": [_vp, _i64, ctypes.c_float, _vp, _i64, _vp, _vp, _vp, _vp, _vp],
    "qt_cuda_kl_divergences": [_vp, _i64, _i64, _vp, _vp],
    "qt_cuda_kl_threshold": [_vp, _i64, _i64, _vp, _vp],
    "qt_cuda_mse_errors": [_vp, _i64, _i64, _vp, _vp],
    "qt_cuda_mse_threshold": [_vp, _i64, _i64, _vp, _vp],
    "qt_cuda_block_mse_search": [
        *[_vp, _i64, _i64, _i64, _i32, _i32, _i32, _i32, _vp, _i64],
        *[_vp, _vp, _vp, _vp, _vp],
    ],
    "qt_cuda_variant_count": [],
    "qt_cuda_set_variant": [ctypes.c_int],
    "qt_cuda_get_variant": [],
    "qt_cuda_default_variant": [],
    "qt_cuda_set_blocks_per_sm": [ctypes.c_int],
}

_lock = threading.Lock()
_cpu: ctypes.CDLL | None = None
_cuda: ctypes.CDLL | None = None
_cuda_state: str | None = None  # backends() text for cuda once probed


def _bind(lib: ctypes.CDLL, signatures: dict[str, list[Any]], status_fn: str) -> None:
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    getattr(lib, status_fn).argtypes = [ctypes.c_int]
    getattr(lib, status_fn).restype = ctypes.c_char_p


def _build_info() -> dict[str, Any]:
    try:
        return json.loads(BUILD_INFO.read_text())
    except (OSError, ValueError):
        return {}


def _load_cpu() -> ctypes.CDLL:
    global _cpu
    with _lock:
        if _cpu is None:
            if not CPU_LIB.is_file():
                raise KernelError(
                    f"CPU kernel library {CPU_LIB} is missing: reinstall qtool "
                    "(`pip install .` or `pip install -e .`, needs g++)"
                )
            try:
                lib = ctypes.CDLL(str(CPU_LIB))
                _bind(lib, _CPU_SIGNATURES, "qt_cpu_status_string")
            except (OSError, AttributeError) as exc:
                raise KernelError(f"cannot load {CPU_LIB}: {exc}; reinstall qtool") from exc
            if lib.qt_cpu_abi_version() != _ABI_VERSION:
                raise KernelError(f"{CPU_LIB} has an outdated interface: reinstall qtool")
            _apply_environment(lib)
            _cpu = lib
        return _cpu


def _apply_environment(lib: ctypes.CDLL) -> None:
    """QTOOL_CPU_ISA / QTOOL_CPU_THREADS, checked here so a typo is an error, not ignored."""
    isa = os.environ.get(_ISA_ENV, "").strip().lower()
    if isa:
        if isa not in CPU_ISAS:
            raise KernelError(f"{_ISA_ENV}={isa!r}: expected one of {', '.join(CPU_ISAS)}")
        if lib.qt_cpu_set_isa(CPU_ISAS.index(isa)) != _OK:
            raise KernelError(f"{_ISA_ENV}={isa}: this CPU does not support {isa}")
    threads = os.environ.get(_THREADS_ENV, "").strip()
    if threads:
        if not threads.isdigit() or not 1 <= int(threads) <= 64:
            raise KernelError(f"{_THREADS_ENV}={threads!r}: expected an integer from 1 to 64")
        lib.qt_cpu_set_num_threads(int(threads))


def _probe_cuda() -> tuple[ctypes.CDLL | None, str]:
    """Load the CUDA library once; report why it is unusable instead of raising."""
    global _cuda, _cuda_state
    with _lock:
        if _cuda_state is not None:
            return _cuda, _cuda_state
        if not CUDA_LIB.is_file():
            reason = _build_info().get("cuda", {}).get("reason", "library missing")
            _cuda_state = f"not built: {reason}"
            return None, _cuda_state
        try:
            lib = ctypes.CDLL(str(CUDA_LIB))
            _bind(lib, _CUDA_SIGNATURES, "qt_cuda_status_string")
            lib.qt_cuda_variant_name.argtypes = [ctypes.c_int]
            lib.qt_cuda_variant_name.restype = ctypes.c_char_p
        except (OSError, AttributeError) as exc:
            _cuda_state = f"built, cannot load: {exc}"
            return None, _cuda_state
        if lib.qt_cuda_abi_version() != _ABI_VERSION:
            _cuda_state = "built, outdated interface: reinstall qtool"
            return None, _cuda_state
        count = ctypes.c_int(0)
        if lib.qt_cuda_device_count(ctypes.byref(count)) != _OK or count.value < 1:
            _cuda_state = "built, no CUDA device visible"
            return None, _cuda_state
        _cuda = lib
        _cuda_state = f"loaded, {count.value} device{'s' if count.value > 1 else ''} ({CUDA_LIB})"
        return _cuda, _cuda_state


def backends() -> dict[str, str]:
    """State of each backend, for `qtool` diagnostics and the GPU test gate."""
    try:
        _load_cpu()
        cpu = f"loaded ({CPU_LIB})"
    except KernelError as exc:
        cpu = f"unavailable: {exc}"
    return {"cpu": cpu, "cuda": _probe_cuda()[1]}


def default_device() -> str:
    """ "cuda" when the CUDA library loads and sees a device, else "cpu"."""
    return "cuda" if _probe_cuda()[0] is not None else "cpu"


# ---------------------------------------------------------------------------------------------
# argument handling
# ---------------------------------------------------------------------------------------------


def _check_device(device: str) -> str:
    if device not in ("cpu", "cuda"):
        raise KernelError(f"unknown kernel device {device!r}: expected 'cpu' or 'cuda'")
    return device


def _float_data(x: Any, what: str) -> np.ndarray:
    arr = np.ascontiguousarray(x, dtype=np.float32)
    if arr.size == 0:
        raise KernelError(f"{what}: empty tensor (shape {arr.shape})")
    return arr


def _hist_data(hist: Any, what: str, require_counts: bool = True) -> np.ndarray:
    arr = np.asarray(hist)
    if arr.ndim != 1 or arr.size < 1:
        raise KernelError(f"{what}: histogram must be 1-D with nbins >= 1, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or not np.all(np.isfinite(arr)):
            raise KernelError(f"{what}: histogram counts must be finite numbers")
        if np.any(arr != np.round(arr)):
            raise KernelError(f"{what}: histogram counts must be whole numbers")
    out = np.ascontiguousarray(arr, dtype=np.int64)
    if np.any(out < 0):
        raise KernelError(f"{what}: histogram has negative counts")
    if require_counts and not np.any(out > 0):
        raise KernelError(f"{what}: histogram has no counts")
    return out


def _check_counts(counts: Any, what: str) -> None:
    if (
        not isinstance(counts, np.ndarray)
        or counts.dtype != np.int64
        or counts.ndim != 1
        or not counts.flags.c_contiguous
        or not counts.flags.writeable
    ):
        raise KernelError(f"{what}: counts must be a writeable contiguous int64 1-D array")
    if counts.size < 1:
        raise KernelError(f"{what}: nbins must be >= 1")


def _ptr(arr: np.ndarray, ctype: Any) -> Any:
    return arr.ctypes.data_as(ctypes.POINTER(ctype))


def _check_cpu(status: int, what: str) -> None:
    if status != _OK:
        raise KernelError(f"{what}: CPU kernel failed: {_STATUS.get(status, f'status {status}')}")


# ---------------------------------------------------------------------------------------------
# CUDA plumbing (device buffers through the library's own helpers, no CuPy)
# ---------------------------------------------------------------------------------------------


def _cuda_lib() -> ctypes.CDLL:
    lib, state = _probe_cuda()
    if lib is None:
        raise KernelError(f"CUDA kernels unavailable ({state}); use device='cpu'")
    return lib


class _DeviceBuffers:
    """Device allocations freed together, even when a kernel fails."""

    def __init__(self, lib: ctypes.CDLL, what: str) -> None:
        self.lib = lib
        self.what = what
        self.ptrs: list[int] = []

    def check(self, status: int) -> None:
        if status != _OK:
            msg = self.lib.qt_cuda_status_string(status).decode(errors="replace")
            raise KernelError(f"{self.what}: CUDA kernel failed: {msg}")

    def alloc(self, nbytes: int) -> int:
        ptr = _vp()
        self.check(self.lib.qt_cuda_malloc(ctypes.byref(ptr), max(int(nbytes), 1)))
        self.ptrs.append(ptr.value)
        return ptr.value

    def upload(self, arr: np.ndarray) -> int:
        dev = self.alloc(arr.nbytes)
        self.check(self.lib.qt_cuda_memcpy_h2d(dev, arr.ctypes.data, arr.nbytes, None))
        return dev

    def download(self, dev: int, out: np.ndarray) -> np.ndarray:
        self.check(self.lib.qt_cuda_memcpy_d2h(out.ctypes.data, dev, out.nbytes, None))
        self.check(self.lib.qt_cuda_stream_sync(None))
        return out

    def __enter__(self) -> _DeviceBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.lib.qt_cuda_stream_sync(None)
        for p in self.ptrs:
            self.lib.qt_cuda_free(p)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def supported_cpu_isas() -> list[str]:
    """Instruction sets this CPU can run the kernels with, worst to best."""
    lib = _load_cpu()
    return [name for i, name in enumerate(CPU_ISAS) if lib.qt_cpu_isa_supported(i)]


def cpu_isa() -> str:
    """The instruction set the CPU kernels use now."""
    return CPU_ISAS[_load_cpu().qt_cpu_get_isa()]


def set_cpu_isa(name: str | None) -> None:
    """Force an instruction set for the whole process (None: the best one). Every set gives
    identical results; this exists so tests can check each against the numpy references."""
    lib = _load_cpu()
    if name is None:
        lib.qt_cpu_set_isa(-1)
        return
    if name not in CPU_ISAS:
        raise KernelError(f"unknown CPU instruction set {name!r}: expected one of {CPU_ISAS}")
    if lib.qt_cpu_set_isa(CPU_ISAS.index(name)) != _OK:
        raise KernelError(f"this CPU does not support the {name} kernels")


def cpu_threads() -> int:
    """Threads a CPU kernel call may use, the caller included."""
    return int(_load_cpu().qt_cpu_get_num_threads())


def set_cpu_threads(threads: int | None) -> None:
    """Threads per call (None: the default, QTOOL_CPU_THREADS or every CPU of the affinity mask).
    The pool's threads are started once and reused; results do not depend on the count."""
    n = 0 if threads is None else int(threads)
    if threads is not None and not 1 <= n <= 64:
        raise KernelError(f"threads must be from 1 to 64, got {threads}")
    _load_cpu().qt_cpu_set_num_threads(n)


def cuda_variants() -> list[str]:
    """Names of the CUDA observe designs (kernels/cuda.cu), index order. Every design computes
    the same results; they exist so that one GPU run can time them all (benchmarks/
    gpu_observe.py) and the tests can check each against the CPU."""
    lib = _cuda_lib()
    return [lib.qt_cuda_variant_name(i).decode() for i in range(lib.qt_cuda_variant_count())]


def cuda_variant() -> str:
    """The design observe, tensor_minmax and histogram_accumulate use on CUDA now."""
    lib = _cuda_lib()
    return lib.qt_cuda_variant_name(lib.qt_cuda_get_variant()).decode()


def default_cuda_variant() -> str:
    """The built-in default design (benchmarks/README.md, GPU section, says how it was chosen)."""
    lib = _cuda_lib()
    return lib.qt_cuda_variant_name(lib.qt_cuda_default_variant()).decode()


def set_cuda_variant(name: str | None, blocks_per_sm: int = 0) -> None:
    """Use design `name` for the whole process (None: the default) with `blocks_per_sm` blocks
    per multiprocessor (0: as many as fit at once). For tests and benchmarks."""
    lib = _cuda_lib()
    names = cuda_variants()
    if name is not None and name not in names:
        raise KernelError(f"unknown CUDA variant {name!r}: expected one of {', '.join(names)}")
    if not 0 <= int(blocks_per_sm) <= 64:
        raise KernelError(f"blocks_per_sm must be from 0 to 64, got {blocks_per_sm}")
    lib.qt_cuda_set_variant(-1 if name is None else names.index(name))
    lib.qt_cuda_set_blocks_per_sm(int(blocks_per_sm))


def observe_on_device(
    x_ptr: int,
    n: int,
    half_range: float,
    counts_ptr: int,
    nbins: int,
    out_ptr: int,
    stream: int | None = None,
) -> None:
    """kernels.observe on device memory the caller owns (a torch CUDA tensor's data_ptr()), with
    no copies and no synchronisation: x float32 [n], counts int64 [nbins], out 24 bytes that
    receive float min, float max, int64 non-finite count and int32 accumulated (as `observe`
    returns them) once `stream` (a cudaStream_t; None: the default stream) has run."""
    lib = _cuda_lib()
    r = float(np.float32(half_range))
    if not np.isfinite(r) or r < 0.0:
        raise KernelError(f"observe_on_device: half_range must be finite and >= 0: {half_range}")
    status = lib.qt_cuda_observe(
        x_ptr, int(n), r, counts_ptr, int(nbins), out_ptr, out_ptr + 4, out_ptr + 8, out_ptr + 16,
        stream,
    )  # fmt: skip
    if status != _OK:
        msg = lib.qt_cuda_status_string(status).decode(errors="replace")
        raise KernelError(f"observe_on_device: CUDA kernel failed: {msg}")


def tensor_minmax(x: np.ndarray, device: str = "cpu") -> tuple[float, float, int]:
    """(min, max, count of NaN/Inf); min/max ignore non-finite values and are NaN if none is
    finite, so the caller can name the offending tensor."""
    arr = _float_data(x, "tensor_minmax")
    if _check_device(device) == "cpu":
        lo, hi, nf = np.zeros(1, np.float32), np.zeros(1, np.float32), np.zeros(1, np.int64)
        lib = _load_cpu()
        status = lib.qt_cpu_tensor_minmax(
            _ptr(arr, ctypes.c_float),
            arr.size,
            _ptr(lo, ctypes.c_float),
            _ptr(hi, ctypes.c_float),
            _ptr(nf, ctypes.c_int64),
        )
        _check_cpu(status, "tensor_minmax")
        return float(lo[0]), float(hi[0]), int(nf[0])
    with _DeviceBuffers(_cuda_lib(), "tensor_minmax") as buf:
        d_x = buf.upload(arr)
        d_out = buf.alloc(16)  # float min, float max, int64 count
        buf.check(buf.lib.qt_cuda_tensor_minmax(d_x, arr.size, d_out, d_out + 4, d_out + 8, None))
        raw = buf.download(d_out, np.zeros(16, np.uint8))
    lo, hi = raw[:8].view(np.float32)
    return float(lo), float(hi), int(raw[8:].view(np.int64)[0])


def channel_minmax(x: np.ndarray, axis: int, device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (min, max) along `axis`, float32 [C] each; non-finite values are ignored and a
    channel without finite values gets NaN."""
    arr = np.asarray(x)
    if arr.ndim < 1:
        raise KernelError("channel_minmax: tensor must have at least one dimension")
    if not -arr.ndim <= axis < arr.ndim:
        raise KernelError(f"channel_minmax: axis {axis} out of range for shape {arr.shape}")
    channels = arr.shape[axis]
    if arr.size == 0:
        raise KernelError(f"channel_minmax: empty tensor (shape {arr.shape})")
    rows = _float_data(np.moveaxis(arr, axis, 0).reshape(channels, -1), "channel_minmax")
    inner = rows.shape[1]
    lo, hi = np.zeros(channels, np.float32), np.zeros(channels, np.float32)
    if _check_device(device) == "cpu":
        status = _load_cpu().qt_cpu_channel_minmax(
            _ptr(rows, ctypes.c_float),
            channels,
            inner,
            _ptr(lo, ctypes.c_float),
            _ptr(hi, ctypes.c_float),
        )
        _check_cpu(status, "channel_minmax")
        return lo, hi
    with _DeviceBuffers(_cuda_lib(), "channel_minmax") as buf:
        d_x = buf.upload(rows)
        d_lo, d_hi = buf.alloc(lo.nbytes), buf.alloc(hi.nbytes)
        buf.check(buf.lib.qt_cuda_channel_minmax(d_x, channels, inner, d_lo, d_hi, None))
        return buf.download(d_lo, lo), buf.download(d_hi, hi)


def histogram_accumulate(
    x: np.ndarray, half_range: float, counts: np.ndarray, device: str = "cpu"
) -> None:
    """Add x to `counts` (int64 [nbins], in place): uniform bins over [-R, R], values outside
    clamp into the edge bins, NaN/Inf are skipped."""
    arr = _float_data(x, "histogram_accumulate")
    _check_counts(counts, "histogram_accumulate")
    r = float(np.float32(half_range))
    if not np.isfinite(r) or r <= 0.0:
        raise KernelError(
            f"histogram_accumulate: half_range must be finite and > 0, got {half_range}"
        )
    if _check_device(device) == "cpu":
        status = _load_cpu().qt_cpu_histogram_accumulate(
            _ptr(arr, ctypes.c_float), arr.size, r, _ptr(counts, ctypes.c_int64), counts.size
        )
        _check_cpu(status, "histogram_accumulate")
        return
    with _DeviceBuffers(_cuda_lib(), "histogram_accumulate") as buf:
        d_x, d_counts = buf.upload(arr), buf.upload(counts)
        n, nbins = arr.size, counts.size
        buf.check(buf.lib.qt_cuda_histogram_accumulate(d_x, n, r, d_counts, nbins, None))
        buf.download(d_counts, counts)


def observe(
    x: np.ndarray, half_range: float, counts: np.ndarray, device: str = "cpu"
) -> tuple[float, float, int, bool]:
    """One pass for a streaming observer: (min, max, NaN/Inf count, accumulated).

    min/max/count are those of tensor_minmax. When half_range > 0 and every value is finite and
    strictly inside (-half_range, half_range), the histogram of x (as histogram_accumulate) is
    also added to `counts` and `accumulated` is True; otherwise `counts` is untouched, so the
    caller can grow its range and call again. half_range == 0 computes min/max only.
    """
    arr = _float_data(x, "observe")
    _check_counts(counts, "observe")
    r = float(np.float32(half_range))
    if not np.isfinite(r) or r < 0.0:
        raise KernelError(f"observe: half_range must be finite and >= 0, got {half_range}")
    if _check_device(device) == "cpu":
        lo, hi, nf = np.zeros(1, np.float32), np.zeros(1, np.float32), np.zeros(1, np.int64)
        done = np.zeros(1, np.int32)
        status = _load_cpu().qt_cpu_observe(
            _ptr(arr, ctypes.c_float),
            arr.size,
            r,
            _ptr(counts, ctypes.c_int64),
            counts.size,
            _ptr(lo, ctypes.c_float),
            _ptr(hi, ctypes.c_float),
            _ptr(nf, ctypes.c_int64),
            _ptr(done, ctypes.c_int32),
        )
        _check_cpu(status, "observe")
        return float(lo[0]), float(hi[0]), int(nf[0]), bool(done[0])
    with _DeviceBuffers(_cuda_lib(), "observe") as buf:
        d_x, d_counts = buf.upload(arr), buf.upload(counts)
        d_out = buf.alloc(24)  # float min, float max, int64 count, int32 accumulated
        lib = buf.lib
        buf.check(
            lib.qt_cuda_observe(
                d_x,
                arr.size,
                r,
                d_counts,
                counts.size,
                d_out,
                d_out + 4,
                d_out + 8,
                d_out + 16,
                None,
            )
        )
        raw = buf.download(d_out, np.zeros(24, np.uint8))
        accumulated = bool(raw[16:20].view(np.int32)[0])
        if accumulated:
            buf.download(d_counts, counts)
    lo, hi = raw[:8].view(np.float32)
    return float(lo), float(hi), int(raw[8:16].view(np.int64)[0]), accumulated


def _check_levels(value: int, name: str, what: str) -> int:
    if int(value) != value or int(value) < 1:
        raise KernelError(f"{what}: {name} must be an integer >= 1, got {value}")
    return int(value)


def kl_divergences(hist: np.ndarray, num_levels: int = 128, device: str = "cpu") -> np.ndarray:
    """KL(P||Q) for every candidate i = num_levels..nbins (float64 [nbins - num_levels + 1]);
    exposed for diagnostics, plots and cross-backend tests."""
    h = _hist_data(hist, "kl_divergences")
    levels = _check_levels(num_levels, "num_levels", "kl_divergences")
    if h.size < levels:
        raise KernelError(f"kl_divergences: nbins {h.size} < num_levels {levels}")
    out = np.zeros(h.size - levels + 1, np.float64)
    if _check_device(device) == "cpu":
        status = _load_cpu().qt_cpu_kl_divergences(
            _ptr(h, ctypes.c_int64), h.size, levels, _ptr(out, ctypes.c_double)
        )
        _check_cpu(status, "kl_divergences")
        return out
    with _DeviceBuffers(_cuda_lib(), "kl_divergences") as buf:
        d_h, d_out = buf.upload(h), buf.alloc(out.nbytes)
        buf.check(buf.lib.qt_cuda_kl_divergences(d_h, h.size, levels, d_out, None))
        return buf.download(d_out, out)


def kl_threshold_bins(hist: np.ndarray, num_levels: int = 128, device: str = "cpu") -> int:
    """TensorRT entropy calibration on a histogram of |x| (bin 0 starts at 0): the number of
    bins i minimising KL(P||Q), threshold = i * bin_width. nbins when nbins <= num_levels."""
    h = _hist_data(hist, "kl_threshold_bins")
    levels = _check_levels(num_levels, "num_levels", "kl_threshold_bins")
    out = np.zeros(1, np.int64)
    if _check_device(device) == "cpu":
        status = _load_cpu().qt_cpu_kl_threshold(
            _ptr(h, ctypes.c_int64), h.size, levels, _ptr(out, ctypes.c_int64)
        )
        _check_cpu(status, "kl_threshold_bins")
        return int(out[0])
    with _DeviceBuffers(_cuda_lib(), "kl_threshold_bins") as buf:
        d_h, d_out = buf.upload(h), buf.alloc(out.nbytes)
        buf.check(buf.lib.qt_cuda_kl_threshold(d_h, h.size, levels, d_out, None))
        return int(buf.download(d_out, out)[0])


def percentile_bin(hist: np.ndarray, percentile: float) -> float:
    """Fractional bin position with `percentile`% of the mass below it (uniform within bins)."""
    h = _hist_data(hist, "percentile_bin")
    p = float(percentile)
    if not 0.0 < p <= 100.0:
        raise KernelError(f"percentile_bin: percentile must be in (0, 100], got {percentile}")
    out = np.zeros(1, np.float64)
    status = _load_cpu().qt_cpu_percentile_bin(
        _ptr(h, ctypes.c_int64), h.size, p, _ptr(out, ctypes.c_double)
    )
    _check_cpu(status, "percentile_bin")
    return float(out[0])


def mse_errors(hist: np.ndarray, num_steps: int, device: str = "cpu") -> np.ndarray:
    """Mean squared quantization error for every threshold t = 1..nbins (float64 [nbins])."""
    h = _hist_data(hist, "mse_errors")
    steps = _check_levels(num_steps, "num_steps", "mse_errors")
    out = np.zeros(h.size, np.float64)
    if _check_device(device) == "cpu":
        status = _load_cpu().qt_cpu_mse_errors(
            _ptr(h, ctypes.c_int64), h.size, steps, _ptr(out, ctypes.c_double)
        )
        _check_cpu(status, "mse_errors")
        return out
    with _DeviceBuffers(_cuda_lib(), "mse_errors") as buf:
        d_h, d_out = buf.upload(h), buf.alloc(out.nbytes)
        buf.check(buf.lib.qt_cuda_mse_errors(d_h, h.size, steps, d_out, None))
        return buf.download(d_out, out)


def mse_threshold_bins(hist: np.ndarray, num_steps: int, device: str = "cpu") -> float:
    """Threshold t (a bin edge, in bin units) minimising the expected squared error of uniform
    quantization with num_steps steps over [0, t] on a one-sided histogram."""
    h = _hist_data(hist, "mse_threshold_bins")
    steps = _check_levels(num_steps, "num_steps", "mse_threshold_bins")
    out = np.zeros(1, np.float64)
    if _check_device(device) == "cpu":
        status = _load_cpu().qt_cpu_mse_threshold(
            _ptr(h, ctypes.c_int64), h.size, steps, _ptr(out, ctypes.c_double)
        )
        _check_cpu(status, "mse_threshold_bins")
        return float(out[0])
    with _DeviceBuffers(_cuda_lib(), "mse_threshold_bins") as buf:
        d_h, d_out = buf.upload(h), buf.alloc(out.nbytes)
        buf.check(buf.lib.qt_cuda_mse_threshold(d_h, h.size, steps, d_out, None))
        return float(buf.download(d_out, out)[0])


class BlockSearch(NamedTuple):
    """Result of `block_mse_search`, in ONNX DequantizeLinear terms."""

    scale: np.ndarray  # float32 [num_blocks, columns]
    zero_point: np.ndarray | None  # uint8 [num_blocks, columns]; None when symmetric
    # int32 [num_blocks, columns]: the grid factor each block chose; len(grid) where it took the
    # signed-scale grid (signed_scales)
    best_index: np.ndarray
    values: np.ndarray  # [rows, columns] levels: int8 when symmetric, else uint8


def _qrange_ok(qmin: int, qmax: int, symmetric: bool) -> bool:
    """qt_block_qrange_ok: the integer ranges whose levels fit a byte."""
    if symmetric:
        return -128 <= qmin < 0 < qmax <= 127
    return 0 <= qmin < qmax <= 255


def block_mse_search(
    x: np.ndarray,
    block_len: int,
    grid: Any,
    *,
    qmin: int,
    qmax: int,
    symmetric: bool,
    signed_scales: bool = False,
    device: str = "cpu",
) -> BlockSearch:
    """Per block of `block_len` consecutive rows of each column of x [rows, columns], the grid
    factor whose shrunk [min, max] range quantizes the block with the least squared error.

    The exact float32 recipe is qt_cpu_block_mse_search's (kernels/qtool_kernels.h), the one
    qtool/quantize/int4.py's numpy reference computes: same scales, zero points, chosen indices
    and levels bit for bit, on every instruction set, thread count and on CUDA. A short last block
    (block_len not dividing rows) behaves as if padded with zero rows. grid[0] wins ties, so put
    1.0 (the plain min/max range) first. A grid of one factor skips the error search.

    `signed_scales` (symmetric only): last, each block takes the signed-scale grid (its largest
    magnitude on qmin, the scale negative when that value is positive) where that reconstructs
    strictly better: qtool/write/int4.py `_prefer_signed`, bit for bit, in the same pass.
    """
    what = "block_mse_search"
    arr = np.ascontiguousarray(x, dtype=np.float32)
    if arr.ndim != 2 or arr.size == 0:
        raise KernelError(f"{what}: x must be a non-empty 2-D [rows, columns], got {arr.shape}")
    length = _check_levels(block_len, "block_len", what)
    factors = np.ascontiguousarray(grid, dtype=np.float32).reshape(-1)
    if factors.size < 1 or not np.all((factors > 0) & (factors <= 1)):
        raise KernelError(f"{what}: grid factors must lie in (0, 1], got {factors.tolist()}")
    qmin, qmax, symmetric = int(qmin), int(qmax), bool(symmetric)
    if not _qrange_ok(qmin, qmax, symmetric):
        kind = "symmetric" if symmetric else "asymmetric"
        raise KernelError(f"{what}: unsupported {kind} integer range [{qmin}, {qmax}]")
    if signed_scales and not symmetric:
        raise KernelError(f"{what}: signed_scales needs a symmetric grid")
    rows, columns = arr.shape
    num_blocks = -(-rows // length)
    scale = np.empty((num_blocks, columns), np.float32)
    zero = None if symmetric else np.empty((num_blocks, columns), np.uint8)
    best = np.empty((num_blocks, columns), np.int32)
    values = np.empty((rows, columns), np.uint8)
    args = (rows, columns, length, qmin, qmax, int(symmetric), int(signed_scales))
    if _check_device(device) == "cpu":
        status = _load_cpu().qt_cpu_block_mse_search(
            _ptr(arr, ctypes.c_float),
            *args,
            _ptr(factors, ctypes.c_float),
            factors.size,
            _ptr(scale, ctypes.c_float),
            None if zero is None else _ptr(zero, ctypes.c_uint8),
            _ptr(best, ctypes.c_int32),
            _ptr(values, ctypes.c_uint8),
        )
        _check_cpu(status, what)
    else:
        if not np.all(np.isfinite(arr)):  # the device kernel cannot report it without a sync
            raise KernelError(f"{what}: {_STATUS[5]}")
        with _DeviceBuffers(_cuda_lib(), what) as buf:
            d_x, d_grid = buf.upload(arr), buf.upload(factors)
            d_scale, d_best = buf.alloc(scale.nbytes), buf.alloc(best.nbytes)
            d_zero = None if zero is None else buf.alloc(zero.nbytes)
            d_values = buf.alloc(values.nbytes)
            buf.check(
                buf.lib.qt_cuda_block_mse_search(
                    d_x, *args, d_grid, factors.size, d_scale, d_zero, d_best, d_values, None
                )
            )
            buf.download(d_scale, scale)
            buf.download(d_best, best)
            buf.download(d_values, values)
            if zero is not None:
                buf.download(d_zero, zero)
    return BlockSearch(
        scale=scale,
        zero_point=zero,
        best_index=best,
        values=values.view(np.int8) if symmetric else values,
    )
