"""Smoke checks of ``python -m benchmarks.schedule``'s profile and workers modes: the pure helpers
of ``rhyme_lab.schedule.profile`` (grid, fit report, history per step, medians) and the set-up errors
of the command (a subprocess from the repository root). No model is built and nothing is timed
(timings belong in the benchmark itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rhyme_jax.io.rollout_log import save_rollouts
from rhyme_lab.schedule import profile as bench
from rhyme_jax.sched.cost_model import CostModel

ROOT = Path(__file__).resolve().parents[1]


def test_profile_grid_is_capped_by_the_engine():
    assert bench.profile_grid(128, 64) == ([1, 4, 16, 64], [16, 48, 64])
    assert bench.profile_grid(8, 96) == ([1, 4, 8], [16, 48, 96])


def test_fit_report_recovers_an_exact_cost_model():
    true = CostModel(a=2e-3, b=1e-4, c=5e-3)
    samples = [(t, b, true(t, b)) for b in (1, 4, 16, 64) for t in (16, 48, 64)]
    cm, rows = bench.fit_report(samples)
    assert cm.a == pytest.approx(true.a, rel=1e-6) and cm.b == pytest.approx(true.b, rel=1e-6)
    assert cm.c == pytest.approx(true.c, rel=1e-6)
    assert len(rows) == 12 and max(abs(r["rel_error"]) for r in rows) < 1e-6
    table = bench.format_profile_table(cm, rows)
    assert "a = 0.002 s" in table and table.count("\n| ") == 13  # header + 12 grid points


def _save_run(run_dir: Path, steps: int = 4, per_step: int = 2, num_prompts: int = 4, n: int = 2) -> dict:
    """Saved rollouts cycling ``num_prompts`` prompts, ``per_step`` per step; prompt p at step s
    has responses of length ``10 * s + p``. Returns {step: prompt ids}."""
    ids = {}
    for s in range(1, steps + 1):
        first = (s - 1) * per_step % num_prompts
        pids = np.arange(first, first + per_step)
        ids[s] = pids.tolist()
        rows = np.repeat(pids, n)
        save_rollouts(run_dir, s, rows, [np.ones(10 * s + int(p), np.int32) for p in rows],
                      np.zeros(rows.size, np.float32))
    return ids


def test_worker_steps_history_is_the_previous_occurrence(tmp_path):
    ids = _save_run(tmp_path)
    out = bench.worker_steps(tmp_path, 3, 2)
    assert [st.step for st, _ in out] == [3, 4]
    (st3, h3), (st4, h4) = out
    assert st3.prompt_ids.tolist() == ids[3] == [0, 1] and st3.lengths.shape == (2, 2)
    assert sorted(h3) == [0, 1, 2, 3] and h3[0].tolist() == [10, 10] and h3[3].tolist() == [23, 23]
    assert h4[0].tolist() == [30, 30] and h4[2].tolist() == [22, 22]  # step 3 overwrote prompts 0, 1
    with pytest.raises(bench.BenchSetupError, match=r"steps \[5\]"):
        bench.worker_steps(tmp_path, 4, 2)
    with pytest.raises(bench.BenchSetupError, match="no rollouts"):
        bench.worker_steps(tmp_path / "empty", 1, 1)


def test_summarize_workers_medians_and_ratio():

    def row(bubble, mig=0.0, span=1.0):
        return {"sched/bubble_fraction": bubble, "sched/earliest_finisher_idle": 2 * bubble,
                "time/rollout_makespan_s": span, "sched/migrated_share": mig,
                "sched/predicted_makespan_s": 0.5, "wall_s": 1.1}

    per_step = {"fifo": [row(0.2), row(0.3), row(0.4, span=2.0)], "tier1": [row(0.1), row(0.15), row(0.5)],
                "tier1+tier2+migration": [row(0.0, 0.01)] * 3}
    s = bench.summarize_workers(per_step)
    assert s["fifo"]["sched/bubble_fraction"] == pytest.approx(0.3) and s["fifo"]["steps"] == 3
    # pooled: idle worker-seconds over window worker-seconds, (0.2 + 0.3 + 0.4 * 2) / 4
    assert s["fifo"]["pooled_bubble_fraction"] == pytest.approx(0.325) and s["fifo"]["total_makespan_s"] == 4.0
    assert s["tier1"]["bubble_ratio_vs_fifo"] == pytest.approx(2.0)
    assert s["tier1+tier2+migration"]["bubble_ratio_vs_fifo"] is None  # zero bubble: no ratio
    table = bench.format_workers_table(s)
    assert "| tier1 | 15.0% | 2.00x | 25.0% | 30.0% |" in table and "| tier1+tier2+migration | 0.0% | - |" in table


def _schedule(*argv: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.schedule ARGV`` from the repository root."""
    return subprocess.run([sys.executable, "-m", "benchmarks.schedule", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_workers_mode_without_enough_devices_says_how_to_start():
    out = _schedule("--mode", "workers", "--workers", "4096", "--jax-cache", "")
    assert out.returncode == 2
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4096" in out.stderr


def test_profile_without_params_fails_clearly(tmp_path):
    out = _schedule("--mode", "profile", "--init-from", str(tmp_path / "none"), "--jax-cache", "")
    assert out.returncode == 2
    assert "rhyme-jax sft" in out.stderr
