"""The machine the offload model predicts for: its GPU, its memory bandwidths, and a calibration.

`dsq offload --calibrate` measures the CPU's read bandwidth (at the thread count the runtime uses),
the GPU's copy bandwidth, the pinned host -> GPU transfer rate and a split's per-token round trip,
and keeps them in dsq's cache dir with the time and the machine's identity (CPU model, core count,
GPU name). Without a calibration for this machine the CPU is measured for the call that needs it
and the reading is not kept: one reading taken on a busy machine must not stay.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

GiB, MiB = 1 << 30, 1 << 20
# Ten times a server CPU's last-level cache, so a sum over it reads DRAM (docs/benchmarks.md#offload-model).
CPU_PROBE_BYTES = 1 * GiB
# Enough for a GPU copy to run at its steady rate, well past L2 (docs/benchmarks.md#offload-model).
GPU_PROBE_BYTES = 1 * GiB
# A pinned host -> GPU copy reaches the PCIe rate from tens of MiB (docs/benchmarks.md#offload-model).
H2D_PROBE_BYTES = 256 * MiB
# A hidden state of the widest model dsq plans for (8192 floats, 70B-class), the split's per-token
# exchange (docs/benchmarks.md#offload-model).
ROUND_TRIP_FLOATS = 8192
# A split's per-token cost where no calibration measured it: a small copy each way and one launch,
# tens of microseconds on PCIe 4/5 (docs/benchmarks.md#offload-model).
SPLIT_OVERHEAD_S = 50e-6
# Only to choose a split without measuring (--gpu-layers auto): the choice barely depends on it;
# dual-channel DDR5 reads about this much (docs/benchmarks.md#offload-model).
NOMINAL_CPU_BW = 50e9
# A GPU neither the card table nor a calibration knows: a mid-range card's memory bandwidth
# (docs/benchmarks.md#offload-model).
NOMINAL_GPU_BW = 0.5e12
# After this many days `dsq offload` says the calibration may be out of date (drivers, BIOS, DIMMs
# change; docs/benchmarks.md#offload-model).
CALIBRATION_MAX_AGE_DAYS = 30
# Bytes/s a card's memory delivers to a copy, by a name fragment (vendor figures, ~90% of spec).
_KNOWN_GPU_BW = {"H200": 4.25e12, "H100": 3.0e12, "A100": 1.8e12, "L40S": 0.78e12, "4090": 0.9e12,
                 "3090": 0.85e12, "A10": 0.54e12, "L4": 0.27e12, "T4": 0.28e12}


@dataclass
class GpuInfo:
    name: str
    total_bytes: int
    free_bytes: int


def detect_gpu() -> GpuInfo | None:
    """The first NVIDIA GPU via nvidia-smi (no torch import), or None."""
    gpus = detect_gpus()
    return gpus[0] if gpus else None


def detect_gpus() -> list[GpuInfo]:
    """The NVIDIA GPUs this process sees, in CUDA's order, via nvidia-smi (no torch import: the
    llama.cpp backend must not load it): those CUDA_VISIBLE_DEVICES names by index or UUID, where set."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,memory.free,uuid", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        rows = [[x.strip() for x in line.split(",")] for line in out if line.strip()]
        gpus = [(GpuInfo(r[0], int(float(r[1])) * MiB, int(float(r[2])) * MiB), r[3] if len(r) > 3 else "")
                for r in rows]
    except Exception:
        return []
    return _visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _visible(gpus: list[tuple[GpuInfo, str]], visible: str | None) -> list[GpuInfo]:
    """Of (GPU, UUID) in nvidia-smi's order, those CUDA_VISIBLE_DEVICES (`visible`) names, in its
    order, up to the first it cannot name (an index past the GPUs, empty, -1), as CUDA reads it; a
    name nvidia-smi's UUIDs do not match (a MIG instance's) stands for the next GPU in order."""
    if visible is None:
        return [g for g, _ in gpus]
    picked = []
    for name in (n.strip() for n in visible.split(",")):
        if name.isdigit() and int(name) < len(gpus):
            picked.append(gpus[int(name)][0])
        elif name and not name.lstrip("-").isdigit() and len(picked) < len(gpus):
            picked.append(next((g for g, u in gpus if u and u.startswith(name)), gpus[len(picked)][0]))
        else:
            break
    return picked


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        platform.processor() or platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def machine_identity(gpu: GpuInfo | None) -> dict:
    """What a calibration is valid for: CPU model, core count, GPU name (None without one)."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "gpu": gpu.name if gpu else None}


def runtime_threads() -> int:
    """The CPU threads dsq's runtime computes with by default (runtime/threads.py)."""
    from dsq.runtime.threads import default_threads

    return default_threads()


