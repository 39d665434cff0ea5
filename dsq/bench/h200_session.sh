#!/usr/bin/env bash
# One device call's worth of GPU work (the `device` tool runs this from the repository root on an
# H200 with no dsq install): GPU tests first, then the kernel tables, quantized decode and the
# host CPU's kernels, each with its own time limit so one overrun cannot eat the others.
# Usage (from the developer machine, through the device tool):  bash dsq/bench/h200_session.sh
# Results land in $OUT (the device tool's output folder) as JSON and text. ~9 minutes.
set -u
ln -sfn ../kernels dsq/kernels; ln -sfn ../recipes dsq/recipes
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsq-out}; mkdir -p "$OUT"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  echo "==== $name (limit ${secs}s)"
  timeout "$secs" "$@" 2>&1 | grep -v -i warn | tee "$OUT/$name.txt" | tail -45
}
(timeout 150 python setup.py build_ext --inplace > "$OUT/build_cpu.txt" 2>&1) &  # C kernels for the host's Python
step tests 150 python -m pytest -q -x tests/test_native_cuda.py tests/test_kernels_triton.py -k "cuda or real_shapes"
step kernels 200 python -m dsq.bench.kernels_gpu --m 1 --shapes 4096x4096,14336x4096,4096x14336,28672x8192 \
  --formats int4-g128+q8,Q4_K+q8,Q8_0+q8,int8-channel+q8,int4-g128,fp8-channel,fp8-block,Q6_K --json "$OUT/kernels.json"
# _gemm_q8 (int8 x, 2-16 rows) against the tl.dot GEMM: decides whether small batches take it
step kernels_m 150 python -m dsq.bench.kernels_gpu --m 4,16 --shapes 4096x4096,28672x8192 \
  --formats int4-g128+q8,int4-g128,Q4_K+q8,Q4_K,Q8_0+q8 --json "$OUT/kernels_m.json"
step decode 200 python -m dsq.bench.decode_gpu --variants compile+graph+fused --transformers '' \
  --formats awq-int4,q4_k_m,fp8,gptq-int4-actorder --quant-variants compile+graph+fused \
  --prompt-tokens 512 --gen-tokens 128 --repeat 2 --json "$OUT/decode.json"
wait
step cpu 60 python -m dsq.bench.kernels_cpu --threads 16 --shapes 14336x4096 --batch 1 \
  --formats "Q4_K,Q6_K,Q8_0,int4 g128" --json "$OUT/cpu16.json"
