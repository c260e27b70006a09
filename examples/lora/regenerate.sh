#!/usr/bin/env bash
# Regenerates the planner outputs stored next to each example, or checks that
# they are current:  examples/lora/regenerate.sh path/to/leanstep [--check]
#
#   <name>.args            arguments of `leanstep lora plan` (one line)
#   <name>.out             its readable output
#   <a>--vs--<b>.diff.out  `leanstep lora diff` of the two plans (--json) and its exit status
set -euo pipefail
bin=$(realpath "$1")
mode=${2:-write}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"  # the .args name configs relative to the repository root
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# name of a diff output -> the two example names it compares
diffs=(
  "qwen3-omni.explicit qwen3-omni.all-linear"
  "qwen3-omni.all-linear qwen3-omni.all-linear.scope-all"
  "qwen3-omni.explicit qwen3-omni.no-linear-proj"
  "qwen3.5.explicit qwen3.5.all-linear"
  "qwen3.5.attention-mlp-only qwen3.5.all-linear"
)

mkdir -p "$work/out"
for args in "$here"/*.args; do
  name=$(basename "$args" .args)
  # shellcheck disable=SC2046
  "$bin" lora plan $(cat "$args") > "$work/out/$name.out"
  "$bin" lora plan $(cat "$args") --json > "$work/$name.json"
done
for pair in "${diffs[@]}"; do
  read -r a b <<< "$pair"
  status=0
  (cd "$work" && "$bin" lora diff --max-lines 12 "$a.json" "$b.json") > "$work/out/$a--vs--$b.diff.out" || status=$?
  echo "exit status: $status" >> "$work/out/$a--vs--$b.diff.out"
done

if [[ "$mode" == "--check" ]]; then
  stale=0
  for f in "$work"/out/*.out; do
    if ! diff -u "$here/$(basename "$f")" "$f"; then stale=1; fi
  done
  if [[ $stale -ne 0 ]]; then
    echo "examples/lora outputs are stale: run examples/lora/regenerate.sh <leanstep>" >&2
    exit 1
  fi
  echo "examples/lora outputs are current"
else
  cp "$work"/out/*.out "$here/"
  echo "wrote $(ls "$work"/out | wc -l) outputs to examples/lora"
fi
