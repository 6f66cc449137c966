#!/usr/bin/env bash
# Runs every example of crates/ember/examples/ and says which passed.
#
#   scripts/run-examples.sh        builds the examples as the workspace build does (CI's
#                                  `cargo build --workspace --all-targets` has made them: nothing
#                                  is rebuilt), then runs each binary of target/debug/examples
#   scripts/run-examples.sh DIR    runs the prebuilt binaries DIR/NAME instead (on a GPU machine,
#                                  the unpacked release binaries of ../shared/tools/gpu-bundle:
#                                  scripts/run-examples.sh .gpu/bin)
#
# The names come from crates/ember/examples/*.rs. Each run is limited to EXAMPLE_TIMEOUT seconds
# (default 120) and prints `=== NAME ok (X s)` or `=== NAME FAILED ...`; a summary line closes,
# and the exit status is non-zero when any example failed, timed out or is missing from DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:-}
limit=${EXAMPLE_TIMEOUT:-120}
names=()
for f in crates/ember/examples/*.rs; do
  names+=("$(basename "$f" .rs)")
done

if [ -z "$dir" ]; then
  # One build up front, so that no example's time limit is spent compiling. With the whole
  # workspace selected, as in CI's build: `-p ember` alone resolves the dependencies' features
  # differently, rebuilding them and relinking every example a second time.
  cargo build -q --workspace --examples || { echo "examples: the build failed"; exit 1; }
  target=$(cargo metadata -q --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
  dir="$target/debug/examples"
fi

now() { date +%s.%N; }
failed=()
for name in "${names[@]}"; do
  cmd=("$dir/$name")
  if [ ! -x "$dir/$name" ]; then
    echo "=== $name FAILED (no executable $dir/$name)"
    failed+=("$name")
    continue
  fi
  echo "--- $name"
  start=$(now)
  timeout "$limit" "${cmd[@]}"
  status=$?
  secs=$(awk -v a="$start" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
  if [ "$status" = 0 ]; then
    echo "=== $name ok ($secs s)"
  elif [ "$status" = 124 ]; then
    echo "=== $name FAILED (timed out after $limit s)"
    failed+=("$name")
  else
    echo "=== $name FAILED (exit status $status, $secs s)"
    failed+=("$name")
  fi
done

passed=$((${#names[@]} - ${#failed[@]}))
if [ ${#failed[@]} = 0 ]; then
  echo "examples: all $passed passed"
else
  echo "examples: $passed passed, ${#failed[@]} failed: ${failed[*]}"
  exit 1
fi
