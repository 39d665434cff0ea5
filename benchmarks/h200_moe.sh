#!/usr/bin/env bash
# DeepSeek MoE on the H200 machine, through the device tool, from the repo root: the routed experts
# on the GPU and in RAM (--experts gpu / cpu), native against llama.cpp (-ot exps=CPU).
#
#   bash benchmarks/h200_moe.sh v2lite   # random DeepSeek-V2-Lite-shape Q4_K_M GGUF (~10 GB); llama-bench
#                                        # all on the GPU and with -ot exps=CPU, dsq bench native with
#                                        # --experts gpu and cpu, the offload plan of each: one table with
#                                        # ratios and rooflines (benchmarks/moe_table.py). ~4-5 min
#   bash benchmarks/h200_moe.sh tests    # the CUDA tests of the experts in RAM and stacked on the GPU, the
#                                        # grouped expert GEMV on the GPU (and test_deepseek's). ~2 min
#   bash benchmarks/h200_moe.sh vram     # the V2-Lite GGUF loaded all on the GPU: torch's allocated and reserved
#                                        # peaks against the device's (benchmarks/load_vram.py), then the same with
#                                        # expandable segments. ~2 min
#   bash benchmarks/h200_moe.sh profile  # all-GPU V2-Lite decode: llama-bench, dsq bench with and without --compile,
#                                        # the captured decode step's top GPU kernels (benchmarks/decode_profile.py),
#                                        # then dsq serve's paged step at 1 and 8 rows (benchmarks/serve_step.py). ~5 min
#   bash benchmarks/h200_moe.sh router   # the one-launch router (DSQ_TRITON_ROUTER): its CUDA tests, then V2-Lite
#                                        # decode with it off and on, experts on the GPU and in RAM, beside
#                                        # llama-bench, alternating in one call. ~6 min
#   bash benchmarks/h200_moe.sh ab       # V2-Lite, experts in RAM then on the GPU: dsq and llama-bench in turn,
#                                        # round after round, the ratio per round (benchmarks/split_ab.py). ~5 min
#   bash benchmarks/h200_moe.sh launches # fewer launches a step, each behind a flag: x rounded by the norm /
#                                        # activation that makes it (DSQ_PRODUCER_Q8), MLA's ropes, norm and
#                                        # cache write as one (DSQ_MLA_WRITE): their CUDA tests, then all-GPU
#                                        # V2-Lite decode without, with the first, with both, twice. ~8 min
#   bash benchmarks/h200_moe.sh v3slice  # random V3-width slice (1 dense + 1 MoE layer of 256 experts,
#                                        # ~7 GB): per-layer and per-part times with the experts in RAM
#                                        # and on the GPU, and the full 61-layer projection
#                                        # (benchmarks/moe_layers.py). ~3 min
#
# Setup as benchmarks/h200_split.sh (sourced for its functions): the C kernels built in place, the
# carried wheels (.whl/) and llama.cpp binaries (.llbin/, else built from .llsrc/). Results under $OUT.
set -uo pipefail
PART=${1:?tests, v2lite, vram, profile, router, launches, ab or v3slice}
OUT=${OUT:-/tmp/dsq-out}; mkdir -p "$OUT"
source benchmarks/h200_setup.sh  # setup_python, llama_bins
setup_python
THREADS=${THREADS:-16}
D=$OUT/moe; mkdir -p "$D"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)" | tr -s ' '

llama_bins || exit 1  # llama-bench, and the library dsq's GGUF tokenizer loads
if [ "$PART" = tests ]; then
  timeout 400 python3 -m pytest -q --timeout 150 --tb=short -rfEs -p no:cacheprovider tests/test_deepseek_experts_cpu.py tests/test_deepseek.py -k "cuda or stand_in" \
    2>&1 | tail -15
  timeout 300 python3 -m pytest -q --timeout 150 --tb=short -rfEs -p no:cacheprovider tests/test_deepseek_experts_gpu.py tests/test_kernels_triton_experts.py tests/test_elementwise_triton.py tests/test_serve_deepseek.py \
    2>&1 | tail -15
  exit 0
