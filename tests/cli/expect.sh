#!/usr/bin/env bash
# Runs one command and checks BOTH its exit status and its output (stdout and
# stderr together), so a CLI test cannot pass on a message printed by a command
# that exited with the wrong status.
#
#   expect.sh [--rc N|nonzero] [--match ERE]... [--no-match ERE]... [--timeout S]
#             [--setup 'shell commands'] -- COMMAND [ARGS...]
#
# Every run gets a fresh temporary directory: "@TMP@" in --setup and in the
# command's arguments is replaced by it, and --setup runs inside it. The default
# status is 0 and the default timeout 120 s (a command still running then fails).
set -u
rc_expected=0
timeout_s=120
setup=""
matches=()
no_matches=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rc) rc_expected="$2"; shift 2 ;;
    --match) matches+=("$2"); shift 2 ;;
    --no-match) no_matches+=("$2"); shift 2 ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    --setup) setup="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "expect.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "expect.sh: no command given" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
args=()
for a in "$@"; do args+=("${a//@TMP@/$tmp}"); done
if [ -n "$setup" ]; then
  (cd "$tmp" && eval "${setup//@TMP@/$tmp}") || { echo "expect.sh: setup failed: $setup" >&2; exit 1; }
fi

out="$tmp/.output"
start=$(date +%s)
timeout --kill-after=5 "$timeout_s" "${args[@]}" >"$out" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$out"
echo "---- exit status $rc after ${elapsed} s"

fail=0
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "FAIL: still running after ${timeout_s} s (killed)"; fail=1
elif [ "$rc_expected" = nonzero ]; then
  [ "$rc" -ne 0 ] || { echo "FAIL: expected a non-zero exit status, got 0"; fail=1; }
elif [ "$rc" -ne "$rc_expected" ]; then
  echo "FAIL: expected exit status $rc_expected, got $rc"; fail=1
fi
# 128 + signal: a crash is never an expected outcome.
if [ "$rc" -gt 128 ] && [ "$rc" -ne 137 ]; then echo "FAIL: killed by signal $((rc - 128))"; fail=1; fi
for re in ${matches[@]+"${matches[@]}"}; do
  grep -Eq -- "${re//@TMP@/$tmp}" "$out" || { echo "FAIL: output does not match: $re"; fail=1; }
done
for re in ${no_matches[@]+"${no_matches[@]}"}; do
  if grep -Eq -- "${re//@TMP@/$tmp}" "$out"; then echo "FAIL: output matches what it must not: $re"; fail=1; fi
done
exit $fail
