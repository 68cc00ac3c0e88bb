#!/usr/bin/env bash
# On a GPU machine: the working tree against a base in one call, the two binaries alternated so
# that the machine's drift (ours moves ~4% between machines) falls on both alike. Builds moe-train
# from the tree as it is ("new"), then with PATCH reversed ("base"), then puts PATCH back; runs
# each COMMAND (moe-train's arguments) ROUNDS times per variant, new and base in turn, and prints
# one line per run: the variant, the command's number, and for `train` the last logged tok/s and
# loss, for anything else the output lines matching GREP (the bench's rows by default).
#   git diff BASE > peers/ab.patch            (here, into a folder the device call carries)
#   scripts/device_ab.sh peers/ab.patch 'train --config configs/moe-small.json' \
#     'bench --config configs/moe-small.json --family attention'
# With --env SETTINGS instead of PATCH, the variants are environment settings of one binary
# built from the tree (a kernel switch read at run time): SETTINGS is NAME=VALUE words separated
# by spaces, each word a variant, run in the order given:
#   scripts/device_ab.sh --env 'MOE_GROUPED_SM90=pingpong MOE_GROUPED_SM90=256' \
#     'train --config configs/moe-fine.json'
# Environment: ROUNDS (2), GREP ('TFLOP/s|GB/s'), BUILD_DIR (build-gpu-sm90), CMAKE_ARGS (the
# sm_90 recipe of ../shared/GPU.md), RUN_TIMEOUT (300 s a run), OUT (/tmp/ab: logs). A
# command's environment settings go before the script (they apply to both variants). A COMMAND
# is split on whitespace: an argument cannot hold a space or quotes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
usage="usage: scripts/device_ab.sh PATCH|--env SETTINGS COMMAND... (PATCH: a readable file of git diff output)"
settings=()
if [ "${1:-}" = --env ]; then
  [ $# -ge 3 ] || { echo "$usage" >&2; exit 2; }
  read -r -a settings <<<"$2"
  for s in "${settings[@]}"; do
    [[ "$s" =~ ^[A-Za-z_][A-Za-z0-9_]*=.*$ ]] || { echo "not a NAME=VALUE setting: $s" >&2; exit 2; }
  done
  shift 2
else
  if [ $# -lt 2 ] || [ ! -f "$1" ]; then
    echo "$usage" >&2
    exit 2
  fi
  if ! grep -q '^@@' "$1"; then
    echo "$1 holds no change: both variants would be the same" >&2
    exit 2
  fi
  patch_file=$(realpath "$1")
  shift
fi
build=${BUILD_DIR:-build-gpu-sm90}
OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT/bin"
read -r -a cmake_args <<<"${CMAKE_ARGS:--DMOE_CUDA=ON -DMOE_CUDA_ARCHS=90}"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)

# build VARIANT: moe-train from the tree as it stands, copied to $OUT/bin/VARIANT; on failure
# the tail of the log of the step that failed.
build_variant() {
  if cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${cmake_args[@]}" >"$OUT/$1.cmake.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" --target moe-train >"$OUT/$1.build.log" 2>&1 &&
    cp "$build/moe-train" "$OUT/bin/$1"; then
    return 0
  fi
  local log="$OUT/$1.build.log"
  [ -f "$log" ] || log="$OUT/$1.cmake.log"
  echo "$1: build failed ($log)" >&2
  tail -20 "$log" >&2
  return 1
}
build_variant new || exit 1
if [ ${#settings[@]} = 0 ]; then
  if ! patch -R -p1 --quiet <"$patch_file"; then
    echo "the patch does not reverse onto this tree: $patch_file" >&2
    exit 1
  fi
  build_variant base
  built=$?
  patch -p1 --quiet <"$patch_file" || { echo "could not put the patch back" >&2; exit 1; }
  [ $built = 0 ] || exit 1
  variants=(new base)
else
  variants=("${settings[@]}")
fi

for round in $(seq 1 "${ROUNDS:-2}"); do
  i=0
  for cmd in "$@"; do
    i=$((i + 1))
    for variant in "${variants[@]}"; do
      tag=${variant//[^A-Za-z0-9_.-]/_}  # (a setting's = and / in file names)
      log="$OUT/run.$round.$i.$tag.log"
      read -r -a args <<<"$cmd"
      if [ "${args[0]}" = train ]; then
        args+=(--set "train.out_dir=\"$OUT/run-$tag\"")
      fi
      if [ ${#settings[@]} = 0 ]; then
        timeout "${RUN_TIMEOUT:-300}" "$OUT/bin/$variant" "${args[@]}" >"$log" 2>&1
      else
        env "$variant" timeout "${RUN_TIMEOUT:-300}" "$OUT/bin/new" "${args[@]}" >"$log" 2>&1
      fi
      rc=$?
      if [ "${args[0]}" = train ]; then
        echo "$variant #$i rc=$rc $(grep -o 'tok/s [0-9]*' "$log" | tail -1)" \
          "$(grep -o 'loss [0-9.]*' "$log" | tail -1)"
      else
        grep -E "${GREP:-TFLOP/s|GB/s}" "$log" | sed "s/^/$variant #$i rc=$rc | /"
      fi
    done
  done
done | tee "$OUT/summary.txt"
