#!/usr/bin/env bash
# Installs the system packages moe-train builds against (Debian 12 / Ubuntu 22.04+).
# CUDA, cuBLAS and NCCL are optional and not installed here: the build finds them when present.
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  build-essential cmake pkg-config ninja-build \
  libcli11-dev nlohmann-json3-dev libspdlog-dev libfmt-dev catch2 \
  libopenblas-dev libopenmpi-dev openmpi-bin \
  libsentencepiece-dev sentencepiece fortunes-min fortunes \
  python3 python3-matplotlib jq >/dev/null
echo "setup.sh: packages installed"
