#!/usr/bin/env bash
# Data-parallel training with the real binary under mpirun (registered by mpi_tests.cmake).
#   dp_train.sh MPIEXEC MOE_TRAIN SRC_DIR MODE
# MODE:
#   equal NP    for ZeRO stages 0, 1 and 2: NP ranks with gradient_accumulation_steps 12/NP give
#               the per-step losses of one rank with accumulation 12 (the same global batch of
#               the same rows), within a relative 1e-6 (the gradient summation order differs;
#               seen: < 1e-8); stages 0 and 1 give bitwise the same losses as each other (the
#               same all-reduce; AdamW is elementwise, so updating shards changes no bits); with
#               the optimizer offloaded to the CPU (offload_optimizer.device "cpu"), stages 1 and
#               2 give bitwise the losses of the same stage without offload (the host AdamW does
#               the op's arithmetic), hence also the 1-rank losses within 1e-6; with
#               overlap_comm (small buckets reduced during the backward), stages 0-2 give the
#               1-rank losses within 1e-6, and stages 0 and 1 agree bitwise
#   resume      2 ranks (ZeRO 1) train 3 steps and save; the run resumes on 1 rank (ZeRO 0), on
#               3 ranks (ZeRO 2: the parameter count is not a multiple of 3, so the shared tail
#               is exercised) and on 4 ranks (ZeRO 1); steps 4-6 match the uninterrupted 1-rank
#               run (1e-6). Then from an offloaded checkpoint (2 ranks, ZeRO 2, optimizer on the
#               CPU): resumed on 1 rank (ZeRO 1, offloaded), 4 ranks (ZeRO 2, not offloaded) and
#               3 ranks (ZeRO 1, offloaded); and the non-offloaded checkpoint resumed on 3 ranks
#               with offload and overlap_comm (ZeRO 2 buckets reaching the shared tail): all match
#               the 1-rank run (1e-6)
#   shards      token shards (prepared from generated text with the byte tokenizer) with held-out
#               files: 2 ranks at ZeRO 2 give the 1-rank losses and the same (split, reduced)
#               evaluation loss, within 1e-6; the checkpoint holds the tokenizer and both ranks'
#               state files
#   mismatch    rank 1 of 2 gets one more override than rank 0 (a wrapper adds it): another
#               model shape (which crashed a rank in the collectives' size mismatch) and another
#               ZeRO stage (which hung until the watchdog) each stop the job at start-up with exit
#               2 within 15 s and one message naming the key and both ranks' values; and
#               train.bf16_expert_grads (one process only) on 2 ranks is refused the same way
#   diverged    2 ranks whose first update makes the weights non-finite, saving at step 1: rank 0
#               (which writes the weights) stops as diverged naming the tensor, rank 1 stops
#               naming rank 0's finding (no rank waits in the save's barrier), nothing published
#   stop        SIGUSR1 to rank 1 of 2 only: both ranks stop after the same step with its
#               checkpoint (both ranks' state) and exit 138; the run resumes from it
#   kill        rank 1 of 2 is killed with SIGKILL mid-run (train.comm_timeout_s 60): the job
#               exits non-zero within 30 s with mpirun's message naming the rank (or the
#               watchdog's line, should mpirun not end the job first)
# MOE_DP_DEVICE=cuda runs the same checks on GPU ranks over NCCL (one GPU per rank; exit 77, a
# skip, with fewer GPUs than ranks). There the cross-rank sums run in NCCL's order and the host
# AdamW of offload is not the device op's arithmetic, so the tolerances are 1e-4 relative and
# only stages 0 and 1 (the same all-reduce) are compared bitwise.
set -uo pipefail
mpiexec=$1 bin=$2 src=$3 mode=$4
np=${5:-2}
fail() { echo "FAIL: $*"; exit 1; }
device=${MOE_DP_DEVICE:-cpu}
tol=1e-6 tol_offload=0
if [ "$device" = cuda ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "${gpus:-0}" -ge "$np" ] || { echo "skipped: $np GPUs needed, ${gpus:-0} found"; exit 77; }
  tol=1e-4 tol_offload=1e-4
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

