"""``python -m benchmarks.trl_side_by_side`` end to end on a tiny random Llama (issue 31, item 2).

The whole benchmark runs once (a subprocess from the repository root): ``rhyme-jax train`` (a subprocess) and TRL's ``GRPOTrainer`` on the
same config (configs/arith_smollm2_135m.yaml with the model swapped for a tiny random Llama that
carries the demo tokenizer, 2 GRPO steps of 2 prompts x 2 samples, 2 minibatches, 8 new tokens).
Checked: the report's structure, the TRL settings mapped from the config
(``rhyme_lab.bench.trl_mapping``), and that both trainers
saw the same prompts in the same order (TRL's recorded generation batches against the rhyme-jax
run's ``rollouts/step_*.npz`` and the prompt schedule). Nothing is timed here. About 35 s on 2
CPU cores (XLA compiles, TRL start-up), so it is not marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl", reason="the TRL side-by-side benchmark needs trl 1.x (the `test` extra)")
torch = pytest.importorskip("torch", reason="the TRL side-by-side benchmark needs torch (the `test` extra)")

from _hf_fixtures import hf_config  # noqa: E402
from rhyme_lab.bench import trl_mapping  # noqa: E402
from rhyme_jax.config import load_config  # noqa: E402
from rhyme_jax.data import load_problems  # noqa: E402
from rhyme_jax.data.synthetic import corpus  # noqa: E402
from rhyme_jax.io.rollout_log import load_rollouts  # noqa: E402
from rhyme_jax.model.tokenizer import train_demo_tokenizer  # noqa: E402
from rhyme_jax.train.prompts import num_grpo_prompts, prompt_schedule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "arith_smollm2_135m.yaml"
STEPS, PROMPTS, SAMPLES, MINIBATCHES, NEW_TOKENS, NUM_EVAL = 2, 2, 2, 2, 8, 6
RUN = ["data.num_train=40", f"data.num_eval={NUM_EVAL}", f"grpo.steps={STEPS}",
       f"grpo.prompts_per_step={PROMPTS}", f"grpo.samples_per_prompt={SAMPLES}", f"grpo.minibatches={MINIBATCHES}",
       f"rollout.max_new_tokens={NEW_TOKENS}", "rollout.max_slots=8", "model.prompt_template=\"{question}\\n\"",
       "spec.step_cost=prior", "run.progress=false"]


def _tiny_llama(directory: Path) -> None:
    """A random Llama whose vocabulary is the demo tokenizer's (trained on the config's train and
    held-out problems), saved with transformers together with that tokenizer."""
    import transformers as tf

    cfg = load_config(CONFIG, RUN)
    train, held_out = load_problems(cfg.data)
    tok = train_demo_tokenizer(corpus(train + held_out), cfg.data.tokenizer_vocab_size,
                               directory / "tokenizer.json")
    tf.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), eos_token="<eos>",
                               pad_token="<pad>", unk_token="<unk>").save_pretrained(str(directory))
    hf = hf_config("llama", tied=False)
    hf.vocab_size, hf.eos_token_id, hf.pad_token_id, hf.bos_token_id = tok.vocab_size, tok.eos_id, tok.pad_id, None
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(hf, dtype=torch.float32).save_pretrained(str(directory))


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_side_by_side")
    _tiny_llama(root / "model")
    sets = RUN + [f"model.path={root / 'model'}", f"run.runs_dir={root / 'runs'}"]
    argv = ["--config", str(CONFIG), "--seeds", "3", "--out", str(root / "out")]
    for item in sets:
        argv += ["--set", item]
    run = subprocess.run([sys.executable, "-m", "benchmarks.trl_side_by_side", *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode in (0, 1), run.stderr[-3000:]
    return run.returncode, root, load_config(CONFIG, sets + ["run.seed=3"]), run


@pytest.mark.slow  # CI time (50 s, a whole side-by-side run): the mapping and schedule tests stay
def test_report_files_and_structure(side_by_side):
    rc, root, cfg, _ = side_by_side
    assert rc == 0
    out = root / "out"
    assert (out / "rewards.png").stat().st_size > 0
    report = json.loads((out / "report.json").read_text())
    assert report["seeds"] == [3] and report["window_steps"] == 1
    (run,) = report["runs"]
    assert run["rhyme_run_dir"] == str(root / "runs" / f"{cfg.run.name}_s3") and run["steps"] == STEPS
    for side in ("rhyme", "trl"):
        assert len(run[side]["reward_mean"]) == STEPS
        assert all(0.0 <= x <= 1.0 for x in run[side]["reward_mean"])
        assert all(x > 0 for x in run[side]["rollout_s"]) and len(run[side]["update_s"]) == STEPS
        ev = run["eval"][side]
        assert ev["n"] == NUM_EVAL and 0 <= ev["before"] <= 1 and 0 <= ev["after"] <= 1
        assert ev["gain"] == pytest.approx(ev["after"] - ev["before"]) and ev["gain_se"] >= 0
    assert run["trl"]["optimizer_steps"] == STEPS * MINIBATCHES
    assert run["final_window"]["steps"] == [STEPS, STEPS]
    assert run["final_window"]["rhyme"]["units"] == PROMPTS * SAMPLES  # one step: its rollouts are the units
    assert run["seconds_per_step"]["ratio_rhyme_over_trl"]["all"] > 0
    assert 0 <= run["eval"]["before_agreement"] <= 1
    settings = report["trl_settings"]
    assert settings["shuffle_dataset"] is False and settings["num_generations"] == SAMPLES
    assert settings["steps_per_generation"] == MINIBATCHES and settings["gradient_accumulation_steps"] == 1
    assert settings["per_device_train_batch_size"] * MINIBATCHES == PROMPTS * SAMPLES
    assert settings["max_steps"] == STEPS * MINIBATCHES and settings["max_completion_length"] == NEW_TOKENS
    assert settings["loss_type"] == "bnpo" and settings["epsilon_high"] == cfg.grpo.eps_high
    assert settings["adam_beta2"] == 0.95 and settings["lr_scheduler_type"] == "constant_with_warmup"
    notes = " ".join(u["setting"] for u in report["unmatched"])
    assert "HistoSpec" in notes and "row assignment" in notes  # spec on; minibatches > 1
    md = (out / "report.md").read_text()
    for heading in ("## Summary", "## Not matched", "## Seed 3", "| step | reward rhyme-jax"):
        assert heading in md


@pytest.mark.slow  # shares the side-by-side run above
def test_both_sides_saw_the_same_prompts_in_the_same_order(side_by_side):
    rc, root, cfg, _ = side_by_side
    run = json.loads((root / "out" / "report.json").read_text())["runs"][0]
    run_dir = Path(run["rhyme_run_dir"])
    train = load_problems(cfg.data)[0]
    for step in range(1, STEPS + 1):
        ours = load_rollouts(run_dir, step)["prompt_ids"].tolist()
        sched = prompt_schedule(cfg.run.seed, num_grpo_prompts(cfg, len(train)), step, PROMPTS)
        assert ours == np.repeat(sched, SAMPLES).tolist()
        assert run["trl"]["prompt_ids"][step - 1] == ours
    assert run["prompts"]["same_order"] and run["prompts"]["matches_schedule"]
    assert run["prompts"]["trl_rows_per_step"] == [PROMPTS * SAMPLES] * STEPS
    tokens = run["prompts"]["tokens"]
    assert tokens["identical"] and tokens["overlong"] == 0 and tokens["eos_ours"] == tokens["eos_trl"] == [1]


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_mapped_lr_schedule_is_ours_per_optimizer_step(schedule):
    """TRL's scheduler built from the mapped settings gives, at every optimizer step, the rate of
    rhyme-jax's optax schedule (counted in optimizer steps: steps x minibatches, warmup too)."""
    from transformers import get_scheduler

    from rhyme_jax.train.optim import grpo_schedule_steps, make_schedule

    cfg = load_config(CONFIG, [f"grpo.schedule={schedule}", "grpo.steps=6", "grpo.warmup_steps=2",
                               "grpo.minibatches=2", "grpo.learning_rate=1e-3"])
    s = trl_mapping.trl_settings(cfg)
    total, warmup = grpo_schedule_steps(cfg.grpo)
    assert (s["max_steps"], s["warmup_steps"]) == (total, warmup) == (12, 4)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=s["learning_rate"])
    sched = get_scheduler(s["lr_scheduler_type"], opt, num_warmup_steps=s["warmup_steps"],
                          num_training_steps=s["max_steps"])
    ours = make_schedule(cfg.grpo.learning_rate, total, warmup, schedule=schedule)
    for k in range(total):
        assert opt.param_groups[0]["lr"] == pytest.approx(float(ours(k)), rel=1e-5, abs=1e-9)
        opt.step()
        sched.step()


