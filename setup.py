"""C extensions only (everything else is in pyproject.toml): dsq's CPU kernels, built once per
instruction set so the best one can be picked at run time. Optional: without a compiler dsq still
installs and falls back to its torch reference kernels."""

import os
import platform
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

MACHINE = platform.machine()
X86 = MACHINE in ("x86_64", "AMD64")
ARM64 = MACHINE in ("aarch64", "arm64")
FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    # aarch64: baseline Armv8-A; the dot product path is compiled for Armv8.2-A+dotprod per function
    # and taken only where the CPU has it. macOS: the compiler's default (Apple M: dotprod built in).
    "neon": [] if sys.platform == "darwin" else ["-march=armv8-a"],
    "generic": [],
}
ISAS = [isa for isa in FLAGS if isa == "generic" or (X86 and isa in ("avx512", "avx2")) or (ARM64 and isa == "neon")]

_SIMD_TEST = "int f(int *x) {\n#pragma omp simd\n  for (int i = 0; i < 8; i++) x[i]++;\n  return 0;\n}\n"


def _accepts(compiler, flags: list[str]) -> bool:
    """Whether the build's C compiler compiles a loop under `#pragma omp simd` with `flags`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "simd_test.c")
        with open(src, "w") as f:
            f.write(_SIMD_TEST)
        try:
            compiler.compile([src], output_dir=tmp, extra_postargs=flags)
        except Exception:
            return False
    return True


class BuildExt(build_ext):
    """The kernels run their parallel loops on their own thread pool (kernels/csrc/pool.inc,
    pthreads), not OpenMP: -pthread, and `omp simd` through -fopenmp-simd where the compiler knows
    it (GCC, clang, Apple's clang included; it needs no OpenMP runtime)."""

    def build_extensions(self):
        simd = ["-fopenmp-simd"] if _accepts(self.compiler, ["-fopenmp-simd"]) else []
        for ext in self.extensions:
            ext.extra_compile_args = [*ext.extra_compile_args, *simd, "-pthread"]
            ext.extra_link_args = [*ext.extra_link_args, "-pthread"]
        super().build_extensions()


exts = [
    Extension(f"dsq.kernels._cpu_{isa}", [f"kernels/csrc/cpu_{isa}.c"],
              depends=[f"kernels/csrc/{f}.inc" for f in ("pool", "gguf_cpu", "moe_cpu", "gguf_x8_cpu", "gguf_avx2_cpu", "gguf_i8gemm_cpu", "gguf_gemm_cpu", "intq_cpu",
                                                         "norm_cpu", "read_cpu", "attn_cpu", "layer_cpu")],
              extra_compile_args=["-O3", "-std=c11", *FLAGS[isa]], optional=True)
    for isa in ISAS
]
setup(ext_modules=exts, cmdclass={"build_ext": BuildExt})
