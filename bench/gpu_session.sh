#!/usr/bin/env bash
# One batched GPU session (the device machine: python3 with torch/triton preinstalled, no package registry).
# Usage: bash bench/gpu_session.sh STAGE...   stages: gputests, smoke, forward, bench, compare, samebits, profile,
# blocks, flash27k, flash30k, attr30k, mps
# pydantic (scenario and policy files) is not preinstalled: run bench/wheels.sh here first and carry .whl/ along.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c 'import pydantic' 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pydantic \
  || { echo "pydantic missing: run bench/wheels.sh and carry .whl/ to this machine"; exit 2; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
dd() { python3 -m harness.cli "$@"; }
# The older code of stages compare and samebits: OLD_TAR (`git archive <rev> -o .scratch/old.tar`, carried along)
# unpacked into /tmp/old; exits naming the stage when OLD_TAR is not set to a file.
old_tree() {
  [ -f "${OLD_TAR:-}" ] || { echo "$1: set OLD_TAR to a git archive of the old code (carried along)"; exit 2; }
  rm -rf /tmp/old && mkdir -p /tmp/old && tar -xf "$OLD_TAR" -C /tmp/old
}
# An A/B of `dsv4-drift bench` in one lease without favouring either side: the first bench of a fresh machine runs
# slower (2026-12-01: the unchanged reference 6-11% slower), so the sides run in the order A, B, B, A and each side's
# mean per layer is compared. `ab_bench NAME A B` calls the stage's `bench_side SIDE JSON` for each run; the JSON
# files are $OUT/NAME-SIDE-N.json. The bench's arguments: MODEL, TOKENS, DECODE, LAYERS, DEVICE, BENCH_ARGS (more
# arguments for both sides, e.g. "--attribution --no-trace").
bench_args() {
  B=(bench --model "${MODEL:-flash}" --tokens "${TOKENS:-30720}" --decode "${DECODE:-64}" --layers "${LAYERS:-2,3}"
     --device "${DEVICE:-cuda}" ${BENCH_ARGS:-})
}
ab_bench() {
  bench_args
  for side in "$2" "$3" "$3" "$2"; do
    n=$(ls "$OUT/$1-$side"-*.json 2>/dev/null | wc -l)
    bench_side "$side" "$OUT/$1-$side-$n.json" | grep -E "^layer"
  done
  python3 - "$OUT" "$1" "$2" "$3" <<'PY'
import glob, json, statistics, sys
out, name, a, b = sys.argv[1:]
runs = {side: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{name}-{side}-*.json"))] for side in (a, b)}
for i, row in enumerate(runs[b][0]["layers"]):
    mean_a, mean_b = (statistics.mean(r["layers"][i]["run_s"] for r in runs[side]) for side in (a, b))
    print(f"layer {row['layer']} ({row['kind']}): {a} {mean_a:.2f} s, {b} {mean_b:.2f} s, {a}/{b} {mean_a / mean_b:.2f}x "
          f"(means of {len(runs[a])} and {len(runs[b])} runs, order {a} {b} {b} {a})")
PY
}
for stage in "$@"; do
  echo "=== stage $stage $(date -u +%T)"
  case $stage in
    gputests)
      # the GPU tests by file: collecting all of tests/ needs the [test] extras the device image lacks (jsonschema)
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_kernels_gpu.py \
        tests/test_host_lanes.py tests/test_distributed_gpu.py tests/test_streams.py tests/test_stream_placement.py \
        tests/test_speed.py tests/test_stream_sums.py \
        2>&1 | tail -15 ;;
    smoke)
      nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv
      python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
      python3 -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_kernels_gpu.py 2>&1 | tail -15
      dd run tiny-smoke --device cuda --out "$OUT/tiny-gpu" --no-report 2>&1 | tail -25 ;;
    forward)
      python3 -c 'import json; json.dump(list(range(1000, 3100)), open("/tmp/p.json","w")); json.dump([5,6,7,8], open("/tmp/d.json","w"))'
      for p in none all; do
        python3 -m harness.cli forward --model flash --tokens /tmp/p.json --decode-tokens /tmp/d.json \
          --stack optimized --patches $p --device cuda --out /tmp/fwd-$p.safetensors 2>&1 | tail -3
      done
      python3 -m harness.cli forward --model flash --tokens /tmp/p.json --decode-tokens /tmp/d.json \
        --device cuda --out /tmp/fwd-ref.safetensors 2>&1 | tail -3
      python3 - <<'PY'
