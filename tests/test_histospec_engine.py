"""Rollout engine with drafts: exactly the outputs / distribution of plain decoding, fewer passes.

A test drafter proposes the continuation of a stored sequence (the "history") wherever the
running sequence's last tokens occur in it, optionally corrupting draft tokens. The engine must
emit the same greedy tokens and logprobs as plain decoding, and under sampling the same token
distribution (two-sample chi-square over many samples), whatever the drafts are.
"""

import jax
import numpy as np
import pytest
from scipy import stats

from rhyme_jax.rollout.engine import SamplingParams

import f32
from test_rollout_engine import (MAX_NEW, _engine, _model, _prompts, _reference_with_eos,
                                 assert_behaviour_logprobs, greedy_logprob_atol, logprob_atol)

PATTERN = 3


class HistoryDrafter:
    """Drafts ``window`` tokens that followed the last ``PATTERN`` tokens in ``history[req]``.

    Args:
      history: per request, a full token sequence (prompt + a previous response).
      window: draft length (before the engine's budget).
      corrupt: probability of replacing each draft token by a random one.
    """

    context_width = PATTERN  # tails of PATTERN tokens (rhyme_jax.rollout.types.Drafter)

    def __init__(self, history, window=4, corrupt=0.0, vocab=64, seed=0):
        self.history, self.window, self.corrupt = history, window, corrupt
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.observed = []

    def draft(self, reqs, tails, budgets):
        out = np.zeros((len(reqs), self.window), np.int32)
        lens = np.zeros(len(reqs), np.int32)
        for b, (r, tail) in enumerate(zip(reqs, tails)):
            h = self.history[int(r)]
            for i in range(len(h) - PATTERN, -1, -1):
                if np.array_equal(h[i: i + PATTERN], tail):
                    d = h[i + PATTERN: i + PATTERN + min(self.window, int(budgets[b]))].copy()
                    bad = self.rng.random(len(d)) < self.corrupt
                    d[bad] = self.rng.integers(0, self.vocab, bad.sum())
                    out[b, : len(d)], lens[b] = d, len(d)
                    break
        return out, lens

    def observe(self, reqs, drafted, accepted):
        assert np.all(accepted <= drafted) and np.all(accepted >= 0)
        self.observed.append((np.array(reqs), np.array(drafted), np.array(accepted)))


def _greedy(prompts, eos, drafter=None, **kw):
    eng = _engine(eos_ids=[eos], **kw)
    return eng.generate(_model()[1], prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                        jax.random.key(0), drafter=drafter)


@pytest.mark.parametrize("corrupt,window", [(0.0, 4), pytest.param(0.0, 16, marks=pytest.mark.slow), (0.3, 4), (1.0, 8)])
def test_greedy_with_drafts_equals_plain(corrupt, window):
    prompts, eos, want, want_lp = _reference_with_eos()
    history = [np.concatenate([p, w]).astype(np.int32) for p, w in zip(prompts, want)]
    drafter = HistoryDrafter(history, window=window, corrupt=corrupt)
    res = _greedy(prompts, eos, drafter)
    for got, exp, glp, elp in zip(res.tokens, want, res.logprobs, want_lp):
        np.testing.assert_array_equal(got, exp)  # EOS inside a draft ends the sequence there
        np.testing.assert_allclose(glp, elp, atol=greedy_logprob_atol(), rtol=0)  # decode vs verify programs
    s = res.stats
    assert s["drafted_tokens"] > 0 and s["generated_tokens"] == sum(len(w) for w in want)
    if corrupt == 0.0:  # true history (a repeated 3-gram may mislead it): far fewer forward passes
        assert s["accepted_tokens"] >= 0.8 * s["drafted_tokens"]
        plain = _greedy(prompts, eos).stats
        assert s["decode_steps"] * 2 <= plain["decode_steps"]
    if corrupt == 1.0:
        assert s["accepted_tokens"] < s["drafted_tokens"] / 4
    acc = sum(a.sum() for _, _, a in drafter.observed)
    assert acc == s["accepted_tokens"]


