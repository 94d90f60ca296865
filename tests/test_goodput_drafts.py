"""Goodput drafting (spec.window = goodput): history candidates at every match length against a
brute-force reference, the prompt head at response start, self-lookup and siblings scored against
the history, online calibration, estimates, and the window policies left as they were.

Tolerances: acceptance estimates are stored as float32 and compared with the python floats
they were computed from: one rounding (``rtol=1e-6`` = 16.8 U); ``pytest.approx`` compares
float64 host arithmetic.
"""

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from rhyme_jax.spec import calibration as C
from rhyme_jax.spec.candidates import MIN_CUM
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryStore
from rhyme_jax.spec.suffix_index import END, PROMPT_HEAD, SEP

W = 256  # context width with self-lookup / siblings


def _cfg(**kw):
    base = dict(enabled=True, branch="reward", window="goodput", fixed_window=8, min_token_prob=0.1,
                pattern_max=7, pattern_min=3, history_depth=1, self_lookup=False, siblings=False)
    return SimpleNamespace(**{**base, **kw})


def _store(pid, prompt, responses, rewards=None):
    store = HistoryStore()
    n = len(responses)
    store.update(0, [pid] * n, [np.asarray(prompt)] * n, [np.asarray(r) for r in responses],
                 np.ones(n) if rewards is None else np.asarray(rewards, float))
    return store


def _tails(seqs, width):
    out = np.full((len(seqs), width), -1, np.int32)
    for i, s in enumerate(seqs):
        s = np.asarray(s)[-width:]
        out[i, width - s.size:] = s
    return out


def _draft(batch, reqs, seqs, budget=40, width=None):
    width = width or batch.context_width
    drafts, lens = batch.draft(np.asarray(reqs), _tails(seqs, width), np.full(len(reqs), budget))
    return [drafts[i, : lens[i]].tolist() for i in range(len(reqs))], batch.estimates


# ----------------------------------------------------------------- brute-force reference
def _occurrences(strings, pattern):
    m = len(pattern)
    return [(k, e) for k, (s, _, _) in enumerate(strings) for e in range(m, len(s))
            if s[e - m:e] == pattern]


def _child_rank(strings, occ, c, branch):
    """Sort key (smaller = better) of next token c after the occurrences ``occ``."""
    after = [(k, e) for k, e in occ if strings[k][0][e] == c]
    resp = [strings[k][2] for k, _ in after if strings[k][1]]
    mean = sum(resp) / len(resp) if resp else 0.0
    if branch == "reward":
        return (-int(bool(resp)), -mean if resp else 0.0, -len(after), c)
    return (-len(after), c)


def _reference(prompt, responses, rewards, tail, max_len, cfg, cal):
    """Every distinct-occurrence match length from the longest down to pattern_min, each walked
    greedily and scored by expected accepted length; the best (ties: the longer match)."""
    strings = [(list(prompt) + [END], False, 0.0)]
    strings += [(list(prompt[-PROMPT_HEAD:]) + list(r) + [SEP], True, float(w)) for r, w in zip(responses, rewards)]
    tail = [t for t in tail if t >= 0][-cfg.pattern_max:]
    longest = max([m for m in range(1, len(tail) + 1) if _occurrences(strings, tail[-m:])], default=0)
    best, best_score = [], 0.0
    for m in range(longest, cfg.pattern_min - 1, -1):
        if m < longest and len(_occurrences(strings, tail[-m:])) == len(_occurrences(strings, tail[-(m + 1):])):
            continue  # same occurrences as a longer match: the same automaton state
        ctx, toks, ests, prob, cum, score = list(tail[-m:]), [], [], 1.0, 1.0, 0.0
        while len(toks) < max_len:
            occ = _occurrences(strings, ctx)
            nxt = sorted({strings[k][0][e] for k, e in occ if strings[k][0][e] >= 0},
                         key=lambda c: _child_rank(strings, occ, c, cfg.branch))
            if not nxt:
                break
            q = sum(strings[k][0][e] == nxt[0] for k, e in occ) / len(occ)
            if prob * q < cfg.min_token_prob:
                break
            prob *= q
            e = cal.estimate("history", m, len(toks), q, once=len(occ) == 1)
            cum *= e
            score += cum
            toks.append(nxt[0])
            ests.append(e)
            ctx.append(nxt[0])
            if cum < MIN_CUM:
                break
        if score > best_score:
            best, best_score = (toks, ests), score
    return best or ([], [])


