#!/usr/bin/env bash
# kda-core on the GPU host: the GPU-marked tests (oracle vs FLA's in-place pool kernel, CUDA device rules of the
# validation) with their printed differences, then the validation cost benchmark on CUDA tensors.
# Run from the repository root after `source .gpu*/setup.sh` (wheels + PYTHONPATH). Logs go to $OUT (default
# ./gpu_out): core_tests.log (pytest -s output, the quoted FLA differences) and core_bench.{log,json}.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
py=${PYTHON:-python3}
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$py" -c "import fla, torch; print('fla', fla.__version__, 'torch', torch.__version__)" || echo "fla-core missing: FLA tests skip"

echo "=== core_tests"
"$py" -m pytest -m gpu -s -ra -p no:cacheprovider packages/kda-core/tests 2>&1 | tee "$OUT/core_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "=== core_tests FAILED"; status=1; }

echo "=== core_bench"
"$py" benchmarks/bench_validation.py --device cuda --json "$OUT/core_bench.json" 2>&1 | tee "$OUT/core_bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "=== core_bench FAILED"; status=1; }
exit $status
