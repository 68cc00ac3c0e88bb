#!/usr/bin/env bash
# On the H200: the optimizer overlapped with the next forward (train.overlap_optimizer) against
# the update in line, on the given configs: tokens/s and peak memory of each setting, plus the
# bench rows of the split AdamW alone and beside the grouped GEMMs. Builds build-gpu-sm90
# (moe-train) when missing; logs under $OUT (default /tmp/overlap).
#   scripts/device_overlap_bench.sh [configs...]     (default: moe-small moe-fine)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/overlap}
mkdir -p "$OUT"
configs=("${@:-moe-small moe-fine}")
read -r -a configs <<<"${configs[*]}"
export PATH=/usr/local/cuda/bin:$PATH
if [ ! -x build-gpu-sm90/moe-train ] || [ -n "${REBUILD:-}" ]; then
  cmake -S . -B build-gpu-sm90 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON \
    -DMOE_CUDA_ARCHS=90 >"$OUT/cmake.log" 2>&1
  cmake --build build-gpu-sm90 -j "$(nproc)" --target moe-train >"$OUT/build.log" 2>&1 ||
    { tail -30 "$OUT/build.log"; exit 1; }
fi
moe=build-gpu-sm90/moe-train
timeout 120 "$moe" bench --config configs/moe-fine.json --family adamw overlap \
  >"$OUT/bench.log" 2>&1
rows=()
for c in "${configs[@]}"; do
  for on in false true; do
    log="$OUT/$c.$on.log"
    timeout 120 "$moe" train --config "configs/$c.json" --set train.overlap_optimizer=$on \
      --set train.out_dir=\""$OUT/run"\" >"$log" 2>&1
    tps=$(grep -o 'tok/s [0-9]*' "$log" | tail -1 | awk '{print $2}')
    mib=$(grep -o 'gpu [0-9]* MiB' "$log" | tail -1 | awk '{print $2}')
    loss=$(grep -o 'loss [0-9.]*' "$log" | tail -1 | awk '{print $2}')
    rows+=("$(printf '%-10s overlap %-5s: %8s tok/s %6s MiB loss %s' "$c" "$on" \
      "${tps:-?}" "${mib:-?}" "${loss:-?}")")
  done
done
{
  echo "== bench (moe-fine shapes)"
  grep -E "^(family|copy|adamw|overlap)" "$OUT/bench.log" | cut -c1-110
  echo "== training steps"
  printf '%s\n' "${rows[@]}"
} | tee "$OUT/summary.txt"
