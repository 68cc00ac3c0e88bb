#!/usr/bin/env bash
# Starts N ranks of a command on this node with mpirun (one rank per GPU on a GPU node; CPU ranks
# otherwise). Each rank finds its rank / local rank in mpirun's OMPI_COMM_WORLD_* variables.
#   scripts/launch.sh -n 4 -- build/moe-train train --config configs/tiny.json
#   scripts/launch.sh -n 2 --bind numa -- build/moe-train train --config cfg.json --set ...
#   scripts/launch.sh -n 4 --dry-run -- build/moe-train ...    print the mpirun line only
# Flags it adds (Open MPI): --oversubscribe when N exceeds the physical cores, --allow-run-as-root as root,
# --bind-to none (default; --bind numa maps and binds ranks by NUMA domain instead).
# Environment it sets for the ranks unless already set:
#   NCCL_NVLS_ENABLE=0   NVLink SHARP multicast off (fails or hangs where the fabric manager does
#                        not provide it); set it to 1 to opt in
#   OMP_NUM_THREADS      cores / N (at least 1), so N ranks do not each start a thread per core
# MPIRUN=/path/to/mpirun picks another mpirun; MOE_MPIRUN_ARGS adds flags before the command.
set -euo pipefail

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
  exit 2
}

ranks="" bind=none dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    -n | -np) [ $# -ge 2 ] || usage; ranks=$2; shift 2 ;;
    --bind) [ $# -ge 2 ] || usage; bind=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage ;;
    --) shift; break ;;
    -*) echo "launch.sh: unknown flag $1" >&2; usage ;;
    *) break ;;
  esac
done
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || { echo "launch.sh: -n N (ranks, >= 1) is required" >&2; usage; }
[ $# -gt 0 ] || { echo "launch.sh: no command to launch" >&2; usage; }

MPIRUN=${MPIRUN:-mpirun}
command -v "$MPIRUN" >/dev/null || {
  echo "launch.sh: $MPIRUN not found (install Open MPI, or set MPIRUN)" >&2
  exit 2
}

export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
cores=$(nproc)
# Open MPI's default slots are physical cores (hyperthreads not counted)
slots=$(lscpu -p=Core,Socket 2>/dev/null | grep -v '^#' | sort -u | wc -l || true)
[ "${slots:-0}" -gt 0 ] || slots=$cores
threads=$((cores / ranks))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}

args=(-np "$ranks")
if "$MPIRUN" --version 2>&1 | grep -Eq "Open MPI|OpenRTE|open-mpi.org"; then
  if [ "$ranks" -gt "$slots" ]; then args+=(--oversubscribe); fi
  if [ "$(id -u)" = 0 ]; then args+=(--allow-run-as-root); fi
  case "$bind" in
    none) args+=(--bind-to none) ;;
    numa) args+=(--map-by numa --bind-to numa) ;;
    *) echo "launch.sh: --bind takes none or numa, not $bind" >&2; exit 2 ;;
  esac
  # -x: the variables travel to every rank explicitly (also to remote nodes with --host)
  args+=(-x NCCL_NVLS_ENABLE -x OMP_NUM_THREADS)
  for var in $(compgen -e | grep -E '^(NCCL_|MOE_|CUDA_VISIBLE_DEVICES$)' || true); do
    case "$var" in NCCL_NVLS_ENABLE) ;; *) args+=(-x "$var") ;; esac
  done
else
  echo "launch.sh: $MPIRUN is not Open MPI: launching with -np only (no binding flags)" >&2
fi
# shellcheck disable=SC2206  # MOE_MPIRUN_ARGS is a list of flags, split on spaces on purpose
args+=(${MOE_MPIRUN_ARGS:-})

if [ "$dry_run" = 1 ]; then
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE OMP_NUM_THREADS=$OMP_NUM_THREADS $MPIRUN ${args[*]} $*"
  exit 0
fi
exec "$MPIRUN" "${args[@]}" "$@"
