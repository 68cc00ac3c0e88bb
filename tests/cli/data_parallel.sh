#!/usr/bin/env bash
# Data-parallel settings through the real binary on one rank: the global-batch check against
# the launched world size, offload without ZeRO refused, ZeRO stage 3 on one rank (which still
# gathers every unit into its slots and reduces its gradients, as copies) giving bitwise the
# losses of stage 0, and `info`'s per-rank ZeRO memory table with its offload rows.
# (The ZeRO stages across ranks are compared under mpirun, tests/mpi/dp_train.sh.)
# Usage: data_parallel.sh MOE_TRAIN_BINARY SOURCE_DIR
set -u
bin=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL $*"; exit 1; }
export OMP_NUM_THREADS=1
small=(--config "$src/configs/tiny.json" --device cpu --set train.max_steps=3
  --set train.log_interval=1 --set train.eval_batches=1 --set train_micro_batch_size_per_gpu=2
  --set data.seq_len=16 --set train.save_at_end=false)

# 32 = 2 * 1 * 16 passes the config check (a multiple), but this run has 1 rank.
out=$("$bin" train "${small[@]}" --set train_batch_size=32 --set "train.out_dir=\"$tmp/a\"" 2>&1)
[ $? -eq 2 ] || fail "train_batch_size mismatch: expected exit 2: $out"
grep -qF "train_batch_size" <<<"$out" && grep -qF "* 1 = 2, got 32" <<<"$out" ||
  fail "train_batch_size message: $out"

for stage in 0 3; do
  "$bin" train "${small[@]}" --set zero_optimization.stage=$stage --set train.save_at_end=true \
    --set "train.out_dir=\"$tmp/z$stage\"" >"$tmp/z$stage.log" 2>&1 ||
    fail "stage $stage exited $?: $(cat "$tmp/z$stage.log")"
done
losses() { grep -o '"loss":[^,]*' "$1/metrics.jsonl"; }
[ -n "$(losses "$tmp/z0")" ] && [ "$(losses "$tmp/z0")" = "$(losses "$tmp/z3")" ] ||
  fail "stage 3 losses differ from stage 0: $(losses "$tmp/z0") / $(losses "$tmp/z3")"
cmp "$tmp/z0/step_00000003/model.safetensors" "$tmp/z3/step_00000003/model.safetensors" ||
  fail "stage 3 saved other weights than stage 0"

out=$("$bin" info --config "$src/configs/tiny.json" --world 4) || fail "info exited $?"
for word in "per rank with 4 data-parallel rank(s)" "ZeRO" "2+offload" "3+offload"; do
  grep -qF -- "$word" <<<"$out" || fail "info lacks '$word': $out"
done
# stage 1 divides the optimizer state by the world size: 2.5 MiB -> 0.6 MiB for tiny.json
grep -Eq "^  1 +[0-9.]+ +[0-9.]+ +0\.6 " <<<"$out" || fail "stage-1 optimizer column: $out"
# offload: no optimizer state on the GPU; on the CPU 16 bytes per parameter / 4 ranks (master,
# m, v, gradient staging): 5.0 MiB / 4 = 1.2 MiB for tiny.json
grep -Eq "^  2\+offload +[0-9.]+ +[0-9.]+ +0\.0 +0\.0 +[0-9.]+ +[0-9.]+ +1\.2 " <<<"$out" ||
  fail "offload row: $out"
# stage 3: the fp32 weights, gradients and moments of one chunk per unit (tiny.json: 1.2, 1.2 and
# 2.5 MiB over 4 ranks), plus the slots the units in use are gathered into
grep -Eq "^  3 +0\.3 +0\.3 +0\.6 +[0-9.]+ " <<<"$out" || fail "stage-3 row: $out"

out=$("$bin" info --config "$src/configs/tiny.json" --world 2 --set zero_optimization.stage=1 \
  --set 'zero_optimization.offload_optimizer.device="cpu"') || fail "info (offload) exited $?"
grep -Eq '^\* 2\+offload ' <<<"$out" || fail "info does not mark the offload row: $out"

# Offload needs a ZeRO stage that partitions the optimizer state (DeepSpeed's rule).
out=$("$bin" train "${small[@]}" --set 'zero_optimization.offload_optimizer.device="cpu"' 2>&1)
[ $? -eq 2 ] || fail "offload at stage 0: expected exit 2: $out"
grep -qF "zero_optimization.offload_optimizer.device" <<<"$out" ||
  fail "offload at stage 0 message: $out"
out=$("$bin" info --config "$src/configs/tiny.json" --world 2 --set zero_optimization.stage=3 \
  --set 'zero_optimization.offload_optimizer.device="cpu"') || fail "info (stage 3) exited $?"
grep -Eq '^\* 3\+offload ' <<<"$out" || fail "info does not mark the stage-3 offload row: $out"
# with offload_param nothing but the gathered slots stays on the GPU
out=$("$bin" info --config "$src/configs/tiny.json" --world 2 --set zero_optimization.stage=3 \
  --set 'zero_optimization.offload_optimizer.device="cpu"' \
  --set 'zero_optimization.offload_param.device="cpu"') || fail "info (offload_param) exited $?"
grep -Eq '^\* 3\+param +0\.0 +0\.0 +0\.0 +[0-9.]+ ' <<<"$out" ||
  fail "info's offload_param row: $out"
echo "ok: data-parallel settings on one rank"
