#!/usr/bin/env bash
# A GPU session's first runs, in two device calls (each must finish inside the device tool's 600 s
# limit; the machine has no dsq install): part 1, the GPU tests, the int8-x GEMV's tile sweep on the
# decode shapes and the M=1 kernel table with the autotune candidates; part 2, compiled decode end
# to end for the four formats with a kernel-time profile.
# Each step has its own time limit so one overrun cannot eat the others.
# Usage (from the developer machine, through the device tool):
#   bash dsq/bench/h200_session.sh 1     # <= 560 s
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
  timeout "$secs" "$@" 2>&1 | grep -v -E "Warning|warnings.warn" | tee "$OUT/$name.txt" | tail -45
}
if [ "$PART" = 1 ]; then
  step tests 170 python -m pytest -q tests/test_native_cuda.py tests/test_kernels_triton.py -k "cuda or real_shapes or dispatch"
  # the register-prefetch GEMV (stages 0) against the best pipelined tiles, on the decode shapes
  step sweep 210 python -m dsq.bench.q8_sweep --formats int4-g128 \
    --shapes 4096x4096,6144x4096,28672x4096,4096x14336,28672x8192 \
    --configs 4:512:1:3,4:512:1:2,4:1024:2:3,1:1024:1:0,2:1024:1:0,4:1024:1:0,8:1024:1:0,1:2048:1:0,2:2048:1:0,4:2048:2:0,2:2048:2:0,8:2048:2:0,4:4096:4:0
  step kernels 180 env TRITON_PRINT_AUTOTUNING=1 python -m dsq.bench.kernels_gpu --m 1 \
    --shapes 4096x4096,14336x4096,4096x14336,28672x8192 \
    --formats int4-g128+q8,Q4_K+q8,Q6_K+q8,Q8_0+q8 --json "$OUT/kernels.json"
else
  step decode 470 python -m dsq.bench.decode_gpu --variants '' --transformers '' \
    --formats awq-int4,q4_k_m,fp8,gptq-int4-actorder --quant-variants compile+graph+fused \
    --prompt-tokens 512 --gen-tokens 128 --repeat 2 --profile --json "$OUT/decode.json"
fi
