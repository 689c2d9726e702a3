"""Where the host time of one eager T=1 call goes (B=1, H=12 by default, bf16 pool), packed entry first.

Each row is the wall time per call of many back-to-back calls with one sync at the end, so on a GPU it is the host
cost whenever it exceeds the ~2.4 us kernel. Rows, then a split of each entry point into its parts:

- validation: kda-core's full validators ``validate_packed_decode_t1`` / ``validate_decode_t1`` /
  ``validate_recurrent`` (a call shape's first call), and the re-validators the entries call on every later one
  (``revalidate_packed_decode_t1`` / ``revalidate_decode_t1`` / ``revalidate_recurrent_t1``: the facts the compiled
  wrapper cannot check); the split below counts the re-validators;
- facade routing: ``facade._route`` on the validated call (the knob read included);
- launch glue + compiled call: decode_t1's ``_run_packed`` / ``_run`` on a validated call (launch memo lookup, then
  the compiled function);
- compiled call alone: the cached TVM-FFI function with the packed rows (8 tensors) and with five views (10
  tensors), and on tensors converted to ``tvm_ffi.Tensor`` beforehand (what the per-call torch -> DLPack conversion
  costs); one ``tvm_ffi.from_dlpack``;
- whole entries: ``kda_decode_t1_packed``, ``kda_decode_t1`` (on views of the same rows), ``recurrent_kda`` (the
  facade, T=1 fast path); ``torch.mul(out=)`` as a yardstick of torch's own per-op cost.

``--device cpu`` runs without a GPU: the validators take ``device_kind="any"``, the compile step is replaced by a
Python no-op (so "launch glue" is the memo lookup and argument handling plus one Python call), the re-validators'
launch device floor is lowered to accept CPU tensors (``validation._LAUNCH_DEVICE_MIN``), and the facade sees its
call as a described CUDA call (a stand-in after the real re-validation reads). The stand-in's own cost is printed as
a row; the CPU figures are for comparing host-path changes on one machine, the
GPU figures are the ones the targets (issue 3: 12 us packed; issue 4: 15 us facade) are about.

    python benchmarks/profile_t1_host.py [--calls 2000] [--heads 12] [--json PATH]   # on the GPU host
    python benchmarks/profile_t1_host.py --device cpu                                # validation + glue only
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import platform
import pstats
import sys
import time

import torch

K = 128
LOWER_BOUND = -5.0


def _addon_loaded():
    """Whether tvm_ffi loaded (or JIT-built) its torch C DLPack addon: without it and without torch's own
    ``__dlpack_c_exchange_api__``, every torch tensor argument takes tvm_ffi's Python fallback."""
    try:
        from tvm_ffi import _optional_torch_c_dlpack as addon
    except ImportError:
        return None
    return getattr(addon, "_LIB", None) is not None


def per_call_us(fn, calls, sync):
    for _ in range(50):
        fn()
    sync()
    best = float("inf")
    for _ in range(3):  # the best of three rounds: host timings only ever get slower from noise
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--calls", type=int, default=2000, help="calls per timing round (3 rounds, best kept)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--profile", action="store_true", help="also print a cProfile of the packed entry")
    p.add_argument("--json", type=str, default=None)
    return p.parse_args(argv)


def make_inputs(B, H, dev):
    mixed = torch.randn(B, 3 * H * K, device=dev).bfloat16()
    gate = torch.randn(B, H * K, device=dev).bfloat16()
    beta = torch.randn(B, H, device=dev).bfloat16()
    pool = (torch.randn(B + 7, H, K, K, device=dev) * 0.1).bfloat16()
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    A_log = torch.zeros(H, device=dev)
    dt_bias = torch.zeros(H * K, device=dev)
    out = torch.empty(B, 1, H, K, dtype=torch.bfloat16, device=dev)
    from kda_core.oracle import unpack_packed

    q, k, v, g, bt = unpack_packed(mixed, gate, beta, H, K)  # zero-copy views of the same rows
    return dict(
        mixed=mixed,
        gate=gate,
        beta=beta,
        pool=pool,
        slots=slots,
        A_log=A_log,
        dt_bias=dt_bias,
        out=out,
        q=q,
        k=k,
        v=v,
        g=g,
        bt=bt,
    )


