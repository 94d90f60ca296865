"""``rhyme_jax.measure.pass_replay`` (``python -m benchmarks.pass_replay``) replays HistoSpec's
forward passes exactly: a sampled rollout with the real drafter (suffix index over the previous
rollout, AIMD window, self-lookup) needs exactly the verify passes the replay computes from the
emitted tokens alone."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from rhyme_jax.measure import pass_replay as replay
from rhyme_jax.rollout.engine import SamplingParams
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryStore
from test_rollout_engine import MAX_NEW, _engine, _model, _prompts


@pytest.mark.parametrize("self_lookup", [pytest.param(False, marks=pytest.mark.slow), True])  # CI time: True covers more
def test_replay_reproduces_engine_passes(self_lookup):
    cfg = SimpleNamespace(branch="reward", window="aimd", fixed_window=8, min_token_prob=0.1, pattern_max=7,
                          pattern_min=3, self_lookup=self_lookup)
    groups = _prompts(3, (6, 9, 5))
    pids = np.repeat(np.arange(3), 4)  # 3 prompts x 4 samples
    prompts = [groups[p] for p in pids]
    eng = _engine(max_slots=12, max_verify_tokens=12 * 33)  # nothing trimmed by the token budget
    state = _model()[1]
    sp = SamplingParams(temperature=0.4, max_new_tokens=MAX_NEW)
    first = eng.generate(state, prompts, sp, jax.random.key(1))
    rewards = np.random.default_rng(0).choice([0.0, 1.0], pids.size).astype(np.float32)
    store = HistoryStore()
    store.update(1, pids, [np.array(p, np.int32) for p in prompts], first.tokens, rewards)
    with Drafter(cfg, store) as drafter:
        res = eng.generate(state, prompts, sp, jax.random.key(2), drafter=drafter.batch(pids))
    s = res.stats
    assert s["prefill_steps"] == 1 and s["preemptions"] == 0
    assert 0 < s["accepted_tokens"] < s["drafted_tokens"]  # drafts both accepted and rejected

    passes = replay.replay_step(cfg, MAX_NEW, {p: np.array(groups[p], np.int32) for p in range(3)}, pids,
                                res.tokens, rewards, store, siblings=False)
    assert passes.max() == s["decode_steps"]  # the batch runs until its slowest sequence is done
    assert passes.sum() + pids.size == s["sequence_steps"]  # every sequence's verify passes + its prefill


def test_oracle_passes_on_constructed_sequences():
    prompt = np.array([1, 2, 3, 4, 5], np.int32)
    seen = np.arange(10, 50, dtype=np.int32)  # 40 distinct tokens
    # the response repeats a history response: every pass accepts a whole window (+ 1 sampled token)
    assert replay.oracle_passes(prompt, seen, [np.concatenate([prompt, seen])], 64, window=8) == 5  # 39 / 9
    assert replay.oracle_passes(prompt, seen, [np.concatenate([prompt, seen])], 64, window=32) == 2  # 39 / 33
    # nothing to copy: one token per pass after the prefill's first token
    assert replay.oracle_passes(prompt, seen, [prompt], 64, window=32) == 39
    # the response repeats itself: its own earlier tokens are drafted once the pattern recurs
    loop = np.tile(np.array([7, 8, 9, 6], np.int32), 6)  # 24 tokens
    assert replay.oracle_passes(prompt, loop, [prompt], 64, window=32) < 10


def test_replay_with_siblings_runs_the_goodput_drafter():
    """``replay_step(..., siblings=True)`` with the goodput drafter (its length prediction reads
    the store's ``lengths``, which the siblings' view of the store passes on): with the response in
    the history every sample drafts all of it in one verify pass; without history, samples that
    all finish together have no sibling to draft from, and distinct tokens nothing of their own
    (one token per pass)."""
    cfg = SimpleNamespace(branch="reward", window="goodput", fixed_window=8, min_token_prob=0.0, pattern_max=7,
                          pattern_min=1, self_lookup=True, siblings=True, history_depth=1)
    prompt = np.array([1, 2, 3], np.int32)
    response = np.arange(10, 40, dtype=np.int32)  # 30 distinct tokens: the prefill's + 29
    pids = np.zeros(4, np.int64)
    ones = np.ones(4, np.float32)
    store = HistoryStore()
    store.update(1, pids, [prompt] * 4, [response] * 4, ones)
    known = replay.replay_step(cfg, 64, {0: prompt}, pids, [response] * 4, ones, store, siblings=True)
    unknown = replay.replay_step(cfg, 64, {0: prompt}, pids, [response] * 4, ones, HistoryStore(), siblings=True)
    assert known.tolist() == [1] * 4 and unknown.tolist() == [29] * 4


def test_draft_gap_counts_the_tokens_the_oracle_would_have_drafted():
    """``measure.draft_gap.gap_step`` (``python -m benchmarks.draft_gap``): a response that repeats
    its first five tokens. Without self-lookup the drafter sends nothing, and each pass of the
    repeat emits one token the oracle's self source held (positions 6-8 missed, cause ``no draft``,
    source ``self``; position 9 ends the response, where a longer draft saves no pass); with
    self-lookup it drafts the repeat and misses none. A response known from the history is drafted
    in one pass: nothing missed."""
    from rhyme_jax.measure import draft_gap

    def spec(self_lookup):
        return SimpleNamespace(branch="reward", window="fixed", fixed_window=8, min_token_prob=0.0, pattern_max=7,
                               pattern_min=1, self_lookup=self_lookup, siblings=False, history_depth=1)

    prompt = np.array([1, 2, 3], np.int32)
    response = np.array([5, 6, 7, 8, 9, 5, 6, 7, 8, 9], np.int32)
    pids, one = np.zeros(1, np.int64), np.ones(1, np.float32)
    blind = draft_gap.gap_step(spec(False), 64, {0: prompt}, pids, [response], one, HistoryStore())
    assert (blind["tokens"], blind["passes"], blind["drafted"], blind["accepted"], blind["missed"]) == (10, 9, 0, 0, 3)
    assert blind["by_cause"] == {"no draft": 3} and blind["by_source"] == {"self": 3}
    assert blind["by_position"] == {"4-7": 2, "8-15": 1}
    seeing = draft_gap.gap_step(spec(True), 64, {0: prompt}, pids, [response], one, HistoryStore())
    # positions 1-5 have nothing earlier to look up; at 6 the draft from the first 5 carries 6-9
    assert (seeing["passes"], seeing["accepted"], seeing["missed"]) == (6, 4, 0)
    store = HistoryStore()
    store.update(1, pids, [prompt], [response], one)
    known = draft_gap.gap_step(spec(False), 64, {0: prompt}, pids, [response], one, store)
    assert (known["passes"], known["accepted"], known["missed"]) == (1, 8, 0)  # 8 drafted + its own token
    # a pass that sends nothing (``send``: the engine's cut) misses every held token but the last
    cut = draft_gap.gap_step(spec(False), 64, {0: prompt}, pids, [response], one, store,
                             send=lambda batch, lens, left: np.zeros_like(lens))
    assert (cut["passes"], cut["drafted"], cut["missed"], cut["by_source"]) == (9, 0, 8, {"history": 8})
    # the goodput drafter gives estimates: every accepted draft token, and the first rejected one
    # of each draft, is a tested token of one bin
    est = draft_gap.gap_step(SimpleNamespace(**{**vars(spec(True)), "window": "goodput"}), 64, {0: prompt}, pids,
                             [response], one, store)
    cal = est["calibration"]
    assert sum(cal["accepted"]) == est["accepted"] > 0 and est["accepted"] < sum(cal["tested"]) <= est["drafted"]
    assert all(0 <= a <= n for n, a in zip(cal["tested"], cal["accepted"]))
    assert blind["calibration"]["tested"] == [0] * draft_gap.ESTIMATE_BINS  # a fixed window has no estimates
    merged = draft_gap.merge([blind, known])
    assert (merged["tokens"], merged["missed"], merged["by_source"]) == (20, 3, {"self": 3})
    assert draft_gap.merge([est, est])["calibration"]["tested"] == [2 * n for n in cal["tested"]]
