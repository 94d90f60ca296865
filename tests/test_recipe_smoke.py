"""Smoke run of the real-model learning recipe (``configs/arith_smollm2_135m.yaml``).

Two GRPO steps of SmolLM2-135M-Instruct through ``GRPOTrainer`` (the recipe's model, chat
template, task, reward, HistoSpec and update settings; fewer prompts, samples and tokens), so a
change that breaks the recipe fails the slow set (`pytest -m slow`; CI time moved it there). The learning figures themselves come from the full run
(README, "Real models").
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from rhyme_jax.config import load_config
from rhyme_jax.train.trainer import GRPOTrainer

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "arith_smollm2_135m.yaml"


@pytest.mark.slow  # CI time (42 s); tests/test_real_model.py keeps SmolLM2 (parity, generate, HistoSpec) in the default set
def test_recipe_runs_two_grpo_steps(smollm2_dir, tmp_path):
    cfg = load_config(RECIPE, [f"model.path={smollm2_dir}", f"run.runs_dir={tmp_path}", "grpo.steps=2",
                               "grpo.prompts_per_step=2", "grpo.samples_per_prompt=2", "rollout.max_new_tokens=16",
                               "rollout.max_slots=8", "data.num_eval=2", "run.progress=false"])
    trainer = GRPOTrainer(cfg)
    before = [np.array(x) for x in jax.tree.leaves(trainer.state)[:3]]
    try:
        rows = [trainer.train_step(s) for s in (1, 2)]
    finally:
        trainer.close()
    for row in rows:
        assert row["finite"] == 1.0 and row["rollout/generated_tokens"] > 0
        assert 0.0 <= row["reward/mean"] <= 1.0
    assert trainer.tokenizer.vocab_size >= 49152  # the real tokenizer, not the demo's
    after = [np.array(x) for x in jax.tree.leaves(trainer.state)[:3]]
    assert all(a.dtype == np.float32 for a in after)  # float32 master weights
    rewards = [r["reward/mean"] for r in rows]
    if any(0.0 < r < 1.0 for r in rewards):  # a mixed group gives a gradient: the weights move
        assert any(not np.array_equal(a, b) for a, b in zip(before, after))
