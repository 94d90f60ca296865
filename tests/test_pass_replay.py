"""``rhyme_lab.measure.pass_replay`` (``python -m benchmarks.pass_replay``) replays HistoSpec's
forward passes exactly: a sampled rollout with the real drafter (suffix index over the previous
rollout, AIMD window, self-lookup) needs exactly the verify passes the replay computes from the
emitted tokens alone."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from rhyme_lab.measure import pass_replay as replay
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
    from rhyme_lab.measure import draft_gap

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


def cut_bound_case() -> SimpleNamespace:
    """One row whose history holds 5 6 7 8 9 10 11 12 and which emits 5 6 7 8 20 10 11 12; a
    step costs 1 plus 0.01 per draft token slot (shared by ``test_policy_mode``)."""
    from rhyme_jax.rollout import shapes

    spec = SimpleNamespace(branch="reward", window="goodput", fixed_window=8, min_token_prob=0.0, pattern_max=7,
                           pattern_min=1, self_lookup=True, siblings=False, history_depth=1)
    prompt = np.array([1, 2, 3], np.int32)
    pids, one = np.zeros(1, np.int64), np.ones(1, np.float32)
    store = HistoryStore()
    store.update(1, pids, [prompt], [np.array([5, 6, 7, 8, 9, 10, 11, 12], np.int32)], one)
    plan = shapes.plan(max_slots=4, page_size=16, max_prompt_len=16, max_new_tokens=64, max_verify_tokens=64)
    return SimpleNamespace(spec=spec, prompt=prompt, pids=pids, one=one, store=store, plan=plan,
                           response=np.array([5, 6, 7, 8, 20, 10, 11, 12], np.int32),
                           cost=lambda rows, tokens, q_len: 1.0 + 0.01 * (tokens - rows))


def test_cut_bound_separates_estimates_from_drafts():
    """``measure.cut_bound.bound_step`` (``python -m benchmarks.draft_gap --unit U --bound``): the
    history holds 5 6 7 8 9 10 11 12 and the row emits 5 6 7 8 20 10 11 12. The source-bound
    oracle (one-token matches) gets 6 7 8 accepted after the prefill's 5, then emits 20 (held
    nowhere), 10, then 11 12 in one draft: 3 passes, 5 accepted tokens, none rejected. The
    drafter that knows its acceptance never sends a rejected token; plain decode is one step per
    token after the prefill's (7 steps of the cost model's unit)."""
    from rhyme_lab.measure import cut_bound

    c = cut_bound_case()
    spec, prompt, pids, one, store, response, plan, cost = (c.spec, c.prompt, c.pids, c.one, c.store, c.response,
                                                            c.plan, c.cost)
    drafters = {m: Drafter(spec, store) for m in ("estimates", "known")}
    try:
        got = cut_bound.bound_step(64, {0: prompt}, pids, [response], one, store, plan, cost, drafters)
    finally:
        for d in drafters.values():
            d.close()
    assert got["tokens"] == 8 and got["plain_seconds"] == pytest.approx(7.0)
    oracle, known, own = got["oracle"], got["known"], got["estimates"]
    assert (oracle["passes"], oracle["accepted"], oracle["drafted"]) == (3, 5, 5)
    assert 3 <= oracle["seconds"] < 3.5  # three steps and the slots of five draft tokens (bucketed)
    assert known["accepted"] == known["drafted"] >= 3  # nothing rejected: it sends what holds
    assert own["drafted"] >= own["accepted"] >= 3
    merged = cut_bound.merge([got, got])
    assert merged["tokens"] == 16 and merged["oracle"]["passes"] == 6
    r = cut_bound.ratios(merged)
    assert r["oracle"] == pytest.approx(7.0 / oracle["seconds"]) and r["oracle_share"] == pytest.approx(1.0)
    assert r["known_share"] == pytest.approx(oracle["seconds"] / known["seconds"])


def test_cross_prompt_oracle_drafts_from_other_prompts_text():
    """``oracle_cross`` (``draft_gap --bound --cross-prompt``): another prompt's history holds 8 20
    10 11 12, so after the first pass (6 7 8 accepted, 20 emitted) the cross-prompt oracle gets 10
    11 12 accepted from it: 2 passes and 6 accepted tokens, where the prompt's own sources need 3
    passes (20 is held nowhere in them)."""
    from rhyme_lab.measure import cut_bound

    c = cut_bound_case()
    c.store.update(2, np.ones(1, np.int64), [np.array([9, 9], np.int32)], [np.array([8, 20, 10, 11, 12], np.int32)],
                   c.one)
    drafters = {m: Drafter(c.spec, c.store) for m in ("estimates", "known")}
    try:
        got = cut_bound.bound_step(64, {0: c.prompt}, c.pids, [c.response], c.one, c.store, c.plan, c.cost,
                                   drafters, cross=True)
    finally:
        for d in drafters.values():
            d.close()
    assert (got["oracle"]["passes"], got["oracle"]["accepted"]) == (3, 5)
    assert (got["oracle_cross"]["passes"], got["oracle_cross"]["accepted"]) == (2, 6)
    assert cut_bound.ratios(got)["oracle_cross_share"] > 1.0


def test_occurrence_rules_on_constructed_sequences():
    """``measure.occurrence_rules`` (``python -m benchmarks.draft_gap RUN --rules``): the history
    ``7 1 2 8 7 1 4 5 6`` holds the context's last token ``7`` twice. After ``3 3 3 3 7`` the
    first occurrence drafts ``1 2 ..`` (one token held, then ``4`` emitted and ``5`` from
    ``7 1 4``: 2 passes, 2 carried), the one nearest the row's position drafts ``1 4 5`` (1 pass,
    3 carried, the pass's own token ends the response), as hindsight does."""
    from rhyme_lab.measure import occurrence_rules as occ

    table = occ.suffix_matches(np.array([1, 2, 3]), np.array([2, 3, 1, 2]))
    assert table[2].tolist() == [0, 1, 0, 0, 2] and table[3].tolist() == [0, 0, 2, 0, 0]
    prompt, hist = np.array([9]), [np.array([7, 1, 2, 8, 7, 1, 4, 5, 6])]
    response = np.array([3, 3, 3, 3, 7, 1, 4, 5, 6])
    got = {r: occ.rule_passes(prompt, response, hist, r, emitted=5) for r in occ.RULES}
    assert got == {"longest": (2, 2), "count": (2, 2), "nearest": (1, 3), "sticky": (1, 3), "top2": (2, 2),
                   "hindsight": (1, 3)}
    with pytest.raises(ValueError, match="occurrence rule"):
        occ.rule_passes(prompt, response, hist, "random")
    store = HistoryStore()
    store.update(1, np.zeros(1, np.int64), [prompt], hist, np.ones(1, np.float32))
    step = occ.rules_step({0: prompt, 1: prompt}, np.array([0, 1]), [response, response], store)
    one = {r: occ.rule_passes(prompt, response, hist, r) for r in occ.RULES}  # the prefill's token emitted
    assert step == {r: {"passes": n, "carried": c, "tokens": 9} for r, (n, c) in one.items()}  # row 1: no history
