"""Goodput allocation of draft tokens (rollout/allocation.py) and the pass-cost model (step_cost.py)."""

import itertools
import json

import numpy as np
import pytest

from rhyme_jax.rollout import allocation, shapes
from rhyme_jax.rollout.pass_cost import PassCost, PassCostError, cache_path, monotone, profile

PLAN = shapes.plan(max_slots=16, page_size=16, max_prompt_len=32, max_new_tokens=64)


def test_accept_curve_is_the_running_product_cut_at_each_length():
    est = np.array([[0.5, 0.5, 1.0], [0.9, 0.1, 0.5]])
    p = allocation.accept_curve(est, np.array([3, 1]))
    np.testing.assert_allclose(p, [[0.5, 0.25, 0.25], [0.9, 0.0, 0.0]])
    with pytest.raises(ValueError, match="estimates"):
        allocation.accept_curve(np.array([[1.5]]), np.array([1]))


def _brute_force(plan, curve, cost):
    """Best expected tokens per second over every prefix length per row and every program."""
    n, k = curve.shape
    smallest = shapes.seq_bucket(n, plan.max_slots)
    best = 0.0
    pairs = [(r, t, q) for r in shapes.seq_buckets(plan.max_slots) if r >= smallest
             for t, q in shapes.verify_pairs(r, plan.verify_budget)]
    for rows, t_total, q_len in pairs:
        top = min(k, q_len - 1)
        for lens in itertools.product(range(top + 1), repeat=n):
            if n + sum(lens) > t_total:
                continue
            e = n + sum(curve[i, :l].sum() for i, l in enumerate(lens))
            best = max(best, e / cost(rows, t_total, q_len))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_goodput_choice_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, k = 3, 4
    plan = shapes.plan(max_slots=4, page_size=16, max_prompt_len=8, max_new_tokens=16, max_verify_tokens=8)
    est = rng.uniform(0.05, 1.0, (n, k))
    curve = allocation.accept_curve(est, rng.integers(0, k + 1, n))
    cost = PassCost({(4, 4, 1): 1.0, (4, 6, 2): rng.uniform(1.0, 2.0), (4, 8, 2): rng.uniform(1.2, 3.0)})
    choice = allocation.goodput_choice(plan, curve, cost)
    rate = choice.expected / cost(choice.rows, choice.tokens, choice.q_len)
    assert rate == pytest.approx(_brute_force(plan, curve, cost), rel=1e-9)
    assert choice.expected == pytest.approx(n + allocation.expected_accepted(curve, choice.draft_lens))
    assert np.all(choice.draft_lens <= choice.q_len - 1) and n + choice.draft_lens.sum() <= choice.tokens


@pytest.mark.parametrize("seed", range(4))
def test_goodput_choice_takes_equal_tokens_shallowest_first_then_by_row(seed):
    """Among draft tokens of equal weighted acceptance the step keeps the shallower ones first,
    then the lower rows (the order of a sort on (-P, depth, row)), whatever program it picks."""
    rng = np.random.default_rng(seed)
    n, k = 5, 6
    plan = shapes.plan(max_slots=8, page_size=16, max_prompt_len=8, max_new_tokens=16, max_verify_tokens=24)
    curve = allocation.accept_curve(rng.choice([0.5, 1.0], (n, k)), rng.integers(0, k + 1, n))
    cost = PassCost({(r, t, q): 1.0 + 0.01 * t for r in shapes.seq_buckets(8)
                     for t, q in shapes.verify_pairs(r, plan.verify_budget)})
    choice = allocation.goodput_choice(plan, curve, cost)
    rows, depth = np.nonzero(curve > 0)
    order = sorted(zip(-curve[rows, depth], depth, rows))
    kept = [r for _, d, r in order if d < choice.q_len - 1][: choice.tokens - n]
    assert choice.draft_lens.tolist() == np.bincount(np.array(kept, np.int64), minlength=n).tolist()
    assert choice.draft_lens.sum() > 0


def test_drafts_that_do_not_pay_are_not_sent():
    """Acceptance 0.19 (SmolLM2 at T=1) with verify costing 1.8x decode: plain decode wins."""
    curve = allocation.accept_curve(np.full((16, 4), 0.19), np.full(16, 4))
    rows = 16
    pairs = shapes.verify_pairs(rows, PLAN.verify_budget)
    cost = PassCost({(rows, t, q): (1.0 if q == 1 else 1.8) for t, q in pairs})
    choice = allocation.goodput_choice(PLAN, curve, cost)
    assert (choice.tokens, choice.q_len) == (rows, 1) and choice.draft_lens.sum() == 0
    # Near-certain drafts at the same costs: the biggest program pays.
    curve = allocation.accept_curve(np.full((16, 32), 0.98), np.full(16, 32))
    choice = allocation.goodput_choice(PLAN, curve, cost)
    assert choice.tokens == pairs[-1][0] and choice.draft_lens.sum() == pairs[-1][0] - 16


