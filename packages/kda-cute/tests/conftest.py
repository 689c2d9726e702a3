"""Shared fixtures of the kda-cute tests.

GPU tests carry ``@pytest.mark.gpu`` and skip cleanly where CUDA is missing; ``@pytest.mark.multi_gpu`` ones skip
below two GPUs. CPU tests (compile checks,
validation, schedule policy) compile for ``CUTE_DSL_ARCH`` (default sm_90a here) without a GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    # The DSL reads the target once at import: set it before anything imports cutlass.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

HEAD_DIM = 128


# The compile checks run for sm_90a and sm_100a. The kernels have no arch-dependent source (one source, no sm_100
# branch yet), so the sm_100a build differs only in the backend's lowering and register allocation; a compile check
# marked ``sm100_share(keep)`` runs its sm_100a cases only where ``keep(params, indices)`` (pytest's callspec: the
# parameter values and indices) is true. The full cross product cost 25 of CI's 30 minutes on the 2-core
# machine; the share keeps every kernel family, gate, pool dtype and alignment class on both targets.
# The long variant lists keep every third case by its position in the list (``VARIANTS.index(params[name]) % 3``;
# ``indices`` counts a case's position in the whole parametrization, not in one list).


def _sm100_deselected(item) -> bool:
    marker = item.get_closest_marker("sm100_share")
    spec = getattr(item, "callspec", None)
    if marker is None or spec is None or spec.params.get("arch") != "sm_100a":
        return False
    return not marker.args[0](spec.params, spec.indices)


def pytest_collection_modifyitems(config, items):
    deselected = [item for item in items if _sm100_deselected(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not _sm100_deselected(item)]
    if torch.cuda.device_count() < 2:  # (device_count is 0 without CUDA)
        skip_two = pytest.mark.skip(reason="needs two CUDA GPUs")
        for item in items:
            if "multi_gpu" in item.keywords:
                item.add_marker(skip_two)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass
class DecodeCase:
    """One T=1 decode call's inputs (unpacked views of a packed GEMM output, like a serving engine's)."""

    mixed_qkv: torch.Tensor
    raw_gate: torch.Tensor
    raw_beta: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    pool: torch.Tensor
    slots: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    lower_bound: float | None
    use_gate_in_kernel: bool
    beta_is_logit: bool

    def kwargs(self):
        return dict(A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound,
                    use_gate_in_kernel=self.use_gate_in_kernel, beta_is_logit=self.beta_is_logit)

    def oracle(self, pool=None, dtype=torch.float32):
        """(output, pool after the step) from kda_core's oracle, on a copy of the pool."""
        from kda_core.oracle import recurrent_kda_ref

        ref_pool = (self.pool if pool is None else pool).clone()
        o, ref_pool = recurrent_kda_ref(
            self.q, self.k, self.v, self.g, self.beta, A_log=self.A_log, dt_bias=self.dt_bias,
            initial_state=ref_pool, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=self.use_gate_in_kernel,
            lower_bound=self.lower_bound, beta_is_logit=self.beta_is_logit, ssm_state_indices=self.slots.long(),
            dtype=dtype,
        )
        return o, ref_pool


