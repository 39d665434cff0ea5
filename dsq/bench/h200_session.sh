#!/usr/bin/env bash
# A GPU session's first runs, in three device calls (each must finish inside the device tool's 600 s
# limit; the machine has no dsq install): part 1, the GPU tests and the kernel table (every
# format at M=1 on its four shapes, autotuned); part 2, compiled decode end to end for the four
# formats with a kernel-time profile; part 3, int4 at 2-64 rows through the three kernel families.
# (Machines differ by up to ~10% between calls: compare a change against its baseline inside one
# call, e.g. with DSQ_PDL=0 or DSQ_TRITON_ATTN=0.)
# Each step has its own time limit so one overrun cannot eat the others.
# Usage (from the developer machine, through the device tool):
#   bash dsq/bench/h200_session.sh 1     # <= 470 s
#   bash dsq/bench/h200_session.sh 2     # <= 480 s
#   bash dsq/bench/h200_session.sh 3     # <= 550 s
# Results land in $OUT (the device tool's output folder) as JSON and text.
set -u
PART=${1:?usage: h200_session.sh 1|2|3}
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
  # the table at M=1: every format on its four shapes, autotuned (which config won is printed)
  step kernels 220 env TRITON_PRINT_AUTOTUNING=1 python -m dsq.bench.kernels_gpu --m 1 \
    --shapes 4096x4096,14336x4096,4096x14336,28672x8192 \
    --formats int4-g128+q8,Q4_K+q8,Q5_K+q8,Q5_K,Q6_K+q8,Q8_0+q8,fp8-channel,fp8-block --json "$OUT/kernels.json"
elif [ "$PART" = 3 ]; then
  # a few rows: int4 on tensor cores (+tc, the default at 3-16 rows; 32 and 64 not yet timed against
  # tl.dot) beside int8 x (+q8, the default at 1-2) and the tl.dot GEMM (int4-g128, the default above 16)
  step kernels_m 400 python -m dsq.bench.kernels_gpu --m 2,4,16,32,64 --shapes 4096x4096,14336x4096,4096x14336,28672x8192 \
    --formats int4-g128+tc,int4-g128+q8,int4-g128 --json "$OUT/kernels_m.json"
  # Q4_K at 4-16 rows: the weight-scaling tensor-core variant (untimed) against the dispatcher's kernels
  step kernels_q4k 150 python -m dsq.bench.kernels_gpu --m 4,16 --shapes 4096x4096,14336x4096,4096x14336,28672x8192 \
    --formats Q4_K+tcs,Q4_K+q8,Q4_K,int4-g128+tcs --json "$OUT/kernels_q4k.json"
else
  step decode 470 python -m dsq.bench.decode_gpu --variants '' --transformers '' \
    --formats awq-int4,q4_k_m,fp8,gptq-int4-actorder --quant-variants compile+graph+fused \
    --prompt-tokens 512 --gen-tokens 128 --repeat 2 --profile --json "$OUT/decode.json"
fi
