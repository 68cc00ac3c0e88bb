#!/usr/bin/env bash
# Installs dependencies, builds and runs the test suite (what CI runs):
#   1. the CPU build and every CPU test (GPU tests are not built there);
#   2. when nvcc is present, the CUDA sources compiled for sm_75 and sm_90 (no GPU needed);
#      their GPU tests run (or report "skipped" without a GPU);
#   3. the unit tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
#   scripts/test.sh --fast     step 1 only
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${MOE_SKIP_SETUP:-0}" != 1 ]; then scripts/setup.sh; fi
# ctest runs two tests at once on two cores: one OpenMP thread each (the tests that check
# thread-count independence set their thread counts themselves). Only ctest gets it: nproc obeys
# it, and the builds would run on one core.
omp=${OMP_NUM_THREADS:-1}
BUILD_DIR=build scripts/build.sh --cpu
OMP_NUM_THREADS=$omp ctest --test-dir build --output-on-failure -j 2
if [ "${1:-}" = "--fast" ]; then exit 0; fi
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  PATH=$PATH:/usr/local/cuda/bin
  cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON -DMOE_CUDA_ARCHS="75;90" \
    $(command -v ninja >/dev/null && echo -G Ninja)
  # the binary and the GPU tests: every CUDA source, and the CPU sources linked with it
  gpu_tests=$(ls tests/test_gpu_*.cpp | xargs -n1 basename | sed 's/\.cpp$//')
  cmake --build build-cuda -j "$(nproc)" --target moe-train $gpu_tests
  OMP_NUM_THREADS=$omp ctest --test-dir build-cuda --output-on-failure -L gpu
fi
BUILD_DIR=build-asan scripts/build.sh --asan
OMP_NUM_THREADS=$omp ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j 2 -LE slow