fi
if [ "$PART" = v2lite ]; then
  GGUF=${GGUF:-/tmp/v2lite.Q4_K_M.gguf}
  t=$(date +%s)
  [ -f "$GGUF" ] || python3 -m dsq.bench.random_gguf "$GGUF" --shape deepseek-v2-lite --mix Q4_K_M 2>/dev/null | tail -1
  echo "written in $(( $(date +%s) - t )) s"
  echo "== llama-bench, $THREADS threads: all on the GPU, then -ot exps=CPU"
  timeout 150 "$LL/build/bin/llama-bench" -m "$GGUF" -ngl 99 -p 64 -n 32 -r 2 -t "$THREADS" -o json \
    > "$D/llama_gpu.json" 2>"$D/llama_gpu.log" || tail -3 "$D/llama_gpu.log"
  timeout 150 "$LL/build/bin/llama-bench" -m "$GGUF" -ngl 99 -ot exps=CPU -p 64 -n 32 -r 2 -t "$THREADS" -o json \
    > "$D/llama_cpu.json" 2>"$D/llama_cpu.log" || tail -3 "$D/llama_cpu.log"
  for ex in gpu cpu; do
    echo "== dsq bench native, --experts $ex"
    timeout 200 python3 -m dsq bench "$GGUF" -b native -g all --experts "$ex" --prompt-tokens 64 --gen-tokens 32 \
      --repeat 2 --threads "$THREADS" --json "$D/dsq_$ex.json" --force 2>&1 | grep -v -i warn | grep -E "^\||native" | tail -4
    timeout 60 python3 -m dsq offload "$GGUF" -b native -g all --experts "$ex" --threads "$THREADS" --json \
      > "$D/plan_$ex.json" 2>/dev/null || echo "offload plan ($ex) failed"
  done
  python3 -m benchmarks.moe_table "$D"
  [ "${MOE_CPU:-1}" = 1 ] || exit 0  # MOE_CPU=0: the engines' table alone
  echo "== the experts' C call against per-expert GEMM calls, $THREADS threads"
  timeout 90 python3 -m benchmarks.moe_cpu --shape deepseek-v2-lite --rows 1,4,64 --threads "$THREADS" \
    --json "$D/moe_cpu_v2lite.json" 2>&1 | tail -5
  exit 0
fi

if [ "$PART" = vram ]; then  # where all-GPU V2-Lite's VRAM goes at load: allocated, reserved, device; fragmentation?
  GGUF=${GGUF:-/tmp/v2lite.Q4_K_M.gguf}
  [ -f "$GGUF" ] || python3 -m dsq.bench.random_gguf "$GGUF" --shape deepseek-v2-lite --mix Q4_K_M 2>/dev/null | tail -1
  timeout 200 python3 -m benchmarks.load_vram "$GGUF" --experts gpu --json "$D/vram.json" 2>&1 | grep -v -i warn
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 python3 -m benchmarks.load_vram "$GGUF" --experts gpu \
    --json "$D/vram_expandable.json" 2>&1 | grep -v -i warn
  exit 0
fi

if [ "$PART" = profile ]; then  # where all-GPU V2-Lite decode's 6.3 ms go (llama.cpp: 3.3): the captured step's
  # kernels (serve_step at 1 and 8 rows, torch profiler), and dsq bench with and without --compile beside llama-bench
  GGUF=${GGUF:-/tmp/v2lite.Q4_K_M.gguf}
  [ -f "$GGUF" ] || python3 -m dsq.bench.random_gguf "$GGUF" --shape deepseek-v2-lite --mix Q4_K_M 2>/dev/null | tail -1
  timeout 100 "$LL/build/bin/llama-bench" -m "$GGUF" -ngl 99 -p 64 -n 32 -r 2 -t "$THREADS" -o md 2>&1 | grep -E "^\|"
  for c in "" --compile; do
    timeout 240 python3 -m dsq bench "$GGUF" -b native -g all --experts gpu --prompt-tokens 64 --gen-tokens 32 \
      --repeat 2 --threads "$THREADS" $c --json "$D/dsq_gpu$c.json" --force 2>&1 | grep -v -i warn |
      tee "$D/dsq_gpu$c.log" | grep -E "^\||native|compile|fail" | tail -6
  done
  # the captured decode step's GPU kernels (dsq bench's path), then dsq serve's paged step (gathers its latent blocks)
  timeout 200 python3 -m benchmarks.decode_profile "$GGUF" --gpu-layers all --experts gpu --steps 8 --rows 28 \
    2>&1 | grep -v -i "warn\|USDT\|profiler" | cut -c1-200 | tail -40
  timeout 200 python3 -m benchmarks.serve_step "$GGUF" --rows 1,8 --ctx 64 --steps 8 --profile 1 \
    --json "$D/serve_step.json" > "$D/serve_step.log" 2>&1
  grep -v -i warn "$D/serve_step.log" | cut -c1-160 | head -60
  exit 0
fi

