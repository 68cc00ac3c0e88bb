#!/usr/bin/env bash
# The binary end to end: `info` prints counts and a memory estimate, `train` runs a few steps
# and prints the build line, the resolved config and progress lines with every field.
set -u
bin=$1
src=$2
fail() { echo "FAIL $*"; exit 1; }

out=$("$bin" info --config "$src/configs/tiny.json") || fail "info exited $?"
for word in "parameters:" "active per token:" "training FLOPs:" "optimizer state" "activations" "total"; do
  grep -qF "$word" <<<"$out" || fail "info lacks '$word': $out"
done

out=$("$bin" train --config "$src/configs/tiny.json" --set train.max_steps=4 \
  --set train.log_interval=2 --set train.eval_batches=1 --device cpu) || fail "train exited $?"
for word in "moe-train 0.1.0" "CUDA archs" "BLAS" "MPI" "resolved config" '"num_local_experts"' \
  "step      2/4" "loss" "aux" "lr" "grad_norm" "tok/s" "maxvio" "mod_kept" "eta" "eval" "done:"; do
  grep -qF -- "$word" <<<"$out" || fail "train output lacks '$word': $out"
done
echo "ok: info and a 4-step train run"
