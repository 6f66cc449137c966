#!/usr/bin/env bash
# Settles whether compute-sanitizer's initcheck reports on ember's kernels that read what a
# cuBLASLt product wrote are real: the uninitialized reads the full sanitize.sh run found begin
# in unary_gelu_tanh_bf16, reading a block cuBLASLt's GEMM wrote, and Hopper's GEMM kernels
# store their output with TMA (cp.async.bulk.tensor), which initcheck may not track.
#
#   scripts/initcheck-probe.sh TEST_BINARY [-o LOGDIR]
#
# TEST_BINARY  ember-core's integration test binary (tests/it, e.g. .gpu/bin/it-0123abcd of
#              a ../shared/tools/gpu-bundle bundle), holding the two ignored tests
#              cuda_matmul::initcheck_probe_gelu_tanh_of_a_fresh_bf16_matmul_output and
#              cuda_matmul::initcheck_probe_gelu_tanh_of_a_prefilled_bf16_matmul_output: a bf16
#              matmul through the normal API, then gelu_tanh of its output; in the first the
#              output block is fresh (only the GEMM wrote it), in the second a plain fill of
#              ember's wrote it first. Both check the result against the CPU, so the GEMM did
#              write the block.
# -o LOGDIR    where the logs go (default initcheck-probe-logs): LOGDIR/CASE.log (the tool's
#              report), LOGDIR/CASE.out (the test's output), LOGDIR/summary.txt.
#
# Each test runs alone in its own process, first without the tool (to fill the kernel cache),
# then under `compute-sanitizer --tool initcheck`, with the environment of sanitize.sh
# (CUDA_TESTS_REQUIRED=1, EMBER_KERNEL_PREFETCH=0, EMBER_KERNEL_CACHE=LOGDIR/kernel-cache unless
# set) and EMBER_SANITIZER_PREFILL=0 (products do not zero their output first under the tool).
# EMBER_INITCHECK_SHAPE=m,k,n changes the product's shape (default 1024,768,3072: GPT-2's MLP
# over 1,024 tokens). COMPUTE_SANITIZER as in sanitize.sh.
#
# Output: per case the number of errors and the kernels the reports are in, then a verdict:
#   fresh reported, prefilled clean  -> initcheck does not see the GEMM's stores: a false
#                                       positive (exclude nothing of ember's for it; say so)
#   both clean                       -> this shape does not reproduce the report
#   prefilled reported               -> not explained by untracked GEMM stores: read the logs
# The exit status is 0 when the verdict is one of the first two, 1 otherwise, 2 on bad usage.
set -uo pipefail

logdir=initcheck-probe-logs
binary=
while [ $# -gt 0 ]; do
  case "$1" in
    -o) logdir="$2"; shift 2 ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    -*) echo "initcheck-probe.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    *) binary="$1"; shift ;;
  esac
done
if [ -z "$binary" ] || [ ! -x "$binary" ]; then
  echo "initcheck-probe.sh: give ember-core's test binary (try --help)" >&2
  exit 2
fi

sanitizer=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
if [ ! -x "$sanitizer" ]; then
  sanitizer=$(command -v compute-sanitizer) || {
    echo "initcheck-probe.sh: no compute-sanitizer at /usr/local/cuda/bin or on PATH (set COMPUTE_SANITIZER)" >&2
    exit 2
  }
fi

mkdir -p "$logdir"
logdir=$(cd "$logdir" && pwd)
# The products' own zeroing under the tool (Note [Library outputs under initcheck] in
# ember-core's cuda_backend/mod.rs) would hide what this probe looks for: off.
export CUDA_TESTS_REQUIRED=1 EMBER_KERNEL_PREFETCH=0 EMBER_SANITIZER_PREFILL=0
export EMBER_KERNEL_CACHE=${EMBER_KERNEL_CACHE:-$logdir/kernel-cache}
summary="$logdir/summary.txt"
: > "$summary"
"$sanitizer" --version | tail -1 | tee -a "$summary"
echo "shape: ${EMBER_INITCHECK_SHAPE:-1024,768,3072} (m,k,n)" | tee -a "$summary"

# The kernels named in a report's "at KERNEL+0x..." lines, most reported first.
kernels_of() {
  # Device-side reports name the kernel ("at kernel+0x..."); host-side ones the API ("on access
  # by cudaMemcpy source").
  sed -n -e 's/^=========  *at \([^+ ]*\)+0x.*/\1/p' -e 's/.* on access by \(.*\)$/\1/p' "$1" |
    tr ' ' '_' | sort | uniq -c | sort -rn | head -5 |
    awk '{ printf "%s%s (%d)", (NR > 1 ? ", " : ""), $2, $1 }'
}

declare -A errors
for case in fresh prefilled; do
  test=cuda_matmul::initcheck_probe_gelu_tanh_of_a_${case}_bf16_matmul_output
  args=(--exact "$test" --include-ignored --nocapture --test-threads=1)
  # The plain run: fills the kernel cache and shows the test passes without the tool.
  if ! "$binary" "${args[@]}" > "$logdir/$case.plain.out" 2>&1; then
    echo "$case: the test fails without the tool (output in $logdir/$case.plain.out)" | tee -a "$summary"
    exit 1
  fi
  "$sanitizer" --tool initcheck --error-exitcode 86 --print-limit 100 \
    --log-file "$logdir/$case.log" "$binary" "${args[@]}" > "$logdir/$case.out" 2>&1
  status=$?
  # One "ERROR SUMMARY: N errors" a process; the "N errors were not printed" line is not a count.
  e=$(grep -v "not printed" "$logdir/$case.log" | sed -n 's/.*ERROR SUMMARY: \([0-9][0-9]*\) error.*/\1/p' | awk '{ s += $1 } END { print s + 0 }')
  errors[$case]=$e
  line="$case: $e errors"
  [ "$e" -gt 0 ] && line="$line, in $(kernels_of "$logdir/$case.log")"
  if [ "$status" != 0 ] && ! { [ "$status" = 86 ] && [ "$e" -gt 0 ]; }; then
    line="$line; the run failed (exit status $status, output in $logdir/$case.out)"
    errors[$case]=failed
  fi
  echo "$line" | tee -a "$summary"
done

if [ "${errors[prefilled]}" = 0 ] && [ "${errors[fresh]}" != 0 ] && [ "${errors[fresh]}" != failed ]; then
  verdict="false positive: the same reads are clean when a fill wrote the block first, and the values are the GEMM's, so initcheck does not see the GEMM's stores"
  status=0
elif [ "${errors[prefilled]}" = 0 ] && [ "${errors[fresh]}" = 0 ]; then
  verdict="no report from this shape: try EMBER_INITCHECK_SHAPE (m,k,n) of the failing program"
  status=0
else
  verdict="not explained by untracked GEMM stores: read $logdir/*.log"
  status=1
fi
echo "verdict: $verdict" | tee -a "$summary"
exit $status
