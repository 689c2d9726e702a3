#!/usr/bin/env bash
# T=1 persistent-CTA variant on the GPU host (issue 3), ~150 s: its GPU tests (bitwise equal to the one-CTA-per-item
# kernel of the same schedule, oracle, inactive slots, ragged last wave, graph replay), then the sweep against FLA and
# the copy roofline in the same process: bf16 B=256/512/1024 (persistent CTAs/SM x rows in flight) and fp32 B=512.
# Spill-free candidates on sm_90a (packages/kda-cute/tests/test_compile.py, PERSISTENT_NO_SPILL): bf16 p2/rif8,
# p3/rif4, p4/rif4 (packed entry); fp32 p2/rif8, p3/rif4, p4/rif2. The other points of the product spill a little and
# are measured for the record. Run from the repository root after `source .gpu*/setup.sh`.
# Output: $OUT/persistent.log and $OUT/t1_persistent.json (the bench records, `persistent` in each); default
# OUT=./gpu_out. A failing stage is logged and the later stages still run; the exit status says whether any failed.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
py=${PYTHON:-python3}
status=0
parts=$(mktemp -d)
exec > >(tee -a "$OUT/persistent.log") 2>&1

run() {  # run NAME SECONDS CMD...: time-boxed, remember a failure, keep going
  local name=$1 limit=$2; shift 2
  echo "=== $name (t=${SECONDS}s, limit ${limit}s): $*"
  timeout "$limit" "$@"
  local rc=$?
  [ "$rc" -eq 0 ] || { echo "=== $name FAILED (rc=$rc)"; status=1; }
}

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
git log -1 --format='commit %H %s' 2>/dev/null || true

run tests 90 "$py" -m pytest -q -ra -m gpu -p no:cacheprovider packages/kda-cute/tests/test_decode_t1.py -k persistent

bench=benchmarks/bench_packed_kda_decode.py
run sweep_bf16 70 "$py" $bench --mode cuda_graph --state-dtype bf16 --batch-size 256 512 1024 --persistent 0 2 3 4 \
    --rows-in-flight 4 8 --iterations 50 --eager-calls 0 --json "$parts/bf16.json"
run sweep_fp32 50 "$py" $bench --mode cuda_graph --state-dtype fp32 --batch-size 512 --persistent 0 2 3 4 \
    --rows-in-flight 2 4 8 16 --cache-hint global --iterations 50 --eager-calls 0 --json "$parts/fp32.json"

"$py" - "$parts" "$OUT/t1_persistent.json" <<'PY'
import json, os, sys
parts, dest = sys.argv[1], sys.argv[2]
sweep = [r for name in ("bf16.json", "fp32.json") if os.path.exists(os.path.join(parts, name))
         for r in json.load(open(os.path.join(parts, name)))]
json.dump(sweep, open(dest, "w"), indent=1)
print(f"wrote {dest}: {len(sweep)} records")
for r in sorted(sweep, key=lambda r: (r["state_dtype"], r["B"], r.get("ours_us") or 1e9)):
    if "ours_us" in r:
        print(f"{r['state_dtype']} B={r['B']:5d} p{r['persistent']} rif{r['rows_in_flight']:2d} {r['cache_hint']:6s} "
              f"{r['ours_us']:8.2f} us  {100 * r['frac_of_copy']:5.1f}% of copy")
    else:
        print(f"{r['state_dtype']} B={r['B']:5d} {r['config']}: {r['check_failed']}")
PY
rm -rf "$parts"
echo "=== done in ${SECONDS}s, status $status"
exit $status
