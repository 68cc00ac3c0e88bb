#!/usr/bin/env bash
# A graceful stop through the real binary: SIGTERM to a training run ends it after the step in
# progress with that step's checkpoint and exit 143 (128 + 15), and --resume auto goes on from
# it; metrics.jsonl ends with a stop record (that the plots skip); SIGUSR1 to a run that saves no
# checkpoints stops it with exit 138 and says so; a run whose output pipe loses its reader right
# after the signal still saves and exits 143.
# Usage: stop_signal.sh MOE_TRAIN_BINARY SOURCE_DIR
set -u
bin=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL $*"; exit 1; }

# start DIR ARGS...: a long run in the background (pid in $job), returning once it has logged
# step 2
start() {
  local dir=$1
  shift
  "$bin" train --config "$src/configs/tiny.json" --device cpu --set train.max_steps=1000000 \
    --set train.log_interval=1 --set "train.out_dir=\"$dir\"" "$@" >"$dir.log" 2>&1 &
  job=$!
  for _ in $(seq 300); do
    grep -q "^step .* 2/" "$dir.log" 2>/dev/null && return
    kill -0 "$job" 2>/dev/null || fail "the run ended early: $(tail -3 "$dir.log")"
    sleep 0.1
  done
  kill -KILL "$job"
  fail "no progress line in 30 s"
}

# stop SIGNAL STATUS DIR: sends SIGNAL to the run started into DIR, which must exit with STATUS
# and print its stop line; sets $n to the step it stopped after
stop() {
  local signal=$1 status=$2 dir=$3 rc line
  kill "-$signal" "$job"
  wait "$job"
  rc=$?
  [ "$rc" -eq "$status" ] || fail "SIG$signal: exit $rc, expected $status: $(tail -3 "$dir.log")"
  line=$(grep -m1 "^stopped by SIG$signal after step" "$dir.log") ||
    fail "no stop line: $(tail -3 "$dir.log")"
  n=$(sed 's/^stopped by SIG[A-Z0-9]* after step \([0-9]*\).*/\1/' <<<"$line")
}

# SIGTERM with periodic saves off and a save at the end: the stop saves the step it ends at.
start "$tmp/a" --set train.save_interval=0 --set train.save_at_end=true
stop TERM 143 "$tmp/a"
dir=$(printf "%s/a/step_%08d" "$tmp" "$n")
[ -f "$dir/DONE" ] || fail "no complete checkpoint $dir: $(ls "$tmp/a")"
grep -q "^saved $dir" "$tmp/a.log" || fail "no 'saved $dir' line"
grep -q "^stopped: $n steps" "$tmp/a.log" || fail "no summary line"
stop_record="{\"checkpoint\":\"$dir\",\"kind\":\"stop\",\"signal\":\"SIGTERM\",\"step\":$n}"
[ "$(tail -1 "$tmp/a/metrics.jsonl")" = "$stop_record" ] ||
  fail "metrics.jsonl ends with $(tail -1 "$tmp/a/metrics.jsonl"), expected $stop_record"
"$bin" train --config "$src/configs/tiny.json" --device cpu --set train.max_steps=$((n + 2)) \
  --set "train.out_dir=\"$tmp/a\"" --resume auto >"$tmp/a2.log" 2>&1 ||
  fail "resume exited $?: $(tail -3 "$tmp/a2.log")"
grep -q "resumed from $dir at step $n" "$tmp/a2.log" || fail "not resumed at step $n"
grep -q "^done: $((n + 2)) steps" "$tmp/a2.log" || fail "the resume did not finish"
grep -qF "$stop_record" "$tmp/a/metrics.jsonl" || fail "the resume dropped the stop record"
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then  # the plots skip the stop record
  /usr/bin/python3 "$src/scripts/plot_metrics.py" "$tmp/a" >/dev/null ||
    fail "plot_metrics.py on a stopped and resumed run"
fi
echo "ok   SIGTERM: stopped after step $n with its checkpoint and a metrics record, exit 143;" \
  "resumed to step $((n + 2))"

# SIGUSR1 to a run that saves nothing: it stops and says that no checkpoint was saved.
start "$tmp/b" --set train.save_interval=0 --set train.save_at_end=false
stop USR1 138 "$tmp/b"
grep -q "^stopped by SIGUSR1 after step $n .*no checkpoint saved" "$tmp/b.log" ||
  fail "no 'no checkpoint saved': $(tail -3 "$tmp/b.log")"
[ -z "$(ls "$tmp/b" | grep step_)" ] || fail "a checkpoint was saved: $(ls "$tmp/b")"
grep -qF "{\"checkpoint\":null,\"kind\":\"stop\",\"signal\":\"SIGUSR1\",\"step\":$n}" \
  "$tmp/b/metrics.jsonl" || fail "no stop record without a checkpoint: $(tail -1 "$tmp/b/metrics.jsonl")"
echo "ok   SIGUSR1 without saves: stopped, exit 138, no checkpoint"

# SIGTERM, then the reader of its output gone (Ctrl-C on `moe-train train | tee log` ends both):
# the save and the exit status are not lost to SIGPIPE.
mkfifo "$tmp/pipe"
cat "$tmp/pipe" >"$tmp/c.log" &
reader=$!
"$bin" train --config "$src/configs/tiny.json" --device cpu --set train.max_steps=1000000 \
  --set train.log_interval=1 --set train.save_interval=0 --set train.save_at_end=true \
  --set "train.out_dir=\"$tmp/c\"" >"$tmp/pipe" 2>&1 &
job=$!
for _ in $(seq 300); do
  grep -q "^step .* 2/" "$tmp/c.log" 2>/dev/null && break
  sleep 0.1
done
kill -TERM "$job"
{ kill -KILL "$reader" && wait "$reader"; } 2>/dev/null
wait "$job"
rc=$?
[ "$rc" -eq 143 ] || fail "SIGTERM with the reader gone: exit $rc, expected 143"
[ -n "$(ls "$tmp/c" | grep step_)" ] || fail "SIGTERM with the reader gone: no checkpoint"
echo "ok   SIGTERM with the output pipe's reader gone: exit 143, checkpoint saved"