# -- measurements --------------------------------------------------------------------------------
def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_cpu_read(threads: int, nbytes: int = CPU_PROBE_BYTES, repeats: int = 5) -> float:
    """Bytes/s `threads` threads read memory at: the best of `repeats` torch sums over nbytes (the
    figure the offload model's efficiencies were fit on, placement.EFFICIENCY)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        x.sum()
        return x.numel() * 4 / best_seconds(x.sum, repeats)
    finally:
        torch.set_num_threads(before)


def measure_cpu_peak_read(threads: int, nbytes: int = CPU_PROBE_BYTES, repeats: int = 5) -> float | None:
    """Bytes/s `threads` threads of the C kernels' own pool read memory at (kernels/cpu.py read_sum):
    the ceiling a decode roofline divides by, above torch's sum (86 against the head GEMV's 115 GB/s
    on the H200 host: docs/benchmarks.md#split-between-gpu-and-cpu). None without the C kernels."""
    import torch

    from dsq.kernels import cpu

    lib = cpu.library()[0]
    if lib is None or not hasattr(lib, "dsq_read_sum"):
        return None
    x = torch.ones(nbytes // 8, dtype=torch.int64)
    cpu.read_sum(x, threads, lib)
    return x.numel() * 8 / best_seconds(lambda: cpu.read_sum(x, threads, lib), repeats)


def _cuda_seconds(fn, repeats: int) -> float:
    """Seconds for `repeats` calls of fn on the GPU, synchronized around them."""
    import torch

    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def measure_gpu_copy(nbytes: int = GPU_PROBE_BYTES, repeats: int = 10) -> float:
    """Bytes/s a device-to-device copy moves (read + write), as docs/benchmarks.md counts it."""
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * repeats * nbytes / _cuda_seconds(lambda: y.copy_(x), repeats)


def measure_h2d(nbytes: int = H2D_PROBE_BYTES, repeats: int = 5) -> float:
    """Bytes/s a copy from pinned host memory to the GPU moves."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return repeats * nbytes / _cuda_seconds(lambda: dev.copy_(host, non_blocking=True), repeats)


def measure_round_trip(floats: int = ROUND_TRIP_FLOATS, repeats: int = 200) -> float:
    """Seconds a split spends per token outside compute: a hidden state to the GPU through pinned
    memory, one kernel launch, the result back, and the wait for it (median of `repeats`)."""
    import torch

    host, back = torch.zeros(floats, pin_memory=True), torch.empty(floats, pin_memory=True)
    dev = torch.empty(floats, device="cuda")

    def once() -> float:
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        dev.add_(1.0)
        back.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    once()
    return statistics.median(once() for _ in range(repeats))


# -- the calibration file --------------------------------------------------------------------------
@dataclass
class Calibration:
    """Bandwidths measured on one machine (bytes/s; seconds for the round trip)."""

    taken: str  # ISO 8601, UTC
    machine: dict  # machine_identity()
    threads: int  # the CPU threads cpu_read_bw was measured with
    cpu_read_bw: float
    gpu_copy_bw: float | None = None
    h2d_bw: float | None = None
    split_overhead_s: float | None = None
    version: int = 1
    cpu_peak_read_bw: float | None = None  # the C kernels' pool (measure_cpu_peak_read); None before it

    def age_days(self, now: datetime.datetime | None = None) -> float:
        now = now or datetime.datetime.now(datetime.timezone.utc)
        return (now - datetime.datetime.fromisoformat(self.taken)).total_seconds() / 86400

    def as_dict(self) -> dict:
        return asdict(self)


def calibration_path() -> Path:
    from dsq.runtime.builtin import cache_dir

    return cache_dir() / "calibration.json"


def calibrate(threads: int | None = None, gpu: GpuInfo | None = None) -> Calibration:
    """Measure this machine: the CPU at `threads` (default: the runtime's), and with a CUDA GPU its
    copy bandwidth, the pinned host -> GPU rate and the split's round trip."""
    threads = threads or runtime_threads()
    cal = Calibration(taken=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      machine=machine_identity(gpu), threads=threads, cpu_read_bw=measure_cpu_read(threads),
                      cpu_peak_read_bw=measure_cpu_peak_read(threads))
    if _cuda_available():
        import torch

        cal.gpu_copy_bw = measure_gpu_copy()
        cal.h2d_bw = measure_h2d()
        cal.split_overhead_s = measure_round_trip()
        torch.cuda.empty_cache()  # the probes' memory back to the driver, for what runs next
    return cal


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def save_calibration(cal: Calibration, path: Path | None = None) -> Path:
    from dsq.formats.hf import atomic_output_file

    path = path or calibration_path()
    with atomic_output_file(path, force=True) as tmp:
        tmp.write_text(json.dumps(cal.as_dict(), indent=2) + "\n")
    return path


def load_calibration(path: Path | None = None) -> Calibration | None:
    """The saved calibration, or None where there is none (or it cannot be read)."""
    try:
        data = json.loads((path or calibration_path()).read_text())
        return Calibration(**data)
    except (OSError, ValueError, TypeError):
        return None


def calibration_note(cal: Calibration, here: dict, now: datetime.datetime | None = None) -> str | None:
    """What is wrong with using `cal` on the machine `here`, or None where nothing is."""
    if cal.machine != here:
        return (f"the calibration was taken on another machine ({_describe(cal.machine)}; this one: "
                f"{_describe(here)}): not used; run `dsq offload --calibrate` here")
    age = cal.age_days(now)
    if age > CALIBRATION_MAX_AGE_DAYS:
        return (f"the calibration is {age:.0f} days old (more than {CALIBRATION_MAX_AGE_DAYS}); "
                "`dsq offload --calibrate` measures again")
    return None


def _describe(machine: dict) -> str:
    gpu = machine.get("gpu") or "no GPU"
    return f"{machine.get('cpu')}, {machine.get('cores')} cores, {gpu}"


# -- the figures the offload model uses ------------------------------------------------------------
@dataclass
class Bandwidths:
    cpu: float  # bytes/s the CPU reads weights at
    gpu: float  # bytes/s the GPU reads weights at (its copy bandwidth)
    split_overhead_s: float  # per token, where both the CPU and the GPU hold a part of the model
    source: str  # where the figures come from, in words
    notes: list[str] = field(default_factory=list)
    # bytes/s the C kernels' pool read (the calibration's cpu_peak_read_bw), the ceiling rooflines divide
    # by; None: `cpu` is the best known
    cpu_peak: float | None = None

    @property
    def cpu_ceiling(self) -> float:
        return max(self.cpu, self.cpu_peak or 0.0)


def machine_bandwidths(gpu: GpuInfo | None, *, measure: bool = True, cpu_bw: float | None = None,
                       gpu_bw: float | None = None, threads: int | None = None,
                       path: Path | None = None) -> Bandwidths:
    """The offload model's figures: those given, then this machine's calibration, then the CPU
    measured now at `threads` (default: the runtime's; `measure`, and the reading is not kept) or a
    nominal figure, and the card table for the GPU. A calibration of another machine is not used;
    a stale one is, with a note."""
    notes: list[str] = []
    cal = None if cpu_bw and gpu_bw else _usable_calibration(gpu, path, notes)
    if cal is not None and threads and threads != cal.threads:
        notes.append(f"the CPU was calibrated with {cal.threads} threads; this run uses {threads}")
    cpu = cpu_bw or (cal.cpu_read_bw if cal else None)
    if cpu is None:
        cpu = measure_cpu_read(threads or runtime_threads()) if measure else NOMINAL_CPU_BW
    gpu_fig = gpu_bw or (cal.gpu_copy_bw if cal and cal.gpu_copy_bw else card_bandwidth(gpu))
    overhead = cal.split_overhead_s if cal and cal.split_overhead_s is not None else SPLIT_OVERHEAD_S
    peak = cal.cpu_peak_read_bw if cal is not None and not cpu_bw else None
    return Bandwidths(cpu, gpu_fig, overhead, _source(cal, cpu_bw, measure), notes, peak)


def _source(cal: Calibration | None, cpu_given: float | None, measure: bool) -> str:
    if cpu_given:
        return "given"
    if cal is not None:
        return f"calibrated {cal.taken[:10]} with {cal.threads} threads"
    if measure:
        return "CPU measured now, not kept (`dsq offload --calibrate` keeps a calibration)"
    return "nominal (no calibration)"


def _usable_calibration(gpu: GpuInfo | None, path: Path | None, notes: list[str]) -> Calibration | None:
    cal = load_calibration(path)
    if cal is None:
        return None
    here = machine_identity(gpu)
    note = calibration_note(cal, here)
    if note:
        notes.append(note)
    return cal if cal.machine == here else None


def card_bandwidth(gpu: GpuInfo | None) -> float:
    """Bytes/s the card streams weights at, from the table of known cards; else a nominal figure."""
    if gpu is not None:
        for key, bw in _KNOWN_GPU_BW.items():
            if key in gpu.name:
                return bw
    return NOMINAL_GPU_BW