def test_drafts_with_preemption_keep_greedy_outputs():
    prompts, eos, want, _ = _reference_with_eos()
    history = [np.concatenate([p, w]).astype(np.int32) for p, w in zip(prompts, want)]
    res = _greedy(prompts, eos, HistoryDrafter(history, window=8), num_pages=9)
    assert res.stats["preemptions"] > 0
    for got, exp in zip(res.tokens, want):
        np.testing.assert_array_equal(got, exp)


def test_drafts_respect_length_limit_and_token_budget():
    prompts, eos, want, _ = _reference_with_eos()
    history = [np.concatenate([p, w, w]).astype(np.int32) for p, w in zip(prompts, want)]
    eng = _engine(eos_ids=[], max_verify_tokens=5)  # 3 slots: at most 2 draft tokens per step
    sp = SamplingParams(temperature=0.0, max_new_tokens=7)
    res = eng.generate(_model()[1], prompts, sp, jax.random.key(0), drafter=HistoryDrafter(history, 16))
    plain = eng.generate(_model()[1], prompts, sp, jax.random.key(0))
    for got, exp in zip(res.tokens, plain.tokens):
        np.testing.assert_array_equal(got, exp)
        assert len(got) == 7
    assert 0 < res.stats["drafted_tokens"] <= 2 * res.stats["decode_steps"]


def _samples(drafter, n_calls, seed0, prompt, temperature=1.0):
    eng = _engine(max_slots=32, eos_ids=[])
    sp = SamplingParams(temperature=temperature, max_new_tokens=4)
    out, acc = [], 0
    for c in range(n_calls):
        res = eng.generate(_model()[1], [prompt] * 64, sp, jax.random.key(seed0 + c), drafter=drafter)
        out += [t for t in res.tokens]
        acc += res.stats["accepted_tokens"]
    return np.stack(out), acc


def test_sampled_distribution_with_drafts_equals_plain():
    prompt = _prompts(11, (6,))[0]
    plain, _ = _samples(None, 12, 100, prompt)
    # History: the most frequent plain continuation, so drafts are often (not always) accepted.
    vals, counts = np.unique(plain[:, :3], axis=0, return_counts=True)
    hist = np.concatenate([prompt, vals[np.argmax(counts)], [0, 0]]).astype(np.int32)
    spec, acc = _samples(HistoryDrafter([hist] * 64, window=4), 12, 500, prompt)
    assert acc > 50  # drafts are really exercised (76-92 of ~350-400 drafted since the layer-scan init, b73300d)
    for pos in range(4):  # per-position token marginals
        table = _contingency(plain[:, pos], spec[:, pos])
        assert stats.chi2_contingency(table).pvalue > 1e-3, pos
    # joint of the first two tokens
    table = _contingency(plain[:, 0] * 64 + plain[:, 1], spec[:, 0] * 64 + spec[:, 1])
    assert stats.chi2_contingency(table).pvalue > 1e-3


@pytest.mark.parametrize("corrupt", [0.0, pytest.param(0.5, marks=pytest.mark.slow)])  # CI time: 0.0 drafts too
def test_sampled_rollout_with_drafts_draws_plain_tokens_with_the_same_key(corrupt):
    """Every token's draw is keyed by (request, position), so with the same key a rollout with
    drafts emits exactly plain decode's sampled tokens and logprobs, in fewer passes (the
    drafts only change how many passes run). Fails with per-pass keys (fold_in(key, pass))."""
    prompts = _prompts(7, (4, 10, 6, 8))
    eng = _engine()
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=MAX_NEW)
    key = jax.random.key(11)
    plain = eng.generate(_model()[1], prompts, sp, key)
    history = [np.concatenate([p, t]).astype(np.int32) for p, t in zip(prompts, plain.tokens)]
    spec = eng.generate(_model()[1], prompts, sp, key, drafter=HistoryDrafter(history, 4, corrupt=corrupt))
    assert spec.stats["accepted_tokens"] > 0
    assert spec.stats["forward_passes"] < plain.stats["forward_passes"]
    atol = logprob_atol(prompts, plain.tokens, 0.8)  # decode vs verify programs: f32 bound
    for a, b, la, lb in zip(plain.tokens, spec.tokens, plain.logprobs, spec.logprobs):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(la, lb, rtol=0, atol=atol)


