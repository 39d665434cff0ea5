#!/usr/bin/env bash
# llama.cpp's CUDA binaries for the H200 device (sm_90: llama-bench, llama-server and their libraries), built on
# the dev machine, which has nvcc but no GPU, no cuBLAS and no CUDA driver. The device then spends none of its
# time building them (~5 min there a session otherwise).
# - cuBLAS (headers, libraries) comes from PyPI's nvidia-cublas wheel of the toolkit's major version and is
#   copied into the toolkit (this writes under the toolkit's directory: run it as its owner);
# - the driver's symbols come from a stub built from cuda.h (libcuda.so / .so.1 in the toolkit's lib/stubs), for
#   linking only: on the device its own libcuda.so.1 loads;
# - the sources are llama-cpp-python's vendored llama.cpp, the version installed here (the Python package the
#   device scripts carry in .llsrc/ must be the same version), with tools/CMakeLists.txt trimmed to the targets;
# - CPU flags are the H200 host's (llama.cpp's own detection there printed AVX512, VBMI, VNNI, BF16, AMX_INT8).
# Output: .llbin/llbin.tar.xz.* (15 MB parts: carry .llbin; benchmarks/h200_setup.sh's llama_bins unpacks them),
# and .llsrc/llama-src.tar.gz, the installed llama_cpp Python package as llama_cpp_py/ (carry .llsrc).
# About 40 minutes on two cores.
#
#   bash benchmarks/build_llama_cuda.sh [WORKDIR]        # from the repo root; WORKDIR default /tmp/llcuda
set -euo pipefail
W=${1:-/tmp/llcuda}
ROOT=$PWD
CUDA=${CUDA:-$(ls -d /usr/local/cuda-[0-9]* | sort -V | tail -1)}
MAJOR=$("$CUDA/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
VER=${LLAMA_CPP_VERSION:-$(python3 -c "import llama_cpp; print(llama_cpp.__version__)")}  # set it to build while install.sh still compiles
mkdir -p "$W" && cd "$W"
echo "toolkit $CUDA (CUDA $MAJOR), llama-cpp-python $VER, in $W"

if [ ! -f "$CUDA/include/cublas_v2.h" ]; then  # cuBLAS from PyPI into the toolkit
  python3 -m pip download -q --no-deps "nvidia-cublas>=$MAJOR,<$((MAJOR + 1))" -d cublas
  python3 -m zipfile -e cublas/nvidia_cublas-*.whl cublas/x
  cp cublas/x/nvidia/cu"$MAJOR"/include/* "$CUDA/include/"
  for l in cublas cublasLt; do
    cp cublas/x/nvidia/cu"$MAJOR"/lib/lib$l.so."$MAJOR" "$CUDA/lib/" && ln -sf lib$l.so."$MAJOR" "$CUDA/lib/lib$l.so"
  done
fi
if [ ! -e "$CUDA/lib/stubs/libcuda.so.1" ]; then  # the driver API as empty functions, to link against
  mkdir -p "$CUDA/lib/stubs"
  grep -o -E "\bcu[A-Z][A-Za-z0-9_]*" "$CUDA/include/cuda.h" | sort -u | awk '{print "void "$1"(void){}"}' > cudastub.c
  gcc -shared -fPIC -o "$CUDA/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 cudastub.c
  ln -sf libcuda.so "$CUDA/lib/stubs/libcuda.so.1"
fi

S=$W/llama_cpp_python-$VER/vendor/llama.cpp
if [ ! -d "$S" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d .
  tar xzf "llama_cpp_python-$VER.tar.gz"
  python3 - "$S/tools/CMakeLists.txt" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
s = s[:s.index("if (EMSCRIPTEN)")] + """add_subdirectory(llama-bench)
add_subdirectory(mtmd)
if (LLAMA_BUILD_SERVER)
    add_subdirectory(ui)
    add_subdirectory(server)
endif()
"""
open(p, "w").write(s)
PY
fi
cd "$S"
cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX_VNNI=ON -DGGML_AVX2=ON -DGGML_F16C=ON -DGGML_FMA=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \
  -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON \
  -DCUDAToolkit_ROOT="$CUDA" "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL" > "$W/configure.log"
[ "${CONFIGURE_ONLY:-0}" = 1 ] && { echo "configured: $S/build"; exit 0; }
LD_LIBRARY_PATH=$CUDA/lib/stubs nice -n 5 cmake --build build -j"$(nproc)" --target llama-bench llama-server llama \
  > "$W/build.log" 2>&1 || { tail -20 "$W/build.log"; exit 1; }
cd build/bin
strip --strip-unneeded ./*.so* llama-bench llama-server
rm -rf "$ROOT/.llbin" && mkdir -p "$ROOT/.llbin"
tar c ./*.so* llama-bench llama-server | xz -6 -T0 | split -b 15M - "$ROOT/.llbin/llbin.tar.xz."
pkg=$(python3 -c "import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))")
rm -rf "$W/pkg" && mkdir -p "$W/pkg" "$ROOT/.llsrc" && cp -a "$pkg" "$W/pkg/llama_cpp_py"
rm -rf "$W/pkg/llama_cpp_py/lib" "$W/pkg/llama_cpp_py/__pycache__"
tar czf "$ROOT/.llsrc/llama-src.tar.gz" -C "$W/pkg" llama_cpp_py
ls -la "$ROOT/.llbin" "$ROOT/.llsrc"