launch=("$mpiexec")
if "$mpiexec" --version 2>&1 | grep -Eq "Open MPI|OpenRTE|open-mpi.org"; then
  launch+=(--oversubscribe --bind-to none)
  if [ "$(id -u)" = 0 ]; then launch+=(--allow-run-as-root); fi
fi
export OMP_NUM_THREADS=1

# A small model; the schedule length is fixed (total_num_steps) so a shorter run has the same lr.
common=(--config "$src/configs/tiny.json" --device "$device"
  --set train_micro_batch_size_per_gpu=1 --set data.seq_len=32 --set train.max_steps=6
  --set scheduler.params.total_num_steps=6 --set scheduler.params.warmup_num_steps=2
  --set train.log_interval=1 --set train.eval_batches=2 --set train.comm_timeout_s=60)

offload=(--set 'zero_optimization.offload_optimizer.device="cpu"'
  --set zero_optimization.offload_optimizer.pin_memory=true)  # (pinning: GPU runs only)

# run NP OUT_DIR ARGS...: the binary on NP ranks (1 = no mpirun)
run() {
  local n=$1 dir=$2
  shift 2
  local cmd=("$bin" train "${common[@]}" --set "train.out_dir=\"$dir\"" \
    --set "gradient_accumulation_steps=$((12 / n))" "$@")
  if [ "$n" -gt 1 ]; then cmd=("${launch[@]}" -np "$n" "${cmd[@]}"); fi
  timeout -k 5 120 "${cmd[@]}" >"$dir.log" 2>&1 || { cat "$dir.log"; fail "${cmd[*]} exited $?"; }
}
# rank1_pid DIR: the pid of rank 1 of the job training into DIR (on its command line: other
# tests may run at the same time; OMPI_COMM_WORLD_RANK=1 in its environment), once DIR.log shows
# step 2; fails after 20 s
rank1_pid() {
  local dir=$1 found="" pid
  for _ in $(seq 100); do
    for pid in $(pgrep -x moe-train); do
      tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$dir" || continue
      if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=1; then
        found=$pid
      fi
    done
    if [ -n "$found" ] && grep -q "^step .* 2/" "$dir.log"; then
      echo "$found"
      return 0
    fi
    sleep 0.2
  done
  return 1
}

losses() { jq -r 'select(.kind == "train") | "\(.step) \(.loss)"' "$1/metrics.jsonl"; }
# same A B TOL: the step/loss lists agree (relative TOL; 0 = bitwise)
same() {
  paste -d' ' <(losses "$1") <(losses "$2") | awk -v tol="$3" -v a="$1" -v b="$2" '
    { n++; if ($1 != $3) { print "step mismatch " $1 " vs " $3; bad = 1; next }
      d = $2 - $4; if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2);
      if (r > worst) worst = r;
      if ((tol == 0 && $2 != $4) || r > tol) { print "step " $1 ": " $2 " vs " $4; bad = 1 } }
    END { printf "%s vs %s: %d steps, max relative difference %.3g\n", a, b, n, worst;
          exit bad || n == 0 }' || fail "losses differ ($1 vs $2, tolerance $3)"
}

