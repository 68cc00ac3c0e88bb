#!/usr/bin/env bash
# On the H200: trains moe-small, moe-fine and moe-t4 with moe-train and runs the PyTorch peer
# (grouped+compile, the best of ../shared/peers/torch_moe_peer.py) beside it, then prints one
# table: tokens/s and peak GPU memory (GiB) of both. Usage:
#   scripts/device_bench.sh BUILD_DIR PEER_SCRIPT [configs...]
# Logs go to $OUT (default /tmp/bench). The peer measures steady-state steps after warm-up; ours
# is the tokens/s of the last log interval (steps 11-20 of 20: warm-up excluded). The peer runs
# PEER_RUNS times (default 2) and its best run is the table's.
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1 peer=$2
shift 2
configs=("${@:-moe-small moe-fine moe-t4}")
read -r -a configs <<<"${configs[*]}"
OUT=${OUT:-/tmp/bench}
mkdir -p "$OUT"
rows=()
for c in "${configs[@]}"; do
  log="$OUT/ours.$c.log"
  timeout "${RUN_TIMEOUT:-300}" "$build/moe-train" train --config "configs/$c.json" --set train.out_dir=\"$OUT/run-$c\" >"$log" 2>&1
  rc=$?
  # tokens/s of the last log interval; peak bytes held by our allocations (as PyTorch's
  # max_memory_allocated: the CUDA context is not counted by either)
  ours=$(grep -o 'tok/s [0-9]*' "$log" | tail -1 | awk '{print $2}')
  peak=$(grep -o 'gpu [0-9]* MiB' "$log" | tail -1 | awk '{print $2}')
  # The peer moves between runs (moe-t4 by up to 31% between two calls): it runs PEER_RUNS times
  # (default 2) and the table takes its best run (the ratio against the fastest peer).
  ptps="" pmem="" runs=()
  for run in $(seq 1 "${PEER_RUNS:-2}"); do
    plog="$OUT/peer.$c.$run.log"
    timeout "${RUN_TIMEOUT:-300}" python3 "$peer" --configs "$c" --impls grouped+compile >"$plog" 2>&1
    t=$(grep -o '"tokens_per_s": [0-9]*' "$plog" | tail -1 | awk '{print $2}')
    runs+=("${t:-?}")
    if [ -n "$t" ] && { [ -z "$ptps" ] || [ "$t" -gt "$ptps" ]; }; then
      ptps=$t
      pmem=$(grep -o '"peak_GiB": [0-9.]*' "$plog" | tail -1 | awk '{print $2}')
    fi
  done
  rows+=("$(printf '%-10s rc=%d ours %8s tok/s %6.1f GiB | peer %8s tok/s %6s GiB (runs %s)' \
    "$c" "$rc" "${ours:-?}" "$(awk -v m="${peak:-0}" 'BEGIN {print m / 1024}')" "${ptps:-?}" \
    "${pmem:-?}" "${runs[*]}")")
done
printf '%s\n' "${rows[@]}" | tee "$OUT/bench.txt"
