#!/usr/bin/env bash
# T=1 bulk-ring variant on the GPU host, <= 175 s: its GPU tests (bitwise equal to the tile-128 register path, oracle,
# inactive slots -1 / N / INT_MIN, rows not addressed untouched, every gate, packed entry, graph replay), then the
# sweep against the copy roofline in the same process (FLA skipped): bf16 B=256/512/1024 and fp32 B=512 over ring
# depths 0 (the register path: the table's tile-128 row) / 2 / 4 / 8. Every point is checked against the oracle
# before it is timed. Each stage is time-boxed: a hang (an mbarrier that never completes) costs only that stage.
# Run from the repository root after `source .gpu*/setup.sh`. Output: $OUT/bulk.log and $OUT/t1_bulk.json (the
# bench records, `bulk_ring` in each); default OUT=./gpu_out. A failing stage is logged and the later stages still
# run; the exit status says whether any failed.
set -uo pipefail
source "$(dirname "$0")/timebox.sh"  # OUT, py, parts, start_log, run NAME SECONDS CMD..., $status
start_log bulk.log

run tests 90 "$py" -m pytest -q -ra -x -m gpu -p no:cacheprovider packages/kda-cute/tests/test_decode_t1.py -k bulk

bench=benchmarks/bench_packed_kda_decode.py
run sweep_bf16 55 "$py" $bench --mode cuda_graph --state-dtype bf16 --batch-size 256 512 1024 --bulk-ring 0 2 4 8 \
    --no-fla --iterations 50 --eager-calls 0 --json "$parts/bf16.json"
run sweep_fp32 30 "$py" $bench --mode cuda_graph --state-dtype fp32 --batch-size 512 --bulk-ring 0 2 4 8 \
    --no-fla --iterations 50 --eager-calls 0 --json "$parts/fp32.json"

"$py" - "$parts" "$OUT/t1_bulk.json" <<'PY'
import json, os, sys
parts, dest = sys.argv[1], sys.argv[2]
sweep = [r for name in ("bf16.json", "fp32.json") if os.path.exists(os.path.join(parts, name))
         for r in json.load(open(os.path.join(parts, name)))]
json.dump(sweep, open(dest, "w"), indent=1)
print(f"wrote {dest}: {len(sweep)} records")
for r in sorted(sweep, key=lambda r: (r["state_dtype"], r["B"], r.get("bulk_ring_forced", 0))):
    if "ours_us" in r:
        print(f"{r['state_dtype']} B={r['B']:5d} bulk_ring {r['bulk_ring']:2d} {r['ours_us']:8.2f} us  "
              f"{100 * r['frac_of_copy']:5.1f}% of copy (copy {r['copy_us']:.2f} us)")
    else:
        print(f"{r['state_dtype']} B={r['B']:5d} {r['config']}: {r['check_failed']}")
PY
rm -rf "$parts"
echo "=== done in ${SECONDS}s, status $status"
exit $status
