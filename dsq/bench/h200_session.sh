#!/usr/bin/env bash
# The next GPU session's first runs, in two device calls (each must finish inside the device tool's
# 600 s limit; the machine has no dsq install): part 1, the GPU tests and the M=1 kernel table with
# the current autotune candidates; part 2, compiled decode end to end for the four formats with a
# kernel-time profile (the candidates added at the end of session 4 are not measured end to end yet).
# Each step has its own time limit so one overrun cannot eat the others.
# Usage (from the developer machine, through the device tool):
#   bash dsq/bench/h200_session.sh 1     # <= 450 s
#   bash dsq/bench/h200_session.sh 2     # <= 480 s
# Results land in $OUT (the device tool's output folder) as JSON and text.
set -u
PART=${1:?usage: h200_session.sh 1|2}
ln -sfn ../kernels dsq/kernels; ln -sfn ../recipes dsq/recipes
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsq-out}; mkdir -p "$OUT"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  echo "==== $name (limit ${secs}s)"
  timeout "$secs" "$@" 2>&1 | grep -v -i warn | tee "$OUT/$name.txt" | tail -45
}
if [ "$PART" = 1 ]; then
  step tests 200 python -m pytest -q tests/test_native_cuda.py tests/test_kernels_triton.py -k "cuda or real_shapes or dispatch"
  step kernels 240 python -m dsq.bench.kernels_gpu --m 1 --shapes 4096x4096,6144x4096,28672x4096,4096x14336 \
    --formats int4-g128+q8,Q4_K+q8,Q6_K+q8,Q6_K,Q8_0+q8,fp8-channel,fp8-block --json "$OUT/kernels.json"
else
  step decode 470 python -m dsq.bench.decode_gpu --variants '' --transformers '' \
    --formats awq-int4,q4_k_m,fp8,gptq-int4-actorder --quant-variants compile+graph+fused \
    --prompt-tokens 512 --gen-tokens 128 --repeat 2 --profile --json "$OUT/decode.json"
fi
