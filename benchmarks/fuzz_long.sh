#!/usr/bin/env bash
# The long fuzz run of docs/fuzzing.md on a many-core machine (the device machine: 16 idle cores),
# through the device tool, from the repo root, in one call of at most 10 minutes:
#
#   bash benchmarks/fuzz_long.sh            # in-process and CLI shards side by side, ~9 minutes
#
# Each shard is `python -m dsq.fuzz` with its own seed, pinned to one core (taskset: dsq's default
# thread count is then 1), stopped by --max-time; its last line is its summary. The script prints
# every shard's summary and one total line per kind; findings come back under $OUT/found/ as
# regression files (copy them into tests/regressions/).
#
#   INPROC=9 CLI=5 PROBE=2 shards of each kind (default: 9, 5 and 2 on 16 cores; probe: GGUFs through
#                          the child-process check before llama.cpp loads them)
#   SECONDS_EACH=480       each shard's time budget (with set-up and the last inputs, under 10 minutes)
#   SEED0=100              the first seed (a second call with another SEED0 adds new inputs)
#
# The machine has no dsq install: as benchmarks/h200_split.sh, the C kernels are built in place,
# wheels come from .whl/, llama-cpp-python from .llsrc/ and its libraries from .llbin/ (carry
# .whl, .llsrc and .llbin). The GPU is hidden (CUDA_VISIBLE_DEVICES=): the fork server must not
# start CUDA, and the fuzzed paths are the CPU ones.
set -uo pipefail
OUT=${OUT:-/tmp/dsq-out}; mkdir -p "$OUT/found" "$OUT/logs"
ROOT=$PWD
LL=/tmp/ll/llama.cpp
INPROC=${INPROC:-9}
CLI=${CLI:-5}
PROBE=${PROBE:-2}
SECONDS_EACH=${SECONDS_EACH:-480}
SEED0=${SEED0:-100}
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES= DSQ_FUZZ_PRELOAD_DSQ=1

if [ "${SETUP:-1}" = 1 ]; then  # SETUP=0: a checkout where dsq and llama_cpp already import
source benchmarks/h200_setup.sh
setup_python
if [ ! -e "$LL/build/bin/libllama.so" ]; then
  mkdir -p "$LL/build/bin" && cat "$ROOT"/.llbin/llbin.tar.xz.* | xz -d | tar x -C "$LL/build/bin" ||
    { echo "no .llbin/ to unpack: carry it (bash benchmarks/h200_split.sh build makes it)"; exit 1; }
fi
fi
python3 -c "import llama_cpp, dsq.fuzz.zygote" || exit 1
nproc; lscpu | grep -E "Model name" || true

run_shard() {  # kind index core
  local kind=$1 i=$2 core=$3 seed=$((SEED0 + $2)) target=all iters=1000000
  [ "$kind" = cli ] && target=cli iters=10000
  [ "$kind" = probe ] && target=probe iters=100000
  local pin=(); command -v taskset >/dev/null && pin=(taskset -c "$((core % $(nproc)))")
  "${pin[@]}" python3 -m dsq.fuzz --target "$target" --iterations "$iters" --seed "$seed" \
    --max-time "$SECONDS_EACH" --work "/tmp/fuzz-$kind-$i" --save "$OUT/found" \
    > "$OUT/logs/$kind-$i.log" 2>&1
}

t0=$(date +%s)
core=0
for i in $(seq 1 "$INPROC"); do run_shard inproc "$i" $core & core=$((core + 1)); done
for i in $(seq 1 "$CLI"); do run_shard cli "$i" $core & core=$((core + 1)); done
for i in $(seq 1 "$PROBE"); do run_shard probe "$i" $core & core=$((core + 1)); done
wait
echo "all shards done in $(( $(date +%s) - t0 )) s"

for kind in inproc cli probe; do
  # the last summary line of each shard, then their sum
  for f in "$OUT"/logs/$kind-*.log; do grep -s "^dsq.fuzz " "$f" | tail -n 1; done > "$OUT/$kind.lines"
  cat "$OUT/$kind.lines"
  python3 - "$kind" "$OUT/$kind.lines" <<'PY'
import re, sys
kind, path = sys.argv[1:]
tot, slowest, longest = dict.fromkeys(("inputs", "clean", "refused", "crashes", "hangs", "internal_errors"), 0), 0.0, 0
for line in open(path):
    for k, v in re.findall(r"(inputs|clean|crashes|hangs|internal_errors)=(\d+)", line):
        tot[k] += int(v)
    tot["refused"] += int(re.search(r"\(refused (\d+)\)", line).group(1))
    slowest = max(slowest, float(re.search(r"slowest=([\d.]+)s", line).group(1)))
    longest = max(longest, int(re.search(r"time=(\d+)s", line).group(1)))
print(f"TOTAL {kind}: inputs={tot['inputs']} clean={tot['clean']} (refused {tot['refused']}) crashes={tot['crashes']} "
      f"hangs={tot['hangs']} internal_errors={tot['internal_errors']} slowest={slowest:.2f}s within {longest}s")
PY
done
ls "$OUT/found" | head -50
