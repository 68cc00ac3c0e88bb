#!/usr/bin/env bash
# On a machine with transformers (the H200 test machine): build the CPU trainer, train a small
# Mixtral-compatible model (every layer MoE, no shared experts, no MoD), export it, and compare
# the logits transformers' MixtralForCausalLM computes with ours (scripts/check_hf_export.py).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hf_check}
mkdir -p "$OUT"
cmake -S . -B build-hf -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=OFF -DMOE_BUILD_TESTS=OFF >"$OUT/cmake.log"
cmake --build build-hf -j "$(nproc)" >"$OUT/build.log"
bin=build-hf/moe-train
text=$(ls /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/* 2>/dev/null | head -1)
"$bin" prepare --input "$text" --tokenizer byte --out "$OUT/data" | tee "$OUT/prepare.log"
"$bin" train --config configs/tiny.json --set data.source=shards \
  --set "data.train_files=\"$OUT/data/train_*.bin\"" --set "data.val_files=\"$OUT/data/val_*.bin\"" \
  --set model.vocab_size=257 --set model.moe_layer_freq=1 --set model.num_shared_experts=0 \
  --set model.mod.enabled=false --set train.max_steps=30 --set train.log_interval=10 \
  --set "train.out_dir=\"$OUT/run\"" >"$OUT/train.log"
tail -3 "$OUT/train.log"
"$bin" export --checkpoint "$OUT/run" --out "$OUT/hf"
"$bin" eval --checkpoint "$OUT/run" --data "$OUT/data/val_000000.bin" --batches 1 --batch-size 2 \
  --seq-len 64 --logits-out "$OUT/logits.bin" | tee "$OUT/eval.json"
python3 scripts/check_hf_export.py "$OUT/hf" "$OUT/data/val_000000.bin" "$OUT/logits.bin" 2 64 |
  tee "$OUT/hf_check.txt"