from safetensors.torch import load_file
r = load_file("/tmp/fwd-ref.safetensors")["logits"]
for p in ("none", "all"):
    o = load_file(f"/tmp/fwd-{p}.safetensors")["logits"]
    print(p, "logits rel-L2 vs reference", float((o - r).norm() / r.norm()), "top1 agree", float((o.argmax(-1) == r.argmax(-1)).float().mean()))
PY
      ;;
    bench)
      COLUMNS=250 dd bench --model flash --tokens 30720 --decode 64 --layers 2,3 --device cuda --json "$OUT/bench.json" 2>&1 | tail -9
      python3 optimized/kernels/bench_kernels.py 2>&1 | tail -12 ;;
    compare)
      # A speed-up against older code (ab_bench: old/new > 1 is faster now). OLD_TAR: `git archive <rev> -o
      # .scratch/old.tar` made beside the work tree and carried along.
      old_tree compare
      bench_side() {
        tree=$PWD; [ "$1" = old ] && tree=/tmp/old
        (cd "$tree" && PYTHONPATH="$tree" python3 -m harness.cli "${B[@]}" --json "$2")
      }
      ab_bench compare old new ;;
    samebits)
      # Whether a change keeps a GPU run's metrics: tiny-smoke (every patch, local on) on this GPU with older code and
      # with this tree, every metric row compared (the CPU's pin, tests/test_metrics_pin.py, cannot see GPU-only paths).
      # OLD_TAR: as for compare (old_tree).
      old_tree samebits
      for side in old new; do
        tree=$PWD; [ $side = old ] && tree=/tmp/old
        rm -rf /tmp/samebits-$side
        (cd "$tree" && PYTHONPATH="$tree" python3 -m harness.cli run tiny-smoke --device cuda --out /tmp/samebits-$side \
          --no-report --no-gate > /tmp/samebits-$side.log 2>&1) \
          || { echo "samebits: the $side side's run failed:"; tail -5 /tmp/samebits-$side.log; continue 2; }
      done
      python3 - <<'PY'
import pandas as pd
old, new = (pd.read_parquet(f"/tmp/samebits-{side}/metrics.parquet") for side in ("old", "new"))
print(f"samebits: {len(old)} and {len(new)} rows, identical: {old.equals(new)}")
if not old.equals(new):
    keys = [c for c in old.columns if c not in ("value", "max", "count")]
    sides = old.merge(new, on=keys, how="outer", suffixes=("_old", "_new"), indicator=True)
    for side in ("left_only", "right_only"):  # rows one side has and the other lacks, by tap and metric
        only = sides[sides._merge == side]
        if len(only):
            print(f"samebits: {len(only)} rows only in the {'old' if side == 'left_only' else 'new'} run:",
                  only.groupby(["tap", "metric"]).size().to_dict(), "largest |value|:",
                  float(only[f"value_{'old' if side == 'left_only' else 'new'}"].abs().max()))
    both = sides[sides._merge == "both"]
    moved = False
    for col in ("value", "max", "count"):
        a, b = both[f"{col}_old"], both[f"{col}_new"]
        moved |= (a != b) & ~(a.isna() & b.isna())
    print(f"samebits: {int(moved.sum())} rows moved (value, max or count), by metric:",
          both[moved].metric.value_counts().head(12).to_dict())