case "$mode" in
  equal)
    run 1 "$work/ref"
    for stage in 0 1 2 3; do
      run "$np" "$work/z$stage" --set zero_optimization.stage=$stage
      grep -q "data parallel: $np ranks" "$work/z$stage.log" || fail "no data-parallel line"
      same "$work/ref" "$work/z$stage" "$tol"
    done
    same "$work/z0" "$work/z1" 0
    # overlap_comm: the gradients reduced in buckets during the last micro-batch's backward; 3000
    # elements is less than any layer's range, so each range is reduced as soon as the backward
    # finishes it (merging smaller ranges into buckets is unit-tested: GradientBuckets)
    for stage in 0 1 2; do
      run "$np" "$work/ov$stage" --set zero_optimization.stage=$stage \
        --set zero_optimization.overlap_comm=true --set zero_optimization.reduce_bucket_size=3000
      grep -q "gradients reduced in buckets during the backward" "$work/ov$stage.log" ||
        fail "no overlap line"
      same "$work/ref" "$work/ov$stage" "$tol"
    done
    same "$work/ov0" "$work/ov1" 0
    # overlap_comm with the optimizer offloaded: each bucket's owned part also goes to the host
    # staging during the backward, and with offload_optimizer.overlap_backward the CPU AdamW
    # updates it there and then, guessing no clip; this run's gradient norms are 0.84, 0.86,
    # 1.21, 2.53, 1.13, 0.95 against gradient_clipping 1.0, so steps 1 and 2 keep the guess, 3
    # redoes it clipped and 4-6 (after a clipped step) update after the backward: the arithmetic
    # of the overlap run each way. Without overlap_backward the update follows the backward; at
    # world 1 too (buckets to the host only)
    for stage in 1 2; do
      run "$np" "$work/ovoff$stage" --set zero_optimization.stage=$stage "${offload[@]}" \
        --set zero_optimization.overlap_comm=true --set zero_optimization.reduce_bucket_size=3000 \
        --set zero_optimization.offload_optimizer.overlap_backward=true
      grep -q "as each gradient bucket lands during the backward" "$work/ovoff$stage.log" ||
        fail "no overlapped offload line"
      same "$work/ov$stage" "$work/ovoff$stage" "$tol_offload"
    done
    run "$np" "$work/ovoffseq" --set zero_optimization.stage=2 "${offload[@]}" \
      --set zero_optimization.overlap_comm=true --set zero_optimization.reduce_bucket_size=3000 \
      --set zero_optimization.offload_optimizer.overlap_backward=false
    if grep -q "as each gradient bucket lands" "$work/ovoffseq.log"; then
      fail "overlap_backward=false still overlaps"
    fi
    same "$work/ov2" "$work/ovoffseq" "$tol_offload"
    run 1 "$work/ovoffone" --set zero_optimization.stage=1 "${offload[@]}" \
      --set zero_optimization.overlap_comm=true --set zero_optimization.reduce_bucket_size=3000 \
      --set zero_optimization.offload_optimizer.overlap_backward=true
    grep -q "as each gradient bucket lands during the backward" "$work/ovoffone.log" ||
      fail "no overlapped offload line at world 1"
    same "$work/ref" "$work/ovoffone" "$tol_offload"
    for stage in 1 2 3; do
      run "$np" "$work/off$stage" --set zero_optimization.stage=$stage "${offload[@]}"
      grep -q "optimizer offload: AdamW state" "$work/off$stage.log" || fail "no offload line"
      same "$work/z$stage" "$work/off$stage" "$tol_offload"
      same "$work/ref" "$work/off$stage" "$tol"
    done
    # ZeRO-3 parameter offload: the weight and gradient chunks in host memory, updated in place
    # by the CPU AdamW: the arithmetic of the optimizer offload (on GPUs the gradient norm is
    # summed on the host instead of the device)
    run "$np" "$work/offp3" --set zero_optimization.stage=3 "${offload[@]}" \
      --set 'zero_optimization.offload_param.device="cpu"' --set zero_optimization.offload_param.pin_memory=true
    grep -q "parameter offload: this rank's chunks" "$work/offp3.log" || fail "no parameter offload line"
    same "$work/off3" "$work/offp3" "$tol_offload"
    same "$work/ref" "$work/offp3" "$tol"
    # rank 0 alone reports: one config print, one progress line per step, one done line
    [ "$(grep -c '^step ' "$work/z2.log")" = 6 ] || fail "progress lines not from rank 0 alone"
    [ "$(grep -c '^resolved config' "$work/z2.log")" = 1 ] || fail "config printed by every rank"
    [ "$(grep -c '^done:' "$work/z2.log")" = 1 ] || fail "done line printed by every rank"
    ;;
  resume)
    run 1 "$work/ref"
    run 2 "$work/two" --set zero_optimization.stage=1 --set train.max_steps=3
    [ -f "$work/two/step_00000003/rank_00001.state" ] || fail "rank 1 wrote no state file"
    for target in "1 0" "3 2" "4 1"; do
      set -- $target
      cp -r "$work/two" "$work/on$1"
      run "$1" "$work/on$1" --set zero_optimization.stage=$2 --set train.resume=auto
      grep -q "resumed from" "$work/on$1.log" || fail "no resume on $1 rank(s)"
      same "$work/ref" "$work/on$1" 1e-6
    done
    run 2 "$work/twooff" --set zero_optimization.stage=2 "${offload[@]}" --set train.max_steps=3
    # (the fourth also with overlap_comm: ZeRO 2 buckets on 3 ranks reach the shared tail)
    run 2 "$work/three" --set zero_optimization.stage=3 --set train.max_steps=3
    for target in "1 1 cpu twooff" "4 2 none twooff" "3 1 cpu twooff" "3 2 cpu two overlap" \
      "3 3 none two" "4 3 cpu twooff" "1 0 none three" "3 3 cpu three" "4 2 none three" \
      "2 3 cpu three param" "3 3 cpu twooff param"; do
      set -- $target
      dir="$work/from_$4_on$1_$3"
      cp -r "$work/$4" "$dir"
      extra=()
      if [ "${5:-}" = overlap ]; then
        extra=(--set zero_optimization.overlap_comm=true --set zero_optimization.reduce_bucket_size=3000)
      elif [ "${5:-}" = param ]; then
        extra=(--set 'zero_optimization.offload_param.device="cpu"')
      fi
      run "$1" "$dir" --set zero_optimization.stage=$2 "${extra[@]}" \
        --set "zero_optimization.offload_optimizer.device=\"$3\"" --set train.resume=auto
      grep -q "resumed from" "$dir.log" || fail "no resume into $dir"
      if [ "${5:-}" = overlap ]; then
        grep -q "gradients reduced in buckets" "$dir.log" || fail "no overlap in $dir"
      fi
      same "$work/ref" "$dir" 1e-6
    done
    ;;
  shards)
    # A corpus of its own (the docs change every session, and a 1e-6 bound is data-dependent):
    # six files of pseudo-random words, the same at every run (awk's srand(seed)).
    mkdir -p "$work/corpus"
    for f in 1 2 3 4 5 6; do
      awk -v seed=$f 'BEGIN { srand(seed); split("the of a rank step loss expert token route shard", w)
        for (i = 0; i < 6000; ++i) printf "%s%s", w[int(rand() * 10) + 1], (i % 12 == 11) ? ".\n" : " " }' \
        >"$work/corpus/part$f.txt"
    done
    "$bin" prepare --input "$work"/corpus/*.txt --tokenizer byte --out "$work/byte" >"$work/prep.log" 2>&1 ||
      fail "prepare: $(cat "$work/prep.log")"
    shard_args=(--set data.source=shards --set "data.train_files=\"$work/byte/train_*.bin\""
      --set "data.val_files=\"$work/byte/val_*.bin\"" --set model.vocab_size=257
      --set train.eval_batches=3)
    run 1 "$work/ref" "${shard_args[@]}"
    run 2 "$work/two" "${shard_args[@]}" --set zero_optimization.stage=2
    same "$work/ref" "$work/two" 1e-6
    evals() { jq -r 'select(.kind == "eval") | .loss' "$1/metrics.jsonl"; }
    [ -n "$(evals "$work/ref")" ] || fail "no evaluation"
    awk -v a="$(evals "$work/ref")" -v b="$(evals "$work/two")" \
      'BEGIN { d = a - b; if (d < 0) d = -d; print "eval " a " vs " b; exit !(d <= 1e-6 * a) }' ||
      fail "evaluation losses differ"
    for f in moe_tokenizer.json rank_00000.state rank_00001.state DONE; do
      [ -f "$work/two/step_00000006/$f" ] || fail "checkpoint lacks $f"
    done
    ;;
  mismatch)
    # rank 1 (Open MPI's or a PMI launcher's variable) gets "--set $MOE_RANK1_SET" appended, or
    # starts in the directory MOE_RANK1_CD
    cat >"$work/rank1.sh" <<'EOS'
#!/usr/bin/env bash
if [ "${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}" = 1 ]; then
  if [ -n "${MOE_RANK1_CD:-}" ]; then cd "$MOE_RANK1_CD" || exit 1; exec "$@"; fi
  exec "$@" --set "$MOE_RANK1_SET"
fi
exec "$@"
EOS
    chmod +x "$work/rank1.sh"
    for case in "model.num_hidden_layers=6|model.num_hidden_layers: .* 4 on rank 0, 6 on rank 1" \
      "zero_optimization.stage=2|zero_optimization.stage: .* 0 on rank 0, 2 on rank 1"; do
      set_arg=${case%%|*} expect=${case#*|}
      start=$(date +%s.%N)
      MOE_RANK1_SET=$set_arg timeout -k 5 60 "${launch[@]}" -np 2 "$work/rank1.sh" \
        "$bin" train "${common[@]}" --set "train.out_dir=\"$work/mismatch\"" >"$work/mismatch.log" 2>&1
      rc=$?
      elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
      grep '^error' "$work/mismatch.log"
      echo "$set_arg on rank 1: exit $rc after $elapsed s"
      [ "$rc" = 2 ] || { cat "$work/mismatch.log"; fail "$set_arg on rank 1: exit $rc, not 2"; }
      grep -Eq "^error: config $expect" "$work/mismatch.log" || fail "no message naming the key"
      awk -v e="$elapsed" 'BEGIN { exit !(e < 15) }' || fail "took $elapsed s"
    done
    # The same config, but a relative train.out_dir from another working directory on rank 1:
    # two run directories (as a node-local path on several nodes), which made every checkpoint
    # incomplete; found at start-up by the run directory probe.
    mkdir -p "$work/rank0_cwd" "$work/rank1_cwd"
    (cd "$work/rank0_cwd" && MOE_RANK1_CD="$work/rank1_cwd" timeout -k 5 60 "${launch[@]}" -np 2 \
      "$work/rank1.sh" "$bin" train "${common[@]}" --set 'train.out_dir="run"') \
      >"$work/mismatch.log" 2>&1
    rc=$?
    grep '^error' "$work/mismatch.log"
    [ "$rc" = 2 ] || { cat "$work/mismatch.log"; fail "two run directories: exit $rc, not 2"; }
    grep -Eq "^error: config train.out_dir \(as each rank sees it\): differs between the data-parallel ranks: the one holding start-up token [0-9a-f]{16} on rank 0, not the directory rank 0 wrote into \(rank 1 finds no $work/rank1_cwd/run/.moe-train-ranks-probe\) on rank 1" \
      "$work/mismatch.log" || fail "no message naming the run directory"
    [ -z "$(ls -A "$work/rank0_cwd/run" | grep probe)" ] || fail "the probe files were left behind"
    # One-process options on two ranks (the same config on both): refused before any rank
    # builds a model, by each rank alike.
    timeout -k 5 60 "${launch[@]}" -np 2 "$bin" train "${common[@]}" --set bf16.enabled=true \
      --set train.split_master=true --set train.bf16_expert_grads=true \
      --set gradient_accumulation_steps=1 --set "train.out_dir=\"$work/one\"" \
      >"$work/mismatch.log" 2>&1
    rc=$?
    grep '^error' "$work/mismatch.log" | sort -u
    [ "$rc" = 2 ] || { cat "$work/mismatch.log"; fail "bf16 expert gradients on 2 ranks: exit $rc, not 2"; }
    grep -q "^error: config train.bf16_expert_grads: needs one process .* got 2 ranks" \
      "$work/mismatch.log" || fail "no message naming train.bf16_expert_grads"
    ;;
  stop)
    # SIGUSR1 to rank 1 alone: both ranks stop after the same step (rank 0 learns it from the
    # per-step exchange), the step's checkpoint holds both ranks' state, every rank exits 138
    # (128 + 10), and the run resumes from it on 2 ranks
    cmd=("${launch[@]}" -np 2 "$bin" train "${common[@]}" --set train.max_steps=100000
      --set scheduler.params.total_num_steps=100000 --set "train.out_dir=\"$work/stop\""
      --set gradient_accumulation_steps=1 --set train.log_interval=1 --set train.save_interval=0
      --set train.save_at_end=true)
    timeout -k 5 120 "${cmd[@]}" >"$work/stop.log" 2>&1 &
    job=$!
    target=$(rank1_pid "$work/stop") || { kill "$job"; fail "rank 1 not found"; }
    kill -USR1 "$target"
    wait "$job"
    rc=$?
    tail -5 "$work/stop.log"
    echo "exit $rc"
    [ "$rc" -eq 138 ] || fail "exit $rc, expected 138 (128 + SIGUSR1)"
    line=$(grep -m1 "^stopped by SIGUSR1 after step" "$work/stop.log") || fail "no stop line"
    n=$(sed 's/^stopped by SIGUSR1 after step \([0-9]*\).*/\1/' <<<"$line")
    step_dir=$(printf "%s/stop/step_%08d" "$work" "$n")
    for f in DONE rank_00000.state rank_00001.state model.safetensors; do
      [ -f "$step_dir/$f" ] || fail "$step_dir lacks $f"
    done
    grep -q "^saved $step_dir" "$work/stop.log" || fail "no 'saved $step_dir' line"
    timeout -k 5 120 "${launch[@]}" -np 2 "$bin" train "${common[@]}" \
      --set scheduler.params.total_num_steps=100000 --set "train.out_dir=\"$work/stop\"" \
      --set gradient_accumulation_steps=1 --set train.max_steps=$((n + 2)) --resume auto \
      >"$work/stop2.log" 2>&1 || { cat "$work/stop2.log"; fail "the resume exited $?"; }
    grep -q "resumed from $step_dir at step $n" "$work/stop2.log" || fail "not resumed at step $n"
    grep -q "^done: $((n + 2)) steps" "$work/stop2.log" || fail "the resume did not finish"
    ;;
  kill)
    cmd=("${launch[@]}" -np 2 "$bin" train "${common[@]}" --set train.max_steps=100000
      --set "train.out_dir=\"$work/kill\"" --set gradient_accumulation_steps=1
      --set train.log_interval=1 --set train.save_at_end=false)
    timeout -k 5 120 "${cmd[@]}" >"$work/kill.log" 2>&1 &
    job=$!
    victim=$(rank1_pid "$work/kill") || { kill "$job"; fail "rank 1 not found"; }
    start=$(date +%s.%N)
    kill -KILL "$victim"
    wait "$job"
    rc=$?
    elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    cat "$work/kill.log" | tail -20
    echo "exit $rc after $elapsed s"
    [ "$rc" -ne 0 ] || fail "the job exited 0"
    # (137 here is mpirun passing on rank 1's SIGKILL; a hang shows as 124 and the time)
    [ "$rc" -ne 124 ] || fail "the job hung until timeout(1) killed it"
    grep -Eq "exited on signal 9|did not complete within|rank 1.*(Killed|signal)" "$work/kill.log" ||
      fail "no message names the dead rank"
    awk -v e="$elapsed" 'BEGIN { exit !(e < 30) }' || fail "took $elapsed s"
    ;;
  diverged)
    # lr 1e300: the first update makes the weights non-finite; the save at step 1 meets it on
    # rank 0 (which writes the weights), and rank 1 learns it from the save's exchange of
    # outcomes instead of waiting in its barrier until mpirun ends the job
    start=$(date +%s.%N)
    timeout -k 5 60 "${launch[@]}" -np 2 "$bin" train "${common[@]}" \
      --set optimizer.params.lr=1e300 --set gradient_accumulation_steps=1 \
      --set train.save_interval=1 --set "train.out_dir=\"$work/diverged\"" \
      >"$work/diverged.log" 2>&1
    rc=$?
    elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    grep "error" "$work/diverged.log"
    echo "exit $rc after $elapsed s"
    [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "exit $rc (124: the job hung)"
    grep -q "error: the weights became non-finite at step 1 (.* holds a non-finite value" \
      "$work/diverged.log" || fail "rank 0 does not name the tensor"
    grep -q "error: the weights became non-finite at step 1 (checkpoint .*: rank 0 found a weight that is not finite" \
      "$work/diverged.log" || fail "rank 1 does not say that rank 0 found a non-finite weight"
    [ -z "$(ls -A "$work/diverged" | grep step_)" ] || fail "a checkpoint was published"
    ;;
  *) fail "unknown mode $mode" ;;
esac
echo "ok: $mode $np"