@pytest.mark.parametrize("branch,pmin,min_prob", [("reward", 1, 0.0), ("count", 2, 0.1), ("reward", 3, 0.05)])
def test_history_candidates_equal_brute_force(branch, pmin, min_prob):
    rng = np.random.default_rng(pmin)
    cfg = _cfg(branch=branch, pattern_min=pmin, min_token_prob=min_prob, pattern_max=5)
    prompt = rng.integers(0, 4, 8)
    base = rng.integers(0, 4, 30)
    responses = []
    for _ in range(6):
        r = base.copy()
        r[rng.integers(0, 30, 4)] = rng.integers(0, 4, 4)
        responses.append(r[: rng.integers(12, 31)])
    rewards = rng.choice([0.0, 0.5, 1.0], 6)
    with Drafter(cfg, _store(3, prompt, responses, rewards)) as d:
        d.rebuild([3])
        batch = d.batch([3] * 40)
        # calibrate a little first so estimates differ between cells
        for _ in range(3):
            seqs = [np.r_[prompt, responses[i % 6][: rng.integers(0, 12)]] for i in range(40)]
            drafts, _ = _draft(batch, range(40), seqs)
            lens = np.array([len(x) for x in drafts])
            batch.observe(np.arange(40), lens, np.array([rng.integers(0, n + 1) for n in lens]))
        seqs = [np.r_[prompt, responses[i % 6][: rng.integers(0, 12)], rng.integers(0, 4, i % 3)] for i in range(40)]
        budgets = rng.integers(0, 40, 40)
        drafts, lens = batch.draft(np.arange(40), _tails(seqs, cfg.pattern_max), budgets)
        est = batch.estimates
        assert est.dtype == np.float32 and est.shape == drafts.shape
        drafted = 0
        for i, s in enumerate(seqs):
            toks, ests = _reference(prompt, responses, rewards, s, min(budgets[i], 32), cfg, d._calibration)
            assert drafts[i, : lens[i]].tolist() == toks, i
            np.testing.assert_allclose(est[i, : lens[i]], np.float32(ests), rtol=1e-6)
            drafted += len(toks)
        assert drafted > 40