PY
      ;;
    profile)
      # Where a Flash CSA layer's time goes (bench/launch_count.py): synced seconds per part and tap; then traced runs
      # with DECODE_TRACED decode steps (default 8: tracing 64 steps' ~100,000 launches takes minutes): each part's
      # device-busy seconds and the device's idle seconds charged to what the host launched after each gap (unmarked),
      # then per line of this repository (each operation marked in the trace, which slows the host). The full
      # listings go to $OUT (a device call's output tail keeps only the last 12,000 characters); the heads are printed.
      L=(--model flash --tokens 30720 --layer "${LAYER:-2}" --device cuda --time)
      python3 bench/launch_count.py "${L[@]}" --decode 64 --sync --by-tap --top 120 > "$OUT/profile-sync.txt" 2>&1
      python3 bench/launch_count.py "${L[@]}" --decode "${DECODE_TRACED:-8}" --kernels --top 45 \
        > "$OUT/profile-idle.txt" 2>&1
      python3 bench/launch_count.py "${L[@]}" --decode "${DECODE_TRACED:-8}" --kernels --top 45 \
        --kernel-lines 60 --caller-depth 2 > "$OUT/profile-kernels.txt" 2>&1
      head -12 "$OUT/profile-sync.txt"; sed -n '/^device idle between/,+16p' "$OUT/profile-idle.txt"
      sed -n '/^device idle per line/,+25p;/^device-busy seconds per kernel over/,+25p' \
        "$OUT/profile-kernels.txt"
      sed -n '/device-busy seconds per line of/,+30p' "$OUT/profile-kernels.txt" ;;
    blocks)
      # Query blocks of 256 (reference.layer.MAX_QUERY_BLOCK) against BLOCK (default 512) queries in this tree
      # (ab_bench; LAYERS defaults to 2 here, a Flash CSA layer, and BENCH_ARGS to --no-trace). Counted on the CPU as
      # a GPU launches (bench/launch_count.py --defer-blocks, tiny, 30,720 + 64, forty-fourth session's code),
      # 512-query blocks cut a CSA layer's operations 158,975 -> 117,027 and host reads 3,551 -> 3,081, and widen each
      # query's keys from 383 window-band rows (256 + W − 1, W = 128) + 512 picks to 639 + 512. GPU GEMMs of other
      # shapes may round differently: this stage measures time only (forty-fourth session on an H100: 1.06x and
      # 1.19x, within the lease's load noise; README, Benchmarks).
      LAYERS=${LAYERS:-2} BENCH_ARGS=${BENCH_ARGS:---no-trace}
      bench_side() {
        python3 -c "import sys, reference.layer as layer
layer.MAX_QUERY_BLOCK = int(sys.argv[1])
from harness.cli.main import main
sys.exit(main(sys.argv[2:]))" "$1" "${B[@]}" --json "$2"
      }
      ab_bench blocks 256 "${BLOCK:-512}" ;;
    flash27k|flash30k)
      # Resumable across calls while the machine stays warm: the run lives in /tmp/<stage>-<patches>, each call runs at
      # most RUN_LIMIT seconds, and the measured files come back under $OUT/<stage>-<patches> (report and gate run
      # off-device). PATCHES picks the variants: base plus one with these patches (none: reference, yardstick and base
      # alone). flash27k runs global mode only (the symptom's shape; default none); flash30k is #14's budget shape
      # (flash-30k with all six patches, global and local, every probe; default all), timed through the CLI as a user
      # runs it.
      if [ $stage = flash30k ]; then P=${PATCHES:-all}; else P=${PATCHES:-none}; fi; D=/tmp/$stage-$P
      if [ $stage = flash27k ]; then fresh=(run flash-27k --no-local); else fresh=(run flash-30k); fi
      if [ -f $D/manifest.json ]; then args=(run --resume $D); else
        args=("${fresh[@]}" --device cuda --patches "$P" --out $D); fi
      timeout "${RUN_LIMIT:-540}" python3 -m harness.cli "${args[@]}" --no-report 2>&1 | grep -v "^\s*$" | tail -70
      mkdir -p "$OUT/$stage-$P" && cp $D/manifest.json $D/findings.json $D/metrics.parquet "$OUT/$stage-$P/" 2>/dev/null
      python3 -c 'import json, sys; m=json.load(open(sys.argv[1])); print("status", m.get("status"), "wall", m.get("wall_seconds"), "peaks", m.get("peak_device_gib"), m.get("peak_host_rss_gib"), "segments", m.get("segments"))' $D/manifest.json ;;
    attr30k)
      # `attribute flash-30k` (the six built-ins, --interactions never), resumable across calls while the machine stays
      # warm like flash30k: each call runs at most RUN_LIMIT seconds; the manifest, findings and per-layer log come
      # back under $OUT/attr30k.
      D=/tmp/attr30k
      if [ -f $D/manifest.json ]; then args=(attribute --resume $D); else
        args=(attribute flash-30k --device cuda --interactions never --out $D); fi
      timeout "${RUN_LIMIT:-540}" python3 -m harness.cli "${args[@]}" --no-report 2>&1 | grep -v "^\s*$" \
        | tee -a "$OUT/attr30k.log" | grep -E "^layer|rror|note|verdict" | tail -60
      mkdir -p "$OUT/attr30k" && cp $D/manifest.json $D/findings.json $D/attribution.json "$OUT/attr30k/" 2>/dev/null
      python3 -c 'import json, sys; m=json.load(open(sys.argv[1])); print("status", m.get("status"), "wall", m.get("wall_seconds"), "peaks", m.get("peak_device_gib"), m.get("peak_host_rss_gib"), "segments", m.get("segments"))' $D/manifest.json ;;
    mps)
      # Two ranks sharing the one GPU under NVIDIA MPS against one process, on the first layers of flash-30k (the same
      # prompt, patches and probes): each side runs RUN_LIMIT seconds (default 240; keep both sides and the rest of
      # the call under the device's per-command limit), then the per-layer seconds of the layers both finished are
      # compared (the first three are left out: start-up, and the first CSA layer compiles the patches' Triton
      # kernels). The manifests come back too: a sharded run's `rank_wait_s` says how evenly its ranks were loaded.
      P=${PATCHES:-all}; PIPE=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}/control
      rm -f "$OUT"/mps-*.log "$OUT"/mps-*.json
      if [ -e "$PIPE" ]; then echo "mps: an MPS daemon is already running; the one-process side would be its client"; continue; fi
      for how in one mps; do
        D=/tmp/mps-$how; rm -rf $D; extra=()
        if [ $how = mps ]; then
          nvidia-cuda-mps-control -d || { echo "mps: the MPS daemon did not start"; break; }
          trap 'echo quit | nvidia-cuda-mps-control 2>/dev/null' EXIT  # stopped even if this script is killed
          extra=(--devices 2)
        fi
        timeout -k 30 "${RUN_LIMIT:-240}" python3 -m harness.cli run flash-30k --device cuda --patches "$P" \
          --no-report --no-gate ${extra[@]+"${extra[@]}"} --out $D > "$OUT/mps-$how.log" 2>&1
        if [ $how = mps ]; then echo quit | nvidia-cuda-mps-control; trap - EXIT; fi
        cp $D/manifest.json "$OUT/mps-$how-manifest.json" 2>/dev/null
        grep -E "^note|rror|waited" "$OUT/mps-$how.log" | head -5
      done
      [ -f "$OUT/mps-one.log" ] && [ -f "$OUT/mps-mps.log" ] && python3 - "$OUT" <<'PY'
import re, sys
times = {}
for how in ("one", "mps"):
    text = open(f"{sys.argv[1]}/mps-{how}.log").read()
    times[how] = {int(m[1]): float(m[2]) for m in re.finditer(r"^layer (\d+)/\d+ done in ([\d.]+) s", text, re.M)}
both = sorted(set(times["one"]) & set(times["mps"]) - {1, 2, 3})
if both:
    one, mps = (sum(times[h][n] for n in both) for h in ("one", "mps"))
    print(f"layers {both[0]}-{both[-1]}: one process {one:.1f} s, two ranks under MPS {mps:.1f} s ({one / mps:.2f}x)")
else:
    print("mps: no layer past the third finished on both sides", {h: sorted(t) for h, t in times.items()})
PY
      ;;
  esac
done
