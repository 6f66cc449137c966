#!/usr/bin/env bash
# Runs NVIDIA compute-sanitizer's four tools (memcheck, racecheck, synccheck, initcheck) over
# prebuilt ember binaries on a GPU machine (no Rust toolchain needed there) and prints one line
# per tool with the errors and warnings it reported.
#
#   scripts/sanitize.sh [-t TOOLS] [-o LOGDIR] [-d BUNDLE] [-j JOBS] [--split K] [--ignored-only]
#                       [--part I/N] [--windows K:N] [--no-warm] [--exclude-vendor] [--exclude REGEX]
#                       [COMMAND ...]
#
# COMMAND   a program and its arguments as one string, split at spaces (no quoting), e.g.
#           ".gpu/bin/it-0123abcd --include-ignored --test-threads=1 cuda_" or
#           ".gpu/bin/tutorial_mlp". A libtest binary runs its ignored (GPU) tests only when
#           given --include-ignored (or --ignored).
# -d BUNDLE without COMMANDs: every test binary named in BUNDLE/tests.txt (the layout of
#           ../shared/tools/gpu-bundle: binaries in BUNDLE/bin, default .gpu) with
#           "--include-ignored --test-threads=1", a --skip for each word of $SANITIZE_SKIP and
#           $SANITIZE_TEST_ARGS, then the examples named in
#           $SANITIZE_EXAMPLES that are in BUNDLE/bin (default: tutorial_mlp tutorial_cnn
#           tutorial_lstm tutorial_transformer mixed_precision cuda_streams cuda_graphs_training
#           pinned_loader gradient_accumulation activation_checkpointing). A bundle packed as
#           BUNDLE/bin.tar.xz is unpacked first.
# --ignored-only  with -d: the test binaries run their ignored tests only (--ignored, not
#           --include-ignored): the GPU tests, without the CPU tests that launch no kernel.
# --split K with -d: each test binary runs as K processes, its tests (as its --list names them,
#           with $SANITIZE_TEST_ARGS applied) dealt round-robin into K groups run with --exact.
# SANITIZE_FIRST  words (substrings of a command) marking the slow commands: their runs, under
#           every tool, are queued before all others (so one test runs under several tools at
#           once: tests must not share files between processes).
# --part I/N  run only commands I, I+N, I+2N, ... (counting from 1, after --split): a sweep
#           too long for one device call done in N calls, each printing its own lines (add them).
# --windows K:N  each command runs K times under each tool, run w checking kernel launches
#           w*N to w*N+N-1 only (the tool's --launch-skip and --launch-count; the last run checks
#           every launch from (K-1)*N on) while the rest run unchecked at full speed: a program
#           too slow under a tool (racecheck over ember's sort test stopped at 507 s; its first
#           300 launches took 64 s) is checked in windows side by side. The windows cover every
#           launch when the program's launch sequence repeats from run to run. Not with
#           initcheck (refused): memory written outside a window is unseen by it, and it checks
#           copies in every run, windowed or not. Racecheck's windows after the first can fail
#           where the whole run does not: over mixed_precision, the three from launch 2500 on
#           ended in "failed to handle a hardware exception" within 6 s, while racecheck over
#           the whole program ran clean in 21 s (session 55). Try the whole run first.
# -j JOBS   run up to JOBS processes at once (default 1), the plain runs and then every tool's
#           runs from one queue, in the order of -t: one GPU runs many sanitized processes side
#           by side, since the tools spend most of their time on the host (16 cores: -j 12).
# -t TOOLS  comma-separated subset of memcheck,racecheck,synccheck,initcheck (default all four).
# -o LOGDIR where each tool's logs go (default sanitize-logs): LOGDIR/TOOL-N.PID.log per
#           process, LOGDIR/TOOL-N.out the program's own output; LOGDIR/summary.txt the lines below.
# --no-warm skip the first plain run of each command (it fills the kernel cache, so that no
#           kernel is compiled under a tool, and shows which commands fail without one).
# --exclude-vendor  leave the vendor libraries' kernels unchecked: those whose (mangled) name
#           matches $SANITIZE_VENDOR_KERNELS, default
#           cudnn|xmma|cutlass|nvjet|nccl|cublas|gemm|gemv|splitKreduce|nchwToNhwc|nhwcToNchw
#           (cuDNN's generated kernels such as cudnn_generated_fort_native_sdpa_sm90_flash_*,
#           cuBLAS/cuBLASLt's sm90_xmma_*, nvjet_*, cutlass::* and gemv/gemm kernels, NCCL's
#           ncclDevKernel_*; no ember kernel matches). ember cannot fix what the tools report
#           inside them (racecheck's hazards in cuDNN's flash-attention kernels), and they are
#           the slowest to check. They still run, unchecked: for initcheck that may also leave
#           what they write unseen, so reads of it by ember's kernels can be reported
#           (scripts/initcheck-probe.sh tests this for cuBLASLt's output). Not for racecheck:
#           with them excluded, racecheck "failed to handle a hardware exception" at the first
#           cuBLASLt, cuBLAS or cuDNN product of 11 of 33 processes, and every later test of
#           those failed with CUDA_ERROR_ILLEGAL_ADDRESS; without the exclusion the same
#           product test ran clean (session 50, docs/benchmarks.md runs 2 and 3). Read the
#           summary's vendor/ember split instead. synccheck leaves them unchecked always
#           (SANITIZE_SYNCCHECK_VENDOR=1 checks them): with cuDNN's flash-attention kernels
#           checked it warned "Detected overflow of tracked cuda::barrier structures" (with
#           --num-cuda-barriers 64 too), the kernel failed, and so did every later test of its
#           process (CUDA_ERROR_LAUNCH_FAILED); excluded, the same processes ran clean (session
#           51, runs 1 and 2).
# --exclude REGEX   leave kernels matching REGEX unchecked too (several are joined with |; no
#           commas: the tool splits its filter at them).
#
# Environment of every run: CUDA_TESTS_REQUIRED=1 (a GPU test that finds no GPU fails);
# EMBER_TEST_TIME_SCALE=20 unless set (tests that bound how long GPU work takes allow that
# many times longer: racecheck made ten adds take 2 s against a 1 s bound);
# EMBER_KERNEL_PREFETCH=0 (no background threads compiling kernel units: every kernel is
# compiled on the thread that needs it, before its first launch, and the tool sees only the
# launches); EMBER_KERNEL_CACHE=LOGDIR/kernel-cache unless set (warmed by the plain run).
# COMPUTE_SANITIZER (default /usr/local/cuda/bin/compute-sanitizer, else on PATH),
# SANITIZE_TIMEOUT seconds per run (default 3600), SANITIZE_DEADLINE seconds for the whole
# script (default none: a run still queued then is not started, and counted as not run; a
# running one is stopped at the deadline, as by its time-out), SANITIZE_ARGS extra arguments
# for the tool, SANITIZE_API_ERRORS the tool's --report-api-errors (default no: the CUDA API
# calls that fail by design are not counted, NCCL's cudaFuncGetAttributes probes of kernels
# built for other GPUs at each communicator's start and the out-of-memory tests' allocations;
# ember checks every call's result itself, so its own failed calls fail their tests).
# SANITIZE_SKIP (with -d; default "two_gpus cupti kernel_time launches_one_kernel
# memviz_timeline every_kernel_source_compiles_with_nvrtc soak_"): the tests left out, by
# substrings of their names. Tests that read the profiler's kernel records from CUPTI (names
# with "cupti", "kernel_time", "launches_one_kernel") cannot have them under a tool: CUPTI
# beside it killed their processes with SIGSEGV (session 49 run 11, session 50), so the
# profiler now keeps off CUPTI there (Note [CUPTI under compute-sanitizer] in
# ember-core's cuda_backend/cupti.rs) and they fail instead. The others: two GPUs, a browser,
# an NVRTC compile of every kernel (no launch), the soak (its memory limits are not the
# tool's).
#
# Output: one line per tool,
#   memcheck: 0 errors, 0 warnings (12 runs, 0 failed, 0 not run, 412 s)
# then, per tool that reported anything, the kernels the reports name most ("at KERNEL+0x..."
# lines), split into vendor kernels (matching the vendor pattern) and ember's; with exclusions,
# a line saying which kernels were left unchecked.
# where errors are the tools' "ERROR SUMMARY" counts (racecheck: the errors of its "RACECHECK
# SUMMARY"), warnings the "Warning" lines of the logs (racecheck: its summary's warnings), and a
# failed run is one that exited non-zero for another reason than a reported error (a test
# failure, a time-out: its output is in LOGDIR/TOOL-N.out); the seconds are the runs' own,
# summed. The exit status is 0 only when every tool reported 0 errors and 0 warnings and every
# run ran and passed.
#
# Notes: the tools slow kernels 10-100x (racecheck most), so choose what to run (a test filter,
# --test-threads=1 keeps the logs in order), or run many processes at once (-j, --split: over
# every GPU test of a bundle on one H200, memcheck's runs took ~1,600 s, beside the other
# three tools', 15 processes at a time).
# cuBLASLt's and cuDNN attention's outputs and the libraries' workspaces are zeroed first under
# the tool, and copies captured into a CUDA graph are kernels there (Notes [Library outputs
# under initcheck] and [Graph copies under initcheck] in ember-core's cuda_backend/mod.rs):
# initcheck does not see the libraries' TMA stores, and checks a graph's copies before its
# kernels have run.
set -uo pipefail

