#!/usr/bin/env bash
# GPU + CPU split runs on the H200 machine, through the device tool, from the repo root.
#
#   bash benchmarks/h200_split.sh build    # llama.cpp's llama-bench (CUDA) from the vendored sources in
#                                          # .llsrc/llama-src.tar.gz; binaries back under $OUT as
#                                          # llbin.tar.xz.* parts (carry them as .llbin/ next time)
#   bash benchmarks/h200_split.sh sweep    # random 8B Q4_K_M GGUF; llama-bench and dsq at each split
#   bash benchmarks/h200_split.sh tests    # the CUDA tests of the native runtime
#   bash benchmarks/h200_split.sh offload  # dsq offload --calibrate, then --measure at each split
#   bash benchmarks/h200_split.sh bench    # dsq bench, both engines at each split with their ratio and plot
#   bash benchmarks/h200_split.sh race     # the whole race in one call: the CPU's bandwidth (dsq offload
#                                          # --calibrate), llama-bench, dsq bench with both engines (head on
#                                          # the GPU), then dsq at llama.cpp's placement (--head cpu); every
#                                          # table printed to the log (a call returns at most 8 files)
#   bash benchmarks/h200_split.sh ram      # the race at llama.cpp's placement (--head cpu), both shapes in one
#                                          # call: calibrate, then per shape llama-bench, llama.cpp's VRAM
#                                          # (dsq bench -b llama.cpp) and dsq bench --head cpu; summaries printed
#   bash benchmarks/h200_split.sh probe    # the CPU read probes side by side (benchmarks/cpu_read_probe.py)
#   bash benchmarks/h200_split.sh convert  # GGUF -> GPU layout, torch ops against one Triton launch a chunk
#                                          # (benchmarks/gguf_convert.py), the streamed-prefill CUDA tests with
#                                          # DSQ_TRITON_GGUF=1, and prefill at 24 / 16 layers with it off and on
#   bash benchmarks/h200_split.sh vram     # where each split's VRAM goes (benchmarks/vram_parts.py), with torch's
#                                          # expandable segments (dsq's default) and with fixed ones
#   bash benchmarks/h200_split.sh ab       # the 8B at llama.cpp's placement, dsq and llama-bench in turn, round
#                                          # after round, the ratio per round and dsq's VRAM (benchmarks/split_ab.py).
#                                          # ~5 min. AB_HEAD=cpu,0.2,0.3,0.5: dsq's --head per split;
#                                          # LLAMA_VRAM=1: then llama.cpp's peak VRAM at the same splits
#   bash benchmarks/h200_split.sh knobs    # the CPU kernels' constants (prefetch distance, pool claims, expert
#                                          # units) as builds side by side, round after round, on an 8B layer's
#                                          # GEMVs and a V2-Lite expert call beside the pool's read
#                                          # (benchmarks/cpu_knobs.py). ~4 min
#   bash benchmarks/h200_split.sh fused    # one C call per CPU layer against op by op: one 8B layer and a
#                                          # synthetic 32-layer step, then the GGUF's decode step at each split
#
# The machine has no dsq install: the C kernels are built in place and dsq.kernels is linked to
# kernels/. Wheels the image lacks (gguf, diskcache) travel in .whl/.
set -uo pipefail
PART=${1:?build or sweep}
OUT=${OUT:-/tmp/dsq-out}; mkdir -p "$OUT"
SPLITS=${SPLITS:-0,8,16,24,99}

source benchmarks/h200_setup.sh  # setup_python, llama_bins

