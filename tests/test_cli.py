"""``rhyme-jax`` command line on the tiny config (demo end to end, eval, config errors) and the
run-config loader's validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rhyme_jax.cli import main
from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.io.checkpoint import Checkpointer
from rhyme_jax.io.metrics import read_metrics
from rhyme_jax.io.rollout_log import list_rollout_steps, load_rollouts

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "tiny_test.yaml")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, compile_cache):
    """``rhyme-jax demo`` on the tiny config: SFT warm start, 4 GRPO steps, summary."""
    runs = tmp_path_factory.mktemp("cli")
    rc = main(["demo", "--config", CONFIG, "--set", f"run.runs_dir={runs}"])
    return rc, runs / "tiny"


def test_demo_writes_every_output(demo_run):
    rc, run_dir = demo_run
    assert rc == 0
    for name in ("metrics.jsonl", "tokenizer.json", "config.yaml", "summary.md"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "reward_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tb").iterdir())
    assert (run_dir / "sft" / "params").is_dir()
    assert any(r["phase"] == "sft" for r in read_metrics(run_dir / "sft"))

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if r["phase"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if r["phase"] == "eval"] == [0, 4]
    with Checkpointer(run_dir / "checkpoints") as c:
        assert c.latest_step() == 4 and c.all_steps() == [3, 4]
    assert list_rollout_steps(run_dir) == [1, 2, 3, 4]
    roll = load_rollouts(run_dir, 1)
    assert len(roll["responses"]) == 2 * 4 and roll["rewards"].shape == (8,)
    assert (run_dir / "rollouts" / "step_000001.npz").is_file()

    summary = json.loads((run_dir / "summary.json").read_text())
    evals = [r for r in rows if r["phase"] == "eval"]
    assert summary["steps"] == 4 and summary["n_eval"] == 8
    assert summary["accuracy_before"] == evals[0]["eval/accuracy"]
    assert summary["accuracy_after"] == evals[1]["eval/accuracy"]
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    train = [r for r in rows if r["phase"] == "train"]
    assert summary["reward_per_step"] == [round(r["reward/mean"], 4) for r in train]
    assert summary["nonfinite_skipped"] == 0
    comp = summary["compile"]  # warm-up figures: compiles vs cache loads, programs run vs enumerated
    assert comp["compiled"] + comp["loaded_from_cache"] == summary["compilations"]
    assert 0 < comp["programs_run"] <= comp["programs_enumerated"] and comp["cache_dir"] == ""


def test_eval_after_demo_reports_the_final_accuracy(demo_run, capsys):
    rc, run_dir = demo_run
    assert rc == 0
    capsys.readouterr()
    assert main(["eval", "--config", CONFIG, "--set", f"run.runs_dir={run_dir.parent}"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((run_dir / "summary.json").read_text())
    # Greedy decoding of the step-4 checkpoint = the run's final evaluation.
    assert f"checkpoints step 4: held-out greedy accuracy {summary['accuracy_after']:.3f}" in out
    assert "(n=8)" in out


def test_eval_initial_scores_the_warm_start_with_pass_at_k(demo_run, capsys, tmp_path):
    """``--checkpoint initial`` scores what GRPO starts from (here the run's SFT params): the
    demo's before-RL evaluation, plus pass@1 / pass@k at the rollout temperature. ``--save`` keeps
    its per-problem results, and ``--paired-with`` them the newest checkpoint's paired gain is the
    run's own (the evaluations before and after GRPO)."""
    rc, run_dir = demo_run
    capsys.readouterr()
    runs = f"run.runs_dir={run_dir.parent}"
    saved = tmp_path / "initial.npz"
    assert main(["eval", "--config", CONFIG, "--checkpoint", "initial", "--set", runs,
                 "--set", "run.eval_samples=2", "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    before = [r for r in read_metrics(run_dir) if r["phase"] == "eval"][0]
    assert f"initial model ({run_dir / 'sft' / 'params'}): held-out greedy accuracy {before['eval/accuracy']:.3f}" in out
    assert "pass@1 at T = 1 (mean of 2 samples)" in out and ", pass@2 " in out
    np.testing.assert_array_equal(np.load(saved)["correct"], np.load(run_dir / "eval" / "step_000000.npz")["correct"])
    assert main(["eval", "--config", CONFIG, "--set", runs, "--paired-with", str(saved)]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"paired over {saved}: " in (out := capsys.readouterr().out)
    assert f"gain {summary['gain_paired']:+.3f} ± {summary['gain_paired_stderr']:.3f}" in out
    assert main(["eval", "--config", CONFIG, "--set", runs, "--paired-with", str(tmp_path / "none.npz")]) == 2
    assert "none.npz: not a per-problem eval file" in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--set", "grpo.nosuch=1"], "nosuch"),
    (["--set", "grpo.steps=many"], "grpo.steps"),
    (["--set", "grpo.steps"], "KEY=VALUE"),
], ids=["unknown-key", "wrong-type", "no-value"])
def test_bad_override_exits_2_naming_the_key(args, needle, capsys):
    assert main(["train", "--config", CONFIG, *args]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and needle in err


def test_sft_without_steps_exits_2_naming_the_key_before_any_work(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(["sft", "--config", CONFIG, "--set", "sft.steps=0", "--set", f"run.runs_dir={runs}"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "sft.steps=0" in err
    assert not runs.exists()  # nothing was built or written


def test_missing_config_file_exits_2_naming_it(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert main(["eval", "--config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "config file not found" in err and str(missing) in err


# ---------------------------------------------------------------- load_config


def test_tiny_config_loads_read_only():
    cfg = load_config(CONFIG, ["grpo.steps=7"])
    assert cfg.grpo.steps == 7 and cfg.grpo.samples_per_prompt == 4
    assert cfg.model.tiny.hidden_size == 32 and cfg.rollout.page_size == 8
    assert cfg.run.progress is False
    with pytest.raises(Exception):
        cfg.grpo.steps = 3


@pytest.mark.parametrize("text, key", [
    ("grpo:\n  nosuch: 1\n", "nosuch"),
    ("nosection:\n  steps: 1\n", "nosection"),
    ("grpo:\n  steps: many\n", "grpo.steps"),
    ("run:\n  progress: maybe\n", "run.progress"),
    ("rollout:\n  temperature: hot\n", "rollout.temperature"),
], ids=["unknown-key", "unknown-section", "int", "bool", "float"])
def test_load_config_rejects_bad_yaml_naming_file_and_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:") and key in msg


def test_load_config_names_the_included_file_with_the_bad_key(tmp_path):
    (tmp_path / "base.yaml").write_text("sft:\n  stepz: 3\n")
    top = tmp_path / "top.yaml"
    top.write_text("defaults: [base.yaml]\ngrpo:\n  steps: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(top)
    assert str(err.value).startswith(f"{tmp_path / 'base.yaml'}:") and "stepz" in str(err.value)


def test_load_config_rejects_invalid_yaml_and_non_mapping(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("grpo: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        load_config(bad)
    assert str(bad) in str(err.value)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(lst)


def test_resume_of_a_run_that_does_not_exist_fails_before_any_work(tmp_path, capsys):
    """``--resume`` with a run name that has no directory: exit 2 naming the run directory and
    the way out, and nothing is created (a typo in run.name must not start a fresh run)."""
    args = ["demo", "--config", CONFIG, "--set", f"run.runs_dir={tmp_path}", "--set", "run.name=no_such_run",
            "--resume"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "no_such_run") in err and "nothing to resume" in err and "drop --resume" in err
    assert not (tmp_path / "no_such_run").exists()


def test_rerunning_a_finished_run_needs_resume_and_resume_is_a_no_op(demo_run, capsys):
    rc, run_dir = demo_run
    assert rc == 0
    base = ["--config", CONFIG, "--set", f"run.runs_dir={run_dir.parent}"]
    rows_before = read_metrics(run_dir)
    summary_before = json.loads((run_dir / "summary.json").read_text())
    capsys.readouterr()
    assert main(["train", *base]) == 2
    err = capsys.readouterr().err
    assert "RunExistsError" in err and "--resume" in err and str(run_dir) in err
    assert main(["demo", *base, "--resume"]) == 0
    assert "already complete (4 GRPO steps)" in capsys.readouterr().out
    # Nothing was rerun or rewritten.
    assert read_metrics(run_dir) == rows_before
    assert json.loads((run_dir / "summary.json").read_text()) == summary_before
    md = (run_dir / "summary.md").read_text()
    assert f"| held-out greedy accuracy after RL (n=8) | {summary_before['accuracy_after']:.3f}" in md


@pytest.mark.parametrize("override, needle", [
    ("grpo.loss_agg=sum", "grpo.loss_agg='sum' must be one of"),
    ("grpo.warmup_steps=99", "grpo.warmup_steps=99 must be in [0, grpo.steps=4]"),
    ("sft.schedule=bogus", "sft.schedule='bogus' must be one of"),
    ("grpo.minibatches=9", "grpo.minibatches=9 exceeds the rollout batch"),
    ("rollout.top_p=0", "rollout.top_p"),
])
def test_invalid_values_fail_when_the_config_loads(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, [override])
    assert needle in str(info.value) and str(info.value).startswith(CONFIG)
