#!/usr/bin/env bash
# On a GPU machine, in one device call from a cold machine (~4-5 minutes; every step skipped
# once the deadline is near): builds moe-train for sm_90 (and the GPU test binaries named in
# TESTS, in the background), then the peer table (device_bench.sh, one peer run a config), the
# MoD step ratio (moe-small with model.mod.enabled against the table's plain run), profiles of
# moe-fine and of the MoD run, and the tests; prints one summary last. Logs under $OUT (default
# /tmp/quick). The peer script is the copy of ../shared/peers/torch_moe_peer.py in an ignored
# folder of the checkout that the device call carries.
#   TESTS="test_gpu_mod test_gpu_router_fused" scripts/device_quick.sh peers/torch_moe_peer.py
# Environment: LIMIT (seconds for the whole script, default 560: the device's 600 s a call less
# the transfers), TESTS (default none), CONFIGS (default "moe-small moe-fine moe-t4").
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/device_summary.sh
peer=${1:?usage: scripts/device_quick.sh PEER_SCRIPT}
t0=$SECONDS
limit=${LIMIT:-560}
left() { echo $((limit - (SECONDS - t0))); }
OUT=${OUT:-/tmp/quick}
mkdir -p "$OUT"
build="build-gpu-sm90"
moe=$build/moe-train
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | head -1 >"$OUT/gpu.txt"
if ! cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON \
  -DMOE_CUDA_ARCHS=90 >"$OUT/cmake.log" 2>&1 ||
  ! cmake --build "$build" -j "$(nproc)" --target moe-train >"$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log" "$OUT/cmake.log" 2>/dev/null
  exit 1
fi
echo "moe-train built in $((SECONDS - t0)) s" >"$OUT/steps.txt"
read -r -a tests <<<"${TESTS:-}"
if [ ${#tests[@]} -gt 0 ]; then
  (cmake --build "$build" -j "$(($(nproc) / 2))" --target "${tests[@]}" >"$OUT/build.tests.log" 2>&1
  echo $? >"$OUT/build.tests.rc") &
fi
# step NEEDS_S NAME COMMAND...: runs COMMAND when NEEDS_S seconds are left, else records the skip
step() {
  local need=$1 name=$2
  shift 2
  if [ "$(left)" -lt "$need" ]; then
    echo "$name: skipped ($(left) s left)" >>"$OUT/steps.txt"
    return
  fi
  "$@"
  echo "$name: rc=$? at $((SECONDS - t0)) s" >>"$OUT/steps.txt"
}
train() {  # train LOG ARGS...: moe-small or moe-fine, 20 steps
  local log=$1
  shift
  timeout 90 "$moe" train "$@" --set "train.out_dir=\"$OUT/run-$(basename "$log" .log)\"" \
    >"$OUT/$log" 2>&1
}
read -r -a configs <<<"${CONFIGS:-moe-small moe-fine moe-t4}"
step $((100 * ${#configs[@]} + 60)) "peer table" env OUT="$OUT/peer" PEER_RUNS=1 RUN_TIMEOUT=120 \
  scripts/device_bench.sh "$build" "$peer" "${configs[@]}"
step 90 "MoD run" train mod.log --config configs/moe-small.json --set model.mod.enabled=true
step 90 "moe-fine profile" train fine.profile.log --profile --config configs/moe-fine.json
step 90 "MoD profile" train mod.profile.log --profile --config configs/moe-small.json \
  --set model.mod.enabled=true
wait
for t in "${tests[@]}"; do
  if [ "$(cat "$OUT/build.tests.rc" 2>/dev/null)" != 0 ]; then
    echo "$t: not built (build.tests.log)" >>"$OUT/steps.txt"
    continue
  fi
  step 30 "$t" timeout "$(($(left) - 20))" "$build/tests/$t" --reporter compact \
    -o "$OUT/$t.log"
done
{
  echo "== $(cat "$OUT/gpu.txt"), git $(git rev-parse --short HEAD 2>/dev/null) (may be stale)," \
    "sources $(source_id)"
  cat "$OUT/steps.txt"
  echo "== peer table"
  cat "$OUT/peer/bench.txt" 2>/dev/null
  mod_ratio_line "$OUT/peer/ours.moe-small.log" "$OUT/mod.log"
  for p in fine mod; do
    echo "== $p profile (ms per step)"
    profile_table "$OUT/$p.profile.log" 14
  done
} | tee "$OUT/summary.txt"
