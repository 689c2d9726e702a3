#!/usr/bin/env bash
# T=1 decode on the GPU host: GPU tests, a compute-sanitizer memcheck of a small case, then the benchmark.
# Run from the repository root after `source .gpu*/setup.sh` (wheels + PYTHONPATH). One log ($OUT/t1_gpu.log),
# JSON and PNG go to $OUT (default ./gpu_out). Stages: T1_STAGES="tests memcheck bench sweep" (default: all four).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
stages=${T1_STAGES:-"tests memcheck bench sweep"}
status=0
py=${PYTHON:-python3}

log="$OUT/t1_gpu.log"
run() {  # run NAME CMD...: append the output to $OUT/t1_gpu.log and remember a failure
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$log"
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "=== $name FAILED (rc=$rc)"; status=1; }
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

case " $stages " in *" tests "*)
  run t1_tests "$py" -m pytest -q -ra -m gpu -p no:cacheprovider packages/kda-cute/tests/test_decode_t1.py \
      packages/kda-cute/tests/test_decode_t1_host.py ;;
esac

case " $stages " in *" memcheck "*)
  case_py=$(mktemp --suffix=.py)
  cat > "$case_py" <<'PY'
import torch
from kda_core.oracle import unpack_packed  # noqa: F401  (import check)
from kda_cute import kda_decode_t1_packed
B, H, K = 3, 12, 128
mixed = torch.randn(B, 3 * H * K + 3, device="cuda").bfloat16()[:, : 3 * H * K]  # odd row stride: unaligned path
gate = torch.randn(B, H * K, device="cuda").bfloat16()
beta = torch.randn(B, H, device="cuda").bfloat16()
for dtype in (torch.bfloat16, torch.float32):
    pool = torch.randn(4, H, K, K, device="cuda").to(dtype)
    slots = torch.tensor([2, -1, 4], dtype=torch.int32, device="cuda")  # one active, two inactive
    A_log, dt_bias = torch.zeros(H, device="cuda"), torch.zeros(H * K, device="cuda")
    kda_decode_t1_packed(mixed, gate, beta, pool, slots, num_heads=H, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    aligned = torch.randn(B, 3 * H * K, device="cuda").bfloat16()
    kda_decode_t1_packed(aligned, gate, beta, pool, slots, num_heads=H, A_log=A_log, dt_bias=dt_bias)
# The schedule's bulk-ring rows (aligned, > 384 bf16 / > 287 fp32 states): 40 rows, every 5th inactive (-1 / N).
B = 40
mixed = torch.randn(B, 3 * H * K, device="cuda").bfloat16()
gate = torch.randn(B, H * K, device="cuda").bfloat16()
beta = torch.randn(B, H, device="cuda").bfloat16()
for dtype in (torch.bfloat16, torch.float32):
    pool = torch.randn(B + 2, H, K, K, device="cuda").to(dtype)
    slots = torch.arange(B, dtype=torch.int32, device="cuda").flip(0)
    slots[::5] = -1
    slots[1::5] = B + 2
    kda_decode_t1_packed(mixed, gate, beta, pool, slots, num_heads=H, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
torch.cuda.synchronize()
print("memcheck case done")
PY
  if command -v compute-sanitizer >/dev/null; then
    run t1_memcheck compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 "$py" "$case_py"
  else
    echo "compute-sanitizer not on PATH: memcheck skipped" | tee -a "$log"
  fi ;;
esac

bench=benchmarks/bench_packed_kda_decode.py
case " $stages " in *" bench "*)
  run t1_bench_bf16 "$py" $bench --mode cuda_graph --state-dtype bf16 --json "$OUT/t1_bench_bf16.json" \
      --plot "$OUT/t1_bench_bf16.png"
  run t1_bench_fp32 "$py" $bench --mode cuda_graph --state-dtype fp32 --batch-size 1 8 64 256 512 1024 \
      --eager-calls 0 --json "$OUT/t1_bench_fp32.json" ;;
esac

case " $stages " in *" sweep "*)
  # Staging and tile at the bandwidth-bound sizes (the small sizes' sweep is in benchmarks/results/).
  run t1_tile_sweep_bf16 "$py" $bench --mode cuda_graph --state-dtype bf16 --tile-v 64 128 --stage regs smem \
      --batch-size 256 512 1024 --iterations 50 --eager-calls 0 --no-fla --json "$OUT/t1_tile_sweep_bf16.json"
  run t1_tile_sweep_fp32 "$py" $bench --mode cuda_graph --state-dtype fp32 --tile-v 32 64 --stage regs smem \
      --batch-size 512 --iterations 50 --eager-calls 0 --no-fla --json "$OUT/t1_tile_sweep_fp32.json" ;;
esac

exit $status
