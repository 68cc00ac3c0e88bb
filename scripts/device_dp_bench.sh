#!/usr/bin/env bash
# On a machine with several GPUs (or CPU ranks, for trying the script): trains one config on 1
# rank and on N ranks for each ZeRO stage (and stage 2 with overlapped buckets, stages 1 and 3
# with optimizer offload, stage 2 with offload and overlap_comm with the CPU AdamW during the
# backward and after it) and prints tokens/s, the scaling over 1 rank, and rank 0's peak memory.
#   scripts/device_dp_bench.sh BUILD_DIR [config] [ranks]      (default moe-small, 2)
# ONLY="label ..." runs those rows alone (the 1-rank stage0 row always runs: it is the base).
# Each run: `scripts/launch.sh -n W -- BUILD_DIR/moe-train train --config configs/<config>.json`
# with the micro-batch per rank unchanged (the global batch grows with W), 20 steps, tokens/s of
# the last log interval. Logs go to $OUT (default /tmp/dp_bench).
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1 config=${2:-moe-small} ranks=${3:-2}
OUT=${OUT:-/tmp/dp_bench}
mkdir -p "$OUT"
rows=()
base=""
run() {  # label world extra --set args...
  local label=$1 world=$2
  shift 2
  if [ -n "${ONLY:-}" ] && [ "$world" != 1 ] && ! [[ " $ONLY " == *" $label "* ]]; then return; fi
  local log="$OUT/$label.w$world.log"
  timeout "${RUN_TIMEOUT:-300}" scripts/launch.sh -n "$world" -- "$build/moe-train" train \
    --config "configs/$config.json" --set train.out_dir=\"$OUT/run-$label-$world\" "$@" >"$log" 2>&1
  local rc=$?
  local tps mem
  tps=$(grep -o 'tok/s [0-9]*' "$log" | tail -1 | awk '{print $2}')
  mem=$(grep -o 'gpu [0-9]* MiB' "$log" | tail -1 | awk '{print $2}')
  [ "$world" = 1 ] && [ "$label" = stage0 ] && base=$tps
  local scale="-"
  [ -n "$base" ] && [ -n "$tps" ] && scale=$(awk -v a="$tps" -v b="$base" 'BEGIN {printf "%.2fx", a / b}')
  rows+=("$(printf '%-16s ranks %d rc=%d %10s tok/s  scaling %6s  rank-0 peak %8s MiB' "$label" \
    "$world" "$rc" "${tps:-?}" "$scale" "${mem:-n/a}")")
}
run stage0 1
for s in 0 1 2 3; do run "stage$s" "$ranks" --set zero_optimization.stage=$s; done
run stage2-overlap "$ranks" --set zero_optimization.stage=2 --set zero_optimization.overlap_comm=true
for s in 1 3; do
  run "stage$s-offload" "$ranks" --set zero_optimization.stage=$s \
    --set zero_optimization.offload_optimizer.device=\"cpu\" \
    --set zero_optimization.offload_optimizer.pin_memory=true
done
# (buckets of 5e7 elements: the default 5e8 would land most of moe-small's gradient at the end)
ovoff=(--set zero_optimization.stage=2 --set zero_optimization.overlap_comm=true
  --set zero_optimization.reduce_bucket_size=5e7 --set 'zero_optimization.offload_optimizer.device="cpu"'
  --set zero_optimization.offload_optimizer.pin_memory=true)
run stage2-ovoff "$ranks" "${ovoff[@]}" --set zero_optimization.offload_optimizer.overlap_backward=true
run stage2-ovoff-after "$ranks" "${ovoff[@]}"
printf '%s\n' "${rows[@]}" | tee "$OUT/dp_bench.txt"
