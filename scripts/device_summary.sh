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
