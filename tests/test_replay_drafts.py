"""``python -m rhyme_lab replay-drafts``: the drafter replayed along target texts (rhyme_lab/measure/text_replay.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rhyme_lab.cli.main import main
from rhyme_lab.measure.oracle_drafters import KnownTargets
from rhyme_lab.measure.text_replay import ReplayInputError, floor_pass, read_cases, replay
from rhyme_jax.config import load_config
from rhyme_jax.model.tokenizer import train_demo_tokenizer
from rhyme_jax.rollout import shapes

CONFIG = "configs/tiny_test.yaml"
ANSWERS = [
    "She sold 48 / 2 = 24 clips in May, so 48 + 24 = 72 clips in all. #### 72",
    "He earns 12 / 60 = 0.2 per minute, so 0.2 * 50 = 10 dollars. #### 10",
    "Betty has 100 / 2 = 50 dollars and needs 100 - 50 - 15 - 30 = 5 more. #### 5",
]
QUESTIONS = ["How many clips did she sell?", "How much did he earn?", "How much more does Betty need?"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_demo_tokenizer(ANSWERS + QUESTIONS, 200, path), path


def _spec(**kw):
    sets = [f"spec.{k}={v}" for k, v in kw.items()]
    return load_config(CONFIG, ["spec.enabled=true", *sets]).spec


def _plan(rows):
    return shapes.plan(max_slots=rows, page_size=16, max_prompt_len=64, max_new_tokens=128)


def _write(tmp_path, rows):
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _changed_cases(tok, tmp_path):
    """Each answer as the history of its question, a copy with one number changed as the target,
    and the goodput drafter with every source."""
    changed = [a.replace("72", "73").replace("10", "11").replace("5 more", "6 more") for a in ANSWERS]
    path = _write(tmp_path, [{"prompt": q, "history": [a], "history_rewards": [1.0], "target": b}
                             for q, a, b in zip(QUESTIONS, ANSWERS, changed)])
    return read_cases(path, tok.encode), _spec(window="goodput", pattern_min=1, self_lookup=True, min_token_prob=0.0)


def test_a_target_equal_to_its_history_is_drafted_and_fully_accepted(tokenizer, tmp_path):
    tok, _ = tokenizer
    path = _write(tmp_path, [{"prompt": q, "history": [a], "history_rewards": [1.0], "target": a}
                             for q, a in zip(QUESTIONS, ANSWERS)])
    out = replay(read_cases(path, tok.encode), _spec(window="fixed", fixed_window=4, min_token_prob=0.0),
                 _plan(8), 8)
    tokens = sum(len(tok.encode(a)) for a in ANSWERS)
    assert out["target_tokens"] == tokens
    assert out["acceptance"] == 1.0  # every drafted token is the target's next token
    assert out["accepted_tokens"] == out["drafted_tokens"] > tokens / 2
    # every pass emits its accepted draft plus one token, so passes + accepted = target tokens
    assert out["sequence_passes"] + out["accepted_tokens"] == tokens
    assert out["drafted_per_forward"] <= 4  # the fixed window
    assert out["tokens_per_forward"] == pytest.approx(tokens / out["sequence_passes"])


def test_no_history_and_no_self_lookup_predicts_nothing(tokenizer, tmp_path):
    tok, _ = tokenizer
    path = _write(tmp_path, [{"prompt": QUESTIONS[0], "history": [], "target": ANSWERS[0]}])
    out = replay(read_cases(path, tok.encode), _spec(self_lookup="false"), _plan(8), 8)
    assert out["predicted_share"] == 0.0 and out["drafted_tokens"] == 0
    assert out["tokens_per_forward"] == 1.0


def test_drafts_are_cut_to_the_step_budget_of_the_rows(tokenizer, tmp_path):
    tok, _ = tokenizer
    path = _write(tmp_path, [{"prompt": QUESTIONS[1], "history": [ANSWERS[1]], "target": ANSWERS[1]}])
    cases = read_cases(path, tok.encode)
    spec = _spec(window="fixed", fixed_window=16, min_token_prob=0.0)
    one_row = replay(cases, spec, _plan(1), 1)  # budget 4 packed tokens: at most 3 drafted per pass
    wide = replay(cases, spec, _plan(16), 16)
    assert one_row["drafted_tokens"] <= 3 * one_row["sequence_passes"]
    assert wide["sequence_passes"] < one_row["sequence_passes"]
    assert np.isclose(one_row["acceptance"], 1.0) and np.isclose(wide["acceptance"], 1.0)


def test_floor_step_sends_the_prefix_whose_cumulative_estimate_clears_the_floor():
    est = np.array([[0.9, 0.5, 0.5], [0.2, 0.9, 0.0], [0.8, 0.8, 0.8]], np.float32)
    choice, curve = floor_pass(np.array([3, 2, 1]), est, 0.25, rows=4)
    # cumulative 0.9, 0.45, 0.225 | 0.2, 0.18 | 0.8 (its length is 1)
    assert choice.draft_lens.tolist() == [2, 0, 1]
    assert (choice.rows, choice.tokens, choice.q_len) == (4, 4 + 3, 3)
    assert choice.expected == pytest.approx(3 + 0.9 + 0.45 + 0.8)
    assert curve[0, 2] == pytest.approx(0.225)
    with pytest.raises(ValueError, match="goodput"):
        floor_pass(np.array([1]), None, 0.1, rows=1)


def test_accept_floor_trades_drafts_for_acceptance(tokenizer, tmp_path):
    tok, _ = tokenizer
    cases, spec = _changed_cases(tok, tmp_path)
    every = replay(cases, spec, _plan(8), 8, accept_floor=0.0)
    shaped = replay(cases, spec, _plan(8), 8)
    sure = replay(cases, spec, _plan(8), 8, accept_floor=0.5)
    # floor 0 sends every drafted token: none is cut to a step shape, so at least the shaped drafts
    assert every["drafted_tokens"] >= shaped["drafted_tokens"] > 0
    assert 0 < sure["drafted_tokens"] < every["drafted_tokens"]
    # every token sent has a cumulative estimate >= the floor, so the mean estimate is too
    assert sure["predicted_acceptance"] >= 0.5 > every["predicted_acceptance"]
    tokens = sum(c.target.size for c in cases)
    for out in (every, sure):
        assert out["sequence_passes"] + out["accepted_tokens"] == tokens


def test_cli_json_and_errors_name_the_line(tokenizer, tmp_path, capsys):
    _, tok_path = tokenizer
    good = _write(tmp_path, [{"prompt": QUESTIONS[2], "history": [ANSWERS[2]], "target": ANSWERS[2]}])
    assert main(["replay-drafts", str(good), "--tokenizer", str(tok_path), "--config", CONFIG, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"predicted_share", "tokens_per_forward", "drafted_per_forward", "acceptance"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "He", "history": ["a"], "target": "a"}) + "\n{\"prompt\": 3}\n")
    assert main(["replay-drafts", str(bad), "--tokenizer", str(tok_path), "--config", CONFIG]) == 2
    assert f"{bad}:2" in capsys.readouterr().err
    bad.write_text(json.dumps({"prompt": "He", "history": [], "target": "~"}) + "\n")  # '~' not in vocab
    assert main(["replay-drafts", str(bad), "--tokenizer", str(tok_path), "--config", CONFIG]) == 2
    assert f"{bad}:1" in capsys.readouterr().err
    args = ["replay-drafts", str(good), "--tokenizer", str(tok_path), "--config", CONFIG]
    assert main([*args, "--accept-floor", "1.5"]) == 2
    assert "--accept-floor" in capsys.readouterr().err
    assert main([*args, "--accept-floor", "0.1", "--set", "spec.window=aimd"]) == 2
    assert "spec.window=goodput" in capsys.readouterr().err
    with pytest.raises(ReplayInputError, match="history_rewards"):
        read_cases(_write(tmp_path, [{"prompt": "x", "history": ["a"], "history_rewards": [1, 2],
                                      "target": "a"}]), lambda s: [1, 2])


def test_replay_bounds_always_right_above_best_source_above_the_drafter(tokenizer, tmp_path):
    """``oracle_drafters.KnownTargets`` (``python -m benchmarks.replay_bound``): always-right drafts
    accept everything and beat the best-in-hindsight drafts from the sources, which accept
    everything they send and predict at least what the real drafter predicts (same steps, the
    analytical prior as step cost)."""
    tok, _ = tokenizer
    cases, spec = _changed_cases(tok, tmp_path)
    tokens = sum(c.target.size for c in cases)
    prompts, targets = [c.prompt for c in cases], [c.target for c in cases]
    perfect = replay(cases, spec, _plan(8), 8, make_drafter=KnownTargets(prompts, targets))
    oracle = replay(cases, spec, _plan(8), 8, make_drafter=KnownTargets(prompts, targets, [c.history for c in cases]))
    real = replay(cases, spec, _plan(8), 8)
    assert perfect["acceptance"] == oracle["acceptance"] == 1.0
    assert perfect["sequence_passes"] + perfect["accepted_tokens"] == tokens
    assert perfect["accepted_tokens"] > oracle["accepted_tokens"] >= real["accepted_tokens"] > 0
    modelled = [r["modelled_speedup"] for r in (perfect, oracle)]  # the prior cost model: no clock involved
    assert modelled[0] >= modelled[1] > 1.0
