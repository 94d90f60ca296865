"""``rhyme_lab.ablate.saved_runs.build`` / ``write_corpus`` (``python -m benchmarks.replay_corpus``): a
drafter replay corpus from a run's saved rollouts (issue 16)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rhyme_lab.ablate import saved_runs as rc
from rhyme_lab.measure.text_replay import read_cases
from rhyme_jax.config import load_config
from rhyme_jax.config.loader import to_yaml
from rhyme_jax.data import corpus, load_problems
from rhyme_jax.io.rollout_log import save_rollouts
from rhyme_jax.model.tokenizer import Tokenizer, train_demo_tokenizer

# 4 GRPO prompts, 2 per step: epoch 1 = steps 1-2, epoch 2 = steps 3-4
OVERRIDES = ["grpo.num_prompts=4", "grpo.prompts_per_step=2", "grpo.samples_per_prompt=2", "grpo.minibatches=1"]
STEPS = {  # step -> (prompt ids, response texts, rewards)
    1: ([5, 5, 9, 9], ["1 + 2 = 3", "1 + 2 = 4", "7 - 1 = 6", "7 - 2 = 5"], [1.0, 0.0, 1.0, 0.0]),
    2: ([0, 0, 3, 3], ["4 + 4 = 8", "4 + 5 = 9", "2 + 2 = 4", "3 + 3 = 6"], [1.0, 1.0, 0.0, 1.0]),
    3: ([9, 9, 0, 0], ["7 - 1 = 6 #### 6", "", "4 + 4 = 8 #### 8", "4 + 4 = 9"], [1.0, 0.0, 1.0, 0.0]),
    4: ([5, 5, 3, 3], ["1 + 2 = 3 #### 3", "1 + 1 = 2", "2 + 2 = 4 #### 4", "3 + 3 = 6"], [1.0, 0.0, 0.0, 1.0]),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A fake run directory: config.yaml (with a key from another schema version), tokenizer,
    rollouts of steps 1-4."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config("configs/tiny_test.yaml", OVERRIDES)
    (run_dir / "config.yaml").write_text(to_yaml(cfg).replace("rollout:\n", "rollout:\n  retired_key: 3\n"))
    train, _ = load_problems(cfg.data)
    tok = train_demo_tokenizer(corpus(train), 256, run_dir / "tokenizer.json")
    for step, (pids, texts, rewards) in STEPS.items():
        save_rollouts(run_dir, step, np.array(pids), [np.array(tok.encode(t), np.int32) for t in texts],
                      np.array(rewards, np.float32))
    return run_dir, tok, cfg, train


def test_history_is_epoch_one_and_targets_epoch_two_by_default(run, capsys):
    run_dir, tok, cfg, train = run
    lines = rc.build(run_dir, tok)
    assert "retired_key" in capsys.readouterr().err  # dropped, named
    # step 3 then 4, in order; the empty response of step 3 is no target
    assert [line["target"] for line in lines] == [t for s in (3, 4) for t in STEPS[s][1] if t]
    pids = [p for s in (3, 4) for p, t in zip(*STEPS[s][:2]) if t]
    for line, pid in zip(lines, pids):
        assert line["prompt"] == cfg.model.prompt_template.format(question=train[pid].question)
        want = [(t, r) for s in (1, 2) for p, t, r in zip(*STEPS[s]) if p == pid]
        assert list(zip(line["history"], line["history_rewards"])) == want
    assert lines[0]["history"] == ["7 - 1 = 6", "7 - 2 = 5"] and lines[0]["history_rewards"] == [1.0, 0.0]


def test_written_file_is_a_replay_corpus_and_subsets_are_seeded(run, tmp_path):
    run_dir, _, _, _ = run
    out = tmp_path / "c.jsonl"
    tok = Tokenizer.from_file(run_dir / "tokenizer.json")  # the benchmark's --tokenizer

    def write():  # the benchmark's --history-steps 1-1 --target-steps 4 --max-targets 3 --seed 1
        built = rc.build(run_dir, tok, history_steps=rc.parse_steps("1-1", "--history-steps"),
                         target_steps=rc.parse_steps("4", "--target-steps"), max_targets=3, seed=1)
        return rc.write_corpus(out, built)

    assert write().startswith(f"{out}: 3 targets")
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 3
    assert [x["target"] for x in lines] == [t for t in STEPS[4][1] if t in {x["target"] for x in lines}]  # order kept
    assert all(x["history"] == (["1 + 2 = 3", "1 + 2 = 4"] if x["target"].startswith("1") else []) for x in lines)
    cases = read_cases(out, tok.encode)
    assert [c.target.tolist() for c in cases] == [tok.encode(x["target"]) for x in lines]
    assert write() and [json.loads(x) for x in out.read_text().splitlines()] == lines


def test_bad_steps_are_named(run):
    run_dir, tok, _, _ = run
    with pytest.raises(rc.CorpusError, match="no rollouts saved for step 7"):
        rc.build(run_dir, tok, history_steps=[1], target_steps=[7])
    with pytest.raises(rc.CorpusError, match="--target-steps"):
        rc.parse_steps("4-2", "--target-steps")
    assert rc.parse_steps("3-5", "x") == [3, 4, 5] and rc.parse_steps("2", "x") == [2]
