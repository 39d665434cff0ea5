#!/usr/bin/env bash
# A kernels change timed on one warm device machine: all-GPU decode with this tree's kernels/ and with
# another commit's, alternating, the same GGUF, the same call (docs/benchmarks.md#gpu-decode). Made on
# the dev machine, carried with the rest:
#
#   mkdir -p .base && git archive REV kernels | tar x -C .base     # .base/ is git-ignored locally
#   bash benchmarks/kernels_ab.sh /tmp/q7b.gguf [ROUNDS]           # on the device, after setup_python
#
# Each side swaps the dsq/kernels link device_plan.sh's setup makes (the C kernels are this tree's
# build, copied beside the other side's Python), runs `dsq bench -b native -g all` and prints its
# decode tok/s; the link is restored at the end
# (or removed, where an installed dsq found kernels/ without it). Writes $OUT/kernels_ab.json (every run) when OUT is set.
set -uo pipefail
G=${1:?usage: kernels_ab.sh GGUF [ROUNDS]}
ROUNDS=${2:-2}
BASE=${BASE:-.base/kernels}
TH=${THREADS:-$(lscpu -p=CORE | grep -v '^#' | sort -u | wc -l)}
[ -d "$BASE" ] || { echo "no $BASE: carry .base (git archive REV kernels | tar x -C .base)"; exit 1; }
cp kernels/_cpu_*.so "$BASE"/ 2>/dev/null
link() { rm -f dsq/kernels; ln -s "$1" dsq/kernels; }
if [ -L dsq/kernels ]; then trap 'link ../kernels' EXIT; else trap 'rm -f dsq/kernels' EXIT; fi
runs=()
for r in $(seq "$ROUNDS"); do
  for side in new base; do
    if [ "$side" = new ]; then link ../kernels; else link "../$BASE"; fi
    out=/tmp/ab_${side}_$r.json
    timeout "${AB_LIMIT:-90}" python3 -m dsq bench "$G" -b native -g all --prompt-tokens 64 --max-tokens 128 --repeat 3 \
      --threads "$TH" --out "$out" --force > "/tmp/ab_${side}_$r.txt" 2>&1
    tps=$(python3 -c "import json,sys; d=json.load(open('$out')); print(d['summary'][0]['decode_tok_s_median'])" 2>/dev/null)
    echo "round $r $side: decode ${tps:-failed} tok/s"
    runs+=("{\"round\": $r, \"side\": \"$side\", \"decode_tok_s\": ${tps:-null}}")
  done
done
if [ -n "${OUT:-}" ]; then
  (IFS=,; echo "[${runs[*]}]") > "$OUT/kernels_ab.json"
fi
