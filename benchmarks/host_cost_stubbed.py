"""Host cost of the engine adapters and their bare entries, with the compiled launch stubbed out (no GPU needed).

Each call form of ``bench_serving.py`` at B sequences (default 1), H = 12, ``out`` given, on CPU tensors: the vLLM
Kimi K3 packed-decode adapter against ``kda_decode_t1_packed`` on ready views, the vLLM Kimi-Linear adapter (its
``[1, N, H, 128]`` + ``cu_seqlens`` form, the facade's varlen path) against ``kda_decode_t1`` on ready views, and
the SGLang adapter against ``kda_decode_t1_packed``, for a bf16 and an fp32 pool. The compiled function is replaced by
a no-op, the launch floors are lowered so that CPU tensors take the kernel branches, and every description kda-core
builds for a CPU call is also remembered as the CUDA one of the same facts; what is timed is the Python host path
(validation, re-validation, routing, the launch memo), not the FFI call.

Prints the min and median over rounds of the mean thread CPU time per call. ``--root`` measures another tree's
packages (e.g. ``git archive <commit> packages | tar -x -C /tmp/before``) for an A/B comparison: run both
alternately, several times, and compare each adapter's excess over its bare entry within one run (the absolute
figures drift with the machine's load).

    python benchmarks/host_cost_stubbed.py
    python benchmarks/host_cost_stubbed.py --root /tmp/before --rounds 9 --calls 2000
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import os
import statistics
import sys
import time
import timeit

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=os.path.dirname(HERE), help="the tree whose packages/*/src are measured")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    p.add_argument("--batch-size", type=int, default=1)
    return p.parse_args(argv)


def stub(V, decode_t1, facade, kimi_k3, sglang):
    """Stub the compiled launch and make CPU calls take the kernel branches (see the module docstring)."""
    decode_t1._launch.get_or_compile = lambda key, build, arch: (lambda *args: None)
    V._LAUNCH_DEVICE_MIN = -1
    kimi_k3._KERNEL_DEVICE_MIN = -1
    sglang._KERNEL_DEVICE_MIN = -1
    for name in ("validate_decode_t1", "validate_packed_decode_t1", "validate_packed_tokens_decode_t1"):
        if hasattr(V, name):
            full = functools.partial(getattr(V, name), device_kind="any")
            setattr(V, name, full)
            setattr(decode_t1, name, full)
    twin = {}
    remember = V._remember

    def remember_twin(key, call):
        call = remember(key, call)
        if key[0] == "recurrent" and key[-1] is False and "not on a CUDA device" in call.t1_reason:
            cuda = dataclasses.replace(call, on_cuda=True, t1_eligible=True)
            V._MEMO[(*key[:-1], True)] = cuda
            twin[id(call)] = cuda
        return call

    V._remember = remember_twin
    validate = facade._validate

    def validate_as_cuda(args):
        call = validate(args)
        return twin.get(id(call), call)

    facade._validate = validate_as_cuda


def calls(torch, B, H, state_dtype, decode_t1, kimi_k3, kimi_linear, sglang):
    K = 128
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def rn(*shape, to=bf):
        return torch.randn(*shape, generator=gen).to(to)

    row = H * K * K
    pool = torch.zeros((B + 1) * (row + 8), dtype=state_dtype).as_strided((B + 1, H, K, K), (row + 8, K * K, K, 1))
    slots = torch.zeros(B, 4, dtype=torch.int32)[:, 0]
    slots += torch.arange(1, B + 1, dtype=torch.int32)
    A_log, dt_bias = rn(H, to=torch.float32), rn(H, K, to=torch.float32)
    dt_flat = dt_bias.view(-1)
    mixed = rn(B, 3 * H * K + 8)[:, : 3 * H * K]
    raw_g, raw_beta = rn(1, B, H, K), rn(1, B, H)
    out = torch.empty(1, B, H, K, dtype=bf)
    q, k, v = (rn(1, B, H, K) for _ in range(3))
    g = torch.nn.functional.logsigmoid(rn(1, B, H, K, to=torch.float32))
    beta = torch.rand(1, B, H, generator=gen)
    cu = torch.arange(B + 1, dtype=torch.int32)
    sg_mixed, sg_a, sg_b = rn(B, 3 * H * K), rn(B, H * K), rn(B, H)
    sg_out = torch.empty(B, 1, H, K, dtype=bf)
    gate_rows, beta_rows, out_rows = raw_g.view(B, H * K), raw_beta.view(B, H), out.view(B, 1, H, K)
    views = [t.view(B, 1, H, K) for t in (q, k, v, g)] + [beta.view(B, 1, H)]
    nonpositive = kimi_k3._NULL_POLICY
    return {
        "vllm_k3 adapter": lambda: kimi_k3.fused_recurrent_kda_packed_decode(
            mixed, raw_g, raw_beta, A_log, dt_bias, -5.0, pool, slots, out=out),
        "vllm_k3 bare": lambda: decode_t1.kda_decode_t1_packed(
            mixed, gate_rows, beta_rows, pool, slots, num_heads=H, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
            output=out_rows, null_policy=nonpositive),
        "kimi_linear adapter": lambda: kimi_linear.fused_recurrent_kda(
            q, k, v, g, beta, initial_state=pool, inplace_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu, ssm_state_indices=slots, out=out),
        "kimi_linear bare": lambda: decode_t1.kda_decode_t1(
            *views, pool, slots, use_gate_in_kernel=False, beta_is_logit=False, output=out_rows,
            null_policy=nonpositive),
        "sglang adapter": lambda: sglang.fused_recurrent_kda_packed_decode(
            sg_mixed, sg_a, sg_b, A_log, dt_flat, K**-0.5, pool, sg_out, slots, use_qk_l2norm_in_kernel=True,
            lower_bound=None),
        "sglang bare": lambda: decode_t1.kda_decode_t1_packed(
            sg_mixed, sg_a, sg_b, pool, slots, num_heads=H, A_log=A_log, dt_bias=dt_flat, lower_bound=None,
            output=sg_out),
    }


def main(argv=None):
    args = parse_args(argv)
    sys.path[:0] = sorted(glob.glob(os.path.join(args.root, "packages", "*", "src")))
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # no device to ask (nothing compiles: the launch is stubbed)
    import torch

    from kda_core import validation
    from kda_cute import decode_t1
    from kda_recurrent import facade
    from kda_recurrent.compat import sglang
    from kda_recurrent.compat.vllm import kimi_k3, kimi_linear

    stub(validation, decode_t1, facade, kimi_k3, sglang)
    print(f"root {args.root}, B={args.batch_size}, H=12, {args.rounds} rounds x {args.calls} calls, thread CPU time")
    for state_dtype in (torch.bfloat16, torch.float32):
        fns = calls(torch, args.batch_size, 12, state_dtype, decode_t1, kimi_k3, kimi_linear, sglang)
        for fn in fns.values():  # described, configured
            fn()
            fn()
        samples = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                seconds = timeit.Timer(fn, timer=time.thread_time).timeit(number=args.calls)
                samples[name].append(seconds / args.calls * 1e6)
        for name, s in samples.items():
            med = statistics.median(s)
            print(f"{str(state_dtype)[6:]:8s} pool  {name:20s} min {min(s):6.2f} us  median {med:6.2f} us")


if __name__ == "__main__":
    main()
