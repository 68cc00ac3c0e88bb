#!/usr/bin/env bash
# Bad input through the real binary: each case exits with code 2 and one message naming the key
# or file. Usage: config_errors.sh MOE_TRAIN_BINARY SOURCE_DIR
set -u
bin=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

. "$src/tests/cli/lib/expect.sh"

tiny=$src/configs/tiny.json
echo '{"model": {"hidden_size": 64,}}' >"$tmp/malformed.json"
echo '{"modle": {}}' >"$tmp/unknown_top.json"
echo '{"model": {"num_local_expert": 4}}' >"$tmp/unknown_nested.json"
echo '{"model": {"hidden_size": "64"}}' >"$tmp/wrong_type.json"

expect_error missing_file "does_not_exist.json" train --config "$tmp/does_not_exist.json"
expect_error malformed_json "malformed.json" train --config "$tmp/malformed.json"
expect_error unknown_top_key 'did you mean "model"' train --config "$tmp/unknown_top.json"
expect_error unknown_nested_key "model.num_local_expert" train --config "$tmp/unknown_nested.json"
expect_error wrong_type "model.hidden_size" train --config "$tmp/wrong_type.json"
expect_error heads_not_divisible "model.num_key_value_heads" train --config "$tiny" \
  --set model.num_key_value_heads=3
expect_error topk_above_experts "model.num_experts_per_tok" train --config "$tiny" \
  --set model.num_experts_per_tok=9
expect_error capacity_zero "model.mod.capacity" train --config "$tiny" --set model.mod.capacity=0
expect_error capacity_above_one "model.mod.capacity" info --config "$tiny" \
  --set model.mod.capacity=1.5
expect_error seq_len_too_long "data.seq_len" train --config "$tiny" --set data.seq_len=100000
expect_error override_unknown "train.max_step" train --config "$tiny" --set train.max_step=3
expect_error override_syntax "has no '='" train --config "$tiny" --set train.max_steps
expect_error bad_device "train.device" train --config "$tiny" --device tpu
expect_error bf16_on_cpu "bf16.enabled" train --config "$tiny" --device cpu --set bf16.enabled=true
expect_error fp16_on_cpu "runs on a GPU only" train --config "$tiny" --device cpu \
  --set fp16.enabled=true
expect_error fp16_and_bf16 "at most one" train --config "$tiny" --set fp16.enabled=true \
  --set bf16.enabled=true
expect_error synthetic_big_vocab "use \"random\"" train --config "$tiny" --device cpu \
  --set model.vocab_size=32000
expect_error gpu_cap_negative "train.gpu_memory_limit_gib" train --config "$tiny" \
  --set train.gpu_memory_limit_gib=-1
expect_error gpu_cap_flag_negative "--gpu-memory-limit" train --config "$tiny" --gpu-memory-limit -1
expect_error missing_config_flag "--config" train
expect_error unknown_flag "--bogus" train --config "$tiny" --bogus

# Robustness: inputs that once crashed, hung or ran silently wrong.
printf '{"train": {"max_steps": 5, "max_steps": 7}}' >"$tmp/duplicate.json"
printf '{"train": {"out_dir": "runs/a\\u0000b"}}' >"$tmp/nul.json"
{ printf '{"model": '; head -c 100000 /dev/zero | tr '\0' '['; head -c 100000 /dev/zero | tr '\0' ']'
  printf '}'; } >"$tmp/deep.json"
: >"$tmp/not_a_dir"
expect_error duplicate_key "train.max_steps: given twice" info --config "$tmp/duplicate.json"
expect_error nul_in_path "train.out_dir" info --config "$tmp/nul.json"
expect_error deep_nesting "nested too deep" info --config "$tmp/deep.json"
expect_error override_not_utf8 "model.hidden_size" info --config "$tiny" \
  --set "$(printf 'model.hidden_size=\xff')"
expect_error path_not_utf8 "train.out_dir" info --config "$tiny" \
  --set "$(printf 'train.out_dir=runs/\xff')"
expect_error too_many_layers "model.num_hidden_layers" info --config "$tiny" \
  --set model.num_hidden_layers=100000
expect_error sizes_wrap_64_bits "2^40" info --config "$tiny" --set model.hidden_size=2147483644 \
  --set model.num_attention_heads=2 --set model.num_key_value_heads=2
expect_error memory_limit_nan "--gpu-memory-limit" train --config "$tiny" --gpu-memory-limit nan
expect_error bench_skew_nan "--skew" bench --config "$tiny" --device cpu --skew nan
expect_error device_verbatim 'got "cpu""' train --config "$tiny" --device 'cpu"'
expect_error resume_verbatim "in $tmp/a\"b" train --config "$tiny" --device cpu --resume "$tmp/a\"b"
expect_error out_dir_not_a_dir "train.out_dir" train --config "$tiny" --device cpu \
  --set train.out_dir="\"$tmp/not_a_dir\""
expect_error init_from_missing "$tmp/no_weights: no such file or directory (model.init_from" \
  train --config "$tiny" --device cpu --set model.init_from="\"$tmp/no_weights\""
expect_error init_from_empty_dir "$tmp: no model.safetensors" train --config "$tiny" --device cpu \
  --set model.init_from="\"$tmp\""
