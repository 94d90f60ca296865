"""rhyme_lab/ablate/logged_update.py: the update of a logged step is rebuilt from the run's files.

The calls hold exactly the logged rows' prompt and response tokens, split into the trainer's
minibatches and packed into the config's class buffers; the timed update runs and reports them.
"""

from __future__ import annotations

import numpy as np
import pytest

from rhyme_jax.config import load_config
from rhyme_jax.config.loader import to_yaml
from rhyme_jax.data import load_problems
from rhyme_jax.io.rollout_log import RolloutLogError, save_rollouts
from rhyme_jax.train.policy import build_tokenizer
from rhyme_jax.train.prompts import PromptTokens
from rhyme_lab.ablate.logged_update import logged_calls, time_logged_update

SETS = ["data.num_train=64", "data.num_eval=8", "rollout.max_prompt_len=192", "rollout.max_new_tokens=320",
        "grpo.pack_lengths=[512]", "grpo.micro_batch_tokens=1024",
        "model.attention_block=128"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory: the ledger config (small), its tokenizer and step 3's 8 rows (4 per
    minibatch), responses of 5 to 300 tokens; step 5 the same rows with equal rewards."""
    run_dir = tmp_path_factory.mktemp("logged")
    cfg = load_config("configs/longtail.yaml", SETS)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    train, _ = load_problems(cfg.data)
    tok = build_tokenizer(cfg, run_dir, train)
    rng = np.random.default_rng(0)
    ids = np.arange(8, dtype=np.int64) * 3
    lengths = [5, 300, 40, 17, 120, 9, 250, 64]
    responses = [rng.integers(3, tok.vocab_size, n).astype(np.int32) for n in lengths]
    save_rollouts(run_dir, 3, ids, responses, np.tile(np.float32([1, 0]), 4))  # one group of 8, rewards differ
    save_rollouts(run_dir, 5, ids, responses, np.zeros(8, np.float32))  # rewards all equal: advantage 0
    prompts = PromptTokens(tok, train, cfg.model.prompt_template)
    return run_dir, cfg, [len(prompts(i)) + n for i, n in zip(ids, lengths)]


def test_the_calls_hold_the_logged_rows_in_the_trainers_minibatches(run):
    run_dir, cfg, row_tokens = run
    per_step, model_cfg, rows = logged_calls(cfg, run_dir, 3)
    assert rows == 8 and len(per_step) == cfg.grpo.minibatches == 2
    for half, calls in zip((row_tokens[:4], row_tokens[4:]), per_step):
        assert sum(int(np.count_nonzero(c["attn_mask"])) for c in calls) == sum(half)
        assert all(c["tokens"].shape[1] == 512 for c in calls)
        segments = sorted(int(n) for c in calls for row in c["segment_ids"]
                          for n in np.bincount(row)[1:] if n)
        assert segments == sorted(half)  # one segment per logged row, its prompt + response
    assert model_cfg.num_layers == 4
    with pytest.raises(RolloutLogError):  # a step the run did not log
        logged_calls(cfg, run_dir, 4)
    # the logged rewards' advantages reach the packing: with all rewards equal every row has
    # advantage 0 and leaves the update (grpo.skip_zero_advantage_rows), but for each minibatch's
    # shortest row, which keeps its optimizer step
    assert cfg.grpo.skip_zero_advantage_rows
    zero, _, _ = logged_calls(cfg, run_dir, 5)
    for half, calls in zip((row_tokens[:4], row_tokens[4:]), zero):
        assert sum(int(np.count_nonzero(c["attn_mask"])) for c in calls) == min(half)


@pytest.mark.slow  # 20 s on 2 cores: compiles the update's programs
def test_the_timed_update_reports_its_calls_and_a_missing_step_fails(run):
    run_dir, _, row_tokens = run
    report = time_logged_update(run_dir, 3, ["grpo.remat=true"], repeats=1)
    assert report["rows"] == 8 and report["real_tokens"] == sum(row_tokens)
    assert report["overrides"] == ["grpo.remat=true"] and len(report["calls"]) == 2
    assert report["step_s"] > 0 and report["temp_bytes"] > 0
    with pytest.raises(RolloutLogError):
        time_logged_update(run_dir, 4)