@pytest.mark.slow  # CI time (15 s): right drafts are accepted and keep plain tokens in test_greedy_with_drafts_equals_plain and tests/test_chunk_spec.py; rhyme_lab/ablate/paired.py stays covered by tests/test_learning_suite.py
def test_always_right_drafter_is_always_accepted_and_draws_plain_tokens():
    """``measure.oracle_drafters.AlwaysRightDrafter`` (the ``--oracle`` bound of ``benchmarks.rollout``):
    drafting the plain rollout's own tokens, every draft token is accepted, the tokens are plain
    decode's and the rollout needs at most half the passes."""
    from rhyme_lab.ablate.paired import AlwaysRightDrafter

    prompts = _prompts(5, (4, 10, 6, 8))
    eng = _engine()
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    key = jax.random.key(3)
    plain = eng.generate(_model()[1], prompts, sp, key)
    spec = eng.generate(_model()[1], prompts, sp, key,
                        drafter=AlwaysRightDrafter(prompts, plain.tokens, MAX_NEW))
    s = spec.stats
    assert s["drafted_tokens"] > 0 and s["accepted_tokens"] == s["drafted_tokens"]
    assert 2 * s["decode_steps"] <= plain.stats["decode_steps"]
    for a, b in zip(plain.tokens, spec.tokens):
        np.testing.assert_array_equal(a, b)


def test_held_run_is_the_longest_continuation_after_the_last_token():
    """``measure.oracle_drafters.held_run``: sources, siblings and self-lookup; a source's end stops a run."""
    from rhyme_lab.ablate.paired import held_run

    a = lambda *x: np.array(x)  # noqa: E731
    assert held_run([a(5, 1, 2, 3, 9)], a(7, 5), a(1, 2, 3, 4)) == 3
    assert held_run([a(5, 1, 2)], a(7, 5), a(1, 2, 3, 4)) == 2
    assert held_run([a(0, 5, 1), a(5, 1, 2, 3, 3)], a(7, 5), a(1, 2, 3, 4)) == 3
    assert held_run([], a(5, 1, 2, 5), a(1, 2, 9)) == 2  # the row's own context
    assert held_run([a(1, 1)], a(7, 5), a(1)) == 0


def test_source_bound_drafts_only_what_the_sources_hold():
    """``measure.oracle_drafters.SourceBound`` (``--oracle sources``): on the first rollout of distinct
    prompts only self-lookup can draft, so it drafts less than always-right; on a repeat with
    that rollout as history every draft is accepted and the rollout needs at most half the
    passes. The tokens stay plain decode's."""
    from rhyme_lab.ablate.paired import AlwaysRightDrafter, SourceBound

    prompts = _prompts(5, (4, 10, 6, 8))
    eng = _engine()
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    key = jax.random.key(3)
    plain = eng.generate(_model()[1], prompts, sp, key)
    right = eng.generate(_model()[1], prompts, sp, key, drafter=AlwaysRightDrafter(prompts, plain.tokens, MAX_NEW))
    bound = SourceBound()
    first = eng.generate(_model()[1], prompts, sp, key, drafter=bound(prompts, plain.tokens, MAX_NEW))
    again = eng.generate(_model()[1], prompts, sp, key, drafter=bound(prompts, plain.tokens, MAX_NEW))
    assert first.stats["drafted_tokens"] < right.stats["drafted_tokens"]
    for res in (first, again):
        assert res.stats["accepted_tokens"] == res.stats["drafted_tokens"]
        for a, b in zip(plain.tokens, res.tokens):
            np.testing.assert_array_equal(a, b)
    assert again.stats["drafted_tokens"] > first.stats["drafted_tokens"]
    assert 2 * again.stats["decode_steps"] <= plain.stats["decode_steps"]