tools=memcheck,racecheck,synccheck,initcheck
logdir=sanitize-logs
bundle=.gpu
jobs=1
split=1
part=1/1
windows=
select=--include-ignored
warm=1
exclude_vendor=0
excludes=()
commands=()
while [ $# -gt 0 ]; do
  case "$1" in
    -t) tools="$2"; shift 2 ;;
    -o) logdir="$2"; shift 2 ;;
    -d) bundle="$2"; shift 2 ;;
    -j) jobs="$2"; shift 2 ;;
    --split) split="$2"; shift 2 ;;
    --part) part="$2"; shift 2 ;;
    --windows) windows="$2"; shift 2 ;;
    --ignored-only) select=--ignored; shift ;;
    --no-warm) warm=0; shift ;;
    --exclude-vendor) exclude_vendor=1; shift ;;
    --exclude) excludes+=("$2"); shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
    --) shift; commands+=("$@"); break ;;
    -*) echo "sanitize.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    *) commands+=("$1"); shift ;;
  esac
done

sanitizer=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
if [ ! -x "$sanitizer" ]; then
  sanitizer=$(command -v compute-sanitizer) || {
    echo "sanitize.sh: no compute-sanitizer at /usr/local/cuda/bin or on PATH (set COMPUTE_SANITIZER)" >&2
    exit 2
  }
