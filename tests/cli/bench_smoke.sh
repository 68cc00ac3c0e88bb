#!/usr/bin/env bash
# `moe-train bench` on the CPU at configs/tiny.json's shapes: every kernel family gets a row with a
# time and a roofline fraction, an expert-load skew above E - 1 is capped (E = 4 here), and
# --family keeps only the families named (and the references) and rejects a name that starts
# none.
# Usage: bench_smoke.sh MOE_TRAIN_BINARY SOURCE_DIR
set -u
bin=$1
src=$2
out=$(OMP_NUM_THREADS=1 "$bin" bench --config "$src/configs/tiny.json" --device cpu --iters 1 \
  --skew 0 --skew 10 2>&1)
code=$?
failures=0
if [ "$code" -ne 0 ]; then
  echo "FAIL bench exited $code: $out"
  exit 1
fi
for family in copy dense_gemm dense_gemm_bwd router router_topk permute combine grouped_gemm grouped_gemm_bwd \
  grouped_swiglu grouped_swiglu_gathered grouped_swiglu_bwd swiglu rmsnorm attention_fwd attention_bwd mod_select mod_select_2op mod_select_scores mod_gather mod_scatter cross_entropy_fwd \
  cross_entropy_bwd adamw linear_qkv linear_qkv_bwd embedding_bwd; do
  if ! grep -Eq "^$family +.+ [0-9.]+%" <<<"$out"; then
    echo "FAIL no row for $family"
    failures=$((failures + 1))
  fi
done
grep -q "maxvio 0 " <<<"$out" || { echo "FAIL no balanced grouped_gemm row"; failures=$((failures + 1)); }
grep -q "maxvio 3 " <<<"$out" || { echo "FAIL skew 10 not capped to E-1 = 3"; failures=$((failures + 1)); }
# --family: only the named families, plus the references they are set against
out=$(OMP_NUM_THREADS=1 "$bin" bench --config "$src/configs/tiny.json" --device cpu --iters 1 \
  --family attention 2>&1)
rows=$(grep -Ec "^[a-z_]+ +.+ [0-9.]+%" <<<"$out")
for family in copy dense_gemm dense_gemm_bwd attention_fwd attention_bwd; do
  grep -Eq "^$family +.+ [0-9.]+%" <<<"$out" || { echo "FAIL --family: no row for $family"; failures=$((failures + 1)); }
done
[ "$rows" -eq 5 ] || { echo "FAIL --family attention gave $rows rows: $out"; failures=$((failures + 1)); }
# a --family that starts no family is an error naming it (it used to time the references alone)
out=$("$bin" bench --config "$src/configs/tiny.json" --device cpu --family attention --family nope 2>&1)
code=$?
if [ "$code" -ne 2 ] || ! grep -q -- '--family: "nope" starts no family; the families are: copy' <<<"$out"; then
  echo "FAIL --family nope: exit $code: $out"
  failures=$((failures + 1))
fi
out=$("$bin" bench --config "$src/configs/tiny.json" --iters 0 2>&1)
[ $? -eq 2 ] || { echo "FAIL --iters 0 accepted: $out"; failures=$((failures + 1)); }
[ "$failures" -eq 0 ] && echo "bench smoke test passed"
exit "$failures"