def test_backoff_skips_the_drafter_while_drafts_do_not_pay():
    """``allocation.DraftBackoff`` in the engine: under a pass-cost model where every verify
    program costs 100 decode steps no draft is sent, and after the first choices the drafter is
    asked on at most every other step (1, 2, 4, ... 8 skipped); the tokens stay plain decode's.
    Where drafts pay (the prior) it is asked on every step."""
    from rhyme_lab.ablate.paired import AlwaysRightDrafter
    from rhyme_jax.rollout.pass_cost import PassCost

    class Counting(AlwaysRightDrafter):
        calls = 0

        def draft(self, reqs, tails, budgets):
            self.calls += 1
            return super().draft(reqs, tails, budgets)

    prompts = _prompts(5, (4, 10, 6, 8))
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    key = jax.random.key(3)
    eng = _engine()
    plain = eng.generate(_model()[1], prompts, sp, key)
    eng.pass_cost = PassCost({(s.rows, s.tokens, s.q_len): 1.0 if s.q_len == 1 else 100.0
                              for s in eng.programs(spec=True) if s.kind != "prefill"})
    dear = Counting(prompts, plain.tokens, MAX_NEW)
    res = eng.generate(_model()[1], prompts, sp, key, drafter=dear)
    assert res.stats["drafted_tokens"] == 0
    assert 0 < dear.calls <= res.stats["decode_steps"] // 2
    for a, b in zip(plain.tokens, res.tokens):
        np.testing.assert_array_equal(a, b)
    eng = _engine()  # the prior: drafts pay
    cheap = Counting(prompts, plain.tokens, MAX_NEW)
    res = eng.generate(_model()[1], prompts, sp, key, drafter=cheap)
    assert res.stats["drafted_tokens"] > 0 and cheap.calls == res.stats["decode_steps"]


def _contingency(a, b, min_count=10):
    """2 x C counts over the categories of a and b; rare categories pooled into one column."""
    cats = np.union1d(a, b)
    ca = np.array([(a == c).sum() for c in cats])
    cb = np.array([(b == c).sum() for c in cats])
    big = ca + cb >= min_count
    cols = [np.stack([ca[big], cb[big]])]
    if (~big).any():
        cols.append(np.array([[ca[~big].sum()], [cb[~big].sum()]]))
    return np.concatenate(cols, axis=1)


def test_sampled_logprobs_with_drafts_are_behaviour_logprobs():
    prompts = _prompts(3, (4, 10, 6))
    eng = _engine()
    sp = SamplingParams(temperature=0.7, top_k=12, top_p=0.85, max_new_tokens=8)
    first = eng.generate(_model()[1], prompts, sp, jax.random.key(5))
    history = [np.concatenate([p, t]).astype(np.int32) for p, t in zip(prompts, first.tokens)]
    # the same key: every draw is the history's, so its drafts are accepted (whatever the draws)
    res = eng.generate(_model()[1], prompts, sp, jax.random.key(5), drafter=HistoryDrafter(history, 4))
    assert res.stats["accepted_tokens"] > 0
    assert all(np.array_equal(a, b) for a, b in zip(res.tokens, first.tokens))
    assert_behaviour_logprobs(prompts, res, 0.7, 12, 0.85)


class EstimatingDrafter(HistoryDrafter):
    """``HistoryDrafter`` that also gives every draft token the same acceptance estimate
    (``Drafter.estimates``): the engine then sizes drafts with its goodput allocation."""

    def __init__(self, history, estimate, **kw):
        super().__init__(history, **kw)
        self.estimate, self.estimates = estimate, None

    def draft(self, reqs, tails, budgets):
        out, lens = super().draft(reqs, tails, budgets)
        self.estimates = np.full(out.shape, self.estimate, np.float32)
        return out, lens


