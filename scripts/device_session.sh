#!/usr/bin/env bash
# On the H200, in one call (about 7-8 minutes from a cold machine): every GPU test in the sm_90
# and PTX-only sm_75 builds (device_gpu_tests.sh --sm75), the kernel rows of `moe-train bench`
# for moe-small, moe-fine and moe-t4, the peer table (device_bench.sh), a moe-small profile, the
# MoD step ratio (moe-small with model.mod.enabled against the table's plain run) with a profile
# of the MoD run and the MoD run with MOE_ROUTER_FUSED=0, and a moe-fine profile. Prints
# one summary last; logs under $OUT (default /tmp/session). The peer script is the one copied
# from ../shared/peers into the checkout (an ignored folder named in the device call's carry).
#   scripts/device_session.sh PEER_SCRIPT
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/device_summary.sh
peer=${1:?usage: scripts/device_session.sh PEER_SCRIPT}
OUT=${OUT:-/tmp/session}
mkdir -p "$OUT"
OUT="$OUT/tests" scripts/device_gpu_tests.sh --sm75 >/dev/null 2>&1
moe=build-gpu-sm90/moe-train
for c in moe-small moe-fine moe-t4; do
  timeout 120 "$moe" bench --config "configs/$c.json" >"$OUT/bench.$c.log" 2>&1
done
OUT="$OUT/peer" RUN_TIMEOUT=100 scripts/device_bench.sh build-gpu-sm90 "$peer" \
  moe-small moe-fine moe-t4 >/dev/null 2>&1
timeout 120 "$moe" train --profile --config configs/moe-small.json \
  --set train.out_dir=\""$OUT/profile-run"\" >"$OUT/profile.log" 2>&1
# The MoD bar: moe-small with mod {capacity 0.125, every 2} against the plain run of the table,
# with a profile of that run (where the MoD step's time goes).
timeout 120 "$moe" train --config configs/moe-small.json --set model.mod.enabled=true \
  --set train.out_dir=\""$OUT/mod-run"\" >"$OUT/mod.log" 2>&1
timeout 120 "$moe" train --profile --config configs/moe-small.json --set model.mod.enabled=true \
  --set train.out_dir=\""$OUT/mod-profile-run"\" >"$OUT/mod.profile.log" 2>&1
timeout 120 "$moe" train --profile --config configs/moe-fine.json \
  --set train.out_dir=\""$OUT/fine-profile-run"\" >"$OUT/fine.profile.log" 2>&1
# The routers as two ops each (MOE_ROUTER_FUSED=0) against the MoD run above.
MOE_ROUTER_FUSED=0 timeout 120 "$moe" train --config configs/moe-small.json \
  --set model.mod.enabled=true --set train.out_dir=\""$OUT/mod-unfused-run"\" >"$OUT/mod.unfused.log" 2>&1
{
  echo "== GPU tests (rc 0 = pass)"
  sed 's/  */ /g' "$OUT/tests/summary.txt"
  for c in moe-small moe-fine moe-t4; do
    echo "== moe-train bench, $c (the rooflines and the rows with a target)"
    grep -E "^(family|copy|dense_gemm |attention|residual_add|zero_grads|cross_entropy|adamw|permute|grouped_swiglu|.*>= )" "$OUT/bench.$c.log" | cut -c1-120
  done
  echo "== peer table"
  cat "$OUT/peer/bench.txt"
  echo "== moe-small profile (ms per step)"
  profile_table "$OUT/profile.log" 14
  mod_ratio_line "$OUT/peer/ours.moe-small.log" "$OUT/mod.log"
  echo "== MoD profile (ms per step)"
  profile_table "$OUT/mod.profile.log"
  echo "== MoD with MOE_ROUTER_FUSED=0 (the routers as two ops each):" \
    "$(last_tok "$OUT/mod.unfused.log") tok/s against $(last_tok "$OUT/mod.log")"
  echo "== moe-fine profile (ms per step)"
  profile_table "$OUT/fine.profile.log"
} | tee "$OUT/summary.txt"
