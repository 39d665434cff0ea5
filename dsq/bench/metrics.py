"""Peak memory while something runs: process RSS (psutil) and GPU memory (NVML through ctypes,
so no torch import and no CUDA context of our own)."""

from __future__ import annotations

import ctypes
import threading
import time


class _Nvml:
    """Device-wide used memory of each GPU (NVML's order, nvidia-smi's), or None without an NVIDIA driver."""

    class _Mem(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    def __init__(self):
        self.lib, self.handles = None, []
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return
            n = ctypes.c_uint()
            if lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) != 0:
                return
            for i in range(n.value):
                h = ctypes.c_void_p()
                if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) != 0:
                    return
                self.handles.append(h)
            if self.handles:
                self.lib = lib
        except OSError:
            pass

    def used_each(self) -> list[int] | None:
        if self.lib is None:
            return None
        out = []
        for h in self.handles:
            m = self._Mem()
            if self.lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m)) != 0:
                return None
            out.append(int(m.used))
        return out


_nvml: _Nvml | None = None


def gpus_used_bytes() -> list[int] | None:
    """Each GPU's device-wide used memory, in NVML's order; None without an NVIDIA driver."""
    global _nvml
    if _nvml is None:
        _nvml = _Nvml()
    return _nvml.used_each()


def gpu_used_bytes() -> int | None:
    """Device-wide used memory of all GPUs together; None without an NVIDIA driver."""
    each = gpus_used_bytes()
    return None if each is None else sum(each)


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

    Figures are above their baselines: RSS above `baseline_rss`, GPU memory (device-wide, all GPUs
    together) above `baseline_gpu` (what was in use before the model loaded), and each GPU's
    (peak_gpus) above its own in `baseline_gpus`. peak_gpu stays None without an NVIDIA GPU.
    """

    def __init__(self, interval: float = 0.02, baseline_gpu: int | None = None, baseline_rss: int = 0,
                 baseline_gpus: list[int] | None = None):
        import psutil

        self.proc = psutil.Process()
        self.interval = interval
        self.baseline_gpu = baseline_gpu
        self.baseline_rss = baseline_rss
        self.peak_rss = 0
        self.peak_gpu: int | None = None
        self.baseline_gpus = baseline_gpus
        self.peak_gpus: list[int] | None = None
        self._stop = threading.Event()

    def _sample(self) -> None:
        self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss - self.baseline_rss)
        each = gpus_used_bytes()
        if each is None:
            return
        self.peak_gpu = max(self.peak_gpu or 0, sum(each) - (self.baseline_gpu or 0))
        base = self.baseline_gpus if self.baseline_gpus and len(self.baseline_gpus) == len(each) else [0] * len(each)
        self.peak_gpus = [max(p, u - b) for p, u, b in zip(self.peak_gpus or [0] * len(each), each, base)]

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