@pytest.mark.parametrize("estimate", [0.99, 0.02])
def test_goodput_allocation_keeps_greedy_outputs_and_drops_drafts_that_do_not_pay(estimate):
    """Sure drafts are sent and cut the passes; hopeless ones (2% acceptance) are not sent at
    all: plain decode is cheaper than any verify program under the prior cost model."""
    prompts, eos, want, want_lp = _reference_with_eos()
    history = [np.concatenate([p, w]).astype(np.int32) for p, w in zip(prompts, want)]
    drafter = EstimatingDrafter(history, estimate, window=8)
    res = _greedy(prompts, eos, drafter)
    for got, exp, glp, elp in zip(res.tokens, want, res.logprobs, want_lp):
        np.testing.assert_array_equal(got, exp)
        np.testing.assert_allclose(glp, elp, atol=greedy_logprob_atol(), rtol=0)  # decode vs verify programs
    s = res.stats
    if estimate > 0.5:
        assert s["drafted_tokens"] > 0 and s["accepted_tokens"] >= 0.8 * s["drafted_tokens"]
        # float32 (or better) products of <= 8 estimates (each rounded to float32) summed over n
        # drafted tokens: relative error <= gamma(16 + n) (positive terms, Higham 3.5); a draft
        # counted wrongly moves the sum by >= 0.99, far more
        n = int(sum(int(ds.sum()) for _, ds, _ in drafter.observed))
        assert s["predicted_accepted"] == pytest.approx(
            sum(float(np.sum(estimate ** np.arange(1, d + 1))) for _, ds, _ in drafter.observed for d in ds),
            rel=f32.gamma(16 + n), abs=0)
        assert s["decode_steps"] * 2 <= _greedy(prompts, eos).stats["decode_steps"]
    else:
        assert s["drafted_tokens"] == 0 and s["predicted_accepted"] == 0.0


def test_pass_cost_profile_times_every_program_and_leaves_outputs_unchanged():
    """``profile_pass_cost`` runs every decode/verify program with each row on its own pages of the
    idle pool; a rollout afterwards still gives the greedy reference (the profile's writes do not
    leak into it), and the model covers every program of the plan. The rollout's own passes then
    feed the model live times (``PassCost.observe``): only decode/verify programs it ran, each as
    often as it ran them."""
    prompts, eos, want, _ = _reference_with_eos()
    eng = _engine(eos_ids=[eos])
    sp = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    cost = eng.profile_pass_cost(_model()[1], sp, repeats=1)
    progs = {(s.rows, s.tokens, s.q_len) for s in eng.programs(spec=True) if s.kind != "prefill"}
    assert set(cost.seconds) == progs and all(v > 0 for v in cost.seconds.values())
    assert cost.live == {}  # the profile's own runs are not live times
    eng.programs_run.clear()
    res = eng.generate(_model()[1], prompts, sp, jax.random.key(0))
    for got, exp in zip(res.tokens, want):
        np.testing.assert_array_equal(got, exp)
    ran = {(s.rows, s.tokens, s.q_len, s.width) for s in eng.programs_run if s.kind != "prefill"}
    assert set(cost.live) == ran and ran  # each program at each page-table width it ran at
    assert sum(len(times) for times, _ in cost.live.values()) == min(res.stats["decode_steps"], 15 * len(ran))


def test_an_idle_drafter_is_never_called_and_a_step_without_proposals_is_plain_decode(monkeypatch):
    """A drafter that says it is ``idle`` (no request can get a draft) is not called at all, and
    a step where an estimating drafter proposes nothing runs plain decode's program without the
    goodput choice: both rollouts emit plain decode's tokens in plain decode's passes."""
    from rhyme_jax.rollout import allocation

    prompts, eos, want, _ = _reference_with_eos()
    plain = _greedy(prompts, eos)

    class Idle(EstimatingDrafter):
        idle = True

        def draft(self, reqs, tails, budgets):
            raise AssertionError("an idle drafter was asked for drafts")

    history = [np.concatenate([p, w]).astype(np.int32) for p, w in zip(prompts, want)]
    idle = _greedy(prompts, eos, Idle(history, 0.99))
    never = [np.full(3, -7, np.int32) for _ in prompts]  # no PATTERN-token match: no proposals
    proposing_nothing = EstimatingDrafter(never, 0.99)

    def no_choice(*args, **kw):
        raise AssertionError("the goodput choice ran on a step without proposals")

    monkeypatch.setattr(allocation, "choose_pass", no_choice)
    silent = _greedy(prompts, eos, proposing_nothing)
    assert len(proposing_nothing.observed) == plain.stats["decode_steps"]
    for res in (idle, silent):
        assert res.stats["decode_steps"] == plain.stats["decode_steps"] and res.stats["drafted_tokens"] == 0
        for got, exp in zip(res.tokens, plain.tokens):
            np.testing.assert_array_equal(got, exp)