def test_a_larger_row_bucket_runs_the_step_when_the_model_times_it_faster():
    """SmolLM2 on CPU profiled its 1- and 4-row programs slower than its 16-row ones: a tail of
    2 live rows then runs padded in the 16-row bucket; with ordinary costs it stays in its own."""
    curve = allocation.accept_curve(np.full((2, 4), 0.5), np.full(2, 4))
    pairs = {r: shapes.verify_pairs(r, PLAN.verify_budget) for r in shapes.seq_buckets(16)}
    assert shapes.seq_bucket(2, 16) == 4

    def cost_of(small):
        return PassCost({(r, t, q): (small if r < 16 else 1.0) * (1.0 + 0.01 * t) for r in pairs for t, q in pairs[r]})

    slow_small = allocation.goodput_choice(PLAN, curve, cost_of(3.0))
    assert slow_small.rows == 16 and slow_small.draft_lens.sum() > 0
    assert allocation.goodput_choice(PLAN, curve, cost_of(0.5)).rows == 4
    with_rows = allocation.goodput_choice(PLAN, allocation.accept_curve(np.full((16, 4), 0.5), np.full(16, 4)),
                                          cost_of(0.5))
    assert with_rows.rows == 16  # a bucket smaller than the live rows is never taken


def test_fixed_rule_sends_drafts_when_fewer_rows_are_live_than_the_bucket():
    """Fewer live rows than the bucket: the decode pair (S, 1) holds rows + drafts but would cut
    every draft to 0 (the old rule's defect); the fixed rule takes the first verify program."""
    lens = np.array([2, 0, 1])  # 3 rows live in a 4-row bucket (max_slots 16 -> buckets 1, 4, 16)
    pairs = shapes.verify_pairs(4, PLAN.verify_budget)
    choice = allocation.fixed_rule(PLAN, lens)
    assert choice.rows == 4 and (choice.tokens, choice.q_len) == pairs[1]
    np.testing.assert_array_equal(choice.draft_lens, np.minimum(lens, pairs[1][1] - 1))
    assert choice.draft_lens.sum() > 0
    choice = allocation.fixed_rule(PLAN, np.zeros(3, np.int64))
    assert (choice.tokens, choice.q_len) == (4, 1)
    t_last, q_last = pairs[-1]
    big = allocation.fixed_rule(PLAN, np.array([q_last + 3, t_last - q_last - 6]))  # only the last program holds them
    assert (big.tokens, big.q_len) == (t_last, q_last)
    np.testing.assert_array_equal(big.draft_lens, [q_last - 1, t_last - q_last - 6])
    with pytest.raises(ValueError, match="more than the cap"):
        allocation.fixed_rule(PLAN, np.array([t_last, 0]))


def test_choose_pass_without_estimates_trims_to_the_budget():
    lens = np.full(16, 32)
    choice, curve = allocation.choose_pass(PLAN, lens, None, PassCost.prior())
    assert curve is None and 16 + choice.draft_lens.sum() <= PLAN.verify_budget


def test_pass_cost_lookup_scaling_save_load(tmp_path):
    cost = PassCost({(4, 4, 1): 2.0, (4, 8, 3): 3.0}, {"backend": "cpu"})
    assert cost(4, 8, 3) == 3.0
    assert cost(4, 6, 2) == pytest.approx(2.0 * (8 + 6) / (8 + 4))  # nearest profiled program, scaled
    assert PassCost.prior()(4, 8, 3) == 16.0
    lin = PassCost({(r, t, 1): 0.5 + 0.1 * r + 0.01 * t for r in (4, 16) for t in (r, 3 * r)})
    assert lin(64, 128, 9) == pytest.approx(0.5 + 6.4 + 1.28)  # an unprofiled row bucket: the linear fit
    path = cost.save(tmp_path / "c.json")
    back = PassCost.load(path)
    assert back.seconds == cost.seconds and back.meta == {"backend": "cpu"}
    body = json.loads(path.read_text())
    body["programs"][0]["seconds"] = -1
    path.write_text(json.dumps(body))
    with pytest.raises(PassCostError, match=r"programs\[0\]"):
        PassCost.load(path)
    with pytest.raises(PassCostError, match="unreadable"):
        PassCost.load(tmp_path / "missing.json")