setup_python
if [ "$PART" = build ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node|L3"
  t=$(date +%s); llama_bins || exit 1; echo "llama.cpp built in $(( $(date +%s) - t )) s"
  ls -la "$LL/build/bin"
  (cd "$LL/build/bin" && strip --strip-unneeded ./*.so* llama-bench 2>/dev/null;
   tar c ./*.so* llama-bench | xz -6 -T0 | split -b 15M - "$OUT/llbin.tar.xz.")
  ls -la "$OUT"
  exit 0
fi

llama_bins || exit 1
if [ "$PART" = fused ]; then  # (llama.cpp: the GGUF tokenizer)
  GGUF=${GGUF:-/tmp/r8b.gguf}
  THREADS=${THREADS:-$(lscpu -p=CORE | grep -v '^#' | sort -u | wc -l)}
  timeout 240 python3 -m benchmarks.layer_decode --shape "${SHAPE:-llama3-8b}" --layers 32 --threads "$THREADS" \
    --json "$OUT/fused_layer_synthetic.json" 2>&1 | grep -v -i warn | tail -6
  [ -f "$GGUF" ] || python3 -m dsq.bench.random_gguf "$GGUF" --shape "${SHAPE:-llama3-8b}" --mix Q4_K_M | tail -1
  for g in ${FUSED_SPLITS:-0 8 24}; do
    timeout 150 python3 -m benchmarks.layer_decode --gguf "$GGUF" --gpu-layers "$g" --threads "$THREADS" \
      --json "$OUT/fused_layer_g$g.json" 2>&1 | grep -v -i warn | tail -4
  done
  exit 0
fi
if [ "$PART" = tests ]; then
  timeout 300 python3 -m pytest -q --timeout 150 --tb=short -rfE -p no:cacheprovider tests/test_native_cuda.py tests/test_elementwise_triton.py tests/test_attn_triton.py ${TESTS:+-k "$TESTS"} 2>&1 | tail -15
  exit 0
fi
if [ "$PART" = probe ]; then
  timeout 200 python3 -m benchmarks.cpu_read_probe --threads "${PROBE_THREADS:-8,16}" 2>&1 | grep -v -i warn
  exit 0
fi
if [ "$PART" = ab ]; then  # docs/benchmarks.md#does-a-split-beat-llamacpp-and-at-what-vram: the engines in turn
  llama_bins || exit 1
  TH=${THREADS:-$(lscpu -p=CORE | grep -v '^#' | sort -u | wc -l)}
  [ -f /tmp/r8b.gguf ] || python3 -m dsq.bench.random_gguf /tmp/r8b.gguf --shape llama3-8b --mix Q4_K_M | tail -1
  timeout 60 python3 -m dsq offload --calibrate --threads "$TH" --json > "$OUT/calibration_ab.json" 2>/dev/null
  timeout 500 python3 -m benchmarks.split_ab /tmp/r8b.gguf --llama-bench "$LL/build/bin/llama-bench" \
    --splits "${AB_SPLITS:-0,8,16,24}" --head "${AB_HEAD:-cpu}" --rounds "${ROUNDS:-4}" --threads "$TH" \
    --json "$OUT/split_ab.json" 2>&1 | grep -v -i warn
  [ "${LLAMA_VRAM:-0}" = 1 ] || exit 0  # llama.cpp's peak VRAM at the same splits (its Python binding, dsq's measure)
  timeout 150 python3 -m dsq bench /tmp/r8b.gguf -b llama.cpp -g "${AB_SPLITS:-0,8,16,24}" --prompt-tokens 64 \
    --gen-tokens 8 --repeat 1 --threads "$TH" --json "$OUT/llama_vram.json" --force >/dev/null 2>&1
  python3 -c "import json; [print('llama.cpp -g', r['gpu_layers'], 'peak VRAM MiB', r['peak_vram_mb']) for r in json.load(open('$OUT/llama_vram.json'))['summary']]"
  exit 0
fi
if [ "$PART" = knobs ]; then  # docs/benchmarks.md#cpu-kernels
  timeout 400 python3 -m benchmarks.cpu_knobs --threads "${KNOB_THREADS:-8,16}" --rounds "${ROUNDS:-4}" \
    --json "$OUT/cpu_knobs.json" 2>&1 | grep -v -i warn
  exit 0
fi
if [ "$PART" = convert ]; then  # docs/benchmarks.md#does-a-split-beat-llamacpp-and-at-what-vram
  TH=${THREADS:-$(lscpu -p=CORE | grep -v '^#' | sort -u | wc -l)}
  [ -f /tmp/r8b.gguf ] || python3 -m dsq.bench.random_gguf /tmp/r8b.gguf --shape llama3-8b --mix Q4_K_M | tail -1
  timeout 120 python3 -m benchmarks.gguf_convert /tmp/r8b.gguf 2>&1 | grep -v -i warn
  DSQ_TRITON_GGUF=1 timeout 300 python3 -m pytest -q --timeout 280 --tb=short -rfE -p no:cacheprovider \
    tests/test_native_cuda.py -k "streamed or head_in_ram" 2>&1 | tail -6
  for v in 0 1; do
    DSQ_TRITON_GGUF=$v timeout 150 python3 -m dsq bench /tmp/r8b.gguf -b native -g 24,16 --head cpu --prompt-tokens 64 \
      --gen-tokens 8 --repeat 2 --threads "$TH" --json "$OUT/convert_$v.json" >/dev/null 2>&1
    python3 -c "import json,sys; [print('DSQ_TRITON_GGUF=$v', r['gpu_layers'], 'prefill', r['prefill_tok_s_median'], 'VRAM', r['peak_vram_mb']) for r in json.load(open(sys.argv[1]))['summary']]" "$OUT/convert_$v.json"
  done
  exit 0
fi
if [ "$PART" = ram ]; then  # docs/benchmarks.md#does-a-split-beat-llamacpp-and-at-what-vram
  TH=${THREADS:-$(lscpu -p=CORE | grep -v '^#' | sort -u | wc -l)}
  python3 -m dsq.bench.random_gguf /tmp/r8b.gguf --shape llama3-8b --mix Q4_K_M | tail -1
  python3 -m dsq.bench.random_gguf /tmp/q7b.gguf --shape qwen2-7b --mix Q4_K_M | tail -1
  timeout 60 python3 -m dsq offload --calibrate --threads "$TH" --json > "$OUT/calibration_ram.json" 2>/dev/null
  grep -E '"(cpu_read_bw|cpu_peak_read_bw|gpu_copy_bw|h2d_bw)"' "$OUT/calibration_ram.json"
  for run in "r8b 0,8,16,24" "q7b 0,7,14,21"; do
    set -- $run; G=/tmp/$1.gguf
    echo "== $1: llama-bench, $TH threads"
    timeout 150 "$LL/build/bin/llama-bench" -m "$G" -ngl "$2,99" -fa 1 -p 64 -n 32 -r 2 -t "$TH" -o md 2>&1 | grep -E "^\|"
    timeout 130 python3 -m dsq bench "$G" -b llama.cpp -g "$2,all" --prompt-tokens 64 --gen-tokens 32 --repeat 2 \
      --threads "$TH" --json "$OUT/ram_$1_llamacpp.json" >/dev/null 2>&1
    timeout 150 python3 -m dsq bench "$G" -b native -g "$2" --head cpu --prompt-tokens 64 --gen-tokens 32 --repeat 2 \
      --threads "$TH" --json "$OUT/ram_$1_native.json" >/dev/null 2>&1
    python3 - "$OUT/ram_$1_llamacpp.json" "$OUT/ram_$1_native.json" <<'PY'
import json, sys
for f in sys.argv[1:]:
    for r in json.load(open(f))["summary"]:
        print(r["backend"], r["gpu_layers"], "head", r.get("head"), "decode", r["decode_tok_s_median"], "prefill",
              r["prefill_tok_s_median"], "VRAM", r["peak_vram_mb"], "roofline", r.get("decode_roofline_tok_s"))
PY
  done
  exit 0
fi
GGUF=${GGUF:-/tmp/r8b.gguf}
[ -f "$GGUF" ] || python3 -m dsq.bench.random_gguf "$GGUF" --shape "${SHAPE:-llama3-8b}" --mix Q4_K_M | tail -1
THREADS=${THREADS:-$(lscpu -p=CORE | grep -v '^#' | sort -u | wc -l)}
if [ "$PART" = offload ]; then  # the offload model: calibrate, then predicted beside measured (native) at each split
  python3 -m dsq offload --calibrate --threads "$THREADS" --json | tee "$OUT/calibration.json"
  timeout 420 python3 -m dsq offload "$GGUF" --measure -g "${DSQ_SPLITS:-0,8,16,24,all}" --prompt-tokens "${PROMPT:-64}" \
    --gen-tokens "${GEN:-32}" --repeat 2 --threads "$THREADS" --json > "$OUT/offload_${TAG:-split}.json" 2>/dev/null
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['bandwidths']); [print(s) for s in r['splits']]" \
    "$OUT/offload_${TAG:-split}.json"
  for b in native llama.cpp; do python3 -m dsq offload "$GGUF" -b $b 2>&1 | tail -6; done
  exit 0
fi
if [ "$PART" = bench ]; then  # both engines through dsq bench: tok/s and peak VRAM at each split
  timeout 400 python3 -m dsq bench "$GGUF" --backend "${BACKENDS:-native,llama.cpp}" -g "${DSQ_SPLITS:-0,8,16,24,all}" \
    --prompt-tokens "${PROMPT:-64}" --gen-tokens "${GEN:-32}" --repeat 2 --threads "$THREADS" ${COMPILE:+--compile} \
    --json "$OUT/bench_${TAG:-split}.json" --plot "$OUT/bench_${TAG:-split}.png" 2>&1 | grep -v -i warn | tail -25
  exit 0
fi
if [ "$PART" = race ]; then  # docs/benchmarks.md#does-a-split-beat-llamacpp-and-at-what-vram
  timeout 60 python3 -m dsq offload --calibrate --threads "$THREADS" --json > "$OUT/calibration_${TAG:-race}.json" 2>/dev/null
  grep -E '"(cpu_read_bw|cpu_peak_read_bw|gpu_copy_bw|h2d_bw)"' "$OUT/calibration_${TAG:-race}.json"
  timeout 120 "$LL/build/bin/llama-bench" -m "$GGUF" -ngl "$SPLITS" -fa 1 -p 64 -n 32 -r 2 -t "$THREADS" -o md 2>&1 |
    grep -E "^\|" | tee "$OUT/llama_bench_${TAG:-race}.md"
  timeout 200 python3 -m dsq bench "$GGUF" -b native,llama.cpp -g "${DSQ_SPLITS:-0,8,16,24,all}" --prompt-tokens 64 \
    --gen-tokens 32 --repeat 2 --threads "$THREADS" --json "$OUT/bench_${TAG:-race}.json" --plot "$OUT/bench_${TAG:-race}.png" \
    2>&1 | grep -E "│ (native|llama)"
  timeout 120 python3 -m dsq bench "$GGUF" -b native -g "${DSQ_SPLITS_CPU_HEAD:-0,8,16,24}" --head cpu --prompt-tokens 64 \
    --gen-tokens 32 --repeat 2 --threads "$THREADS" --json "$OUT/bench_${TAG:-race}_head_cpu.json" 2>&1 | grep -E "│ native"
  exit 0
fi
if [ "$PART" = vram ]; then  # VRAM by part at each split; the B run with the allocator's fixed segments
  timeout 200 python3 -m benchmarks.vram_parts "$GGUF" --gpu-layers "${DSQ_SPLITS:-0,8,24,all}" --threads "$THREADS" \
    --json "$OUT/vram_parts.json" 2>&1 | grep -v -i warn
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False timeout 200 python3 -m benchmarks.vram_parts "$GGUF" \
    --gpu-layers "${DSQ_SPLITS:-0,8,24,all}" --threads "$THREADS" --json "$OUT/vram_parts_fixed.json" 2>&1 | grep -v -i warn
  exit 0
fi
if [ "$PART" = crossover ]; then  # prefill of a split: the CPU's kernels (DSQ_STREAM_ROWS=0) or streamed weights
  for p in ${PROMPTS:-8 16 32 64 256}; do for rows in 0 1; do
    echo "prompt $p stream_from $rows: $(DSQ_STREAM_ROWS=$rows timeout 120 python3 -m dsq bench "$GGUF" -b native \
      -g "${SPLIT:-8}" --prompt-tokens "$p" --gen-tokens 2 --repeat 2 --threads "$THREADS" --json /tmp/x.json \
      >/dev/null 2>&1; python3 -c "import json; r=json.load(open('/tmp/x.json'))['summary'][0]; print(r['prefill_tok_s_median'], r['peak_vram_mb'])")"
  done; done
  exit 0
fi
[ -n "${SKIP_LLAMA:-}" ] || {
echo "== llama-bench, $THREADS threads"
timeout 300 "$LL/build/bin/llama-bench" -m $GGUF -ngl "$SPLITS" -fa 1 -p 64 -n 32 -r 2 -t "$THREADS" -o md \
  2>&1 | grep -E "^\|" | tee "$OUT/llama_bench.md"
}
echo "== dsq split profile"
timeout 300 python3 -m benchmarks.split_profile $GGUF --gpu-layers "${DSQ_SPLITS:-0,8,16,24,all}" \
  --threads "$THREADS" --json "$OUT/split_profile.json" ${PROFILE:+--profile} ${BANDWIDTH:+--bandwidth $BANDWIDTH} ${KERNELS:+--kernels} \
  2>&1 | grep -v -i warn | tail -60
