"""Where the host time of one eager T=1 call goes (B=1, H=12, bf16 pool, packed inputs), on a GPU host.

Each line is the wall time per call of many back-to-back calls with one sync at the end, so it is the host cost
whenever it exceeds the ~2.4 us kernel. Pieces: kda-core validation, the packed views, the cached compiled call
alone (TVM-FFI + launch), the same call on tensors converted to tvm_ffi.Tensor beforehand (what the per-call
torch -> DLPack conversion costs: with torch's C exchange API, ``__dlpack_c_exchange_api__``, it is a C call;
without it, a Python ``__dlpack__`` per tensor), one ``tvm_ffi.from_dlpack``, the whole packed and unpacked entry
points, and torch.mul(out=) as a yardstick. The first lines name the torch / tvm_ffi builds and that API.

    python benchmarks/profile_t1_host.py [--calls 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch


def _addon_loaded():
    """Whether tvm_ffi loaded (or JIT-built) its torch C DLPack addon: without it and without torch's own
    ``__dlpack_c_exchange_api__``, every torch tensor argument takes tvm_ffi's Python fallback."""
    try:
        from tvm_ffi import _optional_torch_c_dlpack as addon
    except ImportError:
        return None
    return getattr(addon, "_LIB", None) is not None


def per_call_us(fn, calls):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args(argv)

    import tvm_ffi

    from kda_core.validation import validate_packed_decode_t1
    from kda_cute import decode_t1

    env = dict(torch=torch.__version__, tvm_ffi=getattr(tvm_ffi, "__version__", "?"),
               torch_c_dlpack_exchange_api=hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
               cuda_stream_protocol=hasattr(torch.cuda.Stream, "__cuda_stream__"),
               torch_c_dlpack_addon_loaded=_addon_loaded(),
               TVM_FFI_DISABLE_TORCH_C_DLPACK=os.environ.get("TVM_FFI_DISABLE_TORCH_C_DLPACK"))
    print("env:", env)

    B, H, K = 1, 12, 128
    dev = "cuda"
    mixed = torch.randn(B, 3 * H * K, device=dev).bfloat16()
    gate = torch.randn(B, H * K, device=dev).bfloat16()
    beta = torch.randn(B, H, device=dev).bfloat16()
    pool = (torch.randn(8, H, K, K, device=dev) * 0.1).bfloat16()
    slots = torch.tensor([3], dtype=torch.int32, device=dev)
    A_log = torch.zeros(H, device=dev)
    dt_bias = torch.zeros(H * K, device=dev)
    out = torch.empty(B, 1, H, K, dtype=torch.bfloat16, device=dev)
    kw = dict(num_heads=H, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, output=out)

    def full_packed():
        decode_t1.kda_decode_t1_packed(mixed, gate, beta, pool, slots, **kw)

    full_packed()
    q, k, v, g, bt = decode_t1._packed_views(mixed, gate, beta, H)

    def full_unpacked():
        decode_t1.kda_decode_t1(q, k, v, g, bt, pool, slots, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                                output=out)

    def validation():
        validate_packed_decode_t1(mixed, gate, beta, pool, slots, **kw)

    def views():
        decode_t1._packed_views(mixed, gate, beta, H)

    (fn, _owner), = list(decode_t1._LAUNCH_MEMO.values())[:1]
    scale = K**-0.5

    def compiled_call():
        fn(q, k, v, g, bt, A_log, dt_bias, pool, slots, out, scale, -5.0)

    try:
        ffi_args = [tvm_ffi.from_dlpack(t) for t in (q, k, v, g, bt, A_log, dt_bias, pool, slots, out)]
    except Exception as err:  # a view tvm_ffi refuses: that row is skipped, the others still run
        print(f"tvm_ffi.from_dlpack failed: {type(err).__name__}: {err}")
        ffi_args = None

    def compiled_call_ffi_tensors():
        fn(*ffi_args, scale, -5.0)

    def one_from_dlpack():
        tvm_ffi.from_dlpack(pool)

    def one_python_dlpack_fallback():  # what tvm_ffi does per torch tensor without the C exchange API
        tvm_ffi.from_dlpack(torch.utils.dlpack.to_dlpack(pool))

    a = torch.randn(1024, device=dev)
    c = torch.empty_like(a)

    def torch_mul():
        torch.mul(a, 2.0, out=c)

    rows = {}
    for name, f in [
        ("validate_packed_decode_t1", validation), ("packed views", views), ("compiled call alone", compiled_call),
        ("compiled call, ffi tensors", compiled_call_ffi_tensors if ffi_args else None),
        ("one tvm_ffi.from_dlpack", one_from_dlpack), ("one to_dlpack+from_dlpack", one_python_dlpack_fallback),
        ("kda_decode_t1_packed (whole)", full_packed),
        ("kda_decode_t1 (whole)", full_unpacked), ("torch.mul(out=) yardstick", torch_mul)]:
        if f is None:
            continue
        try:
            rows[name] = per_call_us(f, args.calls)
        except Exception as err:  # one failing row must not hide the others
            print(f"{name}: {type(err).__name__}: {err}")
            continue
        print(f"{name:32s} {rows[name]:8.2f} us/call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        full_packed()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
    print(s.getvalue())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(rows_us=rows, env=env, gpu=torch.cuda.get_device_name()), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