fi
for n in "$jobs" "$split"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "sanitize.sh: -j and --split take a positive whole number, got $n" >&2; exit 2; }
done
if [[ ! "$part" =~ ^([1-9][0-9]*)/([1-9][0-9]*)$ ]] || [ "${BASH_REMATCH[1]}" -gt "${BASH_REMATCH[2]}" ]; then
  echo "sanitize.sh: --part takes I/N with 1 <= I <= N, got $part" >&2
  exit 2
fi
part_i=${BASH_REMATCH[1]} part_n=${BASH_REMATCH[2]}
if [ -n "$windows" ] && [[ ! "$windows" =~ ^([1-9][0-9]*):([1-9][0-9]*)$ ]]; then
  echo "sanitize.sh: --windows takes K:N (K runs of N launches each), got $windows" >&2
  exit 2
fi
if [ -n "$windows" ] && [[ ",$tools," == *,initcheck,* ]]; then
  echo "sanitize.sh: initcheck cannot run in --windows: the launches outside a window write memory it does not see, and its checks of copies run throughout, so it reports their sources as uninitialized (session 54: 51,529 such reports over tutorial_transformer's later windows, none in the first); run initcheck over whole programs (-t initcheck, no --windows)" >&2
  exit 2
fi
IFS=, read -ra tool_list <<< "$tools"
for t in "${tool_list[@]}"; do
  case "$t" in
    memcheck|racecheck|synccheck|initcheck) ;;
    *) echo "sanitize.sh: unknown tool $t (memcheck, racecheck, synccheck, initcheck)" >&2; exit 2 ;;
  esac
done

