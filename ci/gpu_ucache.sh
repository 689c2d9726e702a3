#!/usr/bin/env bash
# ucache verify+flush on the GPU host: GPU tests against the oracle, then the benchmark (T=8 w16 full sweep, then
# T=4 and w_ring 32 on fewer points). Run from the repository root after `source .gpu*/setup.sh` (wheels +
# PYTHONPATH). Everything is tee'd to $OUT/log; JSON and PNG go to $OUT (default ./gpu_out).
# Stages: UCACHE_STAGES="tests bench sweep more" (default: all four); UCACHE_BENCH_ARGS adds flags to the main run.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
stages=${UCACHE_STAGES:-"tests bench sweep more"}
py=${PYTHON:-python3}
status=0
exec > >(tee -a "$OUT/log") 2>&1

run() {  # run NAME CMD...: remember a failure, keep going
  local name=$1; shift
  echo "=== $name: $*"
  "$@"
  local rc=$?
  [ "$rc" -eq 0 ] || { echo "=== $name FAILED (rc=$rc)"; status=1; }
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

case " $stages " in *" tests "*)
  run ucache_tests "$py" -m pytest -q -ra -x -m gpu -p no:cacheprovider packages/kda-cute/tests/test_ucache.py
  run ucache_api_tests "$py" -m pytest -q -ra -m gpu -p no:cacheprovider packages/kda-recurrent/tests/test_ucache_api.py ;;
esac

bench=benchmarks/bench_kda_ucache_flush.py
case " $stages " in *" bench "*)
  run ucache_bench_t8_w16 "$py" $bench --t 8 --w-ring 16 ${UCACHE_BENCH_ARGS:-} --json "$OUT/ucache_t8_w16.json" \
      --plot "$OUT/ucache_t8_w16.png" ;;
esac

case " $stages " in *" sweep "*)
  run ucache_tile_sweep "$py" $bench --t 8 --w-ring 16 --batch-size 8 64 512 --fold-pct 0 100 --tile-v 64 128 \
      --no-fla --check-max-batch 0 --iterations 50 --json "$OUT/ucache_tile_sweep.json" ;;
esac

case " $stages " in *" more "*)
  run ucache_bench_t4_w16 "$py" $bench --t 4 --w-ring 16 --batch-size 1 64 512 --fold-pct 0 100 \
      --check-max-batch 8 --json "$OUT/ucache_t4_w16.json"
  run ucache_bench_t8_w32 "$py" $bench --t 8 --w-ring 32 --batch-size 1 64 512 --fold-pct 0 100 \
      --check-max-batch 8 --json "$OUT/ucache_t8_w32.json" ;;
esac

exit $status
