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
