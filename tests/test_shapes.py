"""Step programs: the enumeration from the config bounds what a run compiles, and the engine
never runs (or compiles) a shape outside it."""

import jax
import numpy as np
import pytest

from rhyme_jax.compile_count import CompileCounter
from rhyme_jax.config import load_config
from rhyme_jax.rollout import shapes
from rhyme_jax.rollout.engine import SamplingParams
from test_histospec_engine import HistoryDrafter
from test_rollout_engine import MAX_NEW, _engine, _model, _prompts, _reference_with_eos


def test_real_recipe_compiles_at_most_36_programs():
    cfg = load_config("configs/gsm8k_qwen2.5_1.5b.yaml")
    assert cfg.spec.enabled
    progs = shapes.programs_from_config(cfg)
    assert len(progs) <= 36  # 32 until prefill ran at each page-table width (6 buckets x 2 widths)
    kinds = {p.kind for p in progs}
    assert kinds == {"prefill", "decode", "verify"}
    assert len(set(progs)) == len(progs)
    # HistoSpec off: no verify programs
    off = shapes.plan_from_config(cfg).programs(spec=False)
    assert {p.kind for p in off} == {"prefill", "decode"} and set(off) < set(progs)
    for name in ("configs/gsm8k_smollm2_135m.yaml", "configs/default.yaml"):  # 227 and 126 before
        assert len(shapes.programs_from_config(load_config(name))) <= 36, name


def test_plan_matches_the_engine():
    cfg = load_config("configs/default.yaml")
    r = cfg.rollout
    plan = shapes.plan_from_config(cfg)
    assert plan.verify_budget == 4 * r.max_slots and plan.pages_per_seq == -(-(r.max_prompt_len + r.max_new_tokens)
                                                                              // r.page_size)
    for s in shapes.seq_buckets(r.max_slots):  # every step fits some pair of its row bucket
        pairs = shapes.verify_pairs(s, plan.verify_budget)
        assert pairs[0] == (s, 1) and pairs[-1][0] >= min(plan.verify_budget, s * (shapes.MAX_DRAFT + 1))
        assert all(q <= t - s + 1 for t, q in pairs)


@pytest.mark.slow  # 73 s on 2 cores: CI time
def test_engine_runs_only_enumerated_programs_and_warmup_covers_them():
    """Warm-up of ``programs(spec=True)``, then greedy and sampled rollouts with drafts of every
    length: nothing compiles and every program run is in the enumeration."""
    prompts, eos, want, _ = _reference_with_eos()
    history = [np.concatenate([p, w, w]).astype(np.int32) for p, w in zip(prompts, want)]
    eng = _engine(eos_ids=[eos], max_prefill_tokens=32)
    state = _model()[1]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    sampled = SamplingParams(temperature=0.8, max_new_tokens=MAX_NEW)
    with CompileCounter() as warm:
        n = eng.warmup(state, greedy, spec=True)
        eng.warmup(state, sampled, spec=True)
    # (how many compile events that is depends on what earlier tests of the process compiled)
    assert n == len(eng.programs(spec=True)) and warm.count > 0
    with CompileCounter() as counter:
        for window in (2, 5, 16):
            res = eng.generate(state, prompts, greedy, jax.random.key(0), drafter=HistoryDrafter(history, window))
            for got, exp in zip(res.tokens, want):
                np.testing.assert_array_equal(got, exp)
            eng.generate(state, _prompts(7), sampled, jax.random.key(1), drafter=HistoryDrafter(history, window))
    assert counter.count == 0
    assert eng.programs_run <= set(eng.programs(spec=True))
    assert {p.kind for p in eng.programs_run} == {"prefill", "decode", "verify"}
