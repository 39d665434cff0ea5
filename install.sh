#!/usr/bin/env bash
# Install dsq into the current Python environment (a venv is recommended).
#
#   ./install.sh          dsq and everything it needs to run
#   ./install.sh --dev    plus the test tools (pytest, transformers as the reference implementation;
#                         on x86-64 as root, apt's aarch64 cross compiler and qemu for the NEON test)
#
# Two choices a plain `pip install -e .` would get wrong:
# - PyTorch: with no NVIDIA GPU, the CPU build (a plain `torch` requirement pulls a multi-GB CUDA
#   build). Set DSQ_TORCH_INDEX to a wheel index (e.g. https://download.pytorch.org/whl/cpu) to
#   choose where it comes from.
# - llama-cpp-python is compiled here: with CUDA when nvcc is present, otherwise for the CPU with
#   explicit SIMD flags and no AMX (llama.cpp's CPU AMX path crashes on some machines). The CUDA
#   build links with --exclude-libs,ALL: otherwise its CUDA library exports a copy of the C++
#   runtime, and loading a model in a process that has loaded PyTorch segfaults.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
EXTRA=""
[ "${1:-}" = "--dev" ] && EXTRA="[dev]"

pipi() { "$PY" -m pip install --disable-pip-version-check "$@"; }
have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if have_gpu; then
    echo "install.sh: NVIDIA GPU found: installing PyTorch with CUDA"
    pipi "torch>=2.4"
  elif [ -n "${DSQ_TORCH_INDEX:-}" ]; then
    pipi torch --index-url "$DSQ_TORCH_INDEX"
  else
    echo "install.sh: no GPU: installing the CPU build of PyTorch"
    pipi "torch==2.13.0"
  fi
fi

if ! "$PY" -c "import llama_cpp" >/dev/null 2>&1; then
  if [ -z "${CMAKE_ARGS:-}" ]; then
    if have_gpu && command -v nvcc >/dev/null 2>&1; then
      export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL"
    elif [ "$(uname -m)" = "x86_64" ]; then
      avx512=OFF
      grep -qw avx512f /proc/cpuinfo 2>/dev/null && avx512=ON
      export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=$avx512"
    fi
  fi
  echo "install.sh: building llama-cpp-python (a few minutes; CMAKE_ARGS=${CMAKE_ARGS:-})"
  pipi "llama-cpp-python>=0.3.8"
fi

pipi -e ".$EXTRA"

# --dev on x86-64: a cross compiler and qemu, so tests/test_kernels_neon_qemu.py can check the
# aarch64 NEON kernels (best effort, as root with apt; without them that test skips)
neon_test_tools() {
  [ "$(uname -m)" = "x86_64" ] || return 0
  command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && [ -d /usr/aarch64-linux-gnu/include ] &&
    { command -v qemu-aarch64 || command -v qemu-aarch64-static; } >/dev/null 2>&1 && return 0
  local pkgs="gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    if apt-get install -y -qq --no-install-recommends $pkgs >/dev/null 2>&1 ||
       { apt-get update -qq >/dev/null 2>&1 &&
         apt-get install -y -qq --no-install-recommends $pkgs >/dev/null 2>&1; }; then
      echo "install.sh: installed $pkgs (for the NEON kernel test)"
      return 0
    fi
  fi
  echo "install.sh: could not install $pkgs (needs root and apt): the NEON kernel test will skip"
}
if [ -n "$EXTRA" ]; then neon_test_tools; fi

echo "install.sh: done. Try: dsq run -p \"The history of the Roman Empire\" --max-tokens 32"
