#!/usr/bin/env bash
# The multi-GPU benchmarks of shared/bench/WORKLOADS.md ("Multi-GPU workloads"), ember beside
# PyTorch in one command on a machine with two GPUs (the device tool's nvidia-h200-x2), from a
# ../shared/tools/gpu-bundle bundle (no Rust toolchain needed there):
#
#   bash scripts/bench-multi-gpu.sh [-d BUNDLE] [-o OUTDIR] [WORKLOADS]
#
# BUNDLE   the bundle folder (default .gpu): bin/ember and bin/ember-run (unpacked from
#          bin.tar.xz if needed), bench/torch_reference.py and bench/torch_ddp_reference.py.
# OUTDIR   where the JSON lines and logs go (default $OUT, else /tmp/bench-multi-gpu).
# WORKLOADS comma-separated DDP/FSDP workloads (default ddp_gpt2,fsdp_gpt2,ddp_mlp_large).
#
# What it runs, in this order, all in the one command so that the ratios compare:
# 1. the one-GPU baselines, unwrapped: gpt2_124m_bf16 and mlp_large, `ember bench` and
#    torch_reference.py (WORKLOADS.md: the GPT workloads' N = 1 figure is the unwrapped model);
# 2. for N = 1 and 2: `ember-run --standalone --nproc-per-node N ember bench --only WORKLOADS`
#    and `torchrun --standalone --nproc-per-node N torch_ddp_reference.py --only WORKLOADS`;
# 3. for N = 1 and 2: ember's ddp_mlp_large with the bf16 compression hook (`--comm-hook bf16`);
# then one table: each workload's ms a step, throughput and scaling efficiency
# (throughput(N) / (N x throughput of the N = 1 baseline)) for both frameworks, ember's
# throughput over PyTorch's, and the per-GPU training-state memory FSDP reports (the hooked
# workload scales against itself at N = 1, and in a line after the table against DDP without
# the hook at N = 1). NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
set -uo pipefail

bundle=.gpu
outdir=${OUT:-/tmp/bench-multi-gpu}
while [ $# -gt 0 ]; do
  case "$1" in
    -d) bundle="$2"; shift 2 ;;
    -o) outdir="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
    -*) echo "bench-multi-gpu.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
workloads=${1:-ddp_gpt2,fsdp_gpt2,ddp_mlp_large}
export NCCL_NVLS_ENABLE=0
mkdir -p "$outdir"
cd "$bundle" || { echo "bench-multi-gpu.sh: no bundle folder $bundle" >&2; exit 2; }
[ -d bin ] || { mkdir -p bin && tar -xJf bin.tar.xz; } || exit 1
for f in bin/ember bin/ember-run bench/torch_reference.py bench/torch_ddp_reference.py; do
  [ -e "$f" ] || { echo "bench-multi-gpu.sh: $bundle/$f is missing" >&2; exit 2; }
done
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
[ "$gpus" -ge 2 ] || { echo "bench-multi-gpu.sh: needs two GPUs, found $gpus" >&2; exit 2; }

run() { # NAME COMMAND...: JSON lines to OUTDIR/NAME.jsonl, stderr to OUTDIR/NAME.err
  local name=$1; shift
  timeout 300 "$@" > "$outdir/$name.jsonl" 2> "$outdir/$name.err"
  echo "$name: exit status $?"
}
run ember_1gpu ./bin/ember bench --device cuda --only gpt2_124m_bf16,mlp_large
run torch_1gpu python3 bench/torch_reference.py --device cuda --only gpt2_124m_bf16,mlp_large
for n in 1 2; do
  run "ember_n$n" ./bin/ember-run --standalone --nproc-per-node "$n" ./bin/ember bench --device cuda --only "$workloads"
  run "torch_n$n" torchrun --standalone --nproc-per-node "$n" bench/torch_ddp_reference.py --only "$workloads"
  if [[ ",$workloads," == *,ddp_mlp_large,* ]]; then
    run "ember_bf16_n$n" ./bin/ember-run --standalone --nproc-per-node "$n" ./bin/ember bench --device cuda --only ddp_mlp_large --comm-hook bf16
  fi
done

python3 - "$outdir" <<'PY'
import json, os, sys
out = sys.argv[1]
def rows(name):
    path = os.path.join(out, name + ".jsonl")
    found = {}
    if os.path.exists(path):
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                found[r.get("workload")] = r
    return found
def rate(r):
    return r.get("tokens_per_s") or r.get("samples_per_s") if r else None
base = {"ember": rows("ember_1gpu"), "torch": rows("torch_1gpu")}
def baseline(fw, workload, n1):
    # WORKLOADS.md: the GPT workloads scale against the unwrapped one-GPU model.
    if workload.endswith("_gpt2"):
        return rate(base[fw].get("gpt2_124m_bf16"))
    return rate(n1.get(workload))
print(f"{'workload':24} {'N':>2} {'ember ms':>9} {'torch ms':>9} {'ember scaling':>14} {'torch scaling':>14} {'ember/torch rate':>17} {'state MiB (unsharded)':>22}")
for suffix, label in (("", ""), ("_bf16", " +bf16 hook")):
    e1 = rows(f"ember{suffix}_n1")
    t1 = rows("torch_n1")
    for n in (1, 2):
        e, t = rows(f"ember{suffix}_n{n}"), rows(f"torch_n{n}")
        for w, er in e.items():
            tr = t.get(w) if not suffix else None
            eb, tb = baseline("ember", w, e1), baseline("torch", w, t1)
            es = rate(er) / (n * eb) if eb and rate(er) else None
            ts = rate(tr) / (n * tb) if tr and tb and rate(tr) else None
            ratio = rate(er) / rate(tr) if tr and rate(tr) else None
            mem = er.get("state_mem_mb"), er.get("state_mem_mb_unsharded")
            fmt = lambda v, s: "-" if v is None else format(v, s)
            print(f"{w + label:24} {n:>2} {fmt(er.get('ms_per_step'), '.3f'):>9} {fmt(tr.get('ms_per_step') if tr else None, '.3f'):>9} "
                  f"{fmt(es, '.3f'):>14} {fmt(ts, '.3f'):>14} {fmt(ratio, '.3f'):>17} "
                  f"{(fmt(mem[0], '.0f') + ' (' + fmt(mem[1], '.0f') + ')') if mem[0] is not None else '-':>22}")
# A hooked workload scales against itself at N = 1 above; against DDP without the hook at
# N = 1 too, since the hook's own cost at N = 1 flatters the first figure.
plain, hooked = rows("ember_n1"), rows("ember_bf16_n2")
for w, hr in hooked.items():
    p = rate(plain.get(w))
    if p and rate(hr):
        print(f"{w} +bf16 hook at N=2 against {w} without it at N=1: scaling {rate(hr) / (2 * p):.3f}")
PY
