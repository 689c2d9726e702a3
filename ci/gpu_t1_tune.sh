#!/usr/bin/env bash
# T=1 decode tuning sweep on the GPU host (issue 3), ~150 s: the GPU tests of the tuning variants (oracle match,
# inactive rows untouched), the host-path profile (benchmarks/profile_t1_host.py), then the candidates against FLA
# and the copy roofline in the same process: small B (tile x cache hint), large bf16 B (tile x rows in flight),
# B=512 bf16 + fp32 (tile x rows in flight x cache hint). Run from the repository root after
# `source .gpu*/setup.sh`. Stage limits add up to 145 s (plus the merge); the 2026-11-29 run took 120 s and is
# benchmarks/results/t1_tune_h200.{json,log} (it also swept a plain ld.ca/st.wb hint and two heads per CTA,
# both since deleted as losers).
# Output: $OUT/tune.log (everything) and $OUT/tune.json ({"profile": ..., "sweep": [...records]}); default
# OUT=./gpu_out. A failing stage is logged and the later stages still run; the exit status says whether any failed.
set -uo pipefail
source "$(dirname "$0")/timebox.sh"  # OUT, py, parts, start_log, run NAME SECONDS CMD..., $status
start_log tune.log

tests=packages/kda-cute/tests
run tests 30 "$py" -m pytest -q -ra -m gpu -p no:cacheprovider \
    "$tests/test_decode_t1.py::test_tuning_variant_matches_oracle_and_leaves_inactive_rows_untouched" \
    "$tests/test_decode_t1.py::test_inactive_slots_give_zero_output_and_leave_pool_bitwise_untouched"

run profile 15 "$py" benchmarks/profile_t1_host.py --json "$parts/profile.json"

# Every bench point is checked against the kda-core oracle before it is timed (a failing variant is logged with
# check_failed and not timed); FLA and the copy are timed once per batch size in the same process.
bench=benchmarks/bench_packed_kda_decode.py
# B=2 must not lose to FLA: tiles 8/16/32 x cache operators (eager wall time on the first).
run sweep_small 30 "$py" $bench --mode cuda_graph --state-dtype bf16 --batch-size 1 2 4 8 --tile-v 8 16 32 \
    --cache-hint stream global --iterations 200 --eager-calls 200 --json "$parts/small.json"
# B>=256 at 90% of the copy: rows in flight (0 = 8 bf16 rows, 16 = the whole 128-row tile).
run sweep_large 35 "$py" $bench --mode cuda_graph --state-dtype bf16 --batch-size 256 512 1024 --tile-v 64 128 \
    --rows-in-flight 0 16 --iterations 50 --eager-calls 50 --json "$parts/large.json"
# B=512 bf16 and fp32: cache operators x rows in flight.
run sweep_hints 35 "$py" $bench --mode cuda_graph --state-dtype bf16 fp32 --batch-size 512 --tile-v 64 128 \
    --rows-in-flight 0 16 --cache-hint stream global --iterations 50 --eager-calls 0 \
    --json "$parts/hints.json"

"$py" - "$parts" "$OUT/tune.json" <<'PY'
import json, os, sys
parts, dest = sys.argv[1], sys.argv[2]
def load(name):
    path = os.path.join(parts, name)
    return json.load(open(path)) if os.path.exists(path) else None
sweep = [r for name in ("small.json", "large.json", "hints.json") for r in (load(name) or [])]
json.dump(dict(profile=load("profile.json"), sweep=sweep), open(dest, "w"), indent=1)
print(f"wrote {dest}: {len(sweep)} sweep records")
PY
rm -rf "$parts"
echo "=== done in ${SECONDS}s, status $status"
exit $status