def test_live_step_times_replace_the_profiled_ones(tmp_path):
    """``PassCost.observe``: from ``LIVE_MIN`` live times on, a program costs the median of its
    last ``LIVE_WINDOW``; the bucket's other programs cost their profiled figure times the bucket's
    live / profiled ratio, other buckets their profiled figure; the prior ignores live times
    (other units) and a saved profile holds only what was profiled."""
    from rhyme_jax.rollout.pass_cost import LIVE_MIN, LIVE_WINDOW

    cost = PassCost({(4, 4, 1): 2.0, (4, 8, 3): 3.0, (8, 8, 1): 4.0})
    for i in range(LIVE_MIN - 1):
        cost.observe(4, 4, 1, 1.0 + i)
        assert cost(4, 4, 1) == 2.0  # too few live times yet
    cost.observe(4, 4, 1, 0.5)
    assert cost(4, 4, 1) == 1.0  # median of 1.0, 2.0, 0.5
    assert cost(4, 8, 3) == 1.5 and cost(4, 6, 2) == pytest.approx(2.0 * 0.5 * 14 / 12)  # half the profile
    assert cost(8, 8, 1) == 4.0  # another bucket: its profile
    for _ in range(LIVE_WINDOW):
        cost.observe(4, 4, 1, 7.0)
    assert cost(4, 4, 1) == 7.0  # only the last LIVE_WINDOW count
    assert cost(4, 8, 3) == 10.5
    for _ in range(LIVE_MIN):
        cost.observe(4, 8, 3, 6.0)
    assert cost(4, 8, 3) == 6.0 and cost(4, 6, 2) == pytest.approx(2.0 * 2.75 * 14 / 12)  # median of 3.5 and 2
    assert PassCost.load(cost.save(tmp_path / "c.json")).seconds == {(4, 4, 1): 2.0, (4, 8, 3): 3.0, (8, 8, 1): 4.0}
    prior = PassCost.prior()
    for _ in range(LIVE_MIN):
        prior.observe(4, 8, 3, 1e-3)
    assert prior(4, 8, 3) == 16.0


def test_live_costs_are_kept_per_page_table_width():
    """A program's live times at one page-table width neither answer for another width nor scale
    its programs there: decode timed on short rows (width 2) and verify timed on long ones (width
    8) are not compared; at a width with no live time the profile's own ratio holds."""
    from rhyme_jax.rollout.pass_cost import LIVE_MIN

    cost = PassCost({(4, 4, 1): 2.0, (4, 8, 3): 3.0})
    for _ in range(LIVE_MIN):
        cost.observe(4, 4, 1, 0.1, width=2)
        cost.observe(4, 8, 3, 6.0, width=8)
    assert cost(4, 4, 1, width=2) == 0.1 and cost(4, 8, 3, width=2) == pytest.approx(0.15)  # scaled as decode there
    assert cost(4, 8, 3, width=8) == 6.0 and cost(4, 4, 1, width=8) == pytest.approx(4.0)  # scaled as verify there
    assert cost(4, 4, 1, width=32) == 2.0 and cost(4, 8, 3, width=32) == 3.0  # nothing live there: the profile
    assert cost(4, 4, 1) == 2.0  # width not given: its own key


def test_profile_times_each_decode_program_once_per_widest_table(monkeypatch, tmp_path):
    calls = []
    progs = [shapes.PassShape("prefill", 64, 16, 16, 4), shapes.PassShape("decode", 4, 4, 1, 2),
             shapes.PassShape("decode", 4, 4, 1, 8), shapes.PassShape("verify", 8, 4, 3, 8)]
    out = profile(calls.append, progs, repeats=2)
    assert sorted(out) == [(4, 4, 1), (4, 8, 3)] and all(v >= 0 for v in out.values())
    assert [c.width for c in calls if c.kind == "decode"] == [8] * 4  # 2 untimed + 2 timed, widest only
    monkeypatch.setenv("RHYME_JAX_STEP_COST_DIR", str(tmp_path))
    a, b = cache_path({"m": 1}), cache_path({"m": 2})
    assert a.parent == tmp_path and a != b and a == cache_path({"m": 1})
    monkeypatch.delenv("RHYME_JAX_STEP_COST_DIR")
    monkeypatch.setenv("RHYME_JAX_CACHE", str(tmp_path / "cache"))  # the rest of rhyme-jax's cache
    assert cache_path({"m": 1}) == tmp_path / "cache" / "step_cost" / a.name


