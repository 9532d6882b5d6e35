# Shared by the command-line tests (sourced); failures set `fail=1`.

# `check CONDITION WHAT` evaluates CONDITION and records a failure naming WHAT
# unless it holds.
check() { if ! eval "$1"; then echo "FAIL: $2"; fail=1; fi; }

# `expect_error ARGS...` runs "$bin" ARGS and records a failure unless it
# exits 2 with exactly one "deepseek: error:" line on stderr.
expect_error() {
  local err rc
  err=$("$bin" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -ne 2 ]; then echo "FAIL: deepseek $* exited $rc, want 2"; fail=1; fi
  if [ "$(printf '%s\n' "$err" | wc -l)" -ne 1 ] || [[ "$err" != deepseek:\ error:* ]]; then
    echo "FAIL: deepseek $* stderr is not one 'deepseek: error:' line: $err"; fail=1
  fi
}

# `served_port LOG [TRIES]` prints the port `deepseek serve` says (in LOG) it
# listens on, waiting up to TRIES x 50 ms (default 200); nothing if it never does.
served_port() {
  local port=""
  for _ in $(seq "${2:-200}"); do
    port=$(grep -o '127.0.0.1:[0-9]*' "$1" | head -1 | cut -d: -f2)
    [ -n "$port" ] && break
    sleep 0.05
  done
  echo "$port"
}

# `logits_of MODEL OUT [ARGS...]` writes `deepseek logits` of the token file
# $toks to OUT, reading MODEL from one fixed path ($tmp/same): the logits
# file names its model folder, so two folders compare byte for byte.
logits_of() {
  rm -rf "$tmp/same" && cp -r "$1" "$tmp/same" &&
    "$bin" logits --model "$tmp/same" --tokens "$toks" --out "$2" "${@:3}" >/dev/null 2>&1
}