if [ ${#commands[@]} = 0 ]; then
  if [ ! -f "$bundle/tests.txt" ]; then
    echo "sanitize.sh: no COMMAND given and no $bundle/tests.txt (see --help)" >&2
    exit 2
  fi
  if [ ! -d "$bundle/bin" ] && [ -f "$bundle/bin.tar.xz" ]; then
    (cd "$bundle" && mkdir -p bin && tar -xJf bin.tar.xz) || { echo "sanitize.sh: cannot unpack $bundle/bin.tar.xz" >&2; exit 2; }
  fi
  skips=
  for word in ${SANITIZE_SKIP-two_gpus cupti kernel_time launches_one_kernel memviz_timeline every_kernel_source_compiles_with_nvrtc soak_}; do
    skips="$skips --skip $word"
  done
  SANITIZE_TEST_ARGS="${skips# } ${SANITIZE_TEST_ARGS:-}"
  read -ra test_args <<< "$SANITIZE_TEST_ARGS"
  while read -r name; do
    [ -n "$name" ] || continue
    if [ "$split" -le 1 ]; then
      commands+=("$bundle/bin/$name $select --test-threads=1 ${SANITIZE_TEST_ARGS:-}")
      continue
    fi
    mapfile -t names < <("$bundle/bin/$name" --list $select ${test_args[@]+"${test_args[@]}"} 2>/dev/null | sed -n 's/: test$//p')
    for ((k = 0; k < split; k++)); do
      group=()
      for ((n = k; n < ${#names[@]}; n += split)); do group+=("${names[$n]}"); done
      [ ${#group[@]} -gt 0 ] && commands+=("$bundle/bin/$name $select --test-threads=1 --exact ${group[*]}")
    done
  done < "$bundle/tests.txt"
  for ex in ${SANITIZE_EXAMPLES:-tutorial_mlp tutorial_cnn tutorial_lstm tutorial_transformer mixed_precision cuda_streams cuda_graphs_training pinned_loader gradient_accumulation activation_checkpointing}; do
    [ -x "$bundle/bin/$ex" ] && commands+=("$bundle/bin/$ex")
  done
fi

if [ "$part_n" -gt 1 ]; then
  kept=()
  for i in "${!commands[@]}"; do
    [ $((i % part_n)) = $((part_i - 1)) ] && kept+=("${commands[$i]}")
  done
  commands=(${kept[@]+"${kept[@]}"})
  [ ${#commands[@]} -gt 0 ] || { echo "sanitize.sh: part $part holds no command" >&2; exit 2; }
fi

# --windows K:N: command i's launches to check, as the tool's arguments (none: all of them).
window_args=()
if [ -n "$windows" ]; then
  win_k=${windows%:*} win_n=${windows#*:} expanded=()
  for c in "${commands[@]}"; do
    for ((w = 0; w < win_k; w++)); do
      expanded+=("$c")
      a="--launch-skip $((w * win_n))"
      [ $w -lt $((win_k - 1)) ] && a="$a --launch-count $win_n"
      window_args+=("$a")
    done
  done
  commands=("${expanded[@]}")
fi
# Whether command i is a program's first run (its only one, or its first window): the one
# that warms the cache.
first_run() {
  [ -z "$windows" ] || [ $(($1 % win_k)) = 0 ]
}

# The kernels left unchecked: one regex for the tool's --kernel-name-exclude filter (its keys
# are kernel_name/kne, an exact mangled name; kernel_substring/kns; regex), matched anywhere
# in the mangled name.
vendor=${SANITIZE_VENDOR_KERNELS:-cudnn|xmma|cutlass|nvjet|nccl|cublas|gemm|gemv|splitKreduce|nchwToNhwc|nhwcToNchw}
[ $exclude_vendor = 1 ] && excludes=("$vendor" ${excludes[@]+"${excludes[@]}"})
exclude_args=()
excluded=
if [ ${#excludes[@]} -gt 0 ]; then
  excluded=$(IFS='|'; echo "${excludes[*]}")
  case "$excluded" in
    *,*) echo "sanitize.sh: no commas in --exclude patterns (the tool splits its filter at them)" >&2; exit 2 ;;
  esac
  exclude_args=(--kernel-name-exclude "regex=.*($excluded).*")
fi
# synccheck leaves the vendor kernels unchecked unless SANITIZE_SYNCCHECK_VENDOR=1 (see
# --exclude-vendor: cuDNN's flash attention breaks it).
sync_excluded=$vendor
[ -n "$excluded" ] && [ $exclude_vendor = 0 ] && sync_excluded="$vendor|$excluded"
[ -n "$excluded" ] && [ $exclude_vendor = 1 ] && sync_excluded=$excluded
sync_exclude_args=(--kernel-name-exclude "regex=.*($sync_excluded).*")
if [ "${SANITIZE_SYNCCHECK_VENDOR:-0}" = 1 ]; then
  sync_excluded=$excluded
  sync_exclude_args=(${exclude_args[@]+"${exclude_args[@]}"})
fi

# The kernels named in the logs LOGDIR/TOOL-*.log, most named first: "NAMES vendor|ember COUNT"
# lines, from the reports' "at KERNEL+0x..." (memcheck, initcheck, synccheck, racecheck's
# "Race reported between ... at KERNEL+0x...").
kernels_named() {
  cat "$logdir/$1"-*.log 2>/dev/null | grep -o ' at [A-Za-z_$][A-Za-z0-9_$.:]*+0x' |
    sed 's/^ at //; s/+0x$//' | sort | uniq -c | sort -rn |
    while read -r n name; do
      if printf '%s\n' "$name" | grep -qE "$vendor"; then echo "$name vendor $n"; else echo "$name ember $n"; fi
    done
}

mkdir -p "$logdir"
logdir=$(cd "$logdir" && pwd)
export CUDA_TESTS_REQUIRED=1 EMBER_KERNEL_PREFETCH=0 EMBER_TEST_TIME_SCALE=${EMBER_TEST_TIME_SCALE:-20}
export EMBER_KERNEL_CACHE=${EMBER_KERNEL_CACHE:-$logdir/kernel-cache}
limit=${SANITIZE_TIMEOUT:-3600}
summary="$logdir/summary.txt"
: > "$summary"
"$sanitizer" --version | tail -1 | tee -a "$summary"
if [ -n "$excluded" ]; then
  echo "excluded (run, not checked, not reported): kernels matching $excluded" | tee -a "$summary"
fi
case ",$tools," in
  *,synccheck,*)
    [ -n "$sync_excluded" ] && [ "$sync_excluded" != "$excluded" ] &&
      echo "excluded under synccheck: kernels matching $sync_excluded" | tee -a "$summary" ;;
esac

for i in "${!commands[@]}"; do
  echo "command $i: ${commands[$i]}${window_args[$i]:+ (checking $(echo "${window_args[$i]}" | sed 's/--launch-//g'))}" | tee -a "$summary"
done

# One run: "plain" (no tool) or a tool, over command I. It leaves LOGDIR/TOOL-I.status holding
# the exit status and the seconds it took; a run never started has none.
run_one() {
  local tool=$1 i=$2 left cmd start status
  read -ra cmd <<< "${commands[$i]}"
  left=$limit
  if [ "$deadline" -gt 0 ]; then
    left=$((deadline - (SECONDS - began)))
    [ "$left" -gt "$limit" ] && left=$limit
  fi
  rm -f "$logdir/$tool-$i".*.log
  start=$SECONDS
  if [ "$tool" = plain ]; then
    timeout "$left" "${cmd[@]}" > "$logdir/plain-$i.out" 2>&1
  else
    local skip=(${exclude_args[@]+"${exclude_args[@]}"})
    [ "$tool" = synccheck ] && skip=(${sync_exclude_args[@]+"${sync_exclude_args[@]}"})
    # shellcheck disable=SC2086
    timeout "$left" "$sanitizer" --tool "$tool" --target-processes all --error-exitcode 86 \
      --print-limit 1000 --report-api-errors "${SANITIZE_API_ERRORS:-no}" \
      --log-file "$logdir/$tool-$i.%p.log" ${skip[@]+"${skip[@]}"} \
      ${SANITIZE_ARGS:-} ${window_args[$i]:-} "${cmd[@]}" > "$logdir/$tool-$i.out" 2>&1
  fi
  status=$?
  echo "$status $((SECONDS - start))" > "$logdir/$tool-$i.status"
}

# Every run from one queue, at most JOBS at once; none is started within 10 s of the deadline.
began=$SECONDS
deadline=${SANITIZE_DEADLINE:-0}
# The commands naming a word of $SANITIZE_FIRST (the slow ones) go first, under every tool,
# so that a deadline stops short runs queued last rather than long ones started late.
slow=() rest=()
for i in "${!commands[@]}"; do
  hit=0
  for word in ${SANITIZE_FIRST:-}; do
    case "${commands[$i]}" in *"$word"*) hit=1 ;; esac
  done
  if [ $hit = 1 ]; then slow+=("$i"); else rest+=("$i"); fi
done
queue=()
[ $warm = 1 ] && for i in "${!commands[@]}"; do first_run "$i" && queue+=("plain $i"); done
for i in ${slow[@]+"${slow[@]}"}; do
  for tool in "${tool_list[@]}"; do queue+=("$tool $i"); done
done
for tool in "${tool_list[@]}"; do
  for i in ${rest[@]+"${rest[@]}"}; do queue+=("$tool $i"); done
done
rm -f "$logdir"/*.status
for job in "${queue[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  if [ "$deadline" -gt 0 ] && [ $((deadline - (SECONDS - began))) -le 10 ]; then break; fi
  # shellcheck disable=SC2086
  run_one $job &
done
wait

if [ $warm = 1 ]; then
  for i in "${!commands[@]}"; do
    first_run "$i" || continue
    if [ -f "$logdir/plain-$i.status" ]; then
      read -r status secs < "$logdir/plain-$i.status"
      echo "plain run of command $i: exit status $status ($secs s)" | tee -a "$summary"
    else
      echo "plain run of command $i: not run (deadline)" | tee -a "$summary"
    fi
  done
fi

overall=0
lines=()
for tool in "${tool_list[@]}"; do
  errors=0 warnings=0 runs=0 failed=0 unrun=0 secs=0
  for i in "${!commands[@]}"; do
    if [ ! -f "$logdir/$tool-$i.status" ]; then
      unrun=$((unrun + 1))
      continue
    fi
    read -r status took < "$logdir/$tool-$i.status"
    secs=$((secs + took))
    runs=$((runs + 1))
    e=0 w=0
    for log in "$logdir/$tool-$i".*.log; do
      [ -f "$log" ] || continue
      # "ERROR SUMMARY: 3 errors" (memcheck, synccheck, initcheck; racecheck too);
      # "RACECHECK SUMMARY: 5 hazards displayed (3 errors, 2 warnings)".
      le=$(grep -v "not printed" "$log" | sed -n 's/.*ERROR SUMMARY: \([0-9][0-9]*\) error.*/\1/p' | awk '{ s += $1 } END { print s + 0 }')
      re=$(sed -n 's/.*RACECHECK SUMMARY:.*(\([0-9][0-9]*\) error.*/\1/p' "$log" | awk '{ s += $1 } END { print s + 0 }')
      rw=$(sed -n 's/.*RACECHECK SUMMARY:.*, \([0-9][0-9]*\) warning.*/\1/p' "$log" | awk '{ s += $1 } END { print s + 0 }')
      lw=$(grep -c '^========= Warning' "$log")
      # A run stopped before the end (a time-out) prints no summary: count its reports' first
      # lines instead (at most the tool's 1000 printed; session 54 counted such a run as clean).
      if ! grep -q 'ERROR SUMMARY\|RACECHECK SUMMARY' "$log"; then
        le=$(grep '^========= [A-Z]' "$log" | grep -cvE '^========= (COMPUTE-SANITIZER|Warning|Target application|LEAK SUMMARY)')
      fi
      # racecheck prints each warning as a "Warning" line and counts it in its summary too.
      [ "$re" -gt "$le" ] && le=$re
      [ "$rw" -gt "$lw" ] && lw=$rw
      e=$((e + le)) w=$((w + lw))
    done
    errors=$((errors + e)) warnings=$((warnings + w))
    if [ "$status" != 0 ] && ! { [ "$status" = 86 ] && [ $e -gt 0 ]; }; then
      failed=$((failed + 1))
      why="exit status $status"
      [ "$status" = 124 ] && why="timed out after $took s"
      echo "$tool: command $i failed ($why; output in $logdir/$tool-$i.out)" | tee -a "$summary"
    fi
    [ $e -gt 0 ] || [ $w -gt 0 ] && echo "$tool: command $i: $e errors, $w warnings" | tee -a "$summary"
  done
  line="$tool: $errors errors, $warnings warnings ($runs runs, $failed failed, $unrun not run, $secs s)"
  echo "$line"
  lines+=("$line")
  if [ $errors != 0 ] || [ $warnings != 0 ]; then
    named=$(kernels_named "$tool")
    for side in vendor ember; do
      top=$(printf '%s\n' "$named" | awk -v s=$side '$2 == s { t += $3; if (k++ < 5) l = l (l ? ", " : "") $1 " (" $3 ")" }
        END { if (t) printf "%d report lines name %s kernels: %s%s", t, s, l, (k > 5 ? ", ..." : "") }')
      [ -n "$top" ] && lines+=("  $tool: $top")
    done
  fi
  if [ $errors != 0 ] || [ $warnings != 0 ] || [ $failed != 0 ] || [ $unrun != 0 ]; then
    overall=1
  fi
done
echo "== compute-sanitizer, one line per tool" | tee -a "$summary"
printf '%s\n' "${lines[@]}" | tee -a "$summary"
exit $overall
