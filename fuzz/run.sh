#!/usr/bin/env bash
# Builds the fuzz targets with libFuzzer's coverage instrumentation on a stable toolchain and
# runs each for SECONDS (default 30) from its checked-in seed corpus (corpus/TARGET). New inputs
# go to a scratch folder, so the checked-in corpus is left as it is; a crash, a hang (-timeout)
# or an oversized allocation stops the target, leaves the input in artifacts/TARGET/ and fails
# the script.
#
# Usage: fuzz/run.sh [SECONDS] [TARGET...]   (all targets when none is named)
#        fuzz/run.sh --seeds                  (rewrites corpus/ with ember's writers: make_seeds)
#
# cargo-fuzz adds the same instrumentation (and AddressSanitizer, which needs a nightly
# toolchain or RUSTC_BOOTSTRAP=1); the stable flags below need neither: the coverage passes
# and -Cllvm-args are stable options, and safe Rust needs no address checks.
set -euo pipefail
cd "$(dirname "$0")"
all=(safetensors state_dict checkpoint idx pickle memviz store dcp)
if [ "${1:-}" = --seeds ]; then
  targets=(make_seeds)
else
  secs=${1:-30}
  shift || true
  # libFuzzer reads -max_total_time=0 as "no limit".
  [[ "$secs" =~ ^[1-9][0-9]*$ ]] || { echo "fuzz/run.sh: SECONDS must be a positive integer, got $secs" >&2; exit 2; }
  targets=("${@:-${all[@]}}")
fi

export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
export CARGO_TARGET_DIR=${FUZZ_TARGET_DIR:-$PWD/target}
# With --target, RUSTFLAGS reach only the targets' code, not build scripts and proc macros
# (which have no libFuzzer to link against).
host=$(rustc -vV | sed -n 's/^host: //p')
bins=()
for t in "${targets[@]}"; do bins+=(--bin "$t"); done
cargo build --release --locked --target "$host" "${bins[@]}"
if [ "${targets[0]}" = make_seeds ]; then
  exec "$CARGO_TARGET_DIR/$host/release/make_seeds"
fi

status=0
for t in "${targets[@]}"; do
  scratch=$(mktemp -d)
  mkdir -p "artifacts/$t"
  echo "== fuzz $t for ${secs}s (seed corpus: $(ls "corpus/$t" | wc -l) files)"
  # The words of the format, for mutations that keep a header's JSON or a snapshot's keys.
  case $t in
    safetensors | state_dict | checkpoint | dcp) dict=(-dict=dicts/safetensors.dict) ;;
    pickle | memviz) dict=(-dict=dicts/pickle.dict) ;;
    *) dict=() ;;
  esac
  # -timeout: one input running longer than 10 s is a hang; -rss_limit_mb: the process's memory.
  if ! "$CARGO_TARGET_DIR/$host/release/$t" "$scratch" "corpus/$t" "${dict[@]}" \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="artifacts/$t/" 2>"$scratch.log"; then
    tail -n 40 "$scratch.log"
    echo "fuzz $t FAILED: the input is in fuzz/artifacts/$t/"
    status=1
  else
    grep -E '^stat::(number_of_executed_units|peak_rss_mb)|^Done|INITED' "$scratch.log" || true
  fi
  rm -rf "$scratch" "$scratch.log"
done
exit $status
