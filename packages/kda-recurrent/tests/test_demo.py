"""The README's main job (`python -m kda_recurrent.demo`), run for two small steps on the CPU."""

from __future__ import annotations

import pytest
import torch

from kda_core.oracle import recurrent_kda_ref
from kda_recurrent import demo

SMALL = dict(heads=8, batch=4, steps=2, pool_size=6, padding=2)


def _silent_run(**overrides):
    return demo.run_demo(**{**SMALL, **overrides}, log=lambda line: None)


def _dense_replay(run: demo.DemoRun, row: int):
    """Request `row` on its own, through the oracle's dense-state mode: no pool, no slot indices."""
    state = run.initial_pool[run.slots[row].long()][None]
    outputs = []
    for q, k, v, g, beta in run.inputs:
        o, final = recurrent_kda_ref(
            q[row : row + 1], k[row : row + 1], v[row : row + 1], g[row : row + 1], beta[row : row + 1],
            A_log=run.A_log, dt_bias=run.dt_bias, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=demo.K3_LOWER_BOUND,
            beta_is_logit=True,
        )  # fmt: skip
        state = final.to(run.pool.dtype)  # the pool stores each state rounded once
        outputs.append(o[0])
    return outputs, state[0]


@pytest.mark.parametrize("state_dtype", ["bf16", "fp32"])
def test_demo_pool_rows_match_the_dense_oracle_per_request(state_dtype):
    run = _silent_run(state_dtype=state_dtype)
    active_rows = [b for b in range(SMALL["batch"]) if 0 <= int(run.slots[b]) < SMALL["pool_size"]]
    assert len(active_rows) == SMALL["batch"] - SMALL["padding"]
    for row in active_rows:
        outputs, final_state = _dense_replay(run, row)
        for step, expected in enumerate(outputs):
            torch.testing.assert_close(run.outputs[step][row], expected)
        torch.testing.assert_close(run.pool[run.slots[row].long()], final_state)


def test_demo_padding_rows_use_minus_one_and_past_the_end_slots():
    run = _silent_run()
    padding = sorted(int(s) for s in run.slots if not 0 <= int(s) < SMALL["pool_size"])
    assert padding == [-1, SMALL["pool_size"]]
    assert demo.check_bounds_policy(run) == []


def test_bounds_check_reports_a_changed_unowned_pool_row():
    run = _silent_run()
    owned = {int(s) for s in run.slots if 0 <= int(s) < SMALL["pool_size"]}
    unowned = next(i for i in range(SMALL["pool_size"]) if i not in owned)
    run.pool[unowned, 0, 0, 0] += 1
    assert demo.check_bounds_policy(run) == ["a pool row that no request owns changed"]


def test_demo_main_prints_one_line_per_step_and_says_it_runs_the_cpu_oracle(capsys):
    assert demo.main(["--heads", "8", "--batch", "4", "--steps", "2", "--state-dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "oracle" in out and "CPU" in out
    step_lines = [line for line in out.splitlines() if line.strip().startswith("step ")]
    assert len(step_lines) == 2 and all(" ms  checksum " in line for line in step_lines)
    assert "bounds policy holds" in out


def test_demo_main_rejects_a_batch_of_zero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--batch", "0"])
    assert exit_info.value.code == 2
    assert "--batch: expected a positive integer, got 0" in capsys.readouterr().err


FUSED_SMALL = dict(heads=8, batch=4, steps=2, pool_size=6, padding=2)


def _fused_replay(run: demo.FusedDemoRun):
    """The run's steps replayed through kda-core's fused reference from the initial pages (fresh copies, CPU)."""
    from kda_core.oracle_fused import fused_kda_decode_ref

    H = run.outputs[0].shape[2]
    pages = run.initial_pages.cpu().clone()
    conv, state = demo.fused_page_views(pages, H, run.state_dtype)
    layer = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in run.layer.items()}
    outputs = []
    for step in run.inputs:
        s = {k: v.cpu() for k, v in step.items()}
        outputs.append(fused_kda_decode_ref(
            s["x"], layer["weight"], conv, s["raw_gate"], s["raw_beta"], layer["A_log"], layer["dt_bias"],
            run.slots.cpu(), state, s["output_gate"], layer["norm_weight"], layer["lower_bound"]))
    return outputs, pages


def test_fused_demo_replays_as_the_reference_and_padding_touches_nothing():
    """``--fused`` on the CPU: every step and the final pages equal kda-core's fused reference replayed from the
    initial pages; padding rows (slot 0, vLLM's null block, and N) output zeros, pages no row owns are unchanged."""
    run = demo.run_fused_demo(**FUSED_SMALL, log=lambda line: None)
    assert not run.graph and run.max_err == 0.0 and len(run.outputs) == 2
    assert sorted(int(s) for s in run.slots if not 0 < int(s) < 6) == [0, 6]
    assert demo.check_fused_bounds(run) == []
    outputs, pages = _fused_replay(run)
    assert all(torch.equal(a, b) for a, b in zip(run.outputs, outputs)) and torch.equal(run.pages, pages)
    live = [r for r in range(4) if 0 < int(run.slots[r]) < 6]
    assert all(run.outputs[1][0, r].abs().sum() > 0 for r in live)
    assert not torch.equal(run.pages, run.initial_pages)  # the live slots' pages were written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_fused_demo_on_cuda_replays_a_graph_within_the_tolerance(state_dtype):
    """On the GPU each step is a CUDA-graph replay of the kernel; outputs within FlashInfer's tolerances of the
    reference replayed on the CPU, the conv cache bitwise, the null policy held, a time per step."""
    run = demo.run_fused_demo(heads=12, batch=8, steps=4, state_dtype=state_dtype, log=lambda line: None)
    assert run.graph and all(us > 0 for us in run.step_us)
    assert run.max_err <= demo.MAX_ERR and demo.check_fused_bounds(run) == []
    outputs, pages = _fused_replay(run)
    for got, want in zip(run.outputs, outputs):
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=3e-2, atol=2e-2)
    got_conv, got_state = demo.fused_page_views(run.pages.cpu(), 12, run.state_dtype)
    want_conv, want_state = demo.fused_page_views(pages, 12, run.state_dtype)
    assert torch.equal(got_conv, want_conv)
    torch.testing.assert_close(got_state.float(), want_state.float(), rtol=3e-2, atol=2e-3)


def test_fused_bounds_check_reports_a_changed_page():
    run = demo.run_fused_demo(**FUSED_SMALL, log=lambda line: None)
    run.pages[0, 0] ^= 1  # a byte of the null block's conv cache
    assert demo.check_fused_bounds(run) == ["a page (conv cache or state) that no request owns changed"]


def test_demo_main_fused_prints_each_step_and_the_error(capsys):
    assert demo.main(["--fused", "--heads", "8", "--batch", "4", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "conv + recurrence + gated RMSNorm" in out and "oracle" in out and "CPU" in out
    step_lines = [line for line in out.splitlines() if line.strip().startswith("step ")]
    assert len(step_lines) == 2 and all("max |layer - oracle|" in line for line in step_lines)
    assert "max |layer - oracle| 0.000e+00 over outputs, conv cache and state" in out
    assert "null policy holds" in out
    with pytest.raises(SystemExit):
        demo.main(["--fused", "--spec-t", "2"])
