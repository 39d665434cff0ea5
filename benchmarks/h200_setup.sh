# Shared setup of the device scripts (sourced: `source benchmarks/h200_setup.sh`, from the repo root).
# The device machine has no dsq install and no network: the C kernels are built in place, dsq.kernels
# is linked to kernels/, the wheels the image lacks travel in .whl/, llama-cpp-python's package in
# .llsrc/, and llama.cpp's CUDA binaries in .llbin/ (else built from .llsrc/ by llama_bins). On the dev machine
# `bash benchmarks/build_llama_cuda.sh` makes both .llbin/ and .llsrc/ (~40 min on two cores, no device time).
ROOT=${ROOT:-$PWD}
LL=${LL:-/tmp/ll/llama.cpp}
export PYTHONUNBUFFERED=1

setup_python() {  # dsq importable in place, with the carried wheels and llama_cpp's Python package
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$ROOT"/.whl/*.whl >/dev/null 2>&1 || echo "wheels: install failed"
  [ -e dsq/kernels ] || ln -sfn ../kernels dsq/kernels
  ls kernels/_cpu_*.so >/dev/null 2>&1 || python3 setup.py -q build_ext --inplace >/tmp/build_ext.log 2>&1 ||
    tail -5 /tmp/build_ext.log
  mkdir -p /tmp/ll && { [ -d /tmp/ll/llama_cpp_py ] || tar xzf "$ROOT"/.llsrc/llama-src.tar.gz -C /tmp/ll; }
  mkdir -p /tmp/llpy && ln -sfn /tmp/ll/llama_cpp_py /tmp/llpy/llama_cpp
  export PYTHONPATH=$ROOT:/tmp/llpy:/tmp/site
  export LLAMA_CPP_LIB_PATH=$LL/build/bin
  # the carried libraries' RUNPATH names the dev machine's build folder: their ggml siblings are found here
  export LD_LIBRARY_PATH=$LL/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

llama_bins() {  # llama.cpp's CUDA libraries and llama-bench: unpack the carried ones, or build them
  if [ -x "$LL/build/bin/llama-bench" ]; then return 0; fi
  if ls "$ROOT"/.llbin/llbin.tar.xz.* >/dev/null 2>&1; then
    mkdir -p "$LL/build/bin" && cat "$ROOT"/.llbin/llbin.tar.xz.* | xz -d | tar x -C "$LL/build/bin" && return 0
  fi
  (cd "$LL" && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=OFF \
     "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL" >/tmp/llcfg.log 2>&1 &&
   cmake --build build -j"$(nproc)" --target llama-bench llama >/tmp/llbuild.log 2>&1) ||
    { tail -30 /tmp/llcfg.log /tmp/llbuild.log; return 1; }
}
