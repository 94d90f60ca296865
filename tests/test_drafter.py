"""HistoSpec drafter: batched drafts vs per-sequence SuffixIndex.draft, budgets, windows,
cold start and background index rebuilds."""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from rhyme_jax.spec import drafter as D
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryStore
from rhyme_jax.spec.suffix_index import SuffixIndex
from rhyme_jax.spec.window import initial_window, next_window

P = 7


def _cfg(**kw):
    base = dict(enabled=True, branch="reward", window="aimd", fixed_window=8, min_token_prob=0.1,
                pattern_max=P, pattern_min=3, history_depth=1)
    return SimpleNamespace(**{**base, **kw})


def _store(rng, pids, n=4, vocab=6, step=0, store=None):
    """History with rhyming responses (one base per prompt with edits) so drafts are long."""
    store = store or HistoryStore()
    ids = np.repeat(pids, n)
    prompts = [np.arange(10 + p, 10 + p + 6) % vocab for p in ids]
    bases = {p: rng.integers(0, vocab, 60) for p in pids}
    responses = []
    for p in ids:
        r = bases[p].copy()
        r[rng.integers(0, 60, 3)] = rng.integers(0, vocab, 3)
        responses.append(r[: rng.integers(30, 61)])
    store.update(step, ids, prompts, responses, rng.choice([0.0, 1.0], ids.size))
    return store


def _tails(rng, store, pids, vocab=6, anywhere=0.2):
    """For each request: a tail cut from prompt + one of its history responses (left-padded),
    ending inside the response (or, with probability ``anywhere``, anywhere)."""
    out = []
    for p in pids:
        e = store.entry(p)
        if e is None:
            seq, lo = rng.integers(0, vocab, 20), 1
        else:
            resp = e.rollouts[-1].responses[rng.integers(len(e.rollouts[-1].responses))]
            seq, lo = np.concatenate([e.prompt, resp]), e.prompt.size + 1
        end = int(rng.integers(1 if rng.random() < anywhere else lo, len(seq) + 1))
        t = seq[max(0, end - P):end]
        out.append(np.concatenate([np.full(P - t.size, -1), t]))
    return np.stack(out).astype(np.int32)


def _reference(store, pid, tail, max_len, cfg):
    e = store.entry(pid)
    if e is None:
        return []
    return D.index_of(e).draft(tail, max_len, branch=cfg.branch, min_token_prob=cfg.min_token_prob,
                               pattern_max=cfg.pattern_max, pattern_min=cfg.pattern_min).tolist()


@pytest.mark.parametrize("branch,window", [("reward", "aimd"), ("count", "mimd"), ("reward", "fixed")])
def test_batched_draft_equals_per_sequence(branch, window):
    rng = np.random.default_rng(0)
    cfg = _cfg(branch=branch, window=window, fixed_window=16)
    store = _store(rng, [3, 5, 8])
    pids = [3, 5, 8, 3, 99, 5, 3, 8, 99]  # 99: no history (cold start)
    with Drafter(cfg, store) as d:
        d.rebuild([3, 5, 8])
        batch = d.batch(pids)  # what the trainer's rollout workers drive the engine with
        for _ in range(6):
            reqs = rng.permutation(len(pids))[: rng.integers(1, len(pids) + 1)]
            tails = _tails(rng, store, [pids[r] for r in reqs])
            budgets = rng.integers(0, 40, reqs.size)
            windows = batch.windows[reqs]
            drafts, lens = batch.draft(reqs, tails, budgets)
            assert drafts.dtype == lens.dtype == np.int32
            assert drafts.shape == (reqs.size, int(lens.max()))  # the engine fits drafts to its steps
            assert np.all(lens <= np.minimum(windows, budgets))
            for b, r in enumerate(reqs):
                want = _reference(store, pids[r], tails[b], min(windows[b], budgets[b]), cfg)
                assert drafts[b, : lens[b]].tolist() == want
                assert np.all(drafts[b, lens[b]:] == 0)
                if pids[r] == 99:
                    assert lens[b] == 0
            accepted = np.array([rng.integers(0, n + 1) for n in lens])
            batch.observe(reqs, lens, accepted)
            assert np.array_equal(batch.windows[reqs], next_window(window, windows, lens, accepted, 16))