def make_case(B, H, *, state_dtype=torch.bfloat16, gate="lower_bound", n_slots=None, slots=None, seed=0,
              row_pad=0, row_shift=0, pool_row_pad=0, g_dtype=torch.bfloat16, device="cuda"):
    """Random decode inputs. ``gate``: "lower_bound" | "softplus" | "precomputed".

    ``row_pad`` pads the packed GEMM rows (elements), ``row_shift`` starts mixed_qkv and raw_gate that many elements
    into their rows (a shifted data pointer), ``pool_row_pad`` pads the pool's dim-0 stride.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    K = HEAD_DIM

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device)

    pad, at = row_pad + row_shift, row_shift
    mixed = randn(B, 3 * H * K + pad).to(torch.bfloat16)[:, at : at + 3 * H * K]
    precomputed = gate == "precomputed"
    if precomputed:
        raw_gate = (-rand(B, H * K + pad) * 0.5).to(g_dtype)[:, at : at + H * K]
        raw_beta = rand(B, H).to(torch.bfloat16)
    else:
        raw_gate = randn(B, H * K + pad).to(g_dtype)[:, at : at + H * K]
        raw_beta = randn(B, H).to(torch.bfloat16)
    from kda_core.oracle import unpack_packed

    q, k, v, g, beta = unpack_packed(mixed, raw_gate, raw_beta, H, K)
    n_slots = n_slots if n_slots is not None else 2 * B + 3
    pool_storage = randn(n_slots, H * K * K + pool_row_pad, scale=0.1).to(state_dtype)
    pool = pool_storage[:, : H * K * K].view(n_slots, H, K, K) if pool_row_pad == 0 else \
        pool_storage.as_strided((n_slots, H, K, K), (H * K * K + pool_row_pad, K * K, K, 1))
    if slots is None:
        slots = torch.randperm(n_slots, generator=gen, device=device)[:B]
    slots = torch.as_tensor(slots, dtype=torch.int32).to(device)
    A_log = dt_bias = lb = None
    if not precomputed:
        A_log = torch.log(rand(H) * 15 + 1)
        dt_bias = randn(H * K, scale=0.5)
        lb = -5.0 if gate == "lower_bound" else None
    return DecodeCase(mixed, raw_gate, raw_beta, q, k, v, g, beta, pool, slots, A_log, dt_bias, lb,
                      use_gate_in_kernel=not precomputed, beta_is_logit=not precomputed)


def _lower_bound_activations(B: int, T: int, H: int, seed: int, device: str = "cuda") -> dict:
    """bf16 q, k, v, raw gate, beta logits [B, T, H, ...] and the lower-bound gate's parameters, as keyword arguments
    of the oracle and of the kernel entries (``recurrent_kda_ref``, ``kda_decode_t1``, ``kda_recurrent_fwd``)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale

    K = HEAD_DIM
    return dict(
        q=randn(B, T, H, K).to(torch.bfloat16), k=randn(B, T, H, K).to(torch.bfloat16),
        v=randn(B, T, H, K).to(torch.bfloat16), g=randn(B, T, H, K).to(torch.bfloat16),
        beta=randn(B, T, H).to(torch.bfloat16),
        A_log=torch.log(torch.rand(H, generator=gen, device=device) * 15 + 1), dt_bias=randn(H * K, scale=0.5),
        lower_bound=-5.0, use_gate_in_kernel=True, beta_is_logit=True, use_qk_l2norm_in_kernel=True,
    )


@pytest.fixture(scope="session")
def activations():
    """``activations(B, T, H, seed, device="cuda") -> dict``: random bf16 inputs of a lower-bound-gate call."""
    return _lower_bound_activations


@pytest.fixture(name="make_case")
def make_case_fixture():
    """The :func:`make_case` factory."""
    return make_case


# ptxas -v on a kernel's kept PTX, for the CPU no-spill checks of every kernel family (the tests run with
# --import-mode=importlib, so a shared helper module is not importable from them: they take the fixture).
PTXAS_REMARKS = "ptxas-remarks.yaml"


def _keep(dump_dir) -> str:
    """Compile options that keep the PTX in ``dump_dir`` and have the DSL's own ptxas (the one that builds the
    kernel that runs) write its ``-v`` report there as a remark, which :func:`_ptxas_report` reads instead of
    assembling the PTX a second time with the local ptxas (measured: up to 4 s a build, the varlen T=1 ones)."""
    return (f"--keep-ptx --dump-dir {dump_dir} --ptxas-options=-v --remark-filter=ptxas "
            f"--remark-output={dump_dir}/{PTXAS_REMARKS}")


def _ptxas_report(ptx_path, arch: str) -> str:
    """``ptxas -v`` output: the DSL's ptxas remarks beside the PTX when the compile wrote them (:func:`_keep`),
    else the local ptxas on the PTX (a PTX newer than the local ptxas is retried with the .version that ptxas names
    as its newest)."""
    remarks = ptx_path.parent / PTXAS_REMARKS
    if remarks.exists():
        text = remarks.read_text()
        if re.search(r"Used \d+ registers", text):
            return text
    cmd = [shutil.which("ptxas"), f"-arch={arch}", "-v", str(ptx_path), "-o", "/dev/null"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    newest = re.search(r"Unsupported \.version \S+; current version is '([\d.]+)'", run.stderr)
    if run.returncode and newest:
        text = ptx_path.read_text()
        ptx_path.write_text(re.sub(r"^\.version \S+", f".version {newest.group(1)}", text, count=1, flags=re.M))
        run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stderr + run.stdout


def _registers_and_spills(ptx_path, arch: str) -> tuple[int, int]:
    """(registers, spill bytes stored + loaded) of the PTX's kernel."""
    report = _ptxas_report(ptx_path, arch)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return registers, spills


@pytest.fixture
def ptxas():
    """``ptxas.keep(dir)`` -> compile options keeping the PTX and the DSL's ptxas report in ``dir``;
    ``ptxas.report(ptx, arch)`` -> the ``-v`` text; ``ptxas.registers_and_spills(ptx, arch)`` -> (int, int)."""
    return SimpleNamespace(keep=_keep, report=_ptxas_report, registers_and_spills=_registers_and_spills)