def main(argv=None):
    args = parse_args(argv)
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu for validation + glue only)")
    if not on_gpu:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # the DSL reads it at import; nothing is compiled here

    from kda_core import validation
    from kda_cute import _launch, decode_t1
    from kda_recurrent import facade

    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    env = dict(torch=torch.__version__, python=platform.python_version(), device=args.device)
    if on_gpu:
        import tvm_ffi

        env.update(
            tvm_ffi=getattr(tvm_ffi, "__version__", "?"),
            torch_c_dlpack_exchange_api=hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
            torch_c_dlpack_addon_loaded=_addon_loaded(),
            TVM_FFI_DISABLE_TORCH_C_DLPACK=os.environ.get("TVM_FFI_DISABLE_TORCH_C_DLPACK"),
            gpu=torch.cuda.get_device_name(),
        )
    else:
        env.update(
            processor=platform.processor() or platform.machine(),
            note="validators with device_kind='any'; the compiled function is a Python no-op",
        )
    print("env:", env)

    B, H = args.batch_size, args.heads
    x = make_inputs(B, H, args.device)
    mixed, gate, beta, pool, slots, A_log, dt_bias, out = (
        x[n] for n in ("mixed", "gate", "beta", "pool", "slots", "A_log", "dt_bias", "out")
    )
    q, k, v, g, bt = (x[n] for n in ("q", "k", "v", "g", "bt"))
    kind = "cuda" if on_gpu else "any"
    gate_kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND)
    rows, notes = {}, {}

    if not on_gpu:  # the CPU stand-ins: a no-op compiled function, validators that accept CPU tensors

        def no_op(*_args):
            return None

        _launch.get_or_compile = lambda key, build, arch=None: no_op
        real_validate = validation.validate_recurrent
        as_cuda = {}

        def validate_as_cuda(*a):
            call = real_validate(*a)
            marked = as_cuda.get(id(call))
            if marked is None:  # the remembered description, as a CUDA call would have it (T=1 eligible)
                marked = as_cuda[id(call)] = (call, dataclasses.replace(call, on_cuda=True, t1_eligible=True))
            return marked[1]

        facade._validate = validate_as_cuda
        # The re-validators read every fact as on a GPU (the device floor lowered for CPU tensors); the facade's key
        # names on_cuda, so on CPU it misses and the stand-in returns the CUDA-marked description after the reads.
        validation._LAUNCH_DEVICE_MIN = -1
        real_revalidate = validation.revalidate_recurrent_t1
        marked = []  # the CUDA-marked description of the facade's call, once the full path has built it

        def revalidate_as_cuda(*a):
            real_revalidate(*a)
            return marked[0] if marked else None

        facade._revalidate = revalidate_as_cuda
        # Describe the calls once with device_kind="any", so that the entries' re-validators find them.
        validation.validate_packed_decode_t1(mixed, gate, beta, pool, slots, num_heads=H, output=out, device_kind="any",
                                             **gate_kw)
        validation.validate_decode_t1(q, k, v, g, bt, pool, slots, output=out, device_kind="any", **gate_kw)

    def packed_entry():
        decode_t1.kda_decode_t1_packed(mixed, gate, beta, pool, slots, num_heads=H, output=out, **gate_kw)

    def unpacked_entry():
        decode_t1.kda_decode_t1(q, k, v, g, bt, pool, slots, output=out, **gate_kw)

    facade_kw = dict(
        initial_state=pool, use_gate_in_kernel=True, beta_is_logit=True, ssm_state_indices=slots, output=out, **gate_kw
    )

    def facade_call():
        facade.recurrent_kda(q, k, v, g, bt, **facade_kw)

    facade_args = (
        q,
        k,
        v,
        g,
        bt,
        A_log,
        dt_bias,
        None,
        pool,
        False,
        True,
        True,
        LOWER_BOUND,
        True,
        None,
        slots,
        None,
        out,
    )
    packed_entry()  # compile (GPU) and fill the memos
    unpacked_entry()
    facade_call()
    packed_call = validation.validate_packed_decode_t1(
        mixed, gate, beta, pool, slots, num_heads=H, output=out, device_kind=kind, **gate_kw
    )
    unpacked_call = validation.validate_decode_t1(q, k, v, g, bt, pool, slots, output=out, device_kind=kind, **gate_kw)
    facade_t1_call = facade._validate(*facade_args)
    if not on_gpu:
        marked.append(facade_t1_call)
    assert facade._route(facade_t1_call) is facade.Path.T1, facade._route(facade_t1_call)

    cases = [
        (
            "validate_packed_decode_t1",
            lambda: validation.validate_packed_decode_t1(
                mixed, gate, beta, pool, slots, num_heads=H, output=out, device_kind=kind, **gate_kw
            ),
        ),
        (
            "validate_decode_t1",
            lambda: validation.validate_decode_t1(q, k, v, g, bt, pool, slots, output=out, device_kind=kind, **gate_kw),
        ),
        ("validate_recurrent", lambda: validation.validate_recurrent(*facade_args, device_kind=kind)),
        (
            "revalidate_packed_decode_t1 (hot path)",
            lambda: validation.revalidate_packed_decode_t1(
                mixed, gate, beta, pool, slots, H, A_log, dt_bias, LOWER_BOUND, True, True, None, out
            ),
        ),
        (
            "revalidate_decode_t1 (hot path)",
            lambda: validation.revalidate_decode_t1(
                q, k, v, g, bt, pool, slots, A_log, dt_bias, LOWER_BOUND, True, True, None, out
            ),
        ),
        ("revalidate_recurrent_t1 (hot path)", lambda: validation.revalidate_recurrent_t1(*facade_args)),
        ("facade routing", lambda: facade._route(facade_t1_call)),
        (
            "packed launch glue + compiled call",
            lambda: decode_t1._run_packed(packed_call, mixed, gate, beta, pool, slots, A_log, dt_bias, True, out),
        ),
        (
            "unpacked launch glue + compiled call",
            lambda: decode_t1._run(unpacked_call, q, k, v, g, bt, pool, slots, A_log, dt_bias, True, out),
        ),
    ]
    if on_gpu:
        memo = decode_t1._LAUNCH_MEMO
        fn_packed = next(e[1] for key, e in memo.items() if key[0] == id(packed_call) and key[1])
        fn_unpacked = next(e[1] for key, e in memo.items() if key[0] == id(unpacked_call) and not key[1])
        scale = K**-0.5
        cases += [
            (
                "compiled call alone, packed (8 tensors)",
                lambda: fn_packed(mixed, gate, beta, A_log, dt_bias, pool, slots, out, scale, LOWER_BOUND),
            ),
            (
                "compiled call alone, views (10 tensors)",
                lambda: fn_unpacked(q, k, v, g, bt, A_log, dt_bias, pool, slots, out, scale, LOWER_BOUND),
            ),
        ]
        import tvm_ffi

        try:
            ffi = [tvm_ffi.from_dlpack(t) for t in (mixed, gate, beta, A_log, dt_bias, pool, slots, out)]
            cases.append(("compiled call, packed, ffi tensors", lambda: fn_packed(*ffi, scale, LOWER_BOUND)))
        except Exception as err:  # a tensor tvm_ffi refuses: that row is skipped, the others still run
            print(f"tvm_ffi.from_dlpack failed: {type(err).__name__}: {err}")
        cases.append(("one tvm_ffi.from_dlpack", lambda: tvm_ffi.from_dlpack(pool)))
    else:
        cases.append(("(cpu) facade's re-validation stand-in", lambda: facade._revalidate(*facade_args)))
        notes["(cpu) facade's re-validation stand-in"] = "minus revalidate_recurrent_t1 = the stand-in's wrapper"
    cases += [
        ("kda_decode_t1_packed (whole)", packed_entry),
        ("kda_decode_t1 (whole, views)", unpacked_entry),
        ("recurrent_kda facade (whole, T=1 path)", facade_call),
    ]
    if on_gpu:
        a = torch.randn(1024, device="cuda")
        c = torch.empty_like(a)
        cases.append(("torch.mul(out=) yardstick", lambda: torch.mul(a, 2.0, out=c)))

    for name, fn in cases:
        try:
            rows[name] = per_call_us(fn, args.calls, sync)
        except Exception as err:  # one failing row must not hide the others
            print(f"{name}: {type(err).__name__}: {err}")
            continue
        print(f"{name:44s} {rows[name]:8.2f} us/call", flush=True)

    # The split of each whole entry into its measured parts (whatever is left is Python glue in the entry itself).
    def part(name):
        return rows.get(name, float("nan"))

    fwrap = 0.0 if on_gpu else (part("(cpu) facade's re-validation stand-in")
                                - part("revalidate_recurrent_t1 (hot path)"))
    split = {
        "packed entry": (
            part("kda_decode_t1_packed (whole)"),
            [
                ("validation", part("revalidate_packed_decode_t1 (hot path)")),
                ("launch glue + compiled call", part("packed launch glue + compiled call")),
            ],
        ),
        "unpacked entry": (
            part("kda_decode_t1 (whole, views)"),
            [
                ("validation", part("revalidate_decode_t1 (hot path)")),
                ("launch glue + compiled call", part("unpacked launch glue + compiled call")),
            ],
        ),
        "facade": (
            part("recurrent_kda facade (whole, T=1 path)") - fwrap,
            [
                ("validation", part("revalidate_recurrent_t1 (hot path)")),
                ("routing", part("facade routing")),
                ("launch glue + compiled call", part("unpacked launch glue + compiled call")),
            ],
        ),
    }
    if on_gpu:
        for entry, compiled in (
            ("packed entry", "compiled call alone, packed (8 tensors)"),
            ("unpacked entry", "compiled call alone, views (10 tensors)"),
            ("facade", "compiled call alone, views (10 tensors)"),
        ):
            parts = split[entry][1]
            glue = parts[-1][1] - part(compiled)
            parts[-1:] = [("launch glue", glue), ("compiled call", part(compiled))]
    print("\nsplit (us per call" + ("" if on_gpu else ", CPU stand-ins' wrapper cost removed") + "):")
    for entry, (whole, parts) in split.items():
        rest = whole - sum(v for _, v in parts)
        text = ", ".join(f"{n} {v:.2f}" for n, v in parts)
        print(f"  {entry:15s} {whole:6.2f} = {text}, rest {rest:.2f}")

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            packed_entry()
        prof.disable()
        sync()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        print(s.getvalue())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                dict(
                    rows_us=rows,
                    notes=notes,
                    env=env,
                    B=B,
                    heads=H,
                    split_us={e: dict(whole=w, **dict(p)) for e, (w, p) in split.items()},
                ),
                fh,
                indent=1,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
