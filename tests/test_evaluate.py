"""Held-out evaluation: greedy and mean@k accuracies, per-problem files, paired gains."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from rhyme_jax.config import load_config
from rhyme_jax.data import load_problems
from rhyme_jax.io.summary import paired_gain
from rhyme_jax.rollout.engine import SamplingParams
from rhyme_jax.train.assembly import make_engine
from rhyme_jax.train.evaluate import encode_prompts, evaluate
from rhyme_jax.train.policy import build_model, build_tokenizer, eos_ids


def test_paired_gain_matches_hand_computation():
    before = np.array([1, 0, 0, 1, 0, 1, 0, 0], float)
    after = np.array([1, 1, 0, 1, 1, 0, 0, 1], float)
    d = after - before  # [0, 1, 0, 0, 1, -1, 0, 1]
    mean, se = paired_gain(before, after)
    assert mean == pytest.approx(2 / 8)
    var = np.sum((d - d.mean()) ** 2) / (len(d) - 1)
    assert se == pytest.approx(math.sqrt(var / len(d)))
    with pytest.raises(ValueError, match="shapes"):
        paired_gain(before, after[:3])


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    cfg = load_config("configs/tiny_test.yaml",
                      [f"run.runs_dir={tmp_path_factory.mktemp('runs')}"])
    train, held_out = load_problems(cfg.data)
    run_dir = tmp_path_factory.mktemp("run")
    tok = build_tokenizer(cfg, run_dir, train)
    model = build_model(cfg, tok, 0)
    graphdef, state = nnx.split(model)
    return cfg, tok, held_out, make_engine(graphdef, model.cfg, cfg, eos_ids(model, tok)), state


def test_demo_tokenizer_learns_the_prompt_templates_characters(tmp_path):
    """Train problems without a newline and the template ``"{question}\\n"``: the demo tokenizer
    still encodes every prompt (its corpus takes the template's text where that has characters
    the problems lack), and round-trips it."""
    from rhyme_jax.data import Problem

    cfg = load_config("configs/tiny_test.yaml", [f"run.runs_dir={tmp_path}"])
    assert cfg.model.prompt_template == "{question}\n"
    train = [Problem(i, f"What is {i} plus {i}?", f"It is {2 * i}. #### {2 * i}", str(2 * i)) for i in range(20)]
    tok = build_tokenizer(cfg, tmp_path, train)
    prompt = cfg.model.prompt_template.format(question=train[3].question)
    assert tok.decode(tok.encode(prompt)) == prompt


def test_evaluate_scores_greedy_and_sampled_responses(tiny_policy, tmp_path):
    cfg, tok, problems, engine, state = tiny_policy
    problems = problems[:6]
    # A verifier that accepts responses of even token length: its result is recomputed here
    # from the engine's own outputs, so the accuracies are checked value for value.

    def even_length(text, problem):
        return float(len(tok.encode(text)) % 2 == 0)

    k = 3
    res = evaluate(engine, state, tok, problems, template=cfg.model.prompt_template,
                   max_new_tokens=cfg.rollout.max_new_tokens, key=jax.random.key(5),
                   samples=k, temperature=1.0, reward_fn=even_length)
    prompts = encode_prompts(tok, problems, cfg.model.prompt_template)
    greedy = engine.generate(state, prompts, SamplingParams(
        temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens), jax.random.key(5))
    expect = np.array([even_length(tok.decode(t), None) for t in greedy.tokens])
    np.testing.assert_array_equal(res.correct, expect)
    assert res.accuracy == pytest.approx(expect.mean())
    assert res.stderr == pytest.approx(math.sqrt(expect.mean() * (1 - expect.mean()) / 6))
    sampled = engine.generate(state, [p for p in prompts for _ in range(k)], SamplingParams(
        temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens),
        jax.random.fold_in(jax.random.key(5), 1))
    per = np.array([even_length(tok.decode(t), None) for t in sampled.tokens]).reshape(6, k).mean(1)
    np.testing.assert_allclose(res.sampled_per_problem, per)
    assert res.sampled_accuracy == pytest.approx(per.mean())
    assert res.sampled_stderr == pytest.approx(per.std(ddof=1) / math.sqrt(6))
    m = res.as_metrics()
    assert m["eval/samples"] == k and m["eval/n"] == 6
    assert m["eval/pass_at_k"] == pytest.approx(np.mean(per > 0))  # any of the k samples correct

    path = tmp_path / "eval" / "step_000000.npz"
    res.save(path)
    loaded = np.load(path)
    np.testing.assert_array_equal(loaded["correct"], res.correct)
    np.testing.assert_allclose(loaded["sampled"], per)
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_000000.npz"]


def test_evaluate_rejects_an_empty_problem_list(tiny_policy):
    cfg, tok, _, engine, state = tiny_policy
    with pytest.raises(ValueError, match="num_eval"):
        evaluate(engine, state, tok, [], template=cfg.model.prompt_template, max_new_tokens=4)


def test_summary_reward_windows_and_z():
    from rhyme_jax.io.summary import _reward_windows, _z

    w = _reward_windows([0.1] * 10 + [0.5] * 5 + [0.3] * 10)
    assert w == {"reward_window": 10, "reward_first": pytest.approx(0.1), "reward_last": pytest.approx(0.3),
                 "reward_rise": pytest.approx(0.2)}
    assert _reward_windows([0.2, 0.6, 0.4])["reward_window"] == 1  # short runs: halves at most
    assert _reward_windows([]) == {}
    assert _z({"gain_paired": 0.1, "gain_paired_stderr": 0.02}) == "5.0"
    assert _z({"gain_paired": 0.0, "gain_paired_stderr": 0.0}) == "inf"