expect_error glob_missing_dir "$tmp/no_dir: No such file or directory" train --config "$tiny" \
  --device cpu --set data.source=shards --set data.train_files="\"$tmp/no_dir/*.bin\""
expect_error eval_batch_size_zero "not in range 1 to" eval --checkpoint "$tmp" --data x \
  --batch-size 0

# A run whose numbers diverge stops with the step and what to change (exit 1: not bad input), also
# where the CPU router meets the non-finite logits before the loss does.
out=$("$bin" train --config "$tiny" --device cpu --set optimizer.params.lr=1e300 \
  --set train.max_steps=5 --set "train.out_dir=\"$tmp/diverged\"" 2>&1)
code=$?
if [ "$code" -eq 1 ] && grep -q "error: the loss became non-finite at step 2 (router_topk_forward" \
  <<<"$out" && grep -q "lower optimizer.params.lr" <<<"$out"; then
  echo "ok   diverged_run"
else
  echo "FAIL diverged_run: exit $code: $(tail -2 <<<"$out")"
  failures=$((failures + 1))
fi

# A save at the step whose update made the weights non-finite (the loss shows it only a step
# later) stops the run as diverged and publishes no checkpoint.
out=$("$bin" train --config "$tiny" --device cpu --set optimizer.params.lr=1e300 \
  --set train.max_steps=5 --set train.save_interval=1 \
  --set "train.out_dir=\"$tmp/diverged_save\"" 2>&1)
code=$?
if [ "$code" -eq 1 ] && grep -q "error: the weights became non-finite at step 1 (.* holds a non-finite value" \
  <<<"$out" && grep -q "checkpoint was not saved" <<<"$out" &&
  [ -z "$(ls -A "$tmp/diverged_save" | grep step_)" ]; then
  echo "ok   diverged_save"
else
  echo "FAIL diverged_save: exit $code: $(tail -2 <<<"$out"); $(ls "$tmp/diverged_save" 2>&1)"
  failures=$((failures + 1))
fi

# A CPU run that does not fit in host memory says what it needs and what to lower (the address
# space capped, so the allocation fails whatever the machine's overcommit policy).
out=$(ulimit -v 4000000 && "$bin" train --config "$tiny" --device cpu \
  --set train_micro_batch_size_per_gpu=100000 --set "train.out_dir=\"$tmp/oom\"" 2>&1)
code=$?
if [ "$code" -eq 1 ] && grep -q "out of host memory.*this run needs about.*lower train_micro_batch_size_per_gpu" <<<"$out"; then
  echo "ok   host_out_of_memory"
else
  echo "FAIL host_out_of_memory: exit $code: $(tail -2 <<<"$out")"
  failures=$((failures + 1))
fi

# info counts a step's tokens in 64 bits
out=$("$bin" info --config "$tiny" --set gradient_accumulation_steps=2147483647 2>&1)
if grep -q "per step of 2199023254528 tokens" <<<"$out"; then
  echo "ok   info_step_tokens_64_bit"
else
  echo "FAIL info_step_tokens_64_bit: $(grep 'per step' <<<"$out")"
  failures=$((failures + 1))
fi

# info names the bf16 expert gradients' fp32 sums that GPUs other than sm_90 add (moe-fine: 64
# experts x 704 x 1024 x 4 bytes), and only where the config keeps those gradients in bf16
fine=$("$bin" info --config "$src/configs/moe-fine.json" 2>&1)
plain=$("$bin" info --config "$src/configs/moe-fine.json" --set train.bf16_expert_grads=false 2>&1)
if grep -q "other than sm_90: + 176.0 MiB" <<<"$fine" && ! grep -q "other than sm_90" <<<"$plain"; then
  echo "ok   info_bf16_dw_fallback_sums"
else
  echo "FAIL info_bf16_dw_fallback_sums: $(grep -c 'sm_90' <<<"$fine") / $(grep -c 'sm_90' <<<"$plain")"
  failures=$((failures + 1))
fi

# --gpu-memory-limit is the key train.gpu_memory_limit_gib (the resolved config shows the flag's
# value over the config's)
out=$("$bin" train --config "$tiny" --device cpu --set train.gpu_memory_limit_gib=8 \
  --gpu-memory-limit 3 --set train.max_steps=1 --set train.save_at_end=false \
  --set train.out_dir="\"$tmp/cap\"" 2>&1)
if grep -q '"gpu_memory_limit_gib": 3' <<<"$out"; then
  echo "ok   gpu_memory_limit_flag"
else
  echo "FAIL gpu_memory_limit_flag: the resolved config lacks the flag's cap"
  failures=$((failures + 1))
fi

# --help documents every subcommand and flag
help=$("$bin" --help 2>&1)
for word in train info; do
  grep -q "$word" <<<"$help" || { echo "FAIL help lacks $word"; failures=$((failures + 1)); }
done
help=$("$bin" train --help 2>&1)
for word in --config --set --device --profile; do
  grep -q -- "$word" <<<"$help" || { echo "FAIL train --help lacks $word"; failures=$((failures + 1)); }
done

[ "$failures" -eq 0 ] && echo "all config error cases passed"
exit "$failures"
