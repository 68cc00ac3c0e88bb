# shellcheck shell=bash
# Summary lines shared by the device call scripts (device_session.sh, device_quick.sh); sourced.
# last_tok LOG: the tokens/s of a moe-train log's last logged interval ("" without one).
last_tok() { grep -o 'tok/s [0-9]*' "$1" 2>/dev/null | tail -1 | awk '{print $2}'; }
# mod_ratio_line PLAIN_LOG MOD_LOG: the MoD bar's line, the MoD step's time over the plain one's.
mod_ratio_line() {
  local plain mod
  plain=$(last_tok "$1") mod=$(last_tok "$2")
  echo "== MoD (moe-small, model.mod.enabled): ${mod:-?} tok/s against ${plain:-?}: a step in" \
    "$(awk -v a="${plain:-0}" -v b="${mod:-0}" 'BEGIN {if (a > 0 && b > 0) printf "%.3f", a / b; else print "?"}')x" \
    "the time (bar 0.65x)"
}
# profile_table LOG [ROWS]: the --profile table's first ROWS lines (default 16).
profile_table() { sed -n '/profile:/,/total/p' "$1" 2>/dev/null | head -"${2:-16}"; }
# source_id: a fingerprint of the sources the build reads (CMake files, configs, include,
# kernels, src, tests), to tie a device call's figures to a tree: the device copy's `git
# rev-parse HEAD` can name an older base than the tree it was given. Run `source
# scripts/device_summary.sh; source_id` here to compare.
source_id() {
  find CMakeLists.txt configs include kernels src tests -type f 2>/dev/null | LC_ALL=C sort |
    xargs cat 2>/dev/null | sha1sum | cut -c1-12
}
