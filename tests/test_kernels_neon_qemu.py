"""The C CPU kernels checked by kernels/csrc/test_harness.c: a standalone C program (its own scalar
reference, no torch) built with one kernel build. The aarch64 NEON build is cross-compiled and run
under qemu-aarch64 when the tools are there (install.sh --dev installs them on x86-64 as root), or
built natively on an aarch64 machine; the generic build (and the x86 builds this CPU runs) natively
everywhere with a C compiler, which checks the harness itself."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsq.kernels import cpu

CSRC = Path(__file__).resolve().parents[1] / "kernels" / "csrc"
X86_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"], "avx2": ["-mavx2", "-mfma", "-mf16c"]}
SYSROOT = "/usr/aarch64-linux-gnu"
ENV = dict(os.environ)  # the harness switches the integer row dots off itself, for its second pass
ENV.pop("DSQ_NO_VNNI", None)
ENV.pop("DSQ_NO_DOTPROD", None)
ENV.pop("DSQ_INT8_PREFILL", None)


def build(cc: str, isa: str, flags: list[str], out: Path) -> Path:
    """The harness linked with cpu_<isa>.c, as setup.py builds it: -pthread (the kernels' own thread
    pool), `omp simd` through -fopenmp-simd when the compiler has it."""
    exe = out / f"harness_{isa}"
    base = [cc, "-O3", "-std=c11", "-Wall", "-pthread", *flags, "-I", str(CSRC), str(CSRC / "test_harness.c"),
            str(CSRC / f"cpu_{isa}.c"), "-o", str(exe)]
    for simd in (["-fopenmp-simd"], []):
        r = subprocess.run([*base[:2], *simd, *base[2:], "-lm"], capture_output=True, text=True, timeout=300)
        if r.returncode == 0:
            return exe
    pytest.fail(f"{cc} could not build the harness for {isa}:\n{r.stderr[-4000:]}")


def run(cmd: list[str], isa: str) -> int:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=ENV)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{out[-6000:]}"
    m = re.search(rf"harness {isa}: (\d+) checks passed", r.stdout)
    assert m, out[-3000:]
    n = int(m.group(1))
    assert n > 50000, f"only {n} checks ran"
    print(r.stdout)  # the per-format error table, shown with pytest -s
    return n


def native_cc() -> str:
    cc = shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler")
    return cc


def test_harness_generic_native(tmp_path):
    """The harness with the plain C build on this machine, whatever it is."""
    run([str(build(native_cc(), "generic", [], tmp_path))], "generic")


@pytest.mark.parametrize("isa", list(X86_FLAGS))
def test_harness_x86_native(isa, tmp_path):
    if platform.machine() not in ("x86_64", "AMD64") or isa not in cpu.supported_isas():
        pytest.skip(f"this CPU does not run the {isa} build")
    run([str(build(native_cc(), isa, X86_FLAGS[isa], tmp_path))], isa)


def qemu() -> str | None:
    return shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


# qemu's "max" CPU has the dot product instructions (the integer row dots); a Cortex-A57 has not
# (the build must notice at run time and take the float row dots)
@pytest.mark.parametrize("qemu_cpu", ["max", "cortex-a57"])
def test_neon_build(qemu_cpu, tmp_path):
    if platform.machine() in ("aarch64", "arm64"):  # an Arm machine: natively
        if qemu_cpu != "max":
            pytest.skip("natively, the CPU is what it is")
        flags = [] if platform.system() == "Darwin" else ["-march=armv8-a"]
        run([str(build(native_cc(), "neon", flags, tmp_path))], "neon")
        return
    cross = shutil.which("aarch64-linux-gnu-gcc")
    if not cross or not qemu():
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu "
                    "libc6-dev-arm64-cross qemu-user; install.sh --dev does it as root)")
    hello = tmp_path / "hello.c"
    hello.write_text("#include <stdio.h>\nint main(void) { puts(\"hi\"); return 0; }\n")
    if subprocess.run([cross, str(hello), "-o", str(tmp_path / "hello")], capture_output=True).returncode:
        pytest.skip("the aarch64 cross compiler cannot build a C program (libc6-dev-arm64-cross missing?)")
    exe = build(cross, "neon", ["-march=armv8-a"], tmp_path)
    run([qemu(), "-cpu", qemu_cpu, "-L", SYSROOT, str(exe)], "neon")
