#!/usr/bin/env bash
# Generic recurrent kernel (kda_cute.recurrent) on the GPU host: its GPU tests, a compute-sanitizer memcheck of a
# small spec-decode + varlen case, then a timing run against FLA (fused_recurrent_kda_fwd, state_v_first) in the
# same process: spec decode with per-token checkpoints (T = 4, 8) and short prefill chunks (T = 16, 64), plus a tile
# sweep for the schedule table. Run from the repository root after `source .gpu*/setup.sh`.
# Everything is tee'd to $OUT/log (default ./gpu_out); the timings also go to $OUT/generic_bench.json.
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
  "$py" -m pytest -q -ra -p no:cacheprovider --durations=5 packages/kda-cute/tests/test_recurrent.py || status=1 ;;
esac

case " $stages " in *" memcheck "*)
  echo "=== generic memcheck"
  cat > "$OUT/generic_memcheck_case.py" <<'PY'
import torch
from kda_cute.recurrent import kda_recurrent_fwd
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
  echo "=== generic bench"
  cat > "$OUT/generic_bench.py" <<'PY'
"""Generic kernel vs FLA fused_recurrent_kda_fwd (state_v_first) in one process, CUDA-graph replay, warm L2."""
import json
import os
import torch
from kda_cute import recurrent as R

try:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
except Exception as exc:  # noqa: BLE001
    print("FLA unavailable:", exc)
    fused_recurrent_kda_fwd = None

H, K = 12, 128
REPS = 20


def time_us(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)
    return sorted(times)[len(times) // 2]


def inputs(B, T, spec):
    """spec: a bf16 pool with 2-D slots and num_accepted_tokens; else a dense fp32 initial state (FLA's 1-D pool
    mode writes token t's state to idx[n + t], so prefill chunks are compared in dense mode)."""
    gen = torch.Generator(device="cuda").manual_seed(B * 100 + T)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q, k, v, g = (rnd(B, T, H, K).bfloat16() for _ in range(4))
    beta = rnd(B, T, H).bfloat16()
    A_log = torch.log(torch.rand(H, generator=gen, device="cuda") * 15 + 1)
    dt_bias = rnd(H * K) * 0.5
    if spec:
        n_slots = B * T + 64
        pool = (rnd(n_slots, H, K, K) * 0.1).bfloat16()
        perm = torch.randperm(n_slots, generator=gen, device="cuda").to(torch.int32)
        slots = perm[: B * T].view(B, T).contiguous()
        nat = torch.randint(1, T + 1, (B,), generator=gen, device="cuda", dtype=torch.int32)
    else:
        pool, slots, nat = rnd(B, H, K, K) * 0.1, None, None
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, pool=pool, slots=slots, nat=nat)


def ours(x, out):
    spec = x["slots"] is not None
    return lambda: R.kda_recurrent_fwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0,
        use_gate_in_kernel=True, beta_is_logit=True, initial_state=x["pool"], ssm_state_indices=x["slots"],
        num_accepted_tokens=x["nat"], output_final_state=not spec, output=out)


def fla(x, out):
    spec = x["slots"] is not None
    return lambda: fused_recurrent_kda_fwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=x["pool"],
        inplace_final_state=spec, output_final_state=not spec, state_v_first=True, ssm_state_indices=x["slots"],
        num_accepted_tokens=x["nat"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, out=out)


QUICK = os.environ.get("GENERIC_BENCH", "full") == "quick"
rows = []
if QUICK:
    cases = [(T, B, True) for T in (4, 8) for B in (64, 512)] + [(16, 64, False), (64, 64, False)]
else:
    cases = [(T, B, True) for T in (4, 8) for B in (1, 8, 64, 128, 256, 512)]
    cases += [(T, B, False) for T in (16, 64) for B in (1, 8, 64, 256)]
for T, B, spec in cases:
    x = inputs(B, T, spec)
    out = torch.empty(B, T, H, K, dtype=torch.bfloat16, device="cuda")
    state_bytes = B * H * K * K * (2 * (1 + T) if spec else 8)
    row = dict(T=T, B=B, mode="spec" if spec else "dense", state_MB=state_bytes / 1e6,
               tile_v=R.select_config(B * H, K).tile_v)
    row["ours_us"] = time_us(ours(x, out))
    if fused_recurrent_kda_fwd is not None:
        # Same inputs, fresh pools: one call each from the same state, outputs compared.
        x1, x2 = dict(x, pool=x["pool"].clone()), dict(x, pool=x["pool"].clone())
        o1, o2 = torch.empty_like(out), torch.zeros_like(out)
        s1 = ours(x1, o1)()[1]
        s2 = fla(x2, o2)()[1]
        torch.cuda.synchronize()
        row["max_abs_diff_vs_fla_o"] = (o1.float() - o2.float()).abs().max().item()
        row["max_abs_diff_vs_fla_state"] = (s1.float() - s2.float()).abs().max().item()
        row["fla_us"] = time_us(fla(x, out))
        row["ratio"] = row["ours_us"] / row["fla_us"]
    row["ours_GBps"] = state_bytes / row["ours_us"] / 1e3
    rows.append(row)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)

# Tile sweep for the schedule table (spec decode T=8 and a T=64 chunk).
sweep = []
default_select = R.select_config
for T, B, spec in [(8, 64, True), (8, 512, True)] if QUICK else [(8, 8, True), (8, 64, True), (8, 512, True),
                                                                 (64, 64, False)]:
    x = inputs(B, T, spec)
    out = torch.empty(B, T, H, K, dtype=torch.bfloat16, device="cuda")
    for tile in R.tile_v_choices(K):
        R.select_config = lambda n, k, tile=tile: R.RecurrentConfig(tile)
        us = time_us(ours(x, out))
        sweep.append(dict(T=T, B=B, mode="spec" if spec else "dense", tile_v=tile, us=us))
        print("sweep", sweep[-1], flush=True)
    R.select_config = default_select

json.dump(dict(device=torch.cuda.get_device_name(), rows=rows, sweep=sweep),
          open(os.path.join(os.environ.get("OUT", "."), "generic_bench.json"), "w"), indent=1)
PY
  "$py" "$OUT/generic_bench.py" || status=1 ;;
esac

echo "=== gpu_generic.sh done, status $status"
return $status
}

main 2>&1 | tee -a "$OUT/log"
exit "${PIPESTATUS[0]}"
