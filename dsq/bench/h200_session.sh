#!/usr/bin/env bash
# One device call's worth of GPU work (the `device` tool runs this from the repository root on an
# H200 with no dsq install): GPU tests first, then the kernel table, quantized decode and the
# quantization speed, each with its own time limit so one overrun cannot eat the others.
# Usage (from the developer machine, through the device tool):  bash dsq/bench/h200_session.sh [budget_s]
# Results land in $OUT (the device tool's output folder) as JSON and text.
set -u
ln -sfn ../kernels dsq/kernels; ln -sfn ../recipes dsq/recipes
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsq-out}; mkdir -p "$OUT"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  echo "==== $name (limit ${secs}s)"
  timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.txt" | tail -40
}
step tests 240 python -m pytest -q tests/test_native_cuda.py tests/test_kernels_triton.py::test_real_shapes_autotuned
step kernels 150 python -m dsq.bench.kernels_gpu --shapes 4096x4096,14336x4096,4096x14336,28672x8192 \
  --formats int4-g128,int4-g128-actorder,int8-channel,fp8-channel,fp8-block,Q4_K,Q6_K,Q8_0 --json "$OUT/kernels.json"
step decode 180 python -m dsq.bench.decode_gpu --variants graph+fused --transformers '' \
  --formats awq-int4,gptq-int4-actorder,fp8,q4_k_m --prompt-tokens 512 --gen-tokens 128 --repeat 2 --json "$OUT/decode.json"
