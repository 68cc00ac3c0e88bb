# What the command-line tests share (sourced, not a test itself: tests/CMakeLists.txt runs
# tests/cli/*.sh only). The caller sets bin (the moe-train binary) and failures=0.

# fail MESSAGE: one failed case.
fail() {
  echo "FAIL $*"
  failures=$((failures + 1))
}

# expect_error NAME EXPECTED_SUBSTRING ARGS...: moe-train ARGS exits with code 2 and one short
# message (at most 3 lines) holding the substring.
expect_error() {
  local name=$1 want=$2
  shift 2
  local out code
  out=$("$bin" "$@" 2>&1)
  code=$?
  if [ "$code" -ne 2 ]; then
    fail "$name: exit code $code, expected 2. Output: $(tail -3 <<<"$out")"
  elif ! grep -qF -- "$want" <<<"$out"; then
    fail "$name: message lacks '$want'. Output: $(tail -3 <<<"$out")"
  elif [ "$(grep -c . <<<"$out")" -gt 3 ]; then
    fail "$name: expected one short message, got: $out"
  else
    echo "ok   $name: $out"
  fi
}
