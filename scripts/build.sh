#!/usr/bin/env bash
# Configures and builds moe-train into ./build (or $BUILD_DIR).
#   scripts/build.sh                 CUDA when nvcc is found (archs 75;80;90), else CPU only
#   scripts/build.sh --cpu           CPU only
#   scripts/build.sh --arch sm_75    CUDA for one card (sm_75 T4, sm_80 A100, sm_90 H100/H200)
#   scripts/build.sh --asan          CPU only, AddressSanitizer + UBSan, Debug (into build-asan)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
args=(-DCMAKE_BUILD_TYPE=Release)
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) args+=(-DMOE_CUDA=OFF) ;;
    --arch) shift; args+=(-DMOE_CUDA=ON "-DMOE_CUDA_ARCHS=${1#sm_}") ;;
    --asan) BUILD_DIR=${BUILD_DIR/%build/build-asan}
            args=(-DCMAKE_BUILD_TYPE=Debug -DMOE_CUDA=OFF -DMOE_SANITIZE=ON) ;;
    *) echo "build.sh: unknown flag $1 (see the comment at the top)" >&2; exit 2 ;;
  esac
  shift
done
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S . -B "$BUILD_DIR" "${generator[@]}" "${args[@]}"
# nproc obeys OMP_NUM_THREADS, which a caller may have set for its runs: count the cores without it.
cmake --build "$BUILD_DIR" -j "$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
