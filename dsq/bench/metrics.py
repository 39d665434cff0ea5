"""Peak memory while something runs: process RSS (psutil) and GPU memory (NVML through ctypes,
so no torch import and no CUDA context of our own)."""

from __future__ import annotations

import ctypes
import threading
import time


class _Nvml:
    """Device-wide used memory of GPU 0, or None without an NVIDIA driver."""

    class _Mem(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    def __init__(self):
        self.lib = self.handle = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return
            h = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) != 0:
                return
            self.lib, self.handle = lib, h
        except OSError:
            pass

    def used(self) -> int | None:
        if self.lib is None:
            return None
        m = self._Mem()
        if self.lib.nvmlDeviceGetMemoryInfo(self.handle, ctypes.byref(m)) != 0:
            return None
        return int(m.used)


_nvml: _Nvml | None = None


def gpu_used_bytes() -> int | None:
    global _nvml
    if _nvml is None:
        _nvml = _Nvml()
    return _nvml.used()


def _retain_primary_context() -> bool | None:
    """Retain GPU 0's primary CUDA context (the one torch and llama.cpp share) through the driver
    API, making it if there is none: True if it was made now, False if it existed, None without a
    driver or a GPU."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, flags, active, ctx = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int(), ctypes.c_void_p()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return None
    if cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) != 0:
        return None
    if active.value:
        return False
    return True if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 else None


_context: dict[str, int | None] = {}


def cuda_context_bytes() -> int | None:
    """Make this process's CUDA context now (once), so that it lands in no configuration's peak
    VRAM: its size in bytes, 0 where the process had one already (size unknown), None without an
    NVIDIA driver and GPU."""
    if "bytes" not in _context:
        before = gpu_used_bytes()
        made = _retain_primary_context() if before is not None else None
        _context["bytes"] = None if made is None else ((gpu_used_bytes() or before) - before if made else 0)
    return _context["bytes"]


def rss_bytes() -> int:
    """This process's resident memory now."""
    import psutil

    return psutil.Process().memory_info().rss


def release_memory() -> None:
    """Hand what freed objects held back: Python's garbage, torch's cached GPU blocks, and the C
    heap's free pages (glibc keeps them otherwise), so that a later baseline is this process's own."""
    import ctypes
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class PeakMemory:
    """Context manager sampling RSS and GPU memory every `interval` s; peaks in bytes.

    Figures are above their baselines: RSS above `baseline_rss`, GPU memory (device-wide) above
    `baseline_gpu` (what was in use before the model loaded). peak_gpu stays None without an
    NVIDIA GPU.
    """

    def __init__(self, interval: float = 0.02, baseline_gpu: int | None = None, baseline_rss: int = 0):
        import psutil

        self.proc = psutil.Process()
        self.interval = interval
        self.baseline_gpu = baseline_gpu
        self.baseline_rss = baseline_rss
        self.peak_rss = 0
        self.peak_gpu: int | None = None
        self._stop = threading.Event()

    def _sample(self) -> None:
        self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss - self.baseline_rss)
        g = gpu_used_bytes()
        if g is not None:
            self.peak_gpu = max(self.peak_gpu or 0, g - (self.baseline_gpu or 0))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __enter__(self) -> "PeakMemory":
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
