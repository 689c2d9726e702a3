#!/usr/bin/env bash
# kda-recurrent on the GPU host: the facade / routing / FLA-adapter / torch.compile GPU tests, then
# benchmarks/bench_recurrent_kda.py (host overhead, spec decode T=4,8 and prefill T=16,64 vs FLA).
# Run from the repository root after `source .gpu*/setup.sh` (wheels + PYTHONPATH). Everything is tee'd to
# $OUT/log (default ./gpu_out); the benchmark's JSON and PNG go to $OUT too.
# Stages: RECURRENT_STAGES="tests bench" (default both). RECURRENT_BENCH_ARGS: extra benchmark flags (e.g. a
# shorter sweep); RECURRENT_TEST_TIMEOUT / RECURRENT_BENCH_TIMEOUT: seconds per stage (default: no limit).
# Exit status: nonzero if any stage failed.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
stages=${RECURRENT_STAGES:-"tests bench"}
py=${PYTHON:-python3}
status=0
exec > >(tee -a "$OUT/log") 2>&1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

case " $stages " in *" tests "*)
  echo "=== kda-recurrent GPU tests"
  (cd packages/kda-recurrent && ${RECURRENT_TEST_TIMEOUT:+timeout $RECURRENT_TEST_TIMEOUT} "$py" -m pytest -q -ra -m gpu -p no:cacheprovider \
      tests/test_facade.py tests/test_routing.py tests/test_compat_fla.py tests/test_torch_compile.py)
  rc=$?; [ "$rc" -eq 0 ] || { echo "=== tests FAILED (rc=$rc)"; status=1; } ;;
esac

case " $stages " in *" bench "*)
  echo "=== bench_recurrent_kda"
  # shellcheck disable=SC2086  (the extra flags are meant to split)
  ${RECURRENT_BENCH_TIMEOUT:+timeout $RECURRENT_BENCH_TIMEOUT} "$py" benchmarks/bench_recurrent_kda.py \
      --out-dir "$OUT" ${RECURRENT_BENCH_ARGS:-}
  rc=$?; [ "$rc" -eq 0 ] || { echo "=== bench FAILED (rc=$rc)"; status=1; } ;;
esac

echo "=== gpu_recurrent.sh done, status $status"
exit $status