def test_trl_model_dir_adds_architectures_without_touching_the_checkpoint(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "model.safetensors").write_bytes(b"weights")
    view = Path(trl_mapping.trl_model_dir(str(src), tmp_path / "out"))
    assert view == tmp_path / "out" / "model"
    assert json.loads((view / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (view / "model.safetensors").resolve() == (src / "model.safetensors").resolve()
    assert json.loads((src / "config.json").read_text()) == {"model_type": "llama"}
    assert trl_mapping.trl_model_dir(str(view), tmp_path / "elsewhere") == str(view.resolve())  # already complete


def test_steps_truncation_only_where_a_shorter_run_is_the_longer_ones_beginning():
    """``--steps N``: the first N steps of a run are an N-step run only under a constant rate
    without warm-up; anything else is refused, and N must lie within the run."""
    root = ROOT
    cfg = load_config(root / "configs" / "arith_smollm2_135m.yaml")
    short = trl_mapping.truncated(cfg, 12, "run")
    assert short.grpo.steps == 12 and short.grpo.learning_rate == cfg.grpo.learning_rate
    assert trl_mapping.truncated(cfg, 0, "run") is cfg
    for bad in (["grpo.schedule=cosine"], ["grpo.warmup_steps=2"]):
        with pytest.raises(trl_mapping.SideBySideError, match="constant rate without warm-up"):
            trl_mapping.truncated(load_config(root / "configs" / "arith_smollm2_135m.yaml", bad), 12, "run")
    with pytest.raises(trl_mapping.SideBySideError, match=r"must be in \[1, 30\]"):
        trl_mapping.truncated(cfg, 31, "run")