def test_budget_and_window_limits():
    rng = np.random.default_rng(1)
    store = _store(rng, [0])
    e = store.entry(0)
    full = SuffixIndex.build(e.prompt, list(e.rollouts[0].responses), e.rollouts[0].rewards)
    seen = set()
    with Drafter(_cfg(window="fixed", fixed_window=32, min_token_prob=0.0), store) as d:
        b = d.batch([0, 0, 0])
        first = np.concatenate([e.prompt, e.rollouts[0].responses[0][:1]])
        tail = first[-P:][None].repeat(3, 0)  # the response's second token is next
        for budget in (0, 1, 2, 3, 5, 9, 17, 40):
            drafts, lens = b.draft(np.arange(3), tail, np.array([budget, 0, min(budget, 1)]))
            want = full.draft(tail[0], min(budget, 32), branch="reward", min_token_prob=0.0)
            assert lens.tolist() == [want.size, 0, min(want.size, 1)]
            assert drafts.shape == (3, want.size)  # K = the longest draft (the engine fits K)
            assert drafts[0, : lens[0]].tolist() == want.tolist()
            seen.add(drafts.shape[1])
    assert seen == {0, 1, 2, 3, 5, 9, 17, 32}  # the budget binds below the window, the window (32) above


def _window_reference(policy, w, drafted, accepted, fixed):
    """Scalar restatement of the window rules (``rhyme_jax/spec/window.py`` docstring)."""
    if policy == "fixed":
        return fixed
    if drafted == 0:
        return w
    if accepted == drafted:
        return min(w + 2, 32) if policy == "aimd" else min(w * 2, 16)
    return 2 if policy == "aimd" else max(w // 2, 2)


@pytest.mark.parametrize("policy", ["aimd", "mimd", "fixed"])
def test_windows_follow_their_definitions(policy):
    rng = np.random.default_rng(2)
    w = initial_window(policy, 5, fixed=6)
    assert w.tolist() == [6 if policy == "fixed" else 2] * 5
    ref = w.tolist()
    for _ in range(60):
        drafted = np.array([rng.integers(0, x + 1) for x in w])
        full = rng.random(5) < 0.7
        accepted = np.where(full, drafted, [rng.integers(0, max(x, 1)) for x in drafted])
        w = next_window(policy, w, drafted, accepted, fixed=6)
        ref = [_window_reference(policy, *a, 6) for a in zip(ref, drafted, accepted)]
        assert w.tolist() == ref
    # one explicit trace per policy: full, full, full, rejected, nothing drafted, full
    trace = [(2, 2), (4, 4), (6, 6), (8, 3), (0, 0), (2, 2)]
    got, w = [], initial_window(policy, 1, fixed=6)
    for dr, ac in trace:
        w = next_window(policy, w, np.array([dr]), np.array([ac]), fixed=6)
        got.append(int(w[0]))
    assert got == {"aimd": [4, 6, 8, 2, 2, 4], "mimd": [4, 8, 16, 8, 8, 16], "fixed": [6] * 6}[policy]
    with pytest.raises(ValueError, match="accepted"):
        next_window(policy, np.array([4]), np.array([2]), np.array([3]), fixed=6)


def test_cold_start_drafts_nothing():
    with Drafter(_cfg(), HistoryStore()) as d:
        b = d.batch([1, 2])
        drafts, lens = b.draft(np.array([0, 1]), np.zeros((2, P), np.int32), np.array([8, 8]))
        assert drafts.shape == (2, 0) and lens.tolist() == [0, 0]


def test_rebuild_in_background_then_batch_sees_new_history(monkeypatch):
    rng = np.random.default_rng(3)
    store = _store(rng, [4])
    threads = []
    real = D.index_of
    started = threading.Event()

    def slow_index_of(entry):
        threads.append(threading.current_thread().name)
        started.set()
        time.sleep(0.2)  # batch() must wait for a build that is still running
        return real(entry)

    with Drafter(_cfg(min_token_prob=0.0), store) as d:
        d.rebuild([4])
        b = d.batch([4])
        old_tail = _tails(rng, store, [4])
        old = b.draft(np.array([0]), old_tail, np.array([2]))
        assert old[1][0] == 2

        old_index = D.index_of(store.entry(4))
        _store(np.random.default_rng(99), [4], step=1, store=store)  # new rollout of prompt 4
        monkeypatch.setattr(D, "index_of", slow_index_of)
        d.rebuild([4])
        assert started.wait(10)
        b = d.batch([4])
        assert threads and all(t.startswith("histospec-index") for t in threads)
        tail = _tails(rng, store, [4], anywhere=0.0)
        drafts, lens = b.draft(np.array([0]), tail, np.array([2]))
        assert drafts[0, : lens[0]].tolist() == _reference(store, 4, tail[0], 2, _cfg(min_token_prob=0.0))
        assert lens[0] > 0
        assert old_index.draft(tail[0], 2, branch="reward", min_token_prob=0.0).tolist() != \
            drafts[0, : lens[0]].tolist()  # the draft comes from the new history, not the old


def test_batch_builds_a_queued_index_itself(monkeypatch):
    rng = np.random.default_rng(6)
    store = _store(rng, [1, 2, 3, 4])
    built = []
    real = D.index_of
    gate = threading.Event()

    def gated_index_of(entry):
        built.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            gate.wait(10)  # the background thread is stuck on the first prompt
        return real(entry)

    monkeypatch.setattr(D, "index_of", gated_index_of)
    with Drafter(_cfg(), store) as d:
        try:
            d.rebuild([1, 2, 3, 4])
            b = d.batch([4])  # 4 is still queued behind 1: built here, not waited for
            assert built.count("MainThread") == 1
            tail = _tails(rng, store, [4], anywhere=0.0)
            drafts, lens = b.draft(np.array([0]), tail, np.array([2]))
            assert drafts[0, : lens[0]].tolist() == _reference(store, 4, tail[0], 2, _cfg())
        finally:
            gate.set()


def test_loaded_store_without_rebuild_is_indexed_at_batch(tmp_path):
    rng = np.random.default_rng(4)
    store = HistoryStore.load(_store(rng, [1, 2]).save(tmp_path / "h.npz"))
    cfg = _cfg()
    with Drafter(cfg, store) as d:
        b = d.batch([2, 1])
        tails = _tails(rng, store, [2, 1])
        drafts, lens = b.draft(np.array([0, 1]), tails, np.array([2, 2]))
        for b, pid in enumerate([2, 1]):
            assert drafts[b, : lens[b]].tolist() == _reference(store, pid, tails[b], 2, cfg)


def test_accepts_the_run_config_section():
    from rhyme_jax.config import load_config

    spec = load_config(None, ["spec.branch=count", "spec.window=mimd"]).spec
    rng = np.random.default_rng(5)
    store = _store(rng, [0])
    with Drafter(spec, store) as d:
        assert (d.branch, d.window_policy, d.pattern_max) == ("count", "mimd", spec.pattern_max)
        b = d.batch([0])
        tail = _tails(rng, store, [0], anywhere=0.0)
        drafts, lens = b.draft(np.array([0]), tail, np.array([8]))
        assert drafts[0, : lens[0]].tolist() == _reference(store, 0, tail[0], 2, spec)


@pytest.mark.parametrize("window", ["aimd", "goodput"])
def test_bad_arguments_are_named(window):
    with pytest.raises(ValueError, match="window"):
        Drafter(_cfg(window="linear"), HistoryStore())
    with pytest.raises(ValueError, match="fixed_window"):
        Drafter(_cfg(window="fixed", fixed_window=64), HistoryStore())
    with Drafter(_cfg(window=window, self_lookup=window == "goodput"), HistoryStore()) as d:
        b = d.batch([0, 1])
        w = b.context_width
        for bad in ([2], [-1], [0, 2]):
            with pytest.raises(ValueError, match="reqs"):
                b.draft(np.array(bad), np.zeros((len(bad), w), np.int32), np.full(len(bad), 4))
        with pytest.raises(ValueError, match="budgets"):
            b.draft(np.array([0, 1]), np.zeros((2, w), np.int32), np.array([4]))
        with pytest.raises(ValueError, match="reqs"):
            b.observe(np.array([0, 0]), np.array([1, 1]), np.array([1, 1]))
        with pytest.raises(ValueError, match="reqs"):
            b.observe(np.array([2]), np.array([1]), np.array([1]))
        tails = np.tile(np.arange(w, dtype=np.int32), (2, 1))  # no history, nothing repeats: no draft
        drafts, lens = b.draft([0, 1], tails, [4, 4])  # lists are fine; the batch is still usable
        assert lens.tolist() == [0, 0] and drafts.shape == (2, 0)


def test_self_lookup_drafts_match_brute_force():
    """spec.self_lookup fallback: the continuation after the earliest earlier occurrence of the
    longest matching suffix (pattern_max down to pattern_min) of the running sequence."""
    from rhyme_jax.spec.self_lookup import self_lookup_drafts

    rng = np.random.default_rng(0)
    for _ in range(200):
        w = int(rng.integers(4, 40))
        n = int(rng.integers(1, w + 1))
        row = np.full(w, -1, np.int64)
        row[w - n:] = rng.integers(0, 3, n)
        max_len = int(rng.integers(0, 8))
        got, lens = self_lookup_drafts(row[None], np.array([max_len]), pattern_max=5, pattern_min=2)
        seq = row[w - n:].tolist()
        want = []
        if max_len > 0:
            for m in range(min(5, n - 1), 1, -1):
                pat = seq[n - m:]
                hits = [e for e in range(m, n) if seq[e - m:e] == pat]
                if hits:
                    e = hits[0]
                    want = seq[e:e + max_len]
                    break
        assert lens[0] == len(want) and got[0, :lens[0]].tolist() == want


def test_drafter_falls_back_to_self_lookup_only_without_a_history_match():
    store = HistoryStore()
    d = Drafter(_cfg(self_lookup=True, window="fixed", fixed_window=4), store)
    try:
        assert d.context_width > d.pattern_max
        b = d.batch([7])  # cold start: no history for prompt 7
        seq = [5, 6, 7, 8, 9, 5, 6, 7]
        tails = np.full((1, d.context_width), -1, np.int64)
        tails[0, -len(seq):] = seq
        drafts, lens = b.draft(np.array([0]), tails, np.array([10]))
        assert lens.tolist() == [4] and drafts[0, :4].tolist() == [8, 9, 5, 6]
        off = Drafter(_cfg(window="fixed", fixed_window=4), store)
        b_off = off.batch([7])
        assert b_off.draft(np.array([0]), tails[:, -off.context_width:], np.array([10]))[1].tolist() == [0]
        off.close()
    finally:
        d.close()


def test_a_batch_without_history_or_lookup_sources_is_idle():
    """``DraftBatch.idle``: true only when no prompt of the batch has history and neither
    self-lookup nor siblings could draft (the engine then skips the drafter)."""
    store = HistoryStore()
    with Drafter(_cfg(window="goodput"), store) as d:
        assert d.batch([0, 0, 1]).idle
    with Drafter(_cfg(window="goodput", self_lookup=True), store) as d:
        assert not d.batch([0, 0, 1]).idle
    store = _store(np.random.default_rng(0), [0])  # prompt 0 gets history
    with Drafter(_cfg(window="goodput"), store) as d:
        assert not d.batch([0, 0, 1]).idle and d.batch([1]).idle
