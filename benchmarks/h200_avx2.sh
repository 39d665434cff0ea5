#!/usr/bin/env bash
# Native against llama.cpp, both built for AVX2 without AVX-512, on the H200 machine's idle CPU
# (the dev machine is shared and never idle: docs/benchmarks.md#cpu-decode, the AVX2 table). Runs
# benchmarks.cpu_ab on a random Qwen2-1.5B Q4_K_M and on the built-in model, at 2 threads (the dev
# machine's count) and at the default. From the repo root, through the device tool, carrying
#   .whl/    the wheels the image lacks (as benchmarks/h200_split.sh)
#   .llsrc/  llama-cpp-python's sources (its Python bindings; as benchmarks/h200_split.sh)
#   .llavx2/ llama.cpp's AVX2 libraries: mkdir -p .llavx2 && cp -a "$(.ci/llama_avx2.sh)"/*.so* .llavx2/
#
#   bash benchmarks/h200_avx2.sh            # ~6 minutes
set -uo pipefail
OUT=${OUT:-/tmp/dsq-out}; mkdir -p "$OUT"
source benchmarks/h200_setup.sh
setup_python
export LLAMA_CPP_LIB_PATH=$ROOT/.llavx2 DSQ_CPU_ISA=avx2
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core" ; uptime
GGUF=/tmp/q15.gguf
[ -f "$GGUF" ] || python3 -m dsq.bench.random_gguf "$GGUF" --shape qwen2-1.5b --mix Q4_K_M | tail -1
for t in 2 ""; do
  timeout 240 python3 -m benchmarks.cpu_ab "$GGUF" --variants native,native:DSQ_INT8_PREFILL=0,llama.cpp \
    --rounds 4 ${t:+--threads $t} --json "$OUT/ab-qwen2-1.5b-avx2${t:+-t$t}.json" 2>&1 | grep -E "^(round|\||/|CPU)"
done
timeout 120 python3 -m benchmarks.cpu_ab --variants native,llama.cpp --rounds 4 --threads 2 \
  --json "$OUT/ab-builtin-avx2-t2.json" 2>&1 | grep -E "^(round|\||built|CPU)"
uptime
