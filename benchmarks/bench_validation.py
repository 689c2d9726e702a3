"""Host cost of kda-core's metadata-only validation for a T=1 decode call (target: at most 5 us per call).

Times ``validate_decode_t1``, ``validate_packed_decode_t1``, ``validate_recurrent`` (a T=1 pool call, the facade's
routing input) and ``validate_ucache`` (T=8) on one set of tensors, in rounds of many calls; a round's mean is one
sample and the median over rounds is reported. For scale it also times the floor: reading shape, stride, dtype,
data pointer and device of the same tensors once each, which any metadata check must do.

The defaults are the baseline (CUDA tensors where there is a GPU, B=64, H=12), written with its provenance to
benchmarks/baselines/<gpu>/validation.{json,png}; a few seconds. Without a GPU it runs on CPU tensors (the metadata
path is the same) and writes to benchmarks/baselines/cpu/ unless told otherwise.

    python benchmarks/bench_validation.py                              # the baseline
    python benchmarks/bench_validation.py --device cpu --out /tmp/validation_cpu.json
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _baseline  # noqa: E402  (first: puts the repository's packages on sys.path)

NAME = "validation"
HEAD_DIM = 128


def parse_args(argv=None):
    p = _baseline.parser(__doc__)
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "meta"], default="auto",
                   help="where the tensors live (auto: cuda when there is a GPU, else cpu)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--target-us", type=float, default=5.0)
    _baseline.add_output_args(p)
    return p.parse_args(argv)


def make_tensors(B, H, device):
    K = HEAD_DIM
    dev = dict(device=device)
    bf16 = dict(dtype=torch.bfloat16, **dev)
    mixed = torch.zeros(B, 3 * H * K, **bf16)
    t = dict(
        q=mixed[:, : H * K].view(B, 1, H, K), k=mixed[:, H * K : 2 * H * K].view(B, 1, H, K),
        v=mixed[:, 2 * H * K :].view(B, 1, H, K), g=torch.zeros(B, 1, H, K, **bf16),
        beta=torch.zeros(B, 1, H, **bf16), pool=torch.zeros(B + 8, H, K, K, **bf16),
        slots=torch.zeros(B, dtype=torch.int32, **dev), A_log=torch.zeros(H, **dev),
        dt_bias=torch.zeros(H * K, **dev), mixed=mixed, raw_gate=torch.zeros(B, H * K, **bf16),
        raw_beta=torch.zeros(B, H, **bf16),
    )
    T = 8
    t["uc"] = dict(
        q=torch.zeros(B, T, H, K, **bf16), k=torch.zeros(B, T, H, K, **bf16), v=torch.zeros(B, T, H, K, **bf16),
        g=torch.zeros(B, T, H, K, **bf16), b=torch.zeros(B, T, H, **bf16), initial_state_source=t["pool"],
        initial_state_indices=t["slots"], k_cache=torch.zeros(B + 8, H, 32, K, **bf16),
        u_cache=torch.zeros(B + 8, H, 32, K, **bf16), g_cache=torch.zeros(B + 8, H, 32, K, dtype=torch.float32, **dev),
        hist_len=torch.zeros(B, dtype=torch.int32, **dev), cache_base=torch.zeros(B, dtype=torch.int32, **dev),
    )
    return t


def cases(t, device_kind):
    from kda_core import validation as V
    from kda_core.call_args import RecurrentArgs

    q, k, v, g, beta, pool, slots, A_log, dt = (t[n] for n in ("q", "k", "v", "g", "beta", "pool", "slots", "A_log",
                                                             "dt_bias"))
    mixed, raw_gate, raw_beta = t["mixed"], t["raw_gate"], t["raw_beta"]
    H = q.shape[2]
    uc = t["uc"]
    floor_tensors = (q, k, v, g, beta, pool, slots, A_log, dt)
    recurrent = RecurrentArgs(q, k, v, g, beta, A_log=A_log, dt_bias=dt, initial_state=pool, ssm_state_indices=slots,
                              use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True)  # built by the facade

    def floor():
        for x in floor_tensors:
            x.shape, x.stride(), x.dtype, x.data_ptr(), x.get_device()  # noqa: B018

    return {
        "validate_decode_t1": lambda: V.validate_decode_t1(
            q, k, v, g, beta, pool, slots, A_log=A_log, dt_bias=dt, lower_bound=-5.0, device_kind=device_kind),
        "validate_packed_decode_t1": lambda: V.validate_packed_decode_t1(
            mixed, raw_gate, raw_beta, pool, slots, num_heads=H, A_log=A_log, dt_bias=dt, lower_bound=-5.0,
            device_kind=device_kind),
        "validate_recurrent": lambda: V.validate_recurrent(recurrent, device_kind=device_kind),
        "validate_ucache_T8": lambda: V.validate_ucache(
            A_log, uc["g"], dt, -5.0, q=uc["q"], k=uc["k"], v=uc["v"], b=uc["b"],
            initial_state_source=uc["initial_state_source"], initial_state_indices=uc["initial_state_indices"],
            k_cache=uc["k_cache"], u_cache=uc["u_cache"], g_cache=uc["g_cache"], hist_len=uc["hist_len"],
            cache_base=uc["cache_base"], w_ring=16, device_kind=device_kind),
        "floor_metadata_reads_9_tensors": floor,
    }


def time_call(fn, calls, rounds):
    for _ in range(calls):  # warm up
        fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - start) / calls / 1e3)
    return statistics.median(samples), min(samples), max(samples)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        _baseline.require_cuda(f"{NAME} --device cuda")
    run = _baseline.Run(NAME, args)
    device_kind = "cuda" if args.device == "cuda" else "any"
    t = make_tensors(args.batch_size, args.heads, args.device)
    all_cases = cases(t, device_kind)
    records = []
    for i, (name, fn) in enumerate(all_cases.items(), 1):
        median, low, high = time_call(fn, args.calls, args.rounds)
        _baseline.progress(i, len(all_cases), f"{name}: median {median:.2f} us (rounds {low:.2f}..{high:.2f})")
        records.append(dict(name=name, median_us=round(median, 3), min_us=round(low, 3), max_us=round(high, 3),
                            B=args.batch_size, heads=args.heads, device=args.device,
                            target_us=None if name.startswith("floor") else args.target_us,
                            within_target=None if name.startswith("floor") else median <= args.target_us))
    print("\n| call | median us | target |")
    print("|---|---|---|")
    for r in records:
        print(f"| {r['name']} | {r['median_us']:.2f} | {'' if r['target_us'] is None else r['target_us']} |")
    run.save(records)
    run.plot([dict(bars={r["name"]: r["median_us"] for r in records}, ylabel="host time per call (us, median)",
                   target=args.target_us, title=f"B={args.batch_size}, H={args.heads}, {args.device} tensors")],
             title="kda-core validation, host cost per call")
    return records


if __name__ == "__main__":
    main()