def test_profile_takes_the_median_of_rounds_over_the_programs(monkeypatch):
    """Timed runs alternate between the programs (one of each per round, after two untimed runs of
    each) and each program's figure is the median of its rounds."""
    import types

    from rhyme_jax.rollout import pass_cost as sc

    clock, order = [0.0], []
    timed = {(4, 4, 1): [0, 0, 5.0, 1.0, 3.0], (4, 8, 3): [0, 0, 2.0, 9.0, 4.0]}  # seconds per call

    def run(shape):
        key = (shape.rows, shape.tokens, shape.q_len)
        order.append(key)
        clock[0] += timed[key][sum(k == key for k in order) - 1]

    monkeypatch.setattr(sc, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    progs = [shapes.PassShape("decode", 4, 4, 1, 8), shapes.PassShape("verify", 8, 4, 3, 8)]
    assert sc.profile(run, progs, repeats=3) == {(4, 4, 1): 3.0, (4, 8, 3): 4.0}
    assert order[4:] == [(4, 4, 1), (4, 8, 3)] * 3


def test_monotone_costs_never_fall_with_more_tokens():
    got = monotone({(8, 8, 1): 2.0, (8, 12, 5): 1.5, (8, 56, 29): 3.0, (32, 32, 1): 1.0})
    assert got == {(8, 8, 1): 2.0, (8, 12, 5): 2.0, (8, 56, 29): 3.0, (32, 32, 1): 1.0}


def test_rows_predicted_long_get_the_scarce_draft_tokens():
    """Equal acceptance everywhere and room for only some drafts: the row the history predicts
    longest gets them; without priorities the first rows do (ties by depth, then order)."""
    plan = shapes.plan(max_slots=4, page_size=16, max_prompt_len=8, max_new_tokens=16, max_verify_tokens=8)
    curve = allocation.accept_curve(np.full((4, 4), 0.9), np.full(4, 4))
    free = PassCost({(4, t, q): 1.0 for t, q in shapes.verify_pairs(4, plan.verify_budget)})
    w = allocation.makespan_weights(np.array([0.0, 3.0, 30.0, 0.0]), 4)
    np.testing.assert_allclose(w, [1.0, 1.1, 2.0, 1.0])
    choice = allocation.goodput_choice(plan, curve, free, w)
    assert choice.tokens == 8 and choice.draft_lens.tolist() == [0, 0, 4, 0]
    assert allocation.goodput_choice(plan, curve, free).draft_lens.tolist() == [1, 1, 1, 1]
    assert choice.expected == pytest.approx(4 + allocation.expected_accepted(curve, choice.draft_lens))
    np.testing.assert_array_equal(allocation.makespan_weights(None, 3), np.ones(3))
    np.testing.assert_array_equal(allocation.makespan_weights(np.zeros(2), 2), np.ones(2))


def test_busy_verify_fills_every_program_with_live_rows():
    """The profile's inputs: every row live, the program's T tokens all used, drafts within Q - 1,
    contexts on the scratch page only, or (given the pool's size) on each row's own pages."""
    from rhyme_jax.rollout.batching import busy_verify

    for s in PLAN.programs():
        if s.kind == "prefill":
            continue
        inp = busy_verify(s, PLAN.max_slots, PLAN.pages_per_seq, 16)
        lens = inp.draft_lens[: s.rows]
        assert s.rows + lens.sum() == s.tokens and lens.max() <= s.q_len - 1
        assert inp.meta.page_indices.shape == (s.rows, s.width) and not inp.meta.page_indices.any()
        assert np.all(inp.meta.kv_lens[: s.rows] > 1)
        # with the pool's size: each row on its own pages, never the scratch page 0
        own = busy_verify(s, PLAN.max_slots, PLAN.pages_per_seq, 16, PLAN.max_slots * PLAN.pages_per_seq + 1)
        pages = own.meta.page_indices
        assert pages.min() >= 1 and np.unique(pages).size == pages.size


def test_draft_backoff_doubles_to_its_limit_and_resets():
    """``DraftBackoff``: each choice that sends nothing although drafts were proposed skips the
    next 1, 2, 4, ... ``limit`` steps; a choice that sends drafts, or a new row bucket, ends it."""
    b = allocation.DraftBackoff(limit=4)
    pattern = []
    for _ in range(12):
        if b.skip(8):
            pattern.append("s")
            continue
        b.chose(proposed=True, sent=False)
        pattern.append("c")
    assert "".join(pattern) == "cscsscsssscs"  # skips of 1, 2, 4, then 4 (the limit)
    b = allocation.DraftBackoff(limit=4)
    for _ in range(2):
        b.skip(8)
        b.chose(proposed=True, sent=False)
    assert b.span == 2
    b.chose(proposed=True, sent=True)  # drafts pay again: the next backoff starts at 1
    b.chose(proposed=True, sent=False)
    assert (b.span, b.wait) == (1, 1)
    b = allocation.DraftBackoff(limit=4)
    assert not b.skip(8)
    b.chose(proposed=True, sent=False)
    assert b.skip(8) is True
    b.chose(proposed=True, sent=False)  # span 2
    assert not b.skip(16)  # another row bucket: asked again at once
    assert not b.skip(16)
    b.chose(proposed=False, sent=False)  # nothing proposed: no backoff
    assert not b.skip(16)
