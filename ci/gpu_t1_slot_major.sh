#!/usr/bin/env bash
# T=1 slot-major grid on the GPU host, <= 330 s: its GPU tests and the bulk ring's (bitwise equal to the batch-major
# grid, oracle, inactive slots -1 / N / INT_MIN, duplicate slots, rows not addressed untouched, packed entry, graph
# replay, the schedule's choice), a compute-sanitizer memcheck of slot-major calls with inactive and duplicate slots,
# then sweeps of the grid against FLA and the copy roofline in the same process: bf16 B=256/512/1024 on a dense pool
# (FLA timed), pools of 1.25 / 1.5 / 2 rows per batch row at B=256/512, fp32 B=256/512. Every point is checked against
# the oracle before it is timed. Run from the repository root after `source .gpu*/setup.sh`. Output:
# $OUT/slot_major.log and $OUT/t1_slot_major.json (the bench records, `slot_major` and `pool_factor` in each); default
# OUT=./gpu_out. A failing stage is logged and the later stages still run; the exit status says whether any failed.
set -uo pipefail
source "$(dirname "$0")/timebox.sh"  # OUT, py, parts, start_log, run NAME SECONDS CMD..., $status
start_log slot_major.log
stages=${SLOT_MAJOR_STAGES:-"tests memcheck bench"}

case " $stages " in *" tests "*)
  run tests 150 "$py" -m pytest -q -ra -m gpu -p no:cacheprovider packages/kda-cute/tests/test_decode_t1.py \
      -k "slot_major or bulk" ;;
esac

case " $stages " in *" memcheck "*)
  case_py=$(mktemp --suffix=.py)
  cat > "$case_py" <<'PY'
import torch
from kda_cute import decode_t1, kda_decode_t1_packed
B, H, K = 40, 12, 128
mixed = torch.randn(B, 3 * H * K, device="cuda").bfloat16()
gate = torch.randn(B, H * K, device="cuda").bfloat16()
beta = torch.randn(B, H, device="cuda").bfloat16()
A_log, dt_bias = torch.zeros(H, device="cuda"), torch.zeros(H * K, device="cuda")
decode_t1._FORCE_SLOT_MAJOR = True
for dtype in (torch.bfloat16, torch.float32):
    pool = torch.randn(B + 2, H, K, K, device="cuda").to(dtype)
    slots = torch.arange(B, dtype=torch.int32, device="cuda").flip(0)
    slots[::5] = -1
    slots[1::5] = B + 2
    slots[2::7] = 3  # duplicates of slot 3
    kda_decode_t1_packed(mixed, gate, beta, pool, slots, num_heads=H, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
torch.cuda.synchronize()
print("memcheck case done")
PY
  if command -v compute-sanitizer >/dev/null; then
    run memcheck 90 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 "$py" "$case_py"
  else
    echo "compute-sanitizer not on PATH: memcheck skipped"
  fi ;;
esac

bench=benchmarks/bench_packed_kda_decode.py
case " $stages " in *" bench "*)
  run dense_bf16 60 "$py" $bench --mode cuda_graph --state-dtype bf16 --batch-size 256 512 1024 --slot-major off on \
      --eager-calls 0 --json "$parts/dense_bf16.json"
  for f in 1.25 1.5 2; do
    run "pool${f}_bf16" 40 "$py" $bench --mode cuda_graph --state-dtype bf16 --batch-size 256 512 --pool-factor $f \
        --slot-major off on --no-fla --eager-calls 0 --json "$parts/pool${f}_bf16.json"
  done
  run dense_fp32 40 "$py" $bench --mode cuda_graph --state-dtype fp32 --batch-size 256 512 --slot-major off on \
      --no-fla --eager-calls 0 --json "$parts/dense_fp32.json" ;;
esac

"$py" - "$parts" "$OUT/t1_slot_major.json" <<'PY'
import glob, json, os, sys
parts, dest = sys.argv[1], sys.argv[2]
sweep = [r for name in sorted(glob.glob(os.path.join(parts, "*.json"))) for r in json.load(open(name))]
if sweep:
    json.dump(sweep, open(dest, "w"), indent=1)
    print(f"wrote {dest}: {len(sweep)} records")
for r in sorted(sweep, key=lambda r: (r["state_dtype"], r.get("pool_factor", 1), r["B"], r.get("slot_major", False))):
    if "ours_us" in r:
        fla = f"  {r['ours_over_fla']:.3f}x FLA" if r.get("ours_over_fla") else ""
        print(f"{r['state_dtype']} pool x{r.get('pool_factor', 1)} B={r['B']:5d} slot_major {r['slot_major']!s:5s} "
              f"{r['ours_us']:8.2f} us  {100 * r['frac_of_copy']:5.1f}% of copy (copy {r['copy_us']:.2f} us){fla}")
    else:
        print(f"{r['state_dtype']} B={r['B']:5d} {r['config']}: {r['check_failed']}")
PY
rm -rf "$parts"
echo "=== done in ${SECONDS}s, status $status"
exit $status
