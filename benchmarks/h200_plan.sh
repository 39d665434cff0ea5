#!/usr/bin/env bash
# The GPU device runs, one part a device call (each inside the device tool's 600 s limit). The
# machine gets a plain copy of the repository and no dsq install: each part links kernels/ and
# recipes/ in as dsq.kernels and dsq.recipes and runs with PYTHONPATH=$PWD (benchmarks/README.md).
#   part 1 (<= 470 s): the GPU tests, then every format at M=1 on the four Llama-3-8B shapes,
#     autotuned, with the configs that won (kernels.json)
#   part 2 (<= 480 s): compiled decode end to end of a random Llama-3-8B in awq-int4, q4_k_m, fp8
#     and gptq-int4-actorder (q/k/v and gate/up fused), with a kernel-time profile (decode.json)
#   part 3 (<= 590 s): int4 at 2-64 rows through the three kernel families, Q4_K at 4-16 rows, and
#     prefill's bf16-weight route against the tl.dot GEMM (kernels_m, kernels_q4k, kernels_dq.json)
#   part 4 (<= 600 s on the x2 kind): llama.cpp (CUDA) beside the native runtime on one random
#     Llama-3-8B Q4_K_M GGUF, then the native runtime's batched decode on it (peer_*.json); without
#     llama.cpp's build, batched decode alone: python -m benchmarks.batch_gpu --compile --batch 1,2,4,8,16,64
# Machines differ by up to ~10% between calls: compare a change against its baseline inside one
# call (e.g. with DSQ_PDL=0 or DSQ_TRITON_ATTN=0). Each step has its own time limit so one overrun
# cannot eat the others.
# Usage (from the developer machine, through the device tool):
#   bash benchmarks/h200_plan.sh 1
#   bash benchmarks/h200_plan.sh 2
#   bash benchmarks/h200_plan.sh 3
#   LLSRC=.llsrc/llama_cpp_python.tar.gz bash benchmarks/h200_plan.sh 4
#     (carry the sdist, trimmed of vendor/llama.cpp/{models,docs,benches,media}, and a gguf wheel in
#     .whl: the image has no gguf; the build takes ~3 min on 32 cores, ~9 on 16)
# Results land in $OUT (the device tool's output folder) as JSON and text.
set -u
PART=${1:?usage: h200_plan.sh 1|2|3|4}
ln -sfn ../kernels dsq/kernels; ln -sfn ../recipes dsq/recipes
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsq-out}; mkdir -p "$OUT"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  echo "==== $name (limit ${secs}s)"
  timeout "$secs" "$@" 2>&1 | grep -v -E "Warning|warnings.warn" | tee "$OUT/$name.txt" | tail -45
}
if [ "$PART" = 1 ]; then
  step tests 250 python -m pytest -q tests/test_native_cuda.py tests/test_kernels_triton.py tests/test_attn_triton.py \
    tests/test_mma_triton.py -k "cuda or real_shapes or dispatch or attn or sdpa or mma"
  # the kernel table at M=1: every format on its four shapes, autotuned (which config won is printed)
  step kernels 220 env TRITON_PRINT_AUTOTUNING=1 python -m benchmarks.kernels_gpu --m 1 \
    --shapes 4096x4096,14336x4096,4096x14336,28672x8192 \
    --formats int4-g128+q8,Q4_K+q8,Q5_K+q8,Q5_K,Q6_K+q8,Q8_0+q8,fp8-channel,fp8-block --json "$OUT/kernels.json"
elif [ "$PART" = 3 ]; then
  # a few rows: int4 on tensor cores (+tc, the default at 3-64 rows) beside int8 x (+q8, the
  # default at 1-2) and the tl.dot GEMM (int4-g128, the default above 64)
  step kernels_m 300 python -m benchmarks.kernels_gpu --m 2,4,16,32,64 --shapes 4096x4096,14336x4096,4096x14336,28672x8192 \
    --formats int4-g128+tc,int4-g128+q8,int4-g128 --json "$OUT/kernels_m.json"
  # Q4_K at 4-16 rows: the weight-scaling tensor-core variant (the default at 5-64) against the others
  step kernels_q4k 120 python -m benchmarks.kernels_gpu --m 4,16 --shapes 4096x4096,14336x4096,4096x14336,28672x8192 \
    --formats Q4_K+tcs,Q4_K+q8,Q4_K,int4-g128+tcs --json "$OUT/kernels_q4k.json"
  # prefill: the weight written out in bf16 for cuBLAS (+dq, the default from dispatch.DEQUANT_MIN_ROWS rows)
  # against the tl.dot GEMM, at the row counts where the threshold would go
  step kernels_dq 170 python -m benchmarks.kernels_gpu --m 128,256,512,2048 --shapes 4096x4096,14336x4096,4096x14336 \
    --formats int4-g128+dq,int4-g128,Q4_K+dq,Q4_K --json "$OUT/kernels_dq.json"
elif [ "$PART" = 4 ]; then
  export CUDA_VISIBLE_DEVICES=0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  echo "class Cache: pass" > /tmp/site/diskcache.py  # llama_cpp imports diskcache for a cache dsq does not use
  mkdir -p /tmp/ll && tar xzf "${LLSRC:?LLSRC: the llama-cpp-python sdist}" -C /tmp/ll
  # in the background while the GGUF is written
  (cd /tmp/ll/llama_cpp_python-* && CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF \
    -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) setsid nohup nice -n 10 \
    python3 -m pip install --no-build-isolation --no-deps --target /tmp/llpy . > /tmp/llbuild.log 2>&1 < /dev/null &)
  export PYTHONPATH=$PWD:/tmp/site
  step gguf 120 python -m dsq.bench.random_gguf /tmp/r8b.gguf --shape llama3-8b --mix Q4_K_M --force
  B="python -m dsq bench /tmp/r8b.gguf -g all --prompt-tokens 512 --gen-tokens 128 --repeat 3"
  # the native GGUF tokenizer reads the vocabulary through llama.cpp too: both wait for the build
  for _ in $(seq 80); do grep -q -E "Successfully installed|^ERROR" /tmp/llbuild.log && break; sleep 5; done
  tail -c 300 /tmp/llbuild.log
  export PYTHONPATH=$PWD:/tmp/llpy:/tmp/site
  step native 200 $B --backend native --compile --json "$OUT/peer_native.json"
  step native_gemm 200 env DSQ_DEQUANT_ROWS=0 $B --backend native --compile --json "$OUT/peer_native_gemm.json"
  step llama_cpp 90 $B --backend llama.cpp --json "$OUT/peer_llama_cpp.json"
  # batched decode (3-64 rows through the tensor-core kernels; each size compiles and captures once)
  step native_batch 150 python -m dsq bench /tmp/r8b.gguf -g all --prompt-tokens 128 --gen-tokens 64 --repeat 2 \
    --backend native --compile --batch 1,4,16,64 --json "$OUT/peer_native_batch.json"
else
  step decode 470 python -m benchmarks.decode_gpu --variants '' --transformers '' \
    --formats awq-int4,q4_k_m,fp8,gptq-int4-actorder --quant-variants compile+graph+fused \
    --prompt-tokens 512 --gen-tokens 128 --repeat 2 --profile --json "$OUT/decode.json"
fi
