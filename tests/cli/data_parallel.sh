#!/usr/bin/env bash
# Data-parallel settings through the real binary on one rank: the global-batch check against
# the launched world size, ZeRO stage 3 and offload without ZeRO refused, and `info`'s per-rank
# ZeRO memory table with its offload row.
# (The ZeRO stages themselves are compared under mpirun, tests/mpi/dp_train.sh: on one rank
# every stage reduces to stage 0, so a comparison here could not fail.)
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

out=$("$bin" train "${small[@]}" --set zero_optimization.stage=3 2>&1)
[ $? -eq 2 ] || fail "stage 3: expected exit 2: $out"
grep -qF "ZeRO stage 3" <<<"$out" || fail "stage 3 message: $out"

out=$("$bin" info --config "$src/configs/tiny.json" --world 4) || fail "info exited $?"
for word in "per rank with 4 data-parallel rank(s)" "ZeRO" "2+offload" "not available yet"; do
  grep -qF -- "$word" <<<"$out" || fail "info lacks '$word': $out"
done
# stage 1 divides the optimizer state by the world size: 2.5 MiB -> 0.6 MiB for tiny.json
grep -Eq "^  1 +[0-9.]+ +[0-9.]+ +0\.6 " <<<"$out" || fail "stage-1 optimizer column: $out"
# offload: no optimizer state on the GPU; on the CPU 16 bytes per parameter / 4 ranks (master,
# m, v, gradient staging): 5.0 MiB / 4 = 1.2 MiB for tiny.json
grep -Eq "^  2\+offload +[0-9.]+ +[0-9.]+ +0\.0 +0\.0 +[0-9.]+ +[0-9.]+ +1\.2 " <<<"$out" ||
  fail "offload row: $out"

out=$("$bin" info --config "$src/configs/tiny.json" --world 2 --set zero_optimization.stage=1 \
  --set 'zero_optimization.offload_optimizer.device="cpu"') || fail "info (offload) exited $?"
grep -Eq '^\* 2\+offload ' <<<"$out" || fail "info does not mark the offload row: $out"

# Offload needs a ZeRO stage that partitions the optimizer state (DeepSpeed's rule).
out=$("$bin" train "${small[@]}" --set 'zero_optimization.offload_optimizer.device="cpu"' 2>&1)
[ $? -eq 2 ] || fail "offload at stage 0: expected exit 2: $out"
grep -qF "zero_optimization.offload_optimizer.device" <<<"$out" ||
  fail "offload at stage 0 message: $out"
echo "ok: data-parallel settings on one rank"
