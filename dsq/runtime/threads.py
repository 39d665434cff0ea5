"""CPU threads: the one default both backends and `dsq bench` use, and OpenMP's wait.

The default is the physical cores this process may run on (its affinity mask), one thread a core,
not one per SMT sibling: decode is memory-bound, its speed follows the read bandwidth, and a second
thread on a core shares that core's load ports and caches rather than adding bandwidth; threads
past the cores in the mask would only time-share them. The rule is one function
(`default_threads`), to follow the bandwidth curve measured on the largest host
(docs/benchmarks.md#cpu-decode, the thread count).
"""

from __future__ import annotations

import os


def default_threads() -> int:
    """Threads for CPU work when none are asked for: physical cores in this process's affinity
    mask (at least 1)."""
    cpus = _affinity()
    cores = {_core_of(c) for c in cpus}
    if None in cores:  # no topology to read (not Linux): psutil's count of physical cores
        return max(1, min(len(cpus), _physical_cores() or len(cpus)))
    return max(1, len(cores))


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: every CPU
        return list(range(os.cpu_count() or 1))


def _core_of(cpu: int) -> str | None:
    """The core a logical CPU belongs to, as the list of its SMT siblings (Linux sysfs), or None."""
    for name in ("core_cpus_list", "thread_siblings_list"):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/{name}") as f:
                return f.read().strip()
        except OSError:
            continue
    return None


def _physical_cores() -> int | None:
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except Exception:  # noqa: BLE001 - psutil missing or unable to tell
        return None


# Spins an idle OpenMP thread makes before it sleeps (GNU OpenMP's default: 300000, ~ms): short
# enough that a spinning torch thread stops competing with the kernels' pool and a descheduled
# thread stalls a barrier only briefly, long enough that llama.cpp's per-op barriers keep their
# idle speed (docs/benchmarks.md#cpu-decode, OpenMP's wait)
OMP_SPINCOUNT = 1000


def quiet_openmp() -> None:
    """Bound how long OpenMP threads (torch's; llama.cpp's share the same libgomp once torch has
    loaded it) spin at the end of a parallel region before sleeping, unless the user chose a wait
    policy. Takes effect for a runtime loaded after it: dsq/__init__.py calls it before anything
    imports torch."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(OMP_SPINCOUNT)
