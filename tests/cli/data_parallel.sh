#!/usr/bin/env bash
# Data-parallel settings through the real binary on one rank: the global-batch check against
# the launched world size, ZeRO stage 3 refused, ZeRO 1/2 on one rank train like stage 0, and
# `info`'s per-rank ZeRO memory table. Usage: data_parallel.sh MOE_TRAIN_BINARY SOURCE_DIR
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

out=$("$bin" train "${small[@]}" --set zero_optimization.stage=3 2>&1)
[ $? -eq 2 ] || fail "stage 3: expected exit 2: $out"
grep -qF "ZeRO stage 3" <<<"$out" || fail "stage 3 message: $out"

# One rank: every ZeRO stage is the same computation, bit for bit.
for stage in 0 1 2; do
  "$bin" train "${small[@]}" --set train_batch_size=2 --set zero_optimization.stage=$stage \
    --set "train.out_dir=\"$tmp/z$stage\"" >"$tmp/z$stage.log" 2>&1 ||
    fail "stage $stage exited $?: $(cat "$tmp/z$stage.log")"
  jq -r 'select(.kind == "train") | .loss' "$tmp/z$stage/metrics.jsonl" >"$tmp/z$stage.losses"
done
[ "$(wc -l <"$tmp/z0.losses")" = 3 ] || fail "expected 3 logged steps"
cmp -s "$tmp/z0.losses" "$tmp/z1.losses" && cmp -s "$tmp/z0.losses" "$tmp/z2.losses" ||
  fail "ZeRO stages differ on one rank"

out=$("$bin" info --config "$src/configs/tiny.json" --world 4) || fail "info exited $?"
for word in "per rank with 4 data-parallel rank(s)" "ZeRO" "2+offload" "not available yet"; do
  grep -qF -- "$word" <<<"$out" || fail "info lacks '$word': $out"
done
# stage 1 divides the optimizer state by the world size: 2.5 MiB -> 0.6 MiB for tiny.json
grep -Eq "^  1 +[0-9.]+ +[0-9.]+ +0\.6 " <<<"$out" || fail "stage-1 optimizer column: $out"
echo "ok: data-parallel settings on one rank"
