#!/usr/bin/env bash
# The next GPU session's runs, in two device calls (each must finish inside the device tool's
# 600 s limit; the machine has no dsq install): part 1, GPU tests and the kernel tables; part 2,
# quantized decode end to end and the host CPU's kernels. Each step has its own time limit so one
# overrun cannot eat the others.
# Usage (from the developer machine, through the device tool):
#   bash dsq/bench/h200_session.sh 1     # <= 500 s
#   bash dsq/bench/h200_session.sh 2     # <= 400 s
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
  step tests 150 python -m pytest -q -x tests/test_native_cuda.py tests/test_kernels_triton.py -k "cuda or real_shapes"
  step kernels 200 python -m dsq.bench.kernels_gpu --m 1 --shapes 4096x4096,14336x4096,4096x14336,28672x8192 \
    --formats int4-g128+q8,Q4_K+q8,Q8_0+q8,int8-channel+q8,int4-g128,fp8-channel,fp8-block,Q6_K --json "$OUT/kernels.json"
  # _gemm_q8 (int8 x, 2-16 rows) against the tl.dot GEMM: decides whether small batches take it
  step kernels_m 150 python -m dsq.bench.kernels_gpu --m 4,16 --shapes 4096x4096,28672x8192 \
    --formats int4-g128+q8,int4-g128,Q4_K+q8,Q4_K,Q8_0+q8 --json "$OUT/kernels_m.json"
else
  (timeout 150 python setup.py build_ext --inplace > "$OUT/build_cpu.txt" 2>&1) &  # C kernels for the host's Python
  # compiled decode not yet measured validly: FP8, GPTQ act-order, and AWQ with float x (+fx)
  step decode 220 python -m dsq.bench.decode_gpu --variants '' --transformers '' \
    --formats awq-int4,fp8,gptq-int4-actorder --quant-variants compile+graph+fused \
    --prompt-tokens 512 --gen-tokens 128 --repeat 2 --json "$OUT/decode.json"
  step decode_fx 110 python -m dsq.bench.decode_gpu --variants '' --transformers '' \
    --formats awq-int4 --quant-variants compile+graph+fused+fx \
    --prompt-tokens 512 --gen-tokens 128 --repeat 2 --json "$OUT/decode_fx.json"
  wait
  step cpu 60 python -m dsq.bench.kernels_cpu --threads 16 --shapes 14336x4096 --batch 1 \
    --formats "Q4_K,Q6_K,Q8_0,int4 g128" --json "$OUT/cpu16.json"
fi
