#!/usr/bin/env bash
# The tool end to end through the binary: prepare (byte and spm) -> train on shards with
# checkpoints -> resume -> eval (one JSON line) -> sample (deterministic per seed) -> export ->
# plot; and the bad-file cases (corrupt shard, incomplete checkpoint) with their messages.
set -u
bin=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL $*"; exit 1; }

# a small corpus of real English text that does not change with the project: three fortune
# files of the `fortunes` package (scripts/setup.sh installs it); where they are missing, this
# project's own documentation
corpus=()
for f in /usr/share/games/fortunes/{computers,linux,science}; do [ -f "$f" ] && corpus+=("$f"); done
[ ${#corpus[@]} -gt 0 ] || corpus=("$src"/README.md "$src"/docs/*.md)

"$bin" prepare --input "${corpus[@]}" --tokenizer byte --out "$tmp/byte" >"$tmp/prep.log" 2>&1 ||
  fail "prepare byte: $(cat "$tmp/prep.log")"
ls "$tmp"/byte/train_000000.bin "$tmp"/byte/val_000000.bin "$tmp"/byte/moe_tokenizer.json >/dev/null ||
  fail "prepare byte wrote no shards/tokenizer"
"$bin" prepare --input "${corpus[@]}" --tokenizer spm --vocab-size 500 --out "$tmp/spm" \
  >"$tmp/prep2.log" 2>&1 || fail "prepare spm: $(cat "$tmp/prep2.log")"
[ -f "$tmp/spm/tokenizer.model" ] || fail "prepare spm wrote no tokenizer.model"

run=$tmp/run
common=(--config "$src/configs/tiny.json" --set data.source=shards
  --set "data.train_files=\"$tmp/byte/train_*.bin\"" --set "data.val_files=\"$tmp/byte/val_*.bin\""
  --set model.vocab_size=257 --set train.max_steps=6 --set train.save_interval=3
  --set train.log_interval=1 --set train.eval_batches=1 --set "train.out_dir=\"$run\"")
"$bin" train "${common[@]}" >"$tmp/train.log" 2>&1 || fail "train: $(tail -5 "$tmp/train.log")"
[ -f "$run/step_00000003/DONE" ] && [ -f "$run/step_00000006/DONE" ] || fail "checkpoints missing"
[ "$(grep -c '"kind":"train"' "$run/metrics.jsonl")" -eq 6 ] || fail "metrics.jsonl lines"

# resume: an incomplete newer checkpoint is skipped with a warning
mkdir -p "$run/step_00000009"
"$bin" train "${common[@]}" --set train.max_steps=8 --resume auto >"$tmp/resume.log" 2>&1 ||
  fail "resume: $(tail -5 "$tmp/resume.log")"
grep -q "step_00000009" "$tmp/resume.log" || fail "no warning about the incomplete checkpoint"
grep -q "resumed from .*step_00000006 at step 6" "$tmp/resume.log" || fail "did not resume at 6"
rm -rf "$run/step_00000009"

# eval prints one JSON line with loss, ppl, tokens
out=$("$bin" eval --checkpoint "$run" --data "$tmp/byte/val_*.bin" --batches 2 --batch-size 2 --seq-len 32) ||
  fail "eval: $out"
/usr/bin/python3 -c "import json,sys; j=json.loads(sys.argv[1]); assert j['tokens']==128 and j['loss']>0 and abs(j['ppl']-__import__('math').exp(j['loss']))<1e-6*j['ppl']" "$out" ||
  fail "eval output: $out"

# --device: the CPU runs in f32 (and is what auto picks without a GPU: then the same loss); a
# name outside train.device's grammar, or a GPU that is not there, exits 2 naming the flag
eauto=$out
ecpu=$("$bin" eval --checkpoint "$run" --data "$tmp/byte/val_*.bin" --batches 2 --batch-size 2 \
  --seq-len 32 --device cpu) || fail "eval --device cpu: $ecpu"
/usr/bin/python3 -c "
import json, sys
auto, cpu = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert cpu['device'] == 'cpu' and cpu['dtype'] == 'f32', cpu
assert auto['device'] != 'cpu' or auto['loss'] == cpu['loss'], (auto, cpu)" "$eauto" "$ecpu" ||
  fail "eval --device cpu: $ecpu (auto: $eauto)"
out=$("$bin" eval --checkpoint "$run" --data "$tmp/byte/val_*.bin" --device cuda:63 2>&1)
[ $? -eq 2 ] && grep -q -- "--device" <<<"$out" || fail "eval --device cuda:63: $out"
out=$("$bin" sample --checkpoint "$run" --prompt "The " --device gpu 2>&1)
[ $? -eq 2 ] && grep -q -- "--device" <<<"$out" || fail "sample --device gpu: $out"

# sampling is deterministic for a seed
s1=$("$bin" sample --checkpoint "$run" --prompt "The " --max-new-tokens 20 --seed 5) || fail "sample: $s1"
s2=$("$bin" sample --checkpoint "$run" --prompt "The " --max-new-tokens 20 --seed 5) || fail "sample: $s2"
[ "$s1" = "$s2" ] || fail "same seed, different text: '$s1' vs '$s2'"
s4=$("$bin" sample --checkpoint "$run" --prompt "The " --max-new-tokens 20 --seed 5 --device cpu) ||
  fail "sample --device cpu: $s4"
if grep -q '"device":"cpu"' <<<"$eauto"; then  # auto sampled on the CPU too
  [ "$s4" = "$s1" ] || fail "sample --device cpu: '$s4', auto: '$s1'"
fi
s3=$("$bin" sample --checkpoint "$run" --prompt "The " --max-new-tokens 20 --top-k 40 --top-p 0.9 \
  --temperature 0.8 --seed 5) || fail "sample --top-p: $s3"
[ -n "$s3" ] || fail "sample --top-p printed nothing"

# export writes a Hugging Face directory
"$bin" export --checkpoint "$run" --out "$tmp/hf" >/dev/null || fail "export"
for f in model.safetensors config.json moe_tokenizer.json; do [ -f "$tmp/hf/$f" ] || fail "export lacks $f"; done

# plots
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  /usr/bin/python3 "$src/scripts/plot_metrics.py" "$run" >/dev/null || fail "plot_metrics.py"
  [ -s "$run/curves.png" ] && [ -s "$run/expert_load.png" ] || fail "plots missing"
fi

# bad files: each exits 2 naming the file
cp "$tmp/byte/train_000000.bin" "$tmp/bad.bin"
truncate -s 2000 "$tmp/bad.bin"
out=$("$bin" train "${common[@]}" --set "data.train_files=\"$tmp/bad.bin\"" 2>&1)
[ $? -eq 2 ] && grep -q "bad.bin" <<<"$out" || fail "truncated shard: $out"
printf 'garbage' >"$tmp/magic.bin"
out=$("$bin" eval --checkpoint "$run" --data "$tmp/magic.bin" 2>&1)
[ $? -eq 2 ] && grep -q "magic.bin" <<<"$out" || fail "wrong-magic shard: $out"
mkdir -p "$tmp/nodone/step_00000001"
out=$("$bin" eval --checkpoint "$tmp/nodone/step_00000001" --data "$tmp/byte/val_*.bin" 2>&1)
[ $? -eq 2 ] && grep -q "DONE" <<<"$out" || fail "checkpoint without DONE: $out"
echo "ok: prepare, train, resume, eval, sample, export, plot and bad files"
