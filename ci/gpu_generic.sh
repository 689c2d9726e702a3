#!/usr/bin/env bash
# Generic recurrent kernel (kda_cute.generic) on the GPU host: its GPU tests, a compute-sanitizer memcheck of a
# small spec-decode + varlen case, then a timing run against FLA (fused_recurrent_kda_fwd, state_v_first) in the
# same process: spec decode with per-token checkpoints (T = 4, 8) and short prefill chunks (T = 16, 64), plus a tile
# sweep for the schedule table. Run from the repository root after `source .gpu*/setup.sh`.
# Everything is tee'd to $OUT/log (default ./gpu_out); the timings go to $OUT (bench_recurrent_kda's JSON + PNG,
# generic_tile_sweep.json).
# Stages: GENERIC_STAGES="tests memcheck bench" (default: all three). GENERIC_BENCH=quick times fewer shapes.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
stages=${GENERIC_STAGES:-"tests memcheck bench"}
py=${PYTHON:-python3}
status=0

main() {
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

case " $stages " in *" tests "*)
  echo "=== generic tests"
  "$py" -m pytest -q -ra -p no:cacheprovider --durations=5 packages/kda-cute/tests/test_generic.py || status=1 ;;
esac

case " $stages " in *" memcheck "*)
  echo "=== generic memcheck"
  cat > "$OUT/generic_memcheck_case.py" <<'PY'
import torch
from kda_cute.generic import kda_recurrent_fwd
H, K = 4, 128
for dtype in (torch.bfloat16, torch.float32):
    B, T = 3, 4
    q, k, v, g = (torch.randn(B, T, H, K + 1, device="cuda").bfloat16()[..., 1:] for _ in range(4))  # unaligned
    beta = torch.randn(B, T, H, device="cuda").bfloat16()
    pool = torch.randn(6, H, K, K, device="cuda").to(dtype)
    slots = torch.tensor([[0, 1, -1, 3], [6, 4, 5, 2], [-1, -1, -1, -1]], dtype=torch.int32, device="cuda")
    nat = torch.tensor([4, 1, 2], dtype=torch.int32, device="cuda")
    kda_recurrent_fwd(q, k, v, g, beta, A_log=torch.zeros(H, device="cuda"), dt_bias=torch.zeros(H * K, device="cuda"),
                      lower_bound=-5.0, use_gate_in_kernel=True, beta_is_logit=True, initial_state=pool,
                      ssm_state_indices=slots, num_accepted_tokens=nat)
    cu = torch.tensor([0, 0, 5, 7], dtype=torch.int32, device="cuda")
    q, k, v, g = (torch.randn(1, 9, H, K, device="cuda").bfloat16() for _ in range(4))
    beta = torch.rand(1, 9, H, device="cuda").bfloat16()
    kda_recurrent_fwd(q, k, v, -g.abs(), beta, initial_state=pool, cu_seqlens=cu,
                      ssm_state_indices=torch.tensor([1, 6, 2], dtype=torch.int32, device="cuda"))
    kda_recurrent_fwd(q, k, v, -g.abs(), beta, cu_seqlens=cu, output_final_state=True)
torch.cuda.synchronize()
print("memcheck case ran")
PY
  if command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 "$py" "$OUT/generic_memcheck_case.py" || status=1
  else
    echo "compute-sanitizer not found; running the case plainly"; "$py" "$OUT/generic_memcheck_case.py" || status=1
  fi ;;
esac

case " $stages " in *" bench "*)
  # The benchmark scripts themselves (each checks ours against FLA and the oracle before timing): spec decode and
  # prefill chunks through the generic kernel, then the tile sweep for the schedule table.
  echo "=== generic bench"
  if [ "${GENERIC_BENCH:-full}" = quick ]; then
    bench_args=(--parts spec prefill --spec-batch 64 512 --prefill-batch 8 --eager-calls 0)
    sweep_args=(--t 8 --batch-size 64 512)
  else
    bench_args=(--parts spec prefill --eager-calls 0)
    sweep_args=(--t 4 8 --batch-size 1 8 64 512)
  fi
  "$py" benchmarks/bench_recurrent_kda.py --out-dir "$OUT" "${bench_args[@]}" || status=1
  "$py" benchmarks/sweep_recurrent_tiles.py "${sweep_args[@]}" --json "$OUT/generic_tile_sweep.json" || status=1 ;;
esac

echo "=== gpu_generic.sh done, status $status"
return $status
}

main 2>&1 | tee -a "$OUT/log"
exit "${PIPESTATUS[0]}"
