"""HistoSpec inside a chunk (``rollout/chunk_spec.py``, ``rollout/device_drafts.py``): the device's
history lookup equals a brute-force reference, and a chunked HistoSpec rollout (history from the
store, own tokens, siblings; drafts made on the device) emits the per-pass engine's tokens with
fewer dispatches than passes, whether the history is right or wrong."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rhyme_jax.config import RolloutSection
from rhyme_jax.config.checks import ConfigError
from rhyme_jax.rollout.device_drafts import MATCH, append_tokens, fit_to_budget, lookup_drafts
from rhyme_jax.rollout.engine import SamplingParams
from rhyme_jax.rollout.pass_cost import PassCost
from rhyme_jax.rollout.shapes import plan
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryStore
from test_chunked_decode import _sampled_eos
from test_rollout_engine import MAX_NEW, _engine, _model, _prompts, logprob_atol


def _reference(source, pattern_min, max_len, k, own_from):
    """Brute force of ``lookup_drafts`` for one row: among occurrences followed by a token, the
    longest suffix match, then the longest continuation (tokens before the next -1, up to the
    draft room), then history before own tokens, then the latest."""
    m_max, n = MATCH, len(source)
    best = None
    for j in range(n - 1):
        m = 0
        while m < m_max and j - m >= 0 and source[n - 1 - m] >= 0 and source[j - m] == source[n - 1 - m]:
            m += 1
        avail = 0
        while j + 1 + avail < n and source[j + 1 + avail] >= 0:
            avail += 1
        rank = (m, min(avail, max_len, k, MATCH), j < own_from, j)
        if m >= pattern_min and rank[1] > 0 and (best is None or rank > best):
            best = rank
    if best is None:
        return []
    out = []
    for t in source[best[3] + 1: best[3] + 1 + min(k, max_len)]:
        if t < 0:
            break
        out.append(int(t))
    return out


@pytest.mark.parametrize("pattern_min", [1, 3])
def test_lookup_drafts_equal_a_brute_force_search(pattern_min):
    """200 rows over a 4-token vocabulary (many repeats, ties between occurrences) with -1 gaps,
    a quarter of them periodic (matches longer than ``MATCH``) and some a run of one token (the
    latest occurrence has a one-token continuation, an earlier one the whole room): every row's
    draft is the brute-force search's, cut to its max length."""
    rng = np.random.default_rng(0)
    rows, width, k = 200, 90, 5
    source = rng.integers(0, 4, (rows, width)).astype(np.int32)
    source[: rows // 4] = np.tile(rng.integers(0, 4, (rows // 4, 7)), 13)[:, :width]
    source[rng.random((rows, width)) < 0.08] = -1
    source[rows // 4: rows // 4 + 10, 40:] = 2  # runs of one token to the end (a response stuck repeating)
    source[:, -1] = rng.integers(0, 4, rows)  # the pending token is a real token
    source[rows // 4: rows // 4 + 10, -1] = 2
    max_lens = rng.integers(0, k + 2, rows).astype(np.int32)
    own_from = 25
    drafts, lens = jax.jit(lookup_drafts, static_argnums=(3, 4))(jnp.asarray(source), jnp.int32(pattern_min),
                                                                 jnp.asarray(max_lens), k, own_from)
    drafts, lens = np.asarray(drafts), np.asarray(lens)
    found = 0
    for s in range(rows):
        want = _reference(source[s].tolist(), pattern_min, int(max_lens[s]), k, own_from)
        assert lens[s] == len(want), s
        assert drafts[s, :lens[s]].tolist() == want and not drafts[s, lens[s]:].any(), s
        found += bool(want)
    assert found > rows // 5  # both outcomes (a draft, none) are exercised
    assert found < rows
    runs = slice(rows // 4, rows // 4 + 10)  # the runs draft their whole room, not the last token
    assert (lens[runs] == np.minimum(max_lens[runs], k)).all() and lens[runs].sum() > 10
    assert all((drafts[s, :lens[s]] == 2).all() for s in range(rows // 4, rows // 4 + 10))


def test_budget_fit_and_context_append():
    lens = jnp.array([3, 0, 4, 2, 5], jnp.int32)
    live = jnp.array([True, True, False, True, True])
    # 4 live rows need 4 tokens; 6 more fit: equal shares of 1 each (row 1 wants none), then the
    # 3 left first come: row 0 takes 2 more, row 3 one more, row 4 none; the dead row nothing
    assert fit_to_budget(lens, live, 10).tolist() == [3, 0, 0, 2, 1]
    assert fit_to_budget(lens, live, 40).tolist() == [3, 0, 0, 2, 5]
    # a chunk also feeds one token for each row that finished earlier in it (the dead row 2): with
    # 5 fed tokens the room is 5: shares of 1 (row 1 wants none), then the 2 left to row 0; 5 + 3 + 1 + 1 = 10
    assert fit_to_budget(lens, live, 10, fed=jnp.int32(5)).tolist() == [3, 0, 0, 1, 1]
    # nothing but the fed tokens fits: no draft, never a negative one
    assert fit_to_budget(lens, live, 4, fed=jnp.int32(5)).tolist() == [0, 0, 0, 0, 0]
    ctx = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
    new = jnp.array([[7, 8], [9, 0]], jnp.int32)
    assert append_tokens(ctx, new, jnp.array([2, 1], jnp.int32)).tolist() == [[3, 7, 8], [5, 6, 9]]


def test_a_pass_packs_every_live_row_within_its_tokens_when_a_row_has_finished():
    """``chunk_spec._pack`` after a row finished mid-chunk: the done row still feeds one scratch
    token, so the drafts are fitted to ``T`` minus every row's fed token. Before, the fit counted
    live rows only and this pass packed 7 tokens into ``T = 6``: the last row's pending token fell
    past ``T`` (never computed, its K/V page slot never written) while its kv_len counted it; on
    the ledger task that gave behaviour logprobs up to 4 nats off the trainer's recompute in 9 of
    64 rows of a step (tokens mostly unchanged: the rows repeated digits)."""
    from rhyme_jax.rollout.chunk_spec import _pack

    ps, total = 4, 6
    pending = jnp.array([11, 12, 13, 14], jnp.int32)
    pos = jnp.array([5, 9, 6, 7], jnp.int32)
    drafts = jnp.array([[21, 22, 23], [0, 0, 0], [31, 32, 33], [41, 42, 43]], jnp.int32)
    lens = jnp.array([3, 3, 3, 3], jnp.int32)
    is_row = jnp.ones(4, bool)
    live = jnp.array([True, False, True, True])  # row 1 finished earlier in the chunk
    pages = jnp.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], jnp.int32)
    tok, position, _, meta, cu, fed = _pack(pending, pos, lens, drafts, is_row, live, pages, jnp.arange(4),
                                           total=total, page_size=ps)
    assert fed.tolist() == [2, 0, 0, 0]  # 4 fed tokens, 2 of draft room, first come first served
    assert cu.tolist() == [0, 3, 4, 5, 6] and int(cu[-1]) <= total
    assert tok.tolist() == [11, 21, 22, 12, 13, 14] and position.tolist() == [5, 6, 7, 9, 6, 7]
    # every live row's tokens write their own page slots; the done row writes scratch slot 0
    slot = lambda r, p: int(pages[r, p // ps]) * ps + p % ps  # noqa: E731
    assert meta.slot_mapping.tolist() == [slot(0, 5), slot(0, 6), slot(0, 7), 0, slot(2, 6), slot(3, 7)]
    assert meta.kv_lens.tolist() == [8, 9, 7, 8]


def _drafter(store, pids, siblings=True, window="goodput"):
    cfg = SimpleNamespace(enabled=True, branch="reward", window=window, fixed_window=8, min_token_prob=0.0,
                          pattern_max=7, pattern_min=1, history_depth=1, self_lookup=True, siblings=siblings,
                          step_cost="prior")
    d = Drafter(cfg, store)
    d.rebuild(pids)
    return d


@pytest.mark.parametrize("history_key,window", [
    (3, "goodput"),
    pytest.param(5, "aimd", marks=pytest.mark.slow),  # wrong history: the same tokens path, ~20 s; CI time
])
def test_chunked_histospec_emits_the_per_pass_tokens(history_key, window):
    """Sampled (T = 1), a stop token that ends rows mid-chunk, 3 slots for 6 requests (admission
    at chunk ends), two requests per prompt (siblings). History: the plain rollout itself (key 3:
    every draft right; goodput sizing) or another key's (drafts mostly wrong; the AIMD window,
whose host choice always sends its drafts, where goodput would choose plain chunks). The chunked engine (4 passes per
    dispatch, drafts made on the device) emits the per-pass plain engine's tokens and finish
    reasons, with behaviour logprobs within the float32 bound of two programs."""
    state, eos = _model()[1], _sampled_eos(3)
    prompts = _prompts(0)
    prompts = [prompts[i // 2] for i in range(6)]  # 3 prompts x 2 samples
    pids = np.arange(6) // 2
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    kw = dict(max_slots=3, eos_ids=(eos,), max_prefill_tokens=32)  # the programs _sampled_eos compiled
    want = _engine(**kw).generate(state, prompts, sp, jax.random.key(3))
    hist = _engine(**kw).generate(state, prompts, sp, jax.random.key(history_key))
    store = HistoryStore()
    store.update(0, pids, [np.asarray(p) for p in prompts], hist.tokens, np.zeros(6))
    eng = _engine(**kw, passes_per_dispatch=4)
    # a profile where every program costs the same (drafts look free), and a log of what the chunks observe
    seen = []

    class Logged(PassCost):
        def observe(self, *args, width=0):
            seen.append(args)
            super().observe(*args, width=width)

    eng.pass_cost = Logged({(p.rows, p.tokens, p.q_len): 1.0 for p in eng.programs() if p.kind in ("decode", "verify")},
                           {"source": "test"})
    with _drafter(store, pids, window=window) as d:
        got = eng.generate(state, prompts, sp, jax.random.key(3), drafter=d.batch(pids))
    atol = logprob_atol(prompts, want.tokens)
    for g, w, glp, wlp in zip(got.tokens, want.tokens, got.logprobs, want.logprobs):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_allclose(glp, wlp, atol=atol, rtol=0)
    assert got.finish_reasons == want.finish_reasons and "eos" in want.finish_reasons
    s = got.stats
    assert s["generated_tokens"] == want.stats["generated_tokens"]
    assert any(p.kind == "spec_chunk" for p in eng.programs_run) and eng.programs_run <= set(eng.programs())
    assert s["decode_dispatches"] < s["decode_steps"] and 0 <= s["accepted_tokens"] <= s["drafted_tokens"]
    # every chunk's seconds per pass reached the pass-cost model under its decode / verify program's key
    keys = {(p.rows, p.tokens, p.q_len): p.kind for p in eng.programs() if p.kind in ("decode", "verify")}
    assert seen and all(k[:3] in keys for k in seen) and "verify" in {keys[k[:3]] for k in seen}
    spec_seen = sum(sec for *k, sec in seen if keys[tuple(k)] == "verify")
    assert 0 < s["spec_chunk_passes"] <= s["decode_steps"] and s["spec_chunk_row_passes"] <= s["sequence_steps"]
    # each chunk ran 1..4 passes and its per-pass time is its call's time over them (the host's own work around
    # the call is small beside the passes: a factor 2 of slack)
    assert 0 < spec_seen <= s["spec_chunk_seconds"] <= 2 * 4 * spec_seen
    assert {k[:3] for k in eng.pass_cost.live} == {k[:3] for k in seen}  # kept as live times (medians: test_allocation)
    # and the guard's realized seconds a pass, per (row bucket, width, verify program), of the HistoSpec chunks that ran
    spec_keys = {(p.rows, p.width, p.tokens) for p in eng.programs_run if p.kind == "spec_chunk"}
    assert set(eng.spec_guard.spec_seconds) == spec_keys and all(v > 0 for v in eng.spec_guard.spec_seconds.values())
    if history_key == 3:  # the history is the output itself: most drafts land, fewer passes than plain
        assert s["accepted_tokens"] >= 0.8 * s["drafted_tokens"] > 0
        assert s["decode_steps"] < want.stats["decode_steps"]


def test_history_rows_hold_the_stored_responses_most_recent_last():
    store = HistoryStore(depth=2)
    store.update(0, np.array([7, 7]), [np.array([1, 2]), np.array([1, 2])], [np.array([5, 6]), np.array([8])],
                 np.zeros(2))
    store.update(1, np.array([7]), [np.array([1, 2])], [np.array([9, 9, 4])], np.zeros(1))
    with _drafter(store, [7, 3], siblings=False) as d:
        rows = d.batch([7, 3]).history_rows(np.array([0, 1]), 16)
    assert rows[0].tolist() == [-1, 1, 2, 5, 6, -1, 1, 2, 8, -1, 1, 2, 9, 9, 4, -1]
    assert rows[1].tolist() == [-1] * 16  # prompt 3 has no history


def test_spec_chunks_are_planned_and_the_history_width_checked():
    with pytest.raises(ConfigError, match="rollout.draft_history"):
        RolloutSection(draft_history=0)
    base = dict(max_slots=64, page_size=16, max_prompt_len=96, max_new_tokens=64)
    assert not [p for p in plan(**base, passes_per_dispatch=8).programs(spec=False) if p.kind == "spec_chunk"]
    chunked = plan(**base, passes_per_dispatch=8)
    spec = [p for p in chunked.programs(spec=True) if p.kind == "spec_chunk"]
    verify = [p for p in chunked.programs(spec=True) if p.kind == "verify"]
    assert sorted((p.tokens, p.rows, p.q_len, p.width) for p in spec) == sorted(
        (p.tokens, p.rows, p.q_len, p.width) for p in verify)


def test_chunk_history_puts_sibling_tails_before_the_previous_rollouts():
    """Rows 0 and 1 share group 0, row 2 is alone: the group's rows get both tails (each
    followed by -1), then the stored responses, right-aligned; the lone row its responses only."""
    from rhyme_jax.rollout.chunk_spec import history

    prev = np.array([[-1, -1, -1, -1, 4, 5, -1], [-1, -1, -1, -1, 4, 5, -1], [-1, -1, -1, 6, 6, 6, -1]], np.int32)
    tails = np.array([[-1, 1, 2], [3, 3, 3], [9, 9, 9]], np.int32)
    drafter = SimpleNamespace(history_rows=lambda reqs, width: prev[reqs], groups=np.array([0, 0, 1]), siblings=True)
    table = SimpleNamespace(req=np.arange(3), tails=SimpleNamespace(get=lambda ids: tails[ids]))
    engine = SimpleNamespace(draft_history=7)
    out = history(engine, table, np.arange(3), drafter, 4)
    # group 0: tails "1 2 -1 3 3 3 -1" (7 tokens) are cut to the last 3 (half of 7), then "4 5 -1"
    assert out[0].tolist() == [-1, 3, 3, -1, 4, 5, -1] == out[1].tolist()
    assert out[2].tolist() == prev[2].tolist() and out[3].tolist() == [-1] * 7


def test_page_cut_never_sends_a_negative_draft():
    """A chunk drafts before it reserves pages, so a slot can hold exactly its tokens' pages (its
    pending token opens the next page): its draft is cut to 0, never to -1 (a -1 once reached the
    calibration as 'drafted', which refused accepted 0 > drafted -1)."""
    eng = _engine(max_slots=3)
    ps = eng.page_size
    eng.allocator.ensure(0, ps)  # slot 0: one full page
    eng.allocator.ensure(1, ps)  # slot 1: one full page, a draft of 3 (the pool gives it a page)
    table = SimpleNamespace(length=np.array([ps, ps, 0]))
    got = eng._page_cut(table, np.array([0, 1]), np.array([0, 3]))
    np.testing.assert_array_equal(got, [0, 3])


def test_always_right_drafts_on_the_device_in_chunks():
    """The always-right oracle in the chunked engine (``history_rows``: each row's known sequence
    from just before its place): the device finds the row's own place, every drafted token is
    accepted, the tokens are plain decode's, and the rollout needs fewer passes and dispatches;
    the source-bound oracle refuses chunks (its device drafts would not be cut to the sources)."""
    from rhyme_lab.ablate.paired import AlwaysRightDrafter, SourceBoundDrafter

    state, eos = _model()[1], _sampled_eos(3)
    prompts = _prompts(0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    kw = dict(max_slots=3, eos_ids=(eos,), max_prefill_tokens=32)
    want = _engine(**kw).generate(state, prompts, sp, jax.random.key(3))
    eng = _engine(**kw, passes_per_dispatch=4)
    got = eng.generate(state, prompts, sp, jax.random.key(3), drafter=AlwaysRightDrafter(prompts, want.tokens, MAX_NEW))
    atol = logprob_atol(prompts, want.tokens)
    for g, w, glp, wlp in zip(got.tokens, want.tokens, got.logprobs, want.logprobs):
        np.testing.assert_array_equal(g, w)
        # the behaviour logprobs too (what the loss scores): on the ledger task a chunk's packing error changed
        # them where the tokens stayed the same (this small case does not reach it: the packing test above does)
        np.testing.assert_allclose(glp, wlp, atol=atol, rtol=0)
    s = got.stats
    assert any(p.kind == "spec_chunk" for p in eng.programs_run)
    assert s["drafted_tokens"] > 0 and s["accepted_tokens"] == s["drafted_tokens"]
    assert s["decode_steps"] < want.stats["decode_steps"] and s["decode_dispatches"] < s["decode_steps"]
    bound = SourceBoundDrafter(prompts, want.tokens, MAX_NEW, [[] for _ in prompts])
    with pytest.raises(NotImplementedError, match="passes_per_dispatch=1"):
        bound.history_rows(np.arange(2), 8)


def test_device_drafts_run_when_the_host_sends_no_draft():
    """The host's choice sends nothing (a drafter whose ``draft`` proposes no token) while the
    device's drafts are right (the always-right oracle's ``history_rows``): the guard tries the
    bottom verify program, every device draft lands, it climbs, and the tokens are plain
    decode's; with the guard off the host's choice decides (every chunk plain)."""
    from rhyme_lab.ablate.paired import AlwaysRightDrafter

    class Silent(AlwaysRightDrafter):
        def draft(self, reqs, tails, budgets):
            return np.zeros((len(reqs), 0), np.int32), np.zeros(len(reqs), np.int64)

    state, eos = _model()[1], _sampled_eos(3)
    prompts = _prompts(0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    kw = dict(max_slots=3, eos_ids=(eos,), max_prefill_tokens=32)
    want = _engine(**kw).generate(state, prompts, sp, jax.random.key(3))
    for guarded in (True, False):
        eng = _engine(**kw, passes_per_dispatch=4)
        eng.spec_guard.enabled = guarded
        got = eng.generate(state, prompts, sp, jax.random.key(3), drafter=Silent(prompts, want.tokens, MAX_NEW))
        for g, w in zip(got.tokens, want.tokens):
            np.testing.assert_array_equal(g, w)
        s = got.stats
        ran = {p for p in eng.programs_run if p.kind == "spec_chunk"}
        assert bool(ran) == guarded and s["spec_chunks_declined"] == 0
        if guarded:  # every draft lands; more than the bottom rung ran
            assert s["accepted_tokens"] == s["drafted_tokens"] > 0 and s["decode_steps"] < want.stats["decode_steps"]
            assert len({p.tokens for p in ran}) > 1


def _pairs_with_history():
    """Six rows (3 prompts x 2 samples), their plain rollout at key 3 and a history store holding
    the rollout at key 5: ``(state, prompts, pids, sampling, engine kwargs, want, store)``."""
    state, eos = _model()[1], _sampled_eos(3)
    prompts = _prompts(0)
    prompts = [prompts[i // 2] for i in range(6)]
    pids = np.arange(6) // 2
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    kw = dict(max_slots=3, eos_ids=(eos,), max_prefill_tokens=32)
    want = _engine(**kw).generate(state, prompts, sp, jax.random.key(3))
    hist = _engine(**kw).generate(state, prompts, sp, jax.random.key(5))
    store = HistoryStore()
    store.update(0, pids, [np.asarray(p) for p in prompts], hist.tokens, np.zeros(6))
    return state, prompts, pids, sp, kw, want, store


def _priced(verify: float) -> type:
    """A ``PassCost`` pricing every verify program at ``verify`` decode passes, learning nothing."""

    class Priced(PassCost):
        def __call__(self, rows, tokens, q_len, width=0):
            return verify if q_len > 1 else 1.0

        def observe(self, *args, width=0):
            pass

    return Priced


def test_guard_runs_plain_chunks_where_verify_chunks_do_not_pay(monkeypatch):
    """Verify programs priced at 10 decode passes and drafts from another key's history: after the
    first HistoSpec chunk of a (rows, width) key the guard runs plain chunks (probing every
    ``PROBE_EVERY``-th), each of its trials runs at most ``TRIAL_PASSES`` passes (1 here; the
    unguarded engine's chunks run 2), and the tokens stay the plain engine's."""
    from rhyme_jax.rollout import chunk_spec
    from rhyme_jax.rollout.spec_guard import PROBE_EVERY

    monkeypatch.setattr(chunk_spec, "TRIAL_PASSES", 1)
    asked = []  # passes asked of each HistoSpec chunk
    real_call = chunk_spec.call

    def call(engine, flat_state, inp, *args):
        asked.append(int(inp.base.passes))
        return real_call(engine, flat_state, inp, *args)

    monkeypatch.setattr(chunk_spec, "call", call)

    state, prompts, pids, sp, kw, want, store = _pairs_with_history()
    Priced = _priced(10.0)

    runs, passes = {}, {}
    for guarded in (True, False):
        asked.clear()
        eng = _engine(**kw, passes_per_dispatch=2)
        eng.pass_cost = Priced({}, {"source": "test"})
        eng.spec_guard.enabled = guarded
        eng.spec_guard.observe_seconds = lambda *a: None  # price by Priced alone (realized seconds: test_spec_guard)
        with _drafter(store, pids, window="aimd") as d:  # the AIMD window always sends its drafts
            runs[guarded] = got = eng.generate(state, prompts, sp, jax.random.key(3), drafter=d.batch(pids))
        passes[guarded] = set(asked)
        for g, w in zip(got.tokens, want.tokens):
            np.testing.assert_array_equal(g, w)
    on, off = runs[True].stats, runs[False].stats
    assert off["spec_chunks_declined"] == 0 and on["spec_chunks_declined"] > 0
    assert on["spec_chunk_passes"] < off["spec_chunk_passes"]
    # every HistoSpec chunk (2 passes at most) the guard let run was a key's first or a probe
    keys = len(eng.spec_guard.gain)
    assert 0 < on["spec_chunk_passes"] <= keys + on["spec_chunks_declined"] // (PROBE_EVERY - 1)
    assert passes == {True: {1}, False: {2}}  # every guarded HistoSpec chunk here is a trial


def test_declined_chunks_grade_the_device_drafts_on_the_tokens_they_emit():
    """Verify priced at 1,000 decode passes, so the guard declines every chunk but a key's first
    try: each declined chunk runs plain and grades the drafts the device would have made at its
    start on the tokens it then emitted (``graded_plain``). With the always-right oracle's history
    none of them misses; with another key's rollouts as history some do. The tokens stay plain
    decode's either way."""
    from rhyme_lab.ablate.paired import AlwaysRightDrafter

    Priced = _priced(1000.0)
    state, prompts, pids, sp, kw, want, store = _pairs_with_history()
    graded = {}
    for name in ("right", "other"):
        eng = _engine(**kw, passes_per_dispatch=4)
        eng.pass_cost = Priced({}, {"source": "test"})
        eng.spec_guard.observe_seconds = lambda *a: None
        calls = graded[name] = []
        real = eng.spec_guard.observe_shadow
        eng.spec_guard.observe_shadow = lambda rows, width, a, f, real=real, calls=calls: (calls.append((a, f)),
                                                                                              real(rows, width, a, f))
        if name == "right":
            got = eng.generate(state, prompts, sp, jax.random.key(3), drafter=AlwaysRightDrafter(prompts, want.tokens, MAX_NEW))
        else:
            with _drafter(store, pids, window="aimd") as d:
                got = eng.generate(state, prompts, sp, jax.random.key(3), drafter=d.batch(pids))
        for g, w in zip(got.tokens, want.tokens):
            np.testing.assert_array_equal(g, w)
        assert len(calls) == got.stats["spec_chunks_declined"] > 0
    accepted, failed = np.sum(graded["right"], axis=0)
    assert accepted > 0 and failed == 0  # every draft of the oracle's history is the token sampled there
    accepted, failed = np.sum(graded["other"], axis=0)
    assert failed > 0


def test_draft_room_climbs_the_ladder_and_the_guard_picks_a_rung():
    """``program``: the smallest rung with the packed tokens and the draft room ``Q`` asked for
    (the ledger config's 4-row bucket: (6, 3), (32, 17), (132, 33)); ``guarded_program``: of the
    rungs up to it, the guard's choice (bottom first, climbing once a rung paid), None when none."""
    from rhyme_jax.rollout.chunk_spec import guarded_program, ladder, program
    from rhyme_jax.rollout.spec_guard import SpecGuard

    p = plan(max_slots=64, page_size=16, max_prompt_len=2048, max_new_tokens=4096, passes_per_dispatch=16)
    assert ladder(p, 4) == [(6, 3), (32, 17), (132, 33)]
    assert program(p, 4, 2) == (6, 3)
    assert program(p, 4, 2, q_want=4) == (32, 17)  # a row that accepted 2 of 2 a pass asks for 1 + 3
    assert program(p, 4, 7) == (32, 17) and program(p, 4, 2, q_want=25) == (132, 33)
    assert program(p, 4, 500, q_want=40) == (132, 33)  # past the ladder: its top
    guard = SpecGuard()
    eng = SimpleNamespace(plan=p, spec_guard=guard, pass_cost=lambda rows, t, q, width=0: 1.0)
    assert guarded_program(eng, 4, 384, 2, 25) == (6, 3)  # the bottom rung's first try
    guard.observe(4, 384, 6, accepted=16, row_passes=16)  # 1 a row-pass at 1.2 s a pass: pays
    guard.observe_seconds(True, 4, 384, 6, 1.2)
    assert guarded_program(eng, 4, 384, 2, 2) == (6, 3)  # the chunk asks for the bottom rung only
    assert guarded_program(eng, 4, 384, 2, 25) == (32, 17)  # asks for more: the next rung's first try
    guard.observe(4, 384, 32, accepted=0, row_passes=16)  # it accepted nothing
    guard.observe_seconds(True, 4, 384, 32, 2.0)
    assert guarded_program(eng, 4, 384, 2, 25) == (6, 3)  # the climb stops there; 132 is never tried
    assert (4, 384, 132) not in guard.gain
    for _ in range(3):  # 1 -> 0.125 a row-pass: 1.125 x 1.0 s < 1.2 s
        guard.observe(4, 384, 6, accepted=0, row_passes=16)
    assert guarded_program(eng, 4, 384, 2, 2) is None  # the bottom rung no longer pays
    fresh = SimpleNamespace(plan=p, spec_guard=SpecGuard(), pass_cost=lambda rows, t, q, width=0: t / 3.5)
    fresh.spec_guard.observe_seconds(False, 4, 384, 4, 1.0)
    fresh.spec_guard.observe(4, 384, 6, accepted=16, row_passes=16, drafted=16)  # every 1-token draft lands
    fresh.spec_guard.observe_seconds(True, 4, 384, 6, 2.5)  # but (1 + 1) x 1.0 s < 2.5 s
    # the rung above the ask, (32, 17), priced 32 / 3.5 = 9.1 s: 4 live rows get 7 draft tokens each there
    assert guarded_program(fresh, 4, 384, 2, 2) is None  # (1 + 7) x 1.0 < 9.1
    assert guarded_program(fresh, 4, 384, 2, 2, live=1) == (32, 17)  # one live row: (1 + 16) x 1.0 >= 9.1
    assert fresh.spec_guard.trial

def test_extra_row_buckets_are_planned_and_checked_at_load():
    """``rollout.row_buckets``: extra decode/verify row buckets beside ``max_slots / 16``, ``/ 4``
    and ``max_slots`` in the engine's plan; a bucket outside ``[1, max_slots]`` fails at load time."""
    assert _engine(max_slots=16, row_buckets=(2, 8)).plan.buckets() == (1, 2, 4, 8, 16)
    with pytest.raises(ConfigError, match="rollout.row_buckets"):
        RolloutSection(max_slots=16, row_buckets=[32])


@pytest.mark.slow  # ~25 s; rollout.row_buckets is off in every shipped config
def test_extra_row_buckets_run_small_programs_with_the_same_tokens():
    """The chunked engine with extra row buckets, plain and with device drafts, runs its tail in
    them and emits exactly the tokens of the engine without them (sampling is keyed by request
    and position)."""
    from rhyme_lab.ablate.paired import AlwaysRightDrafter

    state, eos = _model()[1], _sampled_eos(3)
    prompts = _prompts(0) * 2
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    kw = dict(max_slots=16, eos_ids=(eos,), max_prefill_tokens=64, passes_per_dispatch=4)
    want = _engine(**kw).generate(state, prompts, sp, jax.random.key(3))
    for drafter in (None, AlwaysRightDrafter(prompts, want.tokens, MAX_NEW)):
        eng = _engine(**kw, row_buckets=(2, 8))
        got = eng.generate(state, prompts, sp, jax.random.key(3), drafter=drafter)
        for g, w in zip(got.tokens, want.tokens):
            np.testing.assert_array_equal(g, w)
        assert {p.rows for p in eng.programs_run if p.kind != "prefill"} & {2, 8}
        assert eng.programs_run <= set(eng.programs())
