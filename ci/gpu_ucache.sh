#!/usr/bin/env bash
# ucache verify+flush on the GPU host: GPU tests against the oracle, then the benchmark (T=8 w16 full sweep, then
# T=4 and w_ring 32 on fewer points). Run from the repository root after `source .gpu*/setup.sh` (wheels +
# PYTHONPATH). Everything is tee'd to $OUT/log; JSON and PNG go to $OUT (default ./gpu_out).
# Stages: UCACHE_STAGES="tests bench sweep more" (the default); "memcheck" and "racecheck" run compute-sanitizer over
# small steps (below). UCACHE_BENCH_ARGS adds flags to the main run. Every benchmark run times FLA in the three call
# forms of the benchmark's FLA_FORMS (our pool's V-first bf16 states, fp32 states, FLA's default K-first layout).
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

# compute-sanitizer over small steps that reach every build and every bounds path (inactive and out-of-range
# slots, a padded and offset pool, a misaligned pool, T=4 and w_ring 32, the softplus gate with the fallback vote,
# the 4-CTA build, the cursor restart kernel), under memcheck and racecheck (shared memory) alike.
write_sanitizer_case() {
  cat > "$OUT/ucache_sanitizer_case.py" <<'PY'
import importlib.util
import sys

import torch
from kda_core.contracts import default_flush_min, max_hist_len
from kda_cute import ucache
spec = importlib.util.spec_from_file_location("tu", "packages/kda-cute/tests/test_ucache.py")
tu = importlib.util.module_from_spec(spec)
sys.modules["tu"] = tu  # the module's dataclass looks itself up there
spec.loader.exec_module(tu)
cases = {
    "inactive-rows-tile64": (lambda: tu.make_step(6, 8, 8, n_slots=10, slots=[-1, 3, 10, -7, 5, 110], hist=9, seed=13), {}),
    "inactive-rows-tile128": (lambda: tu.make_step(6, 8, 8, n_slots=10, slots=[-1, 3, 10, -7, 5, 110], hist=9, seed=13),
                              dict(tile_v=128)),
    "padded-pool-wrapped": (lambda: tu.make_step(8, 8, 8, n_slots=20, pool_row_pad=8, pool_offset=8, bases=29,
                                                 hist=default_flush_min(8, 16), seed=19), dict(tile_v=128)),
    "misaligned-pool": (lambda: tu.make_step(8, 8, 8, n_slots=20, pool_row_pad=1, pool_offset=1, hist=9, seed=19),
                        dict(aligned=False)),
    "T4-w32": (lambda: tu.make_step(8, 4, 8, w_ring=32, flush_min=default_flush_min(4, 32),
                                    hist=torch.arange(8) % (max_hist_len(4, 32) + 1), seed=7), dict(tile_v=128)),
    "softplus-strong-decay": (lambda: tu.make_step(8, 8, 8, hist=torch.arange(8) % 9 + 8, decay_range=(-5.0, -1.0),
                                                   gate="softplus", seed=6), dict(tile_v=128)),
    "four-ctas-build": (lambda: tu.make_step(8, 8, 8, seed=3), dict(tile_v=128, min_blocks=4)),
    "restart-cursors": (lambda: tu.make_step(8, 8, 8, seed=4), dict(tile_v=128, restart=True)),
}
for name, (make, kw) in cases.items():
    kw = dict(kw)
    ucache._FORCE_MIN_BLOCKS = kw.pop("min_blocks", 0)
    restart = kw.pop("restart", False)
    tu.check_against_oracle(make(), restart, **kw)
    print("sanitizer case ran:", name, flush=True)
ucache._FORCE_MIN_BLOCKS = 0
torch.cuda.synchronize()
PY
}

for tool in memcheck racecheck; do
  case " $stages " in *" $tool "*)
    write_sanitizer_case
    run "ucache_$tool" compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 1 "$py" \
        "$OUT/ucache_sanitizer_case.py" ;;
  esac
done

bench=benchmarks/bench_kda_ucache_flush.py
forms="--fla-form bf16 fp32 kfirst"
case " $stages " in *" bench "*)
  run ucache_bench_t8_w16 "$py" $bench --t 8 --w-ring 16 $forms ${UCACHE_BENCH_ARGS:-} --json "$OUT/ucache_t8_w16.json" \
      --plot "$OUT/ucache_t8_w16.png" ;;
esac

case " $stages " in *" sweep "*)
  run ucache_tile_sweep "$py" $bench --t 8 --w-ring 16 --batch-size 8 64 512 --fold-pct 0 100 --tile-v 64 128 \
      --no-fla --check-max-batch 0 --iterations 50 --json "$OUT/ucache_tile_sweep.json" ;;
esac

case " $stages " in *" more "*)
  run ucache_bench_t4_w16 "$py" $bench --t 4 --w-ring 16 --batch-size 1 64 512 --fold-pct 0 100 \
      --check-max-batch 8 $forms --json "$OUT/ucache_t4_w16.json"
  run ucache_bench_t8_w32 "$py" $bench --t 8 --w-ring 32 --batch-size 1 64 512 --fold-pct 0 100 \
      --check-max-batch 8 $forms --json "$OUT/ucache_t8_w32.json" ;;
esac

exit $status
