"""C extensions only (everything else is in pyproject.toml): dsq's CPU kernels, built once per
instruction set so the best one can be picked at run time. Optional: without a compiler dsq still
installs and falls back to its torch reference kernels."""

import platform

from setuptools import Extension, setup

X86 = platform.machine() in ("x86_64", "AMD64")
FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}
exts = [
    Extension(f"dsq.kernels._cpu_{isa}", [f"kernels/csrc/cpu_{isa}.c"],
              depends=["kernels/csrc/gguf_cpu.inc", "kernels/csrc/intq_cpu.inc"],
              extra_compile_args=["-O3", "-fopenmp", "-std=c11", *flags], extra_link_args=["-fopenmp"], optional=True)
    for isa, flags in FLAGS.items() if X86 or isa == "generic"
]
setup(ext_modules=exts)
