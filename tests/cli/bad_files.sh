#!/usr/bin/env bash
# Bad data and checkpoint files through the real binary, each once a crash, a lost run or a
# silently wrong result: a bad held-out shard fails before training (not at the last evaluation,
# before the final checkpoint), eval names a shard of another tokenizer, sample keeps to the
# tokenizer's ids, a changed or deeply nested safetensors file is an error (not a stack overflow), a
# metrics line of another program survives a resume, a resume past train.max_steps says it has
# nothing to train, and prepare refuses options its tokenizer would ignore and inputs without
# text. Usage: bad_files.sh MOE_TRAIN_BINARY SOURCE_DIR
set -u
bin=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
. "$src/tests/cli/lib/expect.sh"

"$bin" prepare --input "$src"/README.md "$src"/docs/config.md --tokenizer byte --out "$tmp/byte" \
  >"$tmp/prep.log" 2>&1 || { echo "FAIL prepare: $(cat "$tmp/prep.log")"; exit 1; }
# a u16 shard (llm.c layout) of 1200 tokens with ids up to 299: beyond the byte tokenizer's 257
/usr/bin/python3 - "$tmp/other_vocab.bin" <<'EOF'
import struct, sys
header = [0] * 256
header[0], header[1], header[2] = 20240520, 1, 1200
tokens = [(i * 7) % 300 for i in range(1200)]
open(sys.argv[1], "wb").write(struct.pack("<256i", *header) + struct.pack("<1200H", *tokens))
EOF
head -c 3000 "$tmp/byte/train_000000.bin" >"$tmp/truncated.bin"

run=$tmp/run
common=(--config "$src/configs/tiny.json" --device cpu --set data.source=shards
  --set "data.train_files=\"$tmp/byte/train_*.bin\"" --set model.vocab_size=280
  --set train.max_steps=2 --set train.log_interval=1 --set train.eval_batches=1
  --set "train.out_dir=\"$run\"")

expect_error val_shard_truncated "truncated.bin" train "${common[@]}" \
  --set "data.val_files=\"$tmp/truncated.bin\""
"$bin" train "${common[@]}" >"$tmp/train.log" 2>&1 || fail "train: $(tail -3 "$tmp/train.log")"

# eval: a shard of another tokenizer is named, not reported as a bare token id
expect_error eval_other_vocab "other_vocab.bin" eval --checkpoint "$run" \
  --data "$tmp/other_vocab.bin" --batch-size 1 --seq-len 16
"$bin" export --checkpoint "$run" --out "$tmp/hf" >/dev/null || fail "export"

# sample: the model's 280 ids, the tokenizer's 257; no draw may leave the tokenizer's
for seed in 1 2 3 4 5; do
  out=$("$bin" sample --checkpoint "$run" --prompt "The " --max-new-tokens 30 --temperature 5 \
    --seed "$seed" 2>&1) || fail "sample seed $seed: $out"
done
expect_error prompt_id_wraps "4294967296" sample --checkpoint "$run" --prompt-ids 4294967296
# An empty --prompt-ids is an empty prompt, not a missing one (on a run without a tokenizer it
# once asked for the --prompt-ids it had been given).
"$bin" train --config "$src/configs/tiny.json" --device cpu --set train.max_steps=1 \
  --set train.save_at_end=true --set "train.out_dir=\"$tmp/synthetic\"" >/dev/null 2>&1 ||
  fail "synthetic train"
expect_error prompt_ids_empty "the prompt is empty" sample --checkpoint "$tmp/synthetic" \
  --prompt-ids ""
expect_error top_p_zero "top_p must be in (0, 1]" sample --checkpoint "$run" --prompt "The " \
  --top-p 0

# a safetensors header nested far deeper than the stack allows to print
step=$(ls -d "$run"/step_* | tail -1)
cp -r "$step" "$tmp/deep_step"
/usr/bin/python3 - "$tmp/deep_step/model.safetensors" <<'EOF'
import struct, sys
header = ('{"a":{"dtype":"F32","shape":' + "[" * 200000 + "]" * 200000 +
          ',"data_offsets":[0,0]}}').encode()
header += b" " * ((8 - len(header) % 8) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(header)) + header)
EOF
expect_error deep_safetensors_checksum "deep_step/model.safetensors" export \
  --checkpoint "$tmp/deep_step" --out "$tmp/hf2"
# (and past the size and checksum DONE records, as in a checkpoint saved before it recorded them:
# the parser itself)
echo "step 1" >"$tmp/deep_step/DONE"
expect_error deep_safetensors '"shape" holds array' export --checkpoint "$tmp/deep_step" \
  --out "$tmp/hf2"

# resume keeps going past metrics lines of another program (a "step" that is not a number, or
# none), and keeps them
echo '{"kind": "note", "step": "x"}' >>"$run/metrics.jsonl"
echo '{"kind": "note2"}' >>"$run/metrics.jsonl"
"$bin" train "${common[@]}" --set train.max_steps=3 --resume auto >"$tmp/resume.log" 2>&1 ||
  fail "resume with a foreign metrics line: $(tail -3 "$tmp/resume.log")"
for note in '"step": "x"' '"kind": "note2"'; do
  grep -qF "$note" "$run/metrics.jsonl" || fail "resume dropped the metrics line with $note"
done

# a resume already past train.max_steps trains nothing and says so (not "last train loss 0")
out=$("$bin" train "${common[@]}" --set train.max_steps=1 --resume auto 2>&1) ||
  fail "resume past max_steps: $(tail -3 <<<"$out")"
grep -q "nothing to train: resumed at step 3, train.max_steps is 1" <<<"$out" ||
  fail "resume past max_steps: $(tail -1 <<<"$out")"

# prepare: options the byte tokenizer would silently ignore, inputs with no text, a JSON Lines
# file cut mid-line, a JSON Lines key with no JSON Lines input
expect_error prepare_byte_vocab "--vocab-size" prepare --input "$src/README.md" --tokenizer byte \
  --vocab-size 500 --out "$tmp/p"
: >"$tmp/empty.txt"
expect_error prepare_no_text "empty.txt" prepare --input "$tmp/empty.txt" --tokenizer spm \
  --vocab-size 100 --out "$tmp/p"
expect_error export_empty_out "output directory name is empty" export --checkpoint "$run" --out ""
printf '{"text": "fine"}\n{"text": "cut\n' >"$tmp/cut.jsonl"
expect_error prepare_bad_jsonl "cut.jsonl:2: not a JSON line" prepare --input "$tmp/cut.jsonl" \
  --out "$tmp/p"
expect_error prepare_jsonl_key_unused "--jsonl-key" prepare --input "$src/README.md" \
  --jsonl-key body --out "$tmp/p"

[ "$failures" -eq 0 ] && echo "all bad file cases passed"
exit "$failures"