if [ "$PART" = router ]; then  # docs/benchmarks.md#deepseek: the router's ~6 kernels a layer as one
  GGUF=${GGUF:-/tmp/v2lite.Q4_K_M.gguf}
  [ -f "$GGUF" ] || python3 -m dsq.bench.random_gguf "$GGUF" --shape deepseek-v2-lite --mix Q4_K_M 2>/dev/null | tail -1 &
  DSQ_TRITON_ROUTER=1 timeout 240 python3 -m pytest -q --timeout 200 --tb=short -rfE -p no:cacheprovider \
    tests/test_elementwise_triton.py tests/test_deepseek_experts_gpu.py -k "gpu_models or moe_route or graph" 2>&1 | tail -6
  wait
  timeout 60 "$LL/build/bin/llama-bench" -m "$GGUF" -ngl 99 -p 64 -n 32 -r 2 -t "$THREADS" -o md 2>&1 | grep -E "tg32"
  timeout 60 "$LL/build/bin/llama-bench" -m "$GGUF" -ngl 99 -ot exps=CPU -p 64 -n 32 -r 2 -t "$THREADS" -o md 2>&1 |
    grep -E "tg32"
  for ex in gpu cpu; do for r in 0 1 0 1; do
    DSQ_TRITON_ROUTER=$r timeout 100 python3 -m dsq bench "$GGUF" -b native -g all --experts $ex --prompt-tokens 64 \
      --gen-tokens 32 --repeat 2 --threads "$THREADS" --json /tmp/r.json --force >/dev/null 2>&1
    python3 -c "import json; r=json.load(open('/tmp/r.json'))['summary'][0]; print('experts $ex router $r decode', r['decode_tok_s_median'])"
  done; done
  exit 0
fi

if [ "$PART" = ab ]; then  # docs/benchmarks.md#deepseek: dsq and llama-bench in turn, round after round
  GGUF=${GGUF:-/tmp/v2lite.Q4_K_M.gguf}
  [ -f "$GGUF" ] || python3 -m dsq.bench.random_gguf "$GGUF" --shape deepseek-v2-lite --mix Q4_K_M 2>/dev/null | tail -1
  timeout 60 python3 -m dsq offload --calibrate --threads "$THREADS" --json > "$D/calibration_ab.json" 2>/dev/null
  timeout 250 python3 -m benchmarks.split_ab "$GGUF" --llama-bench "$LL/build/bin/llama-bench" --splits all \
    --experts cpu --llama-args "-ot exps=CPU" --rounds "${ROUNDS:-5}" --threads "$THREADS" --json "$D/ab_cpu.json" \
    2>&1 | grep -v -i warn
  timeout 200 python3 -m benchmarks.split_ab "$GGUF" --llama-bench "$LL/build/bin/llama-bench" --splits all \
    --experts gpu --llama-args "" --rounds "${ROUNDS:-5}" --threads "$THREADS" --json "$D/ab_gpu.json" 2>&1 | grep -v -i warn
  exit 0
fi

if [ "$PART" = launches ]; then  # docs/benchmarks.md#deepseek: fewer launches a decode step, each behind a flag until timed
  GGUF=${GGUF:-/tmp/v2lite.Q4_K_M.gguf}
  [ -f "$GGUF" ] || python3 -m dsq.bench.random_gguf "$GGUF" --shape deepseek-v2-lite --mix Q4_K_M 2>/dev/null | tail -1 &
  DSQ_PRODUCER_Q8=1 DSQ_MLA_WRITE=1 timeout 300 python3 -m pytest -q --timeout 280 --tb=short -rfE -p no:cacheprovider \
    tests/test_elementwise_triton.py tests/test_kernels_triton.py tests/test_deepseek_experts_gpu.py \
    -k "rounds or offer or q8_gemv_reads or gguf_models_steps or gpu_models or mla_write or q8_x_quantizer or stacked_experts_graph" \
    2>&1 | tail -6
  wait
  timeout 60 "$LL/build/bin/llama-bench" -m "$GGUF" -ngl 99 -p 64 -n 32 -r 2 -t "$THREADS" -o md 2>&1 | grep -E "tg32"
  for round in 1 2; do for v in "0 0" "1 0" "1 1"; do
    set -- $v
    DSQ_PRODUCER_Q8=$1 DSQ_MLA_WRITE=$2 timeout 100 python3 -m dsq bench "$GGUF" -b native -g all --experts gpu \
      --prompt-tokens 64 --gen-tokens 32 --repeat 2 --threads "$THREADS" --json /tmp/r.json --force >/dev/null 2>&1
    python3 -c "import json; r=json.load(open('/tmp/r.json'))['summary'][0]; print('producer q8 $1 mla write $2 decode', r['decode_tok_s_median'])"
  done; done
  exit 0
fi

if [ "$PART" = v3slice ]; then
  GGUF=${GGUF:-/tmp/v3slice.Q4_K_M.gguf}
  t=$(date +%s)
  [ -f "$GGUF" ] || python3 -m dsq.bench.random_gguf "$GGUF" --shape deepseek-v3-slice --layers "${LAYERS:-2}" \
    --mix Q4_K_M 2>/dev/null | tail -1
  echo "written in $(( $(date +%s) - t )) s"
  timeout 420 python3 -m benchmarks.moe_layers "$GGUF" --experts "${EXPERTS:-cpu,gpu}" --threads "$THREADS" \
    --steps 16 --json "$D/v3slice_layers.json" 2>&1 | grep -v -i warn | tail -40
  exit 0
fi
echo "unknown part $PART (tests, v2lite, vram, profile, router, launches, ab or v3slice)"; exit 1