def test_match_advanced_from_the_last_step_equals_a_fresh_match():
    """Each step the history match is advanced over the tokens observe() reported; a batch
    without that memory (fresh every step) must draft the same, also after a tail that is not
    the last one plus those tokens (e.g. a preempted and re-admitted request)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 5, 8) for _ in range(3)]
    base = [rng.integers(0, 5, 40) for _ in range(3)]

    def edit(b):
        r = b.copy()
        r[rng.integers(0, 40, 3)] = rng.integers(0, 5, 3)
        return r

    store = HistoryStore()
    pids = np.repeat(np.arange(3), 4)
    store.update(0, pids, [prompts[p] for p in pids], [edit(base[p]) for p in pids], rng.random(12))
    targets = [np.r_[prompts[p], edit(base[p])] for p in pids]
    done = np.array([9] * 12)
    with Drafter(_cfg(pattern_max=5, pattern_min=1), store) as d:
        d.rebuild(range(3))
        batch = d.batch(pids.tolist())
        for step in range(12):
            if step == 4:  # request 3's tail jumps back 2 tokens without observe() saying so
                done[3] -= 2
            tails, budgets = _tails([targets[r][: done[r]] for r in range(12)], 5), 47 - done
            drafts, lens = batch.draft(np.arange(12), tails, budgets)
            other = d.batch(pids.tolist())
            fresh, fresh_lens = other.draft(np.arange(12), tails, budgets)
            assert lens.tolist() == fresh_lens.tolist() and lens.sum() > 0
            np.testing.assert_array_equal(drafts, fresh)
            np.testing.assert_array_equal(batch.estimates, other.estimates)
            acc = np.array([int(np.argmin(np.r_[drafts[r, : lens[r]] == targets[r][done[r]: done[r] + lens[r]], False]))
                            for r in range(12)])
            batch.observe(np.arange(12), lens, acc)
            done += acc + 1
        assert (batch._goodput.memo[:, 0] > 0).all()


def test_shorter_match_wins_when_its_continuation_is_better():
    # "9 1 2 3" (longest) continues with 30 or 31 and ends; "2 3" continues 10..15 in 6 of 8
    prompt = [50, 51, 52, 53, 54, 55]
    responses = [[9, 1, 2, 3, 30], [9, 1, 2, 3, 31]] + [[8, 2, 3, 10, 11, 12, 13, 14, 15]] * 6
    seq = prompt + [7, 9, 1, 2, 3]
    store = _store(1, prompt, responses)
    kw = dict(branch="count", pattern_min=2, min_token_prob=0.0)
    with Drafter(_cfg(window="fixed", fixed_window=32, **kw), store) as d:
        d.rebuild([1])
        assert _draft(d.batch([1]), [0], [seq])[0] == [[30]]  # the paper's rule: longest match only
    with Drafter(_cfg(**kw), store) as d:
        d.rebuild([1])
        drafts, est = _draft(d.batch([1]), [0], [seq])
        assert drafts == [[10, 11, 12, 13, 14, 15]]
        q = 6 / 8  # "2 3" occurs 8 times, 6 followed by 10
        expect = [d._calibration.estimate("history", 2, 0, q)] + [d._calibration.estimate("history", 2, j, 1.0)
                                                                  for j in range(1, 6)]
        np.testing.assert_allclose(est[0], np.float32(expect))
        # prior: 0.85 x the bucket centre x the factor of a 2-token match
        assert est[0, 0] == np.float32(C.HISTORY_SHRINK * 0.75 * C.MATCH_PRIOR[C.MATCH_BUCKET[2]])


def test_prompt_head_drafts_at_response_start():
    prompt = list(range(40, 50))
    responses = [[5, 6, 7, 8, 20 + i, 30] for i in range(4)]
    store = _store(2, prompt, responses)
    with Drafter(_cfg(window="aimd"), store) as d:
        d.rebuild([2])
        assert _draft(d.batch([2]), [0], [prompt])[0] == [[]]  # the 7-token match ends in END
    with Drafter(_cfg(), store) as d:
        d.rebuild([2])
        drafts, est = _draft(d.batch([2]), [0], [prompt])
        assert drafts[0][:4] == [5, 6, 7, 8]
        assert est[0, 0] == pytest.approx(d._calibration.estimate("history", PROMPT_HEAD, 0, 4 / 5))


def test_self_lookup_is_scored_against_the_history():
    prompt = list(range(40, 50))
    a, b, c = 1, 2, 3
    seq = prompt + [11, 12, a, b, c, 21, 22, 23, 24, 11, 12, a, b, c]
    weak = [[a, b, c, 60 + i] for i in range(8)]  # history: 8 different continuations (q = 1/8)
    strong = [[a, b, c, 4, 5, 6, 7]] * 8  # history: one continuation (q = 1)
    cfg = _cfg(self_lookup=True, min_token_prob=0.0)
    with Drafter(cfg, _store(5, prompt, weak)) as d:
        d.rebuild([5])
        batch = d.batch([5])
        assert batch.context_width == W
        drafts, est = _draft(batch, [0], [seq])
        # self: "11 12 a b c" occurred before, followed by 21 22 23 24; the prior 0.3 per token stops
        # the candidate once all-accepted falls below MIN_CUM (0.3^4 < 0.01)
        assert drafts == [[21, 22, 23, 24]]
        np.testing.assert_allclose(est[0], np.float32([C.LOOKUP_BASE] * 4))
    with Drafter(cfg, _store(5, prompt, strong)) as d:
        d.rebuild([5])
        assert _draft(d.batch([5]), [0], [seq])[0] == [[4, 5, 6, 7]]
    with Drafter(_cfg(min_token_prob=0.0), _store(5, prompt, weak)) as d:  # self-lookup off
        d.rebuild([5])
        assert _draft(d.batch([5]), [0], [seq])[0] == [[60]]


def test_self_lookup_drafts_the_most_common_continuation_of_the_longest_match():
    prompt = list(range(40, 50))
    x = 9
    # "x" occurs 4 times before the end: followed by 31, 30, 30, 30 (31 is the newest but rarest)
    seq = prompt + [x, 30, 5, x, 30, 6, x, 30, 7, x, 31, 8, x]
    cfg = _cfg(self_lookup=True, min_token_prob=0.0, pattern_min=1)
    with Drafter(cfg, HistoryStore()) as d:
        batch = d.batch([3])
        drafts, est = _draft(batch, [0], [seq])
        assert drafts[0][0] == 30  # prompt lookup's newest occurrence would give 31
        cal = d._calibration
        assert est[0, 0] == np.float32(cal.estimate("self", 1, 0, 3 / 4))
        seq2 = prompt + [x, 30, 5, x, 30, 6, 7, 8]
        # "x 30" occurred twice, followed by 5 and by 6: a tie, the newest wins at share 1/2
        drafts, est = _draft(d.batch([3]), [0], [seq2 + [x, 30]])
        assert drafts[0][:2] == [6, 7] and est[0, 0] == np.float32(cal.estimate("self", 2, 0, 0.5))
        # "6" occurred once: the "once" cell (share 1 on one example)
        batch = d.batch([3])
        drafts, _ = _draft(batch, [0], [seq2 + [6]])
        assert drafts[0][:2] == [7, 8]
        assert batch._goodput.cells[0, 0] == C.cell_of(C.SELF, 1, 0, 1.0, True) != C.cell_of(C.SELF, 1, 0, 1.0, False)


def test_sequence_store_grows_past_its_capacity_and_keeps_drafting():
    prompt = list(range(1000, 1010))
    period = list(range(100, 150))  # distinct tokens repeated: self-lookup always knows what comes next
    full = prompt + period * 16  # 810 tokens: past the store's first 512 columns
    with Drafter(_cfg(self_lookup=True, min_token_prob=0.0, pattern_min=1), HistoryStore()) as d:
        batch = d.batch([4])
        n, checked = len(prompt) + 1, 0
        while n < len(full) - 8:
            drafts, _ = _draft(batch, [0], [full[:n]], budget=4)
            if n >= len(prompt) + len(period) + 1:
                assert drafts == [full[n: n + len(drafts[0])]] and len(drafts[0]) >= 1, n
                checked += 1
            batch.observe(np.array([0]), np.array([len(drafts[0])]), np.array([len(drafts[0])]))
            n += len(drafts[0]) + 1
        store = batch._goodput.store
        assert checked > 100 and store.seq.shape[1] > 512
        assert store.sequence(0).tolist() == full[: store.slen[0]] and store.slen[0] > 700


def test_middle_cells_carry_what_match_length_and_depth_do_across_branch_shares():
    cal = C.Calibration()
    cold = cal.estimate("history", 2, 1, 0.95)
    assert cold == pytest.approx(C.HISTORY_SHRINK * 0.95 * C.MATCH_PRIOR[C.MATCH_BUCKET[2]])
    cells = np.full((1, 32), -1, np.int32)
    for _ in range(400):  # 2-token matches, depth 1, branch share ~0.5: the second token always fails
        cells[0, :2] = [C.cell_of(C.HISTORY, 2, 0, 0.55, False), C.cell_of(C.HISTORY, 2, 1, 0.55, False)]
        cal.update(np.array([0]), cells, np.full((1, 32), 0.5, np.float32), [2], [1])
    # an untried share at the same match length and depth now starts far lower; other depths and
    # match lengths keep their prior factor (their coarse cell moved: bucket 0.9 saw no trials)
    assert cal.estimate("history", 2, 1, 0.95) < 0.1 * cold
    assert cal.estimate("history", 4, 1, 0.95) == pytest.approx(C.HISTORY_SHRINK * 0.95)
    assert cal.estimate("history", 2, 0, 0.95) > 0.9 * cold


def test_siblings_draft_from_the_groups_other_requests():
    prompt = list(range(1, 11))
    resp = list(range(20, 40))
    with Drafter(_cfg(siblings=True), HistoryStore()) as d:  # no history: siblings only
        batch = d.batch([7, 7, 9])  # requests 0 and 1 share prompt 7 (one group); 2 has prompt 9
        assert batch.context_width == W
        done = 1  # request 0 runs alone: prefill emitted resp[0]; then passes emit 1, 3, 2, ... tokens
        for grow in [1, 3, 2, 1, 4, 2]:
            drafts, _ = _draft(batch, [0], [prompt + resp[:done]])
            assert drafts == [[]]  # nothing to copy yet
            batch.observe(np.array([0]), np.array([grow - 1]), np.array([grow - 1]))
            done += grow
        seen = done - 2  # the last pass's 2 tokens never reach the drafter (no later tail)
        assert batch._goodput.store.sequence(0).tolist() == prompt + resp[:seen]
        assert batch._goodput.store.used[1:].tolist() == [5, 0, 0]  # every tail lined up
        drafts, est = _draft(batch, [1, 2], [prompt + resp[:5], prompt + resp[:5]])
        assert drafts[0] == resp[5:9]  # sibling 0's continuation (4 tokens at the prior 0.3)
        assert drafts[1] == []  # request 2 is in another group (same tokens, other prompt id)
        np.testing.assert_allclose(est[0], np.float32([C.LOOKUP_BASE] * 4))
        assert est.shape == (2, 4) and not est[1].any()
        drafts, _ = _draft(batch, [1], [prompt + resp[: seen - 2]])
        assert drafts == [resp[seen - 2: seen]]  # ends where sibling 0's stored tokens end


def test_calibration_converges_to_the_true_acceptance():
    rng = np.random.default_rng(0)
    prompt = list(range(40, 50))
    responses = [list(range(60, 100))] * 4
    with Drafter(_cfg(min_token_prob=0.0), _store(4, prompt, responses)) as d:
        d.rebuild([4])
        batch = d.batch([4] * 64)
        seq = prompt + list(range(60, 70))
        for _ in range(60):
            drafts, est = _draft(batch, range(64), [seq] * 64)
            lens = np.array([len(x) for x in drafts])
            assert lens.min() > 0 and ((est > 0) & (est < 1))[:, : lens.min()].all()
            # each draft token accepted with probability 0.3 given the earlier ones were
            accepted = np.array([int(np.argmin(np.r_[rng.random(n) < 0.3, False])) for n in lens])
            batch.observe(np.arange(64), lens, accepted)
        _, est = _draft(batch, [0], [seq])
        assert abs(est[0, 0] - 0.3) < 0.05 and abs(est[0, 1] - 0.3) < 0.05
        rows = {(r["depth"]): r for r in d.calibration() if r["source"] == "history"}
        assert rows["0"]["trials"] == 60 * 64
        assert abs(rows["0"]["observed"] - 0.3) < 0.03 and abs(rows["0"]["estimate"] - 0.3) < 0.05
        assert rows["0"]["predicted"] > 0.3  # the prior was optimistic at first


def test_calibration_updates_are_thread_safe():
    cal = C.Calibration()
    cell = C.cell_of(C.SIBLING, 3, 0, 1.0, False)

    def work():
        cells = np.full((8, 32), -1, np.int32)
        for _ in range(100):
            cells[:, 0] = cell
            cal.update(np.arange(8), cells, np.zeros((8, 32), np.float32), np.ones(8), np.r_[np.ones(4), np.zeros(4)])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (row,) = cal.rows()
    assert row["trials"] == 4 * 100 * 8 and row["observed"] == 0.5
    assert row["source"] == "sibling" and row["match"] == "3" and row["depth"] == "0" and row["prob"] == "1"
    with pytest.raises(ValueError, match="once per observe"):
        cal.update(np.array([1, 1]), np.full((8, 32), -1, np.int32), np.zeros((8, 32), np.float32),
                   np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match="accepted <= drafted"):
        cal.update(np.array([1]), np.full((8, 32), -1, np.int32), np.zeros((8, 32), np.float32), [1], [2])


def test_budgets_cap_drafts_at_32_and_rows_without_history_draft_nothing():
    prompt = list(range(40, 50))
    store = _store(1, prompt, [list(range(60, 110))] * 3)
    with Drafter(_cfg(min_token_prob=0.0), store) as d:
        d.rebuild([1])
        batch = d.batch([1, 1, 1, 2])
        seq = prompt + [60, 61, 62]
        drafts, lens = batch.draft(np.arange(4), _tails([seq] * 4, 7), np.array([100, 5, 0, 100]))
        assert lens.tolist()[1:] == [5, 0, 0] and 0 < lens[0] <= 32
        assert drafts[0, : lens[0]].tolist() == list(range(63, 63 + lens[0]))
        assert drafts.shape == batch.estimates.shape == (4, lens[0])
        assert not drafts[1:, 5:].any() and not batch.estimates[1, 5:].any() and not batch.estimates[2:].any()


def test_old_outcomes_fade():
    cal = C.Calibration()
    cells = np.full((1, 32), -1, np.int32)
    for i in range(int(C.MEMORY) + 100):
        cells[0, 0] = C.cell_of(C.SELF, 4, 2, 1.0, False)
        cal.update(np.array([0]), cells, np.full((1, 32), 0.3, np.float32), [1], [int(i >= C.MEMORY)])
    # trial 5001 (the first accepted) halves the counts: 2500.5 trials, 0.5 accepted; 99 accepted follow
    (row,) = cal.rows()
    assert row["trials"] == 2599 and row["observed"] == pytest.approx(99.5 / 2599.5)
    assert row["predicted"] == pytest.approx(0.3) and row["source"] == "self" and row["depth"] == "2"


@pytest.mark.parametrize("window", ["aimd", "mimd", "fixed"])
def test_window_policies_give_no_estimates(window):
    prompt = list(range(40, 50))
    with Drafter(_cfg(window=window, siblings=True), _store(1, prompt, [[1, 2, 3, 4]] * 2)) as d:
        d.rebuild([1])
        batch = d.batch([1])
        assert batch.context_width == 7 and batch.estimates is None  # siblings need goodput
        drafts, _ = _draft(batch, [0], [prompt])
        assert batch.estimates is None and d.calibration() == []


def test_run_config_selects_goodput_with_all_sources():
    from rhyme_jax.config import load_config

    spec = load_config(None, ["spec.window=goodput", "spec.siblings=true", "spec.self_lookup=true"]).spec
    prompt = list(range(40, 50))
    with Drafter(spec, _store(1, prompt, [[5, 6, 7, 8, 9]] * 2)) as d:
        d.rebuild([1])
        batch = d.batch([1, 1])
        assert (d.goodput, d.siblings, d.self_lookup, batch.context_width) == (True, True, True, W)
        drafts, est = _draft(batch, [0, 1], [prompt, prompt + [5, 6]])
        assert drafts == [[5, 6, 7, 8, 9], [7, 8, 9]] and est.shape == (2, 5)


def test_priorities_are_the_tokens_the_history_predicts_left():
    """Makespan priority: each row's prompt's mean response length last time minus the tokens it
    emitted in observed passes (accepted + 1 each), floored at 0; 0 for a prompt without history."""
    prompt = list(range(40, 50))
    store = _store(2, prompt, [[5, 6, 7, 8], [5, 6, 7, 8, 9, 10]])  # mean length 5
    with Drafter(_cfg(), store) as d:
        d.rebuild([2])
        batch = d.batch([2, 2, 9])
        _draft(batch, [0, 1, 2], [prompt, prompt, [1, 2, 3]])
        np.testing.assert_allclose(batch.priorities, [5.0, 5.0, 0.0])
        batch.observe(np.array([0, 1]), np.array([3, 0]), np.array([2, 0]))
        _draft(batch, [0, 1], [prompt + [5, 6, 7], prompt + [5]])
        np.testing.assert_allclose(batch.priorities, [2.0, 4.0])
    with Drafter(_cfg(window="aimd"), store) as d:
        batch = d.batch([2])
        _draft(batch, [0], [prompt])
        assert batch.priorities is None
