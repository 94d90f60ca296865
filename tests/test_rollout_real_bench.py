"""Smoke check of ``python -m benchmarks.rollout_real`` (a subprocess from the repository root) on
the real SmolLM2-135M checkpoint: one --quick run
without warm-up and with 12 new tokens (each of the few step shapes it meets compiles in ~15-25 s
on 2 CPU cores, which bounds the test's time), then the report's counts are checked against the
rollouts it saved. Nothing is timed here (timings belong in the benchmark)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rhyme_lab.bench.rollout_real import QUICK
from rhyme_jax.io.rollout_log import load_rollouts

ROOT = Path(__file__).resolve().parents[1]

NEW_TOKENS = 12


def _total_length(run_dir, step: int) -> int:
    return int(load_rollouts(run_dir, step)["lengths"].sum())


@pytest.mark.slow  # CI time (17 s on SmolLM2); a lab benchmark
def test_quick_run_reports_consistent_plain_and_histospec_rows(tmp_path, smollm2_dir):
    run = subprocess.run([sys.executable, "-m", "benchmarks.rollout_real", "--quick", "--no-warmup",
                          "--max-new-tokens", str(NEW_TOKENS), "--compile-cache", "", "--repeats", "2",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "rollout_real.json").read_text())
    q = QUICK
    rows = q["prompts"] * q["samples"]
    assert report["meta"]["rows"] == rows and report["meta"]["attention_impl"]
    (row,) = report["temperatures"]
    assert row["temperature"] == float(q["temperatures"])
    tdir = tmp_path / f"T{row['temperature']}"
    plain, spec, ep1 = row["plain"], row["spec"], row["epoch1"]

    # the report's token counts are those of the saved rollouts
    assert ep1["generated_tokens"] == _total_length(tdir, 1)
    assert spec["generated_tokens"] == _total_length(tdir, 2)
    assert plain["generated_tokens"] == _total_length(tdir / "plain_epoch2", 2)
    saved = load_rollouts(tdir, 2)
    assert saved["prompt_ids"].tolist() == [i for i in range(q["prompts"]) for _ in range(q["samples"])]
    assert saved["lengths"].max() <= NEW_TOKENS and set(saved["rewards"].tolist()) <= {0.0, 1.0}

    for kind in (ep1, plain, spec):
        assert kind["forward_passes"] == kind["decode_steps"] + kind["prefill_steps"]
        assert kind["bulk"]["passes"] + kind["tail"]["passes"] == kind["forward_passes"]
        assert kind["bulk"]["tokens"] + kind["tail"]["tokens"] == kind["generated_tokens"]
        assert kind["sequence_steps"] * kind["tokens_per_seq_forward"] == pytest.approx(kind["generated_tokens"])
        assert kind["lengths"]["max"] <= NEW_TOKENS and 0 <= kind["reward_mean"] <= 1
    for kind in (plain, spec):  # two interleaved rounds: tokens/s from their median seconds
        assert len(kind["seconds_rounds"]) == 2 and kind["seconds"] == pytest.approx(np.median(kind["seconds_rounds"]))
        assert kind["tokens_per_s"] == pytest.approx(kind["generated_tokens"] / kind["seconds"])
    assert plain["drafted_tokens"] == plain["accepted_tokens"] == 0 and plain["tokens_per_seq_forward"] == 1.0
    assert spec["drafted_tokens"] >= spec["accepted_tokens"] >= 0
    # a plain sequence pass emits one token; a verify pass one plus its accepted drafts (those after
    # an EOS are dropped)
    assert plain["sequence_steps"] == plain["generated_tokens"]
    assert spec["generated_tokens"] <= spec["sequence_steps"] + spec["accepted_tokens"]
    assert row["passes_ratio"] == pytest.approx(plain["forward_passes"] / spec["forward_passes"])

    # entropy estimate: mean -logprob of the saved plain epoch-2 tokens, positive and finite
    lp = load_rollouts(tdir / "plain_epoch2", 2)["behaviour_logprobs"]
    assert np.isfinite(row["entropy_nats_per_token"]) and row["entropy_nats_per_token"] > 0
    assert row["entropy_nats_per_token"] == pytest.approx(-np.concatenate(lp).astype(np.float64).mean(), rel=1e-5)

    # RhymeRL analyze of the saved rollouts: epoch 2 (HistoSpec) against epoch 1
    a = row["analysis"]
    assert a["prompts"] == q["prompts"] and a["tokens"] == spec["generated_tokens"]
    assert 0 <= a["o5_rhyme"] <= 1 and 0 <= a["o6_rank_shift_share"] <= 1
    assert (tdir / "analysis.md").is_file()
    md = (tmp_path / "rollout_real.md").read_text()
    assert f"### T = {row['temperature']}" in md and "HistoSpec" in md and "O5 rhyme" in md
