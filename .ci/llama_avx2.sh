#!/usr/bin/env bash
# llama.cpp's shared libraries built for AVX2 without AVX-512 (what most x86 CPUs have: desktop
# Intel, AMD before Zen 4), from the installed llama-cpp-python's own sources; prints the folder
# to point LLAMA_CPP_LIB_PATH at. Built once per llama-cpp-python version and cached under
# $DSQ_CI_CACHE (default ~/.cache/dsq-ci). llama.cpp's CPU AMX path stays off, as in install.sh.
set -euo pipefail
PY="${PYTHON:-python3}"
ver=$("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)')
root="${DSQ_CI_CACHE:-$HOME/.cache/dsq-ci}"
out="$root/llama-avx2-$ver"
if [ -f "$out/bin/libllama.so" ]; then echo "$out/bin"; exit 0; fi
src="$root/src/llama_cpp_python-$ver"
if [ ! -d "$src/vendor/llama.cpp/ggml" ]; then
  mkdir -p "$root/src"
  [ -f "$root/src/llama_cpp_python-$ver.tar.gz" ] ||
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
      "llama-cpp-python==$ver" -d "$root/src" >&2
  tar -xzf "$root/src/llama_cpp_python-$ver.tar.gz" -C "$root/src"
fi
cmake -S "$src/vendor/llama.cpp" -B "$out" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
  -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_APP=OFF >&2
cmake --build "$out" -j"$(nproc)" --target llama >&2
echo "$out/bin"
