#!/usr/bin/env bash
# Install dsq into the current Python environment (a venv is recommended).
#
#   ./install.sh          dsq and everything it needs to run
#   ./install.sh --dev    plus the test tools (pytest, transformers as the reference implementation)
#
# Two choices a plain `pip install -e .` would get wrong:
# - PyTorch: with no NVIDIA GPU, the CPU build (a plain `torch` requirement pulls a multi-GB CUDA
#   build). Set DSQ_TORCH_INDEX to a wheel index (e.g. https://download.pytorch.org/whl/cpu) to
#   choose where it comes from.
# - llama-cpp-python is compiled here: with CUDA when nvcc is present, otherwise for the CPU with
#   explicit SIMD flags and no AMX (llama.cpp's CPU AMX path crashes on some machines).
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
      export CMAKE_ARGS="-DGGML_CUDA=on"
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
echo "install.sh: done. Try: dsq run -p \"The history of the Roman Empire\" --max-tokens 32"
